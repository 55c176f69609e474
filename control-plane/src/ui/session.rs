//! Who is looking at the dashboard, and whether they may act.
//!
//! With auth off (`dev`, `--insecure` on loopback) everyone is `anonymous`
//! with every role, and there is no sign-in. With auth on, the sign-in form
//! takes an API token (the same tokens and roles as the gRPC API, see
//! [`crate::auth`]) and keeps it in the `punchclock_ui` cookie: HttpOnly,
//! SameSite=Strict, Path=/ui, Secure when the request came over TLS (a
//! proxy's `X-Forwarded-Proto: https`). Each page and action is checked as
//! the gRPC method it stands for, so a reader sees and may do what
//! `punchclock` with its token may.
//!
//! A sign-in is a session: the cookie is `{session}.{token}`, a random
//! session id made at sign-in beside the token, for at most
//! [`SESSION_SECONDS`]. Every action carries a CSRF token bound to that
//! session: the SHA-256 of the session id and the token under a fixed
//! label (with auth off, of a secret made at start). A page from another
//! site cannot read it, so it cannot forge an action even where the
//! browser would send the cookie; a second sign-in gets another. Sign-out
//! clears the cookie and ends the session on the replica that served it
//! (kept in memory, [`MAX_ENDED`] at most): the cookie carries the token,
//! so what ends it on every replica is revoking the token.

use std::sync::{Arc, OnceLock};

use axum::Form;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::api::Core;
use crate::auth::Role;

/// The session cookie's name.
pub const COOKIE: &str = "punchclock_ui";

/// How long a sign-in lasts (the cookie's `Max-Age`): 12 hours.
pub const SESSION_SECONDS: u64 = 12 * 3600;

/// Most sessions ended by sign-out a replica remembers (each for
/// [`SESSION_SECONDS`], after which its cookie has expired anyway); past
/// it, the oldest is forgotten.
pub const MAX_ENDED: usize = 100_000;

/// Sessions ended here: id → when.
fn ended() -> &'static std::sync::Mutex<std::collections::HashMap<String, std::time::Instant>> {
    static ENDED: OnceLock<std::sync::Mutex<std::collections::HashMap<String, std::time::Instant>>> = OnceLock::new();
    ENDED.get_or_init(Default::default)
}

fn is_ended(session: &str) -> bool {
    ended().lock().map(|m| m.contains_key(session)).unwrap_or(false)
}

fn end(session: &str) {
    let Ok(mut m) = ended().lock() else { return };
    let now = std::time::Instant::now();
    m.retain(|_, at| now.duration_since(*at).as_secs() < SESSION_SECONDS);
    if m.len() >= MAX_ENDED
        && let Some(oldest) = m.iter().min_by_key(|(_, at)| **at).map(|(k, _)| k.clone())
    {
        m.remove(&oldest);
    }
    m.insert(session.to_string(), now);
}

/// Who is looking.
#[derive(Debug, Clone)]
pub struct Viewer {
    /// The token's name (`anonymous` with auth off).
    pub name: String,
    /// Its role.
    pub role: Role,
    /// This session's CSRF token (hex).
    pub csrf: String,
    /// Signed in with a token (a sign-out button is shown).
    pub signed_in: bool,
}

impl Viewer {
    /// Whether it may pause, resume, trigger, cancel (operator or admin):
    /// action buttons are shown only then.
    pub fn can_operate(&self) -> bool {
        matches!(self.role, Role::Operator | Role::Admin)
    }
}

fn random_hex(bytes: usize) -> String {
    use rand::RngCore;
    let mut b = vec![0u8; bytes];
    rand::rng().fill_bytes(&mut b);
    hex::encode(b)
}

fn secret() -> &'static str {
    static SECRET: OnceLock<String> = OnceLock::new();
    SECRET.get_or_init(|| random_hex(32))
}

fn csrf_of(session: &str, token: &str) -> String {
    hex::encode(Sha256::digest(format!("punchclock-ui-csrf\n{session}\n{token}").as_bytes()))
}

/// Whether `sent` is `viewer`'s CSRF token (compared in constant time).
pub fn csrf_ok(viewer: &Viewer, sent: &str) -> bool {
    let (a, b) = (viewer.csrf.as_bytes(), sent.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The cookie's (session id, token), when it holds both and the session
/// was not ended here.
fn cookie_session(headers: &HeaderMap) -> Option<(String, String)> {
    let value = headers.get_all(header::COOKIE).iter().filter_map(|v| v.to_str().ok()).flat_map(|v| v.split(';')).find_map(|c| {
        let (k, v) = c.trim().split_once('=')?;
        (k == COOKIE && !v.is_empty()).then(|| v.to_string())
    })?;
    let (session, token) = value.split_once('.')?;
    (session.len() == 32 && !token.is_empty() && !is_ended(session)).then(|| (session.to_string(), token.to_string()))
}

/// A refusal: one line of text for the page's script (`x-punchclock-ui`),
/// else a page.
fn refused(headers: &HeaderMap, viewer: Option<&Viewer>, message: &str) -> Response {
    if headers.contains_key("x-punchclock-ui") {
        return (StatusCode::FORBIDDEN, message.to_string()).into_response();
    }
    (StatusCode::FORBIDDEN, super::pages::error(viewer, StatusCode::FORBIDDEN, message)).into_response()
}

/// The viewer of a request for what `method` (a gRPC method path) may
/// show or do. Without a session (auth on) the answer is a redirect to the
/// sign-in form; a role short of `method`'s, `403` naming the role needed
/// (written to the audit log, as the API writes a refused call). Nothing
/// else is audited here: an action writes its own line
/// (`super::actor`), once.
#[allow(clippy::result_large_err)]
pub fn viewer(core: &Core, headers: &HeaderMap, method: &str) -> Result<Viewer, Response> {
    if !core.auth.enabled() {
        return Ok(Viewer { name: "anonymous".into(), role: Role::Admin, csrf: csrf_of("", secret()), signed_in: false });
    }
    let Some((session, token)) = cookie_session(headers) else {
        return Err(Redirect::to("/ui/login").into_response());
    };
    let mut h = HeaderMap::new();
    match HeaderValue::from_str(&format!("Bearer {token}")) {
        Ok(v) => {
            h.insert(header::AUTHORIZATION, v);
        }
        Err(_) => return Err(Redirect::to("/ui/login").into_response()),
    }
    let principal = match core.auth.check(method, &h, None) {
        Ok(Some(p)) => p,
        Ok(None) => {
            // An open method: still, who is it?
            match core.auth.principal(&h, None) {
                Ok(p) => p,
                Err(_) => return Err(Redirect::to("/ui/login").into_response()),
            }
        }
        Err(s) if s.code() == tonic::Code::PermissionDenied => {
            let v = core.auth.principal(&h, None).ok().map(|p| Viewer {
                name: p.name.clone(),
                role: p.role,
                csrf: csrf_of(&session, &token),
                signed_in: true,
            });
            let name = v.as_ref().map_or("", |v| v.name.as_str());
            tracing::info!(target: "punchclock::audit", method, token = %name, via = "dashboard", reason = %s.message(), "denied");
            return Err(refused(headers, v.as_ref(), s.message()));
        }
        Err(_) => return Err(Redirect::to("/ui/login").into_response()),
    };
    if principal.role == Role::Runner {
        return Err(refused(headers, None, "a runner token cannot use the dashboard"));
    }
    Ok(Viewer { name: principal.name.clone(), role: principal.role, csrf: csrf_of(&session, &token), signed_in: true })
}

/// `GET /ui/login` query.
#[derive(Debug, Default, Deserialize)]
pub struct LoginQuery {
    /// Why the form is shown again.
    #[serde(default)]
    pub error: String,
}

/// `GET /ui/login`: the sign-in form (with auth off: to the tasks).
pub async fn login_form(State(core): State<Arc<Core>>, Query(q): Query<LoginQuery>) -> Response {
    if !core.auth.enabled() {
        return Redirect::to("/ui/tasks").into_response();
    }
    super::pages::login(&q.error).into_response()
}

/// `POST /ui/login` form.
#[derive(Debug, Default, Deserialize)]
pub struct LoginForm {
    /// An API token.
    #[serde(default)]
    pub token: String,
}

/// `POST /ui/login`: a token that names a reader, operator or admin gets
/// the session cookie; any other goes back to the form, saying why.
pub async fn login(State(core): State<Arc<Core>>, headers: HeaderMap, Form(f): Form<LoginForm>) -> Response {
    let token = f.token.trim();
    let mut h = HeaderMap::new();
    let principal = HeaderValue::from_str(&format!("Bearer {token}")).ok().and_then(|v| {
        h.insert(header::AUTHORIZATION, v);
        core.auth.principal(&h, None).ok()
    });
    let Some(p) = principal.filter(|p| p.role != Role::Runner && !token.is_empty()) else {
        tracing::info!(target: "punchclock::audit", method = "dashboard sign-in", "denied: unknown token");
        return Redirect::to("/ui/login?error=unknown+token").into_response();
    };
    tracing::info!(target: "punchclock::audit", token = %p.name, role = %p.role.as_str(), method = "dashboard sign-in", "audit");
    let tls = headers.get("x-forwarded-proto").and_then(|v| v.to_str().ok()).is_some_and(|v| v.eq_ignore_ascii_case("https"));
    let cookie = format!(
        "{COOKIE}={}.{token}; Path=/ui; HttpOnly; SameSite=Strict; Max-Age={SESSION_SECONDS}{}",
        random_hex(16),
        if tls { "; Secure" } else { "" }
    );
    let mut r = Redirect::to("/ui/tasks").into_response();
    if let Ok(v) = HeaderValue::from_str(&cookie) {
        r.headers_mut().insert(header::SET_COOKIE, v);
    }
    r
}

/// `POST /ui/logout`: the session ends here and the cookie is cleared.
pub async fn logout(headers: HeaderMap) -> Response {
    if let Some((session, _)) = cookie_session(&headers) {
        end(&session);
    }
    let mut r = Redirect::to("/ui/login").into_response();
    r.headers_mut().insert(header::SET_COOKIE, HeaderValue::from_static("punchclock_ui=; Path=/ui; HttpOnly; SameSite=Strict; Max-Age=0"));
    r
}
