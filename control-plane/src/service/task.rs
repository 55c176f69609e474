//! `TaskService` handlers.

use std::sync::Arc;

use punchclock_proto::v1 as pb;
use punchclock_proto::v1::task_service_server::TaskService;
use tonic::{Request, Response, Status};

use punchclock_proto::time::{from_timestamp, to_timestamp};

use super::convert::{task_summary_to_pb, task_to_pb};
use super::definition::definition_json;
use super::status;
use crate::api::{Core, TaskView};
use crate::engine::{CallerTrace, TriggerRequest};
use crate::error::Error;
use crate::model::task::MAX_SPEC_BYTES;

/// `punchclock.v1.TaskService`.
pub struct TaskSvc(pub Arc<Core>);

impl TaskSvc {
    /// A task with its effective definition too (one task answers).
    fn full(&self, v: &TaskView) -> pb::Task {
        task_to_pb(v, Some(&self.0.retention))
    }
}

fn view(record: crate::model::TaskRecord) -> TaskView {
    TaskView { record, cursor: None, next_fire_at: None, ended: None }
}

/// Most definitions one `ApplyTasks` call takes.
pub const MAX_APPLY_TASKS: usize = 200_000;
/// Most bytes of definitions one `ApplyTasks` call takes (256 MiB).
pub const MAX_APPLY_BYTES: usize = 256 * 1024 * 1024;
/// Results per `ApplyTasksResponse` message.
const APPLIED_PER_MESSAGE: usize = 1000;

#[tonic::async_trait]
impl TaskService for TaskSvc {
    type ApplyTasksStream = futures::stream::BoxStream<'static, Result<pb::ApplyTasksResponse, Status>>;

    async fn apply_tasks(&self, req: Request<tonic::Streaming<pb::ApplyTasksRequest>>) -> Result<Response<Self::ApplyTasksStream>, Status> {
        let mut incoming = req.into_inner();
        let (mut specs, mut dry_run, mut bytes) = (Vec::new(), false, 0usize);
        while let Some(msg) = incoming.message().await? {
            dry_run |= msg.dry_run;
            let typed =
                msg.tasks.iter().map(|d| definition_json(d).map(|v| v.to_string())).collect::<crate::Result<Vec<_>>>().map_err(status)?;
            for spec in msg.spec_json.into_iter().chain(typed) {
                // Refused as they arrive: nothing unbounded is held.
                if spec.len() > MAX_SPEC_BYTES {
                    let n = specs.len() + 1;
                    return Err(status(Error::invalid(
                        "tasks",
                        format!("task #{n}: definition is {} bytes; at most {MAX_SPEC_BYTES}; nothing applied", spec.len()),
                    )));
                }
                bytes += spec.len();
                specs.push(spec);
            }
            if specs.len() > MAX_APPLY_TASKS || bytes > MAX_APPLY_BYTES {
                return Err(status(Error::invalid(
                    "tasks",
                    format!("more than {MAX_APPLY_TASKS} definitions or {MAX_APPLY_BYTES} bytes in one apply; nothing applied"),
                )));
            }
        }
        let applied = self.0.apply_tasks(specs, dry_run).await.map_err(status)?;
        let messages: Vec<Result<pb::ApplyTasksResponse, Status>> = applied
            .chunks(APPLIED_PER_MESSAGE)
            .map(|chunk| {
                Ok(pb::ApplyTasksResponse {
                    tasks: chunk
                        .iter()
                        .map(|a| pb::TaskApplied {
                            task_id: a.task_id.clone(),
                            outcome: a.outcome.as_str().into(),
                            warnings: a.warnings.clone(),
                        })
                        .collect(),
                })
            })
            .collect();
        Ok(Response::new(Box::pin(futures::stream::iter(messages))))
    }

    async fn apply_task(&self, req: Request<pb::ApplyTaskRequest>) -> Result<Response<pb::ApplyTaskResponse>, Status> {
        let r = req.into_inner();
        let spec_json = match (&r.task, r.spec_json.is_empty()) {
            (Some(_), false) => return Err(status(Error::invalid("task", "give exactly one of spec_json and task"))),
            (Some(d), true) => definition_json(d).map_err(status)?.to_string(),
            (None, _) => r.spec_json,
        };
        let applied = self.0.apply_task(&spec_json, r.dry_run).await.map_err(status)?;
        let task_id = applied.record.spec.task_id.clone();
        let task = if r.dry_run { view(applied.record) } else { self.0.get_task(&task_id).await.map_err(status)? };
        Ok(Response::new(pb::ApplyTaskResponse {
            task: Some(self.full(&task)),
            created: applied.created,
            warnings: applied.warnings,
            outcome: applied.outcome.as_str().into(),
        }))
    }

    async fn get_task(&self, req: Request<pb::GetTaskRequest>) -> Result<Response<pb::Task>, Status> {
        let v = self.0.get_task(&req.into_inner().task_id).await.map_err(status)?;
        Ok(Response::new(self.full(&v)))
    }

    async fn list_tasks(&self, req: Request<pb::ListTasksRequest>) -> Result<Response<pb::ListTasksResponse>, Status> {
        let r = req.into_inner();
        let (tasks, next_page_token) =
            self.0.task_summaries(&Default::default(), &r.page_token, r.page_size, r.recent_slots).await.map_err(status)?;
        Ok(Response::new(pb::ListTasksResponse { tasks: tasks.iter().map(task_summary_to_pb).collect(), next_page_token }))
    }

    async fn delete_task(&self, req: Request<pb::DeleteTaskRequest>) -> Result<Response<pb::DeleteTaskResponse>, Status> {
        self.0.delete_task(&req.into_inner().task_id).await.map_err(status)?;
        Ok(Response::new(pb::DeleteTaskResponse {}))
    }

    async fn pause_task(&self, req: Request<pb::PauseTaskRequest>) -> Result<Response<pb::Task>, Status> {
        let id = req.into_inner().task_id;
        self.0.pause_task(&id).await.map_err(status)?;
        Ok(Response::new(self.full(&self.0.get_task(&id).await.map_err(status)?)))
    }

    async fn resume_task(&self, req: Request<pb::ResumeTaskRequest>) -> Result<Response<pb::Task>, Status> {
        let id = req.into_inner().task_id;
        self.0.resume_task(&id).await.map_err(status)?;
        Ok(Response::new(self.full(&self.0.get_task(&id).await.map_err(status)?)))
    }

    async fn reset_breaker(&self, req: Request<pb::ResetBreakerRequest>) -> Result<Response<pb::Task>, Status> {
        let id = req.into_inner().task_id;
        self.0.reset_breaker(&id).await.map_err(status)?;
        Ok(Response::new(self.full(&self.0.get_task(&id).await.map_err(status)?)))
    }

    async fn trigger_task(&self, req: Request<pb::TriggerTaskRequest>) -> Result<Response<pb::TriggerTaskResponse>, Status> {
        // The caller's trace: the `traceparent` field, else the request's
        // `traceparent` metadata (W3C propagation over gRPC).
        let header = |name: &str| req.metadata().get(name).and_then(|v| v.to_str().ok()).map(str::to_string).unwrap_or_default();
        let (header_tp, header_ts, header_baggage) = (header("traceparent"), header("tracestate"), header("baggage"));
        let r = req.into_inner();
        let caller_trace = if r.traceparent.is_empty() {
            punchclock_proto::tracecontext::parse(&header_tp).map(|ids| (ids, header_ts))
        } else {
            let ids = punchclock_proto::tracecontext::parse(&r.traceparent)
                .ok_or_else(|| status(Error::invalid("traceparent", "is not a W3C traceparent (00-<32 hex>-<16 hex>-<2 hex>)")))?;
            Some((ids, r.tracestate.clone()))
        };
        let caller_trace = match caller_trace {
            None => None,
            Some(((trace_id, span_id, _), trace_state)) => {
                let trace_state = trace_header("tracestate", if r.tracestate.is_empty() { trace_state } else { r.tracestate }, 512)?;
                Some(CallerTrace { trace_id, span_id, trace_state })
            }
        };
        let baggage = trace_header("baggage", if r.baggage.is_empty() { header_baggage } else { r.baggage }, 8192)?;
        let params = if r.params_json.trim().is_empty() {
            serde_json::Map::new()
        } else {
            match serde_json::from_str::<serde_json::Value>(&r.params_json) {
                Ok(serde_json::Value::Object(m)) => m,
                Ok(_) => return Err(status(Error::invalid("params_json", "must be a JSON object"))),
                Err(e) => return Err(status(Error::invalid("params_json", e.to_string()))),
            }
        };
        let req = TriggerRequest {
            task_id: r.task_id,
            params,
            not_before: match r.not_before.as_ref() {
                None => None,
                Some(ts) => Some(from_timestamp(ts).ok_or_else(|| {
                    status(Error::invalid(
                        "not_before",
                        format!("seconds {} nanos {} is not an instant (nanos 0..=999999999, years 1..=9999)", ts.seconds, ts.nanos),
                    ))
                })?),
            },
            delay_seconds: r.delay_seconds,
            idempotency_window: match (r.idempotency_key.is_empty(), r.idempotency_ttl.is_empty()) {
                (true, false) => return Err(status(Error::invalid("idempotency_ttl", "needs an idempotency_key"))),
                (true, true) => None,
                (false, _) => Some(crate::model::trigger::dedup_window("idempotency_ttl", &r.idempotency_ttl).map_err(status)?),
            },
            idempotency_key: (!r.idempotency_key.is_empty()).then_some(r.idempotency_key),
            caller_trace,
            baggage,
        };
        let t = self.0.trigger(req).await.map_err(status)?;
        Ok(Response::new(pb::TriggerTaskResponse {
            run_id: t.run_id,
            scheduled_at: Some(to_timestamp(t.scheduled_at)),
            created: t.created,
        }))
    }

    async fn publish_event(&self, req: Request<pb::PublishEventRequest>) -> Result<Response<pb::PublishEventResponse>, Status> {
        let r = req.into_inner();
        let runs = self.0.publish_event(&r.topic, &r.payload_json, &r.idempotency_key, &r.idempotency_ttl).await.map_err(status)?;
        Ok(Response::new(pb::PublishEventResponse {
            runs: runs.into_iter().map(|(task_id, a)| pb::PublishedRun { task_id, run_id: a.run_id, created: a.created }).collect(),
        }))
    }

    async fn backfill_task(&self, req: Request<pb::BackfillTaskRequest>) -> Result<Response<pb::BackfillTaskResponse>, Status> {
        use crate::model::backfill::{BackfillSpec, OnFailure, Order, Reprocess};
        let r = req.into_inner();
        let at = |field: &str, t: &Option<prost_types::Timestamp>| {
            t.as_ref().and_then(from_timestamp).ok_or_else(|| status(Error::invalid(field, "required (an instant)")))
        };
        let spec = BackfillSpec {
            task_id: r.task_id.clone(),
            from: at("from", &r.from)?,
            to: at("to", &r.to)?,
            reprocess: match r.reprocess.as_str() {
                "" | "missing" => Reprocess::Missing,
                "failed" => Reprocess::Failed,
                "all" => Reprocess::All,
                x => return Err(status(Error::invalid("reprocess", format!("{x:?}: missing, failed or all")))),
            },
            max_concurrent: r.max_concurrent.max(1),
            order: match r.order.as_str() {
                "" | "oldest" => Order::Oldest,
                "newest" => Order::Newest,
                x => return Err(status(Error::invalid("order", format!("{x:?}: oldest or newest")))),
            },
            on_failure: match r.on_failure.as_str() {
                "" | "continue" => OnFailure::Continue,
                "stop" => OnFailure::Stop,
                x => return Err(status(Error::invalid("on_failure", format!("{x:?}: continue or stop")))),
            },
        };
        let plan = self.0.backfill(spec, r.dry_run).await.map_err(status)?;
        Ok(Response::new(pb::BackfillTaskResponse {
            backfill: plan.backfill.as_ref().map(super::convert::backfill_to_pb),
            listing: plan
                .listing
                .into_iter()
                .map(|(slot, run_id, verdict)| pb::BackfillSlot { slot: Some(to_timestamp(slot)), run_id, verdict })
                .collect(),
        }))
    }

    async fn list_backfills(&self, req: Request<pb::ListBackfillsRequest>) -> Result<Response<pb::ListBackfillsResponse>, Status> {
        let all = self.0.backfills(&req.into_inner().task_id).await.map_err(status)?;
        Ok(Response::new(pb::ListBackfillsResponse { backfills: all.iter().map(super::convert::backfill_to_pb).collect() }))
    }

    async fn get_backfill(&self, req: Request<pb::GetBackfillRequest>) -> Result<Response<pb::Backfill>, Status> {
        let b = self.0.get_backfill(&req.into_inner().id).await.map_err(status)?;
        Ok(Response::new(super::convert::backfill_to_pb(&b)))
    }

    async fn change_backfill(&self, req: Request<pb::ChangeBackfillRequest>) -> Result<Response<pb::Backfill>, Status> {
        use crate::engine::core::sources::backfill::BackfillOp;
        let r = req.into_inner();
        let op = match r.action.as_str() {
            "pause" => BackfillOp::Pause(r.id),
            "resume" => BackfillOp::Resume(r.id),
            "cancel" => BackfillOp::Cancel(r.id),
            x => return Err(status(Error::invalid("action", format!("{x:?}: pause, resume or cancel")))),
        };
        let b = self.0.change_backfill(op).await.map_err(status)?;
        Ok(Response::new(super::convert::backfill_to_pb(&b)))
    }

    async fn preview_schedule(&self, req: Request<pb::PreviewScheduleRequest>) -> Result<Response<pb::PreviewScheduleResponse>, Status> {
        let r = req.into_inner();
        let after = r.after.as_ref().and_then(from_timestamp);
        let dst = crate::schedule::DstSpec {
            gap: match r.dst_gap.as_str() {
                "" => None,
                "shift" => Some(crate::schedule::GapRule::Shift),
                "skip" => Some(crate::schedule::GapRule::Skip),
                g => return Err(status(Error::invalid("dst_gap", format!("{g:?}: shift or skip")))),
            },
            repeat: match r.dst_repeat.as_str() {
                "" => None,
                "first" => Some(crate::schedule::RepeatRule::First),
                "last" => Some(crate::schedule::RepeatRule::Last),
                "both" => Some(crate::schedule::RepeatRule::Both),
                x => return Err(status(Error::invalid("dst_repeat", format!("{x:?}: first, last or both")))),
            },
        };
        let p = self.0.preview(&r.expr, &r.timezone, dst, &r.task_id, after, r.count).await.map_err(status)?;
        let (times, zone) = (p.times, p.zone);
        let jittered_times = if p.fires != times { p.fires.into_iter().map(to_timestamp).collect() } else { Vec::new() };
        let local_times = times
            .iter()
            .map(|t| match zone {
                Some(z) => t.with_timezone(&z).to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true),
                None => t.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true),
            })
            .collect();
        Ok(Response::new(pb::PreviewScheduleResponse {
            fire_times: times.into_iter().map(to_timestamp).collect(),
            local_times,
            notes: p.notes,
            jittered_times,
        }))
    }
}

/// A W3C `tracestate` or `baggage` value for the agent's environment: at
/// most `max` characters (W3C Trace Context: 512 for tracestate; W3C
/// Baggage: 8192), printable ASCII (both formats are ASCII lists), trimmed.
fn trace_header(field: &str, value: String, max: usize) -> Result<String, Status> {
    let value = value.trim().to_string();
    if value.len() > max {
        return Err(status(Error::invalid(field, format!("is {} characters; at most {max}", value.len()))));
    }
    if let Some(c) = value.chars().find(|c| !(c.is_ascii_graphic() || *c == ' ' || *c == '\t')) {
        return Err(status(Error::invalid(field, format!("contains {c:?}: only printable ASCII is allowed"))));
    }
    Ok(value)
}
