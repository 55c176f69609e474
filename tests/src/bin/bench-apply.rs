//! Bench (issue 8, acceptance 1): `punchclock task apply -f FILE` of a
//! whole task file through the CLI, against `dev` (embedded store) and a
//! `server` on a real etcd. For each size it prints the wall time of the
//! first apply (every task created), of the same file again (every task
//! unchanged), and the CLI's peak resident memory next to the file size.
//!
//! Usage: `bench-apply [--dev 10000,100000] [--etcd 10000]` (run with
//! `PUNCHCLOCK_BIN` set to a release build: `make bench-apply`).

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use punchclock_tests::etcd::{Etcd, free_port};
use punchclock_tests::{Proc, bin, repo_root, wait_leader};

fn sizes(flag: &str, default: &[usize]) -> Vec<usize> {
    let args: Vec<String> = std::env::args().collect();
    match args.iter().position(|a| a == flag) {
        Some(i) => args.get(i + 1).map(|v| v.split(',').filter_map(|n| n.parse().ok()).collect()).unwrap_or_default(),
        None => default.to_vec(),
    }
}

/// `n` cron tasks of about 300 bytes each, as one JSON array.
fn task_file(dir: &Path, n: usize) -> std::path::PathBuf {
    let specs: Vec<serde_json::Value> = (0..n)
        .map(|i| {
            serde_json::json!({"task_id": format!("bench{i:06}"), "agent_id": "ok_agent",
                "trigger": {"type": "cron", "expr": "0 30 8 * * *", "timezone": "Asia/Shanghai"},
                "execution": {"timeout_seconds": 600, "max_retries": 3},
                "context": {"params": {"region": "cn-north", "n": i}}})
        })
        .collect();
    let path = dir.join(format!("tasks-{n}.json"));
    std::fs::write(&path, serde_json::to_string(&specs).expect("json")).expect("write task file");
    path
}

/// Runs the CLI's apply; returns (wall seconds, peak RSS in MB, the
/// outcome counts it printed). The peak is the CLI's own `VmHWM`, polled
/// while it runs: `wait4`'s `ru_maxrss` would count this bench's memory,
/// which a forked child carries into its `exec`.
fn apply(addr: &str, file: &Path) -> (f64, f64, String) {
    let started = Instant::now();
    let mut child = Command::new(bin())
        .args(["task", "apply", "-f", &file.to_string_lossy()])
        .env("PUNCHCLOCK_ENDPOINT", addr)
        .current_dir(repo_root())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("run cli");
    let stdout = child.stdout.take().expect("stdout");
    let lines = std::thread::spawn(move || std::io::read_to_string(stdout).unwrap_or_default());
    let status_path = format!("/proc/{}/status", child.id());
    let mut peak_kb = 0u64;
    let status = loop {
        if let Ok(s) = std::fs::read_to_string(&status_path)
            && let Some(kb) =
                s.lines().find(|l| l.starts_with("VmHWM:")).and_then(|l| l.split_whitespace().nth(1)).and_then(|v| v.parse().ok())
        {
            peak_kb = peak_kb.max(kb);
        }
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    };
    let secs = started.elapsed().as_secs_f64();
    let text = lines.join().unwrap_or_default();
    assert!(status.success(), "apply failed");
    let mut counts = std::collections::BTreeMap::new();
    for l in text.lines() {
        *counts.entry(l.rsplit(' ').next().unwrap_or("").to_string()).or_insert(0) += 1;
    }
    (secs, peak_kb as f64 / 1024.0, format!("{counts:?}"))
}

fn row(target: &str, n: usize, file: &Path, addr: &str) {
    let mb = std::fs::metadata(file).map(|m| m.len()).unwrap_or(0) as f64 / 1e6;
    let (first, rss, outcomes) = apply(addr, file);
    let (again, _, again_outcomes) = apply(addr, file);
    println!(
        "{target:<5} {n:>7} tasks ({mb:>5.1} MB file): apply {first:>6.2} s {outcomes}, again {again:>6.2} s {again_outcomes}, CLI peak RSS {rss:.0} MB"
    );
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let dir = tempfile::tempdir().expect("tempdir");
    println!("bench-apply: `punchclock task apply -f FILE` through the CLI, wall time per apply");
    for n in sizes("--dev", &[10_000, 100_000]) {
        let file = task_file(dir.path(), n);
        let data = dir.path().join(format!("dev-{n}"));
        let dev = Proc::dev_logged(&data, 8, &dir.path().join(format!("dev-{n}.log")));
        row("dev", n, &file, &dev.addr);
    }
    for n in sizes("--etcd", &[10_000]) {
        let file = task_file(dir.path(), n);
        let etcd = Etcd::start(1).await;
        let server = Proc::server(&etcd.store_url(), "cp0", free_port(), dir.path());
        wait_leader(std::slice::from_ref(&server.addr), std::time::Duration::from_secs(30), |_| true).await;
        row("etcd", n, &file, &server.addr);
    }
}
