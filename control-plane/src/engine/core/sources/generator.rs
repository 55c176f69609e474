//! The generator: a task's time triggers (cron, interval, once) become
//! slots, and each due slot becomes a run request
//! ([`super::RunRequest`]) admitted through the one admission
//! ([`EngineCore::submit`]) — or, for slots that do not run, one coalesced
//! SKIPPED record (a misfire, slots due while the task was paused, a DST
//! gap under `dst.gap: skip`).
//!
//! Every due slot leaves a record. A task's cursor (`Cursor::last_slot`)
//! is the watermark: slots strictly after it are still to come; it is
//! written with the slot's records in one transaction. A fire first
//! settles slots due under earlier definitions (`TaskEntry::settle`, see
//! `tasks.rs`), then plans the current one's. A paused task generates
//! nothing; on resume, one SKIPPED `paused` record covers what was due.

use std::collections::HashSet;

use chrono::{DateTime, Utc};

use super::RunRequest;
use crate::clock::Now;
use crate::engine::core::admission::Submitted;
use crate::engine::core::{EngineCore, MAX_RUNS_PER_FIRE, TaskEntry, Timer};
use crate::engine::lifecycle::Lifecycle;
use crate::model::run::{SkipReason, TriggerKind, slot_run_id};
use crate::model::task::MisfirePolicy;
use crate::model::{Cursor, RunRecord, TaskRecord};
use crate::schedule::{Schedule, Shape, SlotWindow, count_slots, next_slot, plan_due_slots};

/// The compiled triggers of a definition. Compiled when needed rather than
/// kept per task (a parsed cron holds a year bitmap of ~5 KB: see the
/// bench-idle memory figure); a cron expression is parsed once for every
/// task that shares it, from [`crate::schedule::parse_cron`]'s bounded
/// cache (`make bench-core`: fire to dispatch 75–90 µs a run without it,
/// 20–33 µs with it).
pub(in crate::engine::core) fn schedules(rec: &TaskRecord) -> Vec<Schedule> {
    rec.spec.schedules().unwrap_or_default()
}

/// Why slots were late when the engine got to them (in the misfire log
/// and the SKIPPED record's error).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::engine::core) enum LateCause {
    /// Due before this leader started: no leader ran.
    NoLeader,
    /// The wall clock stepped forward over them.
    ClockStep { seconds: i64 },
    /// This leader was busy, or its process stopped (SIGSTOP, a pause).
    Busy,
}

impl std::fmt::Display for LateCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LateCause::NoLeader => write!(f, "no leader ran"),
            LateCause::ClockStep { seconds } => write!(f, "the wall clock stepped {seconds} s forward"),
            LateCause::Busy => write!(f, "this leader was busy or stopped"),
        }
    }
}

/// Runs the task's time triggers may still create under `max_runs`
/// (`None`: no bound). One time trigger of a task may have it (see
/// `TaskSpec::validate`).
pub(in crate::engine::core) fn runs_left(e: &TaskEntry, scheds: &[Schedule]) -> Option<u64> {
    let max = scheds.iter().find_map(|s| s.bounds.max_runs)?;
    Some(max.saturating_sub(e.cursor.as_ref().map_or(0, |c| c.time_runs)))
}

impl EngineCore {
    /// A `once` trigger already past when the task was created runs once,
    /// right away (an explicit backfill), unless the task has fired before.
    pub(in crate::engine::core) fn run_past_once(&mut self, _now: Now, task_id: &str) {
        let Some(e) = self.tasks.get(task_id) else { return };
        if e.cursor.as_ref().is_some_and(|c| c.last_slot.is_some()) || e.record.paused {
            return;
        }
        let created = e.record.created_at;
        let past: Vec<DateTime<Utc>> = schedules(&e.record)
            .iter()
            .filter_map(|s| match s.shape {
                Shape::Once { at } if at <= created => Some(at),
                _ => None,
            })
            .collect();
        // A task deleted and applied again has no cursor but may have the
        // run of this slot from before: ask the store first.
        for at in past {
            self.fx.reads.push((slot_run_id(task_id, at), crate::engine::core::ReadPurpose::PastOnce { task_id: task_id.to_string(), at }));
        }
    }

    /// The stored run of a past `once` slot (see `run_past_once`): run the
    /// slot if it has no record; either way it is handled.
    pub(in crate::engine::core) fn past_once_loaded(&mut self, now: Now, task_id: &str, at: DateTime<Utc>, exists: bool) {
        let Some(e) = self.tasks.get(task_id) else { return };
        if e.record.paused || e.deleted || e.cursor.as_ref().and_then(|c| c.last_slot).is_some_and(|l| l >= e.record.created_at) {
            return;
        }
        let rec = e.record.clone();
        if !exists {
            self.admit_slot(now, &rec, &schedules(&rec), at, TriggerKind::Once, &HashSet::new());
        }
        self.set_cursor(now, task_id, rec.created_at);
    }

    /// On resume: one SKIPPED record (`paused`) covers the slots between the
    /// last handled slot and the resume; the schedule continues from there.
    pub(in crate::engine::core) fn cover_paused_slots(&mut self, now: Now, task_id: &str) {
        let Some(e) = self.tasks.get(task_id) else { return };
        let Some(resumed_at) = e.record.resumed_at else { return };
        if e.record.paused || resumed_at <= e.baseline() || !e.settle.is_empty() {
            return;
        }
        let scheds = schedules(&e.record);
        if let Some(range) = count_slots(&scheds, e.baseline(), resumed_at) {
            let kind = scheds.first().map_or(TriggerKind::Cron, |s| s.kind().into());
            let rec = e.record.clone();
            let why = format!("{} slot(s) due while the task was paused", range.0);
            self.skip_record(now, &rec, kind, SkipReason::Paused, range, why);
            tracing::info!(task_id, missed = range.0, "resumed; paused slots covered by one SKIPPED record");
        }
        self.set_cursor(now, task_id, resumed_at);
    }

    /// Sets the next fire timer of a task (none if paused, deleted or no slot left).
    pub(in crate::engine::core) fn arm(&mut self, _now: Now, task_id: &str) {
        let Some(e) = self.tasks.get_mut(task_id) else { return };
        e.generation += 1;
        if e.record.paused || e.deleted {
            return;
        }
        let scheds = schedules(&e.record);
        if runs_left(e, &scheds) == Some(0) {
            return;
        }
        let Some((slot, sched)) = next_slot(&scheds, e.baseline()) else { return };
        let fire_at = sched.fire_at(task_id, slot);
        let generation = e.generation;
        self.timers.push_wall(fire_at, Timer::Fire { task_id: task_id.to_string(), generation });
    }

    /// A fire at once (settlement, continued catch-up, released deferral).
    pub(in crate::engine::core) fn fire_now(&mut self, now: Now, task_id: &str) {
        if let Some(generation) = self.tasks.get(task_id).map(|e| e.generation) {
            self.timers.push_wall(now.wall, Timer::Fire { task_id: task_id.to_string(), generation });
        }
    }

    /// Handles the slots due for a task: settlements of earlier
    /// definitions first, then the current one.
    pub(in crate::engine::core) fn on_fire(&mut self, now: Now, task_id: &str, generation: u64) {
        let Some(e) = self.tasks.get_mut(task_id) else { return };
        if e.generation != generation {
            return;
        }
        if self.awaits_redeclare(task_id) {
            if let Some(e) = self.tasks.get_mut(task_id) {
                e.deferred = true;
            }
            self.deferred.insert(task_id.to_string());
            return;
        }
        let mut budget = MAX_RUNS_PER_FIRE;
        while let Some((def, until)) = self.tasks.get(task_id).and_then(|e| e.settle.front().cloned()) {
            if !self.plan_and_admit(now, task_id, &def, until, &mut budget) {
                self.fire_now(now, task_id);
                return;
            }
            if let Some(e) = self.tasks.get_mut(task_id) {
                e.settle.pop_front();
            }
        }
        let Some(e) = self.tasks.get(task_id) else { return };
        if e.deleted {
            self.remove_task(now, task_id);
            return;
        }
        if !e.record.paused {
            let def = e.record.clone();
            if !self.plan_and_admit(now, task_id, &def, now.wall, &mut budget) {
                self.arm(now, task_id);
                self.fire_now(now, task_id);
                return;
            }
        }
        self.arm(now, task_id);
    }

    /// Records the slots of `def` in `(cursor, until]`, at most `budget`
    /// runs, and moves the cursor past them. A slot later than
    /// `misfire_grace_seconds` when the engine gets to it is a misfire,
    /// whatever made it late — no leader ran (slots due before this leader
    /// started), the wall clock stepped, this leader was busy or stopped —
    /// and the misfire policy decides it and the slots after it
    /// ([`EngineCore::plan_missed`]): one coalesced SKIPPED record for what
    /// does not run. Slots within the grace each get their run, late (the
    /// lag shows), under the overlap policy. Returns false when there is
    /// more to do than `budget` allowed (the cursor is at the last slot
    /// handled).
    fn plan_and_admit(&mut self, now: Now, task_id: &str, def: &TaskRecord, until: DateTime<Utc>, budget: &mut usize) -> bool {
        let scheds = schedules(def);
        let Some(e) = self.tasks.get(task_id) else { return true };
        if runs_left(e, &scheds) == Some(0) {
            // `max_runs` reached: no more slots (README "Bounds and jitter").
            return true;
        }
        if self.clocks.loaded_at > e.baseline()
            && !self.plan_missed(now, task_id, def, std::cmp::min(self.clocks.loaded_at, until), budget, LateCause::NoLeader)
        {
            return false;
        }
        let grace = chrono::Duration::seconds(def.spec.execution.misfire_grace_seconds.min(i64::MAX as u64 / 1000) as i64);
        // A `run_all` catch-up goes on as it began (its runs queue behind
        // each other).
        if let Some(e) = self.tasks.get(task_id)
            && let Some((first, _)) = next_slot(&scheds, e.baseline())
            && first <= until
            && (until - first > grace || !e.catchup.is_empty())
        {
            let cause = self.late_cause(first);
            return self.plan_missed(now, task_id, def, until, budget, cause);
        }
        let mut last = None;
        loop {
            let Some(baseline) = self.tasks.get(task_id).map(|e| last.unwrap_or_else(|| e.baseline())) else { return true };
            let Some((slot, sched)) = next_slot(&scheds, baseline) else { break };
            if slot > until || self.tasks.get(task_id).is_some_and(|e| runs_left(e, &scheds) == Some(0)) {
                break;
            }
            if *budget == 0 {
                if let Some(l) = last {
                    self.set_cursor(now, task_id, l);
                }
                return false;
            }
            // Late past its fire time (a jittered slot fires after it).
            let lag = now.wall - sched.fire_at(task_id, slot);
            if lag > chrono::Duration::seconds(1) {
                tracing::info!(task_id, slot = %slot, lag_ms = lag.num_milliseconds(), "slot runs late, within misfire_grace_seconds: this leader was busy");
            }
            self.admit_slot(now, def, &scheds, slot, sched.kind().into(), &HashSet::new());
            *budget -= 1;
            last = Some(slot);
        }
        if let Some(l) = last {
            self.set_cursor(now, task_id, l);
        }
        true
    }

    /// Why slots from `first` on are late now (the engine got to them
    /// after they were due): the wall clock stepped forward since the first
    /// was due, else this leader was busy (or stopped: a frozen process
    /// sees both clocks move alike).
    fn late_cause(&self, first: DateTime<Utc>) -> LateCause {
        match self.clocks.last_step {
            Some((from, to)) if to > first => LateCause::ClockStep { seconds: (to - from).num_seconds() },
            _ => LateCause::Busy,
        }
    }

    /// Plans the slots of `def` in `(cursor, until]` — missed (see
    /// [`EngineCore::plan_and_admit`]; `cause` says why) — and records
    /// them: one coalesced SKIPPED record for what does not run, a run per
    /// slot that does (at most `budget`), the cursor past them. The grace
    /// is counted up to `until` (now, or when this leader started, or when
    /// the definition changed). Returns false when a `run_all` catch-up has
    /// more to run (the cursor is at its last run).
    fn plan_missed(
        &mut self,
        now: Now,
        task_id: &str,
        def: &TaskRecord,
        until: DateTime<Utc>,
        budget: &mut usize,
        cause: LateCause,
    ) -> bool {
        let Some(e) = self.tasks.get(task_id) else { return true };
        let ex = &def.spec.execution;
        let (policy, grace) = (ex.misfire_policy, ex.misfire_grace_seconds);
        let scheds = schedules(def);
        let cap = runs_left(e, &scheds).map_or(*budget, |left| (*budget).min(usize::try_from(left).unwrap_or(usize::MAX)));
        let plan = plan_due_slots(&scheds, SlotWindow { after: e.baseline(), now: until }, policy, grace, cap);
        let kind = scheds.first().map_or(TriggerKind::Cron, |s| s.kind().into());
        if let Some(range) = plan.skipped {
            let why = match policy {
                MisfirePolicy::Skip => format!("{} slot(s) missed ({cause}): misfire_policy skip", range.0),
                MisfirePolicy::RunOnce => format!(
                    "{} slot(s) missed ({cause}): misfire_policy run_once runs only the latest slot within misfire_grace_seconds ({grace} s)",
                    range.0
                ),
                MisfirePolicy::RunAll => format!("{} slot(s) missed ({cause}) by more than misfire_grace_seconds ({grace} s)", range.0),
            };
            tracing::warn!(task_id, missed = range.0, from = %range.1, until = %range.2, cause = %cause, "slots missed: coalesced into one SKIPPED record");
            self.skip_record(now, def, kind, SkipReason::Misfired, range, why);
        }
        // A catch-up's runs queue behind each other (run_all), whatever the
        // overlap policy says about runs from before it.
        let catchup = plan.run.len() > 1 || plan.more || self.tasks.get(task_id).is_some_and(|e| !e.catchup.is_empty());
        let mut batch = self.tasks.get(task_id).map(|e| e.catchup.clone()).unwrap_or_default();
        for (slot, kind) in &plan.run {
            if let Some(run_id) = self.admit_slot(now, def, &scheds, *slot, (*kind).into(), &batch)
                && catchup
            {
                batch.insert(run_id);
            }
        }
        *budget = budget.saturating_sub(plan.run.len());
        if let Some(e) = self.tasks.get_mut(task_id) {
            e.catchup = if plan.more { batch } else { HashSet::new() };
        }
        if let Some(last) = plan.last_slot {
            self.set_cursor(now, task_id, last);
        }
        !plan.more
    }

    /// Creates the run of one slot of `scheds` (the definition's
    /// schedules) under the overlap policy (see `runs.rs`), or its
    /// SKIPPED `dst_gap` record when it stands for local times a DST change
    /// skipped under `dst.gap: skip`. Returns its id when a run was created;
    /// a run that is not SKIPPED counts toward `max_runs`.
    pub(in crate::engine::core) fn admit_slot(
        &mut self,
        now: Now,
        def: &TaskRecord,
        scheds: &[Schedule],
        slot: DateTime<Utc>,
        kind: TriggerKind,
        batch: &HashSet<String>,
    ) -> Option<String> {
        let spec = &def.spec;
        let gap = scheds.iter().map(|s| s.gap_slots(slot)).max().unwrap_or(0);
        if gap > 0 {
            let why = format!("{gap} slot(s) at local times the daylight-saving change at {slot} skipped (dst.gap: skip)");
            self.skip_record(now, def, kind, SkipReason::DstGap, (gap, slot, slot), why);
            return None;
        }
        let mut run = RunRecord::pending(slot_run_id(&spec.task_id, slot), &spec.task_id, "", kind, slot, now.wall);
        if let Some(sched) = scheds.iter().find(|s| s.next_after(slot - chrono::Duration::milliseconds(1)) == Some(slot))
            && sched.jitter_ms() > 0
        {
            run.fire_at = Some(sched.fire_at(&spec.task_id, slot));
        }
        let id = run.run_id.clone();
        let req = RunRequest { def: Some(def), batch: Some(batch), ..RunRequest::new(run) };
        if !matches!(self.submit(now, req), Ok(Submitted::Recorded)) {
            return None;
        }
        if self.runs.get(&id).is_some_and(|r| r.status != crate::model::RunStatus::Skipped)
            && let Some(c) = self.tasks.get_mut(&spec.task_id).map(|e| e.cursor.get_or_insert_with(Cursor::default))
        {
            c.time_runs += 1;
        }
        Some(id)
    }

    /// A SKIPPED record covering `range` (`(count, first, last)`); its id is
    /// the first slot's run id.
    pub(in crate::engine::core) fn skip_record(
        &mut self,
        now: Now,
        def: &TaskRecord,
        kind: TriggerKind,
        reason: SkipReason,
        range: (u64, DateTime<Utc>, DateTime<Utc>),
        why: String,
    ) {
        let spec = &def.spec;
        let run =
            RunRecord::skipped(slot_run_id(&spec.task_id, range.1), &spec.task_id, &spec.agent_id, kind, reason, range, why, now.wall);
        if self.runs.contains_key(&run.run_id) {
            return;
        }
        let run_id = run.run_id.clone();
        self.create(now, run);
        if let Some(r) = self.event_run(&run_id) {
            self.fx.events.push(Lifecycle::SlotSkipped { run: r, reason, count: range.0, from: range.1, until: range.2 });
        }
        self.notify(now, &run_id, crate::model::notification::NotifyEvent::OnSkipped, None);
    }

    /// Every slot up to `last` is handled: written with this turn's records
    /// of the task, in the same transaction.
    pub(in crate::engine::core) fn set_cursor(&mut self, now: Now, task_id: &str, last: DateTime<Utc>) {
        let Some(e) = self.tasks.get_mut(task_id) else { return };
        let cursor = e.cursor.get_or_insert_with(Cursor::default);
        cursor.last_slot = Some(last);
        cursor.updated_at = Some(now.wall);
        let cursor = cursor.clone();
        self.writes.cursor(task_id, Some(cursor));
    }

    /// How many tasks fire next at each of `instants` (their armed fire,
    /// jitter included; a task changed since its timer was armed counted
    /// by its current one only): what `apply` warns about when many share
    /// one instant. One pass over the armed timers.
    ///
    /// Tasks in `exclude` are not counted.
    pub fn fires_at(
        &self,
        instants: &HashSet<DateTime<Utc>>,
        exclude: &HashSet<String>,
    ) -> std::collections::HashMap<DateTime<Utc>, usize> {
        let mut out = std::collections::HashMap::new();
        for (at, task, generation) in self.timers.fires() {
            if instants.contains(&at)
                && !exclude.contains(task)
                && self.tasks.get(task).is_some_and(|e| e.generation == generation && !e.deleted)
            {
                *out.entry(at).or_insert(0) += 1;
            }
        }
        out
    }
}
