//! Where the policies' state goes: a circuit breaker lives in its task's
//! cursor, so it is written in the same transaction as what changed it
//! (the finished run that opened or closed it, or the slot record it
//! skipped), and a new leader reads it back with the cursor. What the
//! breaker decides is `policy/breaker.rs`; the state machine is
//! [`crate::model::breaker`]. Here: applying a policy's writes, recovering
//! a lost trial at load, the reset by hand.

use crate::clock::Now;

use super::policy::Write;
use super::{EngineCore, Reply, ReplyId};
use crate::engine::lifecycle::Lifecycle;
use crate::error::{Error, Result};
use crate::model::Cursor;
use crate::model::breaker::Breaker;
use crate::model::notification::NotifyEvent;

impl EngineCore {
    /// Applies what the policies want written for `run_id`: a breaker
    /// goes in its task's cursor, and the run's write joins the cursor's
    /// group (with the `on_breaker_open` notification when it opened);
    /// store ops go in the run's group; a following task's run is created
    /// in it too; a pause goes to the shell.
    pub(super) fn apply_writes(&mut self, now: Now, run_id: &str, writes: Vec<Write>) {
        for w in writes {
            match w {
                Write::Breaker { task_id, breaker, opened } => {
                    self.writes.join_task(run_id);
                    if opened {
                        self.notify(now, run_id, NotifyEvent::OnBreakerOpen, Some(&breaker));
                    }
                    self.store_breaker(now, &task_id, breaker, opened);
                }
                Write::Op(op) => self.writes.with_run(run_id, [op]),
                Write::PauseTask { task_id, why } => self.fx.pauses.push((task_id, why)),
                Write::Follow { task_id, upstream, unmet } => self.follow(now, &task_id, upstream, unmet),
                // Taken onto the run at its creation (`admit`) or dispatch (`assign`).
                Write::Charges(_) | Write::Holds(_) => {}
            }
        }
    }

    /// At load: a half-open breaker whose trial is not among the runs
    /// recovered (it finished without the breaker hearing, or was pruned)
    /// lets the next run be the trial.
    pub(super) fn recover_breakers(&mut self, now: Now) {
        let lost: Vec<(String, Breaker)> = self
            .tasks
            .iter()
            .filter_map(|(id, e)| {
                let b = e.cursor.as_ref()?.breaker.as_ref()?;
                let trial = b.trial_run_id.as_deref()?;
                self.runs.get(trial).is_none_or(|r| r.status.is_terminal()).then(|| (id.clone(), b.clone()))
            })
            .collect();
        for (task_id, mut b) in lost {
            tracing::warn!(task_id, trial = ?b.trial_run_id, "circuit breaker's trial run is not active; the next run is the trial");
            b.trial_lost();
            self.store_breaker(now, &task_id, b, false);
        }
    }

    /// `ResetBreaker`: closes the task's breaker by hand.
    pub(super) fn reset_breaker(&mut self, now: Now, reply: ReplyId, task_id: &str) {
        let r = self.reset_breaker_checked(now, task_id);
        self.fx.replies.push((reply, Reply::ResetBreaker(r)));
    }

    fn reset_breaker_checked(&mut self, now: Now, task_id: &str) -> Result<Breaker> {
        let e = self.tasks.get(task_id).filter(|e| !e.deleted).ok_or_else(|| Error::NotFound { kind: "task", id: task_id.to_string() })?;
        if e.record.spec.execution.circuit_breaker.is_none() {
            return Err(Error::FailedPrecondition(format!("task {task_id} has no execution.circuit_breaker")));
        }
        let mut b = self.breaker_of(task_id).unwrap_or_default();
        let was = b.phase;
        b.close();
        tracing::info!(task_id, was = was.as_str(), "circuit breaker reset by hand");
        self.store_breaker(now, task_id, b.clone(), false);
        Ok(b)
    }

    /// A definition without `circuit_breaker` forgets any breaker state.
    pub(super) fn drop_breaker_if_off(&mut self, now: Now, task_id: &str) {
        let Some(e) = self.tasks.get_mut(task_id) else { return };
        if e.record.spec.execution.circuit_breaker.is_some() {
            return;
        }
        let Some(cursor) = e.cursor.as_mut().filter(|c| c.breaker.is_some()) else { return };
        cursor.breaker = None;
        cursor.updated_at = Some(now.wall);
        let c = cursor.clone();
        self.writes.cursor(task_id, Some(c));
    }

    fn breaker_of(&self, task_id: &str) -> Option<Breaker> {
        self.tasks.get(task_id)?.cursor.as_ref()?.breaker.clone()
    }

    /// Puts the breaker in the task's cursor (queued for this turn's
    /// write) and announces it.
    fn store_breaker(&mut self, now: Now, task_id: &str, b: Breaker, opened: bool) {
        let Some(e) = self.tasks.get_mut(task_id) else { return };
        let cursor = e.cursor.get_or_insert_with(Cursor::default);
        cursor.breaker = Some(b.clone());
        cursor.updated_at = Some(now.wall);
        let c = cursor.clone();
        self.writes.cursor(task_id, Some(c));
        self.fx.events.push(Lifecycle::BreakerChanged { task_id: task_id.to_string(), breaker: b, opened });
    }
}
