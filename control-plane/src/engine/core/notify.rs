//! Notifications decided by the core: when a run ends, a slot is skipped
//! or a breaker opens, the task's `notify` sinks for that event get one
//! outbox record each, committed in the same group as the run record that
//! they report (see `poll_effects`). Delivery is the notifier's job
//! ([`crate::notify`]), outside the core.

use crate::clock::Now;

use super::EngineCore;
use crate::model::breaker::Breaker;
use crate::model::notification::{NotifyEvent, for_sinks, notification_base};
use crate::repo::StoreOp;

impl EngineCore {
    /// Queues the notifications of `event` for run `run_id` of its task
    /// (none when the task has no sinks for it). `breaker`: for
    /// `on_breaker_open`, the breaker as it opened (the run that opened it
    /// makes each opening's id distinct).
    pub(super) fn notify(&mut self, now: Now, run_id: &str, event: NotifyEvent, breaker: Option<&Breaker>) {
        let Some(run) = self.runs.get(run_id) else { return };
        let Some(spec) = self.tasks.get(&run.task_id).and_then(|e| e.record.spec.notify.as_ref()) else { return };
        let sinks = spec.sinks(event);
        if sinks.is_empty() {
            return;
        }
        let ops = for_sinks(sinks, event, &notification_base(run), now.wall, run, breaker)
            .into_iter()
            .map(|n| StoreOp::PutNotification(Box::new(n)));
        self.writes.with_run(run_id, ops);
    }
}
