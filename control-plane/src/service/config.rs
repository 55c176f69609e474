//! `ConfigService` handlers: the cluster configuration in the store.

use std::sync::Arc;

use punchclock_proto::v1 as pb;
use punchclock_proto::v1::config_service_server::ConfigService;
use tonic::{Request, Response, Status};

use super::status;
use crate::api::Core;
use crate::auth::Principal;
use crate::error::Error;

/// `punchclock.v1.ConfigService`.
pub struct ConfigSvc(pub Arc<Core>);

#[tonic::async_trait]
impl ConfigService for ConfigSvc {
    async fn apply_config(&self, req: Request<pb::ApplyConfigRequest>) -> Result<Response<pb::ApplyConfigResponse>, Status> {
        let by = req.extensions().get::<Principal>().map_or_else(|| "anonymous".to_string(), |p| p.name.clone());
        let req = req.into_inner();
        if req.text.trim().is_empty() {
            return Err(status(Error::invalid("text", "is empty: give the whole configuration document")));
        }
        let a = self.0.apply_config(&req.text, &by, req.dry_run).await.map_err(status)?;
        Ok(Response::new(pb::ApplyConfigResponse { version: a.version, changed: a.changed, previous_version: a.previous }))
    }

    async fn get_config(&self, req: Request<pb::GetConfigRequest>) -> Result<Response<pb::StoredConfig>, Status> {
        let version = req.into_inner().version;
        let c = self.0.get_config(version).await.map_err(status)?.ok_or_else(|| {
            status(Error::NotFound {
                kind: "configuration version",
                id: if version == 0 { "in force".into() } else { version.to_string() },
            })
        })?;
        Ok(Response::new(pb::StoredConfig {
            version: c.version,
            text: c.text,
            applied_at: Some(punchclock_proto::time::to_timestamp(c.applied_at)),
            applied_by: c.applied_by,
        }))
    }
}
