//! Issue 8, acceptance 4: retention on a real etcd. A task with
//! `history: {keep_last: 100}` gets 10,000 finished runs (written straight
//! into etcd, as history imported) and one old run still RUNNING; the
//! leader's retention pass leaves the newest 100 and the running one; a
//! second 10,000 ends the same way, and etcd's database does not grow from
//! one 10,000 to the next (the leader compacts the history, so the space of
//! deleted runs is reused). `runs prune` does the same on request.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use punchclock_control_plane::model::RunRecord;
use punchclock_control_plane::model::RunStatus;
use punchclock_control_plane::model::run::{TriggerKind, slot_run_id};
use punchclock_control_plane::repo::{Keys, encode_run};
use punchclock_control_plane::store::etcd::EtcdStore;
use punchclock_control_plane::store::{KvStore, Txn, TxnOp};
use punchclock_tests::etcd::{Etcd, free_port};
use punchclock_tests::{KeepLogsOnPanic, Proc, apply, cli, wait_leader};

const N: usize = 10_000;
const KEEP: usize = 100;

/// Writes `N` finished runs of `hist`, slots one minute apart from `from`.
async fn seed(store: &EtcdStore, from: DateTime<Utc>) {
    let keys = Keys::default();
    let mut ops = Vec::new();
    for i in 0..N {
        let slot = from + chrono::Duration::minutes(i as i64);
        let mut run = RunRecord::pending(slot_run_id("hist", slot), "hist", "ok_agent", TriggerKind::Cron, slot, slot);
        run.status = RunStatus::Succeeded;
        run.finished_at = Some(slot + chrono::Duration::seconds(1));
        run.stdout_tail = "x".repeat(512);
        ops.push(TxnOp::put(keys.run(&run.run_id), encode_run(&run).expect("encode")));
        if ops.len() == 100 {
            store.txn(Txn { success: std::mem::take(&mut ops), ..Txn::default() }).await.expect("seed");
        }
    }
    if !ops.is_empty() {
        store.txn(Txn { success: ops, ..Txn::default() }).await.expect("seed");
    }
}

async fn run_ids(store: &EtcdStore) -> Vec<String> {
    let keys = Keys::default();
    let prefix = keys.runs_of("hist");
    let mut ids = Vec::new();
    let mut after = String::new();
    loop {
        let page = store.range_page(&prefix, &after, 1000, true).await.expect("range");
        let Some(last) = page.last() else { break };
        after = last.key.clone();
        ids.extend(page.iter().map(|kv| kv.key.trim_start_matches(&keys.runs()).to_string()));
    }
    ids
}

async fn wait_runs(store: &EtcdStore, n: usize) -> Vec<String> {
    for _ in 0..600 {
        let ids = run_ids(store).await;
        if ids.len() == n {
            return ids;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("runs of hist never came down to {n}: {}", run_ids(store).await.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_last_holds_active_runs_stay_and_etcd_does_not_grow() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "retention");
    let etcd = Etcd::start(1).await;
    let listen = format!("127.0.0.1:{}", free_port());
    let server = Proc::start(
        &["server", "--store", &etcd.store_url(), "--listen", &listen, "--node-id", "cp0", "--retention-interval", "2s"],
        &dir.path().join("cp0.log"),
        true,
    );
    wait_leader(std::slice::from_ref(&server.addr), Duration::from_secs(30), |_| true).await;
    apply(
        &server.addr,
        serde_json::json!({"task_id": "hist", "agent_id": "ok_agent", "trigger": {"type": "cron", "expr": "0 0 0 1 1 *"},
            "history": {"keep_last": KEEP, "max_age": "3650d"}}),
    )
    .await;
    let store = EtcdStore::connect(&etcd.endpoints()).await.expect("etcd");
    let keys = Keys::default();

    // An old run still RUNNING (its agent alive somewhere): in the active
    // index, never deleted.
    let old = DateTime::from_timestamp(1_600_000_000, 0).expect("t");
    let mut running = RunRecord::pending(slot_run_id("hist", old), "hist", "ok_agent", TriggerKind::Cron, old, old);
    running.status = RunStatus::Running;
    store
        .txn(Txn {
            success: vec![
                TxnOp::put(keys.run(&running.run_id), encode_run(&running).expect("encode")),
                TxnOp::put(keys.active_run(&running.run_id), Vec::new()),
            ],
            ..Txn::default()
        })
        .await
        .expect("running run");

    let client = Arc::new(store.client());
    let mut sizes = Vec::new();
    for round in 0..2 {
        let from = DateTime::from_timestamp(1_700_000_000 + round * 10_000_000, 0).expect("t");
        seed(&store, from).await;
        let ids = wait_runs(&store, KEEP + 1).await;
        assert!(ids.contains(&running.run_id), "the running run was deleted");
        let newest: Vec<String> = (N - KEEP..N).map(|i| slot_run_id("hist", from + chrono::Duration::minutes(i as i64))).collect();
        assert!(newest.iter().all(|id| ids.contains(id)), "round {round}: not the newest {KEEP} kept");
        // Two more passes: the deletions are compacted away.
        tokio::time::sleep(Duration::from_secs(5)).await;
        let size = (*client).clone().status().await.expect("etcd status").db_size();
        println!("round {round}: etcd db size {size} bytes after {N} runs pruned to {KEEP}");
        sizes.push(size);
    }
    assert!(sizes[1] <= sizes[0] + sizes[0] / 5, "etcd's database grew from one {N} runs to the next: {sizes:?} (history not compacted?)");

    // On request: nothing more to delete.
    let out = cli(&server.addr, &["runs", "prune", "--task", "hist"]);
    assert!(out.contains("0 finished runs deleted, 101 runs kept"), "{out}");
}
