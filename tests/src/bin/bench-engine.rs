//! Bench (issue 6): store transactions per run and runs/s for N (default
//! 1,000) single-attempt runs of `/bin/true`, through the embedded store
//! and through a real etcd; with `--before BIN`, the same for another
//! build of `punchclock`, side by side in one run.
//!
//! Runs come from `TriggerTask` calls, 32 in flight, on a task with
//! `concurrency_limit` 1000 and a runner with 64 slots. Transactions are
//! counted by the store itself: its revision grows by one per committed
//! write transaction (etcd semantics, kept by the embedded store), read
//! before the first trigger and after the last run succeeded.
//!
//! Usage: `bench-engine [--runs N] [--after BIN] [--before BIN]`
//! (default `--after`: the workspace's debug build). Exits 1 when the
//! build under test costs more than 2.0 transactions per run.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use punchclock_control_plane::store::KvStore;
use punchclock_control_plane::store::embedded::EmbeddedStore;
use punchclock_control_plane::store::etcd::EtcdStore;
use punchclock_proto::v1 as pb;
use punchclock_tests::etcd::{Etcd, free_port};
use punchclock_tests::{Proc, apply, tasks};

/// Most transactions per run the build under test may cost (issue 6).
const MAX_TXNS_PER_RUN: f64 = 2.0;

struct Figures {
    store: &'static str,
    build: String,
    runs: usize,
    txns: i64,
    secs: f64,
}

fn args() -> (usize, PathBuf, Option<PathBuf>) {
    let mut runs = 1000;
    let mut after = punchclock_tests::bin();
    let mut before = None;
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--runs" => runs = it.next().and_then(|v| v.parse().ok()).expect("--runs N"),
            "--after" => after = PathBuf::from(it.next().expect("--after BIN")),
            "--before" => before = Some(PathBuf::from(it.next().expect("--before BIN"))),
            other => panic!("unknown argument {other:?}; usage: bench-engine [--runs N] [--after BIN] [--before BIN]"),
        }
    }
    (runs, after, before)
}

async fn revision(store: &dyn KvStore) -> i64 {
    store.range("/punchclock/bench-revision-probe/").await.expect("read the store revision").1
}

async fn embedded_revision(dir: &Path) -> i64 {
    let store = EmbeddedStore::open(dir).await.expect("open the embedded store");
    revision(&store).await
}

async fn wait_runners(addr: &str) {
    let mut client = pb::cluster_service_client::ClusterServiceClient::new(punchclock_tests::channel(addr).await);
    for _ in 0..600 {
        if let Ok(r) = client.list_runners(pb::ListRunnersRequest {}).await
            && !r.into_inner().runners.is_empty()
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("no runner connected");
}

/// Triggers `n` runs and waits until all succeeded; returns the seconds taken.
async fn drive(addr: &str, n: usize) -> f64 {
    let client = tasks(addr).await;
    let t = Instant::now();
    let failed: Vec<String> = futures::stream::iter(0..n)
        .map(|i| {
            let mut c = client.clone();
            async move {
                let req = pb::TriggerTaskRequest { task_id: "bench".into(), idempotency_key: format!("b{i}"), ..Default::default() };
                c.trigger_task(req).await.map(|_| ()).map_err(|e| e.to_string())
            }
        })
        .buffer_unordered(32)
        .filter_map(|r| async move { r.err() })
        .collect()
        .await;
    assert!(failed.is_empty(), "{} triggers failed, first: {}", failed.len(), failed[0]);
    let mut runs = punchclock_tests::runs(addr).await;
    loop {
        let done = runs
            .list_runs(pb::ListRunsRequest {
                task_id: "bench".into(),
                status: pb::RunStatus::Succeeded as i32,
                limit: 100_000,
                ..Default::default()
            })
            .await
            .expect("list runs")
            .into_inner()
            .runs
            .len();
        if done >= n {
            return t.elapsed().as_secs_f64();
        }
        assert!(t.elapsed() < Duration::from_secs(600), "only {done} of {n} runs succeeded in 10 minutes");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn task() -> serde_json::Value {
    serde_json::json!({"task_id": "bench", "agent_id": "true_agent", "execution": {"concurrency_limit": 1000}})
}

fn stop(mut p: Proc) {
    p.signal(libc::SIGTERM);
    let _ = p.child.wait();
}

async fn embedded(binary: &Path, build: &str, n: usize) -> Figures {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let data_s = data.to_string_lossy().to_string();
    let start = |log: &str| {
        Proc::start_bin(
            binary,
            &[
                "dev",
                "--data-dir",
                &data_s,
                "--listen",
                "127.0.0.1:0",
                "--http-listen",
                "127.0.0.1:0",
                "--agents",
                "tests/agents.yaml",
                "--slots",
                "64",
            ],
            &[],
            &dir.path().join(log),
            true,
        )
    };
    // Set up, stop, read the revision with the file closed, start again.
    let dev = start("setup.log");
    apply(&dev.addr, task()).await;
    stop(dev);
    let r0 = embedded_revision(&data).await;
    let dev = start("dev.log");
    wait_runners(&dev.addr).await;
    let secs = drive(&dev.addr, n).await;
    stop(dev);
    let r1 = embedded_revision(&data).await;
    Figures { store: "embedded", build: build.into(), runs: n, txns: r1 - r0, secs }
}

async fn etcd(binary: &Path, build: &str, n: usize) -> Figures {
    let dir = tempfile::tempdir().expect("tempdir");
    let etcd = Etcd::start(1).await;
    let listen = format!("127.0.0.1:{}", free_port());
    let server = Proc::start_bin(
        binary,
        &["server", "--store", &etcd.store_url(), "--listen", &listen, "--node-id", "cp"],
        &[],
        &dir.path().join("server.log"),
        true,
    );
    let work = dir.path().join("work").to_string_lossy().to_string();
    let runner = Proc::start_bin(
        binary,
        &[
            "runner",
            "--control-plane",
            &server.addr,
            "--agents",
            "tests/agents.yaml",
            "--runner-id",
            "r1",
            "--slots",
            "64",
            "--work-dir",
            &work,
        ],
        &[],
        &dir.path().join("runner.log"),
        false,
    );
    wait_runners(&server.addr).await;
    apply(&server.addr, task()).await;
    let store: Arc<dyn KvStore> = Arc::new(EtcdStore::connect(&etcd.endpoints()).await.expect("connect etcd"));
    let r0 = revision(&*store).await;
    let secs = drive(&server.addr, n).await;
    let r1 = revision(&*store).await;
    stop(runner);
    stop(server);
    Figures { store: "etcd", build: build.into(), runs: n, txns: r1 - r0, secs }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let (n, after, before) = args();
    let mut builds: Vec<(&str, PathBuf)> = Vec::new();
    if let Some(b) = before {
        builds.push(("before", b));
    }
    builds.push(("after", after));
    let mut rows = Vec::new();
    for (name, binary) in &builds {
        rows.push(embedded(binary, name, n).await);
    }
    for (name, binary) in &builds {
        rows.push(etcd(binary, name, n).await);
    }
    println!("bench-engine: {n} single-attempt runs of /bin/true (TriggerTask, 32 in flight, 64 runner slots)");
    println!("{:<9} {:<7} {:>7} {:>9} {:>8} {:>7}", "store", "build", "txns", "txns/run", "seconds", "runs/s");
    let mut ok = true;
    for f in &rows {
        let per_run = f.txns as f64 / f.runs as f64;
        println!("{:<9} {:<7} {:>7} {:>9.2} {:>8.1} {:>7.0}", f.store, f.build, f.txns, per_run, f.secs, f.runs as f64 / f.secs);
        if f.build == "after" && per_run > MAX_TXNS_PER_RUN {
            ok = false;
        }
    }
    println!("bench-engine: {}", if ok { format!("within {MAX_TXNS_PER_RUN} transactions per run") } else { "TARGET MISSED".into() });
    if !ok {
        std::process::exit(1);
    }
}
