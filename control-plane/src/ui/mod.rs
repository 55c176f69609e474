//! The dashboard: `/ui/` on the HTTP port of every replica, rendered here
//! from [`crate::views`] (no store reads of its own: every page asks
//! [`Core`] what the gRPC API would) with maud templates, its script and
//! style embedded in the binary, live over server-sent events from the
//! replica's run watch ([`crate::watch`]).
//!
//! Module map:
//! - this file: the routes, who is looking ([`session`]), the actions;
//! - [`pages`]: the pages and fragments (HTML);
//! - [`live`]: `GET /ui/live`, the event stream a page listens to;
//! - `assets/`: `app.js` (forms sent in place, the live stream applied to
//!   the page) and `style.css`.
//!
//! Pages: `/ui/tasks` (search, filters, the last slots of each task as
//! cells), `/ui/tasks/{id}` (definition, next fires, runs with a cursor,
//! actions), `/ui/runs/{id}` (attempts, result, actions), `/ui/cluster`
//! (replicas, runners, resources, budgets, history). Actions are `POST`s
//! carrying the session's CSRF token, checked against the same roles as the
//! gRPC method they stand for, and audited under the same name.

pub mod live;
pub mod pages;
pub mod session;

use std::sync::Arc;

use axum::Router;
use axum::extract::{Form, Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use serde::Deserialize;

use crate::api::Core;
use crate::error::Error;
use crate::repo::history::{self, HistoryQuery};
use session::Viewer;

/// The dashboard's settings.
#[derive(Debug, Clone, Default)]
pub struct UiConfig {
    /// A run's trace as a link: a URL with `{trace_id}` in it
    /// (`--ui-trace-url`; Jaeger's `http://jaeger:16686/trace/{trace_id}`,
    /// Grafana Tempo's explore URL). `None`: the trace id is shown as text.
    pub trace_link: Option<String>,
}

/// Tasks a page of the tasks list shows.
pub const TASKS_PAGE: u32 = 100;
/// Slots shown per task on the tasks list.
pub const TASK_CELLS: u32 = 20;
/// Runs a page of a task's runs shows.
pub const RUNS_PAGE: usize = 50;

/// The dashboard's routes (state: the replica's [`Core`], `core`), with at
/// most `live_max` live streams open at once ([`live::cap_for`]).
pub fn routes(core: Arc<Core>, live_max: usize) -> Router<Arc<Core>> {
    Router::new()
        .route("/", get(|| async { Redirect::to("/ui/tasks") }))
        .route("/ui", get(|| async { Redirect::to("/ui/tasks") }))
        .route("/ui/", get(|| async { Redirect::to("/ui/tasks") }))
        .route("/ui/assets/app.js", get(|| async { asset("text/javascript; charset=utf-8", include_str!("assets/app.js")) }))
        .route("/ui/assets/style.css", get(|| async { asset("text/css; charset=utf-8", include_str!("assets/style.css")) }))
        .route("/ui/login", get(session::login_form).post(session::login).route_layer(axum::middleware::from_fn(bounded_form)))
        .route("/ui/logout", post(session::logout).route_layer(axum::middleware::from_fn(bounded_form)))
        .route("/ui/tasks", get(tasks))
        .route("/ui/tasks/{id}", get(task))
        .route("/ui/runs/{id}", get(run))
        .route("/ui/cluster", get(cluster))
        .route("/ui/events", get(events))
        .route("/ui/live", get(live::stream).layer(axum::Extension(live::Streams::new(live_max))))
        .merge(actions(core))
}

/// Every form the dashboard takes is read whole before its handler runs:
/// at most [`MAX_FORM_BYTES`] (`413`), within the HTTP port's body
/// timeout (`408`), one of the port's turns to read a body
/// ([`crate::events::webhook::Bodies`], shared with webhooks: a client
/// trickling forms holds a turn for the timeout, not a connection for
/// ever).
async fn bounded_form(
    axum::Extension(bodies): axum::Extension<Arc<crate::events::webhook::Bodies>>,
    axum::extract::ConnectInfo(peer): axum::extract::ConnectInfo<std::net::SocketAddr>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let (parts, body) = req.into_parts();
    match crate::events::webhook::read_body(&bodies, &parts.headers, body, MAX_FORM_BYTES as u64, peer.ip()).await {
        Ok((bytes, _turn)) => next.run(axum::extract::Request::from_parts(parts, axum::body::Body::from(bytes))).await,
        Err(r) => r,
    }
}

/// The actions: `POST`s, each the gRPC call it names. A follower checks the
/// session and its CSRF token, then forwards the request as it came to the
/// leader's HTTP port (as webhooks are) and relays the answer.
fn actions(core: Arc<Core>) -> Router<Arc<Core>> {
    Router::new()
        .route("/ui/tasks/{id}/trigger", post(trigger))
        .route("/ui/tasks/{id}/backfill", post(backfill))
        .route("/ui/tasks/{id}/pause", post(pause))
        .route("/ui/tasks/{id}/resume", post(resume))
        .route("/ui/tasks/{id}/reset-breaker", post(reset_breaker))
        .route("/ui/tasks-bulk", post(bulk))
        .route("/ui/runs/{id}/cancel", post(cancel))
        .route("/ui/runs/{id}/rerun", post(rerun))
        .route_layer(axum::middleware::from_fn_with_state(core, to_leader))
        .route_layer(axum::middleware::from_fn(bounded_form))
}

/// Most bytes an action's form may have.
const MAX_FORM_BYTES: usize = 64 * 1024;

async fn to_leader(State(core): State<Arc<Core>>, req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let leading = core.engine.read().map(|g| g.is_some()).unwrap_or(false);
    if leading {
        return next.run(req).await;
    }
    let (parts, body) = req.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, MAX_FORM_BYTES).await else {
        return (StatusCode::PAYLOAD_TOO_LARGE, "the form is over 64 KiB").into_response();
    };
    // This replica vouches for the session's CSRF token (with auth off its
    // token is this replica's own); the leader checks the session again.
    let sent =
        std::str::from_utf8(&bytes).unwrap_or_default().split('&').find_map(|kv| kv.strip_prefix("csrf=")).unwrap_or_default().to_string();
    let viewer = match session::viewer(&core, &parts.headers, "/punchclock.v1.RunService/GetRun") {
        Ok(v) => v,
        Err(r) => return r,
    };
    if !session::csrf_ok(&viewer, &sent) {
        return (StatusCode::FORBIDDEN, "the form's CSRF token is missing or stale: reload the page").into_response();
    }
    let peer = parts
        .extensions
        .get::<axum::extract::ConnectInfo<std::net::SocketAddr>>()
        .map(|c| c.0)
        .unwrap_or_else(|| std::net::SocketAddr::from(([127, 0, 0, 1], 0)));
    crate::events::webhook::forward(&core, &parts.uri, &parts.headers, bytes, peer).await
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    ([(header::CONTENT_TYPE, content_type), (header::CACHE_CONTROL, "public, max-age=300")], body).into_response()
}

/// An error as a page: the status the API's error maps to, and its words.
pub(crate) fn error_page(viewer: Option<&Viewer>, e: &Error) -> Response {
    let code = match e {
        Error::InvalidArgument { .. } => StatusCode::BAD_REQUEST,
        Error::NotFound { .. } => StatusCode::NOT_FOUND,
        Error::AlreadyExists { .. } | Error::FailedPrecondition(_) => StatusCode::CONFLICT,
        Error::Unavailable { .. } | Error::Fenced(_) | Error::Store(_) => StatusCode::SERVICE_UNAVAILABLE,
        Error::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
    };
    (code, pages::error(viewer, code, &e.to_string())).into_response()
}

// ------------------------------------------------------------------ pages

/// `GET /ui/tasks` query.
#[derive(Debug, Default, Deserialize)]
pub struct TasksQuery {
    /// Substring of id, agent or label.
    #[serde(default)]
    pub q: String,
    /// `paused` or `active`.
    #[serde(default)]
    pub state: String,
    /// A trigger kind.
    #[serde(default)]
    pub trigger: String,
    /// Status of the newest run.
    #[serde(default)]
    pub last: String,
    /// `open`: breaker open only.
    #[serde(default)]
    pub breaker: String,
    /// Page token (the last task id of the previous page).
    #[serde(default)]
    pub after: String,
}

impl TasksQuery {
    fn filter(&self) -> Result<crate::views::TaskFilter, Error> {
        let trigger = match self.trigger.as_str() {
            "" => None,
            k => Some(
                serde_json::from_value(serde_json::Value::String(k.to_string()))
                    .map_err(|_| Error::invalid("trigger", format!("{k:?} is not a trigger kind")))?,
            ),
        };
        let last_status = match self.last.as_str() {
            "" => None,
            s => Some(crate::model::RunStatus::parse(s).ok_or_else(|| Error::invalid("last", format!("{s:?} is not a run status")))?),
        };
        let paused = match self.state.as_str() {
            "" => None,
            "paused" => Some(true),
            "active" => Some(false),
            s => return Err(Error::invalid("state", format!("{s:?}: paused or active"))),
        };
        Ok(crate::views::TaskFilter { text: self.q.trim().to_string(), paused, trigger, breaker_open: self.breaker == "open", last_status })
    }
}

async fn tasks(State(core): State<Arc<Core>>, headers: HeaderMap, Query(q): Query<TasksQuery>) -> Response {
    let viewer = match session::viewer(&core, &headers, "/punchclock.v1.TaskService/ListTasks") {
        Ok(v) => v,
        Err(r) => return r,
    };
    let filter = match q.filter() {
        Ok(f) => f,
        Err(e) => return error_page(Some(&viewer), &e),
    };
    // Resources and budgets are the leader's: a follower's rows go without.
    let (summaries, policy) = tokio::join!(core.task_summaries(&filter, &q.after, TASKS_PAGE, TASK_CELLS), core.policy_views());
    match summaries {
        Ok((rows, next)) => pages::tasks(&viewer, &q, &rows, &next, policy.ok().as_ref(), core.clock.now()).into_response(),
        Err(e) => error_page(Some(&viewer), &e),
    }
}

/// `GET /ui/tasks/{id}` query: the runs shown.
#[derive(Debug, Default, Deserialize)]
pub struct RunsQuery {
    /// A run status.
    #[serde(default)]
    pub status: String,
    /// Slots from (RFC 3339 or a duration ago: `1h`).
    #[serde(default)]
    pub since: String,
    /// Slots before.
    #[serde(default)]
    pub until: String,
    /// Page token.
    #[serde(default)]
    pub page: String,
}

impl RunsQuery {
    fn query(&self, task_id: &str, now: chrono::DateTime<chrono::Utc>) -> Result<HistoryQuery, Error> {
        let when = |field: &str, s: &str| -> Result<Option<chrono::DateTime<chrono::Utc>>, Error> {
            let s = s.trim();
            if s.is_empty() {
                return Ok(None);
            }
            if let Ok(t) = chrono::DateTime::parse_from_rfc3339(s) {
                return Ok(Some(t.with_timezone(&chrono::Utc)));
            }
            let secs = crate::schedule::parse_duration(s)
                .map_err(|e| Error::invalid(field, format!("{s:?}: an RFC 3339 time or a duration ago ({e})")))?;
            i64::try_from(secs)
                .ok()
                .and_then(chrono::Duration::try_seconds)
                .and_then(|d| now.checked_sub_signed(d))
                .filter(|t| t.timestamp() >= 0)
                .map(Some)
                .ok_or_else(|| Error::invalid(field, format!("{s:?}: too long ago")))
        };
        let status = match self.status.as_str() {
            "" => None,
            s => Some(crate::model::RunStatus::parse(s).ok_or_else(|| Error::invalid("status", format!("{s:?} is not a run status")))?),
        };
        Ok(HistoryQuery {
            task_id: task_id.to_string(),
            status,
            from: when("since", &self.since)?,
            to: when("until", &self.until)?,
            limit: RUNS_PAGE,
            newest_first: true,
            ..Default::default()
        })
    }
}

async fn task(State(core): State<Arc<Core>>, headers: HeaderMap, Path(id): Path<String>, Query(rq): Query<RunsQuery>) -> Response {
    let viewer = match session::viewer(&core, &headers, "/punchclock.v1.TaskService/GetTask") {
        Ok(v) => v,
        Err(r) => return r,
    };
    let now = core.clock.now();
    let page = async {
        let view = core.get_task(&id).await?;
        let hq = rq.query(&id, now)?;
        let (runs, next) = core.list_runs(hq.clone(), &rq.page).await?;
        let next = next.map(|c| history::encode_token(&hq, &c)).unwrap_or_default();
        let fires = core.preview("", "", Default::default(), &id, None, 5).await.unwrap_or_default();
        let slots = core.recent_slots(&id, TASK_CELLS).await?;
        Ok::<_, Error>(pages::task(&viewer, &view, &fires, &slots, &runs, &rq, &next, now))
    };
    match page.await {
        Ok(p) => p.into_response(),
        Err(e) => error_page(Some(&viewer), &e),
    }
}

async fn run(State(core): State<Arc<Core>>, headers: HeaderMap, Path(id): Path<String>) -> Response {
    let viewer = match session::viewer(&core, &headers, "/punchclock.v1.RunService/GetRun") {
        Ok(v) => v,
        Err(r) => return r,
    };
    match core.get_run(&id).await {
        Ok(r) => {
            let (notes, downstream) = core.run_links(&r).await;
            pages::run(&viewer, &crate::views::RunDetail::of(r), &notes, &downstream, core.ui.trace_link.as_deref()).into_response()
        }
        Err(e) => error_page(Some(&viewer), &e),
    }
}

async fn cluster(State(core): State<Arc<Core>>, headers: HeaderMap) -> Response {
    let viewer = match session::viewer(&core, &headers, "/punchclock.v1.ClusterService/GetClusterStatus") {
        Ok(v) => v,
        Err(r) => return r,
    };
    let view = core.cluster_view().await;
    // Live state is the leader's: a follower says so instead.
    let runners = core.list_runners().await;
    let policy = core.policy_views().await;
    let history = (core.history.kind(), core.archive.as_ref().and_then(|(_, s)| s.problem()));
    pages::cluster(&viewer, &view, &runners, &policy, history).into_response()
}

async fn events(State(core): State<Arc<Core>>, headers: HeaderMap) -> Response {
    let viewer = match session::viewer(&core, &headers, "/punchclock.v1.TaskService/ListTasks") {
        Ok(v) => v,
        Err(r) => return r,
    };
    use crate::model::run::TriggerKind;
    let mut sections = Vec::new();
    for kind in [TriggerKind::Webhook, TriggerKind::Queue, TriggerKind::Event, TriggerKind::After] {
        let filter = crate::views::TaskFilter { trigger: Some(kind), ..Default::default() };
        match core.task_summaries(&filter, "", TASKS_PAGE, TASK_CELLS).await {
            Ok((rows, _)) => sections.push((kind, rows)),
            Err(e) => return error_page(Some(&viewer), &e),
        }
    }
    pages::events(&viewer, &sections, &core.consumers.snapshot()).into_response()
}

// ---------------------------------------------------------------- actions

/// An action's form: its CSRF token and, for a trigger, its params.
#[derive(Debug, Default, Deserialize)]
pub struct ActionForm {
    /// The session's CSRF token ([`Viewer::csrf`]).
    #[serde(default)]
    pub csrf: String,
    /// `TriggerTask` params, a JSON object (empty: none).
    #[serde(default)]
    pub params: String,
    /// Why (a cancel's reason).
    #[serde(default)]
    pub reason: String,
    /// Bulk actions: `pause` or `resume`.
    #[serde(default)]
    pub action: String,
    /// Bulk actions: the selected task ids, comma-separated.
    #[serde(default)]
    pub tasks: String,
    /// A backfill's first and last slot (RFC 3339, or a duration ago: `30d`).
    #[serde(default)]
    pub from: String,
    /// See `from` (empty: now).
    #[serde(default)]
    pub to: String,
    /// A backfill's `reprocess`: missing, failed or all.
    #[serde(default)]
    pub reprocess: String,
    /// A backfill's `max_concurrent` (empty: 1).
    #[serde(default)]
    pub max_concurrent: String,
}

/// What an action answers: a fetch from the page's script gets a short
/// text (`200`, or the error's status); a plain form post is sent back to
/// `back` (303).
fn done(headers: &HeaderMap, back: &str, result: Result<String, Error>) -> Response {
    let in_place = headers.get("x-punchclock-ui").is_some();
    match result {
        Ok(msg) if in_place => (StatusCode::OK, msg).into_response(),
        Ok(_) => Redirect::to(back).into_response(),
        Err(e) if in_place => {
            let code = match e {
                Error::InvalidArgument { .. } => StatusCode::BAD_REQUEST,
                Error::NotFound { .. } => StatusCode::NOT_FOUND,
                Error::Unavailable { .. } | Error::Fenced(_) | Error::Store(_) => StatusCode::SERVICE_UNAVAILABLE,
                _ => StatusCode::CONFLICT,
            };
            (code, e.to_string()).into_response()
        }
        Err(e) => error_page(None, &e),
    }
}

/// The viewer of an action: may call `method`, and sent the CSRF token.
#[allow(clippy::result_large_err)]
fn actor(core: &Core, headers: &HeaderMap, method: &str, form: &ActionForm, target: &str) -> Result<Viewer, Response> {
    let viewer = session::viewer(core, headers, method)?;
    // With auth off, a follower checked the token (its own) before it
    // forwarded the action here; with auth on the token is the session's,
    // the same on every replica, and is checked again.
    let vouched = !core.auth.enabled() && headers.contains_key(crate::events::webhook::FORWARDED);
    if !vouched && !session::csrf_ok(&viewer, &form.csrf) {
        tracing::info!(target: "punchclock::audit", token = %viewer.name, method, target, "denied: dashboard action without its CSRF token");
        return Err((StatusCode::FORBIDDEN, "the form's CSRF token is missing or stale: reload the page").into_response());
    }
    tracing::info!(target: "punchclock::audit", token = %viewer.name, role = %viewer.role.as_str(), method, target, via = "dashboard", "audit");
    Ok(viewer)
}

/// A manual run of `task_id` now with `params`, as `TriggerTask` without
/// a key or a trace makes it.
fn manual_run(task_id: &str, params: serde_json::Map<String, serde_json::Value>) -> crate::engine::TriggerRequest {
    crate::engine::TriggerRequest {
        task_id: task_id.to_string(),
        params,
        not_before: None,
        delay_seconds: 0,
        idempotency_key: None,
        idempotency_window: None,
        caller_trace: None,
        baggage: String::new(),
    }
}

/// An instant of a form: RFC 3339, or a duration ago (`30d`), naming the field.
fn form_instant(field: &str, text: &str, now: chrono::DateTime<chrono::Utc>) -> Result<chrono::DateTime<chrono::Utc>, Error> {
    let text = text.trim();
    if let Ok(t) = chrono::DateTime::parse_from_rfc3339(text) {
        return Ok(t.with_timezone(&chrono::Utc));
    }
    let secs = crate::schedule::parse_duration(text)
        .map_err(|e| Error::invalid(field, format!("{e}: an RFC 3339 time, or a duration ago such as 30d")))?;
    Ok(now - chrono::Duration::seconds(i64::try_from(secs).unwrap_or(0).min(100 * 366 * 86_400)))
}

/// Starts a backfill of the task (checked as `BackfillTask`).
async fn backfill(State(core): State<Arc<Core>>, headers: HeaderMap, Path(id): Path<String>, Form(f): Form<ActionForm>) -> Response {
    use crate::model::backfill::{BackfillSpec, Reprocess};
    if let Err(r) = actor(&core, &headers, "/punchclock.v1.TaskService/BackfillTask", &f, &id) {
        return r;
    }
    let now = core.clock.now();
    let spec = async {
        Ok::<_, Error>(BackfillSpec {
            task_id: id.clone(),
            from: form_instant("from", &f.from, now)?,
            to: if f.to.trim().is_empty() { now } else { form_instant("to", &f.to, now)? },
            reprocess: match f.reprocess.as_str() {
                "" | "missing" => Reprocess::Missing,
                "failed" => Reprocess::Failed,
                "all" => Reprocess::All,
                x => return Err(Error::invalid("reprocess", format!("{x:?}: missing, failed or all"))),
            },
            max_concurrent: if f.max_concurrent.trim().is_empty() {
                1
            } else {
                f.max_concurrent.trim().parse().map_err(|_| Error::invalid("max_concurrent", "a number from 1 to 1000"))?
            },
            order: Default::default(),
            on_failure: Default::default(),
        })
    }
    .await;
    let result = match spec {
        Ok(spec) => core.backfill(spec, false).await.map(|p| match p.backfill {
            Some(b) => format!("backfill {} started: {} slot(s) planned", b.id, b.planned),
            None => "nothing started".into(),
        }),
        Err(e) => Err(e),
    };
    done(&headers, &format!("/ui/tasks/{}", pages::path_segment(&id)), result)
}

async fn trigger(State(core): State<Arc<Core>>, headers: HeaderMap, Path(id): Path<String>, Form(f): Form<ActionForm>) -> Response {
    if let Err(r) = actor(&core, &headers, "/punchclock.v1.TaskService/TriggerTask", &f, &id) {
        return r;
    }
    let params = match f.params.trim() {
        "" => Ok(serde_json::Map::new()),
        text => match serde_json::from_str::<serde_json::Value>(text) {
            Ok(serde_json::Value::Object(m)) => Ok(m),
            _ => Err(Error::invalid("params", "a JSON object, such as {\"region\": \"eu\"}")),
        },
    };
    let result = match params {
        Ok(params) => match core.trigger(manual_run(&id, params)).await {
            Ok(t) => said_of(&core, &t.run_id, "triggered").await,
            Err(e) => Err(e),
        },
        Err(e) => Err(e),
    };
    done(&headers, &format!("/ui/tasks/{}", pages::path_segment(&id)), result)
}

/// What a new manual run became, as the CLI says it: `{what}: run ID`,
/// or, when it was SKIPPED at once (its task busy, a budget spent), an
/// error naming the run and the reason.
async fn said_of(core: &Core, run_id: &str, what: &str) -> Result<String, Error> {
    match core.get_run(run_id).await {
        Ok(r) if r.status == crate::model::RunStatus::Skipped => {
            Err(Error::FailedPrecondition(format!("run {run_id} SKIPPED: {}", crate::views::RunSummary::of(&r).reason)))
        }
        _ => Ok(format!("{what}: run {run_id}")),
    }
}

async fn pause(State(core): State<Arc<Core>>, headers: HeaderMap, Path(id): Path<String>, Form(f): Form<ActionForm>) -> Response {
    pause_or_resume(&core, &headers, &id, &f, true).await
}

async fn resume(State(core): State<Arc<Core>>, headers: HeaderMap, Path(id): Path<String>, Form(f): Form<ActionForm>) -> Response {
    pause_or_resume(&core, &headers, &id, &f, false).await
}

/// `PauseTask` or `ResumeTask` from a task's page.
async fn pause_or_resume(core: &Core, headers: &HeaderMap, id: &str, f: &ActionForm, pause: bool) -> Response {
    let method = if pause { "/punchclock.v1.TaskService/PauseTask" } else { "/punchclock.v1.TaskService/ResumeTask" };
    if let Err(r) = actor(core, headers, method, f, id) {
        return r;
    }
    let result = if pause { core.pause_task(id).await } else { core.resume_task(id).await };
    let result = result.map(|_| format!("{id} {}", if pause { "paused" } else { "resumed" }));
    done(headers, &format!("/ui/tasks/{}", pages::path_segment(id)), result)
}

async fn reset_breaker(State(core): State<Arc<Core>>, headers: HeaderMap, Path(id): Path<String>, Form(f): Form<ActionForm>) -> Response {
    if let Err(r) = actor(&core, &headers, "/punchclock.v1.TaskService/ResetBreaker", &f, &id) {
        return r;
    }
    let result = core.reset_breaker(&id).await.map(|_| format!("{id}: breaker closed"));
    done(&headers, &format!("/ui/tasks/{}", pages::path_segment(&id)), result)
}

async fn bulk(State(core): State<Arc<Core>>, headers: HeaderMap, Form(f): Form<ActionForm>) -> Response {
    let method = match f.action.as_str() {
        "pause" => "/punchclock.v1.TaskService/PauseTask",
        "resume" => "/punchclock.v1.TaskService/ResumeTask",
        other => return done(&headers, "/ui/tasks", Err(Error::invalid("action", format!("{other:?}: pause or resume")))),
    };
    let ids: Vec<&str> = f.tasks.split(',').map(str::trim).filter(|s| !s.is_empty()).collect();
    if let Err(r) = actor(&core, &headers, method, &f, &ids.join(",")) {
        return r;
    }
    let mut failed = Vec::new();
    for id in &ids {
        let r = if f.action == "pause" { core.pause_task(id).await } else { core.resume_task(id).await };
        if let Err(e) = r {
            failed.push(format!("{id}: {e}"));
        }
    }
    let result = if failed.is_empty() {
        Ok(format!("{} task(s): {}d", ids.len(), f.action))
    } else {
        Err(Error::FailedPrecondition(format!("{} of {} failed: {}", failed.len(), ids.len(), failed.join("; "))))
    };
    done(&headers, "/ui/tasks", result)
}

async fn cancel(State(core): State<Arc<Core>>, headers: HeaderMap, Path(id): Path<String>, Form(f): Form<ActionForm>) -> Response {
    let viewer = match actor(&core, &headers, "/punchclock.v1.RunService/CancelRun", &f, &id) {
        Ok(v) => v,
        Err(r) => return r,
    };
    let reason = if f.reason.trim().is_empty() { format!("cancelled from the dashboard by {}", viewer.name) } else { f.reason };
    let result = core.cancel_run(&id, &reason).await.map(|r| format!("run {} {}", r.run_id, r.status.as_str()));
    done(&headers, &format!("/ui/runs/{}", pages::path_segment(&id)), result)
}

async fn rerun(State(core): State<Arc<Core>>, headers: HeaderMap, Path(id): Path<String>, Form(f): Form<ActionForm>) -> Response {
    if let Err(r) = actor(&core, &headers, "/punchclock.v1.RunService/RerunRuns", &f, &id) {
        return r;
    }
    match core.rerun(&id, false).await {
        Ok(new) => done(&headers, &format!("/ui/runs/{}", pages::path_segment(&new.run_id)), said_of(&core, &new.run_id, "re-run").await),
        Err(e) => done(&headers, &format!("/ui/runs/{}", pages::path_segment(&id)), Err(e)),
    }
}
