//! `RunService` handlers.

use std::pin::Pin;
use std::sync::Arc;

use futures::{Stream, StreamExt};
use punchclock_proto::v1 as pb;
use punchclock_proto::v1::run_service_server::RunService;
use tonic::{Request, Response, Status};

use super::convert::{run_to_pb, stats_to_pb, status_from_pb, trigger_from_pb};
use super::status;
use crate::api::Core;
use crate::error::Error;
use crate::repo::history::{self, HistoryQuery};

/// Most bytes of runs one `ListRuns` answer carries (gRPC's default
/// message limit is 4 MiB): the newest runs up to it.
pub const MAX_LIST_RUNS_BYTES: usize = 3 * 1024 * 1024;

/// The history query of a `ListRuns` request (its page token aside).
///
/// Errors: `InvalidArgument` naming `status`, `trigger_kind`, `order` (an
/// unknown value) or `scheduled_from`/`scheduled_to` (out of range).
pub fn list_query(r: &pb::ListRunsRequest) -> Result<HistoryQuery, Error> {
    let status = pb::RunStatus::try_from(r.status)
        .map_err(|_| Error::invalid("status", format!("unknown run status {}", r.status)))
        .map(status_from_pb)?;
    let trigger = match pb::TriggerKind::try_from(r.trigger_kind) {
        Ok(pb::TriggerKind::Unspecified) => None,
        Ok(k) => Some(trigger_from_pb(k)),
        Err(_) => return Err(Error::invalid("trigger_kind", format!("unknown trigger kind {}", r.trigger_kind))),
    };
    let newest_first = match pb::RunOrder::try_from(r.order) {
        Ok(pb::RunOrder::Unspecified | pb::RunOrder::NewestFirst) => true,
        Ok(pb::RunOrder::OldestFirst) => false,
        Err(_) => return Err(Error::invalid("order", format!("unknown order {}", r.order))),
    };
    let time = |field: &str, t: &Option<prost_types::Timestamp>| {
        t.as_ref()
            .map(|t| {
                punchclock_proto::time::from_timestamp(t)
                    .filter(|t| t.timestamp() >= 0)
                    .ok_or_else(|| Error::invalid(field, "is not a time between 1970 and 2262"))
            })
            .transpose()
    };
    Ok(HistoryQuery {
        task_id: r.task_id.clone(),
        task_prefix: r.task_prefix.clone(),
        from: time("scheduled_from", &r.scheduled_from)?,
        to: time("scheduled_to", &r.scheduled_to)?,
        status,
        trigger,
        event_key: r.event_key.clone(),
        after: None,
        limit: if r.page_size > 0 { r.page_size } else { r.limit } as usize,
        newest_first,
    })
}

/// `punchclock.v1.RunService`.
pub struct RunSvc(pub Arc<Core>);

#[tonic::async_trait]
impl RunService for RunSvc {
    async fn list_runs(&self, req: Request<pb::ListRunsRequest>) -> Result<Response<pb::ListRunsResponse>, Status> {
        let r = req.into_inner();
        let q = list_query(&r).map_err(status)?;
        let (runs, next) = self.0.list_runs(q.clone(), &r.page_token).await.map_err(status)?;
        // In order, until the message would pass its byte budget: then
        // the next page starts after the last run given.
        let mut out = Vec::with_capacity(runs.len());
        let mut bytes = 0;
        let mut cut = None;
        for run in &runs {
            let pb_run = run_to_pb(run);
            bytes += prost::Message::encoded_len(&pb_run);
            if bytes > MAX_LIST_RUNS_BYTES && !out.is_empty() {
                cut = Some(history::Cursor::of(&runs[out.len() - 1]));
                break;
            }
            out.push(pb_run);
        }
        let next = cut.or(next).map(|c| history::encode_token(&q, &c)).unwrap_or_default();
        Ok(Response::new(pb::ListRunsResponse { runs: out, next_page_token: next }))
    }

    async fn get_run(&self, req: Request<pb::GetRunRequest>) -> Result<Response<pb::Run>, Status> {
        let run = self.0.get_run(&req.into_inner().run_id).await.map_err(status)?;
        let mut out = run_to_pb(&run);
        out.reruns = self.0.reruns_of(&run.run_id).await.unwrap_or_default();
        Ok(Response::new(out))
    }

    async fn cancel_run(&self, req: Request<pb::CancelRunRequest>) -> Result<Response<pb::Run>, Status> {
        let r = req.into_inner();
        let run = self.0.cancel_run(&r.run_id, &r.reason).await.map_err(status)?;
        Ok(Response::new(run_to_pb(&run)))
    }

    async fn rerun_runs(&self, req: Request<pb::RerunRunsRequest>) -> Result<Response<pb::RerunRunsResponse>, Status> {
        let r = req.into_inner();
        let results = if !r.run_id.is_empty() {
            vec![self.0.rerun(&r.run_id, r.dry_run).await.map_err(status)?]
        } else {
            let status_filter = crate::model::RunStatus::parse(&r.status)
                .ok_or_else(|| status(crate::error::Error::invalid("status", format!("{:?}: a run status such as FAILED", r.status))))?;
            if r.limit > 10_000 {
                return Err(status(crate::error::Error::invalid("limit", "at most 10000")));
            }
            let q = history::HistoryQuery {
                task_id: r.task_id.clone(),
                from: r.since.as_ref().and_then(punchclock_proto::time::from_timestamp),
                to: r.until.as_ref().and_then(punchclock_proto::time::from_timestamp),
                status: Some(status_filter),
                limit: if r.limit == 0 { 1000 } else { r.limit as usize },
                ..Default::default()
            };
            self.0.rerun_matching(q, r.dry_run).await.map_err(status)?
        };
        Ok(Response::new(pb::RerunRunsResponse {
            results: results
                .into_iter()
                .map(|x| pb::RerunResult { of: x.of, run_id: x.run_id, created: x.created, skipped: x.skipped.unwrap_or_default() })
                .collect(),
        }))
    }

    async fn prune_runs(&self, req: Request<pb::PruneRunsRequest>) -> Result<Response<pb::PruneRunsResponse>, Status> {
        let report = self.0.prune_runs(&req.into_inner().task_id).await.map_err(status)?;
        Ok(Response::new(pb::PruneRunsResponse {
            deleted: report.deleted as u64,
            kept: report.kept as u64,
            note: report.note.unwrap_or_default(),
        }))
    }

    async fn get_scheduling_stats(&self, req: Request<pb::GetSchedulingStatsRequest>) -> Result<Response<pb::SchedulingStats>, Status> {
        let r = req.into_inner();
        let s = self.0.scheduling_stats(&r.task_id, std::time::Duration::from_secs(r.since_seconds)).await.map_err(status)?;
        Ok(Response::new(stats_to_pb(&s)))
    }

    type WatchRunsStream = Pin<Box<dyn Stream<Item = Result<pb::Run, Status>> + Send + 'static>>;

    async fn watch_runs(&self, req: Request<pb::WatchRunsRequest>) -> Result<Response<Self::WatchRunsStream>, Status> {
        let r = req.into_inner();
        let s = self.0.watch_runs(&r.task_id, &r.run_id).await.map_err(status)?;
        Ok(Response::new(s.map(|r| r.map(|run| run_to_pb(&run)).map_err(status)).boxed()))
    }
}
