//! Helpers for punchclock's end-to-end tests: start real `punchclock`
//! processes on free loopback ports, talk to them over real gRPC, and wait
//! on events (WatchRuns streams, process exits), not on sleeps.

pub mod brokers;
pub mod browser;
pub mod etcd;
pub mod pki;
pub mod postgres;
pub mod receiver;
pub mod storm;

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use pb::run_service_client::RunServiceClient;
use pb::task_service_client::TaskServiceClient;
use punchclock_proto::bearer::Bearer;
use punchclock_proto::v1 as pb;
use tokio_stream::StreamExt;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

/// A helper's connection: a channel whose calls carry the test binary's
/// token, if any ([`pki::use_client_credentials`]).
pub type Conn = InterceptedService<Channel, Bearer>;

/// The endpoint for `addr`, trusting the test CA for `https://`.
pub fn endpoint(addr: &str) -> Endpoint {
    let mut ep = Endpoint::from_shared(addr.to_string()).expect("endpoint");
    if addr.starts_with("https://") {
        let c = pki::client_credentials().expect("https needs pki::use_client_credentials");
        let tls = tonic::transport::ClientTlsConfig::new().ca_certificate(tonic::transport::Certificate::from_pem(pki::ca_pem(c)));
        ep = ep.tls_config(tls).expect("tls");
    }
    ep
}

/// Wraps a channel with the test binary's token.
pub fn with_token(ch: Channel) -> Conn {
    InterceptedService::new(ch, Bearer::new(pki::client_credentials().map(|c| c.token.as_str())))
}

/// The repository root (where the tests run punchclock, so relative agent
/// paths in `tests/agents.yaml` resolve).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().map(Path::to_path_buf).unwrap_or_default()
}

/// Path of the `punchclock` binary, built once per test process (a no-op
/// when it is up to date, as after `make build`).
pub fn bin() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        if let Ok(p) = std::env::var("PUNCHCLOCK_BIN") {
            return PathBuf::from(p);
        }
        let status = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .args(["build", "--quiet", "--workspace", "--bins"])
            .current_dir(repo_root())
            .status()
            .expect("run cargo build");
        assert!(status.success(), "cargo build of the punchclock binary failed");
        let target = std::env::var("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|_| repo_root().join("target"));
        target.join("debug").join("punchclock")
    })
    .clone()
}

/// A running `punchclock` process (dev, server or runner) that is killed
/// (SIGKILL, whole process group) when dropped.
pub struct Proc {
    /// The child.
    pub child: Child,
    /// gRPC address (`http://127.0.0.1:PORT`) when the process serves one.
    pub addr: String,
    /// File the process's stderr is copied to.
    pub log: PathBuf,
}

impl Proc {
    /// Starts `punchclock ARGS` in the repo root; when `serves` is true,
    /// waits for its "API on http://ADDR" line (at most 60 s).
    pub fn start(args: &[&str], log: &Path, serves: bool) -> Proc {
        Proc::start_with_env(args, &[], log, serves)
    }

    /// [`Proc::start`] with extra environment variables.
    pub fn start_with_env(args: &[&str], env: &[(&str, &str)], log: &Path, serves: bool) -> Proc {
        Proc::start_bin(&bin(), args, env, log, serves)
    }

    /// [`Proc::start_with_env`] of a given `punchclock` binary (benches
    /// compare two builds).
    pub fn start_bin(binary: &Path, args: &[&str], env: &[(&str, &str)], log: &Path, serves: bool) -> Proc {
        Proc::start_limited(binary, args, env, log, serves, None)
    }

    /// [`Proc::start_bin`] whose process starts with `RLIMIT_NOFILE` set
    /// to `nofile` (soft, hard) before it runs (`None`: inherited): a
    /// server's open-files limit, as its systemd unit would set it.
    pub fn start_limited(binary: &Path, args: &[&str], env: &[(&str, &str)], log: &Path, serves: bool, nofile: Option<(u64, u64)>) -> Proc {
        use std::os::unix::process::CommandExt;
        let mut cmd = Command::new(binary);
        if let Some((soft, hard)) = nofile {
            let limit = libc::rlimit { rlim_cur: soft as libc::rlim_t, rlim_max: hard as libc::rlim_t };
            // SAFETY: setrlimit is async-signal-safe and the closure
            // touches only its own copy of `limit`.
            unsafe {
                cmd.pre_exec(
                    move || {
                        if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) }
                    },
                );
            }
        }
        let mut child = cmd
            .args(args)
            .current_dir(repo_root())
            .env("PUNCHCLOCK_LOG", "info")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .process_group(0)
            .spawn()
            .expect("spawn punchclock");
        let stderr = child.stderr.take().expect("stderr");
        let (tx, rx) = std::sync::mpsc::channel::<String>();
        let log_path = log.to_path_buf();
        std::thread::spawn(move || {
            let mut out = std::fs::OpenOptions::new().create(true).append(true).open(&log_path).ok();
            let mut sent = false;
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(f) = out.as_mut() {
                    let _ = writeln!(f, "{line}");
                }
                if !sent && let Some(i) = line.find("API on http") {
                    let rest = &line[i + "API on ".len()..];
                    let addr = rest.split([' ', ',', ')']).next().unwrap_or("").to_string();
                    let _ = tx.send(addr);
                    sent = true;
                }
            }
        });
        let addr = if serves {
            match rx.recv_timeout(Duration::from_secs(60)) {
                Ok(a) => a,
                Err(_) => {
                    let _ = child.kill();
                    panic!("punchclock {args:?} did not start serving; log: {}", std::fs::read_to_string(log).unwrap_or_default());
                }
            }
        } else {
            String::new()
        };
        Proc { child, addr, log: log.to_path_buf() }
    }

    /// `punchclock dev` on a data dir, free ports, the test agents, 1 s heartbeats.
    pub fn dev(data_dir: &Path) -> Proc {
        Proc::dev_with_slots(data_dir, 8)
    }

    /// [`Proc::dev`] whose in-process runner has `slots` slots.
    pub fn dev_with_slots(data_dir: &Path, slots: u32) -> Proc {
        Proc::dev_logged(data_dir, slots, &data_dir.with_extension("log"))
    }

    /// [`Proc::dev_with_slots`] with its log at `log` (not beside the data
    /// dir: a test may fill that disk).
    pub fn dev_logged(data_dir: &Path, slots: u32, log: &Path) -> Proc {
        Proc::dev_with(data_dir, slots, log, &[])
    }

    /// [`Proc::dev_logged`] with extra arguments.
    pub fn dev_with(data_dir: &Path, slots: u32, log: &Path, extra: &[&str]) -> Proc {
        Proc::dev_agents(data_dir, slots, log, Path::new("tests/agents.yaml"), extra)
    }

    /// [`Proc::dev_with`] offering the agents of `agents` (an agents file).
    pub fn dev_agents(data_dir: &Path, slots: u32, log: &Path, agents: &Path, extra: &[&str]) -> Proc {
        Proc::dev_env(data_dir, slots, log, agents, extra, &[])
    }

    /// [`Proc::dev_agents`] with extra environment variables.
    pub fn dev_env(data_dir: &Path, slots: u32, log: &Path, agents: &Path, extra: &[&str], env: &[(&str, &str)]) -> Proc {
        let d = data_dir.to_string_lossy().to_string();
        let agents = agents.to_string_lossy().to_string();
        let slots = slots.to_string();
        let mut args = vec![
            "dev",
            "--data-dir",
            &d,
            "--listen",
            "127.0.0.1:0",
            "--http-listen",
            "127.0.0.1:0",
            "--agents",
            &agents,
            "--heartbeat-ms",
            "1000",
            "--kill-grace-ms",
            "1000",
            "--slots",
            &slots,
        ];
        args.extend_from_slice(extra);
        Proc::start_with_env(&args, env, log, true)
    }

    /// `punchclock server` on etcd: `--listen 127.0.0.1:PORT`, fast
    /// heartbeats (500 ms), a 3 s lease and a 1 s kill grace.
    pub fn server(store_url: &str, node_id: &str, port: u16, dir: &Path) -> Proc {
        Proc::server_with_env(store_url, node_id, port, dir, &[])
    }

    /// [`Proc::server`] with extra environment variables (test hooks).
    pub fn server_with_env(store_url: &str, node_id: &str, port: u16, dir: &Path, env: &[(&str, &str)]) -> Proc {
        Proc::server_with(store_url, node_id, port, dir, env, &[])
    }

    /// [`Proc::server`] with extra environment variables and arguments.
    pub fn server_with(store_url: &str, node_id: &str, port: u16, dir: &Path, env: &[(&str, &str)], extra: &[&str]) -> Proc {
        let listen = format!("127.0.0.1:{port}");
        let mut args = vec![
            "server",
            "--store",
            store_url,
            "--listen",
            &listen,
            "--node-id",
            node_id,
            "--heartbeat-ms",
            "500",
            "--lease-ttl-ms",
            "3000",
            "--kill-grace-ms",
            "1000",
        ];
        args.extend_from_slice(extra);
        Proc::start_with_env(&args, env, &dir.join(format!("{node_id}.log")), true)
    }

    /// `punchclock runner` with the test agents, following `control_planes` (comma-separated).
    pub fn runner(control_planes: &str, runner_id: &str, dir: &Path) -> Proc {
        Proc::runner_with(control_planes, runner_id, dir, &[])
    }

    /// [`Proc::runner`] with extra arguments.
    pub fn runner_with(control_planes: &str, runner_id: &str, dir: &Path, extra: &[&str]) -> Proc {
        Proc::runner_with_env(control_planes, runner_id, dir, extra, &[])
    }

    /// [`Proc::runner_with`] with extra environment variables (a log
    /// filter: per-execution lines are at debug).
    pub fn runner_with_env(control_planes: &str, runner_id: &str, dir: &Path, extra: &[&str], env: &[(&str, &str)]) -> Proc {
        let work = dir.join(format!("work-{runner_id}")).to_string_lossy().into_owned();
        let mut args = vec![
            "runner",
            "--control-plane",
            control_planes,
            "--agents",
            "tests/agents.yaml",
            "--runner-id",
            runner_id,
            "--slots",
            "16",
            "--kill-grace-ms",
            "1000",
            "--work-dir",
            &work,
        ];
        args.extend_from_slice(extra);
        Proc::start_with_env(&args, env, &dir.join(format!("{runner_id}.log")), false)
    }

    /// Sends `sig` to this process only.
    pub fn signal(&self, sig: i32) {
        unsafe_kill(self.pid(), sig);
    }

    /// The process's log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The HTTP (health, metrics) address (`host:port`) the process printed
    /// in its log (`dev`, or a `server` with `--http-listen`).
    pub fn http_addr(&self) -> String {
        let log = self.log_text();
        let line = log.lines().find(|l| l.contains("health on http://")).unwrap_or_else(|| panic!("no health address in the log: {log}"));
        let start = line.find("health on http://").expect("health address") + "health on http://".len();
        line[start..].split(['/', ' ', '"']).next().expect("host:port").to_string()
    }

    /// Process id.
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// SIGKILL to this process only (not its group): a crash.
    pub fn kill9(&mut self) {
        unsafe_kill(self.pid(), libc::SIGKILL);
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        unsafe_kill(-self.pid(), libc::SIGKILL);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn unsafe_kill(pid: i32, sig: i32) {
    // SAFETY: kill(2) has no memory-safety preconditions.
    unsafe {
        libc::kill(pid, sig);
    }
}

/// Resident memory of a process in bytes (`VmRSS` of `/proc/PID/status`; 0
/// when it is gone).
pub fn rss_bytes(pid: i32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    s.lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// Whether a process is gone (no such pid, or a zombie nobody reaped).
pub fn process_gone(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(s) => s.rsplit(')').next().map(|r| r.trim_start().starts_with('Z')).unwrap_or(false),
    }
}

/// Waits (bounded) until `pid` is gone.
pub async fn wait_gone(pid: i32, within: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + within;
    while tokio::time::Instant::now() < deadline {
        if process_gone(pid) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    process_gone(pid)
}

/// A gRPC connection to `addr` (with the test binary's credentials).
pub async fn channel(addr: &str) -> Conn {
    with_token(endpoint(addr).connect().await.expect("connect"))
}

/// Task service client, or `None` while `addr` refuses connections (a
/// replica just killed).
pub async fn try_tasks(addr: &str) -> Option<TaskServiceClient<Conn>> {
    let conn = endpoint(addr).connect().await.ok()?;
    Some(TaskServiceClient::new(with_token(conn)).max_decoding_message_size(64 << 20))
}

/// Task service client.
pub async fn tasks(addr: &str) -> TaskServiceClient<Conn> {
    TaskServiceClient::new(channel(addr).await).max_decoding_message_size(64 << 20)
}

/// Applies every spec (`ApplyTask`, 32 in flight on `client`'s channel);
/// panics naming how many failed and the first error.
pub async fn apply_all(client: &TaskServiceClient<Conn>, specs: impl Iterator<Item = serde_json::Value>) {
    // futures' StreamExt, spelled out: tokio_stream's is in scope too.
    use futures::StreamExt as Futures;
    let applies = Futures::map(futures::stream::iter(specs), |spec| {
        let mut c = client.clone();
        async move {
            c.apply_task(pb::ApplyTaskRequest { spec_json: spec.to_string(), dry_run: false, task: None })
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        }
    });
    let failed: Vec<String> =
        Futures::collect(Futures::filter_map(Futures::buffer_unordered(applies, 32), |r| async move { r.err() })).await;
    assert!(failed.is_empty(), "{} applies failed, first: {}", failed.len(), failed[0]);
}

/// Run service client.
pub async fn runs(addr: &str) -> RunServiceClient<Conn> {
    RunServiceClient::new(channel(addr).await).max_decoding_message_size(64 << 20)
}

/// Applies one task given as JSON; panics with the server's message on error.
pub async fn apply(addr: &str, spec: serde_json::Value) -> pb::Task {
    tasks(addr)
        .await
        .apply_task(pb::ApplyTaskRequest { spec_json: spec.to_string(), dry_run: false, task: None })
        .await
        .expect("apply task")
        .into_inner()
        .task
        .expect("task")
}

/// A WatchRuns stream of `task_id`'s runs (all when empty).
pub async fn watch_runs(addr: &str, task_id: &str) -> tonic::Streaming<pb::Run> {
    runs(addr).await.watch_runs(pb::WatchRunsRequest { task_id: task_id.into(), run_id: String::new() }).await.expect("watch").into_inner()
}

/// Waits for the first run (current or future, of `task_id` or all when
/// empty) matching `pred`, via WatchRuns. Panics after `within`.
///
/// A watch that ends with `Unavailable` (the store failing over: a member
/// just restarted) is opened again; any other error fails the test.
pub async fn wait_run(addr: &str, task_id: &str, within: Duration, pred: impl Fn(&pb::Run) -> bool) -> pb::Run {
    let r = tokio::time::timeout(within, async {
        loop {
            let mut s = watch_runs(addr, task_id).await;
            while let Some(r) = s.next().await {
                match r {
                    Ok(r) if pred(&r) => return Some(r),
                    Ok(_) => {}
                    Err(e) if e.code() == tonic::Code::Unavailable => {
                        eprintln!("watch of {task_id:?} ended ({e}); watching again");
                        break;
                    }
                    Err(e) => panic!("watch item: {e}"),
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await;
    match r {
        Ok(Some(r)) => r,
        _ => {
            let all = list_runs(addr, task_id).await;
            panic!("no run of {task_id:?} matched within {within:?}; runs now: {all:#?}")
        }
    }
}

/// Every run of a task (or all), newest first.
pub async fn list_runs(addr: &str, task_id: &str) -> Vec<pb::Run> {
    let mut client = runs(addr).await;
    let (mut all, mut token) = (Vec::new(), String::new());
    loop {
        let page = client
            .list_runs(pb::ListRunsRequest { task_id: task_id.into(), page_size: 1000, page_token: token, ..Default::default() })
            .await
            .expect("list runs")
            .into_inner();
        all.extend(page.runs);
        if page.next_page_token.is_empty() {
            return all;
        }
        token = page.next_page_token;
    }
}

/// Whether a run reached a final state.
pub fn terminal(r: &pb::Run) -> bool {
    matches!(
        status(r),
        pb::RunStatus::Succeeded | pb::RunStatus::Failed | pb::RunStatus::Timeout | pb::RunStatus::Cancelled | pb::RunStatus::Skipped
    )
}

/// Status of a run.
pub fn status(r: &pb::Run) -> pb::RunStatus {
    pb::RunStatus::try_from(r.status).unwrap_or(pb::RunStatus::Unspecified)
}

/// Protobuf timestamp → chrono.
pub fn at(t: &Option<prost_types::Timestamp>) -> Option<chrono::DateTime<chrono::Utc>> {
    punchclock_proto::time::from_timestamp_opt(t.as_ref())
}

/// `punchclock` aimed at `addr`, with the test binary's credentials.
pub fn cli_command(addr: &str) -> Command {
    let mut c = Command::new(bin());
    c.env("PUNCHCLOCK_ENDPOINT", addr).current_dir(repo_root());
    if let Some(creds) = pki::client_credentials() {
        c.env("PUNCHCLOCK_TOKEN_FILE", &creds.token_file).env("PUNCHCLOCK_CA_FILE", &creds.ca_file);
    }
    c
}

/// Runs the CLI (`punchclock ARGS`) against `addr`; returns stdout, panics on failure.
pub fn cli(addr: &str, args: &[&str]) -> String {
    let out = cli_command(addr).args(args).output().expect("run cli");
    assert!(out.status.success(), "punchclock {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).to_string()
}

/// Runs the CLI (`punchclock ARGS`) against `addr`, expecting it to fail;
/// returns its stderr, panics when it succeeds.
pub fn cli_fails(addr: &str, args: &[&str]) -> String {
    let out = cli_command(addr).args(args).output().expect("run cli");
    assert!(!out.status.success(), "punchclock {args:?} succeeded: {}", String::from_utf8_lossy(&out.stdout));
    String::from_utf8_lossy(&out.stderr).to_string()
}

/// The cluster as `addr` sees it.
pub async fn cluster_status(addr: &str) -> Option<pb::ClusterStatus> {
    let ch = endpoint(addr).connect_timeout(Duration::from_secs(1)).timeout(Duration::from_secs(2)).connect().await.ok()?;
    pb::cluster_service_client::ClusterServiceClient::new(with_token(ch))
        .get_cluster_status(pb::GetClusterStatusRequest {})
        .await
        .ok()
        .map(|r| r.into_inner())
}

/// Waits until some replica in `addrs` reports a leader for which `pred`
/// holds; returns that status. Polls every 50 ms (the leader is a fact in
/// etcd, not an event any process pushes to the test).
pub async fn wait_leader(addrs: &[String], within: Duration, pred: impl Fn(&pb::ClusterStatus) -> bool) -> pb::ClusterStatus {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        for a in addrs {
            if let Some(s) = cluster_status(a).await
                && !s.leader_id.is_empty()
                && pred(&s)
            {
                return s;
            }
        }
        assert!(tokio::time::Instant::now() < deadline, "no leader as expected within {within:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits (bounded, 20 s) until the replica at `addr` runs its engine: it
/// answers a leader-only call (`ListRunners`).
pub async fn wait_engine(addr: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while tokio::time::Instant::now() < deadline {
        if let Ok(ch) = endpoint(addr).connect().await
            && pb::cluster_service_client::ClusterServiceClient::new(with_token(ch)).list_runners(pb::ListRunnersRequest {}).await.is_ok()
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits (bounded, polling every 100 ms) until the leader at `addr` has a
/// connected runner; returns them all. Panics past `within`.
pub async fn wait_runners(addr: &str, within: Duration) -> Vec<pb::Runner> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if let Ok(ch) = endpoint(addr).connect().await
            && let Ok(r) =
                pb::cluster_service_client::ClusterServiceClient::new(with_token(ch)).list_runners(pb::ListRunnersRequest {}).await
            && !r.get_ref().runners.is_empty()
        {
            return r.into_inner().runners;
        }
        assert!(tokio::time::Instant::now() < deadline, "no runner connected to {addr} within {within:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits (bounded, polling a file) until `proc`'s log contains `needle`.
pub async fn wait_log(proc: &Proc, needle: &str, within: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + within;
    while tokio::time::Instant::now() < deadline {
        if proc.log_text().contains(needle) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    proc.log_text().contains(needle)
}

/// Copies every `*.log` of `dir` to `target/test-logs/NAME/` if the test
/// panics (the temp dir itself is deleted), so a failure can be read; with
/// `PUNCHCLOCK_KEEP_TEST_LOGS=1` also when it passes (to compare timelines).
pub struct KeepLogsOnPanic {
    dir: PathBuf,
    name: String,
}

impl KeepLogsOnPanic {
    /// Guards `dir` for the test `name`.
    pub fn new(dir: &Path, name: &str) -> Self {
        KeepLogsOnPanic { dir: dir.to_path_buf(), name: name.to_string() }
    }
}

impl Drop for KeepLogsOnPanic {
    fn drop(&mut self) {
        if !std::thread::panicking() && std::env::var_os("PUNCHCLOCK_KEEP_TEST_LOGS").is_none() {
            return;
        }
        let out = repo_root().join("target").join("test-logs").join(&self.name);
        let _ = std::fs::create_dir_all(&out);
        if let Ok(entries) = std::fs::read_dir(&self.dir) {
            for e in entries.flatten() {
                if e.path().extension().is_some_and(|x| x == "log") {
                    let _ = std::fs::copy(e.path(), out.join(e.file_name()));
                }
            }
        }
        eprintln!("logs kept in {}", out.display());
    }
}

/// A control plane inside the test process on the embedded store in `dir`,
/// driven by a manual `clock`, serving gRPC on a free loopback port.
/// Returns the server and the sender that stops it (then `wait` on it).
pub async fn in_process_server(
    clock: punchclock_control_plane::clock::ManualClock,
    dir: &Path,
) -> (punchclock_control_plane::bootstrap::RunningServer, tokio::sync::oneshot::Sender<()>) {
    use punchclock_control_plane::bootstrap::{self, ServerConfig, StoreSpec};
    let cfg = ServerConfig {
        listen: "127.0.0.1:0".parse().expect("addr"),
        advertise: None,
        http_listen: None,
        http_advertise: None,
        http_listen_fallback: false,
        store: StoreSpec::Embedded(dir.to_path_buf()),
        key_prefix: "/punchclock/".into(),
        node_id: "test".into(),
        timing: punchclock_control_plane::timing::Timing::default(),
        retention: Default::default(),
        config: Default::default(),
        traces: false,
        auth: punchclock_control_plane::auth::Auth::off(),
        tls: None,
        etcd: Default::default(),
        connections: Default::default(),
        history: None,
        ui: Default::default(),
    };
    let clock = std::sync::Arc::new(clock);
    // A server stopped in this process a moment ago may still have a
    // connection task holding its store (the embedded store's file lock)
    // while tonic winds down: wait for it, bounded.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        match bootstrap::start(cfg.clone(), clock.clone(), async move {
            let _ = rx.await;
        })
        .await
        {
            Ok(s) => return (s, tx),
            Err(e) if e.to_string().contains("already open") && tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("server starts: {e:?}"),
        }
    }
}

/// A runner stream driven by the test over the real `RunnerService`: it
/// says Hello, heartbeats every 300 ms, and otherwise does only what the
/// test tells it (to play a runner that forges, floods, never reads, or
/// re-declares what it likes).
pub struct RawRunner {
    /// Messages to the control plane (dropping it ends the stream).
    pub tx: tokio::sync::mpsc::Sender<pb::RunnerMessage>,
    /// Messages from the control plane.
    pub inbound: tonic::Streaming<pb::ControlMessage>,
    /// The Welcome it got.
    pub welcome: pb::Welcome,
}

impl RawRunner {
    /// Connects as `runner_id` serving `agents`, declaring `in_flight`;
    /// retries while the server answers `UNAVAILABLE` (not leading yet) or
    /// `FAILED_PRECONDITION` (the id's previous stream not yet seen closed),
    /// for at most 20 s. Waits for the Welcome.
    pub async fn connect(addr: &str, runner_id: &str, agents: &[&str], instance: &str, in_flight: Vec<pb::InFlight>) -> RawRunner {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let (tx, rx) = tokio::sync::mpsc::channel(1024);
            let hello = pb::Hello {
                runner_id: runner_id.into(),
                agents: agents.iter().map(|a| a.to_string()).collect(),
                slots: 4,
                instance_id: instance.into(),
                in_flight: in_flight.clone(),
                ..Default::default()
            };
            tx.send(pb::RunnerMessage { msg: Some(pb::runner_message::Msg::Hello(hello)) }).await.expect("queue hello");
            let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
            match pb::runner_service_client::RunnerServiceClient::new(channel(addr).await).connect(stream).await {
                Ok(resp) => {
                    let mut inbound = resp.into_inner();
                    let first = tokio::time::timeout(Duration::from_secs(10), inbound.message()).await;
                    if let Ok(Ok(Some(pb::ControlMessage { msg: Some(pb::control_message::Msg::Welcome(welcome)) }))) = first {
                        // Heartbeats while the test holds the runner (a weak
                        // sender: dropping the runner still ends the stream).
                        let weak = tx.downgrade();
                        tokio::spawn(async move {
                            let mut seq = 0;
                            loop {
                                tokio::time::sleep(Duration::from_millis(300)).await;
                                let Some(tx) = weak.upgrade() else { return };
                                seq += 1;
                                let hb =
                                    pb::runner_message::Msg::Heartbeat(pb::Heartbeat { running: 0, seq, draining: false, acked_seq: seq });
                                if tx.send(pb::RunnerMessage { msg: Some(hb) }).await.is_err() {
                                    return;
                                }
                            }
                        });
                        return RawRunner { tx, inbound, welcome };
                    }
                    assert!(tokio::time::Instant::now() < deadline, "no Welcome: {first:?}");
                }
                Err(e)
                    if matches!(e.code(), tonic::Code::Unavailable | tonic::Code::FailedPrecondition)
                        && tokio::time::Instant::now() < deadline => {}
                Err(e) => panic!("runner stream does not open: {e}"),
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Sends one message.
    pub async fn send(&self, msg: pb::runner_message::Msg) {
        self.tx.send(pb::RunnerMessage { msg: Some(msg) }).await.expect("runner stream open");
    }

    /// The next Assign (other messages are skipped), within `within`.
    pub async fn next_assign(&mut self, within: Duration) -> pb::Assign {
        tokio::time::timeout(within, async {
            loop {
                let m = self.inbound.message().await.expect("stream ok").expect("stream open");
                if let Some(pb::control_message::Msg::Assign(a)) = m.msg {
                    return a;
                }
            }
        })
        .await
        .expect("an assignment in time")
    }

    /// Reports the assignment started.
    pub async fn started(&self, a: &pb::Assign) {
        let s = pb::Started { run_id: a.run_id.clone(), execution_id: a.execution_id.clone(), ..Default::default() };
        self.send(pb::runner_message::Msg::Started(s)).await;
    }

    /// Reports the assignment finished with `outcome`.
    pub async fn finished(&self, run_id: &str, execution_id: &str, outcome: pb::Outcome, result_json: &str) {
        let f = pb::Finished {
            run_id: run_id.into(),
            execution_id: execution_id.into(),
            outcome: outcome as i32,
            result_json: result_json.into(),
            ..Default::default()
        };
        self.send(pb::runner_message::Msg::Finished(f)).await;
    }
}

/// Pids of live agent processes whose command line contains `marker`
/// (agent shims, which carry the agent's command line too, left out).
pub fn live_agents(marker: &str) -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            let shim = cmdline.contains(punchclock_agent_shim::SHIM_SUBCOMMAND) || cmdline.contains(punchclock_agent_shim::SHIM_BINARY);
            cmdline.contains(marker) && !shim && !process_gone(*pid)
        })
        .collect()
}

/// Samples [`live_agents`] every 50 ms until `until` resolves; returns the
/// most seen at once (and prints their command lines when more than one).
pub async fn max_live_agents_until<F: std::future::Future>(marker: &str, until: F) -> (usize, F::Output) {
    let mut until = std::pin::pin!(until);
    let mut max = 0;
    let sample = |max: &mut usize| {
        let pids = live_agents(marker);
        if pids.len() > *max {
            *max = pids.len();
            if pids.len() > 1 {
                for pid in &pids {
                    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
                    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
                    eprintln!("live agent {pid}: {} [{}]", String::from_utf8_lossy(&cmdline).replace('\0', " "), stat.trim());
                }
            }
        }
    };
    loop {
        sample(&mut max);
        tokio::select! {
            out = &mut until => {
                sample(&mut max);
                return (max, out);
            }
            _ = tokio::time::sleep(Duration::from_millis(50)) => {}
        }
    }
}

/// Waits (via WatchRuns, at most `within`) until `n` distinct runs of
/// `task_id` have matched `pred`; returns them in the order they matched.
pub async fn wait_n_runs(addr: &str, task_id: &str, n: usize, within: Duration, pred: impl Fn(&pb::Run) -> bool) -> Vec<pb::Run> {
    let mut s = watch_runs(addr, task_id).await;
    let mut seen: Vec<pb::Run> = Vec::new();
    let r = tokio::time::timeout(within, async {
        while let Some(r) = s.next().await {
            let r = r.expect("watch item");
            if pred(&r) && !seen.iter().any(|x| x.run_id == r.run_id) {
                seen.push(r);
                if seen.len() >= n {
                    return true;
                }
            }
        }
        false
    })
    .await;
    assert!(matches!(r, Ok(true)), "only {} of {n} runs of {task_id:?} matched within {within:?}: {seen:#?}", seen.len());
    seen
}

/// `GET path` over plain HTTP/1.0 to `addr` (`host:port`): the status code
/// (0 when nothing answers) and the body.
pub fn http_get(addr: &str, path: &str) -> (u16, String) {
    http_get_with(addr, path, &[])
}

/// [`http_get`] with request headers.
pub fn http_get_with(addr: &str, path: &str, headers: &[(&str, &str)]) -> (u16, String) {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(addr) else { return (0, String::new()) };
    let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
    let extra: String = headers.iter().map(|(k, v)| format!("{k}: {v}\r\n")).collect();
    let _ = write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n{extra}\r\n");
    let mut text = String::new();
    let _ = s.read_to_string(&mut text);
    let code = text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (code, text.split("\r\n\r\n").nth(1).unwrap_or("").to_string())
}

/// `POST path` over plain HTTP/1.1 (`Connection: close`) to `addr`
/// (`host:port`) with `headers` and `body`: the status code (0 when
/// nothing answers) and the body. With `body` `None` only the headers go
/// (`Expect: 100-continue` and the given `Content-Length`), as a client
/// does that waits to hear whether a large body is wanted.
pub fn http_post(addr: &str, path: &str, headers: &[(&str, &str)], body: Option<&[u8]>) -> (u16, String) {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(addr) else { return (0, String::new()) };
    let _ = s.set_read_timeout(Some(Duration::from_secs(30)));
    let mut head = format!("POST {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    match body {
        Some(b) => head.push_str(&format!("Content-Length: {}\r\n\r\n", b.len())),
        None => head.push_str("Expect: 100-continue\r\n\r\n"),
    }
    let _ = s.write_all(head.as_bytes());
    if let Some(b) = body {
        let _ = s.write_all(b);
    }
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let text = String::from_utf8_lossy(&raw).to_string();
    let code = text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (code, text.split("\r\n\r\n").nth(1).unwrap_or("").to_string())
}

/// Where skipped tests are listed (`target/test-skips.txt`): `make test`
/// clears it first and counts its lines in its closing line.
pub fn skips_file() -> PathBuf {
    let target = std::env::var("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|_| repo_root().join("target"));
    target.join("test-skips.txt")
}

/// A test that cannot run here skips, saying so on its output and in
/// [`skips_file`] — but under CI (`CI` set) a skip fails unless `allow`
/// (an environment variable, e.g. `PUNCHCLOCK_SKIP_CGROUP_TESTS`) is `1`:
/// a silent skip is a pass that proves nothing. Returns (call it and
/// `return`) when the skip is allowed; panics otherwise.
pub fn skip(test: &str, allow: &str, why: &str) {
    let allowed = std::env::var(allow).is_ok_and(|v| v == "1");
    assert!(
        std::env::var_os("CI").is_none() || allowed,
        "{test} cannot run here ({why}); under CI that fails: set {allow}=1 to allow the skip"
    );
    eprintln!("SKIPPED {test}: {why}");
    use std::io::Write;
    if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(skips_file()) {
        let _ = writeln!(f, "{test}: {why}");
    }
}
