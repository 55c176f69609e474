//! Issue 37, time to the letter, over a real gRPC server:
//! - DST: every case of `tests/cases/dst.json` (New York, Berlin, Lord
//!   Howe, Santiago; `0 30 2 * * *`, `*/20 2 * * *` and more, each policy)
//!   fires as the table says with a controllable clock: every slot a run
//!   or a SKIPPED `dst_gap` record, none doubled unless `repeat: both`;
//!   and a daily `wall_clock` interval in Berlin fires at 09:00 local on
//!   both sides of each change.
//! - Jitter: 500 tasks on `0 * * * *` with `jitter: auto` fire spread over
//!   the allowed window (a tenth of the hour: 6 minutes), each at the same
//!   offset every hour and across a restart of the server.
//! - Bounds: a cron with `end_at` 10 s ahead leaves no slot after it;
//!   `max_runs: 3` runs three times; `task get` says why each ended.
//! - Delayed triggers (real runner, `task trigger --delay 10`): one made
//!   while a run is active that ends before it is due runs; one due while
//!   a run is active, under `overlap_policy: skip`, is SKIPPED at its due
//!   time.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use chrono::{DateTime, Utc};
use punchclock_control_plane::clock::ManualClock;
use punchclock_proto::v1 as pb;
use punchclock_tests::{Proc, apply, at, cli, in_process_server, list_runs, status, tasks, wait_run};

fn t(s: &str) -> DateTime<Utc> {
    s.parse().expect("RFC 3339")
}

fn stamp(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
}

/// A run as the DST cases write it: its slot, or `X dst_gap N` for a
/// SKIPPED `dst_gap` record.
fn as_case(r: &pb::Run) -> String {
    let slot = stamp(at(&r.scheduled_at).expect("slot"));
    if status(r) == pb::RunStatus::Skipped { format!("{slot} {} {}", r.skip_reason, r.missed_count) } else { slot }
}

/// Waits until the engine has handled every slot up to the clock's
/// instant: a `once` probe a millisecond later, the clock moved to it,
/// has its run (timers fire in instant order).
async fn settle(addr: &str, clock: &ManualClock, n: &mut u32) {
    *n += 1;
    let id = format!("probe_{n}");
    let at = clock_now(clock) + chrono::Duration::milliseconds(1);
    let at = at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
    apply(addr, serde_json::json!({"task_id": id, "agent_id": "nobody", "trigger": {"type": "once", "at": at}})).await;
    clock.advance(chrono::Duration::milliseconds(1));
    wait_run(addr, &id, Duration::from_secs(60), |_| true).await;
    let _ = tasks(addr).await.delete_task(pb::DeleteTaskRequest { task_id: id }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dst_case_fires_as_the_table_says() {
    let v: serde_json::Value = serde_json::from_str(include_str!("../cases/dst.json")).expect("cases parse");
    let mut cases: Vec<serde_json::Value> = v["cases"].as_array().expect("cases").clone();
    cases.sort_by_key(|c| t(c["from"].as_str().expect("from")));
    let dir = tempfile::tempdir().expect("tempdir");
    let first = t(cases[0]["from"].as_str().expect("from"));
    let clock = ManualClock::new(first);
    let (srv, stop) = in_process_server(clock.clone(), dir.path()).await;
    let addr = format!("http://{}", srv.addr);
    let mut probes = 0;
    let mut checked = 0;
    for (n, c) in cases.iter().enumerate() {
        let id = c["id"].as_str().expect("id");
        let (from, until) = (t(c["from"].as_str().expect("from")), t(c["until"].as_str().expect("until")));
        // Created just before the window: a slot at `from` is its first.
        clock.set(from - chrono::Duration::seconds(1));
        let mut want: BTreeMap<String, Vec<String>> = BTreeMap::new();
        let mut instants: Vec<DateTime<Utc>> = Vec::new();
        for (policy, slots) in c["expect"].as_object().expect("expect") {
            let task_id = format!("c{n}_{policy}");
            let dst = match policy.as_str() {
                "default" => serde_json::Value::Null,
                "shift" | "skip" => serde_json::json!({"gap": policy}),
                p => serde_json::json!({"repeat": p}),
            };
            let mut trigger = serde_json::json!({"type": "cron", "expr": c["expr"], "timezone": c["zone"]});
            if !dst.is_null() {
                trigger["dst"] = dst;
            }
            apply(
                &addr,
                serde_json::json!({"task_id": task_id, "agent_id": "nobody", "trigger": trigger,
                "execution": {"overlap_policy": "queue", "concurrency_limit": 100}}),
            )
            .await;
            let slots: Vec<String> = slots.as_array().expect("list").iter().map(|s| s.as_str().expect("slot").to_string()).collect();
            instants.extend(slots.iter().map(|s| t(s.split(' ').next().expect("instant"))));
            want.insert(task_id, slots);
        }
        instants.sort();
        instants.dedup();
        // The clock moves to each slot in turn, then to the window's end.
        for i in instants.into_iter().chain([until]) {
            clock.set(i);
            settle(&addr, &clock, &mut probes).await;
        }
        for (task_id, slots) in &want {
            let mut got: Vec<String> = list_runs(&addr, task_id).await.iter().map(as_case).collect();
            got.sort();
            assert_eq!(&got, slots, "case {id}, task {task_id}");
            tasks(&addr).await.delete_task(pb::DeleteTaskRequest { task_id: task_id.clone() }).await.expect("delete");
            checked += 1;
        }
    }
    assert!(checked >= 60, "{checked} case policies");

    // A day of 24 hours and `wall_clock: true`: 09:00 in Berlin on both
    // sides of each change.
    for c in v["wall_clock"].as_array().expect("wall_clock") {
        let id = c["id"].as_str().expect("id");
        let (from, until) = (t(c["from"].as_str().expect("from")), t(c["until"].as_str().expect("until")));
        clock.set(from - chrono::Duration::seconds(1));
        let zone = c["zone"].as_str().expect("zone");
        let mut trigger = serde_json::json!({"type": "interval", "every": c["every"], "start_at": c["start_at"]});
        if !zone.is_empty() {
            trigger["wall_clock"] = true.into();
            trigger["timezone"] = zone.into();
        }
        let task_id = id.replace('-', "_");
        apply(
            &addr,
            serde_json::json!({"task_id": task_id, "agent_id": "nobody", "trigger": trigger,
            "execution": {"overlap_policy": "queue", "concurrency_limit": 100}}),
        )
        .await;
        let want: Vec<String> = c["expect"].as_array().expect("list").iter().map(|s| s.as_str().expect("slot").to_string()).collect();
        for i in want.iter().map(|s| t(s)).chain([until]) {
            clock.set(i);
            settle(&addr, &clock, &mut probes).await;
        }
        let mut got: Vec<String> = list_runs(&addr, &task_id).await.iter().map(as_case).collect();
        got.sort();
        assert_eq!(got, want, "{id}");
        if !zone.is_empty() {
            let local: Vec<String> =
                got.iter().map(|s| t(s).with_timezone(&chrono_tz::Europe::Berlin).format("%H:%M").to_string()).collect();
            assert!(local.iter().all(|l| l == "09:00"), "{id}: {local:?}");
        }
        tasks(&addr).await.delete_task(pb::DeleteTaskRequest { task_id }).await.expect("delete");
    }
    let _ = stop.send(());
    srv.wait().await.expect("server stops");
}

/// Each task's fire offset (fire_at − slot) in ms, by task, from its runs
/// of the slot `slot`.
async fn offsets(addr: &str, slot: DateTime<Utc>) -> HashMap<String, i64> {
    let mut out = HashMap::new();
    for r in list_runs(addr, "").await {
        if at(&r.scheduled_at) == Some(slot) && r.task_id.starts_with("herd_") {
            let fired = at(&r.fire_at).unwrap_or_else(|| panic!("{} has no fire_at", r.run_id));
            out.insert(r.task_id.clone(), (fired - slot).num_milliseconds());
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_jitter_spreads_a_herd_and_keeps_each_offset_across_a_restart() {
    const TASKS: usize = 500;
    const WINDOW_MS: i64 = 360_000; // a tenth of an hour
    let dir = tempfile::tempdir().expect("tempdir");
    let t0 = t("2026-12-08T08:58:00Z");
    let clock = ManualClock::new(t0);
    let (srv, stop) = in_process_server(clock.clone(), dir.path()).await;
    let addr = format!("http://{}", srv.addr);
    let specs: Vec<String> = (0..TASKS)
        .map(|i| {
            serde_json::json!({"task_id": format!("herd_{i}"), "agent_id": "nobody",
                "trigger": {"type": "cron", "expr": "0 * * * *", "jitter": "auto"},
                "execution": {"misfire_grace_seconds": 3600}})
            .to_string()
        })
        .collect();
    let r = applied(&addr, specs).await;
    // The crowd is said at apply: jitter spreads these, so no warning.
    assert!(r.iter().all(|x| x.warnings.iter().all(|w| !w.contains("tasks fire at"))), "{:?}", r.first());
    // Without jitter, a crowd is warned of at apply.
    let crowd: Vec<String> = (0..60)
        .map(|i| {
            serde_json::json!({"task_id": format!("crowd_{i}"), "agent_id": "nobody", "trigger": {"type": "cron", "expr": "0 * * * *"}})
                .to_string()
        })
        .collect();
    let r = applied(&addr, crowd).await;
    let w = r[0].warnings.join("\n");
    assert!(w.contains("60 tasks fire at 2026-12-08T09:00:00 UTC") && w.contains("jitter: auto"), "{w}");
    // Once the engine has them (its task watch is ordered: a probe applied
    // after them has fired), a task applied alone counts them.
    let mut probes = 0;
    settle(&addr, &clock, &mut probes).await;
    let one = tasks(&addr)
        .await
        .apply_task(pb::ApplyTaskRequest {
            spec_json: serde_json::json!({"task_id": "crowd_60", "agent_id": "nobody", "trigger": {"type": "cron", "expr": "0 * * * *"}})
                .to_string(),
            dry_run: false,
            task: None,
        })
        .await
        .expect("apply one")
        .into_inner();
    assert!(one.warnings.iter().any(|w| w.contains("61 tasks fire at")), "counts the stored tasks too: {:?}", one.warnings);
    // Half way through the window only the tasks whose offset is under
    // half of it have fired: each waits for its own offset.
    let hour = |h: u32| t(&format!("2026-12-08T{h:02}:00:00Z"));
    clock.set(hour(9) + chrono::Duration::milliseconds(WINDOW_MS / 2));
    settle(&addr, &clock, &mut probes).await;
    let half = offsets(&addr, hour(9)).await;
    assert!(half.values().all(|o| *o <= WINDOW_MS / 2), "none before its offset");
    assert!((150..350).contains(&half.len()), "about half fired by mid-window: {}", half.len());
    clock.set(hour(9) + chrono::Duration::milliseconds(WINDOW_MS));
    settle(&addr, &clock, &mut probes).await;
    let first = offsets(&addr, hour(9)).await;
    assert_eq!(first.len(), TASKS, "every task fired within the window");
    // Spread: within [0, 6 min), every tenth of the window used.
    let mut tenths = [0usize; 10];
    for o in first.values() {
        assert!((0..WINDOW_MS).contains(o), "offset {o} ms out of the window");
        tenths[(*o * 10 / WINDOW_MS) as usize] += 1;
    }
    assert!(tenths.iter().all(|n| *n >= 20), "spread over the window: {tenths:?}");
    // The next hour: the same offset each.
    clock.set(hour(10) + chrono::Duration::milliseconds(WINDOW_MS));
    settle(&addr, &clock, &mut probes).await;
    assert_eq!(offsets(&addr, hour(10)).await, first, "the same offset every hour");
    // A restart: a new server on the same store.
    let _ = stop.send(());
    srv.wait().await.expect("server stops");
    clock.set(hour(10) + chrono::Duration::minutes(50));
    let (srv, stop) = in_process_server(clock.clone(), dir.path()).await;
    let addr = format!("http://{}", srv.addr);
    clock.set(hour(11) + chrono::Duration::milliseconds(WINDOW_MS));
    settle(&addr, &clock, &mut probes).await;
    assert_eq!(offsets(&addr, hour(11)).await, first, "the same offset across a restart");
    // `preview` of a task says when its slots fire.
    let p = tasks(&addr)
        .await
        .preview_schedule(pb::PreviewScheduleRequest { task_id: "herd_7".into(), count: 2, ..Default::default() })
        .await
        .expect("preview")
        .into_inner();
    let fired: Vec<i64> = p
        .fire_times
        .iter()
        .zip(&p.jittered_times)
        .map(|(s, f)| (at(&Some(*f)).expect("f") - at(&Some(*s)).expect("s")).num_milliseconds())
        .collect();
    assert_eq!(fired, vec![first["herd_7"]; 2], "{p:?}");
    assert!(p.notes.iter().any(|n| n.contains("jitter: auto")), "{:?}", p.notes);
    let _ = stop.send(());
    srv.wait().await.expect("server stops");
}

/// `ApplyTasks` of `specs`: what it says of each task.
async fn applied(addr: &str, specs: Vec<String>) -> Vec<pb::TaskApplied> {
    use tokio_stream::StreamExt;
    let mut s = tasks(addr)
        .await
        .apply_tasks(tokio_stream::iter([pb::ApplyTasksRequest { spec_json: specs, ..Default::default() }]))
        .await
        .expect("apply")
        .into_inner();
    let mut out = Vec::new();
    while let Some(m) = s.next().await {
        out.extend(m.expect("apply response").tasks);
    }
    out
}

fn clock_now(c: &ManualClock) -> DateTime<Utc> {
    use punchclock_control_plane::clock::Clock;
    c.now()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn end_at_and_max_runs_bound_the_slots() {
    let dir = tempfile::tempdir().expect("tempdir");
    let t0 = t("2026-12-08T09:00:00Z");
    let clock = ManualClock::new(t0);
    let (srv, stop) = in_process_server(clock.clone(), dir.path()).await;
    let addr = format!("http://{}", srv.addr);
    let end = t0 + chrono::Duration::seconds(10);
    apply(
        &addr,
        serde_json::json!({"task_id": "ends", "agent_id": "nobody",
        "trigger": {"type": "cron", "expr": "* * * * * *", "end_at": stamp(end)},
        "execution": {"overlap_policy": "queue", "concurrency_limit": 100}}),
    )
    .await;
    apply(
        &addr,
        serde_json::json!({"task_id": "three", "agent_id": "nobody",
        "trigger": {"type": "interval", "every": "2s", "max_runs": 3},
        "execution": {"overlap_policy": "queue", "concurrency_limit": 100}}),
    )
    .await;
    let mut probes = 0;
    for s in 1..=30 {
        let now = t0 + chrono::Duration::seconds(s);
        clock.set(now);
        settle(&addr, &clock, &mut probes).await;
    }
    let ends = list_runs(&addr, "ends").await;
    assert_eq!(ends.len(), 10, "a slot each second up to end_at, none after");
    assert!(ends.iter().all(|r| at(&r.scheduled_at).is_some_and(|s| s <= end)));
    let three = list_runs(&addr, "three").await;
    assert_eq!(three.len(), 3, "max_runs: 3 runs three times: {three:#?}");
    for (task, why) in [("ends", "end_at 2026-12-08T09:00:10Z passed"), ("three", "max_runs 3 reached")] {
        let got = tasks(&addr).await.get_task(pb::GetTaskRequest { task_id: task.into() }).await.expect("get").into_inner();
        assert!(got.ended.starts_with(why), "{task}: {:?}", got.ended);
        assert_eq!(got.next_fire_at, None, "{task}");
        let text = cli(&addr, &["task", "get", task]);
        assert!(text.contains(why), "task get says so: {text}");
    }
    // An end already past is refused at apply, naming the field.
    let e = tasks(&addr)
        .await
        .apply_task(pb::ApplyTaskRequest {
            spec_json: serde_json::json!({"task_id": "late", "agent_id": "nobody",
                "trigger": {"type": "cron", "expr": "* * * * *", "end_at": stamp(t0)}})
            .to_string(),
            dry_run: false,
            task: None,
        })
        .await
        .expect_err("past end");
    assert!(e.message().starts_with("trigger.end_at:"), "{}", e.message());
    let _ = stop.send(());
    srv.wait().await.expect("server stops");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delayed_triggers_are_admitted_when_due() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dev = Proc::dev(&dir.path().join("data"));
    // A run of sleep_agent lasts 3 s, of long_sleep_agent 25 s.
    for (id, agent) in [("short", "sleep_agent"), ("long", "long_sleep_agent")] {
        apply(&dev.addr, serde_json::json!({"task_id": id, "agent_id": agent, "execution": {"overlap_policy": "skip"}})).await;
    }
    // A run active when the delayed trigger is made, ended before it is due.
    cli(&dev.addr, &["task", "trigger", "short", "--key", "now"]);
    wait_run(&dev.addr, "short", Duration::from_secs(30), |r| status(r) == pb::RunStatus::Running).await;
    cli(&dev.addr, &["task", "trigger", "short", "--delay", "10", "--key", "later"]);
    let later = list_runs(&dev.addr, "short").await.into_iter().find(|r| r.run_id == "short.manual-later").expect("recorded at once");
    assert_eq!(status(&later), pb::RunStatus::Pending, "not skipped while the first run is active: {later:?}");
    let done =
        wait_run(&dev.addr, "short", Duration::from_secs(40), |r| r.run_id == "short.manual-later" && punchclock_tests::terminal(r)).await;
    assert_eq!(status(&done), pb::RunStatus::Succeeded, "{done:?}");
    // Due while a run is active, under skip: SKIPPED at its due time.
    cli(&dev.addr, &["task", "trigger", "long", "--key", "now"]);
    wait_run(&dev.addr, "long", Duration::from_secs(30), |r| status(r) == pb::RunStatus::Running).await;
    let made = Utc::now();
    cli(&dev.addr, &["task", "trigger", "long", "--delay", "10", "--key", "busy"]);
    let busy =
        wait_run(&dev.addr, "long", Duration::from_secs(40), |r| r.run_id == "long.manual-busy" && punchclock_tests::terminal(r)).await;
    assert_eq!((status(&busy), busy.skip_reason.as_str()), (pb::RunStatus::Skipped, "concurrency_limit"), "{busy:?}");
    let skipped_at = at(&busy.finished_at).expect("finished");
    assert!(skipped_at >= made + chrono::Duration::seconds(9), "SKIPPED at its due time, not when made: {skipped_at} vs {made}");
}
