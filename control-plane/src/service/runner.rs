//! `RunnerService.Connect`: one bidi stream per runner, served by the leader.
//! The first message must be Hello; the rest are forwarded to the engine
//! tagged with the stream's session so a late end of an old stream cannot
//! tear down a newer one.

use std::pin::Pin;
use std::sync::Arc;

use futures::{Stream, StreamExt};
use punchclock_proto::v1 as pb;
use punchclock_proto::v1::runner_message::Msg;
use punchclock_proto::v1::runner_service_server::RunnerService;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use super::status;
use crate::api::Core;
use crate::engine::Command;
use crate::error::Error;

/// Outbound messages buffered per runner stream.
const OUTBOUND_BUFFER: usize = 256;

/// `punchclock.v1.RunnerService`.
pub struct RunnerSvc(pub Arc<Core>);

#[tonic::async_trait]
impl RunnerService for RunnerSvc {
    type ConnectStream = Pin<Box<dyn Stream<Item = Result<pb::ControlMessage, Status>> + Send + 'static>>;

    async fn connect(&self, req: Request<Streaming<pb::RunnerMessage>>) -> Result<Response<Self::ConnectStream>, Status> {
        let engine = self.0.engine().await.map_err(status)?;
        let mut inbound = req.into_inner();
        let hello = match inbound.message().await? {
            Some(pb::RunnerMessage { msg: Some(Msg::Hello(h)) }) => h,
            _ => return Err(status(Error::invalid("msg", "the first message on the stream must be Hello"))),
        };
        let runner_id = hello.runner_id.clone();
        let (tx, rx) = mpsc::channel(OUTBOUND_BUFFER);
        let session = engine.runner_hello(hello, tx).await.map_err(status)?;
        tokio::spawn(async move {
            loop {
                match inbound.message().await {
                    Ok(Some(pb::RunnerMessage { msg: Some(msg) })) => {
                        if engine.send(Command::RunnerMessage { runner_id: runner_id.clone(), session, msg }).await.is_err() {
                            break;
                        }
                    }
                    Ok(Some(_)) => {}
                    Ok(None) => break,
                    Err(e) => {
                        tracing::debug!(runner_id = %runner_id, error = %e, "runner stream error");
                        break;
                    }
                }
            }
            let _ = engine.send(Command::RunnerGone { runner_id, session }).await;
        });
        Ok(Response::new(ReceiverStream::new(rx).map(Ok).boxed()))
    }
}
