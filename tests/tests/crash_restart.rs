//! Acceptance 3 (issue 2): kill -9 of `punchclock dev` mid-run, restart on
//! the same data dir. Every task and run is back; the run that was RUNNING
//! ends as a lost attempt and follows its retry policy; slots missed during
//! the outage follow the misfire policy (one coalesced record, no burst); a
//! one-shot that already ran does not run again; the killed runner's agent
//! processes do not survive it.

use std::collections::HashSet;
use std::time::Duration;

use chrono::Utc;
use punchclock_proto::v1 as pb;
use punchclock_tests::{Proc, apply, at, cli, list_runs, status, tasks, terminal, wait_gone, wait_run};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_mid_run_then_restart_loses_nothing_and_bursts_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _keep = punchclock_tests::KeepLogsOnPanic::new(dir.path(), "crash_restart");
    let data = dir.path().join("data");
    let mut a = Proc::dev(&data);

    apply(
        &a.addr,
        json!({"task_id": "long_one", "agent_id": "slow_agent",
        "execution": {"max_retries": 1, "retry_backoff": {"base_seconds": 1, "cap_seconds": 1, "jitter_seconds": 0}}}),
    )
    .await;
    apply(
        &a.addr,
        json!({"task_id": "ticker", "agent_id": "ok_agent", "trigger": {"type": "interval", "every": "2s"},
        "execution": {"misfire_policy": "run_once", "misfire_grace_seconds": 60, "concurrency_limit": 10}}),
    )
    .await;
    apply(
        &a.addr,
        json!({"task_id": "ticker_skip", "agent_id": "ok_agent", "trigger": {"type": "interval", "every": "2s"},
        "execution": {"misfire_policy": "skip", "concurrency_limit": 10}}),
    )
    .await;
    let once_at = (Utc::now() + chrono::Duration::seconds(2)).to_rfc3339();
    apply(&a.addr, json!({"task_id": "one_shot", "agent_id": "ok_agent", "trigger": {"type": "once", "at": once_at}})).await;

    let shot = wait_run(&a.addr, "one_shot", Duration::from_secs(30), terminal).await;
    assert_eq!(status(&shot), pb::RunStatus::Succeeded);
    wait_run(&a.addr, "ticker", Duration::from_secs(30), |r| status(r) == pb::RunStatus::Succeeded).await;
    cli(&a.addr, &["task", "trigger", "long_one", "--key", "crash"]);
    let running =
        wait_run(&a.addr, "long_one", Duration::from_secs(30), |r| r.progress.as_ref().is_some_and(|p| p.message.starts_with("pids ")))
            .await;
    assert_eq!(status(&running), pb::RunStatus::Running);
    let agent_pids: Vec<i32> =
        running.progress.expect("progress").message.split_whitespace().skip(1).filter_map(|p| p.parse().ok()).collect();
    let before: HashSet<String> = list_runs(&a.addr, "").await.into_iter().map(|r| r.run_id).collect();

    let killed_at = Utc::now();
    a.kill9();
    for pid in &agent_pids {
        assert!(wait_gone(*pid, Duration::from_secs(5)).await, "agent process {pid} outlived its killed runner");
    }
    // The outage: several 2 s slots of the tickers come and go with nothing running.
    tokio::time::sleep(Duration::from_secs(7)).await;
    let restarted_at = Utc::now();
    let b = Proc::dev(&data);

    // Every task and every run is back.
    let task_ids: HashSet<String> = tasks(&b.addr)
        .await
        .list_tasks(pb::ListTasksRequest { page_size: 1000, ..Default::default() })
        .await
        .expect("list")
        .into_inner()
        .tasks
        .into_iter()
        .map(|t| t.task_id)
        .collect();
    for t in ["long_one", "ticker", "ticker_skip", "one_shot"] {
        assert!(task_ids.contains(t), "task {t} lost: {task_ids:?}");
    }
    let after: HashSet<String> = list_runs(&b.addr, "").await.into_iter().map(|r| r.run_id).collect();
    assert!(before.is_subset(&after), "runs lost across the crash: {:?}", before.difference(&after).collect::<Vec<_>>());

    // The RUNNING run: its attempt is lost, the retry runs it to the end.
    let long = wait_run(&b.addr, "long_one", Duration::from_secs(60), terminal).await;
    assert_eq!(status(&long), pb::RunStatus::Succeeded, "{long:#?}");
    assert_eq!(long.attempts.len(), 2, "{long:#?}");
    assert_eq!(long.attempts[0].outcome, "lost");
    assert_eq!(long.attempts[1].outcome, "succeeded");

    // Misfires: one coalesced SKIPPED record and (run_once) one late run of the latest slot.
    let ticker = wait_run(&b.addr, "ticker", Duration::from_secs(20), |r| r.skip_reason == "misfired").await;
    assert!(ticker.missed_count >= 2, "{ticker:#?}");
    let (from, until) = (at(&ticker.missed_from).expect("from"), at(&ticker.missed_until).expect("until"));
    let latest = until + chrono::Duration::seconds(2);
    wait_run(&b.addr, "ticker", Duration::from_secs(20), |r| at(&r.scheduled_at) == Some(latest)).await;
    let runs = list_runs(&b.addr, "ticker").await;
    let covered: Vec<&pb::Run> = runs.iter().filter(|r| at(&r.scheduled_at).is_some_and(|t| t >= from && t <= until)).collect();
    assert_eq!(covered.len(), 1, "run_once: one coalesced record for the missed slots, not one per slot: {covered:#?}");
    let last: Vec<&pb::Run> = runs.iter().filter(|r| at(&r.scheduled_at) == Some(latest)).collect();
    assert_eq!(last.len(), 1, "the latest missed slot has one record");
    assert_ne!(status(last[0]), pb::RunStatus::Skipped, "run_once: the latest missed slot runs (late): {:#?}", last[0]);
    let before_gap: Vec<&pb::Run> =
        runs.iter().filter(|r| at(&r.scheduled_at).is_some_and(|t| t > killed_at + chrono::Duration::seconds(1) && t < from)).collect();
    assert!(before_gap.is_empty(), "no burst: nothing between the crash and the coalesced range: {before_gap:#?}");

    let skip = wait_run(&b.addr, "ticker_skip", Duration::from_secs(20), |r| r.skip_reason == "misfired").await;
    assert!(skip.missed_count >= 3, "{skip:#?}");
    let skip_from = at(&skip.missed_from).expect("from");
    assert!(skip_from <= killed_at + chrono::Duration::seconds(2), "the record starts where the crash stopped the schedule: {skip:#?}");
    let gap: Vec<pb::Run> = list_runs(&b.addr, "ticker_skip")
        .await
        .into_iter()
        .filter(|r| at(&r.scheduled_at).is_some_and(|t| t >= skip_from && t <= restarted_at))
        .collect();
    assert_eq!(gap.len(), 1, "skip: the whole gap is one SKIPPED record: {gap:#?}");

    // The one-shot ran once, before the crash, and never again.
    let shots = list_runs(&b.addr, "one_shot").await;
    assert_eq!(shots.len(), 1, "{shots:#?}");
    assert_eq!(shots[0].attempts.len(), 1);

    // Nothing from before the crash stays non-terminal.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let stuck: Vec<pb::Run> = list_runs(&b.addr, "").await.into_iter().filter(|r| before.contains(&r.run_id) && !terminal(r)).collect();
        if stuck.is_empty() {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "runs stuck after restart: {stuck:#?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
