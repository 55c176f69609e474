//! Runner configuration: the agents file and [`RunnerConfig`].
//!
//! The agents file is YAML and declares which agents this runner can run:
//!
//! ```yaml
//! agents:
//!   report_agent:
//!     type: process
//!     command: ["python3", "examples/agents/report.py"]
//!     env: {K: V}          # optional
//!     env_from_file:       # optional: variables read from files on this host
//!       API_KEY: /etc/punchclock/secrets/api_key
//!     working_dir: "."     # optional, relative to the runner's cwd
//!     limits:              # optional: cgroup limits (see crate::cgroup)
//!       memory_max: 512Mi  # bytes (Ki, Mi, Gi, K, M, G suffixes)
//!       cpu: 0.5           # cores
//!       pids_max: 256      # processes and threads, the supervisor included
//!       enforce: required  # or best_effort (default): see below
//!   summarize:
//!     type: http           # an agent served over HTTP (see crate::http_agent)
//!     url: https://agents.internal/summarize
//!     method: POST         # optional (POST)
//!     headers: {X-Team: research}
//!     timeout_seconds: 300 # optional: per request, within the run's deadline
//!     tls: {ca_file: /etc/ca.pem, cert_file: /etc/c.pem, key_file: /etc/c.key}
//!     signing_secret_file: /etc/punchclock/agent.secret
//!     max_in_flight: 16    # optional: requests at once to this agent
//!     cancel_url: https://agents.internal/summarize/cancel  # optional
//!     rate_limit_resource: llm  # optional: the shared resource a 429 holds back
//! ```
//!
//! `env_from_file` is how an agent gets a credential: the file is read on
//! the runner host at every execution start (so a rotated secret is used
//! from the next run), one trailing newline dropped; the value never
//! travels through the control plane or the store, and is never logged.
//!
//! Unknown fields are rejected, and every error names the offending field
//! (`agents.report_agent.command: must not be empty`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::Error;
use crate::cgroup::Limits;

/// Time between SIGTERM and SIGKILL when an agent is stopped (5 s).
pub const DEFAULT_KILL_GRACE: Duration = Duration::from_secs(5);

/// How much lower process agents' CPU priority is than the runner's, by
/// default: nice 19 more (the kernel's weight 15 against 1,024). A burst
/// of agents otherwise takes the CPU from the runner threads that start
/// the rest of the burst and acknowledge heartbeats (measured, bench-load
/// on `dev`, 2 cores, 100 `/bin/true` due every second: start p50/p99
/// 37 / 83 ms at 0 and 19 / 59 ms at 19; runs differ by 10-15 ms at p99).
/// Agents keep equal shares among themselves, and under autogroup
/// scheduling or a cpu cgroup per service the nice value only weighs them
/// against the runner's own process tree. Kubernetes gives best-effort
/// pods `cpu.shares` 2 against the kubelet's 1,024 for the same reason.
///
/// An agent with `limits` runs in a cgroup of its own, which competes with
/// the runner by the cgroup's CPU weight, not by nice: that cgroup gets the
/// weight of the same nice value ([`crate::cgroup::nice_weight`]). The supervisor takes the agent's nice value too (it lowers its
/// own before the agent starts, so the exec is counted low as well): the
/// fence it enforces while the runner is stopped may then wait for the CPU
/// behind nice-0 work on a saturated host, within the leader's margin of
/// one heartbeat.
pub const DEFAULT_AGENT_NICE: u8 = 19;

/// The parsed agents file: agent id → how to run it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AgentsFile {
    /// The declared agents, by id (sorted).
    pub agents: BTreeMap<String, AgentSpec>,
}

/// How to run one agent (the file's `type` field selects the variant).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AgentSpec {
    /// `type: process`: a local program run as a child process.
    Process(ProcessAgent),
    /// `type: http`: a service the runner calls.
    Http(HttpAgent),
}

/// A `type: http` agent: the runner `POST`s the run's context to `url`
/// (see [`crate::http_agent`] for the request and the answers).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpAgent {
    /// `http://` or `https://` URL.
    pub url: String,
    /// `POST` (default), `PUT` or `PATCH`.
    pub method: String,
    /// Extra request headers.
    pub headers: BTreeMap<String, String>,
    /// Longest wait for the answer (and, for an asynchronous agent, for its
    /// result), within the run's deadline; `None`: the deadline alone.
    pub timeout: Option<Duration>,
    /// CA to trust (PEM) instead of the webpki roots, and a client
    /// certificate and key (PEM) for mTLS.
    pub tls: HttpTls,
    /// A file holding the secret that signs each request's body
    /// (`Punchclock-Signature`, the scheme of outgoing notifications); read
    /// at each request.
    pub signing_secret_file: Option<PathBuf>,
    /// Requests in flight to this agent at once (default 16); an
    /// execution waits for its turn within its deadline.
    pub max_in_flight: u32,
    /// Called (`POST`, the same headers, `{"execution_id": ...}`) when an
    /// asynchronous execution is cancelled or times out.
    pub cancel_url: Option<String>,
    /// The shared resource (the cluster configuration's `resources:`) that
    /// a `429` from this agent holds back until its `Retry-After`: the
    /// runner names it in the attempt's outcome (`resource`), and the
    /// control plane holds it back when the run's task uses it
    /// (`execution.resources`). A `Punchclock-Resource` header on the 429
    /// wins over it. A valid resource name
    /// ([`punchclock_proto::resources::is_valid_name`]).
    pub rate_limit_resource: Option<String>,
}

/// TLS files of an HTTP agent.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpTls {
    /// CA certificate(s), PEM.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    /// Client certificate chain, PEM (with `key_file`).
    #[serde(default)]
    pub cert_file: Option<PathBuf>,
    /// Client key, PEM.
    #[serde(default)]
    pub key_file: Option<PathBuf>,
}

/// Default `max_in_flight` of an HTTP agent.
pub const DEFAULT_MAX_IN_FLIGHT: u32 = 16;

/// A `type: process` agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessAgent {
    /// Program and arguments (argv; no shell). Never empty.
    pub command: Vec<String>,
    /// Extra environment variables, added to the runner's own environment.
    pub env: BTreeMap<String, String>,
    /// Variables whose values are read from files on the runner host at
    /// each execution start (relative paths: against the runner's current
    /// directory).
    pub env_from_file: BTreeMap<String, PathBuf>,
    /// Working directory of the agent; relative paths are resolved against
    /// the runner's current directory. `None`: the runner's current directory.
    pub working_dir: Option<PathBuf>,
    /// CPU, memory and process limits of each execution (a task may lower
    /// them, never raise them); [`Limits::default`]: none.
    pub limits: Limits,
    /// Whether the limits must be applied ([`Enforce::Required`]: a runner
    /// whose host cannot refuses the agent at start) or are applied where
    /// the host can ([`Enforce::BestEffort`]).
    pub enforce: Enforce,
}

/// Whether an agent's limits must hold (`limits.enforce`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Enforce {
    /// `best_effort` (default): what the host cannot limit is not limited
    /// (logged once at start).
    #[default]
    BestEffort,
    /// `required`: the runner refuses the agent at start when its host
    /// cannot apply every limit, and fails an execution whose cgroup cannot
    /// be made.
    Required,
}

/// `limits` as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLimits {
    memory_max: Option<SizeOrNumber>,
    cpu: Option<f64>,
    pids_max: Option<u64>,
    enforce: Option<String>,
}

/// A size as a string with a unit (`512Mi`) or a number of bytes.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum SizeOrNumber {
    Number(u64),
    Text(String),
}

/// Largest `pids_max`: the kernel's `PID_MAX_LIMIT` (2^22; a larger
/// `pids.max` is refused by the kernel).
pub const MAX_PIDS: u64 = 1 << 22;

/// Smallest `memory_max`: 4 MiB (the agent's supervisor lives in the same
/// cgroup).
pub const MIN_MEMORY_MAX: u64 = 4 << 20;

impl RawLimits {
    /// Checks the limits; errors name the field under `field` (`agents.x.limits`).
    fn validate(self, field: &str) -> Result<(Limits, Enforce), String> {
        let memory_max = match self.memory_max {
            None => None,
            Some(SizeOrNumber::Number(n)) => Some(n),
            Some(SizeOrNumber::Text(t)) => Some(crate::cgroup::parse_bytes(&t).map_err(|e| format!("{field}.memory_max: {e}"))?),
        };
        if let Some(m) = memory_max
            && m < MIN_MEMORY_MAX
        {
            return Err(format!("{field}.memory_max: {m} bytes is below the minimum of 4Mi (the agent's supervisor shares the cgroup)"));
        }
        if let Some(c) = self.cpu
            && !(c.is_finite() && (0.01..=1024.0).contains(&c))
        {
            return Err(format!("{field}.cpu: {c} cores: must be in 0.01..=1024"));
        }
        if let Some(p) = self.pids_max
            && !(2..=MAX_PIDS).contains(&p)
        {
            return Err(format!(
                "{field}.pids_max: {p}: must be in 2..={MAX_PIDS} (the agent and its supervisor; the kernel's PID_MAX_LIMIT)"
            ));
        }
        let enforce = match self.enforce.as_deref() {
            None | Some("best_effort") => Enforce::BestEffort,
            Some("required") => Enforce::Required,
            Some(other) => return Err(format!("{field}.enforce: {other:?}: \"required\" or \"best_effort\"")),
        };
        let limits = Limits { memory_max, cpu: self.cpu, pids_max: self.pids_max };
        if !limits.any() && enforce == Enforce::Required {
            return Err(format!("{field}.enforce: required, but no limit is set"));
        }
        Ok((limits, enforce))
    }
}

impl AgentsFile {
    /// Reads and validates the agents file at `path`.
    ///
    /// # Errors
    ///
    /// [`Error::ReadAgentsFile`] if the file cannot be read;
    /// [`Error::InvalidAgentsFile`] (naming the field) if it is not valid YAML
    /// of the expected shape, has unknown fields, an unknown agent `type`, an
    /// empty `command`, or an invalid `env` entry.
    pub fn load(path: impl AsRef<Path>) -> Result<Self, Error> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| Error::ReadAgentsFile { path: path.to_owned(), source })?;
        let file = Self::parse(&text).map_err(|message| Error::InvalidAgentsFile { path: path.to_owned(), message })?;
        // A secret file that is not there now is a mistake to report at
        // start, not at the first run (it is read again at every run).
        for (id, agent) in &file.agents {
            let AgentSpec::Process(agent) = agent else { continue };
            for (key, secret) in &agent.env_from_file {
                if let Err(e) = std::fs::File::open(secret) {
                    return Err(Error::InvalidAgentsFile {
                        path: path.to_owned(),
                        message: format!("agents.{id}.env_from_file.{key}: cannot read {}: {e}", secret.display()),
                    });
                }
            }
        }
        Ok(file)
    }

    /// The declared agent ids, sorted.
    pub fn ids(&self) -> impl Iterator<Item = &str> {
        self.agents.keys().map(String::as_str)
    }

    /// The agent with this id, if declared.
    pub fn get(&self, agent_id: &str) -> Option<&AgentSpec> {
        self.agents.get(agent_id)
    }

    /// Parses and validates YAML text; the error is a message naming the field.
    fn parse(text: &str) -> Result<Self, String> {
        let raw: RawAgentsFile = serde_yaml_ng::from_str(text).map_err(|e| e.to_string())?;
        let agents = raw
            .agents
            .into_iter()
            .map(|(id, agent)| {
                let spec = agent.validate(&id)?;
                Ok((id, spec))
            })
            .collect::<Result<_, String>>()?;
        Ok(Self { agents })
    }
}

/// The file as written, before validation.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAgentsFile {
    agents: BTreeMap<String, RawAgent>,
}

/// One agent entry as written. Holds the fields of every agent type; each
/// type's validation rejects the ones that do not apply to it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAgent {
    #[serde(rename = "type")]
    kind: String,
    command: Option<Vec<String>>,
    #[serde(default)]
    env: BTreeMap<String, String>,
    #[serde(default)]
    env_from_file: BTreeMap<String, PathBuf>,
    working_dir: Option<PathBuf>,
    limits: Option<RawLimits>,
    url: Option<String>,
    method: Option<String>,
    headers: Option<BTreeMap<String, String>>,
    timeout_seconds: Option<u64>,
    tls: Option<HttpTls>,
    signing_secret_file: Option<PathBuf>,
    max_in_flight: Option<u32>,
    cancel_url: Option<String>,
    rate_limit_resource: Option<String>,
}

impl RawAgent {
    fn validate(self, id: &str) -> Result<AgentSpec, String> {
        let field = |name: &str| format!("agents.{id}.{name}");
        if id.is_empty() {
            return Err("agents: agent ids must not be empty".to_owned());
        }
        match self.kind.as_str() {
            "process" => {}
            "http" => return self.validate_http(id),
            other => {
                return Err(format!("{}: unknown agent type {other:?} (supported: \"process\", \"http\")", field("type")));
            }
        }
        for (name, set) in [
            ("url", self.url.is_some()),
            ("method", self.method.is_some()),
            ("headers", self.headers.is_some()),
            ("timeout_seconds", self.timeout_seconds.is_some()),
            ("tls", self.tls.is_some()),
            ("signing_secret_file", self.signing_secret_file.is_some()),
            ("max_in_flight", self.max_in_flight.is_some()),
            ("cancel_url", self.cancel_url.is_some()),
            ("rate_limit_resource", self.rate_limit_resource.is_some()),
        ] {
            if set {
                return Err(format!("{}: only for an http agent", field(name)));
            }
        }

        let command = self.command.ok_or_else(|| format!("{}: required for a process agent", field("command")))?;
        match command.first() {
            None => return Err(format!("{}: must not be empty", field("command"))),
            Some(program) if program.is_empty() => {
                return Err(format!("{}: the program (first element) must not be empty", field("command")));
            }
            Some(_) => {}
        }
        if command.iter().any(|arg| arg.contains('\0')) {
            return Err(format!("{}: must not contain NUL bytes", field("command")));
        }

        for (key, value) in &self.env {
            if key.is_empty() || key.contains(['=', '\0']) || value.contains('\0') {
                return Err(format!("{}: invalid variable {key:?} (names must be non-empty without '=', and no NUL bytes)", field("env")));
            }
        }

        for (key, path) in &self.env_from_file {
            if key.is_empty() || key.contains(['=', '\0']) {
                return Err(format!("{}: invalid variable {key:?} (names must be non-empty without '=')", field("env_from_file")));
            }
            if self.env.contains_key(key) {
                return Err(format!("{}.{key}: also set in env; give it in one of them", field("env_from_file")));
            }
            if path.as_os_str().is_empty() {
                return Err(format!("{}.{key}: the file path must not be empty", field("env_from_file")));
            }
        }

        if self.working_dir.as_ref().is_some_and(|dir| dir.as_os_str().is_empty()) {
            return Err(format!("{}: must not be empty when set", field("working_dir")));
        }

        let (limits, enforce) = match self.limits {
            Some(raw) => raw.validate(&field("limits"))?,
            None => (Limits::default(), Enforce::BestEffort),
        };
        Ok(AgentSpec::Process(ProcessAgent {
            command,
            env: self.env,
            env_from_file: self.env_from_file,
            working_dir: self.working_dir,
            limits,
            enforce,
        }))
    }

    fn validate_http(self, id: &str) -> Result<AgentSpec, String> {
        let field = |name: &str| format!("agents.{id}.{name}");
        for (name, set) in [
            ("command", self.command.is_some()),
            ("env", !self.env.is_empty()),
            ("env_from_file", !self.env_from_file.is_empty()),
            ("working_dir", self.working_dir.is_some()),
            ("limits", self.limits.is_some()),
        ] {
            if set {
                return Err(format!("{}: only for a process agent", field(name)));
            }
        }
        let url_ok = |u: &str| (u.starts_with("http://") || u.starts_with("https://")) && reqwest::Url::parse(u).is_ok();
        let url = self.url.ok_or_else(|| format!("{}: required for an http agent", field("url")))?;
        if !url_ok(&url) {
            return Err(format!("{}: {url:?} is not an http:// or https:// URL", field("url")));
        }
        if let Some(c) = &self.cancel_url
            && !url_ok(c)
        {
            return Err(format!("{}: {c:?} is not an http:// or https:// URL", field("cancel_url")));
        }
        let method = self.method.unwrap_or_else(|| "POST".into()).to_ascii_uppercase();
        if !matches!(method.as_str(), "POST" | "PUT" | "PATCH") {
            return Err(format!("{}: {method:?}: POST, PUT or PATCH (the context is the body)", field("method")));
        }
        let headers = self.headers.unwrap_or_default();
        for (k, v) in &headers {
            if reqwest::header::HeaderName::from_bytes(k.as_bytes()).is_err() || reqwest::header::HeaderValue::from_str(v).is_err() {
                return Err(format!("{}.{k}: not a valid header", field("headers")));
            }
        }
        if let Some(t) = self.timeout_seconds
            && !(1..=365 * 86_400).contains(&t)
        {
            return Err(format!("{}: must be in 1..=31536000", field("timeout_seconds")));
        }
        let tls = self.tls.unwrap_or_default();
        if tls.cert_file.is_some() != tls.key_file.is_some() {
            return Err(format!("{}: give cert_file and key_file together", field("tls")));
        }
        let max_in_flight = self.max_in_flight.unwrap_or(DEFAULT_MAX_IN_FLIGHT);
        if !(1..=10_000).contains(&max_in_flight) {
            return Err(format!("{}: must be in 1..=10000", field("max_in_flight")));
        }
        if let Some(r) = &self.rate_limit_resource
            && !punchclock_proto::resources::is_valid_name(r)
        {
            return Err(format!("{}: {r:?}: {}", field("rate_limit_resource"), punchclock_proto::resources::NAME_RULE));
        }
        Ok(AgentSpec::Http(HttpAgent {
            url,
            method,
            headers,
            timeout: self.timeout_seconds.map(Duration::from_secs),
            tls,
            signing_secret_file: self.signing_secret_file,
            max_in_flight,
            cancel_url: self.cancel_url,
            rate_limit_resource: self.rate_limit_resource,
        }))
    }
}

/// Everything [`crate::session::run`] needs.
#[derive(Debug, Clone)]
pub struct RunnerConfig {
    /// Control-plane addresses (`http://host:port`; a bare `host:port` gets
    /// `http://`). Tried in turn until one welcomes the runner. Non-empty.
    pub control_plane: Vec<String>,
    /// The agents this runner can run.
    pub agents: AgentsFile,
    /// How many executions may run at once (at least 1).
    pub slots: u32,
    /// Free-form labels announced to the control plane (for placement).
    pub labels: BTreeMap<String, String>,
    /// This runner's stable identity, announced in `Hello`. Non-empty.
    pub runner_id: String,
    /// How to exec the agent shim (see [`crate::shim`]); `None` spawns
    /// agents directly. With the shim, agents do not outlive a runner killed
    /// with SIGKILL nor its fence deadline.
    pub shim: Option<ShimCommand>,
    /// Start agents through the shim's fork server (`shim --zygote`, one
    /// process per runner that forks each execution's supervisor) rather
    /// than exec'ing the shim for every execution. Same guarantees; about
    /// half the CPU per start. Ignored without `shim`.
    pub zygote: bool,
    /// Time between SIGTERM and SIGKILL when an agent is stopped.
    pub kill_grace: Duration,
    /// Added to process agents' nice value (0-19; 0: the runner's own
    /// priority): [`DEFAULT_AGENT_NICE`].
    pub agent_nice: u8,
    /// Directory under which each execution gets its own temporary directory
    /// (created if missing).
    pub work_dir: PathBuf,
    /// The runner's credentials: bearer token, TLS trust and client
    /// certificate.
    pub credentials: Credentials,
    /// Where the callback server of asynchronous HTTP agents listens
    /// (`None`: no server; a `202` answer then fails the attempt).
    pub callback_listen: Option<std::net::SocketAddr>,
    /// The base URL agents call back (default: `http://` and the bound
    /// address).
    pub callback_advertise: Option<String>,
    /// Where the host's cgroup hierarchies are mounted (`/sys/fs/cgroup`),
    /// for agents' `limits`; `None`: no limits are applied (an agent with
    /// `enforce: required` limits is then refused).
    pub cgroup_root: Option<PathBuf>,
}

/// How a runner proves who it is to the control plane.
#[derive(Clone, Default)]
pub struct Credentials {
    /// Bearer token (`--token`), sent as `authorization: Bearer …` on the
    /// runner stream. Bound by the control plane to a runner id.
    pub token: Option<String>,
    /// File holding the token (`--token-file`), read again at every
    /// connection (rotation without a restart); wins over `token`.
    pub token_file: Option<PathBuf>,
    /// CA certificate (PEM) that signed the control plane's certificate
    /// (`--ca-file`); `https://` addresses use the webpki roots without it.
    pub ca_pem: Option<Vec<u8>>,
    /// Client certificate and key (PEM) for mTLS (`--tls-cert`,
    /// `--tls-key`): its first DNS subjectAltName must be the runner id.
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl Credentials {
    /// The token to send now: the token file's content (trimmed), else
    /// `token`. An unreadable file keeps `token` and says why.
    pub fn current_token(&self) -> Option<String> {
        match &self.token_file {
            Some(path) => match std::fs::read_to_string(path) {
                Ok(t) if !t.trim().is_empty() => Some(t.trim().to_string()),
                Ok(_) => {
                    tracing::warn!(file = %path.display(), "the token file is empty");
                    self.token.clone()
                }
                Err(e) => {
                    tracing::warn!(file = %path.display(), error = %e, "cannot read the token file");
                    self.token.clone()
                }
            },
            None => self.token.clone(),
        }
    }
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the token or the key.
        f.debug_struct("Credentials")
            .field("token", &self.token.is_some())
            .field("token_file", &self.token_file)
            .field("ca", &self.ca_pem.is_some())
            .field("client_cert", &self.identity.is_some())
            .finish()
    }
}

/// The program (and arguments before `--`) that starts the agent shim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShimCommand {
    /// The program to exec.
    pub program: PathBuf,
    /// Arguments before `-- <agent command...>` (the subcommand, if any).
    pub args: Vec<std::ffi::OsString>,
}

impl ShimCommand {
    /// The dedicated `punchclock-agent-shim` binary at `path`.
    pub fn binary(path: PathBuf) -> Self {
        Self { program: path, args: Vec::new() }
    }

    /// A binary with the hidden `__agent-shim` subcommand (`punchclock`).
    pub fn subcommand(path: PathBuf) -> Self {
        Self { program: path, args: vec![crate::SHIM_SUBCOMMAND.into()] }
    }

    /// The shim for a runner running as `exe`: [`crate::SHIM_BINARY`] in the
    /// same directory if it is there, executable, and speaks this build's
    /// [`crate::shim::SHIM_PROTOCOL`] (asked with `--protocol`; less than
    /// half the CPU per start), else `exe`'s own `__agent-shim` subcommand
    /// (a shim from another build is logged and not used: it would misread
    /// the zygote's requests).
    pub fn beside(exe: PathBuf) -> Self {
        use std::os::unix::fs::PermissionsExt;
        let executable = |path: &std::path::Path| std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0);
        match exe.parent().map(|dir| dir.join(crate::SHIM_BINARY)) {
            Some(binary) if executable(&binary) => match shim_protocol(&binary) {
                Some(p) if p == crate::shim::SHIM_PROTOCOL => Self::binary(binary),
                found => {
                    tracing::warn!(
                        shim = %binary.display(),
                        protocol = ?found,
                        expected = crate::shim::SHIM_PROTOCOL,
                        "the agent shim beside the runner is from another build; using the runner's own __agent-shim (install both from one build)"
                    );
                    Self::subcommand(exe)
                }
            },
            _ => Self::subcommand(exe),
        }
    }
}

/// What `binary --protocol` prints (`None`: nothing a number, or it did
/// not run: a shim from before the flag takes it for an agent to start).
fn shim_protocol(binary: &std::path::Path) -> Option<u32> {
    let out = std::process::Command::new(binary)
        .arg(crate::shim::PROTOCOL_FLAG)
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    std::str::from_utf8(&out.stdout).ok()?.trim().parse().ok()
}

impl RunnerConfig {
    /// Whether the runner talks TLS: an `https://` address, a CA or a
    /// client certificate. Then it never connects in plaintext.
    pub fn uses_tls(&self) -> bool {
        self.control_plane.iter().any(|a| a.trim().starts_with("https://"))
            || self.credentials.ca_pem.is_some()
            || self.credentials.identity.is_some()
    }

    /// A configuration with defaults: 1 slot, no labels, no shim,
    /// [`DEFAULT_KILL_GRACE`], and `work_dir` = `$TMPDIR/punchclock-runner`.
    pub fn new(runner_id: impl Into<String>, control_plane: Vec<String>, agents: AgentsFile) -> Self {
        Self {
            control_plane,
            agents,
            slots: 1,
            labels: BTreeMap::new(),
            runner_id: runner_id.into(),
            shim: None,
            zygote: true,
            kill_grace: DEFAULT_KILL_GRACE,
            agent_nice: DEFAULT_AGENT_NICE,
            work_dir: std::env::temp_dir().join("punchclock-runner"),
            credentials: Credentials::default(),
            callback_listen: None,
            callback_advertise: None,
            cgroup_root: Some(PathBuf::from("/sys/fs/cgroup")),
        }
    }

    /// Checks the invariants documented on the fields.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] naming the field that is wrong.
    pub fn validate(&self) -> Result<(), Error> {
        let invalid = |message: &str| Err(Error::InvalidConfig(message.to_owned()));
        if self.control_plane.is_empty() {
            return invalid("control_plane: at least one address is required");
        }
        if self.agent_nice > 19 {
            return Err(Error::InvalidConfig(format!("agent_nice: {}: must be in 0..=19 (nice values end at 19)", self.agent_nice)));
        }
        for address in &self.control_plane {
            if let Err(err) = tonic::transport::Endpoint::from_shared(normalize_address(address)) {
                return Err(Error::InvalidConfig(format!("control_plane: invalid address {address:?}: {err}")));
            }
        }
        if self.slots == 0 {
            return invalid("slots: must be at least 1");
        }
        if self.runner_id.is_empty() {
            return invalid("runner_id: must not be empty");
        }
        if self.runner_id.len() > 128 || !self.runner_id.chars().all(|c| c.is_ascii_alphanumeric() || "_-.:@".contains(c)) {
            return invalid("runner_id: at most 128 letters, digits and _ - . : @");
        }
        if let Some(t) = &self.credentials.token
            && (t.is_empty() || !t.bytes().all(|b| b.is_ascii_graphic()))
        {
            return invalid("token: must be non-empty printable ASCII (check the token file)");
        }
        Ok(())
    }
}

/// `host:port` → `http://host:port`; addresses with a scheme are kept.
pub(crate) fn normalize_address(address: &str) -> String {
    let address = address.trim();
    if address.contains("://") { address.to_owned() } else { format!("http://{address}") }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A shim binary beside the runner that does not answer `--protocol`
    /// with this build's number (one from an older build takes the flag
    /// for an agent; here programs that print nothing or something else)
    /// is not used: the runner's own subcommand is.
    #[test]
    fn a_shim_from_another_build_is_not_used() {
        for stand_in in ["/bin/true", "/bin/echo", "/bin/false"] {
            let dir = tempfile::tempdir().expect("tempdir");
            std::os::unix::fs::symlink(stand_in, dir.path().join(crate::SHIM_BINARY)).expect("symlink");
            let exe = dir.path().join("punchclock");
            assert_eq!(ShimCommand::beside(exe.clone()), ShimCommand::subcommand(exe), "{stand_in} as the shim");
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let exe = dir.path().join("punchclock");
        assert_eq!(ShimCommand::beside(exe.clone()), ShimCommand::subcommand(exe), "no shim beside it");
    }

    #[test]
    fn parses_a_good_file() {
        let file = AgentsFile::parse(
            r#"
agents:
  report_agent:
    type: process
    command: ["python3", "examples/agents/report.py"]
    env: {K: V}
    working_dir: "."
  minimal:
    type: process
    command: [true]
"#,
        )
        .expect("valid file");

        assert_eq!(file.ids().collect::<Vec<_>>(), ["minimal", "report_agent"]);
        let Some(AgentSpec::Process(report)) = file.get("report_agent") else {
            panic!("report_agent missing");
        };
        assert_eq!(report.command, ["python3", "examples/agents/report.py"]);
        assert_eq!(report.env.get("K").map(String::as_str), Some("V"));
        assert_eq!(report.working_dir.as_deref(), Some(Path::new(".")));
        let Some(AgentSpec::Process(minimal)) = file.get("minimal") else {
            panic!("minimal missing");
        };
        assert_eq!(minimal.command, ["true"]);
        assert!(minimal.env.is_empty());
        assert_eq!(minimal.working_dir, None);
    }

    #[test]
    fn rejects_unknown_fields_naming_them() {
        let err = AgentsFile::parse("agents:\n  a:\n    type: process\n    command: [x]\n    cmd: [y]\n").expect_err("unknown field");
        assert!(err.starts_with("agents.a: unknown field `cmd`"), "{err}");

        let err = AgentsFile::parse("agents: {}\nextra: 1\n").expect_err("unknown top-level field");
        assert!(err.contains("unknown field `extra`"), "{err}");
    }

    #[test]
    fn rejects_empty_or_missing_command() {
        let err = AgentsFile::parse("agents:\n  report_agent:\n    type: process\n    command: []\n").expect_err("empty command");
        assert_eq!(err, "agents.report_agent.command: must not be empty");

        let err = AgentsFile::parse("agents:\n  a:\n    type: process\n").expect_err("no command");
        assert_eq!(err, "agents.a.command: required for a process agent");

        let err = AgentsFile::parse("agents:\n  a:\n    type: process\n    command: ['']\n").expect_err("empty program");
        assert!(err.starts_with("agents.a.command: "), "{err}");
    }

    #[test]
    fn rejects_unknown_type_naming_it() {
        let err = AgentsFile::parse("agents:\n  a:\n    type: docker\n    command: [x]\n").expect_err("unknown type");
        assert_eq!(err, r#"agents.a.type: unknown agent type "docker" (supported: "process", "http")"#);
    }

    #[test]
    fn http_agents_are_parsed_and_checked() {
        let ok = AgentsFile::parse(
            "agents:\n  h:\n    type: http\n    url: https://x.test/run\n    headers: {X-Team: a}\n    timeout_seconds: 30\n    max_in_flight: 4\n",
        )
        .expect("valid");
        let Some(AgentSpec::Http(h)) = ok.get("h") else { panic!("h") };
        assert_eq!((h.method.as_str(), h.max_in_flight, h.timeout), ("POST", 4, Some(Duration::from_secs(30))));
        let err = |y: &str| AgentsFile::parse(y).expect_err("invalid");
        assert_eq!(err("agents:\n  h:\n    type: http\n"), "agents.h.url: required for an http agent");
        assert!(err("agents:\n  h:\n    type: http\n    url: ftp://x\n").starts_with("agents.h.url:"));
        assert!(
            err("agents:\n  h:\n    type: http\n    url: http://x\n    command: [a]\n").starts_with("agents.h.command: only for a process")
        );
        assert!(
            err("agents:\n  p:\n    type: process\n    command: [a]\n    url: http://x\n").starts_with("agents.p.url: only for an http")
        );
        assert!(err("agents:\n  h:\n    type: http\n    url: http://x\n    method: GET\n").starts_with("agents.h.method:"));
        assert!(err("agents:\n  h:\n    type: http\n    url: http://x\n    tls: {cert_file: /c}\n").starts_with("agents.h.tls:"));
        assert!(err("agents:\n  h:\n    type: http\n    url: http://x\n    max_in_flight: 0\n").starts_with("agents.h.max_in_flight:"));
        let named =
            AgentsFile::parse("agents:\n  h:\n    type: http\n    url: http://x\n    rate_limit_resource: llm-eu.1\n").expect("valid");
        let Some(AgentSpec::Http(h)) = named.get("h") else { panic!("h") };
        assert_eq!(h.rate_limit_resource.as_deref(), Some("llm-eu.1"));
        for bad in ["''", "'open ai'", "'a/b'", &"x".repeat(65)] {
            assert_eq!(
                err(&format!("agents:\n  h:\n    type: http\n    url: http://x\n    rate_limit_resource: {bad}\n")),
                format!("agents.h.rate_limit_resource: {:?}: a resource name is 1 to 64 letters, digits, _ - .", bad.trim_matches('\'')),
                "{bad}"
            );
        }
        assert!(
            err("agents:\n  p:\n    type: process\n    command: [a]\n    rate_limit_resource: llm\n")
                .starts_with("agents.p.rate_limit_resource: only for an http")
        );
    }

    #[test]
    fn limits_are_checked() {
        let a = AgentsFile::parse("agents:\n  a:\n    type: process\n    command: [x]\n    limits: {memory_max: 512Mi, cpu: 0.5, pids_max: 64, enforce: required}\n")
            .expect("valid");
        let Some(AgentSpec::Process(a)) = a.get("a") else { panic!("process") };
        assert_eq!(a.limits, Limits { memory_max: Some(512 << 20), cpu: Some(0.5), pids_max: Some(64) });
        assert_eq!(a.enforce, Enforce::Required);
        for (limits, says) in [
            ("{memory_max: lots}", "agents.a.limits.memory_max: \"lots\""),
            ("{memory_max: 1000}", "agents.a.limits.memory_max: 1000 bytes is below the minimum"),
            ("{cpu: 0}", "agents.a.limits.cpu: 0 cores"),
            ("{pids_max: 1}", "agents.a.limits.pids_max: 1: must be in 2..=4194304"),
            ("{pids_max: 5000000}", "agents.a.limits.pids_max: 5000000: must be in 2..=4194304"),
            ("{cpu: 1, enforce: always}", "agents.a.limits.enforce: \"always\""),
            ("{enforce: required}", "agents.a.limits.enforce: required, but no limit is set"),
            ("{cpus: 1}", "unknown field `cpus`"),
        ] {
            let err = AgentsFile::parse(&format!("agents:\n  a:\n    type: process\n    command: [x]\n    limits: {limits}\n"))
                .expect_err(limits);
            assert!(err.contains(says), "{limits}: {err}");
        }
        let http = AgentsFile::parse("agents:\n  h:\n    type: http\n    url: http://x/\n    limits: {cpu: 1}\n").expect_err("http");
        assert!(http.contains("agents.h.limits: only for a process agent"), "{http}");
    }

    #[test]
    fn env_from_file_is_checked() {
        let ok = AgentsFile::parse("agents:\n  a:\n    type: process\n    command: [x]\n    env_from_file: {KEY: /etc/secret}\n")
            .expect("valid");
        let Some(AgentSpec::Process(a)) = ok.get("a") else { panic!("a") };
        assert_eq!(a.env_from_file.get("KEY"), Some(&PathBuf::from("/etc/secret")));
        let both =
            AgentsFile::parse("agents:\n  a:\n    type: process\n    command: [x]\n    env: {KEY: v}\n    env_from_file: {KEY: /s}\n")
                .expect_err("twice");
        assert!(both.starts_with("agents.a.env_from_file.KEY: also set in env"), "{both}");
        let dir = tempfile::tempdir().expect("tempdir");
        let f = dir.path().join("agents.yaml");
        std::fs::write(&f, "agents:\n  a:\n    type: process\n    command: [x]\n    env_from_file: {KEY: /nonexistent/secret}\n")
            .expect("write");
        let err = AgentsFile::load(&f).expect_err("missing secret file").to_string();
        assert!(err.contains("agents.a.env_from_file.KEY: cannot read /nonexistent/secret"), "{err}");
    }

    #[test]
    fn rejects_bad_env_names() {
        let err = AgentsFile::parse("agents:\n  a:\n    type: process\n    command: [x]\n    env: {'A=B': v}\n").expect_err("bad env name");
        assert!(err.starts_with("agents.a.env: "), "{err}");
    }

    #[test]
    fn load_names_the_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("agents.yaml");
        std::fs::write(&path, "agents:\n  a:\n    type: process\n    command: []\n").expect("write");
        let err = AgentsFile::load(&path).expect_err("invalid");
        let text = err.to_string();
        assert!(text.contains("agents.yaml") && text.ends_with("agents.a.command: must not be empty"), "{text}");

        let err = AgentsFile::load(dir.path().join("missing.yaml")).expect_err("missing");
        assert!(matches!(err, Error::ReadAgentsFile { .. }), "{err}");
    }

    #[test]
    fn validates_runner_config() {
        let mut config = RunnerConfig::new("r1", vec!["http://127.0.0.1:1".into()], AgentsFile::default());
        assert!(config.validate().is_ok());
        config.slots = 0;
        assert!(matches!(config.validate(), Err(Error::InvalidConfig(m)) if m.starts_with("slots")));
        config.slots = 1;
        config.control_plane = vec!["127.0.0.1:7070".into()];
        assert!(config.validate().is_ok(), "a bare host:port gets http://");
        config.control_plane = vec!["http://bad host".into()];
        assert!(matches!(config.validate(), Err(Error::InvalidConfig(m)) if m.starts_with("control_plane")));
        config.control_plane.clear();
        assert!(matches!(config.validate(), Err(Error::InvalidConfig(m)) if m.starts_with("control_plane")));
    }
}
