//! Issue 19, finding 6, on a real `dev` and real runner processes:
//!
//! - `echoed_input_is_cut_and_old_dates_refused`: a 1 MB task id echoed in
//!   an error made the status exceed gRPC's header limit (the client got
//!   no answer it could read); the message is cut at 4 KiB. `not_before`
//!   in year 0001 was accepted; it is refused like one far in the future.
//! - `a_runner_restarted_at_once_waits_for_its_work_directory`: restarted
//!   without waiting for the old process (SIGTERM, then at once a new one
//!   on the same work directory), 2 of 146 runners exited "work directory
//!   ... is in use"; every one now waits and connects.

use std::time::Duration;

use punchclock_proto::v1 as pb;
use punchclock_tests::{Proc, apply, runs, tasks, wait_log};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echoed_input_is_cut_and_old_dates_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dev = Proc::dev(&dir.path().join("data"));
    let huge = "x".repeat(1024 * 1024);
    let e = tasks(&dev.addr).await.get_task(pb::GetTaskRequest { task_id: huge.clone() }).await.expect_err("no such task");
    assert!(matches!(e.code(), tonic::Code::NotFound | tonic::Code::InvalidArgument), "a readable answer, not a transport error: {e}");
    assert!(e.message().len() <= 4096 && e.message().contains("more bytes"), "{} bytes", e.message().len());
    let e = runs(&dev.addr).await.get_run(pb::GetRunRequest { run_id: huge.clone() }).await.expect_err("no such run");
    assert!(matches!(e.code(), tonic::Code::NotFound | tonic::Code::InvalidArgument), "{e}");
    assert!(e.message().len() <= 4096, "{} bytes", e.message().len());

    apply(&dev.addr, json!({"task_id": "m", "agent_id": "true_agent"})).await;
    let ancient = prost_types::Timestamp { seconds: -62_135_596_800, nanos: 0 };
    let e = tasks(&dev.addr)
        .await
        .trigger_task(pb::TriggerTaskRequest { task_id: "m".into(), not_before: Some(ancient), ..Default::default() })
        .await
        .expect_err("year 0001");
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e}");
    assert!(e.message().starts_with("not_before:"), "{}", e.message());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_restarted_at_once_waits_for_its_work_directory() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dev = Proc::dev(&dir.path().join("data"));
    // An agent that takes the kill grace to stop keeps the old runner busy
    // stopping it while the new one starts.
    apply(&dev.addr, json!({"task_id": "busy", "agent_id": "stubborn_agent", "execution": {"concurrency_limit": 20}})).await;
    // Each process logs to a file of its own; all share one work directory.
    let work = dir.path().join("work-rr").to_string_lossy().into_owned();
    let start = |i: usize| {
        let args = [
            "runner",
            "--control-plane",
            &dev.addr,
            "--agents",
            "tests/agents.yaml",
            "--runner-id",
            "rr",
            "--kill-grace-ms",
            "1000",
            "--work-dir",
            &work,
        ];
        Proc::start(&args, &dir.path().join(format!("rr-{i}.log")), false)
    };
    let mut runner = start(0);
    assert!(wait_log(&runner, "connected to the control plane", Duration::from_secs(20)).await, "{}", runner.log_text());
    for i in 0..6 {
        let key = format!("k{i}");
        punchclock_tests::cli(&dev.addr, &["task", "trigger", "busy", "--key", &key]);
        let run_id = format!("busy.manual-{key}");
        punchclock_tests::wait_run(&dev.addr, "busy", Duration::from_secs(30), |r| r.run_id == run_id && r.actual_started_at.is_some())
            .await;
        // SIGTERM, and at once the next process on the same work directory.
        runner.signal(libc::SIGTERM);
        let next = start(i + 1);
        assert!(
            wait_log(&next, "connected to the control plane", Duration::from_secs(40)).await,
            "restart {i}: the new runner did not connect: {}",
            next.log_text()
        );
        assert!(!next.log_text().contains("is in use by another runner process"), "restart {i}: {}", next.log_text());
        let _ = runner.child.wait();
        runner = next;
    }
}
