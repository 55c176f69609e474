//! Issue 8, acceptance 2: 20,000 tasks with 2 KiB contexts and 2,000 runs
//! with 64 KiB output tails on a real etcd — about 45 MB and 260 MB, far
//! over gRPC's 4 MiB default message — and every replica restarted. The
//! new leader loads them (ranges are read in pages) and fires a task of
//! them on time; `task list` pages through all of them; `runs list` and
//! `runs list --task` answer; an unknown status is refused.

use std::time::Duration;

use punchclock_control_plane::model::run::{TriggerKind, slot_run_id};
use punchclock_control_plane::model::{RunRecord, RunStatus};
use punchclock_control_plane::repo::{Keys, encode_run};
use punchclock_control_plane::store::etcd::EtcdStore;
use punchclock_control_plane::store::{KvStore, Txn, TxnOp};
use punchclock_proto::v1 as pb;
use punchclock_tests::etcd::{Etcd, free_port};
use punchclock_tests::{KeepLogsOnPanic, Proc, at, cli, runs, status, wait_leader, wait_run};

const N: usize = 20_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_leader_loads_twenty_thousand_big_tasks_and_fires_on_time() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "etcd_at_size");
    let etcd = Etcd::start(1).await;
    let first = Proc::server(&etcd.store_url(), "cp0", free_port(), dir.path());
    wait_leader(std::slice::from_ref(&first.addr), Duration::from_secs(30), |_| true).await;

    let context = "x".repeat(2048);
    let mut specs: Vec<serde_json::Value> = (0..N)
        .map(|i| {
            serde_json::json!({"task_id": format!("big{i:05}"), "agent_id": "ok_agent",
                "trigger": {"type": "cron", "expr": "0 0 0 1 1 *"}, "context": {"params": {"pad": context}}})
        })
        .collect();
    // One of them fires every 5 s.
    specs[N / 2]["trigger"]["expr"] = "*/5 * * * * *".into();
    let file = dir.path().join("big.json");
    std::fs::write(&file, serde_json::to_string(&specs).expect("json")).expect("write");
    let out = cli(&first.addr, &["task", "apply", "-f", &file.to_string_lossy()]);
    assert_eq!(out.lines().filter(|l| l.ends_with(" created")).count(), N);

    // 2,000 finished runs with 64 KiB tails (as history left by agents).
    let store = EtcdStore::connect(&etcd.endpoints()).await.expect("etcd");
    let keys = Keys::default();
    let tail = "t".repeat(64 * 1024);
    let mut ops = Vec::new();
    for i in 0..2000 {
        let slot = chrono::DateTime::from_timestamp(1_780_000_000 + i * 60, 0).expect("t");
        let task = format!("big{:05}", i % 50);
        let mut run = RunRecord::pending(slot_run_id(&task, slot), &task, "ok_agent", TriggerKind::Cron, slot, slot);
        run.status = RunStatus::Succeeded;
        run.finished_at = Some(slot);
        run.stdout_tail = tail.clone();
        run.stderr_tail = tail.clone();
        ops.push(TxnOp::put(keys.run(&run.run_id), encode_run(&run).expect("encode")));
        // Its time index entries, as a run of this version has (the
        // leader marked the index whole when the store was new).
        ops.push(TxnOp::put(keys.history_entry(slot, &run.run_id), Vec::new()));
        ops.push(TxnOp::put(keys.task_history_entry(&task, slot, &run.run_id), Vec::new()));
        if ops.len() == 18 {
            store.txn(Txn { success: std::mem::take(&mut ops), ..Txn::default() }).await.expect("seed runs");
        }
    }
    if !ops.is_empty() {
        store.txn(Txn { success: ops, ..Txn::default() }).await.expect("seed runs");
    }

    // Every replica restarted: the new leader reads everything back.
    drop(first);
    let server = Proc::server(&etcd.store_url(), "cp1", free_port(), dir.path());
    wait_leader(std::slice::from_ref(&server.addr), Duration::from_secs(30), |s| s.leader_id == "cp1").await;
    let _runner = Proc::runner(&server.addr, "r1", dir.path());
    let restarted = chrono::Utc::now();
    let firing = format!("big{:05}", N / 2);
    let succeeded_after = |after: chrono::DateTime<chrono::Utc>| {
        move |r: &pb::Run| status(r) == pb::RunStatus::Succeeded && at(&r.scheduled_at).is_some_and(|t| t > after)
    };
    // The first slot after the restart may wait for the runner to connect;
    // the next one (the runner is there) starts on time.
    let first = wait_run(&server.addr, &firing, Duration::from_secs(60), succeeded_after(restarted)).await;
    let run = wait_run(&server.addr, &firing, Duration::from_secs(30), succeeded_after(at(&first.finished_at).expect("finished"))).await;
    let lag = at(&run.actual_started_at).expect("started") - at(&run.scheduled_at).expect("slot");
    assert!(lag < chrono::Duration::seconds(1), "fired late: {lag}");

    let listed = cli(&server.addr, &["task", "list", "-o", "json"]);
    let listed: serde_json::Value = serde_json::from_str(&listed).expect("task list JSON");
    assert_eq!(listed.as_array().map(Vec::len), Some(N), "task list pages through every task");

    let all = cli(&server.addr, &["runs", "list", "--limit", "1000", "-o", "json"]);
    let all: serde_json::Value = serde_json::from_str(&all).expect("runs list JSON");
    assert!(all.as_array().is_some_and(|a| a.len() == 1000), "runs list over 2,000 big runs");
    let of_one = cli(&server.addr, &["runs", "list", "--task", "big00007", "-o", "json"]);
    let of_one: serde_json::Value = serde_json::from_str(&of_one).expect("runs list --task JSON");
    assert_eq!(of_one.as_array().map(Vec::len), Some(40), "runs list --task: that task's 40 runs");
    let mut client = runs(&server.addr).await;
    let of_task = client
        .list_runs(pb::ListRunsRequest { task_id: firing.clone(), status: 0, limit: 0, ..Default::default() })
        .await
        .expect("runs of a task");
    assert!(of_task.into_inner().runs.iter().all(|r| r.task_id == firing));
    let unknown = client.list_runs(pb::ListRunsRequest { task_id: String::new(), status: 99, limit: 0, ..Default::default() }).await;
    assert_eq!(unknown.map_err(|e| e.code()).err(), Some(tonic::Code::InvalidArgument), "unknown status");
}
