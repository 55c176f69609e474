//! Issue 35, acceptance 1: every run of a window is found, once, in
//! scheduled order — by the CLI's JSON lines (`runs list --since … -o
//! jsonl`, paging transparently), by `ListRuns` pages of 500 through
//! `next_page_token`, and by per-task listings, which all agree. Before,
//! `ListRuns` answered at most 1,000 runs, newest first, with no token and
//! no window.
//!
//! `punchclock dev` (embedded store), 120 tasks every second for 30 s
//! (about 3,600 runs) with an agent of `true`.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use chrono::{DateTime, Utc};
use punchclock_proto::v1 as pb;
use punchclock_tests::{KeepLogsOnPanic, Proc, apply_all, at, cli, cli_fails, runs, tasks};

const TASKS: usize = 120;
const WINDOW_SECS: i64 = 30;

/// Every page of `req` through `next_page_token`; the page count.
async fn all_pages(addr: &str, mut req: pb::ListRunsRequest) -> (Vec<pb::Run>, usize) {
    let mut client = runs(addr).await;
    let (mut all, mut pages) = (Vec::new(), 0);
    loop {
        let page = client.list_runs(req.clone()).await.expect("list runs").into_inner();
        pages += 1;
        all.extend(page.runs);
        if page.next_page_token.is_empty() {
            return (all, pages);
        }
        req.page_token = page.next_page_token;
    }
}

fn key(r: &pb::Run) -> (DateTime<Utc>, String) {
    (at(&r.scheduled_at).expect("slot"), r.run_id.clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_run_of_a_window_is_listed_once_in_slot_order() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "history_paging");
    let dev = Proc::dev_with_slots(&dir.path().join("data"), 512);
    let specs = (0..TASKS).map(
        |i| serde_json::json!({"task_id": format!("h{i:03}"), "agent_id": "true_agent", "trigger": {"type": "interval", "every": "1s"}}),
    );
    apply_all(&tasks(&dev.addr).await, specs).await;
    // The window: 30 whole seconds starting after every task is in.
    let from = DateTime::from_timestamp(Utc::now().timestamp() + 2, 0).expect("t");
    let to = from + chrono::Duration::seconds(WINDOW_SECS);
    let ts = |t: DateTime<Utc>| Some(punchclock_proto::time::to_timestamp(t));
    // The window is over once every task has a run of a later slot.
    tokio::time::timeout(Duration::from_secs(WINDOW_SECS as u64 + 120), async {
        loop {
            let (later, _) =
                all_pages(&dev.addr, pb::ListRunsRequest { scheduled_from: ts(to), page_size: 1000, ..Default::default() }).await;
            if later.iter().map(|r| r.task_id.as_str()).collect::<HashSet<_>>().len() == TASKS {
                return;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    })
    .await
    .expect("every task passed the window");

    // ListRuns, 500 a page, oldest first.
    let window = pb::ListRunsRequest {
        scheduled_from: ts(from),
        scheduled_to: ts(to),
        page_size: 500,
        order: pb::RunOrder::OldestFirst as i32,
        ..Default::default()
    };
    let (paged, pages) = all_pages(&dev.addr, window.clone()).await;
    let ids: Vec<String> = paged.iter().map(|r| r.run_id.clone()).collect();
    assert_eq!(ids.iter().collect::<HashSet<_>>().len(), ids.len(), "a run listed twice");
    assert!(paged.windows(2).all(|w| key(&w[0]) < key(&w[1])), "not in slot order");
    assert!(
        paged.iter().all(|r| {
            let s = at(&r.scheduled_at).expect("slot");
            s >= from && s < to
        }),
        "a run outside the window"
    );
    // About one run a task a second (a slow debug build may coalesce a few).
    assert!(paged.len() >= TASKS * WINDOW_SECS as usize * 9 / 10, "{} runs in the window", paged.len());
    assert_eq!(pages, paged.len().div_ceil(500).max(1), "pages of 500");

    // The CLI's JSON lines, pages fetched transparently.
    let (f, t) = (from.to_rfc3339(), to.to_rfc3339());
    let out = cli(&dev.addr, &["runs", "list", "--since", &f, "--until", &t, "--limit", "0", "-o", "jsonl"]);
    let lines: Vec<String> = out
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("a JSON line")["run_id"].as_str().expect("run_id").to_string())
        .collect();
    assert_eq!(lines, ids, "runs list -o jsonl streams the window in scheduled order");
    let exported = cli(&dev.addr, &["runs", "export", "--since", &f, "--until", &t]);
    assert_eq!(exported.lines().count(), ids.len(), "runs export");
    // Without --since an export still reads forward: in scheduled order.
    let everything = cli(&dev.addr, &["runs", "export", "--until", &t]);
    let keys: Vec<(chrono::DateTime<chrono::Utc>, String)> = everything
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("a JSON line");
            let slot = v["scheduled_at"].as_str().and_then(|s| s.parse().ok()).expect("scheduled_at");
            (slot, v["run_id"].as_str().unwrap_or_default().to_string())
        })
        .collect();
    assert!(keys.len() >= ids.len() && keys.windows(2).all(|w| w[0].0 <= w[1].0), "runs export without --since: oldest first");
    // A malformed date is named as one; a window backwards names both flags.
    let e = cli_fails(&dev.addr, &["runs", "list", "--since", "2026-13-01T00:00:00Z"]);
    assert!(e.contains("--since") && e.contains("RFC 3339"), "{e}");
    let e = cli_fails(&dev.addr, &["runs", "list", "--since", "10m", "--until", "20m"]);
    assert!(e.contains("--until") && e.contains("--since"), "{e}");

    // Newest first: the same runs backwards.
    let (newest, _) =
        all_pages(&dev.addr, pb::ListRunsRequest { order: pb::RunOrder::NewestFirst as i32, page_size: 700, ..window.clone() }).await;
    assert_eq!(newest.iter().rev().map(|r| r.run_id.clone()).collect::<Vec<_>>(), ids);

    // Per task: the same runs, each task's in slot order.
    let mut by_task: HashMap<String, Vec<String>> = HashMap::new();
    for r in &paged {
        by_task.entry(r.task_id.clone()).or_default().push(r.run_id.clone());
    }
    assert_eq!(by_task.len(), TASKS);
    for (task, want) in &by_task {
        let (got, _) = all_pages(&dev.addr, pb::ListRunsRequest { task_id: task.clone(), page_size: 7, ..window.clone() }).await;
        assert_eq!(&got.iter().map(|r| r.run_id.clone()).collect::<Vec<_>>(), want, "task {task}");
    }

    // A token is good only for the query that made it.
    let first = runs(&dev.addr).await.list_runs(window.clone()).await.expect("page").into_inner();
    let e = runs(&dev.addr)
        .await
        .list_runs(pb::ListRunsRequest { page_token: first.next_page_token, status: pb::RunStatus::Failed as i32, ..window })
        .await
        .expect_err("another query's token");
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(e.message().contains("page_token"), "{}", e.message());
    println!(
        "history paging: {} runs of {TASKS} tasks over {WINDOW_SECS} s, {pages} pages of 500, CLI and per-task listings agree",
        ids.len()
    );
}
