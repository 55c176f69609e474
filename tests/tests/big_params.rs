//! Issue 19, finding 3: params larger than the run record were accepted,
//! trimmed in the stored record, and a retry got `{"trimmed": ...}`
//! instead of the user's params (and SUCCEEDED); the agent's 144-byte
//! result was replaced too. On a real `dev`:
//!
//! - params over 64 KiB (a 600 KiB `TriggerTask`, a task whose
//!   `context.params` is over the limit) are refused, naming the field and
//!   the limit, through gRPC and the CLI, and nothing is created;
//! - 60 KiB params reach attempt 2 whole (the agent reports their SHA-256)
//!   while the record must be trimmed (64 KiB of control characters on
//!   stdout and stderr), and the agent's small result is kept as written.

use std::time::Duration;

use punchclock_proto::v1 as pb;
use punchclock_tests::{Proc, apply, cli_command, list_runs, status, tasks, terminal, wait_run};
use serde_json::json;
use sha2::Digest;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn params_are_refused_over_the_limit_and_kept_whole_under_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dev = Proc::dev(&dir.path().join("data"));
    apply(
        &dev.addr,
        json!({"task_id": "echo", "agent_id": "params_echo_agent",
               "execution": {"max_retries": 1, "retry_backoff": {"base_seconds": 0.1, "cap_seconds": 0.1, "jitter_seconds": 0}}}),
    )
    .await;

    // 600 KiB: refused, naming the field and the limit.
    let big = json!({"blob": "x".repeat(600 * 1024)});
    let e = tasks(&dev.addr)
        .await
        .trigger_task(pb::TriggerTaskRequest { task_id: "echo".into(), params_json: big.to_string(), ..Default::default() })
        .await
        .expect_err("600 KiB of params");
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e}");
    assert!(e.message().starts_with("params:") && e.message().contains("at most 65536"), "{}", e.message());
    // (The CLI takes params as one argument: at most 128 KiB.)
    let over = json!({"blob": "x".repeat(100 * 1024)}).to_string();
    let out = cli_command(&dev.addr).args(["task", "trigger", "echo", "--params", &over]).output().expect("cli");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("params:"), "{}", String::from_utf8_lossy(&out.stderr));
    let e = tasks(&dev.addr)
        .await
        .apply_task(pb::ApplyTaskRequest {
            spec_json: json!({"task_id": "fat", "agent_id": "a", "context": {"params": {"blob": "x".repeat(100 * 1024)}}}).to_string(),
            dry_run: false,
            task: None,
        })
        .await
        .expect_err("fat context.params");
    assert!(e.message().starts_with("context.params:") && e.message().contains("at most 65536"), "{}", e.message());
    assert!(list_runs(&dev.addr, "echo").await.is_empty(), "nothing was created");

    // 60 KiB: attempt 2 gets them whole, though the record is trimmed.
    let params = json!({"blob": "y".repeat(60 * 1024), "n": 7});
    let canon = serde_json::to_vec(&params).expect("json");
    let want = hex::encode(sha2::Sha256::digest(&canon));
    let run_id = tasks(&dev.addr)
        .await
        .trigger_task(pb::TriggerTaskRequest { task_id: "echo".into(), params_json: params.to_string(), ..Default::default() })
        .await
        .expect("60 KiB of params")
        .into_inner()
        .run_id;
    let run = wait_run(&dev.addr, "echo", Duration::from_secs(60), |r| r.run_id == run_id && terminal(r)).await;
    assert_eq!(status(&run), pb::RunStatus::Succeeded, "{run:#?}");
    let run =
        punchclock_tests::runs(&dev.addr).await.get_run(pb::GetRunRequest { run_id: run_id.clone() }).await.expect("get").into_inner();
    assert_eq!(run.attempts.len(), 2);
    let result: serde_json::Value = serde_json::from_str(&run.result_json).expect("result json");
    assert_eq!(result["attempt"], 2, "the small result is kept as written: {result}");
    assert_eq!(result["params_sha256"], want.as_str(), "attempt 2 got the user's params whole");
    let trimmed = |t: &str| t.starts_with("[trimmed to fit the store]");
    assert!(trimmed(&run.stdout_tail) || trimmed(&run.stderr_tail), "the record had to be trimmed (an output tail, the largest part)");
    let stored: serde_json::Value = serde_json::from_str(&run.context_json).expect("context");
    assert_eq!(stored["params"], params, "the stored params are whole");
}
