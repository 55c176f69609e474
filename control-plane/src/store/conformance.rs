//! The store conformance suite: one set of checks every [`KvStore`]
//! implementation must pass (embedded always; etcd when one is running).
//! Each check uses its own key prefix so implementations can share a store.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;

use super::{Compare, KvStore, Txn, TxnOp, WatchEvent};

/// Runs every check under `prefix`; panics with the failed check's name.
pub async fn run_all(store: Arc<dyn KvStore>, prefix: &str) {
    put_get_and_revisions(&*store, prefix).await;
    range_is_prefix_exact_and_ordered(&*store, prefix).await;
    range_pages_walk_every_key_once(&*store, prefix).await;
    txn_create_if_absent(&*store, prefix).await;
    txn_guard_fails_then_failure_branch(&*store, prefix).await;
    watch_sees_changes_in_order(&*store, prefix).await;
    lease_expiry_deletes_keys(&*store, prefix).await;
}

async fn put_get_and_revisions(s: &dyn KvStore, p: &str) {
    let k = format!("{p}a/x");
    let r1 = s.put(&k, b"1".to_vec()).await.expect("put");
    let r2 = s.put(&k, b"2".to_vec()).await.expect("put");
    assert!(r2 > r1, "put_get: revisions grow");
    let kv = s.get(&k).await.expect("get").expect("present");
    assert_eq!(kv.value, b"2");
    assert_eq!(kv.create_revision, r1, "put_get: create revision kept");
    assert_eq!(kv.mod_revision, r2);
    assert_eq!(kv.version, 2);
    assert!(s.delete(&k).await.expect("delete"));
    assert!(s.get(&k).await.expect("get").is_none());
    assert!(!s.delete(&k).await.expect("delete again"));
}

async fn range_is_prefix_exact_and_ordered(s: &dyn KvStore, p: &str) {
    for k in ["r/b", "r/a", "r/c", "rr/x", "q/z"] {
        s.put(&format!("{p}{k}"), k.as_bytes().to_vec()).await.expect("put");
    }
    let (kvs, rev) = s.range(&format!("{p}r/")).await.expect("range");
    let keys: Vec<String> = kvs.iter().map(|kv| kv.key.trim_start_matches(p).to_string()).collect();
    assert_eq!(keys, vec!["r/a", "r/b", "r/c"], "range: exact prefix, key order");
    assert!(rev >= kvs.iter().map(|k| k.mod_revision).max().unwrap_or(0));
}

async fn range_pages_walk_every_key_once(s: &dyn KvStore, p: &str) {
    let keys = ["pg/a", "pg/a0", "pg/b", "pg/c", "pg/d", "pgx/e"];
    for k in keys {
        s.put(&format!("{p}{k}"), k.as_bytes().to_vec()).await.expect("put");
    }
    let prefix = format!("{p}pg/");
    let (mut seen, mut after) = (Vec::new(), String::new());
    loop {
        let page = s.range_page(&prefix, &after, 2, false).await.expect("range_page");
        assert!(page.len() <= 2, "range_page: at most limit keys");
        let Some(last) = page.last() else { break };
        after = last.key.clone();
        seen.extend(page.iter().map(|kv| (kv.key.trim_start_matches(p).to_string(), kv.value.clone())));
    }
    let want: Vec<(String, Vec<u8>)> = keys[..5].iter().map(|k| (k.to_string(), k.as_bytes().to_vec())).collect();
    assert_eq!(seen, want, "range_page: every key under the prefix once, in order, with values");
    let keys_only = s.range_page(&prefix, "", 10, true).await.expect("range_page");
    assert_eq!(keys_only.len(), 5);
    assert!(keys_only.iter().all(|kv| kv.value.is_empty() && kv.mod_revision > 0), "range_page: keys only, with revisions");
    // Backwards: the same keys, last first.
    let (mut back, mut before) = (Vec::new(), String::new());
    loop {
        let page = s.range_page_rev(&prefix, &before, 2, false).await.expect("range_page_rev");
        assert!(page.len() <= 2, "range_page_rev: at most limit keys");
        let Some(last) = page.last() else { break };
        before = last.key.clone();
        back.extend(page.iter().map(|kv| (kv.key.trim_start_matches(p).to_string(), kv.value.clone())));
    }
    let mut want_back = want.clone();
    want_back.reverse();
    assert_eq!(back, want_back, "range_page_rev: every key under the prefix once, last first, with values");
    let keys_only = s.range_page_rev(&prefix, "", 10, true).await.expect("range_page_rev");
    assert!(keys_only.len() == 5 && keys_only.iter().all(|kv| kv.value.is_empty()), "range_page_rev: keys only");
}

async fn txn_create_if_absent(s: &dyn KvStore, p: &str) {
    let k = format!("{p}slot/1");
    let t = || Txn { compares: vec![Compare::absent(&k)], success: vec![TxnOp::put(&k, b"first".to_vec())], failure: vec![TxnOp::get(&k)] };
    let a = s.txn(t()).await.expect("txn");
    assert!(a.succeeded, "create_if_absent: first wins");
    let b = s.txn(t()).await.expect("txn");
    assert!(!b.succeeded, "create_if_absent: second loses");
    assert_eq!(b.gets.len(), 1);
    assert_eq!(b.gets[0].as_ref().map(|kv| kv.value.clone()), Some(b"first".to_vec()));
}

async fn txn_guard_fails_then_failure_branch(s: &dyn KvStore, p: &str) {
    let guard = format!("{p}guard");
    let k = format!("{p}guarded");
    let rev = s.put(&guard, b"g".to_vec()).await.expect("put guard");
    let kv = s.get(&guard).await.expect("get").expect("present");
    assert_eq!(kv.create_revision, rev);
    let ok = s
        .txn(Txn { compares: vec![Compare::create_revision(&guard, rev)], success: vec![TxnOp::put(&k, b"1".to_vec())], failure: vec![] })
        .await
        .expect("txn");
    assert!(ok.succeeded, "guard: matching create revision passes");
    let stale = s
        .txn(Txn {
            compares: vec![Compare::create_revision(&guard, rev - 1)],
            success: vec![TxnOp::put(&k, b"2".to_vec())],
            failure: vec![],
        })
        .await
        .expect("txn");
    assert!(!stale.succeeded, "guard: stale create revision is rejected");
    assert_eq!(s.get(&k).await.expect("get").map(|kv| kv.value), Some(b"1".to_vec()));
}

async fn watch_sees_changes_in_order(s: &dyn KvStore, p: &str) {
    let prefix = format!("{p}w/");
    let mut w = s.watch(&prefix).await.expect("watch");
    s.put(&format!("{p}other"), b"x".to_vec()).await.expect("put");
    for i in 0..5 {
        s.put(&format!("{prefix}{i}"), vec![i]).await.expect("put");
    }
    s.delete(&format!("{prefix}0")).await.expect("delete");
    let mut seen = Vec::new();
    while seen.len() < 6 {
        let ev = tokio::time::timeout(Duration::from_secs(10), w.next())
            .await
            .expect("watch event in time")
            .expect("stream open")
            .expect("event");
        seen.push(ev);
    }
    for (i, ev) in seen.iter().take(5).enumerate() {
        assert!(matches!(ev, WatchEvent::Put(kv) if kv.value == vec![i as u8]), "watch: put {i} in order");
    }
    assert!(matches!(&seen[5], WatchEvent::Delete { key, .. } if key.ends_with("w/0")), "watch: delete seen");
    assert!(seen.windows(2).all(|w| w[0].revision() < w[1].revision()), "watch: revisions increase");
}

async fn lease_expiry_deletes_keys(s: &dyn KvStore, p: &str) {
    let k = format!("{p}leased");
    let lease = s.grant_lease(1).await.expect("grant");
    s.txn(Txn { success: vec![TxnOp::Put { key: k.clone(), value: b"v".to_vec(), lease }], ..Txn::default() })
        .await
        .expect("put with lease");
    assert_eq!(s.get(&k).await.expect("get").map(|kv| kv.lease), Some(lease));
    s.keep_alive(lease).await.expect("keep alive");
    let mut gone = false;
    for _ in 0..80 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if s.get(&k).await.expect("get").is_none() {
            gone = true;
            break;
        }
    }
    assert!(gone, "lease: key deleted after the lease expired");
    let k2 = format!("{p}revoked");
    let lease2 = s.grant_lease(30).await.expect("grant");
    s.txn(Txn { success: vec![TxnOp::Put { key: k2.clone(), value: b"v".to_vec(), lease: lease2 }], ..Txn::default() }).await.expect("put");
    s.revoke_lease(lease2).await.expect("revoke");
    assert!(s.get(&k2).await.expect("get").is_none(), "lease: revoke deletes keys");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::embedded::EmbeddedStore;

    #[tokio::test]
    async fn embedded_store_passes_conformance() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = EmbeddedStore::open(dir.path()).await.expect("open");
        run_all(Arc::new(store), "/conf/").await;
    }

    /// Reopening the data dir must restore every key; a crash loses nothing committed.
    #[tokio::test]
    async fn embedded_store_survives_reopen() {
        let dir = tempfile::tempdir().expect("tempdir");
        let rev = {
            let s = EmbeddedStore::open(dir.path()).await.expect("open");
            s.put("/k/a", b"1".to_vec()).await.expect("put");
            let lease = s.grant_lease(60).await.expect("lease");
            s.txn(Txn { success: vec![TxnOp::Put { key: "/k/leased".into(), value: b"x".to_vec(), lease }], ..Txn::default() })
                .await
                .expect("put");
            s.put("/k/b", b"2".to_vec()).await.expect("put")
        };
        // The reaper task holds only a weak reference; wait for the file lock to drop.
        let s = loop {
            match EmbeddedStore::open(dir.path()).await {
                Ok(s) => break s,
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        };
        let (kvs, rev2) = s.range("/k/").await.expect("range");
        let keys: Vec<&str> = kvs.iter().map(|k| k.key.as_str()).collect();
        assert_eq!(keys, vec!["/k/a", "/k/b"], "leased key from the dead process is gone");
        assert!(rev2 >= rev);
    }
}
