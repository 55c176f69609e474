//! Acceptance 6 (issue 3): SIGTERM to the leader hands leadership over in
//! under 1 s (it resigns instead of letting its lease run out), and no run
//! fails: the runner moves to the new leader and re-declares what it runs.

use std::time::{Duration, Instant};

use punchclock_proto::v1 as pb;
use punchclock_tests::etcd::{Etcd, free_port};
use punchclock_tests::{Proc, apply, list_runs, status, wait_leader, wait_run};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_of_the_leader_hands_over_in_under_a_second_with_no_failed_run() {
    let dir = tempfile::tempdir().expect("tempdir");
    let etcd = Etcd::start(1).await;
    let ports = [free_port(), free_port()];
    let mut servers =
        [Proc::server(&etcd.store_url(), "cp0", ports[0], dir.path()), Proc::server(&etcd.store_url(), "cp1", ports[1], dir.path())];
    let addrs: Vec<String> = servers.iter().map(|s| s.addr.clone()).collect();
    let _runner = Proc::runner(&addrs.join(","), "r1", dir.path());
    let first = wait_leader(&addrs, Duration::from_secs(20), |_| true).await;

    // Runs that take 3 s, one per second: some are always in flight.
    apply(
        &addrs[0],
        json!({"task_id": "steady", "agent_id": "sleep_agent", "trigger": {"type": "interval", "every": "1s"},
        "execution": {"concurrency_limit": 10, "max_retries": 0}}),
    )
    .await;
    wait_run(&addrs[0], "steady", Duration::from_secs(30), |r| status(r) == pb::RunStatus::Succeeded).await;
    wait_run(&addrs[0], "steady", Duration::from_secs(30), |r| status(r) == pb::RunStatus::Running).await;

    let leader = servers.iter().position(|s| s.addr == first.leader_address).expect("leader is one of ours");
    let other = addrs[1 - leader].clone();
    let t0 = Instant::now();
    servers[leader].signal(libc::SIGTERM);
    let next = wait_leader(std::slice::from_ref(&other), Duration::from_secs(10), |s| s.leader_id != first.leader_id).await;
    let handover = t0.elapsed();
    println!("handover took {} ms (token {} -> {})", handover.as_millis(), first.fencing_token, next.fencing_token);
    assert!(handover < Duration::from_secs(1), "handover took {handover:?}");
    assert!(next.fencing_token > first.fencing_token, "new token is larger");
    let _ = servers[leader].child.wait();

    // The new leader runs the schedule, and every run in flight at the handover finishes.
    wait_run(&other, "steady", Duration::from_secs(30), |r| status(r) == pb::RunStatus::Succeeded && r.fencing_token == next.fencing_token)
        .await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let handed: Vec<String> = list_runs(&other, "steady")
        .await
        .into_iter()
        .filter(|r| r.fencing_token == first.fencing_token && status(r) == pb::RunStatus::Running)
        .map(|r| r.run_id)
        .collect();
    for id in handed {
        loop {
            let r = list_runs(&other, "steady").await.into_iter().find(|r| r.run_id == id).expect("run");
            if status(&r) != pb::RunStatus::Running && status(&r) != pb::RunStatus::Pending {
                break;
            }
            assert!(tokio::time::Instant::now() < deadline, "run {id} never finished after the handover");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    let runs = list_runs(&other, "steady").await;
    let failed: Vec<&pb::Run> =
        runs.iter().filter(|r| matches!(status(r), pb::RunStatus::Failed | pb::RunStatus::Timeout | pb::RunStatus::Retrying)).collect();
    assert!(failed.is_empty(), "no run fails across a graceful handover: {failed:#?}");
    let lost: Vec<&pb::Run> = runs.iter().filter(|r| r.attempts.iter().any(|a| a.outcome == "lost")).collect();
    assert!(lost.is_empty(), "in-flight runs were re-declared, not lost: {lost:#?}");
}
