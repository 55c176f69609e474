//! `NotificationService` handlers.

use std::sync::Arc;

use punchclock_proto::v1 as pb;
use punchclock_proto::v1::notification_service_server::NotificationService;
use tonic::{Request, Response, Status};

use super::convert::notification_to_pb;
use super::status;
use crate::api::Core;
use crate::error::Error;
use crate::model::notification::DeliveryStatus;

/// `punchclock.v1.NotificationService`.
pub struct NotificationSvc(pub Arc<Core>);

#[tonic::async_trait]
impl NotificationService for NotificationSvc {
    async fn list_notifications(
        &self,
        req: Request<pb::ListNotificationsRequest>,
    ) -> Result<Response<pb::ListNotificationsResponse>, Status> {
        let r = req.into_inner();
        let st = match r.status.to_ascii_lowercase().as_str() {
            "" => None,
            "pending" => Some(DeliveryStatus::Pending),
            "delivered" => Some(DeliveryStatus::Delivered),
            "dead" => Some(DeliveryStatus::Dead),
            other => return Err(status(Error::invalid("status", format!("{other:?} is not pending, delivered or dead")))),
        };
        let list = self.0.list_notifications(st, &r.task_id, r.limit).await.map_err(status)?;
        Ok(Response::new(pb::ListNotificationsResponse { notifications: list.iter().map(notification_to_pb).collect() }))
    }

    async fn retry_notification(&self, req: Request<pb::RetryNotificationRequest>) -> Result<Response<pb::Notification>, Status> {
        let n = self.0.retry_notification(&req.into_inner().id).await.map_err(status)?;
        Ok(Response::new(notification_to_pb(&n)))
    }
}
