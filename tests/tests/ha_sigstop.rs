//! Acceptance 2 (issue 3): the leader is SIGSTOPped past its lease while a
//! runner is connected. Another replica takes over within lease TTL + 2 s.
//!
//! - `stopped_leader_is_replaced_and_fenced_when_it_resumes`: until its
//!   lease ends the other replica names it as the leader that does not
//!   answer (`cluster status`); resumed, the
//!   old leader checks its lease cutoff before anything else, writes nothing
//!   and steps down by itself; the runner follows the new leader.
//! - `resumed_leader_blind_to_its_lease_is_stopped_by_the_fence`: the same
//!   with the old leader's lease checks turned off (test hook
//!   `PUNCHCLOCK_TEST_IGNORE_LEASE_LOSS`), so it does attempt writes: etcd
//!   rejects each by its fencing token, none lands, and the first rejection
//!   makes it step down.
//!
//! A stale leader can only reach a runner through writes it must make first
//! (an assignment is recorded before it is sent), so the runner's own check —
//! it keeps the highest token seen and refuses lower ones — is shown with a
//! leader played by the test in `agent-runner/tests/session.rs`
//! (`runs_assignments_and_refuses_stale_or_impossible_ones`).

use std::time::{Duration, Instant};

use chrono::Utc;
use punchclock_proto::v1 as pb;
use punchclock_tests::etcd::{Etcd, free_port};
use punchclock_tests::{Proc, apply, at, cluster_status, list_runs, status, wait_leader, wait_log, wait_run};
use serde_json::json;

const LEASE_TTL: Duration = Duration::from_secs(3);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopped_leader_is_replaced_and_fenced_when_it_resumes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let etcd = Etcd::start(1).await;
    let ports = [free_port(), free_port()];
    let servers =
        [Proc::server(&etcd.store_url(), "cp0", ports[0], dir.path()), Proc::server(&etcd.store_url(), "cp1", ports[1], dir.path())];
    let addrs: Vec<String> = servers.iter().map(|s| s.addr.clone()).collect();
    let runner = Proc::runner(&addrs.join(","), "r1", dir.path());
    let first = wait_leader(&addrs, Duration::from_secs(20), |_| true).await;
    apply(&addrs[0], json!({"task_id": "tick", "agent_id": "ok_agent", "trigger": {"type": "interval", "every": "1s"}})).await;
    wait_run(&addrs[0], "tick", Duration::from_secs(30), |r| status(r) == pb::RunStatus::Succeeded).await;

    let old = servers.iter().position(|s| s.addr == first.leader_address).expect("leader is ours");
    let other = addrs[1 - old].clone();
    let live = cluster_status(&other).await.expect("status");
    assert_eq!((live.leader_id.as_str(), live.leader_unresponsive), (first.leader_id.as_str(), false), "a live leader answers");
    let t0 = Instant::now();
    servers[old].signal(libc::SIGSTOP);
    // Until its lease ends the other replica names it, and says that it
    // does not answer (found attacking issue 34: a leader without an HTTP
    // port was taken as answering, its stopped process's kernel accepting
    // connections).
    let stopped = cluster_status(&other).await.expect("status");
    assert_eq!(
        (stopped.leader_id.as_str(), stopped.leader_unresponsive),
        (first.leader_id.as_str(), true),
        "{:?} after the SIGSTOP: {stopped:?}",
        t0.elapsed()
    );
    let next = wait_leader(std::slice::from_ref(&other), Duration::from_secs(20), |s| s.leader_id != first.leader_id).await;
    let takeover = t0.elapsed();
    let took_over_at = Utc::now();
    println!("takeover after SIGSTOP: {} ms (lease TTL {} ms)", takeover.as_millis(), LEASE_TTL.as_millis());
    assert!(takeover <= LEASE_TTL + Duration::from_secs(2), "takeover took {takeover:?}");
    assert!(next.fencing_token > first.fencing_token);

    // The runner follows the new leader.
    wait_run(&other, "tick", Duration::from_secs(30), |r| status(r) == pb::RunStatus::Succeeded && r.fencing_token == next.fencing_token)
        .await;

    // Resume the old leader: its timers are all overdue; whatever it tries is fenced.
    servers[old].signal(libc::SIGCONT);
    assert!(
        wait_log(&servers[old], "stepped down", Duration::from_secs(10)).await,
        "old leader did not step down: {}",
        servers[old].log_text()
    );
    // Let the schedule run a few more slots under the new leader.
    let later = Utc::now() + chrono::Duration::seconds(3);
    wait_run(&other, "tick", Duration::from_secs(30), |r| {
        at(&r.scheduled_at).is_some_and(|t| t > later) && status(r) == pb::RunStatus::Succeeded
    })
    .await;
    let still = wait_leader(std::slice::from_ref(&other), Duration::from_secs(5), |_| true).await;
    assert_eq!(still.leader_id, next.leader_id, "the resumed replica did not take leadership back");

    let runs = list_runs(&other, "tick").await;
    let stale: Vec<&pb::Run> =
        runs.iter().filter(|r| r.fencing_token == first.fencing_token && at(&r.updated_at).is_some_and(|t| t > took_over_at)).collect();
    assert!(stale.is_empty(), "the old leader wrote after the takeover: {stale:#?}");
    let mut ids: Vec<&str> = runs.iter().map(|r| r.run_id.as_str()).collect();
    ids.dedup();
    assert_eq!(ids.len(), runs.len(), "one record per slot");
    let log = servers[old].log_text();
    println!("old leader: writes attempted after resuming = {}", log.matches("rejected by fencing token").count());
    drop(runner);
}

/// The same pause, with the old leader's lease checks turned off by a test
/// hook (a leader that cannot tell its lease is gone: the case fencing tokens
/// exist for). Resumed, it does attempt writes; etcd rejects every one by its
/// fencing token, nothing it tried lands, and the first rejection makes it
/// step down by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resumed_leader_blind_to_its_lease_is_stopped_by_the_fence() {
    let dir = tempfile::tempdir().expect("tempdir");
    let etcd = Etcd::start(1).await;
    let ports = [free_port(), free_port()];
    let hook = [(punchclock_control_plane::election::etcd::IGNORE_LEASE_LOSS_ENV, "1")];
    let blind = Proc::server_with_env(&etcd.store_url(), "cp0", ports[0], dir.path(), &hook);
    let first = wait_leader(std::slice::from_ref(&blind.addr), Duration::from_secs(20), |s| s.leader_id == "cp0").await;
    let other = Proc::server(&etcd.store_url(), "cp1", ports[1], dir.path());
    let _runner = Proc::runner(&format!("{},{}", blind.addr, other.addr), "r1", dir.path());
    apply(&other.addr, json!({"task_id": "tick", "agent_id": "ok_agent", "trigger": {"type": "interval", "every": "1s"}})).await;
    wait_run(&other.addr, "tick", Duration::from_secs(30), |r| status(r) == pb::RunStatus::Succeeded).await;

    blind.signal(libc::SIGSTOP);
    let next = wait_leader(std::slice::from_ref(&other.addr), Duration::from_secs(20), |s| s.leader_id == "cp1").await;
    let took_over_at = Utc::now();
    assert!(next.fencing_token > first.fencing_token);
    wait_run(&other.addr, "tick", Duration::from_secs(30), |r| {
        status(r) == pb::RunStatus::Succeeded && r.fencing_token == next.fencing_token
    })
    .await;

    // Resumed, it still believes it leads: its overdue timers fire and write.
    blind.signal(libc::SIGCONT);
    assert!(
        wait_log(&blind, "rejected by fencing token", Duration::from_secs(20)).await,
        "the blind leader attempted no write, or one was not fenced: {}",
        blind.log_text()
    );
    assert!(
        wait_log(&blind, "newer leader exists", Duration::from_secs(10)).await,
        "the blind leader did not step down on the fenced write: {}",
        blind.log_text()
    );
    let later = Utc::now() + chrono::Duration::seconds(2);
    wait_run(&other.addr, "tick", Duration::from_secs(30), |r| {
        at(&r.scheduled_at).is_some_and(|t| t > later) && status(r) == pb::RunStatus::Succeeded
    })
    .await;
    let still = wait_leader(std::slice::from_ref(&other.addr), Duration::from_secs(5), |_| true).await;
    assert_eq!(still.leader_id, "cp1", "the blind replica took leadership back");

    let runs = list_runs(&other.addr, "tick").await;
    let stale: Vec<&pb::Run> =
        runs.iter().filter(|r| r.fencing_token == first.fencing_token && at(&r.updated_at).is_some_and(|t| t > took_over_at)).collect();
    assert!(stale.is_empty(), "a write of the blind leader landed after the takeover: {stale:#?}");
    let ids: std::collections::HashSet<&str> = runs.iter().map(|r| r.run_id.as_str()).collect();
    assert_eq!(ids.len(), runs.len(), "one record per slot");
    println!("blind leader: fenced writes rejected = {}", blind.log_text().matches("rejected by fencing token").count());
}
