//! Bench (issue 2, acceptance 4): 10,000 cron tasks registered with a real
//! `punchclock server` on the embedded store; prints the registration rate,
//! then the idle control plane's CPU use between fires and its memory.
//! Targets: under 1% of a core, under 200 MB resident. Exits 1 if missed.
//!
//! Usage: `cargo run -p punchclock-tests --bin bench-idle [TASKS] [IDLE_SECONDS]`

use std::time::{Duration, Instant};

use chrono::{Timelike, Utc};
use futures::StreamExt;
use punchclock_proto::v1 as pb;
use punchclock_tests::{Proc, tasks};

fn cpu_ticks(pid: i32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("read /proc/PID/stat");
    let after = stat.rsplit(')').next().expect("stat format");
    let f: Vec<&str> = after.split_whitespace().collect();
    // Fields after the comm: state is [0]; utime is field 14 overall → [11], stime → [12].
    f[11].parse::<u64>().expect("utime") + f[12].parse::<u64>().expect("stime")
}

fn status_kb(pid: i32, key: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("read /proc/PID/status");
    s.lines().find(|l| l.starts_with(key)).and_then(|l| l.split_whitespace().nth(1)).and_then(|v| v.parse().ok()).unwrap_or(0)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let mut args = std::env::args().skip(1);
    let n: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(10_000);
    let idle_secs: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(30);
    let dir = tempfile::tempdir().expect("tempdir");
    let store = format!("embedded:{}", dir.path().join("data").display());
    let server = Proc::start(&["server", "--store", &store, "--listen", "127.0.0.1:0"], &dir.path().join("server.log"), true);
    let pid = server.pid();
    let addr = server.addr.clone();

    // Daily slots three hours or more from now: nothing fires while we measure.
    let hour = (Utc::now().hour() + 3) % 24;
    let started = Instant::now();
    let client = tasks(&addr).await;
    let results: Vec<Result<(), String>> = futures::stream::iter(0..n)
        .map(|i| {
            let mut c = client.clone();
            let spec = serde_json::json!({
                "task_id": format!("bench_{i:05}"),
                "agent_id": "bench_agent",
                "trigger": {"type": "cron", "expr": format!("{} {} {} * * *", i % 60, (i / 60) % 60, (hour + (i / 3600) as u32 % 6) % 24), "timezone": "Asia/Shanghai"},
            });
            async move { c.apply_task(pb::ApplyTaskRequest { spec_json: spec.to_string(), dry_run: false, task: None }).await.map(|_| ()).map_err(|e| e.to_string()) }
        })
        .buffer_unordered(16)
        .collect()
        .await;
    let failed: Vec<&String> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    assert!(failed.is_empty(), "{} registrations failed, first: {}", failed.len(), failed[0]);
    let reg = started.elapsed();
    let mut listed = 0;
    let mut token = String::new();
    loop {
        let page = client
            .clone()
            .list_tasks(pb::ListTasksRequest { page_size: 1000, page_token: token, ..Default::default() })
            .await
            .expect("list")
            .into_inner();
        listed += page.tasks.len();
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
    }
    assert_eq!(listed, n, "every task registered");

    // The engine takes in every definition through its watch: measure once
    // the process has settled (a 1 s window under 2% of a core, or 60 s).
    let hz = 100.0; // USER_HZ on Linux
    let settle = Instant::now();
    loop {
        let (t, w) = (cpu_ticks(pid), Instant::now());
        tokio::time::sleep(Duration::from_secs(1)).await;
        let pct = (cpu_ticks(pid) - t) as f64 / hz / w.elapsed().as_secs_f64() * 100.0;
        if pct < 2.0 || settle.elapsed() > Duration::from_secs(60) {
            println!("bench-idle: settled after {:.1} s", settle.elapsed().as_secs_f64());
            break;
        }
    }
    let t0 = cpu_ticks(pid);
    let w0 = Instant::now();
    tokio::time::sleep(Duration::from_secs(idle_secs)).await;
    let ticks = cpu_ticks(pid) - t0;
    let wall = w0.elapsed().as_secs_f64();
    let cpu_pct = ticks as f64 / hz / wall * 100.0;
    let rss_mb = status_kb(pid, "VmRSS:") as f64 / 1024.0;
    let hwm_mb = status_kb(pid, "VmHWM:") as f64 / 1024.0;

    println!(
        "bench-idle: {n} cron tasks registered in {:.1} s ({:.0} tasks/s, 16 in flight)",
        reg.as_secs_f64(),
        n as f64 / reg.as_secs_f64()
    );
    println!("bench-idle: idle CPU over {wall:.0} s: {cpu_pct:.2}% of one core ({ticks} ticks)   target < 1%");
    println!("bench-idle: resident memory {rss_mb:.1} MB (peak {hwm_mb:.1} MB)   target < 200 MB");
    let ok = cpu_pct < 1.0 && rss_mb < 200.0;
    println!("bench-idle: {}", if ok { "within targets" } else { "TARGET MISSED" });
    drop(server);
    if !ok {
        std::process::exit(1);
    }
}
