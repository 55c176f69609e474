//! Issue 35, point 5: a task's recent slots are one view
//! (`views::TaskSummary`), read from the run history and rendered alike by
//! gRPC (`ListTasks` with `recent_slots`) and the CLI (`task list
//! --slots`): every cell is a run of the history, newest first, and a
//! SKIPPED or FAILED cell says why in words.
//!
//! `punchclock dev`: a task every second whose agent takes 2 s under
//! `overlap_policy: skip` (SUCCEEDED and SKIPPED `concurrency_limit` slots),
//! and a task whose agent fails. (Skips in a row are one record for
//! several slots: one cell with its count.)

use std::time::Duration;

use punchclock_proto::v1 as pb;
use punchclock_tests::{KeepLogsOnPanic, Proc, apply_all, at, cli, runs, tasks};

const CELLS: u32 = 6;

async fn summaries(addr: &str) -> Vec<pb::Task> {
    tasks(addr)
        .await
        .list_tasks(pb::ListTasksRequest { recent_slots: CELLS, ..Default::default() })
        .await
        .expect("list tasks")
        .into_inner()
        .tasks
}

fn cells_of<'a>(tasks: &'a [pb::Task], id: &str) -> &'a [pb::SlotCell] {
    &tasks.iter().find(|t| t.task_id == id).expect("task listed").recent_slots
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tasks_recent_slots_are_its_history_newest_first_with_their_reasons() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "task_views");
    let dev = Proc::dev(&dir.path().join("data"));
    let specs = [
        serde_json::json!({"task_id": "skippy", "agent_id": "light_agent", "trigger": {"type": "interval", "every": "1s"},
            "execution": {"concurrency_limit": 1, "overlap_policy": "skip"}}),
        serde_json::json!({"task_id": "failing", "agent_id": "fail_agent", "trigger": {"type": "interval", "every": "1s"},
            "execution": {"max_retries": 0}}),
    ];
    apply_all(&tasks(&dev.addr).await, specs.into_iter()).await;

    // Until the strip has a succeeded and a skipped slot, and a failed one.
    let listed = tokio::time::timeout(Duration::from_secs(120), async {
        loop {
            let listed = summaries(&dev.addr).await;
            let skippy = cells_of(&listed, "skippy");
            let has = |cells: &[pb::SlotCell], s: pb::RunStatus| cells.iter().any(|c| c.status == s as i32);
            if skippy.len() == CELLS as usize
                && has(skippy, pb::RunStatus::Succeeded)
                && has(skippy, pb::RunStatus::Skipped)
                && has(cells_of(&listed, "failing"), pb::RunStatus::Failed)
            {
                return listed;
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    })
    .await
    .expect("succeeded, skipped and failed slots");

    for id in ["skippy", "failing"] {
        let cells = cells_of(&listed, id);
        // The history's newest runs of the task, up to the newest cell.
        let newest = at(&cells[0].scheduled_at).expect("slot");
        let page = runs(&dev.addr)
            .await
            .list_runs(pb::ListRunsRequest {
                task_id: id.into(),
                scheduled_to: Some(punchclock_proto::time::to_timestamp(newest + chrono::Duration::milliseconds(1))),
                order: pb::RunOrder::NewestFirst as i32,
                page_size: CELLS,
                ..Default::default()
            })
            .await
            .expect("list runs")
            .into_inner();
        assert_eq!(
            cells.iter().map(|c| c.run_id.as_str()).collect::<Vec<_>>(),
            page.runs.iter().map(|r| r.run_id.as_str()).collect::<Vec<_>>(),
            "{id}: the cells are the history's newest runs, newest first"
        );
        for (c, r) in cells.iter().zip(&page.runs) {
            assert_eq!(c.scheduled_at, r.scheduled_at);
            assert_eq!(c.slots, r.missed_count.max(1), "{id}: a cell stands for its record's slots");
        }
    }
    for c in cells_of(&listed, "skippy") {
        match pb::RunStatus::try_from(c.status).expect("status") {
            pb::RunStatus::Skipped => {
                assert_eq!(c.reason, "concurrency_limit");
                let label =
                    if c.slots > 1 { format!("SKIPPED concurrency_limit ×{}", c.slots) } else { "SKIPPED concurrency_limit".into() };
                assert_eq!(c.label, label);
                assert_eq!(c.start_lag_ms, None, "a skipped slot did not start");
            }
            pb::RunStatus::Succeeded => {
                assert_eq!(c.label, "SUCCEEDED");
                assert!(c.start_lag_ms.is_some_and(|l| l >= 0), "{c:?}");
            }
            _ => {}
        }
    }
    let failed = cells_of(&listed, "failing").iter().find(|c| c.status == pb::RunStatus::Failed as i32).expect("failed cell");
    let run = runs(&dev.addr).await.get_run(pb::GetRunRequest { run_id: failed.run_id.clone() }).await.expect("get run").into_inner();
    assert!(!failed.reason.is_empty(), "a failed cell says why");
    assert_eq!(failed.reason, run.error, "the failed cell's reason is its run's error");

    // Bounded: at most 50 cells, the field named.
    let e = tasks(&dev.addr).await.list_tasks(pb::ListTasksRequest { recent_slots: 51, ..Default::default() }).await.expect_err("51 cells");
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(e.message().contains("recent_slots"), "{}", e.message());

    // The CLI renders the same view: a SLOTS column, and the cells in JSON.
    let table = cli(&dev.addr, &["task", "list", "--slots", "6"]);
    let row = table.lines().find(|l| l.starts_with("skippy")).expect("skippy row");
    assert!(table.lines().next().expect("header").contains("SLOTS"), "{table}");
    assert!(row.contains('·') && row.contains('✓'), "skipped and succeeded glyphs: {row}");
    let json: serde_json::Value = serde_json::from_str(&cli(&dev.addr, &["task", "list", "--slots", "6", "-o", "json"])).expect("json");
    let skippy = json.as_array().expect("array").iter().find(|t| t["task_id"] == "skippy").expect("skippy");
    let labels: Vec<&str> = skippy["recent_slots"].as_array().expect("cells").iter().map(|c| c["label"].as_str().expect("label")).collect();
    assert!(labels.iter().any(|l| l.starts_with("SKIPPED concurrency_limit")), "{labels:?}");
    assert!(cli(&dev.addr, &["task", "list"]).lines().next().is_some_and(|h| !h.contains("SLOTS")), "no strip unless asked");
    println!("task views: {} cells of skippy: {labels:?}", labels.len());
}
