//! Issue 9, acceptance 5: `punchclock stats` gives the numbers this test
//! computes itself from `runs list -o json` (fired, outcomes, retried,
//! skipped by reason, dispatch and start lag p50/p99/max), and both
//! replicas of an etcd cluster give the same answer.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use punchclock_proto::v1 as pb;
use punchclock_tests::etcd::{Etcd, free_port};
use punchclock_tests::{KeepLogsOnPanic, Proc, apply, cli, status, wait_leader, wait_n_runs};
use serde_json::{Value, json};

const TASKS: [&str; 3] = ["st_ok", "st_retry", "st_overlap"];

fn time(v: &Value) -> Option<DateTime<Utc>> {
    v.as_str().map(|s| s.parse().expect("RFC 3339"))
}

/// Nearest-rank percentile, as README "Scheduling stats" defines it.
fn lag(mut v: Vec<i64>) -> Value {
    v.sort_unstable();
    let n = v.len();
    if n == 0 {
        return json!({"count": 0, "p50_ms": 0, "p99_ms": 0, "max_ms": 0});
    }
    let rank = |p: usize| v[(p * n).div_ceil(100).clamp(1, n) - 1];
    json!({"count": n, "p50_ms": rank(50), "p99_ms": rank(99), "max_ms": v[n - 1]})
}

/// The stats of one task from its runs as `runs list -o json` shows them.
fn expected(task: &str, runs: &[Value], from: DateTime<Utc>, until: DateTime<Utc>) -> Value {
    let (mut fired, mut ok, mut failed, mut timed_out, mut cancelled, mut active, mut retried, mut attempts) = (0, 0, 0, 0, 0, 0, 0, 0);
    let mut skipped: BTreeMap<String, u64> = BTreeMap::new();
    let (mut dispatch, mut start) = (Vec::new(), Vec::new());
    for r in runs {
        let slot = time(&r["scheduled_at"]).expect("slot");
        if slot < from || slot > until {
            continue;
        }
        let status = r["status"].as_str().expect("status");
        if status == "SKIPPED" {
            *skipped.entry(r["skip_reason"].as_str().expect("reason").to_string()).or_default() += r["missed_count"].as_u64().unwrap_or(1);
            continue;
        }
        fired += 1;
        match status {
            "SUCCEEDED" => ok += 1,
            "FAILED" => failed += 1,
            "TIMEOUT" => timed_out += 1,
            "CANCELLED" => cancelled += 1,
            _ => active += 1,
        }
        let a = r["attempts"].as_array().expect("attempts");
        attempts += a.len();
        if a.len() > 1 {
            retried += 1;
        }
        let ms = |t: DateTime<Utc>| (t - slot).num_milliseconds().max(0);
        if let Some(d) = a.first().and_then(|a| time(&a["dispatched_at"])) {
            dispatch.push(ms(d));
        }
        if let Some(s) = time(&r["actual_started_at"]) {
            start.push(ms(s));
        }
    }
    json!({"task_id": task, "fired": fired, "succeeded": ok, "failed": failed, "timed_out": timed_out, "cancelled": cancelled,
           "in_progress": active, "retried": retried, "attempts": attempts, "skipped": skipped,
           "dispatch_lag": lag(dispatch), "start_lag": lag(start)})
}

fn json_of(addr: &str, args: &[&str]) -> Value {
    let mut a = vec!["-o", "json"];
    a.extend_from_slice(args);
    serde_json::from_str(&cli(addr, &a)).expect("JSON output")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_equal_what_the_run_records_say_on_every_replica() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "stats");
    let etcd = Etcd::start(1).await;
    let ports = [free_port(), free_port()];
    let servers =
        [Proc::server(&etcd.store_url(), "cp0", ports[0], dir.path()), Proc::server(&etcd.store_url(), "cp1", ports[1], dir.path())];
    let addrs: Vec<String> = servers.iter().map(|s| s.addr.clone()).collect();
    let _runner = Proc::runner(&addrs.join(","), "r1", dir.path());
    wait_leader(&addrs, Duration::from_secs(20), |_| true).await;

    let every = json!({"type": "interval", "every": "1s"});
    apply(&addrs[0], json!({"task_id": "st_ok", "agent_id": "ok_agent", "trigger": every})).await;
    apply(
        &addrs[0],
        json!({"task_id": "st_retry", "agent_id": "fail_agent", "trigger": {"type": "interval", "every": "2s"},
        "execution": {"max_retries": 1, "retry_backoff": {"base_seconds": 0.2, "cap_seconds": 0.2, "jitter_seconds": 0}}}),
    )
    .await;
    apply(&addrs[0], json!({"task_id": "st_overlap", "agent_id": "slow_agent", "trigger": every})).await;
    // Enough of each: successes, retried failures, overlap skips.
    wait_n_runs(&addrs[0], "st_ok", 5, Duration::from_secs(30), |r| status(r) == pb::RunStatus::Succeeded).await;
    wait_n_runs(&addrs[0], "st_retry", 2, Duration::from_secs(30), |r| r.attempts.len() == 2 && status(r) == pb::RunStatus::Failed).await;
    wait_n_runs(&addrs[0], "st_overlap", 3, Duration::from_secs(30), |r| status(r) == pb::RunStatus::Skipped).await;
    for t in TASKS {
        cli(&addrs[0], &["task", "pause", t]);
    }
    // Nothing changes any more once every run is final.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let runs = json_of(&addrs[0], &["runs", "list", "--limit", "1000"]);
        if runs.as_array().expect("array").iter().all(|r| !matches!(r["status"].as_str(), Some("PENDING" | "RUNNING" | "RETRYING"))) {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "runs did not finish: {runs:#}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }

    let stats = json_of(&addrs[0], &["stats", "--since", "1h"]);
    let from = time(&stats["window_start"]).expect("window_start");
    let until = time(&stats["window_end"]).expect("window_end");
    assert!(until - from == chrono::Duration::hours(1));
    let by_task: BTreeMap<String, Value> =
        stats["tasks"].as_array().expect("tasks").iter().map(|t| (t["task_id"].as_str().unwrap().to_string(), t.clone())).collect();
    for t in TASKS {
        let runs = json_of(&addrs[0], &["runs", "list", "--task", t, "--limit", "1000"]);
        let want = expected(t, runs.as_array().expect("runs"), from, until);
        assert_eq!(by_task.get(t), Some(&want), "stats of {t}");
        // One task alone gives the same figures.
        let one = json_of(&addrs[1], &["stats", "--task", t, "--since", "1h"]);
        let mut got = one["tasks"][0].clone();
        assert_eq!(got.as_object_mut().map(|o| o.len()), want.as_object().map(|o| o.len()));
        assert_eq!(got, want, "stats --task {t} on the other replica");
    }
    assert!(by_task["st_retry"]["retried"].as_u64().unwrap() >= 2);
    assert!(by_task["st_overlap"]["skipped"]["concurrency_limit"].as_u64().unwrap() >= 3);
    assert!(by_task["st_ok"]["start_lag"]["count"].as_u64().unwrap() >= 5);
    // The total adds the tasks up.
    let total_fired: u64 = TASKS.iter().map(|t| by_task[*t]["fired"].as_u64().unwrap()).sum();
    assert_eq!(stats["total"]["fired"].as_u64(), Some(total_fired));
    // The other replica answers the same for everything.
    let other = json_of(&addrs[1], &["stats", "--since", "1h"]);
    assert_eq!(other["tasks"], stats["tasks"], "a follower answers like the leader");
    let table = cli(&addrs[1], &["stats"]);
    assert!(table.contains("DISPATCH_LAG") && table.contains("st_overlap"), "{table}");
}
