//! Invariant 3 (issue 6) through a leader failover: the leader is killed
//! (SIGKILL) while a run's agent works and the next run of the task waits
//! behind it (`concurrency_limit: 1`). The runner re-declares the running
//! agent to the new leader, which keeps it — no second agent starts, and
//! the runner's fence does not fire across the failover. Cancelling the run
//! lets the next one start once the old agent is gone.

use std::time::Duration;

use punchclock_control_plane::timing::Timing;
use punchclock_proto::v1 as pb;
use punchclock_tests::etcd::{Etcd, free_port};
use punchclock_tests::{KeepLogsOnPanic, Proc, apply, cli, live_agents, max_live_agents_until, status, wait_leader, wait_run};
use serde_json::json;

const MARKER: &str = "pc-live-agent";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_keeps_one_agent_per_concurrency_slot() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "inv_failover_agents");
    let etcd = Etcd::start(1).await;
    let ports = [free_port(), free_port()];
    let mut servers =
        [Proc::server(&etcd.store_url(), "cp0", ports[0], dir.path()), Proc::server(&etcd.store_url(), "cp1", ports[1], dir.path())];
    let addrs: Vec<String> = servers.iter().map(|s| s.addr.clone()).collect();
    let _runner = Proc::runner(&addrs.join(","), "r1", dir.path());
    let first = wait_leader(&addrs, Duration::from_secs(20), |_| true).await;
    apply(
        &addrs[0],
        json!({"task_id": "live", "agent_id": "live_agent", "execution": {"max_retries": 0, "concurrency_limit": 1, "overlap_policy": "queue"}}),
    )
    .await;
    let leader = servers.iter().position(|s| s.addr == first.leader_address).expect("leader is one of ours");
    let other = addrs[1 - leader].clone();
    cli(&addrs[leader], &["task", "trigger", "live", "--key", "a"]);
    wait_run(&addrs[leader], "live", Duration::from_secs(30), |r| {
        r.run_id.ends_with("manual-a") && r.attempts.first().is_some_and(|a| a.started_at.is_some())
    })
    .await;
    cli(&addrs[leader], &["task", "trigger", "live", "--key", "b"]);

    // The leader dies; the other replica takes over and the runner moves to it.
    let failover = async {
        servers[leader].kill9();
        let next = wait_leader(std::slice::from_ref(&other), Duration::from_secs(30), |s| s.leader_id != first.leader_id).await;
        // Past the new leader's re-declaration wait and the runner's fence
        // (the servers' and runner's timing in `Proc`), with 2 s to spare.
        let timing = Timing {
            heartbeat_interval: Duration::from_millis(500),
            kill_grace: Duration::from_secs(1),
            lease_ttl: Duration::from_secs(3),
        };
        tokio::time::sleep(timing.redeclare_wait().max(timing.runner_fence()) + Duration::from_secs(2)).await;
        next
    };
    let (max, _) = max_live_agents_until(MARKER, failover).await;
    assert!(max <= 1, "two agents alive across the failover");
    assert_eq!(live_agents(MARKER).len(), 1, "the first agent survived the failover");
    let a = wait_run(&other, "live", Duration::from_secs(10), |r| r.run_id.ends_with("manual-a")).await;
    assert_eq!(status(&a), pb::RunStatus::Running, "re-declared, not lost: {a:#?}");
    assert!(a.attempts.len() == 1 && a.attempts[0].outcome.is_empty(), "{a:#?}");

    // Cancel it: the next run starts once its agent is gone.
    let (max, b) = max_live_agents_until(MARKER, async {
        cli(&other, &["runs", "cancel", &a.run_id]);
        wait_run(&other, "live", Duration::from_secs(30), |r| {
            r.run_id.ends_with("manual-b") && r.attempts.first().is_some_and(|a| a.started_at.is_some())
        })
        .await
    })
    .await;
    assert!(max <= 1, "the next run overlapped the cancelled one");
    assert_eq!(b.attempts.len(), 1);
}

/// Issue 34, finding 14: an agent that ends while its leader is dead is
/// reported to the next leader seconds later, and its record said it ran
/// until then (6.6 s shown for a 1.3 s run). It ends when its runner says
/// the agent exited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_that_ends_during_a_failover_ends_at_its_agents_exit() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "inv_failover_finished_at");
    let etcd = Etcd::start(1).await;
    let ports = [free_port(), free_port()];
    let mut servers =
        [Proc::server(&etcd.store_url(), "cp0", ports[0], dir.path()), Proc::server(&etcd.store_url(), "cp1", ports[1], dir.path())];
    let addrs: Vec<String> = servers.iter().map(|s| s.addr.clone()).collect();
    let _runner = Proc::runner(&addrs.join(","), "r1", dir.path());
    let first = wait_leader(&addrs, Duration::from_secs(20), |_| true).await;
    // `light_agent`: `sleep 2`, then its result.
    apply(&addrs[0], json!({"task_id": "timed", "agent_id": "light_agent", "execution": {"max_retries": 0}})).await;
    punchclock_tests::wait_runners(&first.leader_address, Duration::from_secs(30)).await;
    let leader = servers.iter().position(|s| s.addr == first.leader_address).expect("leader is one of ours");
    let other = addrs[1 - leader].clone();
    cli(&addrs[leader], &["task", "trigger", "timed", "--key", "a"]);
    wait_run(&addrs[leader], "timed", Duration::from_secs(30), |r| r.attempts.first().is_some_and(|a| a.started_at.is_some())).await;
    // The leader dies while the agent sleeps; it ends before a new leader is up.
    servers[leader].kill9();
    wait_leader(std::slice::from_ref(&other), Duration::from_secs(30), |s| !s.leader_id.is_empty() && s.leader_id != first.leader_id).await;
    let r = wait_run(&other, "timed", Duration::from_secs(60), |r| status(r) == pb::RunStatus::Succeeded).await;
    let started = punchclock_tests::at(&r.attempts[0].started_at).expect("started");
    let ended = punchclock_tests::at(&r.finished_at).expect("finished");
    let ran = (ended - started).num_milliseconds();
    assert!((1_900..3_000).contains(&ran), "a 2 s agent ran {ran} ms by its record: {r:#?}");
    assert_eq!(punchclock_tests::at(&r.attempts[0].finished_at), Some(ended));
}
