//! The agent shim: a minimal supervisor between the runner and an agent, so
//! that nothing of the agent survives the runner being killed (even with
//! SIGKILL).
//!
//! The runner spawns `punchclock-agent-shim -- <command...>` (or, when that
//! binary is not installed beside `punchclock`, `punchclock __agent-shim --
//! <command...>`) in a new process group (the shim is its leader). The shim:
//!
//! 1. blocks SIGCHLD, SIGTERM and SIGUSR2 and handles them synchronously
//!    with `sigwait` (no async signal handlers; the agent is spawned with
//!    an empty signal mask and SIGPIPE at its default — `posix_spawn`'s
//!    `POSIX_SPAWN_SETSIGMASK`/`SETSIGDEF` — so it sees default signal
//!    handling);
//! 2. arms `prctl(PR_SET_PDEATHSIG, SIGUSR2)`, then compares `getppid()`
//!    with the runner pid passed in `PUNCHCLOCK_SHIM_PARENT_PID`: if the
//!    runner already died, it kills the group and exits;
//! 3. spawns the agent (inheriting stdin, stdout, stderr, cwd and the
//!    environment minus `PUNCHCLOCK_SHIM_PARENT_PID`), which stays in the
//!    shim's process group;
//! 4. loops: SIGCHLD → if the agent exited, kill what it left behind and
//!    exit with its exit code (128+N if it was killed by signal N); SIGUSR2
//!    (the runner died, or stops the execution for good) → kill every
//!    descendant, then `kill(0, SIGKILL)`, taking the whole group down. The
//!    shim is a child subreaper (`PR_SET_CHILD_SUBREAPER`), so descendants
//!    that left the group with `setsid` are reparented to it and swept too;
//!    SIGTERM → ignored
//!    (the runner signals the whole group, so the agent got it too, and the
//!    runner escalates to SIGKILL after its grace period).
//!
//! 5. **fence**: every 200 ms (a `sigtimedwait` timeout) it reads the
//!    runner's fence deadline from the file named by
//!    `PUNCHCLOCK_SHIM_FENCE_FILE` ([`fence_file`]); once the deadline
//!    less the kill grace (`PUNCHCLOCK_SHIM_KILL_GRACE_MS`) has passed it
//!    sends SIGTERM to the group, and at the deadline it kills every
//!    descendant and the group. This runs even while the runner process is
//!    stopped, so no agent outlives its runner's fence.
//!
//! Steps 1–5 are the same when the supervisor is not exec'd but forked by
//! the shim's fork server ([`zygote`], `punchclock-agent-shim --zygote`,
//! what the runner uses by default): then the parent whose death it
//! watches is the zygote, which exits when the runner's socket closes. In
//! both cases the supervisor closes every inherited descriptor but 0, 1 and
//! 2 before it starts the agent.
//!
//! It is its own crate, with no dependency but libc, because it is exec'd
//! once per execution: the `punchclock-agent-shim` binary starts in a
//! fraction of the time of the whole `punchclock` binary (which still
//! exposes the same code as its hidden `__agent-shim` subcommand). The agent
//! is started with `posix_spawn` (a `vfork`, no page-table copy).

pub mod zygote;

use std::ffi::OsString;
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::RawFd;
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;

pub use zygote::ZYGOTE_FLAG;

/// The subcommand of the `punchclock` binary that runs the shim (the
/// fallback when `punchclock-agent-shim` is not installed beside it).
pub const SHIM_SUBCOMMAND: &str = "__agent-shim";
/// File name of the dedicated shim binary, looked up beside `punchclock`.
pub const SHIM_BINARY: &str = "punchclock-agent-shim";
/// The version of what the runner and the shim say to each other (the
/// zygote's [`zygote::Request`] fields and statuses, the `SHIM_*`
/// variables); bumped whenever either changes. 2: the request's `nice`.
pub const SHIM_PROTOCOL: u32 = 2;
/// `shim --protocol` prints [`SHIM_PROTOCOL`] and exits: a runner asks a
/// dedicated shim binary found beside it before using it, since one left
/// from another build would misread its requests.
pub const PROTOCOL_FLAG: &str = "--protocol";

/// Environment variable through which the runner passes its pid to the shim.
pub const SHIM_PARENT_PID_ENV: &str = "PUNCHCLOCK_SHIM_PARENT_PID";
/// Environment variable naming the runner's fence deadline file.
pub const SHIM_FENCE_FILE_ENV: &str = "PUNCHCLOCK_SHIM_FENCE_FILE";
/// Environment variable with the kill grace in milliseconds.
pub const SHIM_KILL_GRACE_ENV: &str = "PUNCHCLOCK_SHIM_KILL_GRACE_MS";
/// Environment variable: how much lower the agent's CPU priority is than
/// the runner's (0-19, added to the shim's nice value before the agent
/// starts; unset: 0). Removed from the agent's environment.
pub const SHIM_NICE_ENV: &str = "PUNCHCLOCK_SHIM_NICE";
/// How often the shim checks the fence deadline.
const FENCE_POLL: std::time::Duration = std::time::Duration::from_millis(200);

/// Exit code when the shim is given no command (usage error).
const EXIT_USAGE: i32 = 2;
/// Exit code when the agent program cannot be executed (as in POSIX shells).
const EXIT_CANNOT_EXECUTE: i32 = 126;
/// Exit code when the agent program does not exist (as in POSIX shells).
const EXIT_NOT_FOUND: i32 = 127;
/// Exit code of a supervisor whose runner gave up on the start (no go):
/// the agent was not started.
const EXIT_NOT_STARTED: i32 = 125;

/// Runs the shim and exits with the agent's exit code (128+N if the agent
/// was killed by signal N; 126/127 if it could not be started; 2 if `argv`
/// is empty).
///
/// `argv` is what follows the `__agent-shim` subcommand: the agent's program
/// and arguments, optionally preceded by `--` (which is skipped).
///
/// Must be called early in `main`, **before any other thread is started**
/// (no tokio runtime, no logging threads): the signal mask it sets only
/// covers the calling thread, and a thread that does not block SIGUSR2 would
/// let it kill the shim without taking the agent down. Never returns.
pub fn shim_main(argv: Vec<OsString>) -> ! {
    let mut argv = argv.into_iter().peekable();
    if argv.peek().is_some_and(|arg| arg == ZYGOTE_FLAG) {
        zygote::zygote_main();
    }
    if argv.peek().is_some_and(|arg| arg == PROTOCOL_FLAG) {
        println!("{SHIM_PROTOCOL}");
        std::process::exit(0);
    }
    if argv.peek().is_some_and(|arg| arg == "--") {
        argv.next();
    }
    let Some(program) = argv.next().filter(|p| p != "--help" && p != "-h") else {
        fail(
            EXIT_USAGE,
            format_args!(
                "usage: {SHIM_BINARY} -- <command> [args...]  (or punchclock {SHIM_SUBCOMMAND} -- ...)\n\
                 the per-execution supervisor the punchclock runner starts agents behind; not for use by hand"
            ),
        );
    };

    let expected_parent = std::env::var(SHIM_PARENT_PID_ENV).ok().and_then(|pid| pid.parse::<libc::pid_t>().ok());
    let fence_file = std::env::var_os(SHIM_FENCE_FILE_ENV).map(std::path::PathBuf::from);
    let kill_grace_ms = std::env::var(SHIM_KILL_GRACE_ENV).ok().and_then(|v| v.parse::<u64>().ok()).unwrap_or(5000);
    let nice = std::env::var(SHIM_NICE_ENV).ok().and_then(|v| v.parse::<u8>().ok()).unwrap_or(0);
    supervise(program, argv.collect(), Supervision { expected_parent, fence_file, kill_grace_ms, nice, control: None })
}

/// What the supervisor is told besides the agent's command.
struct Supervision {
    /// The pid the supervisor's parent must have once the parent-death
    /// signal is armed (else the parent already died: kill and exit).
    expected_parent: Option<libc::pid_t>,
    /// The runner's fence deadline file ([`fence_file`]).
    fence_file: Option<std::path::PathBuf>,
    /// Time between the fence's SIGTERM and its kill, in milliseconds.
    kill_grace_ms: u64,
    /// Added to the supervisor's nice value once the agent is to start
    /// (the agent inherits it; the supervisor then competes as its agent).
    nice: u8,
    /// Behind the zygote: the execution's control socket (at fd 3,
    /// close-on-exec). The agent is started only once the runner sends one
    /// byte on it ("go": it has taken the supervisor's pid; EOF instead —
    /// the runner gave up on this start — means exit without starting it),
    /// and the agent's exit code is written on it (an i32, little-endian)
    /// before the supervisor exits, so the runner learns it even if the
    /// zygote dies.
    control: Option<RawFd>,
}

/// Supervises `program args` to its end (the shim proper, steps 1–5 of the
/// crate docs), as a process-group leader whose stdin, stdout, stderr, cwd
/// and environment the agent inherits. Never returns.
fn supervise(program: OsString, args: Vec<OsString>, supervision: Supervision) -> ! {
    close_inherited_fds(supervision.control.map_or(3, |fd| fd + 1));
    if let Some(control) = supervision.control {
        CONTROL.store(control, std::sync::atomic::Ordering::Relaxed);
    }
    let signals = SignalSet::new(&[libc::SIGCHLD, libc::SIGTERM, libc::SIGUSR2])
        .and_then(|set| set.block().map(|()| set))
        .unwrap_or_else(|err| fail(1, format_args!("cannot block signals: {err}")));

    // Orphaned descendants of the agent (double forks, `setsid` daemons)
    // are reparented to the shim instead of init, so it can sweep them.
    // SAFETY: prctl(PR_SET_CHILD_SUBREAPER) has no memory-safety preconditions.
    if unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1) } == -1 {
        let err = io::Error::last_os_error();
        fail(1, format_args!("cannot become a child subreaper: {err}"));
    }
    // SAFETY: prctl(PR_SET_PDEATHSIG) has no memory-safety preconditions.
    if unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGUSR2) } == -1 {
        let err = io::Error::last_os_error();
        fail(1, format_args!("cannot set the parent-death signal: {err}"));
    }
    // The parent may have died before the parent-death signal was armed.
    // SAFETY: getppid() has no preconditions.
    if supervision.expected_parent.is_some_and(|parent| parent != unsafe { libc::getppid() }) {
        kill_group();
    }

    let Supervision { fence_file, kill_grace_ms, nice, control, .. } = &supervision;
    let (fence_file, kill_grace_ms, nice, control) = (fence_file.clone(), *kill_grace_ms, *nice, *control);
    // Behind the zygote: wait for the runner's go (EOF: it gave up on this
    // start, so the agent must not run).
    if let Some(control) = control {
        // SAFETY: getppid() has no preconditions.
        let parent_alive = || supervision.expected_parent.is_none_or(|parent| parent == unsafe { libc::getppid() });
        if !zygote::await_go(control) || !parent_alive() {
            report_exit(EXIT_NOT_STARTED);
            std::process::exit(EXIT_NOT_STARTED);
        }
    }
    let kill_grace_ns = kill_grace_ms.saturating_mul(1_000_000);
    drop_controlling_terminal();
    lower_priority(nice);
    let agent = spawn_agent(&program, args.into_iter()).unwrap_or_else(|err| {
        let code = match err.kind() {
            io::ErrorKind::NotFound => EXIT_NOT_FOUND,
            _ => EXIT_CANNOT_EXECUTE,
        };
        fail(code, format_args!("cannot start {}: {err}", program.to_string_lossy()))
    });

    let mut fence = ShimFence::default();
    loop {
        match try_wait(agent) {
            Ok(Some(status)) => {
                // Whatever the agent left behind (even in a new session)
                // was reparented to us, the subreaper: it goes too.
                sweep_descendants();
                let code = exit_code(status);
                report_exit(code);
                std::process::exit(code)
            }
            Ok(None) => {}
            Err(err) => {
                eprintln!("punchclock agent shim: cannot wait for the agent: {err}");
                kill_group();
            }
        }
        match signals.wait_for(FENCE_POLL) {
            // The runner died (parent-death signal) or is stopping us for
            // good: kill every descendant, wherever it moved, then go.
            Ok(Some(libc::SIGUSR2)) => {
                sweep_descendants();
                kill_group()
            }
            // SIGCHLD: re-check the agent. SIGTERM: the agent got it too.
            Ok(Some(_)) => {}
            // Timeout: check the runner's fence.
            Ok(None) => {
                if let Some(path) = &fence_file {
                    fence.check(path, kill_grace_ns);
                }
            }
            Err(err) => {
                eprintln!("punchclock agent shim: sigwait failed: {err}");
                kill_group();
            }
        }
    }
}

/// Gives up the controlling terminal the runner has (run from a shell),
/// so the agent has none: `/dev/tty` fails with ENXIO instead of reaching
/// the operator's terminal, and a read from it cannot stop the agent's
/// whole group (SIGTTIN) until its timeout. Supervisors share the runner's
/// session (see the zygote's docs), so this is `TIOCNOTTY`, which a
/// process that does not lead its session may use for itself, not
/// `setsid`. Nothing to do (ENXIO) without a terminal.
fn drop_controlling_terminal() {
    // SAFETY: open/ioctl/close on a descriptor this function owns.
    unsafe {
        let tty = libc::open(c"/dev/tty".as_ptr(), libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC);
        if tty >= 0 {
            libc::ioctl(tty, libc::TIOCNOTTY);
            libc::close(tty);
        }
    }
}

/// The shim's side of the runner fence.
#[derive(Debug, Default)]
struct ShimFence {
    /// SIGTERM was sent to the group.
    terminated: bool,
}

impl ShimFence {
    /// TERM once the deadline less the grace has passed; kill everything
    /// at the deadline. A missing or unreadable file means no fence.
    fn check(&mut self, path: &std::path::Path, kill_grace_ns: u64) {
        let Some(deadline) = fence_file::read_deadline(path) else { return };
        let now = fence_file::boottime_ns();
        // No message on stderr here: it is the runner's pipe, and while the
        // runner is stopped (what the fence is for) a full pipe would block
        // the shim before it kills anything. The runner reports the reason.
        if now >= deadline {
            sweep_descendants();
            kill_group();
        }
        if !self.terminated && now >= deadline.saturating_sub(kill_grace_ns) {
            self.terminated = true;
            // SAFETY: kill(2) has no memory-safety preconditions; pid 0 is
            // our group (the shim blocks SIGTERM and is not affected).
            unsafe { libc::kill(0, libc::SIGTERM) };
        }
    }
}

/// Adds `by` to this process's nice value (capped at 19 by the kernel),
/// before the agent starts, which inherits it: the runner's own work
/// (starting agents, heartbeats, the fence) comes before agents' when the
/// CPU is short. Best effort: raising one's nice value needs no privilege.
fn lower_priority(by: u8) {
    if by > 0 {
        // SAFETY: nice(2) has no memory-safety preconditions.
        unsafe { libc::nice(libc::c_int::from(by)) };
    }
}

/// Starts the agent with `posix_spawnp` (a `vfork`: no page tables are
/// copied): `program` looked up in `PATH`, the shim's environment minus its
/// own variables, every signal unblocked and SIGPIPE back to its default
/// (an ignored signal survives exec). Not `std::process::Command`: with a
/// `pre_exec` hook it forks (copying page tables), and without one the agent
/// was seen to inherit the shim's blocked mask. A program with a `/` that
/// the kernel cannot exec as is (`ENOEXEC`: a script without `#!`) runs with
/// `/bin/sh`, as `execvp` does.
fn spawn_agent(program: &OsString, args: impl Iterator<Item = OsString>) -> io::Result<libc::pid_t> {
    use std::ffi::CString;
    use std::os::unix::ffi::{OsStrExt, OsStringExt};

    let cstring = |s: &[u8]| CString::new(s).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "argument contains a NUL byte"));
    let mut argv = vec![cstring(program.as_bytes())?];
    for arg in args {
        argv.push(cstring(arg.as_bytes())?);
    }
    let own = [SHIM_PARENT_PID_ENV, SHIM_FENCE_FILE_ENV, SHIM_KILL_GRACE_ENV, SHIM_NICE_ENV];
    let env: Vec<CString> = std::env::vars_os()
        .filter(|(key, _)| !own.iter().any(|own| key.as_bytes() == own.as_bytes()))
        .filter_map(|(key, value)| {
            let mut pair = key.into_vec();
            pair.push(b'=');
            pair.extend_from_slice(value.as_bytes());
            CString::new(pair).ok()
        })
        .collect();
    match posix_spawnp(&argv[0], &argv, &env) {
        Err(err) if err.raw_os_error() == Some(libc::ENOEXEC) && program.as_bytes().contains(&b'/') => {
            let sh = cstring(b"/bin/sh")?;
            let argv: Vec<CString> = std::iter::once(sh.clone()).chain(argv).collect();
            posix_spawnp(&sh, &argv, &env)
        }
        result => result,
    }
}

/// `posix_spawnp(file, argv, env)` with an empty signal mask and SIGPIPE at
/// its default; the child's pid.
fn posix_spawnp(file: &std::ffi::CStr, argv: &[std::ffi::CString], env: &[std::ffi::CString]) -> io::Result<libc::pid_t> {
    let mut argv: Vec<*mut libc::c_char> = argv.iter().map(|a| a.as_ptr().cast_mut()).collect();
    argv.push(std::ptr::null_mut());
    let mut envp: Vec<*mut libc::c_char> = env.iter().map(|e| e.as_ptr().cast_mut()).collect();
    envp.push(std::ptr::null_mut());

    let check = |r: libc::c_int| if r == 0 { Ok(()) } else { Err(io::Error::from_raw_os_error(r)) };
    let mut attr = MaybeUninit::<libc::posix_spawnattr_t>::uninit();
    // SAFETY: posix_spawnattr_init initializes the attribute object in place.
    check(unsafe { libc::posix_spawnattr_init(attr.as_mut_ptr()) })?;
    let attr = attr.as_mut_ptr();
    let result = (|| {
        let empty = SignalSet::new(&[])?;
        let default = SignalSet::new(&[libc::SIGPIPE])?;
        // SAFETY: `attr` is initialized; the sets are valid sigset_t.
        unsafe {
            check(libc::posix_spawnattr_setsigmask(attr, &empty.0))?;
            check(libc::posix_spawnattr_setsigdefault(attr, &default.0))?;
            check(libc::posix_spawnattr_setflags(attr, (libc::POSIX_SPAWN_SETSIGMASK | libc::POSIX_SPAWN_SETSIGDEF) as libc::c_short))?;
        }
        let mut pid: libc::pid_t = 0;
        // SAFETY: argv and envp are NULL-terminated arrays of pointers into
        // CStrings that outlive the call; `attr` is initialized.
        check(unsafe { libc::posix_spawnp(&mut pid, file.as_ptr(), std::ptr::null(), attr, argv.as_ptr(), envp.as_ptr()) })?;
        Ok(pid)
    })();
    // SAFETY: `attr` was initialized by posix_spawnattr_init.
    unsafe { libc::posix_spawnattr_destroy(attr) };
    result
}

/// Closes every descriptor from `first` up: the agent gets stdin, stdout
/// and stderr only, not what the runner inherited without close-on-exec (a
/// jobserver pipe, a terminal) nor, behind the zygote, its socket and other
/// executions' (the supervisor's own control socket sits below `first`,
/// close-on-exec). The Rust objects that owned any of them (in a zygote's
/// child) are never dropped: the callers never return.
fn close_inherited_fds(first: RawFd) {
    let first = u32::try_from(first).unwrap_or(3);
    // SAFETY: close_range/close only end descriptors; none is used after.
    unsafe {
        if libc::syscall(libc::SYS_close_range, first, u32::MAX, 0u32) == -1 {
            for fd in first..1024 {
                libc::close(fd as RawFd);
            }
        }
    }
}

/// Reaps the agent if it has exited (`waitpid` with `WNOHANG`).
fn try_wait(pid: libc::pid_t) -> io::Result<Option<ExitStatus>> {
    let mut status: libc::c_int = 0;
    loop {
        // SAFETY: waitpid writes the status into a c_int we own.
        match unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) } {
            0 => return Ok(None),
            -1 if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted => continue,
            -1 => return Err(io::Error::last_os_error()),
            _ => return Ok(Some(ExitStatus::from_raw(status))),
        }
    }
}

/// The exit code that reports `status` to the runner.
fn exit_code(status: ExitStatus) -> i32 {
    match (status.code(), status.signal()) {
        (Some(code), _) => code,
        (None, Some(signal)) => 128 + signal,
        (None, None) => 1,
    }
}

/// SIGKILLs every child of the shim until none is left: as each dies, its
/// own children are reparented to the shim (a child subreaper), so the loop
/// reaches every descendant, including ones that left the process group
/// with `setsid`. Bounded; reaps as it goes.
fn sweep_descendants() {
    let me = std::process::id() as libc::pid_t;
    for _ in 0..SWEEP_ROUNDS {
        let children = own_children(me).unwrap_or_else(|| children_by_scan(me));
        for &pid in &children {
            // SAFETY: kill(2) has no memory-safety preconditions; pid > 0.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        // SAFETY: waitpid with a null status pointer is allowed.
        while unsafe { libc::waitpid(-1, std::ptr::null_mut(), libc::WNOHANG) } > 0 {}
        if children.is_empty() {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// The shim's children from `/proc/<pid>/task/<pid>/children` (the shim is
/// single-threaded, so its main thread has them all): one small read, where
/// scanning /proc costs a read per process on the host.
fn own_children(me: libc::pid_t) -> Option<Vec<libc::pid_t>> {
    let s = std::fs::read_to_string(format!("/proc/{me}/task/{me}/children")).ok()?;
    Some(s.split_whitespace().filter_map(|p| p.parse().ok()).collect())
}

/// The shim's children by scanning every `/proc/<pid>/stat` (kernels
/// without `CONFIG_PROC_CHILDREN`).
fn children_by_scan(me: libc::pid_t) -> Vec<libc::pid_t> {
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_str().and_then(|s| s.parse::<libc::pid_t>().ok()))
        .filter(|pid| {
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return false };
            // After the command name: state, ppid, ...
            let ppid = stat.rsplit(')').next().and_then(|rest| rest.split_whitespace().nth(1)).and_then(|p| p.parse::<libc::pid_t>().ok());
            ppid == Some(me)
        })
        .collect()
}

/// Upper bound on sweep rounds (each one generation of descendants).
const SWEEP_ROUNDS: usize = 400;

/// SIGKILLs the shim's process group (the shim included).
fn kill_group() -> ! {
    report_exit(128 + libc::SIGKILL);
    // SAFETY: kill(2) has no memory-safety preconditions; pid 0 is our group.
    unsafe { libc::kill(0, libc::SIGKILL) };
    // Not reached: SIGKILL to ourselves is delivered before kill() returns.
    std::process::exit(128 + libc::SIGKILL)
}

/// Reports a shim failure on stderr (which ends up in the agent's stderr
/// tail) and exits.
fn fail(code: i32, message: std::fmt::Arguments<'_>) -> ! {
    eprintln!("punchclock agent shim: {message}");
    report_exit(code);
    std::process::exit(code)
}

/// Behind the zygote, the execution's control socket (-1: none), so every
/// way the supervisor ends tells the runner its code.
static CONTROL: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(-1);

/// Tells the runner `code` on the control socket, if there is one (once).
fn report_exit(code: i32) {
    let control = CONTROL.swap(-1, std::sync::atomic::Ordering::Relaxed);
    if control >= 0 {
        zygote::report_exit(control, code);
    }
}

/// A set of signals handled synchronously with `sigwait`.
struct SignalSet(libc::sigset_t);

impl SignalSet {
    fn new(signals: &[libc::c_int]) -> io::Result<Self> {
        let mut set = MaybeUninit::<libc::sigset_t>::uninit();
        // SAFETY: sigemptyset initializes the set it is given.
        if unsafe { libc::sigemptyset(set.as_mut_ptr()) } == -1 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: initialized by sigemptyset above.
        let mut set = unsafe { set.assume_init() };
        for &signal in signals {
            // SAFETY: `set` is an initialized sigset_t.
            if unsafe { libc::sigaddset(&mut set, signal) } == -1 {
                return Err(io::Error::last_os_error());
            }
        }
        Ok(Self(set))
    }

    /// Blocks the set in the calling thread, so its signals stay pending
    /// until [`SignalSet::wait`] takes them.
    fn block(&self) -> io::Result<()> {
        // SAFETY: valid set; a null old-set pointer is allowed.
        match unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &self.0, std::ptr::null_mut()) } {
            0 => Ok(()),
            errno => Err(io::Error::from_raw_os_error(errno)),
        }
    }

    /// Waits up to `timeout` for one of the (blocked) signals: its number,
    /// or `None` when the time ran out.
    fn wait_for(&self, timeout: std::time::Duration) -> io::Result<Option<libc::c_int>> {
        let ts = libc::timespec {
            tv_sec: libc::time_t::try_from(timeout.as_secs()).unwrap_or(libc::time_t::MAX),
            tv_nsec: libc::c_long::from(timeout.subsec_nanos()),
        };
        loop {
            // SAFETY: valid set and timespec; a null siginfo pointer is allowed.
            let r = unsafe { libc::sigtimedwait(&self.0, std::ptr::null_mut(), &ts) };
            if r >= 0 {
                return Ok(Some(r));
            }
            let err = io::Error::last_os_error();
            match err.raw_os_error() {
                Some(libc::EAGAIN) => return Ok(None),
                Some(libc::EINTR) => continue,
                _ => return Err(err),
            }
        }
    }
}

/// The fence deadline file the runner writes and the shims read: one line,
/// the deadline as `CLOCK_BOOTTIME` nanoseconds (one clock for every process
/// on the host, counting time spent suspended). The runner's writer is
/// `punchclock_agent_runner::fence::Fence`.
pub mod fence_file {
    use std::path::Path;

    /// The error text of executions stopped by the fence.
    pub const FENCE_REASON: &str = "no leader acknowledged this runner within its fence deadline";

    /// `CLOCK_BOOTTIME` now, in nanoseconds (0 if the clock cannot be read).
    pub fn boottime_ns() -> u64 {
        let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: clock_gettime writes into the timespec we own.
        if unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) } != 0 {
            return 0;
        }
        u64::try_from(ts.tv_sec).unwrap_or(0).saturating_mul(1_000_000_000).saturating_add(u64::try_from(ts.tv_nsec).unwrap_or(0))
    }

    /// Reads a deadline file (`None`: absent or unreadable, i.e. no fence).
    pub fn read_deadline(path: &Path) -> Option<u64> {
        std::fs::read_to_string(path).ok()?.trim().parse().ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_code_maps_signals_like_a_shell() {
        assert_eq!(exit_code(ExitStatus::from_raw(3 << 8)), 3);
        assert_eq!(exit_code(ExitStatus::from_raw(libc::SIGKILL)), 128 + libc::SIGKILL);
    }
}
