//! Task definitions in the core: created, changed (edit, pause, resume),
//! deleted, reloaded; and settling the slots due under a definition
//! before it changes (their firing is the generator's,
//! `sources/generator.rs`).
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

use super::sources::generator::schedules;
use super::{EngineCore, TaskEntry};
use crate::model::{Cursor, TaskRecord};
use crate::schedule::next_slot;

impl TaskEntry {
    /// Slots strictly after this instant are still to come.
    pub(super) fn baseline(&self) -> DateTime<Utc> {
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

    pub(super) fn remove_task(&mut self, now: Now, task_id: &str) {
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
