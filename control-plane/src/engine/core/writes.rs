//! This turn's store writes, by the atomic group each belongs to.
//!
//! Every change the core decides names its group when it is made:
//! - **the task's group** ([`WriteSet::created`] with [`Home::Task`],
//!   [`WriteSet::cursor`], [`WriteSet::join_task`]): the slot runs a fire
//!   created, then the task's cursor — a slot's record and the cursor
//!   moving past it commit together (a later leader never re-creates a
//!   handled slot); a run whose end moved its task's circuit breaker joins
//!   it too;
//! - **the run's group** ([`WriteSet::changed`], [`WriteSet::with_run`],
//!   [`WriteSet::created`] with [`Home::Own`]): a changed run — or a run
//!   an event created, with its stored body — and what it caused: its
//!   notifications, the budget ledger entries it settles; none is written
//!   without the other;
//! - **another run's group** ([`Home::With`]): a run created because that
//!   one ended (`after`) commits in the same transaction as that end, so a
//!   following run exists exactly when its upstream is terminal.
//!
//! A change is urgent (this turn's transaction) or lazy (a start, progress,
//! a pending reason: it rides with the next transaction, or is flushed
//! within [`super::PROGRESS_FLUSH`]). [`WriteSet::drain`] turns the turn's
//! changes into groups, task groups first, in a fixed order.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use crate::model::{Cursor, RunRecord};
use crate::repo::StoreOp;

/// How soon a changed run must reach the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Urgency {
    /// In this turn's transaction.
    Now,
    /// With the next transaction, or at the next flush (a run started,
    /// progress, a pending reason): never a transaction of its own per change.
    Lazy,
}

/// Where a run created this turn is written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Home {
    /// In its task's group, with the cursor (a time slot's run).
    Task,
    /// In a group of its own, with its ops (an event's run).
    Own,
    /// In the group of that run's write (it follows that run's end).
    With(String),
}

/// See the module docs.
#[derive(Debug, Default)]
pub(super) struct WriteSet {
    /// Runs created this turn, in order, with where each is written.
    created: Vec<(String, Home)>,
    created_set: HashSet<String>,
    /// Runs changed this turn that must be written now.
    urgent: BTreeSet<String>,
    /// Runs changed lazily.
    lazy: BTreeSet<String>,
    /// Runs whose write goes in their task's group (their end changed the
    /// task's cursor: its breaker).
    in_task_group: BTreeSet<String>,
    /// Cursors to write (`None`: delete), each in its task's group.
    cursors: BTreeMap<String, Option<Cursor>>,
    /// Ops that go in the group of a run's write.
    with_run: HashMap<String, Vec<StoreOp>>,
    /// Write the lazy changes with this drain even without other writes.
    flush: bool,
    /// Groups of ops tied to no run (a hold-back released by hand).
    alone: Vec<Vec<StoreOp>>,
}

impl WriteSet {
    /// A new run, created in the group `home` names.
    pub(super) fn created(&mut self, run_id: &str, home: Home) {
        if self.created_set.insert(run_id.to_string()) {
            self.created.push((run_id.to_string(), home));
        }
    }

    /// A run changed (a run created this turn is written whole anyway).
    pub(super) fn changed(&mut self, run_id: &str, urgency: Urgency) {
        if self.created_set.contains(run_id) {
            return;
        }
        match urgency {
            Urgency::Now => {
                self.lazy.remove(run_id);
                self.urgent.insert(run_id.to_string());
            }
            Urgency::Lazy if !self.urgent.contains(run_id) => {
                self.lazy.insert(run_id.to_string());
            }
            Urgency::Lazy => {}
        }
    }

    /// Runs this turn writes now (created or urgently changed).
    pub(super) fn runs(&self) -> usize {
        self.created.len() + self.urgent.len()
    }

    /// Whether the run's write is pending this turn (urgent or created).
    pub(super) fn pending(&self, run_id: &str) -> bool {
        self.urgent.contains(run_id) || self.created_set.contains(run_id)
    }

    /// A task's cursor changed (`None`: deleted).
    pub(super) fn cursor(&mut self, task_id: &str, cursor: Option<Cursor>) {
        self.cursors.insert(task_id.to_string(), cursor);
    }

    /// The run's write goes in its task's group (with the cursor).
    pub(super) fn join_task(&mut self, run_id: &str) {
        self.in_task_group.insert(run_id.to_string());
    }

    /// Ops to commit in the same group as the run's write this turn.
    pub(super) fn with_run(&mut self, run_id: &str, ops: impl IntoIterator<Item = StoreOp>) {
        self.with_run.entry(run_id.to_string()).or_default().extend(ops);
    }

    /// A group of ops of its own, tied to no run's write.
    pub(super) fn alone(&mut self, ops: Vec<StoreOp>) {
        self.alone.push(ops);
    }

    /// Write the lazy changes with the next drain.
    pub(super) fn request_flush(&mut self) {
        self.flush = true;
    }

    /// The turn's groups, in commit order, with the runs as `runs` holds
    /// them now; and the ids of the runs written.
    pub(super) fn drain(&mut self, runs: &HashMap<String, RunRecord>) -> (Vec<Vec<StoreOp>>, Vec<String>) {
        let mut d = Drain { runs, with_run: std::mem::take(&mut self.with_run), linked: HashMap::new(), written: Vec::new() };
        let mut by_task: BTreeMap<String, Vec<StoreOp>> = BTreeMap::new();
        let mut own_created = Vec::new();
        let created = std::mem::take(&mut self.created);
        // Followers first: their upstream may be among the creations.
        for (run_id, home) in &created {
            self.urgent.remove(run_id);
            self.lazy.remove(run_id);
            if let Home::With(other) = home {
                d.linked.entry(other.clone()).or_default().push(run_id.clone());
            }
        }
        for (run_id, home) in created {
            let Some(run) = runs.get(&run_id) else { continue };
            match home {
                Home::Task => d.put(by_task.entry(run.task_id.clone()).or_default(), &run_id, true),
                Home::Own => own_created.push(run_id),
                Home::With(_) => {}
            }
        }
        self.created_set.clear();
        for run_id in std::mem::take(&mut self.in_task_group) {
            let Some(run) = runs.get(&run_id) else { continue };
            if self.urgent.remove(&run_id) || self.lazy.remove(&run_id) {
                d.put(by_task.entry(run.task_id.clone()).or_default(), &run_id, false);
            }
        }
        for (task_id, cursor) in std::mem::take(&mut self.cursors) {
            let op = match cursor {
                Some(cursor) => StoreOp::PutCursor { task_id: task_id.clone(), cursor },
                None => StoreOp::DeleteCursor { task_id: task_id.clone() },
            };
            by_task.entry(task_id).or_default().push(op);
        }
        let mut groups: Vec<Vec<StoreOp>> = by_task.into_values().collect();
        groups.append(&mut self.alone);
        for run_id in own_created {
            let mut group = Vec::new();
            d.put(&mut group, &run_id, true);
            groups.push(group);
        }
        let urgent = std::mem::take(&mut self.urgent);
        for id in &urgent {
            self.lazy.remove(id);
        }
        d.own(urgent, &mut groups);
        if !groups.is_empty() || self.flush {
            d.own(std::mem::take(&mut self.lazy), &mut groups);
            self.flush = false;
        }
        // A run created to follow one not written this turn (none is
        // expected: a run is written in the turn it ends) goes on its own
        // rather than be lost.
        for run_id in d.linked.drain().flat_map(|(_, ids)| ids).collect::<Vec<_>>() {
            tracing::warn!(run_id, "a following run written without its upstream's end");
            let mut group = Vec::new();
            d.put(&mut group, &run_id, true);
            groups.push(group);
        }
        // Ops of runs not written this turn (none are expected: a run is
        // written in the turn it ends) go on their own rather than be lost.
        for (run_id, ops) in d.with_run {
            tracing::warn!(run_id, "ops written without their run's change");
            groups.push(ops);
        }
        (groups, d.written)
    }
}

/// One drain's state: each run written once, with its ops and the runs
/// created to follow it.
struct Drain<'a> {
    runs: &'a HashMap<String, RunRecord>,
    with_run: HashMap<String, Vec<StoreOp>>,
    /// Runs created to follow a run (written in that run's group).
    linked: HashMap<String, Vec<String>>,
    written: Vec<String>,
}

impl Drain<'_> {
    /// Writes `run_id` as it is now (created or put) into `group`, then
    /// its ops, then the runs that follow it.
    fn put(&mut self, group: &mut Vec<StoreOp>, run_id: &str, create: bool) {
        let Some(run) = self.runs.get(run_id) else { return };
        group.push(if create { StoreOp::CreateRun(Box::new(run.clone())) } else { StoreOp::PutRun(Box::new(run.clone())) });
        group.extend(self.with_run.remove(run_id).unwrap_or_default());
        self.written.push(run_id.to_string());
        for follower in self.linked.remove(run_id).unwrap_or_default() {
            self.put(group, &follower, true);
        }
    }

    /// Each of `ids` in a group of its own.
    fn own(&mut self, ids: BTreeSet<String>, groups: &mut Vec<Vec<StoreOp>>) {
        for run_id in ids {
            if self.runs.contains_key(&run_id) {
                let mut group = Vec::new();
                self.put(&mut group, &run_id, false);
                groups.push(group);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::run::TriggerKind;

    fn runs(ids: &[(&str, &str)]) -> HashMap<String, RunRecord> {
        let t = "2026-12-01T10:00:00Z".parse().expect("t");
        ids.iter().map(|(task, id)| (id.to_string(), RunRecord::pending(id.to_string(), task, "a", TriggerKind::Manual, t, t))).collect()
    }

    fn shape(groups: &[Vec<StoreOp>]) -> Vec<Vec<String>> {
        groups
            .iter()
            .map(|g| {
                g.iter()
                    .map(|op| match op {
                        StoreOp::CreateRun(r) => format!("create {}", r.run_id),
                        StoreOp::PutRun(r) => format!("put {}", r.run_id),
                        StoreOp::PutCursor { task_id, .. } => format!("cursor {task_id}"),
                        StoreOp::DeleteCursor { task_id } => format!("delete cursor {task_id}"),
                        other => format!("{other:?}").chars().take(20).collect(),
                    })
                    .collect()
            })
            .collect()
    }

    /// Creations and the cursor share the task's group; a run whose end
    /// moved the breaker joins it; other runs go alone, lazy ones only with
    /// something urgent or a flush.
    #[test]
    fn each_change_lands_in_the_group_it_named() {
        let runs = runs(&[("t", "t.1"), ("t", "t.2"), ("t", "t.3"), ("u", "u.1"), ("u", "u.2")]);
        let mut w = WriteSet::default();
        w.changed("u.2", Urgency::Lazy);
        let (groups, _) = w.drain(&runs);
        assert!(groups.is_empty(), "a lazy change alone waits");
        w.created("t.1", Home::Task);
        w.changed("t.1", Urgency::Now);
        w.cursor("t", Some(Cursor::default()));
        w.changed("t.2", Urgency::Now);
        w.join_task("t.2");
        w.changed("t.3", Urgency::Now);
        let (groups, written) = w.drain(&runs);
        assert_eq!(shape(&groups), vec![vec!["create t.1", "put t.2", "cursor t"], vec!["put t.3"], vec!["put u.2"]]);
        assert_eq!(written, vec!["t.1", "t.2", "t.3", "u.2"]);
        w.changed("u.1", Urgency::Lazy);
        w.request_flush();
        assert_eq!(shape(&w.drain(&runs).0), vec![vec!["put u.1"]]);
    }

    /// An event's run goes alone; a run that follows another's end (and
    /// changed again in the same turn) is created once, in that run's
    /// group, after it.
    #[test]
    fn created_runs_go_where_their_home_says() {
        let runs = runs(&[("t", "t.1"), ("e", "e.1"), ("b", "b.1")]);
        let mut w = WriteSet::default();
        w.created("e.1", Home::Own);
        w.with_run("e.1", [StoreOp::DeleteCursor { task_id: "marker".into() }]);
        w.changed("t.1", Urgency::Now);
        w.created("b.1", Home::With("t.1".into()));
        w.changed("b.1", Urgency::Now);
        let (groups, written) = w.drain(&runs);
        assert_eq!(shape(&groups), vec![vec!["create e.1", "delete cursor marker"], vec!["put t.1", "create b.1"]]);
        assert_eq!(written, vec!["e.1", "t.1", "b.1"]);
    }
}
