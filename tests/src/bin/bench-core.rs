//! Bench (issue 22): the leader's decision core alone — no store, no
//! socket, no runtime — for N tasks due on the same second (`* * * * * *`),
//! on one thread. Dispatch lag under load is this CPU: the engine task
//! takes a burst's slots in turns of [`MAX_TIMERS_PER_TURN`] timers, and a
//! slot is assigned only after every slot before it was handled.
//!
//! Per second of the window it feeds the core, as the shell does: the due
//! timers (fire, admission, dispatch to one runner with enough slots) and
//! drains the effects (the writes' records, the assignments); then each
//! run's `Started` and `Finished` as a runner reports them. It prints the
//! CPU per run of each phase (µs, median over the seconds) and the time
//! the last slot of a burst waited for its dispatch (ms) — the floor of
//! `bench-load`'s dispatch p99 for that many tasks on this machine.
//!
//! Usage: `bench-core [TASKS] [SECONDS]` (defaults 1000, 10).

use std::collections::BTreeMap;
use std::time::Instant;

use chrono::{DateTime, Duration, Utc};
use punchclock_control_plane::clock::{Mono, Now};
use punchclock_control_plane::engine::MAX_TIMERS_PER_TURN;
use punchclock_control_plane::engine::core::{CoreConfig, EngineCore, Input};
use punchclock_control_plane::engine::protocol::{FinishedReport, FromRunner, ReportedOutcome, RunnerHello, ToRunner};
use punchclock_control_plane::model::{TaskRecord, TaskSpec};
use punchclock_control_plane::timing::Timing;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let tasks: usize = args.first().and_then(|s| s.parse().ok()).unwrap_or(1000);
    let seconds: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(10);
    let t0: DateTime<Utc> = "2026-12-01T10:00:00Z".parse().expect("t0");
    let at = |wall: DateTime<Utc>| Now::new(wall, Mono::ZERO.after(wall - t0));

    let mut core = EngineCore::new(CoreConfig { timing: Timing::default(), token: 1, leader_id: "bench".into() });
    let records: Vec<(TaskRecord, Option<_>)> = (0..tasks)
        .map(|i| {
            let json = serde_json::json!({"task_id": format!("load{i:05}"), "agent_id": "agent", "trigger": {"type": "cron", "expr": "* * * * * *"}});
            let spec = TaskSpec::from_json(&json.to_string()).expect("valid task");
            let rec = TaskRecord {
                spec,
                applied: None,
                paused: false,
                paused_at: None,
                paused_reason: String::new(),
                resumed_at: None,
                created_at: t0,
                updated_at: t0,
            };
            (rec, None)
        })
        .collect();
    core.load(at(t0), records, Vec::new());
    let hello = RunnerHello {
        runner_id: "r1".into(),
        agents: vec!["agent".into()],
        slots: u32::try_from(tasks * 2).unwrap_or(u32::MAX),
        labels: BTreeMap::new(),
        version: "bench".into(),
        in_flight: Vec::new(),
        instance_id: "i1".into(),
    };
    let session = core.runner_hello(at(t0), hello).expect("hello");
    let _ = core.poll_effects();

    let (mut fire_us, mut report_us, mut last_ms) = (Vec::new(), Vec::new(), Vec::new());
    for s in 1..=seconds {
        let due = t0 + Duration::seconds(s as i64);
        // The burst: turns of at most MAX_TIMERS_PER_TURN timers, effects
        // drained after each, as the shell does.
        let started = Instant::now();
        let mut assigned = Vec::new();
        loop {
            let more = core.handle_timeout(at(due), MAX_TIMERS_PER_TURN);
            let fx = core.poll_effects();
            for out in fx.sends {
                if let ToRunner::Assign(a) = out.msg {
                    assigned.push((a.run_id, a.execution_id));
                }
            }
            if !more {
                break;
            }
        }
        let burst = started.elapsed();
        assert_eq!(assigned.len(), tasks, "second {s}: every slot assigned");
        // The runner's reports: Started, then Finished, each a turn of
        // queued commands.
        let started = Instant::now();
        let wall = due + Duration::milliseconds(100);
        for chunk in assigned.chunks(256) {
            for (run_id, execution_id) in chunk {
                let msg = FromRunner::Started { run_id: run_id.clone(), execution_id: execution_id.clone(), started_at: Some(wall) };
                core.handle(at(wall), Input::Runner { runner_id: "r1".into(), session, received_at: at(wall), msg });
            }
            let _ = core.poll_effects();
        }
        for chunk in assigned.chunks(256) {
            for (run_id, execution_id) in chunk {
                let report = FinishedReport {
                    run_id: run_id.clone(),
                    execution_id: execution_id.clone(),
                    outcome: ReportedOutcome::Succeeded,
                    result: None,
                    error: String::new(),
                    exit_code: Some(0),
                    stdout_tail: String::new(),
                    stderr_tail: String::new(),
                    started_at: Some(wall),
                    finished_at: Some(wall),
                    class: None,
                    machine: None,
                };
                let msg = FromRunner::Finished(Box::new(report));
                core.handle(at(wall), Input::Runner { runner_id: "r1".into(), session, received_at: at(wall), msg });
            }
            let _ = core.poll_effects();
        }
        let reports = started.elapsed();
        fire_us.push(burst.as_secs_f64() * 1e6 / tasks as f64);
        report_us.push(reports.as_secs_f64() * 1e6 / tasks as f64);
        last_ms.push(burst.as_secs_f64() * 1e3);
    }
    println!("bench-core: {tasks} tasks due on each of {seconds} seconds, one thread, no store (median over the seconds)");
    println!("{:<44} {:>10}", "fire + admit + dispatch + drain, per run", format!("{:.1} µs", median(fire_us)));
    println!("{:<44} {:>10}", "Started + Finished reports, per run", format!("{:.1} µs", median(report_us)));
    println!("{:<44} {:>10}", "the burst's last dispatch after its slot", format!("{:.1} ms", median(last_ms)));
}
