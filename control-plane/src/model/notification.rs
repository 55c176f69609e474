//! Notifications (`notify.on_success`, `on_failure`, `on_skipped`,
//! `on_breaker_open`): one record per (event, sink), written by the engine
//! in the same transaction as the run state it reports (the outbox,
//! `outbox/{id}`), delivered by the leader's notifier
//! ([`crate::notify`]), then kept as a small delivery record under
//! `notifications/{id}`.
//!
//! The id is deterministic, `{base}.{event}.{i}` (see
//! [`notification_base`]; for a breaker opening, the base of the run whose
//! end opened it): it is the idempotency key a receiver sees, the same on
//! every retry and after a leader failover, and never the same for two
//! different runs or openings.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::RunRecord;
use super::breaker::Breaker;
use super::run::RunStatus;

/// What a notification reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NotifyEvent {
    /// A run SUCCEEDED.
    OnSuccess,
    /// A run ended FAILED or TIMEOUT.
    OnFailure,
    /// A slot (or a coalesced range) was SKIPPED.
    OnSkipped,
    /// The task's circuit breaker opened (once per opening).
    OnBreakerOpen,
    /// A budget's spend crossed its soft limit (once per window; the
    /// budget's own `notify` sinks).
    OnBudget,
}

impl NotifyEvent {
    /// As in the task's `notify` and the `Punchclock-Event` header.
    pub fn as_str(self) -> &'static str {
        match self {
            NotifyEvent::OnSuccess => "on_success",
            NotifyEvent::OnFailure => "on_failure",
            NotifyEvent::OnSkipped => "on_skipped",
            NotifyEvent::OnBreakerOpen => "on_breaker_open",
            NotifyEvent::OnBudget => "on_budget",
        }
    }

    /// The event a run's final status reports, if any.
    pub fn for_status(status: RunStatus) -> Option<NotifyEvent> {
        match status {
            RunStatus::Succeeded => Some(NotifyEvent::OnSuccess),
            RunStatus::Failed | RunStatus::Timeout => Some(NotifyEvent::OnFailure),
            RunStatus::Skipped => Some(NotifyEvent::OnSkipped),
            _ => None,
        }
    }
}

/// Where a notification stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeliveryStatus {
    /// Waiting for its (next) delivery attempt.
    #[default]
    Pending,
    /// A 2xx answer was received.
    Delivered,
    /// Every attempt failed (`max_attempts`); kept until retried by hand.
    Dead,
}

impl DeliveryStatus {
    /// Lower-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            DeliveryStatus::Pending => "pending",
            DeliveryStatus::Delivered => "delivered",
            DeliveryStatus::Dead => "dead",
        }
    }
}

/// One notification: what to send, where, and how delivery went.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Notification {
    /// Deterministic id (see the module docs): the idempotency key.
    pub id: String,
    /// What it reports.
    pub event: NotifyEvent,
    /// The sink as the task names it (`https://…` or `webhook://NAME`).
    pub sink: String,
    /// Task.
    pub task_id: String,
    /// The run it reports (the run that opened the breaker, for `on_breaker_open`).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub run_id: String,
    /// The JSON body, fixed when the notification was created (see
    /// [`payload`]); left out of delivery records.
    #[serde(default, skip_serializing_if = "serde_json::Value::is_null")]
    pub payload: serde_json::Value,
    /// Status.
    #[serde(default)]
    pub status: DeliveryStatus,
    /// Delivery attempts made.
    #[serde(default)]
    pub attempts: u32,
    /// Earliest next attempt (UTC).
    pub next_attempt_at: DateTime<Utc>,
    /// The last attempt's error (connection error, timeout, or the HTTP status and body start).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// Created (UTC): the run's final write.
    pub created_at: DateTime<Utc>,
    /// Delivered (UTC).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delivered_at: Option<DateTime<Utc>>,
    /// Last change (UTC).
    pub updated_at: DateTime<Utc>,
}

/// Largest `result` (serialized) a notification carries; a larger one is
/// replaced by `{"trimmed": true, "bytes": N}`, so a notification stays
/// small next to the run it is written with.
pub const MAX_PAYLOAD_RESULT_BYTES: usize = 64 * 1024;

/// The body of a notification (schema in README "Notifications"):
/// `{id, event, created_at, task_id, run: {...}, breaker?: {...}}`. The run
/// is the stored record without output tails, params and checkpoint
/// (they may be large or hold secrets), its result trimmed over 64 KiB.
pub fn payload(id: &str, event: NotifyEvent, now: DateTime<Utc>, run: &RunRecord, breaker: Option<&Breaker>) -> serde_json::Value {
    let mut r = serde_json::to_value(run).unwrap_or(serde_json::Value::Null);
    if let Some(o) = r.as_object_mut() {
        for k in ["stdout_tail", "stderr_tail", "params", "progress", "priority", "fencing_token", "start_by", "pending_reason"] {
            o.remove(k);
        }
        // Internal to the runner protocol (not in `runs get` either).
        if let Some(attempts) = o.get_mut("attempts").and_then(|a| a.as_array_mut()) {
            for a in attempts.iter_mut().filter_map(|a| a.as_object_mut()) {
                a.remove("runner_instance");
            }
        }
        if let Some(res) = o.get("result")
            && let Ok(bytes) = serde_json::to_vec(res)
            && bytes.len() > MAX_PAYLOAD_RESULT_BYTES
        {
            o.insert("result".into(), serde_json::json!({"trimmed": true, "bytes": bytes.len()}));
        }
    }
    let mut body = serde_json::json!({
        "id": id,
        "event": event.as_str(),
        "created_at": now,
        "task_id": run.task_id,
        "run": r,
    });
    if let Some(b) = breaker {
        body["breaker"] = serde_json::to_value(b).unwrap_or_default();
    }
    body
}

/// The base of a run's notification ids: its run id; for a manual run also
/// its `scheduled_at` in Unix milliseconds (`{run_id}-{ms}`), because the
/// same idempotency key may make a new run once the old one was pruned.
/// Slot runs are unique per slot already.
pub fn notification_base(run: &RunRecord) -> String {
    if matches!(run.trigger, super::run::TriggerKind::Manual | super::run::TriggerKind::Event) {
        format!("{}-{}", run.run_id, run.scheduled_at.timestamp_millis())
    } else {
        run.run_id.clone()
    }
}

/// The notifications of one event of a task, one per sink in order.
pub fn for_sinks(
    sinks: &[String],
    event: NotifyEvent,
    id_base: &str,
    now: DateTime<Utc>,
    run: &RunRecord,
    breaker: Option<&Breaker>,
) -> Vec<Notification> {
    sinks
        .iter()
        .enumerate()
        .map(|(i, sink)| {
            let id = format!("{id_base}.{}.{i}", event.as_str());
            Notification {
                payload: payload(&id, event, now, run, breaker),
                id,
                event,
                sink: sink.clone(),
                task_id: run.task_id.clone(),
                run_id: run.run_id.clone(),
                status: DeliveryStatus::Pending,
                attempts: 0,
                next_attempt_at: now,
                last_error: None,
                created_at: now,
                delivered_at: None,
                updated_at: now,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::run::TriggerKind;

    /// Found by an attack: a breaker-open id counted openings from 1 again
    /// after the task was re-created, and a manual key used again after its
    /// run was pruned gave the same ids — a receiver deduplicating by id
    /// dropped real alerts. Ids now come from the run (and, for manual
    /// runs, its time).
    #[test]
    fn ids_differ_for_different_runs_with_the_same_run_id() {
        let t1: DateTime<Utc> = "2026-12-01T10:00:00.123Z".parse().unwrap();
        let t2: DateTime<Utc> = "2026-12-01T11:00:00.456Z".parse().unwrap();
        let a = RunRecord::pending("t.manual-k".into(), "t", "ag", TriggerKind::Manual, t1, t1);
        let b = RunRecord::pending("t.manual-k".into(), "t", "ag", TriggerKind::Manual, t2, t2);
        assert_ne!(notification_base(&a), notification_base(&b));
        assert_eq!(notification_base(&a), format!("t.manual-k-{}", t1.timestamp_millis()));
        let slot = RunRecord::pending("t.20261201T100000Z".into(), "t", "ag", TriggerKind::Cron, t1, t1);
        assert_eq!(notification_base(&slot), "t.20261201T100000Z");
        let n = for_sinks(&["webhook://x".into()], NotifyEvent::OnBreakerOpen, &notification_base(&slot), t1, &slot, None);
        assert_eq!(n[0].id, "t.20261201T100000Z.on_breaker_open.0");
    }
}
