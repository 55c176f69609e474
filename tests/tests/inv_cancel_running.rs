//! Invariant 3 (issue 6), through `overlap_policy: cancel_running` with an
//! agent that ignores SIGTERM: the replacement run starts only once the
//! cancelled agent is gone (killed at the end of the kill grace), so the
//! task never has two live agents. Before, the replacement started during
//! the old agent's kill grace on every slot.

use std::time::Duration;

use punchclock_proto::v1 as pb;
use punchclock_tests::{KeepLogsOnPanic, Proc, apply, list_runs, max_live_agents_until, status, wait_n_runs};
use serde_json::json;

const MARKER: &str = "pc-stubborn-agent";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_running_waits_for_the_old_agent_to_exit() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "inv_cancel_running");
    let dev = Proc::dev(&dir.path().join("data"));
    apply(
        &dev.addr,
        json!({"task_id": "stub", "agent_id": "stubborn_live_agent", "trigger": {"type": "interval", "every": "3s"},
               "execution": {"concurrency_limit": 1, "overlap_policy": "cancel_running"}}),
    )
    .await;
    // Three replacements: each slot cancels the previous run, whose agent
    // ignores SIGTERM for the whole 1 s kill grace.
    let (max, _) = max_live_agents_until(
        MARKER,
        wait_n_runs(&dev.addr, "stub", 3, Duration::from_secs(60), |r| {
            status(r) == pb::RunStatus::Cancelled && r.attempts.first().is_some_and(|a| !a.awaiting_runner)
        }),
    )
    .await;
    assert!(max <= 1, "two agents of the task alive at once");
    let runs = list_runs(&dev.addr, "stub").await;
    let cancelled = runs.iter().filter(|r| status(r) == pb::RunStatus::Cancelled).count();
    assert!(cancelled >= 3, "replacements happened: {cancelled} cancelled: {runs:#?}");
    for r in runs.iter().filter(|r| status(r) == pb::RunStatus::Cancelled) {
        assert!(r.error.contains("cancel_running"), "{r:#?}");
    }
}
