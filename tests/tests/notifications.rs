//! Issue 9, acceptance 3: notifications that arrive. A real HTTP receiver
//! (tests/src/receiver.rs) checks every request's signature with its own
//! HMAC and records it.
//! - Across 10 leader kill -9s on etcd, every finished run's notification
//!   arrives, exactly one per run by id (a repeat only with the same id).
//! - With the receiver down for 30 s, the notifications arrive after it
//!   returns.
//! - A receiver that always fails leads to a dead letter after
//!   `max_attempts` tries, shown by `notifications list --status dead`;
//!   `notifications retry` sends it again.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Duration;

use punchclock_proto::v1 as pb;
use punchclock_tests::etcd::{Etcd, free_port};
use punchclock_tests::receiver::{Received, Receiver};
use punchclock_tests::{KeepLogsOnPanic, Proc, apply, cli, list_runs, status, tasks, wait_engine, wait_leader, wait_n_runs};
use serde_json::{Value, json};

const SECRET: &str = "whsec_test_0123456789";

fn config(dir: &Path, receiver: &Receiver, extra: &str) -> String {
    let path = dir.join("punchclock.yaml");
    std::fs::write(
        &path,
        format!(
            "notifications:\n  retry_base_seconds: 0.2\n  retry_cap_seconds: 2\n{extra}sinks:\n  hook:\n    url: {}\n    secret: {SECRET}\n    headers: {{X-Test: yes}}\n",
            receiver.url()
        ),
    )
    .expect("config");
    path.to_string_lossy().to_string()
}

fn ids(received: &[Received]) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for r in received.iter().filter(|r| r.answered == 200) {
        *m.entry(r.id.clone()).or_insert(0) += 1;
    }
    m
}

fn json_of(addr: &str, args: &[&str]) -> Value {
    let mut a = vec!["-o", "json"];
    a.extend_from_slice(args);
    serde_json::from_str(&cli(addr, &a)).expect("JSON output")
}

/// Waits until no run of `task` is PENDING, RUNNING or RETRYING; returns the runs.
async fn drained(addr: &str, task: &str) -> Vec<pb::Run> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        let runs = list_runs(addr, task).await;
        if runs.iter().all(|r| !matches!(status(r), pb::RunStatus::Pending | pb::RunStatus::Running | pb::RunStatus::Retrying)) {
            return runs;
        }
        assert!(tokio::time::Instant::now() < deadline, "runs of {task} did not finish");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_one_notification_per_finished_run_across_ten_leader_kills() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "notifications_ha");
    let receiver = Receiver::start(SECRET).await;
    let cfg = config(dir.path(), &receiver, "");
    let etcd = Etcd::start(1).await;
    let ports = [free_port(), free_port()];
    let start = |i: usize| Proc::server_with(&etcd.store_url(), &format!("cp{i}"), ports[i], dir.path(), &[], &["--config", &cfg]);
    let mut servers: Vec<Proc> = (0..2).map(start).collect();
    let addrs: Vec<String> = servers.iter().map(|s| s.addr.clone()).collect();
    let _runner = Proc::runner(&addrs.join(","), "r1", dir.path());
    wait_leader(&addrs, Duration::from_secs(20), |_| true).await;
    for (task, agent, event) in [("n_ok", "light_agent", "on_success"), ("n_fail", "fail_agent", "on_failure")] {
        apply(
            &addrs[0],
            json!({"task_id": task, "agent_id": agent, "trigger": {"type": "interval", "every": "1s"},
                   "execution": {"concurrency_limit": 4}, "notify": {event: ["webhook://hook"]}}),
        )
        .await;
    }
    let mut last_token = 0;
    let mut kills = Vec::new();
    for k in 0..10 {
        let s = wait_leader(&addrs, Duration::from_secs(30), |s| s.fencing_token != last_token).await;
        last_token = s.fencing_token;
        wait_engine(&s.leader_address).await;
        // Let it deliver some: a notification arrives under this leader.
        let before = receiver.received().len();
        assert!(receiver.wait_for(Duration::from_secs(20), |r| r.len() > before).await, "no notification under leader {k}");
        let i = addrs.iter().position(|a| *a == s.leader_address).expect("leader is ours");
        servers[i].kill9();
        kills.push(std::time::Instant::now());
        servers[i] = start(i);
        println!("kill {k}: cp{i} (token {})", s.fencing_token);
    }
    let end = wait_leader(&addrs, Duration::from_secs(30), |_| true).await;
    let leader = end.leader_address.clone();
    for task in ["n_ok", "n_fail"] {
        tasks(&leader).await.pause_task(pb::PauseTaskRequest { task_id: task.into() }).await.expect("pause");
    }
    let mut expected = BTreeSet::new();
    for (task, event, st) in [("n_ok", "on_success", pb::RunStatus::Succeeded), ("n_fail", "on_failure", pb::RunStatus::Failed)] {
        for r in drained(&leader, task).await.iter().filter(|r| status(r) == st) {
            expected.insert(format!("{}.{event}.0", r.run_id));
        }
    }
    assert!(expected.len() >= 20, "runs finished: {}", expected.len());
    let arrived = receiver
        .wait_for(Duration::from_secs(60), |r| {
            let got = ids(r);
            expected.iter().all(|id| got.contains_key(id))
        })
        .await;
    let received = receiver.received();
    let got = ids(&received);
    let missing: Vec<&String> = expected.iter().filter(|id| !got.contains_key(*id)).collect();
    assert!(arrived && missing.is_empty(), "{} of {} notifications never arrived: {missing:?}", missing.len(), expected.len());
    let unknown: Vec<&String> = got.keys().filter(|id| !expected.contains(*id)).collect();
    assert!(unknown.is_empty(), "notifications for no finished run: {unknown:?}");
    assert!(received.iter().all(|r| r.signature_ok && r.idempotency_ok), "every request is signed and carries its id");
    // A repeat happens only when a leader died between the receiver's 200
    // and its write (this test kills right after a delivery, with others
    // in flight): the first answer came shortly before a kill, and the
    // repeat has the same id.
    let repeats: Vec<(&String, &usize)> = got.iter().filter(|(_, n)| **n > 1).collect();
    println!("{} notifications, {} repeated by id after a kill", got.len(), repeats.len());
    for (id, _) in &repeats {
        let first = received.iter().find(|r| &r.id == *id && r.answered == 200).expect("first").at;
        assert!(
            kills.iter().any(|k| *k >= first && k.duration_since(first) < Duration::from_secs(3)),
            "{id} was delivered twice without a leader dying right after the first delivery"
        );
    }
    for r in &received {
        let run = &r.body["run"];
        assert_eq!(r.body["id"], Value::String(r.id.clone()));
        assert!(r.id.starts_with(run["run_id"].as_str().expect("run_id")), "{}", r.body);
        assert!(run.get("stdout_tail").is_none());
    }
    // Nothing left pending.
    let pending = json_of(&leader, &["notifications", "list", "--status", "pending"]);
    assert_eq!(pending.as_array().map(Vec::len), Some(0), "{pending:#}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_arrive_after_the_receiver_was_down_for_30_s() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "notifications_down");
    let mut receiver = Receiver::start(SECRET).await;
    // Tries every 2 s at most: 50 attempts outlast the 30 s.
    let cfg = config(dir.path(), &receiver, "  max_attempts: 50\n");
    let dev = Proc::dev_with(&dir.path().join("data"), 8, &dir.path().join("dev.log"), &["--config", &cfg]);
    apply(
        &dev.addr,
        json!({"task_id": "d_ok", "agent_id": "ok_agent", "trigger": {"type": "interval", "every": "1s"},
               "notify": {"on_success": ["webhook://hook"]}}),
    )
    .await;
    assert!(receiver.wait_for(Duration::from_secs(20), |r| !r.is_empty()).await, "first notification");
    receiver.stop();
    let down_from = receiver.received().len();
    // 30 s down while the task keeps running.
    tokio::time::sleep(Duration::from_secs(30)).await;
    cli(&dev.addr, &["task", "pause", "d_ok"]);
    let runs = drained(&dev.addr, "d_ok").await;
    let expected: BTreeSet<String> =
        runs.iter().filter(|r| status(r) == pb::RunStatus::Succeeded).map(|r| format!("{}.on_success.0", r.run_id)).collect();
    assert!(expected.len() >= 25, "{} runs", expected.len());
    assert_eq!(receiver.received().len(), down_from, "nothing arrives while it is down");
    let pending = json_of(&dev.addr, &["notifications", "list", "--status", "pending", "--limit", "1000"]);
    assert!(pending.as_array().is_some_and(|p| p.len() >= 20), "notifications wait in the outbox: {pending:#}");
    assert!(pending[0]["attempts"].as_u64().unwrap_or(0) >= 1, "and were tried: {:#}", pending[0]);
    receiver.restart().await;
    let all = receiver.wait_for(Duration::from_secs(30), |r| expected.iter().all(|id| ids(r).contains_key(id))).await;
    assert!(all, "after the receiver returned, all {} arrived", expected.len());
    assert!(receiver.received().iter().all(|r| r.signature_ok));
    let delivered = json_of(&dev.addr, &["notifications", "list", "--status", "delivered", "--limit", "1000"]);
    assert_eq!(delivered.as_array().map(Vec::len), Some(expected.len()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_that_always_fails_gets_a_dead_letter_after_max_attempts() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "notifications_dead");
    let receiver = Receiver::start(SECRET).await;
    receiver.set_failing(true);
    let cfg = config(dir.path(), &receiver, "  max_attempts: 3\n");
    let dev = Proc::dev_with(&dir.path().join("data"), 8, &dir.path().join("dev.log"), &["--config", &cfg]);
    apply(&dev.addr, json!({"task_id": "dl", "agent_id": "fail_agent", "notify": {"on_failure": ["webhook://hook"]}})).await;
    cli(&dev.addr, &["task", "trigger", "dl"]);
    let run = wait_n_runs(&dev.addr, "dl", 1, Duration::from_secs(20), |r| status(r) == pb::RunStatus::Failed).await.remove(0);
    // A manual run's notification ids carry its scheduled_at (ms).
    let id = format!("{}-{}.on_failure.0", run.run_id, punchclock_tests::at(&run.scheduled_at).expect("slot").timestamp_millis());
    assert!(receiver.wait_for(Duration::from_secs(30), |r| r.iter().filter(|x| x.id == id).count() >= 3).await);
    // Dead after exactly 3 tries.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let dead = loop {
        let dead = json_of(&dev.addr, &["notifications", "list", "--status", "dead"]);
        if dead.as_array().is_some_and(|d| !d.is_empty()) {
            break dead;
        }
        assert!(tokio::time::Instant::now() < deadline, "no dead letter");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(dead[0]["id"], Value::String(id.clone()));
    assert_eq!(dead[0]["attempts"], 3);
    assert!(dead[0]["last_error"].as_str().is_some_and(|e| e.contains("500")), "{dead:#}");
    assert_eq!(receiver.received().iter().filter(|x| x.id == id).count(), 3, "no fourth try");
    let table = cli(&dev.addr, &["notifications", "list"]);
    assert!(table.contains("dead") && table.contains(&id), "{table}");
    // Retried by hand once the receiver works: delivered.
    receiver.set_failing(false);
    cli(&dev.addr, &["notifications", "retry", &id]);
    assert!(receiver.wait_for(Duration::from_secs(20), |r| r.iter().any(|x| x.id == id && x.answered == 200)).await);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let delivered = json_of(&dev.addr, &["notifications", "list", "--status", "delivered"]);
        if delivered.as_array().is_some_and(|d| d.iter().any(|n| n["id"] == Value::String(id.clone()))) {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "not recorded as delivered");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A sink that never answers holds at most `per_sink_concurrency` of the
/// requests in flight: the other sink's notifications keep arriving about
/// as fast as runs finish. (Before, oldest-first delivery let the hanging
/// sink's backlog take every slot.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_sink_does_not_hold_up_the_others() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "notifications_hang");
    let receiver = Receiver::start(SECRET).await;
    // Accepts connections and never answers.
    let hang = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let hang_port = hang.local_addr().expect("addr").port();
    let _hang = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((conn, _)) = hang.accept().await {
            held.push(conn);
        }
    });
    let cfg = dir.path().join("punchclock.yaml");
    std::fs::write(
        &cfg,
        format!(
            "notifications:\n  concurrency: 2\n  per_sink_concurrency: 1\n  retry_cap_seconds: 1\nsinks:\n  hang:\n    url: http://127.0.0.1:{hang_port}/\n    timeout_seconds: 20\n  ok:\n    url: {}\n    secret: {SECRET}\n",
            receiver.url()
        ),
    )
    .expect("config");
    let dev = Proc::dev_with(&dir.path().join("data"), 8, &dir.path().join("dev.log"), &["--config", &cfg.to_string_lossy()]);
    apply(
        &dev.addr,
        json!({"task_id": "h", "agent_id": "ok_agent", "trigger": {"type": "interval", "every": "1s"},
               "notify": {"on_success": ["webhook://hang", "webhook://ok"]}}),
    )
    .await;
    assert!(receiver.wait_for(Duration::from_secs(20), |r| !r.is_empty()).await, "first notification to ok");
    let start = receiver.received().len();
    // 10 s of runs: their ok notifications arrive while hang holds its one slot.
    let arrived = receiver.wait_for(Duration::from_secs(10), |r| r.len() >= start + 7).await;
    assert!(arrived, "only {} notifications reached the ok sink in 10 s", receiver.received().len() - start);
}
