//! Issue 21, queue triggers on real brokers (Debian's `rabbitmq-server`
//! and `nats-server`, each started here on free loopback ports), with real
//! control planes, runners, agents and etcd:
//!
//! - **exactly one record per message across failover**: 1,000 messages
//!   published at 50/s to RabbitMQ, and separately to NATS JetStream,
//!   while the leader of 3 control planes on etcd is killed (SIGKILL) 5
//!   times: the task has exactly 1,000 records, each message's once, every
//!   run SUCCEEDED; the queue (the durable consumer) has nothing left;
//! - **a long agent outlives the consumer timeout**: RabbitMQ's
//!   `consumer_timeout` at 10 s, an agent of 20 s: the message is
//!   acknowledged when its record commits, the channel stays open, the
//!   message is never redelivered (one record);
//! - **back-pressure**: 10,000 messages queued for a task whose agent takes
//!   1 s: its waiting runs (sampled from `/metrics`) never exceed
//!   `max_pending`, and all 10,000 end recorded;
//! - a message that is not JSON is recorded SKIPPED `invalid_event` and
//!   acknowledged; an AMQP priority raises the run's; a broker that goes
//!   away is said in `/readyz` and `/metrics` and consumed again when it is
//!   back.

use std::time::Duration;

use punchclock_proto::v1 as pb;
use punchclock_tests::brokers::{Nats, Publisher, Rabbit};
use punchclock_tests::etcd::{Etcd, free_port};
use punchclock_tests::{KeepLogsOnPanic, Proc, apply, http_get, list_runs, status, terminal, wait_leader, wait_run};
use serde_json::{Value, json};

fn write(dir: &std::path::Path, name: &str, text: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, text).expect("write");
    p.to_string_lossy().into_owned()
}

/// Records of `task` by outcome, read from the stats of the last hour.
async fn records(addr: &str, task: &str) -> pb::TaskStats {
    let s = punchclock_tests::runs(addr)
        .await
        .get_scheduling_stats(pb::GetSchedulingStatsRequest { task_id: task.into(), since_seconds: 3600 })
        .await
        .expect("stats")
        .into_inner();
    s.tasks.into_iter().find(|t| t.task_id == task).unwrap_or_default()
}

/// Polls `f` every 250 ms until it says true or `within` passes.
async fn eventually<F: std::future::Future<Output = bool>>(within: Duration, mut f: impl FnMut() -> F) -> bool {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if f().await {
            return true;
        }
        if tokio::time::Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

enum Broker {
    Rabbit(Rabbit),
    Nats(Nats),
}

/// 1,000 messages at 50/s with 5 leader kills: one record each.
async fn one_record_per_message_across_leader_kills(name: &str, broker: Broker) {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), name);
    let (config, trigger) = match &broker {
        Broker::Rabbit(r) => {
            r.declare("work").await;
            (format!("brokers:\n  mq: {{amqp: {{url: \"{}\"}}}}\n", r.url()), json!({"type": "queue", "broker": "mq", "queue": "work"}))
        }
        Broker::Nats(n) => {
            n.stream("WORK", &["work.>"]).await;
            (
                format!("brokers:\n  mq: {{nats: {{url: \"{}\"}}}}\n", n.url()),
                json!({"type": "queue", "broker": "mq", "subject": "work.items", "stream": "WORK"}),
            )
        }
    };
    let cfg = write(dir.path(), "config.yaml", &config);
    let etcd = Etcd::start(1).await;
    let ports = [free_port(), free_port(), free_port()];
    let start = |i: usize| Proc::server_with(&etcd.store_url(), &format!("cp{i}"), ports[i], dir.path(), &[], &["--config", &cfg]);
    let mut servers: Vec<Proc> = (0..3).map(start).collect();
    let addrs: Vec<String> = servers.iter().map(|s| s.addr.clone()).collect();
    let _r1 = Proc::runner(&addrs.join(","), "r1", dir.path());
    let first = wait_leader(&addrs, Duration::from_secs(30), |_| true).await;
    apply(
        &first.leader_address,
        json!({"task_id": "work", "agent_id": "true_agent", "trigger": trigger,
               "execution": {"overlap_policy": "queue", "concurrency_limit": 16, "start_timeout_seconds": 600}}),
    )
    .await;

    // The publisher: 1,000 messages at 50/s, each with an id.
    const N: usize = 1000;
    let publish = async {
        let mut tick = tokio::time::interval(Duration::from_millis(20));
        match &broker {
            Broker::Rabbit(r) => {
                let p = Publisher::new(r).await;
                for i in 0..N {
                    tick.tick().await;
                    p.publish("work", json!({"i": i}).to_string().as_bytes(), Some(&format!("m{i}")), None).await;
                }
            }
            Broker::Nats(n) => {
                let js = n.jetstream().await;
                for i in 0..N {
                    tick.tick().await;
                    let mut h = async_nats::HeaderMap::new();
                    h.insert("Nats-Msg-Id", format!("m{i}").as_str());
                    js.publish_with_headers("work.items", h, json!({"i": i}).to_string().into())
                        .await
                        .expect("publish")
                        .await
                        .expect("ack");
                }
            }
        }
    };
    let kills = async {
        let mut leader = first;
        for _ in 0..5 {
            tokio::time::sleep(Duration::from_secs(3)).await;
            let i = servers.iter().position(|s| s.addr == leader.leader_address).expect("leader is ours");
            servers[i].kill9();
            let others: Vec<String> = addrs.iter().filter(|a| **a != addrs[i]).cloned().collect();
            let old = leader.leader_id.clone();
            leader = wait_leader(&others, Duration::from_secs(30), |s| !s.leader_id.is_empty() && s.leader_id != old).await;
            servers[i] = start(i);
        }
        leader
    };
    let ((), leader) = tokio::join!(publish, kills);
    let addr = leader.leader_address;

    // Every message recorded once, every run ended.
    let done = eventually(Duration::from_secs(240), || async {
        let s = records(&addr, "work").await;
        s.fired + s.skipped.values().sum::<u64>() >= N as u64 && s.in_progress == 0
    })
    .await;
    let s = records(&addr, "work").await;
    assert!(done, "not every message was recorded and run within 4 minutes: {s:?}");
    assert_eq!((s.fired, s.succeeded), (N as u64, N as u64), "one run per message, each SUCCEEDED: {s:?}");
    assert!(s.skipped.is_empty(), "{s:?}");
    let runs = list_runs(&addr, "work").await;
    let mut keys: Vec<String> = runs
        .iter()
        .map(|r| serde_json::from_str::<Value>(&r.event_json).expect("event")["key"].as_str().unwrap_or("").to_string())
        .collect();
    keys.sort();
    keys.dedup();
    assert_eq!(keys.len(), N, "each message's id once");
    // Nothing left at the broker.
    match &broker {
        Broker::Rabbit(r) => {
            drop(servers);
            assert!(eventually(Duration::from_secs(30), || async { r.ready("work").await == 0 }).await, "messages left in the queue");
            assert_eq!(r.ready("work").await, 0);
        }
        Broker::Nats(n) => {
            let js = n.jetstream().await;
            let stream = js.get_stream("WORK").await.expect("stream");
            let mut names = stream.consumer_names();
            use futures::StreamExt;
            let durable = names.next().await.expect("a consumer").expect("name");
            let mut c: async_nats::jetstream::consumer::PullConsumer = stream.get_consumer(&durable).await.expect("consumer");
            // A message a killed leader had taken and not acknowledged comes
            // back after the consumer's ack_wait (60 s): the new leader finds
            // its record and acknowledges it.
            let drained = eventually(Duration::from_secs(120), || {
                let c = c.clone();
                async move {
                    let mut c = c;
                    c.info().await.is_ok_and(|i| (i.num_pending, i.num_ack_pending) == (0, 0))
                }
            })
            .await;
            let info = c.info().await.expect("info");
            assert!(drained, "messages left on the stream: {info:?}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_one_record_per_message_across_leader_kills() {
    one_record_per_message_across_leader_kills("queues_rabbit", Broker::Rabbit(Rabbit::start("").await)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_one_record_per_message_across_leader_kills() {
    one_record_per_message_across_leader_kills("queues_nats", Broker::Nats(Nats::start().await)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_agent_outlives_the_consumer_timeout() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "queues_timeout");
    let rabbit = Rabbit::start("consumer_timeout = 10000").await;
    rabbit.declare("long").await;
    let cfg = write(dir.path(), "config.yaml", &format!("brokers:\n  rabbit: {{amqp: {{url: \"{}\"}}}}\n", rabbit.url()));
    let dev = Proc::dev_with(&dir.path().join("data"), 4, &dir.path().join("dev.log"), &["--config", &cfg]);
    apply(
        &dev.addr,
        json!({"task_id": "long", "agent_id": "event_agent", "context": {"params": {"sleep": 20}},
               "trigger": {"type": "queue", "broker": "rabbit", "queue": "long", "format": "raw"}}),
    )
    .await;
    let p = Publisher::new(&rabbit).await;
    p.publish("long", b"work for 20 s", None, None).await;
    let running = wait_run(&dev.addr, "long", Duration::from_secs(30), |r| status(r) == pb::RunStatus::Running).await;
    // Acknowledged when recorded: nothing ready, nothing unacknowledged.
    let unacked = || rabbit.ctl(&["list_queues", "name", "messages_ready", "messages_unacknowledged"]);
    assert!(
        eventually(Duration::from_secs(10), || async {
            unacked().lines().any(|l| l.split_whitespace().collect::<Vec<_>>() == ["long", "0", "0"])
        })
        .await,
        "{}",
        unacked()
    );
    let done = wait_run(&dev.addr, "long", Duration::from_secs(60), terminal).await;
    assert_eq!(done.run_id, running.run_id);
    assert_eq!(status(&done), pb::RunStatus::Succeeded, "{done:#?}");
    let result: Value = serde_json::from_str(&done.result_json).expect("result");
    assert_eq!(result["event"]["body"], "d29yayBmb3IgMjAgcw==", "raw bytes, base64");
    // The consumer outlived the 10 s timeout: same channel, no redelivery.
    assert!(!rabbit.log().contains("consumer ack timed out"), "{}", rabbit.log());
    assert!(!dev.log_text().contains("cannot consume"), "the consumer was cut off");
    assert_eq!(list_runs(&dev.addr, "long").await.len(), 1, "redelivered");
    let consumers = rabbit.ctl(&["list_consumers", "queue_name"]);
    assert!(consumers.lines().any(|l| l.trim() == "long"), "{consumers}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_messages_never_pass_max_pending() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "queues_backpressure");
    let rabbit = Rabbit::start("").await;
    rabbit.declare("flood").await;
    let cfg = write(dir.path(), "config.yaml", &format!("brokers:\n  rabbit: {{amqp: {{url: \"{}\"}}}}\n", rabbit.url()));
    // An agent of its own, so the pending gauge is this task's.
    let agents = write(
        dir.path(),
        "agents.yaml",
        "agents:\n  second_agent:\n    type: process\n    command: [\"sleep\", \"1\"]\n  event_agent:\n    type: process\n    command: [\"python3\", \"tests/agents/event.py\"]\n",
    );
    let dev =
        Proc::dev_agents(&dir.path().join("data"), 100, &dir.path().join("dev.log"), std::path::Path::new(&agents), &["--config", &cfg]);
    let http = dev.http_addr();
    const MAX_PENDING: u64 = 200;
    apply(
        &dev.addr,
        json!({"task_id": "flood", "agent_id": "second_agent",
               "trigger": {"type": "queue", "broker": "rabbit", "queue": "flood", "max_pending": MAX_PENDING},
               "execution": {"overlap_policy": "queue", "concurrency_limit": 200, "start_timeout_seconds": 3600}}),
    )
    .await;
    const N: usize = 10_000;
    Publisher::new(&rabbit).await.publish_all("flood", (0..N).map(|i| (json!({"n": i}).to_string().into_bytes(), format!("f{i}")))).await;
    let pending = || {
        let (_, text) = http_get(&http, "/metrics");
        text.lines()
            .find(|l| l.starts_with("punchclock_runs_pending{") && l.contains("second_agent"))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let (mut max, mut samples) = (0, 0);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(600);
    loop {
        max = max.max(pending());
        samples += 1;
        let s = records(&dev.addr, "flood").await;
        if s.fired as usize >= N && s.in_progress == 0 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "not done in 10 minutes: {s:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!("{samples} samples of the waiting runs; at most {max}");
    assert!(max <= MAX_PENDING, "{max} runs waiting; max_pending is {MAX_PENDING}");
    assert!(max >= MAX_PENDING / 2, "the limit was never approached ({max}): the test proves nothing");
    let s = records(&dev.addr, "flood").await;
    assert_eq!((s.fired, s.succeeded), (N as u64, N as u64), "{s:?}");
    assert_eq!(rabbit.ready("flood").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_messages_priorities_and_a_broker_that_goes_away() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "queues_broker_down");
    let mut rabbit = Rabbit::start("").await;
    rabbit.declare("jobs").await;
    let cfg = write(dir.path(), "config.yaml", &format!("brokers:\n  rabbit: {{amqp: {{url: \"{}\"}}}}\n", rabbit.url()));
    let dev = Proc::dev_with(&dir.path().join("data"), 4, &dir.path().join("dev.log"), &["--config", &cfg]);
    let http = dev.http_addr();
    apply(
        &dev.addr,
        json!({"task_id": "jobs", "agent_id": "event_agent", "trigger": {"type": "queue", "broker": "rabbit", "queue": "jobs"},
               "execution": {"overlap_policy": "queue", "priority": 10}}),
    )
    .await;
    // Not JSON: SKIPPED invalid_event, acknowledged. A priority: added.
    {
        let p = Publisher::new(&rabbit).await;
        p.publish("jobs", b"not json", Some("bad"), None).await;
        p.publish("jobs", br#"{"ok": true}"#, Some("good"), Some(5)).await;
    }
    let bad = wait_run(&dev.addr, "jobs", Duration::from_secs(30), |r| status(r) == pb::RunStatus::Skipped).await;
    assert_eq!(bad.skip_reason, "invalid_event");
    assert!(bad.error.contains("not a JSON document"), "{}", bad.error);
    let good = wait_run(&dev.addr, "jobs", Duration::from_secs(30), |r| status(r) == pb::RunStatus::Succeeded).await;
    assert_eq!(good.priority, 15, "the task's 10 and the message's 5");
    let result: Value = serde_json::from_str(&good.result_json).expect("result");
    assert_eq!((result["event"]["body"].clone(), result["event"]["key"].as_str()), (json!({"ok": true}), Some("good")));
    assert!(eventually(Duration::from_secs(10), || async { rabbit.ready("jobs").await == 0 }).await);
    let up = |want: &'static str| {
        let http = http.clone();
        move || {
            let http = http.clone();
            async move { http_get(&http, "/metrics").1.lines().any(|l| l.starts_with("punchclock_queue_consumer_up{") && l.ends_with(want)) }
        }
    };
    assert!(eventually(Duration::from_secs(10), up(" 1")).await, "the consumer says it is up");

    // The broker goes away: said, retried; scheduling goes on.
    rabbit.kill();
    assert!(eventually(Duration::from_secs(30), up(" 0")).await, "the consumer says it is down");
    let (code, ready) = http_get(&http, "/readyz");
    assert_eq!(code, 200, "the control plane stays ready: {ready}");
    let ready: Value = serde_json::from_str(&ready).expect("readyz");
    assert!(
        ready["degraded"].as_array().is_some_and(|d| d.iter().any(|x| x.as_str().unwrap_or("").contains("jobs/rabbit/jobs"))),
        "{ready}"
    );
    punchclock_tests::cli(&dev.addr, &["task", "trigger", "jobs", "--key", "while-down"]);
    wait_run(&dev.addr, "jobs", Duration::from_secs(30), |r| r.run_id.ends_with("while-down") && terminal(r)).await;

    // Back: consumed again.
    rabbit.restart().await;
    rabbit.declare("jobs").await;
    Publisher::new(&rabbit).await.publish("jobs", br#"{"after": "restart"}"#, Some("after"), None).await;
    let after = wait_run(&dev.addr, "jobs", Duration::from_secs(90), |r| r.event_json.contains("\"after\"") && terminal(r)).await;
    assert_eq!(status(&after), pb::RunStatus::Succeeded, "{after:#?}");
    assert!(eventually(Duration::from_secs(10), up(" 1")).await);
}

/// Found by an attack: a NATS trigger whose subject changed got a new
/// durable from the stream's start (every retained message again, as new
/// runs), and a stream deleted under a consumer went unnoticed (up, no
/// runs). Now the new durable starts after the old one's acknowledged
/// floor and the old one is deleted; a deleted stream is said in
/// `/readyz` and `/metrics`, and consumed again once it is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_subject_change_and_a_deleted_stream() {
    use futures::StreamExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "queues_nats_change");
    let nats = Nats::start().await;
    nats.stream("DATA", &["data.>"]).await;
    let cfg = write(dir.path(), "config.yaml", &format!("brokers:\n  nats: {{nats: {{url: \"{}\"}}}}\n", nats.url()));
    let dev = Proc::dev_with(&dir.path().join("data"), 4, &dir.path().join("dev.log"), &["--config", &cfg]);
    let http = dev.http_addr();
    let task = |subject: &str| {
        json!({"task_id": "t", "agent_id": "event_agent", "trigger": {"type": "queue", "broker": "nats", "stream": "DATA", "subject": subject},
               "execution": {"overlap_policy": "queue"}})
    };
    let js = nats.jetstream().await;
    for (subject, body) in [("data.b", "b1"), ("data.b", "b2"), ("data.a", "a1"), ("data.a", "a2"), ("data.a", "a3")] {
        js.publish(subject, json!({"m": body}).to_string().into()).await.expect("publish").await.expect("ack");
    }
    apply(&dev.addr, task("data.a")).await;
    let done = |n: usize| {
        let addr = dev.addr.clone();
        move || {
            let addr = addr.clone();
            async move { list_runs(&addr, "t").await.iter().filter(|r| terminal(r)).count() >= n }
        }
    };
    assert!(eventually(Duration::from_secs(60), done(3)).await, "the three data.a messages ran");
    // Acknowledged up to the last data.a message (stream sequence 5).
    let durables = || async {
        let stream = nats.jetstream().await.get_stream("DATA").await.expect("stream");
        let mut out = Vec::new();
        let mut infos = stream.consumers();
        while let Some(i) = infos.next().await {
            let i = i.expect("info");
            out.push((i.name.clone(), i.ack_floor.stream_sequence, i.num_ack_pending));
        }
        out
    };
    assert!(
        eventually(Duration::from_secs(10), || async { durables().await.iter().any(|d| d.1 == 5 && d.2 == 0) }).await,
        "{:?}",
        durables().await
    );
    let old = durables().await;
    assert_eq!(old.len(), 1, "{old:?}");

    // The subject widens: the old data.b messages are not run, a new one is.
    apply(&dev.addr, task("data.>")).await;
    js.publish("data.b", json!({"m": "b3"}).to_string().into()).await.expect("publish").await.expect("ack");
    assert!(eventually(Duration::from_secs(60), done(4)).await, "b3 ran");
    let now = durables().await;
    assert!(now.len() == 1 && now[0].0 != old[0].0, "one durable, the new one: {now:?}");
    let runs = list_runs(&dev.addr, "t").await;
    let bodies: Vec<String> =
        runs.iter().map(|r| serde_json::from_str::<Value>(&r.event_json).expect("event")["body"]["m"].to_string()).collect();
    assert_eq!(runs.len(), 4, "a1 a2 a3 b3 and nothing replayed: {bodies:?}");
    assert!(bodies.iter().any(|b| b.contains("b3")) && !bodies.iter().any(|b| b.contains("b1") || b.contains("b2")), "{bodies:?}");

    // The stream is deleted under the consumer: said; back, consumed again.
    let up = |want: &'static str| {
        let http = http.clone();
        move || {
            let http = http.clone();
            async move { http_get(&http, "/metrics").1.lines().any(|l| l.starts_with("punchclock_queue_consumer_up{") && l.ends_with(want)) }
        }
    };
    js.delete_stream("DATA").await.expect("delete stream");
    assert!(eventually(Duration::from_secs(30), up(" 0")).await, "the consumer says it is down");
    let (_, ready) = http_get(&http, "/readyz");
    assert!(ready.contains("t/nats/DATA"), "{ready}");
    nats.stream("DATA", &["data.>"]).await;
    js.publish("data.c", json!({"m": "c1"}).to_string().into()).await.expect("publish").await.expect("ack");
    assert!(eventually(Duration::from_secs(90), done(5)).await, "consumed again once the stream is back");
    assert!(eventually(Duration::from_secs(10), up(" 1")).await);
}
