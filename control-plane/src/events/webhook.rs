//! Webhook triggers and published events over HTTP, on the control plane's
//! HTTP port:
//!
//! - `POST /hooks/...`: the task whose `webhook` trigger has that path
//!   gets a run. The request is authenticated (`signature.rs`), its
//!   delivery id taken from the trigger's `dedup` (else `Idempotency-Key`),
//!   and it is answered `202 {run_id, deduplicated}` only once the run's
//!   record is committed — so a sender's retry is always safe. `401` a bad
//!   signature (no record; logged once per path and source a minute),
//!   `404` an unknown path, `413` a body over the limit, `400` a delivery
//!   without its dedup id, `408` (and the connection closed) a body that
//!   does not arrive within `--http-body-timeout` (10 s), or that was
//!   still arriving, the slowest, when all 64 turns to read one were taken
//!   and another request came ([`Bodies`]), `503` with `Retry-After` when
//!   no leader can admit it (or its secret cannot be read here, or 8
//!   bodies from the same address are being read, or all 64 turns hold
//!   bodies read already and none is given back within 10 s).
//! - `POST /events/{topic}`: `PublishEvent` (a bearer token of role
//!   `operator` when auth is on; `Idempotency-Key` header required).
//!
//! Any replica accepts: a follower forwards the request as it came to the
//! leader's HTTP port (`LeaderInfo::http_address`) and relays the answer.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{ConnectInfo, Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};

use super::signature::{self, Refusal};
use crate::api::Core;
use crate::error::Error;
use crate::model::event::event_run_id;
use crate::model::run::TriggerKind;
use crate::model::trigger::{MAX_EVENT_BODY_BYTES, WebhookTrigger};

/// Set on a request a follower forwards (its replica id): a replica that
/// gets one and does not lead answers 503 instead of forwarding again.
pub(crate) const FORWARDED: &str = "x-punchclock-forwarded-by";
/// The original sender of a forwarded request, as the forwarding replica
/// saw it. Any client can set it: it is kept as the run's
/// `attributes.forwarded_for` (at most 64 characters), never in place of
/// the connection's own address (`attributes.peer`).
const FORWARDED_FOR: &str = "x-punchclock-forwarded-for";
/// Longest `forwarded_for` kept.
const MAX_FORWARDED_FOR: usize = 64;
/// Longest delivery id taken (its run id is a digest of it).
const MAX_KEY_CHARS: usize = 512;
/// Longest header value given to the agent.
const MAX_HEADER_VALUE: usize = 1024;
/// Requests whose bodies are read at once (each up to 1 MiB): a flood of
/// large or slow requests holds at most this many bodies in memory.
const MAX_BODIES_IN_FLIGHT: usize = 64;
/// Of those, how many one peer address may hold: one client that trickles
/// bodies cannot take every turn (its further requests get 503 at once).
const MAX_BODIES_PER_PEER: usize = 8;
/// How long a request waits for a turn when every turn holds a body read
/// already (waiting on the engine), none still arriving.
const BODY_TURN_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// The turns to read (and hold) a body: [`MAX_BODIES_IN_FLIGHT`] in all,
/// [`MAX_BODIES_PER_PEER`] per peer address. When every turn is taken, the
/// body that has been arriving longest is cut (`408`, its connection
/// closed) and its turn goes to the newcomer: slow senders from many
/// addresses (64 trickled bodies from 8 of them) cannot make a real
/// delivery wait (it waited 10 s for a turn, then got 503). A body must
/// also arrive within `read_timeout`.
pub(crate) struct Bodies {
    read_timeout: std::time::Duration,
    table: std::sync::Mutex<BodyTable>,
    /// A turn was given back.
    freed: tokio::sync::Notify,
}

#[derive(Default)]
struct BodyTable {
    taken: usize,
    next: u64,
    /// Turns whose body is still arriving, oldest first, with the signal
    /// that cuts it.
    arriving: BTreeMap<u64, Arc<tokio::sync::Notify>>,
    /// Turns taken or waited for, per peer.
    peers: std::collections::HashMap<std::net::IpAddr, usize>,
}

impl Bodies {
    pub(crate) fn new(read_timeout: std::time::Duration) -> Self {
        Self { read_timeout, table: Default::default(), freed: tokio::sync::Notify::new() }
    }

    fn table(&self) -> std::sync::MutexGuard<'_, BodyTable> {
        self.table.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Takes a turn for `peer`: `None` when it holds its share already,
    /// or when every turn holds a body read already and none is given back
    /// within [`BODY_TURN_WAIT`].
    async fn turn(self: &Arc<Self>, peer: std::net::IpAddr) -> Option<Turn> {
        let hold = {
            let mut t = self.table();
            let n = t.peers.entry(peer).or_insert(0);
            if *n >= MAX_BODIES_PER_PEER {
                return None;
            }
            *n += 1;
            // Given back however this ends (a request dropped while it
            // waits too).
            PeerHold { bodies: self.clone(), peer }
        };
        let deadline = tokio::time::Instant::now() + BODY_TURN_WAIT;
        loop {
            let freed = self.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            {
                let mut t = self.table();
                if t.taken < MAX_BODIES_IN_FLIGHT {
                    t.taken += 1;
                    let seq = t.next;
                    t.next += 1;
                    let cut = Arc::new(tokio::sync::Notify::new());
                    t.arriving.insert(seq, cut.clone());
                    return Some(Turn { hold, seq, cut });
                }
                // Every turn is taken: the body arriving longest is cut.
                if let Some((_, cut)) = t.arriving.pop_first() {
                    cut.notify_one();
                }
            }
            tokio::time::timeout_at(deadline, freed).await.ok()?;
        }
    }
}

/// One of a peer's [`MAX_BODIES_PER_PEER`], given back on drop.
struct PeerHold {
    bodies: Arc<Bodies>,
    peer: std::net::IpAddr,
}

impl Drop for PeerHold {
    fn drop(&mut self) {
        let mut t = self.bodies.table();
        if let Some(n) = t.peers.get_mut(&self.peer) {
            *n -= 1;
            if *n == 0 {
                t.peers.remove(&self.peer);
            }
        }
    }
}

/// A turn to read (and hold) one body, given back on drop (its peer's
/// share after it).
pub(crate) struct Turn {
    hold: PeerHold,
    seq: u64,
    /// Notified when this body, still arriving, is cut for a newcomer.
    cut: Arc<tokio::sync::Notify>,
}

impl Turn {
    /// The body has arrived: it is no longer cut for a newcomer.
    fn arrived(&self) {
        self.hold.bodies.table().arriving.remove(&self.seq);
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        let bodies = &self.hold.bodies;
        {
            let mut t = bodies.table();
            t.taken -= 1;
            t.arriving.remove(&self.seq);
        }
        bodies.freed.notify_one();
    }
}

/// The routes (bodies are read with the limit of their endpoint: a
/// larger one is refused 413, before it is read whole; one that does not
/// arrive within `body_timeout` is refused 408).
/// The port's [`Bodies`] are an `Extension` of the whole HTTP port (the
/// dashboard's forms take their turns too).
pub fn routes() -> Router<Arc<Core>> {
    Router::new().route("/hooks/{*rest}", post(hook)).route("/events/{topic}", post(publish))
}

fn answer(status: StatusCode, body: serde_json::Value) -> Response {
    (status, Json(body)).into_response()
}

fn error(status: StatusCode, msg: impl Into<String>) -> Response {
    answer(status, serde_json::json!({ "error": msg.into() }))
}

fn unavailable(msg: impl Into<String>, retry_after: u32) -> Response {
    let mut r = error(StatusCode::SERVICE_UNAVAILABLE, msg);
    r.headers_mut().insert("retry-after", HeaderValue::from(retry_after));
    r
}

fn header_of(headers: &HeaderMap) -> impl Fn(&str) -> Option<String> + '_ {
    move |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).map(str::to_string)
}

/// `408` with the connection closed: a body that did not arrive whole.
fn too_slow(msg: String) -> Response {
    let mut r = error(StatusCode::REQUEST_TIMEOUT, msg);
    r.headers_mut().insert(axum::http::header::CONNECTION, HeaderValue::from_static("close"));
    r
}

/// Reads a body of at most `limit` bytes: `413` as soon as its
/// `Content-Length` says it is larger (before it is sent, to a client
/// that waits for `100 Continue`), or once it passes the limit.
/// At most [`MAX_BODIES_IN_FLIGHT`] bodies are read (and held) at once,
/// [`MAX_BODIES_PER_PEER`] from one `peer` (`503` beyond); one that takes
/// longer than the read timeout to arrive, or is cut for a newcomer while
/// every turn is taken ([`Bodies`]), is refused `408` and its connection
/// closed.
pub(crate) async fn read_body(
    bodies: &Arc<Bodies>,
    headers: &HeaderMap,
    body: Body,
    limit: u64,
    peer: std::net::IpAddr,
) -> Result<(Bytes, Turn), Response> {
    let too_large = |what: String| error(StatusCode::PAYLOAD_TOO_LARGE, format!("{what}; this endpoint takes at most {limit} bytes"));
    if let Some(n) = headers.get("content-length").and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok())
        && n > limit
    {
        return Err(too_large(format!("{n} bytes")));
    }
    let Some(turn) = bodies.turn(peer).await else {
        return Err(unavailable("too many requests are being read; try again", 1));
    };
    let timeout = bodies.read_timeout;
    tokio::select! {
        read = axum::body::to_bytes(body, limit as usize) => match read {
            Ok(b) => {
                turn.arrived();
                Ok((b, turn))
            }
            Err(_) => Err(too_large("the body is larger".into())),
        },
        () = turn.cut.notified() => Err(too_slow(
            "the body was still arriving when every turn to read one was taken: the slowest is cut; send it again".into(),
        )),
        () = tokio::time::sleep(timeout) => Err(too_slow(format!("the body did not arrive within {} s", timeout.as_secs_f64()))),
    }
}

/// `POST /hooks/...`.
async fn hook(
    State(core): State<Arc<Core>>,
    axum::Extension(bodies): axum::Extension<Arc<Bodies>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    uri: Uri,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let path = uri.path().to_string();
    let Ok(engine) = core.engine().await else {
        let (body, _turn) = match read_body(&bodies, &headers, body, MAX_EVENT_BODY_BYTES, peer.ip()).await {
            Ok(b) => b,
            Err(r) => return r,
        };
        return forward(&core, &uri, &headers, body, peer).await;
    };
    let route = match engine.webhook(path.clone()).await {
        Ok(r) => r,
        Err(e) => return unavailable(format!("no leader can take it now: {e}"), 1),
    };
    let Some((task_id, trigger)) = route else {
        return error(StatusCode::NOT_FOUND, format!("no task has a webhook at {path}"));
    };
    let (body, _turn) = match read_body(&bodies, &headers, body, trigger.max_body(), peer.ip()).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    let forwarded_for = headers
        .get(FORWARDED_FOR)
        .filter(|_| headers.contains_key(FORWARDED))
        .and_then(|v| v.to_str().ok())
        .map(|v| v.chars().take(MAX_FORWARDED_FOR).collect::<String>());
    let peer_ip = peer.ip().to_string();
    let checked = match signature::secret_of(&trigger.auth).await {
        Ok(secret) => signature::verify(&trigger.auth, secret.as_deref(), &header_of(&headers), &body, core.clock.now().timestamp()),
        Err(e) => Err(e),
    };
    match checked {
        Ok(()) => {}
        Err(Refusal::Unauthorized(why)) => {
            if let Some(repeats) = crate::auth::refusal_due(&format!("webhook {path} {peer_ip}")) {
                tracing::warn!(
                    path,
                    peer = peer_ip,
                    forwarded_for,
                    why,
                    repeats,
                    "webhook request refused: not authenticated (no record made)"
                );
            }
            return error(StatusCode::UNAUTHORIZED, "not authenticated");
        }
        Err(Refusal::NoSecret(why)) => {
            if crate::auth::refusal_due(&format!("webhook secret {path}")).is_some() {
                tracing::error!(path, why, "a webhook's secret cannot be read on this control plane: its requests are refused 503");
            }
            return unavailable("this webhook's secret cannot be read here", 30);
        }
    }
    let key = match delivery_id(&trigger, &headers, &body) {
        Ok(k) => k,
        Err(why) => return error(StatusCode::BAD_REQUEST, why),
    };
    let mut kept = BTreeMap::new();
    for name in trigger.allowed_headers() {
        if let Some(v) = headers.get(name.as_str()).and_then(|v| v.to_str().ok()) {
            kept.insert(name, v.chars().take(MAX_HEADER_VALUE).collect());
        }
    }
    let mut attributes = BTreeMap::new();
    attributes.insert("peer".to_string(), peer_ip);
    if let Some(f) = forwarded_for {
        attributes.insert("forwarded_for".to_string(), f);
    }
    let run_id = event_run_id(&task_id, TriggerKind::Webhook, &path, &key);
    let mut ev = super::event_request(&task_id, run_id, TriggerKind::Webhook, &path, &key, core.clock.now(), kept, attributes, &body);
    ev.dedup_window = i64::try_from(trigger.dedup_ttl_seconds()).ok().and_then(chrono::Duration::try_seconds);
    match engine.events(vec![ev]).await.map(|mut a| a.pop()) {
        Ok(Some(Ok(a))) => answer(
            StatusCode::ACCEPTED,
            serde_json::json!({"run_id": a.run_id, "deduplicated": !a.created, "skipped": a.skipped.map(|s| s.as_str())}),
        ),
        Ok(Some(Err(Error::NotFound { .. }))) => error(StatusCode::NOT_FOUND, format!("no task has a webhook at {path}")),
        // The history cannot say whether this key made a run (PostgreSQL
        // away): the sender retries, and nothing is run twice.
        Ok(Some(Err(e @ (Error::Unavailable { .. } | Error::Store(_))))) => unavailable(e.to_string(), 5),
        Ok(Some(Err(e))) => error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
        Ok(None) => error(StatusCode::INTERNAL_SERVER_ERROR, "no answer"),
        Err(e) => unavailable(format!("no leader can take it now: {e}"), 1),
    }
}

/// The delivery id of a request: the trigger's dedup header or body field,
/// else the `Idempotency-Key` header, else a fresh one (no dedup).
fn delivery_id(trigger: &WebhookTrigger, headers: &HeaderMap, body: &[u8]) -> Result<String, String> {
    let key = match trigger.dedup.as_ref() {
        Some(d) => match (&d.header, &d.body_field) {
            (Some(h), _) => headers
                .get(h.as_str())
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
                .ok_or_else(|| format!("no {h} header (this webhook's dedup id)"))?,
            (None, Some(field)) => {
                let doc: serde_json::Value = serde_json::from_slice(body)
                    .map_err(|_| format!("the body is not JSON, so it has no {field} (this webhook's dedup id)"))?;
                let v = field
                    .split('.')
                    .try_fold(&doc, |v, k| v.get(k))
                    .ok_or_else(|| format!("the body has no {field} (this webhook's dedup id)"))?;
                match v {
                    serde_json::Value::String(s) => s.clone(),
                    serde_json::Value::Number(n) => n.to_string(),
                    _ => return Err(format!("{field} is not a string or a number (this webhook's dedup id)")),
                }
            }
            (None, None) => uuid::Uuid::new_v4().to_string(),
        },
        None => match headers.get("idempotency-key").and_then(|v| v.to_str().ok()) {
            Some(k) => k.to_string(),
            None => uuid::Uuid::new_v4().to_string(),
        },
    };
    if key.is_empty() || key.chars().count() > MAX_KEY_CHARS {
        return Err(format!("the delivery id must be 1 to {MAX_KEY_CHARS} characters"));
    }
    Ok(key)
}

/// `POST /events/{topic}`: publishes an event (as `PublishEvent`).
async fn publish(
    State(core): State<Arc<Core>>,
    axum::Extension(bodies): axum::Extension<Arc<Bodies>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    Path(topic): Path<String>,
    uri: Uri,
    headers: HeaderMap,
    body: Body,
) -> Response {
    if let Err(status) = core.auth.authorize("/punchclock.v1.TaskService/PublishEvent", &headers, None) {
        let code = if status.code() == tonic::Code::PermissionDenied { StatusCode::FORBIDDEN } else { StatusCode::UNAUTHORIZED };
        return error(code, status.message());
    }
    let (body, _turn) = match read_body(&bodies, &headers, body, crate::model::task::MAX_PARAMS_BYTES as u64, peer.ip()).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    if core.engine().await.is_err() {
        return forward(&core, &uri, &headers, body, peer).await;
    }
    let Some(key) = headers.get("idempotency-key").and_then(|v| v.to_str().ok()) else {
        return error(
            StatusCode::BAD_REQUEST,
            "Idempotency-Key header required: the same key makes no second run of a task within its window (Idempotency-TTL, 24h by default)",
        );
    };
    let Ok(payload) = std::str::from_utf8(&body) else {
        return error(StatusCode::BAD_REQUEST, "payload_json: not UTF-8 JSON");
    };
    // `Idempotency-TTL: 2h` (optional): how long the key finds its runs.
    let ttl = headers.get("idempotency-ttl").and_then(|v| v.to_str().ok()).unwrap_or_default();
    match core.publish_event(&topic, payload, key, ttl).await {
        Ok(runs) => answer(
            StatusCode::ACCEPTED,
            serde_json::json!({"runs": runs.into_iter().map(|(task_id, a)| serde_json::json!({
                "task_id": task_id, "run_id": a.run_id, "created": a.created, "skipped": a.skipped.map(|s| s.as_str())})).collect::<Vec<_>>()}),
        ),
        Err(e @ Error::InvalidArgument { .. }) => error(StatusCode::BAD_REQUEST, e.to_string()),
        Err(e) => unavailable(e.to_string(), 1),
    }
}

/// A follower's part: the request goes to the leader's HTTP port as it
/// came, and its answer comes back as it is. `503` with `Retry-After`
/// when no leader is known (or it is this one, whose engine is not up), or
/// the request was forwarded once already.
pub(crate) async fn forward(core: &Core, uri: &Uri, headers: &HeaderMap, body: Bytes, peer: SocketAddr) -> Response {
    if headers.contains_key(FORWARDED) {
        return unavailable("forwarded to a replica that no longer leads; try again", 1);
    }
    let leader = core.leader().await.filter(|l| l.leader_id != core.election.id());
    let Some(base) = leader.map(|l| l.http_address).filter(|a| !a.is_empty()) else {
        return unavailable("no leader can take it now (none elected, or it has no HTTP port)", 1);
    };
    static CLIENT: std::sync::OnceLock<reqwest::Client> = std::sync::OnceLock::new();
    let client = CLIENT.get_or_init(|| {
        reqwest::Client::builder()
            .timeout(std::time::Duration::from_secs(30))
            // Below the leader's header read timeout (10 s by default), which
            // closes kept-alive connections: a pooled one is let go first.
            .pool_idle_timeout(std::time::Duration::from_secs(5))
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .unwrap_or_default()
    });
    let url = format!("{}{}", base.trim_end_matches('/'), uri.path_and_query().map_or(uri.path(), |p| p.as_str()));
    let mut req = client.post(&url).body(body);
    for (name, value) in headers {
        if !matches!(name.as_str(), "host" | "content-length" | "connection" | "transfer-encoding" | "keep-alive" | "upgrade") {
            req = req.header(name.as_str(), value.as_bytes());
        }
    }
    req = req.header(FORWARDED, core.election.id()).header(FORWARDED_FOR, peer.ip().to_string());
    match req.send().await {
        Ok(resp) => {
            let status = StatusCode::from_u16(resp.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
            let retry = resp.headers().get("retry-after").and_then(|v| v.to_str().ok()).map(str::to_string);
            let ctype = resp.headers().get("content-type").and_then(|v| v.to_str().ok()).map(str::to_string);
            // The leader's answers are small JSON documents.
            let bytes = resp.bytes().await.unwrap_or_default();
            let mut r = (status, bytes).into_response();
            if let Some(v) = retry.and_then(|v| HeaderValue::from_str(&v).ok()) {
                r.headers_mut().insert("retry-after", v);
            }
            if let Some(v) = ctype.and_then(|v| HeaderValue::from_str(&v).ok()) {
                r.headers_mut().insert("content-type", v);
            }
            r
        }
        Err(e) => unavailable(format!("the leader at {base} cannot be reached: {e}"), 1),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(i: usize) -> std::net::IpAddr {
        std::net::IpAddr::from([10, 0, (i / 250) as u8, (i % 250) as u8])
    }

    /// Every turn taken by bodies still arriving (8 addresses, 8 each): a
    /// newcomer cuts the one arriving longest and gets its turn at once,
    /// instead of waiting 10 s for a 503.
    #[tokio::test]
    async fn a_newcomer_cuts_the_body_arriving_longest() {
        let bodies = Arc::new(Bodies::new(std::time::Duration::from_secs(10)));
        let mut turns = Vec::new();
        for i in 0..MAX_BODIES_IN_FLIGHT {
            turns.push(bodies.turn(peer(i / MAX_BODIES_PER_PEER)).await.expect("a free turn"));
        }
        assert!(bodies.turn(peer(0)).await.is_none(), "an address at its share is refused at once");
        let oldest = turns.remove(0);
        let waiter = tokio::spawn({
            let bodies = bodies.clone();
            async move { bodies.turn(peer(1000)).await.map(|t| t.seq) }
        });
        tokio::time::timeout(std::time::Duration::from_secs(1), oldest.cut.notified()).await.expect("the oldest is cut");
        drop(oldest);
        let got = tokio::time::timeout(std::time::Duration::from_secs(1), waiter).await.expect("at once").expect("joined");
        assert!(got.is_some(), "the newcomer reads its body");
    }

    /// Bodies read already (waiting on the leader) are not cut: a newcomer
    /// waits for one to be given back.
    #[tokio::test]
    async fn bodies_read_already_are_not_cut() {
        let bodies = Arc::new(Bodies::new(std::time::Duration::from_secs(10)));
        let mut turns = Vec::new();
        for i in 0..MAX_BODIES_IN_FLIGHT {
            let t = bodies.turn(peer(i / MAX_BODIES_PER_PEER)).await.expect("a free turn");
            t.arrived();
            turns.push(t);
        }
        let waiter = tokio::spawn({
            let bodies = bodies.clone();
            async move { bodies.turn(peer(1000)).await.is_some() }
        });
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        assert!(!waiter.is_finished(), "waits for a turn");
        drop(turns.pop());
        assert!(tokio::time::timeout(std::time::Duration::from_secs(1), waiter).await.expect("woken").expect("joined"));
        assert_eq!(bodies.table().peers.get(&peer(7)), Some(&7), "a dropped turn gives its address's share back");
    }
}
