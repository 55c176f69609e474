//! Acceptance 2 (issue 2), end to end with real processes: `punchclock dev`
//! (control plane + in-process runner over loopback gRPC) running real
//! agent programs, driven by the real CLI and gRPC API.

use std::time::Duration;

use punchclock_proto::v1 as pb;
use punchclock_tests::{Proc, apply, at, cli, list_runs, status, tasks, terminal, wait_gone, wait_run};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_tasks_succeed_with_result_and_progress() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dev = Proc::dev(&dir.path().join("data"));
    let out = cli(&dev.addr, &["task", "apply", "-f", "examples/tasks/demo_report.yaml"]);
    assert!(out.contains("demo_report created"), "{out}");
    let run = wait_run(&dev.addr, "demo_report", Duration::from_secs(60), terminal).await;
    assert_eq!(status(&run), pb::RunStatus::Succeeded, "{run:#?}");
    let result: serde_json::Value = serde_json::from_str(&run.result_json).expect("result is JSON");
    assert_eq!(result["format"], "markdown");
    assert!(result["report"].as_str().is_some_and(|r| r.contains("cn-north")), "report mentions the region: {result}");
    let progress = run.progress.expect("progress recorded");
    assert_eq!(progress.percent, Some(100.0));
    assert!(run.actual_started_at.is_some() && run.dispatched_at.is_some() && run.finished_at.is_some());
    assert_eq!(run.attempts.len(), 1);
    assert_eq!(run.attempts[0].outcome, "succeeded");
    assert!(!run.attempts[0].execution_id.is_empty());

    // The CLI shows the record with DESIGN's field names.
    let json: serde_json::Value = serde_json::from_str(&cli(&dev.addr, &["runs", "get", &run.run_id])).expect("runs get prints JSON");
    for field in [
        "run_id",
        "task_id",
        "status",
        "scheduled_at",
        "dispatched_at",
        "actual_started_at",
        "finished_at",
        "attempts",
        "result",
        "progress",
        "skip_reason",
    ] {
        assert!(json.get(field).is_some(), "runs get lacks {field}: {json}");
    }
    assert_eq!(json["status"], "SUCCEEDED");
    assert!(json["attempts"][0]["execution_id"].is_string());
    let listed: serde_json::Value =
        serde_json::from_str(&cli(&dev.addr, &["runs", "list", "--task", "demo_report", "-o", "json"])).expect("json list");
    assert!(listed.as_array().is_some_and(|a| !a.is_empty()));
}

/// Retries follow `retry_backoff`: delay before retry k = min(base*2^(k-1), cap) + jitter,
/// measured from the records (previous attempt's end → next attempt's dispatch).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_agent_is_retried_with_backoff_then_failed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dev = Proc::dev(&dir.path().join("data"));
    apply(
        &dev.addr,
        json!({
            "task_id": "always_fails", "agent_id": "fail_agent",
            "execution": {"max_retries": 2, "retry_backoff": {"base_seconds": 3, "cap_seconds": 60, "jitter_seconds": 0}}
        }),
    )
    .await;
    let out = cli(&dev.addr, &["task", "trigger", "always_fails"]);
    assert!(out.contains("always_fails.manual-"), "{out}");
    let run = wait_run(&dev.addr, "always_fails", Duration::from_secs(60), terminal).await;
    assert_eq!(status(&run), pb::RunStatus::Failed, "{run:#?}");
    assert_eq!(run.attempts.len(), 3, "1 attempt + 2 retries");
    for a in &run.attempts {
        assert_eq!(a.outcome, "failed");
        assert_eq!(a.exit_code, Some(3));
    }
    assert!(run.stderr_tail.contains("boom"), "stderr tail kept: {:?}", run.stderr_tail);
    for (k, want) in [(1usize, 3.0f64), (2, 6.0)] {
        let prev_end = at(&run.attempts[k - 1].finished_at).expect("finished");
        let next = at(&run.attempts[k].dispatched_at).expect("dispatched");
        let got = (next - prev_end).num_milliseconds() as f64 / 1000.0;
        assert!((got - want).abs() <= want * 0.10, "retry {k}: backoff {got:.3} s, want {want} s ±10%");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hanging_agent_times_out_and_its_process_group_is_gone() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dev = Proc::dev(&dir.path().join("data"));
    apply(&dev.addr, json!({"task_id": "hangs", "agent_id": "hang_agent", "execution": {"timeout_seconds": 6}})).await;
    cli(&dev.addr, &["task", "trigger", "hangs"]);
    let running =
        wait_run(&dev.addr, "hangs", Duration::from_secs(30), |r| r.progress.as_ref().is_some_and(|p| p.message.starts_with("pids ")))
            .await;
    let pids: Vec<i32> = running.progress.expect("progress").message.split_whitespace().skip(1).filter_map(|p| p.parse().ok()).collect();
    assert_eq!(pids.len(), 2, "agent reported its pid and its child's");
    assert!(!punchclock_tests::process_gone(pids[1]), "the agent's child runs before the timeout");
    let run = wait_run(&dev.addr, "hangs", Duration::from_secs(30), terminal).await;
    assert_eq!(status(&run), pb::RunStatus::Timeout, "{run:#?}");
    assert_eq!(run.attempts[0].outcome, "timeout");
    for pid in pids {
        assert!(wait_gone(pid, Duration::from_secs(5)).await, "process {pid} of the agent's group survived the timeout");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_slot_is_skipped_with_a_reason() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dev = Proc::dev(&dir.path().join("data"));
    // sleep_agent takes 3 s; the interval fires every second.
    apply(
        &dev.addr,
        json!({
            "task_id": "overlaps", "agent_id": "sleep_agent",
            "trigger": {"type": "interval", "every": "1s"},
            "execution": {"concurrency_limit": 1}
        }),
    )
    .await;
    let skipped = wait_run(&dev.addr, "overlaps", Duration::from_secs(30), |r| status(r) == pb::RunStatus::Skipped).await;
    assert_eq!(skipped.skip_reason, "concurrency_limit");
    assert!(skipped.error.contains("concurrency_limit 1"), "{}", skipped.error);
    let runs = list_runs(&dev.addr, "overlaps").await;
    let active = runs.iter().filter(|r| matches!(status(r), pb::RunStatus::Pending | pb::RunStatus::Running)).count();
    assert!(active <= 1, "never more than concurrency_limit active: {runs:#?}");
    tasks(&dev.addr).await.delete_task(pb::DeleteTaskRequest { task_id: "overlaps".into() }).await.expect("delete");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_waits_pending_with_a_visible_reason_while_no_runner_serves_its_agent() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dev = Proc::dev(&dir.path().join("data"));
    apply(&dev.addr, json!({"task_id": "orphan", "agent_id": "no_such_agent"})).await;
    cli(&dev.addr, &["task", "trigger", "orphan"]);
    let run = wait_run(&dev.addr, "orphan", Duration::from_secs(20), |r| !r.pending_reason.is_empty()).await;
    assert_eq!(status(&run), pb::RunStatus::Pending);
    assert!(run.pending_reason.contains("no_such_agent"), "{}", run.pending_reason);
}

/// Regression: with SIGPIPE at its default, an agent that exits without
/// reading a context larger than a pipe buffer killed the whole dev process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_that_ignores_a_large_stdin_does_not_kill_the_runner() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut dev = Proc::dev(&dir.path().join("data"));
    // Over a pipe buffer (64 KiB), within the context limit (128 KiB).
    let big = "x".repeat(120 * 1024);
    apply(&dev.addr, json!({"task_id": "big_ctx", "agent_id": "ok_agent", "context": {"blob": big}})).await;
    for key in ["one", "two"] {
        cli(&dev.addr, &["task", "trigger", "big_ctx", "--key", key]);
        let id = format!("big_ctx.manual-{key}");
        let run = wait_run(&dev.addr, "big_ctx", Duration::from_secs(30), |r| r.run_id == id && terminal(r)).await;
        assert_eq!(status(&run), pb::RunStatus::Succeeded, "{run:#?}");
    }
    assert!(dev.child.try_wait().expect("try_wait").is_none(), "punchclock dev is still running");
}

/// Regression: a cancelled run's runner slot was freed at once, while its
/// agent still had the kill grace to exit; the next run was assigned to the
/// full runner, refused ("no free slot") and FAILED without running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slot_of_a_cancelled_run_stays_taken_until_its_agent_exits() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dev = Proc::dev_with_slots(&dir.path().join("data"), 1);
    apply(&dev.addr, json!({"task_id": "stubborn", "agent_id": "stubborn_agent"})).await;
    apply(&dev.addr, json!({"task_id": "next", "agent_id": "ok_agent"})).await;
    cli(&dev.addr, &["task", "trigger", "stubborn", "--key", "a"]);
    // Running, and TERM ignored (an agent started slowly under load would
    // otherwise die of the TERM at once, before its trap).
    wait_run(&dev.addr, "stubborn", Duration::from_secs(30), |r| {
        status(r) == pb::RunStatus::Running && r.progress.as_ref().is_some_and(|p| p.message == "trap set")
    })
    .await;
    // Taken before the cancel is sent: the grace starts no earlier.
    let cancelled_at = chrono::Utc::now();
    cli(&dev.addr, &["runs", "cancel", "stubborn.manual-a"]);
    cli(&dev.addr, &["task", "trigger", "next", "--key", "b"]);
    let next = wait_run(&dev.addr, "next", Duration::from_secs(30), terminal).await;
    assert_eq!(status(&next), pb::RunStatus::Succeeded, "{next:#?}");
    assert_eq!(next.attempts.len(), 1, "no attempt was burnt on a refusal: {next:#?}");
    let started = at(&next.actual_started_at).expect("started");
    assert!(
        started >= cancelled_at + chrono::Duration::milliseconds(1000),
        "started only after the cancelled agent's 1 s kill grace: {started} vs {cancelled_at}"
    );
}
