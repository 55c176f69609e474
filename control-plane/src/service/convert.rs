//! Conversions between the core's model and `punchclock.v1` messages.

use punchclock_proto::time::{to_timestamp as ts, to_timestamp_opt as ots};
use punchclock_proto::v1 as pb;

use crate::api::TaskView;
use crate::model::run::{Outcome, SkipReason, TriggerKind};
use crate::model::{RunRecord, RunStatus};
use crate::views::RunnerView;

/// Core trigger kind → API enum.
pub fn trigger_to_pb(t: TriggerKind) -> pb::TriggerKind {
    match t {
        TriggerKind::Cron => pb::TriggerKind::Cron,
        TriggerKind::Interval => pb::TriggerKind::Interval,
        TriggerKind::Once => pb::TriggerKind::Once,
        TriggerKind::Manual => pb::TriggerKind::Manual,
        TriggerKind::Event => pb::TriggerKind::Event,
        TriggerKind::Webhook => pb::TriggerKind::Webhook,
        TriggerKind::Queue => pb::TriggerKind::Queue,
        TriggerKind::After => pb::TriggerKind::After,
        TriggerKind::Backfill => pb::TriggerKind::Backfill,
    }
}

/// API trigger kind → core (`Unspecified` reads as `Manual`: callers map
/// it to "any" first).
pub fn trigger_from_pb(t: pb::TriggerKind) -> TriggerKind {
    match t {
        pb::TriggerKind::Cron => TriggerKind::Cron,
        pb::TriggerKind::Interval => TriggerKind::Interval,
        pb::TriggerKind::Once => TriggerKind::Once,
        pb::TriggerKind::Unspecified | pb::TriggerKind::Manual => TriggerKind::Manual,
        pb::TriggerKind::Event => TriggerKind::Event,
        pb::TriggerKind::Webhook => TriggerKind::Webhook,
        pb::TriggerKind::Queue => TriggerKind::Queue,
        pb::TriggerKind::After => TriggerKind::After,
        pb::TriggerKind::Backfill => TriggerKind::Backfill,
    }
}

/// Core skip reason → API enum.
pub fn skip_to_pb(s: Option<SkipReason>) -> pb::SkipReason {
    match s {
        None => pb::SkipReason::Unspecified,
        Some(SkipReason::ConcurrencyLimit) => pb::SkipReason::ConcurrencyLimit,
        Some(SkipReason::Misfired) => pb::SkipReason::Misfired,
        Some(SkipReason::Paused) => pb::SkipReason::Paused,
        Some(SkipReason::CircuitOpen) => pb::SkipReason::CircuitOpen,
        Some(SkipReason::ResourceBusy) => pb::SkipReason::ResourceBusy,
        Some(SkipReason::BudgetExceeded) => pb::SkipReason::BudgetExceeded,
        Some(SkipReason::InvalidEvent) => pb::SkipReason::InvalidEvent,
        Some(SkipReason::UpstreamUnmet) => pb::SkipReason::UpstreamUnmet,
        Some(SkipReason::DstGap) => pb::SkipReason::DstGap,
    }
}

/// Core attempt outcome → API enum (`Unspecified` while open).
pub fn attempt_outcome_to_pb(o: Option<Outcome>) -> pb::AttemptOutcome {
    match o {
        None => pb::AttemptOutcome::Unspecified,
        Some(Outcome::Succeeded) => pb::AttemptOutcome::Succeeded,
        Some(Outcome::Failed) => pb::AttemptOutcome::Failed,
        Some(Outcome::Timeout) => pb::AttemptOutcome::Timeout,
        Some(Outcome::Cancelled) => pb::AttemptOutcome::Cancelled,
        Some(Outcome::Lost) => pb::AttemptOutcome::Lost,
        Some(Outcome::Interrupted) => pb::AttemptOutcome::Interrupted,
        Some(Outcome::RateLimited) => pb::AttemptOutcome::RateLimited,
        Some(Outcome::QuotaExhausted) => pb::AttemptOutcome::QuotaExhausted,
        Some(Outcome::NonRetryable) => pb::AttemptOutcome::NonRetryable,
    }
}

/// Core outcome → the runner-report enum (what a runner can report).
pub fn report_outcome_to_pb(o: Outcome) -> pb::Outcome {
    match o {
        Outcome::Succeeded => pb::Outcome::Succeeded,
        Outcome::Failed | Outcome::Lost | Outcome::RateLimited | Outcome::QuotaExhausted | Outcome::NonRetryable => pb::Outcome::Failed,
        Outcome::Timeout => pb::Outcome::Timeout,
        Outcome::Cancelled => pb::Outcome::Cancelled,
        Outcome::Interrupted => pb::Outcome::Interrupted,
    }
}

/// Core status → API enum.
pub fn status_to_pb(s: RunStatus) -> pb::RunStatus {
    match s {
        RunStatus::Pending => pb::RunStatus::Pending,
        RunStatus::Running => pb::RunStatus::Running,
        RunStatus::Succeeded => pb::RunStatus::Succeeded,
        RunStatus::Failed => pb::RunStatus::Failed,
        RunStatus::Retrying => pb::RunStatus::Retrying,
        RunStatus::Timeout => pb::RunStatus::Timeout,
        RunStatus::Cancelled => pb::RunStatus::Cancelled,
        RunStatus::Skipped => pb::RunStatus::Skipped,
    }
}

/// API enum → core status (`None` for unspecified).
pub fn status_from_pb(s: pb::RunStatus) -> Option<RunStatus> {
    Some(match s {
        pb::RunStatus::Unspecified => return None,
        pb::RunStatus::Pending => RunStatus::Pending,
        pb::RunStatus::Running => RunStatus::Running,
        pb::RunStatus::Succeeded => RunStatus::Succeeded,
        pb::RunStatus::Failed => RunStatus::Failed,
        pb::RunStatus::Retrying => RunStatus::Retrying,
        pb::RunStatus::Timeout => RunStatus::Timeout,
        pb::RunStatus::Cancelled => RunStatus::Cancelled,
        pb::RunStatus::Skipped => RunStatus::Skipped,
    })
}

fn json_or_empty(v: &Option<serde_json::Value>) -> String {
    v.as_ref().map(|v| v.to_string()).unwrap_or_default()
}

/// A run record as the API shows it.
pub fn run_to_pb(r: &RunRecord) -> pb::Run {
    pb::Run {
        run_id: r.run_id.clone(),
        task_id: r.task_id.clone(),
        agent_id: r.agent_id.clone(),
        trigger_kind: r.trigger.as_str().to_string(),
        status: status_to_pb(r.status) as i32,
        scheduled_at: Some(ts(r.scheduled_at)),
        dispatched_at: ots(r.dispatched_at),
        actual_started_at: ots(r.actual_started_at),
        finished_at: ots(r.finished_at),
        attempts: r
            .attempts
            .iter()
            .map(|a| pb::Attempt {
                attempt: a.attempt,
                execution_id: a.execution_id.clone(),
                runner_id: a.runner_id.clone(),
                dispatched_at: Some(ts(a.dispatched_at)),
                started_at: ots(a.started_at),
                finished_at: ots(a.finished_at),
                outcome: a.outcome.map(|o| o.as_str().to_string()).unwrap_or_default(),
                error: a.error.clone().unwrap_or_default(),
                exit_code: a.exit_code,
                outcome_code: attempt_outcome_to_pb(a.outcome) as i32,
                report: a.report.as_ref().map(|rep| pb::AttemptReport {
                    outcome: report_outcome_to_pb(rep.outcome) as i32,
                    error: rep.error.clone().unwrap_or_default(),
                    exit_code: rep.exit_code,
                    result_json: json_or_empty(&rep.result),
                    finished_at: Some(ts(rep.finished_at)),
                }),
                awaiting_runner: a.awaiting_runner,
                class: a.class.clone().unwrap_or_default(),
                resource: a.resource.clone().unwrap_or_default(),
                retry_at: ots(a.retry_at),
                holds: a.holds.iter().map(|h| pb::ResourceHold { name: h.name.clone(), units: h.units, tokens: h.tokens }).collect(),
                usage: a.usage.map(|u| pb::Usage {
                    input_tokens: u.input_tokens,
                    output_tokens: u.output_tokens,
                    cache_read_input_tokens: u.cache_read_input_tokens,
                    cost: u.cost,
                    cost_priced: u.cost_priced,
                }),
                model: a.model.clone().unwrap_or_default(),
                peak_memory_bytes: a.machine.and_then(|m| m.peak_memory_bytes),
                cpu_seconds: a.machine.and_then(|m| m.cpu_seconds),
            })
            .collect(),
        result_json: json_or_empty(&r.result),
        progress: r.progress.as_ref().map(|p| pb::Progress {
            percent: p.percent,
            message: p.message.clone(),
            checkpoint_json: json_or_empty(&p.checkpoint),
            updated_at: Some(ts(p.updated_at)),
        }),
        skip_reason: r.skip_reason.map(|s| s.as_str().to_string()).unwrap_or_default(),
        missed_count: r.missed_count.unwrap_or(0),
        missed_from: ots(r.missed_from),
        missed_until: ots(r.missed_until),
        pending_reason: r.pending_reason.clone().unwrap_or_default(),
        next_attempt_at: ots(r.next_attempt_at),
        fire_at: ots(r.fire_at),
        rerun_of: r.rerun_of.clone().unwrap_or_default(),
        backfill_id: r.backfill_id.clone().unwrap_or_default(),
        reruns: Vec::new(),
        context_json: serde_json::json!({ "params": r.params }).to_string(),
        stdout_tail: r.stdout_tail.clone(),
        stderr_tail: r.stderr_tail.clone(),
        fencing_token: r.fencing_token,
        error: r.error.clone().unwrap_or_default(),
        updated_at: Some(ts(r.updated_at)),
        trigger: trigger_to_pb(r.trigger) as i32,
        skip: skip_to_pb(r.skip_reason) as i32,
        start_by: ots(r.start_by),
        interruptions: r.interruptions,
        elided_attempts: r.elided_attempts.total,
        event_json: r.event.as_ref().map(|e| serde_json::to_string(e).unwrap_or_default()).unwrap_or_default(),
        upstream_json: r.upstream.as_ref().map(|u| serde_json::to_string(u).unwrap_or_default()).unwrap_or_default(),
        priority: r.priority,
        trace_id: r.trace_id.clone(),
        span_id: r.span_id.clone(),
    }
}

/// A task as the API shows it: its definition as applied, and, given the
/// server's retention defaults (`GetTask`, not `ListTasks`), its effective
/// definition.
pub fn task_to_pb(v: &TaskView, effective: Option<&crate::engine::retention::RetentionConfig>) -> pb::Task {
    use super::definition::{applied_definition, effective_definition, typed_json};
    let effective = effective.map(|defaults| effective_definition(&v.record.spec, defaults));
    pb::Task {
        task_id: v.record.spec.task_id.clone(),
        agent_id: v.record.spec.agent_id.clone(),
        spec_json: v.record.applied_doc().to_string(),
        definition: Some(applied_definition(&v.record.spec, &v.record.written_fields())),
        effective_json: effective.as_ref().map(|e| typed_json(e).to_string()).unwrap_or_default(),
        effective,
        recent_slots: Vec::new(),
        paused: v.record.paused,
        paused_reason: v.record.paused_reason.clone(),
        created_at: Some(ts(v.record.created_at)),
        updated_at: Some(ts(v.record.updated_at)),
        next_fire_at: ots(v.next_fire_at),
        ended: v.ended.clone().unwrap_or_default(),
        last_slot_at: ots(v.cursor.as_ref().and_then(|c| c.last_slot)),
        breaker: v.record.spec.execution.circuit_breaker.map(|_| {
            let b = v.cursor.as_ref().and_then(|c| c.breaker.clone()).unwrap_or_default();
            pb::Breaker {
                phase: b.phase.as_str().to_string(),
                consecutive_failures: b.consecutive_failures,
                opened_at: ots(b.opened_at),
                open_until: ots(b.open_until),
                trial_run_id: b.trial_run_id.unwrap_or_default(),
                openings: b.openings,
            }
        }),
    }
}

/// A task with its recent slots as `ListTasks` shows it (no effective
/// definition: pages stay small).
pub fn task_summary_to_pb(v: &crate::views::TaskSummary) -> pb::Task {
    let mut t = task_to_pb(&v.task, None);
    t.recent_slots = v.slots.iter().map(slot_to_pb).collect();
    t
}

/// A slot cell as the API shows it.
pub fn slot_to_pb(c: &crate::views::SlotCell) -> pb::SlotCell {
    let s = &c.summary;
    pb::SlotCell {
        run_id: s.run_id.clone(),
        scheduled_at: Some(ts(s.scheduled_at)),
        status: status_to_pb(s.status) as i32,
        reason: s.reason.clone(),
        slots: s.slots,
        label: c.label(),
        start_lag_ms: s.start_lag_ms,
    }
}

/// A budget's current window as the API shows it.
pub fn budget_to_pb(b: crate::views::BudgetView) -> pb::Budget {
    let amount = |a: crate::model::budget::Amount| pb::BudgetAmount {
        cost: Some(a.cost),
        input_tokens: Some(a.input_tokens),
        output_tokens: Some(a.output_tokens),
        runs: Some(a.runs),
    };
    pb::Budget {
        name: b.name,
        scope: b.scope,
        window: b.window.into(),
        window_start: Some(ts(b.window_start)),
        window_end: Some(ts(b.window_end)),
        used: Some(amount(b.used)),
        reserved: Some(amount(b.reserved)),
        limits: Some(pb::BudgetAmount {
            cost: b.limits.cost,
            input_tokens: b.limits.input_tokens,
            output_tokens: b.limits.output_tokens,
            runs: b.limits.runs,
        }),
        soft_percent: b.soft_percent,
        on_exceeded: b.on_exceeded.into(),
        state: b.state.into(),
        timezone: b.timezone,
    }
}

/// A resource as the API shows it.
pub fn resource_to_pb(r: crate::views::ResourceView) -> pb::Resource {
    pb::Resource {
        name: r.name,
        concurrency: r.limits.concurrency,
        requests_per_minute: r.limits.requests_per_minute,
        tokens_per_minute: r.limits.tokens_per_minute,
        in_use: r.in_use,
        waiting: r.waiting,
        requests_available: r.requests_available,
        tokens_available: r.tokens_available,
        held_until: r.held_until.map(ts),
        held_why: r.held_why,
    }
}

/// A runner as the API shows it.
pub fn runner_to_pb(r: &RunnerView) -> pb::Runner {
    pb::Runner {
        runner_id: r.runner_id.clone(),
        agents: r.agents.clone(),
        slots: r.slots,
        busy_slots: r.busy,
        labels: r.labels.clone().into_iter().collect(),
        version: r.version.clone(),
        connected_at: Some(ts(r.connected_at)),
        last_seen: Some(ts(r.last_seen)),
        running: r.running.clone(),
        draining: r.draining,
    }
}

fn lag_to_pb(l: &crate::stats::Lag) -> pb::LagStats {
    pb::LagStats { count: l.count, p50_ms: l.p50_ms, p99_ms: l.p99_ms, max_ms: l.max_ms }
}

fn task_stats_to_pb(s: &crate::stats::TaskStats) -> pb::TaskStats {
    pb::TaskStats {
        task_id: s.task_id.clone(),
        fired: s.fired,
        succeeded: s.succeeded,
        failed: s.failed,
        timed_out: s.timed_out,
        cancelled: s.cancelled,
        in_progress: s.in_progress,
        retried: s.retried,
        attempts: s.attempts,
        skipped: s.skipped.clone().into_iter().collect(),
        dispatch_lag: Some(lag_to_pb(&s.dispatch_lag)),
        start_lag: Some(lag_to_pb(&s.start_lag)),
    }
}

/// Scheduling stats as the API shows them.
pub fn stats_to_pb(s: &crate::stats::SchedulingStats) -> pb::SchedulingStats {
    pb::SchedulingStats {
        window_start: Some(ts(s.from)),
        window_end: Some(ts(s.until)),
        tasks: s.tasks.iter().map(task_stats_to_pb).collect(),
        total: Some(task_stats_to_pb(&s.total)),
    }
}

/// A notification as the API shows it (without its payload).
pub fn notification_to_pb(n: &crate::model::notification::Notification) -> pb::Notification {
    pb::Notification {
        id: n.id.clone(),
        event: n.event.as_str().into(),
        sink: crate::notify::redact_sink(&n.sink),
        task_id: n.task_id.clone(),
        run_id: n.run_id.clone(),
        status: n.status.as_str().into(),
        attempts: n.attempts,
        next_attempt_at: Some(ts(n.next_attempt_at)),
        last_error: n.last_error.clone().unwrap_or_default(),
        created_at: Some(ts(n.created_at)),
        delivered_at: ots(n.delivered_at),
        updated_at: Some(ts(n.updated_at)),
    }
}

/// A backfill as the API sends it.
pub fn backfill_to_pb(b: &crate::model::backfill::Backfill) -> pb::Backfill {
    let name = |v: serde_json::Result<serde_json::Value>| v.ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default();
    pb::Backfill {
        id: b.id.clone(),
        task_id: b.spec.task_id.clone(),
        from: Some(ts(b.spec.from)),
        to: Some(ts(b.spec.to)),
        reprocess: name(serde_json::to_value(b.spec.reprocess)),
        max_concurrent: b.spec.max_concurrent,
        order: name(serde_json::to_value(b.spec.order)),
        on_failure: name(serde_json::to_value(b.spec.on_failure)),
        state: b.state.as_str().into(),
        cursor: ots(b.cursor),
        planned: b.planned,
        created: b.created,
        left: b.left,
        succeeded: b.succeeded,
        failed: b.failed,
        other: b.other,
        remaining: b.remaining(),
        in_flight: b.in_flight.clone(),
        reason: b.reason.clone(),
        created_at: Some(ts(b.created_at)),
        updated_at: Some(ts(b.updated_at)),
    }
}
