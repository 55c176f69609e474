//! Acceptance 1 (issue 2): every case of `tests/cases/cron.json` (a copy of
//! `shared/cases/cron.json`) and of `tests/cases/cron_extra.json` (this
//! project's own: the cronie parsing rules of issue 34) passes through
//! `PreviewSchedule` and through actual firing of a registered task with a
//! controllable clock, over a real gRPC server; every `invalid` case is
//! rejected naming the problem.

use std::time::Duration;

use chrono::{DateTime, Utc};
use punchclock_control_plane::clock::ManualClock;
use punchclock_proto::v1 as pb;
use punchclock_tests::{at, in_process_server, list_runs, tasks, wait_run};

/// The case files, same shape: `cases` (expected fire times) and `invalid`.
const FILES: [&str; 2] = [include_str!("../cases/cron.json"), include_str!("../cases/cron_extra.json")];

fn ts(t: DateTime<Utc>) -> prost_types::Timestamp {
    punchclock_proto::time::to_timestamp(t)
}

/// The `key` list (`cases` or `invalid`) of every case file, in order.
fn cases(key: &str) -> Vec<serde_json::Value> {
    FILES
        .iter()
        .flat_map(|f| {
            let v: serde_json::Value = serde_json::from_str(f).expect("cases parse");
            v[key].as_array().expect("list").clone()
        })
        .collect()
}

fn time(v: &serde_json::Value) -> DateTime<Utc> {
    v.as_str().expect("string").parse().expect("RFC 3339")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_cron_case_previews_and_fires_at_its_expected_times() {
    for c in &cases("cases") {
        let id = c["id"].as_str().expect("id");
        let after = time(&c["after"]);
        let expected: Vec<DateTime<Utc>> = c["expected"].as_array().expect("expected").iter().map(time).collect();
        let dir = tempfile::tempdir().expect("tempdir");
        let clock = ManualClock::new(after);
        let (srv, stop) = in_process_server(clock.clone(), dir.path()).await;
        let addr = format!("http://{}", srv.addr);

        // PreviewSchedule over gRPC.
        let p = tasks(&addr)
            .await
            .preview_schedule(pb::PreviewScheduleRequest {
                expr: c["expr"].as_str().expect("expr").into(),
                timezone: c["timezone"].as_str().expect("tz").into(),
                task_id: String::new(),
                after: Some(ts(after)),
                count: expected.len() as u32,
                ..Default::default()
            })
            .await
            .unwrap_or_else(|e| panic!("{id}: preview failed: {e}"))
            .into_inner();
        let got: Vec<DateTime<Utc>> = p.fire_times.iter().map(|t| at(&Some(*t)).expect("time")).collect();
        assert_eq!(got, expected, "case {id}: PreviewSchedule");

        // Actual firing: a registered task, the clock moved to each expected instant.
        let task_id = format!("case_{}", id.replace('-', "_"));
        let spec = serde_json::json!({
            "task_id": task_id, "agent_id": "nobody",
            "trigger": {"type": "cron", "expr": c["expr"], "timezone": c["timezone"]},
            "execution": {"concurrency_limit": 100}
        });
        punchclock_tests::apply(&addr, spec).await;
        for want in &expected {
            clock.set(*want);
            let run = wait_run(&addr, &task_id, Duration::from_secs(20), |r| at(&r.scheduled_at) == Some(*want)).await;
            assert_eq!(punchclock_tests::status(&run), pb::RunStatus::Pending, "case {id}: the slot made a run (no runner, so it waits)");
        }
        let fired: Vec<DateTime<Utc>> = {
            let mut v: Vec<DateTime<Utc>> = list_runs(&addr, &task_id).await.iter().filter_map(|r| at(&r.scheduled_at)).collect();
            v.sort();
            v
        };
        assert_eq!(fired, expected, "case {id}: fired slots (no extra, none missing)");
        let _ = stop.send(());
        srv.wait().await.expect("server stops");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_invalid_cron_case_is_rejected_naming_the_problem() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (srv, stop) = in_process_server(ManualClock::new("2026-11-30T00:00:00Z".parse().expect("t")), dir.path()).await;
    let addr = format!("http://{}", srv.addr);
    for c in &cases("invalid") {
        let id = c["id"].as_str().expect("id");
        let expr = c["expr"].as_str().expect("expr");
        let tz = c["timezone"].as_str().expect("tz");
        let e = tasks(&addr)
            .await
            .preview_schedule(pb::PreviewScheduleRequest {
                expr: expr.into(),
                timezone: tz.into(),
                task_id: String::new(),
                after: None,
                count: 3,
                ..Default::default()
            })
            .await
            .expect_err(id);
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{id}: {e}");
        let field = if id == "bad-zone" { "timezone" } else { "expr" };
        assert!(e.message().contains(field), "{id}: preview error must name {field}: {}", e.message());

        let spec = serde_json::json!({"task_id": "bad", "agent_id": "a", "trigger": {"type": "cron", "expr": expr, "timezone": tz}});
        let e = tasks(&addr)
            .await
            .apply_task(pb::ApplyTaskRequest { spec_json: spec.to_string(), dry_run: false, task: None })
            .await
            .expect_err(id);
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{id}: {e}");
        assert!(e.message().starts_with(&format!("trigger.{field}:")), "{id}: apply error must name trigger.{field}: {}", e.message());
    }
    let listed = tasks(&addr)
        .await
        .list_tasks(pb::ListTasksRequest { page_size: 1000, ..Default::default() })
        .await
        .expect("list")
        .into_inner()
        .tasks;
    assert!(listed.is_empty(), "rejected definitions must not be written: {listed:?}");
    let _ = stop.send(());
    srv.wait().await.expect("server stops");
}
