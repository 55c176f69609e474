//! The backfill source (issue 37): a backfill walks its task's slots in
//! `[from, to]` in its order, one slot at a time, while fewer than
//! `max_concurrent` of its runs are live. For each slot it reads what is
//! stored there (memory first, then the store and the history archive:
//! [`ReadPurpose::Backfill`]), lets [`decide`] say what the slot gets,
//! and then:
//! - a run: the slot's own run id (`{task}.{stamp}`, as a live slot's),
//!   `trigger: backfill`, admitted like any run (every policy), at the
//!   task's priority less [`BACKFILL_PRIORITY_DROP`] so live slots keep
//!   their place; its backfill record — cursor on this slot, counters —
//!   commits in the run's own write group;
//! - a linked run `{slot run}.rerun-1` the same way, with the slot run's
//!   input and `rerun_of`;
//! - nothing: the cursor moves on in a write of its own.
//!
//! A run's end updates the counters in the group of its final record.
//! A backfill of a paused task is held (it creates nothing; its cursor
//! stays) until the task resumes: the `paused` policy's rule.
//! A paused backfill has no timer and no read in flight: it creates
//! nothing until resumed. Slots after the task's own cursor are the live
//! schedule's: the backfill waits for them (a timer each second).

use chrono::{DateTime, Utc};

use super::{Input, RunRequest};
use crate::clock::Now;
use crate::engine::core::admission::Submitted;
use crate::engine::core::policy::paused::{WhilePaused, while_paused};
use crate::engine::core::{EngineCore, ReadPurpose, Timer};
use crate::error::{Error, Result};
use crate::model::RunRecord;
use crate::model::backfill::{Backfill, BackfillState, MAX_BACKFILL_SLOTS, Order, Verdict, decide};
use crate::model::run::{RunStatus, TriggerKind, rerun_run_id, slot_run_id};
use crate::repo::StoreOp;
use crate::schedule::Schedule;

/// How much lower than the task's own priority a backfill's runs wait.
pub const BACKFILL_PRIORITY_DROP: i32 = 100;

/// A backfill in the core: its record and its slots in order.
#[derive(Debug)]
pub(in crate::engine::core) struct BackfillEntry {
    rec: Backfill,
    /// Every slot of the range, in the backfill's order.
    slots: Vec<DateTime<Utc>>,
    /// A read for a slot is in flight.
    reading: bool,
}

/// What an operator does to a backfill (`EngineHandle::backfill`).
#[derive(Debug, Clone)]
pub enum BackfillOp {
    /// Start one (validated, its slots counted, by the API).
    Create(Box<Backfill>),
    /// Freeze its cursor.
    Pause(String),
    /// Go on from its cursor.
    Resume(String),
    /// Stop it for good; its record stays.
    Cancel(String),
}

/// The slots of `scheds` in `[from, to]`, in `order`; at most
/// [`MAX_BACKFILL_SLOTS`] (`None` past it).
pub fn plan_slots(scheds: &[Schedule], from: DateTime<Utc>, to: DateTime<Utc>, order: Order) -> Option<Vec<DateTime<Utc>>> {
    let mut out = Vec::new();
    let mut t = from - chrono::Duration::milliseconds(1);
    while let Some((n, _)) = crate::schedule::next_slot(scheds, t) {
        if n > to {
            break;
        }
        if out.len() >= MAX_BACKFILL_SLOTS {
            return None;
        }
        out.push(n);
        t = n;
    }
    if order == Order::Newest {
        out.reverse();
    }
    Some(out)
}

impl EngineCore {
    /// The backfills stored when this leader took over: each goes on from
    /// its cursor. Its runs still live are in memory (loaded with the
    /// active runs); those that ended were counted with their end.
    pub(in crate::engine::core) fn load_backfills(&mut self, now: Now, backfills: Vec<Backfill>) {
        for rec in backfills {
            let id = rec.id.clone();
            let e = self.backfill_entry(rec);
            self.backfills.insert(id.clone(), e);
            self.backfill_step(now, &id);
        }
    }

    fn backfill_entry(&self, rec: Backfill) -> BackfillEntry {
        let slots = if rec.finished() {
            Vec::new()
        } else {
            let scheds = self.tasks.get(&rec.spec.task_id).and_then(|e| e.record.spec.schedules().ok()).unwrap_or_default();
            plan_slots(&scheds, rec.spec.from, rec.spec.to, rec.spec.order).unwrap_or_default()
        };
        BackfillEntry { rec, slots, reading: false }
    }

    /// An operator's change; the answer is the backfill as it then is.
    pub(in crate::engine::core) fn backfill_op(&mut self, now: Now, op: BackfillOp) -> Result<Backfill> {
        let (id, state) = match op {
            BackfillOp::Create(rec) => {
                let id = rec.id.clone();
                if self.backfills.contains_key(&id) {
                    return Err(Error::FailedPrecondition(format!("backfill {id} exists")));
                }
                if self.tasks.get(&rec.spec.task_id).is_none_or(|e| e.deleted) {
                    return Err(Error::NotFound { kind: "task", id: rec.spec.task_id.clone() });
                }
                let e = self.backfill_entry(*rec);
                self.backfills.insert(id.clone(), e);
                self.backfill_changed(&id, None);
                tracing::info!(backfill = %id, "backfill started");
                self.backfill_step(now, &id);
                return self.backfill_view(&id);
            }
            BackfillOp::Pause(id) => (id, BackfillState::Paused),
            BackfillOp::Resume(id) => (id, BackfillState::Running),
            BackfillOp::Cancel(id) => (id, BackfillState::Cancelled),
        };
        let e = self.backfills.get_mut(&id).ok_or_else(|| Error::NotFound { kind: "backfill", id: id.clone() })?;
        if e.rec.finished() {
            return Err(Error::FailedPrecondition(format!("backfill {id} is {}", e.rec.state.as_str())));
        }
        e.rec.state = state;
        e.rec.updated_at = now.wall;
        if state == BackfillState::Cancelled {
            e.rec.reason = "cancelled by hand".into();
        }
        self.backfill_changed(&id, None);
        tracing::info!(backfill = %id, state = state.as_str(), "backfill changed");
        self.backfill_step(now, &id);
        self.backfill_view(&id)
    }

    /// A backfill as the core holds it.
    pub fn backfill_view(&self, id: &str) -> Result<Backfill> {
        self.backfills.get(id).map(|e| self.shown(e)).ok_or_else(|| Error::NotFound { kind: "backfill", id: id.to_string() })
    }

    /// Every backfill the core holds.
    pub fn backfill_views(&self) -> Vec<Backfill> {
        self.backfills.values().map(|e| self.shown(e)).collect()
    }

    /// A backfill of `task_id` is held now: its task is paused (the
    /// `paused` policy's rule for backfills).
    fn held(&self, task_id: &str) -> bool {
        self.tasks.get(task_id).is_some_and(|t| t.record.paused) && while_paused(TriggerKind::Backfill) == WhilePaused::Hold
    }

    /// A backfill as shown: a running one held by its paused task says so
    /// in its `reason` (not stored: it holds only while the task is paused).
    fn shown(&self, e: &BackfillEntry) -> Backfill {
        let mut rec = e.rec.clone();
        if rec.state == BackfillState::Running && self.held(&rec.spec.task_id) {
            rec.reason = "held: its task is paused (it goes on when the task is resumed)".into();
        }
        rec
    }

    /// The next slot of a running backfill with room: its stored record
    /// is read ([`ReadPurpose::Backfill`]); or, past the last slot with
    /// nothing live, the backfill is done.
    pub(in crate::engine::core) fn backfill_step(&mut self, now: Now, id: &str) {
        let Some(e) = self.backfills.get(id) else { return };
        if e.reading || e.rec.state != BackfillState::Running || e.rec.in_flight.len() >= e.rec.spec.max_concurrent as usize {
            return;
        }
        let next = match e.rec.cursor {
            None => 0,
            Some(c) => match e.rec.spec.order {
                Order::Oldest => e.slots.partition_point(|s| *s <= c),
                Order::Newest => e.slots.partition_point(|s| *s >= c),
            },
        };
        let task_id = e.rec.spec.task_id.clone();
        let Some(slot) = e.slots.get(next).copied() else {
            if e.rec.in_flight.is_empty() {
                self.backfill_set(now, id, |b| b.state = BackfillState::Done);
                tracing::info!(backfill = id, "backfill done");
            }
            return;
        };
        let Some(task) = self.tasks.get(&task_id).filter(|t| !t.deleted) else {
            self.backfill_set(now, id, |b| {
                b.state = BackfillState::Stopped;
                b.reason = "its task was deleted".into();
            });
            return;
        };
        // A paused task holds its backfills (`policy/paused.rs`); slots the
        // task's own schedule has not handled are its to run.
        let held = self.held(&task_id);
        if held || task.cursor.as_ref().and_then(|c| c.last_slot).unwrap_or(task.record.created_at) < slot {
            self.timers.push_wall(now.wall + chrono::Duration::seconds(1), Timer::BackfillStep { id: id.to_string() });
            return;
        }
        if let Some(e) = self.backfills.get_mut(id) {
            e.reading = true;
        }
        let run_id = slot_run_id(&task_id, slot);
        self.fx.reads.push((run_id, ReadPurpose::Backfill { id: id.to_string(), slot, slot_run: None }));
    }

    /// A read a backfill asked for: the slot's run (`slot_run` `None`), or
    /// — the slot run read before — its linked re-run's.
    pub(in crate::engine::core) fn backfill_read(
        &mut self,
        now: Now,
        id: &str,
        slot: DateTime<Utc>,
        slot_run: Option<Option<Box<RunRecord>>>,
        run_id: &str,
        stored: Option<RunRecord>,
    ) {
        let Some(e) = self.backfills.get(id) else { return };
        let (reprocess, task_id) = (e.rec.spec.reprocess, e.rec.spec.task_id.clone());
        // Memory is fresher than the store.
        let found = self.runs.get(run_id).cloned().or(stored);
        let first_read = slot_run.is_none();
        let (slot_rec, rerun_exists) = match slot_run {
            None => (found, false),
            Some(first) => (first.map(|b| *b), found.is_some()),
        };
        let gap =
            self.tasks.get(&task_id).and_then(|t| t.record.spec.schedules().ok()).is_some_and(|s| s.iter().any(|s| s.gap_slots(slot) > 0));
        let verdict = if gap { Verdict::Leave("dst_gap".into()) } else { decide(reprocess, slot_rec.as_ref(), rerun_exists) };
        // A re-run waits for the word on its linked run's id.
        if verdict == Verdict::Rerun && first_read {
            let linked = rerun_run_id(run_id, 1);
            self.fx.reads.push((linked, ReadPurpose::Backfill { id: id.to_string(), slot, slot_run: Some(slot_rec.map(Box::new)) }));
            return;
        }
        if let Some(e) = self.backfills.get_mut(id) {
            e.reading = false;
        }
        if self.backfills.get(id).is_none_or(|e| e.rec.state != BackfillState::Running) {
            // Paused or cancelled meanwhile: the slot waits, the cursor stays.
            return;
        }
        if self.held(&task_id) {
            // Its task was paused while the read was out: held likewise
            // (a helper's find: the run was made and dispatched).
            self.timers.push_wall(now.wall + chrono::Duration::seconds(1), Timer::BackfillStep { id: id.to_string() });
            return;
        }
        match verdict {
            Verdict::Leave(why) => {
                tracing::debug!(backfill = id, slot = %slot, why, "backfill leaves a slot");
                self.backfill_set(now, id, |b| {
                    b.cursor = Some(slot);
                    b.left += 1;
                });
            }
            Verdict::Run | Verdict::Rerun => {
                let new = match (&verdict, &slot_rec) {
                    (Verdict::Rerun, Some(first)) => self.backfill_rerun(now, id, first),
                    _ => self.backfill_run(now, id, &task_id, slot),
                };
                match new {
                    Some(run_id) => {
                        let ended = self.runs.get(&run_id).is_none_or(|r| r.status.is_terminal());
                        let status = self.runs.get(&run_id).map(|r| r.status);
                        if let Some(e) = self.backfills.get_mut(id) {
                            let b = &mut e.rec;
                            b.cursor = Some(slot);
                            b.created += 1;
                            b.updated_at = now.wall;
                            if ended {
                                count_end(b, status);
                            } else {
                                b.in_flight.push(run_id.clone());
                            }
                        }
                        self.backfill_changed(id, Some(&run_id));
                    }
                    // It exists in memory after all (a live slot made it).
                    None => self.backfill_set(now, id, |b| {
                        b.cursor = Some(slot);
                        b.left += 1;
                    }),
                }
            }
        }
        self.backfill_step(now, id);
    }

    /// Creates the slot's own run; its id when created.
    fn backfill_run(&mut self, now: Now, id: &str, task_id: &str, slot: DateTime<Utc>) -> Option<String> {
        let mut run = RunRecord::pending(slot_run_id(task_id, slot), task_id, "", TriggerKind::Backfill, slot, now.wall);
        run.backfill_id = Some(id.to_string());
        self.backfill_submit(now, run, Input::Task)
    }

    /// Creates a linked run re-running `first` (its input, `rerun_of`).
    fn backfill_rerun(&mut self, now: Now, id: &str, first: &RunRecord) -> Option<String> {
        let run_id = rerun_run_id(&first.run_id, 1);
        let mut run = RunRecord::pending(run_id, &first.task_id, "", TriggerKind::Backfill, first.scheduled_at, now.wall);
        run.event = first.event.clone().filter(|e| !e.body_stored);
        run.upstream = first.upstream.clone();
        run.rerun_of = Some(first.run_id.clone());
        run.backfill_id = Some(id.to_string());
        self.backfill_submit(now, run, Input::Exact(first.params.clone()))
    }

    /// A backfill's run through the one admission, [`BACKFILL_PRIORITY_DROP`]
    /// below the task's priority; its id when it was made.
    fn backfill_submit(&mut self, now: Now, run: RunRecord, input: Input) -> Option<String> {
        let run_id = run.run_id.clone();
        let req = RunRequest { input, priority_delta: -BACKFILL_PRIORITY_DROP, ..RunRequest::new(run) };
        matches!(self.submit(now, req), Ok(Submitted::Recorded)).then_some(run_id)
    }

    /// A backfill's run changed: at its end, the backfill counts it in the
    /// group of the run's final record, and may go on (or stop, under
    /// `on_failure: stop`).
    pub(in crate::engine::core) fn backfill_run_changed(&mut self, now: Now, run_id: &str) {
        let Some(run) = self.runs.get(run_id) else { return };
        let (Some(id), true) = (run.backfill_id.clone(), run.status.is_terminal()) else { return };
        let status = run.status;
        let Some(e) = self.backfills.get_mut(&id) else { return };
        let Some(pos) = e.rec.in_flight.iter().position(|r| r == run_id) else { return };
        e.rec.in_flight.remove(pos);
        count_end(&mut e.rec, Some(status));
        e.rec.updated_at = now.wall;
        if matches!(status, RunStatus::Failed | RunStatus::Timeout)
            && e.rec.spec.on_failure == crate::model::backfill::OnFailure::Stop
            && e.rec.state == BackfillState::Running
        {
            e.rec.state = BackfillState::Stopped;
            e.rec.reason = format!("run {run_id} ended {} (on_failure: stop)", status.as_str());
        }
        self.backfill_changed(&id, Some(run_id));
        self.backfill_step(now, &id);
    }

    /// Changes a backfill's record and writes it alone.
    fn backfill_set(&mut self, now: Now, id: &str, f: impl FnOnce(&mut Backfill)) {
        let Some(e) = self.backfills.get_mut(id) else { return };
        f(&mut e.rec);
        e.rec.updated_at = now.wall;
        self.backfill_changed(id, None);
    }

    /// A backfill's record changed this turn, with `run`'s write (its
    /// creation or end) or alone.
    fn backfill_changed(&mut self, id: &str, run: Option<&str>) {
        let runs = self.backfills_changed.entry(id.to_string()).or_default();
        if let Some(r) = run {
            runs.insert(r.to_string());
        }
    }

    /// The turn's backfill records, each written once as it ends the turn
    /// (a store takes a key once per transaction, and an earlier copy
    /// committing after a later one would undo it): in the write group of
    /// a run that changed it this turn (its cursor and counters commit
    /// with that run's creation or end), or in a group of its own.
    pub(in crate::engine::core) fn flush_backfills(&mut self) {
        for (id, runs) in std::mem::take(&mut self.backfills_changed) {
            let Some(e) = self.backfills.get(&id) else { continue };
            let rec = Box::new(e.rec.clone());
            match runs.into_iter().next() {
                Some(r) => self.writes.with_run(&r, [StoreOp::PutBackfill(rec)]),
                None => self.writes.alone(vec![StoreOp::PutBackfill(rec)]),
            }
        }
    }
}

/// A backfill run's end in the counters.
fn count_end(b: &mut Backfill, status: Option<RunStatus>) {
    match status {
        Some(RunStatus::Succeeded) => b.succeeded += 1,
        Some(RunStatus::Failed | RunStatus::Timeout) => b.failed += 1,
        _ => b.other += 1,
    }
}
