//! `make bench-ui` (issue 36): the dashboard's server time, measured from a
//! client on loopback (the request's whole time: rendering and reads).
//!
//! - the tasks page (100 tasks with their last 20 slots) with 10,000 and
//!   100,000 tasks: the first page, a page deep in the list, a substring
//!   search — p50/p99 over 100 requests each;
//! - a task page whose history holds 100,000 runs: its newest runs, and a
//!   page deep in them through the cursor;
//! - 100 browsers' live streams open for a minute while about 300 runs a
//!   second happen: the server's resident memory before, at its peak and
//!   after, and what each stream received (a stream that fell behind gets a
//!   `reload` event, never silence).
//!
//! Main before this issue had no dashboard: `GET /` was a 404; the figures
//! stand alone. Usage: `bench-ui [TASKS...]` (default 10000 100000).
//! The server is `PUNCHCLOCK_BIN` (`make bench-ui` builds it `--release`).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use punchclock_control_plane::election::Leadership;
use punchclock_control_plane::model::RunRecord;
use punchclock_control_plane::model::run::{RunStatus, TriggerKind};
use punchclock_control_plane::repo::{Keys, Repo, StoreOp};
use punchclock_control_plane::store::embedded::EmbeddedStore;
use punchclock_proto::v1 as pb;
use punchclock_tests::{Proc, apply_all, rss_bytes, tasks};

const SAMPLES: usize = 100;

fn pct(mut v: Vec<f64>, p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(((v.len() as f64 - 1.0) * p).round() as usize).copied().unwrap_or(0.0)
}

/// `GET path` on `addr` `SAMPLES` times: (p50, p99) ms; every answer 200.
fn timed(addr: &str, path: &str) -> (f64, f64) {
    let mut ms = Vec::with_capacity(SAMPLES);
    for _ in 0..SAMPLES {
        let t = Instant::now();
        let (code, body) = punchclock_tests::http_get(addr, path);
        ms.push(t.elapsed().as_secs_f64() * 1000.0);
        assert_eq!(code, 200, "GET {path}: {}", body.chars().take(300).collect::<String>());
    }
    (pct(ms.clone(), 0.5), pct(ms, 0.99))
}

fn row(what: &str, (p50, p99): (f64, f64)) {
    println!("  {what:<58} {p50:>8.1} / {p99:<8.1}");
}

async fn apply_fleet(addr: &str, n: usize) {
    let specs: Vec<String> = (0..n)
        .map(|i| {
            serde_json::json!({"task_id": format!("fleet-{i:06}"), "agent_id": "light_agent", "labels": {"team": format!("t{}", i % 50)},
                               "trigger": {"type": "cron", "expr": "0 0 1 1 *", "timezone": "Asia/Shanghai"}})
            .to_string()
        })
        .collect();
    let messages: Vec<pb::ApplyTasksRequest> =
        specs.chunks(1000).map(|c| pb::ApplyTasksRequest { spec_json: c.to_vec(), ..Default::default() }).collect();
    tasks(addr).await.apply_tasks(tokio_stream::iter(messages)).await.expect("apply the fleet");
}

fn busy_run(i: i64, t0: DateTime<Utc>) -> RunRecord {
    let at = t0 + chrono::Duration::seconds(i * 60);
    let mut r = RunRecord::pending(format!("fleet-000000.{i:07}"), "fleet-000000", "light_agent", TriggerKind::Cron, at, at);
    r.status = if i % 11 == 0 { RunStatus::Failed } else { RunStatus::Succeeded };
    r.dispatched_at = Some(at);
    r.actual_started_at = Some(at + chrono::Duration::milliseconds(40));
    r.finished_at = Some(at + chrono::Duration::seconds(3));
    r
}

/// What one SSE client saw.
#[derive(Default)]
struct Seen {
    runs: u64,
    reloads: u64,
    /// The stream ended (EOF or an error) before `stop` without a `reload`
    /// event first: a session dropped silently.
    silent_end: bool,
}

/// One SSE client: counts `run` and `reload` events until `stop`.
fn stream(addr: String, stop: Arc<std::sync::atomic::AtomicBool>) -> Seen {
    let mut seen = Seen::default();
    let mut s = TcpStream::connect(&addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_millis(500))).expect("timeout");
    write!(s, "GET /ui/live HTTP/1.1\r\nHost: {addr}\r\nAccept: text/event-stream\r\n\r\n").expect("request");
    let mut r = BufReader::new(s);
    let mut line = String::new();
    while !stop.load(Ordering::Relaxed) {
        line.clear();
        match r.read_line(&mut line) {
            Ok(0) => {
                seen.silent_end = seen.reloads == 0;
                break;
            }
            Ok(_) if line.starts_with("event: run") => seen.runs += 1,
            Ok(_) if line.starts_with("event: reload") => seen.reloads += 1,
            Ok(_) => {}
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
            Err(_) => {
                seen.silent_end = seen.reloads == 0;
                break;
            }
        }
    }
    let _ = r.get_mut().read(&mut [0u8; 1]);
    seen
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let sizes: Vec<usize> = {
        let v: Vec<usize> = std::env::args().skip(1).filter_map(|s| s.parse().ok()).collect();
        if v.is_empty() { vec![10_000, 100_000] } else { v }
    };
    println!("bench-ui: the dashboard's pages, server time seen from loopback, ms p50 / p99 over {SAMPLES} requests");
    for n in &sizes {
        let dir = tempfile::tempdir().expect("tempdir");
        let data = dir.path().join("data");
        let mut dev = Proc::dev_logged(&data, 8, &dir.path().join("dev.log"));
        let t = Instant::now();
        apply_fleet(&dev.addr, *n).await;
        println!();
        println!("{n} tasks (applied in {:.1} s):", t.elapsed().as_secs_f64());
        let http = dev.http_addr();
        row("tasks page, first 100 with their last 20 slots", timed(&http, "/ui/tasks"));
        row("tasks page, 100 from the middle (after=)", timed(&http, &format!("/ui/tasks?after=fleet-{:06}", n / 2)));
        row("search \"fleet-000777\" (a substring of the id)", timed(&http, "/ui/tasks?q=fleet-000777"));
        if n != sizes.last().unwrap_or(n) {
            continue;
        }
        // One task's history of 100,000 runs, written as the leader writes them.
        dev.kill9();
        {
            let store = Arc::new(EmbeddedStore::open(&data).await.expect("open"));
            let repo = Repo::new(store, Keys::default());
            let lead = Leadership { token: u64::MAX / 2, fence: Vec::new() };
            let t0: DateTime<Utc> = "2026-06-01T00:00:00Z".parse().expect("t0");
            for chunk in (0..100_000i64).collect::<Vec<_>>().chunks(1000) {
                let group: Vec<StoreOp> = chunk.iter().map(|i| StoreOp::CreateRun(Box::new(busy_run(*i, t0)))).collect();
                repo.commit(&lead, vec![group]).await.expect("commit");
            }
        }
        let dev = Proc::dev_logged(&data, 8, &dir.path().join("dev2.log"));
        let http = dev.http_addr();
        println!();
        println!("a task with 100,000 runs in its history:");
        row("task page, its newest 50 runs", timed(&http, "/ui/tasks/fleet-000000"));
        row("task page, 50 runs a month back (since/until)", timed(&http, "/ui/tasks/fleet-000000?until=30d"));
        row("run page", timed(&http, "/ui/runs/fleet-000000.0050000"));
        drop(dev);
    }

    // 100 live streams for a minute while about 300 runs a second happen.
    let dir = tempfile::tempdir().expect("tempdir");
    let dev = Proc::dev_logged(&dir.path().join("data"), 64, &dir.path().join("dev.log"));
    let http = dev.http_addr();
    let idle = rss_bytes(dev.pid());
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let clients: Vec<_> = (0..100)
        .map(|_| {
            let (a, s) = (http.clone(), stop.clone());
            std::thread::spawn(move || stream(a, s))
        })
        .collect();
    let specs = (0..300).map(|i| {
        serde_json::json!({"task_id": format!("live-{i:03}"), "agent_id": "true_agent", "trigger": {"type": "interval", "every": "1s"}})
    });
    apply_all(&tasks(&dev.addr).await, specs).await;
    let t = Instant::now();
    let mut peak = idle;
    while t.elapsed() < Duration::from_secs(60) {
        peak = peak.max(rss_bytes(dev.pid()));
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let answering = punchclock_tests::runs(&dev.addr)
        .await
        .list_runs(pb::ListRunsRequest { page_size: 1, status: pb::RunStatus::Succeeded as i32, ..Default::default() })
        .await
        .is_ok();
    stop.store(true, Ordering::Relaxed);
    let seen: Vec<Seen> = clients.into_iter().map(|c| c.join().expect("stream thread")).collect();
    let after = rss_bytes(dev.pid());
    let mb = |b: u64| b as f64 / 1e6;
    let per: Vec<u64> = seen.iter().map(|s| s.runs).collect();
    println!();
    println!("100 live streams for 60 s, 300 tasks every second (API answering after: {answering}):");
    println!("  server RSS idle / peak / after: {:.0} / {:.0} / {:.0} MB", mb(idle), mb(peak), mb(after));
    println!(
        "  run events per stream: min {} / max {} ({:.0} a second); streams told to reload (fell behind): {}; dropped silently: {}",
        per.iter().min().copied().unwrap_or(0),
        per.iter().max().copied().unwrap_or(0),
        per.iter().sum::<u64>() as f64 / 100.0 / 60.0,
        seen.iter().filter(|s| s.reloads > 0).count(),
        seen.iter().filter(|s| s.silent_end).count(),
    );
    println!("  (main before: no dashboard, `GET /` answered 404)");
}
