//! Issue 22, part 2: CPU, memory and process limits of process agents,
//! through the cgroups of the machine the test runs on (a real
//! `punchclock dev`, its in-process runner, the agent shim and real agent
//! processes):
//!
//! - an agent allocating past its task's `memory_max` (64Mi, within its
//!   agent's 256Mi) ends FAILED with class `oom_killed` and its peak
//!   memory, while an agent running beside it on the same runner SUCCEEDS;
//! - four busy processes under `cpu: 0.5` use at most 0.6 of a core over
//!   their 5 s (the attempt's CPU seconds, from the cgroup), and the agent
//!   sees itself in the execution's cgroup;
//! - a `setsid` daemon an agent leaves behind is gone after the run;
//! - `enforce: required` limits on a runner without cgroups (a
//!   `--cgroup-root` with no hierarchy): that agent is refused with the
//!   reason, the others are offered, the runner's label says `cgroup=none`;
//!   a runner (or `dev`) left with no agent does not start.
//!
//! What is skipped: these machines have cgroup v1 (memory, cpu, cpuacct
//! and pids hierarchies) and a unified hierarchy with no controllers, so
//! the v2 layout (`memory.max`, `cpu.max`, `cgroup.kill`) is exercised only
//! on a fake tree, in `agent-runner/src/cgroup.rs`'s unit tests. Where the
//! host has no writable cgroup at all, the tests that need one say so and
//! return.

use std::time::Duration;

use punchclock_proto::v1 as pb;
use punchclock_tests::{KeepLogsOnPanic, Proc, apply, at, bin, cli, status, terminal, wait_gone, wait_run};
use serde_json::{Value, json};

/// Whether this host has a writable cgroup v1 memory and cpu hierarchy
/// for this process (else the limits cannot be exercised here).
fn cgroups_here() -> bool {
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    ["memory", "cpu"].iter().all(|c| {
        own.lines()
            .find_map(|l| {
                let mut p = l.splitn(3, ':');
                let (_, cs, path) = (p.next()?, p.next()?, p.next()?);
                cs.split(',').any(|x| x == *c).then(|| std::path::Path::new("/sys/fs/cgroup").join(c).join(path.trim_start_matches('/')))
            })
            .is_some_and(|d| tempfile::tempdir_in(&d).is_ok())
    })
}

fn agents_file(dir: &std::path::Path) -> std::path::PathBuf {
    let yaml = r#"agents:
  hog:
    type: process
    command: ["python3", "-c", "import time; b = b'x' * (200 * 1024 * 1024); time.sleep(1); print('survived')"]
    limits: {memory_max: 256Mi, enforce: required}
  steady:
    type: process
    command: ["sh", "-c", "sleep 3; printf '{\"steady\": true}' > \"$PUNCHCLOCK_RESULT_FILE\""]
    limits: {memory_max: 64Mi}
  spinner:
    type: process
    command: ["sh", "-c", "cat /proc/self/cgroup; for i in 1 2 3 4; do (while :; do :; done) & done; sleep 5"]
    limits: {cpu: 0.5, pids_max: 64, enforce: required}
  daemon:
    type: process
    command: ["sh", "-c", "setsid sleep 300 & printf '{\"daemon\": %s}' $! > \"$PUNCHCLOCK_RESULT_FILE\""]
    limits: {memory_max: 64Mi}
"#;
    let path = dir.join("agents.yaml");
    std::fs::write(&path, yaml).expect("agents file");
    path
}

fn task(id: &str, agent: &str, execution: Value) -> Value {
    json!({"task_id": id, "agent_id": agent, "execution": execution})
}

fn last_attempt(r: &pb::Run) -> pb::Attempt {
    r.attempts.last().cloned().unwrap_or_else(|| panic!("no attempt: {r:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_hold_on_this_host() {
    if !cgroups_here() {
        return punchclock_tests::skip(
            "limits_hold_on_this_host",
            "PUNCHCLOCK_SKIP_CGROUP_TESTS",
            "no writable cgroup v1 memory and cpu hierarchy for this process",
        );
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "limits");
    let agents = agents_file(dir.path());
    let dev = Proc::dev_agents(&dir.path().join("data"), 8, &dir.path().join("dev.log"), &agents, &[]);
    apply(&dev.addr, task("hog", "hog", json!({"limits": {"memory_max": "64Mi"}}))).await;
    apply(&dev.addr, task("steady", "steady", json!({}))).await;
    apply(&dev.addr, task("spinner", "spinner", json!({"timeout_seconds": 60}))).await;
    apply(&dev.addr, task("daemon", "daemon", json!({}))).await;

    // The neighbour starts first, the hog beside it.
    cli(&dev.addr, &["task", "trigger", "steady", "--key", "k"]);
    wait_run(&dev.addr, "steady", Duration::from_secs(30), |r| status(r) == pb::RunStatus::Running).await;
    cli(&dev.addr, &["task", "trigger", "hog", "--key", "k"]);
    cli(&dev.addr, &["task", "trigger", "daemon", "--key", "k"]);

    let hog = wait_run(&dev.addr, "hog", Duration::from_secs(60), terminal).await;
    let a = last_attempt(&hog);
    assert_eq!(status(&hog), pb::RunStatus::Failed, "{hog:?}");
    assert_eq!(a.class, "oom_killed", "{a:?}");
    assert!(a.error.contains("out of memory"), "{a:?}");
    assert!(!hog.stdout_tail.contains("survived"), "{hog:?}");
    // The task's 64Mi, not the agent's 256Mi: never far above it.
    let peak = a.peak_memory_bytes.expect("peak memory recorded");
    assert!(peak > 32 << 20 && peak <= 68 << 20, "peak {peak} bytes");
    let steady = wait_run(&dev.addr, "steady", Duration::from_secs(60), terminal).await;
    assert_eq!(status(&steady), pb::RunStatus::Succeeded, "the neighbour is unaffected: {steady:?}");

    // The daemon the agent left is gone with the run.
    let daemon = wait_run(&dev.addr, "daemon", Duration::from_secs(60), terminal).await;
    assert_eq!(status(&daemon), pb::RunStatus::Succeeded, "{daemon:?}");
    let pid = serde_json::from_str::<Value>(&daemon.result_json).expect("result")["daemon"].as_i64().expect("pid");
    assert!(wait_gone(pid as i32, Duration::from_secs(10)).await, "the setsid daemon {pid} outlived its run");

    // Four busy processes, half a core.
    cli(&dev.addr, &["task", "trigger", "spinner", "--key", "k"]);
    let spin = wait_run(&dev.addr, "spinner", Duration::from_secs(60), terminal).await;
    assert_eq!(status(&spin), pb::RunStatus::Succeeded, "{spin:?}");
    let a = last_attempt(&spin);
    let elapsed = (at(&a.finished_at).expect("finished") - at(&a.started_at).expect("started")).as_seconds_f64();
    let cpu = a.cpu_seconds.expect("cpu seconds recorded");
    assert!(elapsed >= 5.0, "{elapsed}");
    assert!(cpu <= 0.6 * elapsed, "{cpu} CPU seconds over {elapsed} s: more than 0.6 of a core");
    assert!(cpu >= 0.5, "{cpu} CPU seconds: the agent hardly ran");
    assert!(spin.stdout_tail.lines().any(|l| l.contains(":cpu") && l.contains("punchclock-")), "in its cgroup: {}", spin.stdout_tail);

    // Both are metrics.
    let (code, metrics) = punchclock_tests::http_get(&dev.http_addr(), "/metrics");
    assert_eq!(code, 200);
    for line in
        ["punchclock_attempt_peak_memory_bytes_count{agent_id=\"hog\"} 1", "punchclock_attempt_cpu_seconds_count{agent_id=\"spinner\"} 1"]
    {
        assert!(metrics.contains(line), "{line} in {metrics}");
    }
    assert!(metrics.contains("punchclock_attempts_ended_total{agent_id=\"hog\",status=\"failed\",class=\"oom_killed\"} 1"), "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn required_limits_without_cgroups_refuse_the_agent() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "limits_required");
    let no_cgroups = dir.path().join("no-cgroups");
    std::fs::create_dir(&no_cgroups).expect("mkdir");
    let agents = dir.path().join("agents.yaml");
    std::fs::write(
        &agents,
        "agents:\n  strict:\n    type: process\n    command: [\"true\"]\n    limits: {memory_max: 64Mi, enforce: required}\n  plain:\n    type: process\n    command: [\"true\"]\n",
    )
    .expect("agents");
    let root = no_cgroups.to_string_lossy().into_owned();
    let dev = Proc::dev_agents(&dir.path().join("data"), 2, &dir.path().join("dev.log"), &agents, &["--cgroup-root", &root]);
    let runners = punchclock_tests::wait_runners(&dev.addr, Duration::from_secs(30)).await;
    let r = runners.first().expect("the dev runner");
    assert_eq!(r.agents, vec!["plain".to_string()], "strict is not offered: {r:?}");
    assert_eq!(r.labels.get("cgroup").map(String::as_str), Some("none"), "{r:?}");
    let log = dev.log_text();
    assert!(log.contains("refusing the agent") && log.contains("strict") && log.contains("no cgroup"), "{log}");

    // A runner with nothing else to offer does not start, and says why.
    let only = dir.path().join("only.yaml");
    std::fs::write(&only, "agents:\n  strict:\n    type: process\n    command: [\"true\"]\n    limits: {cpu: 0.5, enforce: required}\n")
        .expect("agents");
    let work = dir.path().join("work").to_string_lossy().into_owned();
    let out = std::process::Command::new(bin())
        .args(["runner", "--control-plane", &dev.addr, "--agents"])
        .arg(&only)
        .args(["--runner-id", "r-strict", "--work-dir", &work, "--cgroup-root", &root])
        .output()
        .expect("runner");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("agents.strict.limits: enforce: required, but no cgroup"), "{stderr}");

    // Nor does `dev` (found by breaking it: it served on without a runner).
    let data = dir.path().join("data2").to_string_lossy().into_owned();
    let out = std::process::Command::new(bin())
        .args(["dev", "--data-dir", &data, "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0", "--agents"])
        .arg(&only)
        .args(["--cgroup-root", &root])
        .output()
        .expect("dev");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("the dev runner stopped") && stderr.contains("enforce: required, but no cgroup"), "{stderr}");
}
