//! The runner's side of the shim's fork server (`punchclock-agent-shim
//! --zygote`; protocol and guarantees in [`crate::shim::zygote`]).
//!
//! A [`Zygote`] is started on first use and again whenever it is found
//! dead. Each execution gets three pipes (the agent's stdin, stdout and
//! stderr) and a request id; a reader thread hands the zygote's answers —
//! the supervisor's pid, then, when it has reaped it, its wait status — to
//! the execution they name. If the zygote dies meanwhile (its socket
//! reaches EOF), its supervisors kill their agents (parent-death signal)
//! and those executions are reported killed by SIGKILL.
//!
//! Spares: the reader thread also keeps the spare supervisors the zygote
//! hands over (their sockets); a start sends its request to the newest
//! spare (its pid is known at once) and falls back to the zygote when none
//! is left. Measured (bench-load, `/bin/true`, 100 due every second, 2
//! cores, `punchclock::start=debug`): the zygote's answer was 95 % of a
//! start's time in the runner (p50/p99 40 / 106 ms, the zygote waiting
//! for the CPU behind the agents it had started); with spares the start
//! itself is p50 0.1 ms.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::unix::AsyncFd;
use tokio::net::unix::pipe;
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use crate::config::ShimCommand;
use crate::executor::lock;
use crate::shim::SHIM_PARENT_PID_ENV;
use crate::shim::zygote::{self, MAX_REQUEST_BYTES, Request, Status, ZYGOTE_FLAG};

/// How long the zygote may take to accept a request or to answer it with
/// the supervisor's pid before the start fails (the supervisor, if it is
/// ever forked, then exits without starting the agent). A stopped zygote
/// is not killed: its running executions go on.
const ZYGOTE_PATIENCE: std::time::Duration = std::time::Duration::from_secs(30);

/// A lazily started zygote, shared by every execution of a runner. Cheap to
/// clone.
#[derive(Debug, Clone)]
pub struct Zygote {
    shim: ShimCommand,
    /// The running zygote. A plain mutex, held for no await: starts that
    /// queued on an async one were handed the lock one scheduler round
    /// each, which under a burst cost hundreds of milliseconds per start.
    state: Arc<Mutex<Option<Running>>>,
    next_id: Arc<AtomicU64>,
    /// See [`ZYGOTE_PATIENCE`].
    patience: std::time::Duration,
    /// Whether the zygote keeps spare supervisors (see the module docs).
    spares: bool,
    /// Bounds the starts in progress (each holds eight descriptors until
    /// the zygote has answered): a burst of thousands must not run the
    /// runner out of descriptors.
    starting: Arc<tokio::sync::Semaphore>,
    /// The runner's cgroups: the zygote starts in the agents' shared one
    /// ([`crate::cgroup::Cgroups::shared`]).
    cgroups: Option<Arc<crate::cgroup::Cgroups>>,
}

/// Where the statuses of each request go, by request id; emptied (every
/// sender dropped) when the zygote's socket reaches EOF.
type Waiters = Arc<Mutex<HashMap<u64, mpsc::UnboundedSender<Status>>>>;

#[derive(Debug)]
struct Running {
    /// Which start of the zygote this is (unique per `Zygote`).
    generation: u64,
    socket: Arc<AsyncFd<OwnedFd>>,
    waiters: Waiters,
    /// Reaped by tokio once dropped; the zygote exits when `socket` closes.
    child: tokio::process::Child,
    /// Reads the zygote's statuses; ends at EOF.
    reader: std::thread::JoinHandle<()>,
    /// The spare supervisors the zygote handed over (see
    /// [`crate::shim::zygote::SPARE_ID`]), newest last.
    spares: Spares,
}

/// How often an idle runner's reader thread closes spares unused for
/// [`SPARE_UNUSED_FOR`].
const SPARE_TRIM_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

/// Closes the oldest spares while they have sat unused for
/// [`SPARE_UNUSED_FOR`], keeping the zygote's `MIN_SPARES`.
fn trim(spares: &mut SparePool) {
    while spares.len() > zygote::MIN_SPARES && spares.front().is_some_and(|(_, _, at)| at.elapsed() >= SPARE_UNUSED_FOR) {
        spares.pop_front();
    }
}

/// A request sent: where its statuses arrive, and the runner's ends of the
/// agent's pipes (stdin's write end, stdout's and stderr's read ends).
type Sent = (mpsc::UnboundedReceiver<Status>, [OwnedFd; 3]);

/// Spare supervisors ready for a request: pid, the runner's end of the
/// spare's socket, and when it arrived; newest last.
type SparePool = std::collections::VecDeque<(libc::pid_t, OwnedFd, std::time::Instant)>;
type Spares = Arc<Mutex<SparePool>>;

/// How long a spare may wait unused before the runner closes it (it then
/// exits, and the zygote keeps one fewer), down to the zygote's
/// `MIN_SPARES`: the pool follows the largest burst of the last minute.
const SPARE_UNUSED_FOR: std::time::Duration = std::time::Duration::from_secs(60);

impl Drop for Running {
    fn drop(&mut self) {
        // The reader thread holds the socket: shutting it down (not just
        // dropping our handle) is what ends the zygote, and the thread.
        // SAFETY: shutdown(2) on a socket we own.
        unsafe { libc::shutdown(self.socket.as_raw_fd(), libc::SHUT_RDWR) };
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
    /// The execution's control socket: the agent's exit code arrives here
    /// from the supervisor itself; EOF without one means it was killed.
    control: AsyncFd<OwnedFd>,
    /// The zygote's reports (its wait status tells which signal).
    statuses: mpsc::UnboundedReceiver<Status>,
    exit: Option<ExitStatus>,
    /// Set at the control socket's EOF: until when the zygote's wait
    /// status is awaited (kept across cancelled `wait`s).
    eof_deadline: Option<tokio::time::Instant>,
    /// Keeps the zygote (its socket) open while this supervisor runs: its
    /// closing would make the zygote exit and its supervisors kill their
    /// agents.
    _zygote: Zygote,
}

impl Zygote {
    /// A zygote run as `shim --zygote` (started on first use).
    pub fn new(shim: ShimCommand) -> Self {
        Self {
            shim,
            state: Arc::new(Mutex::new(None)),
            next_id: Arc::new(AtomicU64::new(1)),
            patience: ZYGOTE_PATIENCE,
            spares: true,
            starting: Arc::new(tokio::sync::Semaphore::new(MAX_STARTING)),
            cgroups: None,
        }
    }

    /// The same, its zygote (and so every supervisor and agent it starts)
    /// in the agents' shared cgroup of `cgroups`, when they have one.
    pub fn in_cgroups(self, cgroups: Arc<crate::cgroup::Cgroups>) -> Self {
        Self { cgroups: Some(cgroups), ..self }
    }

    /// The same with another patience (how long a start waits for the
    /// zygote before it fails; default 30 s).
    pub fn with_patience(self, patience: std::time::Duration) -> Self {
        Self { patience, ..self }
    }

    /// The same without spare supervisors: every start is a request the
    /// zygote forks for (tests of that path).
    pub fn without_spares(self) -> Self {
        Self { spares: false, ..self }
    }

    /// The pids of the spare supervisors this runner holds, oldest first.
    pub fn spare_pids(&self) -> Vec<u32> {
        lock(&self.state)
            .as_ref()
            .map(|running| lock(&running.spares).iter().map(|(pid, _, _)| pid.unsigned_abs()).collect())
            .unwrap_or_default()
    }

    /// The running zygote's pid, if one is running.
    pub fn pid(&self) -> Option<u32> {
        lock(&self.state).as_ref().and_then(|running| running.child.id())
    }

    /// Starts a supervisor for `request` (its `id` is set here) and tells
    /// it to start the agent once its pid is known. Whatever fails before
    /// that "go" (an error, a timeout) leaves no agent behind: a supervisor
    /// the zygote forks later finds its control socket closed and exits
    /// without starting it. So a start reported failed never runs.
    ///
    /// Errors: `EMSGSIZE` when the encoded request is larger than
    /// [`MAX_REQUEST_BYTES`] or than the socket takes (nothing was sent:
    /// the caller execs a shim instead); the zygote cannot be started or
    /// refused the request (its errno, e.g. `EAGAIN` from `fork`); it did
    /// not answer within its patience ([`ZYGOTE_PATIENCE`]) (`TimedOut`); pipes or sockets
    /// cannot be created; the supervisor cannot join `cgroup` (the
    /// execution's, which it and the agent then live in).
    pub(crate) async fn spawn(&self, request: &mut Request, cgroup: Option<&crate::cgroup::ExecCgroup>) -> io::Result<Spawned> {
        if request.argv.iter().chain(&request.env).any(|s| s.as_encoded_bytes().contains(&0)) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "an argument or environment entry contains a NUL byte"));
        }
        request.id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let bytes = request.encode();
        if bytes.len() > MAX_REQUEST_BYTES {
            return Err(io::Error::from_raw_os_error(libc::EMSGSIZE));
        }
        let t0 = std::time::Instant::now();
        let _permit = self.starting.acquire().await.map_err(io::Error::other)?;
        let t_permit = t0.elapsed();
        let (control, theirs) = zygote::seqpacket_pair()?;
        if let Some((pid, sent)) = self.send_to_spare(&bytes, &theirs)? {
            drop(theirs);
            debug!(target: "punchclock::start", request = request.id, pid, permit_us = t_permit.as_micros(), spare_us = (t0.elapsed() - t_permit).as_micros(), "zygote phases");
            return go(self.spawned(pid, control, sent)?, cgroup);
        }
        let Ok(sent) = tokio::time::timeout(self.patience, self.send(request.id, &bytes, theirs)).await else {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "the agent zygote did not take the request in time"));
        };
        let (mut statuses, pipes) = sent?;
        let t_sent = t0.elapsed();
        let Ok(first) = tokio::time::timeout(self.patience, statuses.recv()).await else {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "the agent zygote did not answer in time"));
        };
        debug!(
            target: "punchclock::start",
            request = request.id,
            permit_us = t_permit.as_micros(),
            send_us = (t_sent - t_permit).as_micros(),
            answer_us = (t0.elapsed() - t_sent).as_micros(),
            "zygote phases"
        );
        let pid = match first {
            Some(Status::Started(pid)) => pid,
            Some(Status::Failed(errno)) => {
                return Err(io::Error::other(format!("the agent zygote cannot fork: {}", io::Error::from_raw_os_error(errno))));
            }
            Some(Status::Exited(_) | Status::Spare(_)) | None => return Err(io::Error::other("the agent zygote exited")),
        };
        go(self.spawned(pid, control, (statuses, pipes))?, cgroup)
    }

    /// Supervisor `pid` with the runner's ends of its control socket and
    /// pipes, registered with the reactor.
    fn spawned(&self, pid: libc::pid_t, control: OwnedFd, (statuses, [stdin, stdout, stderr]): Sent) -> io::Result<Spawned> {
        Ok(Spawned {
            stdin: pipe::Sender::from_owned_fd(stdin)?,
            stdout: pipe::Receiver::from_owned_fd(stdout)?,
            stderr: pipe::Receiver::from_owned_fd(stderr)?,
            process: ZygoteProcess { pid, control: register(control)?, statuses, exit: None, eof_deadline: None, _zygote: self.clone() },
        })
    }

    /// Sends the encoded request to a spare supervisor, if the running
    /// zygote handed over one that is still alive (newest first; spares
    /// unused for [`SPARE_UNUSED_FOR`] are closed on the way): its pid,
    /// where its statuses arrive, and the runner's ends of the agent's
    /// pipes. `None`: no spare (the zygote forks one for this request).
    fn send_to_spare(&self, bytes: &[u8], control: &OwnedFd) -> io::Result<Option<(libc::pid_t, Sent)>> {
        let (spares, waiters) = match lock(&self.state).as_ref() {
            Some(running) => (Arc::clone(&running.spares), Arc::clone(&running.waiters)),
            None => return Ok(None),
        };
        let mut pipes: Option<[(OwnedFd, OwnedFd); 3]> = None;
        loop {
            let spare = {
                let mut spares = lock(&spares);
                trim(&mut spares);
                spares.pop_back()
            };
            let Some((pid, socket, _)) = spare else { return Ok(None) };
            let [(stdin_r, stdin_w), (stdout_r, stdout_w), (stderr_r, stderr_w)] = match pipes.take() {
                Some(made) => made,
                None => [pipe_pair()?, pipe_pair()?, pipe_pair()?],
            };
            let id = zygote::SPARE_ID | u64::from(pid.unsigned_abs());
            let (tx, rx) = mpsc::unbounded_channel();
            lock(&waiters).insert(id, tx);
            let fds = [stdin_r.as_raw_fd(), stdout_w.as_raw_fd(), stderr_w.as_raw_fd(), control.as_raw_fd()];
            // The spare's socket is empty and sized for the largest request.
            match zygote::send_with_fds(socket.as_raw_fd(), bytes, &fds, false) {
                Ok(()) => return Ok(Some((pid, (rx, [stdin_w, stdout_r, stderr_r])))),
                // Dead (killed from outside): closed; the next.
                Err(err) if matches!(err.raw_os_error(), Some(libc::EPIPE | libc::ECONNRESET | libc::ECONNREFUSED | libc::ENOTCONN)) => {
                    lock(&waiters).remove(&id);
                    pipes = Some([(stdin_r, stdin_w), (stdout_r, stdout_w), (stderr_r, stderr_w)]);
                }
                // Anything else (no buffer space, say) is not the spare's
                // fault: it goes back, and this start to the zygote.
                Err(err) => {
                    lock(&waiters).remove(&id);
                    lock(&spares).push_back((pid, socket, std::time::Instant::now()));
                    debug!(error = %err, "cannot hand a start to a spare supervisor; asking the zygote");
                    return Ok(None);
                }
            }
        }
    }

    /// Sends request `id`, starting the zygote if needed and once more if
    /// the running one turns out to be dead. Returns where its statuses
    /// arrive and the runner's ends of the agent's pipes (stdin's write end,
    /// stdout's and stderr's read ends). Concurrent sends need no lock: each
    /// `sendmsg` on a `SOCK_SEQPACKET` socket is one whole message.
    async fn send(&self, id: u64, bytes: &[u8], control: OwnedFd) -> io::Result<Sent> {
        let (stdin_r, stdin_w) = pipe_pair()?;
        let (stdout_r, stdout_w) = pipe_pair()?;
        let (stderr_r, stderr_w) = pipe_pair()?;
        // The supervisor's ends, closed here once sent (so the runner's ends
        // see EOF when the supervisor is gone).
        let fds = [stdin_r.as_raw_fd(), stdout_w.as_raw_fd(), stderr_w.as_raw_fd(), control.as_raw_fd()];
        for _ in 0..2 {
            let (socket, waiters, generation) = self.current()?;
            let (tx, rx) = mpsc::unbounded_channel();
            lock(&waiters).insert(id, tx);
            loop {
                let mut guard = socket.writable().await?;
                match guard.try_io(|socket| zygote::send_with_fds(socket.as_raw_fd(), bytes, &fds, false)) {
                    Ok(Ok(())) => return Ok((rx, [stdin_w, stdout_r, stderr_r])),
                    Ok(Err(err)) => {
                        lock(&waiters).remove(&id);
                        if matches!(err.raw_os_error(), Some(libc::EPIPE | libc::ECONNRESET | libc::ENOTCONN)) {
                            self.forget(generation);
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

    /// The running zygote's socket, waiters and generation, starting one if
    /// none runs (or the last one exited).
    fn current(&self) -> io::Result<(Arc<AsyncFd<OwnedFd>>, Waiters, u64)> {
        let mut state = lock(&self.state);
        let alive = match state.as_mut() {
            Some(running) => running.child.try_wait().map(|exit| exit.is_none()).unwrap_or(false) && !running.reader.is_finished(),
            None => false,
        };
        if !alive {
            if state.take().is_some() {
                warn!("the agent zygote exited; starting a new one");
            }
            // Unique (shared with request ids).
            let generation = self.next_id.fetch_add(1, Ordering::Relaxed);
            *state = Some(self.start(generation)?);
        }
        let running = state.as_ref().ok_or_else(|| io::Error::other("no agent zygote"))?;
        Ok((Arc::clone(&running.socket), Arc::clone(&running.waiters), running.generation))
    }

    /// Drops the zygote of `generation` (found dead) if it is still the
    /// current one.
    fn forget(&self, generation: u64) {
        let mut state = lock(&self.state);
        if state.as_ref().is_some_and(|running| running.generation == generation) {
            *state = None;
        }
    }

    fn start(&self, generation: u64) -> io::Result<Running> {
        let (mine, theirs) = zygote::seqpacket_pair()?;
        let mut command = tokio::process::Command::new(&self.shim.program);
        command
            .args(&self.shim.args)
            .arg(ZYGOTE_FLAG)
            .env(SHIM_PARENT_PID_ENV, std::process::id().to_string())
            .stdin(Stdio::from(theirs))
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        if !self.spares {
            command.env(zygote::ZYGOTE_SPARES_ENV, "0");
        }
        // The zygote joins the agents' shared cgroup before it execs, so
        // every supervisor and agent it forks starts there: the file is
        // opened here, the child writes "0" (itself) to it.
        let shared = self.cgroups.as_ref().and_then(|cgroups| {
            let opened = |path: PathBuf| std::fs::OpenOptions::new().write(true).open(&path).map(|file| (path, file));
            let joined = cgroups.shared().and_then(|procs| procs.map(opened).transpose());
            joined.unwrap_or_else(|e| {
                warn!(error = %e, "cannot make the agents' cgroup: agents weigh against the runner by their nice value only");
                None
            })
        });
        if let Some((_, procs)) = &shared {
            let fd = procs.as_raw_fd();
            // SAFETY: write(2) is async-signal-safe; `fd` (`shared`, with
            // O_CLOEXEC) stays open until spawn returns.
            unsafe {
                command.pre_exec(move || {
                    // Best effort: a CPU weight, not a limit; a zygote
                    // outside it still serves.
                    libc::write(fd, b"0".as_ptr().cast(), 1);
                    Ok(())
                });
            }
        }
        let child = command.spawn()?;
        // The child's write is best effort: see where it ended up.
        let in_group = shared.as_ref().is_some_and(|(procs, _)| child.id().is_some_and(|pid| in_cgroup(pid, procs)));
        if shared.is_some() && !in_group {
            warn!("the agent zygote did not join the agents' cgroup: agents weigh against the runner by their nice value only");
        }
        info!(program = %self.shim.program.display(), pid = child.id(), agents_cgroup = in_group, "agent zygote started");
        // A request that still does not fit gets EMSGSIZE and is exec'd.
        let _ = zygote::size_for_requests(mine.as_raw_fd());
        let socket = Arc::new(register(mine)?);
        let waiters = Waiters::default();
        let spares = Spares::default();
        let (reader_socket, reader_waiters, reader_spares) = (Arc::clone(&socket), Arc::clone(&waiters), Arc::clone(&spares));
        let reader = std::thread::Builder::new()
            .name("agent-zygote".into())
            .spawn(move || read_statuses(reader_socket, reader_waiters, reader_spares))?;
        Ok(Running { generation, socket, waiters, child, reader, spares })
    }
}

/// Hands each status the zygote sends to its request's waiter, until EOF
/// (then drops every waiter: their executions see the zygote gone). A
/// thread of its own, blocked in `recv`: as a task it was polled once per
/// turn of a runtime busy with a burst's starts, the zygote's answers
/// backed up in the socket, and the zygote stalled on a full socket.
fn read_statuses(socket: Arc<AsyncFd<OwnedFd>>, waiters: Waiters, spares: Spares) {
    // Blocking reads that give up every SPARE_TRIM_EVERY to close spares
    // that sat unused (an idle runner must not keep a burst's spares).
    let timeout = libc::timeval { tv_sec: SPARE_TRIM_EVERY.as_secs() as libc::time_t, tv_usec: 0 };
    if let Err(err) = zygote::set_socket_option(socket.as_raw_fd(), libc::SO_RCVTIMEO, &timeout) {
        warn!(error = %err, "cannot time out reads of the agent zygote's socket: unused spares are closed only at starts");
    }
    let mut buf = [0u8; zygote::STATUS_BYTES];
    loop {
        // The socket is blocking (tokio only sends on it, with
        // MSG_DONTWAIT); a spare's announcement carries its socket.
        let (n, mut fds, truncated) = match zygote::recv_with_fds(socket.as_raw_fd(), &mut buf) {
            Ok(received) => received,
            Err(err) if err.kind() == io::ErrorKind::WouldBlock => {
                trim(&mut lock(&spares));
                continue;
            }
            Err(err) => {
                warn!(error = %err, "cannot read the agent zygote's answers");
                break;
            }
        };
        if n == 0 {
            break;
        }
        let Some((id, status)) = Status::decode(&buf[..n]) else {
            warn!("malformed answer from the agent zygote");
            continue;
        };
        match status {
            Status::Spare(pid) => {
                match fds.pop() {
                    Some(socket) if !truncated => lock(&spares).push_back((pid, socket, std::time::Instant::now())),
                    // Out of descriptors (the spare sees EOF and exits; the
                    // zygote backs off its refills).
                    _ => warn!(pid, "a spare supervisor arrived without its socket (out of descriptors?); dropping it"),
                }
                continue;
            }
            // A spare that died unused: never hand it a request.
            Status::Exited(_) if id & zygote::SPARE_ID != 0 => {
                lock(&spares).retain(|(pid, _, _)| zygote::SPARE_ID | u64::from(pid.unsigned_abs()) != id);
            }
            _ => {}
        }
        let mut waiters = lock(&waiters);
        let delivered = waiters.get(&id).is_some_and(|tx| tx.send(status).is_ok());
        if !delivered || matches!(status, Status::Exited(_) | Status::Failed(_)) {
            waiters.remove(&id);
        }
    }
    lock(&waiters).clear();
}

impl ZygoteProcess {
    /// The supervisor's pid (and process group id).
    pub fn pid(&self) -> u32 {
        u32::try_from(self.pid).unwrap_or_default()
    }

    /// Waits for the supervisor to end (cancel-safe): the exit code it
    /// sends, or — killed before it could — the signal in the zygote's
    /// wait status, or SIGKILL when the zygote cannot tell (it is gone).
    pub async fn wait(&mut self) -> io::Result<ExitStatus> {
        while self.exit.is_none() {
            if self.eof_deadline.is_some() {
                self.exit = Some(self.killed_by().await);
                break;
            }
            let mut guard = self.control.readable().await?;
            let mut code = [0u8; 4];
            let read = guard.try_io(|control| {
                // SAFETY: reading into a buffer we own.
                match unsafe { libc::recv(control.as_raw_fd(), code.as_mut_ptr().cast(), 4, libc::MSG_DONTWAIT) } {
                    -1 => Err(io::Error::last_os_error()),
                    n => Ok(n as usize),
                }
            });
            match read {
                Ok(Ok(4)) => self.exit = Some(ExitStatus::from_raw((i32::from_le_bytes(code) & 0xff) << 8)),
                // EOF: killed before it could tell.
                Ok(Ok(_)) => self.eof_deadline = Some(tokio::time::Instant::now() + KILLED_STATUS_WAIT),
                Ok(Err(err)) if err.kind() == io::ErrorKind::Interrupted => {}
                // A supervisor killed with data unread on its end: as EOF.
                Ok(Err(err)) if err.raw_os_error() == Some(libc::ECONNRESET) => {
                    self.eof_deadline = Some(tokio::time::Instant::now() + KILLED_STATUS_WAIT);
                }
                Ok(Err(err)) => return Err(err),
                Err(_would_block) => {}
            }
        }
        Ok(self.exit.unwrap_or_else(|| ExitStatus::from_raw(libc::SIGKILL)))
    }

    /// The wait status of a supervisor that died without reporting: the
    /// zygote's, when it reports within a moment; else SIGKILL.
    async fn killed_by(&mut self) -> ExitStatus {
        let zygote = async {
            while let Some(status) = self.statuses.recv().await {
                if let Status::Exited(raw) = status {
                    return Some(ExitStatus::from_raw(raw));
                }
            }
            None
        };
        let deadline = self.eof_deadline.unwrap_or_else(tokio::time::Instant::now);
        match tokio::time::timeout_at(deadline, zygote).await {
            Ok(Some(status)) => status,
            _ => ExitStatus::from_raw(libc::SIGKILL),
        }
    }

    /// SIGKILLs the supervisor (not its group); a no-op once reaped.
    pub fn start_kill(&mut self) -> io::Result<()> {
        if self.exit.is_none() && self.pid > 0 {
            // SAFETY: kill(2) has no memory-safety preconditions; pid > 0.
            unsafe { libc::kill(self.pid, libc::SIGKILL) };
        }
        Ok(())
    }
}

/// Starts in progress at once (see [`Zygote::starting`]).
const MAX_STARTING: usize = 256;

/// How long to wait for the zygote's wait status of a supervisor that died
/// without reporting its exit code (it tells the signal).
const KILLED_STATUS_WAIT: std::time::Duration = std::time::Duration::from_millis(500);

/// Moves the supervisor into the execution's cgroup, then tells it to
/// start the agent (an error drops `spawned`: the supervisor exits
/// unstarted).
fn go(spawned: Spawned, cgroup: Option<&crate::cgroup::ExecCgroup>) -> io::Result<Spawned> {
    if let Some(cg) = cgroup {
        cg.add(spawned.process.pid.unsigned_abs())?;
    }
    // Go. The socket is empty, so this never blocks. A supervisor that
    // already ended (it could not enter the working directory, say) has
    // closed its end: its exit code and stderr are what `wait` reports.
    match zygote::send_with_fds(spawned.process.control.as_raw_fd(), &[1], &[], false) {
        Err(err) if !matches!(err.raw_os_error(), Some(libc::EPIPE | libc::ECONNRESET)) => Err(err),
        _ => Ok(spawned),
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

/// Whether process `pid` is in the cgroup of the `cgroup.procs` file
/// `procs` (its `/proc/<pid>/cgroup` names that directory).
fn in_cgroup(pid: u32, procs: &Path) -> bool {
    let Some(name) = procs.parent().and_then(Path::file_name) else { return false };
    let suffix = format!("/{}", name.to_string_lossy());
    std::fs::read_to_string(format!("/proc/{pid}/cgroup")).is_ok_and(|text| text.lines().any(|l| l.ends_with(&suffix)))
}
