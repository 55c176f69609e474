//! The agent shim, end to end. This test binary has no libtest harness
//! (`harness = false`) so that it can double as the shim binary: run as
//! `shim __agent-shim -- <command...>` it *is* the shim, exactly like the
//! `punchclock` binary's hidden subcommand; run as `shim fake-runner <dir>`
//! it is a runner that the test kills with SIGKILL.
//!
//! Every test runs three times: with this binary's `__agent-shim`
//! subcommand (as `punchclock __agent-shim`), then — in child processes
//! with `PUNCHCLOCK_TEST_SHIM` set — with the dedicated
//! `punchclock-agent-shim` binary (built here with cargo) exec'd for each
//! execution, and with supervisors forked by that binary's zygote
//! (`PUNCHCLOCK_TEST_ZYGOTE` set too), plus the zygote's own tests.

mod common;

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{PATIENCE, sh_agent, wait_until_gone};
use punchclock_agent_runner::executor::{self, ExecutionEvent, ExecutorSettings};
use punchclock_agent_runner::zygote::Zygote;
use punchclock_agent_runner::{ProcessAgent, SHIM_BINARY, SHIM_SUBCOMMAND, ShimCommand, shim_main};
use punchclock_proto::v1::{Assign, Finished, Outcome};
use tokio::sync::mpsc;

const FAKE_RUNNER: &str = "fake-runner";

fn main() {
    let mut args = std::env::args_os().skip(1);
    match args.next() {
        Some(arg) if arg == SHIM_SUBCOMMAND => shim_main(args.collect()),
        Some(arg) if arg == FAKE_RUNNER => {
            let dir = args.next().map(PathBuf::from).expect("fake-runner <dir>");
            runtime().block_on(fake_runner(&dir));
        }
        // No arguments, or a test-name filter from `cargo test <filter>`.
        _ => {
            // As when the runner runs from a shell: the tests own a
            // controlling terminal, which no agent may reach.
            take_a_terminal();
            run_tests();
            if std::env::var_os(SHIM_ENV).is_none() {
                run_with_dedicated_shim();
            }
        }
    }
}

/// Makes this process the leader of a new session whose controlling
/// terminal is a new pseudo-terminal (its master kept open for the
/// process's life). Panics if it cannot: `agents_have_no_controlling_terminal`
/// would prove nothing.
fn take_a_terminal() {
    // SAFETY: setsid/posix_openpt/grantpt/unlockpt/ptsname_r/open on this
    // process and descriptors it owns (the master is deliberately leaked).
    unsafe {
        assert!(libc::setsid() != -1, "setsid: {}", std::io::Error::last_os_error());
        let master = libc::posix_openpt(libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC);
        assert!(master >= 0 && libc::grantpt(master) == 0 && libc::unlockpt(master) == 0, "no pseudo-terminal");
        let mut name = [0 as libc::c_char; 128];
        assert_eq!(libc::ptsname_r(master, name.as_mut_ptr(), name.len()), 0, "ptsname");
        // Without O_NOCTTY: the session leader's first terminal becomes its
        // controlling terminal.
        let slave = libc::open(name.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC);
        assert!(slave >= 0, "open the pseudo-terminal: {}", std::io::Error::last_os_error());
        let tty = libc::open(c"/dev/tty".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC);
        assert!(tty >= 0, "the tests have no controlling terminal: {}", std::io::Error::last_os_error());
        libc::close(tty);
    }
}

/// Names the shim binary the tests use (unset: this binary's subcommand).
const SHIM_ENV: &str = "PUNCHCLOCK_TEST_SHIM";
/// Set: executions are started through the shim's zygote.
const ZYGOTE_ENV: &str = "PUNCHCLOCK_TEST_ZYGOTE";

fn zygote_mode() -> bool {
    std::env::var_os(ZYGOTE_ENV).is_some()
}

/// The shim under test.
fn shim() -> ShimCommand {
    match std::env::var_os(SHIM_ENV) {
        Some(path) => ShimCommand::binary(path.into()),
        None => ShimCommand::subcommand(std::env::current_exe().expect("current exe")),
    }
}

/// Builds `punchclock-agent-shim` and runs every test again with it.
fn run_with_dedicated_shim() {
    // This binary is target/<profile>/deps/shim-<hash>; bins sit in target/<profile>.
    let exe = std::env::current_exe().expect("current exe");
    let profile_dir = exe.parent().and_then(Path::parent).expect("target dir");
    let mut build = vec!["build", "--quiet", "-p", "punchclock-agent-shim", "--bin", SHIM_BINARY];
    if profile_dir.ends_with("release") {
        build.push("--release");
    }
    let status = std::process::Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(&build)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .status()
        .expect("run cargo build");
    assert!(status.success(), "cargo build of {SHIM_BINARY} failed");
    let binary = profile_dir.join(SHIM_BINARY);
    assert!(binary.is_file(), "{} was not built", binary.display());
    // It speaks this build's protocol, so a runner beside it uses it.
    assert_eq!(ShimCommand::beside(profile_dir.join("punchclock")), ShimCommand::binary(binary.clone()), "the shim answers --protocol");
    println!("again with {}", binary.display());
    let status = std::process::Command::new(&exe).env(SHIM_ENV, &binary).status().expect("re-run the tests");
    assert!(status.success(), "the tests failed with {}", binary.display());
    println!("again with {} --zygote", binary.display());
    let status = std::process::Command::new(&exe).env(SHIM_ENV, &binary).env(ZYGOTE_ENV, "1").status().expect("re-run the tests");
    assert!(status.success(), "the tests failed with {} --zygote", binary.display());
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime")
}

/// A named test taking a fresh temporary directory.
type Test = (&'static str, fn(&Path));

fn run_tests() {
    let tests: [Test; 24] = [
        ("agents_run_at_the_runners_nice_plus_agent_nice", |dir| runtime().block_on(agent_nice(dir))),
        ("agents_of_the_zygote_start_in_the_agents_cgroup", |dir| runtime().block_on(agents_cgroup(dir))),
        ("a_zygote_whose_spares_cannot_live_backs_off", |dir| runtime().block_on(spares_back_off(dir))),
        ("agents_have_no_controlling_terminal", |dir| runtime().block_on(no_terminal(dir))),
        ("a_killed_supervisor_is_reported_while_the_zygote_is_stopped", |dir| runtime().block_on(killed_supervisor(dir))),
        ("a_start_goes_to_a_spare_while_the_zygote_is_stopped", |dir| runtime().block_on(spare_while_stopped(dir))),
        ("killed_spares_are_skipped_and_a_killed_zygote_takes_its_spares", |dir| runtime().block_on(killed_spares(dir))),
        ("a_stopped_zygote_fails_the_start_and_the_agent_never_runs", |dir| runtime().block_on(stopped_zygote(dir))),
        ("the_exit_code_arrives_while_the_zygote_is_stopped", |dir| runtime().block_on(exit_code_without_zygote(dir))),
        ("sigterm_to_the_zygote_spares_its_agents", |dir| runtime().block_on(sigterm_to_zygote(dir))),
        ("the_agent_gets_only_its_stdio", |dir| runtime().block_on(only_stdio(dir))),
        ("path_and_working_dir_come_from_the_agent", |dir| runtime().block_on(path_and_working_dir(dir))),
        ("a_killed_zygote_takes_its_agents_and_comes_back", |dir| runtime().block_on(killed_zygote(dir))),
        ("missing_programs_and_scripts_without_shebang", |dir| runtime().block_on(missing_and_scripts(dir))),
        ("execution_directories_are_reused_empty", |dir| runtime().block_on(reused_empty(dir))),
        ("a_directory_is_not_reused_after_a_kill", |dir| runtime().block_on(not_reused_after_kill(dir))),
        ("setsid_daemon_dies_when_the_agent_exits", |dir| runtime().block_on(setsid_on_exit(dir))),
        ("setsid_daemon_dies_when_the_agent_times_out", |dir| runtime().block_on(setsid_on_timeout(dir))),
        ("success_passes_through_the_shim", |dir| runtime().block_on(success(dir))),
        ("agent_starts_with_no_blocked_signals", |dir| runtime().block_on(no_blocked_signals(dir))),
        ("shell_wait_returns_behind_the_shim", |dir| runtime().block_on(shell_wait(dir))),
        ("exit_code_passes_through_the_shim", |dir| runtime().block_on(exit_code(dir))),
        ("timeout_kills_the_group_behind_the_shim", |dir| runtime().block_on(timeout(dir))),
        ("killed_runner_leaves_no_agent_behind", killed_runner),
    ];
    for (name, test) in tests {
        if name.contains("zygote") && !zygote_mode() {
            continue;
        }
        let dir = tempfile::tempdir().expect("tempdir");
        test(dir.path());
        println!("test {name} ... ok");
    }
    println!("test result: ok. {} passed", tests.len());
}

fn settings(work_dir: &Path) -> ExecutorSettings {
    ExecutorSettings {
        work_dir: work_dir.join("runs"),
        kill_grace: Duration::from_millis(300),
        shim: Some(shim()),
        zygote: zygote_mode().then(|| Zygote::new(shim())),
        http: Default::default(),
        callbacks: Default::default(),
        fence: punchclock_agent_runner::fence::Fence::new(work_dir.join("fence"), Duration::from_millis(300)),
        dirs: Default::default(),
        cgroups: None,
        agent_nice: 0,
        starts: Default::default(),
    }
}

fn assign(execution_id: &str, timeout_seconds: u64) -> Assign {
    let deadline = chrono::Utc::now() + Duration::from_secs(timeout_seconds);
    Assign {
        run_id: format!("run-{execution_id}"),
        execution_id: execution_id.into(),
        attempt: 1,
        agent_id: "agent".into(),
        deadline: Some(punchclock_proto::time::to_timestamp(deadline)),
        timeout_seconds,
        ..Assign::default()
    }
}

/// Runs `agent` through the shim; returns the pid of the process whose pid
/// the agent writes as its first progress message (if any), and `Finished`.
async fn run_agent(dir: &Path, agent: &ProcessAgent, assign: &Assign) -> (Option<i32>, Finished) {
    let (tx, mut events) = mpsc::channel(16);
    executor::start(agent, assign, &settings(dir), tx).await.expect("shim starts");
    let mut reported_pid = None;
    loop {
        let event = tokio::time::timeout(PATIENCE, events.recv()).await.expect("event in time").expect("channel open");
        match event {
            ExecutionEvent::Progress(progress) => reported_pid = progress.message.parse().ok(),
            ExecutionEvent::Finished(finished) => return (reported_pid, finished),
        }
    }
}

async fn success(dir: &Path) {
    // The shim's own variables stay with the shim.
    let agent = sh_agent(
        r#"[ -z "$PUNCHCLOCK_SHIM_PARENT_PID$PUNCHCLOCK_SHIM_FENCE_FILE$PUNCHCLOCK_SHIM_KILL_GRACE_MS" ] && cat > "$PUNCHCLOCK_RESULT_FILE"; echo hi"#,
    );
    let mut assign = assign("e-ok", 60);
    assign.context_json = r#"{"via":"shim"}"#.into();
    let (_, finished) = run_agent(dir, &agent, &assign).await;
    assert_eq!(finished.outcome(), Outcome::Succeeded, "{finished:?}");
    assert_eq!(finished.result_json, r#"{"via":"shim"}"#, "stdin and env pass through");
    assert_eq!(finished.stdout_tail, "hi\n");
}

/// The shim blocks signals for `sigwait`; the agent must not inherit that
/// mask (it would never see SIGTERM, and `wait` in a shell would hang).
async fn no_blocked_signals(dir: &Path) {
    // Not through `sh`: dash clears its own mask, which would hide a leak.
    let agent = ProcessAgent { command: ["grep", "-E", "^Sig(Blk|Ign)", "/proc/self/status"].map(String::from).to_vec(), ..sh_agent("") };
    let (_, finished) = run_agent(dir, &agent, &assign("e-mask", 60)).await;
    assert_eq!(finished.outcome(), Outcome::Succeeded, "{finished:?}");
    let masks: Vec<u64> =
        finished.stdout_tail.lines().filter_map(|line| u64::from_str_radix(line.split_whitespace().nth(1)?, 16).ok()).collect();
    let [blocked, ignored] = masks[..] else { panic!("two masks expected: {}", finished.stdout_tail) };
    assert_eq!(blocked, 0, "no signal blocked:\n{}", finished.stdout_tail);
    // Bit N-1 is signal N. (glibc's internal signals 32 and 33 may show as ignored.)
    assert_eq!(ignored & (1 << (libc::SIGPIPE - 1)), 0, "SIGPIPE not ignored:\n{}", finished.stdout_tail);
}

/// Regression: `sleep 1 & wait $!` hung forever behind the shim.
async fn shell_wait(dir: &Path) {
    let agent = sh_agent(r#"sleep 0.2 & wait "$!"; echo waited"#);
    let (_, finished) = run_agent(dir, &agent, &assign("e-wait", 60)).await;
    assert_eq!(finished.outcome(), Outcome::Succeeded, "{finished:?}");
    assert_eq!(finished.stdout_tail, "waited\n");
}

/// A daemon started with `setsid` leaves the agent's process group; the
/// shim (a child subreaper) still kills it.
const SETSID_AGENT: &str = r#"
    setsid sleep 3600 </dev/null >/dev/null 2>&1 &
    echo "{\"message\": \"$!\"}" >> "$PUNCHCLOCK_PROGRESS_FILE"
"#;

async fn setsid_on_exit(dir: &Path) {
    let (daemon, finished) = run_agent(dir, &sh_agent(SETSID_AGENT), &assign("e-setsid", 60)).await;
    assert_eq!(finished.outcome(), Outcome::Succeeded, "{finished:?}");
    let daemon = daemon.expect("the agent reported its daemon's pid");
    assert!(wait_until_gone(daemon).await, "setsid daemon {daemon} outlived its agent");
}

async fn setsid_on_timeout(dir: &Path) {
    let agent = sh_agent(&format!("{SETSID_AGENT}\ntrap '' TERM\nsleep 3600"));
    let (daemon, finished) = run_agent(dir, &agent, &assign("e-setsid-timeout", 1)).await;
    assert_eq!(finished.outcome(), Outcome::Timeout, "{finished:?}");
    let daemon = daemon.expect("the agent reported its daemon's pid");
    assert!(wait_until_gone(daemon).await, "setsid daemon {daemon} outlived the timeout");
}

async fn exit_code(dir: &Path) {
    let agent = sh_agent("echo bad >&2; exit 7");
    let (_, finished) = run_agent(dir, &agent, &assign("e-fail", 60)).await;
    assert_eq!(finished.outcome(), Outcome::Failed);
    assert_eq!(finished.exit_code, Some(7));
    assert_eq!(finished.error, "exit code 7: bad");
}

/// Agent and child ignore SIGTERM (so does the shim): SIGKILL to the group
/// after the grace period takes all three down.
const STUBBORN_AGENT: &str = r#"
    trap '' TERM
    sleep 3600 &
    echo "{\"message\": \"$!\"}" >> "$PUNCHCLOCK_PROGRESS_FILE"
    wait
"#;

async fn timeout(dir: &Path) {
    let (grandchild, finished) = run_agent(dir, &sh_agent(STUBBORN_AGENT), &assign("e-timeout", 1)).await;
    assert_eq!(finished.outcome(), Outcome::Timeout, "{finished:?}");
    let grandchild = grandchild.expect("the agent reported its child's pid");
    assert!(wait_until_gone(grandchild).await, "background child {grandchild} survived");
}

/// The fake runner: starts the stubborn agent through the shim, writes the
/// agent's child's pid to `<dir>/pid` and waits to be killed.
async fn fake_runner(dir: &Path) {
    let (tx, mut events) = mpsc::channel(16);
    let _execution = executor::start(&sh_agent(STUBBORN_AGENT), &assign("e-orphan", 3600), &settings(dir), tx).await.expect("shim starts");
    while let Some(event) = events.recv().await {
        if let ExecutionEvent::Progress(progress) = event {
            std::fs::write(dir.join("pid.tmp"), &progress.message).expect("write pid");
            std::fs::rename(dir.join("pid.tmp"), dir.join("pid")).expect("publish pid");
        }
    }
}

fn killed_runner(dir: &Path) {
    let exe = std::env::current_exe().expect("current exe");
    let mut runner = std::process::Command::new(exe)
        .args([OsString::from(FAKE_RUNNER), dir.as_os_str().to_owned()])
        .spawn()
        .expect("fake runner starts");

    let pid_file = dir.join("pid");
    let started = std::time::Instant::now();
    while !pid_file.exists() {
        assert!(started.elapsed() < PATIENCE, "fake runner never reported the agent's child");
        std::thread::sleep(Duration::from_millis(20));
    }
    let grandchild: i32 = std::fs::read_to_string(&pid_file).expect("read pid").trim().parse().expect("a pid");

    runner.kill().expect("SIGKILL the fake runner");
    runner.wait().expect("reap the fake runner");
    assert!(runtime().block_on(wait_until_gone(grandchild)), "agent child {grandchild} outlived the killed runner");
}

/// Runs `agent` with `settings` to its end.
async fn run_with(settings: &ExecutorSettings, agent: &ProcessAgent, assign: &Assign) -> Finished {
    finished(&mut start_events(settings, agent, assign).await).await
}

async fn reused_empty(dir: &Path) {
    let settings = settings(dir);
    // Leaves a result, progress and a file of its own; prints its result
    // path and what it found of an earlier execution.
    let messy = sh_agent(
        r#"echo "$PUNCHCLOCK_RESULT_FILE"
           [ -e "$PUNCHCLOCK_RESULT_FILE" ] && echo "found a result"
           [ -s "$PUNCHCLOCK_PROGRESS_FILE" ] && echo "found progress"
           [ -e "$(dirname "$PUNCHCLOCK_RESULT_FILE")/scratch" ] && echo "found scratch"
           echo '{"ok": true}' > "$PUNCHCLOCK_RESULT_FILE"; echo '{"message": "m"}' >> "$PUNCHCLOCK_PROGRESS_FILE"
           mkdir "$(dirname "$PUNCHCLOCK_RESULT_FILE")/scratch"; touch "$(dirname "$PUNCHCLOCK_RESULT_FILE")/scratch/x"; true"#,
    );
    let mut paths = Vec::new();
    for i in 0..3 {
        let finished = run_with(&settings, &messy, &assign(&format!("e-reuse-{i}"), 60)).await;
        assert_eq!(finished.outcome(), Outcome::Succeeded, "{finished:?}");
        assert_eq!(finished.result_json, r#"{"ok":true}"#);
        let mut lines = finished.stdout_tail.lines();
        paths.push(lines.next().expect("the result path").to_owned());
        assert_eq!(lines.next(), None, "execution {i} found files of an earlier one: {}", finished.stdout_tail);
        assert!(common::files_left(dir).is_empty(), "nothing left after execution {i}: {:?}", common::files_left(dir));
    }
    assert!(paths.windows(2).all(|w| w[0] == w[1]), "one directory, reused: {paths:?}");
}

async fn not_reused_after_kill(dir: &Path) {
    let settings = settings(dir);
    // Ignores SIGTERM: stopped at its 1 s deadline only by the kill.
    let stubborn = sh_agent(r#"trap '' TERM; echo "$PUNCHCLOCK_RESULT_FILE"; while :; do sleep 0.1; done"#);
    let finished = run_with(&settings, &stubborn, &assign("e-stubborn", 1)).await;
    assert_eq!(finished.outcome(), Outcome::Timeout, "{finished:?}");
    let result = PathBuf::from(finished.stdout_tail.trim());
    let exec_dir = result.parent().expect("the execution directory");
    assert!(!exec_dir.exists(), "{} removed, not kept for reuse, after the group was killed", exec_dir.display());
    // The next execution gets a new directory.
    let next = run_with(&settings, &sh_agent(r#"echo "$PUNCHCLOCK_RESULT_FILE""#), &assign("e-next", 60)).await;
    assert_ne!(next.stdout_tail.trim(), finished.stdout_tail.trim());
}

async fn missing_and_scripts(dir: &Path) {
    let missing = ProcessAgent { command: vec!["/nonexistent/punchclock-agent".into()], ..sh_agent("") };
    let (_, finished) = run_agent(dir, &missing, &assign("e-missing", 60)).await;
    assert_eq!(finished.outcome(), Outcome::Failed, "{finished:?}");
    assert_eq!(finished.exit_code, Some(127), "{finished:?}");
    assert!(finished.error.contains("cannot start /nonexistent/punchclock-agent"), "{}", finished.error);

    // No `#!`: the kernel refuses it (ENOEXEC); it runs with /bin/sh.
    let script = dir.join("no-shebang");
    std::fs::write(&script, "echo ran \"$1\"\n").expect("write script");
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).expect("chmod");
    let agent = ProcessAgent { command: vec![script.display().to_string(), "arg".into()], ..sh_agent("") };
    let (_, finished) = run_agent(dir, &agent, &assign("e-script", 60)).await;
    assert_eq!(finished.outcome(), Outcome::Succeeded, "{finished:?}");
    assert_eq!(finished.stdout_tail, "ran arg\n");
}

/// The agent inherits stdin, stdout and stderr and nothing else: no runner
/// socket, no zygote socket, no other execution's status socket.
async fn only_stdio(dir: &Path) {
    let settings = settings(dir);
    // A second execution runs meanwhile, so its descriptors exist.
    let (tx, _events) = mpsc::channel(16);
    let _other = executor::start(&sh_agent("sleep 5"), &assign("e-other", 60), &settings, tx).await.expect("shim starts");
    let agent = ProcessAgent { command: ["ls", "/proc/self/fd"].map(String::from).to_vec(), ..sh_agent("") };
    let first = run_with(&settings, &agent, &assign("e-fds", 60)).await;
    assert_eq!(first.outcome(), Outcome::Succeeded, "{first:?}");
    let fds: Vec<&str> = first.stdout_tail.lines().collect();
    // 0, 1, 2, and the directory `ls` opened to list them.
    assert_eq!(fds, ["0", "1", "2", "3"], "descriptors the agent got");
    // Again through a spare supervisor (it held its socket and the pipe
    // that tells the zygote it was taken).
    if let Some(zygote) = &settings.zygote {
        let held = spares(zygote, 1).await;
        let (tx, mut events) = mpsc::channel(16);
        let execution = executor::start(&agent, &assign("e-fds-spare", 60), &settings, tx).await.expect("shim starts");
        assert_eq!(Some(&execution.pid()), held.last(), "a spare took the start");
        let ended = finished(&mut events).await;
        assert_eq!(ended.outcome(), Outcome::Succeeded, "{ended:?}");
        let fds: Vec<&str> = ended.stdout_tail.lines().collect();
        assert_eq!(fds, ["0", "1", "2", "3"], "descriptors the agent got from a spare");
    }
}

/// The agent's `env` PATH finds its program, and it starts in its `working_dir`.
async fn path_and_working_dir(dir: &Path) {
    let bin = dir.join("bin");
    std::fs::create_dir(&bin).expect("mkdir bin");
    let script = bin.join("only-here");
    std::fs::write(&script, "#!/bin/sh\npwd\n").expect("write script");
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).expect("chmod");
    let agent = ProcessAgent {
        command: vec!["only-here".into()],
        env: [("PATH".to_owned(), format!("{}:/usr/bin:/bin", bin.display()))].into(),
        env_from_file: Default::default(),
        working_dir: Some(bin.clone()),
        ..sh_agent("")
    };
    let (_, finished) = run_agent(dir, &agent, &assign("e-path", 60)).await;
    assert_eq!(finished.outcome(), Outcome::Succeeded, "{finished:?}");
    assert_eq!(finished.stdout_tail.trim(), bin.display().to_string());
}

/// SIGKILL to the zygote: its supervisors kill their agents (and what they
/// left in other sessions), the execution ends killed, and the next one
/// gets a new zygote.
async fn killed_zygote(dir: &Path) {
    let settings = settings(dir);
    let zygote = settings.zygote.clone().expect("zygote mode");
    let (tx, mut events) = mpsc::channel(16);
    let _execution = executor::start(&sh_agent(&format!("{SETSID_AGENT}\nsleep 3600")), &assign("e-zygote", 3600), &settings, tx)
        .await
        .expect("shim starts");
    let daemon: i32 = match tokio::time::timeout(PATIENCE, events.recv()).await.expect("progress in time").expect("channel open") {
        ExecutionEvent::Progress(progress) => progress.message.parse().expect("a pid"),
        ExecutionEvent::Finished(finished) => panic!("ended early: {finished:?}"),
    };
    let first = zygote.pid().expect("zygote running");
    // SAFETY: kill(2) has no memory-safety preconditions.
    unsafe { libc::kill(first as i32, libc::SIGKILL) };
    let finished = loop {
        match tokio::time::timeout(PATIENCE, events.recv()).await.expect("finished in time").expect("channel open") {
            ExecutionEvent::Progress(_) => {}
            ExecutionEvent::Finished(finished) => break finished,
        }
    };
    assert_eq!(finished.outcome(), Outcome::Failed, "{finished:?}");
    assert!(wait_until_gone(daemon).await, "setsid daemon {daemon} outlived the killed zygote");
    let next = run_with(&settings, &sh_agent("echo again"), &assign("e-after", 60)).await;
    assert_eq!(next.outcome(), Outcome::Succeeded, "{next:?}");
    assert_ne!(zygote.pid(), Some(first), "a new zygote serves the next execution");
}

fn signal(pid: u32, signal: libc::c_int) {
    // SAFETY: kill(2) has no memory-safety preconditions.
    unsafe { libc::kill(pid as i32, signal) };
}

/// Starts `agent` and returns its events; the zygote must be running after.
async fn start_events(settings: &ExecutorSettings, agent: &ProcessAgent, assign: &Assign) -> mpsc::Receiver<ExecutionEvent> {
    let (tx, events) = mpsc::channel(16);
    let execution = executor::start(agent, assign, settings, tx).await.expect("shim starts");
    std::mem::forget(execution);
    events
}

/// Starts `sh -c script` through the zygote: its events and the zygote's pid.
async fn start_with_zygote(settings: &ExecutorSettings, script: &str, execution_id: &str) -> (mpsc::Receiver<ExecutionEvent>, u32) {
    let events = start_events(settings, &sh_agent(script), &assign(execution_id, 60)).await;
    let pid = settings.zygote.as_ref().and_then(|zygote| zygote.pid()).expect("zygote running");
    (events, pid)
}

async fn finished(events: &mut mpsc::Receiver<ExecutionEvent>) -> Finished {
    loop {
        match tokio::time::timeout(PATIENCE, events.recv()).await.expect("finished in time").expect("channel open") {
            ExecutionEvent::Progress(_) => {}
            ExecutionEvent::Finished(finished) => return finished,
        }
    }
}

/// A zygote that does not answer in time: the start fails, the zygote is
/// left alone, and the agent of that start never runs — not even once the
/// zygote resumes (it would run twice: the failed start is retried).
async fn stopped_zygote(dir: &Path) {
    let mut settings = settings(dir);
    // Without spares: a spare would take the start without the zygote
    // (see `a_start_goes_to_a_spare_while_the_zygote_is_stopped`).
    settings.zygote = settings.zygote.take().map(|z| z.with_patience(Duration::from_millis(500)).without_spares());
    let zygote = settings.zygote.clone().expect("zygote mode");
    let first = run_with(&settings, &sh_agent("true"), &assign("e-warm", 60)).await;
    assert_eq!(first.outcome(), Outcome::Succeeded, "{first:?}");
    let pid = zygote.pid().expect("zygote running");
    signal(pid, libc::SIGSTOP);
    let marker = dir.join("ran");
    let agent = sh_agent(&format!("touch {}", marker.display()));
    let (tx, _events) = mpsc::channel(16);
    let started = executor::start(&agent, &assign("e-stopped", 60), &settings, tx).await;
    signal(pid, libc::SIGCONT);
    let err = started.expect_err("no answer from a stopped zygote");
    assert!(err.to_string().contains("in time"), "{err}");
    // The resumed zygote forks the supervisor it was asked for; it must
    // not start the agent. Another execution after it proves it has.
    let next = run_with(&settings, &sh_agent("echo next"), &assign("e-next", 60)).await;
    assert_eq!(next.outcome(), Outcome::Succeeded, "{next:?}");
    assert_eq!(zygote.pid(), Some(pid), "the zygote was not killed");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!marker.exists(), "the agent of a start reported failed ran");
}

/// Forks since boot, machine-wide (`processes` in `/proc/stat`, read again
/// from the start of `file`: no descriptor is needed).
fn forks(file: &mut std::fs::File) -> u64 {
    use std::io::{Read, Seek};
    file.rewind().expect("rewind /proc/stat");
    let mut stat = String::new();
    file.read_to_string(&mut stat).expect("/proc/stat");
    stat.lines().find_map(|line| line.strip_prefix("processes ")).and_then(|n| n.trim().parse().ok()).expect("processes line")
}

/// Spares that die as soon as they are made (here: the zygote may hold
/// only 12 descriptors, too few for a spare to set its own up; in the
/// field, a runner out of descriptors loses each spare's socket on the
/// way) must not turn the zygote into a fork loop (before: thousands of
/// forks a second for as long as it lasted); once they can live again,
/// spares come back.
async fn spares_back_off(dir: &Path) {
    let settings = settings(dir);
    let zygote = settings.zygote.clone().expect("zygote mode");
    let warm = run_with(&settings, &sh_agent("true"), &assign("e-warm", 60)).await;
    assert_eq!(warm.outcome(), Outcome::Succeeded, "{warm:?}");
    let held = spares(&zygote, 1).await;
    let pid = zygote.pid().expect("zygote running") as libc::pid_t;
    let mut stat = std::fs::File::open("/proc/stat").expect("/proc/stat");
    let mut saved = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: prlimit on a process of ours, with rlimits we own. Only the
    // soft limit moves (raising a hard one back may take a capability).
    assert_eq!(unsafe { libc::prlimit(pid, libc::RLIMIT_NOFILE, std::ptr::null(), &mut saved) }, 0);
    let tight = libc::rlimit { rlim_cur: 12, rlim_max: saved.rlim_max };
    // SAFETY: as above.
    assert_eq!(unsafe { libc::prlimit(pid, libc::RLIMIT_NOFILE, &tight, std::ptr::null_mut()) }, 0, "{}", std::io::Error::last_os_error());
    // All of them: the pool is short, and refills begin.
    for &spare in &held {
        signal(spare, libc::SIGKILL);
    }
    let before = forks(&mut stat);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let during = forks(&mut stat) - before;
    // SAFETY: as above.
    assert_eq!(unsafe { libc::prlimit(pid, libc::RLIMIT_NOFILE, &saved, std::ptr::null_mut()) }, 0, "{}", std::io::Error::last_os_error());
    // Backoff (doubling from 100 ms per spare that died unused): a few
    // refills at most (other processes of the machine fork too, hence the
    // margin).
    assert!(during < 200, "{during} forks in 1.5 s while every new spare died");
    let next = run_with(&settings, &sh_agent("echo fine"), &assign("e-next", 60)).await;
    assert_eq!(next.outcome(), Outcome::Succeeded, "{next:?}");
    spares(&zygote, 1).await;
}

/// The runner has a controlling terminal (see `take_a_terminal`); its
/// agents do not: `/dev/tty` fails (before: an agent reading it was
/// stopped with its supervisor by SIGTTIN until its timeout, or wrote on
/// the operator's terminal). Through a spare too.
async fn no_terminal(dir: &Path) {
    let settings = settings(dir);
    let agent = sh_agent("if (exec 3</dev/tty) 2>/dev/null; then echo terminal; else echo none; fi");
    let first = run_with(&settings, &agent, &assign("e-tty", 60)).await;
    assert_eq!(first.outcome(), Outcome::Succeeded, "{first:?}");
    assert_eq!(first.stdout_tail, "none\n", "the agent opened the runner's terminal");
    if let Some(zygote) = &settings.zygote {
        let held = spares(zygote, 1).await;
        let (tx, mut events) = mpsc::channel(16);
        let execution = executor::start(&agent, &assign("e-tty-spare", 60), &settings, tx).await.expect("shim starts");
        assert_eq!(Some(&execution.pid()), held.last(), "a spare took the start");
        let ended = finished(&mut events).await;
        assert_eq!(ended.stdout_tail, "none\n", "an agent from a spare opened the runner's terminal");
    }
}

/// Agents run `agent_nice` lower than the runner (their nice value is the
/// runner's plus it, at most 19), through an exec'd shim, a supervisor the
/// zygote forks, and a spare; with 0, at the runner's own.
async fn agent_nice(dir: &Path) {
    // SAFETY: getpriority has no memory-safety preconditions.
    let own = unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
    let agent = sh_agent("cut -d' ' -f19 /proc/$$/stat");
    for nice in [7u8, 0] {
        let settings = ExecutorSettings { agent_nice: nice, ..settings(dir) };
        let want = format!("{}\n", (own + i32::from(nice)).min(19));
        let first = run_with(&settings, &agent, &assign(&format!("e-nice-{nice}"), 60)).await;
        assert_eq!(first.outcome(), Outcome::Succeeded, "{first:?}");
        assert_eq!(first.stdout_tail, want, "agent_nice {nice}, runner at nice {own}");
        if let Some(zygote) = &settings.zygote {
            let held = spares(zygote, 1).await;
            let (tx, mut events) = mpsc::channel(16);
            let execution =
                executor::start(&agent, &assign(&format!("e-nice-spare-{nice}"), 60), &settings, tx).await.expect("shim starts");
            assert_eq!(Some(&execution.pid()), held.last(), "a spare took the start");
            let ended = finished(&mut events).await;
            assert_eq!(ended.stdout_tail, want, "agent_nice {nice} through a spare");
        }
    }
}

/// The zygote joins the agents' shared cgroup (the CPU weight of
/// `agent_nice`) before it execs: its agents start there, from a fork and
/// from a spare. Skipped (said) where this process cannot make cgroups
/// (not root, no cpu hierarchy), and outside zygote mode.
async fn agents_cgroup(dir: &Path) {
    use punchclock_agent_runner::cgroup::Cgroups;
    if !zygote_mode() {
        return;
    }
    let id = format!("shim-test-{}", std::process::id());
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let cgroups = std::sync::Arc::new(Cgroups::detect(Path::new("/sys/fs/cgroup"), &own, &id).with_agent_nice(19));
    let procs = match cgroups.shared() {
        Ok(Some(procs)) => procs,
        other => {
            return skip(
                "agents_of_the_zygote_start_in_the_agents_cgroup",
                "PUNCHCLOCK_SKIP_CGROUP_TESTS",
                &format!("no agents' cgroup here ({other:?})"),
            );
        }
    };
    let group = procs.parent().expect("cgroup dir").to_owned();
    let zygote = Zygote::new(shim()).in_cgroups(cgroups);
    let settings = ExecutorSettings { zygote: Some(zygote.clone()), agent_nice: 19, ..settings(dir) };
    let agent = sh_agent("cat /proc/self/cgroup");
    // The end of the group's path as /proc shows it (v1 `N:cpu:/...`, v2 `0::/...`).
    let want = format!("/{}", group.file_name().expect("name").to_string_lossy());
    let first = run_with(&settings, &agent, &assign("e-agents-cgroup", 60)).await;
    assert_eq!(first.outcome(), Outcome::Succeeded, "{first:?}");
    assert!(first.stdout_tail.lines().any(|l| l.ends_with(&want)), "agent not in {want}: {}", first.stdout_tail);
    let held = spares(&zygote, 1).await;
    let (tx, mut events) = mpsc::channel(16);
    let execution = executor::start(&agent, &assign("e-agents-cgroup-spare", 60), &settings, tx).await.expect("shim starts");
    assert_eq!(Some(&execution.pid()), held.last(), "a spare took the start");
    let ended = finished(&mut events).await;
    assert!(ended.stdout_tail.lines().any(|l| l.ends_with(&want)), "spare's agent not in {want}: {}", ended.stdout_tail);
    drop((execution, settings, zygote));
    // Left empty once the zygote is gone (it exits at its socket's EOF).
    let deadline = std::time::Instant::now() + PATIENCE;
    while std::fs::remove_dir(&group).is_err() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Waits until the runner holds at least `n` spare supervisors (the zygote
/// forks them once no request has come for a moment).
async fn spares(zygote: &Zygote, n: usize) -> Vec<u32> {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        let pids = zygote.spare_pids();
        if pids.len() >= n {
            return pids;
        }
        assert!(tokio::time::Instant::now() < deadline, "only {} spares after {PATIENCE:?}", pids.len());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A start goes straight to a spare supervisor, not through the zygote:
/// with the zygote stopped it still starts, on the spare's pid, and runs
/// to its end.
async fn spare_while_stopped(dir: &Path) {
    let mut settings = settings(dir);
    settings.zygote = settings.zygote.take().map(|z| z.with_patience(Duration::from_millis(500)));
    let zygote = settings.zygote.clone().expect("zygote mode");
    let warm = run_with(&settings, &sh_agent("true"), &assign("e-warm", 60)).await;
    assert_eq!(warm.outcome(), Outcome::Succeeded, "{warm:?}");
    let held = spares(&zygote, 1).await;
    let pid = zygote.pid().expect("zygote running");
    signal(pid, libc::SIGSTOP);
    let (tx, mut events) = mpsc::channel(16);
    let started = executor::start(&sh_agent("echo from a spare"), &assign("e-spare", 60), &settings, tx).await;
    let execution = started.expect("a spare starts the agent while the zygote is stopped");
    assert_eq!(Some(&execution.pid()), held.last(), "the newest spare took the start");
    let finished = finished(&mut events).await;
    signal(pid, libc::SIGCONT);
    assert_eq!(finished.outcome(), Outcome::Succeeded, "{finished:?}");
    assert_eq!(finished.stdout_tail, "from a spare\n");
}

/// Spares killed from outside are skipped (the start falls back to the
/// zygote's fork); SIGKILL to the zygote takes its idle spares down too.
async fn killed_spares(dir: &Path) {
    let settings = settings(dir);
    let zygote = settings.zygote.clone().expect("zygote mode");
    let warm = run_with(&settings, &sh_agent("true"), &assign("e-warm", 60)).await;
    assert_eq!(warm.outcome(), Outcome::Succeeded, "{warm:?}");
    let held = spares(&zygote, 2).await;
    for &pid in &held {
        signal(pid, libc::SIGKILL);
    }
    for &pid in &held {
        assert!(wait_until_gone(pid as i32).await, "spare {pid} outlived SIGKILL");
    }
    let next = run_with(&settings, &sh_agent("echo after"), &assign("e-after", 60)).await;
    assert_eq!(next.outcome(), Outcome::Succeeded, "{next:?}");
    assert_eq!(next.stdout_tail, "after\n");
    let refilled = spares(&zygote, 2).await;
    assert!(refilled.iter().all(|pid| !held.contains(pid)), "new spares: {refilled:?} (killed: {held:?})");
    signal(zygote.pid().expect("zygote running"), libc::SIGKILL);
    for &pid in &refilled {
        assert!(wait_until_gone(pid as i32).await, "spare {pid} outlived its zygote");
    }
    let again = run_with(&settings, &sh_agent("echo again"), &assign("e-again", 60)).await;
    assert_eq!(again.outcome(), Outcome::Succeeded, "{again:?}");
}

/// The agent's exit code comes from its supervisor, not the zygote: it
/// arrives while the zygote is stopped (and would survive its death).
async fn exit_code_without_zygote(dir: &Path) {
    let settings = settings(dir);
    let (mut events, pid) = start_with_zygote(&settings, "sleep 0.3; echo done; exit 3", "e-code").await;
    signal(pid, libc::SIGSTOP);
    let finished = tokio::time::timeout(Duration::from_secs(5), finished(&mut events)).await;
    signal(pid, libc::SIGCONT);
    let finished = finished.expect("Finished while the zygote is stopped");
    assert_eq!(finished.outcome(), Outcome::Failed, "{finished:?}");
    assert_eq!(finished.exit_code, Some(3), "{finished:?}");
    assert_eq!(finished.stdout_tail, "done\n");
}

/// systemd stops a service with SIGTERM to every process of its cgroup:
/// the zygote must not die of it (its agents would be killed at once,
/// before the runner's grace period).
async fn sigterm_to_zygote(dir: &Path) {
    let settings = settings(dir);
    let zygote = settings.zygote.clone().expect("zygote mode");
    let (mut events, pid) = start_with_zygote(&settings, "sleep 0.5; echo survived", "e-term").await;
    signal(pid, libc::SIGTERM);
    signal(pid, libc::SIGINT);
    signal(pid, libc::SIGHUP);
    let finished = finished(&mut events).await;
    assert_eq!(finished.outcome(), Outcome::Succeeded, "{finished:?}");
    assert_eq!(finished.stdout_tail, "survived\n");
    assert_eq!(zygote.pid(), Some(pid));
}

/// A supervisor killed from outside sends no exit code; the runner waits
/// a moment for the zygote's wait status, and no longer when the zygote is
/// stopped (regression: progress polls restarted that wait forever).
async fn killed_supervisor(dir: &Path) {
    let settings = settings(dir);
    let zygote = settings.zygote.clone().expect("zygote mode");
    let (tx, mut events) = mpsc::channel(16);
    let execution = executor::start(&sh_agent("sleep 30"), &assign("e-killed", 60), &settings, tx).await.expect("shim starts");
    let zygote_pid = zygote.pid().expect("zygote running");
    signal(zygote_pid, libc::SIGSTOP);
    signal(execution.pid(), libc::SIGKILL);
    let finished = tokio::time::timeout(Duration::from_secs(5), finished(&mut events)).await;
    signal(zygote_pid, libc::SIGCONT);
    let finished = finished.expect("Finished while the zygote is stopped");
    assert_eq!(finished.outcome(), Outcome::Failed, "{finished:?}");
    assert_eq!(finished.error, "killed by signal 9", "{finished:?}");
}

/// As `punchclock_tests::skip` (this crate cannot depend on that one): says
/// so, lists it in `target/test-skips.txt` for `make test`'s closing line,
/// and fails under CI unless `allow` is `1`.
fn skip(test: &str, allow: &str, why: &str) {
    let allowed = std::env::var(allow).is_ok_and(|v| v == "1");
    assert!(
        std::env::var_os("CI").is_none() || allowed,
        "{test} cannot run here ({why}); under CI that fails: set {allow}=1 to allow the skip"
    );
    eprintln!("SKIPPED {test}: {why}");
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().map(Path::to_path_buf).unwrap_or_default();
    let target = std::env::var("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|_| root.join("target"));
    use std::io::Write;
    if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(target.join("test-skips.txt")) {
        let _ = writeln!(f, "{test}: {why}");
    }
}
