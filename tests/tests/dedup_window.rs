//! Issue 35, acceptance 4: a webhook's delivery id deduplicates for
//! exactly its `dedup.ttl`, whatever the history keeps: with `ttl: 5s` on a
//! task whose runs are kept 1 h, the same id makes no new run within 5 s
//! and a new one after 6 s, and a restart in between (kill -9; the new
//! process reads the dedup key, not memory) changes nothing. Before, the id
//! found its run for as long as the run was kept (an hour here), and a ttl
//! under a minute was refused.

use std::time::{Duration, Instant};

use punchclock_tests::{KeepLogsOnPanic, Proc, apply, http_post, list_runs};
use serde_json::{Value, json};

fn deliver(http: &str, id: &str) -> (bool, String) {
    let (code, text) = http_post(http, "/hooks/d", &[("X-Delivery", id), ("Content-Type", "application/json")], Some(b"{}"));
    assert_eq!(code, 202, "{text}");
    let v: Value = serde_json::from_str(&text).expect("answer");
    (v["deduplicated"].as_bool().expect("deduplicated"), v["run_id"].as_str().expect("run_id").to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_id_deduplicates_for_its_ttl_across_a_restart() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "dedup_window");
    let data = dir.path().join("data");
    let mut dev = Proc::dev_with(&data, 4, &dir.path().join("dev.log"), &[]);
    apply(
        &dev.addr,
        json!({"task_id": "d", "agent_id": "event_agent",
               "trigger": {"type": "webhook", "path": "/hooks/d", "auth": "none", "dedup": {"header": "X-Delivery", "ttl": "5s"}},
               "history": {"keep_last": 1000, "max_age": "1h"},
               "execution": {"overlap_policy": "queue", "concurrency_limit": 4}}),
    )
    .await;

    let first_at = Instant::now();
    let (dup, first) = deliver(&dev.http_addr(), "k1");
    assert!(!dup, "the first delivery makes a run");
    // A restart within the window: the new process finds the id's key.
    dev.kill9();
    dev = Proc::dev_with(&data, 4, &dir.path().join("dev2.log"), &[]);
    let (dup, again) = deliver(&dev.http_addr(), "k1");
    let within = first_at.elapsed();
    assert!(within < Duration::from_secs(5), "the restart took {within:?}: past the window, nothing was shown");
    assert!(dup && again == first, "within 5 s ({within:?}) the id is a duplicate of {first}, got {again} (deduplicated: {dup})");

    // After the window: a new run, though the first is kept an hour.
    tokio::time::sleep(Duration::from_secs(6).saturating_sub(first_at.elapsed())).await;
    let (dup, second) = deliver(&dev.http_addr(), "k1");
    assert!(!dup && second != first, "after 6 s the id makes a new run (got {second}, deduplicated: {dup})");
    // Its own window holds, across another restart.
    let second_at = Instant::now();
    dev.kill9();
    dev = Proc::dev_with(&data, 4, &dir.path().join("dev3.log"), &[]);
    let (dup, third) = deliver(&dev.http_addr(), "k1");
    assert!(second_at.elapsed() < Duration::from_secs(5), "the restart took {:?}", second_at.elapsed());
    assert!(dup && third == second, "the new run's window: got {third} (deduplicated: {dup})");

    let runs = list_runs(&dev.addr, "d").await;
    let mut ids: Vec<&str> = runs.iter().map(|r| r.run_id.as_str()).collect();
    ids.sort_unstable();
    let mut want = vec![first.as_str(), second.as_str()];
    want.sort_unstable();
    assert_eq!(ids, want, "two runs, both kept");
}
