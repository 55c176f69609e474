//! Bench (issue 7, acceptance 4): the CPU an agent start costs, measured
//! through the runner's own executor (`executor::start`: execution
//! directory, spawn, supervision, `Finished`) over N runs of `/bin/true`,
//! `CONCURRENCY` at a time, in a tokio runtime with two workers like the
//! runner's. For each way of starting agents it prints, per run:
//!
//! - `agent+shim ms`: CPU of the processes started (getrusage
//!   `RUSAGE_CHILDREN`: the shim and `/bin/true`);
//! - `shim ms`: that less the CPU of `/bin/true` alone, spawned with
//!   `posix_spawn` and awaited (the `bare /bin/true` row): the supervisor's
//!   own cost — issue 7 asks ≤ 1 ms;
//! - `runner ms`: CPU of the runner side (`RUSAGE_SELF`);
//! - runs/s of wall time.
//!
//! Ways: `bare /bin/true` (the baseline, not through the executor),
//! `direct` (no shim: the agent leads its group, `PR_SET_PDEATHSIG`
//! only), `shim zygote` (supervisors forked by `punchclock-agent-shim
//! --zygote`, what `punchclock runner` uses by default; the zygote's CPU
//! and its supervisors' are read from its `/proc/<pid>/stat`), `shim
//! binary` (`punchclock-agent-shim` exec'd per run) and `shim subcommand`
//! (`punchclock __agent-shim`, the fallback, and what every run paid before).
//!
//! Usage: `bench-spawn [RUNS] [CONCURRENCY] [PUNCHCLOCK_BINARY]` (defaults
//! 10000, 8, the `punchclock` beside this binary).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use punchclock_agent_runner::executor::{self, ExecutionEvent, ExecutorSettings};
use punchclock_agent_runner::fence::Fence;
use punchclock_agent_runner::zygote::Zygote;
use punchclock_agent_runner::{ProcessAgent, SHIM_BINARY, ShimCommand};
use punchclock_proto::v1::{Assign, Outcome};
use tokio::sync::mpsc;

/// CPU time (user + system) of `who`, in milliseconds.
fn cpu_ms(who: libc::c_int) -> f64 {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage fills the struct we own.
    unsafe { libc::getrusage(who, usage.as_mut_ptr()) };
    // SAFETY: zero-initialized and filled above.
    let usage = unsafe { usage.assume_init() };
    let ms = |t: libc::timeval| t.tv_sec as f64 * 1e3 + t.tv_usec as f64 / 1e3;
    ms(usage.ru_utime) + ms(usage.ru_stime)
}

struct Figures {
    children_ms: f64,
    runner_ms: f64,
    runs_per_sec: f64,
}

/// CPU time of a live process and of the children it has reaped
/// (`/proc/<pid>/stat` utime + stime + cutime + cstime), in milliseconds.
fn process_tree_cpu_ms(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // After the command name: state is field 3, utime field 14.
    let fields: Vec<&str> = stat.rsplit(')').next().unwrap_or_default().split_whitespace().collect();
    let ticks: f64 = fields.get(11..15).map(|f| f.iter().filter_map(|t| t.parse::<f64>().ok()).sum()).unwrap_or(0.0);
    // SAFETY: sysconf has no preconditions.
    ticks * 1e3 / unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64
}

async fn measure(shim: Option<ShimCommand>, zygote: bool, runs: usize, concurrency: usize, work: &std::path::Path) -> Figures {
    let settings = ExecutorSettings {
        work_dir: work.join("runs"),
        kill_grace: Duration::from_secs(1),
        zygote: shim.clone().filter(|_| zygote).map(Zygote::new),
        http: Default::default(),
        callbacks: Default::default(),
        cgroups: None,
        agent_nice: 0,
        starts: Default::default(),
        shim,
        fence: Fence::new(work.join("fence"), Duration::from_secs(1)),
        dirs: Default::default(),
    };
    let agent = ProcessAgent {
        command: vec!["/bin/true".into()],
        env: Default::default(),
        env_from_file: Default::default(),
        working_dir: None,
        limits: Default::default(),
        enforce: Default::default(),
    };
    let (tx, mut events) = mpsc::channel(1024);
    let (children0, self0, t0) = (cpu_ms(libc::RUSAGE_CHILDREN), cpu_ms(libc::RUSAGE_SELF), Instant::now());
    let (mut started, mut finished) = (0usize, 0usize);
    let mut live = Vec::new();
    while finished < runs {
        while started < runs && started - finished < concurrency {
            let assign = Assign {
                run_id: format!("run-{started}"),
                execution_id: format!("exec-{started}"),
                attempt: 1,
                agent_id: "true".into(),
                timeout_seconds: 60,
                ..Assign::default()
            };
            live.push(executor::start(&agent, &assign, &settings, tx.clone()).await.expect("agent starts"));
            started += 1;
        }
        match events.recv().await.expect("events") {
            ExecutionEvent::Finished(f) => {
                assert_eq!(f.outcome(), Outcome::Succeeded, "{f:?}");
                finished += 1;
            }
            ExecutionEvent::Progress(_) => {}
        }
        if live.len() > 4 * concurrency {
            live.drain(..live.len() - concurrency);
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    // The zygote is not reaped yet: its CPU and its reaped supervisors' are
    // read from /proc (it started with the first run, so all of it counts).
    let zygote_ms = match &settings.zygote {
        Some(zygote) => process_tree_cpu_ms(zygote.pid().expect("zygote running")),
        None => 0.0,
    };
    Figures {
        children_ms: (cpu_ms(libc::RUSAGE_CHILDREN) - children0 + zygote_ms) / runs as f64,
        runner_ms: (cpu_ms(libc::RUSAGE_SELF) - self0) / runs as f64,
        runs_per_sec: runs as f64 / secs,
    }
}

/// CPU per run of `/bin/true` alone: `posix_spawn` (std, no `pre_exec`) and wait.
fn bare(runs: usize) -> f64 {
    let children0 = cpu_ms(libc::RUSAGE_CHILDREN);
    for _ in 0..runs {
        let status = std::process::Command::new("/bin/true").status().expect("/bin/true runs");
        assert!(status.success());
    }
    (cpu_ms(libc::RUSAGE_CHILDREN) - children0) / runs as f64
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let mut args = std::env::args().skip(1);
    let runs: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(10_000);
    let concurrency: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(8);
    let punchclock = args
        .next()
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::current_exe().expect("current exe").parent().expect("bin dir").join("punchclock"));
    let shim_binary = punchclock.with_file_name(SHIM_BINARY);
    for path in [&punchclock, &shim_binary] {
        assert!(path.is_file(), "{} not found (build the workspace first)", path.display());
    }
    let work = tempfile::tempdir().expect("tempdir");
    // A dynamically linked ELF names its loader (PT_INTERP) near the start.
    let head = std::fs::read(&shim_binary).map(|b| b[..b.len().min(4096)].to_vec()).unwrap_or_default();
    let linked = if head.windows(7).any(|w| w == b"ld-linu") { "dynamically linked" } else { "statically linked" };
    println!("shim binary: {} ({linked}; `make shim-static` links it statically)", shim_binary.display());
    println!("{runs} runs of /bin/true, {concurrency} at a time, through executor::start");
    println!("{:<16} {:>14} {:>9} {:>10} {:>8}", "way", "agent+shim ms", "shim ms", "runner ms", "runs/s");
    let base = bare(runs);
    println!("{:<16} {:>14.3} {:>9} {:>10} {:>8}", "bare /bin/true", base, "", "", "");
    for (way, shim, zygote) in [
        ("direct", None, false),
        ("shim zygote", Some(ShimCommand::binary(shim_binary.clone())), true),
        ("shim binary", Some(ShimCommand::binary(shim_binary.clone())), false),
        ("shim subcommand", Some(ShimCommand::subcommand(punchclock.clone())), false),
    ] {
        let f = measure(shim, zygote, runs, concurrency, work.path()).await;
        println!("{way:<16} {:>14.3} {:>9.3} {:>10.3} {:>8.0}", f.children_ms, f.children_ms - base, f.runner_ms, f.runs_per_sec);
    }
}
