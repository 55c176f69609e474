//! Circuit breakers (`execution.circuit_breaker`) as a policy: a new run
//! of a task whose breaker is open is SKIPPED `circuit_open`; the first
//! after the cooldown is the half-open trial; a finished run counts toward
//! (or decides) the breaker. The state machine is
//! [`crate::model::breaker`]; the state lives in the task's cursor, so it
//! is written in the same transaction as what changed it (the run that
//! opened or closed it, or the slot record it skipped) and a new leader
//! reads it back. Rate-limited and quota-exhausted attempts are not
//! failures: only a run that ends FAILED or TIMEOUT counts.

use super::{Admit, AdmitQuery, FinishQuery, Policy, Write};
use crate::model::RunStatus;
use crate::model::breaker::{Admission, Change};
use crate::model::run::{Outcome, SkipReason};

/// See the module docs. Stateless: the breaker is in the cursor.
#[derive(Debug, Default)]
pub struct BreakerPolicy;

fn admission(q: &AdmitQuery<'_>) -> Admission {
    if q.task.execution.circuit_breaker.is_none() {
        return Admission::Allow;
    }
    q.breaker.map_or(Admission::Allow, |b| b.admission(q.now))
}

impl Policy for BreakerPolicy {
    fn name(&self) -> &'static str {
        "breaker"
    }

    fn admit(&mut self, q: &AdmitQuery<'_>) -> Admit {
        match admission(q) {
            Admission::Allow | Admission::Trial => Admit::Pass,
            Admission::Skip(why) => Admit::Skip { reason: SkipReason::CircuitOpen, why },
        }
    }

    fn created(&mut self, q: &AdmitQuery<'_>) -> Vec<Write> {
        if admission(q) != Admission::Trial {
            return Vec::new();
        }
        let mut b = q.breaker.cloned().unwrap_or_default();
        b.trial_started(&q.run.run_id);
        tracing::info!(task_id = %q.task.task_id, run_id = %q.run.run_id, "circuit breaker half-open: trial run created");
        vec![Write::Breaker { task_id: q.task.task_id.clone(), breaker: b, opened: false }]
    }

    fn finished(&mut self, q: &FinishQuery<'_>) -> Vec<Write> {
        let Some(spec) = q.task.and_then(|t| t.execution.circuit_breaker) else { return Vec::new() };
        let (task_id, run_id) = (q.run.task_id.as_str(), q.run.run_id.as_str());
        let mut b = q.breaker.cloned().unwrap_or_default();
        // Back-pressure is not failure: a run that ended rate limited or out
        // of quota counts as a cancelled one (a trial's ending lets the next
        // run be the trial).
        let pressure =
            q.run.attempts.last().and_then(|a| a.outcome).is_some_and(|o| matches!(o, Outcome::RateLimited | Outcome::QuotaExhausted));
        let status = if pressure { RunStatus::Cancelled } else { q.run.status };
        let change = b.run_finished(&spec, run_id, status, q.now);
        match change {
            Change::None => return Vec::new(),
            Change::Opened => tracing::warn!(
                task_id,
                run_id,
                failures = b.consecutive_failures,
                cooldown_seconds = spec.cooldown_seconds,
                opening = b.openings,
                "circuit breaker opened: runs are skipped until the cooldown ends"
            ),
            Change::Closed => tracing::info!(task_id, run_id, "circuit breaker closed: the trial run succeeded"),
            Change::TrialCancelled => tracing::info!(task_id, run_id, "circuit breaker trial cancelled; the next run is the trial"),
            Change::Counted => {}
        }
        vec![Write::Breaker { task_id: task_id.to_string(), breaker: b, opened: change == Change::Opened }]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::breaker::Breaker;
    use crate::model::run::TriggerKind;
    use crate::model::{Attempt, RunRecord, TaskSpec};

    fn task() -> TaskSpec {
        let j = serde_json::json!({"task_id": "t", "agent_id": "a", "execution": {"circuit_breaker": {"failure_threshold": 2, "cooldown_seconds": 10}}});
        TaskSpec::from_json(&j.to_string()).expect("task")
    }

    /// Two failures open it; a run is skipped until the cooldown ends; the
    /// next is the trial; its success closes it.
    #[test]
    fn opens_skips_trials_and_closes() {
        let spec = task();
        let t0: chrono::DateTime<chrono::Utc> = "2026-12-01T10:00:00Z".parse().expect("t");
        let mut p = BreakerPolicy;
        let mut breaker: Option<Breaker> = None;
        for i in 0..2 {
            let mut run = RunRecord::pending(format!("t.{i}"), "t", "a", TriggerKind::Manual, t0, t0);
            run.status = RunStatus::Failed;
            let w = p.finished(&FinishQuery { now: t0, run: &run, task: Some(&spec), breaker: breaker.as_ref() });
            let Some(Write::Breaker { breaker: b, opened, .. }) = w.into_iter().next() else { panic!("a breaker write") };
            assert_eq!(opened, i == 1);
            breaker = Some(b);
        }
        let new = RunRecord::pending("t.new".into(), "t", "a", TriggerKind::Manual, t0, t0);
        let q = |now| AdmitQuery { now, run: &new, task: &spec, paused: false, active: 0, active_runs: &[], breaker: breaker.as_ref() };
        assert!(matches!(p.admit(&q(t0 + chrono::Duration::seconds(5))), Admit::Skip { reason: SkipReason::CircuitOpen, .. }));
        let after = t0 + chrono::Duration::seconds(11);
        assert_eq!(p.admit(&q(after)), Admit::Pass, "the trial");
        let Some(Write::Breaker { breaker: b, .. }) = p.created(&q(after)).into_iter().next() else { panic!("trial write") };
        assert_eq!(b.trial_run_id.as_deref(), Some("t.new"));
        let mut done = new.clone();
        done.status = RunStatus::Succeeded;
        let Some(Write::Breaker { breaker: b, .. }) =
            p.finished(&FinishQuery { now: after, run: &done, task: Some(&spec), breaker: Some(&b) }).into_iter().next()
        else {
            panic!("close write")
        };
        assert_eq!(b.phase, crate::model::breaker::BreakerPhase::Closed);
    }

    /// Runs that ended FAILED because a provider pushed back (rate limited
    /// past the max wait, quota exhausted) never open the breaker.
    #[test]
    fn back_pressure_is_not_failure() {
        let spec = task();
        let t0: chrono::DateTime<chrono::Utc> = "2026-12-01T10:00:00Z".parse().expect("t");
        let mut p = BreakerPolicy;
        for (i, o) in [Outcome::QuotaExhausted, Outcome::RateLimited, Outcome::QuotaExhausted].into_iter().enumerate() {
            let mut run = RunRecord::pending(format!("t.{i}"), "t", "a", TriggerKind::Manual, t0, t0);
            run.status = RunStatus::Failed;
            run.attempts.push(Attempt { outcome: Some(o), ..Default::default() });
            let w = p.finished(&FinishQuery { now: t0, run: &run, task: Some(&spec), breaker: None });
            assert!(w.is_empty(), "{o:?} counted: {w:?}");
        }
    }
}
