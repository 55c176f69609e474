//! Issue 7, acceptance 1 (correctness): 10,000 tasks due on the same
//! second all fire — every slot gets its run, none SKIPPED, all succeed —
//! and the runner stays connected through the burst. Before, runs were
//! created one at a time at ~30/s, most slots were skipped as misfired, and
//! the runner's stream broke.
//!
//! `punchclock dev --slots 4096` with an agent of `true`; the 10,000 tasks
//! are one-shots at one instant, registered before it.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use futures::StreamExt;
use punchclock_proto::v1 as pb;
use punchclock_tests::{KeepLogsOnPanic, Proc, apply_all, status, tasks};

const TASKS: usize = 10_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_slots_on_one_second_all_run() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "burst");
    let data = dir.path().join("data");
    let d = data.to_string_lossy().to_string();
    let dev = Proc::start(
        &[
            "dev",
            "--data-dir",
            &d,
            "--listen",
            "127.0.0.1:0",
            "--http-listen",
            "127.0.0.1:0",
            "--agents",
            "tests/agents.yaml",
            "--slots",
            "4096",
        ],
        &dir.path().join("dev.log"),
        true,
    );
    // One instant far enough ahead for the registration, on a whole second.
    let started = Instant::now();
    let at = chrono::DateTime::from_timestamp(chrono::Utc::now().timestamp() + 45, 0).expect("instant");
    let client = tasks(&dev.addr).await;
    let specs = (0..TASKS).map(|i| {
        serde_json::json!({"task_id": format!("b{i:05}"), "agent_id": "true_agent", "trigger": {"type": "once", "at": at.to_rfc3339()}})
    });
    apply_all(&client, specs).await;
    let registered = started.elapsed();
    assert!(chrono::Utc::now() < at, "registration took {registered:?}, past the burst instant");
    let runner_before = runner(&dev.addr).await;

    // Every run of the burst, as they finish.
    let mut watch = punchclock_tests::watch_runs(&dev.addr, "").await;
    let mut done: HashSet<String> = HashSet::new();
    let outcome = tokio::time::timeout(Duration::from_secs(240), async {
        while let Some(r) = watch.next().await {
            let r = r.expect("watch item");
            assert_ne!(status(&r), pb::RunStatus::Skipped, "a slot of the burst was skipped: {r:#?}");
            if punchclock_tests::terminal(&r) {
                assert_eq!(status(&r), pb::RunStatus::Succeeded, "{r:#?}");
                done.insert(r.run_id.clone());
                if done.len() == TASKS {
                    return;
                }
            }
        }
    })
    .await;
    let elapsed = chrono::Utc::now() - at;
    assert!(outcome.is_ok(), "{} of {TASKS} runs done {} s after the burst", done.len(), elapsed.num_seconds());
    println!(
        "burst: {TASKS} tasks registered in {registered:?}; all ran and succeeded within {} ms of the slot",
        elapsed.num_milliseconds()
    );

    let runner_after = runner(&dev.addr).await;
    assert_eq!(runner_after.connected_at, runner_before.connected_at, "the runner's stream survived the burst");
    let log = dev.log_text();
    assert!(!log.contains("disconnecting runner") && !log.contains("runner silent"), "the runner was cut off during the burst");
}

async fn runner(addr: &str) -> pb::Runner {
    pb::cluster_service_client::ClusterServiceClient::new(punchclock_tests::channel(addr).await)
        .list_runners(pb::ListRunnersRequest {})
        .await
        .expect("runners")
        .into_inner()
        .runners
        .into_iter()
        .next()
        .expect("the dev runner")
}
