//! Invariants 2 and 3 (issue 6), through a SIGSTOPped runner: with
//! `max_retries: 0` and `concurrency_limit: 1`, a runner stopped past its
//! timeout loses its run — FAILED, for good — and the next run starts only
//! once the stopped runner's agent is gone (its shim's self-fence killed
//! it), so two agents of the task are never alive at once. After SIGCONT
//! the runner's late report is kept on the lost attempt as evidence; the
//! run stays FAILED. Before, the next run started while the first agent
//! ran on, and after SIGCONT the first run flipped to SUCCEEDED.
//!
//! Real processes: a control plane on the embedded store, two runners,
//! agents whose command line carries a marker the test counts in /proc.

use std::time::Duration;

use punchclock_proto::v1 as pb;
use punchclock_tests::etcd::free_port;
use punchclock_tests::{KeepLogsOnPanic, Proc, apply, cli, live_agents, max_live_agents_until, status, wait_run};
use serde_json::json;

const MARKER: &str = "pc-live-agent";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_runner_never_overlaps_the_next_run_and_its_lost_run_stays_failed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "inv_stopped_runner");
    let store = format!("embedded:{}", dir.path().join("store").display());
    let server = Proc::server(&store, "cp", free_port(), dir.path());
    let runners = [Proc::runner(&server.addr, "r1", dir.path()), Proc::runner(&server.addr, "r2", dir.path())];
    apply(
        &server.addr,
        json!({"task_id": "live", "agent_id": "live_agent",
               "execution": {"max_retries": 0, "concurrency_limit": 1, "overlap_policy": "queue"}}),
    )
    .await;
    wait_runners(&server.addr, 2).await;

    cli(&server.addr, &["task", "trigger", "live", "--key", "first"]);
    let first = wait_run(&server.addr, "live", Duration::from_secs(30), |r| {
        r.run_id.ends_with("manual-first") && r.attempts.first().is_some_and(|a| a.started_at.is_some())
    })
    .await;
    let owner = first.attempts[0].runner_id.clone();
    let stopped = runners.iter().find(|p| p.log.ends_with(format!("{owner}.log"))).expect("owner process");
    wait_for(|| live_agents(MARKER).len() == 1).await;

    // Stop the owner (not its agent: the shim and agent are their own group).
    stopped.signal(libc::SIGSTOP);
    cli(&server.addr, &["task", "trigger", "live", "--key", "second"]);
    let (max, second) = max_live_agents_until(
        MARKER,
        wait_run(&server.addr, "live", Duration::from_secs(60), |r| {
            r.run_id.ends_with("manual-second") && r.attempts.first().is_some_and(|a| a.started_at.is_some())
        }),
    )
    .await;
    assert!(max <= 1, "two agents alive at once while the first runner was stopped");
    assert_ne!(second.attempts[0].runner_id, owner);

    let lost =
        wait_run(&server.addr, "live", Duration::from_secs(10), |r| r.run_id == first.run_id && status(r) == pb::RunStatus::Failed).await;
    assert_eq!(lost.attempts[0].outcome, "lost", "{lost:#?}");

    // Resume the owner: it reconnects and reports what happened to its agent.
    stopped.signal(libc::SIGCONT);
    let (max, evidence) = max_live_agents_until(
        MARKER,
        wait_run(&server.addr, "live", Duration::from_secs(30), |r| r.run_id == first.run_id && r.attempts[0].report.is_some()),
    )
    .await;
    assert!(max <= 1, "the resumed runner's agent came back");
    assert_eq!(status(&evidence), pb::RunStatus::Failed, "terminal is final: {evidence:#?}");
    let report = evidence.attempts[0].report.clone().expect("report");
    assert_eq!(pb::Outcome::try_from(report.outcome), Ok(pb::Outcome::Interrupted), "the fence stopped it: {report:#?}");
    assert!(report.error.contains("fence"), "{report:#?}");
    assert_eq!(live_agents(MARKER).len(), 1, "the second run's agent runs on");
}

async fn wait_runners(addr: &str, n: usize) {
    let mut client = pb::cluster_service_client::ClusterServiceClient::new(punchclock_tests::channel(addr).await);
    for _ in 0..200 {
        if let Ok(r) = client.list_runners(pb::ListRunnersRequest {}).await
            && r.into_inner().runners.len() >= n
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{n} runners did not connect");
}

async fn wait_for(cond: impl Fn() -> bool) {
    for _ in 0..200 {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("condition not met in 10 s");
}
