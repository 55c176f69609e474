//! Invariant 1 (issue 6), ownership: `Started`, `Progress` and `Finished`
//! for an execution assigned to another runner — or its re-declaration in
//! a Hello — change nothing, and are logged once with both runner ids.
//! Before, a runner's forged `Finished` made the run SUCCEEDED with the
//! forged result while the real agent kept running.
//!
//! A real `punchclock dev`; two test-driven runners over the real
//! `RunnerService` stream serve an agent its own runner does not know.

use std::time::Duration;

use punchclock_proto::v1 as pb;
use punchclock_tests::{KeepLogsOnPanic, Proc, RawRunner, apply, cli, status, wait_run};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reports_about_another_runners_execution_change_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "inv_ownership");
    let dev = Proc::dev(&dir.path().join("data"));
    apply(&dev.addr, json!({"task_id": "own", "agent_id": "remote_agent", "execution": {"max_retries": 0}})).await;
    let mut r1 = RawRunner::connect(&dev.addr, "r1", &["remote_agent"], "i1", vec![]).await;
    cli(&dev.addr, &["task", "trigger", "own", "--key", "k1"]);
    let a = r1.next_assign(Duration::from_secs(20)).await;
    r1.started(&a).await;
    wait_run(&dev.addr, "own", Duration::from_secs(20), |r| r.attempts.first().is_some_and(|x| x.started_at.is_some())).await;

    // r2 forges every kind of report about r1's execution, several times.
    let r2 = RawRunner::connect(&dev.addr, "r2", &["remote_agent"], "i2", vec![]).await;
    for _ in 0..3 {
        let p = pb::ProgressReport {
            run_id: a.run_id.clone(),
            execution_id: a.execution_id.clone(),
            percent: Some(100.0),
            message: "forged".into(),
            checkpoint_json: String::new(),
        };
        r2.send(pb::runner_message::Msg::Progress(p)).await;
        r2.started(&a).await;
        r2.finished(&a.run_id, &a.execution_id, pb::Outcome::Succeeded, r#"{"forged": true}"#).await;
    }
    // ... and re-declares it as its own on a new stream.
    drop(r2);
    let in_flight = vec![pb::InFlight { run_id: a.run_id.clone(), execution_id: a.execution_id.clone(), attempt: 1, started_at: None }];
    let r2 = RawRunner::connect(&dev.addr, "r2", &["remote_agent"], "i2", in_flight).await;
    assert_eq!(r2.welcome.unknown.len(), 1, "the leader tells r2 the execution is not its: {:?}", r2.welcome);

    // Everything r2 said changed nothing: r1 still holds a running run.
    let run =
        punchclock_tests::runs(&dev.addr).await.get_run(pb::GetRunRequest { run_id: a.run_id.clone() }).await.expect("get").into_inner();
    assert_eq!(status(&run), pb::RunStatus::Running, "{run:#?}");
    assert!(run.result_json.is_empty() && run.progress.is_none(), "{run:#?}");
    let runners = pb::cluster_service_client::ClusterServiceClient::new(punchclock_tests::channel(&dev.addr).await)
        .list_runners(pb::ListRunnersRequest {})
        .await
        .expect("runners")
        .into_inner()
        .runners;
    let busy = |id: &str| runners.iter().find(|r| r.runner_id == id).map(|r| r.busy_slots);
    assert_eq!((busy("r1"), busy("r2")), (Some(1), Some(0)), "{runners:#?}");
    let forged_lines = dev.log_text().lines().filter(|l| l.contains("assigned to another runner") && l.contains(&a.execution_id)).count();
    assert_eq!(forged_lines, 1, "logged once: {}", dev.log_text());
    let line = dev.log_text().lines().find(|l| l.contains("assigned to another runner")).unwrap_or_default().to_string();
    assert!(line.contains("r1") && line.contains("r2"), "both runner ids: {line}");

    // The owner's report counts.
    r1.finished(&a.run_id, &a.execution_id, pb::Outcome::Succeeded, r#"{"real": true}"#).await;
    let done = wait_run(&dev.addr, "own", Duration::from_secs(20), |r| status(r) == pb::RunStatus::Succeeded).await;
    assert_eq!(done.result_json, r#"{"real":true}"#);
    drop((r1, r2));
}
