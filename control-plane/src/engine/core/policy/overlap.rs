//! The task's `concurrency_limit` and `overlap_policy`: when a run asks to
//! be created while `concurrency_limit` runs of its task are active,
//! `skip` makes it a SKIPPED `concurrency_limit` record, `queue` lets it
//! wait, `cancel_running` cancels the oldest ones for it; a ready run is
//! dispatched only while its task has fewer live agents than the limit
//! (agents, not records: a cancelled run holds its slot until its agent is
//! gone).

use super::{Admit, AdmitQuery, Dispatch, DispatchQuery, Policy};
use crate::model::run::SkipReason;
use crate::model::task::OverlapPolicy;

/// See the module docs. Stateless: the core derives who is active.
#[derive(Debug, Default)]
pub struct Overlap;

impl Policy for Overlap {
    fn name(&self) -> &'static str {
        "overlap"
    }

    fn admit(&mut self, q: &AdmitQuery<'_>) -> Admit {
        let ex = &q.task.execution;
        let limit = ex.concurrency_limit as usize;
        if q.active < limit {
            return Admit::Pass;
        }
        // A backfill's runs and re-runs are never dropped for overlap: they
        // queue (Temporal's backfilled actions are not either; a re-run
        // skipped at once could not be re-run in bulk again).
        if q.run.trigger == crate::model::run::TriggerKind::Backfill {
            return Admit::Waiting(format!("backfill run queued behind {} active run(s) (concurrency_limit {limit})", q.active));
        }
        if q.run.rerun_of.is_some() {
            return Admit::Waiting(format!("re-run queued behind {} active run(s) (concurrency_limit {limit})", q.active));
        }
        match ex.overlap_policy {
            OverlapPolicy::Skip => Admit::Skip {
                reason: SkipReason::ConcurrencyLimit,
                why: format!("{} run(s) of the task still active (concurrency_limit {limit}, overlap_policy skip)", q.active),
            },
            OverlapPolicy::Queue => Admit::Waiting(format!("queued behind {} active run(s) (concurrency_limit {limit})", q.active)),
            OverlapPolicy::CancelRunning => {
                // The oldest until the new run fits; runs already cancelled
                // (agent not yet gone) cannot be cancelled again, and the new
                // run waits for them.
                let mut active = q.active_runs.to_vec();
                active.sort_by(|a, b| (a.scheduled_at, &a.run_id).cmp(&(b.scheduled_at, &b.run_id)));
                let excess = active.len() + 1 - limit;
                let cancel = active.into_iter().take(excess).filter(|a| !a.terminal).map(|a| a.run_id).collect();
                Admit::AfterCancelling {
                    cancel,
                    reason: format!("cancelled for {} (overlap_policy cancel_running)", q.run.run_id),
                    waiting: "waiting for the cancelled run's agent to exit (overlap_policy cancel_running)".into(),
                }
            }
        }
    }

    fn dispatch(&mut self, q: &DispatchQuery<'_>) -> Dispatch {
        let limit = q.task.execution.concurrency_limit as usize;
        if q.live_agents >= limit {
            return Dispatch::Wait {
                reason: format!("queued behind {} running run(s) (concurrency_limit {limit})", q.live_agents),
                until: None,
            };
        }
        Dispatch::Pass
    }
}

#[cfg(test)]
mod tests {
    use super::super::ActiveRun;
    use super::*;
    use crate::model::RunRecord;
    use crate::model::TaskSpec;
    use crate::model::run::TriggerKind;

    fn task(policy: &str, limit: u32) -> TaskSpec {
        let j = serde_json::json!({"task_id": "t", "agent_id": "a", "execution": {"overlap_policy": policy, "concurrency_limit": limit}});
        TaskSpec::from_json(&j.to_string()).expect("task")
    }

    fn active(n: usize) -> Vec<ActiveRun> {
        let t0: chrono::DateTime<chrono::Utc> = "2026-12-01T10:00:00Z".parse().expect("t");
        (0..n)
            .map(|i| ActiveRun { scheduled_at: t0 + chrono::Duration::seconds(i as i64), run_id: format!("t.{i}"), terminal: i == 0 })
            .collect()
    }

    fn admit(policy: &str, limit: u32, n: usize) -> Admit {
        let now = "2026-12-01T11:00:00Z".parse().expect("t");
        let run = RunRecord::pending("t.new".into(), "t", "a", TriggerKind::Manual, now, now);
        let spec = task(policy, limit);
        let active = active(n);
        Overlap.admit(&AdmitQuery { now, run: &run, task: &spec, paused: false, active: active.len(), active_runs: &active, breaker: None })
    }

    #[test]
    fn each_overlap_policy_at_the_limit() {
        assert_eq!(admit("skip", 2, 1), Admit::Pass, "under the limit");
        assert!(matches!(admit("skip", 2, 2), Admit::Skip { reason: SkipReason::ConcurrencyLimit, .. }));
        assert!(matches!(admit("queue", 2, 2), Admit::Waiting(r) if r.contains("queued behind 2")));
        // Limit 2, three active: two must go; the oldest (t.0) is already
        // ended (its agent not yet gone) and cannot be cancelled again.
        match admit("cancel_running", 2, 3) {
            Admit::AfterCancelling { cancel, .. } => assert_eq!(cancel, vec!["t.1".to_string()]),
            other => panic!("{other:?}"),
        }
    }

    /// A helper's find: three re-runs made at once under `skip` left two
    /// SKIPPED, and a bulk re-run would never make them again. Re-runs and
    /// backfill runs queue instead.
    #[test]
    fn re_runs_and_backfill_runs_queue_under_skip() {
        let now = "2026-12-01T11:00:00Z".parse().expect("t");
        let spec = task("skip", 1);
        let active = active(1);
        let mut rerun = RunRecord::pending("t.0.rerun-1".into(), "t", "a", TriggerKind::Manual, now, now);
        rerun.rerun_of = Some("t.0".into());
        let backfill = RunRecord::pending("t.b".into(), "t", "a", TriggerKind::Backfill, now, now);
        for run in [&rerun, &backfill] {
            let q = AdmitQuery { now, run, task: &spec, paused: false, active: 1, active_runs: &active, breaker: None };
            assert!(matches!(Overlap.admit(&q), Admit::Waiting(_)), "{}", run.run_id);
        }
    }

    #[test]
    fn dispatch_waits_at_the_live_agent_limit() {
        let now = "2026-12-01T11:00:00Z".parse().expect("t");
        let run = RunRecord::pending("t.new".into(), "t", "a", TriggerKind::Manual, now, now);
        let spec = task("queue", 2);
        let q = |live| DispatchQuery { now, run: &run, task: &spec, live_agents: live };
        assert_eq!(Overlap.dispatch(&q(1)), Dispatch::Pass);
        assert!(matches!(Overlap.dispatch(&q(2)), Dispatch::Wait { .. }));
    }
}
