//! Invariant 6 (issue 6): `misfire_policy: run_all` with the default
//! `concurrency_limit: 1` runs every slot missed during an outage (within
//! the grace), oldest first, one after another — queued behind each other,
//! not SKIPPED for overlapping each other. Before, the first missed slot
//! ran and the others were SKIPPED `concurrency_limit`.

use std::time::Duration;

use punchclock_proto::v1 as pb;
use punchclock_tests::{KeepLogsOnPanic, Proc, apply, at, list_runs, status, wait_n_runs};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_all_runs_every_missed_slot_one_after_another() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "inv_run_all");
    let data = dir.path().join("data");
    let dev = Proc::dev(&data);
    apply(
        &dev.addr,
        json!({"task_id": "all", "agent_id": "ok_agent", "trigger": {"type": "interval", "every": "2s"},
               "execution": {"misfire_policy": "run_all", "misfire_grace_seconds": 3600}}),
    )
    .await;
    wait_n_runs(&dev.addr, "all", 1, Duration::from_secs(20), |r| status(r) == pb::RunStatus::Succeeded).await;
    // A clean stop (nothing left running), then an outage of ~5 slots.
    dev.signal(libc::SIGTERM);
    let mut dev = dev;
    let _ = dev.child.wait();
    let down_from = chrono::Utc::now();
    tokio::time::sleep(Duration::from_secs(10)).await;
    let dev = Proc::dev(&data);
    let up_at = chrono::Utc::now();
    let missed: usize = {
        let first = down_from.timestamp() + 1 + (down_from.timestamp() + 1).rem_euclid(2);
        ((first..up_at.timestamp()).step_by(2)).count()
    };
    assert!(missed >= 4, "slots missed: {missed}");
    // Every missed slot runs.
    let done = wait_n_runs(&dev.addr, "all", missed, Duration::from_secs(60), |r| {
        status(r) == pb::RunStatus::Succeeded && at(&r.scheduled_at).is_some_and(|t| t > down_from && t < up_at)
    })
    .await;
    let runs = list_runs(&dev.addr, "all").await;
    let skipped: Vec<&pb::Run> = runs.iter().filter(|r| status(r) == pb::RunStatus::Skipped).collect();
    assert!(skipped.is_empty(), "no slot skipped: {skipped:#?}");
    // Oldest first, one after another.
    let mut by_slot: Vec<&pb::Run> = done.iter().collect();
    by_slot.sort_by_key(|r| at(&r.scheduled_at));
    for pair in by_slot.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        assert!(at(&a.finished_at) <= at(&b.actual_started_at), "{} ran before {} ended: {a:#?} {b:#?}", b.run_id, a.run_id);
    }
}
