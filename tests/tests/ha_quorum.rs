//! Acceptance 7 (issue 3): losing etcd quorum stops all scheduling — no
//! writes without quorum, and the API says why; regaining it resumes with the
//! misfire policy. Nothing accepted before the loss is lost.

use std::collections::HashSet;
use std::time::Duration;

use chrono::Utc;
use punchclock_proto::v1 as pb;
use punchclock_tests::etcd::{Etcd, free_port};
use punchclock_tests::{Proc, apply, at, list_runs, status, tasks, wait_leader, wait_run};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quorum_loss_stops_scheduling_and_regaining_it_resumes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = punchclock_tests::KeepLogsOnPanic::new(dir.path(), "ha_quorum");
    let mut etcd = Etcd::start(3).await;
    let ports = [free_port(), free_port()];
    let servers: Vec<Proc> = (0..2).map(|i| Proc::server(&etcd.store_url(), &format!("cp{i}"), ports[i], dir.path())).collect();
    let addrs: Vec<String> = servers.iter().map(|s| s.addr.clone()).collect();
    let _runner = Proc::runner(&addrs.join(","), "r1", dir.path());
    wait_leader(&addrs, Duration::from_secs(20), |_| true).await;
    apply(&addrs[0], json!({"task_id": "ticker", "agent_id": "ok_agent", "trigger": {"type": "interval", "every": "1s"}})).await;
    wait_run(&addrs[0], "ticker", Duration::from_secs(30), |r| status(r) == pb::RunStatus::Succeeded).await;
    let before: HashSet<String> = list_runs(&addrs[0], "ticker").await.into_iter().map(|r| r.run_id).collect();

    etcd.kill(1);
    etcd.kill(2);
    let lost_at = Utc::now();
    // Without quorum a task write fails, and says it is the store.
    let e = tasks(&addrs[0])
        .await
        .apply_task(pb::ApplyTaskRequest {
            spec_json: json!({"task_id": "during", "agent_id": "ok_agent"}).to_string(),
            dry_run: false,
            task: None,
        })
        .await
        .expect_err("no writes without quorum");
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e}");
    assert!(e.message().contains("etcd"), "the error names the store: {}", e.message());
    tokio::time::sleep(Duration::from_secs(8)).await;
    etcd.restart(1);
    etcd.restart(2);
    etcd.wait_ready().await;
    let regained_at = Utc::now();
    wait_leader(&addrs, Duration::from_secs(30), |_| true).await;

    // Scheduling resumes with the misfire policy (run_once): one SKIPPED record covers the outage.
    let skip = wait_run(&addrs[0], "ticker", Duration::from_secs(30), |r| r.skip_reason == "misfired").await;
    assert!(skip.missed_count >= 5, "{skip:#?}");
    wait_run(&addrs[0], "ticker", Duration::from_secs(30), |r| {
        status(r) == pb::RunStatus::Succeeded && at(&r.scheduled_at).is_some_and(|t| t > regained_at)
    })
    .await;
    let runs = list_runs(&addrs[0], "ticker").await;
    let written_without_quorum: Vec<&pb::Run> = runs
        .iter()
        .filter(|r| {
            at(&r.updated_at).is_some_and(|t| t > lost_at + chrono::Duration::seconds(1) && t < regained_at - chrono::Duration::seconds(1))
        })
        .collect();
    assert!(written_without_quorum.is_empty(), "no writes without quorum: {written_without_quorum:#?}");
    let after: HashSet<String> = runs.iter().map(|r| r.run_id.clone()).collect();
    assert!(before.is_subset(&after), "runs from before the loss are kept");
    let in_outage: Vec<&pb::Run> = runs
        .iter()
        .filter(|r| at(&r.scheduled_at).is_some_and(|t| t > lost_at && t < regained_at) && status(r) != pb::RunStatus::Skipped)
        .collect();
    assert!(in_outage.len() <= 1, "no burst of runs for the outage: {in_outage:#?}");
}
