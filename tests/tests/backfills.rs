//! Issue 37, backfills, over a real `dev` with its runner:
//! - a 10-day hourly backfill (240 slots) of a task with 40 records in
//!   the range, `missing`: its dry run lists 200 `would_run` and 40
//!   `exists: SUCCEEDED` and creates nothing; the real one creates exactly
//!   those 200 runs (the task's own slot run ids, `trigger: backfill`),
//!   never more than `max_concurrent: 3` agents alive (sampled); paused,
//!   it creates nothing however long it waits, and resumed it goes on from
//!   its cursor; the same backfill again creates nothing;
//! - `failed` re-runs only the slots whose run failed, as linked runs.
//!
//! The 30-day, 720-slot case with a leader killed half way is
//! `ha_backfill.rs`, on etcd.

use std::collections::BTreeSet;
use std::time::Duration;

use chrono::{DateTime, DurationRound, Utc};
use punchclock_proto::v1 as pb;
use punchclock_tests::{KeepLogsOnPanic, Proc, apply, at, list_runs, max_live_agents_until, status, tasks};

fn ts(t: DateTime<Utc>) -> Option<prost_types::Timestamp> {
    Some(punchclock_proto::time::to_timestamp(t))
}

fn req(task: &str, from: DateTime<Utc>, to: DateTime<Utc>, reprocess: &str, max: u32, dry_run: bool) -> pb::BackfillTaskRequest {
    pb::BackfillTaskRequest {
        task_id: task.into(),
        from: ts(from),
        to: ts(to),
        reprocess: reprocess.into(),
        max_concurrent: max,
        dry_run,
        ..Default::default()
    }
}

/// Starts a backfill and waits until it is done; returns it.
async fn backfill_done(addr: &str, r: pb::BackfillTaskRequest) -> pb::Backfill {
    let b = tasks(addr).await.backfill_task(r).await.expect("backfill").into_inner().backfill.expect("started");
    wait_state(addr, &b.id, "done", Duration::from_secs(240)).await
}

async fn wait_state(addr: &str, id: &str, state: &str, within: Duration) -> pb::Backfill {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let b = tasks(addr).await.get_backfill(pb::GetBackfillRequest { id: id.into() }).await.expect("get").into_inner();
        if b.state == state {
            return b;
        }
        assert!(tokio::time::Instant::now() < deadline, "backfill {id} not {state}: {b:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_days_of_hourly_slots_are_backfilled_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "backfills");
    let dev = Proc::dev_with(&dir.path().join("data"), 8, &dir.path().join("dev.log"), &[]);
    apply(
        &dev.addr,
        serde_json::json!({"task_id": "hourly", "agent_id": "backfill_agent",
        "trigger": {"type": "cron", "expr": "0 0 * * * *"},
        "execution": {"overlap_policy": "queue", "concurrency_limit": 10}}),
    )
    .await;
    let hour = chrono::Duration::hours(1);
    let h0 = (Utc::now() - chrono::Duration::days(11)).duration_trunc(hour).expect("trunc");
    let (from, to) = (h0, h0 + hour * 239);
    // 40 records in the range: a first backfill of 40 of its hours.
    let first = backfill_done(&dev.addr, req("hourly", h0 + hour * 100, h0 + hour * 139, "missing", 8, false)).await;
    assert_eq!((first.planned, first.created, first.succeeded), (40, 40, 40), "{first:?}");

    // The dry run: what each slot would get, nothing created.
    let dry = tasks(&dev.addr).await.backfill_task(req("hourly", from, to, "missing", 3, true)).await.expect("dry").into_inner();
    assert!(dry.backfill.is_none());
    assert_eq!(dry.listing.len(), 240);
    let would: BTreeSet<String> = dry.listing.iter().filter(|x| x.verdict == "would_run").map(|x| x.run_id.clone()).collect();
    assert_eq!(would.len(), 200);
    assert_eq!(dry.listing.iter().filter(|x| x.verdict == "exists: SUCCEEDED").count(), 40);
    assert_eq!(list_runs(&dev.addr, "hourly").await.len(), 40, "a dry run creates nothing");

    // The real one, max_concurrent 3, paused and resumed half way.
    let b = tasks(&dev.addr).await.backfill_task(req("hourly", from, to, "missing", 3, false)).await.expect("bf").into_inner();
    let id = b.backfill.expect("started").id;
    let addr = dev.addr.clone();
    let run = async {
        // Pause once about 60 runs are made.
        loop {
            let b = tasks(&addr).await.get_backfill(pb::GetBackfillRequest { id: id.clone() }).await.expect("get").into_inner();
            if b.created >= 60 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let paused =
            tasks(&addr).await.change_backfill(pb::ChangeBackfillRequest { id: id.clone(), action: "pause".into() }).await.expect("pause");
        assert_eq!(paused.into_inner().state, "paused");
        // Whatever was in flight settles; then nothing is made while paused.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let before = list_runs(&addr, "hourly").await.len();
        let cursor = tasks(&addr).await.get_backfill(pb::GetBackfillRequest { id: id.clone() }).await.expect("get").into_inner().cursor;
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert_eq!(list_runs(&addr, "hourly").await.len(), before, "a paused backfill creates nothing");
        let still = tasks(&addr).await.get_backfill(pb::GetBackfillRequest { id: id.clone() }).await.expect("get").into_inner();
        assert_eq!(still.cursor, cursor, "its cursor is frozen");
        tasks(&addr).await.change_backfill(pb::ChangeBackfillRequest { id: id.clone(), action: "resume".into() }).await.expect("resume");
        wait_state(&addr, &id, "done", Duration::from_secs(300)).await
    };
    let (most, done) = max_live_agents_until("pc-backfill-agent", run).await;
    assert!(most <= 3, "max_concurrent 3: {most} agents alive at once");
    assert!(most >= 2, "it ran concurrently: {most}");
    assert_eq!((done.planned, done.created, done.left, done.succeeded, done.remaining), (240, 200, 40, 200, 0), "{done:?}");

    let all = list_runs(&dev.addr, "hourly").await;
    assert_eq!(all.len(), 240, "one run per slot");
    let made: BTreeSet<String> = all.iter().filter(|r| r.backfill_id == done.id).map(|r| r.run_id.clone()).collect();
    assert_eq!(made, would, "the dry run's listing is what the backfill did");
    assert!(all.iter().all(|r| r.trigger_kind == "backfill" && status(r) == pb::RunStatus::Succeeded));
    let slots: BTreeSet<DateTime<Utc>> = all.iter().filter_map(|r| at(&r.scheduled_at)).collect();
    assert_eq!(slots.len(), 240);
    assert!(all.iter().all(|r| r.run_id == format!("hourly.{}", at(&r.scheduled_at).expect("slot").format("%Y%m%dT%H%M%SZ"))));

    // The same backfill again creates nothing.
    let again = backfill_done(&dev.addr, req("hourly", from, to, "missing", 3, false)).await;
    assert_eq!((again.created, again.left), (0, 240));
    assert_eq!(list_runs(&dev.addr, "hourly").await.len(), 240);

    // `failed`: only the failed slots, as linked runs.
    let agent = |a: &str| {
        serde_json::json!({"task_id": "flaky", "agent_id": a, "trigger": {"type": "cron", "expr": "0 0 * * * *"},
            "execution": {"overlap_policy": "queue", "concurrency_limit": 10, "max_retries": 0}})
    };
    apply(&dev.addr, agent("fail_agent")).await;
    let f = backfill_done(&dev.addr, req("flaky", h0, h0 + hour * 9, "missing", 5, false)).await;
    assert_eq!((f.created, f.failed), (10, 10));
    apply(&dev.addr, agent("ok_agent")).await;
    let m = backfill_done(&dev.addr, req("flaky", h0, h0 + hour * 19, "missing", 5, false)).await;
    assert_eq!((m.created, m.left, m.succeeded), (10, 10, 10));
    let dry = tasks(&dev.addr).await.backfill_task(req("flaky", h0, h0 + hour * 19, "failed", 5, true)).await.expect("dry").into_inner();
    assert_eq!(dry.listing.iter().filter(|x| x.verdict == "would_rerun").count(), 10);
    let r = backfill_done(&dev.addr, req("flaky", h0, h0 + hour * 19, "failed", 5, false)).await;
    assert_eq!((r.created, r.left, r.succeeded), (10, 10, 10), "{r:?}");
    let runs = list_runs(&dev.addr, "flaky").await;
    let linked: Vec<&pb::Run> = runs.iter().filter(|x| !x.rerun_of.is_empty()).collect();
    assert_eq!(linked.len(), 10);
    assert!(linked.iter().all(|x| x.run_id == format!("{}.rerun-1", x.rerun_of)));
    let failed: BTreeSet<&str> = runs.iter().filter(|x| status(x) == pb::RunStatus::Failed).map(|x| x.run_id.as_str()).collect();
    assert_eq!(linked.iter().map(|x| x.rerun_of.as_str()).collect::<BTreeSet<_>>(), failed, "only the failed slots");
    // Again: nothing (each failed slot has its re-run).
    let r2 = backfill_done(&dev.addr, req("flaky", h0, h0 + hour * 19, "failed", 5, false)).await;
    assert_eq!(r2.created, 0);
    // A bad request names its field.
    let e = tasks(&dev.addr).await.backfill_task(req("flaky", to, from, "missing", 1, false)).await.expect_err("backwards");
    assert!(e.message().starts_with("to:"), "{}", e.message());
}
