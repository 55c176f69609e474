//! Acceptance 5 (issue 3): a one-shot task that ran is never run again
//! across restarts of every replica; after a full-cluster outage of 100+
//! slots, the coalesced misfire creates one run and one SKIPPED record, not
//! a burst.

use std::time::Duration;

use chrono::Utc;
use punchclock_proto::v1 as pb;
use punchclock_tests::etcd::{Etcd, free_port};
use punchclock_tests::{Proc, apply, at, list_runs, status, wait_leader, wait_run};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_shot_runs_once_and_a_long_outage_coalesces() {
    let dir = tempfile::tempdir().expect("tempdir");
    let etcd = Etcd::start(1).await;
    let ports = [free_port(), free_port()];
    let start = |i: usize| Proc::server(&etcd.store_url(), &format!("cp{i}"), ports[i], dir.path());
    let mut servers = vec![start(0), start(1)];
    let addrs: Vec<String> = servers.iter().map(|s| s.addr.clone()).collect();
    let _runner = Proc::runner(&addrs.join(","), "r1", dir.path());
    let gen1 = wait_leader(&addrs, Duration::from_secs(20), |_| true).await;
    let at_time = (Utc::now() + chrono::Duration::seconds(2)).to_rfc3339();
    apply(&addrs[0], json!({"task_id": "one_shot", "agent_id": "ok_agent", "trigger": {"type": "once", "at": at_time}})).await;
    apply(
        &addrs[0],
        json!({"task_id": "ticker", "agent_id": "ok_agent", "trigger": {"type": "interval", "every": "1s"},
        "execution": {"misfire_policy": "run_once", "misfire_grace_seconds": 60}}),
    )
    .await;
    wait_run(&addrs[0], "one_shot", Duration::from_secs(30), |r| status(r) == pb::RunStatus::Succeeded).await;
    wait_run(&addrs[0], "ticker", Duration::from_secs(30), |r| status(r) == pb::RunStatus::Succeeded).await;

    // Restart every replica once: the one-shot stays done.
    for s in servers.iter_mut() {
        s.kill9();
    }
    servers = vec![start(0), start(1)];
    // A new term, not the dead leader's key waiting out its lease.
    let gen2 = wait_leader(&addrs, Duration::from_secs(20), |s| s.fencing_token > gen1.fencing_token).await;
    wait_run(&addrs[0], "ticker", Duration::from_secs(30), |r| {
        r.fencing_token == gen2.fencing_token && status(r) == pb::RunStatus::Succeeded
    })
    .await;

    // Full outage of 105 one-second slots.
    for s in servers.iter_mut() {
        s.kill9();
    }
    let down_at = Utc::now();
    tokio::time::sleep(Duration::from_secs(105)).await;
    let up_at = Utc::now();
    servers = vec![start(0), start(1)];
    wait_leader(&addrs, Duration::from_secs(20), |s| s.fencing_token > gen2.fencing_token).await;

    let skip = wait_run(&addrs[0], "ticker", Duration::from_secs(30), |r| r.skip_reason == "misfired" && r.missed_count >= 100).await;
    println!("coalesced: {} slots from {:?} to {:?}", skip.missed_count, at(&skip.missed_from), at(&skip.missed_until));
    // The record starts where the last leader stopped (at the latest one
    // slot after the kill) and covers the outage.
    let from = at(&skip.missed_from).expect("missed_from");
    assert!(from <= down_at + chrono::Duration::seconds(2), "the coalesced record starts after the outage did: {skip:#?}");
    assert!(at(&skip.missed_until).is_some_and(|u| u >= up_at - chrono::Duration::seconds(2)), "{skip:#?}");
    let gap: Vec<pb::Run> =
        list_runs(&addrs[0], "ticker").await.into_iter().filter(|r| at(&r.scheduled_at).is_some_and(|t| t >= from && t <= up_at)).collect();
    let runs: Vec<&pb::Run> = gap.iter().filter(|r| status(r) != pb::RunStatus::Skipped).collect();
    let skipped: Vec<&pb::Run> = gap.iter().filter(|r| status(r) == pb::RunStatus::Skipped).collect();
    assert_eq!(skipped.len(), 1, "one coalesced SKIPPED record: {gap:#?}");
    assert!(runs.len() <= 1, "at most the latest missed slot runs, no burst: {runs:#?}");
    let shots = list_runs(&addrs[0], "one_shot").await;
    assert_eq!(shots.len(), 1, "the one-shot ran once: {shots:#?}");
    assert_eq!(shots[0].attempts.len(), 1);
    drop(servers);
}
