//! Issue 20, cluster-wide resources and the agent outcome contract, with
//! real control planes, runners and agent processes:
//!
//! - **never more than a resource's concurrency live agents**: 6 tasks
//!   every second share `search: {concurrency: 2}` on etcd with 3 control
//!   planes whose leader is killed (SIGKILL) 5 times; live agent processes
//!   are sampled every 50 ms (at most 2, and 2 reached), and every run ends
//!   SUCCEEDED (none lost, failed or timed out);
//! - **a 429 storm spends no attempts**: an agent answering `rate_limited,
//!   retry_after_seconds: 2` for 20 s with `max_retries: 0` SUCCEEDS after
//!   it; meanwhile another task on the same resource is held back and
//!   starts within 1 s after the hold's `retry_at`; the breaker stays
//!   closed; the hold is shown by `runs get`, `resources list` and
//!   `/metrics`;
//! - **hold-backs survive failovers** (issue 34, findings 2 and 5): a
//!   `quota_exhausted` hold (10 min `quota_backoff`) lives through 3 leader
//!   kills on etcd — a waiting run of another task stays held back under
//!   each new leader until `resources release` ends the hold; an agent
//!   naming a resource its task does not use holds nothing;
//! - **`skip` when busy at dispatch** (issue 34, finding 4): a `skip` task
//!   due in the same instants as runs of a `wait` task on a resource of 1
//!   never waits: each slot runs at once or is SKIPPED `resource_busy`.

use std::time::Duration;

use punchclock_proto::v1 as pb;
use punchclock_tests::etcd::{Etcd, free_port};
use punchclock_tests::{
    KeepLogsOnPanic, Proc, apply, at, cli, http_get, list_runs, max_live_agents_until, runs, status, tasks, terminal, wait_engine,
    wait_leader, wait_run,
};
use serde_json::json;

const MARKER: &str = "pc-shared-agent";

fn write_config(dir: &std::path::Path, text: &str) -> String {
    let path = dir.join("config.yaml");
    std::fs::write(&path, text).expect("config");
    path.to_string_lossy().into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resource_of_two_holds_across_tasks_and_leader_kills() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "shared_resources");
    let cfg = write_config(dir.path(), "resources:\n  search: {concurrency: 2}\n");
    let etcd = Etcd::start(1).await;
    let ports = [free_port(), free_port(), free_port()];
    let start = |i: usize| Proc::server_with(&etcd.store_url(), &format!("cp{i}"), ports[i], dir.path(), &[], &["--config", &cfg]);
    let mut servers: Vec<Proc> = (0..3).map(start).collect();
    let addrs: Vec<String> = servers.iter().map(|s| s.addr.clone()).collect();
    let _r1 = Proc::runner(&addrs.join(","), "r1", dir.path());
    let _r2 = Proc::runner(&addrs.join(","), "r2", dir.path());
    let first = wait_leader(&addrs, Duration::from_secs(30), |_| true).await;
    let ids: Vec<String> = (0..6).map(|i| format!("search{i}")).collect();
    for id in &ids {
        apply(
            &first.leader_address,
            json!({"task_id": id, "agent_id": "shared_agent", "trigger": {"type": "interval", "every": "1s"},
                   "execution": {"resources": ["search"], "concurrency_limit": 1, "max_retries": 0, "start_timeout_seconds": 300}}),
        )
        .await;
    }

    let kills = async {
        let mut leader = first;
        for _ in 0..5 {
            // Load on the resource under this leader, then its death.
            tokio::time::sleep(Duration::from_secs(4)).await;
            let i = servers.iter().position(|s| s.addr == leader.leader_address).expect("leader is ours");
            servers[i].kill9();
            let others: Vec<String> = addrs.iter().filter(|a| **a != addrs[i]).cloned().collect();
            let old = leader.leader_id.clone();
            leader = wait_leader(&others, Duration::from_secs(30), |s| !s.leader_id.is_empty() && s.leader_id != old).await;
            servers[i] = start(i);
        }
        tokio::time::sleep(Duration::from_secs(4)).await;
        leader
    };
    let (max, leader) = max_live_agents_until(MARKER, kills).await;
    assert!(max <= 2, "{max} agents of a resource of 2 were alive at once");
    assert_eq!(max, 2, "the resource was never fully used: the test proves nothing");
    let addr = leader.leader_address.clone();
    let waiting = cli(&addr, &["resources", "list"]);
    assert!(waiting.contains("search"), "{waiting}");

    // Stop the load; every run ends SUCCEEDED (or is an overlap SKIPPED record).
    for id in &ids {
        cli(&addr, &["task", "pause", id]);
    }
    let (max, all) = max_live_agents_until(MARKER, async {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            let mut all = Vec::new();
            for id in &ids {
                all.extend(list_runs(&addr, id).await);
            }
            if all.iter().all(terminal) || tokio::time::Instant::now() > deadline {
                return all;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    })
    .await;
    assert!(max <= 2, "{max} agents at once while draining");
    let ran: Vec<&pb::Run> = all.iter().filter(|r| status(r) != pb::RunStatus::Skipped).collect();
    assert!(ran.len() >= 20, "only {} runs ran", ran.len());
    for r in &ran {
        assert_eq!(status(r), pb::RunStatus::Succeeded, "a run was lost or failed: {r:#?}");
    }
    // Waits said what for (the attempt's holds name the resource).
    assert!(ran.iter().all(|r| r.attempts.iter().all(|a| a.holds.iter().any(|h| h.name == "search"))), "holds recorded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_storm_spends_no_attempts_and_holds_the_resource_back() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "shared_resources_storm");
    let cfg = write_config(dir.path(), "resources:\n  llm: {concurrency: 4}\n");
    let dev = Proc::dev_with(&dir.path().join("data"), 8, &dir.path().join("dev.log"), &["--config", &cfg]);
    let storm_file = dir.path().join("storm");
    std::fs::write(&storm_file, "on").expect("storm file");
    apply(
        &dev.addr,
        json!({"task_id": "storm", "agent_id": "storm_agent",
               "context": {"params": {"storm_file": storm_file.to_string_lossy(), "retry_after": 2}},
               "execution": {"resources": ["llm"], "max_retries": 0, "circuit_breaker": {"failure_threshold": 2, "cooldown_seconds": 600}}}),
    )
    .await;
    apply(&dev.addr, json!({"task_id": "other", "agent_id": "ok_agent", "execution": {"resources": ["llm"], "max_retries": 0}})).await;
    let storm_started = std::time::Instant::now();
    let t = tasks(&dev.addr).await;
    let storm = t.clone().trigger_task(pb::TriggerTaskRequest { task_id: "storm".into(), ..Default::default() }).await.expect("trigger");
    let storm_id = storm.into_inner().run_id;

    // The first 429: the resource is held back; another task waits for it.
    wait_run(&dev.addr, "storm", Duration::from_secs(30), |r| r.attempts.iter().any(|a| a.outcome == "rate_limited")).await;
    let held = cli(&dev.addr, &["resources", "list"]);
    assert!(held.contains("llm") && held.contains("rate limited"), "resources list shows the hold: {held}");
    // So do the metrics (the hold lasts 2 s from the answer).
    let (_, metrics) = http_get(&dev.http_addr(), "/metrics");
    assert!(metrics.contains("punchclock_resource_held_back{resource=\"llm\"} 1"), "held back gauge");
    let other = t.clone().trigger_task(pb::TriggerTaskRequest { task_id: "other".into(), ..Default::default() }).await.expect("trigger");
    let other_id = other.into_inner().run_id;
    let mut seen_reason = String::new();
    let mut rc = runs(&dev.addr).await;
    for _ in 0..200 {
        let r = rc.get_run(pb::GetRunRequest { run_id: other_id.clone() }).await.expect("get").into_inner();
        if r.pending_reason.contains("held back") {
            seen_reason = r.pending_reason.clone();
            break;
        }
        if r.actual_started_at.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(seen_reason.contains("resource llm held back until"), "the waiting run says why: {seen_reason:?}");
    let other = wait_run(&dev.addr, "other", Duration::from_secs(30), |r| r.run_id == other_id && terminal(r)).await;
    assert_eq!(status(&other), pb::RunStatus::Succeeded, "{other:#?}");

    // It started right after the hold it met ended, not before.
    let storm_now = rc.get_run(pb::GetRunRequest { run_id: storm_id.clone() }).await.expect("get").into_inner();
    let created = at(&other.scheduled_at).expect("scheduled");
    let hold = storm_now
        .attempts
        .iter()
        .filter(|a| at(&a.finished_at).is_some_and(|f| f <= created))
        .filter_map(|a| at(&a.retry_at))
        .max()
        .expect("a hold before the other run was created");
    let started = at(&other.actual_started_at).expect("started");
    let lag = (started - hold).num_milliseconds();
    assert!((0..1000).contains(&lag), "the other run started {lag} ms after the hold's retry_at");

    let (_, metrics) = http_get(&dev.http_addr(), "/metrics");
    assert!(metrics.contains("status=\"rate_limited\""), "rate_limited attempts counted");
    assert!(metrics.contains("punchclock_resource_wait_seconds_count{resource=\"llm\"}"), "the wait is in the histogram");

    // The storm ends after 20 s; the run SUCCEEDS with max_retries 0.
    tokio::time::sleep(Duration::from_secs(20).saturating_sub(storm_started.elapsed())).await;
    std::fs::remove_file(&storm_file).expect("storm over");
    let done = wait_run(&dev.addr, "storm", Duration::from_secs(30), |r| r.run_id == storm_id && terminal(r)).await;
    assert_eq!(status(&done), pb::RunStatus::Succeeded, "{done:#?}");
    let limited = done.attempts.iter().filter(|a| a.outcome == "rate_limited").count() + done.elided_attempts as usize;
    assert!(limited >= 5, "the storm answered {limited} times");
    for a in done.attempts.iter().filter(|a| a.outcome == "rate_limited") {
        assert_eq!(a.class, "http_429");
        assert_eq!(a.resource, "llm");
    }
    // Each retry waited its retry_at.
    for w in done.attempts.windows(2) {
        if let (Some(retry_at), Some(next)) = (at(&w[0].retry_at), at(&w[1].dispatched_at)) {
            assert!(next >= retry_at - chrono::Duration::milliseconds(5), "attempt {} went before its retry_at", w[1].attempt);
        }
    }
    let task = t.clone().get_task(pb::GetTaskRequest { task_id: "storm".into() }).await.expect("task").into_inner();
    assert_eq!(task.breaker.map(|b| b.phase).as_deref(), Some("closed"), "back-pressure opened the breaker");
    let get = cli(&dev.addr, &["runs", "get", &storm_id]);
    assert!(get.contains("http_429"), "runs get shows the class: {get}");
}

fn resource(addr: &str, name: &str) -> serde_json::Value {
    let all: serde_json::Value = serde_json::from_str(&cli(addr, &["resources", "list", "-o", "json"])).expect("json");
    all.as_array().and_then(|a| a.iter().find(|r| r["name"] == name).cloned()).unwrap_or_else(|| panic!("no resource {name}: {all:#}"))
}

/// Triggers `task` once; its run id.
async fn trigger(addr: &str, task: &str) -> String {
    let r = tasks(addr).await.trigger_task(pb::TriggerTaskRequest { task_id: task.into(), ..Default::default() }).await.expect("trigger");
    r.into_inner().run_id
}

/// Issue 34, findings 2 and 5: a `quota_exhausted` hold lived only in the
/// leader's memory (the waiting calls to that provider ran within 35 s of
/// a leader kill), and an agent could freeze a resource its task does not
/// use by naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hold_backs_survive_leader_kills_and_stay_on_the_tasks_own_resources() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "shared_resources_holds");
    let cfg = write_config(dir.path(), "quota_backoff: 10m\nresources:\n  search: {concurrency: 5}\n  payments: {concurrency: 5}\n");
    let etcd = Etcd::start(1).await;
    let ports = [free_port(), free_port(), free_port()];
    let start = |i: usize| Proc::server_with(&etcd.store_url(), &format!("cp{i}"), ports[i], dir.path(), &[], &["--config", &cfg]);
    let mut servers: Vec<Proc> = (0..3).map(start).collect();
    let addrs: Vec<String> = servers.iter().map(|s| s.addr.clone()).collect();
    let _r1 = Proc::runner(&addrs.join(","), "r1", dir.path());
    let mut leader = wait_leader(&addrs, Duration::from_secs(30), |_| true).await;
    let says =
        |resource: &str| json!({"exit": 1, "result": {"outcome": "quota_exhausted", "resource": resource, "class": "insufficient_quota"}});
    let addr = leader.leader_address.clone();
    for (id, params) in [("rogue", says("payments")), ("quota", says("search"))] {
        apply(
            &addr,
            json!({"task_id": id, "agent_id": "outcome_agent", "context": {"params": params},
                   "execution": {"resources": ["search"], "max_retries": 0}}),
        )
        .await;
    }
    apply(
        &addr,
        json!({"task_id": "waiter", "agent_id": "ok_agent", "execution": {"resources": ["search"], "start_timeout_seconds": 900}}),
    )
    .await;
    punchclock_tests::wait_runners(&addr, Duration::from_secs(30)).await;

    // `rogue` names `payments`, which its task does not use: nothing held.
    let id = trigger(&addr, "rogue").await;
    let r = wait_run(&addr, "rogue", Duration::from_secs(60), |r| r.run_id == id && terminal(r)).await;
    assert_eq!((status(&r), r.attempts[0].resource.as_str()), (pb::RunStatus::Failed, "payments"), "{r:#?}");
    assert!(resource(&addr, "payments")["held_until"].is_null(), "{:#}", resource(&addr, "payments"));

    // `quota` names `search`: held back for 10 minutes.
    let id = trigger(&addr, "quota").await;
    wait_run(&addr, "quota", Duration::from_secs(60), |r| r.run_id == id && terminal(r)).await;
    let held_until = resource(&addr, "search")["held_until"].clone();
    assert!(held_until.is_string(), "{:#}", resource(&addr, "search"));
    let waiter = trigger(&addr, "waiter").await;
    let held_back = |r: &pb::Run| r.run_id == waiter && r.pending_reason.contains("resource search held back until");
    wait_run(&addr, "waiter", Duration::from_secs(30), held_back).await;

    for kill in 0..3 {
        let i = servers.iter().position(|s| s.addr == leader.leader_address).expect("leader is ours");
        servers[i].kill9();
        let others: Vec<String> = addrs.iter().filter(|a| **a != addrs[i]).cloned().collect();
        let old = leader.leader_id.clone();
        leader = wait_leader(&others, Duration::from_secs(30), |s| !s.leader_id.is_empty() && s.leader_id != old).await;
        wait_engine(&leader.leader_address).await;
        servers[i] = start(i);
        let now = resource(&leader.leader_address, "search");
        assert_eq!(now["held_until"], held_until, "kill {kill}: the next leader holds it until the same instant: {now:#}");
        // Its dispatch pass has looked at the waiting run and held it back.
        let r = wait_run(&leader.leader_address, "waiter", Duration::from_secs(30), held_back).await;
        assert!(r.actual_started_at.is_none() && r.attempts.is_empty(), "kill {kill}: the waiting run went: {r:#?}");
    }
    // Released by hand: the waiting run goes at once.
    let out = cli(&leader.leader_address, &["resources", "release", "search"]);
    assert!(out.contains("search: not held back"), "{out}");
    let r = wait_run(&leader.leader_address, "waiter", Duration::from_secs(30), |r| r.run_id == waiter && terminal(r)).await;
    assert_eq!(status(&r), pb::RunStatus::Succeeded, "{r:#?}");
    assert!(resource(&leader.leader_address, "search")["held_until"].is_null());
}

/// Issue 34, finding 4: a `skip` task due in the same instant as runs of
/// a `wait` task on the same resource sat PENDING behind them ("waiting
/// for: resource search-api (1/1 in use)") and ran late every time, with
/// no `resource_busy` record. Each of its slots now runs at once or is
/// SKIPPED.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_skip_task_never_waits_behind_the_resource() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "shared_resources_skip");
    let cfg = write_config(dir.path(), "resources:\n  search-api: {concurrency: 1}\n");
    let dev = Proc::dev_with(&dir.path().join("data"), 8, &dir.path().join("dev.log"), &["--config", &cfg]);
    // The `wait` task keeps the resource busy (a 3 s agent every 2 s, queued).
    apply(
        &dev.addr,
        json!({"task_id": "hog", "agent_id": "sleep_agent", "trigger": {"type": "interval", "every": "2s"},
               "execution": {"resources": ["search-api"], "overlap_policy": "queue", "concurrency_limit": 5, "priority": 10}}),
    )
    .await;
    apply(
        &dev.addr,
        json!({"task_id": "skipper", "agent_id": "ok_agent", "trigger": {"type": "interval", "every": "2s"},
               "execution": {"resources": ["search-api"], "on_resource_busy": "skip"}}),
    )
    .await;
    // Four slots skipped (consecutive ones are one record with their count).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while list_runs(&dev.addr, "skipper")
        .await
        .iter()
        .filter(|r| r.skip_reason == "resource_busy")
        .map(|r| r.missed_count.max(1))
        .sum::<u64>()
        < 4
    {
        assert!(tokio::time::Instant::now() < deadline, "no four resource_busy slots");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    cli(&dev.addr, &["task", "pause", "skipper"]);
    cli(&dev.addr, &["task", "pause", "hog"]);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let all = loop {
        let all = list_runs(&dev.addr, "skipper").await;
        if all.iter().all(terminal) {
            break all;
        }
        assert!(tokio::time::Instant::now() < deadline, "skipper's runs did not end: {all:#?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    for r in &all {
        match status(r) {
            pb::RunStatus::Skipped => assert!(["resource_busy", "paused"].contains(&r.skip_reason.as_str()), "{r:#?}"),
            pb::RunStatus::Succeeded => {
                let lag = at(&r.attempts[0].dispatched_at).expect("dispatched") - at(&r.scheduled_at).expect("slot");
                assert!(lag < chrono::Duration::seconds(1), "a skip run waited {lag} for the resource: {r:#?}");
            }
            s => panic!("{s:?}: {r:#?}"),
        }
    }
}
