//! Issue 21, published events (`{type: event, topic}` triggers), with a
//! real `dev` process, agent processes and gRPC:
//!
//! - one publish starts one run of every task listening on the topic,
//!   none of the others; the agent gets the event as `context.event`;
//! - the same idempotency key again — 4 more times at once, and after a
//!   kill -9 and restart — makes no second run (`created: false`, the
//!   same run ids); a new key makes new runs;
//! - admission is the manual trigger's: a paused task records the event
//!   SKIPPED `paused`, a spent budget SKIPPED `budget_exceeded`;
//! - bad input names the field and creates nothing;
//! - `runs list --event-key` finds the runs an event started.

use std::time::Duration;

use punchclock_proto::v1 as pb;
use punchclock_tests::{KeepLogsOnPanic, Proc, apply, cli, cli_fails, list_runs, status, tasks, terminal, wait_engine, wait_run};
use serde_json::{Value, json};

async fn publish(addr: &str, topic: &str, payload: &str, key: &str) -> Vec<pb::PublishedRun> {
    let mut t = tasks(addr).await;
    let req =
        pb::PublishEventRequest { topic: topic.into(), payload_json: payload.into(), idempotency_key: key.into(), ..Default::default() };
    t.publish_event(req).await.expect("publish").into_inner().runs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_published_event_starts_one_run_per_listening_task_per_key() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "events");
    let cfg = dir.path().join("config.yaml");
    std::fs::write(&cfg, "budgets:\n  - name: one\n    scope: {task: ev_budget}\n    window: month\n    limits: {runs: 1}\n")
        .expect("config");
    let cfg = cfg.to_string_lossy().to_string();
    let data = dir.path().join("data");
    let mut dev = Proc::dev_with(&data, 4, &dir.path().join("dev.log"), &["--config", &cfg]);
    let ev = |id: &str, topic: &str| json!({"task_id": id, "agent_id": "event_agent", "trigger": {"type": "event", "topic": topic}});
    apply(&dev.addr, ev("ev_a", "data.updated")).await;
    // An event trigger beside a time trigger (one a year: it does not fire here).
    apply(
        &dev.addr,
        json!({"task_id": "ev_b", "agent_id": "event_agent",
               "triggers": [{"type": "cron", "expr": "0 0 1 1 *"}, {"type": "event", "topic": "data.updated"}]}),
    )
    .await;
    apply(&dev.addr, ev("ev_other", "other.topic")).await;
    apply(&dev.addr, ev("ev_paused", "data.updated")).await;
    apply(&dev.addr, ev("ev_budget", "data.updated")).await;
    cli(&dev.addr, &["task", "pause", "ev_paused"]);

    // Bad input names the field; nothing is created.
    let bad = cli_fails(&dev.addr, &["event", "publish", "bad topic!", "--key", "k"]);
    assert!(bad.contains("topic"), "{bad}");
    let bad = cli_fails(&dev.addr, &["event", "publish", "data.updated", "--key", "k", "--payload", "{not json"]);
    assert!(bad.contains("payload_json"), "{bad}");
    let bad = cli_fails(&dev.addr, &["event", "publish", "data.updated", "--key", "a\tb"]);
    assert!(bad.contains("idempotency_key"), "{bad}");
    let mut t = tasks(&dev.addr).await;
    let refused = t
        .apply_task(pb::ApplyTaskRequest { spec_json: ev("ev_bad", "no spaces allowed").to_string(), dry_run: false, task: None })
        .await
        .expect_err("a bad topic is refused");
    assert!(refused.message().contains("trigger.topic"), "{}", refused.message());
    for id in ["ev_a", "ev_b", "ev_paused", "ev_budget"] {
        assert!(list_runs(&dev.addr, id).await.is_empty(), "{id} has runs before any event");
    }

    // One publish: one run of each listening task.
    let out = cli(&dev.addr, &["-o", "json", "event", "publish", "data.updated", "--key", "k1", "--payload", r#"{"id": 1}"#]);
    let first: Value = serde_json::from_str(&out).expect("json");
    let first = first.as_array().expect("array").clone();
    let ids: Vec<&str> = first.iter().map(|r| r["task_id"].as_str().unwrap_or_default()).collect();
    assert_eq!(ids, vec!["ev_a", "ev_b", "ev_budget", "ev_paused"]);
    assert!(first.iter().all(|r| r["created"] == true));
    let a = wait_run(&dev.addr, "ev_a", Duration::from_secs(30), terminal).await;
    assert_eq!(status(&a), pb::RunStatus::Succeeded, "{a:#?}");
    assert_eq!(a.trigger_kind, "event");
    let result: Value = serde_json::from_str(&a.result_json).expect("result");
    assert_eq!(result["event"]["body"], json!({"id": 1}));
    assert_eq!(result["event"]["source"], "event");
    assert_eq!(result["event"]["name"], "data.updated");
    assert_eq!(result["event"]["key"], "k1");
    let paused = wait_run(&dev.addr, "ev_paused", Duration::from_secs(30), terminal).await;
    assert_eq!((status(&paused), paused.skip_reason.as_str()), (pb::RunStatus::Skipped, "paused"));
    assert!(list_runs(&dev.addr, "ev_other").await.is_empty(), "a task on another topic ran");

    // The same key, 4 more times at once: the same runs, none created.
    let again = futures::future::join_all((0..4).map(|_| publish(&dev.addr, "data.updated", r#"{"id": 1}"#, "k1"))).await;
    for runs in &again {
        assert!(runs.iter().all(|r| !r.created), "{runs:?}");
        let got: Vec<&str> = runs.iter().map(|r| r.run_id.as_str()).collect();
        let want: Vec<&str> = first.iter().map(|r| r["run_id"].as_str().unwrap_or_default()).collect();
        assert_eq!(got, want);
    }
    // ... and after a kill -9 and a restart (read back from the store).
    wait_run(&dev.addr, "ev_b", Duration::from_secs(30), terminal).await;
    wait_run(&dev.addr, "ev_budget", Duration::from_secs(30), terminal).await;
    dev.kill9();
    dev = Proc::dev_with(&data, 4, &dir.path().join("dev2.log"), &["--config", &cfg]);
    // The API serves before the new process leads (its old lease must end).
    wait_engine(&dev.addr).await;
    let after = publish(&dev.addr, "data.updated", r#"{"id": 1}"#, "k1").await;
    assert_eq!(after.len(), 4);
    assert!(after.iter().all(|r| !r.created), "a restart forgot a key: {after:?}");
    for id in ["ev_a", "ev_b", "ev_paused", "ev_budget"] {
        assert_eq!(list_runs(&dev.addr, id).await.len(), 1, "{id}: one run for k1");
    }

    // A new key: new runs; the budget of one run a month holds.
    let second = publish(&dev.addr, "data.updated", r#"{"id": 2}"#, "k2").await;
    assert!(second.iter().all(|r| r.created), "{second:?}");
    let b = wait_run(&dev.addr, "ev_b", Duration::from_secs(30), |r| r.run_id.contains("k2") && terminal(r)).await;
    assert_eq!(status(&b), pb::RunStatus::Succeeded);
    let spent = wait_run(&dev.addr, "ev_budget", Duration::from_secs(30), |r| r.run_id.contains("k2") && terminal(r)).await;
    assert_eq!((status(&spent), spent.skip_reason.as_str()), (pb::RunStatus::Skipped, "budget_exceeded"), "{spent:#?}");
    // Any printable key (a version, a path): its run id uses a digest.
    let dotted = publish(&dev.addr, "data.updated", "{}", "release v1.2.3/x").await;
    assert!(dotted.iter().all(|r| r.created), "{dotted:?}");
    assert!(publish(&dev.addr, "data.updated", "{}", "release v1.2.3/x").await.iter().all(|r| !r.created));
    // Nobody listens on this topic: no run, no error.
    assert!(publish(&dev.addr, "nobody.listens", "", "k3").await.is_empty());
    // Runs found by the event that started them (issue 34, finding 16).
    let by_key: Value = serde_json::from_str(&cli(&dev.addr, &["-o", "json", "runs", "list", "--event-key", "k2"])).expect("json");
    let mut tasks_of: Vec<&str> = by_key.as_array().expect("array").iter().map(|r| r["task_id"].as_str().unwrap_or_default()).collect();
    tasks_of.sort();
    assert_eq!(tasks_of, vec!["ev_a", "ev_b", "ev_budget", "ev_paused"], "{by_key:#}");
    assert!(by_key.as_array().expect("array").iter().all(|r| r["event"]["key"] == "k2"));
}
