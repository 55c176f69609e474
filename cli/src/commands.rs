//! Command-line surface (clap) and what each command does.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, SecondsFormat, Utc};
use clap::{Args, Parser, Subcommand, ValueEnum};
use pb::cluster_service_client::ClusterServiceClient;
use pb::config_service_client::ConfigServiceClient;
use pb::notification_service_client::NotificationServiceClient;
use pb::run_service_client::RunServiceClient;
use pb::task_service_client::TaskServiceClient;
use punchclock_control_plane::bootstrap::{self, ServerConfig, StoreSpec};
use punchclock_control_plane::clock::{Clock, SystemClock};
use punchclock_control_plane::engine::retention::RetentionConfig;
use punchclock_control_plane::schedule::{CronSchedule, Schedule, Shape};
use punchclock_control_plane::timing::Timing;
use punchclock_proto::v1 as pb;
use tokio_stream::StreamExt;

use crate::client::{self, DEFAULT_ENDPOINT};
use crate::output::{self, print_json, resource_json, run_json, run_row, runner_json, table, task_json};
use crate::security::{ClientAuthArgs, RunnerSecurityArgs, ServerSecurityArgs, TokenCmd};

/// punchclock: makes AI agents clock in on time.
#[derive(Parser, Debug)]
#[command(name = "punchclock", version, about)]
pub struct Cli {
    /// Control-plane API address(es), comma-separated.
    #[arg(long, global = true, env = "PUNCHCLOCK_ENDPOINT", default_value = DEFAULT_ENDPOINT)]
    endpoint: String,
    /// Output format of listings.
    #[arg(short = 'o', long, global = true, value_enum, default_value_t = Format::Table)]
    output: Format,
    /// Log filter (RUST_LOG syntax) for server, runner and dev.
    #[arg(long, global = true, env = "PUNCHCLOCK_LOG", default_value = "info")]
    log: String,
    #[command(flatten)]
    auth: ClientAuthArgs,
    #[command(subcommand)]
    cmd: Cmd,
}

/// `-o` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Format {
    Table,
    Json,
    /// One JSON object a line, written as it arrives (`runs list`,
    /// `runs watch`; elsewhere the same as json).
    Jsonl,
}

#[derive(Subcommand, Debug)]
#[allow(clippy::large_enum_variant)] // parsed once; `dev` and `server` carry their flags
enum Cmd {
    /// Control plane on the embedded store plus one in-process runner.
    Dev(DevArgs),
    /// A control-plane replica.
    Server(Box<ServerArgs>),
    /// An agent runner connected to the control plane.
    Runner(RunnerArgs),
    /// Register and control tasks.
    #[command(subcommand)]
    Task(TaskCmd),
    /// Inspect and cancel runs.
    #[command(subcommand)]
    Runs(RunsCmd),
    /// Connected runners.
    #[command(subcommand)]
    Runners(RunnersCmd),
    /// Backfills (`task backfill`): list, get, pause, resume, cancel.
    #[command(subcommand)]
    Backfills(BackfillsCmd),
    /// Shared resources (the control plane's config `resources:`): in use,
    /// waiting, what their rates allow now, held back until when.
    #[command(subcommand)]
    Resources(ResourcesCmd),
    /// Events: `event publish TOPIC` starts a run of every task with an
    /// event trigger on TOPIC, once per key.
    #[command(subcommand)]
    Event(EventCmd),
    /// Budgets (the control plane's config `budgets:`): each one's current
    /// window, spend settled and reserved against its limits, when it resets.
    #[command(subcommand)]
    Budgets(BudgetsCmd),
    /// Fire times of a cron expression (no server needed).
    Preview(PreviewArgs),
    /// Per task: fired, succeeded, failed, retried, skipped by reason, and
    /// the lag from slot to dispatch and to start (from the run records).
    Stats(StatsArgs),
    /// Cluster membership and leadership.
    #[command(subcommand)]
    Cluster(ClusterCmd),
    /// The cluster configuration (resources, budgets, prices, brokers,
    /// sinks), one versioned document in the store every replica follows.
    #[command(subcommand)]
    Config(ConfigCmd),
    /// Checks task files offline, as `task apply` would (no server):
    /// every problem of every definition, by position, id and field.
    Validate(ValidateArgs),
    /// The notification outbox: what was sent, what waits, dead letters.
    #[command(subcommand)]
    Notifications(NotificationsCmd),
    /// Make API tokens and their tokens-file entries (README "Security").
    #[command(subcommand)]
    Token(TokenCmd),
}

#[derive(Subcommand, Debug)]
enum NotificationsCmd {
    /// Notifications, newest first.
    List {
        /// pending, delivered or dead.
        #[arg(long)]
        status: Option<String>,
        /// Only this task's.
        #[arg(long, default_value = "")]
        task: String,
        #[arg(long, default_value_t = 100)]
        limit: u32,
    },
    /// Send a dead (or pending) notification again now, its attempts reset.
    Retry { id: String },
}

#[derive(Args, Debug)]
struct StatsArgs {
    /// One task (default: all).
    #[arg(long)]
    task: Option<String>,
    /// Runs whose slot is within this long ago ("1h", "30m", "7d").
    #[arg(long, default_value = "1h")]
    since: String,
}

#[derive(Subcommand, Debug)]
enum ConfigCmd {
    /// Validates FILE and every stored task against it, then stores it as
    /// the next version (admin; the leader answers).
    Apply {
        /// The document, YAML or JSON (`-`: stdin).
        #[arg(short = 'f', long = "file")]
        file: String,
        /// Check only: nothing is stored.
        #[arg(long)]
        dry_run: bool,
    },
    /// The configuration in force (or an earlier version), as applied.
    Get {
        /// An earlier version (the last 20 are kept).
        #[arg(long)]
        version: Option<u64>,
    },
    /// How FILE differs from the configuration in force (exit code 1 when
    /// it does), compared by meaning: layout, comments and key order aside.
    Diff {
        /// The document (`-`: stdin).
        #[arg(short = 'f', long = "file")]
        file: String,
    },
}

#[derive(Args, Debug)]
struct ValidateArgs {
    /// Task file(s): JSON or YAML, one definition or a list (`-`: stdin).
    #[arg(short = 'f', long = "file", required = true, num_args = 1..)]
    file: Vec<String>,
    /// A cluster configuration to check resources and brokers against
    /// (without it, those are not checked).
    #[arg(long)]
    config: Option<String>,
}

#[derive(Subcommand, Debug)]
enum ClusterCmd {
    /// Members, the leader's advertised address and its fencing token.
    Status,
}

#[derive(Args, Debug, Clone)]
struct TimingArgs {
    /// Runner heartbeat interval in milliseconds: a runner silent for 3 gets no new work; it is lost after its fence (2 × lease TTL + 3 heartbeats + kill grace + 1 s) plus one.
    #[arg(long, default_value_t = 2000)]
    heartbeat_ms: u64,
    /// TERM→KILL grace in milliseconds when an agent is stopped.
    #[arg(long, default_value_t = 5000)]
    kill_grace_ms: u64,
}

/// What only a replica on etcd has (`server`; `dev` has no lease and
/// keeps no history to compact).
#[derive(Args, Debug, Clone)]
struct EtcdArgs {
    /// TTL in milliseconds of the leader's etcd lease (renewed every TTL/3).
    #[arg(long, default_value_t = 5000)]
    lease_ttl_ms: u64,
    /// Do not compact etcd's history after retention passes (etcd's
    /// compaction is cluster-wide: every key prefix of that etcd).
    #[arg(long)]
    no_etcd_compaction: bool,
}

/// Run retention flags (`dev` and `server`).
#[derive(Args, Debug)]
struct RetentionArgs {
    /// Finished runs kept per task, newest first, when its `history` does
    /// not say.
    #[arg(long, default_value_t = 1000)]
    history_keep_last: u32,
    /// Age after which a finished run is deleted, when its task's
    /// `history` does not say ("30d", "12h").
    #[arg(long, default_value = "30d")]
    history_max_age: String,
    /// Time between retention passes of the leader ("5m", "30s").
    #[arg(long, default_value = "5m")]
    retention_interval: String,
}

/// Connection caps and timeouts of the gRPC and HTTP ports (`dev` and
/// `server`): README "Connections and limits".
#[derive(Args, Debug)]
struct ConnArgs {
    /// Open connections on the gRPC port at most; at the cap the one idle
    /// longest is closed for a new one (default: half of what the
    /// open-files limit leaves after a reserve of an eighth, at most
    /// 16,384).
    #[arg(long)]
    grpc_max_connections: Option<usize>,
    /// Of those, from one source address (default: a quarter of the cap).
    #[arg(long)]
    grpc_max_connections_per_ip: Option<usize>,
    /// A gRPC connection must begin its first call within this: TCP, TLS,
    /// the HTTP/2 preface and the call's headers ("10s").
    #[arg(long, default_value = "10s")]
    grpc_handshake_timeout: String,
    /// A gRPC connection with no call in flight this long is closed ("0":
    /// never). A runner's stream is a call in flight while it is open.
    #[arg(long, default_value = "5m")]
    grpc_idle_timeout: String,
    /// HTTP/2 PING on each gRPC connection every this long; one unanswered
    /// for 20 s closes it ("0": no pings).
    #[arg(long, default_value = "30s")]
    grpc_keepalive: String,
    /// Open connections on the HTTP port at most; at the cap the one idle
    /// longest is closed for a new one (default: half of what the
    /// open-files limit leaves after a reserve of an eighth, at most
    /// 16,384).
    #[arg(long)]
    http_max_connections: Option<usize>,
    /// Of those, from one source address (default: a quarter of the cap).
    #[arg(long)]
    http_max_connections_per_ip: Option<usize>,
    /// An HTTP request's headers must arrive within this, and so must the
    /// next request's on a kept-alive connection ("10s").
    #[arg(long, default_value = "10s")]
    http_header_timeout: String,
    /// A webhook's, event's or dashboard form's body must arrive within this, else `408` and
    /// the connection closed ("10s").
    #[arg(long, default_value = "10s")]
    http_body_timeout: String,
}

impl ConnArgs {
    /// The ports' limits, with the process's open-files limit (`None`:
    /// unlimited) their default caps are shares of.
    fn limits(&self, open_files: Option<u64>) -> Result<punchclock_control_plane::conns::ConnectionLimits, String> {
        let secs = |flag: &str, v: &str| {
            punchclock_control_plane::schedule::parse_duration(v).map(Duration::from_secs).map_err(|e| format!("--{flag}: {e}"))
        };
        let positive = |flag: &str, v: &str| match secs(flag, v)? {
            d if d.is_zero() => Err(format!("--{flag}: must be above 0")),
            d => Ok(d),
        };
        let or_never = |flag: &str, v: &str| Ok::<_, String>(Some(secs(flag, v)?).filter(|d| !d.is_zero()));
        Ok(punchclock_control_plane::conns::ConnectionLimits {
            open_files,
            grpc_max: self.grpc_max_connections,
            grpc_max_per_ip: self.grpc_max_connections_per_ip,
            grpc_handshake_timeout: positive("grpc-handshake-timeout", &self.grpc_handshake_timeout)?,
            grpc_idle_timeout: or_never("grpc-idle-timeout", &self.grpc_idle_timeout)?,
            grpc_keepalive: or_never("grpc-keepalive", &self.grpc_keepalive)?,
            http_max: self.http_max_connections,
            http_max_per_ip: self.http_max_connections_per_ip,
            http_header_timeout: positive("http-header-timeout", &self.http_header_timeout)?,
            http_body_timeout: positive("http-body-timeout", &self.http_body_timeout)?,
        })
    }
}

/// The control plane's config file (`dev` and `server`).
#[derive(Args, Debug)]
struct ConfigArgs {
    /// Config file (YAML or JSON): notification sinks (`webhook://NAME`)
    /// and delivery settings, resources, budgets, prices; reloaded on
    /// SIGHUP (an invalid file is refused and the running one kept). See
    /// README "Notifications" and "Agents that share things".
    #[arg(long)]
    config: Option<PathBuf>,
    #[command(flatten)]
    otlp: OtlpArgs,
    /// The dashboard's link for a run's trace: a URL with `{trace_id}` in
    /// it, such as Jaeger's http://jaeger:16686/trace/{trace_id}.
    #[arg(long, value_name = "URL")]
    ui_trace_url: Option<String>,
}

/// Trace export (`dev`, `server`, `runner`).
#[derive(Args, Debug)]
struct OtlpArgs {
    /// OTLP/gRPC endpoint for traces (e.g. http://127.0.0.1:4317); default:
    /// OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT;
    /// none: no traces.
    #[arg(long)]
    otlp_endpoint: Option<String>,
}

impl OtlpArgs {
    fn start(&self, service: &str) -> Result<Option<punchclock_control_plane::telemetry::Telemetry>, String> {
        punchclock_control_plane::telemetry::Telemetry::start(self.otlp_endpoint.as_deref(), service).map_err(|e| e.to_string())
    }
}

impl ConfigArgs {
    fn ui(&self) -> Result<punchclock_control_plane::ui::UiConfig, String> {
        if let Some(u) = &self.ui_trace_url
            && (!u.contains("{trace_id}") || !(u.starts_with("http://") || u.starts_with("https://")))
        {
            return Err(format!("--ui-trace-url {u:?}: an http(s) URL with {{trace_id}} in it"));
        }
        Ok(punchclock_control_plane::ui::UiConfig { trace_link: self.ui_trace_url.clone() })
    }

    fn load(&self) -> Result<punchclock_control_plane::config::ConfigHandle, String> {
        punchclock_control_plane::config::ConfigHandle::load(self.config.as_deref())
            .map_err(|e| format!("--config {}: {e}", self.config.as_deref().map(|p| p.display().to_string()).unwrap_or_default()))
    }
}

impl RetentionArgs {
    /// `compact`: compact the store's history after each pass (etcd).
    fn config(&self, compact: bool) -> Result<RetentionConfig, String> {
        let secs = |flag: &str, v: &str| punchclock_control_plane::schedule::parse_duration(v).map_err(|e| format!("--{flag}: {e}"));
        let max_age = secs("history-max-age", &self.history_max_age)?;
        let interval = secs("retention-interval", &self.retention_interval)?;
        if self.history_keep_last == 0 {
            return Err("--history-keep-last: must be at least 1".into());
        }
        if !(60..=punchclock_control_plane::model::task::MAX_MAX_AGE_SECONDS).contains(&max_age) || interval == 0 {
            return Err("--history-max-age must be within 1m..=36500d and --retention-interval above 0".into());
        }
        Ok(RetentionConfig {
            keep_last: self.history_keep_last,
            max_age: chrono::Duration::seconds(max_age as i64),
            interval: Duration::from_secs(interval),
            compact,
        })
    }
}

impl TimingArgs {
    /// The timing constants, with the leader lease's TTL (ms).
    fn timing(&self, lease_ttl_ms: u64) -> Timing {
        Timing {
            heartbeat_interval: Duration::from_millis(self.heartbeat_ms.max(100)),
            kill_grace: Duration::from_millis(self.kill_grace_ms),
            lease_ttl: Duration::from_millis(lease_ttl_ms.max(1000)),
        }
    }
}

#[derive(Args, Debug)]
struct DevArgs {
    /// Data directory of the embedded store.
    #[arg(long, default_value = ".punchclock")]
    data_dir: PathBuf,
    /// gRPC listen address.
    #[arg(long, default_value = "127.0.0.1:7700")]
    listen: SocketAddr,
    /// HTTP listen address (/healthz, /metrics, webhooks, the dashboard at
    /// /ui/). Default: the port after --listen's (7701), or a free one when
    /// that is taken; printed at start.
    #[arg(long)]
    http_listen: Option<SocketAddr>,
    /// Agents file of the in-process runner.
    #[arg(long, default_value = DEFAULT_AGENTS_FILE)]
    agents: PathBuf,
    /// Slots of the in-process runner.
    #[arg(long, default_value_t = 4)]
    slots: u32,
    /// Exec the agent shim for every execution instead of forking each
    /// execution's supervisor from one long-lived shim (the zygote, the
    /// default: half the CPU per agent start, same guarantees).
    #[arg(long)]
    no_agent_zygote: bool,
    /// Added to process agents' nice value, 0-19 (0: the runner's own CPU
    /// priority). The default, 19, lets the runner start a burst of agents
    /// and answer heartbeats before agents already running take the CPU.
    #[arg(long, default_value_t = punchclock_agent_runner::DEFAULT_AGENT_NICE, value_parser = clap::value_parser!(u8).range(0..=19))]
    agent_nice: u8,
    /// Where asynchronous HTTP agents call back (default: a free port on
    /// 127.0.0.1).
    #[arg(long, default_value = "127.0.0.1:0")]
    callback_listen: SocketAddr,
    /// Where the cgroup hierarchies are mounted, for agents' `limits`
    /// (`none`: apply no limits).
    #[arg(long, default_value = "/sys/fs/cgroup")]
    cgroup_root: PathBuf,
    /// Listen beyond loopback although `dev` has no TLS and no tokens.
    #[arg(long)]
    insecure: bool,
    #[command(flatten)]
    timing: TimingArgs,
    #[command(flatten)]
    retention: RetentionArgs,
    #[command(flatten)]
    config: ConfigArgs,
    #[command(flatten)]
    connections: ConnArgs,
}

/// Where finished runs go (`server`): README "Run history".
#[derive(Args, Debug)]
struct HistoryArgs {
    /// Keep finished runs in PostgreSQL: `postgres://USER@HOST:PORT/DB`
    /// (libpq's URL; `?sslmode=require` for TLS). They move there from
    /// the store once finished; the store keeps open runs only.
    #[arg(long)]
    history: Option<String>,
    /// A file whose first line is the PostgreSQL password.
    #[arg(long)]
    history_password_file: Option<PathBuf>,
    /// PEM CA certificates to verify PostgreSQL's certificate (default:
    /// the web PKI's roots).
    #[arg(long)]
    history_ca_file: Option<PathBuf>,
}

impl HistoryArgs {
    /// The archive's spec, or what is wrong with a flag.
    fn spec(&self) -> Result<Option<punchclock_control_plane::repo::history::postgres::PgSpec>, String> {
        let Some(url) = &self.history else {
            if self.history_password_file.is_some() || self.history_ca_file.is_some() {
                return Err("--history-password-file and --history-ca-file need --history postgres://...".into());
            }
            return Ok(None);
        };
        if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
            return Err(format!("--history {url:?}: give postgres://USER@HOST:PORT/DB"));
        }
        Ok(Some(punchclock_control_plane::repo::history::postgres::PgSpec {
            url: url.clone(),
            password_file: self.history_password_file.clone(),
            ca_file: self.history_ca_file.clone(),
        }))
    }
}

#[derive(Args, Debug)]
struct ServerArgs {
    /// `embedded:DIR` (single node) or `etcd://host:port[,host:port...]`.
    #[arg(long)]
    store: String,
    /// gRPC listen address.
    #[arg(long, default_value = "127.0.0.1:7700")]
    listen: SocketAddr,
    /// Address other processes reach this replica at (default: http://LISTEN).
    #[arg(long)]
    advertise: Option<String>,
    /// HTTP listen address (/healthz, /metrics, webhooks, the dashboard at
    /// /ui/); off when not given.
    #[arg(long)]
    http_listen: Option<SocketAddr>,
    /// Address other replicas reach this one's HTTP port at: followers
    /// forward webhook requests to the leader's (default: http://HTTP_LISTEN,
    /// with --advertise's host when HTTP_LISTEN is 0.0.0.0).
    #[arg(long)]
    http_advertise: Option<String>,
    /// Replica id, unique in the cluster (default: cp-HOST-PID).
    #[arg(long)]
    node_id: Option<String>,
    /// Key prefix in the store.
    #[arg(long, default_value = "/punchclock/")]
    key_prefix: String,
    #[command(flatten)]
    security: ServerSecurityArgs,
    #[command(flatten)]
    timing: TimingArgs,
    #[command(flatten)]
    etcd: EtcdArgs,
    #[command(flatten)]
    retention: RetentionArgs,
    #[command(flatten)]
    config: ConfigArgs,
    #[command(flatten)]
    connections: ConnArgs,
    #[command(flatten)]
    history: HistoryArgs,
}

#[derive(Args, Debug)]
struct RunnerArgs {
    /// Control-plane address(es), comma-separated.
    #[arg(long)]
    control_plane: String,
    /// Agents file (YAML).
    #[arg(long)]
    agents: PathBuf,
    /// Concurrent executions.
    #[arg(long, default_value_t = 4)]
    slots: u32,
    /// Labels, `k=v` comma-separated.
    #[arg(long, default_value = "")]
    labels: String,
    /// Runner id, unique in the cluster (default: runner-HOST-PID).
    #[arg(long)]
    runner_id: Option<String>,
    #[command(flatten)]
    otlp: OtlpArgs,
    /// TERM→KILL grace in milliseconds.
    #[arg(long, default_value_t = 5000)]
    kill_grace_ms: u64,
    /// Working directory for execution directories (progress and result
    /// files); locked by this process. Default: `$TMPDIR/punchclock-runner/<runner id>`.
    #[arg(long)]
    work_dir: Option<PathBuf>,
    /// Exec the agent shim for every execution instead of forking each
    /// execution's supervisor from one long-lived shim (the zygote, the
    /// default: half the CPU per agent start, same guarantees).
    #[arg(long)]
    no_agent_zygote: bool,
    /// Added to process agents' nice value, 0-19 (0: the runner's own CPU
    /// priority). The default, 19, lets the runner start a burst of agents
    /// and answer heartbeats before agents already running take the CPU.
    #[arg(long, default_value_t = punchclock_agent_runner::DEFAULT_AGENT_NICE, value_parser = clap::value_parser!(u8).range(0..=19))]
    agent_nice: u8,
    /// Where asynchronous HTTP agents (a `202` answer) call back with their
    /// progress and result (off when not given).
    #[arg(long)]
    callback_listen: Option<SocketAddr>,
    /// The base URL agents call back at (default: http://CALLBACK_LISTEN).
    #[arg(long)]
    callback_advertise: Option<String>,
    /// Where the cgroup hierarchies are mounted, for agents' `limits`
    /// (`none`: apply no limits; an agent whose limits are `required` is
    /// then refused).
    #[arg(long, default_value = "/sys/fs/cgroup")]
    cgroup_root: PathBuf,
    #[command(flatten)]
    security: RunnerSecurityArgs,
}

#[derive(Subcommand, Debug)]
enum TaskCmd {
    /// Create or replace the tasks in a JSON or YAML file.
    Apply {
        /// Task file (`.json`: an object or an array; YAML: documents or lists).
        #[arg(short = 'f', long = "file")]
        file: PathBuf,
        /// Validate only.
        #[arg(long)]
        dry_run: bool,
    },
    /// List tasks.
    List {
        /// Show each task's last N slots from the run history, newest
        /// first (a SLOTS column: ✓ succeeded, ✗ failed, ⏱ timed out,
        /// ⊘ cancelled, · skipped, ▶ running, … waiting; `-o json` has
        /// each cell's status, reason and run id). 0 to 50.
        #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=50))]
        slots: u32,
    },
    /// Show one task.
    Get { task_id: String },
    /// Delete a task (its runs are kept).
    Delete { task_id: String },
    /// Stop firing a task.
    Pause { task_id: String },
    /// Resume a paused task.
    Resume { task_id: String },
    /// Close a task's circuit breaker by hand (its next run is admitted).
    ResetBreaker { task_id: String },
    /// Run the task's own slots over a past range (README "Backfills"):
    /// `--reprocess missing` (slots with no record), `failed` (slots that
    /// ended FAILED or TIMEOUT, as linked runs) or `all`. Prints the
    /// backfill (follow it with `backfills get ID`), or with --dry-run
    /// what each slot would get.
    Backfill {
        task_id: String,
        /// First slot (RFC 3339, or a duration ago: "30d").
        #[arg(long)]
        from: String,
        /// Last slot (RFC 3339, or a duration ago; default now).
        #[arg(long)]
        to: Option<String>,
        /// missing, failed or all.
        #[arg(long, default_value = "missing", value_parser = ["missing", "failed", "all"])]
        reprocess: String,
        /// Its runs live at once (1..=1000).
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1000))]
        max_concurrent: u32,
        /// oldest or newest first.
        #[arg(long, default_value = "oldest", value_parser = ["oldest", "newest"])]
        order: String,
        /// continue or stop at a failed run.
        #[arg(long, default_value = "continue", value_parser = ["continue", "stop"])]
        on_failure: String,
        /// List what each slot would get; create nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Start a manual run.
    Trigger {
        task_id: String,
        /// JSON object merged over context.params.
        #[arg(long, default_value = "")]
        params: String,
        /// Seconds to wait before the run may start.
        #[arg(long, default_value_t = 0)]
        delay: u64,
        /// Idempotency key: the same key makes no second run within
        /// --key-ttl.
        #[arg(long, default_value = "")]
        key: String,
        /// How long --key finds its run: `90s`, `2h`, `7d` (default 24h, at
        /// most 30d); afterwards the key makes a new run.
        #[arg(long, default_value = "", requires = "key")]
        key_ttl: String,
        /// W3C traceparent: the run joins this trace (default: the
        /// `TRACEPARENT` environment variable, as inside a traced agent).
        #[arg(long, env = "TRACEPARENT", default_value = "")]
        traceparent: String,
        /// W3C tracestate that goes with --traceparent (default: the
        /// `TRACESTATE` environment variable).
        #[arg(long, env = "TRACESTATE", default_value = "")]
        tracestate: String,
        /// W3C baggage for the agent's `BAGGAGE` (default: the `BAGGAGE`
        /// environment variable).
        #[arg(long, env = "BAGGAGE", default_value = "")]
        baggage: String,
    },
}

/// Which runs `runs list` and `runs export` read.
#[derive(Args, Debug)]
struct RunQueryArgs {
    /// One task's runs.
    #[arg(long, default_value = "")]
    task: String,
    /// Runs of tasks whose id starts with this.
    #[arg(long, default_value = "")]
    task_prefix: String,
    /// PENDING, RUNNING, SUCCEEDED, FAILED, RETRYING, TIMEOUT, CANCELLED, SKIPPED.
    #[arg(long)]
    status: Option<String>,
    /// cron, interval, once, manual, event, webhook, queue or after.
    #[arg(long)]
    trigger: Option<String>,
    /// Only runs an event with this id started (a webhook delivery id,
    /// a queue message id, a published event's key).
    #[arg(long, default_value = "")]
    event_key: String,
    /// Runs whose slot is at most this long ago ("1h", "7d") or at or
    /// after this time (RFC 3339).
    #[arg(long)]
    since: Option<String>,
    /// Runs whose slot is more than this long ago ("10m") or before this
    /// time (RFC 3339).
    #[arg(long)]
    until: Option<String>,
    /// newest or oldest (first). Default: oldest with --since (a window
    /// read forward) and for `runs export`, else newest.
    #[arg(long)]
    order: Option<String>,
}

impl RunQueryArgs {
    /// The request of the first page, or what is wrong with a flag.
    /// `forward`: oldest first unless `--order` says otherwise (an export),
    /// else oldest first only with `--since`.
    fn request(&self, now: chrono::DateTime<chrono::Utc>, forward: bool) -> Result<pb::ListRunsRequest, String> {
        let status = match &self.status {
            None => pb::RunStatus::Unspecified,
            Some(s) => {
                pb::RunStatus::from_str_name(&s.to_ascii_uppercase()).filter(|s| *s != pb::RunStatus::Unspecified).ok_or_else(|| {
                    format!("--status: unknown status {s:?} (PENDING, RUNNING, SUCCEEDED, FAILED, RETRYING, TIMEOUT, CANCELLED, SKIPPED)")
                })?
            }
        };
        let trigger = match &self.trigger {
            None => pb::TriggerKind::Unspecified,
            Some(s) => pb::TriggerKind::from_str_name(&format!("TRIGGER_KIND_{}", s.to_ascii_uppercase()))
                .filter(|k| *k != pb::TriggerKind::Unspecified)
                .ok_or_else(|| {
                    format!("--trigger: unknown trigger kind {s:?} (cron, interval, once, manual, event, webhook, queue, after)")
                })?,
        };
        let at = |flag: &str, v: &Option<String>| -> Result<Option<prost_types::Timestamp>, String> {
            let Some(v) = v else { return Ok(None) };
            let t = match chrono::DateTime::parse_from_rfc3339(v) {
                Ok(t) => t.with_timezone(&chrono::Utc),
                // Looks like a date or a time: say what is wrong with it as one.
                Err(e) if v.contains(['-', ':', 'T']) && v.starts_with(|c: char| c.is_ascii_digit()) && v.len() >= 8 => {
                    return Err(format!(
                        "{flag}: {v:?} is not an RFC 3339 time ({e}; such as 2026-12-07T10:00:00Z) nor a duration (1h, 7d)"
                    ));
                }
                Err(_) => {
                    let secs = punchclock_control_plane::schedule::parse_duration(v)
                        .map_err(|e| format!("{flag}: {e} (a duration such as 1h, or an RFC 3339 time)"))?;
                    i64::try_from(secs)
                        .ok()
                        .and_then(chrono::TimeDelta::try_seconds)
                        .and_then(|d| now.checked_sub_signed(d))
                        .ok_or_else(|| format!("{flag}: too long ago"))?
                }
            };
            Ok(Some(punchclock_proto::time::to_timestamp(t)))
        };
        let order = match self.order.as_deref().map(str::to_ascii_lowercase).as_deref() {
            None if forward || self.since.is_some() => pb::RunOrder::OldestFirst,
            None | Some("newest") => pb::RunOrder::NewestFirst,
            Some("oldest") => pb::RunOrder::OldestFirst,
            Some(_) => return Err(format!("--order: {:?} is neither newest nor oldest", self.order.as_deref().unwrap_or_default())),
        };
        let (from, to) = (at("--since", &self.since)?, at("--until", &self.until)?);
        if let (Some(f), Some(t)) = (&from, &to)
            && (t.seconds, t.nanos) < (f.seconds, f.nanos)
        {
            return Err(format!(
                "--until {:?} is before --since {:?}: a window runs from --since to --until",
                self.until.as_deref().unwrap_or_default(),
                self.since.as_deref().unwrap_or_default()
            ));
        }
        Ok(pb::ListRunsRequest {
            task_id: self.task.clone(),
            task_prefix: self.task_prefix.clone(),
            status: status as i32,
            trigger_kind: trigger as i32,
            event_key: self.event_key.clone(),
            scheduled_from: from,
            scheduled_to: to,
            order: order as i32,
            ..Default::default()
        })
    }
}

#[derive(Subcommand, Debug)]
enum RunsCmd {
    /// List runs: the newest 100, or a window (--since, --until) read
    /// forward in scheduled order; pages are fetched as needed (-o jsonl
    /// prints each run as its page arrives).
    List {
        #[command(flatten)]
        q: RunQueryArgs,
        /// Runs at most (0: every run of the window).
        #[arg(long, default_value_t = 100)]
        limit: u64,
    },
    /// Every run of a window as JSON lines, in scheduled order (`runs list
    /// -o jsonl --limit 0`): `runs export --since 7d > runs.jsonl`.
    Export {
        #[command(flatten)]
        q: RunQueryArgs,
    },
    /// Show one run.
    Get { run_id: String },
    /// Cancel a run.
    Cancel {
        run_id: String,
        #[arg(long, default_value = "")]
        reason: String,
    },
    /// Re-run a run with its input (params, event, upstream): a new run
    /// `RUN.rerun-N` with `rerun_of`; or, without RUN, every run of --task
    /// in --status (and --since/--until) that has no re-run yet, each
    /// once (repeating creates nothing). Served by the leader.
    Rerun {
        /// The run to re-run (or give --task and --status).
        run_id: Option<String>,
        #[command(flatten)]
        q: RunQueryArgs,
        /// Say what would be re-run; create nothing.
        #[arg(long)]
        dry_run: bool,
        /// At most this many in bulk (1..=10000).
        #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=10_000))]
        limit: u32,
    },
    /// Delete finished runs beyond their tasks' history now (the leader
    /// does it every --retention-interval).
    Prune {
        /// Only this task's runs.
        #[arg(long, default_value = "")]
        task: String,
    },
    /// Print runs as they change.
    Watch {
        #[arg(long, default_value = "")]
        task: String,
    },
}

#[derive(Subcommand, Debug)]
enum BackfillsCmd {
    /// Every backfill (of --task), newest first.
    List {
        #[arg(long, default_value = "")]
        task: String,
    },
    /// One backfill: state, cursor, counters.
    Get { id: String },
    /// Freeze its cursor: it creates nothing until resumed.
    Pause { id: String },
    /// Go on from its cursor.
    Resume { id: String },
    /// Stop it for good (its record stays; its runs go on).
    Cancel { id: String },
}

#[derive(Subcommand, Debug)]
enum RunnersCmd {
    /// Runners known to the leader.
    List,
}

#[derive(Subcommand, Debug)]
enum ResourcesCmd {
    /// Every resource as the leader holds it now.
    List,
    /// Ends a resource's hold-back now (an agent answered `rate_limited`
    /// or `quota_exhausted` naming it); prints the resource (operator).
    Release {
        /// The resource (`resources.NAME` of the cluster configuration).
        name: String,
    },
}

#[derive(Subcommand, Debug)]
enum EventCmd {
    /// Publishes an event (PublishEvent): one run per task with
    /// `{type: event, topic: TOPIC}`, exactly one per --key.
    Publish {
        /// Topic: 1 to 128 letters, digits, `_ - .`.
        topic: String,
        /// JSON payload (the agent gets it as `context.event.body`).
        #[arg(long, default_value = "")]
        payload: String,
        /// Idempotency key (required, 1 to 256 characters): publishing again
        /// with it within --key-ttl makes no new run.
        #[arg(long)]
        key: String,
        /// How long --key finds its runs: `90s`, `2h`, `7d` (default 24h,
        /// at most 30d).
        #[arg(long, default_value = "")]
        key_ttl: String,
    },
}

#[derive(Subcommand, Debug)]
enum BudgetsCmd {
    /// Every budget's current window as the leader holds it now.
    List,
}

#[derive(Args, Debug)]
struct PreviewArgs {
    /// Cron expression (5, 6 or 7 fields, or @alias).
    expr: String,
    /// IANA zone.
    #[arg(long = "tz", default_value = "UTC")]
    tz: String,
    /// Fire times strictly after this instant (RFC 3339; default now).
    #[arg(long)]
    after: Option<DateTime<Utc>>,
    /// How many (1..=1000).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=i64::from(punchclock_control_plane::api::MAX_PREVIEW)))]
    count: u32,
    /// DST policy for slots whose local time a change skips: shift (run at
    /// the jump) or skip (a SKIPPED dst_gap record). Default: cronie's rule.
    #[arg(long = "dst-gap", value_parser = ["shift", "skip"])]
    dst_gap: Option<String>,
    /// DST policy for slots whose local time happens twice: first, last or both.
    #[arg(long = "dst-repeat", value_parser = ["first", "last", "both"])]
    dst_repeat: Option<String>,
}

impl Cli {
    /// `dev`, `server` and `runner`: processes that run until stopped.
    pub fn is_long_running(&self) -> bool {
        matches!(self.cmd, Cmd::Dev(_) | Cmd::Server(_) | Cmd::Runner(_))
    }
}

/// Sets up `tracing` for the long-running commands. Log lines are written
/// to stderr by a thread of their own (`tracing-appender`'s non-blocking
/// writer, never dropping a line: a full buffer of 128k lines holds the
/// logging thread back), so the leader's engine task does not wait for a
/// `write` per line — four per run at 1,000 runs a second — and a burst of
/// lines leaves in a few large writes. The returned guard flushes what is
/// buffered when dropped: keep it until the process ends.
pub fn init_tracing(cli: &Cli) -> Option<tracing_appender::non_blocking::WorkerGuard> {
    if cli.is_long_running() {
        // The broker clients log every failed connection attempt as an
        // error; punchclock says it once a minute itself (and /readyz, the
        // metrics): theirs are off unless the filter names them.
        let quiet = |f: &str| {
            if f.contains("lapin") || f.contains("async_nats") { f.to_string() } else { format!("{f},lapin=off,async_nats=warn") }
        };
        let filter =
            tracing_subscriber::EnvFilter::try_new(quiet(&cli.log)).unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(quiet("info")));
        use std::io::IsTerminal;
        let (writer, guard) = tracing_appender::non_blocking::NonBlockingBuilder::default()
            .lossy(false)
            .thread_name("punchclock-log")
            // Buffered: the logging thread drains every line queued and
            // then flushes (tracing-appender's worker), so a burst leaves
            // in a few large writes instead of a syscall per line.
            .finish(std::io::BufWriter::with_capacity(64 * 1024, std::io::stderr()));
        let _ = LOG_WRITER.set(writer.clone());
        tracing_subscriber::fmt().with_env_filter(filter).with_ansi(std::io::stderr().is_terminal()).with_writer(writer).init();
        return Some(guard);
    }
    None
}

/// The log lines' writer of a long-running command ([`init_tracing`]).
static LOG_WRITER: std::sync::OnceLock<tracing_appender::non_blocking::NonBlocking> = std::sync::OnceLock::new();

/// Writes `line` to stderr in order with the log lines before it (through
/// their writer when logging is set up, else directly): a line such as
/// "API on ..." never overtakes a warning logged before it.
fn announce(line: &str) {
    use std::io::Write;
    match LOG_WRITER.get() {
        Some(w) => {
            let _ = w.clone().write_all(format!("{line}\n").as_bytes());
        }
        None => eprintln!("{line}"),
    }
}

type Res = Result<(), String>;

/// Largest response the CLI accepts (a page of big run records).
const MAX_MESSAGE: usize = 64 * 1024 * 1024;

fn grpc(e: tonic::Status) -> String {
    // The transport's words, with what to do about them.
    let msg = e.message();
    let hint = if msg.contains("h2 protocol error") || msg.contains("http2 error") {
        " (a plaintext client against a TLS server? use https:// and --ca-file)"
    } else if msg.contains("UnknownIssuer") {
        " (give the CA that signed the server's certificate: --ca-file or PUNCHCLOCK_CA_FILE)"
    } else {
        ""
    };
    format!("{msg}{hint} ({:?})", e.code())
}

/// Dispatches a parsed command line; `open_files` is the process's
/// open-files limit once raised (`None`: unlimited or unknown).
pub async fn run(cli: Cli, open_files: Option<u64>) -> Res {
    let fmt = cli.output;
    // JSON lines are for streams of runs; other commands print JSON.
    let fmt = if fmt == Format::Jsonl && !matches!(cli.cmd, Cmd::Runs(_)) { Format::Json } else { fmt };
    if !cli.is_long_running() {
        cli.auth.configure()?;
    }
    match cli.cmd {
        Cmd::Dev(a) => dev(a, open_files).await,
        Cmd::Server(a) => server(*a, open_files).await,
        Cmd::Runner(a) => runner(a, &cli.auth).await,
        Cmd::Token(c) => crate::security::token(c),
        Cmd::Preview(a) => preview(a, fmt),
        Cmd::Notifications(c) => {
            let mut nc = NotificationServiceClient::new(client::connect(&cli.endpoint).await?).max_decoding_message_size(MAX_MESSAGE);
            match c {
                NotificationsCmd::List { status, task, limit } => {
                    let req = pb::ListNotificationsRequest { status: status.unwrap_or_default(), task_id: task, limit };
                    let r = nc.list_notifications(req).await.map_err(grpc)?.into_inner();
                    if fmt == Format::Json {
                        print_json(&serde_json::Value::Array(r.notifications.iter().map(output::notification_json).collect()));
                    } else {
                        table(
                            &["ID", "EVENT", "SINK", "STATUS", "ATTEMPTS", "NEXT_ATTEMPT_AT", "LAST_ERROR"],
                            r.notifications
                                .iter()
                                .map(|n| {
                                    let j = output::notification_json(n);
                                    let next = if n.status == "pending" {
                                        j["next_attempt_at"].as_str().unwrap_or("-").to_string()
                                    } else {
                                        "-".into()
                                    };
                                    let err: String = n.last_error.chars().take(60).collect();
                                    vec![
                                        n.id.clone(),
                                        n.event.clone(),
                                        n.sink.clone(),
                                        n.status.clone(),
                                        n.attempts.to_string(),
                                        next,
                                        if err.is_empty() { "-".into() } else { err },
                                    ]
                                })
                                .collect(),
                        );
                    }
                }
                NotificationsCmd::Retry { id } => {
                    let n = nc.retry_notification(pb::RetryNotificationRequest { id }).await.map_err(grpc)?.into_inner();
                    if fmt == Format::Json {
                        print_json(&output::notification_json(&n));
                    } else {
                        println!("notification {} is pending again: it is sent now", n.id);
                    }
                }
            }
            Ok(())
        }
        Cmd::Stats(a) => {
            let since = punchclock_control_plane::schedule::parse_duration(&a.since).map_err(|e| format!("--since: {e}"))?;
            if since == 0 || since > 36_500 * 86_400 {
                return Err(format!("--since: must be more than 0 and at most 100 years (got {:?})", a.since));
            }
            let mut c = RunServiceClient::new(client::connect(&cli.endpoint).await?).max_decoding_message_size(MAX_MESSAGE);
            let req_task = a.task.clone().unwrap_or_default();
            let req = pb::GetSchedulingStatsRequest { task_id: req_task.clone(), since_seconds: since };
            let s = c.get_scheduling_stats(req).await.map_err(grpc)?.into_inner();
            if fmt == Format::Json {
                print_json(&output::stats_json(&s));
            } else if s.tasks.is_empty() {
                println!(
                    "no runs with a slot in the last {}{}",
                    a.since,
                    if req_task.is_empty() { String::new() } else { format!(" of task {req_task}") }
                );
            } else {
                output::stats_table(&s);
            }
            Ok(())
        }
        Cmd::Task(c) => task(&cli.endpoint, c, fmt).await,
        Cmd::Runs(c) => runs(&cli.endpoint, c, fmt).await,
        Cmd::Config(ConfigCmd::Apply { file, dry_run }) => {
            let text = read_file_arg(&file)?;
            let mut c = ConfigServiceClient::new(client::connect_leader(&cli.endpoint).await?).max_decoding_message_size(MAX_MESSAGE);
            let r = c.apply_config(pb::ApplyConfigRequest { text, dry_run }).await.map_err(grpc)?.into_inner();
            if fmt == Format::Json {
                print_json(
                    &serde_json::json!({"version": r.version, "changed": r.changed, "previous_version": r.previous_version, "dry_run": dry_run}),
                );
            } else if !r.changed {
                println!("unchanged: version {} is in force", r.version);
            } else if dry_run {
                println!("valid: every task fits it; it would be version {} (nothing stored)", r.version);
            } else {
                println!("applied: version {} (was {})", r.version, r.previous_version);
            }
            Ok(())
        }
        Cmd::Config(ConfigCmd::Get { version }) => {
            let mut c = ConfigServiceClient::new(client::connect(&cli.endpoint).await?).max_decoding_message_size(MAX_MESSAGE);
            let s = c.get_config(pb::GetConfigRequest { version: version.unwrap_or(0) }).await.map_err(grpc)?.into_inner();
            if fmt == Format::Json {
                print_json(
                    &serde_json::json!({"version": s.version, "text": s.text, "applied_at": output::t(&s.applied_at), "applied_by": s.applied_by}),
                );
            } else {
                println!("# version {}, applied {} by {}", s.version, output::t(&s.applied_at).as_str().unwrap_or("-"), s.applied_by);
                print!("{}", s.text);
                if !s.text.ends_with('\n') {
                    println!();
                }
            }
            Ok(())
        }
        Cmd::Config(ConfigCmd::Diff { file }) => {
            let text = read_file_arg(&file)?;
            let mut c = ConfigServiceClient::new(client::connect(&cli.endpoint).await?).max_decoding_message_size(MAX_MESSAGE);
            let stored = match c.get_config(pb::GetConfigRequest { version: 0 }).await {
                Ok(s) => s.into_inner(),
                Err(s) if s.code() == tonic::Code::NotFound => pb::StoredConfig::default(),
                Err(s) => return Err(grpc(s)),
            };
            let canonical = |t: &str| -> Result<String, String> {
                let v: serde_yaml_ng::Value = serde_yaml_ng::from_str(t).map_err(|e| format!("{e}"))?;
                if v.is_null() { Ok(String::new()) } else { serde_yaml_ng::to_string(&v).map_err(|e| e.to_string()) }
            };
            let old = canonical(&stored.text).map_err(|e| format!("the stored configuration: {e}"))?;
            let new = canonical(&text).map_err(|e| format!("{file}: {e}"))?;
            if old == new {
                println!("no difference from version {}", stored.version);
                return Ok(());
            }
            let diff = similar::TextDiff::from_lines(&old, &new);
            print!("{}", diff.unified_diff().header(&format!("cluster (version {})", stored.version), &file));
            Err(String::new())
        }
        Cmd::Validate(args) => validate_offline(&args),
        Cmd::Cluster(ClusterCmd::Status) => {
            let mut c = ClusterServiceClient::new(client::connect(&cli.endpoint).await?).max_decoding_message_size(MAX_MESSAGE);
            let s = c.get_cluster_status(pb::GetClusterStatusRequest {}).await.map_err(grpc)?.into_inner();
            let j = serde_json::json!({
                "members": s.members.iter().map(|m| serde_json::json!({"id": m.id, "advertise_address": m.advertise_address, "is_leader": m.is_leader})).collect::<Vec<_>>(),
                "leader_id": s.leader_id,
                "leader_address": s.leader_address,
                "fencing_token": s.fencing_token,
                "store": s.store,
                "answered_by": s.answered_by,
                "config_version": s.config_version,
                "leader_unresponsive": s.leader_unresponsive,
            });
            if fmt == Format::Json {
                print_json(&j);
            } else {
                if s.leader_id.is_empty() {
                    println!("store: {}\nleader: none", s.store);
                } else if s.leader_unresponsive {
                    println!(
                        "store: {}\nleader: {} at {} (fencing token {}) DOES NOT ANSWER: its lease has not expired yet; a new leader follows within the lease's TTL",
                        s.store, s.leader_id, s.leader_address, s.fencing_token
                    );
                } else {
                    println!("store: {}\nleader: {} at {} (fencing token {})", s.store, s.leader_id, s.leader_address, s.fencing_token);
                }
                println!("configuration: version {}", s.config_version);
                table(
                    &["MEMBER", "ADDRESS", "LEADER"],
                    s.members.iter().map(|m| vec![m.id.clone(), m.advertise_address.clone(), m.is_leader.to_string()]).collect(),
                );
            }
            // Scripts and probes can tell a cluster without a leader.
            if s.leader_id.is_empty() {
                return Err("no leader: nothing is scheduled until one is elected".into());
            }
            Ok(())
        }
        Cmd::Backfills(c) => {
            let leader = !matches!(c, BackfillsCmd::List { .. } | BackfillsCmd::Get { .. });
            let ch = if leader { client::connect_leader(&cli.endpoint).await? } else { client::connect(&cli.endpoint).await? };
            let mut tc = TaskServiceClient::new(ch).max_decoding_message_size(MAX_MESSAGE);
            let change = |id: String, action: &str| pb::ChangeBackfillRequest { id, action: action.into() };
            let one = match c {
                BackfillsCmd::List { task } => {
                    let r = tc.list_backfills(pb::ListBackfillsRequest { task_id: task }).await.map_err(grpc)?.into_inner();
                    if fmt == Format::Json {
                        print_json(&serde_json::json!(r.backfills.iter().map(output::backfill_json).collect::<Vec<_>>()));
                    } else {
                        for b in &r.backfills {
                            println!("{}", output::backfill_text(b));
                        }
                    }
                    return Ok(());
                }
                BackfillsCmd::Get { id } => tc.get_backfill(pb::GetBackfillRequest { id }).await,
                BackfillsCmd::Pause { id } => tc.change_backfill(change(id, "pause")).await,
                BackfillsCmd::Resume { id } => tc.change_backfill(change(id, "resume")).await,
                BackfillsCmd::Cancel { id } => tc.change_backfill(change(id, "cancel")).await,
            };
            let b = one.map_err(grpc)?.into_inner();
            if fmt == Format::Json {
                print_json(&output::backfill_json(&b));
            } else {
                println!("{}", output::backfill_text(&b));
            }
            Ok(())
        }
        Cmd::Resources(ResourcesCmd::List) => {
            let mut c = ClusterServiceClient::new(client::connect_leader(&cli.endpoint).await?).max_decoding_message_size(MAX_MESSAGE);
            let r = c.list_resources(pb::ListResourcesRequest {}).await.map_err(grpc)?.into_inner();
            if fmt == Format::Json {
                print_json(&serde_json::Value::Array(r.resources.iter().map(resource_json).collect()));
            } else {
                let opt = |v: Option<String>| v.unwrap_or_else(|| "-".into());
                table(
                    &["RESOURCE", "IN_USE", "WAITING", "REQUESTS/MIN", "TOKENS/MIN", "HELD_BACK_UNTIL"],
                    r.resources
                        .iter()
                        .map(|x| {
                            vec![
                                x.name.clone(),
                                match x.concurrency {
                                    Some(c) => format!("{}/{c}", x.in_use),
                                    None => x.in_use.to_string(),
                                },
                                x.waiting.to_string(),
                                opt(x.requests_per_minute.map(|l| format!("{}/{l} free", x.requests_available.unwrap_or(0.0)))),
                                opt(x.tokens_per_minute.map(|l| format!("{}/{l} free", x.tokens_available.unwrap_or(0.0)))),
                                match output::t(&x.held_until).as_str() {
                                    Some(t) => format!("{t} ({})", x.held_why),
                                    None => "-".into(),
                                },
                            ]
                        })
                        .collect(),
                );
            }
            Ok(())
        }
        Cmd::Resources(ResourcesCmd::Release { name }) => {
            let mut c = ClusterServiceClient::new(client::connect_leader(&cli.endpoint).await?).max_decoding_message_size(MAX_MESSAGE);
            let r = c.release_resource(pb::ReleaseResourceRequest { name }).await.map_err(grpc)?.into_inner();
            if fmt == Format::Json {
                print_json(&resource_json(&r));
            } else {
                println!("{}: not held back; {} in use, {} waiting", r.name, r.in_use, r.waiting);
            }
            Ok(())
        }
        Cmd::Event(EventCmd::Publish { topic, payload, key, key_ttl }) => {
            let mut c = TaskServiceClient::new(client::connect_leader(&cli.endpoint).await?).max_decoding_message_size(MAX_MESSAGE);
            let r = c
                .publish_event(pb::PublishEventRequest { topic, payload_json: payload, idempotency_key: key, idempotency_ttl: key_ttl })
                .await
                .map_err(grpc)?
                .into_inner();
            if fmt == Format::Json {
                let runs = r.runs.iter().map(|p| serde_json::json!({"task_id": p.task_id, "run_id": p.run_id, "created": p.created}));
                print_json(&serde_json::Value::Array(runs.collect()));
            } else if r.runs.is_empty() {
                println!("no task has an event trigger on this topic: no run");
            } else {
                table(
                    &["TASK", "RUN", "CREATED"],
                    r.runs.iter().map(|p| vec![p.task_id.clone(), p.run_id.clone(), p.created.to_string()]).collect(),
                );
            }
            Ok(())
        }
        Cmd::Budgets(BudgetsCmd::List) => {
            let mut c = ClusterServiceClient::new(client::connect_leader(&cli.endpoint).await?).max_decoding_message_size(MAX_MESSAGE);
            let r = c.list_budgets(pb::ListBudgetsRequest {}).await.map_err(grpc)?.into_inner();
            if fmt == Format::Json {
                print_json(&serde_json::Value::Array(r.budgets.iter().map(output::budget_json).collect()));
            } else {
                table(
                    &["BUDGET", "SCOPE", "WINDOW", "STATE", "USED/LIMIT", "RESERVED", "RESETS_AT"],
                    r.budgets
                        .iter()
                        .map(|b| {
                            vec![
                                b.name.clone(),
                                b.scope.clone(),
                                b.window.clone(),
                                b.state.clone(),
                                output::budget_use(b.used.as_ref(), b.limits.as_ref(), true),
                                output::budget_use(b.reserved.as_ref(), b.limits.as_ref(), false),
                                output::in_zone(&b.window_end, &b.timezone).as_str().unwrap_or("-").to_string(),
                            ]
                        })
                        .collect(),
                );
            }
            Ok(())
        }
        Cmd::Runners(RunnersCmd::List) => {
            let mut c = ClusterServiceClient::new(client::connect_leader(&cli.endpoint).await?).max_decoding_message_size(MAX_MESSAGE);
            let r = c.list_runners(pb::ListRunnersRequest {}).await.map_err(grpc)?.into_inner();
            if fmt == Format::Json {
                print_json(&serde_json::Value::Array(r.runners.iter().map(runner_json).collect()));
            } else {
                table(
                    &["RUNNER", "AGENTS", "SLOTS", "BUSY", "LABELS", "LAST_SEEN", "DRAINING"],
                    r.runners
                        .iter()
                        .map(|x| {
                            vec![
                                x.runner_id.clone(),
                                x.agents.join(","),
                                x.slots.to_string(),
                                x.busy_slots.to_string(),
                                {
                                    let mut labels: Vec<String> = x.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
                                    labels.sort();
                                    if labels.is_empty() { "-".to_string() } else { labels.join(",") }
                                },
                                output::t(&x.last_seen).as_str().unwrap_or("-").to_string(),
                                if x.draining { "yes" } else { "no" }.to_string(),
                            ]
                        })
                        .collect(),
                );
            }
            Ok(())
        }
    }
}

async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => futures_pending().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {},
        _ = term => {},
    }
}

async fn futures_pending() {
    std::future::pending::<()>().await
}

fn default_id(kind: &str) -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").map(|s| s.trim().to_string()).unwrap_or_else(|_| "host".into());
    format!("{kind}-{host}-{}", std::process::id())
}

/// Settings of a runner. `work_dir` is its own (a restarted runner removes
/// what a killed predecessor left there): under the data dir for `dev`, per
/// runner id for `runner`.
fn runner_config(
    runner_id: String,
    control_plane: Vec<String>,
    agents: &Path,
    slots: u32,
    labels: BTreeMap<String, String>,
    kill_grace: Duration,
    work_dir: PathBuf,
) -> Result<punchclock_agent_runner::RunnerConfig, String> {
    let agents = punchclock_agent_runner::AgentsFile::load(agents).map_err(|e| format!("{}: {e}", agents.display()))?;
    let mut cfg = punchclock_agent_runner::RunnerConfig::new(runner_id, control_plane, agents);
    cfg.slots = slots;
    cfg.labels = labels;
    cfg.kill_grace = kill_grace;
    cfg.shim = std::env::current_exe().ok().map(punchclock_agent_runner::ShimCommand::beside);
    cfg.work_dir = work_dir;
    cfg.validate().map_err(|e| e.to_string())?;
    Ok(cfg)
}

/// `dev`'s agents file when `--agents` is not given: the repository's.
const DEFAULT_AGENTS_FILE: &str = "examples/agents.yaml";

async fn dev(a: DevArgs, open_files: Option<u64>) -> Res {
    // Check the agents file before touching the data dir or binding ports.
    if !a.agents.exists() && a.agents == Path::new(DEFAULT_AGENTS_FILE) {
        return Err(format!(
            "no agents file at {DEFAULT_AGENTS_FILE} (the default, relative to the punchclock repository): run `punchclock dev` \
             from the repository, or give --agents FILE (README, \"Agents file\")"
        ));
    }
    punchclock_agent_runner::AgentsFile::load(&a.agents).map_err(|e| format!("{}: {e}", a.agents.display()))?;
    crate::security::check_listen(a.listen, false, false, a.insecure, true)?;
    let timing = a.timing.timing(Timing::default().lease_ttl.as_millis() as u64);
    // The HTTP port defaults to the one after the API's (a free one when
    // that is taken, or when the API's port is chosen by the system).
    let http_next = SocketAddr::new(a.listen.ip(), if a.listen.port() == 0 { 0 } else { a.listen.port().saturating_add(1) });
    let telemetry = a.config.otlp.start("punchclock-dev")?;
    let cfg = ServerConfig {
        listen: a.listen,
        advertise: None,
        http_listen: Some(a.http_listen.unwrap_or(http_next)),
        http_advertise: None,
        http_listen_fallback: a.http_listen.is_none(),
        store: StoreSpec::Embedded(a.data_dir.clone()),
        key_prefix: "/punchclock/".into(),
        node_id: "dev".into(),
        timing,
        retention: a.retention.config(true)?,
        config: a.config.load()?,
        traces: telemetry.is_some(),
        auth: punchclock_control_plane::auth::Auth::off(),
        tls: None,
        etcd: Default::default(),
        connections: a.connections.limits(open_files)?,
        history: None,
        ui: a.config.ui()?,
    };
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut srv_stop = stop_rx.clone();
    let server = bootstrap::start(cfg, Arc::new(SystemClock), async move {
        let _ = srv_stop.wait_for(|s| *s).await;
    })
    .await
    .map_err(|e| e.to_string())?;
    reload_config_on_sighup(server.core.clone());
    let mut rcfg = runner_config(
        "dev-runner".into(),
        vec![format!("http://{}", server.addr)],
        &a.agents,
        a.slots,
        BTreeMap::new(),
        timing.kill_grace,
        a.data_dir.join("runner"),
    )?;
    rcfg.zygote = !a.no_agent_zygote;
    rcfg.agent_nice = a.agent_nice;
    rcfg.callback_listen = Some(a.callback_listen);
    rcfg.cgroup_root = Some(a.cgroup_root.clone()).filter(|p| p.as_os_str() != "none");
    let h = server.http_addr.map(|a| a.to_string()).unwrap_or_default();
    announce(&format!(
        "punchclock dev: API on http://{} (health on http://{h}/healthz, dashboard on http://{h}/ui/), data in {}, agents from {}",
        server.addr,
        a.data_dir.display(),
        a.agents.display()
    ));
    let (runner_stop_tx, runner_stop_rx) = tokio::sync::oneshot::channel::<()>();
    let mut runner = tokio::spawn(punchclock_agent_runner::run(rcfg, async move {
        let _ = runner_stop_rx.await;
    }));
    // The runner first: it interrupts its agents and reports them while the
    // control plane still records reports (they run again at the next start
    // without spending an attempt); then the control plane. A runner that
    // stops by itself (it refused every agent, say) stops `dev` too.
    let ended = tokio::select! {
        () = shutdown_signal() => {
            let _ = runner_stop_tx.send(());
            runner.await
        }
        ended = &mut runner => ended,
    };
    let failed = match ended {
        Ok(Ok(())) => None,
        Ok(Err(e)) => Some(e.to_string()),
        Err(e) => Some(e.to_string()),
    };
    let _ = stop_tx.send(true);
    let r = server.wait().await.map_err(|e| e.to_string());
    let r = match failed {
        Some(e) => Err(format!("the dev runner stopped: {e}")),
        None => r,
    };
    if let Some(t) = telemetry {
        let _ = tokio::task::spawn_blocking(move || t.shutdown()).await;
    }
    r
}

async fn server(a: ServerArgs, open_files: Option<u64>) -> Res {
    let store: StoreSpec = a.store.parse().map_err(|e: punchclock_control_plane::Error| e.to_string())?;
    let security = a.security.load(a.listen)?;
    let scheme = if security.tls.is_some() { "https" } else { "http" };
    // Runners and clients are sent to --advertise: with TLS on it must be
    // https (a bare host:port gets it), or they would be sent to plaintext.
    let advertise = match a.advertise.as_deref().map(str::trim) {
        Some(adv) if !adv.contains("://") => Some(format!("{scheme}://{adv}")),
        Some(adv) if security.tls.is_some() && !adv.starts_with("https://") => {
            return Err(format!("--advertise {adv}: TLS is on, so it must be https:// (runners and clients are sent there)"));
        }
        other => other.map(str::to_string),
    };
    crate::security::reload_on_sighup(security.auth.clone());
    let telemetry = a.config.otlp.start("punchclock-control-plane")?;
    let cfg = ServerConfig {
        listen: a.listen,
        advertise,
        http_listen: a.http_listen,
        http_advertise: a.http_advertise.clone(),
        http_listen_fallback: false,
        store,
        key_prefix: a.key_prefix,
        node_id: a.node_id.unwrap_or_else(|| default_id("cp")),
        timing: a.timing.timing(a.etcd.lease_ttl_ms),
        retention: a.retention.config(!a.etcd.no_etcd_compaction)?,
        config: a.config.load()?,
        traces: telemetry.is_some(),
        auth: security.auth,
        tls: security.tls,
        etcd: security.etcd,
        connections: a.connections.limits(open_files)?,
        history: a.history.spec()?,
        ui: a.config.ui()?,
    };
    if cfg.advertise.is_none() && cfg.listen.ip().is_unspecified() && matches!(cfg.store, StoreSpec::Etcd(_)) {
        tracing::warn!(listen = %cfg.listen, "no --advertise: runners and clients redirected to this replica would be sent to an unspecified address; give --advertise https://HOST:PORT");
    }
    let server = bootstrap::start(cfg, Arc::new(SystemClock), shutdown_signal()).await.map_err(|e| e.to_string())?;
    reload_config_on_sighup(server.core.clone());
    match server.http_addr {
        Some(h) => announce(&format!(
            "punchclock server: API on {scheme}://{} (health on http://{h}/healthz, metrics on http://{h}/metrics, dashboard on http://{h}/ui/)",
            server.addr
        )),
        None => announce(&format!(
            "punchclock server: API on {scheme}://{} (no HTTP port: give --http-listen for health and metrics)",
            server.addr
        )),
    }
    let r = server.wait().await.map_err(|e| e.to_string());
    if let Some(t) = telemetry {
        let _ = tokio::task::spawn_blocking(move || t.shutdown()).await;
    }
    r
}

/// Reads the config file again on every SIGHUP: an invalid one (or one
/// that drops a resource a task still uses) is refused, said once per
/// distinct refusal, and the running configuration stays.
fn reload_config_on_sighup(core: Arc<punchclock_control_plane::api::Core>) {
    if core.config.path().is_none() {
        return;
    }
    tokio::spawn(async move {
        let Ok(mut hup) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) else { return };
        let mut refused: Option<String> = None;
        while hup.recv().await.is_some() {
            match core.reload_config().await {
                Ok(version) => {
                    refused = None;
                    tracing::info!(version, "SIGHUP: the cluster configuration is this replica's --config");
                }
                Err(e) => {
                    let why = e.to_string();
                    if refused.as_ref() != Some(&why) {
                        tracing::error!(error = %why, "SIGHUP: config file refused; the running configuration stays");
                    }
                    refused = Some(why);
                }
            }
        }
    });
}

pub(crate) fn parse_labels(s: &str) -> Result<BTreeMap<String, String>, String> {
    s.split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|p| {
            p.split_once('=')
                .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
                .ok_or_else(|| format!("--labels: {p:?} is not k=v"))
        })
        .collect()
}

async fn runner(a: RunnerArgs, auth: &ClientAuthArgs) -> Res {
    let credentials = a.security.load(auth)?;
    // Bare host:port addresses are given a scheme by the runner: https when
    // it has a CA or a certificate (RunnerConfig::uses_tls).
    let cps: Vec<String> = a.control_plane.split(',').map(str::trim).filter(|s| !s.is_empty()).map(str::to_string).collect();
    let runner_id = a.runner_id.unwrap_or_else(|| default_id("runner"));
    let work_dir = a.work_dir.unwrap_or_else(|| std::env::temp_dir().join("punchclock-runner").join(&runner_id));
    let mut cfg =
        runner_config(runner_id, cps, &a.agents, a.slots, parse_labels(&a.labels)?, Duration::from_millis(a.kill_grace_ms), work_dir)?;
    cfg.zygote = !a.no_agent_zygote;
    cfg.agent_nice = a.agent_nice;
    cfg.credentials = credentials;
    cfg.callback_listen = a.callback_listen;
    cfg.callback_advertise = a.callback_advertise.clone();
    cfg.cgroup_root = Some(a.cgroup_root.clone()).filter(|p| p.as_os_str() != "none");
    cfg.validate().map_err(|e| e.to_string())?;
    let telemetry = a.otlp.start("punchclock-runner")?;
    let r = punchclock_agent_runner::run(cfg, shutdown_signal()).await.map_err(|e| e.to_string());
    if let Some(t) = telemetry {
        let _ = tokio::task::spawn_blocking(move || t.shutdown()).await;
    }
    r
}

fn preview(a: PreviewArgs, fmt: Format) -> Res {
    use punchclock_control_plane::schedule::{DstSpec, GapRule, RepeatRule};
    let dst = DstSpec {
        gap: a.dst_gap.as_deref().map(|g| if g == "skip" { GapRule::Skip } else { GapRule::Shift }),
        repeat: a.dst_repeat.as_deref().map(|r| match r {
            "last" => RepeatRule::Last,
            "both" => RepeatRule::Both,
            _ => RepeatRule::First,
        }),
    };
    let s = CronSchedule::parse(&a.expr, &a.tz, dst).map_err(|e| e.to_string())?;
    let zone = s.timezone();
    let after = a.after.unwrap_or_else(|| SystemClock.now());
    let sched = Schedule::plain(Shape::Cron(std::sync::Arc::new(s)));
    let times = punchclock_control_plane::api::preview_times(std::slice::from_ref(&sched), after, a.count);
    if times.is_empty() {
        return Err(format!("{:?} has no fire time after {}", a.expr, after.to_rfc3339_opts(SecondsFormat::Secs, true)));
    }
    let local: Vec<String> = times.iter().map(|t| t.with_timezone(&zone).to_rfc3339_opts(SecondsFormat::AutoSi, true)).collect();
    if fmt == Format::Json {
        print_json(&serde_json::json!(local));
    } else {
        for l in local {
            println!("{l}");
        }
    }
    // Notes go to stderr, so the fire times alone stay on stdout for scripts.
    for n in sched.dst_effects(after) {
        eprintln!("DST: {n}");
    }
    Ok(())
}

async fn task(endpoint: &str, c: TaskCmd, fmt: Format) -> Res {
    let specs = match &c {
        TaskCmd::Apply { file, .. } => Some(crate::taskfile::read(file)?),
        _ => None,
    };
    // Triggers create runs: the leader's job. Applies go to the leader too
    // when it can be reached (only it can warn that no runner serves an
    // agent); everything else any replica serves.
    let channel = match &c {
        TaskCmd::Trigger { .. } | TaskCmd::Backfill { .. } => client::connect_leader(endpoint).await?,
        TaskCmd::Apply { .. } => match client::connect_leader(endpoint).await {
            Ok(ch) => ch,
            Err(_) => client::connect(endpoint).await?,
        },
        _ => client::connect(endpoint).await?,
    };
    let tc_channel = channel.clone();
    let mut tc = TaskServiceClient::new(channel).max_decoding_message_size(MAX_MESSAGE);
    let show = |t: &pb::Task| {
        if fmt == Format::Json {
            print_json(&task_json(t));
        } else {
            let j = task_json(t);
            println!(
                "task {} (agent {}) paused={} next_fire_at={} last_slot_at={}",
                t.task_id, t.agent_id, t.paused, j["next_fire_at"], j["last_slot_at"]
            );
        }
    };
    match c {
        TaskCmd::Apply { dry_run, .. } => {
            // One call for the whole file: the server validates every task
            // before it writes any, and writes them all or none.
            const CHUNK_BYTES: usize = 1024 * 1024;
            let max = punchclock_control_plane::model::task::MAX_SPEC_BYTES;
            let specs = specs.unwrap_or_default();
            let too_big: Vec<String> = specs
                .iter()
                .enumerate()
                .filter(|(_, s)| s.len() > max)
                .map(|(i, s)| format!("task #{}: definition is {} bytes; at most {max}", i + 1, s.len()))
                .collect();
            if !too_big.is_empty() {
                for p in &too_big {
                    eprintln!("{p}");
                }
                return Err(format!("{} definition(s) too large; nothing applied", too_big.len()));
            }
            let mut messages = Vec::new();
            let (mut chunk, mut bytes) = (Vec::new(), 0);
            for spec in specs {
                if bytes + spec.len() > CHUNK_BYTES && !chunk.is_empty() {
                    messages.push(pb::ApplyTasksRequest { spec_json: std::mem::take(&mut chunk), dry_run, tasks: Vec::new() });
                    bytes = 0;
                }
                bytes += spec.len();
                chunk.push(spec);
            }
            messages.push(pb::ApplyTasksRequest { spec_json: chunk, dry_run, tasks: Vec::new() });
            // A leader change or a broken connection after the apply began:
            // it may well have been finished (a journaled apply is).
            let maybe_done = |e: tonic::Status| {
                let hint = matches!(e.code(), tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled);
                let text = grpc(e);
                if hint && !dry_run {
                    format!(
                        "{text}\n(the apply may have been finished by the leader, or the next one; applying the file again is safe: unchanged tasks are left alone)"
                    )
                } else {
                    text
                }
            };
            let mut replies = tc.apply_tasks(futures::stream::iter(messages)).await.map_err(maybe_done)?.into_inner();
            let mut applied = Vec::new();
            // The same warning for many tasks (one agent no runner serves)
            // is printed once, with the tasks it concerns.
            let mut warnings: Vec<(String, Vec<String>)> = Vec::new();
            while let Some(reply) = replies.message().await.map_err(maybe_done)? {
                for t in reply.tasks {
                    for w in &t.warnings {
                        match warnings.iter_mut().find(|(text, _)| text == w) {
                            Some((_, ids)) => ids.push(t.task_id.clone()),
                            None => warnings.push((w.clone(), vec![t.task_id.clone()])),
                        }
                    }
                    if fmt == Format::Table {
                        if dry_run {
                            println!("task {} valid (would be {})", t.task_id, t.outcome);
                        } else {
                            println!("task {} {}", t.task_id, t.outcome);
                        }
                    }
                    applied
                        .push(serde_json::json!({"task_id": t.task_id, "outcome": t.outcome, "warnings": t.warnings, "dry_run": dry_run}));
                }
            }
            for (text, ids) in warnings {
                let tasks = match ids.len() {
                    1 => format!("task {}", ids[0]),
                    2..=3 => format!("tasks {}", ids.join(", ")),
                    n => format!("{n} tasks ({}, ... {})", ids[..2].join(", "), ids[n - 1]),
                };
                eprintln!("warning: {tasks}: {text}");
            }
            if fmt == Format::Json {
                print_json(&serde_json::Value::Array(applied));
            }
            Ok(())
        }
        TaskCmd::List { slots } => {
            let mut all = Vec::new();
            let mut token = String::new();
            loop {
                let r = tc
                    .list_tasks(pb::ListTasksRequest { page_size: 0, page_token: token, recent_slots: slots })
                    .await
                    .map_err(grpc)?
                    .into_inner();
                all.extend(r.tasks);
                if r.next_page_token.is_empty() {
                    break;
                }
                token = r.next_page_token;
            }
            let r = pb::ListTasksResponse { tasks: all, next_page_token: String::new() };
            if fmt == Format::Json {
                print_json(&serde_json::Value::Array(r.tasks.iter().map(task_json).collect()));
            } else {
                let mut head = vec!["TASK", "AGENT", "PAUSED", "BREAKER", "NEXT_FIRE_AT", "LAST_SLOT_AT"];
                if slots > 0 {
                    head.push("SLOTS");
                }
                table(
                    &head,
                    r.tasks
                        .iter()
                        .map(|t| {
                            let j = task_json(t);
                            let mut row = vec![
                                t.task_id.clone(),
                                t.agent_id.clone(),
                                t.paused.to_string(),
                                t.breaker.as_ref().map_or("-".into(), |b| b.phase.clone()),
                                j["next_fire_at"].as_str().unwrap_or("-").into(),
                                j["last_slot_at"].as_str().unwrap_or("-").into(),
                            ];
                            if slots > 0 {
                                row.push(crate::output::slot_strip(&t.recent_slots));
                            }
                            row
                        })
                        .collect(),
                );
            }
            Ok(())
        }
        TaskCmd::Get { task_id } => {
            let t = tc.get_task(pb::GetTaskRequest { task_id: task_id.clone() }).await.map_err(grpc)?.into_inner();
            if fmt == Format::Json {
                show(&t);
                return Ok(());
            }
            let next = tc
                .preview_schedule(pb::PreviewScheduleRequest { task_id, count: 3, ..Default::default() })
                .await
                .map(|r| r.into_inner())
                .unwrap_or_default();
            for (k, v) in output::task_details(&t, &next) {
                println!("{k:<12}{v}");
            }
            Ok(())
        }
        TaskCmd::Delete { task_id } => {
            tc.delete_task(pb::DeleteTaskRequest { task_id: task_id.clone() }).await.map_err(grpc)?;
            println!("task {task_id} deleted");
            Ok(())
        }
        TaskCmd::Pause { task_id } => {
            show(&tc.pause_task(pb::PauseTaskRequest { task_id }).await.map_err(grpc)?.into_inner());
            Ok(())
        }
        TaskCmd::Resume { task_id } => {
            show(&tc.resume_task(pb::ResumeTaskRequest { task_id }).await.map_err(grpc)?.into_inner());
            Ok(())
        }
        TaskCmd::Backfill { task_id, from, to, reprocess, max_concurrent, order, on_failure, dry_run } => {
            let now = chrono::Utc::now();
            let at = |flag: &str, v: &str| -> Result<prost_types::Timestamp, String> {
                let t = match chrono::DateTime::parse_from_rfc3339(v) {
                    Ok(t) => t.with_timezone(&chrono::Utc),
                    Err(_) => {
                        let secs = punchclock_control_plane::schedule::parse_duration(v)
                            .map_err(|e| format!("{flag}: {e} (an RFC 3339 time, or a duration ago such as 30d)"))?;
                        i64::try_from(secs)
                            .ok()
                            .and_then(chrono::Duration::try_seconds)
                            .and_then(|d| now.checked_sub_signed(d))
                            .filter(|t| *t >= chrono::DateTime::<chrono::Utc>::UNIX_EPOCH)
                            .ok_or_else(|| format!("{flag}: {v} ago is before 1970-01-01"))?
                    }
                };
                Ok(punchclock_proto::time::to_timestamp(t))
            };
            let req = pb::BackfillTaskRequest {
                task_id,
                from: Some(at("--from", &from)?),
                to: Some(match &to {
                    Some(v) => at("--to", v)?,
                    None => punchclock_proto::time::to_timestamp(now),
                }),
                reprocess,
                max_concurrent,
                order,
                on_failure,
                dry_run,
            };
            let r = tc.backfill_task(req).await.map_err(grpc)?.into_inner();
            match (&r.backfill, fmt) {
                (Some(b), Format::Json) => print_json(&output::backfill_json(b)),
                (Some(b), _) => println!("{}", output::backfill_text(b)),
                (None, Format::Json) => print_json(&serde_json::json!(
                    r.listing
                        .iter()
                        .map(|x| serde_json::json!({"slot": output::t(&x.slot), "run_id": x.run_id, "verdict": x.verdict}))
                        .collect::<Vec<_>>()
                )),
                (None, _) => {
                    for x in &r.listing {
                        println!("{} {} {}", output::t(&x.slot).as_str().unwrap_or("-"), x.run_id, x.verdict);
                    }
                    let would = r.listing.iter().filter(|x| x.verdict.starts_with("would_")).count();
                    println!("{} slot(s), {would} would run (dry run: nothing created)", r.listing.len());
                }
            }
            Ok(())
        }
        TaskCmd::ResetBreaker { task_id } => {
            let t = tc.reset_breaker(pb::ResetBreakerRequest { task_id }).await.map_err(grpc)?.into_inner();
            match (fmt, &t.breaker) {
                (Format::Json, _) => print_json(&task_json(&t)),
                (_, Some(b)) => println!("task {}: breaker {}", t.task_id, output::breaker_text(b)),
                (_, None) => println!("task {}: no breaker", t.task_id),
            }
            Ok(())
        }
        TaskCmd::Trigger { task_id, params, delay, key, key_ttl, traceparent, tracestate, baggage } => {
            let r = tc
                .trigger_task(pb::TriggerTaskRequest {
                    task_id,
                    params_json: params,
                    delay_seconds: delay,
                    not_before: None,
                    idempotency_key: key,
                    traceparent,
                    tracestate,
                    baggage,
                    idempotency_ttl: key_ttl,
                })
                .await
                .map_err(grpc)?
                .into_inner();
            // The run may have been skipped at once (its task at its
            // concurrency limit, overlap_policy skip): say so.
            let run = RunServiceClient::new(tc_channel.clone())
                .get_run(pb::GetRunRequest { run_id: r.run_id.clone() })
                .await
                .ok()
                .map(|x| x.into_inner());
            let skipped = run.as_ref().filter(|x| x.status == pb::RunStatus::Skipped as i32);
            if fmt == Format::Json {
                print_json(&serde_json::json!({
                    "run_id": r.run_id,
                    "scheduled_at": output::t(&r.scheduled_at),
                    "created": r.created,
                    "status": run.as_ref().map(|x| output::status_name(x.status)),
                }));
            } else if let Some(x) = skipped {
                println!("run {} SKIPPED: {}", r.run_id, if x.error.is_empty() { &x.skip_reason } else { &x.error });
            } else {
                println!(
                    "run {} scheduled at {}{}",
                    r.run_id,
                    output::t(&r.scheduled_at).as_str().unwrap_or("-"),
                    if r.created { "" } else { " (already existed)" }
                );
            }
            Ok(())
        }
    }
}

/// The columns of a run listing.
const RUN_HEADER: [&str; 6] = ["RUN", "STATUS", "SCHEDULED_AT", "ATTEMPTS", "FINISHED_AT", "INFO"];

/// Prints up to `limit` runs of `req` (0: all), fetching page after page:
/// JSON lines as each page arrives (memory: one page), else collected
/// into one table or array.
async fn list_runs(rc: &mut RunServiceClient<client::Conn>, mut req: pb::ListRunsRequest, limit: u64, fmt: Format) -> Res {
    use std::io::Write as _;
    let mut left = if limit == 0 { u64::MAX } else { limit };
    let mut kept = Vec::new();
    let mut out = std::io::stdout().lock();
    loop {
        req.page_size = u32::try_from(left.min(1000)).unwrap_or(1000);
        let page = rc.list_runs(req.clone()).await.map_err(grpc)?.into_inner();
        for r in page.runs.into_iter().take(usize::try_from(left).unwrap_or(usize::MAX)) {
            left -= 1;
            if fmt == Format::Jsonl {
                // A closed pipe (`| head`) ends the listing quietly.
                if writeln!(out, "{}", run_json(&r)).is_err() {
                    return Ok(());
                }
            } else {
                kept.push(r);
            }
        }
        if fmt == Format::Jsonl && out.flush().is_err() {
            return Ok(());
        }
        if left == 0 || page.next_page_token.is_empty() {
            break;
        }
        req.page_token = page.next_page_token;
    }
    match fmt {
        Format::Jsonl => {}
        Format::Json => print_json(&serde_json::Value::Array(kept.iter().map(run_json).collect())),
        Format::Table => table(&RUN_HEADER, kept.iter().map(run_row).collect()),
    }
    Ok(())
}

async fn runs(endpoint: &str, c: RunsCmd, fmt: Format) -> Res {
    let channel = if matches!(c, RunsCmd::Cancel { .. } | RunsCmd::Prune { .. } | RunsCmd::Rerun { .. }) {
        client::connect_leader(endpoint).await?
    } else {
        client::connect(endpoint).await?
    };
    let mut rc = RunServiceClient::new(channel).max_decoding_message_size(MAX_MESSAGE);
    let header = RUN_HEADER;
    match c {
        RunsCmd::List { q, limit } => list_runs(&mut rc, q.request(chrono::Utc::now(), false)?, limit, fmt).await,
        RunsCmd::Export { q } => list_runs(&mut rc, q.request(chrono::Utc::now(), true)?, 0, Format::Jsonl).await,
        RunsCmd::Get { run_id } => {
            let r = rc.get_run(pb::GetRunRequest { run_id }).await.map_err(grpc)?.into_inner();
            print_json(&run_json(&r));
            Ok(())
        }
        RunsCmd::Rerun { run_id, q, dry_run, limit } => {
            let req = match run_id {
                Some(run_id) => pb::RerunRunsRequest { run_id, dry_run, ..Default::default() },
                None => {
                    if q.task.is_empty() || q.status.is_none() {
                        return Err("runs rerun: give a RUN, or --task and --status (with --since/--until) to re-run in bulk".into());
                    }
                    let l = q.request(chrono::Utc::now(), true)?;
                    pb::RerunRunsRequest {
                        task_id: l.task_id,
                        status: output::status_name(l.status).to_string(),
                        since: l.scheduled_from,
                        until: l.scheduled_to,
                        dry_run,
                        limit,
                        ..Default::default()
                    }
                }
            };
            let r = rc.rerun_runs(req).await.map_err(grpc)?.into_inner();
            if fmt == Format::Json {
                print_json(&serde_json::json!(
                    r.results
                        .iter()
                        .map(|x| serde_json::json!({
                    "of": x.of, "run_id": x.run_id, "created": x.created, "skipped": x.skipped}))
                        .collect::<Vec<_>>()
                ));
            } else {
                let created = r.results.iter().filter(|x| x.created).count();
                for x in &r.results {
                    if !x.skipped.is_empty() {
                        println!("{} left ({}): {}", x.of, x.skipped, x.run_id);
                        continue;
                    }
                    let what = match (x.created, dry_run) {
                        (_, true) => "would re-run as",
                        (true, _) => "re-run as",
                        (false, _) => "re-run exists:",
                    };
                    println!("{} {what} {}", x.of, x.run_id);
                }
                if dry_run {
                    let would = r.results.iter().filter(|x| x.skipped.is_empty()).count();
                    println!("dry run: {would} would be re-run, {} listed; nothing created", r.results.len());
                } else {
                    println!("{} re-run(s) created, {} listed", created, r.results.len());
                }
            }
            Ok(())
        }
        RunsCmd::Cancel { run_id, reason } => {
            let r = rc.cancel_run(pb::CancelRunRequest { run_id, reason }).await.map_err(grpc)?.into_inner();
            if fmt == Format::Json {
                print_json(&run_json(&r));
            } else {
                println!("run {} {}", r.run_id, output::status_name(r.status));
            }
            Ok(())
        }
        RunsCmd::Prune { task } => {
            let r = rc.prune_runs(pb::PruneRunsRequest { task_id: task }).await.map_err(grpc)?.into_inner();
            if fmt == Format::Json {
                print_json(&serde_json::json!({"deleted": r.deleted, "kept": r.kept, "note": r.note}));
            } else {
                println!("{} finished runs deleted, {} runs kept", r.deleted, r.kept);
                if !r.note.is_empty() {
                    eprintln!("note: {}", r.note);
                }
            }
            Ok(())
        }
        RunsCmd::Watch { task } => {
            let mut s = rc.watch_runs(pb::WatchRunsRequest { task_id: task, run_id: String::new() }).await.map_err(grpc)?.into_inner();
            // A change invisible in the chosen format prints nothing new.
            let mut last: std::collections::HashMap<String, String> = std::collections::HashMap::new();
            // `runs list`'s columns, at fixed widths: rows arrive one by one.
            const WIDTHS: [usize; 5] = [40, 10, 21, 8, 31];
            let row = |cells: Vec<String>| {
                cells
                    .iter()
                    .enumerate()
                    .map(|(i, c)| match WIDTHS.get(i) {
                        Some(w) => format!("{c:<w$}"),
                        None => c.clone(),
                    })
                    .collect::<Vec<_>>()
                    .join("  ")
                    .trim_end()
                    .to_string()
            };
            if fmt == Format::Table {
                println!("{}", row(header.iter().map(|h| h.to_string()).collect()));
            }
            while let Some(r) = s.next().await {
                let r = r.map_err(grpc)?;
                let line = if fmt == Format::Table { row(run_row(&r)) } else { run_json(&r).to_string() };
                if last.get(&r.run_id) != Some(&line) {
                    println!("{line}");
                    last.insert(r.run_id.clone(), line);
                }
            }
            Ok(())
        }
    }
}

/// The text of a `-f` argument (`-`: standard input).
fn read_file_arg(path: &str) -> Result<String, String> {
    if path == "-" {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut s).map_err(|e| format!("<stdin>: {e}"))?;
        return Ok(s);
    }
    std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))
}

/// `punchclock validate -f FILE...`: the server's checks of `task apply`,
/// offline: every problem of every definition; with `--config`, resources
/// and brokers against that configuration.
fn validate_offline(args: &ValidateArgs) -> Result<(), String> {
    let config = match &args.config {
        Some(p) => Some(punchclock_control_plane::config::Config::from_text(&read_file_arg(p)?).map_err(|e| format!("--config {p}: {e}"))?),
        None => None,
    };
    let mut specs = Vec::new();
    for f in &args.file {
        specs.extend(crate::taskfile::read(std::path::Path::new(f))?);
    }
    let n = specs.len();
    let now = SystemClock.now();
    punchclock_control_plane::api::validate_file(&specs, now, config.as_ref()).map_err(|e| e.to_string())?;
    let against = if args.config.is_some() { "" } else { " (resources and brokers not checked: give --config)" };
    println!("{n} definition(s) valid{against}");
    Ok(())
}
