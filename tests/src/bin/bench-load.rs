//! Bench (issue 7): load rows — N cron tasks firing every second, and
//! 10,000 tasks due on the same second every 10 s — against `punchclock
//! dev`, `server` + `runner` on the embedded store, and `server` + `runner`
//! on a real etcd. For each row it prints, from the run records of the
//! window's slots: fired/expected (runs whose agent started), SKIPPED and
//! missing slots, dispatch lag (`scheduled_at` → assignment) and start lag
//! (`scheduled_at` → agent started) p50/p99/max, runs/s, and the CPU and
//! resident memory of the control plane (and runner). With `--before BIN`
//! the same rows run for that build too, one after the other, in one run.
//! Before the rows of each target it prints the latency of a unary
//! `GetTask` on loopback (p50/p99 over 1,000 calls).
//!
//! Usage: `bench-load [--after BIN] [--before BIN] [--targets dev,server,etcd]
//! [--rows 100,250,300,1000,burst] [--window SECONDS] [--slots N] [--http-slots N] [--chain]`
//!
//! Runner slots: `--slots` (default 4,096) for a build that runs `/bin/true`,
//! `--http-slots` (default 10,000, the most an HTTP agent's `max_in_flight`
//! may say) for a build that runs the HTTP agent, whose run holds one pooled
//! connection, not a process. With 4,096 slots the 10k burst's last
//! dispatches wait for earlier runs to finish: its dispatch lag is then the
//! finishing throughput (2 cores: 1.4-1.7 s), not the scheduler's lag.
//!
//! Every task's agent is `/bin/true` (`true_agent` in `tests/agents.yaml`).
//! With `--chain` (issue 20: the cost of the admission chain), the `after`
//! build's tasks all declare a shared resource and are in scope of a
//! budget, neither of which ever limits (`--config` with `resources:
//! {bench-llm: ...}` and `budgets: [{scope: {agent: true_agent}}]`); the
//! `before` build (a commit before resources and budgets existed) runs the
//! same load without them.
//!
//! With `--agent http` (issue 22: the scheduler's own cost, without a
//! process per run), the `after` build's tasks run `http_agent`, a `type:
//! http` agent served by a keep-alive HTTP server in this process that
//! answers `200 {}` at once; the `before` build (from before HTTP agents)
//! runs the same rows with `/bin/true`, so the rows print side by side
//! what a process per run costs against one request per run.
//!
//! With `--before-agent http` the `before` build runs the same HTTP agent
//! (a revision that has HTTP agents): two revisions of the scheduler's own
//! cost, side by side.
//!
//! With `--agent http` and a Python that has APScheduler (`--peer PYTHON`,
//! default `target/peers-venv/bin/python`, made by `make peers-venv`), each
//! row of the first target is followed by a `peer` row: the same jobs in
//! APScheduler 3.x (`tests/peers/apscheduler_http.py`) POSTing to the same
//! HTTP agent, so the ratio is measured in one run. Its start lag is the
//! slot to the moment the job begins; it has no dispatch step.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use punchclock_control_plane::model::{RunRecord, RunStatus};
use punchclock_control_plane::repo::{Keys, Repo};
use punchclock_control_plane::store::KvStore;
use punchclock_control_plane::store::embedded::EmbeddedStore;
use punchclock_control_plane::store::etcd::EtcdStore;
use punchclock_proto::v1 as pb;
use punchclock_tests::etcd::{Etcd, free_port};
use punchclock_tests::{Proc, apply_all, tasks};

/// One load shape.
#[derive(Clone, Copy, Debug)]
enum Row {
    /// N tasks firing every second.
    EverySecond(usize),
    /// 10,000 tasks due on the same second, every 10 s.
    Burst,
}

impl Row {
    fn parse(s: &str) -> Row {
        match s {
            "burst" => Row::Burst,
            n => Row::EverySecond(n.parse().expect("a row is a task count or `burst`")),
        }
    }
    fn name(self) -> String {
        match self {
            Row::EverySecond(n) => format!("{n}/s"),
            Row::Burst => "10k burst/10s".into(),
        }
    }
    fn tasks(self) -> usize {
        match self {
            Row::EverySecond(n) => n,
            Row::Burst => 10_000,
        }
    }
    fn expr(self) -> &'static str {
        match self {
            Row::EverySecond(_) => "* * * * * *",
            Row::Burst => "*/10 * * * * *",
        }
    }
}

struct Opts {
    builds: Vec<(String, PathBuf)>,
    targets: Vec<String>,
    rows: Vec<Row>,
    window: i64,
    slots: u32,
    /// Runner slots of a build that runs the HTTP agent.
    http_slots: u32,
    chain: bool,
    /// `process` (`/bin/true`) or `http` (the in-bench HTTP agent, `after` only).
    agent: String,
    /// `--before-agent http`: the `before` build (one that has HTTP agents
    /// too) runs the HTTP agent as well, so two revisions of the
    /// scheduler's own cost print side by side.
    before_http: bool,
    /// A Python with APScheduler for the peer rows (`--agent http` only).
    peer: Option<PathBuf>,
}

fn opts() -> Opts {
    let mut o = Opts {
        builds: Vec::new(),
        targets: vec!["dev".into(), "server".into(), "etcd".into()],
        rows: ["100", "250", "300", "1000", "burst"].iter().map(|r| Row::parse(r)).collect(),
        window: 20,
        slots: 4096,
        http_slots: 10_000,
        chain: false,
        agent: "process".into(),
        before_http: false,
        peer: None,
    };
    let mut peer = PathBuf::from("target/peers-venv/bin/python");
    let mut after = punchclock_tests::bin();
    let mut before = None;
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut val = || it.next().unwrap_or_else(|| panic!("{a} needs a value"));
        match a.as_str() {
            "--after" => after = PathBuf::from(val()),
            "--before" => before = Some(PathBuf::from(val())),
            "--targets" => o.targets = val().split(',').map(str::to_string).collect(),
            "--rows" => o.rows = val().split(',').map(Row::parse).collect(),
            "--window" => o.window = val().parse().expect("--window SECONDS"),
            "--slots" => o.slots = val().parse().expect("--slots N"),
            "--http-slots" => o.http_slots = val().parse().expect("--http-slots N"),
            "--chain" => o.chain = true,
            "--peer" => peer = PathBuf::from(val()),
            "--agent" => {
                o.agent = val();
                assert!(matches!(o.agent.as_str(), "process" | "http"), "--agent process|http");
            }
            "--before-agent" => {
                let v = val();
                assert!(matches!(v.as_str(), "process" | "http"), "--before-agent process|http");
                o.before_http = v == "http";
            }
            other => panic!("unknown argument {other:?} (see the module docs)"),
        }
    }
    if o.agent == "http" {
        let has_apscheduler = std::process::Command::new(&peer)
            .args(["-c", "import apscheduler"])
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if has_apscheduler {
            o.peer = Some(peer);
        } else {
            println!("no APScheduler at {} (make peers-venv): no peer rows", peer.display());
        }
    }
    if let Some(b) = before {
        o.builds.push(("before".into(), b));
    }
    o.builds.push(("after".into(), after));
    o
}

/// A control plane (and runner) under test.
struct Target {
    addr: String,
    procs: Vec<Proc>,
    /// Where its runs are read back: the embedded store's directory, or etcd.
    store: StoreAt,
    _etcd: Option<Etcd>,
    _dir: tempfile::TempDir,
}

enum StoreAt {
    Embedded(PathBuf),
    Etcd(Vec<String>),
}

/// The fields of `/proc/PID/stat` after the command name (field 3 first).
fn stat_fields(pid: i32) -> Vec<u64> {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return Vec::new() };
    stat.rsplit(')').next().unwrap_or("").split_whitespace().map(|v| v.parse::<u64>().unwrap_or(0)).collect()
}

/// A process's own CPU (user + system), in clock ticks (1/100 s).
fn cpu_ticks(pid: i32) -> u64 {
    let f = stat_fields(pid);
    f.get(11).copied().unwrap_or(0) + f.get(12).copied().unwrap_or(0)
}

/// The CPU of a process's waited-for children and their waited-for
/// descendants (cutime + cstime), in clock ticks.
fn children_cpu_ticks(pid: i32) -> u64 {
    let f = stat_fields(pid);
    f.get(13).copied().unwrap_or(0) + f.get(14).copied().unwrap_or(0)
}

/// The agent zygote among the children of `parents`: its own CPU plus that
/// of the supervisors it reaped (which reaped their agents) is what the
/// agents cost.
fn zygote_of(parents: &[i32]) -> Option<i32> {
    std::fs::read_dir("/proc").ok()?.flatten().filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok()).find(|pid| {
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let ppid = stat_fields(*pid).get(1).copied().unwrap_or(0) as i32;
        parents.contains(&ppid) && cmdline.split(|b| *b == 0).any(|arg| arg == b"--zygote")
    })
}

/// Busy and total clock ticks of the whole machine (`/proc/stat`).
fn machine_ticks() -> (u64, u64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let cpu: Vec<u64> = stat.lines().next().unwrap_or("").split_whitespace().skip(1).map(|v| v.parse().unwrap_or(0)).collect();
    let total: u64 = cpu.iter().take(8).sum();
    let idle = cpu.get(3).copied().unwrap_or(0) + cpu.get(4).copied().unwrap_or(0);
    (total - idle, total)
}

fn rss_mb(pid: i32) -> f64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    s.lines().find(|l| l.starts_with("VmRSS:")).and_then(|l| l.split_whitespace().nth(1)).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0)
        / 1024.0
}

/// The `--config` of a `--chain` row: a resource and a budget that never limit.
const CHAIN_CONFIG: &str = "resources:\n  bench-llm: {concurrency: 100000, requests_per_minute: 1000000, tokens_per_minute: 1000000000000}\n\
budgets:\n  - name: bench\n    scope: {agent: true_agent}\n    window: 1d\n    limits: {cost: 1000000000, runs: 1000000000}\n";

/// The in-bench HTTP agent: `200 {}` at once to every POST, keep-alive;
/// returns its base URL. Runs on this process's runtime until it exits.
async fn http_agent_server() -> String {
    let app = axum::Router::new().route("/agent", axum::routing::post(|| async { axum::Json(serde_json::json!({})) }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await.expect("serve") });
    format!("http://{addr}/agent")
}

/// The agents file of a run: `tests/agents.yaml`, or with an HTTP agent
/// URL `http_agent` calling it (written into `dir`).
fn agents_file(dir: &Path, http: Option<&str>, slots: &str) -> String {
    let Some(url) = http else { return "tests/agents.yaml".into() };
    let path = dir.join("agents.yaml");
    let in_flight = slots.parse::<u32>().unwrap_or(4096).min(10_000);
    std::fs::write(&path, format!("agents:\n  http_agent:\n    type: http\n    url: {url}\n    max_in_flight: {in_flight}\n"))
        .expect("agents");
    path.to_string_lossy().into_owned()
}

async fn start(binary: &Path, kind: &str, slots: u32, chain: bool, http: Option<&str>) -> Target {
    let dir = tempfile::tempdir().expect("tempdir");
    // BENCH_LOAD_LOG=<filter> (e.g. `info,punchclock::start=debug`) sets
    // the processes' log filter and keeps their logs (the path is printed).
    let log_filter = std::env::var("BENCH_LOAD_LOG").ok();
    let env: Vec<(&str, &str)> = log_filter.as_deref().map(|f| ("PUNCHCLOCK_LOG", f)).into_iter().collect();
    let logs = match &log_filter {
        Some(_) => {
            let kept = tempfile::tempdir().expect("tempdir").keep();
            eprintln!("{kind} logs kept in {}", kept.display());
            kept
        }
        None => dir.path().to_owned(),
    };
    let slots = slots.to_string();
    let agents = agents_file(dir.path(), http, &slots);
    let config = dir.path().join("config.yaml");
    std::fs::write(&config, CHAIN_CONFIG).expect("config");
    let config = config.to_string_lossy().to_string();
    let with_config = |mut args: Vec<&str>| -> Vec<String> {
        let mut v: Vec<String> = args.drain(..).map(str::to_string).collect();
        if chain {
            v.extend(["--config".to_string(), config.clone()]);
        }
        v
    };
    let log = |name: &str| logs.join(format!("{name}.log"));
    let (procs, store, etcd) = match kind {
        "dev" => {
            let data = dir.path().join("data");
            let d = data.to_string_lossy().to_string();
            let mut args: Vec<String> = ["dev", "--data-dir", &d, "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"]
                .iter()
                .map(|a| a.to_string())
                .collect();
            args.extend(with_config(vec!["--agents", &agents]));
            args.extend(["--slots".to_string(), slots.clone()]);
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let dev = Proc::start_bin(binary, &args, &env, &log("dev"), true);
            (vec![dev], StoreAt::Embedded(data), None)
        }
        "server" | "etcd" => {
            let etcd = if kind == "etcd" { Some(Etcd::start(1).await) } else { None };
            let data = dir.path().join("data");
            let store = match &etcd {
                Some(e) => e.store_url(),
                None => format!("embedded:{}", data.display()),
            };
            let listen = format!("127.0.0.1:{}", free_port());
            let mut args: Vec<String> =
                ["server", "--store", &store, "--listen", &listen, "--node-id", "cp"].iter().map(|a| a.to_string()).collect();
            args.extend(with_config(Vec::new()));
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let server = Proc::start_bin(binary, &args, &env, &log("server"), true);
            let work = dir.path().join("work").to_string_lossy().to_string();
            let runner = Proc::start_bin(
                binary,
                &[
                    "runner",
                    "--control-plane",
                    &server.addr,
                    "--agents",
                    &agents,
                    "--runner-id",
                    "r1",
                    "--slots",
                    &slots,
                    "--work-dir",
                    &work,
                ],
                &env,
                &log("runner"),
                false,
            );
            let at = match &etcd {
                Some(e) => StoreAt::Etcd(e.endpoints()),
                None => StoreAt::Embedded(data),
            };
            (vec![server, runner], at, etcd)
        }
        other => panic!("unknown target {other:?}: dev, server or etcd"),
    };
    let addr = procs[0].addr.clone();
    Target { addr, procs, store, _etcd: etcd, _dir: dir }
}

async fn wait_runner(addr: &str) {
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

fn pct(sorted: &[i64], p: f64) -> i64 {
    if sorted.is_empty() {
        return 0;
    }
    sorted[((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1]
}

struct Figures {
    expected: usize,
    fired: usize,
    skipped: usize,
    /// Skipped slots by reason.
    skip_reasons: std::collections::BTreeMap<&'static str, usize>,
    /// Runs that never started, by status, with one error each.
    not_started: std::collections::BTreeMap<String, (usize, String)>,
    missing: usize,
    dispatch: Vec<i64>,
    start: Vec<i64>,
    cpu: Vec<f64>,
    /// CPU % of the agents with their supervisors and the zygote (0 when
    /// the runner has no zygote).
    agents_cpu: f64,
    /// How busy the whole machine was, % of all its cores.
    machine_busy: f64,
    rss: Vec<f64>,
    apply_secs: f64,
}

async fn run_row(binary: &Path, kind: &str, row: Row, window: i64, slots: u32, chain: bool, http: Option<&str>) -> Figures {
    let mut t = start(binary, kind, slots, chain, http).await;
    wait_runner(&t.addr).await;
    let client = tasks(&t.addr).await;
    let applied = Instant::now();
    let n = row.tasks();
    let specs = (0..n).map(|i| {
        let agent = if http.is_some() { "http_agent" } else { "true_agent" };
        let mut spec =
            serde_json::json!({"task_id": format!("load{i:05}"), "agent_id": agent, "trigger": {"type": "cron", "expr": row.expr()}});
        if chain {
            spec["execution"] = serde_json::json!({"resources": [{"name": "bench-llm", "tokens": 10}]});
        }
        spec
    });
    apply_all(&client, specs).await;
    let apply_secs = applied.elapsed().as_secs_f64();
    // The window: whole seconds, from 3 s after registration (the engine
    // takes in every definition first).
    let from = DateTime::from_timestamp(Utc::now().timestamp() + 3, 0).expect("t");
    let until = from + chrono::Duration::seconds(window);
    tokio::time::sleep((from - Utc::now()).to_std().unwrap_or_default()).await;
    let pids: Vec<i32> = t.procs.iter().map(Proc::pid).collect();
    let ticks0: Vec<u64> = pids.iter().map(|p| cpu_ticks(*p)).collect();
    let zygote = zygote_of(&pids);
    let agents_ticks = |z: Option<i32>| z.map(|z| cpu_ticks(z) + children_cpu_ticks(z)).unwrap_or(0);
    let (agents0, machine0) = (agents_ticks(zygote), machine_ticks());
    let wall = Instant::now();
    tokio::time::sleep((until - Utc::now()).to_std().unwrap_or_default()).await;
    let secs = wall.elapsed().as_secs_f64();
    let cpu: Vec<f64> = pids.iter().zip(&ticks0).map(|(p, t0)| (cpu_ticks(*p) - t0) as f64 / 100.0 / secs * 100.0).collect();
    // A zygote that started during the window (at its first run) had used
    // nothing before it.
    let agents1 = match zygote {
        Some(_) => agents_ticks(zygote),
        None => agents_ticks(zygote_of(&pids)),
    };
    let agents_cpu = agents1.saturating_sub(agents0) as f64 / 100.0 / secs * 100.0;
    let machine1 = machine_ticks();
    let machine_busy = (machine1.0 - machine0.0) as f64 * 100.0 / (machine1.1 - machine0.1).max(1) as f64;
    let rss: Vec<f64> = pids.iter().map(|p| rss_mb(*p)).collect();
    // Let the window's last runs finish, then read the records.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let runs: Vec<RunRecord> = match &t.store {
        StoreAt::Etcd(endpoints) => {
            // Task by task: one range of every run can pass etcd's 4 MiB
            // response limit.
            let store: Arc<dyn KvStore> = Arc::new(EtcdStore::connect(endpoints).await.expect("etcd"));
            let repo = Repo::new(store, Keys::default());
            let mut all = Vec::new();
            for i in 0..n {
                all.extend(repo.list_runs(&format!("load{i:05}")).await.expect("runs").0);
            }
            all
        }
        StoreAt::Embedded(dir) => {
            for p in &mut t.procs {
                p.signal(libc::SIGTERM);
                let _ = p.child.wait();
            }
            let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::open(dir).await.expect("open"));
            Repo::new(store, Keys::default()).list_runs("").await.expect("runs").0
        }
    };
    let in_window: Vec<&RunRecord> = runs.iter().filter(|r| r.scheduled_at >= from && r.scheduled_at < until).collect();
    let seconds_with_slots = match row {
        Row::EverySecond(_) => window as usize,
        Row::Burst => (from.timestamp()..until.timestamp()).filter(|s| s % 10 == 0).count(),
    };
    let expected = n * seconds_with_slots;
    let skipped = in_window.iter().map(|r| if r.status == RunStatus::Skipped { r.missed_count.unwrap_or(1) as usize } else { 0 }).sum();
    let mut skip_reasons = std::collections::BTreeMap::new();
    for r in in_window.iter().filter(|r| r.status == RunStatus::Skipped) {
        *skip_reasons.entry(r.skip_reason.map(|why| why.as_str()).unwrap_or("?")).or_insert(0) += r.missed_count.unwrap_or(1) as usize;
    }
    let started: Vec<&&RunRecord> = in_window.iter().filter(|r| r.actual_started_at.is_some()).collect();
    let mut not_started = std::collections::BTreeMap::new();
    for r in in_window.iter().filter(|r| r.actual_started_at.is_none() && r.status != RunStatus::Skipped) {
        let entry = not_started.entry(format!("{:?}", r.status)).or_insert((0, String::new()));
        entry.0 += 1;
        if entry.1.is_empty() {
            entry.1 = r.error.clone().unwrap_or_default();
        }
    }
    let ms = |d: chrono::Duration| d.num_milliseconds();
    let mut dispatch: Vec<i64> =
        in_window.iter().filter_map(|r| r.attempts.first().map(|a| ms(a.dispatched_at - r.scheduled_at))).collect();
    let mut start: Vec<i64> = started.iter().filter_map(|r| r.actual_started_at.map(|s| ms(s - r.scheduled_at))).collect();
    dispatch.sort();
    start.sort();
    let records = in_window.len() - in_window.iter().filter(|r| r.status == RunStatus::Skipped).count() + skipped;
    Figures {
        expected,
        fired: started.len(),
        skipped,
        skip_reasons,
        not_started,
        missing: expected.saturating_sub(records),
        dispatch,
        start,
        cpu,
        agents_cpu,
        machine_busy,
        rss,
        apply_secs,
    }
}

/// The APScheduler peer of a row (`tests/peers/apscheduler_http.py`): its
/// one JSON line (expected, fired, failed, skipped, missed, start
/// p50/p99/max in ms, cpu_seconds over the window).
async fn run_peer(python: &Path, url: &str, row: Row, window: i64) -> serde_json::Value {
    let every = match row {
        Row::EverySecond(_) => "1",
        Row::Burst => "10",
    };
    // Adding 10,000 jobs takes the peer a few seconds.
    let start = Utc::now().timestamp() + 3 + row.tasks() as i64 / 2000;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/peers/apscheduler_http.py");
    let out = tokio::process::Command::new(python)
        .args([script, "--url", url, "--every", every])
        .args(["--tasks", &row.tasks().to_string(), "--start", &start.to_string(), "--window", &window.to_string()])
        .output()
        .await
        .expect("run the APScheduler peer");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "the APScheduler peer failed: {}{}", stdout, String::from_utf8_lossy(&out.stderr));
    serde_json::from_str(stdout.lines().last().unwrap_or_default()).expect("the peer's JSON line")
}

/// Unary `GetTask` latency on loopback (issue 7, acceptance 5): one task,
/// 1,000 sequential calls on one connection after 100 warm-up calls;
/// (p50, p99) in microseconds.
async fn get_task_latency(binary: &Path, kind: &str) -> (u128, u128) {
    let t = start(binary, kind, 1, false, None).await;
    let mut client = tasks(&t.addr).await;
    let spec = serde_json::json!({"task_id": "probe", "agent_id": "true_agent", "trigger": {"type": "cron", "expr": "0 0 0 1 1 *"}});
    client.apply_task(pb::ApplyTaskRequest { spec_json: spec.to_string(), dry_run: false, task: None }).await.expect("apply");
    let mut micros = Vec::with_capacity(1000);
    for i in 0..1100 {
        let sent = Instant::now();
        client.get_task(pb::GetTaskRequest { task_id: "probe".into() }).await.expect("get task");
        if i >= 100 {
            micros.push(sent.elapsed().as_micros());
        }
    }
    micros.sort_unstable();
    (micros[micros.len() / 2], micros[micros.len() * 99 / 100])
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let o = opts();
    let http = if o.agent == "http" { Some(http_agent_server().await) } else { None };
    println!(
        "bench-load: agent {}, runner slots {} (process agent) / {} (HTTP agent), {} s windows (10k burst: slots every 10 s); lags in ms from the run records{}",
        if http.is_some() {
            if o.before_http {
                "an HTTP agent answering 200 at once (keep-alive, in this process), for both builds"
            } else {
                "after: an HTTP agent answering 200 at once (keep-alive, in this process); before: /bin/true"
            }
        } else {
            "/bin/true"
        },
        o.slots,
        o.http_slots,
        o.window,
        if o.chain { "; after: every task declares a resource and is in a budget's scope (neither limits), before: neither" } else { "" }
    );
    println!(
        "{:<7} {:<7} {:<14} {:>9} {:>7} {:>5} {:>5} {:>18} {:>18} {:>7} {:>15} {:>13} {:>7}",
        "target",
        "build",
        "row",
        "fired",
        "%",
        "skip",
        "miss",
        "dispatch p50/p99/max",
        "start p50/p99/max",
        "runs/s",
        "cpu % (cp,run)",
        "rss MB",
        "apply s"
    );
    for target in &o.targets {
        for (build, binary) in &o.builds {
            let (p50, p99) = get_task_latency(binary, target).await;
            println!("{target:<7} {build:<7} unary GetTask on loopback, 1,000 calls: p50 {p50} µs, p99 {p99} µs");
        }
        for row in &o.rows {
            for (build, binary) in &o.builds {
                // `--chain`: only this checkout knows resources and budgets.
                let chain = o.chain && build == "after";
                // `--agent http`: only this checkout has HTTP agents (unless
                // `--before-agent http` says the before build has them too).
                let agent = http.as_deref().filter(|_| build == "after" || o.before_http);
                let slots = if agent.is_some() { o.http_slots } else { o.slots };
                let f = run_row(binary, target, *row, o.window, slots, chain, agent).await;
                let lag = |v: &[i64]| format!("{}/{}/{}", pct(v, 0.5), pct(v, 0.99), v.last().copied().unwrap_or(0));
                let join = |v: &[f64]| v.iter().map(|x| format!("{x:.0}")).collect::<Vec<_>>().join(",");
                println!(
                    "{:<7} {:<7} {:<14} {:>9} {:>6.1}% {:>5} {:>5} {:>18} {:>18} {:>7.0} {:>15} {:>13} {:>7.1}",
                    target,
                    build,
                    row.name(),
                    format!("{}/{}", f.fired, f.expected),
                    f.fired as f64 * 100.0 / f.expected.max(1) as f64,
                    f.skipped,
                    f.missing,
                    lag(&f.dispatch),
                    lag(&f.start),
                    f.fired as f64 / o.window as f64,
                    join(&f.cpu),
                    join(&f.rss),
                    f.apply_secs,
                );
                let per_run = |pct: f64| pct * 10.0 / (f.fired as f64 / o.window as f64).max(1.0);
                let cores = std::thread::available_parallelism().map(usize::from).unwrap_or(1);
                // The slots of one instant all start together: even alone,
                // their agents keep every core busy this long.
                println!(
                    "{:<30} CPU per run: control plane{} {:.2} ms, agents + supervisors + zygote {:.2} ms; machine {:.0}% busy ({cores} cores); \
                     one instant's {} agents alone fill every core for {:.0} ms",
                    "",
                    if f.cpu.len() > 1 { " + runner" } else { "" },
                    per_run(f.cpu.iter().sum()),
                    per_run(f.agents_cpu),
                    f.machine_busy,
                    row.tasks(),
                    per_run(f.agents_cpu) * row.tasks() as f64 / cores as f64,
                );
                if !f.not_started.is_empty() {
                    println!("{:<30} not started, by status (count, an error): {:?}", "", f.not_started);
                }
                if !f.skip_reasons.is_empty() {
                    println!("{:<30} skipped by reason: {:?}", "", f.skip_reasons);
                }
            }
            if let (Some(python), Some(url), true) = (&o.peer, &http, target == &o.targets[0]) {
                let p = run_peer(python, url, *row, o.window).await;
                let n = |k: &str| p[k].as_u64().unwrap_or(0);
                let (expected, fired) = (n("expected"), n("fired"));
                let cpu_secs = p["cpu_seconds"].as_f64().unwrap_or(0.0);
                println!(
                    "{:<7} {:<7} {:<14} {:>9} {:>6.1}% {:>5} {:>5} {:>18} {:>18} {:>7.0} {:>15}",
                    "apsched",
                    "peer",
                    row.name(),
                    format!("{fired}/{expected}"),
                    fired as f64 * 100.0 / expected.max(1) as f64,
                    n("skipped"),
                    n("missed"),
                    "-",
                    format!("{}/{}/{}", n("start_p50"), n("start_p99"), n("start_max")),
                    fired as f64 / o.window as f64,
                    format!("{:.0}", cpu_secs * 100.0 / o.window as f64),
                );
                println!(
                    "{:<30} CPU per run: APScheduler 3 (one Python process, 64 worker threads, keep-alive per thread) {:.2} ms; {} failed{}",
                    "",
                    cpu_secs * 1000.0 / fired.max(1) as f64,
                    n("failed"),
                    p["first_error"].as_str().filter(|e| !e.is_empty()).map(|e| format!(" (first: {e})")).unwrap_or_default(),
                );
            }
        }
    }
}
