//! Issue 35, acceptance 4: a webhook's delivery id deduplicates for
//! exactly its `dedup.ttl`, whatever the history keeps: with `ttl: 5s` on a
//! task whose runs are kept 1 h, the same id makes no new run within 5 s
//! and a new one after 6 s, and a restart in between (kill -9; the new
//! process reads the dedup key, not memory) changes nothing. Before, the id
//! found its run for as long as the run was kept (an hour here), and a ttl
//! under a minute was refused.

use std::time::{Duration, Instant};

use punchclock_tests::{KeepLogsOnPanic, Proc, apply, http_post, list_runs, wait_engine};
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
    // Serving is not leading yet: its engine takes the event.
    wait_engine(&dev.addr).await;
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
    // Serving is not leading yet: its engine takes the event.
    wait_engine(&dev.addr).await;
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

/// `punchclock task trigger --key K --key-ttl 5s` (and `event publish
/// --key K --key-ttl 5s`): the key finds its run within 5 s, across a kill
/// -9, and makes a new run after it, on a task whose runs are kept 1 h.
/// Before, a manual key and a published event's key found their runs for
/// as long as the runs were kept, and had no window to give.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manual_and_a_published_key_deduplicate_for_their_ttl_across_a_restart() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "dedup_window_keys");
    let data = dir.path().join("data");
    let mut dev = Proc::dev_with(&data, 4, &dir.path().join("dev.log"), &[]);
    apply(
        &dev.addr,
        json!({"task_id": "m", "agent_id": "event_agent", "triggers": [{"type": "event", "topic": "t"}],
               "history": {"keep_last": 1000, "max_age": "1h"},
               "execution": {"overlap_policy": "queue", "concurrency_limit": 4}}),
    )
    .await;
    let trigger = |addr: &str| -> Value {
        serde_json::from_str(&punchclock_tests::cli(addr, &["task", "trigger", "m", "--key", "k", "--key-ttl", "5s", "-o", "json"]))
            .expect("json")
    };
    let publish = |addr: &str| -> Value {
        serde_json::from_str(&punchclock_tests::cli(addr, &["event", "publish", "t", "--key", "k", "--key-ttl", "5s", "-o", "json"]))
            .expect("json")
    };
    let first_at = Instant::now();
    let (t1, p1) = (trigger(&dev.addr), publish(&dev.addr));
    assert_eq!((t1["created"].as_bool(), p1[0]["created"].as_bool()), (Some(true), Some(true)), "{t1} {p1}");
    dev.kill9();
    dev = Proc::dev_with(&data, 4, &dir.path().join("dev2.log"), &[]);
    // Serving is not leading yet: its engine takes the event.
    wait_engine(&dev.addr).await;
    let (t2, p2) = (trigger(&dev.addr), publish(&dev.addr));
    assert!(first_at.elapsed() < Duration::from_secs(5), "the restart took {:?}", first_at.elapsed());
    assert_eq!((t2["created"].as_bool(), &t2["run_id"]), (Some(false), &t1["run_id"]), "within the window: {t2}");
    assert_eq!((p2[0]["created"].as_bool(), &p2[0]["run_id"]), (Some(false), &p1[0]["run_id"]), "{p2}");

    tokio::time::sleep(Duration::from_secs(6).saturating_sub(first_at.elapsed())).await;
    let (t3, p3) = (trigger(&dev.addr), publish(&dev.addr));
    assert_eq!(t3["created"].as_bool(), Some(true), "after the window: {t3}");
    assert_ne!(t3["run_id"], t1["run_id"]);
    assert_eq!(p3[0]["created"].as_bool(), Some(true), "after the window: {p3}");
    assert_ne!(p3[0]["run_id"], p1[0]["run_id"]);
    // A bad window is refused, naming the field.
    let e = punchclock_tests::cli_fails(&dev.addr, &["task", "trigger", "m", "--key", "k2", "--key-ttl", "31d"]);
    assert!(e.contains("idempotency_ttl"), "{e}");
    assert_eq!(list_runs(&dev.addr, "m").await.len(), 4, "two manual runs and two event runs, all kept");
}
