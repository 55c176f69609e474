//! `ClusterService` handlers.

use std::sync::Arc;

use punchclock_proto::v1 as pb;
use punchclock_proto::v1::cluster_service_server::ClusterService;
use tonic::{Request, Response, Status};

use super::convert::{budget_to_pb, resource_to_pb, runner_to_pb};
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
        let v = self.0.cluster_view().await;
        Ok(Response::new(pb::ClusterStatus {
            members: v
                .members
                .into_iter()
                .map(|m| pb::Member { id: m.id, advertise_address: m.advertise_address, is_leader: m.is_leader })
                .collect(),
            leader_id: v.leader_id,
            leader_address: v.leader_address,
            fencing_token: v.fencing_token,
            store: v.store,
            answered_by: v.answered_by,
            config_version: v.config_version,
            leader_unresponsive: v.leader_unresponsive,
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
        Ok(Response::new(pb::ListBudgetsResponse { budgets: budgets.into_iter().map(budget_to_pb).collect() }))
    }
}
