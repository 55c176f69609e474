//! Invariants 8 and 9 (issue 6).
//!
//! 8: a run no connected runner serves ends TIMEOUT after
//! `execution.start_timeout_seconds`, naming why, and frees its
//! concurrency slot; `task apply` warns that no runner serves the agent.
//! Before, such a run stayed PENDING forever and every later slot of its
//! task was SKIPPED `concurrency_limit`.
//!
//! 9: `execution.priority` is bounded (`-1000..=1000`); outside, the task
//! is rejected naming the field. Before, `-2147483648` overflowed a
//! negation (dispatched first in release; a debug engine panicked at every
//! restart, leaving the cluster leaderless).

use std::process::Command;
use std::time::Duration;

use punchclock_proto::v1 as pb;
use punchclock_tests::{KeepLogsOnPanic, Proc, bin, cli, repo_root, status, wait_n_runs};

fn apply_file(addr: &str, dir: &std::path::Path, name: &str, json: serde_json::Value) -> std::process::Output {
    let file = dir.join(name);
    std::fs::write(&file, json.to_string()).expect("write task file");
    Command::new(bin())
        .args(["task", "apply", "-f", &file.to_string_lossy()])
        .env("PUNCHCLOCK_ENDPOINT", addr)
        .current_dir(repo_root())
        .output()
        .expect("run cli")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_no_runner_serves_times_out_and_frees_its_slot() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "inv_start_timeout");
    let dev = Proc::dev(&dir.path().join("data"));
    let out = apply_file(
        &dev.addr,
        dir.path(),
        "nobody.json",
        serde_json::json!({"task_id": "nobody", "agent_id": "nobody_agent", "trigger": {"type": "interval", "every": "3s"},
                           "execution": {"start_timeout_seconds": 2, "max_retries": 3}}),
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("warning: task nobody: no connected runner serves agent \"nobody_agent\""), "{stderr}");
    // Two slots in a row time out: the first freed the slot for the second.
    let timed_out = wait_n_runs(&dev.addr, "nobody", 2, Duration::from_secs(30), |r| status(r) == pb::RunStatus::Timeout).await;
    for r in &timed_out {
        assert_eq!(r.error, "not started within 2 s: no connected runner serves agent \"nobody_agent\"", "{r:#?}");
        assert!(r.attempts.is_empty(), "no attempt, no retry: {r:#?}");
    }
    let listed = cli(&dev.addr, &["runs", "list", "--task", "nobody", "--status", "SKIPPED"]);
    assert!(!listed.contains("concurrency_limit"), "{listed}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn priority_is_bounded_and_an_overflowing_one_is_rejected() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dev = Proc::dev(&dir.path().join("data"));
    let out = apply_file(
        &dev.addr,
        dir.path(),
        "min.json",
        serde_json::json!({"task_id": "p", "agent_id": "ok_agent", "execution": {"priority": i32::MIN}}),
    );
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("execution.priority: must be in -1000..=1000"), "{stderr}");
    let got = punchclock_tests::tasks(&dev.addr).await.get_task(pb::GetTaskRequest { task_id: "p".into() }).await;
    assert_eq!(got.map_err(|e| e.code()).err(), Some(tonic::Code::NotFound), "nothing applied");
    let out = apply_file(
        &dev.addr,
        dir.path(),
        "max.json",
        serde_json::json!({"task_id": "p", "agent_id": "ok_agent", "execution": {"priority": 1000}}),
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}
