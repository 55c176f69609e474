//! Task definitions and their slots: firing, misfires, and settling the
//! slots due under a definition before it changes (edit, pause, delete).
//!
//! Every due slot leaves a record. A change to a task first queues the old
//! definition with the instant of the change (`TaskEntry::settle`); the next
//! fire settles those slots by the old definition's misfire policy, then
//! goes on with the new one. While a new leader waits for runners to
//! re-declare a task's recovered runs, fires (settlements included) wait
//! too, so their overlap decision knows whether those runs are alive.

use std::collections::{HashSet, VecDeque};

use chrono::{DateTime, Utc};

use crate::clock::Now;

use super::{EngineCore, MAX_RUNS_PER_FIRE, TaskEntry, Timer};
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
fn schedules(rec: &TaskRecord) -> Vec<Schedule> {
    rec.spec.schedules().unwrap_or_default()
}

/// Why slots were late when the engine got to them (in the misfire log
/// and the SKIPPED record's error).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LateCause {
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
fn runs_left(e: &TaskEntry, scheds: &[Schedule]) -> Option<u64> {
    let max = scheds.iter().find_map(|s| s.bounds.max_runs)?;
    Some(max.saturating_sub(e.cursor.as_ref().map_or(0, |c| c.time_runs)))
}

impl TaskEntry {
    /// Slots strictly after this instant are still to come.
    fn baseline(&self) -> DateTime<Utc> {
        self.cursor.as_ref().and_then(|c| c.last_slot).unwrap_or(self.record.created_at)
    }
}

impl EngineCore {
    /// A task created or changed.
    pub(super) fn task_put(&mut self, now: Now, mut rec: TaskRecord, cursor: Option<Cursor>) {
        // The engine runs the spec; the document as written is the API's.
        rec.applied = None;
        let id = rec.spec.task_id.clone();
        if let Err(e) = rec.spec.schedules() {
            tracing::error!(task_id = %id, error = %e, "stored task does not compile; not scheduled");
            return;
        }
        match self.tasks.get_mut(&id) {
            Some(e) => {
                if e.record == rec && !e.deleted {
                    return;
                }
                let baseline = e.baseline();
                self.policies.task_changed(&id, Some(&rec.spec));
                self.routes.task_changed(&id, Some(&rec.spec));
                let old = std::mem::replace(&mut e.record, rec);
                // Slots the old definition made due are settled by it first.
                if !e.deleted && !old.paused && next_slot(&schedules(&old), baseline).is_some_and(|(s, _)| s <= now.wall) {
                    e.settle.push_back((old, now.wall));
                }
                e.deleted = false;
            }
            None => {
                self.insert_task(rec, cursor);
            }
        }
        self.task_started(now, &id);
    }

    /// Tracks a task new to the core; returns its id, or `None` when its
    /// stored definition does not compile.
    pub(super) fn insert_task(&mut self, mut rec: TaskRecord, cursor: Option<Cursor>) -> Option<String> {
        rec.applied = None;
        let id = rec.spec.task_id.clone();
        if let Err(e) = rec.spec.schedules() {
            tracing::error!(task_id = %id, error = %e, "stored task does not compile; not scheduled");
            return None;
        }
        let entry = TaskEntry {
            record: rec,
            cursor,
            generation: 0,
            settle: VecDeque::new(),
            deleted: false,
            deferred: false,
            catchup: HashSet::new(),
            skips: None,
        };
        self.policies.task_changed(&id, Some(&entry.record.spec));
        self.routes.task_changed(&id, Some(&entry.record.spec));
        self.tasks.insert(id.clone(), entry);
        Some(id)
    }

    /// The first decisions after a definition arrives: a past `once`, the
    /// slots of a pause, the next fire, pending settlements.
    pub(super) fn task_started(&mut self, now: Now, id: &str) {
        self.drop_breaker_if_off(now, id);
        self.run_past_once(now, id);
        self.cover_paused_slots(now, id);
        self.arm(now, id);
        if self.tasks.get(id).is_some_and(|e| !e.settle.is_empty()) {
            self.fire_now(now, id);
        }
    }

    /// A task deleted: its due slots are settled, then its waiting runs are
    /// cancelled and its cursor deleted. Running runs finish on their own.
    pub(super) fn task_deleted(&mut self, now: Now, task_id: &str) {
        let Some(e) = self.tasks.get_mut(task_id) else { return };
        if e.deleted {
            return;
        }
        let baseline = e.baseline();
        if !e.record.paused && next_slot(&schedules(&e.record), baseline).is_some_and(|(s, _)| s <= now.wall) {
            let rec = e.record.clone();
            e.settle.push_back((rec, now.wall));
        }
        e.deleted = true;
        self.policies.task_changed(task_id, None);
        self.routes.task_changed(task_id, None);
        if e.settle.is_empty() {
            self.remove_task(now, task_id);
        } else {
            self.fire_now(now, task_id);
        }
    }

    /// The task watch broke: reconcile with every stored task.
    pub(super) fn tasks_reloaded(&mut self, now: Now, tasks: Vec<(TaskRecord, Option<Cursor>)>) {
        let mut seen = HashSet::new();
        for (rec, cursor) in tasks {
            seen.insert(rec.spec.task_id.clone());
            let cursor = if self.tasks.contains_key(&rec.spec.task_id) { None } else { cursor };
            self.task_put(now, rec, cursor);
        }
        let gone: Vec<String> = self.tasks.keys().filter(|k| !seen.contains(*k)).cloned().collect();
        for id in gone {
            self.task_deleted(now, &id);
        }
    }

    fn remove_task(&mut self, now: Now, task_id: &str) {
        if self.tasks.remove(task_id).is_none() {
            return;
        }
        self.deferred.remove(task_id);
        let waiting: Vec<String> = self
            .by_task
            .get(task_id)
            .map(|ids| {
                ids.iter()
                    .filter(|id| self.runs.get(*id).is_some_and(|r| !r.status.is_terminal() && r.current_attempt().is_none()))
                    .cloned()
                    .collect()
            })
            .unwrap_or_default();
        for run_id in waiting {
            self.finish(now, &run_id, crate::model::RunStatus::Cancelled, "task deleted before the run started".into());
        }
        self.writes.cursor(task_id, None);
        tracing::info!(task_id, "task removed from the schedule");
    }

    /// A `once` trigger already past when the task was created runs once,
    /// right away (an explicit backfill), unless the task has fired before.
    fn run_past_once(&mut self, _now: Now, task_id: &str) {
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
            self.fx.reads.push((slot_run_id(task_id, at), super::ReadPurpose::PastOnce { task_id: task_id.to_string(), at }));
        }
    }

    /// The stored run of a past `once` slot (see `run_past_once`): run the
    /// slot if it has no record; either way it is handled.
    pub(super) fn past_once_loaded(&mut self, now: Now, task_id: &str, at: DateTime<Utc>, exists: bool) {
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
    fn cover_paused_slots(&mut self, now: Now, task_id: &str) {
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
    pub(super) fn arm(&mut self, _now: Now, task_id: &str) {
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
    fn fire_now(&mut self, now: Now, task_id: &str) {
        if let Some(generation) = self.tasks.get(task_id).map(|e| e.generation) {
            self.timers.push_wall(now.wall, Timer::Fire { task_id: task_id.to_string(), generation });
        }
    }

    /// Handles the slots due for a task: settlements of earlier
    /// definitions first, then the current one.
    pub(super) fn on_fire(&mut self, now: Now, task_id: &str, generation: u64) {
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
            let lag = now.wall - slot;
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
    fn admit_slot(
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
        let mut run = RunRecord::pending(slot_run_id(&spec.task_id, slot), &spec.task_id, &spec.agent_id, kind, slot, now.wall);
        run.params = spec.params();
        run.priority = spec.execution.priority;
        if let Some(sched) = scheds.iter().find(|s| s.next_after(slot - chrono::Duration::milliseconds(1)) == Some(slot))
            && sched.jitter_ms() > 0
        {
            run.fire_at = Some(sched.fire_at(&spec.task_id, slot));
        }
        let id = run.run_id.clone();
        if !self.admit(now, run, spec, batch) {
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
    fn skip_record(
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
    fn set_cursor(&mut self, now: Now, task_id: &str, last: DateTime<Utc>) {
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

    /// True while a run of the task holds an attempt recovered at load whose
    /// runner has not yet said Hello (its entry is still the placeholder of
    /// session 0). The takeover rule of DESIGN (Store and leadership): wait
    /// for runners to re-declare their in-flight runs, bounded by
    /// `redeclare_wait`, then resume; slots due meanwhile follow the misfire
    /// policy. Without the wait, the first slot after a restart meets a run
    /// that is really gone and is skipped for overlap.
    pub(super) fn awaits_redeclare(&self, task_id: &str) -> bool {
        if !self.registry.has_placeholders() {
            return false;
        }
        let Some(ids) = self.by_task.get(task_id) else { return false };
        ids.iter().filter_map(|id| self.runs.get(id)).any(|run| {
            run.attempts
                .iter()
                .any(|a| (a.is_open() || a.awaiting_runner) && self.registry.get(&a.runner_id).is_some_and(|r| r.session == 0))
        })
    }

    /// Re-fires deferred tasks whose recovered runs are now re-declared,
    /// finished or lost.
    pub(super) fn release_deferred(&mut self, now: Now) {
        if self.deferred.is_empty() {
            return;
        }
        let ready: Vec<String> = self.deferred.iter().filter(|t| !self.awaits_redeclare(t)).cloned().collect();
        for task_id in ready {
            self.deferred.remove(&task_id);
            if let Some(e) = self.tasks.get_mut(&task_id) {
                e.deferred = false;
            }
            self.fire_now(now, &task_id);
        }
    }
}
