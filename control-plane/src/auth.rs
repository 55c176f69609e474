//! Who may call what: bearer tokens with roles, runner identities bound to
//! their credential, and the one table from gRPC method to the access it
//! needs.
//!
//! The tokens file (`--auth-file`, YAML; reloaded on SIGHUP):
//!
//! ```yaml
//! tokens:
//!   - name: alice                 # who, in audit lines (letters, digits, _ - . @)
//!     role: admin                 # admin | operator | reader | runner
//!     sha256: 9f86d08188…         # hex SHA-256 of the token; the token itself is never stored
//!   - name: runner-gpu
//!     role: runner
//!     sha256: …
//!     runner_id_prefix: "gpu-"    # or runner_id: gpu-1 (exactly one of them, runner tokens only)
//!     agents: [report_agent]      # optional: the agents it may offer
//!     labels: {zone: secure}      # the labels it may claim (none without this)
//! ```
//!
//! Tokens are random (`punchclock token new` makes 256-bit ones), so a
//! plain SHA-256 is the right hash: nothing to brute-force, and no
//! per-call key stretching. The [`AuthLayer`] checks every call before
//! its service sees it: `authorization: Bearer TOKEN` → a [`Principal`]
//! (put in the request's extensions), or `Unauthenticated`; the method's
//! [`Access`] against the role, or `PermissionDenied` naming the role
//! needed. A verified mTLS client certificate binds a runner to the id in
//! its first DNS subjectAltName ([`Principal::cert_runner_id`]); the
//! runner service checks a Hello against both bindings
//! ([`Principal::check_hello`]).

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, RwLock};
use std::task::{Context, Poll};

use serde::Deserialize;
use sha2::{Digest, Sha256};
use tonic::Status;
use tonic::codegen::http;

use crate::error::{Error, Result};

/// A token's role. Roles nest for reading: an operator may also read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Everything.
    Admin,
    /// Apply, pause, resume, trigger, cancel, delete, reset a breaker,
    /// retry a notification; and everything a reader may.
    Operator,
    /// Get, list, watch, stats, preview.
    Reader,
    /// The runner stream only.
    Runner,
}

impl Role {
    /// The name used in files and messages.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Admin => "admin",
            Role::Operator => "operator",
            Role::Reader => "reader",
            Role::Runner => "runner",
        }
    }
}

/// What a gRPC method needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// No credential (health checks).
    Open,
    /// Any valid credential (finding the leader).
    Any,
    /// reader, operator or admin.
    Read,
    /// operator or admin; audited.
    Operate,
    /// admin only; audited.
    Admin,
    /// runner or admin (the runner stream); audited at connect.
    Runner,
}

impl Access {
    /// Whether `role` may call a method needing this.
    pub fn allows(self, role: Role) -> bool {
        match self {
            Access::Open | Access::Any => true,
            Access::Read => matches!(role, Role::Reader | Role::Operator | Role::Admin),
            Access::Operate => matches!(role, Role::Operator | Role::Admin),
            Access::Admin => role == Role::Admin,
            Access::Runner => matches!(role, Role::Runner | Role::Admin),
        }
    }

    /// The roles named in a `PermissionDenied`.
    fn needed(self) -> &'static str {
        match self {
            Access::Open | Access::Any => "any",
            Access::Read => "reader, operator or admin",
            Access::Operate => "operator or admin",
            Access::Admin => "admin",
            Access::Runner => "runner or admin",
        }
    }

    /// Whether a call is written to the audit log.
    fn audited(self) -> bool {
        matches!(self, Access::Operate | Access::Admin | Access::Runner)
    }
}

/// Every method of every service and what it needs; the README's roles
/// table is this table. A method not listed needs admin (deny by default).
pub const METHODS: &[(&str, Access)] = &[
    ("/grpc.health.v1.Health/Check", Access::Open),
    ("/grpc.health.v1.Health/Watch", Access::Open),
    ("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo", Access::Read),
    ("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", Access::Read),
    ("/punchclock.v1.TaskService/ApplyTask", Access::Operate),
    ("/punchclock.v1.TaskService/ApplyTasks", Access::Operate),
    ("/punchclock.v1.TaskService/GetTask", Access::Read),
    ("/punchclock.v1.TaskService/ListTasks", Access::Read),
    ("/punchclock.v1.TaskService/DeleteTask", Access::Operate),
    ("/punchclock.v1.TaskService/PauseTask", Access::Operate),
    ("/punchclock.v1.TaskService/PublishEvent", Access::Operate),
    ("/punchclock.v1.TaskService/ResumeTask", Access::Operate),
    ("/punchclock.v1.TaskService/TriggerTask", Access::Operate),
    ("/punchclock.v1.TaskService/ResetBreaker", Access::Operate),
    ("/punchclock.v1.TaskService/PreviewSchedule", Access::Read),
    ("/punchclock.v1.TaskService/BackfillTask", Access::Operate),
    ("/punchclock.v1.TaskService/ListBackfills", Access::Read),
    ("/punchclock.v1.TaskService/GetBackfill", Access::Read),
    ("/punchclock.v1.TaskService/ChangeBackfill", Access::Operate),
    ("/punchclock.v1.RunService/ListRuns", Access::Read),
    ("/punchclock.v1.RunService/GetRun", Access::Read),
    ("/punchclock.v1.RunService/CancelRun", Access::Operate),
    ("/punchclock.v1.RunService/RerunRuns", Access::Operate),
    ("/punchclock.v1.RunService/PruneRuns", Access::Admin),
    ("/punchclock.v1.RunService/WatchRuns", Access::Read),
    ("/punchclock.v1.RunService/GetSchedulingStats", Access::Read),
    ("/punchclock.v1.NotificationService/ListNotifications", Access::Read),
    ("/punchclock.v1.NotificationService/RetryNotification", Access::Operate),
    ("/punchclock.v1.RunnerService/Connect", Access::Runner),
    ("/punchclock.v1.ClusterService/GetLeader", Access::Any),
    ("/punchclock.v1.ClusterService/GetClusterStatus", Access::Read),
    ("/punchclock.v1.ClusterService/ListRunners", Access::Read),
    ("/punchclock.v1.ConfigService/ApplyConfig", Access::Admin),
    ("/punchclock.v1.ConfigService/GetConfig", Access::Admin),
    ("/punchclock.v1.ClusterService/ListResources", Access::Read),
    ("/punchclock.v1.ClusterService/ReleaseResource", Access::Operate),
    ("/punchclock.v1.ClusterService/ListBudgets", Access::Read),
];

/// What `path` (`/package.Service/Method`) needs.
pub fn access_for(path: &str) -> Access {
    METHODS.iter().find(|(m, _)| *m == path).map(|(_, a)| *a).unwrap_or(Access::Admin)
}

/// What a runner token may say in its Hello.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunnerBinding {
    /// `runner_id` (exact) or `runner_id_prefix`.
    pub id: IdRule,
    /// The agents it may offer; `None` = any.
    pub agents: Option<BTreeSet<String>>,
    /// The labels it may claim in Hello (key and value); any other label
    /// is refused. Labels route tasks (selectors), and with them their
    /// params: a runner must not give itself one.
    pub labels: std::collections::BTreeMap<String, String>,
}

/// A runner id rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdRule {
    /// This id only.
    Exact(String),
    /// Ids starting with this.
    Prefix(String),
}

/// The caller of one request, in its extensions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    /// The token's name (`anonymous` when auth is off, `cert:ID` for an
    /// mTLS runner without a token).
    pub name: String,
    /// Its role.
    pub role: Role,
    /// A runner token's binding.
    pub binding: Option<RunnerBinding>,
    /// The runner id of a verified client certificate (its first DNS
    /// subjectAltName).
    pub cert_runner_id: Option<String>,
    /// The hash of the token it came from (checked again on reload: a
    /// removed token ends the streams it opened).
    token_hash: Option<[u8; 32]>,
}

impl Principal {
    /// Checks a runner's Hello against the token's binding and the client
    /// certificate: its id, its agents, and its labels — a runner token
    /// may claim only the labels it binds, a certificate without a token
    /// none (issue 19: a runner started with `--labels zone=secure` got the
    /// tasks, and the params, meant for secure runners). Capability labels
    /// ([`punchclock_proto::labels::CAPABILITIES`]: `cgroup`, which every
    /// runner reports) need no binding; a binding that names one holds the
    /// runner to its value.
    ///
    /// Errors: `PermissionDenied` naming the id, the agents or the labels
    /// refused and why.
    #[allow(clippy::result_large_err)]
    pub fn check_hello(
        &self,
        runner_id: &str,
        agents: &[String],
        labels: &std::collections::BTreeMap<String, String>,
    ) -> std::result::Result<(), Status> {
        if let Some(cert_id) = &self.cert_runner_id
            && cert_id != runner_id
        {
            return Err(Status::permission_denied(format!(
                "runner id {runner_id:?} does not match the client certificate, which names {cert_id:?}"
            )));
        }
        let capability = |k: &str| punchclock_proto::labels::is_capability(k);
        let Some(b) = &self.binding else {
            if self.cert_runner_id.is_some()
                && let Some((k, v)) = labels.iter().find(|(k, _)| !capability(k))
            {
                return Err(Status::permission_denied(format!(
                    "runner {runner_id:?} may not claim label {k}={v}: a client certificate binds no labels; connect with a runner token whose tokens-file entry binds them (labels:)"
                )));
            }
            return Ok(());
        };
        let unbound: Vec<String> = labels
            .iter()
            .filter(|(k, v)| match b.labels.get(*k) {
                Some(bound) => bound != *v,
                None => !capability(k),
            })
            .take(5)
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        if !unbound.is_empty() {
            return Err(Status::permission_denied(format!(
                "token {:?} may not claim labels {unbound:?} (it binds {:?}); bind them with labels: in its tokens-file entry",
                self.name,
                b.labels.iter().take(20).map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>()
            )));
        }
        match &b.id {
            IdRule::Exact(id) if id != runner_id => {
                return Err(Status::permission_denied(format!("token {:?} is bound to runner id {id:?}, not {runner_id:?}", self.name)));
            }
            IdRule::Prefix(p) if !runner_id.starts_with(p.as_str()) => {
                return Err(Status::permission_denied(format!(
                    "token {:?} is bound to runner ids starting with {p:?}, not {runner_id:?}",
                    self.name
                )));
            }
            _ => {}
        }
        if let Some(allowed) = &b.agents {
            let refused: Vec<&str> = agents.iter().filter(|a| !allowed.contains(*a)).map(String::as_str).collect();
            if !refused.is_empty() {
                // Named, but bounded: the message goes into a header and a log line.
                let more = if refused.len() > 5 { format!(" and {} more", refused.len() - 5) } else { String::new() };
                return Err(Status::permission_denied(format!(
                    "token {:?} may not offer agents {:?}{more} (allowed: {:?})",
                    self.name,
                    &refused[..refused.len().min(5)],
                    allowed.iter().take(20).collect::<Vec<_>>()
                )));
            }
        }
        Ok(())
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TokensFile {
    tokens: Vec<TokenEntry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenEntry {
    name: String,
    role: Role,
    sha256: String,
    #[serde(default)]
    runner_id: Option<String>,
    #[serde(default)]
    runner_id_prefix: Option<String>,
    #[serde(default)]
    agents: Option<Vec<String>>,
    #[serde(default)]
    labels: Option<std::collections::BTreeMap<String, String>>,
}

/// Token hash → who.
type Table = HashMap<[u8; 32], Arc<Principal>>;

/// The server's tokens (none: auth off) and the reload generation that
/// ends streams of removed tokens.
#[derive(Debug)]
pub struct Auth {
    file: Option<PathBuf>,
    tokens: RwLock<Arc<Table>>,
    /// Bumped by every reload.
    generation: tokio::sync::watch::Sender<u64>,
}

/// Longest token accepted on the wire, in bytes.
const MAX_TOKEN_BYTES: usize = 4096;

impl Auth {
    /// No tokens: every call is allowed (`dev`, or a server on loopback).
    pub fn off() -> Arc<Auth> {
        Arc::new(Auth { file: None, tokens: RwLock::new(Arc::new(Table::new())), generation: tokio::sync::watch::Sender::new(0) })
    }

    /// Tokens from `file`.
    ///
    /// Errors: [`Error::InvalidArgument`] naming `auth-file` (unreadable)
    /// or the entry's field (`tokens[2].sha256: …`).
    pub fn from_file(file: &Path) -> Result<Arc<Auth>> {
        let table = load(file)?;
        Ok(Arc::new(Auth {
            file: Some(file.to_owned()),
            tokens: RwLock::new(Arc::new(table)),
            generation: tokio::sync::watch::Sender::new(0),
        }))
    }

    /// Whether tokens are required.
    pub fn enabled(&self) -> bool {
        self.file.is_some()
    }

    /// Reads the tokens file again (SIGHUP). On error the old tokens stay.
    ///
    /// Errors: as [`Auth::from_file`]; returns the number of tokens.
    pub fn reload(&self) -> Result<usize> {
        let Some(file) = &self.file else { return Ok(0) };
        let table = load(file)?;
        let n = table.len();
        *self.tokens.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(table);
        self.generation.send_modify(|g| *g += 1);
        Ok(n)
    }

    /// Whether `p`'s token is still in the tokens file with the same
    /// name, role and binding (always, for a principal without a token).
    pub fn still_valid(&self, p: &Principal) -> bool {
        let Some(hash) = &p.token_hash else { return true };
        let table = self.tokens.read().unwrap_or_else(|e| e.into_inner()).clone();
        table.get(hash).is_some_and(|now| now.name == p.name && now.role == p.role && now.binding == p.binding)
    }

    /// Resolves once `p`'s token has been removed or changed by a reload
    /// (never, for a principal without a token).
    fn revoked(self: &Arc<Self>, p: Principal) -> impl std::future::Future<Output = ()> + Send + 'static {
        let auth = self.clone();
        let mut changes = self.generation.subscribe();
        async move {
            loop {
                if changes.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
                if !auth.still_valid(&p) {
                    return;
                }
            }
        }
    }

    /// Who is calling: from the bearer token, else the client certificate,
    /// else anonymous when tokens are off.
    #[allow(clippy::result_large_err)]
    pub fn principal(&self, headers: &http::HeaderMap, cert_runner_id: Option<String>) -> std::result::Result<Principal, Status> {
        let bearer = match headers.get(http::header::AUTHORIZATION) {
            None => None,
            Some(v) => {
                let v = v.to_str().map_err(|_| Status::unauthenticated("authorization header is not ASCII"))?;
                let token = v
                    .strip_prefix("Bearer ")
                    .or_else(|| v.strip_prefix("bearer "))
                    .ok_or_else(|| Status::unauthenticated("authorization header must be \"Bearer TOKEN\""))?
                    .trim();
                if token.is_empty() || token.len() > MAX_TOKEN_BYTES {
                    return Err(Status::unauthenticated("invalid token"));
                }
                Some(token.to_string())
            }
        };
        if let Some(token) = bearer {
            if !self.enabled() {
                // Tokens off: a token changes nothing.
                return Ok(Principal { name: "anonymous".into(), role: Role::Admin, binding: None, cert_runner_id, token_hash: None });
            }
            let table = self.tokens.read().unwrap_or_else(|e| e.into_inner()).clone();
            let hash: [u8; 32] = Sha256::digest(token.as_bytes()).into();
            return match table.get(&hash) {
                Some(p) => Ok(Principal { cert_runner_id, ..(**p).clone() }),
                None => Err(Status::unauthenticated("invalid token (unknown, or removed from the tokens file)")),
            };
        }
        if let Some(id) = cert_runner_id {
            return Ok(Principal {
                name: format!("cert:{id}"),
                role: Role::Runner,
                binding: None,
                cert_runner_id: Some(id),
                token_hash: None,
            });
        }
        if self.enabled() {
            return Err(Status::unauthenticated("missing credentials: send \"authorization: Bearer TOKEN\" (punchclock --token)"));
        }
        Ok(Principal { name: "anonymous".into(), role: Role::Admin, binding: None, cert_runner_id: None, token_hash: None })
    }

    /// The whole check for one call: who, and may they; a mutating call
    /// that may is written to the audit log.
    #[allow(clippy::result_large_err)]
    pub fn authorize(
        &self,
        path: &str,
        headers: &http::HeaderMap,
        cert_runner_id: Option<String>,
    ) -> std::result::Result<Option<Principal>, Status> {
        let p = self.check(path, headers, cert_runner_id)?;
        if let Some(p) = &p
            && access_for(path).audited()
            && self.enabled()
        {
            tracing::info!(target: "punchclock::audit", token = %p.name, role = %p.role.as_str(), method = %path, "audit");
        }
        Ok(p)
    }

    /// [`Auth::authorize`] without the audit line, for a caller that
    /// writes its own (the dashboard's actions name their target).
    #[allow(clippy::result_large_err)]
    pub fn check(
        &self,
        path: &str,
        headers: &http::HeaderMap,
        cert_runner_id: Option<String>,
    ) -> std::result::Result<Option<Principal>, Status> {
        let access = access_for(path);
        if access == Access::Open {
            return Ok(None);
        }
        let p = self.principal(headers, cert_runner_id)?;
        if !access.allows(p.role) {
            return Err(Status::permission_denied(format!(
                "{path} needs the {} role; token {:?} has {}",
                access.needed(),
                p.name,
                p.role.as_str()
            )));
        }
        Ok(Some(p))
    }
}

/// Reads and checks a tokens file.
fn load(file: &Path) -> Result<Table> {
    let text = std::fs::read_to_string(file).map_err(|e| Error::invalid("auth-file", format!("cannot read {}: {e}", file.display())))?;
    let doc: TokensFile = serde_yaml_ng::from_str(&text).map_err(|e| Error::invalid("auth-file", format!("{}: {e}", file.display())))?;
    let mut table = Table::new();
    let mut names = BTreeSet::new();
    for (i, t) in doc.tokens.into_iter().enumerate() {
        let field = |f: &str| format!("tokens[{i}].{f}");
        let in_entry = |e: Error| match e {
            Error::InvalidArgument { field: f, reason } => Error::invalid(field(&f), reason),
            other => other,
        };
        let hash: [u8; 32] = hex::decode(t.sha256.trim())
            .ok()
            .and_then(|b| b.try_into().ok())
            .ok_or_else(|| Error::invalid(field("sha256"), "expected 64 hex digits (the SHA-256 of the token)"))?;
        let mut p = principal(t.name, t.role, t.runner_id, t.runner_id_prefix, t.agents, t.labels).map_err(in_entry)?;
        p.token_hash = Some(hash);
        if !names.insert(p.name.clone()) {
            return Err(Error::invalid(field("name"), format!("{:?} is used twice", p.name)));
        }
        if table.insert(hash, Arc::new(p)).is_some() {
            return Err(Error::invalid(field("sha256"), "the same token appears twice"));
        }
    }
    if table.is_empty() {
        tracing::warn!(file = %file.display(), "the tokens file has no tokens: every call without a client certificate is refused");
    }
    Ok(table)
}

/// Checks one token's entry (the tokens file's, or `punchclock token
/// new`'s flags) and makes its principal.
///
/// Errors: [`Error::InvalidArgument`] naming `name`, `runner_id`,
/// `agents` or `labels`: a name outside 1–64 of letters, digits, `_ - .
/// @`; a runner token without exactly one of `runner_id` /
/// `runner_id_prefix`, or with one outside the runner id rules; a binding,
/// `agents` or `labels` on another role.
pub fn principal(
    name: String,
    role: Role,
    runner_id: Option<String>,
    runner_id_prefix: Option<String>,
    agents: Option<Vec<String>>,
    labels: Option<std::collections::BTreeMap<String, String>>,
) -> Result<Principal> {
    if name.is_empty() || name.len() > 64 || !name.chars().all(|c| c.is_ascii_alphanumeric() || "_-.@".contains(c)) {
        return Err(Error::invalid("name", "1 to 64 letters, digits, _ - . @"));
    }
    let runner_chars = |s: &str| s.chars().count() <= 128 && s.chars().all(|c| c.is_ascii_alphanumeric() || "_-.:@".contains(c));
    let binding = match (role, runner_id, runner_id_prefix) {
        (Role::Runner, Some(id), None) if !id.is_empty() && runner_chars(&id) => Some(IdRule::Exact(id)),
        (Role::Runner, None, Some(p)) if !p.is_empty() && runner_chars(&p) => Some(IdRule::Prefix(p)),
        (Role::Runner, None, None) => {
            return Err(Error::invalid("runner_id", "a runner token needs runner_id or runner_id_prefix"));
        }
        (Role::Runner, Some(_), Some(_)) => {
            return Err(Error::invalid("runner_id", "give one of runner_id and runner_id_prefix, not both"));
        }
        (Role::Runner, _, _) => {
            return Err(Error::invalid("runner_id", "a runner id (or prefix) is 1 to 128 letters, digits, _ - . : @"));
        }
        (_, None, None) => None,
        (role, _, _) => {
            return Err(Error::invalid(
                "runner_id",
                format!("only runner tokens are bound to a runner id (this one is {})", role.as_str()),
            ));
        }
    };
    if binding.is_none() && agents.is_some() {
        return Err(Error::invalid("agents", "only runner tokens are bound to agents"));
    }
    if binding.is_none() && labels.is_some() {
        return Err(Error::invalid("labels", "only runner tokens are bound to labels"));
    }
    let binding =
        binding.map(|id| RunnerBinding { id, agents: agents.map(|a| a.into_iter().collect()), labels: labels.unwrap_or_default() });
    Ok(Principal { name, role, binding, cert_runner_id: None, token_hash: None })
}

/// `sha256:` line for a token (hex).
pub fn token_hash(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

/// A new random token: `pc_` and 43 base64url characters (256 bits).
pub fn new_token() -> String {
    use base64::Engine as _;
    let bytes: [u8; 32] = rand::random();
    format!("pc_{}", base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes))
}

/// The runner id a verified client certificate names: its first DNS
/// subjectAltName (the id then must pass the usual runner id rules).
pub fn cert_runner_id(der: &[u8]) -> Option<String> {
    let der = rustls::pki_types::CertificateDer::from(der.to_vec());
    let cert = webpki::EndEntityCert::try_from(&der).ok()?;
    cert.valid_dns_names().next().map(str::to_string)
}

/// A tower layer that runs [`Auth::authorize`] before every gRPC call.
#[derive(Clone)]
pub struct AuthLayer(pub Arc<Auth>);

impl<S> tower::Layer<S> for AuthLayer {
    type Service = AuthService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        AuthService { auth: self.0.clone(), inner }
    }
}

/// See [`AuthLayer`].
#[derive(Clone)]
pub struct AuthService<S> {
    auth: Arc<Auth>,
    inner: S,
}

type BoxFuture<T> = Pin<Box<dyn std::future::Future<Output = T> + Send + 'static>>;

impl<S, B> tower::Service<http::Request<B>> for AuthService<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    B: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = BoxFuture<std::result::Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<std::result::Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        let cert_id = peer_cert_runner_id(&req);
        match self.auth.authorize(req.uri().path(), req.headers(), cert_id) {
            Ok(principal) => {
                // A token-authenticated response ends (`Unauthenticated`)
                // when a reload removes its token: open streams too.
                let revoked =
                    principal.as_ref().filter(|p| p.token_hash.is_some()).map(|p| Box::pin(self.auth.revoked(p.clone())) as Revoked);
                if let Some(p) = principal {
                    req.extensions_mut().insert(p);
                }
                // The clone is not the one polled ready: swap, per tower's
                // guidance for services that must be moved into a future.
                let clone = self.inner.clone();
                let mut inner = std::mem::replace(&mut self.inner, clone);
                Box::pin(async move {
                    let resp = inner.call(req).await?;
                    Ok(match revoked {
                        None => resp,
                        Some(revoked) => resp.map(|body| tonic::body::Body::new(RevocableBody { inner: Some(body), revoked })),
                    })
                })
            }
            Err(status) => {
                // Refusals are audited too (bounded: the path and a short
                // reason), once a minute per method, caller host and code:
                // a client retrying a refused call must not write a line
                // per retry.
                let path: String = req.uri().path().chars().take(128).collect();
                let peer = peer_addr(&req);
                let host = peer.rsplit_once(':').map_or(peer.as_str(), |(h, _)| h).to_string();
                if let Some(repeats) = refusal_due(&format!("{path}|{host}|{:?}", status.code())) {
                    tracing::info!(target: "punchclock::audit", method = %path, peer = %peer, code = ?status.code(), reason = %status.message(), repeats, "denied");
                }
                Box::pin(async move { Ok(status.into_http()) })
            }
        }
    }
}

type Revoked = Pin<Box<dyn std::future::Future<Output = ()> + Send + 'static>>;

/// A response body that ends with `Unauthenticated` trailers once its
/// token is revoked, dropping the service's body (for the runner stream:
/// the engine sees its runner gone).
struct RevocableBody {
    inner: Option<tonic::body::Body>,
    revoked: Revoked,
}

impl http_body::Body for RevocableBody {
    type Data = tonic::codegen::Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<std::result::Result<http_body::Frame<Self::Data>, Status>>> {
        let this = &mut *self;
        let Some(inner) = this.inner.as_mut() else { return Poll::Ready(None) };
        if this.revoked.as_mut().poll(cx).is_ready() {
            this.inner = None;
            let trailers =
                Status::unauthenticated("token revoked: it was removed from the tokens file").into_http::<()>().into_parts().0.headers;
            return Poll::Ready(Some(Ok(http_body::Frame::trailers(trailers))));
        }
        Pin::new(inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(http_body::Body::is_end_stream)
    }
}

/// The caller's address, for audit lines ("-" when unknown).
/// How often one kind of refusal is written to the audit log.
const REFUSAL_LOG_EVERY: std::time::Duration = std::time::Duration::from_secs(60);

/// Whether a refusal keyed `key` is due for an audit line: the first, and
/// then once per [`REFUSAL_LOG_EVERY`]; `Some(n)` with the repeats left
/// out since the last line.
pub fn refusal_due(key: &str) -> Option<u64> {
    use std::sync::{Mutex, OnceLock, PoisonError};
    static SEEN: OnceLock<Mutex<HashMap<String, (std::time::Instant, u64)>>> = OnceLock::new();
    let mut seen = SEEN.get_or_init(Mutex::default).lock().unwrap_or_else(PoisonError::into_inner);
    // Bounded: an attacker varying keys empties it, and then lines resume.
    if seen.len() >= 10_000 {
        seen.clear();
    }
    let now = std::time::Instant::now();
    match seen.get_mut(key) {
        Some((last, repeats)) if now.duration_since(*last) < REFUSAL_LOG_EVERY => {
            *repeats += 1;
            None
        }
        Some((last, repeats)) => {
            let n = *repeats;
            *last = now;
            *repeats = 0;
            Some(n)
        }
        None => {
            seen.insert(key.to_string(), (now, 0));
            Some(0)
        }
    }
}

fn peer_addr<B>(req: &http::Request<B>) -> String {
    use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};
    let tcp =
        req.extensions().get::<TcpConnectInfo>().or_else(|| req.extensions().get::<TlsConnectInfo<TcpConnectInfo>>().map(|t| t.get_ref()));
    tcp.and_then(|c| c.remote_addr()).map(|a| a.to_string()).unwrap_or_else(|| "-".into())
}

/// The runner id of the request's verified client certificate, if any.
fn peer_cert_runner_id<B>(req: &http::Request<B>) -> Option<String> {
    use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};
    let info = req.extensions().get::<TlsConnectInfo<TcpConnectInfo>>()?;
    let certs = info.peer_certs()?;
    certs.first().and_then(|c| cert_runner_id(c.as_ref()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(token: Option<&str>) -> http::HeaderMap {
        let mut h = http::HeaderMap::new();
        if let Some(t) = token {
            h.insert(http::header::AUTHORIZATION, format!("Bearer {t}").parse().expect("header"));
        }
        h
    }

    fn auth(yaml: &str) -> Arc<Auth> {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = dir.path().join("tokens.yaml");
        std::fs::write(&f, yaml).expect("write");
        Auth::from_file(&f).expect("valid tokens file")
    }

    #[test]
    fn roles_follow_the_table() {
        let a = auth(&format!(
            "tokens:\n  - {{name: r, role: reader, sha256: {}}}\n  - {{name: o, role: operator, sha256: {}}}\n",
            token_hash("rt"),
            token_hash("ot")
        ));
        let call = |path: &str, tok: Option<&str>| a.authorize(path, &headers(tok), None).map(|_| ()).map_err(|s| s.code());
        assert_eq!(call("/punchclock.v1.TaskService/GetTask", None), Err(tonic::Code::Unauthenticated));
        assert_eq!(call("/punchclock.v1.TaskService/GetTask", Some("nope")), Err(tonic::Code::Unauthenticated));
        assert_eq!(call("/punchclock.v1.TaskService/GetTask", Some("rt")), Ok(()));
        assert_eq!(call("/punchclock.v1.TaskService/ApplyTask", Some("rt")), Err(tonic::Code::PermissionDenied));
        assert_eq!(call("/punchclock.v1.TaskService/ApplyTask", Some("ot")), Ok(()));
        assert_eq!(call("/punchclock.v1.RunService/PruneRuns", Some("ot")), Err(tonic::Code::PermissionDenied));
        assert_eq!(call("/punchclock.v1.Unknown/Method", Some("ot")), Err(tonic::Code::PermissionDenied), "deny by default");
        assert_eq!(call("/grpc.health.v1.Health/Check", None), Ok(()));
    }

    #[test]
    fn bad_files_name_the_field() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = dir.path().join("t.yaml");
        for (yaml, field) in [
            ("tokens:\n  - {name: a, role: reader, sha256: xyz}\n", "tokens[0].sha256"),
            (&format!("tokens:\n  - {{name: 'a b', role: reader, sha256: {}}}\n", token_hash("a")), "tokens[0].name"),
            (&format!("tokens:\n  - {{name: a, role: runner, runner_id: 'r 1', sha256: {}}}\n", token_hash("a")), "tokens[0].runner_id"),
            (&format!("tokens:\n  - {{name: a, role: runner, sha256: {}}}\n", token_hash("a")), "tokens[0].runner_id"),
            (&format!("tokens:\n  - {{name: a, role: reader, runner_id: r1, sha256: {}}}\n", token_hash("a")), "tokens[0].runner_id"),
            (
                &format!(
                    "tokens:\n  - {{name: a, role: reader, sha256: {}}}\n  - {{name: a, role: reader, sha256: {}}}\n",
                    token_hash("a"),
                    token_hash("b")
                ),
                "tokens[1].name",
            ),
        ] {
            std::fs::write(&f, yaml).expect("write");
            match Auth::from_file(&f) {
                Err(Error::InvalidArgument { field: got, .. }) => assert_eq!(got, field, "{yaml}"),
                other => panic!("{yaml}: {other:?}"),
            }
        }
    }

    #[test]
    fn runner_tokens_are_bound() {
        let a = auth(&format!(
            "tokens:\n  - {{name: r1, role: runner, runner_id: r1, agents: [x], sha256: {}}}\n  - {{name: gpu, role: runner, runner_id_prefix: gpu-, sha256: {}}}\n",
            token_hash("t1"),
            token_hash("t2")
        ));
        let p = a.authorize("/punchclock.v1.RunnerService/Connect", &headers(Some("t1")), None).expect("ok").expect("principal");
        let none = std::collections::BTreeMap::new();
        assert!(p.check_hello("r1", &["x".into()], &none).is_ok());
        assert_eq!(p.check_hello("r2", &["x".into()], &none).map_err(|s| s.code()), Err(tonic::Code::PermissionDenied));
        assert!(p.check_hello("r1", &["x".into(), "y".into()], &none).expect_err("y").message().contains("\"y\""));
        assert_eq!(
            a.authorize("/punchclock.v1.TaskService/GetTask", &headers(Some("t1")), None).map_err(|s| s.code()),
            Err(tonic::Code::PermissionDenied),
            "a runner token reads nothing"
        );
        let g = a.authorize("/punchclock.v1.RunnerService/Connect", &headers(Some("t2")), None).expect("ok").expect("principal");
        assert!(g.check_hello("gpu-7", &[], &none).is_ok());
        assert!(g.check_hello("cpu-7", &[], &none).is_err());
        // A certificate binds too, whatever the token says.
        let c = a.authorize("/punchclock.v1.RunnerService/Connect", &headers(Some("t2")), Some("gpu-1".into())).expect("ok").expect("p");
        assert!(c.check_hello("gpu-1", &[], &none).is_ok());
        assert!(c.check_hello("gpu-2", &[], &none).is_err());
        let secure: std::collections::BTreeMap<String, String> = [("zone".to_string(), "secure".to_string())].into();
        assert!(c.check_hello("gpu-1", &[], &secure).expect_err("a certificate binds no labels").message().contains("zone=secure"));
    }

    /// Issue 22's `cgroup` label is reported by every runner from its host:
    /// a binding need not list it (a runner with a label-less token could
    /// not connect at all), but one that does holds the runner to it, and
    /// every other label still needs its binding.
    #[test]
    fn capability_labels_need_no_binding() {
        let a = auth(&format!(
            "tokens:\n  - {{name: plain, role: runner, runner_id_prefix: r, sha256: {}}}\n  - {{name: v2only, role: runner, runner_id_prefix: r, labels: {{cgroup: v2}}, sha256: {}}}\n",
            token_hash("t1"),
            token_hash("t2")
        ));
        let labels = |pairs: &[(&str, &str)]| -> std::collections::BTreeMap<String, String> {
            pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
        };
        let connect = |token: &str, cert: Option<&str>| {
            a.authorize("/punchclock.v1.RunnerService/Connect", &headers(Some(token)), cert.map(str::to_string)).expect("ok").expect("p")
        };
        let plain = connect("t1", None);
        assert!(plain.check_hello("r1", &[], &labels(&[("cgroup", "v1")])).is_ok());
        let e = plain.check_hello("r1", &[], &labels(&[("cgroup", "v1"), ("zone", "secure")])).expect_err("zone is not bound");
        assert!(e.message().contains("zone=secure") && !e.message().contains("cgroup=v1"), "{}", e.message());
        let bound = connect("t2", None);
        assert!(bound.check_hello("r1", &[], &labels(&[("cgroup", "v2")])).is_ok());
        assert!(bound.check_hello("r1", &[], &labels(&[("cgroup", "v1")])).expect_err("bound to v2").message().contains("cgroup=v1"));
        let cert = connect("t1", Some("r9"));
        assert!(cert.check_hello("r9", &[], &labels(&[("cgroup", "none")])).is_ok());
        assert!(
            cert.check_hello("r9", &[], &labels(&[("cgroup", "none"), ("gpu", "a100")])).expect_err("gpu").message().contains("gpu=a100")
        );
    }

    #[test]
    fn tokens_are_random_and_url_safe() {
        let (a, b) = (new_token(), new_token());
        assert_ne!(a, b);
        assert_eq!(a.len(), 3 + 43);
        assert!(a[3..].chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_'), "{a}");
    }
}
