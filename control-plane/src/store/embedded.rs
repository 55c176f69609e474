//! The embedded store: one redb file in the data dir, crash-safe (every
//! commit is durable before it returns — redb's `Durability::Immediate`).
//!
//! Layout: table `kv` maps a key to `[create_rev, mod_rev, version, lease]`
//! (4 × i64 little-endian) followed by the value; table `meta` holds the
//! store revision. Watches are fed in commit order from a broadcast channel.
//! Leases live in memory: on open, keys left attached to a lease by a
//! previous process are deleted (their owner is gone), as etcd would after
//! the lease's TTL.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use tokio::sync::broadcast;
use tokio::time::Instant;
use tokio_stream::wrappers::BroadcastStream;

use super::{KeyValue, KvStore, LeaseId, Revision, Txn, TxnOp, TxnResult, WatchEvent, WatchStream};
use crate::error::{Error, Result};

const KV: TableDefinition<&str, &[u8]> = TableDefinition::new("kv");
const META: TableDefinition<&str, i64> = TableDefinition::new("meta");
const REVISION: &str = "revision";
/// `meta` key the readiness probe writes.
const PROBE: &str = "probe";
const HEADER: usize = 32;

/// redb's page cache (its default is 1 GiB, which an idle control plane
/// would grow into as the file grows).
const CACHE_BYTES: usize = 32 * 1024 * 1024;

/// Events broadcast per commit; a watcher that falls this far behind gets an error.
const WATCH_BUFFER: usize = 16_384;

fn store_err(e: impl std::fmt::Display) -> Error {
    Error::Store(e.to_string())
}

fn encode(kv: &KeyValue) -> Vec<u8> {
    let mut b = Vec::with_capacity(HEADER + kv.value.len());
    for n in [kv.create_revision, kv.mod_revision, kv.version, kv.lease] {
        b.extend_from_slice(&n.to_le_bytes());
    }
    b.extend_from_slice(&kv.value);
    b
}

/// An entry's header: `[create_rev, mod_rev, version, lease]`.
fn decode_header(key: &str, b: &[u8]) -> Result<[i64; 4]> {
    if b.len() < HEADER {
        return Err(Error::Store(format!("corrupt entry for {key:?}")));
    }
    let n = |i: usize| {
        let mut a = [0u8; 8];
        a.copy_from_slice(&b[i * 8..i * 8 + 8]);
        i64::from_le_bytes(a)
    };
    Ok([n(0), n(1), n(2), n(3)])
}

fn decode(key: &str, b: &[u8]) -> Result<KeyValue> {
    let [create_revision, mod_revision, version, lease] = decode_header(key, b)?;
    Ok(KeyValue { key: key.to_string(), create_revision, mod_revision, version, lease, value: b[HEADER..].to_vec() })
}

/// An entry of a range page: without its value when `keys_only` (the
/// value is not copied).
fn decode_page_entry(key: &str, b: &[u8], keys_only: bool) -> Result<KeyValue> {
    if keys_only {
        let [create_revision, mod_revision, version, lease] = decode_header(key, b)?;
        return Ok(KeyValue { key: key.to_string(), create_revision, mod_revision, version, lease, value: Vec::new() });
    }
    decode(key, b)
}

struct Lease {
    ttl: Duration,
    deadline: Instant,
    keys: HashSet<String>,
}

struct Inner {
    /// `None` after an I/O error closed it: the next use reopens it.
    db: std::sync::RwLock<Option<Arc<Database>>>,
    /// Why writes fail, since the last I/O error (cleared by a write that
    /// commits).
    failure: Mutex<Option<String>>,
    path: PathBuf,
    /// Serializes writers so watch events leave in revision order.
    write_lock: Mutex<()>,
    events: broadcast::Sender<Arc<Vec<WatchEvent>>>,
    leases: Mutex<HashMap<LeaseId, Lease>>,
    next_lease: Mutex<LeaseId>,
}

/// The redb-backed [`KvStore`].
#[derive(Clone)]
pub struct EmbeddedStore {
    inner: Arc<Inner>,
}

/// How long [`EmbeddedStore::open`] waits for another process to let go of
/// the file's lock before it gives up.
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

impl EmbeddedStore {
    /// Opens (or creates) `dir/punchclock.redb`. Keys left on leases by a
    /// previous process are deleted. Starts the lease reaper on the current
    /// tokio runtime.
    ///
    /// Errors: [`Error::Store`] if the directory cannot be created, the
    /// file is still locked by another process after [`LOCK_WAIT`], or it
    /// is corrupt.
    pub async fn open(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(|e| Error::Store(format!("create {}: {e}", dir.display())))?;
        let path = dir.join("punchclock.redb");
        // The file's lock is held while any process has it open: a previous
        // instance that was just killed (or a child forked from it that has
        // not yet exec'd) lets it go a moment later. Wait that long; a
        // second server on the same directory is refused after it.
        let deadline = tokio::time::Instant::now() + LOCK_WAIT;
        let db = loop {
            let p = path.clone();
            match tokio::task::spawn_blocking(move || Database::builder().set_cache_size(CACHE_BYTES).create(&p))
                .await
                .map_err(store_err)?
            {
                Ok(db) => break db,
                Err(redb::DatabaseError::DatabaseAlreadyOpen) if tokio::time::Instant::now() < deadline => {
                    tracing::warn!(path = %path.display(), "the store is locked by another process; waiting for it to let go");
                    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                }
                Err(e) => return Err(Error::Store(format!("open {}: {e}", path.display()))),
            }
        };
        let (events, _) = broadcast::channel(WATCH_BUFFER);
        let store = EmbeddedStore {
            inner: Arc::new(Inner {
                db: std::sync::RwLock::new(Some(Arc::new(db))),
                failure: Mutex::new(None),
                path,
                write_lock: Mutex::new(()),
                events,
                leases: Mutex::new(HashMap::new()),
                next_lease: Mutex::new(1),
            }),
        };
        store
            .blocking({
                let s = store.clone();
                move || s.init_tables()
            })
            .await?;
        let weak = Arc::downgrade(&store.inner);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(250));
            loop {
                tick.tick().await;
                let Some(inner) = weak.upgrade() else { break };
                let s = EmbeddedStore { inner };
                if let Err(e) = s.expire_leases().await {
                    tracing::warn!(error = %e, "lease reaper failed");
                }
            }
        });
        Ok(store)
    }

    async fn blocking<T: Send + 'static>(&self, f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
        tokio::task::spawn_blocking(f).await.map_err(store_err)?
    }

    /// The open database, reopening it after an I/O error closed it (redb
    /// refuses every write after one until it is reopened; an open that
    /// fails — the disk still full, readers of the old one still running —
    /// is tried again at the next use).
    fn db(&self) -> Result<Arc<Database>> {
        if let Some(db) = self.inner.db.read().map_err(|_| Error::Internal("store lock poisoned".into()))?.as_ref() {
            return Ok(Arc::clone(db));
        }
        let mut slot = self.inner.db.write().map_err(|_| Error::Internal("store lock poisoned".into()))?;
        if let Some(db) = slot.as_ref() {
            return Ok(Arc::clone(db));
        }
        let why = self.failure().unwrap_or_default();
        let db = Database::builder()
            .set_cache_size(CACHE_BYTES)
            .create(&self.inner.path)
            .map_err(|e| Error::Store(format!("{why}; reopening {} failed: {e}", self.inner.path.display())))?;
        tracing::info!(path = %self.inner.path.display(), "embedded store reopened after an I/O error");
        let db = Arc::new(db);
        *slot = Some(Arc::clone(&db));
        Ok(db)
    }

    /// Why writes fail now, if they do.
    fn failure(&self) -> Option<String> {
        self.inner.failure.lock().ok().and_then(|f| f.clone())
    }

    /// A write failed in the store (not a compare or a lease): remember
    /// why, and close the database so the next use reopens it.
    fn failed(&self, e: &Error) {
        let first = self.inner.failure.lock().map(|mut f| f.replace(e.to_string()).is_none()).unwrap_or(false);
        if first {
            tracing::error!(error = %e, path = %self.inner.path.display(), "embedded store write failed; reopening it until writes work again");
        }
        if let Ok(mut slot) = self.inner.db.write() {
            *slot = None;
        }
    }

    /// A write committed: the store works again.
    fn recovered(&self) {
        if self.inner.failure.lock().map(|mut f| f.take().is_some()).unwrap_or(false) {
            tracing::info!(path = %self.inner.path.display(), "embedded store writes work again");
        }
    }

    /// Commits a small write outside the key space (a probe of whether
    /// writes work).
    fn probe_write(&self) -> Result<()> {
        let run = || -> Result<()> {
            let w = self.db()?.begin_write().map_err(store_err)?;
            {
                let mut meta = w.open_table(META).map_err(store_err)?;
                meta.insert(PROBE, chrono::Utc::now().timestamp_millis()).map_err(store_err)?;
            }
            w.commit().map_err(store_err)
        };
        match run() {
            Ok(()) => {
                self.recovered();
                Ok(())
            }
            Err(e) => {
                self.failed(&e);
                Err(e)
            }
        }
    }

    fn init_tables(&self) -> Result<()> {
        let w = self.db()?.begin_write().map_err(store_err)?;
        let stale: Vec<String> = {
            let mut meta = w.open_table(META).map_err(store_err)?;
            if meta.get(REVISION).map_err(store_err)?.is_none() {
                meta.insert(REVISION, 0).map_err(store_err)?;
            }
            let kv = w.open_table(KV).map_err(store_err)?;
            let mut stale = Vec::new();
            for item in kv.iter().map_err(store_err)? {
                let (k, v) = item.map_err(store_err)?;
                let kv = decode(k.value(), v.value())?;
                if kv.lease != 0 {
                    stale.push(kv.key);
                }
            }
            stale
        };
        if !stale.is_empty() {
            let mut kv = w.open_table(KV).map_err(store_err)?;
            for k in &stale {
                kv.remove(k.as_str()).map_err(store_err)?;
            }
            let mut meta = w.open_table(META).map_err(store_err)?;
            let rev = meta.get(REVISION).map_err(store_err)?.map(|g| g.value()).unwrap_or(0);
            meta.insert(REVISION, rev + 1).map_err(store_err)?;
        }
        w.commit().map_err(store_err)?;
        Ok(())
    }

    fn txn_blocking(&self, txn: Txn) -> Result<TxnResult> {
        let _guard = self.inner.write_lock.lock().map_err(|_| Error::Internal("store write lock poisoned".into()))?;
        // Leases first: after this, every error is the store's own.
        for op in txn.success.iter().chain(&txn.failure) {
            if let TxnOp::Put { lease, .. } = op
                && *lease != 0
                && !self.lease_alive(*lease)
            {
                return Err(Error::Store(format!("lease {lease} not found")));
            }
        }
        match self.txn_on(txn) {
            Ok(r) => {
                self.recovered();
                Ok(r)
            }
            Err(e) => {
                self.failed(&e);
                Err(e)
            }
        }
    }

    fn txn_on(&self, txn: Txn) -> Result<TxnResult> {
        let w = self.db()?.begin_write().map_err(store_err)?;
        let (result, events, lease_changes) = {
            let mut kv = w.open_table(KV).map_err(store_err)?;
            let mut meta = w.open_table(META).map_err(store_err)?;
            let rev = meta.get(REVISION).map_err(store_err)?.map(|g| g.value()).unwrap_or(0);
            let mut succeeded = true;
            for c in &txn.compares {
                let cur = kv.get(c.key.as_str()).map_err(store_err)?.map(|g| decode(&c.key, g.value())).transpose()?;
                if !c.holds(cur.as_ref()) {
                    succeeded = false;
                    break;
                }
            }
            // The ops are taken by value: keys and values move into the
            // watch events; of a previous entry only its header is read.
            let ops = if succeeded { txn.success } else { txn.failure };
            let writes = ops.iter().any(|o| !matches!(o, TxnOp::Get { .. }));
            let new_rev = if writes { rev + 1 } else { rev };
            let mut gets = Vec::new();
            let mut events = Vec::new();
            let mut lease_changes: Vec<(String, LeaseId, LeaseId)> = Vec::new();
            for op in ops {
                match op {
                    TxnOp::Get { key } => {
                        gets.push(kv.get(key.as_str()).map_err(store_err)?.map(|g| decode(&key, g.value())).transpose()?);
                    }
                    TxnOp::Put { key, value, lease } => {
                        let prev = kv.get(key.as_str()).map_err(store_err)?.map(|g| decode_header(&key, g.value())).transpose()?;
                        if lease != 0 && !self.lease_alive(lease) {
                            return Err(Error::Store(format!("lease {lease} not found")));
                        }
                        let next = KeyValue {
                            key,
                            value,
                            create_revision: prev.map_or(new_rev, |[create, ..]| create),
                            mod_revision: new_rev,
                            version: prev.map_or(1, |[_, _, version, _]| version + 1),
                            lease,
                        };
                        kv.insert(next.key.as_str(), encode(&next).as_slice()).map_err(store_err)?;
                        let old_lease = prev.map_or(0, |[.., l]| l);
                        if old_lease != 0 || lease != 0 {
                            lease_changes.push((next.key.clone(), old_lease, lease));
                        }
                        events.push(WatchEvent::Put(next));
                    }
                    TxnOp::Delete { key } => {
                        if let Some(prev) = kv.remove(key.as_str()).map_err(store_err)? {
                            let [.., old_lease] = decode_header(&key, prev.value())?;
                            if old_lease != 0 {
                                lease_changes.push((key.clone(), old_lease, 0));
                            }
                            events.push(WatchEvent::Delete { key, mod_revision: new_rev });
                        }
                    }
                }
            }
            if writes {
                meta.insert(REVISION, new_rev).map_err(store_err)?;
            }
            (TxnResult { succeeded, revision: new_rev, gets }, events, lease_changes)
        };
        w.commit().map_err(store_err)?;
        if !lease_changes.is_empty()
            && let Ok(mut leases) = self.inner.leases.lock()
        {
            for (key, old, new) in lease_changes {
                if let Some(l) = leases.get_mut(&old) {
                    l.keys.remove(&key);
                }
                if let Some(l) = leases.get_mut(&new) {
                    l.keys.insert(key);
                }
            }
        }
        if !events.is_empty() {
            // No receiver is fine: nobody is watching.
            let _ = self.inner.events.send(Arc::new(events));
        }
        Ok(result)
    }

    fn lease_alive(&self, id: LeaseId) -> bool {
        self.inner.leases.lock().map(|l| l.contains_key(&id)).unwrap_or(false)
    }

    async fn expire_leases(&self) -> Result<()> {
        let now = Instant::now();
        let expired: Vec<(LeaseId, Vec<String>)> = {
            let mut leases = self.inner.leases.lock().map_err(|_| Error::Internal("lease lock poisoned".into()))?;
            let ids: Vec<LeaseId> = leases.iter().filter(|(_, l)| l.deadline <= now).map(|(id, _)| *id).collect();
            ids.into_iter().filter_map(|id| leases.remove(&id).map(|l| (id, l.keys.into_iter().collect()))).collect()
        };
        for (_, keys) in expired {
            if !keys.is_empty() {
                let txn = Txn { success: keys.into_iter().map(TxnOp::delete).collect(), ..Txn::default() };
                let s = self.clone();
                self.blocking(move || s.txn_blocking(txn)).await?;
            }
        }
        Ok(())
    }
}

#[async_trait]
impl KvStore for EmbeddedStore {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>> {
        let s = self.clone();
        let key = key.to_string();
        self.blocking(move || {
            let r = s.db()?.begin_read().map_err(store_err)?;
            let kv = r.open_table(KV).map_err(store_err)?;
            kv.get(key.as_str()).map_err(store_err)?.map(|g| decode(&key, g.value())).transpose()
        })
        .await
    }

    async fn range(&self, prefix: &str) -> Result<(Vec<KeyValue>, Revision)> {
        let s = self.clone();
        let prefix = prefix.to_string();
        self.blocking(move || {
            let r = s.db()?.begin_read().map_err(store_err)?;
            let kv = r.open_table(KV).map_err(store_err)?;
            let meta = r.open_table(META).map_err(store_err)?;
            let rev = meta.get(REVISION).map_err(store_err)?.map(|g| g.value()).unwrap_or(0);
            let mut out = Vec::new();
            for item in kv.range(prefix.as_str()..).map_err(store_err)? {
                let (k, v) = item.map_err(store_err)?;
                if !k.value().starts_with(prefix.as_str()) {
                    break;
                }
                out.push(decode(k.value(), v.value())?);
            }
            Ok((out, rev))
        })
        .await
    }

    async fn range_page(&self, prefix: &str, after: &str, limit: usize, keys_only: bool) -> Result<Vec<KeyValue>> {
        let s = self.clone();
        let (prefix, after) = (prefix.to_string(), after.to_string());
        self.blocking(move || {
            let r = s.db()?.begin_read().map_err(store_err)?;
            let kv = r.open_table(KV).map_err(store_err)?;
            let start = if after.as_str() > prefix.as_str() { after.clone() } else { prefix.clone() };
            let mut out = Vec::new();
            for item in kv.range(start.as_str()..).map_err(store_err)? {
                let (k, v) = item.map_err(store_err)?;
                if !k.value().starts_with(prefix.as_str()) || out.len() >= limit {
                    break;
                }
                if k.value() == after {
                    continue;
                }
                out.push(decode_page_entry(k.value(), v.value(), keys_only)?);
            }
            Ok(out)
        })
        .await
    }

    async fn range_page_rev(&self, prefix: &str, before: &str, limit: usize, keys_only: bool) -> Result<Vec<KeyValue>> {
        let s = self.clone();
        let (prefix, before) = (prefix.to_string(), before.to_string());
        self.blocking(move || {
            let r = s.db()?.begin_read().map_err(store_err)?;
            let kv = r.open_table(KV).map_err(store_err)?;
            let mut out = Vec::new();
            // Keys are text: the prefix's end is the prefix with its last
            // character one higher.
            let end = match before.as_str() {
                b if !b.is_empty() && b.starts_with(prefix.as_str()) => b.to_string(),
                _ => {
                    let mut e = prefix.clone();
                    match e.pop().and_then(|c| char::from_u32(u32::from(c) + 1)) {
                        Some(c) => e.push(c),
                        None => e.push(char::MAX),
                    }
                    e
                }
            };
            for item in kv.range(prefix.as_str()..end.as_str()).map_err(store_err)?.rev() {
                let (k, v) = item.map_err(store_err)?;
                if out.len() >= limit {
                    break;
                }
                out.push(decode_page_entry(k.value(), v.value(), keys_only)?);
            }
            Ok(out)
        })
        .await
    }

    async fn txn(&self, txn: Txn) -> Result<TxnResult> {
        let s = self.clone();
        self.blocking(move || s.txn_blocking(txn)).await
    }

    async fn watch(&self, prefix: &str) -> Result<WatchStream> {
        let prefix = prefix.to_string();
        let rx = self.inner.events.subscribe();
        let stream = BroadcastStream::new(rx).flat_map(move |batch| {
            let items: Vec<Result<WatchEvent>> = match batch {
                Ok(events) => events.iter().filter(|e| e.key().starts_with(prefix.as_str())).cloned().map(Ok).collect(),
                Err(e) => vec![Err(Error::Store(format!("watch fell behind: {e}")))],
            };
            futures::stream::iter(items)
        });
        Ok(stream.boxed())
    }

    async fn grant_lease(&self, ttl_seconds: i64) -> Result<LeaseId> {
        let ttl = Duration::from_secs(ttl_seconds.max(1) as u64);
        let id = {
            let mut n = self.inner.next_lease.lock().map_err(|_| Error::Internal("lease lock poisoned".into()))?;
            *n += 1;
            *n
        };
        self.inner
            .leases
            .lock()
            .map_err(|_| Error::Internal("lease lock poisoned".into()))?
            .insert(id, Lease { ttl, deadline: Instant::now() + ttl, keys: HashSet::new() });
        Ok(id)
    }

    async fn keep_alive(&self, lease: LeaseId) -> Result<i64> {
        let mut leases = self.inner.leases.lock().map_err(|_| Error::Internal("lease lock poisoned".into()))?;
        let l = leases.get_mut(&lease).ok_or_else(|| Error::Store(format!("lease {lease} not found")))?;
        l.deadline = Instant::now() + l.ttl;
        Ok(l.ttl.as_secs() as i64)
    }

    async fn revoke_lease(&self, lease: LeaseId) -> Result<()> {
        let keys: Vec<String> = {
            let mut leases = self.inner.leases.lock().map_err(|_| Error::Internal("lease lock poisoned".into()))?;
            leases.remove(&lease).map(|l| l.keys.into_iter().collect()).unwrap_or_default()
        };
        if !keys.is_empty() {
            self.txn(Txn { success: keys.into_iter().map(TxnOp::delete).collect(), ..Txn::default() }).await?;
        }
        Ok(())
    }

    async fn ready(&self) -> Result<()> {
        if self.failure().is_none() {
            return Ok(());
        }
        let s = self.clone();
        self.blocking(move || s.probe_write()).await
    }

    fn describe(&self) -> String {
        format!("embedded:{}", self.inner.path.display())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A restart right after a crash: the file is still locked for a moment
    /// (a killed instance, or a child forked from it not yet exec'd). The
    /// new instance waits for the lock instead of failing (the fresh-image
    /// check once saw `dev` refuse to start after a kill -9 in a test).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn open_waits_for_a_previous_holder_to_let_go() {
        let dir = tempfile::tempdir().expect("tempdir");
        let first = Database::create(dir.path().join("punchclock.redb")).expect("the first holder");
        let path = dir.path().to_path_buf();
        let second = tokio::spawn(async move { EmbeddedStore::open(&path).await.map(|_| ()) });
        tokio::time::sleep(std::time::Duration::from_millis(600)).await; // held meanwhile
        assert!(!second.is_finished(), "the second open waits while the lock is held");
        drop(first);
        second.await.expect("join").expect("opened once the first let go");
    }
}
