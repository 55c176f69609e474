//! The HTTP executor: an agent served over HTTP (`type: http` in the agents
//! file) — a FastAPI or LangServe endpoint, a serverless function, an agent
//! gateway. The runner calls it instead of starting a process; everything
//! else (slots, the fence, heartbeats, `Finished`) is as for a process.
//!
//! # The request
//!
//! `POST` (or the agent's `method`) to `url`, through one connection pool
//! per agent (at most `max_in_flight` requests at once; an execution waits
//! for its turn within its deadline), with:
//! - the body: the run's context JSON — what a process agent reads on stdin;
//! - `Content-Type: application/json`, `Idempotency-Key: <execution id>`
//!   (the same when an assignment is sent again), `traceparent` and
//!   `tracestate` (the runner's `invoke_agent` span), `Punchclock-Run-Id`,
//!   `Punchclock-Attempt`, the agent's `headers`;
//! - with `signing_secret_file`: `Punchclock-Signature: t=<unix>,v1=<hex
//!   HMAC-SHA256(secret, "<t>.<body>")>` (the scheme of outgoing
//!   notifications);
//! - with the runner's callback server: `Punchclock-Callback-Url` and a
//!   token for this execution alone, `Punchclock-Callback-Token`.
//!
//! # The answer
//!
//! | status | outcome |
//! |---|---|
//! | 2xx (not 202) | success; a JSON body is the result (its `outcome`, `retry_after_seconds`, `usage`... as from a result file), other bytes a JSON string |
//! | 202 | asynchronous: the agent reports later through the callback (below) |
//! | 429 | `rate_limited`: retried at `Retry-After` (seconds or an HTTP date; 1 s without), not counted against `max_retries`; the shared resource named by a `Punchclock-Resource` header, else by the agent's `rate_limit_resource`, is held back until then |
//! | 408, 425, 5xx | failed, retried per `max_retries`, no earlier than `Retry-After` when given |
//! | other 4xx | `non_retryable`: the run fails now |
//! | no answer (connection refused, reset, TLS) | failed, retried per `max_retries` |
//!
//! A body is read up to 1 MiB ([`crate::executor::MAX_RESULT_BYTES`]); a
//! larger one fails the attempt. The first 4 KiB of an error answer are
//! kept as the attempt's output tail.
//!
//! # Long agents: the callback
//!
//! After a `202`, the agent calls the runner back within the run's
//! deadline (`Authorization: Bearer <Punchclock-Callback-Token>`):
//! `POST <callback>/progress` with `{percent, message, checkpoint}` (any
//! number of times), then `POST <callback>/result` with the result JSON
//! (once). The deadline, a cancel and the runner's fence end it as for a
//! process, and then `cancel_url` is called when the agent has one. A
//! runner that dies meanwhile is lost like any other: the control plane
//! retries the attempt elsewhere, and the agent's late callback is
//! refused.
//!
//! The callback's answers ([`CallbackAnswer`]): `204` taken; `401`
//! another token; `404` an execution that is over (a progress report after
//! the result, a result after a timeout or cancel) or was never on this
//! runner; `409` a second result — while the runner remembers the first
//! ([`ANSWERED_REMEMBERED`] results back; older ones are `404`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use punchclock_proto::v1::{Assign, Finished, InFlight, Outcome, ProgressReport};
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, info, warn};

use crate::config::HttpAgent;
use crate::executor::{Execution, ExecutionEvent, MAX_RESULT_BYTES, StopRequest};
use crate::{Error, time as clock};

/// How much of an error answer's body is kept (as the attempt's stdout tail).
const ERROR_BODY_BYTES: usize = 4096;

/// The header by which a `429` names the shared resource it holds back
/// (wins over the agent's `rate_limit_resource`).
pub const RESOURCE_HEADER: &str = "punchclock-resource";

/// How many finished asynchronous executions whose result came by callback
/// the runner remembers, to answer a second result `409` rather than `404`
/// (an id and a token each, about 200 bytes: under 1 MiB).
pub const ANSWERED_REMEMBERED: usize = 4096;

/// One agent's client: its connection pool and its turns.
#[derive(Debug, Clone)]
pub struct AgentClient {
    client: reqwest::Client,
    turns: Arc<tokio::sync::Semaphore>,
    /// The agent's definition, shared by its executions (one `Arc` clone
    /// per request, not a copy of its URL and headers).
    agent: Arc<HttpAgent>,
}

impl AgentClient {
    /// The client of `agent` (its TLS files read now).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] naming the agent's unreadable or invalid TLS file.
    pub fn new(id: &str, agent: &HttpAgent) -> Result<AgentClient, Error> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let bad = |what: &str, e: String| Error::InvalidConfig(format!("agents.{id}.tls.{what}: {e}"));
        let mut b = reqwest::Client::builder()
            .pool_max_idle_per_host(agent.max_in_flight as usize)
            .tcp_nodelay(true)
            .redirect(reqwest::redirect::Policy::none());
        if let Some(ca) = &agent.tls.ca_file {
            let pem = std::fs::read(ca).map_err(|e| bad("ca_file", e.to_string()))?;
            for cert in reqwest::Certificate::from_pem_bundle(&pem).map_err(|e| bad("ca_file", e.to_string()))? {
                b = b.add_root_certificate(cert);
            }
        }
        if let (Some(cert), Some(key)) = (&agent.tls.cert_file, &agent.tls.key_file) {
            let mut pem = std::fs::read(cert).map_err(|e| bad("cert_file", e.to_string()))?;
            pem.extend(std::fs::read(key).map_err(|e| bad("key_file", e.to_string()))?);
            b = b.identity(reqwest::Identity::from_pem(&pem).map_err(|e| bad("cert_file", e.to_string()))?);
        }
        let client = b.build().map_err(|e| Error::InvalidConfig(format!("agents.{id}: {e}")))?;
        Ok(AgentClient {
            client,
            turns: Arc::new(tokio::sync::Semaphore::new(agent.max_in_flight as usize)),
            agent: Arc::new(agent.clone()),
        })
    }
}

/// The runner's callback server's side of the asynchronous executions:
/// who may report what, by execution id.
#[derive(Debug, Default)]
pub struct Callbacks {
    /// The server's advertised base URL (`http://host:port`), if it runs.
    pub base: Mutex<Option<String>>,
    state: Mutex<CallbackState>,
}

#[derive(Debug, Default)]
struct CallbackState {
    /// Executions in progress, by id.
    waiting: HashMap<String, Waiting>,
    /// Finished executions whose result came by callback, by id: their
    /// token and the sequence number of their entry in `order`.
    answered: HashMap<String, (u64, String)>,
    /// `answered`'s ids, oldest first (at most [`ANSWERED_REMEMBERED`]).
    order: std::collections::VecDeque<(u64, String)>,
    /// The next entry's sequence number.
    seq: u64,
}

#[derive(Debug)]
struct Waiting {
    token: String,
    progress: mpsc::Sender<ProgressReport>,
    result: Option<oneshot::Sender<serde_json::Value>>,
    run_id: String,
}

/// What a callback got.
#[derive(Debug, PartialEq, Eq)]
pub enum CallbackAnswer {
    /// Taken (`204`).
    Taken,
    /// No such execution waiting here (`404`): over (its result already
    /// in, or it ended without one), or never here.
    Unknown,
    /// Bad or missing token (`401`).
    Unauthorized,
    /// Its result came already (`409`), while the execution was still
    /// waiting or since it finished (one of the last
    /// [`ANSWERED_REMEMBERED`]).
    AlreadyDone,
}

impl Callbacks {
    fn register(
        &self,
        execution_id: &str,
        run_id: &str,
    ) -> Option<(String, String, mpsc::Receiver<ProgressReport>, oneshot::Receiver<serde_json::Value>)> {
        let base = self.base.lock().unwrap_or_else(PoisonError::into_inner).clone()?;
        let token = hex::encode(rand::random::<[u8; 32]>());
        let (ptx, prx) = mpsc::channel(64);
        let (rtx, rrx) = oneshot::channel();
        let url = format!("{}/v1/executions/{execution_id}", base.trim_end_matches('/'));
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.answered.remove(execution_id);
        state.waiting.insert(
            execution_id.to_string(),
            Waiting { token: token.clone(), progress: ptx, result: Some(rtx), run_id: run_id.to_string() },
        );
        Some((url, token, prx, rrx))
    }

    /// The execution is over: no more callbacks. One whose result came is
    /// remembered (the last [`ANSWERED_REMEMBERED`]), so that a second
    /// result is answered `409`.
    fn forget(&self, execution_id: &str) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(entry) = state.waiting.remove(execution_id) else { return };
        if entry.result.is_some() {
            return;
        }
        let seq = state.seq;
        state.seq += 1;
        state.answered.insert(execution_id.to_string(), (seq, entry.token));
        state.order.push_back((seq, execution_id.to_string()));
        while state.order.len() > ANSWERED_REMEMBERED {
            let Some((old, id)) = state.order.pop_front() else { break };
            // Unless the id was registered and answered again since.
            if state.answered.get(&id).is_some_and(|(s, _)| *s == old) {
                state.answered.remove(&id);
            }
        }
    }

    /// Whether `token` is `expected`, in time independent of where they differ.
    fn same_token(expected: &str, token: &str) -> bool {
        let (a, b) = (expected.as_bytes(), token.as_bytes());
        a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
    }

    fn check<'a>(w: &'a mut HashMap<String, Waiting>, execution_id: &str, token: &str) -> Result<&'a mut Waiting, CallbackAnswer> {
        let entry = w.get_mut(execution_id).ok_or(CallbackAnswer::Unknown)?;
        if Self::same_token(&entry.token, token) { Ok(entry) } else { Err(CallbackAnswer::Unauthorized) }
    }

    /// A progress report of an asynchronous execution.
    pub fn progress(&self, execution_id: &str, token: &str, body: &serde_json::Value) -> CallbackAnswer {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let entry = match Self::check(&mut state.waiting, execution_id, token) {
            Ok(e) => e,
            Err(a) => return a,
        };
        if entry.result.is_none() {
            // Its result is in: the execution is over.
            return CallbackAnswer::Unknown;
        }
        let report = ProgressReport {
            run_id: entry.run_id.clone(),
            execution_id: execution_id.to_string(),
            percent: body.get("percent").and_then(serde_json::Value::as_f64).map(|p| p.clamp(0.0, 100.0)),
            message: body.get("message").and_then(serde_json::Value::as_str).unwrap_or_default().chars().take(4096).collect(),
            checkpoint_json: body.get("checkpoint").map(|c| c.to_string()).unwrap_or_default(),
        };
        // A full queue drops the report: progress is a sample, not a log.
        let _ = entry.progress.try_send(report);
        CallbackAnswer::Taken
    }

    /// The result of an asynchronous execution.
    pub fn result(&self, execution_id: &str, token: &str, body: serde_json::Value) -> CallbackAnswer {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((_, expected)) = state.answered.get(execution_id) {
            return if Self::same_token(expected, token) { CallbackAnswer::AlreadyDone } else { CallbackAnswer::Unauthorized };
        }
        let entry = match Self::check(&mut state.waiting, execution_id, token) {
            Ok(e) => e,
            Err(a) => return a,
        };
        match entry.result.take() {
            Some(tx) => {
                let _ = tx.send(body);
                CallbackAnswer::Taken
            }
            None => CallbackAnswer::AlreadyDone,
        }
    }
}

/// The callback server: `POST /v1/executions/{id}/progress` and
/// `/result`, bearer token of the execution; bodies up to 1 MiB.
pub fn callback_routes(callbacks: Arc<Callbacks>) -> axum::Router {
    use axum::extract::{DefaultBodyLimit, Path, State};
    use axum::http::{HeaderMap, StatusCode};
    use axum::routing::post;
    fn token(h: &HeaderMap) -> String {
        h.get("authorization").and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer ")).unwrap_or_default().trim().to_string()
    }
    fn status(a: CallbackAnswer) -> StatusCode {
        match a {
            CallbackAnswer::Taken => StatusCode::NO_CONTENT,
            CallbackAnswer::Unknown => StatusCode::NOT_FOUND,
            CallbackAnswer::Unauthorized => StatusCode::UNAUTHORIZED,
            CallbackAnswer::AlreadyDone => StatusCode::CONFLICT,
        }
    }
    fn json(body: &[u8]) -> Result<serde_json::Value, StatusCode> {
        serde_json::from_slice(body).map_err(|_| StatusCode::BAD_REQUEST)
    }
    async fn progress(State(c): State<Arc<Callbacks>>, Path(id): Path<String>, h: HeaderMap, body: axum::body::Bytes) -> StatusCode {
        match json(&body) {
            Ok(v) => status(c.progress(&id, &token(&h), &v)),
            Err(s) => s,
        }
    }
    async fn result(State(c): State<Arc<Callbacks>>, Path(id): Path<String>, h: HeaderMap, body: axum::body::Bytes) -> StatusCode {
        match json(&body) {
            Ok(v) => status(c.result(&id, &token(&h), v)),
            Err(s) => s,
        }
    }
    axum::Router::new()
        .route("/v1/executions/{id}/progress", post(progress))
        .route("/v1/executions/{id}/result", post(result))
        .layer(DefaultBodyLimit::max(MAX_RESULT_BYTES as usize))
        .with_state(callbacks)
}

/// Starts `assign` on the HTTP agent of `client`: the request goes out in
/// a task of its own, which sends the execution's events to `events`.
///
/// # Errors
///
/// None today: a request that cannot be sent ends the attempt FAILED
/// through `events`, like an agent that exits non-zero.
pub fn start(
    client: &AgentClient,
    callbacks: &Arc<Callbacks>,
    assign: &Assign,
    events: mpsc::Sender<ExecutionEvent>,
) -> Result<Execution, Error> {
    let invoke = crate::trace::InvokeSpan::begin(assign);
    let traceparent = invoke.as_ref().map(|s| s.traceparent()).unwrap_or_else(|| assign.traceparent.clone());
    let started_at = clock::now_timestamp();
    let in_flight = InFlight {
        run_id: assign.run_id.clone(),
        execution_id: assign.execution_id.clone(),
        attempt: assign.attempt,
        started_at: Some(started_at),
    };
    let deadline = assign.deadline.as_ref().and_then(clock::from_timestamp);
    let mut timeout = deadline.map(|d| (d - clock::now()).to_std().unwrap_or(Duration::ZERO));
    let agent = &client.agent;
    if let Some(t) = agent.timeout {
        timeout = Some(timeout.map_or(t, |d| d.min(t)));
    }
    let (cancel_tx, cancel_rx) = oneshot::channel();
    let call = Call {
        client: client.clone(),
        callbacks: callbacks.clone(),
        assign: assign.clone(),
        traceparent,
        in_flight: in_flight.clone(),
        started_at,
        timeout,
        events,
        invoke,
    };
    debug!(run_id = %assign.run_id, execution_id = %assign.execution_id, agent_id = %assign.agent_id, url = %agent.url, "execution started (http)");
    tokio::spawn(call.run(cancel_rx));
    Ok(Execution::new(in_flight, 0, started_at, cancel_tx))
}

/// One execution's request, and what follows it.
struct Call {
    client: AgentClient,
    callbacks: Arc<Callbacks>,
    assign: Assign,
    traceparent: String,
    in_flight: InFlight,
    started_at: prost_types::Timestamp,
    timeout: Option<Duration>,
    events: mpsc::Sender<ExecutionEvent>,
    invoke: Option<crate::trace::InvokeSpan>,
}

/// How an execution ended, before it becomes a `Finished`.
struct End {
    outcome: Outcome,
    result_json: String,
    error: String,
    exit_code: Option<i32>,
    output: String,
}

impl End {
    fn failed(error: String) -> End {
        End { outcome: Outcome::Failed, result_json: String::new(), error, exit_code: None, output: String::new() }
    }
}

impl Call {
    async fn run(self, cancel: oneshot::Receiver<StopRequest>) {
        let execution_id = self.in_flight.execution_id.clone();
        let timeout = self.timeout;
        let deadline = async {
            match timeout {
                Some(t) => tokio::time::sleep(t).await,
                None => std::future::pending().await,
            }
        };
        let cancelled = async {
            match cancel.await {
                Ok(r) => r,
                Err(_) => std::future::pending().await,
            }
        };
        tokio::pin!(deadline, cancelled);
        let mut asynchronous = false;
        let end = tokio::select! {
            end = self.call(&mut asynchronous) => end,
            () = &mut deadline => {
                self.cancel_remote(asynchronous).await;
                End { outcome: Outcome::Timeout, ..End::failed(format!("timed out after {} s", timeout.map_or(0, |t| t.as_secs()))) }
            }
            request = &mut cancelled => {
                self.cancel_remote(asynchronous).await;
                match request {
                    StopRequest::Cancel(r) => End { outcome: Outcome::Cancelled, ..End::failed(if r.is_empty() { "cancelled".into() } else { format!("cancelled: {r}") }) },
                    StopRequest::Interrupt(r) => End { outcome: Outcome::Interrupted, ..End::failed(format!("interrupted: {r}")) },
                }
            }
        };
        self.callbacks.forget(&execution_id);
        let finished = Finished {
            run_id: self.in_flight.run_id.clone(),
            execution_id: execution_id.clone(),
            outcome: end.outcome.into(),
            result_json: end.result_json.clone(),
            error: end.error.clone(),
            exit_code: end.exit_code,
            stdout_tail: end.output,
            stderr_tail: String::new(),
            finished_at: Some(clock::now_timestamp()),
            started_at: Some(self.started_at),
            ..Finished::default()
        };
        if let Some(span) = &self.invoke {
            let at = |ts: prost_types::Timestamp| {
                clock::from_timestamp(&ts).map(std::time::SystemTime::from).unwrap_or_else(std::time::SystemTime::now)
            };
            span.end(
                at(self.started_at),
                std::time::SystemTime::now(),
                crate::executor::outcome_label(end.outcome).as_str(),
                end.exit_code,
                &end.result_json,
                &end.error,
            );
        }
        if finished.error.is_empty() {
            debug!(run_id = %finished.run_id, execution_id, outcome = finished.outcome().as_str_name(), "execution finished (http)");
        } else {
            info!(run_id = %finished.run_id, execution_id, outcome = finished.outcome().as_str_name(), error = %finished.error, "execution finished (http)");
        }
        let _ = self.events.send(ExecutionEvent::Finished(finished)).await;
    }

    /// The request (after a turn of the agent's pool), and — after a 202 —
    /// the wait for the callback's result.
    async fn call(&self, asynchronous: &mut bool) -> End {
        let Ok(_turn) = self.client.turns.acquire().await else { return End::failed("the agent's client is closed".into()) };
        let body = self.assign.context_json.clone().into_bytes();
        let method = reqwest::Method::from_bytes(self.client.agent.method.as_bytes()).unwrap_or(reqwest::Method::POST);
        let mut req = self
            .client
            .client
            .request(method, &self.client.agent.url)
            .header("content-type", "application/json")
            .header("idempotency-key", &self.assign.execution_id)
            .header("punchclock-run-id", &self.assign.run_id)
            .header("punchclock-attempt", self.assign.attempt.to_string());
        if !self.traceparent.is_empty() {
            req = req.header("traceparent", &self.traceparent);
        }
        if !self.assign.tracestate.is_empty() {
            req = req.header("tracestate", &self.assign.tracestate);
        }
        for (k, v) in &self.client.agent.headers {
            req = req.header(k.as_str(), v.as_str());
        }
        if let Some(f) = &self.client.agent.signing_secret_file {
            match std::fs::read_to_string(f) {
                Ok(secret) => {
                    let secret = secret.strip_suffix('\n').unwrap_or(&secret).to_string();
                    req = req.header("punchclock-signature", punchclock_proto::signature::sign(&secret, clock::now().timestamp(), &body));
                }
                Err(e) => return End::failed(format!("cannot read signing_secret_file {}: {e}", f.display())),
            }
        }
        // Registered before the request: the agent may call back before
        // its 202 arrives here.
        let callback = self.callbacks.register(&self.assign.execution_id, &self.assign.run_id);
        if let Some((url, token, _, _)) = &callback {
            req = req.header("punchclock-callback-url", url.as_str()).header("punchclock-callback-token", token.as_str());
        }
        let resp = match req.body(body).send().await {
            Ok(r) => r,
            Err(e) => return End::failed(format!("no answer from {}: {}", self.client.agent.url, error_chain(&e))),
        };
        let status = resp.status().as_u16();
        let retry_after = resp.headers().get("retry-after").and_then(|v| v.to_str().ok()).and_then(parse_retry_after);
        let resource = if status == 429 {
            limited_resource(resp.headers(), self.client.agent.rate_limit_resource.as_deref(), &self.assign.execution_id)
        } else {
            None
        };
        let bytes = match read_bounded(resp).await {
            Ok(b) => b,
            Err(e) => return End { exit_code: Some(i32::from(status)), ..End::failed(e) },
        };
        if status == 202 {
            let Some((_, _, mut progress, result)) = callback else {
                return End {
                    exit_code: Some(202),
                    ..End::failed(
                        "the agent answered 202 (asynchronous), but this runner has no callback server (--callback-listen)".into(),
                    )
                };
            };
            *asynchronous = true;
            debug!(execution_id = %self.assign.execution_id, "asynchronous: waiting for the callback");
            tokio::pin!(result);
            loop {
                tokio::select! {
                    Some(p) = progress.recv() => {
                        let _ = self.events.send(ExecutionEvent::Progress(p)).await;
                    }
                    r = &mut result => {
                        return match r {
                            Ok(v) => End { outcome: Outcome::Succeeded, result_json: v.to_string(), error: String::new(), exit_code: Some(202), output: String::new() },
                            Err(_) => End::failed("the callback went away".into()),
                        };
                    }
                }
            }
        }
        map_answer(status, retry_after, resource.as_deref(), &bytes)
    }

    /// Tells an asynchronous agent its execution is over (`cancel_url`).
    async fn cancel_remote(&self, asynchronous: bool) {
        let Some(url) = self.client.agent.cancel_url.as_ref().filter(|_| asynchronous) else { return };
        let body = serde_json::json!({"execution_id": self.assign.execution_id, "run_id": self.assign.run_id}).to_string();
        let mut req =
            self.client.client.post(url).header("content-type", "application/json").header("idempotency-key", &self.assign.execution_id);
        for (k, v) in &self.client.agent.headers {
            req = req.header(k.as_str(), v.as_str());
        }
        match tokio::time::timeout(Duration::from_secs(10), req.body(body).send()).await {
            Ok(Ok(r)) => debug!(status = r.status().as_u16(), url, "cancel_url called"),
            Ok(Err(e)) => warn!(url, error = %e, "cannot call the agent's cancel_url"),
            Err(_) => warn!(url, "the agent's cancel_url did not answer within 10 s"),
        }
    }
}

/// The shared resource a `429` holds back: its `Punchclock-Resource`
/// header when that is a valid resource name (an invalid one is logged and
/// ignored), else the agent's `rate_limit_resource` (`file`).
fn limited_resource(headers: &reqwest::header::HeaderMap, file: Option<&str>, execution_id: &str) -> Option<String> {
    if let Some(v) = headers.get(RESOURCE_HEADER) {
        match v.to_str().map(str::trim) {
            Ok(name) if punchclock_proto::resources::is_valid_name(name) => return Some(name.to_string()),
            _ => warn!(
                execution_id,
                value = %String::from_utf8_lossy(v.as_bytes()).chars().take(80).collect::<String>(),
                "the agent's 429 names an invalid resource in Punchclock-Resource ({}); ignored",
                punchclock_proto::resources::NAME_RULE
            ),
        }
    }
    file.map(str::to_string)
}

/// What an answer means (see the module docs' table); `resource`: the
/// shared resource a `429` names (put in its outcome as `resource`).
fn map_answer(status: u16, retry_after: Option<u64>, resource: Option<&str>, bytes: &[u8]) -> End {
    let text = String::from_utf8_lossy(bytes);
    let output: String = text.chars().take(ERROR_BODY_BYTES).collect();
    let failed = |outcome: &str, retry: Option<u64>, error: String| {
        let mut r = serde_json::json!({"outcome": outcome, "class": format!("http_{status}")});
        if let Some(s) = retry {
            r["retry_after_seconds"] = s.into();
        }
        if let Some(name) = resource.filter(|_| outcome == "rate_limited") {
            r["resource"] = name.into();
        }
        End { outcome: Outcome::Failed, result_json: r.to_string(), error, exit_code: Some(i32::from(status)), output: output.clone() }
    };
    match status {
        200..=299 => {
            let result_json = if bytes.is_empty() {
                String::new()
            } else {
                match serde_json::from_slice::<serde_json::Value>(bytes) {
                    Ok(v) => v.to_string(),
                    Err(_) => serde_json::Value::String(text.to_string()).to_string(),
                }
            };
            End {
                outcome: Outcome::Succeeded,
                result_json,
                error: String::new(),
                exit_code: Some(i32::from(status)),
                output: String::new(),
            }
        }
        429 => failed(
            "rate_limited",
            Some(retry_after.unwrap_or(1)),
            match resource {
                Some(name) => format!("HTTP 429 Too Many Requests (retry after {} s; resource {name})", retry_after.unwrap_or(1)),
                None => format!("HTTP 429 Too Many Requests (retry after {} s)", retry_after.unwrap_or(1)),
            },
        ),
        408 | 425 | 500..=599 => failed("failure", retry_after, format!("HTTP {status}: retryable")),
        _ => failed("non_retryable", None, format!("HTTP {status}: not retryable")),
    }
}

/// The body, at most [`MAX_RESULT_BYTES`].
async fn read_bounded(mut resp: reqwest::Response) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    loop {
        match resp.chunk().await {
            Ok(Some(c)) => {
                if out.len() + c.len() > MAX_RESULT_BYTES as usize {
                    return Err(format!("the answer's body is over {MAX_RESULT_BYTES} bytes"));
                }
                out.extend_from_slice(&c);
            }
            Ok(None) => return Ok(out),
            Err(e) => return Err(format!("reading the answer: {}", error_chain(&e))),
        }
    }
}

/// `Retry-After`: seconds, or an HTTP date (seconds from now, at least 0).
fn parse_retry_after(v: &str) -> Option<u64> {
    if let Ok(s) = v.trim().parse::<u64>() {
        return Some(s.min(86_400));
    }
    let t = chrono::DateTime::parse_from_rfc2822(v.trim()).ok()?;
    Some((t.timestamp() - clock::now().timestamp()).clamp(0, 86_400) as u64)
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_map_to_outcomes() {
        let r = |e: &End| serde_json::from_str::<serde_json::Value>(&e.result_json).unwrap_or_default();
        let ok = map_answer(200, None, None, br#"{"summary": "ok"}"#);
        assert_eq!((ok.outcome, r(&ok)["summary"].as_str()), (Outcome::Succeeded, Some("ok")));
        let text = map_answer(201, None, None, b"plain");
        assert_eq!(r(&text), serde_json::json!("plain"));
        let limited = map_answer(429, Some(7), None, b"slow down");
        assert_eq!((r(&limited)["outcome"].as_str(), r(&limited)["retry_after_seconds"].as_u64()), (Some("rate_limited"), Some(7)));
        assert_eq!(limited.output, "slow down");
        assert!(r(&limited).get("resource").is_none(), "a plain 429 names no resource");
        let named = map_answer(429, Some(7), Some("llm"), b"");
        assert_eq!((r(&named)["outcome"].as_str(), r(&named)["resource"].as_str()), (Some("rate_limited"), Some("llm")));
        assert!(named.error.contains("resource llm"), "{}", named.error);
        for s in [408, 425, 500, 503] {
            assert_eq!(r(&map_answer(s, None, None, b""))["outcome"], "failure", "{s}");
        }
        assert_eq!(r(&map_answer(503, Some(3), None, b""))["retry_after_seconds"], 3);
        for s in [400, 401, 404, 422] {
            assert_eq!(r(&map_answer(s, None, None, b""))["outcome"], "non_retryable", "{s}");
        }
        assert_eq!(parse_retry_after("12"), Some(12));
        assert_eq!(parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT"), Some(0), "a past date: at once");
        assert_eq!(parse_retry_after("soon"), None);
    }

    #[test]
    fn a_429_names_the_header_resource_over_the_file() {
        let h = |v: Option<&str>| {
            let mut m = reqwest::header::HeaderMap::new();
            if let Some(v) = v {
                m.insert(RESOURCE_HEADER, reqwest::header::HeaderValue::from_str(v).expect("header"));
            }
            m
        };
        assert_eq!(limited_resource(&h(None), None, "e"), None);
        assert_eq!(limited_resource(&h(None), Some("llm"), "e").as_deref(), Some("llm"));
        assert_eq!(limited_resource(&h(Some(" openai ")), Some("llm"), "e").as_deref(), Some("openai"), "the header wins");
        assert_eq!(limited_resource(&h(Some("open ai")), Some("llm"), "e").as_deref(), Some("llm"), "an invalid header is ignored");
        assert_eq!(limited_resource(&h(Some("")), None, "e"), None);
    }

    /// The README promised `409` for a second result; once the execution
    /// had ended (which the first result does at once) it was `404`, as
    /// for an execution never on the runner.
    #[test]
    fn a_second_result_after_the_end_is_a_conflict() {
        let c = Callbacks::default();
        *c.base.lock().unwrap() = Some("http://127.0.0.1:1".into());
        let (_, token, _progress, _result) = c.register("e1", "r1").expect("registered");
        assert_eq!(c.result("e1", &token, serde_json::json!({"ok": true})), CallbackAnswer::Taken);
        assert_eq!(c.progress("e1", &token, &serde_json::json!({})), CallbackAnswer::Unknown, "over once its result is in");
        c.forget("e1");
        assert_eq!(c.result("e1", &token, serde_json::json!({})), CallbackAnswer::AlreadyDone);
        assert_eq!(c.result("e1", "wrong", serde_json::json!({})), CallbackAnswer::Unauthorized);
        assert_eq!(c.progress("e1", &token, &serde_json::json!({})), CallbackAnswer::Unknown);
        // Ended without a result (timeout, cancel): a late result is 404.
        let (_, t2, _p2, _r2) = c.register("e2", "r2").expect("registered");
        c.forget("e2");
        assert_eq!(c.result("e2", &t2, serde_json::json!({})), CallbackAnswer::Unknown);
        // Remembered for the last ANSWERED_REMEMBERED results only.
        for i in 0..ANSWERED_REMEMBERED {
            let id = format!("x{i}");
            let (_, t, _p, _r) = c.register(&id, "r").expect("registered");
            assert_eq!(c.result(&id, &t, serde_json::json!({})), CallbackAnswer::Taken);
            c.forget(&id);
        }
        assert_eq!(c.result("e1", &token, serde_json::json!({})), CallbackAnswer::Unknown, "forgotten");
        let state = c.state.lock().unwrap();
        assert_eq!((state.answered.len(), state.order.len()), (ANSWERED_REMEMBERED, ANSWERED_REMEMBERED));
    }

    #[test]
    fn callbacks_need_their_token_and_take_one_result() {
        let c = Callbacks::default();
        *c.base.lock().unwrap() = Some("http://127.0.0.1:1".into());
        let (url, token, mut progress, result) = c.register("e1", "r1").expect("registered");
        assert_eq!(url, "http://127.0.0.1:1/v1/executions/e1");
        assert_eq!(c.progress("e1", "wrong", &serde_json::json!({})), CallbackAnswer::Unauthorized);
        assert_eq!(c.progress("e2", &token, &serde_json::json!({})), CallbackAnswer::Unknown);
        assert_eq!(c.progress("e1", &token, &serde_json::json!({"percent": 150, "message": "half"})), CallbackAnswer::Taken);
        assert_eq!(progress.try_recv().expect("report").percent, Some(100.0));
        assert_eq!(c.result("e1", &token, serde_json::json!({"ok": true})), CallbackAnswer::Taken);
        assert_eq!(c.result("e1", &token, serde_json::json!({"ok": false})), CallbackAnswer::AlreadyDone);
        assert_eq!(result.blocking_recv().expect("result"), serde_json::json!({"ok": true}));
        c.forget("e1");
        assert_eq!(c.result("e1", &token, serde_json::json!({})), CallbackAnswer::AlreadyDone);
        assert_eq!(c.result("e3", &token, serde_json::json!({})), CallbackAnswer::Unknown);
    }
}
