//! Bench (issue 35): run history at a million runs, through the history
//! stores themselves (in-process: the store, no gRPC).
//!
//! - embedded (redb, the `dev` store): N runs written as the leader writes
//!   them (each with its time index entries), then a listing page of 100,
//!   newest first, of all tasks and of one task, at random depths
//!   (p50/p99), beside the same listing as main before this issue answered
//!   it (every run read and sorted; `ListRuns` then had no page token);
//!   and an export (every run, pages of 1,000) in runs/s.
//! - the server while exporting: `punchclock dev` on that store, `runs
//!   export` of every run through gRPC: runs/s, and the server's and the
//!   CLI's resident memory before, at the peak and after (sampled every
//!   100 ms) — flat, where main before answered at most 1,000 runs a call.
//! - PostgreSQL (a server started here, as the tests do): the same N runs
//!   recorded by the archive's batched upsert, the same pages and export.
//! - etcd's database after 100,000 runs (each created, then finished, as
//!   the leader writes them), without and with `--history postgres://`
//!   (the mover's loop: recorded in PostgreSQL, deleted from etcd): its size
//!   as written and after compaction and defragmentation.
//!
//! Usage: `bench-history [RUNS [ETCD_RUNS]]` (default 1,000,000 and 100,000).
//! The server is `PUNCHCLOCK_BIN` (`make bench-history` builds it with
//! `--release`).

use std::sync::Arc;
use std::time::Instant;

use chrono::{DateTime, Duration, Utc};
use punchclock_control_plane::election::Leadership;
use punchclock_control_plane::model::run::TriggerKind;
use punchclock_control_plane::model::{RunRecord, RunStatus};
use punchclock_control_plane::repo::history::kv::KvHistory;
use punchclock_control_plane::repo::history::postgres::{PgHistory, PgSpec};
use punchclock_control_plane::repo::history::{Cursor, HistoryQuery, HistoryStore, scan};
use punchclock_control_plane::repo::{Keys, Repo, StoreOp};
use punchclock_control_plane::store::embedded::EmbeddedStore;
use punchclock_control_plane::store::etcd::EtcdStore;
use punchclock_tests::{Proc, cli_command, rss_bytes};

const TASKS: i64 = 1000;
const PAGES: usize = 200;

fn run(i: i64, t0: DateTime<Utc>) -> RunRecord {
    let task = format!("t{:04}", i % TASKS);
    let at = t0 + Duration::milliseconds(i * 100);
    let mut r = RunRecord::pending(format!("{task}.{}", at.format("%Y%m%dT%H%M%S%.3fZ")), &task, "agent", TriggerKind::Cron, at, at);
    r.status = if i % 13 == 0 { RunStatus::Failed } else { RunStatus::Succeeded };
    r.dispatched_at = Some(at);
    r.actual_started_at = Some(at);
    r.finished_at = Some(at + Duration::seconds(2));
    r.result = Some(serde_json::json!({"summary": "ok", "items": i % 97}));
    r
}

fn pct(mut v: Vec<f64>, p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(((v.len() as f64 - 1.0) * p).round() as usize).copied().unwrap_or(0.0)
}

/// Pages of 100 at `PAGES` depths spread over the window: (p50, p99) ms.
async fn pages(h: &dyn HistoryStore, t0: DateTime<Utc>, n: i64, task: &str) -> (f64, f64) {
    let mut ms = Vec::with_capacity(PAGES);
    for k in 0..PAGES as i64 {
        // Deterministic depths: a run's slot as the cursor.
        let i = (k * 7919 * 131) % n;
        let r = run(i, t0);
        let q = HistoryQuery {
            task_id: task.to_string(),
            limit: 100,
            newest_first: true,
            after: Some(Cursor { slot: r.scheduled_at, run_id: r.run_id }),
            ..HistoryQuery::default()
        };
        let t = Instant::now();
        let page = h.page(&q).await.expect("page");
        ms.push(t.elapsed().as_secs_f64() * 1000.0);
        assert!(!page.runs.is_empty() || i < 100 * TASKS, "an empty page at depth {i}");
    }
    (pct(ms.clone(), 0.5), pct(ms, 0.99))
}

async fn export(h: &dyn HistoryStore) -> (u64, f64) {
    let t = Instant::now();
    let n = scan(h, &HistoryQuery { limit: 1000, ..HistoryQuery::default() }, |_| {}).await.expect("export");
    (n, n as f64 / t.elapsed().as_secs_f64())
}

/// `punchclock dev` on the store in `dir`, `runs export` of every run:
/// (runs, runs/s, server RSS idle / peak / after, CLI peak RSS), bytes.
fn export_through_server(dir: &std::path::Path) -> (u64, f64, [u64; 3], u64) {
    use std::io::BufRead;
    let dev = Proc::dev_logged(dir, 8, &dir.with_extension("log"));
    let idle = rss_bytes(dev.pid());
    let t = Instant::now();
    let mut child = cli_command(&dev.addr).args(["runs", "export"]).stdout(std::process::Stdio::piped()).spawn().expect("runs export");
    let stdout = child.stdout.take().expect("stdout");
    let counter = std::thread::spawn(move || std::io::BufReader::new(stdout).lines().map_while(Result::ok).count() as u64);
    let (server, cli) = (dev.pid(), child.id() as i32);
    let (mut peak, mut cli_peak) = (idle, 0);
    while !counter.is_finished() {
        peak = peak.max(rss_bytes(server));
        cli_peak = cli_peak.max(rss_bytes(cli));
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let lines = counter.join().expect("counter");
    let secs = t.elapsed().as_secs_f64();
    assert!(child.wait().expect("wait").success(), "runs export failed");
    (lines, lines as f64 / secs, [idle, peak, rss_bytes(server)], cli_peak)
}

/// etcd's database after `n` runs written as the leader writes them
/// (created PENDING, then finished), the archive's mover run to the end
/// when there is one: (bytes as written, bytes after compaction and
/// defragmentation, runs left in etcd).
async fn etcd_size(n: i64, t0: DateTime<Utc>, archive: Option<&dyn HistoryStore>) -> (i64, i64, u64) {
    let etcd = punchclock_tests::etcd::Etcd::start(1).await;
    let store = Arc::new(EtcdStore::connect(&etcd.endpoints()).await.expect("etcd"));
    let mut repo = Repo::new(store.clone(), Keys::default());
    if archive.is_some() {
        repo = repo.with_archive();
    }
    let lead = Leadership { token: 1, fence: Vec::new() };
    repo.build_history_index(&lead, std::time::Duration::ZERO).await.expect("index");
    for chunk in (0..n).collect::<Vec<_>>().chunks(500) {
        for finished in [false, true] {
            let groups: Vec<Vec<StoreOp>> = chunk
                .chunks(20)
                .map(|c| {
                    c.iter()
                        .map(|i| {
                            let r = run(*i, t0);
                            if finished {
                                StoreOp::PutRun(Box::new(r))
                            } else {
                                let mut p =
                                    RunRecord::pending(r.run_id, &r.task_id, "agent", TriggerKind::Cron, r.scheduled_at, r.scheduled_at);
                                p.dispatched_at = r.dispatched_at;
                                StoreOp::CreateRun(Box::new(p))
                            }
                        })
                        .collect()
                })
                .collect();
            repo.commit(&lead, groups).await.expect("commit");
        }
        if let Some(archive) = archive {
            loop {
                let batch = repo.archive_batch(&lead, 256).await.expect("queue");
                if batch.is_empty() {
                    break;
                }
                let runs: Vec<RunRecord> = batch.iter().map(|(r, _)| r.clone()).collect();
                archive.record(&runs).await.expect("record");
                repo.forget_archived(&lead, &batch).await.expect("forget");
            }
        }
    }
    let left = repo.list_runs("").await.expect("runs").0.len() as u64;
    let mut client = etcd_client::Client::connect(etcd.endpoints(), None).await.expect("etcd client");
    let written = client.status().await.expect("status").db_size();
    let rev = client.get("x", None).await.expect("get").header().expect("header").revision();
    // The client's own call, without the store's request timeout: compacting
    // 200,000 revisions takes longer than a leader's write may.
    client.compact(rev, Some(etcd_client::CompactionOptions::new().with_physical())).await.expect("compact");
    client.defragment().await.expect("defrag");
    (written, client.status().await.expect("status").db_size(), left)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let n: i64 = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(1_000_000);
    let etcd_runs: i64 = std::env::args().nth(2).and_then(|s| s.parse().ok()).unwrap_or(100_000);
    let t0: DateTime<Utc> = "2026-01-01T00:00:00Z".parse().expect("t0");
    println!(
        "bench-history: {n} runs of {TASKS} tasks (~{} B each as JSON)",
        serde_json::to_vec(&run(1, t0)).map(|v| v.len()).unwrap_or(0)
    );

    // Embedded.
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Arc::new(EmbeddedStore::open(dir.path()).await.expect("open"));
    let repo = Repo::new(store.clone(), Keys::default());
    let lead = Leadership { token: 1, fence: Vec::new() };
    repo.build_history_index(&lead, std::time::Duration::ZERO).await.expect("index");
    let t = Instant::now();
    for chunk in (0..n).collect::<Vec<_>>().chunks(1000) {
        let group: Vec<StoreOp> = chunk.iter().map(|i| StoreOp::CreateRun(Box::new(run(*i, t0)))).collect();
        repo.commit(&lead, vec![group]).await.expect("commit");
    }
    let write = n as f64 / t.elapsed().as_secs_f64();
    let file = std::fs::read_dir(dir.path()).expect("dir").flatten().map(|e| e.metadata().map(|m| m.len()).unwrap_or(0)).sum::<u64>();
    let kv = KvHistory::new(repo.clone());
    let (p50, p99) = pages(&kv, t0, n, "").await;
    let (tp50, tp99) = pages(&kv, t0, n, "t0007").await;
    // Main before this issue: every run read, sorted newest first, the first 100.
    let mut old = Vec::new();
    for task in ["", "t0007"] {
        let t = Instant::now();
        let (mut all, _) = repo.list_runs(task).await.expect("list");
        all.sort_by(|a, b| b.scheduled_at.cmp(&a.scheduled_at).then_with(|| b.run_id.cmp(&a.run_id)));
        all.truncate(100);
        old.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    let (exported, rate) = export(&kv).await;
    println!();
    println!("embedded (redb): {write:.0} runs/s written, file {:.0} MB ({:.0} B/run)", file as f64 / 1e6, file as f64 / n as f64);
    println!("  {:<44} {:>12} {:>12}", "", "this build", "main before");
    println!("  {:<44} {:>7.2}/{:<6.2} {:>12}", "page of 100, all tasks, p50/p99 (ms)", p50, p99, format!("{:.0}", old[0]));
    println!("  {:<44} {:>7.2}/{:<6.2} {:>12}", "page of 100, one task, p50/p99 (ms)", tp50, tp99, format!("{:.0}", old[1]));
    println!("  {:<44} {:>12.0} {:>12}", format!("export of {exported} runs (runs/s)"), rate, "at most 1,000");
    drop(kv);
    drop(repo);
    drop(store);

    // The server while exporting every run.
    let (lines, rate, [idle, peak, after], cli_peak) = export_through_server(dir.path());
    let mb = |b: u64| format!("{:.0}", b as f64 / 1e6);
    println!();
    println!("server (`punchclock dev` on that store), `runs export` of every run:");
    println!(
        "  {lines} runs at {rate:.0} runs/s; server RSS idle / peak / after: {} / {} / {} MB; CLI peak {} MB",
        mb(idle),
        mb(peak),
        mb(after),
        mb(cli_peak)
    );
    println!("  (main before: ListRuns answered at most 1,000 runs, no page token)");

    // PostgreSQL.
    let Some(pg) = punchclock_tests::postgres::Postgres::start().await else {
        println!("postgres: not installed (make deps installs it): rows left out");
        return;
    };
    let h = PgHistory::connect(&PgSpec { url: pg.url(), password_file: None, ca_file: None }).await.expect("connect");
    let t = Instant::now();
    for chunk in (0..n).collect::<Vec<_>>().chunks(1000) {
        let runs: Vec<RunRecord> = chunk.iter().map(|i| run(*i, t0)).collect();
        h.record(&runs).await.expect("record");
    }
    let write = n as f64 / t.elapsed().as_secs_f64();
    let (p50, p99) = pages(&h, t0, n, "").await;
    let (tp50, tp99) = pages(&h, t0, n, "t0007").await;
    let (exported, rate) = export(&h).await;
    println!();
    println!("postgres: {write:.0} runs/s recorded (batches of 1,000)");
    println!("  {:<44} {:>7.2}/{:<6.2}", "page of 100, all tasks, p50/p99 (ms)", p50, p99);
    println!("  {:<44} {:>7.2}/{:<6.2}", "page of 100, one task, p50/p99 (ms)", tp50, tp99);
    println!("  {:<44} {:>12.0}", format!("export of {exported} runs (runs/s)"), rate);

    // etcd's database, without and with the archive.
    let (plain, plain_compact, plain_left) = etcd_size(etcd_runs, t0, None).await;
    let pg2 = PgHistory::connect(&PgSpec { url: pg.url(), password_file: None, ca_file: None }).await.expect("connect");
    let (moved, moved_compact, moved_left) = etcd_size(etcd_runs, t0 + Duration::days(400), Some(&pg2)).await;
    let mb = |b: i64| format!("{:.1}", b as f64 / 1e6);
    println!();
    println!("etcd after {etcd_runs} runs (created, then finished):");
    println!("  {:<44} {:>14} {:>22}", "", "etcd alone", "--history postgres://");
    println!("  {:<44} {:>14} {:>22}", "database as written (MB)", mb(plain), mb(moved));
    println!("  {:<44} {:>14} {:>22}", "after compaction + defragmentation (MB)", mb(plain_compact), mb(moved_compact));
    println!("  {:<44} {:>14} {:>22}", "run records left in etcd", plain_left, moved_left);
}
