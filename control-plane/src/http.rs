//! The HTTP port: `GET /healthz` (liveness plus leadership, JSON).

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::State;
use axum::routing::get;
use axum::{Json, Router};
use tokio::net::TcpListener;

use crate::api::Core;
use crate::error::{Error, Result};

async fn healthz(State(core): State<Arc<Core>>) -> Json<serde_json::Value> {
    let leading = core.engine.read().map(|g| g.is_some()).unwrap_or(false);
    let leader = core.leader().await.map(|l| l.advertise_address).unwrap_or_default();
    Json(serde_json::json!({ "status": "ok", "leader": leading, "leader_address": leader, "store": core.repo.store().describe() }))
}

/// Binds `addr` and serves until the process ends; returns the bound address.
pub async fn serve(addr: SocketAddr, core: Arc<Core>) -> Result<SocketAddr> {
    let listener = TcpListener::bind(addr).await.map_err(|e| Error::Unavailable { reason: format!("bind {addr}: {e}"), leader: None })?;
    let bound = listener.local_addr().map_err(|e| Error::Internal(e.to_string()))?;
    let app = Router::new().route("/healthz", get(healthz)).with_state(core);
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "http server failed");
        }
    });
    Ok(bound)
}
