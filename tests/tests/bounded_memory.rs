//! Issue 19, findings 4 and 5: no client can take the leader's memory.
//! Real `punchclock dev` processes, their resident memory sampled from
//! `/proc` while the attack runs.
//!
//! - `stalled_watchers_hold_bounded_memory`: 100 `WatchRuns` clients (each
//!   its own connection, a reader token would do) that never read, with
//!   35,000 runs stored: each copied every run into its own queue and the
//!   control plane went from 106 MiB to 5.4 GiB. Now memory stays within
//!   50 MiB of idle, a watcher that fell behind is ended with `ABORTED`
//!   when it reads again, and a reading watcher still sees every change.

use std::time::Duration;

use punchclock_control_plane::model::run::{TriggerKind, slot_run_id};
use punchclock_control_plane::model::{RunRecord, RunStatus};
use punchclock_control_plane::repo::{Keys, encode_run};
use punchclock_control_plane::store::embedded::EmbeddedStore;
use punchclock_control_plane::store::{KvStore, Txn, TxnOp};
use punchclock_proto::v1 as pb;
use punchclock_tests::{Proc, apply, cli, endpoint, rss_bytes, status, wait_run, with_token};
use serde_json::json;
use tokio_stream::StreamExt;

const MIB: u64 = 1024 * 1024;

/// 35,000 finished runs of 70 tasks, each with a 1 KiB output tail, written
/// straight to an embedded store before `dev` opens it.
async fn seed_runs(data: &std::path::Path) {
    let store = EmbeddedStore::open(data).await.expect("open store");
    let keys = Keys::default();
    let tail = "o".repeat(1024);
    let mut ops = Vec::new();
    for i in 0..35_000i64 {
        let slot = chrono::DateTime::from_timestamp(1_780_000_000 + i, 0).expect("t");
        let task = format!("hist{:02}", i % 70);
        let mut run = RunRecord::pending(slot_run_id(&task, slot), &task, "true_agent", TriggerKind::Cron, slot, slot);
        run.status = RunStatus::Succeeded;
        run.finished_at = Some(slot);
        run.stdout_tail = tail.clone();
        ops.push(TxnOp::put(keys.run(&run.run_id), encode_run(&run).expect("encode")));
        if ops.len() == 1000 {
            store.txn(Txn { success: std::mem::take(&mut ops), ..Txn::default() }).await.expect("seed");
        }
    }
    if !ops.is_empty() {
        store.txn(Txn { success: ops, ..Txn::default() }).await.expect("seed");
    }
}

/// The largest resident size of `pid` over `d`, sampled every 100 ms.
async fn peak_rss(pid: i32, d: Duration) -> u64 {
    let end = tokio::time::Instant::now() + d;
    let mut peak = 0;
    while tokio::time::Instant::now() < end {
        peak = peak.max(rss_bytes(pid));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    peak
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_watchers_hold_bounded_memory() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    seed_runs(&data).await;
    let dev = Proc::dev(&data);
    apply(&dev.addr, json!({"task_id": "live", "agent_id": "true_agent", "execution": {"concurrency_limit": 100}})).await;
    // A watcher that reads: it must see every change, attack or not.
    let mut reader = punchclock_tests::watch_runs(&dev.addr, "live").await;
    let idle = peak_rss(dev.pid(), Duration::from_secs(3)).await;

    // 100 watchers of every run, each on its own connection, never reading.
    let mut stalled = Vec::new();
    for _ in 0..100 {
        let ch = with_token(endpoint(&dev.addr).connect().await.expect("connect"));
        let mut c = pb::run_service_client::RunServiceClient::new(ch);
        let s = c.watch_runs(pb::WatchRunsRequest { task_id: String::new(), run_id: String::new() }).await.expect("watch").into_inner();
        stalled.push(s);
    }
    // Live changes meanwhile: 150 runs (about 600 changes) while they stall.
    for i in 0..150 {
        cli(&dev.addr, &["task", "trigger", "live", "--key", &format!("k{i}")]);
    }
    let peak = peak_rss(dev.pid(), Duration::from_secs(20)).await;
    println!("idle {} MiB, peak with 100 stalled watchers {} MiB", idle / MIB, peak / MIB);
    assert!(peak < idle + 50 * MIB, "memory: idle {} MiB, peak {} MiB", idle / MIB, peak / MIB);

    // The reading watcher saw every run succeed.
    let mut done = std::collections::HashSet::new();
    tokio::time::timeout(Duration::from_secs(60), async {
        while done.len() < 150 {
            let r = reader.next().await.expect("watch open").expect("watch item");
            if status(&r) == pb::RunStatus::Succeeded {
                done.insert(r.run_id);
            }
        }
    })
    .await
    .expect("the reading watcher sees all 150 runs succeed");

    // A stalled watcher that reads again: the listing, what it had queued,
    // then the end of its watch saying it fell behind.
    let mut s = stalled.pop().expect("one");
    let ended = tokio::time::timeout(Duration::from_secs(120), async {
        loop {
            match s.next().await {
                Some(Ok(_)) => {}
                Some(Err(e)) => return Some(e),
                None => return None,
            }
        }
    })
    .await
    .expect("the watch ends");
    let e = ended.expect("ended with a status, not silently");
    assert_eq!(e.code(), tonic::Code::Aborted, "{e}");
    assert!(e.message().contains("fell behind"), "{}", e.message());
    drop(stalled);
    // The control plane still answers.
    wait_run(&dev.addr, "live", Duration::from_secs(10), |r| status(r) == pb::RunStatus::Succeeded).await;
}
