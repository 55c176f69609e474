//! The runner's side of the shim's fork server (`punchclock-agent-shim
//! --zygote`; protocol and guarantees in [`crate::shim::zygote`]).
//!
//! A [`Zygote`] is started on first use and again whenever it is found
//! dead. Each execution gets three pipes (the agent's stdin, stdout and
//! stderr) and a request id; a reader task hands the zygote's answers —
//! the supervisor's pid, then, when it has reaped it, its wait status — to
//! the execution they name. If the zygote dies meanwhile (its socket
//! reaches EOF), its supervisors kill their agents (parent-death signal)
//! and those executions are reported killed by SIGKILL.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::ExitStatusExt;
use std::process::{ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::io::unix::AsyncFd;
use tokio::net::unix::pipe;
use tokio::sync::mpsc;
use tracing::{info, warn};

use crate::config::ShimCommand;
use crate::shim::SHIM_PARENT_PID_ENV;
use crate::shim::zygote::{self, MAX_REQUEST_BYTES, Request, Status, ZYGOTE_FLAG};

/// How long the zygote may take to accept a request or to answer it with
/// the supervisor's pid before it is killed and replaced (its executions
/// end killed). Generous: a zygote this late is stopped or stuck, not busy.
const ZYGOTE_PATIENCE: std::time::Duration = std::time::Duration::from_secs(30);

/// A lazily started zygote, shared by every execution of a runner. Cheap to
/// clone.
#[derive(Debug, Clone)]
pub struct Zygote {
    shim: ShimCommand,
    state: Arc<tokio::sync::Mutex<Option<Running>>>,
    next_id: Arc<AtomicU64>,
}

/// Where the statuses of each request go, by request id; emptied (every
/// sender dropped) when the zygote's socket reaches EOF.
type Waiters = Arc<Mutex<HashMap<u64, mpsc::UnboundedSender<Status>>>>;

#[derive(Debug)]
struct Running {
    socket: Arc<AsyncFd<OwnedFd>>,
    waiters: Waiters,
    /// Reaped by tokio once dropped; the zygote exits when `socket` closes.
    child: tokio::process::Child,
    /// Reads the zygote's statuses; ends at EOF.
    reader: tokio::task::JoinHandle<()>,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

/// An agent supervisor forked by the zygote, with the runner's ends of its
/// pipes.
#[derive(Debug)]
pub(crate) struct Spawned {
    pub process: ZygoteProcess,
    pub stdin: pipe::Sender,
    pub stdout: pipe::Receiver,
    pub stderr: pipe::Receiver,
}

/// A supervisor started by the zygote: its pid (and process group) and the
/// statuses the zygote sends about it.
#[derive(Debug)]
pub(crate) struct ZygoteProcess {
    pid: libc::pid_t,
    statuses: mpsc::UnboundedReceiver<Status>,
    exited: Option<ExitStatus>,
    /// Keeps the zygote (its socket) open while this supervisor runs: its
    /// closing would make the zygote exit and its supervisors kill their
    /// agents.
    _zygote: Zygote,
}

impl Zygote {
    /// A zygote run as `shim --zygote` (started on first use).
    pub fn new(shim: ShimCommand) -> Self {
        Self { shim, state: Arc::new(tokio::sync::Mutex::new(None)), next_id: Arc::new(AtomicU64::new(1)) }
    }

    /// The running zygote's pid, if one is running.
    pub async fn pid(&self) -> Option<u32> {
        self.state.lock().await.as_ref().and_then(|running| running.child.id())
    }

    /// Starts a supervisor for `request` (its `id` is set here).
    ///
    /// Errors: `InvalidInput` when the encoded request is larger than
    /// [`MAX_REQUEST_BYTES`] (the caller execs a shim instead); the zygote
    /// cannot be started or refused the request (its errno, e.g. `EAGAIN`
    /// from `fork`); it did not answer within [`ZYGOTE_PATIENCE`]
    /// (`TimedOut`; it is killed); pipes cannot be created.
    pub(crate) async fn spawn(&self, request: &mut Request) -> io::Result<Spawned> {
        request.id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let bytes = request.encode();
        if bytes.len() > MAX_REQUEST_BYTES {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "argv and environment too large for the zygote"));
        }
        let sent = tokio::time::timeout(ZYGOTE_PATIENCE, self.send(request.id, &bytes)).await;
        let (mut statuses, [stdin, stdout, stderr]) = match sent {
            Ok(sent) => sent?,
            Err(_elapsed) => {
                self.replace("did not take a request").await;
                return Err(io::Error::new(io::ErrorKind::TimedOut, "the agent zygote did not take the request"));
            }
        };
        let first = match tokio::time::timeout(ZYGOTE_PATIENCE, statuses.recv()).await {
            Ok(first) => first,
            Err(_elapsed) => {
                self.replace("did not answer a request").await;
                return Err(io::Error::new(io::ErrorKind::TimedOut, "the agent zygote did not answer"));
            }
        };
        let pid = match first {
            Some(Status::Started(pid)) => pid,
            Some(Status::Failed(errno)) => return Err(io::Error::from_raw_os_error(errno)),
            Some(Status::Exited(_)) | None => return Err(io::Error::other("the agent zygote exited")),
        };
        Ok(Spawned {
            process: ZygoteProcess { pid, statuses, exited: None, _zygote: self.clone() },
            stdin: pipe::Sender::from_owned_fd(stdin)?,
            stdout: pipe::Receiver::from_owned_fd(stdout)?,
            stderr: pipe::Receiver::from_owned_fd(stderr)?,
        })
    }

    /// Kills the running zygote (its executions end killed); the next
    /// request starts a new one.
    async fn replace(&self, why: &str) {
        if let Some(mut running) = self.state.lock().await.take() {
            warn!(pid = running.child.id(), why, "killing the agent zygote");
            let _ = running.child.start_kill();
        }
    }

    /// Sends request `id`, starting the zygote if needed and once more if
    /// the running one turns out to be dead. The agent's pipes are made
    /// here, under the lock, so requests waiting for it hold no
    /// descriptors. Returns where its statuses arrive and the runner's ends
    /// of the pipes (stdin's write end, stdout's and stderr's read ends).
    async fn send(&self, id: u64, bytes: &[u8]) -> io::Result<(mpsc::UnboundedReceiver<Status>, [OwnedFd; 3])> {
        let mut state = self.state.lock().await;
        let (stdin_r, stdin_w) = pipe_pair()?;
        let (stdout_r, stdout_w) = pipe_pair()?;
        let (stderr_r, stderr_w) = pipe_pair()?;
        let fds = [stdin_r.as_raw_fd(), stdout_w.as_raw_fd(), stderr_w.as_raw_fd()];
        for _ in 0..2 {
            let alive = match state.as_mut() {
                Some(running) => running.child.try_wait().map(|exit| exit.is_none()).unwrap_or(false) && !running.reader.is_finished(),
                None => false,
            };
            if !alive {
                if state.is_some() {
                    warn!("the agent zygote exited; starting a new one");
                }
                *state = Some(self.start()?);
            }
            let Some(running) = state.as_mut() else { continue };
            let (tx, rx) = mpsc::unbounded_channel();
            lock(&running.waiters).insert(id, tx);
            loop {
                let mut guard = running.socket.writable().await?;
                match guard.try_io(|socket| zygote::send_with_fds(socket.as_raw_fd(), bytes, &fds, false)) {
                    Ok(Ok(())) => return Ok((rx, [stdin_w, stdout_r, stderr_r])),
                    Ok(Err(err)) => {
                        lock(&running.waiters).remove(&id);
                        if matches!(err.raw_os_error(), Some(libc::EPIPE | libc::ECONNRESET | libc::ENOTCONN)) {
                            *state = None;
                            break;
                        }
                        return Err(err);
                    }
                    Err(_would_block) => continue,
                }
            }
        }
        Err(io::Error::other("the agent zygote exits as soon as it starts"))
    }

    fn start(&self) -> io::Result<Running> {
        let (mine, theirs) = zygote::seqpacket_pair()?;
        let mut command = tokio::process::Command::new(&self.shim.program);
        command
            .args(&self.shim.args)
            .arg(ZYGOTE_FLAG)
            .env(SHIM_PARENT_PID_ENV, std::process::id().to_string())
            .stdin(Stdio::from(theirs))
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        let child = command.spawn()?;
        info!(program = %self.shim.program.display(), pid = child.id(), "agent zygote started");
        let socket = Arc::new(register(mine)?);
        let waiters = Waiters::default();
        let reader = tokio::spawn(read_statuses(Arc::clone(&socket), Arc::clone(&waiters)));
        Ok(Running { socket, waiters, child, reader })
    }
}

/// Hands each status the zygote sends to its request's waiter, until EOF
/// (then drops every waiter: their executions see the zygote gone).
async fn read_statuses(socket: Arc<AsyncFd<OwnedFd>>, waiters: Waiters) {
    loop {
        let Ok(mut guard) = socket.readable().await else { break };
        match guard.try_io(|socket| zygote::read_status(socket.as_raw_fd())) {
            Ok(Ok(Some((id, status)))) => {
                let mut waiters = lock(&waiters);
                let delivered = waiters.get(&id).is_some_and(|tx| tx.send(status).is_ok());
                if !delivered || matches!(status, Status::Exited(_) | Status::Failed(_)) {
                    waiters.remove(&id);
                }
            }
            Ok(Ok(None)) => break,
            Ok(Err(err)) => {
                warn!(error = %err, "cannot read the agent zygote's answers");
                break;
            }
            Err(_would_block) => {}
        }
    }
    lock(&waiters).clear();
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl ZygoteProcess {
    /// The supervisor's pid (and process group id).
    pub fn pid(&self) -> u32 {
        u32::try_from(self.pid).unwrap_or_default()
    }

    /// Waits for the supervisor to be reaped (cancel-safe). A zygote that
    /// died first reports it killed by SIGKILL (its supervisors killed
    /// their agents when it died).
    pub async fn wait(&mut self) -> io::Result<ExitStatus> {
        while self.exited.is_none() {
            match self.statuses.recv().await {
                Some(Status::Exited(raw)) => self.exited = Some(ExitStatus::from_raw(raw)),
                Some(_) => {}
                None => {
                    warn!(pid = self.pid, "the agent zygote exited before reporting this supervisor's end");
                    // Its parent-death signal has it sweeping the agent's
                    // descendants (even ones in other sessions); a kill of
                    // its group now would cut that short.
                    let deadline = tokio::time::Instant::now() + ORPHAN_SWEEP_WAIT;
                    while !exited_or_zombie(self.pid) && tokio::time::Instant::now() < deadline {
                        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                    }
                    self.exited = Some(ExitStatus::from_raw(libc::SIGKILL));
                }
            }
        }
        Ok(self.exited.unwrap_or_else(|| ExitStatus::from_raw(libc::SIGKILL)))
    }

    /// SIGKILLs the supervisor (not its group); a no-op once reaped.
    pub fn start_kill(&mut self) -> io::Result<()> {
        if self.exited.is_none() && self.pid > 0 {
            // SAFETY: kill(2) has no memory-safety preconditions; pid > 0.
            unsafe { libc::kill(self.pid, libc::SIGKILL) };
        }
        Ok(())
    }
}

/// How long a supervisor whose zygote died gets to finish its sweep before
/// the executor kills what is left of its group.
const ORPHAN_SWEEP_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// Whether `pid` has exited (gone, or a zombie nobody reaped yet).
fn exited_or_zombie(pid: libc::pid_t) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // "pid (comm) STATE ...": comm may contain spaces or ')'.
        Ok(stat) => stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().next()).is_some_and(|s| s == "Z" || s == "X"),
        Err(_) => true,
    }
}

/// Registers a socket we own with the reactor.
fn register(fd: OwnedFd) -> io::Result<AsyncFd<OwnedFd>> {
    // SAFETY: the `OwnedFd` is open and owned by the `AsyncFd` for its
    // whole life, so its descriptor never changes.
    Ok(unsafe { AsyncFd::register(fd) }?)
}

/// A pipe (read end, write end), both close-on-exec.
fn pipe_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: pipe2 writes two descriptors into the array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } == -1 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both descriptors are new and owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}
