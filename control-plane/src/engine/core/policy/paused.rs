//! A paused task (`punchclock task pause`): what each run source's request
//! gets while it is paused (issue 37: one rule, asked at admission, where
//! each intake used to check `paused` itself).
//!
//! | source | while paused |
//! |---|---|
//! | time slots (cron, interval, once) | not generated; on resume one SKIPPED `paused` record covers them (the generator's part) — a slot that still asks is SKIPPED `paused` |
//! | events (webhook, queue, published), followers (`after`) | SKIPPED `paused`: every event leaves its record |
//! | manual triggers and re-runs | run: an explicit ask (as Temporal's trigger-immediately and `kubectl create job --from=cronjob` on a suspended schedule) |
//! | backfills | held: the backfill creates nothing and its cursor stays until the task resumes ([`while_paused`]) |
//!
//! Runs created before the pause go on (Kubernetes' `suspend` leaves
//! started jobs alone); cancel them to stop them.

use super::{Admit, AdmitQuery, Policy};
use crate::model::RunRecord;
use crate::model::run::{SkipReason, TriggerKind};

/// What a request of one source gets while its task is paused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WhilePaused {
    /// It runs (an explicit ask).
    Run,
    /// It is recorded SKIPPED `paused`.
    Skip,
    /// It is not made yet: its source holds it until the task resumes.
    Hold,
}

/// The rule of the module docs for a run of trigger `kind`.
pub fn while_paused(kind: TriggerKind) -> WhilePaused {
    match kind {
        TriggerKind::Manual => WhilePaused::Run,
        TriggerKind::Backfill => WhilePaused::Hold,
        _ => WhilePaused::Skip,
    }
}

/// Why `run` was not made while its task is paused (its record's error).
fn why(run: &RunRecord) -> String {
    if let Some(up) = &run.upstream {
        return format!("upstream run {} ({}) ended while the task is paused", up.run_id, up.status.as_str());
    }
    if let Some(ev) = &run.event {
        return format!("{} {} while the task is paused", run.trigger.as_str(), ev.name);
    }
    format!("{} slot while the task is paused", run.trigger.as_str())
}

/// See the module docs. Stateless: the query says whether the task is paused.
#[derive(Debug, Default)]
pub struct Paused;

impl Policy for Paused {
    fn name(&self) -> &'static str {
        "paused"
    }

    fn admit(&mut self, q: &AdmitQuery<'_>) -> Admit {
        if !q.paused {
            return Admit::Pass;
        }
        match while_paused(q.run.trigger) {
            WhilePaused::Run => Admit::Pass,
            // A held source does not ask while its task is paused (the
            // backfill source checks before each slot and again when the
            // slot's read returns); the answer for one that would.
            WhilePaused::Hold => Admit::Waiting("the task is paused".into()),
            WhilePaused::Skip => Admit::Skip { reason: SkipReason::Paused, why: why(q.run) },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::event::Upstream;
    use crate::model::task::TaskSpec;

    fn ask(run: &RunRecord, paused: bool) -> Admit {
        let j = serde_json::json!({"task_id": "t", "agent_id": "a"});
        let task = TaskSpec::from_json(&j.to_string()).expect("task");
        Paused.admit(&AdmitQuery { now: run.scheduled_at, run, task: &task, paused, active: 0, active_runs: &[], breaker: None })
    }

    #[test]
    fn each_source_gets_its_rule() {
        let now = chrono::Utc::now();
        let slot = RunRecord::pending("t.1".into(), "t", "a", TriggerKind::Cron, now, now);
        assert_eq!(ask(&slot, false), Admit::Pass);
        assert!(matches!(ask(&slot, true), Admit::Skip { reason: SkipReason::Paused, .. }));
        let manual = RunRecord::pending("t.m".into(), "t", "a", TriggerKind::Manual, now, now);
        assert_eq!(ask(&manual, true), Admit::Pass);
        let backfill = RunRecord::pending("t.b".into(), "t", "a", TriggerKind::Backfill, now, now);
        assert!(matches!(ask(&backfill, true), Admit::Waiting(_)));
        let mut after = RunRecord::pending("t.after".into(), "t", "a", TriggerKind::After, now, now);
        after.upstream =
            Some(Upstream { task: "u".into(), run_id: "u.1".into(), status: crate::model::RunStatus::Succeeded, result: None, chain: 1 });
        match ask(&after, true) {
            Admit::Skip { why, .. } => assert_eq!(why, "upstream run u.1 (SUCCEEDED) ended while the task is paused"),
            other => panic!("{other:?}"),
        }
    }
}
