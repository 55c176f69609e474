//! Invariant 5 (issue 6): every due slot has a record, also when the task
//! is paused while a new leader still waits for runners to re-declare: the
//! slots due before the pause are settled by the misfire policy first.
//! Before, such slots got no record at all.
//!
//! A real control plane (embedded store) killed with SIGKILL and started
//! again; a test-driven runner over the real stream holds a run across the
//! crash, so the new leader waits for it before deciding anything.

use std::time::Duration;

use chrono::{DateTime, Utc};
use punchclock_proto::v1 as pb;
use punchclock_tests::etcd::free_port;
use punchclock_tests::{KeepLogsOnPanic, Proc, RawRunner, apply, at, cli, list_runs, status, wait_run};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slots_due_before_a_pause_during_redeclaration_have_records() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "inv_slot_records");
    let store = format!("embedded:{}", dir.path().join("store").display());
    let port = free_port();
    let mut server = Proc::server(&store, "cp", port, dir.path());
    apply(
        &server.addr,
        json!({"task_id": "tick", "agent_id": "remote_agent", "trigger": {"type": "interval", "every": "3s"},
               "execution": {"concurrency_limit": 1, "misfire_policy": "run_once", "misfire_grace_seconds": 60}}),
    )
    .await;
    let mut runner = RawRunner::connect(&server.addr, "r1", &["remote_agent"], "i1", vec![]).await;
    let first = runner.next_assign(Duration::from_secs(20)).await;
    runner.started(&first).await;
    wait_run(&server.addr, "tick", Duration::from_secs(20), |r| r.attempts.first().is_some_and(|a| a.started_at.is_some())).await;
    let first_slot = at(&first.scheduled_at).expect("slot");

    // The control plane dies with the run open; slots go by.
    server.kill9();
    drop(runner);
    tokio::time::sleep(Duration::from_secs(7)).await;
    let server = Proc::server(&store, "cp2", port, dir.path());
    // The new leader waits for r1 (it held a run): the task is paused meanwhile.
    cli(&server.addr, &["task", "pause", "tick"]);
    let paused_at: DateTime<Utc> = Utc::now();
    // r1 comes back restarted (a new process) without the run: lost; then
    // the due slots are settled.
    let _runner = RawRunner::connect(&server.addr, "r1", &["remote_agent"], "i2", vec![]).await;
    wait_run(&server.addr, "tick", Duration::from_secs(30), |r| r.run_id == first.run_id && status(r) == pb::RunStatus::Failed).await;
    // The settlement's records commit with the cursor: wait for the last due slot's coverage.
    let last_due = slot_floor(paused_at - chrono::Duration::milliseconds(500));
    wait_run(&server.addr, "tick", Duration::from_secs(30), |r| covers(r, last_due)).await;

    let runs = list_runs(&server.addr, "tick").await;
    let mut slot = first_slot + chrono::Duration::seconds(3);
    let mut checked = 0;
    while slot <= last_due {
        assert!(runs.iter().any(|r| covers(r, slot)), "slot {slot} has no record: {runs:#?}");
        slot += chrono::Duration::seconds(3);
        checked += 1;
    }
    assert!(checked >= 2, "slots fell due during the outage: {checked}");
    // Paused: nothing after the pause fires.
    assert!(runs.iter().all(|r| at(&r.scheduled_at).is_some_and(|t| t <= paused_at)), "{runs:#?}");
}

/// The last 3-second slot at or before `t`.
fn slot_floor(t: DateTime<Utc>) -> DateTime<Utc> {
    DateTime::from_timestamp(t.timestamp() - t.timestamp().rem_euclid(3), 0).expect("slot")
}

fn covers(r: &pb::Run, slot: DateTime<Utc>) -> bool {
    if r.trigger_kind != "interval" {
        return false;
    }
    match (at(&r.missed_from), at(&r.missed_until)) {
        (Some(f), Some(u)) if r.missed_count > 0 => f <= slot && slot <= u,
        _ => at(&r.scheduled_at) == Some(slot),
    }
}

/// Found by breaking it: a task with a past `once` slot, deleted and
/// applied again, made the engine create that slot's run a second time;
/// the write failed, the engine restarted from the store and failed the
/// same way, every second: nothing was scheduled. The slot's existing
/// record now counts as its record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reapplying_a_deleted_task_with_a_past_once_slot_schedules_on() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "inv_reapply_once");
    let dev = Proc::dev(&dir.path().join("data"));
    let once = json!({"task_id": "oncepast", "agent_id": "ok_agent", "trigger": {"type": "once", "at": "2020-01-01T00:00:00Z"}});
    apply(&dev.addr, once.clone()).await;
    wait_run(&dev.addr, "oncepast", Duration::from_secs(20), |r| status(r) == pb::RunStatus::Succeeded).await;
    cli(&dev.addr, &["task", "delete", "oncepast"]);
    apply(&dev.addr, once).await;
    apply(&dev.addr, json!({"task_id": "tick", "agent_id": "ok_agent", "trigger": {"type": "interval", "every": "1s"}})).await;
    punchclock_tests::wait_n_runs(&dev.addr, "tick", 3, Duration::from_secs(20), |r| status(r) == pb::RunStatus::Succeeded).await;
    assert_eq!(list_runs(&dev.addr, "oncepast").await.len(), 1, "the slot keeps its one record");
    assert!(!dev.log_text().contains("exists already"), "{}", dev.log_text());
}
