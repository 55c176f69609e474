//! Issue 19, findings 4 and 5: no client can take the leader's memory.
//! Real `punchclock dev` processes, their resident memory sampled from
//! `/proc` while the attack runs.
//!
//! - `stalled_watchers_hold_bounded_memory`: 100 `WatchRuns` clients (each
//!   its own connection, a reader token would do) that never read, with
//!   35,000 runs stored: each copied every run into its own queue and the
//!   control plane went from 106 MiB to 5.4 GiB. Now memory stays within
//!   50 MiB of idle, a watcher that fell behind catches up with a new
//!   listing when it reads again, and a reading watcher sees every change.
//! - `a_sink_answering_a_huge_error_body_holds_bounded_memory`: six sinks
//!   answering a failed run's notifications with a 300 MB `500` peaked at
//!   2,012 MiB (the whole body was read); now within 50 MiB of idle, and
//!   the notification's error still says `HTTP 500`.
//! - `a_hanging_sink_s_backlog_is_capped`: behind a sink that never
//!   answers, the outbox grew without bound; now past
//!   `max_pending_per_sink` new notifications for it are dead-lettered at
//!   once with the reason, and `punchclock_notifications_pending` shows the
//!   backlog.

use std::time::Duration;

use punchclock_control_plane::model::run::{TriggerKind, slot_run_id};
use punchclock_control_plane::model::{RunRecord, RunStatus};
use punchclock_control_plane::repo::{Keys, encode_run};
use punchclock_control_plane::store::embedded::EmbeddedStore;
use punchclock_control_plane::store::{KvStore, Txn, TxnOp};
use punchclock_proto::v1 as pb;
use punchclock_tests::{Proc, apply, cli, endpoint, http_get, rss_bytes, status, wait_run, with_token};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_stream::StreamExt;

const MIB: u64 = 1024 * 1024;

/// 35,000 finished runs of 70 tasks, each with a 1 KiB output tail, written
/// straight to an embedded store before `dev` opens it.
async fn seed_runs(data: &std::path::Path) {
    let store = EmbeddedStore::open(data).await.expect("open store");
    let keys = Keys::default();
    let tail = "o".repeat(1024);
    let mut ops = Vec::new();
    for i in 0..35_000i64 {
        let slot = chrono::DateTime::from_timestamp(1_780_000_000 + i, 0).expect("t");
        let task = format!("hist{:02}", i % 70);
        let mut run = RunRecord::pending(slot_run_id(&task, slot), &task, "true_agent", TriggerKind::Cron, slot, slot);
        run.status = RunStatus::Succeeded;
        run.finished_at = Some(slot);
        run.stdout_tail = tail.clone();
        ops.push(TxnOp::put(keys.run(&run.run_id), encode_run(&run).expect("encode")));
        if ops.len() == 1000 {
            store.txn(Txn { success: std::mem::take(&mut ops), ..Txn::default() }).await.expect("seed");
        }
    }
    if !ops.is_empty() {
        store.txn(Txn { success: ops, ..Txn::default() }).await.expect("seed");
    }
}

/// The largest resident size of `pid` over `d`, sampled every 100 ms.
async fn peak_rss(pid: i32, d: Duration) -> u64 {
    let end = tokio::time::Instant::now() + d;
    let mut peak = 0;
    while tokio::time::Instant::now() < end {
        peak = peak.max(rss_bytes(pid));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    peak
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_watchers_hold_bounded_memory() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    seed_runs(&data).await;
    let dev = Proc::dev(&data);
    apply(&dev.addr, json!({"task_id": "live", "agent_id": "true_agent", "execution": {"concurrency_limit": 100}})).await;
    // A watcher that reads: it must see every change, attack or not.
    let mut reader = punchclock_tests::watch_runs(&dev.addr, "live").await;
    // The seeded store is one of an earlier version: the leader indexes
    // its runs once (issue 35) before "idle" means idle.
    assert!(punchclock_tests::wait_log(&dev, "time index of runs built", Duration::from_secs(120)).await, "the time index was never built");
    let idle = peak_rss(dev.pid(), Duration::from_secs(3)).await;

    // 100 watchers of every run, each on its own connection, never reading.
    let mut stalled = Vec::new();
    for _ in 0..100 {
        let ch = with_token(endpoint(&dev.addr).connect().await.expect("connect"));
        let mut c = pb::run_service_client::RunServiceClient::new(ch);
        let s = c.watch_runs(pb::WatchRunsRequest { task_id: String::new(), run_id: String::new() }).await.expect("watch").into_inner();
        stalled.push(s);
    }
    // Live changes meanwhile: 300 runs (about 1,200 changes, more than a
    // watcher's queue) while they stall.
    for i in 0..300 {
        cli(&dev.addr, &["task", "trigger", "live", "--key", &format!("k{i}")]);
    }
    let peak = peak_rss(dev.pid(), Duration::from_secs(20)).await;
    println!("idle {} MiB, peak with 100 stalled watchers {} MiB", idle / MIB, peak / MIB);
    assert!(peak < idle + 50 * MIB, "memory: idle {} MiB, peak {} MiB", idle / MIB, peak / MIB);

    // The reading watcher saw every run succeed (bounded generously: on a
    // loaded 2-core machine 300 runs through 8 slots take a while).
    let mut done = std::collections::HashSet::new();
    tokio::time::timeout(Duration::from_secs(180), async {
        while done.len() < 300 {
            let r = reader.next().await.expect("watch open").expect("watch item");
            if status(&r) == pb::RunStatus::Succeeded {
                done.insert(r.run_id);
            }
        }
    })
    .await
    .expect("the reading watcher sees all 300 runs succeed");

    // A stalled watcher that reads again fell behind: it catches up with a
    // new listing, a page at a time, and sees every live run's end.
    let mut s = stalled.pop().expect("one");
    let mut seen = std::collections::HashSet::new();
    tokio::time::timeout(Duration::from_secs(180), async {
        while seen.len() < 300 {
            let r = s.next().await.expect("the watch stays open").expect("watch item");
            if r.task_id == "live" && status(&r) == pb::RunStatus::Succeeded {
                seen.insert(r.run_id);
            }
        }
    })
    .await
    .expect("the stalled watcher catches up");
    drop(stalled);
    // The control plane still answers.
    wait_run(&dev.addr, "live", Duration::from_secs(10), |r| status(r) == pb::RunStatus::Succeeded).await;
}

/// An HTTP sink on a free port: reads each request, then answers `500`
/// with a body of `body_bytes` (zeros, written in 64 KiB pieces until the
/// client goes away) — or, with `body_bytes` `None`, never answers.
async fn sink(body_bytes: Option<u64>) -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = listener.local_addr().expect("addr").port();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 * 1024];
                // The request: headers, then the body by Content-Length.
                let mut got = Vec::new();
                let head_end = loop {
                    let Ok(n) = conn.read(&mut buf).await else { return };
                    if n == 0 {
                        return;
                    }
                    got.extend_from_slice(&buf[..n]);
                    if let Some(i) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                        break i + 4;
                    }
                };
                let head = String::from_utf8_lossy(&got[..head_end]).to_ascii_lowercase();
                let len: usize =
                    head.lines().find_map(|l| l.strip_prefix("content-length:").map(|v| v.trim().parse().unwrap_or(0))).unwrap_or(0);
                let mut have = got.len() - head_end;
                while have < len {
                    let Ok(n) = conn.read(&mut buf).await else { return };
                    if n == 0 {
                        return;
                    }
                    have += n;
                }
                let Some(total) = body_bytes else {
                    // Hang: hold the connection until the client gives up.
                    let _ = conn.read(&mut buf).await;
                    return;
                };
                let head = format!("HTTP/1.1 500 Internal Server Error\r\nContent-Length: {total}\r\nContent-Type: text/plain\r\n\r\n");
                if conn.write_all(head.as_bytes()).await.is_err() {
                    return;
                }
                let zeros = vec![b'0'; 64 * 1024];
                let mut sent = 0u64;
                while sent < total {
                    let n = zeros.len().min((total - sent) as usize);
                    if conn.write_all(&zeros[..n]).await.is_err() {
                        return;
                    }
                    sent += n as u64;
                }
            });
        }
    });
    port
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sink_answering_a_huge_error_body_holds_bounded_memory() {
    let dir = tempfile::tempdir().expect("tempdir");
    let port = sink(Some(300 * 1024 * 1024)).await;
    let cfg = dir.path().join("punchclock.yaml");
    let mut yaml =
        String::from("notifications:\n  max_attempts: 2\n  retry_base_seconds: 1\n  retry_cap_seconds: 1\n  timeout_seconds: 60\nsinks:\n");
    for i in 0..6 {
        yaml.push_str(&format!("  s{i}:\n    url: http://127.0.0.1:{port}/hook{i}\n"));
    }
    std::fs::write(&cfg, yaml).expect("config");
    let dev = Proc::dev_with(&dir.path().join("data"), 8, &dir.path().join("dev.log"), &["--config", &cfg.to_string_lossy()]);
    let sinks: Vec<String> = (0..6).map(|i| format!("webhook://s{i}")).collect();
    apply(&dev.addr, json!({"task_id": "boom", "agent_id": "fail_agent", "notify": {"on_failure": sinks}})).await;
    let idle = peak_rss(dev.pid(), Duration::from_secs(3)).await;
    cli(&dev.addr, &["task", "trigger", "boom"]);
    let peak = peak_rss(dev.pid(), Duration::from_secs(15)).await;
    println!("idle {} MiB, peak while six sinks answer 300 MB errors {} MiB", idle / MIB, peak / MIB);
    assert!(peak < idle + 50 * MIB, "memory: idle {} MiB, peak {} MiB", idle / MIB, peak / MIB);
    let listed: serde_json::Value =
        serde_json::from_str(&cli(&dev.addr, &["notifications", "list", "-o", "json"])).expect("notifications JSON");
    let listed = listed.as_array().cloned().unwrap_or_default();
    assert_eq!(listed.len(), 6, "{listed:#?}");
    for n in &listed {
        let e = n["last_error"].as_str().unwrap_or("");
        assert!(e.starts_with("HTTP 500"), "the error still says what the sink answered: {n}");
        assert!(e.len() < 400, "and only a little of the body: {} bytes", e.len());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_sink_s_backlog_is_capped() {
    let dir = tempfile::tempdir().expect("tempdir");
    let hang = sink(None).await;
    let cfg = dir.path().join("punchclock.yaml");
    std::fs::write(
        &cfg,
        format!(
            "notifications:\n  timeout_seconds: 300\n  per_sink_concurrency: 2\n  max_pending_per_sink: 10\nsinks:\n  hang:\n    url: http://127.0.0.1:{hang}/\n"
        ),
    )
    .expect("config");
    let dev = Proc::dev_with(&dir.path().join("data"), 8, &dir.path().join("dev.log"), &["--config", &cfg.to_string_lossy()]);
    apply(
        &dev.addr,
        json!({"task_id": "boom", "agent_id": "fail_agent", "trigger": {"type": "interval", "every": "1s"},
               "execution": {"concurrency_limit": 10}, "notify": {"on_failure": ["webhook://hang"]}}),
    )
    .await;
    // Failures keep coming; the sink answers none of them.
    let list = |status: &str| -> Vec<serde_json::Value> {
        let out = cli(&dev.addr, &["notifications", "list", "--status", status, "-o", "json"]);
        serde_json::from_str::<serde_json::Value>(&out).expect("json").as_array().cloned().unwrap_or_default()
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    while list("dead").len() < 10 {
        assert!(tokio::time::Instant::now() < deadline, "no notification was dead-lettered for the backlog");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let dead = list("dead");
    assert!(dead.iter().all(|n| n["last_error"].as_str().unwrap_or("").contains("max_pending_per_sink")), "{dead:#?}");
    assert!(dead.iter().all(|n| n["attempts"] == 0), "dead-lettered without a delivery attempt: {dead:#?}");
    let pending = list("pending").len();
    assert!(pending <= 10, "the backlog stays at the cap: {pending}");
    let (code, metrics) = http_get(&dev.http_addr(), "/metrics");
    assert_eq!(code, 200);
    let gauge = metrics
        .lines()
        .find(|l| l.starts_with("punchclock_notifications_pending{sink=\"hang\"}"))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no pending gauge for the sink: {metrics}"));
    assert!((1.0..=10.0).contains(&gauge), "gauge {gauge}");
}
