//! The process executor against real processes (no shim).

mod common;

use std::path::Path;
use std::time::Duration;

use chrono::Utc;
use common::{PATIENCE, dir_entries, sh_agent, wait_until_gone};
use punchclock_agent_runner::executor::{self, ExecutionEvent, ExecutorSettings};
use punchclock_agent_runner::{Error, Execution, ProcessAgent};
use punchclock_proto::v1::{Assign, Finished, Outcome, ProgressReport};
use tokio::sync::mpsc;

fn settings(work_dir: &Path) -> ExecutorSettings {
    ExecutorSettings {
        work_dir: work_dir.to_owned(),
        kill_grace: Duration::from_millis(300),
        shim: None,
        fence: punchclock_agent_runner::fence::Fence::new(work_dir.join("fence"), Duration::from_millis(300)),
        dirs: Default::default(),
        zygote: None,
        http: Default::default(),
        callbacks: Default::default(),
        cgroups: None,
        agent_nice: 0,
        starts: Default::default(),
    }
}

fn timestamp(t: chrono::DateTime<Utc>) -> prost_types::Timestamp {
    punchclock_proto::time::to_timestamp(t)
}

fn assign(execution_id: &str, timeout: Duration) -> Assign {
    let now = Utc::now();
    Assign {
        run_id: format!("run-{execution_id}"),
        execution_id: execution_id.into(),
        attempt: 2,
        task_id: "task-1".into(),
        agent_id: "agent".into(),
        context_json: r#"{"params":{"n":1}}"#.into(),
        checkpoint_json: r#"{"page":1}"#.into(),
        deadline: Some(timestamp(now + timeout)),
        timeout_seconds: timeout.as_secs(),
        fencing_token: 1,
        traceparent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into(),
        scheduled_at: Some(timestamp(now)),
        tracestate: "vendor=abc".into(),
        baggage: "user=alice".into(),
        limits: None,
    }
}

struct Started {
    execution: Execution,
    events: mpsc::Receiver<ExecutionEvent>,
}

async fn start(agent: &ProcessAgent, assign: &Assign, work_dir: &Path) -> Started {
    let (tx, events) = mpsc::channel(64);
    let execution = executor::start(agent, assign, &settings(work_dir), tx).await.expect("agent starts");
    Started { execution, events }
}

async fn next_event(events: &mut mpsc::Receiver<ExecutionEvent>) -> ExecutionEvent {
    tokio::time::timeout(PATIENCE, events.recv()).await.expect("an event in time").expect("events channel open")
}

async fn next_progress(events: &mut mpsc::Receiver<ExecutionEvent>) -> ProgressReport {
    match next_event(events).await {
        ExecutionEvent::Progress(progress) => progress,
        ExecutionEvent::Finished(finished) => panic!("expected progress, got {finished:?}"),
    }
}

/// Collects events up to and including `Finished`.
async fn until_finished(events: &mut mpsc::Receiver<ExecutionEvent>) -> (Vec<ProgressReport>, Finished) {
    let mut progress = Vec::new();
    loop {
        match next_event(events).await {
            ExecutionEvent::Progress(p) => progress.push(p),
            ExecutionEvent::Finished(finished) => return (progress, finished),
        }
    }
}

#[tokio::test]
async fn success_reports_progress_while_running_then_the_result() {
    let work = tempfile::tempdir().expect("tempdir");
    let gate = work.path().join("gate");
    let mut agent = sh_agent(
        r#"
        context=$(cat)
        echo '{"percent": 10, "message": "starting"}' >> "$PUNCHCLOCK_PROGRESS_FILE"
        while [ ! -e "$GATE" ]; do sleep 0.02; done
        echo 'not json' >> "$PUNCHCLOCK_PROGRESS_FILE"
        printf '{"percent": 100, "checkpoint": {"page": 2}}\n' >> "$PUNCHCLOCK_PROGRESS_FILE"
        cat > "$PUNCHCLOCK_RESULT_FILE" <<JSON
        {"context": $context, "checkpoint": $(cat "$PUNCHCLOCK_CHECKPOINT_FILE"),
         "run": "$PUNCHCLOCK_RUN_ID", "execution": "$PUNCHCLOCK_EXECUTION_ID", "task": "$PUNCHCLOCK_TASK_ID",
         "attempt": "$PUNCHCLOCK_ATTEMPT", "deadline": "$PUNCHCLOCK_DEADLINE",
         "scheduled_at": "$PUNCHCLOCK_SCHEDULED_AT", "traceparent": "$TRACEPARENT", "tracestate": "$TRACESTATE", "baggage": "$BAGGAGE", "cwd": "$(pwd)"}
JSON
        echo out
        echo err >&2
        "#,
    );
    agent.env.insert("GATE".into(), gate.display().to_string());
    agent.working_dir = Some(work.path().to_owned());
    let runs = work.path().join("runs");
    let assign = assign("e-ok", Duration::from_secs(60));
    let mut started = start(&agent, &assign, &runs).await;
    assert!(started.execution.pid() > 0);
    assert_eq!(started.execution.execution_id(), "e-ok");

    // Progress arrives while the agent is still running (it waits for the gate).
    let first = next_progress(&mut started.events).await;
    assert_eq!(first.run_id, "run-e-ok");
    assert_eq!(first.execution_id, "e-ok");
    assert_eq!(first.percent, Some(10.0));
    assert_eq!(first.message, "starting");
    assert_eq!(first.checkpoint_json, "");
    std::fs::write(&gate, "").expect("open the gate");

    let (progress, finished) = until_finished(&mut started.events).await;
    assert_eq!(progress.len(), 1, "the malformed line is skipped: {progress:?}");
    assert_eq!(progress[0].percent, Some(100.0));
    assert_eq!(progress[0].checkpoint_json, r#"{"page":2}"#);

    assert_eq!(finished.outcome(), Outcome::Succeeded, "{finished:?}");
    assert_eq!(finished.exit_code, Some(0));
    assert_eq!(finished.error, "");
    assert_eq!(finished.stdout_tail, "out\n");
    assert_eq!(finished.stderr_tail, "err\n");
    assert!(finished.finished_at.is_some());
    let result: serde_json::Value = serde_json::from_str(&finished.result_json).expect("result is JSON");
    assert_eq!(result["context"], serde_json::json!({"params": {"n": 1}}));
    assert_eq!(result["checkpoint"], serde_json::json!({"page": 1}));
    assert_eq!(result["run"], "run-e-ok");
    assert_eq!(result["execution"], "e-ok");
    assert_eq!(result["task"], "task-1");
    assert_eq!(result["attempt"], "2");
    // TRACEPARENT is the runner's invoke_agent span: the assignment's
    // trace, a span of its own (a child of the assignment's).
    let given = punchclock_proto::tracecontext::parse(result["traceparent"].as_str().expect("traceparent")).expect("valid");
    let assigned = punchclock_proto::tracecontext::parse(&assign.traceparent).expect("valid");
    assert_eq!(given.0, assigned.0, "same trace");
    assert_ne!(given.1, assigned.1, "the agent's parent is the invoke_agent span, not the attempt span");
    assert_eq!((result["tracestate"].as_str(), result["baggage"].as_str()), (Some("vendor=abc"), Some("user=alice")));
    assert_eq!(result["cwd"], work.path().canonicalize().expect("cwd").display().to_string());
    for field in ["deadline", "scheduled_at"] {
        let text = result[field].as_str().expect("a string");
        assert!(text.ends_with('Z'), "{field}: {text}");
        chrono::DateTime::parse_from_rfc3339(text).expect("RFC 3339");
    }

    assert!(dir_entries(&runs).is_empty(), "execution directory removed (no shim: never reused)");
}

#[tokio::test]
async fn non_zero_exit_fails_with_the_exit_code_and_last_stderr_line() {
    let work = tempfile::tempdir().expect("tempdir");
    let agent = sh_agent("echo 'first problem' >&2; echo 'it broke' >&2; exit 3");
    let mut started = start(&agent, &assign("e-fail", Duration::from_secs(60)), work.path()).await;
    let (_, finished) = until_finished(&mut started.events).await;
    assert_eq!(finished.outcome(), Outcome::Failed);
    assert_eq!(finished.exit_code, Some(3));
    assert_eq!(finished.error, "exit code 3: it broke");
    assert_eq!(finished.result_json, "");
}

#[tokio::test]
async fn death_by_signal_fails_naming_the_signal() {
    let work = tempfile::tempdir().expect("tempdir");
    let agent = sh_agent("kill -KILL $$");
    let mut started = start(&agent, &assign("e-signal", Duration::from_secs(60)), work.path()).await;
    let (_, finished) = until_finished(&mut started.events).await;
    assert_eq!(finished.outcome(), Outcome::Failed);
    assert_eq!(finished.exit_code, None);
    assert_eq!(finished.error, "killed by signal 9");
}

#[tokio::test]
async fn invalid_result_json_is_sent_as_a_string() {
    let work = tempfile::tempdir().expect("tempdir");
    let agent = sh_agent(r#"printf 'plain text' > "$PUNCHCLOCK_RESULT_FILE""#);
    let mut started = start(&agent, &assign("e-text", Duration::from_secs(60)), work.path()).await;
    let (_, finished) = until_finished(&mut started.events).await;
    assert_eq!(finished.outcome(), Outcome::Succeeded);
    assert_eq!(finished.result_json, r#""plain text""#);
    assert!(finished.error.contains("not valid JSON"), "{}", finished.error);
}

#[tokio::test]
async fn timeout_kills_the_whole_process_group() {
    let work = tempfile::tempdir().expect("tempdir");
    // Both the agent and its background child ignore SIGTERM: only the
    // SIGKILL to the group after the grace period stops them.
    let agent = sh_agent(
        r#"
        trap '' TERM
        sleep 3600 &
        echo "{\"message\": \"$!\"}" >> "$PUNCHCLOCK_PROGRESS_FILE"
        wait
        "#,
    );
    let began = tokio::time::Instant::now();
    let mut started = start(&agent, &assign("e-timeout", Duration::from_secs(1)), work.path()).await;

    let progress = next_progress(&mut started.events).await;
    let grandchild: i32 = progress.message.parse().expect("the background child's pid");
    let (_, finished) = until_finished(&mut started.events).await;

    assert_eq!(finished.outcome(), Outcome::Timeout, "{finished:?}");
    assert_eq!(finished.error, "timed out after 1 s");
    assert!(began.elapsed() >= Duration::from_millis(900), "not before the deadline");
    assert!(wait_until_gone(grandchild).await, "background child {grandchild} survived");
    assert!(dir_entries(work.path()).is_empty(), "execution directory removed (no shim: never reused)");
}

#[tokio::test]
async fn cancel_stops_the_agent_and_reports_cancelled() {
    let work = tempfile::tempdir().expect("tempdir");
    let agent = sh_agent(r#"echo '{"message": "ready"}' >> "$PUNCHCLOCK_PROGRESS_FILE"; exec sleep 3600"#);
    let mut started = start(&agent, &assign("e-cancel", Duration::from_secs(60)), work.path()).await;
    let pid = i32::try_from(started.execution.pid()).expect("pid fits");

    assert_eq!(next_progress(&mut started.events).await.message, "ready");
    started.execution.cancel("operator request");
    started.execution.cancel("ignored: only the first cancel counts");
    let (_, finished) = until_finished(&mut started.events).await;

    assert_eq!(finished.outcome(), Outcome::Cancelled, "{finished:?}");
    assert_eq!(finished.error, "cancelled: operator request");
    assert!(wait_until_gone(pid).await, "agent {pid} survived");
}

#[tokio::test]
async fn spawn_failure_is_an_error_and_leaves_nothing_behind() {
    let work = tempfile::tempdir().expect("tempdir");
    let agent = ProcessAgent { command: vec!["/nonexistent/punchclock-agent".into()], ..sh_agent("") };
    let (tx, _events) = mpsc::channel(1);
    let err =
        executor::start(&agent, &assign("e-missing", Duration::from_secs(60)), &settings(work.path()), tx).await.expect_err("cannot spawn");
    assert!(matches!(err, Error::Spawn { .. }), "{err}");
    assert!(dir_entries(work.path()).is_empty(), "execution directory removed (no shim: never reused)");
}

#[tokio::test]
async fn env_from_file_is_read_at_each_start_and_a_missing_file_names_only_the_variable() {
    let work = tempfile::tempdir().expect("tempdir");
    let secret = work.path().join("api_key");
    std::fs::write(&secret, "s3cret-v1\n").expect("secret");
    let mut agent = sh_agent(r#"printf '{"key": "%s"}' "$API_KEY" > "$PUNCHCLOCK_RESULT_FILE""#);
    agent.env_from_file.insert("API_KEY".into(), secret.clone());
    let runs = work.path().join("runs");
    let mut started = start(&agent, &assign("e-secret-1", Duration::from_secs(60)), &runs).await;
    let (_, finished) = until_finished(&mut started.events).await;
    assert_eq!(finished.result_json, r#"{"key":"s3cret-v1"}"#, "one trailing newline dropped");
    // Rotated: the next start reads the new value.
    std::fs::write(&secret, "s3cret-v2").expect("rotate");
    let mut started = start(&agent, &assign("e-secret-2", Duration::from_secs(60)), &runs).await;
    let (_, finished) = until_finished(&mut started.events).await;
    assert_eq!(finished.result_json, r#"{"key":"s3cret-v2"}"#);
    // Gone: the start fails, naming the variable and the path.
    std::fs::remove_file(&secret).expect("rm");
    let (tx, _events) = mpsc::channel(64);
    let err = executor::start(&agent, &assign("e-secret-3", Duration::from_secs(60)), &settings(&runs), tx)
        .await
        .expect_err("no secret")
        .to_string();
    assert!(err.contains("env_from_file API_KEY: cannot read") && !err.contains("s3cret"), "{err}");
}

/// A context larger than a pipe's buffer (64 KiB) reaches the agent whole.
#[tokio::test]
async fn a_context_larger_than_the_pipe_buffer_reaches_the_agent_whole() {
    let work = tempfile::tempdir().expect("tempdir");
    let agent = sh_agent("wc -c | tr -d ' '");
    let big = format!(r#"{{"blob":"{}"}}"#, "x".repeat(300 * 1024));
    let assign = Assign { context_json: big.clone(), ..assign("exec-big-context", Duration::from_secs(30)) };
    let mut started = start(&agent, &assign, work.path()).await;
    let (_, finished) = until_finished(&mut started.events).await;
    assert_eq!(finished.outcome(), Outcome::Succeeded, "{finished:?}");
    assert_eq!(finished.stdout_tail.trim(), big.len().to_string());
}

/// An execution whose agent has exited reports only once no start is in
/// progress on the runner (the burst's starts go first), and at the latest
/// after `START_FIRST_WAIT` while starts never stop; its `finished_at` is
/// when the agent exited.
#[tokio::test]
async fn an_ended_execution_reports_after_the_starts_in_progress() {
    let work = tempfile::tempdir().expect("tempdir");
    let settings = settings(work.path());
    let agent = sh_agent("exit 0");
    let (tx, mut events) = mpsc::channel(64);
    let starting = settings.starts.enter();
    let execution = executor::start(&agent, &assign("exec-gated", Duration::from_secs(30)), &settings, tx).await.expect("starts");
    // The agent exits at once; its Finished waits for the start in progress.
    assert!(wait_until_gone(i32::try_from(execution.pid()).expect("pid")).await, "the agent exits");
    assert!(tokio::time::timeout(executor::START_FIRST_WAIT / 5, events.recv()).await.is_err(), "reported while a start was in progress");
    let released = timestamp(Utc::now());
    drop(starting);
    let ExecutionEvent::Finished(finished) = next_event(&mut events).await else { panic!("expected Finished") };
    // Its end is when the agent exited, not when the report could go.
    let ended = finished.finished_at.expect("finished_at");
    assert!((ended.seconds, ended.nanos) < (released.seconds, released.nanos), "finished_at {ended:?} after the wait");

    // A start that never ends holds reports back for START_FIRST_WAIT only.
    let (tx, mut events) = mpsc::channel(64);
    let _stuck = settings.starts.enter();
    let at = std::time::Instant::now();
    let _execution = executor::start(&agent, &assign("exec-gated-2", Duration::from_secs(30)), &settings, tx).await.expect("starts");
    assert!(matches!(next_event(&mut events).await, ExecutionEvent::Finished(_)));
    assert!(at.elapsed() >= executor::START_FIRST_WAIT, "reported after {:?}", at.elapsed());
}

/// A result file that is a FIFO, or a symlink to `/dev/zero`, is refused
/// with an error: reading the one hung the execution's report for good,
/// the other filled the runner's memory. The same for the progress file.
#[tokio::test]
async fn a_result_file_that_is_a_fifo_or_a_symlink_is_refused_not_read() {
    for (name, script) in [
        ("fifo", r#"mkfifo "$PUNCHCLOCK_RESULT_FILE"; rm -f "$PUNCHCLOCK_PROGRESS_FILE"; mkfifo "$PUNCHCLOCK_PROGRESS_FILE""#),
        (
            "symlink",
            r#"ln -s /dev/zero "$PUNCHCLOCK_RESULT_FILE"; rm -f "$PUNCHCLOCK_PROGRESS_FILE"; ln -s /dev/zero "$PUNCHCLOCK_PROGRESS_FILE""#,
        ),
    ] {
        let work = tempfile::tempdir().expect("tempdir");
        let agent = sh_agent(script);
        let mut started = start(&agent, &assign(&format!("exec-result-{name}"), Duration::from_secs(30)), work.path()).await;
        let (_, finished) = until_finished(&mut started.events).await;
        assert!(finished.error.contains("cannot read the result file"), "{name}: {finished:?}");
        assert!(finished.error.contains("regular file"), "{name}: {finished:?}");
    }
}
