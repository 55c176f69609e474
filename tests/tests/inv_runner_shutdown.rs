//! Invariant 7 (issue 6): a runner's graceful shutdown (SIGTERM) does not
//! spend an attempt. Its run is interrupted and dispatched again — to
//! another runner here — and succeeds, with the default `max_retries: 0`.
//! Before, every routine runner restart failed the runs it had.

use std::time::Duration;

use punchclock_proto::v1 as pb;
use punchclock_tests::etcd::free_port;
use punchclock_tests::{KeepLogsOnPanic, Proc, apply, cli, status, wait_run};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_restart_interrupts_its_run_without_spending_an_attempt() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "inv_runner_shutdown");
    let store = format!("embedded:{}", dir.path().join("store").display());
    let server = Proc::server(&store, "cp", free_port(), dir.path());
    apply(&server.addr, json!({"task_id": "g", "agent_id": "sleep_agent", "execution": {"max_retries": 0}})).await;
    let mut r1 = Proc::runner(&server.addr, "r1", dir.path());
    cli(&server.addr, &["task", "trigger", "g", "--key", "k"]);
    let running =
        wait_run(&server.addr, "g", Duration::from_secs(30), |r| r.attempts.first().is_some_and(|a| a.started_at.is_some())).await;
    assert_eq!(running.attempts[0].runner_id, "r1");

    // A routine restart of r1: SIGTERM; r2 takes over.
    r1.signal(libc::SIGTERM);
    let _ = r1.child.wait();
    let _r2 = Proc::runner(&server.addr, "r2", dir.path());
    let done = wait_run(&server.addr, "g", Duration::from_secs(30), punchclock_tests::terminal).await;
    assert_eq!(status(&done), pb::RunStatus::Succeeded, "{done:#?}");
    assert_eq!(done.interruptions, 1);
    let outcomes: Vec<(&str, &str)> = done.attempts.iter().map(|a| (a.runner_id.as_str(), a.outcome.as_str())).collect();
    assert_eq!(outcomes, [("r1", "interrupted"), ("r2", "succeeded")], "{done:#?}");
    assert!(done.attempts[0].error.contains("runner shutting down"), "{done:#?}");
}

/// The same for `punchclock dev`, whose runner lives in the control plane's
/// process: on SIGTERM the runner stops first and its interrupted run is
/// recorded, so the run goes again at the next start without spending an
/// attempt. (Found by a walkthrough: the control plane stopped before the
/// runner's report arrived, and the run came back `lost` and FAILED.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dev_restart_interrupts_its_run_without_spending_an_attempt() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "inv_dev_restart");
    let data = dir.path().join("data");
    let mut dev = Proc::dev(&data);
    apply(&dev.addr, json!({"task_id": "g", "agent_id": "sleep_agent", "execution": {"max_retries": 0}})).await;
    cli(&dev.addr, &["task", "trigger", "g", "--key", "k"]);
    wait_run(&dev.addr, "g", Duration::from_secs(30), |r| r.attempts.first().is_some_and(|a| a.started_at.is_some())).await;
    dev.signal(libc::SIGTERM);
    let _ = dev.child.wait();
    let dev = Proc::dev(&data);
    let done = wait_run(&dev.addr, "g", Duration::from_secs(30), punchclock_tests::terminal).await;
    assert_eq!(status(&done), pb::RunStatus::Succeeded, "{done:#?}");
    let outcomes: Vec<&str> = done.attempts.iter().map(|a| a.outcome.as_str()).collect();
    assert_eq!(outcomes, ["interrupted", "succeeded"], "{done:#?}");
}
