//! The shim's fork server ("zygote"): one long-lived shim process per runner
//! that forks the per-execution supervisor, instead of the runner exec'ing
//! a new shim for every execution.
//!
//! The runner starts `punchclock-agent-shim --zygote` once, with one end of
//! a `SOCK_SEQPACKET` Unix socket pair as its stdin. For each execution it
//! sends one [`Request`] (an id of its choosing, the agent's argv, its whole
//! environment, working directory, fence file, kill grace and the nice
//! value to add for the agent) with four
//! descriptors attached (`SCM_RIGHTS`, see [`REQUEST_FDS`]): the agent's
//! stdin, stdout and stderr, and the supervisor's end of the execution's
//! control socket. The zygote forks; the child becomes the supervisor
//! exactly as an exec'd shim would (its own process group, child
//! subreaper, parent-death signal, fence; see the crate docs), with the
//! three descriptors as 0, 1 and 2, the control socket as 3 (close-on-exec)
//! and nothing else open. On its own socket the zygote answers with the
//! request's id and [`Status::Started`] (the supervisor's pid, also its
//! process group id) or [`Status::Failed`], and once it has reaped the
//! supervisor, [`Status::Exited`] with the raw wait status.
//!
//! The control socket makes a start exactly-once and the exit code the
//! supervisor's own: the supervisor starts the agent only on the runner's
//! "go" byte, which the runner sends once it has taken the pid (if it gave
//! up first — the zygote too slow, an error — the socket closes and the
//! supervisor exits without starting anything); it writes the agent's exit
//! code there before it exits, so the runner has it even if the zygote is
//! stopped or dead by then. The zygote keeps no descriptor per execution.
//!
//! Lifetimes: the zygote exits when its socket reaches EOF — the runner
//! closed it or died, even by SIGKILL (a process-wide event, unlike
//! `PR_SET_PDEATHSIG`, which follows the thread that forked); it ignores
//! SIGTERM, SIGINT and SIGHUP (a service manager's stop reaches the runner,
//! which stops its agents with their grace period). Its
//! supervisors' parent-death signal then makes each of them kill its agent
//! and everything the agent left behind.
//!
//! The zygote stays in the runner's session (it leads a process group of
//! its own, as every supervisor does). It used to call `setsid`, so that
//! under the kernel's autogroup scheduling (one CPU share per session) a
//! burst of agents would compete with the runner as one group; measured,
//! that group held the zygote too, which then waited behind the agents it
//! had just started: with 100 agents due at once, the last start waited
//! 110-130 ms for its pid, against 55-80 ms in the runner's session, and
//! the runner's CPU per run doubled (bench-load, process agents, 2 cores).
//! Keeping agents from starving the runner is the request's `nice` (the
//! runner's `agent_nice`: the supervisor lowers its own and its agent's
//! priority before the agent starts) and, for a hard cap, `limits`.
//!
//! Spares: in quiet moments the zygote forks supervisors ahead of time and
//! hands the runner one end of each one's socket ([`Status::Spare`], id
//! [`SPARE_ID`]` | pid`). The runner sends a request (the same bytes and
//! descriptors) straight to a spare and knows its pid at once; only when
//! it has none left does a request go to the zygote, which forks. See
//! `Spares` for the pool's size.
//!
//! Why: a fork of this small, single-threaded process costs a fraction of
//! an `execve` of the shim binary (page tables of a few pages, no loader,
//! no start-up), which every execution paid before.

use std::collections::HashMap;
use std::ffi::OsString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStringExt;

use crate::{SHIM_PARENT_PID_ENV, SignalSet, Supervision, supervise};

/// The first argument that makes the shim binary (or `punchclock
/// __agent-shim`) a zygote.
pub const ZYGOTE_FLAG: &str = "--zygote";

/// Largest encoded [`Request`] (bytes). A request for a larger argv plus
/// environment is not sent to the zygote; the runner execs a shim for it.
pub const MAX_REQUEST_BYTES: usize = 128 * 1024;

/// Descriptors attached to a request, in this order: the agent's stdin,
/// stdout, stderr, and the supervisor's end of the execution's control
/// socket (a `SOCK_SEQPACKET` pair): the runner sends one byte on it once
/// it has the supervisor's pid (only then is the agent started; EOF
/// instead means "do not start it"), and the supervisor sends the agent's
/// exit code back on it (an i32, little-endian) before it exits.
pub const REQUEST_FDS: usize = 4;

/// One execution to start.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Request {
    /// The runner's id for this request, echoed in every [`Status`] about it.
    pub id: u64,
    /// Working directory of the agent (`None`: the zygote's, i.e. the
    /// runner's at zygote start).
    pub cwd: Option<OsString>,
    /// The runner's fence deadline file (`None`: no fence).
    pub fence_file: Option<OsString>,
    /// Time between the fence's SIGTERM and its kill, in milliseconds.
    pub kill_grace_ms: u64,
    /// How much lower the agent's CPU priority is than the runner's: added
    /// to the supervisor's nice value before it starts the agent (0-19).
    pub nice: u8,
    /// The agent's program and arguments (non-empty; the program is looked
    /// up in the `PATH` of `env`).
    pub argv: Vec<OsString>,
    /// The agent's whole environment, as `KEY=VALUE` entries.
    pub env: Vec<OsString>,
}

impl Request {
    /// The wire form: length-prefixed fields (u32 little-endian lengths):
    /// id, cwd, fence file, kill grace, nice, argc (the numbers in decimal),
    /// argv…, env…. Empty cwd or fence file means `None`.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        let mut field = |bytes: &[u8]| {
            out.extend_from_slice(&u32::try_from(bytes.len()).unwrap_or(u32::MAX).to_le_bytes());
            out.extend_from_slice(bytes);
        };
        let bytes = |s: &Option<OsString>| s.as_ref().map(|s| s.as_encoded_bytes().to_vec()).unwrap_or_default();
        field(self.id.to_string().as_bytes());
        field(&bytes(&self.cwd));
        field(&bytes(&self.fence_file));
        field(self.kill_grace_ms.to_string().as_bytes());
        field(self.nice.to_string().as_bytes());
        field(self.argv.len().to_string().as_bytes());
        for arg in self.argv.iter().chain(&self.env) {
            field(arg.as_encoded_bytes());
        }
        out
    }

    /// Parses [`Request::encode`]'s output (`None`: malformed).
    pub fn decode(mut bytes: &[u8]) -> Option<Self> {
        let mut fields = Vec::new();
        while !bytes.is_empty() {
            let len = u32::from_le_bytes(bytes.get(..4)?.try_into().ok()?) as usize;
            fields.push(OsString::from_vec(bytes.get(4..4 + len)?.to_vec()));
            bytes = &bytes[4 + len..];
        }
        let mut fields = fields.into_iter();
        let optional = |s: OsString| (!s.is_empty()).then_some(s);
        let id = fields.next()?.to_str()?.parse().ok()?;
        let cwd = optional(fields.next()?);
        let fence_file = optional(fields.next()?);
        let kill_grace_ms = fields.next()?.to_str()?.parse().ok()?;
        let nice = fields.next()?.to_str()?.parse().ok()?;
        let argc: usize = fields.next()?.to_str()?.parse().ok()?;
        let argv: Vec<OsString> = fields.by_ref().take(argc).collect();
        if argv.len() != argc || argc == 0 {
            return None;
        }
        Some(Self { id, cwd, fence_file, kill_grace_ms, nice, argv, env: fields.collect() })
    }
}

/// What the zygote answers about a request: `Started` or `Failed` first,
/// then (after `Started`) `Exited`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// The supervisor was forked: its pid, which is also its process group.
    Started(libc::pid_t),
    /// The supervisor was reaped: its raw wait status (`waitpid`'s).
    Exited(libc::c_int),
    /// The request could not be served: an errno (`fork` failed, or the
    /// request was malformed: `EINVAL`, with id 0 when even that is
    /// unreadable).
    Failed(libc::c_int),
    /// A spare supervisor (see the module docs): its pid, with the runner's
    /// end of its socket attached; id `SPARE_ID | pid`.
    Spare(libc::pid_t),
}

/// Length of an encoded status message (request id and [`Status`]).
pub const STATUS_BYTES: usize = 13;

impl Status {
    /// The request id (u64), one tag byte (`P`, `X`, `E`, `S`) and an i32, all
    /// little-endian.
    pub fn encode(self, id: u64) -> [u8; STATUS_BYTES] {
        let (tag, value) = match self {
            Status::Started(pid) => (b'P', pid),
            Status::Exited(status) => (b'X', status),
            Status::Failed(errno) => (b'E', errno),
            Status::Spare(pid) => (b'S', pid),
        };
        let mut out = [0u8; STATUS_BYTES];
        out[..8].copy_from_slice(&id.to_le_bytes());
        out[8] = tag;
        out[9..].copy_from_slice(&value.to_le_bytes());
        out
    }

    /// Parses [`Status::encode`]'s output: `(request id, status)`.
    pub fn decode(bytes: &[u8]) -> Option<(u64, Self)> {
        if bytes.len() != STATUS_BYTES {
            return None;
        }
        let id = u64::from_le_bytes(bytes[..8].try_into().ok()?);
        let value = i32::from_le_bytes(bytes[9..].try_into().ok()?);
        let status = match bytes[8] {
            b'P' => Status::Started(value),
            b'X' => Status::Exited(value),
            b'E' => Status::Failed(value),
            b'S' => Status::Spare(value),
            _ => return None,
        };
        Some((id, status))
    }
}

/// Sets `SOL_SOCKET` option `option` of `socket` to `value` (an int, a
/// `timeval`, ...).
pub fn set_socket_option<T>(socket: RawFd, option: libc::c_int, value: &T) -> io::Result<()> {
    // SAFETY: setsockopt reads size_of::<T>() bytes from a value we borrow.
    let set = unsafe { libc::setsockopt(socket, libc::SOL_SOCKET, option, (value as *const T).cast(), size_of::<T>() as libc::socklen_t) };
    if set == -1 { Err(io::Error::last_os_error()) } else { Ok(()) }
}

/// Gives `socket`'s send buffer room for the largest request in one
/// message (the default may be smaller; a request that still does not fit
/// gets `EMSGSIZE`).
pub fn size_for_requests(socket: RawFd) -> io::Result<()> {
    set_socket_option(socket, libc::SO_SNDBUF, &(2 * MAX_REQUEST_BYTES as libc::c_int))
}

/// Sends `bytes` as one message on `socket` with `fds` attached
/// (`SCM_RIGHTS`), without SIGPIPE (`MSG_NOSIGNAL`); `wait`: block while
/// the socket is full, else `WouldBlock`.
pub fn send_with_fds(socket: RawFd, bytes: &[u8], fds: &[RawFd], wait: bool) -> io::Result<()> {
    let mut iov = libc::iovec { iov_base: bytes.as_ptr().cast_mut().cast(), iov_len: bytes.len() };
    let payload = std::mem::size_of_val(fds);
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(payload as u32) } as usize;
    let mut control = vec![0u8; space];
    // SAFETY: an all-zero msghdr is valid; the fields are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: msg_control points at `space` bytes, enough for one
        // header carrying `payload` bytes; CMSG_FIRSTHDR is non-null.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(payload as u32) as _;
            std::ptr::copy_nonoverlapping(fds.as_ptr().cast::<u8>(), libc::CMSG_DATA(cmsg), payload);
        }
    }
    loop {
        // SAFETY: msg points at a live iovec and control buffer.
        let flags = if wait { libc::MSG_NOSIGNAL } else { libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL };
        let sent = unsafe { libc::sendmsg(socket, &msg, flags) };
        if sent >= 0 {
            return Ok(());
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// Receives one message into `buf` with up to `REQUEST_FDS` descriptors:
/// `(length, descriptors, truncated)`; length 0 is EOF.
pub fn recv_with_fds(socket: RawFd, buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>, bool)> {
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE((REQUEST_FDS * std::mem::size_of::<RawFd>()) as u32) } as usize;
    let mut control = vec![0u8; space];
    // SAFETY: an all-zero msghdr is valid; the fields are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    let received = loop {
        // SAFETY: msg points at live buffers; received descriptors are
        // close-on-exec.
        let n = unsafe { libc::recvmsg(socket, &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n >= 0 {
            break n as usize;
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    };
    let mut fds = Vec::new();
    // SAFETY: walking the control messages the kernel filled in.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg).cast::<RawFd>();
                let count = ((*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / std::mem::size_of::<RawFd>();
                for i in 0..count {
                    fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    let truncated = msg.msg_flags & (libc::MSG_TRUNC | libc::MSG_CTRUNC) != 0;
    Ok((received, fds, truncated))
}

/// Tells the runner `status` about request `id`, waiting while its socket
/// is full (it reads all the time); exits when the runner is gone.
fn report(id: u64, status: Status) {
    if let Err(err) = send_with_fds(0, &status.encode(id), &[], true) {
        if !matches!(err.raw_os_error(), Some(libc::EPIPE | libc::ECONNRESET | libc::ENOTCONN)) {
            eprintln!("punchclock agent zygote: cannot answer the runner: {err}");
        }
        std::process::exit(0);
    }
}

/// Runs the zygote on the socket that is its stdin; exits when it reaches
/// EOF. Must run single-threaded (it forks). Never returns.
pub(crate) fn zygote_main() -> ! {
    // SAFETY: setpgid/signal/close_range have no memory-safety
    // preconditions. The zygote leads a process group of its own (a
    // signal to the runner's group does not reach it) but stays in the
    // runner's session (see the module docs). It ends when its socket does, not
    // on a stop signal meant for the whole service (systemd's SIGTERM to
    // the cgroup): dying first would take the agents down before the
    // runner's grace period. Descriptors the runner inherited without
    // close-on-exec are not kept.
    unsafe {
        libc::setpgid(0, 0);
        for signal in ZYGOTE_IGNORES {
            libc::signal(signal, libc::SIG_IGN);
        }
        libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32);
    }
    // The runner may have died before we got here: its socket end is then
    // already closed and the first recv reads EOF; the pid check is for a
    // zygote started by hand.
    let expected_parent = std::env::var(SHIM_PARENT_PID_ENV).ok().and_then(|pid| pid.parse::<libc::pid_t>().ok());
    // SAFETY: getppid() has no preconditions.
    if expected_parent.is_some_and(|parent| parent != unsafe { libc::getppid() }) {
        std::process::exit(1);
    }
    let chld = SignalSet::new(&[libc::SIGCHLD]).and_then(|set| set.block().map(|()| set)).unwrap_or_else(|err| {
        eprintln!("punchclock agent zygote: cannot block SIGCHLD: {err}");
        std::process::exit(1)
    });
    // SAFETY: a valid signal set; the result is a new descriptor or -1.
    let sigfd = unsafe { libc::signalfd(-1, &chld.0, libc::SFD_CLOEXEC | libc::SFD_NONBLOCK) };
    if sigfd == -1 {
        eprintln!("punchclock agent zygote: signalfd: {}", io::Error::last_os_error());
        std::process::exit(1);
    }
    // SAFETY: signalfd returned a descriptor we now own.
    let sigfd = unsafe { OwnedFd::from_raw_fd(sigfd) };
    let me = std::process::id() as libc::pid_t;
    // Supervisors not reaped yet: pid → request id.
    let mut running: HashMap<libc::pid_t, u64> = HashMap::new();
    let mut spares = Spares::new();
    let mut buf = vec![0u8; MAX_REQUEST_BYTES];
    loop {
        let mut polls = [
            libc::pollfd { fd: 0, events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: sigfd.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: spares.as_ref().map_or(-1, Spares::taken_fd), events: libc::POLLIN, revents: 0 },
        ];
        // Nothing to do for a while: refill the pool of spares if it is
        // short (one fork at most before the next request is looked at).
        let timeout = spares.as_ref().map_or(-1, Spares::poll_timeout);
        // SAFETY: three valid pollfd entries (fd -1 is ignored).
        let ready = unsafe { libc::poll(polls.as_mut_ptr(), 3, timeout) };
        if ready == -1 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            eprintln!("punchclock agent zygote: poll: {err}");
            std::process::exit(1);
        }
        if polls[2].revents != 0
            && let Some(spares) = spares.as_mut()
        {
            spares.read_taken();
        }
        if polls[1].revents != 0 {
            let mut info = [0u8; 128];
            // SAFETY: reading into a buffer we own (signalfd_siginfo is 128 bytes).
            while unsafe { libc::read(sigfd.as_raw_fd(), info.as_mut_ptr().cast(), info.len()) } > 0 {}
            reap(&mut running, spares.as_mut());
        }
        if polls[0].revents != 0 {
            match recv_with_fds(0, &mut buf) {
                // EOF: the runner closed the socket or died.
                Ok((0, _, _)) => std::process::exit(0),
                Ok((len, fds, truncated)) => {
                    if let Some(spares) = spares.as_mut() {
                        spares.missed();
                    }
                    start(me, &buf[..len], fds, truncated, &mut running);
                }
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => {}
                // The runner closed its end with a request unread: gone too.
                Err(err) if err.raw_os_error() == Some(libc::ECONNRESET) => std::process::exit(0),
                Err(err) => {
                    eprintln!("punchclock agent zygote: recvmsg: {err}");
                    std::process::exit(1);
                }
            }
        }
        if ready == 0
            && let Some(spares) = spares.as_mut()
        {
            spares.refill(me, &mut running, &mut buf);
        }
    }
}

/// Spares the pool starts with and never shrinks below (the runner keeps
/// this many even when they sit unused).
pub const MIN_SPARES: usize = 8;
/// Set to `0` in the zygote's environment (the runner's, or by
/// `Zygote::without_spares` in the runner crate): no spares, every
/// supervisor is forked on request.
pub const ZYGOTE_SPARES_ENV: &str = "PUNCHCLOCK_ZYGOTE_SPARES";
/// Most spares the pool grows to (each an idle fork of the zygote: ~48 KiB
/// of private pages, its page tables, and a socket held by the runner): a
/// burst of up to this many starts finds one for each. With 256, a burst
/// of 300 sent ~50 starts a second to the zygote, whose answers, behind the
/// agents in their cgroup, made the burst's slowest starts (p99 of the
/// start step 95 ms against 1 ms through a spare).
const MAX_SPARES: usize = 512;
/// How long after the last request (or the last spare taken) the pool is
/// refilled: forks wait for a quiet moment, never between the starts of a
/// burst (they would delay the next answer by a fork each, and the forks
/// and the new spares, at the runner's priority, took the CPU from the
/// runner's starts).
const SPARES_QUIET: std::time::Duration = std::time::Duration::from_millis(20);
/// The first pause between refills after a spare died unused or could not
/// be made; it doubles while that goes on, up to [`REFILL_BACKOFF_MAX`], and
/// is forgotten once a spare is taken.
const REFILL_BACKOFF_MIN: std::time::Duration = std::time::Duration::from_millis(100);
/// The longest pause between refills.
const REFILL_BACKOFF_MAX: std::time::Duration = std::time::Duration::from_secs(10);
/// The bit that marks the request id of a spare: `SPARE_ID | pid` is the id
/// under which the zygote announces a spare ([`Status::Spare`]) and
/// reports its exit ([`Status::Exited`]); the runner's own request ids stay
/// below it.
pub const SPARE_ID: u64 = 1 << 63;
/// The descriptor a spare holds its socket on (the runner's requests
/// arrive there).
const SPARE_SOCKET_FD: RawFd = 3;
/// The descriptor on which a spare tells the zygote it was taken (its pid,
/// an i32, written once to a pipe all spares share; closed before the
/// agent starts).
const SPARE_TAKEN_FD: RawFd = 4;

/// The pool of spare supervisors: children forked ahead of time, in quiet
/// moments, each blocked on a socket of its own whose other end the zygote
/// hands to the runner ([`Status::Spare`], the socket attached). The runner
/// then starts an execution by sending its request straight to a spare
/// (the same [`Request`] and descriptors the zygote takes): the pid is
/// known before anything is sent, and no start waits for the zygote to be
/// scheduled or for a fork. Under a burst the zygote, competing for the
/// CPU with the agents already started, was most of the time a start
/// waited for its pid. The same idea as Android's pool of unspecialized
/// app processes (USAP) beside its zygote.
///
/// A spare that takes a request writes its pid on a pipe the zygote reads
/// (so it knows how many are left idle), then becomes the supervisor; its
/// exit is reported as any supervisor's, under `SPARE_ID | pid`. The pool
/// grows by one for each request that reached the zygote (the runner had
/// no spare left), up to [`MAX_SPARES`], so the next burst of the same size
/// finds one for each start; it shrinks by one for each spare that dies
/// idle (the runner closes spares it has held unused for a minute), down
/// to [`MIN_SPARES`]. Refills pause after a spare dies unused or cannot be
/// made (backoff 100 ms doubling to 10 s, reset when a spare is taken). A spare dies with the zygote (parent-death SIGKILL)
/// and at EOF on its socket (the runner closed it, or died); it holds no
/// descriptor but its socket, the pipe and stdio (stdin is `/dev/null`).
#[derive(Debug)]
struct Spares {
    /// Announced to the runner and not taken yet.
    idle: std::collections::HashSet<libc::pid_t>,
    /// How many idle spares the pool keeps.
    wanted: usize,
    /// The last request's arrival, or the last spare's take.
    request_at: std::time::Instant,
    /// The pipe spares write their pid on when taken.
    taken: [OwnedFd; 2],
    /// No refill before this (see [`Spares::back_off`]).
    refill_at: std::time::Instant,
    /// The current pause between refills after a failure (zero: none).
    backoff: std::time::Duration,
}

impl Spares {
    /// An empty pool; `None` (the zygote forks every supervisor) when
    /// [`ZYGOTE_SPARES_ENV`] is `0` or the pipe cannot be made.
    fn new() -> Option<Self> {
        if std::env::var_os(ZYGOTE_SPARES_ENV).is_some_and(|v| v == "0") {
            return None;
        }
        let mut fds = [0; 2];
        // SAFETY: pipe2 writes two descriptors into `fds`.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) } == -1 {
            return None;
        }
        // SAFETY: pipe2 returned two descriptors we now own.
        let taken = unsafe { [OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])] };
        let now = std::time::Instant::now();
        Some(Self {
            idle: std::collections::HashSet::new(),
            wanted: MIN_SPARES,
            request_at: now.checked_sub(SPARES_QUIET).unwrap_or(now),
            taken,
            refill_at: now,
            backoff: std::time::Duration::ZERO,
        })
    }

    /// `poll`'s timeout in milliseconds: while the pool is short, until
    /// [`SPARES_QUIET`] after the last request; else none (-1).
    fn poll_timeout(&self) -> libc::c_int {
        if self.idle.len() >= self.wanted {
            return -1;
        }
        let now = std::time::Instant::now();
        let quiet = if self.low() { now } else { self.request_at + SPARES_QUIET };
        let left = quiet.max(self.refill_at).saturating_duration_since(now);
        // Rounded up: a timeout cut to whole milliseconds would spin.
        libc::c_int::try_from(left.as_micros().div_ceil(1000)).unwrap_or(libc::c_int::MAX)
    }

    /// Something went wrong with a spare (it died unused, or could not be
    /// made): no refill for a while, doubling from [`REFILL_BACKOFF_MIN`]
    /// to [`REFILL_BACKOFF_MAX`] while it goes on. A spare that cannot
    /// live (the runner out of descriptors, say) must not turn the zygote
    /// into a fork loop.
    fn back_off(&mut self) {
        self.backoff = (self.backoff * 2).clamp(REFILL_BACKOFF_MIN, REFILL_BACKOFF_MAX);
        self.refill_at = std::time::Instant::now() + self.backoff;
    }

    /// Fewer than a quarter of the wanted spares are idle: refills go on
    /// without waiting for a quiet moment. Starts that never pause for
    /// [`SPARES_QUIET`] (a steady stream, not a burst) would otherwise never
    /// see the pool refilled and all go to the zygote.
    fn low(&self) -> bool {
        self.idle.len() < self.wanted / 4
    }

    /// Where taken spares write their pid.
    fn taken_fd(&self) -> RawFd {
        self.taken[0].as_raw_fd()
    }

    /// Reads the pids of the spares taken since the last call.
    fn read_taken(&mut self) {
        let mut pid = [0u8; 4];
        // SAFETY: reading 4 bytes into a buffer we own (non-blocking; the
        // writes are 4 bytes, atomic on a pipe).
        while unsafe { libc::read(self.taken_fd(), pid.as_mut_ptr().cast(), 4) } == 4 {
            self.idle.remove(&i32::from_le_bytes(pid));
            // Spares serve: refills go at full speed again.
            self.backoff = std::time::Duration::ZERO;
            // A start, though it never reached the zygote: refills wait
            // for the burst's quiet moment as after a request.
            self.request_at = std::time::Instant::now();
        }
    }

    /// Nothing else to do: fork one more spare if the pool is short and
    /// the last request is [`SPARES_QUIET`] old, and hand its socket to the
    /// runner.
    fn refill(&mut self, zygote: libc::pid_t, running: &mut HashMap<libc::pid_t, u64>, buf: &mut [u8]) {
        if self.idle.len() >= self.wanted
            || (self.request_at.elapsed() < SPARES_QUIET && !self.low())
            || std::time::Instant::now() < self.refill_at
        {
            return;
        }
        let Ok((mine, theirs)) = seqpacket_pair() else {
            self.back_off();
            return;
        };
        // The runner sends its requests on this end.
        let _ = size_for_requests(mine.as_raw_fd());
        // SAFETY: fork in a single-threaded process.
        unsafe {
            match libc::fork() {
                // Out of processes: no more spares for now; requests fork.
                -1 => self.back_off(),
                0 => {
                    drop(mine);
                    wait_as_spare(zygote, theirs, self.taken[1].as_raw_fd(), buf)
                }
                pid => {
                    // Also here (the child does it too): the group exists
                    // as soon as the pid can reach the runner.
                    libc::setpgid(pid, pid);
                    drop(theirs);
                    running.insert(pid, SPARE_ID | pid.unsigned_abs() as u64);
                    self.idle.insert(pid);
                    if let Err(err) =
                        send_with_fds(0, &Status::Spare(pid).encode(SPARE_ID | pid.unsigned_abs() as u64), &[mine.as_raw_fd()], true)
                    {
                        if !matches!(err.raw_os_error(), Some(libc::EPIPE | libc::ECONNRESET | libc::ENOTCONN)) {
                            eprintln!("punchclock agent zygote: cannot answer the runner: {err}");
                        }
                        std::process::exit(0);
                    }
                }
            }
        }
    }

    /// A request reached the zygote: the runner had no spare left.
    fn missed(&mut self) {
        self.request_at = std::time::Instant::now();
        self.wanted = (self.wanted + 1).min(MAX_SPARES);
        // Demand: refill (at most one fork per request while spares keep
        // dying, never a loop).
        self.backoff = std::time::Duration::ZERO;
        self.refill_at = self.request_at;
    }

    /// A child exited: if it was an idle spare (the runner dropped it, or
    /// it was killed), the pool wants one fewer.
    fn exited(&mut self, pid: libc::pid_t) {
        // A spare that was taken wrote its pid before it could exit: read
        // it first. `reap` collects children that exited after this loop
        // turn's pipe read, and /bin/true-quick agents made most of those
        // look like idle deaths (413 in one 20 s bench row): the pool
        // shrank, refills backed off for seconds, and whole bursts fell
        // back to the zygote.
        self.read_taken();
        if self.idle.remove(&pid) {
            self.wanted = self.wanted.saturating_sub(1).max(MIN_SPARES);
            self.back_off();
        }
    }
}

/// A spare's life: keeps only its socket (as [`SPARE_SOCKET_FD`]), the
/// taken pipe (as [`SPARE_TAKEN_FD`]) and stdio (stdin replaced by
/// `/dev/null`: the zygote's is the runner's socket), dies with the
/// zygote, and waits for a request; then says so on the pipe and becomes
/// its supervisor. Exits at EOF (the runner closed the socket, or died).
fn wait_as_spare(zygote: libc::pid_t, socket: OwnedFd, taken: RawFd, buf: &mut [u8]) -> ! {
    let fd = socket.as_raw_fd();
    std::mem::forget(socket);
    // SAFETY: prctl/setpgid/open/dup3/close_range on this process and
    // descriptors it owns; nothing uses a closed descriptor afterwards
    // (the signalfd and the zygote's ends are not ours to use). `fd` and
    // `taken` are above 2 (0-2 were open when they were made).
    unsafe {
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
        if libc::getppid() != zygote {
            libc::_exit(0);
        }
        libc::setpgid(0, 0);
        libc::prctl(libc::PR_SET_NAME, c"punchclock-spare".as_ptr());
        let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC);
        if null == -1 || libc::dup2(null, 0) == -1 {
            libc::_exit(0);
        }
        // Move both out of the way first (either may sit on 3 or 4).
        let (fd, taken) = (libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 16), libc::fcntl(taken, libc::F_DUPFD_CLOEXEC, 16));
        if fd == -1
            || taken == -1
            || libc::dup3(fd, SPARE_SOCKET_FD, libc::O_CLOEXEC) == -1
            || libc::dup3(taken, SPARE_TAKEN_FD, libc::O_CLOEXEC) == -1
        {
            libc::_exit(0);
        }
        libc::syscall(libc::SYS_close_range, (SPARE_TAKEN_FD + 1) as u32, u32::MAX, 0u32);
    }
    match recv_with_fds(SPARE_SOCKET_FD, buf) {
        Ok((len, fds, false)) if len > 0 => {
            let me = std::process::id() as i32;
            // SAFETY: a 4-byte write (atomic on a pipe) from a buffer we own.
            unsafe { libc::write(SPARE_TAKEN_FD, me.to_le_bytes().as_ptr().cast(), 4) };
            match (Request::decode(&buf[..len]), <[OwnedFd; REQUEST_FDS]>::try_from(fds)) {
                (Some(request), Ok([stdin, stdout, stderr, control])) => {
                    // The descriptors stay open for the supervisor's life
                    // (it moves them to 0-3; 3 was our socket).
                    let (stdio, control_fd) = ([stdin.as_raw_fd(), stdout.as_raw_fd(), stderr.as_raw_fd()], control.as_raw_fd());
                    std::mem::forget((stdin, stdout, stderr, control));
                    become_supervisor(zygote, request, stdio, control_fd)
                }
                // The runner's requests are never malformed; the control
                // socket closes with us (no agent was started).
                _ => std::process::exit(crate::EXIT_NOT_STARTED),
            }
        }
        _ => std::process::exit(0),
    }
}

/// Signals the zygote ignores (its supervisors restore them).
const ZYGOTE_IGNORES: [libc::c_int; 3] = [libc::SIGTERM, libc::SIGINT, libc::SIGHUP];

/// Waits for the runner's go on the control socket: true for a byte, false
/// at EOF or on error (the runner gave up on this start, or died).
pub(crate) fn await_go(control: RawFd) -> bool {
    let mut byte = 0u8;
    loop {
        // SAFETY: reading one byte into a variable we own.
        match unsafe { libc::read(control, (&raw mut byte).cast(), 1) } {
            1 => return true,
            -1 if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted => continue,
            _ => return false,
        }
    }
}

/// Writes the agent's exit code on the control socket (best effort: a
/// runner that is gone needs none).
pub(crate) fn report_exit(control: RawFd, code: i32) {
    let _ = send_with_fds(control, &code.to_le_bytes(), &[], true);
}

/// Reaps every exited supervisor (and spare) and reports it.
fn reap(running: &mut HashMap<libc::pid_t, u64>, mut spares: Option<&mut Spares>) {
    loop {
        let mut status: libc::c_int = 0;
        // SAFETY: waitpid writes into a c_int we own.
        let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
        if pid <= 0 {
            return;
        }
        if let Some(spares) = spares.as_deref_mut() {
            spares.exited(pid);
        }
        if let Some(id) = running.remove(&pid) {
            report(id, Status::Exited(status));
        }
    }
}

/// Serves one request: forks the supervisor, reports its pid.
fn start(zygote: libc::pid_t, bytes: &[u8], fds: Vec<OwnedFd>, truncated: bool, running: &mut HashMap<libc::pid_t, u64>) {
    let request = if truncated { None } else { Request::decode(bytes) };
    let (Some(request), Ok::<[OwnedFd; REQUEST_FDS], _>([stdin, stdout, stderr, control])) = (request, fds.try_into()) else {
        // The runner's requests are never malformed; if one is, its id may
        // be too. The descriptors close.
        report(0, Status::Failed(libc::EINVAL));
        return;
    };
    let id = request.id;
    // SAFETY: the zygote is single-threaded, so the child may do anything
    // the parent could (allocate, set the environment).
    match unsafe { libc::fork() } {
        -1 => report(id, Status::Failed(io::Error::last_os_error().raw_os_error().unwrap_or(libc::EAGAIN))),
        0 => become_supervisor(zygote, request, [stdin.as_raw_fd(), stdout.as_raw_fd(), stderr.as_raw_fd()], control.as_raw_fd()),
        pid => {
            // Also here (the child does it too): the group must exist when
            // the runner reads the pid, which it may signal at once.
            // SAFETY: setpgid has no memory-safety preconditions.
            unsafe { libc::setpgid(pid, pid) };
            // Our copies close before the runner hears of the supervisor:
            // held by a zygote stopped right after its answer, they would
            // keep the supervisor's control socket and pipes open after it
            // died (no EOF for the runner).
            drop((stdin, stdout, stderr, control));
            running.insert(pid, id);
            report(id, Status::Started(pid));
        }
    }
}

/// In the forked child: takes the execution's descriptors as 0, 1, 2, then
/// supervises the agent ([`supervise`] closes every other descriptor: the
/// zygote's socket, other executions' status sockets). Never returns.
fn become_supervisor(zygote: libc::pid_t, request: Request, stdio: [RawFd; 3], control: RawFd) -> ! {
    const CONTROL_FD: RawFd = 3;
    // SAFETY: prctl/signal/setpgid/dup2/fcntl on this process and the
    // descriptors it owns. Received descriptors are all above 3 (0-2 and
    // the signalfd were open when they arrived), so none is overwritten
    // before it is copied.
    unsafe {
        libc::setpgid(0, 0);
        // `ps` tells supervisors from the zygote (the command line is the same).
        libc::prctl(libc::PR_SET_NAME, c"punchclock-sup".as_ptr());
        // The zygote ignores these (it ends with its socket); the agent must not.
        for signal in ZYGOTE_IGNORES {
            libc::signal(signal, libc::SIG_DFL);
        }
        for (target, fd) in stdio.into_iter().enumerate() {
            if libc::dup2(fd, target as RawFd) == -1 {
                libc::_exit(crate::EXIT_CANNOT_EXECUTE);
            }
        }
        if control != CONTROL_FD && libc::dup3(control, CONTROL_FD, libc::O_CLOEXEC) == -1 {
            libc::_exit(crate::EXIT_CANNOT_EXECUTE);
        }
        libc::fcntl(CONTROL_FD, libc::F_SETFD, libc::FD_CLOEXEC);
    }
    let Request { cwd, fence_file, kill_grace_ms, nice, argv, env, .. } = request;
    if let Some(cwd) = &cwd
        && let Err(err) = std::env::set_current_dir(cwd)
    {
        crate::fail(crate::EXIT_CANNOT_EXECUTE, format_args!("cannot enter working directory {}: {err}", cwd.to_string_lossy()));
    }
    // The agent's environment becomes the supervisor's: `posix_spawnp`
    // looks the program up in the caller's PATH.
    for (key, _) in std::env::vars_os() {
        // SAFETY: single-threaded process.
        unsafe { std::env::remove_var(key) };
    }
    for entry in env {
        let bytes = entry.into_vec();
        if let Some(eq) = bytes.iter().position(|&b| b == b'=').filter(|&eq| eq > 0) {
            let (key, value) = (OsString::from_vec(bytes[..eq].to_vec()), OsString::from_vec(bytes[eq + 1..].to_vec()));
            // SAFETY: single-threaded process.
            unsafe { std::env::set_var(key, value) };
        }
    }
    let mut argv = argv.into_iter();
    let program = argv.next().unwrap_or_default();
    supervise(
        program,
        argv.collect(),
        Supervision {
            expected_parent: Some(zygote),
            fence_file: fence_file.map(Into::into),
            kill_grace_ms,
            nice,
            control: Some(CONTROL_FD),
        },
    )
}

/// Creates a `SOCK_SEQPACKET` Unix socket pair, close-on-exec.
pub fn seqpacket_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: socketpair writes two descriptors into the array.
    if unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0, fds.as_mut_ptr()) } == -1 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both descriptors are new and owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Reads one status message (request id and [`Status`]) from the zygote's
/// socket without blocking: `Ok(None)` at EOF; `WouldBlock` when nothing is
/// there yet.
pub fn read_status(socket: RawFd) -> io::Result<Option<(u64, Status)>> {
    let mut buf = [0u8; STATUS_BYTES];
    loop {
        // SAFETY: reading into a buffer we own.
        let n = unsafe { libc::recv(socket, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
        match n {
            0 => return Ok(None),
            n if n > 0 => {
                return Status::decode(&buf[..n as usize])
                    .map(Some)
                    .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "malformed zygote status"));
            }
            _ => {
                let err = io::Error::last_os_error();
                if err.kind() != io::ErrorKind::Interrupted {
                    return Err(err);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A taken spare's exit, reaped before its pid was read from the pipe,
    /// is not an idle death: the pool keeps its size and refills at once.
    #[test]
    fn a_taken_spare_that_exits_before_its_pid_is_read_is_not_an_idle_death() {
        let mut spares = Spares::new().expect("spares");
        spares.wanted = 20;
        spares.idle.insert(4242);
        // SAFETY: a 4-byte write to the pipe's write end, which we own.
        unsafe { libc::write(spares.taken[1].as_raw_fd(), 4242i32.to_le_bytes().as_ptr().cast(), 4) };
        spares.exited(4242);
        assert_eq!(spares.wanted, 20);
        assert_eq!(spares.backoff, std::time::Duration::ZERO);
        assert!(spares.refill_at <= std::time::Instant::now());
        // An idle spare's death does shrink the pool and pause refills.
        spares.idle.insert(4343);
        spares.exited(4343);
        assert_eq!(spares.wanted, 19);
        assert!(spares.backoff > std::time::Duration::ZERO);
    }

    /// A spare taken by the runner is a start the zygote never sees as a
    /// request: refills still wait for the quiet after it, never fork
    /// between the starts of a burst (they took the CPU from the runner's
    /// starts: every take was followed by a fork of a replacement).
    #[test]
    fn a_taken_spare_holds_refills_back_as_a_request_does() {
        let mut spares = Spares::new().expect("spares");
        spares.wanted = 9;
        spares.idle.extend(4240..4248);
        assert_eq!(spares.poll_timeout(), 0, "short and quiet: refill now");
        let take = |spares: &mut Spares, pid: i32| {
            // SAFETY: a 4-byte write to the pipe's write end, which we own.
            unsafe { libc::write(spares.taken[1].as_raw_fd(), pid.to_le_bytes().as_ptr().cast(), 4) };
            spares.read_taken();
        };
        take(&mut spares, 4240);
        let quiet_ms = libc::c_int::try_from(SPARES_QUIET.as_millis()).expect("ms");
        assert!(spares.poll_timeout() > quiet_ms / 2, "refill held back after a take: {} ms", spares.poll_timeout());
        // A stream that never pauses: below a quarter of the pool, refills
        // go on anyway.
        for pid in 4241..4246 {
            take(&mut spares, pid);
        }
        assert_eq!(spares.idle.len(), 2);
        assert!(spares.poll_timeout() > 0, "2 of 9 idle: still held back");
        take(&mut spares, 4246);
        assert_eq!(spares.poll_timeout(), 0, "1 of 9 idle: refill at once");
    }

    #[test]
    fn requests_round_trip() {
        let request = Request {
            id: 7,
            cwd: Some("/tmp".into()),
            fence_file: None,
            kill_grace_ms: 300,
            nice: 19,
            argv: vec!["sh".into(), "-c".into(), "".into()],
            env: vec!["A=1".into(), "PATH=/bin".into()],
        };
        assert_eq!(Request::decode(&request.encode()), Some(request));
        assert_eq!(Request::decode(&[1, 0, 0]), None);
        assert_eq!(Request::decode(&Request::default().encode()), None, "an empty argv is refused");
    }

    #[test]
    fn statuses_round_trip() {
        for status in [Status::Started(42), Status::Exited(9), Status::Failed(libc::EAGAIN), Status::Spare(7)] {
            assert_eq!(Status::decode(&status.encode(u64::MAX - 1)), Some((u64::MAX - 1, status)));
        }
        assert_eq!(Status::decode(b"12345678Q1234"), None);
        assert_eq!(Status::decode(b"P1234"), None);
    }
}
