//! The process executor: runs one assignment as a child process group and
//! reports what happens to it.
//!
//! [`start`] takes a private directory (from [`ExecutionDirs`], reused
//! across executions), spawns the agent and hands back an [`Execution`]
//! handle; a background task then supervises the process and sends
//! [`ExecutionEvent`]s: any number of `Progress`, then exactly one
//! `Finished` (by then the directory is emptied and free again).
//!
//! # The agent's contract
//!
//! * **argv**: the agent's `command` (no shell), in its `working_dir`.
//! * **stdin**: the run's context JSON (`Assign.context_json`), then EOF.
//! * **environment**: the runner's, plus the agent's `env`, plus
//!   `PUNCHCLOCK_TASK_ID`, `PUNCHCLOCK_RUN_ID`, `PUNCHCLOCK_EXECUTION_ID`,
//!   `PUNCHCLOCK_ATTEMPT`, `PUNCHCLOCK_SCHEDULED_AT` and `PUNCHCLOCK_DEADLINE`
//!   (RFC 3339 UTC, `...Z`; empty when the assignment has none),
//!   `PUNCHCLOCK_PROGRESS_FILE`, `PUNCHCLOCK_RESULT_FILE`,
//!   `PUNCHCLOCK_CHECKPOINT_FILE` and `TRACEPARENT`.
//! * **progress**: JSON lines appended to `$PUNCHCLOCK_PROGRESS_FILE`, each
//!   `{"percent": number?, "message": string?, "checkpoint": any?}`; polled
//!   every 200 ms and once more after exit.
//! * **result**: `$PUNCHCLOCK_RESULT_FILE`, JSON, read after exit.
//! * **checkpoint**: `$PUNCHCLOCK_CHECKPOINT_FILE` holds the last checkpoint
//!   the control plane has for the run (absent if none).
//! * **outcome**: exit code 0 succeeds; anything else fails. stdout and
//!   stderr are kept (last 64 KiB each) for the run record.
//!
//! # Stopping
//!
//! The agent runs in its own process group. On timeout or cancel the whole
//! group gets SIGTERM, then SIGKILL after the grace period. When the agent's
//! main process exits, whatever it left behind in its group is killed too:
//! an execution never outlives its agent process.
//!
//! # Surviving the runner's death
//!
//! If the runner process dies (even by SIGKILL), its agents must die too.
//! Two modes, chosen by [`ExecutorSettings::shim`]:
//!
//! * **Without a shim** the agent itself is the group leader and gets
//!   `PR_SET_PDEATHSIG(SIGKILL)`. Only that one process is covered: children
//!   the agent spawned (`sleep 3600 &`) are re-parented and survive a killed
//!   runner. Cheap, and enough for agents that do not fork.
//! * **With the shim** (`punchclock-agent-shim -- <command...>`, or
//!   `punchclock __agent-shim -- ...`; see [`crate::shim`]) a tiny supervisor process leads the group; it gets a
//!   parent-death signal and then SIGKILLs the whole group, so nothing
//!   survives. Costs one extra process per execution, and the agent's exit
//!   by signal N is seen as exit code 128+N. With [`ExecutorSettings::zygote`]
//!   that supervisor is forked by the shim's fork server ([`crate::zygote`])
//!   instead of exec'd by the runner: same supervisor, same guarantees
//!   (the zygote exits when the runner's socket closes, and its supervisors'
//!   parent-death signal fires), about half the CPU per start. A request
//!   too large for the zygote (argv plus environment over
//!   [`crate::shim::zygote::MAX_REQUEST_BYTES`]) is exec'd as before.
//!
//! Linux delivers the parent-death signal when the *thread* that spawned the
//! child exits. Executions are spawned from tokio worker threads, which live
//! as long as the runtime, so do not call [`start`] from a thread that may
//! exit early (e.g. inside `spawn_blocking`).

use std::collections::VecDeque;
use std::ffi::OsString;
use std::future;
use std::io;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use punchclock_proto::v1::{Assign, Finished, InFlight, Outcome, ProgressReport};
use serde::Deserialize;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::process::{Child, Command};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::{self, MissedTickBehavior};
use tracing::{debug, info, warn};

use crate::config::{ProcessAgent, RunnerConfig, ShimCommand};
use crate::shim::zygote::Request as ShimRequest;
use crate::shim::{SHIM_FENCE_FILE_ENV, SHIM_KILL_GRACE_ENV, SHIM_NICE_ENV, SHIM_PARENT_PID_ENV};
use crate::zygote::{Zygote, ZygoteProcess};
use crate::{Error, time as clock};

/// How much of stdout and of stderr is kept (the last 64 KiB of each).
pub const OUTPUT_TAIL_BYTES: usize = 64 * 1024;

/// How often the progress file is polled.
const PROGRESS_POLL_INTERVAL: Duration = Duration::from_millis(200);

/// How long to wait for stdout/stderr to reach EOF once the process group is
/// gone (a process that escaped the group may still hold the pipes).
const OUTPUT_DRAIN_TIMEOUT: Duration = Duration::from_secs(2);

/// Longest progress line accepted; longer ones are dropped.
const MAX_PROGRESS_LINE_BYTES: usize = 256 * 1024;
/// Most progress-file bytes read per poll (the rest waits for the next poll).
const MAX_PROGRESS_READ_BYTES: u64 = 4 * 1024 * 1024;
/// How long the shim gets to sweep an agent's descendants when stopped.
const SHIM_SWEEP_WAIT: Duration = Duration::from_millis(500);
/// Largest result file accepted: 1 MiB (it travels in one gRPC message and
/// is stored with the run). A larger one is replaced by an error object.
pub const MAX_RESULT_BYTES: u64 = 1024 * 1024;

/// File names inside the per-execution directory.
const PROGRESS_FILE: &str = "progress.jsonl";
const RESULT_FILE: &str = "result.json";
const CHECKPOINT_FILE: &str = "checkpoint.json";

/// Runner-wide settings for the executor.
#[derive(Debug, Clone)]
pub struct ExecutorSettings {
    /// Parent of the per-execution directories (created if missing).
    pub work_dir: PathBuf,
    /// Time between SIGTERM and SIGKILL when stopping an agent.
    pub kill_grace: Duration,
    /// How to exec the shim, or `None` to spawn agents directly (see the
    /// module docs for the trade-off).
    pub shim: Option<ShimCommand>,
    /// The runner's self-fence (shared with every execution and, through its
    /// file, with every shim).
    pub fence: crate::fence::Fence,
    /// The reusable execution directories under `work_dir`.
    pub dirs: ExecutionDirs,
    /// The shim's fork server, when agents are started through it (needs
    /// `shim`): one fork per execution instead of an exec of the shim.
    pub zygote: Option<Zygote>,
    /// The HTTP agents' clients (a connection pool each), by agent id.
    pub http: Arc<std::collections::HashMap<String, crate::http_agent::AgentClient>>,
    /// The callback server's executions (asynchronous HTTP agents).
    pub callbacks: Arc<crate::http_agent::Callbacks>,
    /// Where executions' cgroups go (`None`: no limits are applied; an
    /// agent with `enforce: required` limits then fails to start).
    pub cgroups: Option<Arc<crate::cgroup::Cgroups>>,
    /// How much lower agents' CPU priority is than the runner's: added to
    /// their nice value (0-19; [`crate::config::DEFAULT_AGENT_NICE`]).
    pub agent_nice: u8,
    /// The starts in progress: executions that ended wait for them before
    /// they finish ([`StartGate`]).
    pub starts: StartGate,
}

/// The process agents' starts in progress on a runner (cheap to clone).
/// An execution whose agent has exited waits until none is left (at most
/// [`START_FIRST_WAIT`]) before it reads the agent's files and reports:
/// with a burst of agents due at once, the runtime's threads start the
/// burst's last agents before they finish its first ones. Without it the
/// starts queued behind the first runs' endings and reports (300 agents
/// due at once: the last started ~190 ms after the slot).
#[derive(Debug, Clone, Default)]
pub struct StartGate {
    inner: Arc<GateInner>,
}

#[derive(Debug, Default)]
struct GateInner {
    starting: std::sync::atomic::AtomicUsize,
    idle: tokio::sync::Notify,
}

/// The longest an ended execution waits for the starts in progress: a
/// stream of starts that never pauses delays reports by this much, never
/// more.
pub const START_FIRST_WAIT: Duration = Duration::from_millis(250);

impl StartGate {
    /// One more start in progress, until the guard is dropped.
    pub fn enter(&self) -> StartGuard {
        self.inner.starting.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        StartGuard(self.clone())
    }

    /// Waits until no start is in progress, or for `limit`.
    async fn idle_within(&self, limit: Duration) {
        let wait = async {
            loop {
                let notified = self.inner.idle.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                if self.inner.starting.load(std::sync::atomic::Ordering::Acquire) == 0 {
                    return;
                }
                notified.await;
            }
        };
        let _ = time::timeout(limit, wait).await;
    }
}

/// A start in progress ([`StartGate::enter`]).
#[derive(Debug)]
pub struct StartGuard(StartGate);

impl Drop for StartGuard {
    fn drop(&mut self) {
        if self.0.inner.starting.fetch_sub(1, std::sync::atomic::Ordering::AcqRel) == 1 {
            self.0.inner.idle.notify_waiters();
        }
    }
}

impl From<&RunnerConfig> for ExecutorSettings {
    fn from(config: &RunnerConfig) -> Self {
        Self {
            work_dir: config.work_dir.clone(),
            kill_grace: config.kill_grace,
            shim: config.shim.clone(),
            fence: crate::fence::Fence::new(config.work_dir.join(crate::fence::FENCE_FILE), config.kill_grace),
            dirs: ExecutionDirs::default(),
            zygote: config.shim.clone().filter(|_| config.zygote).map(Zygote::new),
            http: Arc::default(),
            callbacks: Arc::default(),
            cgroups: None,
            agent_nice: config.agent_nice,
            starts: StartGate::default(),
        }
    }
}

/// Something that happened to a running execution, ready to send to the
/// control plane.
#[derive(Debug, Clone, PartialEq)]
pub enum ExecutionEvent {
    /// The agent wrote a progress line.
    Progress(ProgressReport),
    /// The execution is over (always the last event of an execution).
    Finished(Finished),
}

/// Why the runner stops an execution before it ends on its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopRequest {
    /// The control plane cancelled it: reported `OUTCOME_CANCELLED`.
    Cancel(String),
    /// The runner is shutting down, or no leader acknowledged it for the
    /// fence deadline: reported `OUTCOME_INTERRUPTED` (the control plane
    /// dispatches it again without counting an attempt).
    Interrupt(String),
}

/// Handle to a started execution. Dropping it does not stop the execution.
#[derive(Debug)]
pub struct Execution {
    in_flight: InFlight,
    pid: u32,
    started_at: prost_types::Timestamp,
    cancel: Option<oneshot::Sender<StopRequest>>,
}

impl Execution {
    /// A handle on an execution started elsewhere (an HTTP agent's call).
    pub(crate) fn new(
        in_flight: InFlight,
        pid: u32,
        started_at: prost_types::Timestamp,
        cancel: oneshot::Sender<StopRequest>,
    ) -> Execution {
        Execution { in_flight, pid, started_at, cancel: Some(cancel) }
    }

    /// The run this execution belongs to.
    pub fn run_id(&self) -> &str {
        &self.in_flight.run_id
    }

    /// The execution's id (unique per attempt).
    pub fn execution_id(&self) -> &str {
        &self.in_flight.execution_id
    }

    /// Pid of the spawned process (the shim's, when a shim is used); also the
    /// process group id.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The execution as declared in `Hello.in_flight`.
    pub fn in_flight(&self) -> InFlight {
        self.in_flight.clone()
    }

    /// When the agent process was started (UTC).
    pub fn started_at(&self) -> prost_types::Timestamp {
        self.started_at
    }

    /// Asks the execution to stop: SIGTERM to its process group, SIGKILL
    /// after the grace period. Its `Finished` then has `OUTCOME_CANCELLED`
    /// and `error` "cancelled" (plus `: reason` when `reason` is not empty).
    /// Only the first stop request has an effect; a no-op once the process
    /// has ended.
    pub fn cancel(&mut self, reason: &str) {
        self.stop(StopRequest::Cancel(reason.to_owned()));
    }

    /// Stops the execution like [`Execution::cancel`], but reports it as
    /// `OUTCOME_INTERRUPTED` with `error` "interrupted: reason": the agent
    /// did not fail and nobody cancelled it (the runner is shutting down or
    /// fenced), so the control plane dispatches it again.
    pub fn interrupt(&mut self, reason: &str) {
        self.stop(StopRequest::Interrupt(reason.to_owned()));
    }

    /// Stops the execution as `request` says (see [`Execution::cancel`] and
    /// [`Execution::interrupt`]); only the first request has an effect.
    pub fn stop(&mut self, request: StopRequest) {
        if let Some(cancel) = self.cancel.take() {
            // Err: the execution already ended; its Finished is on its way.
            let _ = cancel.send(request);
        }
    }
}

/// Starts `assign` with `agent`: creates the execution directory, spawns the
/// process, and supervises it in a background task that sends its events to
/// `events`. Must be called within a tokio runtime.
///
/// A deadline in `assign.deadline` is measured from now (wall clock, read
/// once); if it has already passed the agent is stopped at once.
///
/// # Errors
///
/// [`Error::ExecutionDir`] if the directory or its files cannot be written,
/// [`Error::Spawn`] if the process cannot be started. Nothing is left behind
/// and no event is sent.
pub async fn start(
    agent: &ProcessAgent,
    assign: &Assign,
    settings: &ExecutorSettings,
    events: mpsc::Sender<ExecutionEvent>,
) -> Result<Execution, Error> {
    // The agent's TRACEPARENT is the runner's invoke_agent span (a child of
    // the control plane's attempt span).
    let invoke = crate::trace::InvokeSpan::begin(assign);
    let traced;
    let assign = match &invoke {
        Some(span) => {
            traced = Assign { traceparent: span.traceparent(), ..assign.clone() };
            &traced
        }
        None => assign,
    };
    let t0 = std::time::Instant::now();
    let cgroup = execution_cgroup(agent, assign, settings).await?;
    let t_cgroup = t0.elapsed();
    let dir = ExecutionDir::create(&settings.work_dir, assign, &settings.dirs).await?;
    let t_dir = t0.elapsed() - t_cgroup;
    let cg = cgroup.as_ref().map(|(cg, _)| cg);
    let spawned = match &settings.zygote {
        Some(zygote) if settings.shim.is_some() => match spawn_by_zygote(zygote, agent, assign, settings, &dir, cg).await {
            // Too large a request for the zygote (nothing was sent): exec a
            // shim for this one.
            Err(Error::Spawn { source, .. }) if source.raw_os_error() == Some(libc::EMSGSIZE) => spawn(agent, assign, settings, &dir, cg),
            spawned => spawned,
        },
        _ => spawn(agent, assign, settings, &dir, cg),
    };
    debug!(
        target: "punchclock::start",
        execution_id = %assign.execution_id,
        cgroup_us = t_cgroup.as_micros(),
        dir_us = t_dir.as_micros(),
        spawn_us = (t0.elapsed() - t_cgroup - t_dir).as_micros(),
        "start phases"
    );
    match spawned {
        Ok(agent) => Ok(supervise(agent, dir, assign, settings, events, invoke, cgroup)),
        Err(err) => {
            let _ = tokio::task::spawn_blocking(move || {
                dir.remove();
                if let Some((cg, _)) = cgroup {
                    cg.kill_and_remove();
                }
            })
            .await;
            Err(err)
        }
    }
}

/// The cgroup of an execution whose agent or task sets limits (the
/// tighter of each), with its `memory_max` for the error text; `None`
/// without limits, or (best effort) where the host cannot apply them.
///
/// # Errors
///
/// [`Error::Spawn`] when the agent's limits are `required` and cannot all
/// be applied here (no cgroups, a missing controller, a cgroup that cannot
/// be made).
async fn execution_cgroup(
    agent: &ProcessAgent,
    assign: &Assign,
    settings: &ExecutorSettings,
) -> Result<Option<(crate::cgroup::ExecCgroup, crate::cgroup::Limits)>, Error> {
    use crate::cgroup::Limits;
    let task = assign.limits.as_ref().map_or(Limits::default(), |l| Limits {
        memory_max: l.memory_max_bytes,
        cpu: l.cpu.filter(|c| c.is_finite() && *c > 0.0),
        pids_max: l.pids_max,
    });
    let limits = task.within(agent.limits);
    if !limits.any() {
        return Ok(None);
    }
    let required = agent.enforce == crate::config::Enforce::Required;
    let refuse = |why: String| Error::Spawn {
        agent_id: assign.agent_id.clone(),
        program: "cgroup limits".into(),
        source: io::Error::new(io::ErrorKind::Unsupported, why),
    };
    let Some(cgroups) = settings.cgroups.clone() else {
        return if required { Err(refuse("this runner applies no cgroup limits".into())) } else { Ok(None) };
    };
    if let Some(why) = cgroups.missing(&limits)
        && required
    {
        return Err(refuse(why));
    }
    let id = assign.execution_id.clone();
    match tokio::task::spawn_blocking(move || cgroups.create(&id, &limits)).await {
        Ok(Ok(Some(cg))) => Ok(Some((cg, limits))),
        Ok(Ok(None)) if required => Err(refuse("this host has no cgroups".into())),
        Ok(Ok(None)) => Ok(None),
        Ok(Err(e)) if required => Err(refuse(format!("cannot make the execution's cgroup: {e}"))),
        Ok(Err(e)) => {
            warn!(execution_id = %assign.execution_id, error = %e, "cannot make the execution's cgroup; running it without limits (best_effort)");
            Ok(None)
        }
        Err(e) => Err(refuse(format!("cannot make the execution's cgroup: {e}"))),
    }
}

/// The execution directories of one runner, reused: an execution takes a
/// free one (or creates `<work_dir>/exec-pool-N`) and gives it back emptied,
/// so a run costs no `mkdir`/`rmdir` (inode allocation churn was half the
/// CPU of a runner starting hundreds of agents a second). Cheap to clone.
///
/// A directory is handed out again only once emptied, and only after an
/// execution behind the shim whose shim swept every descendant and exited by
/// itself and whose output pipes closed; any other execution's directory is
/// removed, as is one the agent replaced with a symlink.
#[derive(Debug, Clone, Default)]
pub struct ExecutionDirs {
    inner: Arc<DirsInner>,
}

#[derive(Debug, Default)]
struct DirsInner {
    free: Mutex<Vec<PathBuf>>,
    next: std::sync::atomic::AtomicU64,
}

impl ExecutionDirs {
    /// A free directory under `work_dir` (with an empty progress file),
    /// creating one if none is free.
    fn take(&self, work_dir: &Path) -> io::Result<PathBuf> {
        if let Some(path) = self.take_free() {
            return Ok(path);
        }
        std::fs::create_dir_all(work_dir)?;
        loop {
            let n = self.inner.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let path = work_dir.join(format!("exec-pool-{n}"));
            match std::fs::create_dir(&path) {
                Ok(()) => {
                    std::fs::write(path.join(PROGRESS_FILE), b"")?;
                    return Ok(path);
                }
                // Another pool's (or a previous process's, if the runner did
                // not clear them at start): never touch it, take the next.
                Err(err) if err.kind() == io::ErrorKind::AlreadyExists => {}
                Err(err) => return Err(err),
            }
        }
    }

    /// A free directory, if one is left (one `lstat` each).
    fn take_free(&self) -> Option<PathBuf> {
        loop {
            let path = lock(&self.inner.free).pop()?;
            // Something (a tmp cleaner) may have removed it while it was free.
            if is_real_dir(&path) {
                return Some(path);
            }
        }
    }

    /// Empties `path` (keeping an empty progress file) and makes it free
    /// again; a directory that is not one any more (the agent replaced it
    /// with a symlink) or cannot be emptied is removed instead.
    fn give_back(&self, path: PathBuf) {
        if !is_real_dir(&path) {
            warn!(dir = %path.display(), "execution directory was replaced; removing it");
            let _ = std::fs::remove_file(&path);
            return;
        }
        match empty_dir(&path) {
            Ok(()) => lock(&self.inner.free).push(path),
            Err(err) => {
                warn!(dir = %path.display(), error = %err, "cannot empty execution directory; removing it");
                remove_dir(&path);
            }
        }
    }
}

/// What an execution left in its directory `path` is read and cleared
/// without blocking a runtime thread for long: at most the contract's three
/// entries, each a regular file of at most [`INLINE_FILE_BYTES`] (one
/// `getdents` and a `statx` each). `false` for anything else, or when the
/// directory cannot be listed.
fn small_leftovers(path: &Path) -> bool {
    let Ok(entries) = std::fs::read_dir(path) else { return false };
    let mut count = 0;
    for entry in entries {
        count += 1;
        let small = entry.and_then(|e| e.metadata()).is_ok_and(|m| m.is_file() && m.len() <= INLINE_FILE_BYTES);
        if !small || count > 3 {
            return false;
        }
    }
    true
}

/// The largest file [`small_leftovers`] reads on a runtime thread: 64 KiB.
const INLINE_FILE_BYTES: u64 = 64 * 1024;

/// Opens a file the agent wrote (its result or progress file) for
/// reading, only if it is a regular file, never through a symlink, and
/// without blocking: a FIFO in its place would hang the read (and the
/// execution's report) for good, a symlink to `/dev/zero` would fill the
/// runner's memory.
///
/// # Errors
///
/// `NotFound` when there is none; `InvalidData` ("not a regular file")
/// for a symlink, FIFO, device or directory; any other open error.
fn open_agent_file(path: &Path) -> io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK).open(path).map_err(|e| {
        if e.raw_os_error() == Some(libc::ELOOP) { io::Error::new(io::ErrorKind::InvalidData, "a symlink, not a regular file") } else { e }
    })?;
    if !file.metadata()?.is_file() {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "not a regular file"));
    }
    Ok(file)
}

/// A directory, not a symlink to one.
fn is_real_dir(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_dir())
}

/// Removes a directory and its contents (best effort: failures are logged).
fn remove_dir(path: &Path) {
    match std::fs::remove_dir_all(path) {
        Ok(()) => {}
        Err(err) if err.kind() == io::ErrorKind::NotFound => {}
        Err(err) => warn!(dir = %path.display(), error = %err, "cannot remove execution directory"),
    }
}

/// Removes everything inside `path` but an empty progress file (truncated
/// if the agent wrote to it, created if it removed it): one `getdents` when
/// the agent left nothing. Symlinks are removed, never followed.
fn empty_dir(path: &Path) -> io::Result<()> {
    let mut progress_kept = false;
    for entry in std::fs::read_dir(path)? {
        let entry = entry?;
        let kind = entry.file_type()?;
        if entry.file_name() == PROGRESS_FILE && kind.is_file() {
            if entry.metadata()?.len() > 0 {
                std::fs::OpenOptions::new().write(true).truncate(true).open(entry.path())?;
            }
            progress_kept = true;
        } else if kind.is_dir() {
            std::fs::remove_dir_all(entry.path())?;
        } else {
            std::fs::remove_file(entry.path())?;
        }
    }
    if !progress_kept {
        std::fs::write(path.join(PROGRESS_FILE), b"")?;
    }
    Ok(())
}

/// The per-execution directory and the paths handed to the agent.
#[derive(Debug)]
struct ExecutionDir {
    path: PathBuf,
    progress: PathBuf,
    result: PathBuf,
    checkpoint: PathBuf,
    dirs: ExecutionDirs,
}

impl ExecutionDir {
    /// Takes a directory from `dirs` (with an empty progress file) and
    /// writes the checkpoint file if the assignment carries one. A free
    /// directory without a checkpoint costs one `lstat`, here; making a
    /// directory or writing a checkpoint, one trip to the blocking pool
    /// (which waited for a thread's wake-up, up to 25 ms under a burst of
    /// starts). The result file is the agent's to create.
    async fn create(work_dir: &Path, assign: &Assign, dirs: &ExecutionDirs) -> Result<Self, Error> {
        if assign.checkpoint_json.is_empty()
            && let Some(path) = dirs.take_free()
        {
            return Ok(Self::at(path, dirs.clone()));
        }
        let (work_dir, dirs, checkpoint_json) = (work_dir.to_owned(), dirs.clone(), assign.checkpoint_json.clone());
        let create = move || {
            let path = dirs.take(&work_dir).map_err(|source| Error::ExecutionDir { path: work_dir.clone(), source })?;
            let dir = Self::at(path, dirs);
            if !checkpoint_json.is_empty()
                && let Err(source) = std::fs::write(&dir.checkpoint, checkpoint_json)
            {
                let path = dir.checkpoint.clone();
                dir.remove();
                return Err(Error::ExecutionDir { path, source });
            }
            Ok(dir)
        };
        tokio::task::spawn_blocking(create).await.unwrap_or_else(|join| {
            Err(Error::ExecutionDir { path: PathBuf::new(), source: io::Error::other(format!("setup task failed: {join}")) })
        })
    }

    /// The execution directory `path`, taken from `dirs`, with its files' paths.
    fn at(path: PathBuf, dirs: ExecutionDirs) -> Self {
        Self { progress: path.join(PROGRESS_FILE), result: path.join(RESULT_FILE), checkpoint: path.join(CHECKPOINT_FILE), path, dirs }
    }

    /// Empties the directory and gives it back (blocking).
    fn release(self) {
        self.dirs.give_back(self.path);
    }

    /// Deletes the directory, for good (blocking; failures are logged).
    fn remove(self) {
        remove_dir(&self.path);
    }
}

/// A started agent: its process (or its supervisor's) and the runner's ends
/// of its stdin, stdout and stderr.
struct SpawnedAgent {
    process: AgentProcess,
    stdin: Option<Box<dyn tokio::io::AsyncWrite + Unpin + Send>>,
    stdout: Option<Box<dyn AsyncRead + Unpin + Send>>,
    stderr: Option<Box<dyn AsyncRead + Unpin + Send>>,
}

/// The process the runner waits for: its own child (the agent, or an
/// exec'd shim), or a supervisor forked by the zygote.
enum AgentProcess {
    Child(Child),
    Zygote(ZygoteProcess),
}

impl AgentProcess {
    /// Its pid (also its process group id).
    fn pid(&self) -> u32 {
        match self {
            // `id()` is `Some` until the child has been awaited.
            AgentProcess::Child(child) => child.id().unwrap_or_default(),
            AgentProcess::Zygote(process) => process.pid(),
        }
    }

    /// Waits for it to end (cancel-safe).
    async fn wait(&mut self) -> io::Result<ExitStatus> {
        match self {
            AgentProcess::Child(child) => child.wait().await,
            AgentProcess::Zygote(process) => process.wait().await,
        }
    }

    /// SIGKILLs it (only it, not its group).
    fn start_kill(&mut self) -> io::Result<()> {
        match self {
            AgentProcess::Child(child) => child.start_kill(),
            AgentProcess::Zygote(process) => process.start_kill(),
        }
    }
}

/// Starts the agent behind a supervisor forked by the zygote: the same
/// argv, environment and working directory as [`spawn`] would give it.
async fn spawn_by_zygote(
    zygote: &Zygote,
    agent: &ProcessAgent,
    assign: &Assign,
    settings: &ExecutorSettings,
    dir: &ExecutionDir,
    cgroup: Option<&crate::cgroup::ExecCgroup>,
) -> Result<SpawnedAgent, Error> {
    let spawn_error =
        |source| Error::Spawn { agent_id: assign.agent_id.clone(), program: agent.command.first().cloned().unwrap_or_default(), source };
    check_working_dir(agent, assign)?;
    // As `Command` would: the runner's environment, then the agent's, then ours.
    let mut env: std::collections::BTreeMap<OsString, OsString> =
        std::env::vars_os().filter(|(k, _)| !RUNNER_CREDENTIAL_ENV.iter().any(|c| k == c)).collect();
    env.extend(agent.env.iter().map(|(k, v)| (OsString::from(k), OsString::from(v))));
    env.extend(secret_env(agent).map_err(spawn_error)?);
    env.extend(agent_env(assign, dir).into_iter().map(|(k, v)| (OsString::from(k), v)));
    let mut request = ShimRequest {
        id: 0,
        cwd: agent.working_dir.as_ref().map(|dir| dir.as_os_str().to_owned()),
        fence_file: Some(settings.fence.path().as_os_str().to_owned()),
        kill_grace_ms: u64::try_from(settings.kill_grace.as_millis()).unwrap_or(u64::MAX),
        nice: settings.agent_nice,
        argv: agent.command.iter().map(OsString::from).collect(),
        env: env
            .into_iter()
            .map(|(mut key, value)| {
                key.push("=");
                key.push(value);
                key
            })
            .collect(),
    };
    let spawned = zygote.spawn(&mut request, cgroup).await.map_err(spawn_error)?;
    Ok(SpawnedAgent {
        process: AgentProcess::Zygote(spawned.process),
        stdin: Some(Box::new(spawned.stdin)),
        stdout: Some(Box::new(spawned.stdout)),
        stderr: Some(Box::new(spawned.stderr)),
    })
}

/// Checked before spawning: behind the shim a missing directory would be
/// reported as the shim binary not being found.
fn check_working_dir(agent: &ProcessAgent, assign: &Assign) -> Result<(), Error> {
    if let Some(working_dir) = &agent.working_dir
        && !working_dir.is_dir()
    {
        return Err(Error::Spawn {
            agent_id: assign.agent_id.clone(),
            program: format!("working_dir {}", working_dir.display()),
            source: io::Error::new(io::ErrorKind::NotFound, "not a directory"),
        });
    }
    Ok(())
}

/// Builds and spawns the agent command (directly or behind an exec'd
/// shim), in a new process group.
fn spawn(
    agent: &ProcessAgent,
    assign: &Assign,
    settings: &ExecutorSettings,
    dir: &ExecutionDir,
    cgroup: Option<&crate::cgroup::ExecCgroup>,
) -> Result<SpawnedAgent, Error> {
    // `command` is non-empty: the agents-file validation guarantees it.
    let (program, args): (OsString, Vec<OsString>) = match &settings.shim {
        Some(shim) => (
            shim.program.as_os_str().to_owned(),
            shim.args.iter().cloned().chain(std::iter::once("--".into())).chain(agent.command.iter().map(OsString::from)).collect(),
        ),
        None => {
            let (program, args) = agent.command.split_first().ok_or_else(|| Error::Spawn {
                agent_id: assign.agent_id.clone(),
                program: String::new(),
                source: io::Error::new(io::ErrorKind::InvalidInput, "empty command"),
            })?;
            (program.into(), args.iter().map(OsString::from).collect())
        }
    };

    check_working_dir(agent, assign)?;
    let secrets = secret_env(agent).map_err(|source| Error::Spawn {
        agent_id: assign.agent_id.clone(),
        program: agent.command[0].clone(),
        source,
    })?;
    let mut command = Command::new(&program);
    for name in RUNNER_CREDENTIAL_ENV {
        command.env_remove(name);
    }
    command
        .args(&args)
        .envs(&agent.env)
        .envs(secrets)
        .envs(agent_env(assign, dir))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    if let Some(working_dir) = &agent.working_dir {
        command.current_dir(working_dir);
    }

    // The child joins the execution's cgroup before it execs (so nothing it
    // starts is ever outside it): the `cgroup.procs` files are opened here,
    // and the child writes "0" (itself) to each.
    let procs = cgroup
        .map(|cg| cg.procs_files().iter().map(|f| std::fs::OpenOptions::new().write(true).open(f)).collect::<io::Result<Vec<_>>>())
        .transpose()
        .map_err(|source| Error::Spawn { agent_id: assign.agent_id.clone(), program: "cgroup.procs".into(), source })?
        .unwrap_or_default();
    if !procs.is_empty() {
        let fds: Vec<libc::c_int> = procs.iter().map(std::os::fd::AsRawFd::as_raw_fd).collect();
        // SAFETY: write(2) is async-signal-safe; `fds` is not reallocated.
        unsafe {
            command.pre_exec(move || {
                for fd in &fds {
                    if libc::write(*fd, b"0".as_ptr().cast(), 1) != 1 {
                        return Err(io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
    }

    let runner_pid = std::process::id();
    if settings.shim.is_some() {
        // The shim arms its own parent-death signal and compares getppid()
        // with this to detect that the runner died before that; it kills the
        // agent itself when the runner's fence in this file expires (even
        // while the runner is stopped).
        command.env(SHIM_PARENT_PID_ENV, runner_pid.to_string());
        command.env(SHIM_FENCE_FILE_ENV, settings.fence.path());
        command.env(SHIM_KILL_GRACE_ENV, settings.kill_grace.as_millis().to_string());
        command.env(SHIM_NICE_ENV, settings.agent_nice.to_string());
    } else {
        let nice = libc::c_int::from(settings.agent_nice);
        // SAFETY: the closure only makes async-signal-safe syscalls (prctl,
        // getppid, nice) and allocates nothing.
        unsafe {
            command.pre_exec(move || {
                if nice > 0 {
                    libc::nice(nice);
                }
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) == -1 {
                    return Err(io::Error::last_os_error());
                }
                // The runner died between fork and prctl: do not start.
                if u32::try_from(libc::getppid()).ok() != Some(runner_pid) {
                    return Err(io::Error::other("runner exited during spawn"));
                }
                Ok(())
            });
        }
    }

    let mut child = command.spawn().map_err(|source| Error::Spawn {
        agent_id: assign.agent_id.clone(),
        program: program.to_string_lossy().into_owned(),
        source,
    })?;
    drop(procs);
    Ok(SpawnedAgent {
        stdin: child.stdin.take().map(|pipe| Box::new(pipe) as _),
        stdout: child.stdout.take().map(|pipe| Box::new(pipe) as _),
        stderr: child.stderr.take().map(|pipe| Box::new(pipe) as _),
        process: AgentProcess::Child(child),
    })
}

/// The runner's own credentials in its environment, never passed on to an
/// agent (an agent must not be able to pose as its runner); an agent's
/// `env` may still set them on purpose.
const RUNNER_CREDENTIAL_ENV: &[&str] =
    &["PUNCHCLOCK_TOKEN", "PUNCHCLOCK_TOKEN_FILE", "PUNCHCLOCK_CA_FILE", "PUNCHCLOCK_ETCD_PASSWORD_FILE"];

/// The agent's `env_from_file` variables, read now from their files (one
/// trailing newline dropped).
///
/// Errors: a file that cannot be read, naming the variable and the path
/// (never a value).
fn secret_env(agent: &ProcessAgent) -> io::Result<Vec<(OsString, OsString)>> {
    use std::os::unix::ffi::OsStringExt;
    agent
        .env_from_file
        .iter()
        .map(|(key, path)| {
            let mut value = std::fs::read(path)
                .map_err(|e| io::Error::new(e.kind(), format!("env_from_file {key}: cannot read {}: {e}", path.display())))?;
            if value.ends_with(b"\n") {
                value.pop();
                if value.ends_with(b"\r") {
                    value.pop();
                }
            }
            if value.contains(&0) {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("env_from_file {key}: {} holds a NUL byte", path.display()),
                ));
            }
            Ok((OsString::from(key), OsString::from_vec(value)))
        })
        .collect()
}

/// The `PUNCHCLOCK_*` variables (and `TRACEPARENT`, `TRACESTATE`,
/// `BAGGAGE`: the OpenTelemetry environment carrier) for an execution.
fn agent_env(assign: &Assign, dir: &ExecutionDir) -> Vec<(&'static str, OsString)> {
    let instant = |ts: &Option<prost_types::Timestamp>| ts.as_ref().and_then(clock::from_timestamp).map(clock::rfc3339).unwrap_or_default();
    vec![
        ("PUNCHCLOCK_TASK_ID", assign.task_id.clone().into()),
        ("PUNCHCLOCK_RUN_ID", assign.run_id.clone().into()),
        ("PUNCHCLOCK_EXECUTION_ID", assign.execution_id.clone().into()),
        ("PUNCHCLOCK_ATTEMPT", assign.attempt.to_string().into()),
        ("PUNCHCLOCK_SCHEDULED_AT", instant(&assign.scheduled_at).into()),
        ("PUNCHCLOCK_DEADLINE", instant(&assign.deadline).into()),
        ("PUNCHCLOCK_PROGRESS_FILE", dir.progress.clone().into()),
        ("PUNCHCLOCK_RESULT_FILE", dir.result.clone().into()),
        ("PUNCHCLOCK_CHECKPOINT_FILE", dir.checkpoint.clone().into()),
        ("TRACEPARENT", assign.traceparent.clone().into()),
        // Set even when empty, so a TRACESTATE or BAGGAGE in the runner's
        // own environment never pairs with the run's TRACEPARENT.
        ("TRACESTATE", assign.tracestate.clone().into()),
        ("BAGGAGE", assign.baggage.clone().into()),
    ]
}

/// Wires up the spawned child (stdin, output tails, group) and starts the
/// supervision task.
fn supervise(
    agent: SpawnedAgent,
    dir: ExecutionDir,
    assign: &Assign,
    settings: &ExecutorSettings,
    events: mpsc::Sender<ExecutionEvent>,
    invoke: Option<crate::trace::InvokeSpan>,
    cgroup: Option<(crate::cgroup::ExecCgroup, crate::cgroup::Limits)>,
) -> Execution {
    let started_at = clock::now_timestamp();
    let in_flight = InFlight {
        run_id: assign.run_id.clone(),
        execution_id: assign.execution_id.clone(),
        attempt: assign.attempt,
        started_at: Some(started_at),
    };
    let SpawnedAgent { process, stdin, stdout, stderr } = agent;
    let pid = process.pid();
    let group = ProcessGroup::new(pid);

    if let Some(mut stdin) = stdin {
        let context = assign.context_json.clone().into_bytes();
        tokio::spawn(async move {
            // A broken pipe just means the agent does not read its context.
            if let Err(err) = stdin.write_all(&context).await {
                debug!(error = %err, "agent did not read its stdin");
            }
        });
    }
    let stdout = OutputTail::collect(stdout);
    let stderr = OutputTail::collect(stderr);

    let deadline = assign.deadline.as_ref().and_then(|deadline| {
        let parsed = clock::from_timestamp(deadline);
        if parsed.is_none() {
            warn!(execution_id = %in_flight.execution_id, ?deadline, "ignoring malformed deadline");
        }
        parsed
    });
    // Negative (already passed) becomes zero: stop at once.
    let timeout = deadline.map(|deadline| (deadline - clock::now()).to_std().unwrap_or(Duration::ZERO));
    let timeout_secs = match (assign.timeout_seconds, timeout) {
        (0, Some(remaining)) => remaining.as_secs(),
        (secs, _) => secs,
    };

    let (cancel_tx, cancel_rx) = oneshot::channel();
    let supervisor = Supervisor {
        started_at,
        ended_at: started_at,
        fence: settings.fence.clone(),
        in_flight: in_flight.clone(),
        process,
        group,
        progress_path: dir.progress.clone(),
        dir: Some(dir),
        progress: ProgressFile::default(),
        stdout,
        stderr,
        timeout,
        timeout_secs,
        kill_grace: settings.kill_grace,
        shimmed: settings.shim.is_some(),
        escalated: false,
        events,
        invoke,
        cgroup,
        used: None,
        starts: settings.starts.clone(),
    };
    debug!(
        run_id = %in_flight.run_id,
        execution_id = %in_flight.execution_id,
        agent_id = %assign.agent_id,
        pid,
        "execution started"
    );
    tokio::spawn(supervisor.run(cancel_rx));
    Execution { in_flight, pid, started_at, cancel: Some(cancel_tx) }
}

/// Why the runner stopped an execution.
#[derive(Debug)]
enum StopReason {
    Timeout,
    Requested(StopRequest),
}

/// Owns a running child until its `Finished` is sent.
struct Supervisor {
    /// The execution's span (when the assignment carried a trace).
    invoke: Option<crate::trace::InvokeSpan>,
    in_flight: InFlight,
    /// When the agent was spawned (UTC).
    started_at: prost_types::Timestamp,
    /// When its main process ended (UTC; `started_at` until then).
    ended_at: prost_types::Timestamp,
    /// The runner's fence: an agent that dies after it expired was stopped
    /// by the fence (the shim's, when the runner was paused).
    fence: crate::fence::Fence,
    process: AgentProcess,
    group: Option<ProcessGroup>,
    /// Taken when the execution ends (its files read, then emptied).
    dir: Option<ExecutionDir>,
    progress_path: PathBuf,
    progress: ProgressFile,
    stdout: OutputTail,
    stderr: OutputTail,
    /// Time left until the deadline, if any.
    timeout: Option<Duration>,
    /// The timeout as reported in the error text.
    timeout_secs: u64,
    kill_grace: Duration,
    /// The agent runs behind the shim (the group leader).
    shimmed: bool,
    /// The group was SIGKILLed after the grace period (the shim may not
    /// have finished its sweep).
    escalated: bool,
    events: mpsc::Sender<ExecutionEvent>,
    /// The execution's cgroup and its limits, until it is read and removed.
    cgroup: Option<(crate::cgroup::ExecCgroup, crate::cgroup::Limits)>,
    /// What the cgroup said the execution used (and its memory_max).
    used: Option<(crate::cgroup::Usage, Option<u64>)>,
    /// The runner's starts in progress, which go first.
    starts: StartGate,
}

impl Supervisor {
    async fn run(mut self, cancel: oneshot::Receiver<StopRequest>) {
        let (status, stop) = self.wait(cancel).await;
        // The run ended now, whatever the report waits for below.
        self.ended_at = clock::now_timestamp();

        // The main process is gone: kill whatever it left in its group, so
        // that the pipes close and nothing outlives the execution.
        if let Some(group) = self.group.take() {
            group.kill_remaining();
        }
        // And whatever left the group but not the cgroup (a `setsid`
        // daemon); what it used is read first.
        if let Some((cg, limits)) = self.cgroup.take() {
            self.used = tokio::task::spawn_blocking(move || {
                let used = cg.usage();
                cg.kill_and_remove();
                used
            })
            .await
            .ok()
            .map(|u| (u, limits.memory_max));
        }
        // The burst's starts first (what the cgroup said is read, and what
        // left the group is killed, before the wait).
        self.starts.idle_within(START_FIRST_WAIT).await;
        let stdout_closed = self.stdout.drain().await;
        let stderr_closed = self.stderr.drain().await;
        // The directory is used again only when nothing of this execution
        // can still write to it: the shim swept every descendant and exited
        // by itself, and nothing else holds the output pipes.
        let reusable = self.shimmed && !self.escalated && stdout_closed && stderr_closed;
        let (updates, result) = self.collect_files(reusable).await;
        self.forward_progress(updates).await;

        let finished = self.finished(status, stop, result);
        if finished.error.is_empty() {
            debug!(
                run_id = %finished.run_id,
                execution_id = %finished.execution_id,
                outcome = finished.outcome().as_str_name(),
                exit_code = ?finished.exit_code,
                "execution finished"
            );
        } else {
            info!(
                run_id = %finished.run_id,
                execution_id = %finished.execution_id,
                outcome = finished.outcome().as_str_name(),
                exit_code = ?finished.exit_code,
                error = %finished.error,
                "execution finished"
            );
        }
        // Err: the session is gone (runner shutting down); nobody to tell.
        let _ = self.events.send(ExecutionEvent::Finished(finished)).await;
    }

    /// Waits for the process to exit, forwarding progress meanwhile; stops it
    /// on deadline or cancel.
    async fn wait(&mut self, cancel: oneshot::Receiver<StopRequest>) -> (io::Result<ExitStatus>, Option<StopReason>) {
        let timeout = self.timeout;
        let deadline = async {
            match timeout {
                Some(timeout) => time::sleep(timeout).await,
                None => future::pending().await,
            }
        };
        let cancelled = async {
            match cancel.await {
                Ok(reason) => reason,
                // The handle was dropped without cancelling: run to the end.
                Err(_) => future::pending().await,
            }
        };
        tokio::pin!(deadline, cancelled);
        let mut poll = time::interval(PROGRESS_POLL_INTERVAL);
        poll.set_missed_tick_behavior(MissedTickBehavior::Delay);

        let stop = loop {
            tokio::select! {
                status = self.process.wait() => {
                    // Killed by the shim's fence while the runner was paused.
                    let killed = status.as_ref().is_ok_and(|s| !s.success());
                    let stop = (killed && self.fence.expired())
                        .then(|| StopReason::Requested(StopRequest::Interrupt(crate::fence::FENCE_REASON.into())));
                    return (status, stop);
                }
                () = &mut deadline => break StopReason::Timeout,
                request = &mut cancelled => break StopReason::Requested(request),
                _ = poll.tick() => self.poll_progress().await,
            }
        };
        info!(execution_id = %self.in_flight.execution_id, reason = ?stop, "stopping execution");
        (self.terminate().await, Some(stop))
    }

    /// SIGTERM to the group; SIGKILL if the main process is still alive
    /// after the grace period.
    async fn terminate(&mut self) -> io::Result<ExitStatus> {
        if let Some(group) = &self.group {
            group.signal(libc::SIGTERM);
        }
        match time::timeout(self.kill_grace, self.process.wait()).await {
            Ok(status) => status,
            Err(_elapsed) => {
                debug!(execution_id = %self.in_flight.execution_id, "grace period over; killing");
                self.escalated = true;
                // Behind the shim: SIGUSR2 makes it kill every descendant
                // (even ones that left the group) before it exits.
                if self.shimmed
                    && let Some(group) = &self.group
                {
                    group.signal_leader(libc::SIGUSR2);
                    if let Ok(status) = time::timeout(SHIM_SWEEP_WAIT, self.process.wait()).await {
                        group.signal(libc::SIGKILL);
                        return status;
                    }
                }
                match &self.group {
                    Some(group) => group.signal(libc::SIGKILL),
                    None => self.process.start_kill()?,
                }
                self.process.wait().await
            }
        }
    }

    /// Reads the progress file on the blocking pool and forwards what is new.
    async fn poll_progress(&mut self) {
        let (mut progress, path) = (self.progress.clone(), self.progress_path.clone());
        match tokio::task::spawn_blocking(move || {
            let updates = progress.read_new(&path, false);
            (progress, updates)
        })
        .await
        {
            Ok((progress, updates)) => {
                self.progress = progress;
                self.forward_progress(updates).await;
            }
            Err(err) => warn!(error = %err, "progress poll failed"),
        }
    }

    /// Reads, in one trip to the blocking pool, what the agent left: the
    /// rest of its progress file and its result file; then gives the
    /// execution directory back emptied (`reusable`) or removes it.
    async fn collect_files(&mut self, reusable: bool) -> (Vec<ProgressUpdate>, (String, Option<String>)) {
        let (mut progress, path) = (self.progress.clone(), self.progress_path.clone());
        let dir = self.dir.take();
        // What most agents leave (the contract's files, small) is read and
        // cleared here in a few syscalls: cheaper than a trip to the
        // blocking pool, a thread woken and two context switches per run.
        let inline = reusable && dir.as_ref().is_some_and(|dir| small_leftovers(&dir.path));
        let collect = move || {
            let updates = progress.read_new(&path, true);
            let result = dir.map(|dir| {
                let result = read_result(&dir.result);
                if reusable {
                    dir.release()
                } else {
                    dir.remove()
                }
                result
            });
            (updates, result.unwrap_or_default())
        };
        if inline {
            return collect();
        }
        tokio::task::spawn_blocking(collect)
            .await
            .unwrap_or_else(|err| (Vec::new(), (String::new(), Some(format!("cannot read the execution's files: {err}")))))
    }

    /// Sends a `Progress` event for each update.
    async fn forward_progress(&mut self, updates: Vec<ProgressUpdate>) {
        for update in updates {
            let report = ProgressReport {
                run_id: self.in_flight.run_id.clone(),
                execution_id: self.in_flight.execution_id.clone(),
                percent: update.percent.map(|p| p.clamp(0.0, 100.0)),
                message: update.message.unwrap_or_default(),
                checkpoint_json: update.checkpoint.map(|c| c.to_string()).unwrap_or_default(),
            };
            if self.events.send(ExecutionEvent::Progress(report)).await.is_err() {
                return;
            }
        }
    }

    /// Builds the `Finished` report from the exit status and the files.
    fn finished(&self, status: io::Result<ExitStatus>, stop: Option<StopReason>, result: (String, Option<String>)) -> Finished {
        let stdout_tail = self.stdout.text();
        let stderr_tail = self.stderr.text();
        let (result_json, result_problem) = result;

        let exit_code = status.as_ref().ok().and_then(ExitStatus::code);
        let (outcome, error) = match (stop, status) {
            (Some(StopReason::Timeout), _) => (Outcome::Timeout, format!("timed out after {} s", self.timeout_secs)),
            (Some(StopReason::Requested(StopRequest::Interrupt(reason))), _) => (Outcome::Interrupted, format!("interrupted: {reason}")),
            (Some(StopReason::Requested(StopRequest::Cancel(reason))), _) if reason.is_empty() => {
                (Outcome::Cancelled, "cancelled".to_owned())
            }
            (Some(StopReason::Requested(StopRequest::Cancel(reason))), _) => (Outcome::Cancelled, format!("cancelled: {reason}")),
            (None, Err(err)) => (Outcome::Failed, format!("cannot wait for the agent process: {err}")),
            (None, Ok(status)) => match (status.code(), status.signal()) {
                (Some(0), _) => (Outcome::Succeeded, String::new()),
                (Some(code), _) => {
                    let last_line = stderr_tail.lines().rev().map(str::trim).find(|line| !line.is_empty());
                    match last_line {
                        Some(line) => (Outcome::Failed, format!("exit code {code}: {line}")),
                        None => (Outcome::Failed, format!("exit code {code}")),
                    }
                }
                (None, Some(signal)) => (Outcome::Failed, format!("killed by signal {signal}")),
                (None, None) => (Outcome::Failed, format!("agent ended with {status}")),
            },
        };
        let oom = self.used.as_ref().filter(|(u, _)| u.oom_killed && outcome == Outcome::Failed);
        // The peak beside the limit: far below it, a limit above the
        // execution's (its runner's, the host's) was reached.
        let error = match oom {
            Some((used, max)) => {
                let peak = used.peak_memory_bytes.map_or_else(|| "peak unknown".to_string(), |p| format!("peak {p} bytes"));
                let max = max.map(|m| format!(", memory_max {m} bytes")).unwrap_or_default();
                format!("out of memory: the OOM killer ended a process of the agent ({peak}{max}; {error})")
            }
            None => error,
        };
        let error = [Some(error), result_problem].into_iter().flatten().filter(|part| !part.is_empty()).collect::<Vec<_>>().join("; ");
        if let Some(span) = &self.invoke {
            let at = |ts: prost_types::Timestamp| {
                clock::from_timestamp(&ts).map(std::time::SystemTime::from).unwrap_or_else(std::time::SystemTime::now)
            };
            span.end(at(self.started_at), at(self.ended_at), &outcome_label(outcome), exit_code, &result_json, &error);
        }

        Finished {
            run_id: self.in_flight.run_id.clone(),
            execution_id: self.in_flight.execution_id.clone(),
            outcome: outcome.into(),
            result_json,
            error,
            exit_code,
            stdout_tail,
            stderr_tail,
            finished_at: Some(self.ended_at),
            started_at: Some(self.started_at),
            class: if oom.is_some() { "oom_killed".into() } else { String::new() },
            peak_memory_bytes: self.used.and_then(|(u, _)| u.peak_memory_bytes),
            cpu_seconds: self.used.and_then(|(u, _)| u.cpu_seconds),
        }
    }
}

/// Reads the result file: `("", None)` if absent or blank; re-serialized
/// JSON if valid; otherwise the raw text as a JSON string plus a problem
/// description for `Finished.error`.
fn read_result(path: &Path) -> (String, Option<String>) {
    use std::io::Read;
    let read = open_agent_file(path).and_then(|file| {
        let mut bytes = Vec::new();
        // Results ride in one gRPC message and in the run record: bounded
        // (read up to one byte past, so a file that grows is caught too).
        file.take(MAX_RESULT_BYTES + 1).read_to_end(&mut bytes)?;
        Ok(bytes)
    });
    let raw = match read {
        Ok(bytes) if bytes.len() as u64 > MAX_RESULT_BYTES => {
            let size = std::fs::symlink_metadata(path).map_or(bytes.len() as u64, |m| m.len());
            let problem = format!("result file is {size} bytes, over the {MAX_RESULT_BYTES}-byte limit; dropped");
            return (serde_json::json!({ "error": problem }).to_string(), Some(problem));
        }
        Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
        Err(err) if err.kind() == io::ErrorKind::NotFound => return (String::new(), None),
        Err(err) => {
            return (String::new(), Some(format!("cannot read the result file: {err}")));
        }
    };
    if raw.trim().is_empty() {
        return (String::new(), None);
    }
    match serde_json::from_str::<serde_json::Value>(&raw) {
        Ok(value) => (value.to_string(), None),
        Err(err) => {
            (serde_json::Value::String(raw).to_string(), Some(format!("result file is not valid JSON ({err}); kept as a JSON string")))
        }
    }
}

/// The agent's process group (its id is the group leader's pid).
#[derive(Debug)]
struct ProcessGroup {
    pgid: libc::pid_t,
}

impl ProcessGroup {
    /// `None` for pid 0 (or out of range): `kill(-0, ..)` would signal the
    /// runner's own group.
    fn new(pid: u32) -> Option<Self> {
        libc::pid_t::try_from(pid).ok().filter(|pgid| *pgid > 0).map(|pgid| Self { pgid })
    }

    /// Sends `signal` to every process in the group; a group that is already
    /// gone is not an error.
    fn signal(&self, signal: libc::c_int) {
        // SAFETY: kill(2) has no memory-safety preconditions; pgid > 0.
        if unsafe { libc::kill(-self.pgid, signal) } == -1 {
            let err = io::Error::last_os_error();
            if err.raw_os_error() != Some(libc::ESRCH) {
                warn!(pgid = self.pgid, signal, error = %err, "cannot signal process group");
            }
        }
    }

    /// Sends `signal` to the group leader only (the shim, when there is one).
    fn signal_leader(&self, signal: libc::c_int) {
        // SAFETY: kill(2) has no memory-safety preconditions; pgid > 0.
        unsafe { libc::kill(self.pgid, signal) };
    }

    /// SIGKILLs whatever is left in the group and forgets it.
    fn kill_remaining(self) {
        self.signal(libc::SIGKILL);
        std::mem::forget(self);
    }
}

impl Drop for ProcessGroup {
    /// Supervision was abandoned (task aborted, runtime shut down): leave
    /// nothing running.
    fn drop(&mut self) {
        self.signal(libc::SIGKILL);
    }
}

/// The last [`OUTPUT_TAIL_BYTES`] of one output pipe, filled by a reader task.
struct OutputTail {
    buffer: Arc<Mutex<TailBuffer>>,
    reader: Option<JoinHandle<()>>,
}

impl OutputTail {
    /// Starts reading `pipe` (if any) to its end.
    fn collect(pipe: Option<impl AsyncRead + Unpin + Send + 'static>) -> Self {
        let buffer = Arc::new(Mutex::new(TailBuffer::default()));
        let reader = pipe.map(|mut pipe| {
            let buffer = Arc::clone(&buffer);
            tokio::spawn(async move {
                let mut chunk = vec![0; 8192];
                loop {
                    match pipe.read(&mut chunk).await {
                        Ok(0) => break,
                        Ok(n) => lock(&buffer).push(&chunk[..n]),
                        Err(err) => {
                            debug!(error = %err, "cannot read agent output");
                            break;
                        }
                    }
                }
            })
        });
        Self { buffer, reader }
    }

    /// Waits (bounded) for the pipe to reach EOF; false if it did not (a
    /// process outside the group still holds it).
    async fn drain(&mut self) -> bool {
        if let Some(mut reader) = self.reader.take()
            && time::timeout(OUTPUT_DRAIN_TIMEOUT, &mut reader).await.is_err()
        {
            debug!("agent output still open after the process group ended; keeping what was read");
            reader.abort();
            return false;
        }
        true
    }

    /// The tail as (lossy) UTF-8.
    fn text(&self) -> String {
        lock(&self.buffer).text()
    }
}

pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A byte buffer that keeps only the last [`OUTPUT_TAIL_BYTES`] pushed.
#[derive(Debug, Default)]
struct TailBuffer {
    bytes: VecDeque<u8>,
    /// Bytes dropped from the front.
    cut: u64,
}

impl TailBuffer {
    fn push(&mut self, chunk: &[u8]) {
        let skipped = chunk.len().saturating_sub(OUTPUT_TAIL_BYTES);
        self.cut += skipped as u64;
        self.bytes.extend(&chunk[skipped..]);
        let excess = self.bytes.len().saturating_sub(OUTPUT_TAIL_BYTES);
        if excess > 0 {
            self.bytes.drain(..excess);
            self.cut += excess as u64;
        }
    }

    /// Lossy UTF-8 of at most [`OUTPUT_TAIL_BYTES`], marked
    /// `[trimmed: N earlier bytes not kept]` when the front was cut (see
    /// `punchclock_proto::output::tail`); a partial character at the cut
    /// is skipped rather than shown as U+FFFD.
    fn text(&self) -> String {
        let mut bytes: Vec<u8> = self.bytes.iter().copied().collect();
        let mut cut = self.cut;
        if cut > 0 {
            let partial = bytes.iter().take(3).take_while(|b| (**b & 0b1100_0000) == 0b1000_0000).count();
            bytes.drain(..partial);
            cut += partial as u64;
        }
        // Invalid bytes become U+FFFD (3 bytes): the text can outgrow the
        // buffer, and is cut again to fit.
        punchclock_proto::output::tail(&String::from_utf8_lossy(&bytes), cut, OUTPUT_TAIL_BYTES)
    }
}

/// One parsed progress line.
#[derive(Debug, Default, PartialEq, Deserialize)]
struct ProgressUpdate {
    #[serde(default)]
    percent: Option<f64>,
    #[serde(default)]
    message: Option<String>,
    #[serde(default)]
    checkpoint: Option<serde_json::Value>,
}

/// Incremental reader of the progress file.
#[derive(Debug, Default, Clone)]
struct ProgressFile {
    /// Bytes of the file consumed so far.
    offset: u64,
    /// An incomplete last line, waiting for its newline.
    partial: Vec<u8>,
}

impl ProgressFile {
    /// Parses the complete lines appended since the last call. With
    /// `at_exit`, a final line without a newline counts as complete.
    /// Blocking: call it on the blocking pool.
    fn read_new(&mut self, path: &Path, at_exit: bool) -> Vec<ProgressUpdate> {
        let appended = match self.read_appended(path) {
            Ok(bytes) => bytes,
            Err(err) if err.kind() == io::ErrorKind::NotFound => Vec::new(),
            Err(err) => {
                warn!(file = %path.display(), error = %err, "cannot read progress file");
                Vec::new()
            }
        };
        self.partial.extend_from_slice(&appended);

        let mut lines = Vec::new();
        while let Some(end) = self.partial.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = self.partial.drain(..=end).collect();
            lines.push(line);
        }
        if at_exit && !self.partial.is_empty() {
            lines.push(std::mem::take(&mut self.partial));
        }
        if self.partial.len() > MAX_PROGRESS_LINE_BYTES {
            warn!(bytes = self.partial.len(), "progress line too long; dropped");
            self.partial.clear();
        }
        let updates: Vec<ProgressUpdate> = lines
            .iter()
            .filter(|line| {
                let ok = line.len() <= MAX_PROGRESS_LINE_BYTES;
                if !ok {
                    warn!(bytes = line.len(), "progress line too long; dropped");
                }
                ok
            })
            .filter_map(|line| parse_progress_line(line))
            .collect();
        coalesce(updates).into_iter().collect()
    }

    fn read_appended(&mut self, path: &Path) -> io::Result<Vec<u8>> {
        use std::io::{Read, Seek};
        let mut file = open_agent_file(path)?;
        let len = file.metadata()?.len();
        if len < self.offset {
            debug!(file = %path.display(), "progress file shrank; reading it from the start");
            self.offset = 0;
            self.partial.clear();
        }
        file.seek(io::SeekFrom::Start(self.offset))?;
        let mut appended = Vec::new();
        file.take(MAX_PROGRESS_READ_BYTES).read_to_end(&mut appended)?;
        self.offset += appended.len() as u64;
        Ok(appended)
    }
}

/// The updates of one poll as one: the latest percent and message, and the
/// latest checkpoint given in any of them. A burst of lines costs one
/// report, not one per line.
fn coalesce(updates: Vec<ProgressUpdate>) -> Option<ProgressUpdate> {
    let mut checkpoint = None;
    let mut last = None;
    for u in updates {
        if u.checkpoint.is_some() {
            checkpoint = u.checkpoint.clone();
        }
        last = Some(u);
    }
    last.map(|mut u| {
        if u.checkpoint.is_none() {
            u.checkpoint = checkpoint;
        }
        u
    })
}

/// Parses one progress line; blank lines are skipped silently, malformed
/// ones with a log line.
fn parse_progress_line(line: &[u8]) -> Option<ProgressUpdate> {
    let text = String::from_utf8_lossy(line);
    let text = text.trim();
    if text.is_empty() {
        return None;
    }
    let parsed = serde_json::from_str::<serde_json::Value>(text).and_then(|value| {
        if value.is_object() { serde_json::from_value(value) } else { Err(serde::de::Error::custom("not a JSON object")) }
    });
    match parsed {
        Ok(update) => Some(update),
        Err(err) => {
            info!(line = %text, error = %err, "ignoring malformed progress line");
            None
        }
    }
}

/// An outcome as the control plane's spans name it (`failed`, not
/// `OUTCOME_FAILED`): one vocabulary across a run's trace.
pub(crate) fn outcome_label(o: Outcome) -> String {
    o.as_str_name().trim_start_matches("OUTCOME_").to_ascii_lowercase()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_buffer_keeps_the_last_bytes() {
        let mut tail = TailBuffer::default();
        tail.push(b"hello ");
        tail.push(b"world");
        assert_eq!(tail.text(), "hello world");

        let mut tail = TailBuffer::default();
        tail.push(&vec![b'a'; OUTPUT_TAIL_BYTES]);
        tail.push(b"end");
        let text = tail.text();
        assert_eq!(text.len(), OUTPUT_TAIL_BYTES);
        assert!(text.ends_with("aend"));
        assert!(text.starts_with("[trimmed: "), "what was cut is said");

        let mut tail = TailBuffer::default();
        tail.push(&vec![b'x'; 3 * OUTPUT_TAIL_BYTES]);
        let text = tail.text();
        assert_eq!(text.len(), OUTPUT_TAIL_BYTES);
        let marker = format!(
            "[trimmed: {} earlier bytes not kept] ",
            3 * OUTPUT_TAIL_BYTES - (OUTPUT_TAIL_BYTES - text.find("] ").unwrap_or(0) - 2)
        );
        assert!(text.starts_with(&marker), "{:.60}", text);

        // Binary output: each invalid byte becomes 3 bytes of U+FFFD; the
        // text still fits.
        let mut tail = TailBuffer::default();
        tail.push(&vec![0xff; 2 * OUTPUT_TAIL_BYTES]);
        assert!(tail.text().len() <= OUTPUT_TAIL_BYTES);
    }

    #[test]
    fn tail_buffer_skips_a_cut_character() {
        let mut tail = TailBuffer::default();
        tail.push("é".as_bytes()); // 2 bytes: the first one falls off
        tail.push(&vec![b'z'; OUTPUT_TAIL_BYTES - 1]);
        let text = tail.text();
        assert!(!text.contains('\u{FFFD}'));
        // The 2 bytes of the cut character, plus room for the marker.
        assert!(text.starts_with("[trimmed: ") && text.len() == OUTPUT_TAIL_BYTES, "{:.60}", text);
    }

    #[test]
    fn parses_progress_lines() {
        let update = parse_progress_line(br#"{"percent": 50, "message": "half", "checkpoint": {"page": 3}}"#);
        assert_eq!(
            update,
            Some(ProgressUpdate { percent: Some(50.0), message: Some("half".into()), checkpoint: Some(serde_json::json!({"page": 3})) })
        );
        assert_eq!(parse_progress_line(b"{}\n"), Some(ProgressUpdate::default()));
        assert_eq!(parse_progress_line(b"  \n"), None);
        assert_eq!(parse_progress_line(b"[1, 2]"), None);
        assert_eq!(parse_progress_line(b"not json"), None);
        assert_eq!(parse_progress_line(br#"{"percent": "lots"}"#), None);
    }

    #[tokio::test]
    async fn progress_file_yields_complete_lines_once() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("progress.jsonl");
        let mut progress = ProgressFile::default();
        assert!(progress.read_new(&path, false).is_empty(), "missing file");

        std::fs::write(&path, "{\"message\":\"a\"}\n{\"message\":\"b\"}").expect("write");
        let first = progress.read_new(&path, false);
        assert_eq!(first.len(), 1);
        assert_eq!(first[0].message.as_deref(), Some("a"));
        assert!(progress.read_new(&path, false).is_empty(), "partial line is held back");

        let last = progress.read_new(&path, true);
        assert_eq!(last.len(), 1);
        assert_eq!(last[0].message.as_deref(), Some("b"));
    }

    #[tokio::test]
    async fn result_file_handling() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("result.json");
        assert_eq!(read_result(&path), (String::new(), None));

        std::fs::write(&path, "{ \"ok\" : true }\n").expect("write");
        assert_eq!(read_result(&path), (r#"{"ok":true}"#.to_owned(), None));

        std::fs::write(&path, "oops").expect("write");
        let (json, problem) = read_result(&path);
        assert_eq!(json, r#""oops""#);
        assert!(problem.is_some_and(|p| p.contains("not valid JSON")));
    }
}
