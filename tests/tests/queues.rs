//! Issue 21, queue triggers on real brokers (Debian's `rabbitmq-server`
//! and `nats-server`, each started here on free loopback ports), with real
//! control planes, runners, agents and etcd:
//!
//! - **exactly one record per message across failover**: 1,000 messages
//!   published at 50/s to RabbitMQ, and separately to NATS JetStream,
//!   while the leader of 3 control planes on etcd is killed (SIGKILL) 5
//!   times: the task has exactly 1,000 records, each message's once, every
//!   run SUCCEEDED; the queue (the durable consumer) has nothing left; on
//!   NATS the slowest message is recorded within 30 s of its sending (a
//!   killed leader's messages come back after the 10 s ack wait; 60 s
//!   before issue 34);
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
//!   back;
//! - issue 34, NATS: id-less messages of a stream deleted and made again
//!   each make a run (they took the old stream's ids and were lost); a
//!   killed leader's pulled messages are recorded within 15 s of their
//!   publish; messages held through a 15 s commit (a frozen disk) are not
//!   redelivered; a durable an earlier version made keeps the old ids of
//!   the messages it delivered and gets the 10 s ack wait.

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

    // The publisher: 1,000 messages at 50/s, each with an id and the time
    // it was sent.
    const N: usize = 1000;
    let body = |i: usize| json!({"i": i, "at": chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Nanos, true)}).to_string();
    let publish = async {
        let mut tick = tokio::time::interval(Duration::from_millis(20));
        match &broker {
            Broker::Rabbit(r) => {
                let p = Publisher::new(r).await;
                for i in 0..N {
                    tick.tick().await;
                    p.publish("work", body(i).as_bytes(), Some(&format!("m{i}")), None).await;
                }
            }
            Broker::Nats(n) => {
                let js = n.jetstream().await;
                for i in 0..N {
                    tick.tick().await;
                    let mut h = async_nats::HeaderMap::new();
                    h.insert("Nats-Msg-Id", format!("m{i}").as_str());
                    js.publish_with_headers("work.items", h, body(i).into()).await.expect("publish").await.expect("ack");
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
    let slowest = runs
        .iter()
        .map(|r| {
            let e: Value = serde_json::from_str(&r.event_json).expect("event");
            let at = |v: &Value| chrono::DateTime::parse_from_rfc3339(v.as_str().expect("a time")).expect("RFC 3339");
            (at(&e["received_at"]) - at(&e["body"]["at"])).to_std().unwrap_or_default()
        })
        .max();
    println!("the slowest message was recorded {slowest:?} after it was sent");
    if let Broker::Nats(_) = &broker {
        // What a killed leader held comes back after the durable's 10 s ack
        // wait (it took the 60 s of the old one before issue 34); the
        // 15 s bound is `nats_a_killed_leaders_messages_are_recorded_within_15_s`'s.
        assert!(slowest.is_some_and(|d| d <= Duration::from_secs(30)), "{slowest:?}");
    }
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
            // back after the consumer's ack_wait (10 s): the new leader finds
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

/// The one durable of `stream`; `None` while the stream or its durable
/// does not exist.
async fn durable_info(nats: &Nats, stream: &str) -> Option<async_nats::jetstream::consumer::Info> {
    use futures::StreamExt;
    let stream = nats.jetstream().await.get_stream(stream).await.ok()?;
    let mut infos = stream.consumers();
    infos.next().await?.ok()
}

/// The one durable of `stream`: (last stream sequence delivered, messages
/// not yet delivered, delivered and not acknowledged).
async fn durable_state(nats: &Nats, stream: &str) -> Option<(u64, u64, usize)> {
    durable_info(nats, stream).await.map(|i| (i.delivered.stream_sequence, i.num_pending, i.num_ack_pending))
}

/// Issue 34, point 1: a NATS message without `Nats-Msg-Id` was keyed
/// `{stream}:{sequence}`. A stream deleted and made again (a restore, a
/// move, `nats stream rm/add`) starts its sequences over, so its messages
/// took the ids of the old stream's, were found "duplicates" and
/// acknowledged: 50 of 50 lost, with no record. The id now carries the
/// message's publish time as well.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_a_recreated_stream_loses_no_message() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "queues_nats_recreated");
    let nats = Nats::start().await;
    nats.stream("WORK", &["work.>"]).await;
    let cfg = write(dir.path(), "config.yaml", &format!("brokers:\n  nats: {{nats: {{url: \"{}\"}}}}\n", nats.url()));
    let dev = Proc::dev_with(&dir.path().join("data"), 8, &dir.path().join("dev.log"), &["--config", &cfg]);
    apply(
        &dev.addr,
        json!({"task_id": "w", "agent_id": "true_agent",
               "trigger": {"type": "queue", "broker": "nats", "subject": "work.items", "stream": "WORK"},
               "execution": {"overlap_policy": "queue", "concurrency_limit": 8}}),
    )
    .await;
    let js = nats.jetstream().await;
    let publish = |round: usize| {
        let js = js.clone();
        async move {
            for i in 0..50 {
                let body = json!({"round": round, "i": i}).to_string();
                js.publish("work.items", body.into()).await.expect("publish").await.expect("ack");
            }
        }
    };
    let drained = || async { durable_state(&nats, "WORK").await == Some((50, 0, 0)) };

    publish(1).await;
    assert!(eventually(Duration::from_secs(60), drained).await, "the first 50: {:?}", durable_state(&nats, "WORK").await);
    assert_eq!(records(&dev.addr, "w").await.fired, 50);

    // The stream made again: its sequences start over at 1.
    js.delete_stream("WORK").await.expect("delete stream");
    nats.stream("WORK", &["work.>"]).await;
    publish(2).await;
    // The consumer finds its durable gone, makes one on the new stream from
    // its start and acknowledges all 50 — each after its record commits.
    assert!(eventually(Duration::from_secs(90), drained).await, "the second 50: {:?}", durable_state(&nats, "WORK").await);
    let s = records(&dev.addr, "w").await;
    assert_eq!((s.fired, s.skipped.values().sum::<u64>()), (100, 0), "one run per message, none taken for an old one: {s:?}");
    let runs = list_runs(&dev.addr, "w").await;
    let mut seen: Vec<(u64, u64)> = runs
        .iter()
        .map(|r| {
            let e: Value = serde_json::from_str(&r.event_json).expect("event");
            (e["body"]["round"].as_u64().expect("round"), e["body"]["i"].as_u64().expect("i"))
        })
        .collect();
    seen.sort();
    seen.dedup();
    assert_eq!(seen.len(), 100, "each message of both rounds once");
}

/// Issue 34, point 7: messages a leader had pulled when it was killed came
/// back only after the consumer's 60 s ack wait (the last of 3,000 was
/// recorded 55 s after its publish). 600 messages, 50 every half second;
/// `dev` is killed (-9) while JetStream counts at least 10 messages
/// delivered to it and not acknowledged (checked with the process stopped,
/// so it cannot acknowledge them meanwhile), and started again on its
/// data: every message is recorded once, each within 15 s of its publish,
/// some of them from a redelivery.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_a_killed_leaders_messages_are_recorded_within_15_s() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "queues_nats_killed");
    let nats = Nats::start().await;
    nats.stream("WORK", &["work.>"]).await;
    let cfg = write(dir.path(), "config.yaml", &format!("brokers:\n  nats: {{nats: {{url: \"{}\"}}}}\n", nats.url()));
    let data = dir.path().join("data");
    let mut dev = Proc::dev_with(&data, 16, &dir.path().join("dev.log"), &["--config", &cfg]);
    apply(
        &dev.addr,
        json!({"task_id": "w", "agent_id": "true_agent",
               "trigger": {"type": "queue", "broker": "nats", "subject": "work.items", "stream": "WORK"},
               "execution": {"overlap_policy": "queue", "concurrency_limit": 16, "start_timeout_seconds": 600}}),
    )
    .await;

    // 600 messages, 50 every half second, each with its publish time.
    const N: usize = 600;
    let js = nats.jetstream().await;
    let publish = async {
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        for burst in 0..N / 50 {
            tick.tick().await;
            let mut acks = Vec::new();
            for i in burst * 50..(burst + 1) * 50 {
                let mut h = async_nats::HeaderMap::new();
                h.insert("Nats-Msg-Id", format!("m{i}").as_str());
                let body = json!({"i": i, "at": chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Nanos, true)});
                acks.push(js.publish_with_headers("work.items", h, body.to_string().into()).await.expect("publish"));
            }
            for a in acks {
                a.await.expect("ack");
            }
        }
    };
    let kill = async {
        tokio::time::sleep(Duration::from_secs(2)).await;
        // Stopped, it cannot acknowledge: what JetStream counts pending
        // then is what the kill leaves unacknowledged.
        let mut held = 0;
        for _ in 0..300 {
            dev.signal(libc::SIGSTOP);
            held = durable_state(&nats, "WORK").await.map_or(0, |d| d.2);
            if held >= 10 {
                break;
            }
            dev.signal(libc::SIGCONT);
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(held >= 10, "dev never held 10 messages unacknowledged");
        dev.kill9();
        println!("dev killed holding {held} messages");
        Proc::dev_with(&data, 16, &dir.path().join("dev2.log"), &["--config", &cfg])
    };
    let ((), dev) = tokio::join!(publish, kill);

    // Every message recorded once (long enough to see the old 60 s wait).
    let all = eventually(Duration::from_secs(120), || async { records(&dev.addr, "w").await.fired as usize >= N }).await;
    let s = records(&dev.addr, "w").await;
    assert!(all, "not every message was recorded within 2 minutes: {s:?}");
    assert_eq!((s.fired, s.skipped.values().sum::<u64>()), (N as u64, 0), "{s:?}");
    let runs = list_runs(&dev.addr, "w").await;
    let mut seen = std::collections::BTreeSet::new();
    let (mut latest, mut redelivered) = (Duration::ZERO, 0);
    for r in &runs {
        let e: Value = serde_json::from_str(&r.event_json).expect("event");
        assert!(seen.insert(e["body"]["i"].as_u64().expect("i")), "a message recorded twice: {e}");
        let at = |v: &Value| chrono::DateTime::parse_from_rfc3339(v.as_str().expect("a time")).expect("RFC 3339");
        let took = (at(&e["received_at"]) - at(&e["body"]["at"])).to_std().unwrap_or_default();
        latest = latest.max(took);
        if e["attributes"]["delivered"].as_str().and_then(|d| d.parse::<u32>().ok()).unwrap_or(0) > 1 {
            redelivered += 1;
        }
    }
    println!("{redelivered} messages recorded from a redelivery; the slowest recorded {latest:?} after its publish");
    assert_eq!(seen.len(), N);
    assert!(redelivered > 0, "no held message was recorded from a redelivery: the test proves nothing");
    assert!(latest <= Duration::from_secs(15), "a message was recorded {latest:?} after its publish");
}

/// Issue 34, upgrading: versions before the publish time in NATS ids
/// keyed a message `{stream}:{sequence}`, and made their durables with a
/// 60 s ack wait. A durable such a version made, holding 5 messages it
/// delivered and never acknowledged (their records may be committed under
/// the old ids): the new version marks the durable, those 5 keep their
/// old ids (so a record committed under one is found), later messages get
/// the new ones, and the durable's ack wait becomes 10 s — the 5 come
/// back within it, not after a minute.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_a_durable_of_an_earlier_version_keeps_its_messages_ids() {
    use async_nats::jetstream::consumer::{AckPolicy, pull};
    use futures::StreamExt;
    use sha2::Digest;
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "queues_nats_upgrade");
    let nats = Nats::start().await;
    nats.stream("WORK", &["work.>"]).await;
    let js = nats.jetstream().await;
    let publish = |from: usize| {
        let js = js.clone();
        async move {
            for i in from..from + 5 {
                js.publish("work.items", json!({"i": i}).to_string().into()).await.expect("publish").await.expect("ack");
            }
        }
    };
    publish(1).await;
    // The durable as an earlier version made it for task `w` on
    // `work.items`, and its 5 messages delivered and not acknowledged.
    let durable = format!("punchclock-w-{}", &hex::encode(sha2::Sha256::digest(b"work.items"))[..8]);
    {
        let stream = nats.jetstream().await.get_stream("WORK").await.expect("stream");
        let old: async_nats::jetstream::consumer::PullConsumer = stream
            .create_consumer(pull::Config {
                durable_name: Some(durable.clone()),
                filter_subject: "work.items".into(),
                ack_policy: AckPolicy::Explicit,
                ack_wait: Duration::from_secs(60),
                max_ack_pending: 100,
                ..Default::default()
            })
            .await
            .expect("old durable");
        let held: Vec<_> = old.fetch().max_messages(5).messages().await.expect("fetch").collect().await;
        assert_eq!(held.len(), 5);
    }
    assert_eq!(durable_state(&nats, "WORK").await, Some((5, 0, 5)));

    let cfg = write(dir.path(), "config.yaml", &format!("brokers:\n  nats: {{nats: {{url: \"{}\"}}}}\n", nats.url()));
    let dev = Proc::dev_with(&dir.path().join("data"), 8, &dir.path().join("dev.log"), &["--config", &cfg]);
    apply(
        &dev.addr,
        json!({"task_id": "w", "agent_id": "true_agent",
               "trigger": {"type": "queue", "broker": "nats", "subject": "work.items", "stream": "WORK"},
               "execution": {"overlap_policy": "queue"}}),
    )
    .await;
    let started = tokio::time::Instant::now();
    publish(6).await;
    let all = eventually(Duration::from_secs(30), || async { records(&dev.addr, "w").await.fired >= 10 }).await;
    assert!(all, "{:?} after {:?}", records(&dev.addr, "w").await, started.elapsed());
    println!("all 10 recorded {:?} after the new version started consuming", started.elapsed());
    let runs = list_runs(&dev.addr, "w").await;
    let mut keys: Vec<(u64, String)> = runs
        .iter()
        .map(|r| {
            let e: Value = serde_json::from_str(&r.event_json).expect("event");
            (e["body"]["i"].as_u64().expect("i"), e["key"].as_str().expect("key").to_string())
        })
        .collect();
    keys.sort();
    assert_eq!(keys.len(), 10, "{keys:?}");
    for (i, key) in &keys {
        if *i <= 5 {
            assert_eq!(key, &format!("WORK:{i}"), "a message the old version delivered keeps its old id");
        } else {
            let (head, published) = key.rsplit_once(':').expect("three parts");
            assert_eq!(head, format!("WORK:{i}"), "{key}");
            assert!(published.parse::<u64>().is_ok_and(|ns| ns > 1_000_000_000_000_000_000), "nanoseconds: {key}");
        }
    }
    let info = nats.jetstream().await.get_stream("WORK").await.expect("stream").consumer_info(&durable).await.expect("durable");
    assert_eq!(info.config.ack_wait, Duration::from_secs(10));
    assert!(info.config.description.as_deref().is_some_and(|d| d.ends_with("after stream sequence 5")), "{:?}", info.config.description);
}

/// Unmounts a test's file system when the test ends, however it ends.
struct Mount(std::path::PathBuf);

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// A file system frozen (`fsfreeze`: every write to it waits) until this
/// is dropped — before the processes writing to it, which cannot die
/// while a write of theirs waits.
struct Frozen(std::path::PathBuf);

impl Frozen {
    fn new(path: &std::path::Path) -> Frozen {
        let ok = std::process::Command::new("fsfreeze").arg("-f").arg(path).status().expect("run fsfreeze");
        assert!(ok.success(), "fsfreeze -f {}", path.display());
        Frozen(path.to_path_buf())
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        let _ = std::process::Command::new("fsfreeze").arg("-u").arg(&self.0).status();
    }
}

/// Issue 34, point 7's other side: with a 10 s ack wait, messages a
/// consumer holds while their batch's commit is slow must not be
/// redelivered. `dev`'s data is on an ext4 image the test freezes (root:
/// mount, `fsfreeze`), so the commit of 10 messages' records waits 15 s:
/// their in-progress acks keep JetStream from redelivering any (the
/// durable's `num_redelivered` stays 0), and once the disk thaws each is
/// recorded once and acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_messages_held_through_a_slow_commit_are_not_redelivered() {
    use std::process::Command;
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "queues_nats_slow_commit");
    let (img, disk) = (dir.path().join("disk.img"), dir.path().join("disk"));
    std::fs::create_dir(&disk).expect("mkdir");
    std::fs::File::create(&img).and_then(|f| f.set_len(64 << 20)).expect("image");
    assert!(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(&img).status().expect("run mkfs.ext4").success(), "mkfs.ext4");
    let mounted = Command::new("mount").args(["-o", "loop"]).arg(&img).arg(&disk).status().expect("run mount");
    assert!(mounted.success(), "this test mounts an ext4 image and needs root (or CAP_SYS_ADMIN)");
    let _mount = Mount(disk.clone());

    let nats = Nats::start().await;
    nats.stream("WORK", &["work.>"]).await;
    let cfg = write(dir.path(), "config.yaml", &format!("brokers:\n  nats: {{nats: {{url: \"{}\"}}}}\n", nats.url()));
    let dev = Proc::dev_with(&disk.join("data"), 8, &dir.path().join("dev.log"), &["--config", &cfg]);
    apply(
        &dev.addr,
        json!({"task_id": "w", "agent_id": "true_agent",
               "trigger": {"type": "queue", "broker": "nats", "subject": "work.items", "stream": "WORK"},
               "execution": {"overlap_policy": "queue"}}),
    )
    .await;
    let js = nats.jetstream().await;
    let publish = |from: usize| {
        let js = js.clone();
        async move {
            for i in from..from + 10 {
                js.publish("work.items", json!({"i": i}).to_string().into()).await.expect("publish").await.expect("ack");
            }
        }
    };
    publish(0).await;
    assert!(eventually(Duration::from_secs(30), || async { durable_state(&nats, "WORK").await == Some((10, 0, 0)) }).await);

    let frozen = Frozen::new(&disk);
    publish(10).await;
    // Pulled and held: their records' commit waits on the disk.
    assert!(
        eventually(Duration::from_secs(10), || async { durable_state(&nats, "WORK").await == Some((20, 0, 10)) }).await,
        "{:?}",
        durable_state(&nats, "WORK").await
    );
    let held_since = tokio::time::Instant::now();
    // Half as long again as the ack wait: without in-progress acks the 10
    // would be redelivered by now.
    while held_since.elapsed() < Duration::from_secs(15) {
        let info = durable_info(&nats, "WORK").await.expect("durable");
        assert_eq!((info.num_redelivered, info.num_ack_pending), (0, 10), "held {:?}", held_since.elapsed());
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    drop(frozen);
    assert!(
        eventually(Duration::from_secs(30), || async { durable_state(&nats, "WORK").await == Some((20, 0, 0)) }).await,
        "{:?}",
        durable_state(&nats, "WORK").await
    );
    assert_eq!(durable_info(&nats, "WORK").await.expect("durable").num_redelivered, 0);
    let s = records(&dev.addr, "w").await;
    assert_eq!((s.fired, s.skipped.values().sum::<u64>()), (20, 0), "{s:?}");
}
