//! Conversions between the core's model and `punchclock.v1` messages.

use chrono::{DateTime, Utc};
use prost_types::Timestamp;
use punchclock_proto::v1 as pb;

use crate::api::TaskView;
use crate::engine::RunnerSnapshot;
use crate::model::{RunRecord, RunStatus};

/// UTC instant → protobuf timestamp.
pub fn ts(t: DateTime<Utc>) -> Timestamp {
    Timestamp { seconds: t.timestamp(), nanos: t.timestamp_subsec_nanos() as i32 }
}

/// Optional instant → optional timestamp.
pub fn ots(t: Option<DateTime<Utc>>) -> Option<Timestamp> {
    t.map(ts)
}

/// Protobuf timestamp → UTC instant (`None` if out of range).
pub fn from_ts(t: &Timestamp) -> Option<DateTime<Utc>> {
    DateTime::from_timestamp(t.seconds, t.nanos.max(0) as u32)
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
        trigger_kind: r.trigger.clone(),
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
                outcome: a.outcome.clone().unwrap_or_default(),
                error: a.error.clone().unwrap_or_default(),
                exit_code: a.exit_code,
            })
            .collect(),
        result_json: json_or_empty(&r.result),
        progress: r.progress.as_ref().map(|p| pb::Progress {
            percent: p.percent,
            message: p.message.clone(),
            checkpoint_json: json_or_empty(&p.checkpoint),
            updated_at: Some(ts(p.updated_at)),
        }),
        skip_reason: r.skip_reason.clone().unwrap_or_default(),
        missed_count: r.missed_count.unwrap_or(0),
        missed_from: ots(r.missed_from),
        missed_until: ots(r.missed_until),
        pending_reason: r.pending_reason.clone().unwrap_or_default(),
        next_attempt_at: ots(r.next_attempt_at),
        context_json: serde_json::json!({ "params": r.params }).to_string(),
        stdout_tail: r.stdout_tail.clone(),
        stderr_tail: r.stderr_tail.clone(),
        fencing_token: r.fencing_token,
        error: r.error.clone().unwrap_or_default(),
        updated_at: Some(ts(r.updated_at)),
    }
}

/// A task as the API shows it.
pub fn task_to_pb(v: &TaskView) -> pb::Task {
    pb::Task {
        task_id: v.record.spec.task_id.clone(),
        agent_id: v.record.spec.agent_id.clone(),
        spec_json: serde_json::to_string(&v.record.spec).unwrap_or_default(),
        paused: v.record.paused,
        created_at: Some(ts(v.record.created_at)),
        updated_at: Some(ts(v.record.updated_at)),
        next_fire_at: ots(v.next_fire_at),
        last_slot_at: ots(v.cursor.as_ref().and_then(|c| c.last_slot)),
    }
}

/// A runner as the API shows it.
pub fn runner_to_pb(r: &RunnerSnapshot) -> pb::Runner {
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
    }
}
