//! Issue 19, finding 2: a slot later than `misfire_grace_seconds` when the
//! engine gets to it is a misfire, whatever made it late, and deadlines
//! measure elapsed time. Real `punchclock dev` processes:
//!
//! - `a_stopped_leader_leaves_one_misfire_record`: the leader SIGSTOPped
//!   40 s with a 1-second task under `misfire_policy: skip` ran 39 slots at
//!   once; now its late slots are one coalesced SKIPPED record saying why.
//! - `a_wall_clock_step_is_one_misfire_record_and_ends_no_timeout`: `dev`
//!   under libfaketime (Debian `faketime`; the monotonic clock left real,
//!   as an NTP step leaves it) steps its wall clock an hour forward: a
//!   1-second task leaves one coalesced record instead of 3,600 runs, a
//!   running attempt with a 600 s timeout succeeds, a PENDING run's 120 s
//!   start timeout does not expire, and no runner is lost.

use std::path::Path;
use std::time::Duration;

use chrono::{DateTime, Utc};
use punchclock_proto::v1 as pb;
use punchclock_tests::{Proc, apply, at, list_runs, status, wait_run};
use serde_json::json;

fn skip_reason(r: &pb::Run) -> pb::SkipReason {
    pb::SkipReason::try_from(r.skip).unwrap_or(pb::SkipReason::Unspecified)
}

/// The task's records with their slot, oldest first.
async fn records(addr: &str, task: &str) -> Vec<(DateTime<Utc>, pb::Run)> {
    let mut v: Vec<(DateTime<Utc>, pb::Run)> =
        list_runs(addr, task).await.into_iter().filter_map(|r| at(&r.scheduled_at).map(|t| (t, r))).collect();
    v.sort_by_key(|(t, _)| *t);
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_leader_leaves_one_misfire_record() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dev = Proc::dev(&dir.path().join("data"));
    apply(
        &dev.addr,
        json!({"task_id": "tick", "agent_id": "true_agent", "trigger": {"type": "interval", "every": "1s"},
               "execution": {"concurrency_limit": 100, "misfire_policy": "skip", "misfire_grace_seconds": 10}}),
    )
    .await;
    wait_run(&dev.addr, "tick", Duration::from_secs(30), |r| status(r) == pb::RunStatus::Succeeded).await;

    dev.signal(libc::SIGSTOP);
    let stopped = Utc::now();
    // The scenario itself: the leader stays stopped 40 s.
    tokio::time::sleep(Duration::from_secs(40)).await;
    dev.signal(libc::SIGCONT);
    let resumed = Utc::now();
    // The schedule goes on after the resume.
    let after = resumed + chrono::Duration::seconds(3);
    wait_run(&dev.addr, "tick", Duration::from_secs(60), |r| {
        status(r) == pb::RunStatus::Succeeded && at(&r.scheduled_at).is_some_and(|t| t > after)
    })
    .await;

    let recs = records(&dev.addr, "tick").await;
    let inside = |t: DateTime<Utc>| t > stopped + chrono::Duration::seconds(1) && t < resumed - chrono::Duration::seconds(1);
    let ran: Vec<DateTime<Utc>> = recs.iter().filter(|(t, r)| inside(*t) && status(r) != pb::RunStatus::Skipped).map(|(t, _)| *t).collect();
    assert!(ran.is_empty(), "no slot of the stop runs under skip; ran: {ran:?}");
    let misfired: Vec<&pb::Run> = recs.iter().map(|(_, r)| r).filter(|r| skip_reason(r) == pb::SkipReason::Misfired).collect();
    assert_eq!(misfired.len(), 1, "one coalesced record: {misfired:#?}");
    let m = misfired[0];
    let (from, until) = (at(&m.missed_from).expect("from"), at(&m.missed_until).expect("until"));
    assert!(from <= stopped + chrono::Duration::seconds(2) && until >= resumed - chrono::Duration::seconds(2), "{from}..{until}");
    assert!(m.missed_count >= 38, "{}", m.missed_count);
    assert!(m.error.contains("this leader was busy or stopped"), "the record says why: {}", m.error);
    let singles = recs.iter().filter(|(t, r)| inside(*t) && skip_reason(r) == pb::SkipReason::ConcurrencyLimit).count();
    assert_eq!(singles, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wall_clock_step_is_one_misfire_record_and_ends_no_timeout() {
    let lib = Path::new("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1");
    assert!(lib.exists(), "libfaketime (Debian package faketime; make deps installs it)");
    let dir = tempfile::tempdir().expect("tempdir");
    let rc = dir.path().join("faketime.rc");
    std::fs::write(&rc, "+0\n").expect("rc");
    let rc_s = rc.to_string_lossy().to_string();
    let env = [
        ("LD_PRELOAD", lib.to_str().expect("path")),
        ("FAKETIME_TIMESTAMP_FILE", rc_s.as_str()),
        // The step moves the wall clock only, as NTP's would.
        ("FAKETIME_DONT_FAKE_MONOTONIC", "1"),
        ("FAKETIME_CACHE_DURATION", "1"),
    ];
    let data = dir.path().join("data");
    let dev = Proc::dev_env(&data, 8, &data.with_extension("log"), Path::new("tests/agents.yaml"), &[], &env);
    let addr = dev.addr.clone();
    apply(
        &addr,
        json!({"task_id": "tick", "agent_id": "true_agent", "trigger": {"type": "interval", "every": "1s"},
               "execution": {"concurrency_limit": 100, "misfire_policy": "skip"}}),
    )
    .await;
    apply(&addr, json!({"task_id": "long", "agent_id": "long_sleep_agent", "execution": {"timeout_seconds": 600}})).await;
    apply(&addr, json!({"task_id": "waiting", "agent_id": "nobody_serves_this", "execution": {"start_timeout_seconds": 120}})).await;
    wait_run(&addr, "tick", Duration::from_secs(30), |r| status(r) == pb::RunStatus::Succeeded).await;
    punchclock_tests::cli(&addr, &["task", "trigger", "long", "--key", "one"]);
    punchclock_tests::cli(&addr, &["task", "trigger", "waiting", "--key", "one"]);
    wait_run(&addr, "long", Duration::from_secs(30), |r| r.actual_started_at.is_some()).await;

    // The wall clock steps an hour forward.
    std::fs::write(&rc, "+3600s\n").expect("rc");
    let stepped = Utc::now();
    let resumed = stepped + chrono::Duration::seconds(3600 + 3);
    wait_run(&addr, "tick", Duration::from_secs(60), |r| {
        status(r) == pb::RunStatus::Succeeded && at(&r.scheduled_at).is_some_and(|t| t > resumed)
    })
    .await;
    let recs = records(&addr, "tick").await;
    let inside = |t: DateTime<Utc>| t > stepped + chrono::Duration::seconds(3) && t < stepped + chrono::Duration::seconds(3600 - 3);
    let ran = recs.iter().filter(|(t, r)| inside(*t) && status(r) != pb::RunStatus::Skipped).count();
    assert_eq!(ran, 0, "none of the hour's slots runs under skip");
    let misfired: Vec<&pb::Run> = recs.iter().map(|(_, r)| r).filter(|r| skip_reason(r) == pb::SkipReason::Misfired).collect();
    assert_eq!(misfired.len(), 1, "one coalesced record: {misfired:#?}");
    assert!(misfired[0].missed_count >= 3590, "{}", misfired[0].missed_count);
    assert!(misfired[0].error.contains("wall clock stepped"), "the record says why: {}", misfired[0].error);

    // Deadlines are elapsed time: the 25 s agent, 600 s timeout, succeeds.
    let long = wait_run(&addr, "long", Duration::from_secs(60), punchclock_tests::terminal).await;
    assert_eq!(status(&long), pb::RunStatus::Succeeded, "{long:#?}");
    let waiting = list_runs(&addr, "waiting").await;
    assert_eq!(waiting.len(), 1);
    assert_eq!(status(&waiting[0]), pb::RunStatus::Pending, "its 120 s start timeout has not elapsed: {:#?}", waiting[0]);
    let log = dev.log_text();
    assert!(!log.contains("runner lost") && !log.contains("runner silent"), "the step made the runner look silent");
    assert!(log.contains("the wall clock stepped forward"), "the step is logged");
}
