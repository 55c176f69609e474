//! Tracking task definitions and firing their slots.

use chrono::{DateTime, Utc};

use super::{Engine, TaskEntry, Timer};
use crate::model::run::{skip_reason, slot_run_id};
use crate::model::task::MisfirePolicy;
use crate::model::{Cursor, RunRecord, TaskRecord};
use crate::schedule::{Schedule, SlotWindow, count_slots, jitter_for, next_slot, plan_due_slots};
use crate::store::{Txn, TxnOp};

/// Retry delay after a failed store write while firing.
const WRITE_RETRY: chrono::Duration = chrono::Duration::seconds(1);

impl TaskEntry {
    /// The compiled triggers. Compiled when needed rather than kept: a
    /// parsed cron holds a year bitmap of ~5 KB, and re-parsing is
    /// microseconds at each fire (see the bench-idle memory figure).
    fn schedules(&self) -> Vec<Schedule> {
        self.record.spec.schedules().unwrap_or_default()
    }

    /// Slots strictly after this instant are still to come.
    fn baseline(&self) -> DateTime<Utc> {
        self.cursor.as_ref().and_then(|c| c.last_slot).unwrap_or(self.record.created_at)
    }
}

impl Engine {
    /// Starts tracking a task (new or changed definition, pause, resume).
    pub(super) async fn upsert_task(&mut self, rec: TaskRecord, cursor: Option<Cursor>) {
        let id = rec.spec.task_id.clone();
        if let Err(e) = rec.spec.schedules() {
            tracing::error!(task_id = %id, error = %e, "stored task does not compile; not scheduled");
            return;
        }
        let (cursor, generation) = match self.tasks.remove(&id) {
            Some(prev) => (prev.cursor, prev.generation + 1),
            None => (cursor, 1),
        };
        self.tasks.insert(id.clone(), TaskEntry { record: rec, cursor, generation, next: None });
        self.run_past_once(&id).await;
        self.cover_paused_slots(&id).await;
        self.arm(&id);
    }

    /// Stops tracking a deleted task: runs that have not started are
    /// cancelled; running ones finish on their own.
    pub(super) async fn remove_task(&mut self, task_id: &str) {
        if self.tasks.remove(task_id).is_some() {
            let waiting: Vec<String> =
                self.runs.values().filter(|r| r.task_id == task_id && r.current_execution().is_none()).map(|r| r.run_id.clone()).collect();
            for run_id in waiting {
                if let Err(e) = self.cancel_run(&run_id, "task deleted").await {
                    tracing::warn!(run_id = %run_id, error = %e, "cannot cancel a run of a deleted task");
                }
            }
            let txn = self.fenced(Txn { success: vec![TxnOp::delete(self.keys.cursor(task_id))], ..Txn::default() });
            if let Err(e) = self.store.txn(txn).await {
                tracing::warn!(task_id, error = %e, "cannot delete cursor");
            }
            tracing::info!(task_id, "task removed from the schedule");
        }
    }

    /// A `once` trigger already past when the task was created runs once,
    /// right away (an explicit backfill), unless the task has fired before.
    async fn run_past_once(&mut self, task_id: &str) {
        let Some(e) = self.tasks.get(task_id) else { return };
        if e.cursor.is_some() || e.record.paused {
            return;
        }
        let created = e.record.created_at;
        let past: Vec<DateTime<Utc>> = e
            .schedules()
            .iter()
            .filter_map(|s| match s {
                Schedule::Once { at } if *at <= created => Some(*at),
                _ => None,
            })
            .collect();
        if past.is_empty() {
            return;
        }
        for at in past {
            self.admit_slot(task_id, at, "once").await;
        }
        self.advance_cursor(task_id, created).await;
    }

    /// On resume: one SKIPPED record (`paused`) covers the slots between the
    /// last handled slot and the resume; the schedule continues from there.
    async fn cover_paused_slots(&mut self, task_id: &str) {
        let Some(e) = self.tasks.get(task_id) else { return };
        let Some(resumed_at) = e.record.resumed_at else { return };
        if e.record.paused || resumed_at <= e.baseline() {
            return;
        }
        if let Some(range) = count_slots(&e.schedules(), e.baseline(), resumed_at) {
            let rec = &e.record;
            let kind = e.schedules().first().map_or("cron", Schedule::kind);
            let now = self.now();
            let mut run = RunRecord::skipped(
                slot_run_id(task_id, range.1),
                task_id,
                &rec.spec.agent_id,
                kind,
                skip_reason::PAUSED,
                range,
                format!("{} slot(s) due while the task was paused", range.0),
                now,
            );
            let cursor = self.cursor_op(task_id, resumed_at);
            if let Err(err) = self.store_run_with(&mut run, true, cursor).await {
                tracing::error!(task_id, error = %err, "cannot write paused record");
                return;
            }
            tracing::info!(task_id, missed = range.0, "resumed; paused slots covered by one SKIPPED record");
        }
        self.advance_cursor(task_id, resumed_at).await;
    }

    /// Sets the next fire timer of a task (none if paused or no slot left).
    pub(super) fn arm(&mut self, task_id: &str) {
        let Some(e) = self.tasks.get_mut(task_id) else { return };
        e.generation += 1;
        e.next = None;
        if e.record.paused {
            return;
        }
        let schedules = e.schedules();
        let Some((slot, sched)) = next_slot(&schedules, e.baseline()) else { return };
        let fire_at = slot.checked_add_signed(jitter_for(task_id, slot, sched.jitter_ms())).unwrap_or(slot);
        e.next = Some((slot, fire_at));
        let generation = e.generation;
        self.push_timer(fire_at, Timer::Fire { task_id: task_id.to_string(), generation });
    }

    /// Handles every slot due for a task: on time, late or missed.
    pub(super) async fn on_fire(&mut self, task_id: &str, generation: u64) {
        let now = self.now();
        let Some(e) = self.tasks.get(task_id) else { return };
        if e.generation != generation || e.record.paused {
            return;
        }
        if self.awaits_redeclare(task_id) {
            // Its overlap decision needs to know whether that run is alive.
            self.deferred_fires.insert(task_id.to_string());
            return;
        }
        let Some(e) = self.tasks.get(task_id) else { return };
        let ex = &e.record.spec.execution;
        let (policy, grace) = (ex.misfire_policy, ex.misfire_grace_seconds);
        let window = SlotWindow { after: e.baseline(), now };
        let plan = plan_due_slots(&e.schedules(), window, policy, grace);
        let agent = e.record.spec.agent_id.clone();
        let kind = e.schedules().first().map_or("cron", Schedule::kind);
        if let Some(range) = plan.skipped {
            let why = match policy {
                MisfirePolicy::Skip => "misfire_policy skip".to_string(),
                _ => format!("missed by more than misfire_grace_seconds ({grace})"),
            };
            let mut run = RunRecord::skipped(
                slot_run_id(task_id, range.1),
                task_id,
                &agent,
                kind,
                skip_reason::MISFIRED,
                range,
                format!("{} slot(s) missed while no scheduler ran: {why}", range.0),
                now,
            );
            let cursor = self.cursor_op(task_id, range.2);
            if let Err(err) = self.store_run_with(&mut run, true, cursor).await {
                tracing::error!(task_id, error = %err, "cannot write misfire record; retrying");
                self.push_timer(now + WRITE_RETRY, Timer::Fire { task_id: task_id.to_string(), generation });
                return;
            }
            tracing::warn!(task_id, missed = range.0, from = %range.1, until = %range.2, "misfired slots coalesced");
        }
        for (slot, kind) in &plan.run {
            self.admit_slot(task_id, *slot, kind).await;
        }
        if let Some(last) = plan.last_slot {
            self.advance_cursor(task_id, last).await;
        }
        self.arm(task_id);
    }

    /// True while a run of the task has an open attempt recovered at load
    /// whose runner has not yet reconnected (its entry is still the
    /// placeholder of session 0). The takeover rule of DESIGN (Store and
    /// leadership): wait for runners to re-declare their in-flight runs,
    /// bounded by the runner-lost timeout, then resume; slots due meanwhile
    /// follow the misfire policy. Without the wait, the first slot after a
    /// restart meets a run that is really gone and is skipped for overlap.
    fn awaits_redeclare(&self, task_id: &str) -> bool {
        self.runners.values().any(|r| r.session == 0)
            && self.runs.values().any(|run| {
                run.task_id == task_id
                    && run
                        .attempts
                        .last()
                        .is_some_and(|a| a.outcome.is_none() && self.runners.get(&a.runner_id).is_some_and(|r| r.session == 0))
            })
    }

    /// Re-arms deferred tasks whose recovered runs are now re-declared,
    /// finished or lost. Called after every command and timer batch.
    pub(super) fn release_deferred_fires(&mut self) {
        if self.deferred_fires.is_empty() {
            return;
        }
        let ready: Vec<String> = self.deferred_fires.iter().filter(|t| !self.awaits_redeclare(t)).cloned().collect();
        for task_id in ready {
            self.deferred_fires.remove(&task_id);
            if let Some(generation) = self.tasks.get(&task_id).map(|e| e.generation) {
                let now = self.now();
                self.push_timer(now, Timer::Fire { task_id, generation });
            }
        }
    }

    /// Creates the run of one slot (create-if-absent) under the overlap policy.
    pub(super) async fn admit_slot(&mut self, task_id: &str, slot: DateTime<Utc>, kind: &str) {
        let Some(e) = self.tasks.get(task_id) else { return };
        let now = self.now();
        let spec = &e.record.spec;
        let mut run = RunRecord::pending(slot_run_id(task_id, slot), task_id, &spec.agent_id, kind, slot, now);
        run.params = spec.params();
        run.priority = spec.execution.priority;
        let cursor = self.cursor_op(task_id, slot);
        self.admit_with(run, cursor).await;
    }

    /// The op that records "every slot up to `last` is handled", to commit
    /// with the record of that slot: a slot's record and the cursor moving
    /// past it are never apart, so a later leader's coalesced record (whose
    /// id is its first slot's) can never collide with an existing one.
    fn cursor_op(&self, task_id: &str, last: DateTime<Utc>) -> Vec<TxnOp> {
        let cursor = Cursor { last_slot: Some(last), updated_at: Some(self.now()) };
        match serde_json::to_vec(&cursor) {
            Ok(v) => vec![TxnOp::put(self.keys.cursor(task_id), v)],
            Err(_) => Vec::new(),
        }
    }

    /// Records that every slot up to `last` is handled.
    async fn advance_cursor(&mut self, task_id: &str, last: DateTime<Utc>) {
        let now = self.now();
        let Some(e) = self.tasks.get_mut(task_id) else { return };
        let cursor = Cursor { last_slot: Some(last), updated_at: Some(now) };
        e.cursor = Some(cursor.clone());
        let value = match serde_json::to_vec(&cursor) {
            Ok(v) => v,
            Err(err) => {
                tracing::error!(task_id, error = %err, "cannot encode cursor");
                return;
            }
        };
        let txn = self.fenced(Txn { success: vec![TxnOp::put(self.keys.cursor(task_id), value)], ..Txn::default() });
        match self.store.txn(txn).await {
            Ok(r) if r.succeeded => {}
            Ok(_) => self.on_fenced("cursor write"),
            Err(err) => tracing::error!(task_id, error = %err, "cannot write cursor"),
        }
    }
}
