//! Issue 8, acceptance 3: on a real etcd (1.5 MiB request limit), an agent
//! with a 1 MB result that writes 1 MiB of binary noise (every byte value,
//! ~6 bytes each once JSON-escaped) on stdout and on stderr ends SUCCEEDED;
//! the stored record fits, and what was cut is marked.

use std::time::Duration;

use punchclock_proto::v1 as pb;
use punchclock_tests::etcd::{Etcd, free_port};
use punchclock_tests::{KeepLogsOnPanic, Proc, apply, cli, status, terminal, wait_leader, wait_run};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_with_megabytes_of_result_and_output_succeeds_trimmed_on_etcd() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "big_records");
    let etcd = Etcd::start(1).await;
    let server = Proc::server(&etcd.store_url(), "cp0", free_port(), dir.path());
    wait_leader(std::slice::from_ref(&server.addr), Duration::from_secs(30), |_| true).await;
    let _runner = Proc::runner(&server.addr, "r1", dir.path());
    apply(
        &server.addr,
        serde_json::json!({"task_id": "big", "agent_id": "big_output_agent", "trigger": {"type": "cron", "expr": "0 0 0 1 1 *"}}),
    )
    .await;
    cli(&server.addr, &["task", "trigger", "big"]);

    let run = wait_run(&server.addr, "big", Duration::from_secs(60), terminal).await;
    assert_eq!(status(&run), pb::RunStatus::Succeeded, "{:?}", run.error);
    // Each tail: its last 64 KiB, saying how much came before.
    for tail in [&run.stdout_tail, &run.stderr_tail] {
        assert!(tail.starts_with("[trimmed: ") && tail.contains(" earlier bytes not kept] "), "tail: {:.80}", tail);
        assert!(tail.len() <= 64 * 1024);
    }
    let result: serde_json::Value = serde_json::from_str(&run.result_json).expect("result JSON");
    assert_eq!(result["trimmed"], true, "the result is replaced by a marker: {result}");
    assert!(result["bytes"].as_u64().is_some_and(|b| b > 1_000_000), "the marker says how large it was: {result}");
    let attempt = run.attempts.first().expect("an attempt");
    assert_eq!(attempt.outcome, "succeeded");
}
