//! Bench (issue 21): events into runs on `punchclock dev` (a release build,
//! the embedded store), one process of each kind, real HTTP and AMQP:
//!
//! - **webhook request → run committed**: `--requests` POSTs (default
//!   2,000) from `--senders` concurrent clients (default 8) to a webhook
//!   (`auth: none`, a dedup header): each request's latency — its `202`
//!   comes only after the run's record is committed — p50/p99/max, and
//!   requests/s;
//! - **RabbitMQ → runs**: messages published at `--rate` a second (default
//!   1,000) for `--seconds` (default 20) into a queue a task consumes,
//!   each carrying its publish time in a header; a `WatchRuns` stream sees
//!   each run as it is committed: commit lag (seen − published) p50/p99/
//!   max, runs recorded a second over the window, and the loss (published
//!   − recorded, which must be 0).
//!
//! The tasks' agent is one no runner offers, so their runs stay PENDING:
//! what is measured is the scheduler's own path (routing, dedup lookup,
//! admission, the fenced commit, the acknowledgement), not agent processes.
//!
//! Usage: `bench-events [--bin PATH] [--requests N] [--senders N] [--rate N] [--seconds N]`

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use punchclock_tests::brokers::Rabbit;
use punchclock_tests::{Proc, apply, watch_runs};
use serde_json::{Value, json};

struct Opts {
    bin: PathBuf,
    requests: usize,
    senders: usize,
    rate: usize,
    seconds: u64,
}

fn opts() -> Opts {
    let mut o =
        Opts { bin: punchclock_tests::repo_root().join("target/release/punchclock"), requests: 2000, senders: 8, rate: 1000, seconds: 20 };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < args.len() {
        let v = args.get(i + 1).cloned().unwrap_or_default();
        match args[i].as_str() {
            "--bin" => o.bin = PathBuf::from(v),
            "--requests" => o.requests = v.parse().expect("--requests N"),
            "--senders" => o.senders = v.parse().expect("--senders N"),
            "--rate" => o.rate = v.parse().expect("--rate N"),
            "--seconds" => o.seconds = v.parse().expect("--seconds N"),
            other => {
                panic!("unknown argument {other}; usage: bench-events [--bin PATH] [--requests N] [--senders N] [--rate N] [--seconds N]")
            }
        }
        i += 2;
    }
    o
}

/// Nearest-rank percentile of sorted values.
fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil().max(1.0) as usize;
    sorted[rank.min(sorted.len()) - 1]
}

fn now_ns() -> u128 {
    std::time::SystemTime::UNIX_EPOCH.elapsed().map(|d| d.as_nanos()).unwrap_or_default()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let o = opts();
    // reqwest's rustls wants a crypto provider installed.
    let _ = rustls::crypto::ring::default_provider().install_default();
    assert!(o.bin.exists(), "{} missing: cargo build --release --workspace --bins first (make bench-events does)", o.bin.display());
    let dir = tempfile::tempdir().expect("tempdir");
    let rabbit = Rabbit::start("").await;
    rabbit.declare("bench").await;
    let cfg = dir.path().join("config.yaml");
    std::fs::write(&cfg, format!("brokers:\n  rabbit: {{amqp: {{url: \"{}\"}}}}\n", rabbit.url())).expect("config");
    // The local runner offers an agent no task uses: runs stay PENDING.
    let agents = dir.path().join("agents.yaml");
    std::fs::write(&agents, "agents:\n  idle_agent:\n    type: process\n    command: [\"true\"]\n").expect("agents");
    let data = dir.path().join("data");
    let args: Vec<String> = vec![
        "dev".into(),
        "--data-dir".into(),
        data.to_string_lossy().into(),
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--http-listen".into(),
        "127.0.0.1:0".into(),
        "--agents".into(),
        agents.to_string_lossy().into(),
        "--config".into(),
        cfg.to_string_lossy().into(),
    ];
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let dev = Proc::start_bin(&o.bin, &argv, &[("PUNCHCLOCK_LOG", "warn")], &dir.path().join("dev.log"), true);
    let http = dev.http_addr();
    let pending = json!({"overlap_policy": "queue", "concurrency_limit": 10000, "start_timeout_seconds": 86400});
    apply(
        &dev.addr,
        json!({"task_id": "hook", "agent_id": "nobody", "execution": pending,
               "trigger": {"type": "webhook", "path": "/hooks/bench", "auth": "none", "dedup": {"header": "X-Id"}}}),
    )
    .await;
    apply(
        &dev.addr,
        json!({"task_id": "mq", "agent_id": "nobody", "execution": pending,
               "trigger": {"type": "queue", "broker": "rabbit", "queue": "bench", "max_pending": 100000, "prefetch": 500}}),
    )
    .await;
    println!("bench-events: {} (dev, embedded store), RabbitMQ node on :{}", o.bin.display(), rabbit.port);

    // Webhook request → run committed.
    let client = reqwest::Client::builder().pool_max_idle_per_host(o.senders).build().expect("client");
    let url = format!("http://{http}/hooks/bench");
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let started = Instant::now();
    let senders: Vec<_> = (0..o.senders)
        .map(|_| {
            let (client, url, next, n) = (client.clone(), url.clone(), next.clone(), o.requests);
            tokio::spawn(async move {
                let mut lat = Vec::new();
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if i >= n {
                        return lat;
                    }
                    let t = Instant::now();
                    let r = client.post(&url).header("X-Id", format!("d{i}")).body(format!("{{\"i\": {i}}}")).send().await.expect("POST");
                    assert_eq!(r.status().as_u16(), 202, "{:?}", r.text().await);
                    lat.push(t.elapsed().as_secs_f64() * 1000.0);
                }
            })
        })
        .collect();
    let mut lat: Vec<f64> = Vec::new();
    for s in senders {
        lat.extend(s.await.expect("sender"));
    }
    let secs = started.elapsed().as_secs_f64();
    lat.sort_by(|a, b| a.total_cmp(b));
    println!();
    println!("webhook request -> run committed ({} requests, {} senders)", o.requests, o.senders);
    println!(
        "  latency ms  p50 {:.2}  p99 {:.2}  max {:.2}   {:.0} requests/s",
        pct(&lat, 50.0),
        pct(&lat, 99.0),
        pct(&lat, 100.0),
        o.requests as f64 / secs
    );

    // RabbitMQ → runs.
    let mut watch = watch_runs(&dev.addr, "mq").await;
    let total = o.rate * o.seconds as usize;
    let seen: Arc<tokio::sync::Mutex<HashMap<String, f64>>> = Arc::default();
    let watcher = {
        let seen = seen.clone();
        tokio::spawn(async move {
            while let Some(Ok(r)) = watch.next().await {
                let at = now_ns();
                let Ok(ev) = serde_json::from_str::<Value>(&r.event_json) else { continue };
                let Some(sent) = ev["headers"]["x-published-ns"].as_str().and_then(|v| v.parse::<u128>().ok()) else { continue };
                let mut s = seen.lock().await;
                s.entry(r.run_id.clone()).or_insert(((at.saturating_sub(sent)) as f64) / 1e6);
                if s.len() >= total {
                    return;
                }
            }
        })
    };
    let (_c, ch) = rabbit.channel().await;
    ch.confirm_select(Default::default()).await.expect("confirms");
    let t0 = Instant::now();
    let mut confirms = Vec::with_capacity(total);
    let per_tick = (o.rate / 100).max(1);
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    let mut sent = 0;
    while sent < total {
        tick.tick().await;
        for _ in 0..per_tick.min(total - sent) {
            let mut h = lapin::types::FieldTable::default();
            h.insert("x-published-ns".into(), lapin::types::AMQPValue::LongString(now_ns().to_string().into()));
            let props = lapin::BasicProperties::default().with_message_id(format!("m{sent}").into()).with_headers(h);
            confirms.push(
                ch.basic_publish("".into(), "bench".into(), Default::default(), format!("{{\"n\": {sent}}}").as_bytes(), props)
                    .await
                    .expect("publish"),
            );
            sent += 1;
        }
    }
    let publish_secs = t0.elapsed().as_secs_f64();
    for c in confirms {
        c.await.expect("confirm");
    }
    let _ = tokio::time::timeout(Duration::from_secs(60), watcher).await;
    let elapsed = t0.elapsed().as_secs_f64();
    let seen = seen.lock().await;
    let mut lags: Vec<f64> = seen.values().copied().collect();
    lags.sort_by(|a, b| a.total_cmp(b));
    println!();
    println!("RabbitMQ -> runs ({total} messages published at {} /s over {publish_secs:.1} s)", o.rate);
    let runs_per_s = seen.len() as f64 / elapsed.max(publish_secs);
    let lost = total.saturating_sub(seen.len());
    println!(
        "  commit lag ms  p50 {:.2}  p99 {:.2}  max {:.2}   {:.0} runs/s   recorded {}   lost {}",
        pct(&lags, 50.0),
        pct(&lags, 99.0),
        pct(&lags, 100.0),
        runs_per_s,
        seen.len(),
        lost
    );
    // The targets of issue 21, side by side with what this run measured.
    let verdict = |ok: bool| if ok { "met" } else { "MISSED" };
    println!(
        "  target >= 1,000 events/s with zero loss: {} ({:.0}/s offered at {} /s, {lost} lost)   target p99 commit lag <= 50 ms: {} ({:.2} ms)",
        verdict(o.rate >= 1000 && lost == 0 && runs_per_s >= 0.95 * o.rate as f64),
        runs_per_s,
        o.rate,
        verdict(pct(&lags, 99.0) <= 50.0),
        pct(&lags, 99.0)
    );
    drop(dev);
}
