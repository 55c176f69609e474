//! The runner's session with the control plane (`RunnerService.Connect`).
//!
//! [`run`] keeps one bidirectional stream open to the leader and reconnects
//! whenever it breaks; executions keep running across reconnects.
//!
//! # Protocol, runner side
//!
//! 1. Connect to the next control-plane address (or to the leader named by
//!    the last `Reject`) and send `Hello` with the running executions
//!    (`in_flight`) and the highest fencing token seen.
//! 2. Wait for `Welcome` (or `Reject { leader_address }` → go there). Stop
//!    the executions listed in `Welcome.unknown` (and report their end);
//!    re-send every unacknowledged `Finished`; heartbeat every
//!    `heartbeat_interval_ms`, each with a `seq` the leader echoes.
//! 3. Serve: `Assign` starts an execution (`Started`) or is refused
//!    (`Finished` REFUSED at once; silently dropped, with a warning, if its
//!    fencing token is below the highest seen: that leader is stale);
//!    `Cancel` stops one (`Finished` CANCELLED); `FinishedAck` clears a
//!    `Finished` from the outbox. Executions report `ProgressReport` and
//!    `Finished`; every `Finished` stays in the outbox until acknowledged.
//! 4. Stream ended or failed: reconnect with exponential backoff (100 ms
//!    doubling to 2 s, ±20 % jitter; reset by a `Welcome`). Progress made
//!    while disconnected is dropped; `Finished` reports wait in the outbox.
//! 5. Shutdown: refuse new work, interrupt every execution (reported
//!    INTERRUPTED: the leader dispatches them again without spending an
//!    attempt), send their `Finished` and wait (bounded) for the
//!    acknowledgements, then return.
//! 6. Self-fence ([`crate::fence`]): the Welcome's `fence_ms` counted from
//!    sending the Hello, then from sending each acknowledged heartbeat, is
//!    how long agents may run without a leader. Past it (less the kill
//!    grace and 1 s) every execution is interrupted, connected or not; the
//!    agent shims enforce the same deadline even if this process is stopped.

use std::collections::HashMap;
use std::future::Future;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::time::Duration;

use punchclock_proto::v1::runner_message::Msg as Outbound;
use punchclock_proto::v1::runner_service_client::RunnerServiceClient;
use punchclock_proto::v1::{
    Assign, Cancel, ControlMessage, Finished, Heartbeat, Hello, InFlight, Outcome, RunnerMessage, Started, Welcome,
    control_message::Msg as Inbound,
};
use rand::Rng;
use tokio::sync::mpsc;
use tokio::time::{self, Instant, MissedTickBehavior};
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};
use tracing::{debug, info, warn};

use crate::config::{AgentSpec, Credentials, RunnerConfig, normalize_address};
use crate::executor::{self, Execution, ExecutionEvent, ExecutorSettings, StopRequest};
use crate::{Error, time as clock};

/// Timeout for establishing the TCP/HTTP2 connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the control plane has to answer `Hello`.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(3);
/// HTTP/2 keep-alive, to notice a control plane that vanished silently.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);
/// Heartbeat period when `Welcome.heartbeat_interval_ms` is 0.
const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(5);
/// Capacity of the outbound message queue and of the execution event queue.
const QUEUE_CAPACITY: usize = 1024;
/// Shutdown: extra time (beyond the kill grace) for executions to end.
const SHUTDOWN_DRAIN_SLACK: Duration = Duration::from_secs(5);
/// Shutdown while not connected: how long to try delivering the last reports.
const SHUTDOWN_DELIVERY: Duration = Duration::from_secs(10);
/// Shutdown: how long to wait for the last `FinishedAck`s.
const SHUTDOWN_ACK_TIMEOUT: Duration = Duration::from_secs(5);
/// Heartbeat intervals without any message from the control plane after
/// which the stream is treated as dead (DESIGN: 3 intervals, both ways).
const SILENT_HEARTBEATS: u32 = 3;
/// Metadata key in which a follower names the leader's address on
/// `UNAVAILABLE` (set by the control plane's `service::status`).
pub const LEADER_METADATA: &str = "punchclock-leader";

/// Runs the runner until `shutdown` completes.
///
/// Connects to the control plane (trying `config.control_plane` in turn),
/// executes what it is assigned, and reconnects whenever the stream breaks;
/// connection failures are logged, never returned. When `shutdown`
/// completes, running executions are cancelled (SIGTERM, grace, SIGKILL),
/// their `Finished` reports are sent if connected, and `run` returns.
/// Each running agent holds three or four of the process's descriptors:
/// the `punchclock` binary raises the soft open-files limit to the hard
/// one before it calls this (an embedder should too).
///
/// # Errors
///
/// [`Error::InvalidConfig`] if `config` fails [`RunnerConfig::validate`];
/// [`Error::WorkDirInUse`] if another live process runs on the same
/// `config.work_dir`.
pub async fn run(mut config: RunnerConfig, shutdown: impl Future<Output = ()>) -> Result<(), Error> {
    config.validate()?;
    let cgroups = apply_cgroups(&mut config)?;
    // Held until this function returns; the kernel drops it if the process dies.
    let _lock = lock_work_dir_waiting(&config.work_dir, WORK_DIR_LOCK_WAIT).await?;
    remove_stale_execution_dirs(&config.work_dir).await;
    match &config.shim {
        Some(shim) if !shim.args.is_empty() => warn!(
            shim = %shim.program.display(),
            "no usable {} beside the (symlink-resolved) runner binary (missing, not executable, or from another build): agents start behind its `{}` subcommand, \
             about twice the CPU per start",
            crate::SHIM_BINARY,
            crate::SHIM_SUBCOMMAND,
        ),
        Some(shim) => info!(shim = %shim.program.display(), "agents start behind the shim"),
        None => warn!("no agent shim: an agent's descendants may outlive the runner"),
    }
    let mut shutdown = pin!(shutdown);
    let mut runner = Runner::new(config);
    let cgroups = Arc::new(cgroups);
    runner.executor.zygote = runner.executor.zygote.take().map(|zygote| zygote.in_cgroups(Arc::clone(&cgroups)));
    runner.executor.cgroups = Some(cgroups);
    runner.executor.http = Arc::new(http_clients(&runner.config)?);
    let _callbacks = serve_callbacks(&runner.config, &runner.executor.callbacks).await?;
    runner.run(shutdown.as_mut()).await;
    Ok(())
}

/// Finds what the host lets this runner limit, advertises it as the label
/// `cgroup` (`v2`, `v1` or `none`; a label the operator set wins), and
/// refuses every agent whose `enforce: required` limits it cannot apply
/// (logged with the reason; it is not offered to the control plane).
///
/// # Errors
///
/// [`Error::InvalidConfig`] when that leaves no agent, naming the reasons.
fn apply_cgroups(config: &mut RunnerConfig) -> Result<crate::cgroup::Cgroups, Error> {
    use crate::cgroup::Cgroups;
    let cgroups = match &config.cgroup_root {
        Some(root) => Cgroups::detect(root, &std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default(), &config.runner_id)
            .with_agent_nice(config.agent_nice),
        None => Cgroups::none("the runner was told not to use cgroups"),
    };
    config.labels.entry(punchclock_proto::labels::CGROUP.into()).or_insert_with(|| cgroups.capability().as_str().into());
    let swept = cgroups.sweep();
    if swept > 0 {
        info!(swept, "removed the cgroups a previous process of this runner left");
    }
    let mut refused = Vec::new();
    for (id, spec) in &config.agents.agents {
        let AgentSpec::Process(agent) = spec else { continue };
        let Some(why) = cgroups.missing(&agent.limits) else { continue };
        if agent.enforce == crate::config::Enforce::Required {
            tracing::error!(agent_id = %id, reason = %why, "refusing the agent: its limits are required and this runner cannot apply them");
            refused.push((id.clone(), why));
        } else {
            warn!(agent_id = %id, reason = %why, "the agent's limits are best_effort: this runner does not apply all of them");
        }
    }
    for (id, _) in &refused {
        config.agents.agents.remove(id);
    }
    if config.agents.agents.is_empty() && !refused.is_empty() {
        let reasons: Vec<String> = refused.iter().map(|(id, why)| format!("agents.{id}.limits: enforce: required, but {why}")).collect();
        return Err(Error::InvalidConfig(format!("no agent left to offer: {}", reasons.join("; "))));
    }
    info!(cgroup = cgroups.capability().as_str(), "agent limits");
    Ok(cgroups)
}

/// A client (connection pool) per HTTP agent of the agents file.
fn http_clients(config: &RunnerConfig) -> Result<HashMap<String, crate::http_agent::AgentClient>, Error> {
    let mut out = HashMap::new();
    for (id, spec) in &config.agents.agents {
        if let AgentSpec::Http(agent) = spec {
            out.insert(id.clone(), crate::http_agent::AgentClient::new(id, agent)?);
        }
    }
    Ok(out)
}

/// The callback server of asynchronous HTTP agents (`--callback-listen`),
/// serving until the returned task is dropped (aborted).
async fn serve_callbacks(config: &RunnerConfig, callbacks: &Arc<crate::http_agent::Callbacks>) -> Result<Option<AbortOnDrop>, Error> {
    let Some(addr) = config.callback_listen else { return Ok(None) };
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| Error::InvalidConfig(format!("callback_listen: cannot listen on {addr}: {e}")))?;
    let bound = listener.local_addr().map_err(|e| Error::InvalidConfig(format!("callback_listen: {e}")))?;
    let base = match &config.callback_advertise {
        Some(a) => a.trim_end_matches('/').to_string(),
        None => format!("http://{bound}"),
    };
    info!(listen = %bound, advertise = %base, "callback server for asynchronous HTTP agents");
    *callbacks.base.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(base);
    let app = crate::http_agent::callback_routes(callbacks.clone());
    Ok(Some(AbortOnDrop(tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            warn!(error = %e, "the callback server stopped");
        }
    }))))
}

/// A task aborted when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// How long a starting runner waits for its work directory's lock: a
/// runner restarted at once finds the previous process still stopping its
/// agents (up to the kill grace, 5 s by default), and waits for it rather
/// than exiting (issue 19: 2 of 146 immediate restarts exited).
pub const WORK_DIR_LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// [`lock_work_dir`], waiting up to `wait` for a previous process to let
/// go, and saying once who holds it.
///
/// # Errors
///
/// [`Error::WorkDirInUse`] if it is still held after `wait`.
pub async fn lock_work_dir_waiting(work_dir: &std::path::Path, wait: std::time::Duration) -> Result<std::fs::File, Error> {
    let deadline = tokio::time::Instant::now() + wait;
    let mut said = false;
    loop {
        match lock_work_dir(work_dir) {
            Err(Error::WorkDirInUse { .. }) if tokio::time::Instant::now() < deadline => {
                if !said {
                    let holder = std::fs::read_to_string(work_dir.join(".lock")).unwrap_or_default();
                    info!(work_dir = %work_dir.display(), holder = %holder.trim(), wait_s = wait.as_secs(), "work directory locked by another runner process; waiting for it to exit");
                    said = true;
                }
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            other => return other,
        }
    }
}

/// Takes an exclusive `flock(2)` on `<work_dir>/.lock` (created if missing),
/// without waiting, and writes this process's id into it (for the message
/// of the next one that waits). The file is opened close-on-exec, so agents do not
/// inherit (and outlive the runner with) the lock.
pub fn lock_work_dir(work_dir: &std::path::Path) -> Result<std::fs::File, Error> {
    use std::os::fd::AsRawFd;
    let io = |e: std::io::Error| Error::InvalidConfig(format!("work directory {}: {e}", work_dir.display()));
    std::fs::create_dir_all(work_dir).map_err(io)?;
    let file = std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(work_dir.join(".lock")).map_err(io)?;
    // SAFETY: flock on a file descriptor this function owns for the call.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let e = std::io::Error::last_os_error();
        return Err(if e.kind() == std::io::ErrorKind::WouldBlock { Error::WorkDirInUse { path: work_dir.to_path_buf() } } else { io(e) });
    }
    {
        use std::io::Write;
        let _ = file.set_len(0);
        let _ = writeln!(&file, "pid {}", std::process::id());
    }
    Ok(file)
}

/// Removes `exec-*` directories a previous process of this runner left
/// behind when it was killed (nothing of theirs runs: agents die with their
/// runner). Best effort.
async fn remove_stale_execution_dirs(work_dir: &std::path::Path) {
    let Ok(mut entries) = tokio::fs::read_dir(work_dir).await else { return };
    let mut removed = 0;
    while let Ok(Some(e)) = entries.next_entry().await {
        if e.file_name().to_string_lossy().starts_with("exec-") && tokio::fs::remove_dir_all(e.path()).await.is_ok() {
            removed += 1;
        }
    }
    // A previous process's fence deadline means nothing to this one.
    let _ = tokio::fs::remove_file(work_dir.join(crate::fence::FENCE_FILE)).await;
    if removed > 0 {
        info!(removed, work_dir = %work_dir.display(), "removed execution directories left by a previous run");
    }
}

/// Why a connection ended.
#[derive(Debug)]
enum SessionEnd {
    /// Shutdown was requested (and is done once [`Runner::session`] returns).
    Shutdown,
    /// The replica is not the leader; connect to this address next.
    Redirect(String),
    /// The stream failed or ended; reconnect after a backoff.
    Lost,
    /// The control plane refused this runner (`Unauthenticated`,
    /// `PermissionDenied`: its token, certificate or id): it may only
    /// change by an operator's hand, so retries wait longer and longer.
    Refused(tonic::Code, String),
}

/// An execution this runner is running.
#[derive(Debug)]
struct Running {
    /// `None` while it is being started (a process agent in a task of its
    /// own: the session keeps reading its stream meanwhile; an HTTP agent
    /// until its queued [`StartDone`] is handled).
    execution: Option<Execution>,
    /// As declared in Hello.
    in_flight: InFlight,
    /// A stop asked for while it was being started.
    pending_stop: Option<StopRequest>,
}

impl Running {
    /// Stops it now, or as soon as it has started.
    fn stop(&mut self, request: StopRequest) {
        match &mut self.execution {
            Some(execution) => execution.stop(request),
            None => {
                self.pending_stop.get_or_insert(request);
            }
        }
    }
}

/// The end of an execution's start, from the task that started it.
struct StartDone {
    assign: Assign,
    result: Result<Execution, String>,
}

/// Heartbeats whose send time is remembered, for acks that come late.
const HEARTBEATS_REMEMBERED: usize = 64;

/// Session state that outlives connections.
struct Runner {
    config: RunnerConfig,
    executor: ExecutorSettings,
    /// Running executions by execution id.
    running: HashMap<String, Running>,
    outbox: Outbox,
    /// Highest fencing token seen in a `Welcome` or `Assign`.
    max_token_seen: u64,
    /// Random per process, sent in every Hello.
    instance_id: String,
    /// The self-fence (shared with the executor and, by file, the shims).
    fence: crate::fence::Fence,
    /// The current leader's fence deadline (`None`: no fence).
    fence_after: Option<Duration>,
    /// The executions were interrupted by the fence and it was not renewed since.
    fenced: bool,
    /// The fence a too-long kill grace was last warned about: once per
    /// fence, not at every reconnect.
    grace_warned: Option<Duration>,
    /// Last heartbeat seq sent, and when recent ones were sent.
    heartbeat_seq: u64,
    heartbeats_sent: std::collections::VecDeque<(u64, Instant)>,
    /// Highest HeartbeatAck seq received on the current stream.
    acked_seq: u64,
    events_tx: mpsc::Sender<ExecutionEvent>,
    events_rx: mpsc::Receiver<ExecutionEvent>,
    starts_tx: mpsc::UnboundedSender<StartDone>,
    starts_rx: mpsc::UnboundedReceiver<StartDone>,
}

impl Runner {
    fn new(config: RunnerConfig) -> Self {
        let (events_tx, events_rx) = mpsc::channel(QUEUE_CAPACITY);
        let (starts_tx, starts_rx) = mpsc::unbounded_channel();
        let executor = ExecutorSettings::from(&config);
        Self {
            fence: executor.fence.clone(),
            fence_after: None,
            fenced: false,
            grace_warned: None,
            heartbeat_seq: 0,
            heartbeats_sent: std::collections::VecDeque::new(),
            acked_seq: 0,
            executor,
            config,
            running: HashMap::new(),
            outbox: Outbox::default(),
            max_token_seen: 0,
            instance_id: uuid::Uuid::new_v4().to_string(),
            events_tx,
            events_rx,
            starts_tx,
            starts_rx,
        }
    }

    /// The connect / serve / back off loop.
    async fn run<S: Future<Output = ()>>(mut self, mut shutdown: Pin<&mut S>) {
        let mut addresses = Addresses::new(&self.config.control_plane, self.config.uses_tls());
        let mut backoff = Backoff::default();
        // Refusals in a row: 5 s doubling to 5 min; said once a minute.
        let mut refused = Backoff::refused();
        let mut refusal_said: Option<Instant> = None;
        // Redirects followed in a row without a session.
        let mut redirects = 0u32;
        loop {
            let address = addresses.next();
            let end = self.session(address.clone(), &mut shutdown, &mut backoff).await;
            if !matches!(end, SessionEnd::Refused(..)) {
                refused = Backoff::refused();
            }
            let delay = match end {
                SessionEnd::Shutdown => return,
                SessionEnd::Refused(code, reason) => {
                    redirects = 0;
                    let delay = refused.next_delay();
                    if refusal_said.is_none_or(|t| t.elapsed() >= Duration::from_secs(60)) {
                        warn!(%address, ?code, ?reason, retry_in_s = delay.as_secs(), "the control plane refuses this runner (its token, certificate or --runner-id); retrying less and less often until that is fixed");
                        refusal_said = Some(Instant::now());
                    }
                    delay
                }
                // Follow a redirect at once: it names the leader. But a
                // leader that names itself (its engine is down), or a chain
                // of redirects, is backed off like a lost connection: it
                // answered 80-90 times a second.
                SessionEnd::Redirect(leader) => {
                    redirects += 1;
                    let to_itself = normalize_address(&leader) == address;
                    addresses.redirect(leader);
                    if to_itself || redirects > 2 { backoff.next_delay() } else { Duration::ZERO }
                }
                // Back off once per round over the configured addresses, so a
                // dead address does not delay trying the live ones.
                SessionEnd::Lost if !addresses.round_done() => {
                    redirects = 0;
                    Backoff::INITIAL
                }
                SessionEnd::Lost => {
                    redirects = 0;
                    backoff.next_delay()
                }
            };
            debug!(delay_ms = delay.as_millis(), "reconnecting after backoff");
            if self.offline(time::sleep(delay), &mut shutdown).await.is_none() {
                self.shut_down(None).await;
                return;
            }
        }
    }

    /// One connection: connect, handshake, serve until it ends. Performs the
    /// shutdown if it is requested meanwhile.
    async fn session<S: Future<Output = ()>>(&mut self, address: String, shutdown: &mut Pin<&mut S>, backoff: &mut Backoff) -> SessionEnd {
        // Bounded: a paused control plane accepts TCP but never answers.
        let hello_sent = Instant::now();
        let opened = self
            .offline(
                time::timeout(
                    HANDSHAKE_TIMEOUT,
                    Connection::open(address.clone(), self.hello(), self.config.credentials.clone(), self.config.uses_tls()),
                ),
                shutdown,
            )
            .await;
        let opened = match opened {
            Some(Err(_elapsed)) => {
                warn!(%address, timeout_s = HANDSHAKE_TIMEOUT.as_secs(), "control plane did not answer the runner stream in time");
                return SessionEnd::Lost;
            }
            Some(Ok(r)) => Some(r),
            None => None,
        };
        let mut connection = match opened {
            None => {
                self.shut_down(None).await;
                return SessionEnd::Shutdown;
            }
            Some(Ok(connection)) => connection,
            Some(Err(err)) => {
                // A follower answers UNAVAILABLE with the leader's address in
                // the `punchclock-leader` metadata: go there next.
                if let Error::Stream { status, .. } = &err
                    && let Some(leader) = status.metadata().get(LEADER_METADATA).and_then(|v| v.to_str().ok()).filter(|l| !l.is_empty())
                {
                    return on_reject(&address, status.message(), leader.to_string());
                }
                if let Error::Stream { status, .. } = &err
                    && matches!(status.code(), tonic::Code::Unauthenticated | tonic::Code::PermissionDenied)
                {
                    return SessionEnd::Refused(status.code(), status.message().to_string());
                }
                warn!(error = %err, "cannot open the runner stream");
                return SessionEnd::Lost;
            }
        };

        let first = self.offline(time::timeout(HANDSHAKE_TIMEOUT, connection.inbound.message()), shutdown).await;
        let welcome = match first {
            // Not welcomed yet: the stream is of no use for the last reports.
            None => {
                drop(connection);
                self.shut_down(None).await;
                return SessionEnd::Shutdown;
            }
            Some(Ok(Ok(Some(ControlMessage { msg: Some(Inbound::Welcome(welcome)) })))) => welcome,
            Some(Ok(Ok(Some(ControlMessage { msg: Some(Inbound::Reject(reject)) })))) => {
                return on_reject(&address, &reject.reason, reject.leader_address);
            }
            Some(Ok(Ok(other))) => {
                let err = Error::Protocol { address, message: format!("expected Welcome, got {other:?}") };
                warn!(error = %err, "handshake failed");
                return SessionEnd::Lost;
            }
            Some(Ok(Err(status))) if matches!(status.code(), tonic::Code::Unauthenticated | tonic::Code::PermissionDenied) => {
                return SessionEnd::Refused(status.code(), status.message().to_string());
            }
            Some(Ok(Err(status))) => {
                let err = Error::Stream { address, status: Box::new(status) };
                warn!(error = %err, "handshake failed");
                return SessionEnd::Lost;
            }
            Some(Err(_elapsed)) => {
                warn!(%address, timeout_s = HANDSHAKE_TIMEOUT.as_secs(), "no Welcome in time");
                return SessionEnd::Lost;
            }
        };

        backoff.reset();
        let heartbeat_every = match welcome.heartbeat_interval_ms {
            0 => DEFAULT_HEARTBEAT,
            ms => Duration::from_millis(ms.into()),
        };
        // Only a leader at least as new as any seen renews the fence.
        if welcome.fencing_token >= self.max_token_seen {
            self.fence_after = (welcome.fence_ms > 0).then(|| Duration::from_millis(welcome.fence_ms));
            self.fence.set_stop_lead(welcome.stop_lead_ms);
            // The runner stops its agents its kill grace and a second
            // before the fence: a grace longer than the leader's leaves
            // them less than a failover, or no time at all.
            if let Some(after) = self.fence_after
                && after <= self.config.kill_grace + self.fence.stop_lead()
                && self.grace_warned.replace(after) != Some(after)
            {
                warn!(
                    fence_ms = welcome.fence_ms,
                    kill_grace_ms = self.config.kill_grace.as_millis(),
                    "this runner's kill grace leaves its agents no time within the leader's fence: they are stopped whenever a heartbeat goes unanswered; give the runner the control plane's --kill-grace-ms"
                );
            }
            match self.fence_after {
                Some(after) => self.renew_fence(hello_sent, after),
                None => self.fence.disarm(),
            }
        }
        if let Err(end) = self.on_welcome(welcome, &connection).await {
            return end;
        }
        let end = self.serve(&mut connection, heartbeat_every, shutdown).await;
        if matches!(end, SessionEnd::Shutdown) {
            self.shut_down(Some(connection)).await;
        }
        end
    }

    /// Applies a `Welcome`: stops executions unknown to the leader, re-sends
    /// the outbox.
    async fn on_welcome(&mut self, welcome: Welcome, connection: &Connection) -> Result<(), SessionEnd> {
        info!(
            address = %connection.address,
            leader_id = %welcome.leader_id,
            fencing_token = welcome.fencing_token,
            "connected to the control plane"
        );
        if welcome.fencing_token < self.max_token_seen {
            warn!(
                welcome_token = welcome.fencing_token,
                max_token_seen = self.max_token_seen,
                "welcomed by a leader with an older fencing token; its assignments will be refused"
            );
        }
        self.max_token_seen = self.max_token_seen.max(welcome.fencing_token);

        for unknown in &welcome.unknown {
            if let Some(running) = self.running.get_mut(&unknown.execution_id) {
                warn!(
                    run_id = %unknown.run_id,
                    execution_id = %unknown.execution_id,
                    "the leader does not know this execution (or it ended there); stopping it"
                );
                running.stop(StopRequest::Cancel("unknown to the leader".into()));
            }
        }

        for finished in self.outbox.iter() {
            connection.send(Outbound::Finished(finished.clone())).await?;
        }
        Ok(())
    }

    /// Serves an established stream until it ends or shutdown is requested.
    async fn serve<S: Future<Output = ()>>(
        &mut self,
        connection: &mut Connection,
        heartbeat_every: Duration,
        shutdown: &mut Pin<&mut S>,
    ) -> SessionEnd {
        let mut heartbeat = time::interval_at(Instant::now() + heartbeat_every, heartbeat_every);
        heartbeat.set_missed_tick_behavior(MissedTickBehavior::Delay);
        // Heartbeat seqs count per stream; the acks received say this
        // runner reads what the leader sends.
        self.heartbeat_seq = 0;
        self.heartbeats_sent.clear();
        self.acked_seq = 0;
        // The leader answers every heartbeat; silence this long means it is
        // paused, partitioned or gone even if TCP still looks open.
        let silent_after = heartbeat_every * SILENT_HEARTBEATS;
        let mut last_inbound = Instant::now();
        loop {
            let fence_wait = self.fence_wait();
            // Biased, in this order: the stops and the liveness timers first
            // (rarely ready), then the leader's messages before the reports
            // of executions already started, so that a burst of assignments
            // is started before the Started/Finished of its first ones are
            // sent (the leader's window of slots bounds the burst).
            let step = tokio::select! {
                biased;
                () = shutdown.as_mut() => return SessionEnd::Shutdown,
                () = fence_sleep(fence_wait) => {
                    self.self_fence();
                    Ok(())
                }
                _ = heartbeat.tick() => {
                    if last_inbound.elapsed() > silent_after {
                        warn!(address = %connection.address, silent_ms = last_inbound.elapsed().as_millis(), "control plane silent; reconnecting");
                        return SessionEnd::Lost;
                    }
                    let running = u32::try_from(self.running.len()).unwrap_or(u32::MAX);
                    self.heartbeat_seq += 1;
                    let seq = self.heartbeat_seq;
                    self.heartbeats_sent.push_back((seq, Instant::now()));
                    if self.heartbeats_sent.len() > HEARTBEATS_REMEMBERED {
                        self.heartbeats_sent.pop_front();
                    }
                    connection.send(Outbound::Heartbeat(Heartbeat { running, seq, draining: false, acked_seq: self.acked_seq })).await
                }
                inbound = connection.inbound.message() => match inbound {
                    Ok(Some(message)) => {
                        last_inbound = Instant::now();
                        self.on_control(message, connection).await
                    }
                    Ok(None) => {
                        info!(address = %connection.address, "control plane closed the runner stream");
                        Err(SessionEnd::Lost)
                    }
                    Err(status) => {
                        let err = Error::Stream { address: connection.address.clone(), status: Box::new(status) };
                        warn!(error = %err, "runner stream failed");
                        Err(SessionEnd::Lost)
                    }
                },
                Some(done) = self.starts_rx.recv() => match self.on_start_done(done) {
                    Some(message) => connection.send(message).await,
                    None => Ok(()),
                },
                Some(event) = self.events_rx.recv() => match self.on_event(event) {
                    Some(message) => connection.send(message).await,
                    None => Ok(()),
                },
            };
            if let Err(end) = step {
                return end;
            }
        }
    }

    /// Handles one message from the control plane.
    async fn on_control(&mut self, message: ControlMessage, connection: &Connection) -> Result<(), SessionEnd> {
        match message.msg {
            Some(Inbound::Assign(assign)) => self.on_assign(assign, connection).await,
            Some(Inbound::Cancel(cancel)) => {
                self.on_cancel(&cancel);
                Ok(())
            }
            Some(Inbound::FinishedAck(ack)) => {
                debug!(execution_id = %ack.execution_id, "Finished acknowledged");
                self.outbox.ack(&ack.execution_id);
                Ok(())
            }
            Some(Inbound::Reject(reject)) => Err(on_reject(&connection.address, &reject.reason, reject.leader_address)),
            Some(Inbound::HeartbeatAck(ack)) => {
                if ack.fencing_token < self.max_token_seen {
                    // A deposed leader still answering: find the new one.
                    warn!(
                        ack_token = ack.fencing_token,
                        max_token_seen = self.max_token_seen,
                        "heartbeat answered by a stale leader; reconnecting"
                    );
                    return Err(SessionEnd::Lost);
                }
                self.acked_seq = self.acked_seq.max(ack.seq);
                // The fence runs from when the acknowledged heartbeat was sent.
                if let (Some(after), Some(&(_, sent))) = (self.fence_after, self.heartbeats_sent.iter().find(|(seq, _)| *seq == ack.seq)) {
                    self.renew_fence(sent, after);
                }
                Ok(())
            }
            Some(Inbound::Welcome(welcome)) => {
                warn!(fencing_token = welcome.fencing_token, "unexpected second Welcome; ignoring it");
                self.max_token_seen = self.max_token_seen.max(welcome.fencing_token);
                Ok(())
            }
            None => {
                debug!("ignoring an empty control message");
                Ok(())
            }
        }
    }

    /// Starts an assignment, or refuses it with an immediate `Finished`.
    async fn on_assign(&mut self, assign: Assign, connection: &Connection) -> Result<(), SessionEnd> {
        if !self.accept_token(&assign) {
            return Ok(());
        }
        // A repeated Assign of an execution already running here (e.g. re-sent
        // around a reconnect) is ignored: answering FAILED would be recorded
        // as the outcome of the real, still-running execution.
        if self.running.contains_key(&assign.execution_id) {
            warn!(run_id = %assign.run_id, execution_id = %assign.execution_id, "duplicate assignment of a running execution; ignoring it");
            return Ok(());
        }
        match self.start(assign) {
            Ok(()) => Ok(()),
            Err(refused) => {
                let (assign, reason) = *refused;
                connection.send(Outbound::Finished(self.refuse(&assign, Outcome::Refused, reason))).await
            }
        }
    }

    /// The fencing check: false (and a warning) if the assignment comes from
    /// a leader older than one already seen.
    fn accept_token(&mut self, assign: &Assign) -> bool {
        if assign.fencing_token < self.max_token_seen {
            warn!(
                run_id = %assign.run_id,
                execution_id = %assign.execution_id,
                assign_token = assign.fencing_token,
                max_token_seen = self.max_token_seen,
                "refusing an assignment from a stale leader"
            );
            return false;
        }
        self.max_token_seen = assign.fencing_token;
        true
    }

    /// Takes the assignment and starts it: a process agent in a task of its
    /// own (the session keeps reading its stream while agents spawn: a burst
    /// of assignments must not hold back the heartbeat acks behind it), an
    /// HTTP agent here (its start spawns the request and returns). Either
    /// way the outcome comes back as a [`StartDone`]. `Err` is why it is not
    /// taken (unknown agent, no free slot, a duplicate): REFUSED.
    fn start(&mut self, assign: Assign) -> Result<(), Box<(Assign, String)>> {
        let Some(spec) = self.config.agents.get(&assign.agent_id) else {
            let reason = format!("unknown agent {:?}: not in this runner's agents file", assign.agent_id);
            return Err(Box::new((assign, reason)));
        };
        if self.running.contains_key(&assign.execution_id) {
            let reason = format!("execution {} is already running on this runner", assign.execution_id);
            return Err(Box::new((assign, reason)));
        }
        if self.running.len() >= usize::try_from(self.config.slots).unwrap_or(usize::MAX) {
            let reason = format!("no free slot: all {} slots are busy", self.config.slots);
            return Err(Box::new((assign, reason)));
        }
        let in_flight = InFlight {
            run_id: assign.run_id.clone(),
            execution_id: assign.execution_id.clone(),
            attempt: assign.attempt,
            started_at: None,
        };
        self.running.insert(assign.execution_id.clone(), Running { execution: None, in_flight, pending_stop: None });
        let received = std::time::Instant::now();
        let agent = match spec {
            // An HTTP agent's start only spawns its request: done here, not
            // in a task whose wait for a worker thread would be start lag
            // (with 1,000 due at once that wait was 34 ms at p99).
            AgentSpec::Http(_) => {
                let result = match self.executor.http.get(&assign.agent_id) {
                    Some(client) => crate::http_agent::start(client, &self.executor.callbacks, &assign, self.events_tx.clone()),
                    None => Err(Error::InvalidConfig(format!("no client for http agent {:?}", assign.agent_id))),
                };
                log_start(&assign, received, std::time::Duration::ZERO);
                let _ = self.starts_tx.send(StartDone { assign, result: result.map_err(|err| err.to_string()) });
                return Ok(());
            }
            AgentSpec::Process(agent) => agent.clone(),
        };
        let (settings, events, starts) = (self.executor.clone(), self.events_tx.clone(), self.starts_tx.clone());
        let starting = self.executor.starts.enter();
        tokio::spawn(async move {
            let _starting = starting;
            let queued = received.elapsed();
            let result = executor::start(&agent, &assign, &settings, events).await;
            log_start(&assign, received, queued);
            let _ = starts.send(StartDone { assign, result: result.map_err(|err| err.to_string()) });
        });
        Ok(())
    }

    /// An execution's start ended: its `Started` (or, when the agent cannot
    /// start — bad command or working_dir — a FAILED report: an attempt that
    /// failed, retried per the task's policy).
    fn on_start_done(&mut self, done: StartDone) -> Option<Outbound> {
        let StartDone { assign, result } = done;
        match result {
            Ok(mut execution) => {
                let Some(running) = self.running.get_mut(&assign.execution_id) else {
                    execution.cancel("no longer wanted");
                    return None;
                };
                if let Some(stop) = running.pending_stop.take() {
                    execution.stop(stop);
                }
                running.in_flight = execution.in_flight();
                let started = Started {
                    run_id: assign.run_id.clone(),
                    execution_id: assign.execution_id.clone(),
                    started_at: Some(execution.started_at()),
                    pid: execution.pid(),
                };
                running.execution = Some(execution);
                Some(Outbound::Started(started))
            }
            Err(reason) => {
                self.running.remove(&assign.execution_id);
                Some(Outbound::Finished(self.refuse(&assign, Outcome::Failed, reason)))
            }
        }
    }

    /// A `Finished` (REFUSED, or FAILED when the agent cannot start) for an
    /// assignment that was not started, kept in the outbox like any other.
    fn refuse(&mut self, assign: &Assign, outcome: Outcome, reason: String) -> Finished {
        warn!(
            run_id = %assign.run_id,
            execution_id = %assign.execution_id,
            agent_id = %assign.agent_id,
            %reason,
            "refusing assignment"
        );
        let finished = Finished {
            run_id: assign.run_id.clone(),
            execution_id: assign.execution_id.clone(),
            outcome: outcome.into(),
            error: reason,
            finished_at: Some(clock::now_timestamp()),
            ..Finished::default()
        };
        self.outbox.push(finished.clone());
        finished
    }

    fn on_cancel(&mut self, cancel: &Cancel) {
        match self.running.get_mut(&cancel.execution_id) {
            Some(running) => {
                info!(
                    run_id = %cancel.run_id,
                    execution_id = %cancel.execution_id,
                    reason = %cancel.reason,
                    "cancelling execution"
                );
                running.stop(StopRequest::Cancel(cancel.reason.clone()));
            }
            None => {
                debug!(execution_id = %cancel.execution_id, "cancel for an execution that is not running")
            }
        }
    }

    /// Records an execution event; returns the message to send, if any.
    fn on_event(&mut self, event: ExecutionEvent) -> Option<Outbound> {
        match event {
            ExecutionEvent::Progress(progress) => Some(Outbound::Progress(progress)),
            ExecutionEvent::Finished(finished) => {
                self.running.remove(&finished.execution_id);
                self.outbox.push(finished.clone());
                Some(Outbound::Finished(finished))
            }
        }
    }

    /// Drives `work` while disconnected, recording execution events (progress
    /// is dropped, `Finished` goes to the outbox). `None` if shutdown was
    /// requested first.
    async fn offline<T, S: Future<Output = ()>>(&mut self, work: impl Future<Output = T>, shutdown: &mut Pin<&mut S>) -> Option<T> {
        let mut work = pin!(work);
        loop {
            let fence_wait = self.fence_wait();
            tokio::select! {
                output = &mut work => return Some(output),
                () = shutdown.as_mut() => return None,
                () = fence_sleep(fence_wait) => self.self_fence(),
                Some(done) = self.starts_rx.recv() => {
                    // A Started is not needed offline: the Hello declares it.
                    let _ = self.on_start_done(done);
                }
                Some(event) = self.events_rx.recv() => {
                    if let Some(Outbound::Progress(progress)) = self.on_event(event) {
                        debug!(execution_id = %progress.execution_id, "not connected; dropping progress");
                    }
                }
            }
        }
    }

    /// Shutdown: cancels every execution, reports their `Finished` on
    /// `connection` (if any) and waits, bounded, for the acknowledgements.
    async fn shut_down(&mut self, mut connection: Option<Connection>) {
        info!(running = self.running.len(), "shutting down: stopping running executions");
        // First tell the leader to send nothing more: what is interrupted
        // here is dispatched elsewhere.
        if let Some(open) = &connection {
            self.heartbeat_seq += 1;
            let running = u32::try_from(self.running.len()).unwrap_or(u32::MAX);
            let draining = Heartbeat { running, seq: self.heartbeat_seq, draining: true, acked_seq: self.acked_seq };
            if open.send(Outbound::Heartbeat(draining)).await.is_err() {
                connection = None;
            }
        }
        for running in self.running.values_mut() {
            running.stop(StopRequest::Interrupt("runner shutting down".into()));
        }

        let drain_deadline = Instant::now() + self.config.kill_grace + SHUTDOWN_DRAIN_SLACK;
        let mut ack_deadline = None;
        loop {
            let deadline = if self.running.is_empty() {
                if connection.is_none() || self.outbox.is_empty() {
                    break;
                }
                *ack_deadline.get_or_insert_with(|| Instant::now() + SHUTDOWN_ACK_TIMEOUT)
            } else {
                drain_deadline
            };
            tokio::select! {
                () = time::sleep_until(deadline) => break,
                Some(done) = self.starts_rx.recv() => {
                    if let (Some(message), Some(open)) = (self.on_start_done(done), &connection)
                        && open.send(message).await.is_err()
                    {
                        connection = None;
                    }
                },
                Some(event) = self.events_rx.recv() => {
                    if let (Some(message), Some(open)) = (self.on_event(event), &connection)
                        && open.send(message).await.is_err()
                    {
                        connection = None;
                    }
                },
                inbound = next_message(&mut connection) => match inbound {
                    Some(message) => self.on_control_while_stopping(message, &mut connection).await,
                    None => connection = None,
                },
            }
        }

        if !self.running.is_empty() {
            warn!(still_running = self.running.len(), "executions did not stop in time");
        }
        if !self.outbox.is_empty() && connection.is_none() {
            self.deliver_outbox().await;
        }
        if !self.outbox.is_empty() {
            warn!(unacknowledged = self.outbox.len(), "shutting down with Finished reports the control plane has not acknowledged");
        }
        info!("runner stopped");
    }

    /// Shutting down while not connected: one bounded last try to hand the
    /// unacknowledged reports (interruptions among them) to a leader, so
    /// they are not presumed lost. Says it is draining, refuses anything
    /// assigned meanwhile.
    async fn deliver_outbox(&mut self) {
        let deadline = Instant::now() + SHUTDOWN_DELIVERY;
        let mut addresses = Addresses::new(&self.config.control_plane, self.config.uses_tls());
        info!(unacknowledged = self.outbox.len(), "not connected: delivering the last reports before stopping");
        while !self.outbox.is_empty() && Instant::now() < deadline {
            let address = addresses.next();
            let left = deadline.saturating_duration_since(Instant::now());
            let mut connection = match time::timeout(
                HANDSHAKE_TIMEOUT.min(left),
                Connection::open(address.clone(), self.hello(), self.config.credentials.clone(), self.config.uses_tls()),
            )
            .await
            {
                Ok(Ok(c)) => c,
                Ok(Err(Error::Stream { status, .. })) => {
                    if let Some(leader) = status.metadata().get(LEADER_METADATA).and_then(|v| v.to_str().ok()).filter(|l| !l.is_empty()) {
                        addresses.redirect(leader.to_string());
                    }
                    continue;
                }
                _ => {
                    time::sleep(Backoff::INITIAL.min(deadline.saturating_duration_since(Instant::now()))).await;
                    continue;
                }
            };
            let left = deadline.saturating_duration_since(Instant::now());
            match time::timeout(HANDSHAKE_TIMEOUT.min(left), connection.inbound.message()).await {
                Ok(Ok(Some(ControlMessage { msg: Some(Inbound::Welcome(_)) }))) => {}
                Ok(Ok(Some(ControlMessage { msg: Some(Inbound::Reject(reject)) }))) if !reject.leader_address.is_empty() => {
                    addresses.redirect(reject.leader_address);
                    continue;
                }
                _ => continue,
            }
            let draining = Heartbeat { running: 0, seq: 1, draining: true, acked_seq: 0 };
            let mut open = Some(connection);
            let reports: Vec<Finished> = self.outbox.iter().cloned().collect();
            for message in std::iter::once(Outbound::Heartbeat(draining)).chain(reports.into_iter().map(Outbound::Finished)) {
                if let Some(c) = &open
                    && c.send(message).await.is_err()
                {
                    open = None;
                }
            }
            while !self.outbox.is_empty() && open.is_some() {
                let left = deadline.saturating_duration_since(Instant::now());
                match time::timeout(left, next_message(&mut open)).await {
                    Ok(Some(message)) => self.on_control_while_stopping(message, &mut open).await,
                    Ok(None) | Err(_) => break,
                }
            }
        }
    }

    /// During shutdown: record acks, refuse new assignments.
    async fn on_control_while_stopping(&mut self, message: ControlMessage, connection: &mut Option<Connection>) {
        match message.msg {
            Some(Inbound::FinishedAck(ack)) => self.outbox.ack(&ack.execution_id),
            Some(Inbound::Assign(assign)) if self.accept_token(&assign) => {
                let finished = self.refuse(&assign, Outcome::Refused, "runner is shutting down".to_owned());
                if let Some(open) = connection
                    && open.send(Outbound::Finished(finished)).await.is_err()
                {
                    *connection = None;
                }
            }
            Some(Inbound::Reject(_)) => *connection = None,
            _ => {}
        }
    }

    /// A leader acknowledged what this runner sent at `sent`: agents may
    /// run until `sent + after`.
    fn renew_fence(&mut self, sent: Instant, after: Duration) {
        let remaining = (sent + after).saturating_duration_since(Instant::now());
        self.fence.extend(remaining);
        self.fenced = false;
    }

    /// How long until the fence requires stopping the agents; `None` when
    /// there is nothing to stop (no fence, no execution, or already done).
    fn fence_wait(&self) -> Option<Duration> {
        if self.fenced || self.running.is_empty() {
            return None;
        }
        self.fence.stop_in()
    }

    /// No leader acknowledged this runner in time: interrupt every execution.
    fn self_fence(&mut self) {
        self.fenced = true;
        warn!(running = self.running.len(), "{}; interrupting every execution", crate::fence::FENCE_REASON);
        for running in self.running.values_mut() {
            running.stop(StopRequest::Interrupt(crate::fence::FENCE_REASON.into()));
        }
    }

    /// The `Hello` describing this runner right now.
    fn hello(&self) -> Hello {
        Hello {
            runner_id: self.config.runner_id.clone(),
            agents: self.config.agents.ids().map(str::to_owned).collect(),
            slots: self.config.slots,
            labels: self.config.labels.clone().into_iter().collect(),
            version: env!("CARGO_PKG_VERSION").to_owned(),
            // Executions still running, and those finished but not yet
            // acknowledged: a new leader must not declare either lost before
            // the outbox is re-sent right after Welcome.
            in_flight: self
                .running
                .values()
                .map(|running| running.in_flight.clone())
                .chain(self.outbox.iter().map(|f| InFlight {
                    run_id: f.run_id.clone(),
                    execution_id: f.execution_id.clone(),
                    attempt: 0,
                    started_at: f.started_at,
                }))
                .collect(),
            max_token_seen: self.max_token_seen,
            instance_id: self.instance_id.clone(),
        }
    }
}

/// Sleeps `wait`, or forever when `None`.
async fn fence_sleep(wait: Option<Duration>) {
    match wait {
        Some(d) => time::sleep(d).await,
        None => std::future::pending().await,
    }
}

/// Logs a `Reject` and decides where to go next.
fn on_reject(address: &str, reason: &str, leader_address: String) -> SessionEnd {
    if leader_address.is_empty() {
        warn!(%address, %reason, "control plane rejected the runner");
        SessionEnd::Lost
    } else {
        info!(%address, %reason, leader = %leader_address, "not the leader; redirected");
        SessionEnd::Redirect(leader_address)
    }
}

/// The next message of an optional stream; `None` when there is no stream
/// or it ended or failed. Pending forever without a stream.
async fn next_message(connection: &mut Option<Connection>) -> Option<ControlMessage> {
    match connection {
        Some(open) => open.inbound.message().await.ok().flatten(),
        None => std::future::pending().await,
    }
}

/// An open `RunnerService.Connect` stream.
#[derive(Debug)]
struct Connection {
    address: String,
    outbound: mpsc::Sender<RunnerMessage>,
    inbound: Streaming<ControlMessage>,
}

impl Connection {
    /// Dials `address`, opens the stream and sends `hello` first.
    async fn open(address: String, hello: Hello, credentials: Credentials, require_tls: bool) -> Result<Self, Error> {
        // A runner configured for TLS never sends its token or its
        // assignments in clear, whatever a redirect says.
        if require_tls && !address.starts_with("https://") {
            return Err(Error::Protocol {
                address,
                message: "refusing a plaintext connection: this runner uses TLS (the leader's --advertise should be https://)".into(),
            });
        }
        let mut endpoint =
            Endpoint::from_shared(address.clone()).map_err(|source| Error::InvalidAddress { address: address.clone(), source })?;
        if address.starts_with("https://") {
            let mut tls = match &credentials.ca_pem {
                Some(ca) => ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca)),
                None => ClientTlsConfig::new().with_webpki_roots(),
            };
            if let Some((cert, key)) = &credentials.identity {
                tls = tls.identity(Identity::from_pem(cert, key));
            }
            endpoint = endpoint.tls_config(tls).map_err(|source| Error::InvalidAddress { address: address.clone(), source })?;
        }
        let endpoint = endpoint
            .connect_timeout(CONNECT_TIMEOUT)
            .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
            .keep_alive_timeout(KEEPALIVE_TIMEOUT)
            .keep_alive_while_idle(true);
        let channel = endpoint.connect().await.map_err(|source| Error::Connect { address: address.clone(), source })?;

        let (outbound, queue) = mpsc::channel(QUEUE_CAPACITY);
        // Cannot fail: the queue is empty and its receiver is alive.
        let _ = outbound.try_send(RunnerMessage { msg: Some(Outbound::Hello(hello)) });
        let mut request = tonic::Request::new(ReceiverStream::new(queue));
        // Checked by RunnerConfig::validate: printable ASCII.
        if let Some(v) = credentials.current_token().as_deref().and_then(punchclock_proto::bearer::header) {
            request.metadata_mut().insert("authorization", v);
        }
        let response = RunnerServiceClient::new(channel)
            .connect(request)
            .await
            .map_err(|status| Error::Stream { address: address.clone(), status: Box::new(status) })?;
        debug!(%address, "runner stream open");
        Ok(Self { address, outbound, inbound: response.into_inner() })
    }

    /// Queues a message; `Err(SessionEnd::Lost)` if the stream is gone.
    async fn send(&self, message: Outbound) -> Result<(), SessionEnd> {
        self.outbound.send(RunnerMessage { msg: Some(message) }).await.map_err(|_| {
            warn!(address = %self.address, "runner stream closed while sending");
            SessionEnd::Lost
        })
    }
}

/// `Finished` reports not yet acknowledged, oldest first, at most one per
/// execution id. A push and an ack cost O(log n): a burst or a reconnect
/// leaves thousands unacknowledged at once, and a scan of them per push and
/// per ack was quadratic.
#[derive(Debug, Default)]
struct Outbox {
    /// By order of push.
    reports: std::collections::BTreeMap<u64, Finished>,
    /// Execution id → its key in `reports`.
    by_execution: HashMap<String, u64>,
    next: u64,
}

impl Outbox {
    /// Adds `finished`, replacing an earlier report for the same execution
    /// (the new one goes last).
    fn push(&mut self, finished: Finished) {
        self.ack(&finished.execution_id);
        self.next += 1;
        self.by_execution.insert(finished.execution_id.clone(), self.next);
        self.reports.insert(self.next, finished);
    }

    fn ack(&mut self, execution_id: &str) {
        if let Some(seq) = self.by_execution.remove(execution_id) {
            self.reports.remove(&seq);
        }
    }

    fn iter(&self) -> impl Iterator<Item = &Finished> {
        self.reports.values()
    }

    fn len(&self) -> usize {
        self.reports.len()
    }

    fn is_empty(&self) -> bool {
        self.reports.is_empty()
    }
}

/// Control-plane addresses, tried in turn; a redirect goes first.
#[derive(Debug)]
struct Addresses {
    configured: Vec<String>,
    next: usize,
    redirect: Option<String>,
    /// Configured addresses tried since the last full round.
    tried: usize,
    /// The runner talks TLS: a bare redirect target means `https://`.
    tls: bool,
}

impl Addresses {
    /// `tls`: the runner talks TLS, so a bare `host:port` (configured or
    /// redirected to) means `https://`.
    fn new(configured: &[String], tls: bool) -> Self {
        let mut addresses = Self { configured: Vec::new(), next: 0, redirect: None, tried: 0, tls };
        addresses.configured = configured.iter().map(|a| addresses.normalize(a)).collect();
        addresses
    }

    fn normalize(&self, address: &str) -> String {
        let address = address.trim();
        if self.tls && !address.contains("://") { format!("https://{address}") } else { normalize_address(address) }
    }

    fn next(&mut self) -> String {
        if let Some(leader) = self.redirect.take() {
            return leader;
        }
        // `configured` is non-empty (RunnerConfig::validate).
        let address = self.configured.get(self.next % self.configured.len().max(1)).cloned();
        self.next = self.next.wrapping_add(1);
        self.tried += 1;
        address.unwrap_or_default()
    }

    /// True (once) when every configured address was tried since the last round.
    fn round_done(&mut self) -> bool {
        if self.tried >= self.configured.len() {
            self.tried = 0;
            true
        } else {
            false
        }
    }

    fn redirect(&mut self, leader: String) {
        self.redirect = Some(self.normalize(&leader));
    }
}

/// Reconnect delays: 100 ms doubling to 2 s, each with ±20 % jitter (2 s:
/// a runner finds a new leader well within a lease TTL after it is
/// elected); after a refusal, 5 s doubling to 5 min.
#[derive(Debug)]
struct Backoff {
    next: Duration,
    initial: Duration,
    max: Duration,
}

impl Backoff {
    const INITIAL: Duration = Duration::from_millis(100);
    const MAX: Duration = Duration::from_secs(2);

    /// After a refusal (credentials, runner id): 5 s doubling to 5 min.
    fn refused() -> Self {
        Self { next: Duration::from_secs(5), initial: Duration::from_secs(5), max: Duration::from_secs(300) }
    }

    fn next_delay(&mut self) -> Duration {
        let base = self.next;
        self.next = (self.next * 2).min(self.max);
        base.mul_f64(rand::rng().random_range(0.8..=1.2))
    }

    fn reset(&mut self) {
        self.next = self.initial;
    }
}

impl Default for Backoff {
    fn default() -> Self {
        Self { next: Self::INITIAL, initial: Self::INITIAL, max: Self::MAX }
    }
}

/// Where a start's time went (`punchclock::start=debug`): the slot to this
/// runner's receipt of the assignment (dispatch and the stream), the wait
/// for a worker thread (`queued`), the start itself.
fn log_start(assign: &Assign, received: std::time::Instant, queued: std::time::Duration) {
    debug!(
        target: "punchclock::start",
        execution_id = %assign.execution_id,
        slot_to_receipt_us = slot_to_receipt_us(assign, received),
        queued_us = queued.as_micros(),
        start_us = received.elapsed().saturating_sub(queued).as_micros(),
        "start"
    );
}

/// Microseconds from an assignment's slot to the moment this runner read
/// it (`received`), for the `punchclock::start` debug line; -1 without a
/// slot time.
fn slot_to_receipt_us(assign: &Assign, received: std::time::Instant) -> i64 {
    let Some(slot) = assign.scheduled_at.as_ref().and_then(clock::from_timestamp) else { return -1 };
    let since_receipt = i64::try_from(received.elapsed().as_micros()).unwrap_or(i64::MAX);
    (clock::now() - slot).num_microseconds().map_or(-1, |us| us - since_receipt)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_work_dir_serves_one_runner_process_at_a_time() {
        let dir = tempfile::tempdir().expect("tempdir");
        let work = dir.path().join("r1");
        let held = lock_work_dir(&work).expect("first lock");
        assert!(matches!(lock_work_dir(&work), Err(Error::WorkDirInUse { .. })), "a second holder is refused");
        drop(held);
        lock_work_dir(&work).expect("free again once the holder is gone");
    }

    /// Issue 19: a runner restarted at once exited because the previous
    /// process still held the lock while stopping its agents; it waits.
    #[tokio::test]
    async fn a_restarted_runner_waits_for_the_previous_process_to_let_go() {
        let dir = tempfile::tempdir().expect("tempdir");
        let work = dir.path().join("r1");
        let held = lock_work_dir(&work).expect("first lock");
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let release = tokio::spawn(async move {
            let _ = rx.await;
            drop(held);
        });
        let waiter = tokio::spawn({
            let work = work.clone();
            async move { lock_work_dir_waiting(&work, Duration::from_secs(10)).await }
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!waiter.is_finished(), "it waits while the lock is held");
        let _ = tx.send(());
        release.await.expect("released");
        waiter.await.expect("task").expect("it takes the lock once the holder is gone");
        // A holder that never lets go: refused after the wait.
        let _held = lock_work_dir(&dir.path().join("r2")).expect("lock");
        let r = lock_work_dir_waiting(&dir.path().join("r2"), Duration::from_millis(200)).await;
        assert!(matches!(r, Err(Error::WorkDirInUse { .. })));
    }

    #[test]
    fn backoff_doubles_to_the_cap_with_jitter_and_resets() {
        let mut backoff = Backoff::default();
        let within = |delay: Duration, base: Duration| delay >= base.mul_f64(0.8) && delay <= base.mul_f64(1.2);
        for base_ms in [100, 200, 400, 800, 1600, 2000, 2000] {
            let delay = backoff.next_delay();
            assert!(within(delay, Duration::from_millis(base_ms)), "{delay:?} vs {base_ms} ms");
        }
        backoff.reset();
        assert!(within(backoff.next_delay(), Duration::from_millis(100)));
    }

    #[test]
    fn addresses_rotate_and_redirect_goes_first() {
        let mut addresses = Addresses::new(&["http://a:1".to_owned(), "b:2".to_owned()], false);
        assert_eq!(addresses.next(), "http://a:1");
        assert_eq!(addresses.next(), "http://b:2");
        addresses.redirect("leader:3".to_owned());
        assert_eq!(addresses.next(), "http://leader:3");
        assert_eq!(addresses.next(), "http://a:1");
    }

    #[tokio::test]
    async fn a_tls_runner_never_goes_plaintext() {
        // Bare addresses, configured or redirected to, mean https.
        let mut addresses = Addresses::new(&["a:1".to_owned()], true);
        assert_eq!(addresses.next(), "https://a:1");
        addresses.redirect("leader:3".to_owned());
        assert_eq!(addresses.next(), "https://leader:3");
        // An explicit http:// (a leader's --advertise) is refused before
        // any connection: the token would go in clear.
        let refused =
            Connection::open("http://127.0.0.1:9".into(), Hello::default(), Credentials::default(), true).await.expect_err("refused");
        assert!(refused.to_string().contains("refusing a plaintext connection"), "{refused}");
    }

    #[test]
    fn outbox_keeps_one_report_per_execution_until_acked() {
        let finished = |id: &str, error: &str| Finished { execution_id: id.to_owned(), error: error.to_owned(), ..Finished::default() };
        let mut outbox = Outbox::default();
        outbox.push(finished("e1", "first"));
        outbox.push(finished("e2", ""));
        outbox.push(finished("e1", "second"));
        let errors: Vec<_> = outbox.iter().map(|f| (f.execution_id.as_str(), f.error.as_str())).collect();
        assert_eq!(errors, [("e2", ""), ("e1", "second")]);
        outbox.ack("e2");
        assert_eq!(outbox.len(), 1);
        outbox.ack("e1");
        assert!(outbox.is_empty());
    }
}
