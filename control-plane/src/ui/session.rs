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
//! Every action carries a CSRF token bound to the session: the SHA-256 of
//! the token under a fixed label (with auth off, of a secret made at
//! start). A page from another site cannot read it, so it cannot forge an
//! action even where the browser would send the cookie.

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

fn secret() -> &'static str {
    static SECRET: OnceLock<String> = OnceLock::new();
    SECRET.get_or_init(|| {
        use rand::RngCore;
        let mut b = [0u8; 32];
        rand::rng().fill_bytes(&mut b);
        hex::encode(b)
    })
}

fn csrf_of(token: &str) -> String {
    hex::encode(Sha256::digest(format!("punchclock-ui-csrf\n{token}").as_bytes()))
}

/// Whether `sent` is `viewer`'s CSRF token (compared in constant time).
pub fn csrf_ok(viewer: &Viewer, sent: &str) -> bool {
    let (a, b) = (viewer.csrf.as_bytes(), sent.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn cookie_token(headers: &HeaderMap) -> Option<String> {
    headers.get_all(header::COOKIE).iter().filter_map(|v| v.to_str().ok()).flat_map(|v| v.split(';')).find_map(|c| {
        let (k, v) = c.trim().split_once('=')?;
        (k == COOKIE && !v.is_empty()).then(|| v.to_string())
    })
}

/// The viewer of a request for what `method` (a gRPC method path) may
/// show or do. Without a session (auth on) the answer is a redirect to the
/// sign-in form; a role short of `method`'s, `403` naming the role needed.
#[allow(clippy::result_large_err)]
pub fn viewer(core: &Core, headers: &HeaderMap, method: &str) -> Result<Viewer, Response> {
    if !core.auth.enabled() {
        return Ok(Viewer { name: "anonymous".into(), role: Role::Admin, csrf: csrf_of(secret()), signed_in: false });
    }
    let Some(token) = cookie_token(headers) else {
        return Err(Redirect::to("/ui/login").into_response());
    };
    let mut h = HeaderMap::new();
    match HeaderValue::from_str(&format!("Bearer {token}")) {
        Ok(v) => {
            h.insert(header::AUTHORIZATION, v);
        }
        Err(_) => return Err(Redirect::to("/ui/login").into_response()),
    }
    // The method's role check, audited as the API audits it.
    let principal = match core.auth.authorize(method, &h, None) {
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
                csrf: csrf_of(&token),
                signed_in: true,
            });
            return Err((StatusCode::FORBIDDEN, super::pages::error(v.as_ref(), StatusCode::FORBIDDEN, s.message())).into_response());
        }
        Err(_) => return Err(Redirect::to("/ui/login").into_response()),
    };
    if principal.role == Role::Runner {
        return Err((StatusCode::FORBIDDEN, "a runner token cannot use the dashboard").into_response());
    }
    Ok(Viewer { name: principal.name.clone(), role: principal.role, csrf: csrf_of(&token), signed_in: true })
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
    let cookie = format!("{COOKIE}={token}; Path=/ui; HttpOnly; SameSite=Strict{}", if tls { "; Secure" } else { "" });
    let mut r = Redirect::to("/ui/tasks").into_response();
    if let Ok(v) = HeaderValue::from_str(&cookie) {
        r.headers_mut().insert(header::SET_COOKIE, v);
    }
    r
}

/// `POST /ui/logout`: the cookie is cleared.
pub async fn logout() -> Response {
    let mut r = Redirect::to("/ui/login").into_response();
    r.headers_mut().insert(header::SET_COOKIE, HeaderValue::from_static("punchclock_ui=; Path=/ui; HttpOnly; SameSite=Strict; Max-Age=0"));
    r
}
