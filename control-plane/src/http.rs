//! The HTTP port: `GET /livez` (the process answers), `GET /readyz` and
//! `GET /healthz` (ready: the store takes writes, and a leader runs its
//! engine — 200, else 503 with the reasons; JSON with leadership either
//! way), as Kubernetes probes expect; `GET /metrics` (Prometheus, see
//! [`crate::metrics`]); `POST /hooks/...` (webhook triggers) and `POST
//! /events/{topic}` (published events), see [`crate::events::webhook`];
//! `/ui/` (the dashboard, [`crate::ui`]; `GET /` leads there).

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use axum::{Json, Router};
use tokio::net::TcpListener;

use crate::api::Core;
use crate::error::{Error, Result};

async fn livez() -> Json<serde_json::Value> {
    Json(serde_json::json!({ "status": "ok", "live": true }))
}

async fn readyz(State(core): State<Arc<Core>>) -> (StatusCode, Json<serde_json::Value>) {
    let leading = core.engine.read().map(|g| g.is_some()).unwrap_or(false);
    let leader = core.leader().await.map(|l| l.advertise_address).unwrap_or_default();
    let reasons = core.readiness().await;
    let ready = reasons.is_empty();
    // Not a reason to stop serving: the rest of the control plane goes on.
    let mut degraded: Vec<String> = core
        .consumers
        .snapshot()
        .into_iter()
        .filter_map(|(name, s)| s.error.map(|e| format!("queue consumer {name} (broker {}): {e}; retrying", s.broker)))
        .collect();
    degraded.extend(core.archive.as_ref().and_then(|(_, status)| status.problem()));
    let body = serde_json::json!({
        "status": if ready { "ok" } else { "not_ready" },
        "live": true,
        "ready": ready,
        "reasons": reasons,
        "degraded": degraded,
        "leader": leading,
        "leader_address": leader,
        "store": core.repo.store().describe(),
        // Where finished runs are kept: "kv" (the store's own) or "postgres".
        "history": core.history.kind(),
    });
    (if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE }, Json(body))
}

/// Binds `addr` (with `fallback`, a free port of the same address when
/// its port is taken).
///
/// Errors: `FailedPrecondition` naming the address and the flag to change.
pub async fn bind(addr: SocketAddr, fallback: bool) -> Result<TcpListener> {
    let listener = match TcpListener::bind(addr).await {
        Ok(l) => l,
        Err(e) if fallback && e.kind() == std::io::ErrorKind::AddrInUse => {
            let any = SocketAddr::new(addr.ip(), 0);
            tracing::info!(taken = %addr, "HTTP port taken; listening on a free one");
            TcpListener::bind(any).await.map_err(|e| bind_error(any, e))?
        }
        Err(e) => return Err(bind_error(addr, e)),
    };
    Ok(listener)
}

/// The address other replicas reach an HTTP port bound at `bound` at:
/// `http://bound`, with the host of `advertise` (the API's advertised
/// URL) when `bound`'s address is unspecified (`0.0.0.0`, `::`).
pub fn advertise_of(bound: SocketAddr, advertise: &str) -> String {
    if !bound.ip().is_unspecified() {
        return format!("http://{bound}");
    }
    let host = advertise.split("://").nth(1).unwrap_or(advertise);
    let host = host.split('/').next().unwrap_or(host);
    let host = match host.rsplit_once(':') {
        Some((h, port)) if port.chars().all(|c| c.is_ascii_digit()) => h,
        _ => host,
    };
    format!("http://{host}:{}", bound.port())
}

/// An HTTP connection's socket send buffer (`SO_SNDBUF`; Linux keeps
/// twice this): what a client that does not read holds of the host's
/// memory, instead of up to `tcp_wmem`'s maximum (4 MiB).
pub const SEND_BUFFER_BYTES: usize = 64 * 1024;

/// What the HTTP port holds to (see [`crate::conns`]).
#[derive(Debug, Clone, Copy)]
pub struct HttpLimits {
    /// Open connections, in all and per source address.
    pub connections: crate::conns::PortLimits,
    /// A request's headers must arrive within this, and so must the next
    /// request's on a kept-alive connection; else hyper closes it.
    pub header_timeout: std::time::Duration,
    /// A webhook's, event's or dashboard form's body must arrive within this (else `408`).
    pub body_timeout: std::time::Duration,
}

/// Serves the HTTP port on `listener` until the process ends: HTTP/1.1,
/// each connection admitted under `limits.connections` (the connection
/// idle longest closed for a new one at a cap), headers read within
/// `limits.header_timeout`.
pub fn serve(listener: TcpListener, core: Arc<Core>, limits: HttpLimits) {
    let app = Router::new()
        .route("/livez", get(livez))
        .route("/readyz", get(readyz))
        .route("/healthz", get(readyz))
        .route("/metrics", get(metrics))
        .merge(crate::events::webhook::routes())
        .merge(crate::ui::routes(core.clone(), crate::ui::live::cap_for(limits.connections.max)))
        .layer(axum::Extension(Arc::new(crate::events::webhook::Bodies::new(limits.body_timeout))))
        .with_state(core);
    let conns = crate::conns::Conns::new("HTTP", limits.connections);
    tokio::spawn(async move {
        loop {
            let (io, peer) = conns.accept(&listener).await;
            // A client that stops reading (a live stream left open) fills
            // this socket's send buffer and no more: the kernel's
            // autotuning would let it pin megabytes; past it, the stream's
            // queue fills and it is told to reload.
            if let Err(e) = socket2::SockRef::from(io.get_ref()).set_send_buffer_size(SEND_BUFFER_BYTES) {
                tracing::debug!(error = %e, "cannot set SO_SNDBUF");
            }
            tokio::spawn(serve_connection(io, peer, app.clone(), limits.header_timeout));
        }
    });
}

/// One HTTP connection: each request is in flight on it (so it is not
/// closed for a new one) from its headers to the end of its answer.
async fn serve_connection(
    io: crate::conns::Tracked<tokio::net::TcpStream>,
    peer: SocketAddr,
    app: Router,
    header_timeout: std::time::Duration,
) {
    use tower::ServiceExt;
    let conn = io.conn();
    let svc = hyper::service::service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
        req.extensions_mut().insert(axum::extract::ConnectInfo(peer));
        let busy = conn.busy();
        let app = app.clone();
        async move {
            let resp = match app.oneshot(req).await {
                Ok(r) => r,
                Err(never) => match never {},
            };
            Ok::<_, std::convert::Infallible>(resp.map(|body| axum::body::Body::new(crate::conns::BusyBody::new(body, busy))))
        }
    });
    let mut http1 = hyper::server::conn::http1::Builder::new();
    http1.timer(hyper_util::rt::TokioTimer::new()).header_read_timeout(header_timeout);
    if let Err(e) = http1.serve_connection(hyper_util::rt::TokioIo::new(io), svc).await {
        tracing::debug!(%peer, error = %e, "HTTP connection ended");
    }
}

/// `GET /metrics`: every metric, in the OpenMetrics text format when the
/// client accepts it (Prometheus does), else in the classic Prometheus
/// text format; the leader's engine state is read at each scrape (bounded
/// to 2 s).
async fn metrics(State(core): State<Arc<Core>>, headers: axum::http::HeaderMap) -> impl axum::response::IntoResponse {
    let engine = core.engine.read().ok().and_then(|g| g.clone());
    let leading = match engine {
        Some(e) => match tokio::time::timeout(std::time::Duration::from_secs(2), e.gauges()).await {
            Ok(Ok(g)) => Some((e.leadership().token, g)),
            _ => None,
        },
        None => None,
    };
    core.metrics.set_engine(leading);
    core.metrics.set_consumers(&core.consumers.snapshot());
    let openmetrics =
        headers.get(axum::http::header::ACCEPT).and_then(|v| v.to_str().ok()).is_some_and(crate::metrics::prefers_openmetrics);
    let text = core.metrics.encode();
    if openmetrics {
        ([(axum::http::header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)], text)
    } else {
        ([(axum::http::header::CONTENT_TYPE, crate::metrics::PROMETHEUS_CONTENT_TYPE)], crate::metrics::to_prometheus_text(&text))
    }
}

fn bind_error(addr: SocketAddr, e: std::io::Error) -> Error {
    Error::FailedPrecondition(format!(
        "cannot listen on {addr} (HTTP, /healthz): {e}; give --http-listen another address (port 0 picks a free one)"
    ))
}
