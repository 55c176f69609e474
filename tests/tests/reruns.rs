//! Issue 37, re-runs, over a real `dev` with its runner:
//! - a FAILED run a webhook started, re-run with `runs rerun RUN`, gets the
//!   same `context.event` (and params) under a new id `RUN.rerun-1` with
//!   `rerun_of`; the first run's record lists it (`reruns`); a second
//!   `runs rerun` of it makes `RUN.rerun-2`;
//! - after a fix, `runs rerun --task T --status FAILED --since 1h` re-runs
//!   each of 50 failed runs once (a dry run first lists the 50 and creates
//!   nothing); the same command again creates nothing.

use std::time::Duration;

use punchclock_proto::v1 as pb;
use punchclock_tests::{KeepLogsOnPanic, Proc, apply, cli, http_post, list_runs, runs, status, terminal, wait_run};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_event_run_is_re_run_with_its_event() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "reruns_event");
    let dev = Proc::dev(&dir.path().join("data"));
    apply(
        &dev.addr,
        serde_json::json!({"task_id": "hook", "agent_id": "fail_agent",
        "trigger": {"type": "webhook", "path": "/hooks/hook", "auth": "none"},
        "context": {"params": {"region": "eu"}},
        "execution": {"overlap_policy": "queue", "max_retries": 0}}),
    )
    .await;
    let (code, _) = http_post(&dev.http_addr(), "/hooks/hook", &[("Idempotency-Key", "delivery-1")], Some(br#"{"order": 42}"#));
    assert_eq!(code, 202);
    let first = wait_run(&dev.addr, "hook", Duration::from_secs(30), terminal).await;
    assert_eq!(status(&first), pb::RunStatus::Failed, "{first:?}");
    assert!(first.event_json.contains("\"order\":42"), "{}", first.event_json);

    let out = cli(&dev.addr, &["runs", "rerun", &first.run_id]);
    let rerun_id = format!("{}.rerun-1", first.run_id);
    assert!(out.contains(&format!("re-run as {rerun_id}")), "{out}");
    let again = wait_run(&dev.addr, "hook", Duration::from_secs(30), |r| r.run_id == rerun_id && terminal(r)).await;
    assert_eq!(again.rerun_of, first.run_id);
    assert_eq!(again.event_json, first.event_json, "the same context.event");
    assert_eq!(again.context_json, first.context_json, "the same params");
    assert_ne!(again.run_id, first.run_id);
    // Both ways: the first run's record names its re-run.
    let got = runs(&dev.addr).await.get_run(pb::GetRunRequest { run_id: first.run_id.clone() }).await.expect("get").into_inner();
    assert_eq!(got.reruns, vec![rerun_id.clone()]);
    // Asked again for the same run: a second re-run.
    let out = cli(&dev.addr, &["runs", "rerun", &first.run_id]);
    assert!(out.contains(&format!("{}.rerun-2", first.run_id)), "{out}");
    // In bulk, a run with a re-run and the re-runs themselves are left:
    // the failing re-runs make no re-runs of their own (a helper found the
    // same call making `.rerun-1.rerun-1` each time).
    wait_run(&dev.addr, "hook", Duration::from_secs(30), |r| r.run_id == format!("{}.rerun-2", first.run_id) && terminal(r)).await;
    let bulk = cli(&dev.addr, &["runs", "rerun", "--task", "hook", "--status", "FAILED", "--since", "1h"]);
    assert!(bulk.contains("0 re-run(s) created, 3 listed"), "{bulk}");
    let got = runs(&dev.addr).await.get_run(pb::GetRunRequest { run_id: first.run_id.clone() }).await.expect("get").into_inner();
    assert_eq!(got.reruns, vec![rerun_id.clone(), format!("{}.rerun-2", first.run_id)], "its own re-runs only");
    // Three at once: three re-runs, not one (each takes the next number).
    let kids: Vec<std::process::Child> =
        (0..3).map(|_| punchclock_tests::cli_command(&dev.addr).args(["runs", "rerun", &first.run_id]).spawn().expect("cli")).collect();
    for mut k in kids {
        assert!(k.wait().expect("wait").success());
    }
    let got = runs(&dev.addr).await.get_run(pb::GetRunRequest { run_id: first.run_id.clone() }).await.expect("get").into_inner();
    assert_eq!(got.reruns.len(), 5, "{:?}", got.reruns);
    // A run not ended yet is refused, naming why.
    let out = punchclock_tests::cli_command(&dev.addr).args(["runs", "rerun", "hook.nothing"]).output().expect("cli");
    assert!(!out.status.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bulk_re_run_makes_each_once() {
    const N: usize = 50;
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "reruns_bulk");
    let dev = Proc::dev_with(&dir.path().join("data"), 8, &dir.path().join("dev.log"), &[]);
    let task = |agent: &str| {
        serde_json::json!({"task_id": "bulk", "agent_id": agent,
            "execution": {"overlap_policy": "queue", "concurrency_limit": 8, "max_retries": 0}})
    };
    apply(&dev.addr, task("fail_agent")).await;
    let mut tc = punchclock_tests::tasks(&dev.addr).await;
    for i in 0..N {
        tc.trigger_task(pb::TriggerTaskRequest { task_id: "bulk".into(), idempotency_key: format!("k{i}"), ..Default::default() })
            .await
            .expect("trigger");
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        let rs = list_runs(&dev.addr, "bulk").await;
        if rs.len() == N && rs.iter().all(|r| status(r) == pb::RunStatus::Failed) {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "50 failed runs: {:?}", rs.iter().map(status).collect::<Vec<_>>());
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    // The fix.
    apply(&dev.addr, task("ok_agent")).await;
    let bulk = ["runs", "rerun", "--task", "bulk", "--status", "FAILED", "--since", "1h"];
    let dry = cli(&dev.addr, &[&bulk[..], &["--dry-run", "-o", "json"]].concat());
    let dry: Vec<serde_json::Value> = serde_json::from_str(&dry).expect("json");
    assert_eq!(dry.len(), N, "the dry run lists each");
    assert!(dry.iter().all(|x| x["created"] == false && x["run_id"].as_str().is_some_and(|id| id.ends_with(".rerun-1"))));
    assert_eq!(list_runs(&dev.addr, "bulk").await.len(), N, "a dry run creates nothing");

    let out = cli(&dev.addr, &bulk);
    assert!(out.contains(&format!("{N} re-run(s) created")), "{out}");
    let again = cli(&dev.addr, &bulk);
    assert!(again.contains("0 re-run(s) created"), "the same command again creates nothing: {again}");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        let rs = list_runs(&dev.addr, "bulk").await;
        let reruns: Vec<&pb::Run> = rs.iter().filter(|r| !r.rerun_of.is_empty()).collect();
        assert!(reruns.len() <= N, "at most one re-run each: {}", reruns.len());
        if reruns.len() == N && reruns.iter().all(|r| status(r) == pb::RunStatus::Succeeded) {
            let mut of: Vec<&str> = reruns.iter().map(|r| r.rerun_of.as_str()).collect();
            of.sort_unstable();
            of.dedup();
            assert_eq!(of.len(), N, "one re-run per failed run");
            assert!(reruns.iter().all(|r| r.run_id == format!("{}.rerun-1", r.rerun_of)));
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the re-runs succeed after the fix");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    // After they succeeded, the same command still creates nothing.
    let third = cli(&dev.addr, &bulk);
    assert!(third.contains("0 re-run(s) created"), "{third}");
}
