//! Takeover rule (DESIGN, Store and leadership): a new leader waits for
//! runners to re-declare their in-flight runs before it fires slots that
//! depend on them. Here a run is RUNNING on runner `r1` when the control
//! plane stops; it restarts after three slots of a `concurrency_limit: 1`
//! task went by. The latest missed slot must run (misfire `run_once`) once
//! `r1` reconnects without the old run, not be skipped for overlapping a run
//! that was already gone.
//!
//! A test-driven runner over the real RunnerService stream, and a manual
//! clock, make the order of events exact: without the rule the slot is
//! decided at load, before any runner can say Hello.

use std::time::Duration;

use chrono::{DateTime, Utc};
use punchclock_control_plane::bootstrap::RunningServer;
use punchclock_control_plane::clock::ManualClock;
use punchclock_proto::v1 as pb;
use punchclock_tests::{RawRunner, at, list_runs, status, wait_run};

async fn server(clock: ManualClock, dir: &std::path::Path) -> (RunningServer, String, tokio::sync::oneshot::Sender<()>) {
    let (s, stop) = punchclock_tests::in_process_server(clock, dir).await;
    let addr = format!("http://{}", s.addr);
    (s, addr, stop)
}

/// A test-driven runner `r1` serving agent `a`, nothing in flight.
async fn connect_runner(addr: &str, instance: &str) -> RawRunner {
    RawRunner::connect(addr, "r1", &["a"], instance, vec![]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_waits_for_the_runner_before_deciding_overlap() {
    let _ = tracing_subscriber::fmt().with_env_filter("info").with_test_writer().try_init();
    let dir = tempfile::tempdir().expect("tempdir");
    let t0: DateTime<Utc> = "2026-11-30T10:00:00Z".parse().expect("t0");
    let clock = ManualClock::new(t0 + chrono::Duration::seconds(1));
    let (srv, addr, stop) = server(clock.clone(), dir.path()).await;
    punchclock_tests::apply(
        &addr,
        serde_json::json!({"task_id": "tick", "agent_id": "a",
            "trigger": {"type": "interval", "every": "10s", "start_at": t0.to_rfc3339()},
            "execution": {"concurrency_limit": 1, "overlap_policy": "skip", "misfire_policy": "run_once", "misfire_grace_seconds": 60}}),
    )
    .await;
    // The runner connects after the jump (a manual clock jumping past its
    // heartbeats would make it lost): the slot's run waits PENDING for it.
    clock.set(t0 + chrono::Duration::seconds(10));
    wait_run(&addr, "tick", Duration::from_secs(20), |r| status(r) == pb::RunStatus::Pending).await;
    let mut runner = connect_runner(&addr, "i1").await;
    let first = runner.next_assign(Duration::from_secs(20)).await;
    assert_eq!(first.task_id, "tick");
    runner.started(&first).await;
    let running = wait_run(&addr, "tick", Duration::from_secs(20), |r| r.attempts.first().is_some_and(|a| a.started_at.is_some())).await;
    assert_eq!(running.run_id, first.run_id);

    // The control plane stops with that run open; three slots go by.
    drop(runner);
    let _ = stop.send(());
    srv.wait().await.expect("server stops");
    clock.set(t0 + chrono::Duration::seconds(45));
    let (srv, addr, stop) = server(clock.clone(), dir.path()).await;

    // r1 comes back without the run: its attempt is lost, and only then is
    // the latest missed slot (10:00:40) admitted, and assigned.
    let mut runner = connect_runner(&addr, "i1").await;
    let late = runner.next_assign(Duration::from_secs(20)).await;
    let latest = t0 + chrono::Duration::seconds(40);
    let runs = list_runs(&addr, "tick").await;
    let slot = runs.iter().find(|r| at(&r.scheduled_at) == Some(latest)).expect("a record for the latest missed slot");
    assert_ne!(status(slot), pb::RunStatus::Skipped, "the latest missed slot was skipped for a run that was gone: {slot:#?}");
    assert_eq!(late.run_id, slot.run_id);
    let old = runs.iter().find(|r| r.run_id == first.run_id).expect("the old run");
    assert_eq!(old.attempts.last().map(|a| a.outcome.as_str()), Some("lost"), "{old:#?}");
    let coalesced: Vec<&pb::Run> = runs.iter().filter(|r| r.skip_reason == "misfired").collect();
    assert_eq!(coalesced.len(), 1, "{runs:#?}");
    assert_eq!(coalesced[0].missed_count, 2, "10:00:20 and 10:00:30 in one record: {:#?}", coalesced[0]);

    // Stopping with the runner's stream still open: the server cuts it after
    // its drain instead of waiting for the runner to hang up.
    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(15), srv.wait())
        .await
        .expect("the server stops within its drain while a runner stream is open")
        .expect("server stops");
    drop(runner);
}

/// An assignment whose Assign never reached the runner (the stream broke
/// first): when the same runner process reconnects without it, it never ran,
/// so it is dispatched again as the same attempt; when a restarted runner
/// (another process, same id) comes back without it, it may have started, so
/// it is lost and the retry policy decides.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unstarted_assignment_is_requeued_for_the_same_process_and_lost_for_a_new_one() {
    let dir = tempfile::tempdir().expect("tempdir");
    let t0: DateTime<Utc> = "2026-11-30T10:00:00Z".parse().expect("t0");
    let clock = ManualClock::new(t0);
    let (srv, addr, stop) = server(clock.clone(), dir.path()).await;
    for id in ["same", "other"] {
        punchclock_tests::apply(&addr, serde_json::json!({"task_id": id, "agent_id": "a", "execution": {"max_retries": 0}})).await;
    }

    // The same process: assigned, never started, reconnects without it.
    let mut runner = connect_runner(&addr, "i1").await;
    punchclock_tests::cli(&addr, &["task", "trigger", "same", "--key", "k"]);
    let first = runner.next_assign(Duration::from_secs(20)).await;
    drop(runner);
    let mut runner = connect_runner(&addr, "i1").await;
    let requeued = wait_run(&addr, "same", Duration::from_secs(20), |r| status(r) == pb::RunStatus::Pending && r.attempts.is_empty()).await;
    assert!(requeued.pending_reason.contains("never started"), "{requeued:#?}");
    // The re-dispatch waits a short pause on the (manual) clock.
    clock.advance(chrono::Duration::seconds(2));
    let again = runner.next_assign(Duration::from_secs(20)).await;
    assert_eq!((again.run_id.as_str(), again.attempt), (first.run_id.as_str(), 1), "dispatched again as attempt 1");
    assert_ne!(again.execution_id, first.execution_id);
    let run = list_runs(&addr, "same").await.into_iter().next().expect("run");
    assert_eq!(run.attempts.len(), 1, "no attempt spent: {run:#?}");
    assert!(run.attempts[0].outcome.is_empty(), "{run:#?}");

    // Finish it, then a restarted runner process (new instance id) comes back
    // without an assignment it was given: lost, and with no retries, FAILED.
    runner.finished(&again.run_id, &again.execution_id, pb::Outcome::Succeeded, "").await;
    wait_run(&addr, "same", Duration::from_secs(20), |r| status(r) == pb::RunStatus::Succeeded).await;
    punchclock_tests::cli(&addr, &["task", "trigger", "other", "--key", "k"]);
    runner.next_assign(Duration::from_secs(20)).await;
    drop(runner);
    let _runner = connect_runner(&addr, "i2").await;
    let run = wait_run(&addr, "other", Duration::from_secs(20), punchclock_tests::terminal).await;
    assert_eq!(status(&run), pb::RunStatus::Failed, "{run:#?}");
    assert_eq!(run.attempts.len(), 1);
    assert_eq!(run.attempts[0].outcome, "lost", "{run:#?}");

    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(15), srv.wait()).await.expect("server stops").expect("server stops");
}
