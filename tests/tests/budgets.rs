//! Issue 20, budgets, with real control planes, runners and agent
//! processes:
//!
//! - **runs: 10 per hour**: a task due every second; the 11th slot is a
//!   SKIPPED `budget_exceeded` record naming the budget, used / limit and
//!   when it resets; shown by `runs get`, `budgets list`, `stats`,
//!   `/metrics`; the run crossing the soft limit sends one `on_budget`
//!   notification to a real receiver;
//! - **a burst within one estimate**: with `output_tokens: 10000` and
//!   runs known to spend 1,000 each, 50 slots due at once leave the spend
//!   within 1,000 of the limit (reservations, not 50 runs' overshoot);
//! - **the ledger survives kill -9**: 3 tasks every second on etcd with 3
//!   control planes, the leader killed 3 times; the ledger then equals the
//!   sum of the usage of the runs it counted, none twice;
//! - **a new task's first burst** (issue 34, findings 3 and 12): `cost: 1.0`,
//!   runs costing 0.25, 20 triggers at once on a task with no history spend
//!   at most 1.25 (all 20 ran, 5.00, before); `budgets list` then says
//!   `exceeded` and its reset in the budget's zone; an attempt priced from
//!   the config's table shows that cost.

use std::time::Duration;

use punchclock_proto::v1 as pb;
use punchclock_tests::etcd::{Etcd, free_port};
use punchclock_tests::receiver::Receiver;
use punchclock_tests::{KeepLogsOnPanic, Proc, apply, cli, http_get, list_runs, status, tasks, terminal, wait_leader, wait_n_runs};
use serde_json::{Value, json};

fn write_config(dir: &std::path::Path, text: &str) -> String {
    let path = dir.join("config.yaml");
    std::fs::write(&path, text).expect("config");
    path.to_string_lossy().into_owned()
}

fn budgets_json(addr: &str) -> Vec<Value> {
    let out = cli(addr, &["budgets", "list", "-o", "json"]);
    serde_json::from_str::<Value>(&out).expect("json").as_array().expect("array").clone()
}

/// Waits until every run of `ids` is terminal; all of them.
async fn drained(addr: &str, ids: &[&str], within: Duration) -> Vec<pb::Run> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let mut all = Vec::new();
        for id in ids {
            all.extend(list_runs(addr, id).await);
        }
        if all.iter().all(terminal) {
            return all;
        }
        assert!(tokio::time::Instant::now() < deadline, "runs did not end: {all:#?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_eleventh_run_of_ten_an_hour_is_skipped_and_says_why() {
    // An hour's window: do not start in its last 30 s (the count would reset).
    let now = chrono::Utc::now();
    use chrono::Timelike;
    if now.minute() == 59 && now.second() >= 30 {
        tokio::time::sleep(Duration::from_secs(61 - now.second() as u64)).await;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "budgets_runs");
    let hook = Receiver::start("s3cret").await;
    let cfg = write_config(
        dir.path(),
        &format!(
            "sinks:\n  hook: {{url: \"{}\", secret: s3cret}}\nbudgets:\n  - name: hourly\n    scope: {{task: ten}}\n    window: 1h\n    limits: {{runs: 10}}\n    soft_percent: 50\n    notify: [webhook://hook]\n",
            hook.url()
        ),
    );
    let dev = Proc::dev_with(&dir.path().join("data"), 4, &dir.path().join("dev.log"), &["--config", &cfg]);
    apply(&dev.addr, json!({"task_id": "ten", "agent_id": "ok_agent", "trigger": {"type": "interval", "every": "1s"}})).await;
    let skipped =
        wait_n_runs(&dev.addr, "ten", 1, Duration::from_secs(90), |r| r.skip_reason == "budget_exceeded" && r.missed_count >= 3).await;
    cli(&dev.addr, &["task", "pause", "ten"]);
    let mut all = drained(&dev.addr, &["ten"], Duration::from_secs(60)).await;
    all.sort_by_key(|r| punchclock_tests::at(&r.scheduled_at));
    // Slots skipped for overlap are not admitted; of the rest, 10 ran.
    let admitted: Vec<&pb::Run> =
        all.iter().filter(|r| !(status(r) == pb::RunStatus::Skipped && r.skip_reason != "budget_exceeded")).collect();
    assert!(admitted.len() >= 11, "{admitted:#?}");
    for (i, r) in admitted.iter().enumerate() {
        if i < 10 {
            assert_eq!(status(r), pb::RunStatus::Succeeded, "run {i}: {r:#?}");
        } else {
            assert_eq!(r.skip_reason, "budget_exceeded", "run {i}: {r:#?}");
        }
    }
    // Why, in runs get: the budget, used / limit, when it resets.
    let get = cli(&dev.addr, &["runs", "get", &skipped[0].run_id]);
    assert!(get.contains("budget hourly exceeded: runs 10/10 used or reserved; resets at"), "{get}");
    let list = cli(&dev.addr, &["runs", "list", "--task", "ten"]);
    assert!(list.contains("budget_exceeded"), "{list}");
    let b = budgets_json(&dev.addr);
    assert_eq!(b.len(), 1);
    assert_eq!(
        (b[0]["name"].as_str(), b[0]["state"].as_str(), b[0]["used"]["runs"].as_u64()),
        (Some("hourly"), Some("exceeded"), Some(10))
    );
    let table = cli(&dev.addr, &["budgets", "list"]);
    assert!(table.contains("runs 10/10") && table.contains("task ten"), "{table}");
    let stats: Value = serde_json::from_str(&cli(&dev.addr, &["stats", "--since", "1h", "-o", "json"])).expect("stats");
    let skipped_n = stats["tasks"][0]["skipped"]["budget_exceeded"].as_u64().unwrap_or(0);
    // Consecutive skipped slots are one record with their count (issue 34,
    // finding 13: a record per slot flooded the history).
    assert_eq!(admitted.len(), 11, "the skipped slots are one record: {:#?}", &admitted[10..]);
    let skipped_slots: u64 = admitted[10..].iter().map(|r| r.missed_count.max(1)).sum();
    assert_eq!(skipped_n, skipped_slots, "stats: {stats:#}");
    let (_, metrics) = http_get(&dev.http_addr(), "/metrics");
    assert!(metrics.contains("punchclock_budget_used{budget=\"hourly\",measure=\"runs\"} 10"), "budget gauge");
    assert!(metrics.contains("punchclock_budget_limit{budget=\"hourly\",measure=\"runs\"} 10"), "limit gauge");
    assert!(
        metrics.contains("punchclock_slots_skipped_total{agent_id=\"ok_agent\",reason=\"budget_exceeded\"}"),
        "skips counted by reason"
    );
    // The 5th run crossed 50%: one on_budget notification, no more.
    assert!(hook.wait_for(Duration::from_secs(30), |r| r.iter().any(|n| n.event == "on_budget")).await, "on_budget delivered");
    let notes: Vec<_> = hook.received().into_iter().filter(|n| n.event == "on_budget").collect();
    assert_eq!(notes.len(), 1, "{notes:#?}");
    assert_eq!(notes[0].body["budget"]["name"], "hourly");
    assert!(notes[0].signature_ok);
    assert_eq!(notes[0].body["budget"]["used"]["runs"].as_u64(), Some(5), "crossed by the 5th run: {:#}", notes[0].body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_slots_at_once_end_within_one_estimate_of_a_token_budget() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "budgets_burst");
    let cfg = write_config(
        dir.path(),
        "budgets:\n  - name: tokens\n    scope: {agent: spend_agent}\n    window: month\n    limits: {output_tokens: 10000}\n",
    );
    let dev = Proc::dev_with(&dir.path().join("data"), 8, &dir.path().join("dev.log"), &["--config", &cfg]);
    apply(
        &dev.addr,
        json!({"task_id": "burst", "agent_id": "spend_agent", "execution": {"concurrency_limit": 60, "overlap_policy": "queue"}}),
    )
    .await;
    let t = tasks(&dev.addr).await;
    // History: three runs of 1,000 output tokens each.
    for i in 0..3 {
        let key = format!("h{i}");
        let r = t
            .clone()
            .trigger_task(pb::TriggerTaskRequest { task_id: "burst".into(), idempotency_key: key, ..Default::default() })
            .await
            .expect("trigger")
            .into_inner();
        punchclock_tests::wait_run(&dev.addr, "burst", Duration::from_secs(30), |x| x.run_id == r.run_id && terminal(x)).await;
    }
    // 50 due at once.
    let triggers = (0..50).map(|i| {
        let mut t = t.clone();
        async move {
            t.trigger_task(pb::TriggerTaskRequest { task_id: "burst".into(), idempotency_key: format!("b{i}"), ..Default::default() })
                .await
                .expect("trigger")
        }
    });
    futures::future::join_all(triggers).await;
    let all = drained(&dev.addr, &["burst"], Duration::from_secs(120)).await;
    let ran = all.iter().filter(|r| status(r) == pb::RunStatus::Succeeded).count();
    let skipped = all.iter().filter(|r| r.skip_reason == "budget_exceeded").count();
    assert_eq!(ran + skipped, 53, "{all:#?}");
    assert!(skipped >= 40, "only {skipped} of 50 were held to the budget");
    let b = budgets_json(&dev.addr);
    let used = b[0]["used"]["output_tokens"].as_u64().expect("used");
    assert_eq!(used, ran as u64 * 1000, "the ledger is what the runs used");
    assert!(used.abs_diff(10_000) <= 1000, "spend {used} is not within one run's estimate (1,000) of 10,000");
    assert_eq!(b[0]["reserved"]["runs"].as_u64(), Some(0), "nothing stays reserved");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ledger_counts_each_run_once_through_leader_kills() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "budgets_ledger");
    let cfg = write_config(
        dir.path(),
        "budgets:\n  - name: ledger\n    scope: {agent: spend_agent}\n    window: month\n    limits: {cost: 1000000}\n",
    );
    let etcd = Etcd::start(1).await;
    let ports = [free_port(), free_port(), free_port()];
    let start = |i: usize| Proc::server_with(&etcd.store_url(), &format!("cp{i}"), ports[i], dir.path(), &[], &["--config", &cfg]);
    let mut servers: Vec<Proc> = (0..3).map(start).collect();
    let addrs: Vec<String> = servers.iter().map(|s| s.addr.clone()).collect();
    let _r1 = Proc::runner(&addrs.join(","), "r1", dir.path());
    let mut leader = wait_leader(&addrs, Duration::from_secs(30), |_| true).await;
    let ids = ["spend0", "spend1", "spend2"];
    for id in ids {
        apply(
            &leader.leader_address,
            json!({"task_id": id, "agent_id": "spend_agent", "trigger": {"type": "interval", "every": "1s"},
                   "execution": {"max_retries": 0, "start_timeout_seconds": 300}}),
        )
        .await;
    }
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_secs(4)).await;
        let i = servers.iter().position(|s| s.addr == leader.leader_address).expect("leader is ours");
        servers[i].kill9();
        let others: Vec<String> = addrs.iter().filter(|a| **a != addrs[i]).cloned().collect();
        let old = leader.leader_id.clone();
        leader = wait_leader(&others, Duration::from_secs(30), |s| !s.leader_id.is_empty() && s.leader_id != old).await;
        servers[i] = start(i);
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let addr = leader.leader_address.clone();
    for id in ids {
        cli(&addr, &["task", "pause", id]);
    }
    let all = drained(&addr, &ids, Duration::from_secs(120)).await;
    let counted: Vec<&pb::Run> = all.iter().filter(|r| status(r) != pb::RunStatus::Skipped).collect();
    assert!(counted.len() >= 15, "only {} runs", counted.len());
    let tokens: u64 = counted.iter().flat_map(|r| &r.attempts).filter_map(|a| a.usage.as_ref()).map(|u| u.output_tokens).sum();
    let spent: u64 = counted.iter().map(|r| r.attempts.len() as u64 + u64::from(r.elided_attempts)).sum();
    let b = budgets_json(&addr);
    assert_eq!(b[0]["used"]["runs"].as_u64(), Some(counted.len() as u64), "runs counted: {:#}", b[0]);
    assert_eq!(b[0]["used"]["output_tokens"].as_u64(), Some(tokens), "tokens: {:#}", b[0]);
    assert!(tokens >= 1000 * counted.len() as u64 && spent >= counted.len() as u64);
    assert_eq!(b[0]["reserved"]["runs"].as_u64(), Some(0));
    // A new leader reads the same ledger from the store.
    let i = servers.iter().position(|s| s.addr == addr).expect("leader is ours");
    servers[i].kill9();
    let others: Vec<String> = addrs.iter().filter(|a| **a != addrs[i]).cloned().collect();
    let next = wait_leader(&others, Duration::from_secs(30), |s| !s.leader_id.is_empty() && s.leader_id != leader.leader_id).await;
    punchclock_tests::wait_engine(&next.leader_address).await;
    let again = budgets_json(&next.leader_address);
    for m in ["runs", "output_tokens", "input_tokens"] {
        assert_eq!(again[0]["used"][m], b[0]["used"][m], "the next leader's ledger: {m}");
    }
}

/// Issue 34, findings 3 and 12: nothing could estimate a new task's runs,
/// so nothing was reserved and a burst of 20 at once spent 5.00 of a 1.00
/// budget. Now the first runs as a probe, the others wait for it and are
/// estimated from it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_tasks_burst_spends_at_most_the_limit_plus_one_run() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "budgets_new_task");
    let cfg = write_config(
        dir.path(),
        "budgets:\n  - name: fresh\n    scope: {task: fresh}\n    window: month\n    timezone: Asia/Shanghai\n    limits: {cost: 1.0}\n\
         prices:\n  m1: {input_per_1k: 1.0, output_per_1k: 2.0}\n",
    );
    let dev = Proc::dev_with(&dir.path().join("data"), 30, &dir.path().join("dev.log"), &["--config", &cfg]);
    let spend = json!({"sleep": 0.3, "result": {"ok": true, "usage": {"cost": 0.25}}});
    apply(
        &dev.addr,
        json!({"task_id": "fresh", "agent_id": "outcome_agent", "context": {"params": spend},
               "execution": {"concurrency_limit": 30, "overlap_policy": "queue", "max_retries": 0}}),
    )
    .await;
    let t = tasks(&dev.addr).await;
    let triggers = (0..20).map(|i| {
        let mut t = t.clone();
        async move {
            t.trigger_task(pb::TriggerTaskRequest { task_id: "fresh".into(), idempotency_key: format!("b{i}"), ..Default::default() })
                .await
                .expect("trigger")
        }
    });
    futures::future::join_all(triggers).await;
    let all = drained(&dev.addr, &["fresh"], Duration::from_secs(120)).await;
    assert_eq!(all.len(), 20);
    let ran: Vec<&pb::Run> = all.iter().filter(|r| status(r) == pb::RunStatus::Succeeded).collect();
    let spent: f64 = ran.iter().flat_map(|r| &r.attempts).filter_map(|a| a.usage.as_ref()).map(|u| u.cost).sum();
    assert!(spent <= 1.0 + 0.25 + 1e-9, "{} runs spent {spent:.2} of a 1.00 budget", ran.len());
    for r in all.iter().filter(|r| status(r) != pb::RunStatus::Succeeded) {
        assert_eq!((status(r), r.skip_reason.as_str()), (pb::RunStatus::Skipped, "budget_exceeded"), "{r:#?}");
        assert!(r.attempts.is_empty(), "a skipped run never ran: {r:#?}");
        assert!(r.error.contains("budget fresh exceeded: cost"), "{}", r.error);
    }
    let b = budgets_json(&dev.addr);
    assert_eq!(b[0]["state"], "exceeded", "{:#}", b[0]);
    assert_eq!(b[0]["timezone"], "Asia/Shanghai");
    assert!(b[0]["resets_at"].as_str().is_some_and(|s| s.ends_with("+08:00")), "{:#}", b[0]);
    assert!(cli(&dev.addr, &["budgets", "list"]).contains("+08:00"), "the table shows the reset in the budget's zone");
    assert_eq!(b[0]["reserved"]["runs"].as_u64(), Some(0), "nothing stays reserved");

    // An attempt priced from the config's table shows the cost charged.
    let priced = json!({"result": {"ok": true, "model": "m1", "usage": {"input_tokens": 1000, "output_tokens": 500}}});
    apply(&dev.addr, json!({"task_id": "priced", "agent_id": "outcome_agent", "context": {"params": priced}})).await;
    let r = t
        .clone()
        .trigger_task(pb::TriggerTaskRequest { task_id: "priced".into(), idempotency_key: "p".into(), ..Default::default() })
        .await
        .expect("trigger")
        .into_inner();
    let run = punchclock_tests::wait_run(&dev.addr, "priced", Duration::from_secs(30), |x| x.run_id == r.run_id && terminal(x)).await;
    let u = run.attempts[0].usage.expect("usage");
    assert!((u.cost - 2.0).abs() < 1e-9 && u.cost_priced, "1,000 in at 1.0/1k + 500 out at 2.0/1k: {u:?}");
}
