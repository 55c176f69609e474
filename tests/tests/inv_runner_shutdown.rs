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
