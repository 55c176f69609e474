//! Unit tests of the decision core: no runtime, no store, no socket. Each
//! drives [`EngineCore`] with inputs and a hand-moved clock and checks the
//! effects it asks for.

use std::collections::BTreeMap;

use chrono::{DateTime, Duration, Utc};

use super::*;
use crate::engine::protocol::{Assignment, FinishedReport, InFlightExec, ReportedOutcome, RunnerHello};
use crate::error::Error;
use crate::model::run::{Outcome, SkipReason, TriggerKind};
use crate::model::{RunStatus, TaskSpec};

const TOKEN: u64 = 7;

fn t0() -> DateTime<Utc> {
    "2026-12-01T10:00:00Z".parse().expect("t0")
}

/// A core and its clocks.
struct H {
    core: EngineCore,
    /// Wall clock.
    now: DateTime<Utc>,
    /// Monotonic clock: moves with `now` unless the wall clock is stepped.
    mono: Mono,
    /// Effects drained so far, in order.
    log: Vec<Effects>,
}

impl H {
    fn new() -> H {
        H::at(t0())
    }

    fn at(now: DateTime<Utc>) -> H {
        let mut core = EngineCore::new(CoreConfig { timing: Timing::default(), token: TOKEN, leader_id: "leader".into() });
        core.load(Now::new(now, Mono::ZERO), Vec::new(), Vec::new());
        let mut h = H { core, now, mono: Mono::ZERO, log: Vec::new() };
        h.drain();
        h
    }

    /// Loads a core from "the store": tasks with cursors, active runs.
    fn loaded(now: DateTime<Utc>, tasks: Vec<(TaskRecord, Option<Cursor>)>, runs: Vec<RunRecord>) -> H {
        let mut core = EngineCore::new(CoreConfig { timing: Timing::default(), token: TOKEN + 1, leader_id: "leader".into() });
        core.load(Now::new(now, Mono::ZERO), tasks, runs);
        let mut h = H { core, now, mono: Mono::ZERO, log: Vec::new() };
        h.drain();
        h
    }

    /// Both clocks.
    fn clocks(&self) -> Now {
        Now::new(self.now, self.mono)
    }

    /// Steps the wall clock by `d` (NTP, an operator); elapsed time stands
    /// still. Fires the timers due and drains.
    fn jump(&mut self, d: Duration) -> Effects {
        self.now += d;
        self.advance(Duration::zero())
    }

    fn drain(&mut self) -> Effects {
        let fx = self.core.poll_effects();
        // Every count kept as runs change equals one made from scratch.
        self.core.counts.check(&self.core.runs, self.now);
        let copy = Effects {
            writes: fx.writes.clone(),
            disconnects: fx.disconnects.clone(),
            sends: fx.sends.clone(),
            events: fx.events.clone(),
            replies: Vec::new(),
            reads: fx.reads.clone(),
            run_checks: fx.run_checks.clone(),
            pauses: fx.pauses.clone(),
        };
        self.log.push(copy);
        fx
    }

    fn record(&self, json: serde_json::Value) -> TaskRecord {
        let spec = TaskSpec::from_json(&json.to_string()).expect("valid task");
        TaskRecord {
            spec,
            applied: None,
            paused: false,
            paused_at: None,
            paused_reason: String::new(),
            resumed_at: None,
            created_at: self.now,
            updated_at: self.now,
        }
    }

    fn put(&mut self, rec: TaskRecord) -> Effects {
        self.core.handle(self.clocks(), Input::TaskPut { record: Box::new(rec), cursor: None });
        self.drain()
    }

    fn task(&mut self, json: serde_json::Value) -> Effects {
        let rec = self.record(json);
        self.put(rec)
    }

    fn hello_with(&mut self, id: &str, agents: &[&str], slots: u32, instance: &str, in_flight: Vec<InFlightExec>) -> (u64, Effects) {
        let hello = RunnerHello {
            runner_id: id.into(),
            agents: agents.iter().map(|a| a.to_string()).collect(),
            slots,
            labels: BTreeMap::new(),
            version: "test".into(),
            in_flight,
            instance_id: instance.into(),
        };
        let s = self.core.runner_hello(self.clocks(), hello).expect("hello accepted");
        (s, self.drain())
    }

    fn hello(&mut self, id: &str, agents: &[&str], slots: u32) -> (u64, Effects) {
        self.hello_with(id, agents, slots, &format!("{id}-instance"), Vec::new())
    }

    /// Moves the clock and fires every timer due, draining effects.
    fn advance(&mut self, d: Duration) -> Effects {
        self.now += d;
        self.mono = self.mono.after(d);
        let mut all = Effects::default();
        loop {
            let more = self.core.handle_timeout(self.clocks(), 16);
            let fx = self.drain();
            all.writes.extend(fx.writes);
            all.disconnects.extend(fx.disconnects);
            all.sends.extend(fx.sends);
            all.events.extend(fx.events);
            all.replies.extend(fx.replies);
            all.reads.extend(fx.reads);
            if !more {
                return all;
            }
        }
    }

    /// Advances `secs` seconds one at a time, `alive` runners heartbeating
    /// each second; returns every effect.
    fn tick(&mut self, secs: i64, alive: &[(&str, u64)]) -> Effects {
        let mut all = Effects::default();
        for _ in 0..secs {
            for (r, s) in alive {
                self.heartbeat(r, *s);
            }
            let fx = self.advance(Duration::seconds(1));
            all.writes.extend(fx.writes);
            all.disconnects.extend(fx.disconnects);
            all.sends.extend(fx.sends);
            all.events.extend(fx.events);
            all.reads.extend(fx.reads);
        }
        all
    }

    fn msg(&mut self, runner: &str, session: u64, msg: FromRunner) -> Effects {
        self.core.handle(self.clocks(), Input::Runner { runner_id: runner.into(), session, received_at: self.clocks(), msg });
        self.drain()
    }

    fn heartbeat(&mut self, runner: &str, session: u64) -> Effects {
        self.msg(runner, session, FromRunner::Heartbeat { seq: 1, draining: false, acked_seq: 1 })
    }

    fn finished(&mut self, runner: &str, session: u64, a: &Assignment, outcome: ReportedOutcome) -> Effects {
        let report = FinishedReport {
            run_id: a.run_id.clone(),
            execution_id: a.execution_id.clone(),
            outcome,
            result: Some(serde_json::json!({"by": runner})),
            error: if outcome == ReportedOutcome::Succeeded { String::new() } else { format!("{outcome:?}") },
            exit_code: Some(if outcome == ReportedOutcome::Succeeded { 0 } else { 1 }),
            stdout_tail: String::new(),
            stderr_tail: String::new(),
            started_at: None,
            finished_at: Some(self.now),
            class: None,
            machine: None,
        };
        self.msg(runner, session, FromRunner::Finished(Box::new(report)))
    }

    fn run(&self, run_id: &str) -> RunRecord {
        self.core.active_run(run_id).unwrap_or_else(|| panic!("run {run_id} not in memory"))
    }

    /// The last stored state of a run (from the writes drained so far).
    fn stored(&self, run_id: &str) -> Option<RunRecord> {
        self.log.iter().flat_map(|fx| fx.writes.iter().flatten()).rev().find_map(|op| match op {
            StoreOp::CreateRun(r) | StoreOp::PutRun(r) if r.run_id == run_id => Some((**r).clone()),
            _ => None,
        })
    }

    /// Transactions (polls with writes) that wrote this run.
    fn writes_of(&self, run_id: &str) -> usize {
        self.log
            .iter()
            .filter(|fx| {
                fx.writes.iter().flatten().any(|op| matches!(op, StoreOp::CreateRun(r) | StoreOp::PutRun(r) if r.run_id == run_id))
            })
            .count()
    }

    fn trigger(&mut self, task: &str, key: &str) -> Effects {
        self.trigger_after(task, key, 0)
    }

    /// A manual trigger of `task` with key `key`, due in `delay_seconds`.
    fn trigger_after(&mut self, task: &str, key: &str, delay_seconds: u64) -> Effects {
        let req = TriggerRequest {
            task_id: task.into(),
            params: Default::default(),
            not_before: None,
            delay_seconds,
            idempotency_key: Some(key.into()),
            idempotency_window: None,
            caller_trace: None,
            baggage: String::new(),
        };
        self.core.handle(self.clocks(), Input::Trigger { reply: 1, req, explicit_key: false });
        self.drain()
    }
}

fn assigns(fx: &Effects) -> Vec<(String, Assignment)> {
    fx.sends
        .iter()
        .filter_map(|o| match &o.msg {
            ToRunner::Assign(a) => Some((o.runner_id.clone(), (**a).clone())),
            _ => None,
        })
        .collect()
}

fn one_assign(fx: &Effects) -> Assignment {
    let a = assigns(fx);
    assert_eq!(a.len(), 1, "exactly one assignment: {a:?}");
    a[0].1.clone()
}

fn acks(fx: &Effects) -> usize {
    fx.sends.iter().filter(|o| matches!(o.msg, ToRunner::FinishedAck { .. })).count()
}

fn manual(task: &str) -> serde_json::Value {
    serde_json::json!({"task_id": task, "agent_id": "a"})
}

fn every_10s(task: &str, extra: serde_json::Value) -> serde_json::Value {
    let mut v = serde_json::json!({"task_id": task, "agent_id": "a", "trigger": {"type": "interval", "every": "10s"}});
    if let (Some(o), serde_json::Value::Object(e)) = (v.get_mut("execution"), &extra) {
        o.as_object_mut().expect("object").extend(e.clone());
    } else {
        v["execution"] = extra;
    }
    v
}

// ------------------------------------------------------------------ admission

/// Every overlap policy, with `concurrency_limit: 1` and a run active.
#[test]
fn admission_follows_the_overlap_policy() {
    for (policy, expect_status, expect_reason) in [
        ("skip", RunStatus::Skipped, Some(SkipReason::ConcurrencyLimit)),
        ("queue", RunStatus::Pending, None),
        ("cancel_running", RunStatus::Pending, None),
    ] {
        let mut h = H::new();
        h.task(every_10s("t", serde_json::json!({"overlap_policy": policy})));
        let (s, _) = h.hello("r1", &["a"], 4);
        let fx = h.tick(10, &[("r1", s)]);
        let first = one_assign(&fx);
        let fx = h.tick(10, &[("r1", s)]);
        assert!(assigns(&fx).is_empty(), "{policy}: the limit holds");
        let second = "t.20261201T100020Z";
        let stored = h.stored(second).expect("the second slot has a record");
        assert_eq!(stored.status, expect_status, "{policy}: {stored:?}");
        assert_eq!(stored.skip_reason, expect_reason, "{policy}");
        match policy {
            "cancel_running" => {
                let old = h.run(&first.run_id);
                assert_eq!(old.status, RunStatus::Cancelled);
                assert!(old.attempts[0].awaiting_runner, "the old agent still holds its slot");
                assert!(
                    fx.sends.iter().any(|o| matches!(&o.msg, ToRunner::Cancel { execution_id, .. } if *execution_id == first.execution_id))
                );
                // The replacement starts only once the runner reports the old agent gone.
                let fx = h.tick(4, &[("r1", s)]);
                assert!(assigns(&fx).is_empty());
                let fx = h.finished("r1", s, &first, ReportedOutcome::Cancelled);
                assert_eq!(one_assign(&fx).run_id, second);
                assert_eq!(acks(&fx), 1);
            }
            "queue" => {
                let fx = h.finished("r1", s, &first, ReportedOutcome::Succeeded);
                assert_eq!(one_assign(&fx).run_id, second, "the queued run goes next");
            }
            _ => {}
        }
    }
}

/// A turn of catch-up fires is bounded by the runs it creates, not only
/// by its timers: ten `run_all` tasks that each missed 20 slots fire in
/// turns of about `max` runs (here 16: 20, one task's fire), and every
/// missed slot still gets its run, once.
#[test]
fn a_turn_of_catch_up_fires_is_bounded_by_its_runs() {
    let tasks: Vec<_> = (0..10)
        .map(|i| {
            let mut rec = H::new()
                .record(every_10s(&format!("t{i}"), serde_json::json!({"misfire_policy": "run_all", "misfire_grace_seconds": 3600})));
            rec.created_at = t0() - Duration::seconds(300);
            (rec, Some(Cursor { last_slot: Some(t0() - Duration::seconds(200)), updated_at: None, breaker: None, time_runs: 0 }))
        })
        .collect();
    let mut h = H::loaded(t0(), tasks, Vec::new());
    let created = |fx: &Effects| fx.writes.iter().flatten().filter(|op| matches!(op, StoreOp::CreateRun(_))).count();
    let mut turns = Vec::new();
    loop {
        let more = h.core.handle_timeout(h.clocks(), 16);
        turns.push(created(&h.drain()));
        if !more {
            break;
        }
    }
    assert_eq!(turns.iter().sum::<usize>(), 10 * 20, "every missed slot once: {turns:?}");
    assert!(turns.iter().all(|&n| n <= 16 + 19), "no turn past max + one fire's excess: {turns:?}");
}

/// Issue 6, invariant 6: `run_all` after an outage runs every missed slot
/// within the grace, oldest first, one after another — none is SKIPPED for
/// overlapping the others.
#[test]
fn run_all_queues_missed_slots_behind_each_other() {
    let created = t0() - Duration::seconds(75);
    let mut rec = H::new().record(every_10s("t", serde_json::json!({"misfire_policy": "run_all", "misfire_grace_seconds": 3600})));
    rec.created_at = created;
    let cursor = Cursor { last_slot: Some(t0() - Duration::seconds(70)), updated_at: None, breaker: None, time_runs: 0 };
    let mut h = H::loaded(t0(), vec![(rec, Some(cursor))], Vec::new());
    let fx = h.advance(Duration::zero());
    let created: Vec<&RunRecord> =
        fx.writes.iter().flatten().filter_map(|op| if let StoreOp::CreateRun(r) = op { Some(&**r) } else { None }).collect();
    assert_eq!(created.len(), 7, "slots 09:59:00..10:00:00: {created:?}");
    assert!(created.iter().all(|r| r.status == RunStatus::Pending), "{created:?}");
    assert!(
        fx.writes.iter().any(|g| g.iter().any(|op| matches!(op, StoreOp::PutCursor { .. }))
            && g.iter().filter(|op| matches!(op, StoreOp::CreateRun(_))).count() == 7),
        "records and cursor in one group"
    );
    let (s, fx) = h.hello("r1", &["a"], 4);
    let a = one_assign(&fx);
    assert_eq!(a.run_id, "t.20261201T095900Z", "oldest first");
    let mut order = vec![a.run_id.clone()];
    let mut cur = a;
    for _ in 0..6 {
        let fx = h.finished("r1", s, &cur, ReportedOutcome::Succeeded);
        cur = one_assign(&fx);
        order.push(cur.run_id.clone());
    }
    let mut sorted = order.clone();
    sorted.sort();
    assert_eq!(order, sorted);
}

#[test]
fn misfires_coalesce_into_one_record_with_the_cursor() {
    let mut rec = H::new().record(every_10s("t", serde_json::json!({})));
    rec.created_at = t0() - Duration::hours(1);
    let cursor = Cursor { last_slot: Some(t0() - Duration::minutes(30)), updated_at: None, breaker: None, time_runs: 0 };
    let mut h = H::loaded(t0() + Duration::seconds(5), vec![(rec, Some(cursor))], Vec::new());
    let fx = h.advance(Duration::zero());
    let group = fx.writes.iter().find(|g| g.iter().any(|op| matches!(op, StoreOp::PutCursor { .. }))).expect("a group with the cursor");
    let runs: Vec<&RunRecord> = group.iter().filter_map(|op| if let StoreOp::CreateRun(r) = op { Some(&**r) } else { None }).collect();
    assert_eq!(runs.len(), 2, "one skipped record and the latest slot's run: {runs:?}");
    let skipped = runs.iter().find(|r| r.status == RunStatus::Skipped).expect("skipped");
    assert_eq!(skipped.skip_reason, Some(SkipReason::Misfired));
    assert_eq!(skipped.missed_count, Some(179));
    assert!(skipped.error.as_deref().is_some_and(|e| e.contains("run_once runs only the latest slot")), "{skipped:?}");
    assert!(runs.iter().any(|r| r.run_id == "t.20261201T100000Z" && r.status == RunStatus::Pending));
}

// ---------------------------------------------------------------- dispatch

/// A successful single-attempt run costs two transactions: created and
/// assigned together, then finished; `Started` rides along.
#[test]
fn a_successful_run_costs_two_transactions() {
    let mut h = H::new();
    h.task(manual("m"));
    let (s, _) = h.hello("r1", &["a"], 4);
    let fx = h.trigger("m", "k1");
    let a = one_assign(&fx);
    assert_eq!(fx.writes.len(), 1, "created and assigned in one group");
    let fx = h.msg("r1", s, FromRunner::Started { run_id: a.run_id.clone(), execution_id: a.execution_id.clone(), started_at: None });
    assert!(fx.writes.is_empty(), "Started alone writes nothing");
    assert!(fx.events.iter().any(|e| matches!(e, Lifecycle::RunStarted(_))));
    let fx = h.finished("r1", s, &a, ReportedOutcome::Succeeded);
    assert_eq!(acks(&fx), 1);
    assert_eq!(h.writes_of(&a.run_id), 2);
    let stored = h.stored(&a.run_id).expect("stored");
    assert_eq!(stored.status, RunStatus::Succeeded);
    assert!(stored.actual_started_at.is_some(), "the start rode along with the finish");
    assert!(h.core.active_run(&a.run_id).is_none(), "a written terminal run leaves memory");
}

#[test]
fn dispatch_prefers_priority_then_the_older_slot() {
    let mut h = H::new();
    h.task(serde_json::json!({"task_id": "lo", "agent_id": "a", "execution": {"priority": -1000, "concurrency_limit": 5}}));
    h.task(serde_json::json!({"task_id": "hi", "agent_id": "a", "execution": {"priority": 1000}}));
    h.trigger("lo", "1");
    h.trigger("hi", "1");
    h.now += Duration::seconds(1);
    h.trigger("lo", "2");
    let (_, fx) = h.hello("r1", &["a"], 2);
    let got: Vec<String> = assigns(&fx).into_iter().map(|(_, a)| a.run_id).collect();
    assert_eq!(got, vec!["hi.manual-1", "lo.manual-1"]);
    let waiting = h.run("lo.manual-2");
    assert_eq!(waiting.pending_reason.as_deref(), Some("waiting for a free slot on runners serving agent \"a\""));
}

/// Invariant 8: a run no runner serves ends TIMEOUT at its start deadline,
/// with the reason, whatever `max_retries` says; the slot frees.
#[test]
fn start_timeout_ends_a_run_no_runner_serves() {
    let mut h = H::new();
    h.task(serde_json::json!({"task_id": "m", "agent_id": "x", "execution": {"start_timeout_seconds": 30, "max_retries": 5}}));
    h.trigger("m", "1");
    let run = h.run("m.manual-1");
    assert_eq!(run.start_by, Some(t0() + Duration::seconds(30)));
    assert_eq!(run.pending_reason.as_deref(), Some("no connected runner serves agent \"x\""));
    h.advance(Duration::seconds(29));
    assert_eq!(h.run("m.manual-1").status, RunStatus::Pending);
    h.advance(Duration::seconds(1));
    let stored = h.stored("m.manual-1").expect("stored");
    assert_eq!(stored.status, RunStatus::Timeout);
    assert_eq!(stored.error.as_deref(), Some("not started within 30 s: no connected runner serves agent \"x\""));
    assert!(stored.attempts.is_empty());
}

// ------------------------------------------------------------ attempts end

#[test]
fn failed_attempts_retry_with_backoff_then_fail() {
    let mut h = H::new();
    h.task(serde_json::json!({"task_id": "m", "agent_id": "a",
        "execution": {"max_retries": 1, "retry_backoff": {"base_seconds": 3, "cap_seconds": 60, "jitter_seconds": 0}}}));
    let (s, _) = h.hello("r1", &["a"], 1);
    let a1 = one_assign(&h.trigger("m", "1"));
    h.finished("r1", s, &a1, ReportedOutcome::Failed);
    let run = h.run("m.manual-1");
    assert_eq!(run.status, RunStatus::Retrying);
    assert_eq!(run.next_attempt_at, Some(h.now + Duration::seconds(3)));
    assert!(assigns(&h.advance(Duration::milliseconds(2999))).is_empty());
    let a2 = one_assign(&h.advance(Duration::milliseconds(1)));
    assert_eq!(a2.attempt, 2);
    h.finished("r1", s, &a2, ReportedOutcome::Timeout);
    let stored = h.stored("m.manual-1").expect("stored");
    assert_eq!(stored.status, RunStatus::Timeout, "the last attempt's outcome names the end");
    assert_eq!(stored.attempts.iter().map(|a| a.outcome).collect::<Vec<_>>(), vec![Some(Outcome::Failed), Some(Outcome::Timeout)]);
    // Issue 19: the run's dispatched_at is its first dispatch, as its
    // actual_started_at is its first start; each attempt has its own.
    assert_eq!(stored.dispatched_at, Some(stored.attempts[0].dispatched_at));
    assert!(stored.attempts[1].dispatched_at > stored.attempts[0].dispatched_at);
}

/// Invariant 7: interruptions (runner shutdown) do not spend an attempt, up
/// to 3 per run; the 4th counts.
#[test]
fn interruptions_are_free_three_times_then_count() {
    let mut h = H::new();
    h.task(serde_json::json!({"task_id": "m", "agent_id": "a", "execution": {"max_retries": 0}}));
    let (s, _) = h.hello("r1", &["a"], 1);
    let mut a = one_assign(&h.trigger("m", "1"));
    for n in 1..=3 {
        let fx = h.finished("r1", s, &a, ReportedOutcome::Interrupted);
        assert_eq!(h.run("m.manual-1").interruptions, n);
        a = one_assign(&fx);
        assert_eq!(a.attempt, n + 1);
    }
    h.finished("r1", s, &a, ReportedOutcome::Interrupted);
    let stored = h.stored("m.manual-1").expect("stored");
    assert_eq!(stored.status, RunStatus::Failed, "the 4th interruption counts, and max_retries is 0");
}

/// Found by breaking it: every refusal gave the run a fresh start deadline,
/// so a run its runner always refuses waited forever. The deadline holds.
#[test]
fn refusals_do_not_move_the_start_deadline() {
    let mut h = H::new();
    h.task(serde_json::json!({"task_id": "m", "agent_id": "a", "execution": {"start_timeout_seconds": 5}}));
    let (s, _) = h.hello("r1", &["a"], 1);
    let mut a = one_assign(&h.trigger("m", "1"));
    let mut timed_out = false;
    for _ in 0..10 {
        h.finished("r1", s, &a, ReportedOutcome::Refused);
        let fx = h.tick(1, &[("r1", s)]);
        if h.stored("m.manual-1").is_some_and(|r| r.status == RunStatus::Timeout) {
            timed_out = true;
            break;
        }
        a = one_assign(&fx);
    }
    assert!(timed_out, "refused again and again past its start deadline");
    assert!(h.now <= t0() + Duration::seconds(6));
}

/// A refused assignment spends no attempt: the run waits and goes again.
#[test]
fn a_refused_assignment_is_undone() {
    let mut h = H::new();
    h.task(manual("m"));
    let (s, _) = h.hello("r1", &["a"], 1);
    let a = one_assign(&h.trigger("m", "1"));
    let fx = h.finished("r1", s, &a, ReportedOutcome::Refused);
    assert_eq!(acks(&fx), 1);
    let run = h.run("m.manual-1");
    assert_eq!((run.status, run.attempts.len()), (RunStatus::Pending, 0));
    assert!(run.pending_reason.as_deref().is_some_and(|r| r.contains("refused")), "{run:?}");
    let again = one_assign(&h.advance(Duration::seconds(1)));
    assert_eq!(again.attempt, 1);
    assert_ne!(again.execution_id, a.execution_id);
}

// ------------------------------------------------------------- ownership

/// Invariant 1: reports about another runner's execution change nothing;
/// a Hello re-declaring it does not take it.
#[test]
fn reports_about_another_runners_execution_change_nothing() {
    let mut h = H::new();
    h.task(manual("m"));
    let (s1, _) = h.hello("r1", &["a"], 1);
    let a = one_assign(&h.trigger("m", "1"));
    let (s2, _) = h.hello("r2", &["a"], 1);
    let before = h.run(&a.run_id);
    let fx = h.msg("r2", s2, FromRunner::Started { run_id: a.run_id.clone(), execution_id: a.execution_id.clone(), started_at: None });
    assert!(fx.events.is_empty() && fx.writes.is_empty());
    let fx = h.msg(
        "r2",
        s2,
        FromRunner::Progress {
            run_id: a.run_id.clone(),
            execution_id: a.execution_id.clone(),
            percent: Some(99.0),
            message: "forged".into(),
            checkpoint: None,
        },
    );
    assert!(fx.events.is_empty() && fx.writes.is_empty());
    let fx = h.finished("r2", s2, &a, ReportedOutcome::Succeeded);
    assert!(fx.writes.is_empty(), "{:?}", fx.writes);
    assert_eq!(h.run(&a.run_id), before, "the forged reports changed nothing");
    // A re-connecting r2 claiming the execution is told it is unknown.
    h.now += Duration::seconds(10);
    h.msg("r1", s1, FromRunner::Heartbeat { seq: 9, draining: false, acked_seq: 9 });
    h.core.handle(h.clocks(), Input::RunnerGone { runner_id: "r2".into(), session: s2 });
    let (_, fx) = h.hello_with("r2", &["a"], 1, "r2-instance", vec![InFlightExec::new(&a.run_id, &a.execution_id, 1)]);
    let unknown = fx.sends.iter().find_map(|o| if let ToRunner::Welcome { unknown, .. } = &o.msg { Some(unknown.clone()) } else { None });
    assert_eq!(unknown.map(|u| u.len()), Some(1));
    assert_eq!(h.core.runner_views().iter().find(|r| r.runner_id == "r2").map(|r| r.busy), Some(0));
    // The owner still finishes it.
    h.finished("r1", s1, &a, ReportedOutcome::Succeeded);
    assert_eq!(h.stored(&a.run_id).map(|r| r.status), Some(RunStatus::Succeeded));
}

// --------------------------------------------------------------- loss

/// Invariants 2 and 3: a silent runner gets no new work at 3 heartbeats,
/// but its attempt is lost only past the fence deadline and margin; the
/// next run starts only then; a late success stays evidence.
#[test]
fn a_silent_runner_is_lost_only_past_its_fence_and_late_reports_are_evidence() {
    let mut h = H::new();
    let timing = Timing::default();
    h.task(serde_json::json!({"task_id": "m", "agent_id": "a", "execution": {"max_retries": 0, "concurrency_limit": 1, "overlap_policy": "queue"}}));
    let (s1, _) = h.hello("r1", &["a"], 1);
    let (s2, _) = h.hello("r2", &["a"], 1);
    let a = one_assign(&h.trigger("m", "1"));
    let owner = if h.run(&a.run_id).attempts[0].runner_id == "r1" { ("r1", s1, "r2", s2) } else { ("r2", s2, "r1", s1) };
    h.trigger("m", "2");
    let step = Duration::seconds(1);
    let mut disconnected_at = None;
    let mut waited = Duration::zero();
    while h.core.active_run(&a.run_id).is_some_and(|r| r.status == RunStatus::Running) {
        let fx = h.advance(step);
        waited += step;
        h.msg(owner.2, owner.3, FromRunner::Heartbeat { seq: 1, draining: false, acked_seq: 1 });
        if fx.disconnects.iter().any(|(id, _)| id == owner.0) {
            disconnected_at.get_or_insert(waited);
        }
        assert!(
            assigns(&fx).is_empty() || h.core.active_run(&a.run_id).is_none_or(|r| r.status != RunStatus::Running),
            "no second agent while the first may live"
        );
        assert!(waited < Duration::seconds(60), "never lost");
    }
    let silent = Duration::from_std(timing.runner_silent_after()).expect("d");
    let lost = Duration::from_std(timing.runner_lost_after()).expect("d");
    assert!(disconnected_at.is_some_and(|d| d > silent && d <= silent + step + step), "{disconnected_at:?}");
    assert!(waited > lost && waited <= lost + step + step, "lost after {waited:?}");
    let failed = h.stored(&a.run_id).expect("stored");
    assert_eq!(failed.status, RunStatus::Failed);
    assert_eq!(failed.attempts[0].outcome, Some(Outcome::Lost));
    assert_eq!(h.stored("m.manual-2").map(|r| r.status), Some(RunStatus::Running), "the queued run went once the first was lost");
    // The lost runner comes back and reports success: evidence only.
    let (s1b, _) =
        h.hello_with(owner.0, &["a"], 1, &format!("{}-instance", owner.0), vec![InFlightExec::new(&a.run_id, &a.execution_id, 1)]);
    let fx = h.finished(owner.0, s1b, &a, ReportedOutcome::Succeeded);
    assert!(fx.reads.len() == 1, "the run left memory: the store is asked");
    let (run_id, purpose) = fx.reads[0].clone();
    h.core.handle(h.clocks(), Input::RunLoaded { run_id, run: Some(Box::new(failed)), purpose });
    let fx = h.drain();
    assert_eq!(acks(&fx), 1);
    let after = h.stored(&a.run_id).expect("stored");
    assert_eq!(after.status, RunStatus::Failed, "terminal is final");
    let report = after.attempts[0].report.clone().expect("the late report is kept");
    assert_eq!(report.outcome, Outcome::Succeeded);
    assert_eq!(report.result, Some(serde_json::json!({"by": owner.0})));
}

/// The deadline backstop ends an attempt TIMEOUT but its slot is held
/// until the runner reports the agent gone.
#[test]
fn deadline_backstop_holds_the_slot_until_the_runner_confirms() {
    let mut h = H::new();
    h.task(serde_json::json!({"task_id": "m", "agent_id": "a", "execution": {"timeout_seconds": 10, "overlap_policy": "queue"}}));
    let (s, _) = h.hello("r1", &["a"], 4);
    let a = one_assign(&h.trigger("m", "1"));
    h.trigger("m", "2");
    let slack = Duration::from_std(Timing::default().deadline_slack()).expect("d");
    let mut fx = Effects::default();
    for _ in 0..(10 + slack.num_seconds()) {
        fx = h.advance(Duration::seconds(1));
        h.heartbeat("r1", s);
    }
    assert!(fx.sends.iter().any(|o| matches!(&o.msg, ToRunner::Cancel { execution_id, .. } if *execution_id == a.execution_id)));
    let timed_out = h.run(&a.run_id);
    assert_eq!(timed_out.status, RunStatus::Timeout);
    assert!(timed_out.attempts[0].awaiting_runner);
    assert!(assigns(&fx).is_empty(), "the next run waits for the agent");
    let fx = h.finished("r1", s, &a, ReportedOutcome::Timeout);
    assert_eq!(one_assign(&fx).run_id, "m.manual-2");
    assert_eq!(h.stored(&a.run_id).map(|r| r.attempts[0].awaiting_runner), Some(false));
}

/// A runner process replaced by another with the same id (new instance):
/// its unreported execution is lost, and holds its task's slot until the
/// old process's fence has passed.
#[test]
fn a_restarted_runner_without_its_execution_frees_the_slot_after_the_old_fence() {
    let mut h = H::new();
    h.task(serde_json::json!({"task_id": "m", "agent_id": "a", "execution": {"overlap_policy": "queue"}}));
    let (s, _) = h.hello("r1", &["a"], 4);
    let a = one_assign(&h.trigger("m", "1"));
    h.msg("r1", s, FromRunner::Started { run_id: a.run_id.clone(), execution_id: a.execution_id.clone(), started_at: None });
    h.trigger("m", "2");
    h.core.handle(h.clocks(), Input::RunnerGone { runner_id: "r1".into(), session: s });
    h.now += Duration::seconds(1);
    let (s2, fx) = h.hello_with("r1", &["a"], 4, "new-instance", Vec::new());
    assert!(assigns(&fx).is_empty(), "the old process may still run the agent");
    assert_eq!(h.run(&a.run_id).attempts[0].outcome, Some(Outcome::Lost));
    let lost = Duration::from_std(Timing::default().runner_lost_after()).expect("d");
    let mut got = None;
    for i in 0..=lost.num_seconds() {
        let fx = h.advance(Duration::seconds(1));
        h.heartbeat("r1", s2);
        if let Some((_, x)) = assigns(&fx).into_iter().next() {
            got = Some((i, x));
            break;
        }
    }
    let (i, next) = got.expect("dispatched once the old fence passed");
    assert_eq!(next.run_id, "m.manual-2");
    assert!(i + 2 >= lost.num_seconds(), "not before the old process's fence: {i}");
}

/// The same runner process reconnecting without an assignment it never
/// started: dispatched again as the same attempt.
#[test]
fn the_same_process_reconnecting_without_an_unstarted_assignment_gets_it_again() {
    let mut h = H::new();
    h.task(manual("m"));
    let (s, _) = h.hello("r1", &["a"], 1);
    let a = one_assign(&h.trigger("m", "1"));
    h.core.handle(h.clocks(), Input::RunnerGone { runner_id: "r1".into(), session: s });
    let (_, fx) = h.hello("r1", &["a"], 1);
    assert!(assigns(&fx).is_empty());
    assert!(h.run("m.manual-1").attempts.is_empty());
    let again = one_assign(&h.advance(Duration::seconds(1)));
    assert_eq!((again.attempt, again.run_id), (1, a.run_id));
}

// ----------------------------------------------------------- cancellation

#[test]
fn cancel_of_a_pending_run_is_immediate_and_of_a_running_one_waits_for_the_agent() {
    let mut h = H::new();
    h.task(serde_json::json!({"task_id": "m", "agent_id": "a", "execution": {"concurrency_limit": 1, "overlap_policy": "queue"}}));
    let (s, _) = h.hello("r1", &["a"], 2);
    let a = one_assign(&h.trigger("m", "1"));
    h.trigger("m", "2");
    h.core.handle(h.clocks(), Input::Cancel { reply: 9, run_id: "m.manual-2".into(), reason: String::new() });
    let fx = h.drain();
    assert!(matches!(fx.replies.first(), Some((9, Reply::Cancel(Ok(r)))) if r.status == RunStatus::Cancelled));
    h.trigger("m", "3");
    h.core.handle(h.clocks(), Input::Cancel { reply: 10, run_id: a.run_id.clone(), reason: "stop".into() });
    let fx = h.drain();
    assert!(fx.sends.iter().any(|o| matches!(o.msg, ToRunner::Cancel { .. })));
    assert!(assigns(&fx).is_empty(), "no replacement while the cancelled agent may live");
    let fx = h.finished("r1", s, &a, ReportedOutcome::Cancelled);
    assert_eq!(one_assign(&fx).run_id, "m.manual-3");
    // Cancelling a finished run: the store is asked, then refused.
    h.core.handle(h.clocks(), Input::Cancel { reply: 11, run_id: "m.manual-2".into(), reason: String::new() });
    let fx = h.drain();
    let (run_id, purpose) = fx.reads[0].clone();
    let stored = h.stored("m.manual-2").map(Box::new);
    h.core.handle(h.clocks(), Input::RunLoaded { run_id, run: stored, purpose });
    assert!(matches!(h.drain().replies.first(), Some((11, Reply::Cancel(Err(Error::FailedPrecondition(_)))))));
}

fn keyed(key: &str, window: Option<i64>) -> TriggerRequest {
    TriggerRequest {
        task_id: "m".into(),
        params: Default::default(),
        not_before: None,
        delay_seconds: 0,
        idempotency_key: Some(key.into()),
        idempotency_window: window.map(Duration::seconds),
        caller_trace: None,
        baggage: String::new(),
    }
}

/// The answer of a trigger, after the lookup the core asked for (if any)
/// was answered with `stored`.
fn trigger_answer(h: &mut H, reply: ReplyId, req: TriggerRequest, stored: Option<StoredId>) -> (Effects, Result<Triggered>) {
    h.core.handle(h.clocks(), Input::Trigger { reply, req, explicit_key: true });
    let mut fx = h.drain();
    if let Some(stored) = stored {
        let (r, ids) = fx.run_checks.pop().expect("a lookup");
        assert_eq!((r, ids.len(), ids[0].windowed), (reply, 1, true));
        h.core.handle(h.clocks(), Input::EventsLoaded { reply, found: vec![stored] });
        fx = h.drain();
    }
    assert!(fx.run_checks.is_empty(), "no lookup: {:?}", fx.run_checks);
    let i = fx.replies.iter().position(|(r, _)| *r == reply).expect("an answer");
    let answer = match fx.replies.remove(i).1 {
        Reply::Trigger(t) => t,
        other => panic!("{other:?}"),
    };
    (fx, answer)
}

/// A key whose run was written by an earlier version (no dedup key, no
/// claim of its own) is a duplicate while the run is kept: its record is
/// read for the answer.
#[test]
fn a_trigger_with_a_known_key_reads_the_store_first() {
    let mut h = H::new();
    h.task(manual("m"));
    h.core.handle(h.clocks(), Input::Trigger { reply: 1, req: keyed("k", None), explicit_key: true });
    let fx = h.drain();
    assert!(fx.writes.is_empty() && fx.replies.is_empty());
    h.core.handle(h.clocks(), Input::EventsLoaded { reply: 1, found: vec![StoredId::Run] });
    let fx = h.drain();
    let (run_id, purpose) = fx.reads[0].clone();
    assert_eq!(run_id, "m.manual-k");
    let existing = RunRecord::pending(run_id.clone(), "m", "a", TriggerKind::Manual, t0() - Duration::hours(1), t0());
    h.core.handle(h.clocks(), Input::RunLoaded { run_id: run_id.clone(), run: Some(Box::new(existing)), purpose: purpose.clone() });
    let fx = h.drain();
    assert!(matches!(&fx.replies[0].1, Reply::Trigger(Ok(t)) if !t.created && t.scheduled_at == t0() - Duration::hours(1)));
    assert!(fx.writes.is_empty());
    h.core.handle(h.clocks(), Input::RunLoaded { run_id, run: None, purpose });
    let fx = h.drain();
    assert!(matches!(&fx.replies[0].1, Reply::Trigger(Ok(t)) if t.created));
    assert_eq!(fx.writes.len(), 1);
}

/// Issue 35: a manual trigger's idempotency key finds its run for exactly
/// its window (24 h unless the request says), whatever the history keeps:
/// in memory, from the store's dedup key (a new leader), and then makes a
/// new run with a claim of its own. Before, a key found its run for as
/// long as the run was kept, and never again once it was pruned.
#[test]
fn a_manual_key_deduplicates_for_its_window_only() {
    let mut h = H::new();
    h.task(manual("m"));
    let (fx, first) = trigger_answer(&mut h, 1, keyed("k", Some(5)), Some(StoredId::Absent));
    let first = first.expect("created");
    assert!(first.created);
    assert_eq!(first.run_id, "m.manual-k");
    let claim = fx
        .writes
        .iter()
        .flatten()
        .find_map(|op| match op {
            StoreOp::CreateRun(r) => r.dedup.clone(),
            _ => None,
        })
        .expect("the claim is written with the run");
    assert_eq!(
        (claim.key.as_str(), claim.run_id.as_str(), claim.expires_at, claim.scheduled_at),
        ("m.manual-k", "m.manual-k", t0() + Duration::seconds(5), Some(t0()))
    );
    h.advance(Duration::seconds(4));
    let (fx, again) = trigger_answer(&mut h, 2, keyed("k", Some(5)), None);
    let again = again.expect("duplicate");
    assert!(!again.created && again.run_id == first.run_id && again.scheduled_at == t0(), "{again:?}");
    assert!(fx.writes.is_empty());
    h.advance(Duration::seconds(2));
    let (_, later) = trigger_answer(&mut h, 3, keyed("k", Some(5)), None);
    let later = later.expect("a new run");
    assert!(later.created && later.run_id.starts_with("m.manual-k-"), "{later:?}");

    // A new leader: the store's dedup key decides.
    let live = crate::model::event::DedupClaim {
        key: "m.manual-k".into(),
        run_id: "m.manual-k-17".into(),
        expires_at: t0() + Duration::seconds(1),
        scheduled_at: Some(t0() - Duration::minutes(3)),
    };
    let expired = crate::model::event::DedupClaim { expires_at: t0(), ..live.clone() };
    let mut h = H::new();
    h.task(manual("m"));
    let (_, dup) = trigger_answer(&mut h, 4, keyed("k", None), Some(StoredId::Claim(live)));
    let dup = dup.expect("duplicate");
    assert!(!dup.created && dup.run_id == "m.manual-k-17" && dup.scheduled_at == t0() - Duration::minutes(3), "{dup:?}");
    let mut h = H::new();
    h.task(manual("m"));
    let (_, new) = trigger_answer(&mut h, 5, keyed("k", None), Some(StoredId::Claim(expired)));
    assert!(new.as_ref().is_ok_and(|t| t.created && t.run_id.starts_with("m.manual-k-")), "{new:?}");
    let mut h = H::new();
    h.task(manual("m"));
    let (fx, refused) = trigger_answer(&mut h, 6, keyed("k", None), Some(StoredId::Unavailable("archive down".into())));
    assert!(matches!(refused, Err(Error::Unavailable { .. })), "{refused:?}");
    assert!(fx.writes.is_empty(), "refused rather than risk a second run");
}

// ------------------------------------------------------- task changes

/// Invariant 5: slots due while a new leader waits for re-declaration get
/// records, even when the task is paused (or deleted) before they fire.
#[test]
fn slots_due_before_a_pause_are_settled_after_redeclaration() {
    let start = t0();
    let mut rec = H::new().record(every_10s("t", serde_json::json!({})));
    rec.created_at = start - Duration::minutes(5);
    let mut running =
        RunRecord::pending("t.20261201T095950Z".into(), "t", "a", TriggerKind::Interval, start - Duration::seconds(10), start);
    running.status = RunStatus::Running;
    running.attempts.push(crate::model::Attempt {
        attempt: 1,
        execution_id: "e-old".into(),
        runner_id: "r1".into(),
        runner_instance: "i1".into(),
        dispatched_at: start - Duration::seconds(10),
        started_at: Some(start - Duration::seconds(10)),
        finished_at: None,
        outcome: None,
        error: None,
        exit_code: None,
        awaiting_runner: false,
        report: None,
        usage: None,
        ..Default::default()
    });
    let cursor = Cursor { last_slot: Some(start - Duration::seconds(10)), updated_at: None, breaker: None, time_runs: 0 };
    let mut h = H::loaded(start, vec![(rec.clone(), Some(cursor))], vec![running]);
    // Two slots fire while r1 has not said Hello: deferred.
    let fx = h.advance(Duration::seconds(15));
    assert!(fx.writes.is_empty(), "nothing decided before re-declaration: {:?}", fx.writes);
    // The task is paused meanwhile.
    let mut paused = rec.clone();
    paused.paused = true;
    paused.paused_at = Some(h.now);
    h.put(paused);
    // r1 comes back without the old run (lost); the due slots are settled.
    let (_, _) = h.hello_with("r1", &["a"], 4, "i2", Vec::new());
    let fx = h.advance(Duration::zero());
    let _ = fx;
    for slot in ["t.20261201T100000Z", "t.20261201T100010Z"] {
        let covered = h.log.iter().flat_map(|f| f.writes.iter().flatten()).any(|op| match op {
            StoreOp::CreateRun(r) => {
                r.run_id == slot
                    || (r.missed_from.is_some_and(|f| f <= slot_time(slot)) && r.missed_until.is_some_and(|u| u >= slot_time(slot)))
            }
            _ => false,
        });
        assert!(covered, "slot {slot} has a record");
    }
    // And nothing more fires while paused.
    let fx = h.advance(Duration::seconds(60));
    assert!(!fx.writes.iter().flatten().any(|op| matches!(op, StoreOp::CreateRun(_))));
}

fn slot_time(run_id: &str) -> DateTime<Utc> {
    let stamp = run_id.split('.').nth(1).expect("stamp");
    chrono::NaiveDateTime::parse_from_str(stamp, "%Y%m%dT%H%M%SZ").expect("stamp").and_utc()
}

#[test]
fn deleting_a_task_settles_its_due_slots_and_cancels_its_waiting_runs() {
    let mut h = H::new();
    h.task(serde_json::json!({"task_id": "t", "agent_id": "x", "trigger": {"type": "interval", "every": "10s"}, "execution": {"overlap_policy": "queue"}}));
    h.advance(Duration::seconds(10));
    assert_eq!(h.run("t.20261201T100010Z").status, RunStatus::Pending);
    h.now += Duration::seconds(2);
    h.core.handle(h.clocks(), Input::TaskDeleted { task_id: "t".into() });
    let fx = h.drain();
    assert!(fx.writes.iter().flatten().any(|op| matches!(op, StoreOp::DeleteCursor { task_id } if task_id == "t")));
    assert_eq!(h.stored("t.20261201T100010Z").map(|r| r.status), Some(RunStatus::Cancelled));
    let fx = h.advance(Duration::seconds(30));
    assert!(fx.writes.is_empty());
}

#[test]
fn heartbeats_are_acknowledged_with_their_seq_and_nothing_is_written() {
    let mut h = H::new();
    let (s, fx) = h.hello("r1", &["a"], 1);
    let fence = fx.sends.iter().find_map(|o| if let ToRunner::Welcome { fence_ms, .. } = o.msg { Some(fence_ms) } else { None });
    assert_eq!(fence, Some(Timing::default().runner_fence().as_millis() as u64));
    let fx = h.msg("r1", s, FromRunner::Heartbeat { seq: 42, draining: false, acked_seq: 42 });
    assert!(matches!(fx.sends.as_slice(), [Outbound { msg: ToRunner::HeartbeatAck { seq: 42, fencing_token: TOKEN }, .. }]));
    assert!(fx.writes.is_empty());
    // An old session's messages are ignored.
    let fx = h.msg("r1", s + 100, FromRunner::Heartbeat { seq: 1, draining: false, acked_seq: 1 });
    assert!(fx.sends.is_empty());
}

#[test]
fn a_second_live_runner_with_the_same_id_is_refused() {
    let mut h = H::new();
    h.hello("r1", &["a"], 1);
    let hello = RunnerHello { runner_id: "r1".into(), slots: 1, ..Default::default() };
    assert!(matches!(h.core.runner_hello(h.clocks(), hello), Err(Error::FailedPrecondition(_))));
}

/// Progress is persisted lazily: many reports, one write per flush.
#[test]
fn progress_floods_cost_one_write_per_flush() {
    let mut h = H::new();
    h.task(manual("m"));
    let (s, _) = h.hello("r1", &["a"], 1);
    let a = one_assign(&h.trigger("m", "1"));
    for i in 0..1000 {
        let fx = h.msg(
            "r1",
            s,
            FromRunner::Progress {
                run_id: a.run_id.clone(),
                execution_id: a.execution_id.clone(),
                percent: Some(f64::from(i % 100)),
                message: format!("{i}"),
                checkpoint: None,
            },
        );
        assert!(fx.writes.is_empty());
    }
    let fx = h.advance(Duration::from_std(PROGRESS_FLUSH).expect("d"));
    assert_eq!(fx.writes.len(), 1);
    assert_eq!(h.stored(&a.run_id).and_then(|r| r.progress).map(|p| p.message), Some("999".to_string()));
}

/// Deadlines of dispatched runs and ended attempts are forgotten, not left
/// to fire as no-ops: at a high run rate they would pile up.
#[test]
fn finished_runs_leave_no_deadlines_behind() {
    let mut h = H::new();
    h.task(serde_json::json!({"task_id": "m", "agent_id": "a", "execution": {"concurrency_limit": 100}}));
    let (s, _) = h.hello("r1", &["a"], 100);
    for i in 0..500 {
        let a = one_assign(&h.trigger("m", &i.to_string()));
        h.finished("r1", s, &a, ReportedOutcome::Succeeded);
    }
    assert_eq!((h.core.timers.start_by.len(), h.core.timers.attempt_deadlines.len()), (0, 0));
    assert!(h.core.timers.len() < 10, "timers piled up: {}", h.core.timers.len());
    assert!(h.core.active_runs("").is_empty(), "written terminal runs left memory");
}

/// A runner whose heartbeat acks lag 10 heartbeats behind is not reading its
/// stream (what is sent to it sits in buffers): it is disconnected, though
/// its channel never filled.
#[test]
fn a_runner_that_does_not_read_its_acks_is_disconnected() {
    let mut h = H::new();
    let (s, _) = h.hello("r1", &["a"], 1);
    for seq in 1..=10 {
        let fx = h.msg("r1", s, FromRunner::Heartbeat { seq, draining: false, acked_seq: 0 });
        assert!(fx.disconnects.is_empty(), "seq {seq}");
    }
    let fx = h.msg("r1", s, FromRunner::Heartbeat { seq: 11, draining: false, acked_seq: 0 });
    assert_eq!(fx.disconnects, vec![("r1".to_string(), s)]);
    h.task(manual("m"));
    assert!(assigns(&h.trigger("m", "1")).is_empty(), "no work for a runner cut off");
}

/// Found by breaking it: a task deleted and applied again has no cursor,
/// and its past `once` slot already has a run; creating it again failed
/// the whole transaction, and the engine restarted every second. The slot
/// is now looked up first.
#[test]
fn a_past_once_slot_is_looked_up_before_it_runs() {
    for exists in [false, true] {
        let mut h = H::new();
        let fx = h.task(serde_json::json!({"task_id": "o", "agent_id": "a", "trigger": {"type": "once", "at": "2020-01-01T00:00:00Z"}}));
        assert!(fx.writes.is_empty(), "nothing before the store says");
        let (run_id, purpose) = fx.reads[0].clone();
        assert_eq!(run_id, "o.20200101T000000Z");
        let stored = exists.then(|| Box::new(RunRecord::pending(run_id.clone(), "o", "a", TriggerKind::Once, t0(), t0())));
        h.core.handle(h.clocks(), Input::RunLoaded { run_id: run_id.clone(), run: stored, purpose });
        let fx = h.drain();
        let created = fx.writes.iter().flatten().any(|op| matches!(op, StoreOp::CreateRun(r) if r.run_id == run_id));
        let cursor = fx.writes.iter().flatten().any(|op| matches!(op, StoreOp::PutCursor { .. }));
        assert_eq!((created, cursor), (!exists, true), "exists={exists}");
    }
}

/// Issue 19: `TriggerTask` params over the limit (alone, or merged with
/// the task's) are refused naming `params` and the limit; nothing is created.
#[test]
fn trigger_params_over_the_limit_are_refused() {
    use crate::model::task::MAX_PARAMS_BYTES;
    let mut h = H::new();
    h.task(serde_json::json!({"task_id": "m", "agent_id": "a", "context": {"params": {"base": "y".repeat(40_000)}}}));
    for (key, n) in [("alone", 700_000), ("merged", 30_000)] {
        let mut params = serde_json::Map::new();
        params.insert("p".into(), serde_json::json!("x".repeat(n)));
        let req = TriggerRequest {
            task_id: "m".into(),
            params,
            not_before: None,
            delay_seconds: 0,
            idempotency_key: Some(key.into()),
            idempotency_window: None,
            caller_trace: None,
            baggage: String::new(),
        };
        h.core.handle(h.clocks(), Input::Trigger { reply: 5, req, explicit_key: false });
        let fx = h.core.poll_effects();
        assert!(fx.writes.is_empty(), "{key}: nothing written");
        match fx.replies.as_slice() {
            [(5, Reply::Trigger(Err(Error::InvalidArgument { field, reason })))] => {
                assert_eq!(field, "params", "{key}");
                assert!(reason.contains(&format!("at most {MAX_PARAMS_BYTES}")), "{key}: {reason}");
            }
            other => panic!("{key}: {other:?}"),
        }
    }
}

/// Issue 19: `not_before` in year 0001 was accepted. It is bounded like
/// the future: within a year either way.
#[test]
fn not_before_is_bounded_in_the_past_too() {
    let mut h = H::new();
    h.task(manual("m"));
    for (key, at, ok) in
        [("ancient", "0001-01-01T00:00:00Z", false), ("far", "2200-01-01T00:00:00Z", false), ("yesterday", "2026-11-30T10:00:00Z", true)]
    {
        let req = TriggerRequest {
            task_id: "m".into(),
            params: Default::default(),
            not_before: Some(at.parse().expect("t")),
            delay_seconds: 0,
            idempotency_key: Some(key.into()),
            idempotency_window: None,
            caller_trace: None,
            baggage: String::new(),
        };
        h.core.handle(h.clocks(), Input::Trigger { reply: 7, req, explicit_key: false });
        let fx = h.core.poll_effects();
        match (ok, fx.replies.as_slice()) {
            (true, [(7, Reply::Trigger(Ok(_)))]) => {}
            (false, [(7, Reply::Trigger(Err(Error::InvalidArgument { field, .. })))]) => assert_eq!(field, "not_before", "{key}"),
            (_, other) => panic!("{key}: {other:?}"),
        }
    }
}

fn created(fx: &Effects) -> Vec<RunRecord> {
    fx.writes.iter().flatten().filter_map(|op| if let StoreOp::CreateRun(r) = op { Some((**r).clone()) } else { None }).collect()
}

/// Slots that come due while this leader runs but is busy, within
/// `misfire_grace_seconds`, are late, not missed: each gets its run (its
/// lag shows).
#[test]
fn slots_late_within_the_grace_run_late() {
    let mut h = H::new();
    h.task(serde_json::json!({"task_id": "t", "agent_id": "a", "trigger": {"type": "interval", "every": "1s"},
        "execution": {"concurrency_limit": 100, "misfire_grace_seconds": 60}}));
    // Ten seconds go by (both clocks) before the engine gets to its timers.
    h.now += Duration::seconds(10);
    h.mono = h.mono.after(Duration::seconds(10));
    let created = created(&h.advance(Duration::zero()));
    assert_eq!(created.len(), 10, "{created:?}");
    assert!(created.iter().all(|r| r.status == RunStatus::Pending && r.skip_reason.is_none()), "{created:?}");
}

/// Issue 19: a slot later than `misfire_grace_seconds` when the engine
/// gets to it is a misfire whatever made it late. A leader stopped (or
/// busy) for 40 s ran every 1-second slot at once; now `skip` leaves one
/// coalesced record, and the error says why the slots were late.
#[test]
fn a_stopped_leader_s_late_slots_follow_the_misfire_policy() {
    for (policy, runs) in [("skip", 0), ("run_once", 1), ("run_all", 10)] {
        let mut h = H::new();
        h.task(serde_json::json!({"task_id": "t", "agent_id": "a", "trigger": {"type": "interval", "every": "1s"},
            "execution": {"concurrency_limit": 100, "misfire_policy": policy, "misfire_grace_seconds": 10}}));
        // SIGSTOP: both clocks go on, the engine does not.
        h.now += Duration::seconds(40);
        h.mono = h.mono.after(Duration::seconds(40));
        let created = created(&h.advance(Duration::zero()));
        let skipped: Vec<&RunRecord> = created.iter().filter(|r| r.status == RunStatus::Skipped).collect();
        let ran = created.iter().filter(|r| r.status == RunStatus::Pending).count();
        assert_eq!((skipped.len(), ran), (1, runs), "{policy}: one coalesced record, {runs} run(s): {created:?}");
        assert_eq!(skipped[0].skip_reason, Some(SkipReason::Misfired));
        assert_eq!(skipped[0].missed_count, Some(40 - runs as u64), "{policy}");
        assert!(skipped[0].error.as_deref().unwrap_or("").contains("this leader was busy or stopped"), "{:?}", skipped[0].error);
    }
}

/// Issue 19: the wall clock stepping an hour forward made a `* * * * *`
/// task with `concurrency_limit: 100` run 60 slots at once; with `skip`
/// they are one record, whose error names the clock step.
#[test]
fn a_wall_clock_step_forward_is_a_misfire_not_a_burst() {
    for overlap in ["skip", "queue"] {
        let mut h = H::new();
        h.task(serde_json::json!({"task_id": "t", "agent_id": "a", "trigger": {"type": "cron", "expr": "* * * * *"},
            "execution": {"concurrency_limit": 100, "overlap_policy": overlap, "misfire_policy": "skip"}}));
        let created = created(&h.jump(Duration::hours(1)));
        assert_eq!(created.len(), 1, "{overlap}: {created:?}");
        let r = &created[0];
        assert_eq!((r.status, r.skip_reason, r.missed_count), (RunStatus::Skipped, Some(SkipReason::Misfired), Some(60)));
        assert!(r.error.as_deref().unwrap_or("").contains("wall clock stepped 3600 s forward"), "{:?}", r.error);
        // The schedule goes on from the new time: the next slot runs.
        let next = created_after(&mut h, Duration::seconds(60));
        assert_eq!(next.iter().filter(|r| r.status == RunStatus::Pending).count(), 1, "{next:?}");
    }
}

fn created_after(h: &mut H, d: Duration) -> Vec<RunRecord> {
    created(&h.advance(d))
}

/// Issue 19: deadlines and timeouts measure elapsed time. The hour's
/// step ended a running attempt 17 s into its 600 s timeout, expired a
/// PENDING run's start timeout and made every runner silent; none of that
/// happens now, and the timeouts still fire when their time has elapsed.
#[test]
fn a_wall_clock_step_ends_no_attempt_runner_or_start_timeout() {
    let mut h = H::new();
    h.task(serde_json::json!({"task_id": "t", "agent_id": "a", "execution": {"timeout_seconds": 600}}));
    h.task(serde_json::json!({"task_id": "w", "agent_id": "nobody", "execution": {"start_timeout_seconds": 120}}));
    let (s, _) = h.hello("r1", &["a"], 4);
    let fx = h.trigger("t", "1");
    let a = one_assign(&fx);
    h.trigger("w", "1");
    h.tick(17, &[("r1", s)]);
    // The wall clock steps an hour forward; the runner keeps heartbeating.
    let fx = h.jump(Duration::hours(1));
    assert!(fx.disconnects.is_empty(), "no runner is silent: {:?}", fx.disconnects);
    h.tick(5, &[("r1", s)]);
    assert_eq!(h.run(&a.run_id).status, RunStatus::Running, "the attempt is 22 s into its 600 s");
    assert_eq!(h.run("w.manual-1").status, RunStatus::Pending, "the start timeout is 120 s of elapsed time");
    // 120 s after the trigger (elapsed), the start timeout fires.
    h.tick(100, &[("r1", s)]);
    assert_eq!(h.stored("w.manual-1").map(|r| r.status), Some(RunStatus::Timeout));
    // A step back does not hold a deadline either: past 600 s + slack of
    // elapsed time the backstop ends the attempt.
    h.jump(-Duration::hours(2));
    let slack = h.core.timing().deadline_slack().as_secs() as i64;
    h.tick(600 - 122 + slack + 1, &[("r1", s)]);
    assert_eq!(h.stored(&a.run_id).map(|r| r.status), Some(RunStatus::Timeout), "the backstop counts elapsed time");
}

/// A backward step does not run a handled slot again.
#[test]
fn a_wall_clock_step_back_runs_no_slot_twice() {
    let mut h = H::new();
    h.task(serde_json::json!({"task_id": "t", "agent_id": "a", "trigger": {"type": "interval", "every": "10s"},
        "execution": {"concurrency_limit": 100}}));
    let before = created_after(&mut h, Duration::seconds(30));
    assert_eq!(before.len(), 3);
    h.jump(-Duration::seconds(30));
    let after = created_after(&mut h, Duration::seconds(40));
    let mut ids: Vec<String> = before.iter().chain(after.iter()).map(|r| r.run_id.clone()).collect();
    let n = ids.len();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), n, "no slot twice: {ids:?}");
    assert_eq!(after.len(), 1, "only the slot after the last handled one (10:00:40): {after:?}");
}

// ------------------------------------------------------------ circuit breaker

fn breaker_in(fx: &Effects, task: &str) -> Option<crate::model::breaker::Breaker> {
    fx.writes.iter().flatten().rev().find_map(|op| match op {
        StoreOp::PutCursor { task_id, cursor } if task_id == task => cursor.breaker.clone(),
        _ => None,
    })
}

/// `failure_threshold: 2`, `cooldown_seconds: 25`, every 10 s: two failed
/// runs open it (the second run's end and the cursor in one group), slots
/// are skipped `circuit_open` for the cooldown, the next slot is the trial;
/// it fails (a second opening), a new leader keeps the state, the next
/// trial succeeds and closes it.
#[test]
fn breaker_opens_skips_tries_and_closes_across_a_reload() {
    use crate::model::breaker::BreakerPhase;
    let mut h = H::new();
    let cb = serde_json::json!({"circuit_breaker": {"failure_threshold": 2, "cooldown_seconds": 25}});
    h.task(every_10s("t", cb));
    let (s, _) = h.hello("r1", &["a"], 4);
    let mut opened_events = 0;
    let fail_next = |h: &mut H, s: u64| -> Effects {
        let a = one_assign(&h.tick(10, &[("r1", s)]));
        h.finished("r1", s, &a, ReportedOutcome::Failed)
    };
    let fx = fail_next(&mut h, s);
    assert_eq!(breaker_in(&fx, "t").expect("counted").consecutive_failures, 1);
    let fx = fail_next(&mut h, s);
    // 10:00:20's run failed: opened until 10:00:45, in the same group as the run's end.
    let group = fx.writes.iter().find(|g| g.iter().any(|op| matches!(op, StoreOp::PutCursor { .. }))).expect("cursor written");
    assert!(group.iter().any(|op| matches!(op, StoreOp::PutRun(r) if r.status == RunStatus::Failed)), "run end and breaker together");
    let b = breaker_in(&fx, "t").expect("opened");
    assert_eq!((b.phase, b.openings), (BreakerPhase::Open, 1));
    assert_eq!(b.open_until, Some("2026-12-01T10:00:45Z".parse().unwrap()));
    opened_events += fx.events.iter().filter(|e| matches!(e, Lifecycle::BreakerChanged { opened: true, .. })).count();
    // 10:00:30 and 10:00:40 are skipped circuit_open; 10:00:50 is the trial.
    let fx = h.tick(20, &[("r1", s)]);
    assert!(assigns(&fx).is_empty());
    // One record for both (consecutive skips of one reason coalesce).
    let r = h.stored("t.20261201T100030Z").expect("skip record");
    assert_eq!((r.status, r.skip_reason, r.missed_count), (RunStatus::Skipped, Some(SkipReason::CircuitOpen), Some(2)));
    assert_eq!(r.missed_until, Some(slot_time("t.20261201T100040Z")));
    let trial = one_assign(&h.tick(10, &[("r1", s)]));
    assert_eq!(trial.run_id, "t.20261201T100050Z");
    // Half-open: 10:01:00 is skipped while the trial runs.
    h.tick(10, &[("r1", s)]);
    assert_eq!(h.stored("t.20261201T100100Z").expect("skip").skip_reason, Some(SkipReason::CircuitOpen));
    let fx = h.finished("r1", s, &trial, ReportedOutcome::Failed);
    let b = breaker_in(&fx, "t").expect("reopened");
    assert_eq!((b.phase, b.openings), (BreakerPhase::Open, 2));
    opened_events += fx.events.iter().filter(|e| matches!(e, Lifecycle::BreakerChanged { opened: true, .. })).count();
    assert_eq!(opened_events, 2, "one opening event per opening");

    // A new leader reads the cursor back: still open until 10:01:25, and
    // the trial after it (10:01:30) closes it.
    let cursor = h.log.iter().flat_map(|fx| fx.writes.iter().flatten()).rev().find_map(|op| match op {
        StoreOp::PutCursor { cursor, .. } => Some(cursor.clone()),
        _ => None,
    });
    let rec = h.core.tasks.get("t").expect("task").record.clone();
    let mut h2 = H::loaded(h.now, vec![(rec, cursor)], Vec::new());
    let (s2, _) = h2.hello("r1", &["a"], 4);
    let fx = h2.tick(20, &[("r1", s2)]);
    assert!(assigns(&fx).is_empty(), "10:01:10 and 10:01:20 are inside the cooldown");
    let trial = one_assign(&h2.tick(10, &[("r1", s2)]));
    let fx = h2.finished("r1", s2, &trial, ReportedOutcome::Succeeded);
    let b = breaker_in(&fx, "t").expect("closed");
    assert_eq!((b.phase, b.consecutive_failures, b.openings), (BreakerPhase::Closed, 0, 2));
    assert_eq!(assigns(&h2.tick(10, &[("r1", s2)])).len(), 1, "runs again");
}

/// A half-open breaker whose trial run is not active at load lets the
/// next run be the trial, and `ResetBreaker` closes an open one.
#[test]
fn breaker_recovers_a_lost_trial_and_resets_by_hand() {
    use crate::model::breaker::{Breaker, BreakerPhase};
    let h = H::new();
    let rec = h.record(
        manual("m")
            .as_object()
            .cloned()
            .map(|mut o| {
                o.insert("execution".into(), serde_json::json!({"circuit_breaker": {"failure_threshold": 1, "cooldown_seconds": 60}}));
                serde_json::Value::Object(o)
            })
            .unwrap(),
    );
    let b = Breaker {
        phase: BreakerPhase::HalfOpen,
        consecutive_failures: 1,
        trial_run_id: Some("m.gone".into()),
        openings: 1,
        ..Default::default()
    };
    let cursor = Cursor { breaker: Some(b), ..Default::default() };
    let mut h = H::loaded(t0(), vec![(rec, Some(cursor))], Vec::new());
    let b = breaker_in(&h.log[0], "m").expect("recovered at load");
    assert_eq!((b.phase, b.trial_run_id), (BreakerPhase::Open, None));
    // The manual run is the trial; it fails: open for 60 s; a second trigger is skipped.
    let (s, _) = h.hello("r1", &["a"], 4);
    let a = one_assign(&h.trigger("m", "k1"));
    h.finished("r1", s, &a, ReportedOutcome::Failed);
    h.trigger("m", "k2");
    let skipped = h
        .log
        .iter()
        .flat_map(|fx| fx.events.iter())
        .filter(|e| matches!(e, Lifecycle::SlotSkipped { reason: SkipReason::CircuitOpen, .. }))
        .count();
    assert_eq!(skipped, 1, "the second trigger was skipped circuit_open");
    h.core.handle(h.clocks(), Input::ResetBreaker { reply: 9, task_id: "m".into() });
    let fx = h.core.poll_effects();
    let b = breaker_in(&fx, "m").expect("reset written");
    assert_eq!(b.phase, BreakerPhase::Closed);
    assert!(matches!(&fx.replies[..], [(9, Reply::ResetBreaker(Ok(_)))]));
    assert_eq!(assigns(&h.trigger("m", "k3")).len(), 1, "admitted after the reset");
}

// ------------------------------------------------------------ notifications

/// Each event's sinks get one outbox record, in the same group as the run
/// state it reports: a failure (and the breaker opening it caused), a
/// skipped slot, a success.
#[test]
fn notifications_commit_with_the_run_they_report() {
    use crate::model::notification::NotifyEvent;
    let mut h = H::new();
    let mut spec = every_10s("t", serde_json::json!({"circuit_breaker": {"failure_threshold": 1, "cooldown_seconds": 15}}));
    spec["notify"] = serde_json::json!({"on_failure": ["webhook://a", "https://b.example/x"], "on_success": ["webhook://a"],
        "on_skipped": ["webhook://a"], "on_breaker_open": ["webhook://pager"]});
    h.task(spec);
    let (s, _) = h.hello("r1", &["a"], 4);
    let a = one_assign(&h.tick(10, &[("r1", s)]));
    let fx = h.finished("r1", s, &a, ReportedOutcome::Failed);
    let group = fx
        .writes
        .iter()
        .find(|g| g.iter().any(|op| matches!(op, StoreOp::PutRun(r) if r.run_id == a.run_id && r.status == RunStatus::Failed)))
        .expect("the failed run is written");
    let notes: Vec<(String, NotifyEvent, String)> = group
        .iter()
        .filter_map(|op| match op {
            StoreOp::PutNotification(n) => Some((n.id.clone(), n.event, n.sink.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(
        notes,
        vec![
            (format!("{}.on_failure.0", a.run_id), NotifyEvent::OnFailure, "webhook://a".to_string()),
            (format!("{}.on_failure.1", a.run_id), NotifyEvent::OnFailure, "https://b.example/x".to_string()),
            (format!("{}.on_breaker_open.0", a.run_id), NotifyEvent::OnBreakerOpen, "webhook://pager".to_string()),
        ]
    );
    // The next slot is skipped circuit_open: its record and its notification together.
    let fx = h.tick(10, &[("r1", s)]);
    let group =
        fx.writes.iter().find(|g| g.iter().any(|op| matches!(op, StoreOp::CreateRun(r) if r.status == RunStatus::Skipped))).expect("skip");
    assert!(group.iter().any(|op| matches!(op, StoreOp::PutNotification(n) if n.event == NotifyEvent::OnSkipped)));
    // After the cooldown the trial succeeds: on_success.
    let trial = one_assign(&h.tick(10, &[("r1", s)]));
    let fx = h.finished("r1", s, &trial, ReportedOutcome::Succeeded);
    let n = fx.writes.iter().flatten().find_map(|op| match op {
        StoreOp::PutNotification(n) => Some(n.clone()),
        _ => None,
    });
    let n = n.expect("on_success notification");
    assert_eq!((n.event, n.payload["run"]["status"].as_str()), (NotifyEvent::OnSuccess, Some("SUCCEEDED")));
    assert!(n.payload["run"].get("stdout_tail").is_none() && n.payload["run"].get("params").is_none());
}

// ------------------------------------------------------------------ traces

/// A run gets a trace; a trigger carrying a `traceparent` puts the run in
/// the caller's trace under the caller's span; each assignment names its
/// attempt's span (derived from the execution id) as the parent.
#[test]
fn runs_carry_their_trace_and_assignments_the_attempt_span() {
    let mut h = H::new();
    let mut spec = manual("m");
    spec["execution"] = serde_json::json!({"concurrency_limit": 2});
    h.task(spec);
    let (_s, _) = h.hello("r1", &["a"], 4);
    let req = TriggerRequest {
        task_id: "m".into(),
        params: Default::default(),
        not_before: None,
        delay_seconds: 0,
        idempotency_key: Some("t1".into()),
        idempotency_window: None,
        caller_trace: Some(crate::engine::CallerTrace {
            trace_id: "4bf92f3577b34da6a3ce929d0e0e4736".into(),
            span_id: "00f067aa0ba902b7".into(),
            trace_state: "vendor=abc".into(),
        }),
        baggage: "user=alice".into(),
    };
    h.core.handle(h.clocks(), Input::Trigger { reply: 1, req, explicit_key: false });
    let a = one_assign(&h.drain());
    let run = h.run(&a.run_id);
    assert_eq!(run.trace_id, "4bf92f3577b34da6a3ce929d0e0e4736");
    assert_eq!(run.parent_span_id, "00f067aa0ba902b7");
    assert_eq!(run.span_id.len(), 16);
    assert_eq!((a.trace_id.as_str(), a.span_id.clone()), (run.trace_id.as_str(), crate::model::trace::attempt_span_id(&a.execution_id)));
    assert_eq!((a.trace_state.as_str(), a.baggage.as_str()), ("vendor=abc", "user=alice"), "kept with the run for every attempt");
    // Without a caller: a trace of its own.
    let a2 = one_assign(&h.trigger("m", "t2"));
    let run2 = h.run(&a2.run_id);
    assert!(run2.trace_id.len() == 32 && run2.trace_id != run.trace_id && run2.parent_span_id.is_empty());
}

// ------------------------------------------------------------------ events

fn event(task: &str, key: &str, body: &[u8]) -> crate::engine::EventRequest {
    let run_id = crate::model::event::event_run_id(task, TriggerKind::Webhook, "/hooks/x", key);
    crate::events::event_request(task, run_id, TriggerKind::Webhook, "/hooks/x", key, t0(), Default::default(), Default::default(), body)
}

fn event_task(task: &str) -> serde_json::Value {
    serde_json::json!({"task_id": task, "agent_id": "a", "trigger": {"type": "webhook", "path": format!("/hooks/{task}"), "auth": "none"},
                       "execution": {"overlap_policy": "queue", "concurrency_limit": 10}})
}

impl H {
    /// Sends a batch of events; answers the store lookup with `stored`
    /// (the run ids that exist there); returns the effects and the answers.
    fn events(&mut self, evs: Vec<crate::engine::EventRequest>, stored: &[&str]) -> (Effects, Vec<Result<crate::engine::EventAdmitted>>) {
        self.core.handle(self.clocks(), Input::Events { reply: 9, events: evs });
        let mut fx = self.drain();
        if let Some((reply, ids)) = fx.run_checks.pop() {
            let found = ids.iter().map(|l| if stored.contains(&l.run_id.as_str()) { StoredId::Run } else { StoredId::Absent }).collect();
            self.core.handle(self.clocks(), Input::EventsLoaded { reply, found });
            fx = self.drain();
        }
        let answers = fx
            .replies
            .iter_mut()
            .find_map(|(_, r)| match r {
                Reply::Events(a) => Some(std::mem::take(a)),
                _ => None,
            })
            .expect("the batch is answered");
        (fx, answers)
    }
}

/// Issue 21: one record per event id — a repeat in the same batch, one in
/// memory, one the store has: none makes a second run; each event's run
/// is written in a group of its own (a batch for one task never makes an
/// oversized transaction).
#[test]
fn an_event_id_makes_one_run_whether_repeated_in_memory_or_in_the_store() {
    let mut h = H::new();
    h.task(event_task("w"));
    let stored_id = event("w", "old", b"{}").run_id;
    let (fx, answers) =
        h.events(vec![event("w", "k1", b"{\"n\": 1}"), event("w", "old", b"{}"), event("w", "k1", b"{\"n\": 1}")], &[&stored_id]);
    let answers: Vec<(bool, Option<SkipReason>)> = answers.into_iter().map(|a| a.map(|a| (a.created, a.skipped)).expect("ok")).collect();
    assert_eq!(answers, vec![(true, None), (false, None), (false, None)]);
    let groups: Vec<usize> = fx.writes.iter().map(|g| g.iter().filter(|op| matches!(op, StoreOp::CreateRun(_))).count()).collect();
    assert_eq!(groups, vec![1], "{:?}", fx.writes);
    let k1 = event("w", "k1", b"").run_id;
    let run = h.run(&k1);
    assert_eq!((run.trigger, run.status), (TriggerKind::Webhook, RunStatus::Pending));
    assert_eq!(run.event.as_ref().and_then(|e| e.body.clone()), Some(serde_json::json!({"n": 1})));
    // Again later: in memory, no lookup.
    h.core.handle(h.clocks(), Input::Events { reply: 10, events: vec![event("w", "k1", b"")] });
    let fx = h.drain();
    assert!(fx.run_checks.is_empty() && fx.writes.is_empty());
    assert!(matches!(&fx.replies[..], [(10, Reply::Events(a))] if a.len() == 1 && a[0].as_ref().is_ok_and(|a| !a.created)));
    // An event for a task that is gone says so.
    let (_, answers) = h.events(vec![event("nope", "k", b"")], &[]);
    assert!(matches!(answers[0], Err(Error::NotFound { .. })));
}

/// Issue 35: a webhook id deduplicates for exactly its window, whatever
/// the history keeps — in memory, from the store's dedup key, and from a
/// run's own claim once the key was swept — and then makes a new run of
/// its own, with a claim of its own written in the same group.
#[test]
fn a_windowed_event_id_deduplicates_for_its_window_only() {
    let mut h = H::new();
    h.task(event_task("w"));
    let windowed = |key: &str| {
        let mut ev = event("w", key, b"{}");
        ev.dedup_window = Some(chrono::Duration::seconds(5));
        ev
    };
    let (fx, answers) = h.events(vec![windowed("k"), windowed("k")], &[]);
    let first = answers[0].as_ref().expect("ok").run_id.clone();
    assert_eq!(first, event("w", "k", b"").run_id, "the first run keeps the id's own run id");
    assert!(answers[0].as_ref().is_ok_and(|a| a.created) && answers[1].as_ref().is_ok_and(|a| !a.created && a.run_id == first));
    let claim = match &fx.writes[0][..] {
        [StoreOp::CreateRun(r), ..] => r.dedup.clone().expect("a claim"),
        other => panic!("{other:?}"),
    };
    assert_eq!(
        (claim.key.as_str(), claim.run_id.as_str(), claim.expires_at),
        (first.as_str(), first.as_str(), t0() + chrono::Duration::seconds(5))
    );
    h.advance(Duration::seconds(4));
    let (_, answers) = h.events(vec![windowed("k")], &[]);
    assert!(answers[0].as_ref().is_ok_and(|a| !a.created), "within the window");
    h.advance(Duration::seconds(2));
    let (_, answers) = h.events(vec![windowed("k")], &[]);
    let second = answers[0].as_ref().expect("ok");
    assert!(second.created && second.run_id != first && second.run_id.starts_with(&first), "{second:?}");
    // A new leader (nothing in memory) asks the store: its claim decides.
    let mut h = H::new();
    h.task(event_task("w"));
    let base = event("w", "k", b"").run_id;
    for (stored, dup) in [
        (
            StoredId::Claim(crate::model::event::DedupClaim {
                key: base.clone(),
                run_id: format!("{base}-1"),
                expires_at: t0() + chrono::Duration::seconds(1),
                scheduled_at: None,
            }),
            true,
        ),
        (
            StoredId::Claim(crate::model::event::DedupClaim {
                key: base.clone(),
                run_id: base.clone(),
                expires_at: t0(),
                scheduled_at: None,
            }),
            false,
        ),
    ] {
        let mut h = H::new();
        h.task(event_task("w"));
        h.core.handle(h.clocks(), Input::Events { reply: 9, events: vec![windowed("k")] });
        let fx = h.drain();
        let (reply, ids) = fx.run_checks.last().cloned().expect("a lookup");
        assert!(ids[0].windowed);
        h.core.handle(h.clocks(), Input::EventsLoaded { reply, found: vec![stored] });
        let fx = h.drain();
        let created = fx.replies.iter().any(|(_, r)| matches!(r, Reply::Events(a) if a[0].as_ref().is_ok_and(|a| a.created)));
        assert_eq!(created, !dup);
    }
}

/// Issue 21: every event leaves a record — a paused task's, an invalid
/// one's, a budget's refusal — SKIPPED with its reason and the event.
#[test]
fn an_event_that_cannot_run_is_recorded_skipped_with_why() {
    let mut h = H::new();
    h.task(event_task("w"));
    let mut bad = event("w", "bad", b"not json");
    bad.invalid = Some("not a JSON document".into());
    let (_, answers) = h.events(vec![bad], &[]);
    assert_eq!(answers[0].as_ref().expect("ok").skipped, Some(SkipReason::InvalidEvent));
    let stored = h.stored(&event("w", "bad", b"").run_id).expect("recorded");
    assert_eq!((stored.status, stored.error.as_deref()), (RunStatus::Skipped, Some("not a JSON document")));
    assert_eq!(stored.event.as_ref().map(|e| e.key.as_str()), Some("bad"), "the record says which event");
    let mut rec = h.record(event_task("w"));
    rec.paused = true;
    h.put(rec);
    let (_, answers) = h.events(vec![event("w", "p", b"{}")], &[]);
    assert_eq!(answers[0].as_ref().expect("ok").skipped, Some(SkipReason::Paused));
}

/// Issue 21: a body over 16 KiB is written beside its run, in its group,
/// and never kept in the leader's memory; the assignment says the shell
/// must put it in.
#[test]
fn a_large_event_body_is_stored_beside_its_run() {
    let mut h = H::new();
    h.task(event_task("w"));
    let body = format!("{{\"blob\": \"{}\"}}", "x".repeat(20_000));
    let (fx, answers) = h.events(vec![event("w", "big", body.as_bytes())], &[]);
    let run_id = answers[0].as_ref().expect("ok").run_id.clone();
    let group = fx.writes.iter().find(|g| g.iter().any(|op| matches!(op, StoreOp::CreateRun(r) if r.run_id == run_id))).expect("group");
    assert!(group.iter().any(|op| matches!(op, StoreOp::PutEventBody { run_id: id, body: b } if *id == run_id && b.len() == body.len())));
    let run = h.run(&run_id);
    let ev = run.event.as_ref().expect("event");
    assert!(ev.body_stored && ev.body.is_none() && ev.body_bytes == body.len() as u64);
    let (_, fx) = h.hello("r1", &["a"], 4);
    let a = one_assign(&fx);
    assert!(a.stored_event_body);
    let ctx: serde_json::Value = serde_json::from_str(&a.context_json).expect("context");
    assert_eq!(ctx["event"]["key"], "big");
    assert!(ctx["event"]["body"].is_null(), "filled by the shell");
}

/// Issue 21, chains: a run of A that ends creates B's run (it asked for
/// success) and C's SKIPPED `upstream_unmet` (it asked for failure) in
/// the very group that makes A's run terminal; B's agent gets A's run as
/// `upstream`; a cancelled B follows nothing it did not ask for.
#[test]
fn a_run_that_ends_creates_its_followers_in_its_own_transaction() {
    let mut h = H::new();
    h.task(manual("a"));
    h.task(serde_json::json!({"task_id": "b", "agent_id": "a", "trigger": {"type": "after", "task": "a"}}));
    h.task(serde_json::json!({"task_id": "c", "agent_id": "a", "trigger": {"type": "after", "task": "a", "status": "failed"}}));
    let (s, _) = h.hello("r1", &["a"], 4);
    let fx = h.trigger("a", "k");
    let a = one_assign(&fx);
    let fx = h.finished("r1", s, &a, ReportedOutcome::Succeeded);
    let group = fx.writes.iter().find(|g| g.iter().any(|op| matches!(op, StoreOp::PutRun(r) if r.run_id == a.run_id))).expect("a's end");
    let b_id = crate::model::event::after_run_id("b", &a.run_id);
    let c_id = crate::model::event::after_run_id("c", &a.run_id);
    let created: Vec<(String, RunStatus, Option<SkipReason>)> = group
        .iter()
        .filter_map(|op| match op {
            StoreOp::CreateRun(r) => Some((r.run_id.clone(), r.status, r.skip_reason)),
            _ => None,
        })
        .collect();
    assert!(created.contains(&(c_id.clone(), RunStatus::Skipped, Some(SkipReason::UpstreamUnmet))), "{created:?}");
    assert!(created.iter().any(|(id, _, skip)| *id == b_id && skip.is_none()), "{created:?}");
    let b = assigns(&fx).into_iter().map(|(_, a)| a).find(|x| x.run_id == b_id).expect("b dispatched");
    let ctx: serde_json::Value = serde_json::from_str(&b.context_json).expect("context");
    assert_eq!(ctx["upstream"]["run_id"], a.run_id);
    assert_eq!(ctx["upstream"]["status"], "SUCCEEDED");
    assert_eq!(ctx["upstream"]["result"], serde_json::json!({"by": "r1"}));
    assert_eq!(ctx["trigger"], "after");
    let c = h.stored(&c_id).expect("c recorded");
    assert!(c.error.as_deref().is_some_and(|e| e.contains("ended SUCCEEDED") && e.contains(&a.run_id)), "{c:?}");
    // B's end starts nothing: nobody follows B.
    let fx = h.finished("r1", s, &b, ReportedOutcome::Succeeded);
    assert!(fx.writes.iter().flatten().all(|op| !matches!(op, StoreOp::CreateRun(_))));
}

/// Issue 34, finding 14: after a failover a runner re-declares its run and
/// reports its end to the new leader seconds later; the record kept the
/// new leader's receipt time (6.6 s shown for a 1.3 s run). The attempt and
/// the run end when the runner says the agent exited, within what the
/// leader saw (never before the start, never after now).
#[test]
fn finished_at_is_the_runners_exit_not_the_leaders_receipt() {
    let start = t0();
    let rec = H::new().record(manual("t"));
    let mut running = RunRecord::pending("t.manual-k".into(), "t", "a", TriggerKind::Manual, start, start);
    running.status = RunStatus::Running;
    running.attempts.push(crate::model::Attempt {
        attempt: 1,
        execution_id: "e1".into(),
        runner_id: "r1".into(),
        runner_instance: "i1".into(),
        dispatched_at: start,
        started_at: Some(start),
        ..Default::default()
    });
    let mut h = H::loaded(start + Duration::seconds(5), vec![(rec, None)], vec![running]);
    let fl = InFlightExec { run_id: "t.manual-k".into(), execution_id: "e1".into(), attempt: 1, started_at: Some(start) };
    let (s, _) = h.hello_with("r1", &["a"], 4, "i1", vec![fl]);
    h.advance(Duration::seconds(1));
    let exited = start + Duration::milliseconds(1300);
    let report = |finished_at| FinishedReport {
        run_id: "t.manual-k".into(),
        execution_id: "e1".into(),
        outcome: ReportedOutcome::Succeeded,
        result: None,
        error: String::new(),
        exit_code: Some(0),
        stdout_tail: String::new(),
        stderr_tail: String::new(),
        started_at: Some(start),
        finished_at,
        class: None,
        machine: None,
    };
    h.msg("r1", s, FromRunner::Finished(Box::new(report(Some(exited)))));
    let stored = h.stored("t.manual-k").expect("written");
    assert_eq!(stored.status, RunStatus::Succeeded);
    assert_eq!(stored.finished_at, Some(exited), "the run ends at the agent's exit");
    assert_eq!(stored.attempts[0].finished_at, Some(exited));
    // A runner clock ahead of the leader's cannot put the end in the future.
    let rec2 = h.record(manual("u"));
    h.put(rec2);
    let a2 = one_assign(&h.trigger("u", "k2"));
    let mut r = report(Some(h.now + Duration::hours(1)));
    r.run_id = a2.run_id.clone();
    r.execution_id = a2.execution_id.clone();
    r.started_at = None;
    h.msg("r1", s, FromRunner::Finished(Box::new(r)));
    assert_eq!(h.stored(&a2.run_id).expect("written").finished_at, Some(h.now));
}

/// Issue 34, finding 4, through the core: a `skip` task's slot due with a
/// `wait` task's on a resource of 1 — the `wait` run dispatched first, so
/// the `skip` run's record is SKIPPED `resource_busy` (written), not a run
/// left PENDING behind it.
#[test]
fn a_skip_tasks_slot_busy_at_dispatch_is_recorded_skipped() {
    let mut h = H::new();
    h.core.configure(Arc::new(crate::config::Config::from_text("resources:\n  search-api: {concurrency: 1}\n").expect("config")));
    let (s, _) = h.hello("r1", &["a"], 4);
    h.task(every_10s("a-wait", serde_json::json!({"resources": ["search-api"], "priority": 10})));
    h.task(every_10s("b-skip", serde_json::json!({"resources": ["search-api"], "on_resource_busy": "skip"})));
    let fx = h.tick(10, &[("r1", s)]);
    assert_eq!(assigns(&fx).len(), 1, "one agent on the resource");
    let skipped = h.stored("b-skip.20261201T100010Z").expect("the skip task's slot is recorded");
    assert_eq!(skipped.status, RunStatus::Skipped);
    assert_eq!(skipped.skip_reason, Some(SkipReason::ResourceBusy));
    assert_eq!(skipped.error.as_deref(), Some("resource search-api (1/1 in use)"));
    assert!(h.core.active_run("b-skip.20261201T100010Z").is_none(), "nothing of it stays in memory");
}

/// Issue 34, finding 13: a task skipped slot after slot (a spent budget,
/// an open breaker, its limit) wrote one SKIPPED record per slot —
/// ~120,000 by a month's end for a 20-second task — and pushed its real
/// runs out of `keep_last`. Consecutive slots skipped for one reason are
/// one record with their count and range; a run in between starts anew.
#[test]
fn consecutive_skips_of_one_reason_are_one_record() {
    let mut h = H::new();
    let (s, _) = h.hello("r1", &["a"], 4);
    h.task(every_10s("t", serde_json::json!({"concurrency_limit": 1})));
    let fx = h.tick(10, &[("r1", s)]);
    let first = one_assign(&fx);
    // Five slots while the first run holds the only slot of its task.
    let fx = h.tick(50, &[("r1", s)]);
    let created: Vec<_> = fx
        .writes
        .iter()
        .flatten()
        .filter_map(|op| match op {
            StoreOp::CreateRun(r) => Some(r.run_id.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(created, vec!["t.20261201T100020Z"], "one record for the five skipped slots");
    let rec = h.stored("t.20261201T100020Z").expect("written");
    assert_eq!((rec.status, rec.skip_reason), (RunStatus::Skipped, Some(SkipReason::ConcurrencyLimit)));
    assert_eq!(rec.missed_count, Some(5));
    assert_eq!((rec.missed_from, rec.missed_until), (Some(slot_time("t.20261201T100020Z")), Some(slot_time("t.20261201T100100Z"))));
    // Each extension commits with the cursor that moved past its slot.
    let last = h.log.last().expect("drained");
    let _ = last;
    let groups_with_both = h
        .log
        .iter()
        .flat_map(|f| f.writes.iter())
        .filter(|g| {
            g.iter().any(|op| matches!(op, StoreOp::PutRun(r) if r.run_id == "t.20261201T100020Z"))
                && g.iter().any(|op| matches!(op, StoreOp::PutCursor { .. }))
        })
        .count();
    assert_eq!(groups_with_both, 4, "every extension is in its task's group");
    // A run in between: the next skip is a record of its own.
    h.finished("r1", s, &first, ReportedOutcome::Succeeded);
    let fx = h.tick(10, &[("r1", s)]);
    let second = one_assign(&fx);
    let fx = h.tick(10, &[("r1", s)]);
    let _ = second;
    let created: Vec<_> = fx
        .writes
        .iter()
        .flatten()
        .filter_map(|op| match op {
            StoreOp::CreateRun(r) => Some((r.run_id.clone(), r.missed_count)),
            _ => None,
        })
        .collect();
    assert_eq!(created, vec![("t.20261201T100120Z".to_string(), Some(1))]);
}

/// All stored records (last state of each), by run id.
fn stored_all(h: &H) -> BTreeMap<String, RunRecord> {
    let mut out = BTreeMap::new();
    for op in h.log.iter().flat_map(|fx| fx.writes.iter().flatten()) {
        if let StoreOp::CreateRun(r) | StoreOp::PutRun(r) = op {
            out.insert(r.run_id.clone(), (**r).clone());
        }
    }
    out
}

/// Moves the clock `secs` seconds a second at a time, firing what is due.
fn walk(h: &mut H, secs: i64) {
    for _ in 0..secs {
        h.advance(Duration::seconds(1));
    }
}

/// `max_runs: 3` creates three runs and then no more slots: no timer, no
/// record; `end_at` leaves no slot after it (issue 37, bounds).
#[test]
fn max_runs_and_end_at_bound_the_slots() {
    let mut h = H::new();
    h.task(serde_json::json!({"task_id": "three", "agent_id": "a",
        "trigger": {"type": "interval", "every_seconds": 10, "max_runs": 3},
        "execution": {"overlap_policy": "queue", "concurrency_limit": 10}}));
    let end = t0() + Duration::seconds(25);
    h.task(serde_json::json!({"task_id": "ends", "agent_id": "a",
        "trigger": {"type": "cron", "expr": "*/5 * * * * *", "end_at": end.to_rfc3339()},
        "execution": {"overlap_policy": "queue", "concurrency_limit": 10}}));
    walk(&mut h, 120);
    let runs = stored_all(&h);
    let of = |task: &str| runs.values().filter(|r| r.task_id == task).map(|r| (r.scheduled_at, r.status)).collect::<Vec<_>>();
    let three = of("three");
    assert_eq!(three.len(), 3, "{three:?}");
    assert!(three.iter().all(|(_, s)| *s == RunStatus::Pending), "{three:?}");
    let ends = of("ends");
    assert_eq!(ends.len(), 5, "slots at +5..+25 s: {ends:?}");
    assert!(ends.iter().all(|(at, _)| *at <= end), "{ends:?}");
    // Nothing armed for either task: a later advance makes nothing.
    walk(&mut h, 600);
    assert_eq!(stored_all(&h).len(), runs.len());
}

/// `dst.gap: skip` leaves one SKIPPED `dst_gap` record at the jump for the
/// slots the change skipped; `repeat: both` runs the repeated slot twice
/// with two run ids (Berlin, 2026).
#[test]
fn dst_policies_record_every_slot_once() {
    let start: DateTime<Utc> = "2026-03-28T23:00:00Z".parse().expect("t");
    let mut h = H::at(start);
    h.task(serde_json::json!({"task_id": "gap", "agent_id": "a",
        "trigger": {"type": "cron", "expr": "*/20 2 * * *", "timezone": "Europe/Berlin", "dst": {"gap": "skip"}},
        "execution": {"overlap_policy": "queue", "concurrency_limit": 10}}));
    walk(&mut h, 4 * 3600);
    let runs = stored_all(&h);
    let gap: Vec<&RunRecord> = runs.values().filter(|r| r.task_id == "gap").collect();
    assert_eq!(gap.len(), 1, "{gap:#?}");
    assert_eq!((gap[0].status, gap[0].skip_reason, gap[0].missed_count), (RunStatus::Skipped, Some(SkipReason::DstGap), Some(3)));
    assert_eq!(gap[0].scheduled_at, "2026-03-29T01:00:00Z".parse::<DateTime<Utc>>().expect("t"));

    let start: DateTime<Utc> = "2026-10-24T23:00:00Z".parse().expect("t");
    let mut h = H::at(start);
    h.task(serde_json::json!({"task_id": "twice", "agent_id": "a",
        "trigger": {"type": "cron", "expr": "30 2 * * *", "timezone": "Europe/Berlin", "dst": {"repeat": "both"}},
        "execution": {"overlap_policy": "queue", "concurrency_limit": 10}}));
    walk(&mut h, 4 * 3600);
    let ids: Vec<String> = stored_all(&h).into_keys().filter(|k| k.starts_with("twice.")).collect();
    assert_eq!(ids, ["twice.20261025T003000Z", "twice.20261025T013000Z"]);
}

/// `jitter: auto`: the run records its nominal slot and when it fired, the
/// offset the same for every slot of the task.
#[test]
fn auto_jitter_fires_at_the_tasks_offset() {
    let mut h = H::new();
    h.task(serde_json::json!({"task_id": "spread", "agent_id": "a",
        "trigger": {"type": "cron", "expr": "0 * * * * *", "jitter": "auto"},
        "execution": {"overlap_policy": "queue", "concurrency_limit": 10}}));
    walk(&mut h, 190);
    let runs: Vec<RunRecord> = stored_all(&h).into_values().filter(|r| r.task_id == "spread").collect();
    assert_eq!(runs.len(), 3, "{runs:#?}");
    let offsets: Vec<i64> = runs.iter().map(|r| (r.fire_at.expect("fire_at") - r.scheduled_at).num_milliseconds()).collect();
    assert!(offsets.iter().all(|o| *o == offsets[0] && (0..6_000).contains(o)), "{offsets:?}");
    assert!(runs.iter().all(|r| r.scheduled_at.timestamp_subsec_millis() == 0 && r.scheduled_at.timestamp() % 60 == 0));
}

/// A delayed trigger is admitted when due, not when made (issue 37): with
/// `overlap_policy: skip` and a run active when it is made, it runs if
/// that run ended by its due time; one due while a run is active is
/// SKIPPED at its due time. Before this, the first was skipped at once.
#[test]
fn delayed_triggers_are_admitted_when_due() {
    let mut h = H::new();
    h.task(serde_json::json!({"task_id": "d", "agent_id": "a", "execution": {"overlap_policy": "skip"}}));
    let (s, _) = h.hello("r1", &["a"], 4);
    let fx = h.trigger("d", "first");
    let first = one_assign(&fx);
    let delayed = |h: &mut H, key: &str| h.trigger_after("d", key, 10);
    delayed(&mut h, "later");
    let later = h.stored("d.manual-later").expect("recorded when accepted");
    assert_eq!(later.status, RunStatus::Pending, "not skipped while the first runs: {later:?}");
    assert!(later.awaiting_admission);
    h.tick(5, &[("r1", s)]);
    h.finished("r1", s, &first, ReportedOutcome::Succeeded);
    let fx = h.tick(6, &[("r1", s)]);
    assert_eq!(one_assign(&fx).run_id, "d.manual-later", "admitted at its due time, the first run ended");
    // Due while a run is active: SKIPPED then, not when made.
    let running = h.run("d.manual-later");
    assert_eq!(running.status, RunStatus::Running);
    delayed(&mut h, "busy");
    assert_eq!(h.stored("d.manual-busy").map(|r| r.status), Some(RunStatus::Pending));
    h.tick(9, &[("r1", s)]);
    assert_eq!(h.stored("d.manual-busy").map(|r| r.status), Some(RunStatus::Pending), "nothing decided before its time");
    h.tick(2, &[("r1", s)]);
    let busy = h.stored("d.manual-busy").expect("record");
    assert_eq!((busy.status, busy.skip_reason), (RunStatus::Skipped, Some(SkipReason::ConcurrencyLimit)), "{busy:?}");
    assert!(busy.finished_at.expect("finished") >= t0() + Duration::seconds(20), "skipped at its due time");
}

impl H {
    /// Starts backfill `bf-{task}` of `task`'s slots in the last `hours`
    /// (up to a second ago), `max_concurrent` at once; the drained effects.
    fn backfill(&mut self, task: &str, hours: i64, max_concurrent: u32) -> Effects {
        use crate::engine::core::sources::backfill::BackfillOp;
        use crate::model::backfill::{Backfill, BackfillSpec};
        let spec = BackfillSpec {
            task_id: task.into(),
            from: self.now - Duration::hours(hours),
            to: self.now - Duration::seconds(1),
            reprocess: Default::default(),
            max_concurrent,
            order: Default::default(),
            on_failure: Default::default(),
        };
        let b = Backfill::start(format!("bf-{task}"), spec, hours as u64, self.now);
        self.core.handle(self.clocks(), Input::Backfill { reply: 7, op: BackfillOp::Create(Box::new(b)) });
        self.drain()
    }
}

/// Issue 37, the seam: `paused` is one policy at the one admission. While
/// a task is paused an event is SKIPPED `paused`, a manual trigger runs
/// (an explicit ask), and a backfill holds — no read, no run, its cursor
/// where it was — until the task resumes, then goes on.
#[test]
fn a_paused_task_gives_each_source_its_rule_at_one_admission() {
    let mut h = H::new();
    let spec = serde_json::json!({"task_id": "p", "agent_id": "a", "triggers": [{"type": "cron", "expr": "0 * * * *"},
        {"type": "webhook", "path": "/hooks/p", "auth": "none"}]});
    let mut rec = h.record(spec.clone());
    rec.paused = true;
    rec.paused_at = Some(h.now);
    h.put(rec);
    let (_, answers) = h.events(vec![event("p", "e1", b"{}")], &[]);
    assert_eq!(answers[0].as_ref().expect("ok").skipped, Some(SkipReason::Paused));
    h.trigger("p", "k");
    let manual = h.run(&crate::model::run::manual_run_id("p", "k"));
    assert_eq!((manual.status, manual.skip_reason), (RunStatus::Pending, None), "a manual trigger runs on a paused task");
    let mut reads = h.backfill("p", 3, 2).reads;
    reads.extend(h.advance(Duration::seconds(5)).reads);
    assert!(reads.is_empty(), "a paused task's backfill reads nothing: {reads:?}");
    assert!(!h.core.runs.values().any(|r| r.trigger == TriggerKind::Backfill));
    let mut resumed = h.record(spec);
    resumed.resumed_at = Some(h.now);
    h.put(resumed);
    let fx = h.advance(Duration::seconds(1));
    assert!(
        fx.reads.iter().any(|(_, p)| matches!(p, ReadPurpose::Backfill { id, .. } if id == "bf-p")),
        "resumed, the backfill goes on: {:?}",
        fx.reads
    );
}

/// A helper's find after the seam: a jittered slot already due when its
/// task is paused (before its jittered fire) was recorded SKIPPED
/// `paused` — admission read the pause from the task's current record.
/// It is settled by the definition it was due under, which was not
/// paused: it runs.
#[test]
fn a_slot_due_before_a_pause_runs_though_it_fires_after() {
    let mut h = H::new();
    let spec = serde_json::json!({"task_id": "j", "agent_id": "a", "trigger": {"type": "interval", "every": "1m", "jitter_seconds": 59}});
    let rec = h.record(spec.clone());
    h.put(rec.clone());
    let scheds = rec.spec.schedules().expect("schedules");
    // The first slot whose jittered fire is at least 2 s after it.
    let (slot, fire) = (1..200)
        .map(|k| rec.created_at + Duration::minutes(k))
        .filter_map(|t| crate::schedule::next_slot(&scheds, t - Duration::milliseconds(1)))
        .map(|(s, sched)| (s, sched.fire_at("j", s)))
        .find(|(s, f)| *f - *s >= Duration::seconds(2))
        .expect("a jittered slot");
    // Up to just after the slot (slots before it fire on their way).
    let secs = (slot - h.now).num_seconds() + 1;
    walk(&mut h, secs);
    assert!(h.now > slot && h.now < fire);
    let mut paused = rec;
    paused.paused = true;
    paused.paused_at = Some(h.now);
    h.put(paused);
    h.advance(Duration::zero());
    let run = h.stored(&crate::model::run::slot_run_id("j", slot)).expect("the slot has a record");
    assert_eq!((run.status, run.skip_reason), (RunStatus::Pending, None), "due before the pause: it runs");
}

/// A helper's find: a backfill's read out when its task is paused made
/// the slot's run when it came back (and the run was dispatched). Held.
#[test]
fn a_backfill_read_answered_after_a_pause_makes_nothing() {
    let mut h = H::new();
    let spec = serde_json::json!({"task_id": "q", "agent_id": "a", "trigger": {"type": "cron", "expr": "0 * * * *"}});
    let rec = h.record(spec);
    h.put(rec.clone());
    let fx = h.backfill("q", 2, 1);
    let (run_id, purpose) = fx.reads.into_iter().find(|(_, p)| matches!(p, ReadPurpose::Backfill { .. })).expect("a slot's read");
    let mut paused = rec;
    paused.paused = true;
    paused.paused_at = Some(h.now);
    h.put(paused);
    h.core.handle(h.clocks(), Input::RunLoaded { run_id: run_id.clone(), run: None, purpose });
    h.drain();
    assert!(!h.core.runs.contains_key(&run_id), "held: no run for {run_id}");
    assert_eq!(h.core.backfill_view("bf-q").expect("view").created, 0);
}
