//! Issue 9, acceptance 4: the circuit breaker. A task whose agent always
//! fails, `failure_threshold: 3`, `cooldown_seconds: 10`, firing every
//! second: three FAILED runs, then SKIPPED `circuit_open` slots for about
//! 10 s, one half-open trial that fails (the breaker opens again), and —
//! once the agent is fixed — a trial that closes it. On `dev`, and on etcd
//! with the leader killed (-9) while the breaker is open: the new leader
//! keeps it open until the same instant.

use std::path::Path;
use std::time::Duration;

use chrono::{DateTime, Utc};
use punchclock_proto::v1 as pb;
use punchclock_tests::etcd::{Etcd, free_port};
use punchclock_tests::receiver::Receiver;
use punchclock_tests::{KeepLogsOnPanic, Proc, apply, at, cli, list_runs, status, tasks, wait_leader, wait_run};
use serde_json::json;

const TASK: &str = "flaky_downstream";

fn spec(fixed_file: &Path) -> serde_json::Value {
    json!({"task_id": TASK, "agent_id": "until_fixed_agent",
           "trigger": {"type": "interval", "every": "1s"},
           "execution": {"circuit_breaker": {"failure_threshold": 3, "cooldown_seconds": 10}},
           "context": {"params": {"fixed_file": fixed_file.to_string_lossy()}},
           "notify": {"on_breaker_open": ["webhook://pager"]}})
}

const SECRET: &str = "breaker-secret";

/// A `--config` file whose `pager` sink is `receiver`.
fn config(dir: &Path, receiver: &Receiver) -> String {
    let path = dir.join("punchclock.yaml");
    let text = format!("notifications:\n  retry_cap_seconds: 1\nsinks:\n  pager:\n    url: {}\n    secret: {SECRET}\n", receiver.url());
    std::fs::write(&path, text).expect("config");
    path.to_string_lossy().to_string()
}

/// The breaker-open notifications received: one per opening, by id (the
/// id of the run whose failure opened it: `opened_by`).
async fn openings_notified(receiver: &Receiver, opened_by: &[String]) -> Vec<String> {
    let want: Vec<String> = opened_by.iter().map(|run| format!("{run}.on_breaker_open.0")).collect();
    let ok = receiver.wait_for(Duration::from_secs(20), |r| want.iter().all(|id| r.iter().any(|x| &x.id == id))).await;
    let received = receiver.received();
    assert!(ok, "breaker-open notifications: {received:?}");
    assert!(received.iter().all(|r| r.signature_ok && r.event == "on_breaker_open"), "{received:?}");
    for r in &received {
        assert_eq!(r.body["breaker"]["phase"], "open", "{}", r.body);
        assert_eq!(r.body["task_id"], TASK);
    }
    received.iter().map(|r| r.id.clone()).collect()
}

async fn breaker(addr: &str) -> pb::Breaker {
    tasks(addr).await.get_task(pb::GetTaskRequest { task_id: TASK.into() }).await.expect("get task").into_inner().breaker.expect("breaker")
}

fn skip(r: &pb::Run) -> pb::SkipReason {
    pb::SkipReason::try_from(r.skip).unwrap_or(pb::SkipReason::Unspecified)
}

fn slot(r: &pb::Run) -> DateTime<Utc> {
    at(&r.scheduled_at).expect("scheduled_at")
}

/// What the breaker did, as the runs and the task show it.
struct Openings {
    /// End of each opening's cooldown.
    until: Vec<DateTime<Utc>>,
    /// The run whose failure opened it, per opening.
    opened_by: Vec<String>,
}

/// Drives the scenario against `addr()` (which may change: `failover` is
/// called once the breaker first opened and returns the new address).
async fn scenario(first_addr: String, fixed_file: &Path, failover: impl AsyncFnOnce() -> String) -> Openings {
    let mut addr = first_addr;
    apply(&addr, spec(fixed_file)).await;
    let first_skip = wait_run(&addr, TASK, Duration::from_secs(30), |r| skip(r) == pb::SkipReason::CircuitOpen).await;
    let b1 = breaker(&addr).await;
    assert_eq!((b1.phase.as_str(), b1.openings, b1.consecutive_failures), ("open", 1, 3), "{b1:?}");
    let until1 = at(&b1.open_until).expect("open_until");
    assert!(slot(&first_skip) < until1);
    let shown = cli(&addr, &["task", "get", TASK]);
    assert!(shown.contains("open until"), "task get shows the breaker: {shown}");

    addr = failover().await;

    // The trial after the cooldown fails: a second opening.
    let trial1 = wait_run(&addr, TASK, Duration::from_secs(40), |r| status(r) == pb::RunStatus::Failed && slot(r) >= until1).await;
    let b2 = breaker(&addr).await;
    assert_eq!((b2.phase.as_str(), b2.openings), ("open", 2), "{b2:?}");
    let until2 = at(&b2.open_until).expect("open_until");
    assert!(until2 > slot(&trial1));

    // Fixed: the next trial closes it, and the task runs every second again.
    std::fs::write(fixed_file, b"ok").expect("fix the agent");
    let trial2 = wait_run(&addr, TASK, Duration::from_secs(40), |r| status(r) == pb::RunStatus::Succeeded).await;
    assert!(slot(&trial2) >= until2, "the first success is the trial after the second cooldown");
    let b3 = breaker(&addr).await;
    assert_eq!((b3.phase.as_str(), b3.openings, b3.consecutive_failures), ("closed", 2, 0), "{b3:?}");
    let after = wait_run(&addr, TASK, Duration::from_secs(20), |r| status(r) == pb::RunStatus::Succeeded && slot(r) > slot(&trial2)).await;
    assert!(slot(&after) > slot(&trial2));
    let list = cli(&addr, &["task", "list"]);
    assert!(list.lines().any(|l| l.starts_with(TASK) && l.contains("closed")), "task list shows the breaker: {list}");

    // The record: F F F, skips, trial F, skips, trial S, S...
    let mut runs = list_runs(&addr, TASK).await;
    runs.sort_by_key(slot);
    let executed: Vec<&pb::Run> = runs.iter().filter(|r| status(r) != pb::RunStatus::Skipped && slot(r) <= slot(&trial2)).collect();
    let kinds: Vec<pb::RunStatus> = executed.iter().map(|r| status(r)).collect();
    use pb::RunStatus::{Failed, Succeeded};
    assert_eq!(kinds, vec![Failed, Failed, Failed, Failed, Succeeded], "runs that executed: {executed:#?}");
    assert_eq!(executed[3].run_id, trial1.run_id);
    assert_eq!(executed[4].run_id, trial2.run_id);
    for r in &runs {
        let s = slot(r);
        let inside = (s > slot(executed[2]) && s < slot(&trial1)) || (s > slot(&trial1) && s < slot(&trial2));
        if inside {
            assert_eq!(status(r), pb::RunStatus::Skipped, "nothing runs while the breaker is open: {r:#?}");
            assert!(
                matches!(skip(r), pb::SkipReason::CircuitOpen | pb::SkipReason::Misfired),
                "skipped for the breaker (or missed while no leader ran): {r:#?}"
            );
        }
    }
    Openings { until: vec![until1, until2], opened_by: vec![executed[2].run_id.clone(), trial1.run_id.clone()] }
}

/// Slots skipped `circuit_open` from `from` to `until`: consecutive ones
/// are one record counting them (`missed_count`, from `missed_from`).
fn circuit_skips_between(runs: &[pb::Run], from: DateTime<Utc>, until: DateTime<Utc>) -> usize {
    runs.iter()
        .filter(|r| skip(r) == pb::SkipReason::CircuitOpen)
        .filter(|r| at(&r.missed_from).unwrap_or_else(|| slot(r)) > from && slot(r) < until)
        .map(|r| usize::try_from(r.missed_count.max(1)).unwrap_or(usize::MAX))
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn breaker_opens_skips_tries_and_closes_on_dev() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "breaker_dev");
    let receiver = Receiver::start(SECRET).await;
    let cfg = config(dir.path(), &receiver);
    let dev = Proc::dev_with(&dir.path().join("data"), 8, &dir.path().join("dev.log"), &["--config", &cfg]);
    let fixed = dir.path().join("fixed");
    let addr = dev.addr.clone();
    let o = scenario(addr.clone(), &fixed, async || addr.clone()).await;
    // About 10 s of 1-second slots are skipped in each cooldown.
    let runs = list_runs(&dev.addr, TASK).await;
    for until in &o.until {
        let n = circuit_skips_between(&runs, *until - chrono::Duration::seconds(10), *until);
        assert!((8..=10).contains(&n), "{n} slots skipped circuit_open in the cooldown ending {until}");
    }
    // Exactly one on_breaker_open per opening.
    let ids = openings_notified(&receiver, &o.opened_by).await;
    assert_eq!(ids.len(), 2, "{ids:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn breaker_state_survives_a_leader_kill() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "breaker_failover");
    let etcd = Etcd::start(1).await;
    let ports = [free_port(), free_port()];
    let receiver = Receiver::start(SECRET).await;
    let cfg = config(dir.path(), &receiver);
    let start = |i: usize| Proc::server_with(&etcd.store_url(), &format!("cp{i}"), ports[i], dir.path(), &[], &["--config", &cfg]);
    let mut servers = [start(0), start(1)];
    let addrs: Vec<String> = servers.iter().map(|s| s.addr.clone()).collect();
    let _runner = Proc::runner(&addrs.join(","), "r1", dir.path());
    let first = wait_leader(&addrs, Duration::from_secs(20), |_| true).await;
    let leader = servers.iter().position(|s| s.addr == first.leader_address).expect("leader is one of ours");
    let other = addrs[1 - leader].clone();
    let fixed = dir.path().join("fixed");
    let o = scenario(first.leader_address.clone(), &fixed, async || {
        servers[leader].kill9();
        wait_leader(std::slice::from_ref(&other), Duration::from_secs(20), |s| s.leader_id != first.leader_id).await;
        other.clone()
    })
    .await;
    assert_eq!(o.until.len(), 2);
    // One notification per opening, by id (the first opening's may repeat
    // only if its leader died between the receiver's answer and its write).
    let mut ids = openings_notified(&receiver, &o.opened_by).await;
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 2, "{ids:?}");
}
