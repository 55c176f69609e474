//! `ClusterService` handlers.

use std::sync::Arc;

use punchclock_proto::v1 as pb;
use punchclock_proto::v1::cluster_service_server::ClusterService;
use tonic::{Request, Response, Status};

use super::convert::runner_to_pb;
use super::status;
use crate::api::Core;

/// `punchclock.v1.ClusterService`.
pub struct ClusterSvc(pub Arc<Core>);

#[tonic::async_trait]
impl ClusterService for ClusterSvc {
    async fn get_leader(&self, _req: Request<pb::GetLeaderRequest>) -> Result<Response<pb::GetLeaderResponse>, Status> {
        let l = self.0.leader().await.unwrap_or_default();
        let is_self = l.leader_id == self.0.election.id();
        Ok(Response::new(pb::GetLeaderResponse {
            leader_id: l.leader_id,
            advertise_address: l.advertise_address,
            fencing_token: l.token,
            is_self,
            store: self.0.repo.store().describe(),
        }))
    }

    async fn get_cluster_status(&self, _req: Request<pb::GetClusterStatusRequest>) -> Result<Response<pb::ClusterStatus>, Status> {
        let l = self.0.leader().await.unwrap_or_default();
        let mut members: Vec<pb::Member> = self
            .0
            .election
            .members()
            .await
            .into_iter()
            .map(|(id, advertise_address)| pb::Member { is_leader: id == l.leader_id, id, advertise_address })
            .collect();
        members.sort_by(|a, b| a.id.cmp(&b.id));
        let leader_unresponsive = self.0.leader_unresponsive(&l).await;
        Ok(Response::new(pb::ClusterStatus {
            members,
            leader_id: l.leader_id,
            leader_address: l.advertise_address,
            fencing_token: l.token,
            store: self.0.repo.store().describe(),
            answered_by: self.0.election.id(),
            config_version: self.0.config.current().version,
            leader_unresponsive,
        }))
    }

    async fn list_runners(&self, _req: Request<pb::ListRunnersRequest>) -> Result<Response<pb::ListRunnersResponse>, Status> {
        let runners = self.0.list_runners().await.map_err(status)?;
        Ok(Response::new(pb::ListRunnersResponse { runners: runners.iter().map(runner_to_pb).collect() }))
    }

    async fn list_resources(&self, _req: Request<pb::ListResourcesRequest>) -> Result<Response<pb::ListResourcesResponse>, Status> {
        let resources = self.0.list_resources().await.map_err(status)?;
        Ok(Response::new(pb::ListResourcesResponse { resources: resources.into_iter().map(resource_to_pb).collect() }))
    }

    async fn release_resource(&self, req: Request<pb::ReleaseResourceRequest>) -> Result<Response<pb::Resource>, Status> {
        let name = req.into_inner().name;
        if name.is_empty() {
            return Err(status(crate::error::Error::invalid("name", "is required")));
        }
        Ok(Response::new(resource_to_pb(self.0.release_resource(&name).await.map_err(status)?)))
    }

    async fn list_budgets(&self, _req: Request<pb::ListBudgetsRequest>) -> Result<Response<pb::ListBudgetsResponse>, Status> {
        let budgets = self.0.list_budgets().await.map_err(status)?;
        let amount = |a: crate::model::budget::Amount| pb::BudgetAmount {
            cost: Some(a.cost),
            input_tokens: Some(a.input_tokens),
            output_tokens: Some(a.output_tokens),
            runs: Some(a.runs),
        };
        Ok(Response::new(pb::ListBudgetsResponse {
            budgets: budgets
                .into_iter()
                .map(|b| pb::Budget {
                    name: b.name,
                    scope: b.scope,
                    window: b.window.into(),
                    window_start: Some(punchclock_proto::time::to_timestamp(b.window_start)),
                    window_end: Some(punchclock_proto::time::to_timestamp(b.window_end)),
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
                })
                .collect(),
        }))
    }
}

fn resource_to_pb(r: crate::engine::core::policy::resources::ResourceSnapshot) -> pb::Resource {
    pb::Resource {
        name: r.name,
        concurrency: r.limits.concurrency,
        requests_per_minute: r.limits.requests_per_minute,
        tokens_per_minute: r.limits.tokens_per_minute,
        in_use: r.in_use,
        waiting: r.waiting,
        requests_available: r.requests_available,
        tokens_available: r.tokens_available,
        held_until: r.held_until.map(punchclock_proto::time::to_timestamp),
        held_why: r.held_why,
    }
}
