//! Wiring: open the store, start the election, serve the gRPC API (with
//! health and reflection) and the HTTP port, and run the engine exactly
//! while this replica leads.

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};

use punchclock_proto::v1::FILE_DESCRIPTOR_SET;
use punchclock_proto::v1::cluster_service_server::ClusterServiceServer;
use punchclock_proto::v1::config_service_server::ConfigServiceServer;
use punchclock_proto::v1::notification_service_server::NotificationServiceServer;
use punchclock_proto::v1::run_service_server::RunServiceServer;
use punchclock_proto::v1::runner_service_server::RunnerServiceServer;
use punchclock_proto::v1::task_service_server::TaskServiceServer;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::api::Core;
use crate::auth::{Auth, AuthLayer};
use crate::clock::SharedClock;
use crate::election::Election;
use crate::election::etcd::EtcdElection;
use crate::election::single::SingleNode;
use crate::engine::lifecycle;
use crate::engine::{Engine, EngineConfig, EngineExit};
use crate::error::{Error, Result};
use crate::repo::Keys;
use crate::repo::Repo;
use crate::service::{ClusterSvc, ConfigSvc, NotificationSvc, RunSvc, RunnerSvc, TaskSvc};
use crate::store::KvStore;
use crate::store::embedded::EmbeddedStore;
use crate::store::etcd::{EtcdSecurity, EtcdStore};
use crate::timing::Timing;

/// Where state lives: `embedded:DIR` or `etcd://host:port[,host:port...]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreSpec {
    /// redb file in this directory; single node.
    Embedded(PathBuf),
    /// etcd cluster endpoints (`http://host:port`); any number of replicas.
    Etcd(Vec<String>),
}

impl std::str::FromStr for StoreSpec {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        if let Some(rest) = s.strip_prefix("etcd://") {
            let eps: Vec<String> = rest.split(',').map(str::trim).filter(|e| !e.is_empty()).map(|e| format!("http://{e}")).collect();
            if eps.is_empty() {
                return Err(Error::invalid("store", format!("{s:?}: expected etcd://host:port[,host:port...]")));
            }
            return Ok(StoreSpec::Etcd(eps));
        }
        match s.split_once(':') {
            Some(("embedded", dir)) if !dir.is_empty() => Ok(StoreSpec::Embedded(PathBuf::from(dir))),
            _ => Err(Error::invalid("store", format!("{s:?}: expected embedded:DIR or etcd://host:port[,host:port...]"))),
        }
    }
}

/// Server options.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// gRPC listen address (port 0 = any free port).
    pub listen: SocketAddr,
    /// Address other processes use to reach this replica (default: the bound address).
    pub advertise: Option<String>,
    /// HTTP listen address for `/healthz` (none = no HTTP port).
    pub http_listen: Option<SocketAddr>,
    /// Address other replicas reach this one's HTTP port at (followers
    /// forward webhook requests to the leader's); default: `http://` and
    /// the bound address, with the host of `advertise` when it is
    /// unspecified (`0.0.0.0`).
    pub http_advertise: Option<String>,
    /// When `http_listen`'s port is taken, listen on a free port of the
    /// same address instead of failing (`dev`, whose HTTP port defaults to
    /// the one next to the API's).
    pub http_listen_fallback: bool,
    /// Store.
    pub store: StoreSpec,
    /// Key prefix in the store.
    pub key_prefix: String,
    /// This replica's id.
    pub node_id: String,
    /// Timing constants.
    pub timing: Timing,
    /// Run retention defaults and pace.
    pub retention: crate::engine::retention::RetentionConfig,
    /// The config file (`--config`): sinks, resources, budgets; reloaded
    /// on SIGHUP ([`crate::api::Core::reload_config`]).
    pub config: crate::config::ConfigHandle,
    /// Emit run spans (a trace exporter is installed).
    pub traces: bool,
    /// Tokens and roles ([`Auth::off`]: every call allowed).
    pub auth: Arc<Auth>,
    /// TLS on the gRPC port; `None` = plaintext.
    pub tls: Option<TlsFiles>,
    /// TLS and user for etcd.
    pub etcd: EtcdSecurity,
    /// Connection caps and timeouts of both ports, and the open-files
    /// limit their default caps are shares of.
    pub connections: crate::conns::ConnectionLimits,
    /// Where finished runs go (`--history postgres://…`); `None`: they
    /// stay in the store (README "Run history").
    pub history: Option<crate::repo::history::postgres::PgSpec>,
    /// The dashboard's settings (`/ui/`).
    pub ui: crate::ui::UiConfig,
}

/// The gRPC port's certificate and key (PEM) and, for mTLS, the CA that
/// signs runners' client certificates (then a client certificate is
/// verified when one is presented, and names the runner: see
/// [`crate::auth::cert_runner_id`]).
#[derive(Clone)]
pub struct TlsFiles {
    /// Certificate chain, PEM.
    pub cert_pem: Vec<u8>,
    /// Private key, PEM.
    pub key_pem: Vec<u8>,
    /// Client CA, PEM (`--client-ca`).
    pub client_ca_pem: Option<Vec<u8>>,
}

impl std::fmt::Debug for TlsFiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsFiles").field("client_ca", &self.client_ca_pem.is_some()).finish_non_exhaustive()
    }
}

/// A started server.
pub struct RunningServer {
    /// Bound gRPC address.
    pub addr: SocketAddr,
    /// Bound HTTP address.
    pub http_addr: Option<SocketAddr>,
    /// Shared API core (tests may inspect it).
    pub core: Arc<Core>,
    join: tokio::task::JoinHandle<Result<()>>,
}

impl RunningServer {
    /// Waits until the server stops (after the shutdown future resolved).
    pub async fn wait(self) -> Result<()> {
        self.join.await.map_err(|e| Error::Internal(e.to_string()))?
    }
}

/// Opens the store, binds the ports and starts serving. The server stops
/// (resigning leadership first) when `shutdown` resolves.
///
/// Errors: the store cannot be opened, or a port cannot be bound.
pub async fn start(cfg: ServerConfig, clock: SharedClock, shutdown: impl Future<Output = ()> + Send + 'static) -> Result<RunningServer> {
    // Every HTTPS client of the process (notifications, a follower's
    // forwarded webhooks, brokers) uses ring; installed once, first.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let connections = cfg.connections;
    let (grpc_limits, http_limits) = connections.resolve()?;
    let store: Arc<dyn KvStore> = match &cfg.store {
        StoreSpec::Embedded(dir) => Arc::new(EmbeddedStore::open(dir).await?),
        StoreSpec::Etcd(endpoints) => Arc::new(connect_etcd(endpoints, &cfg.etcd).await),
    };
    let listener = TcpListener::bind(cfg.listen).await.map_err(|e| {
        Error::FailedPrecondition(format!(
            "cannot listen on {} (gRPC API): {e}; give --listen another address (port 0 picks a free one)",
            cfg.listen
        ))
    })?;
    let addr = listener.local_addr().map_err(|e| Error::Internal(e.to_string()))?;
    let scheme = if cfg.tls.is_some() { "https" } else { "http" };
    let advertise = cfg.advertise.clone().unwrap_or_else(|| format!("{scheme}://{addr}"));
    let http_listener = match cfg.http_listen {
        Some(a) => Some(crate::http::bind(a, cfg.http_listen_fallback).await?),
        None => None,
    };
    let http_addr = http_listener.as_ref().and_then(|l| l.local_addr().ok());
    let http_advertise = match (&cfg.http_advertise, http_addr) {
        (Some(a), _) => a.clone(),
        (None, Some(a)) => crate::http::advertise_of(a, &advertise),
        (None, None) => String::new(),
    };
    let keys = Keys::new(&cfg.key_prefix);
    let election: Arc<dyn Election> = match &cfg.store {
        StoreSpec::Embedded(_) => Arc::new(SingleNode::new(cfg.node_id.clone(), advertise)),
        StoreSpec::Etcd(_) => EtcdElection::start(store.clone(), keys.clone(), cfg.node_id.clone(), advertise, http_advertise, cfg.timing),
    };
    let metrics = crate::metrics::Metrics::new();
    let bus = lifecycle::bus();
    let watchers = crate::watch::RunWatchers::start(&bus);
    let mut repo = Repo::new(store.clone(), keys).with_txn_timer(metrics.store_txn_histogram());
    let live = crate::repo::history::kv::KvHistory::new(repo.clone());
    let (history, archive): (Arc<dyn crate::repo::history::HistoryStore>, _) = match &cfg.history {
        None => (Arc::new(live), None),
        Some(spec) => {
            let pg: Arc<dyn crate::repo::history::HistoryStore> = Arc::new(crate::repo::history::postgres::PgHistory::connect(spec).await?);
            repo = repo.with_archive();
            let status = Arc::new(crate::engine::archive::ArchiveStatus::default());
            (Arc::new(crate::repo::history::tiered::TieredHistory::new(live, pg.clone())), Some((pg, status)))
        }
    };
    let core = Arc::new(Core {
        history,
        archive,
        repo,
        lifecycle: bus,
        watchers,
        traces: cfg.traces,
        clock: clock.clone(),
        election: election.clone(),
        engine: RwLock::new(None),
        retention: cfg.retention,
        engine_problem: std::sync::Mutex::new(None),
        metrics: metrics.clone(),
        config: match cfg.store {
            StoreSpec::Embedded(_) => cfg.config.clone().with_file_wins(),
            StoreSpec::Etcd(_) => cfg.config.clone(),
        },
        auth: cfg.auth.clone(),
        consumers: Default::default(),
        ui: cfg.ui.clone(),
    });
    tokio::spawn(metrics.follow(core.lifecycle.clone()));
    if cfg.traces {
        tokio::spawn(crate::telemetry::follow(core.lifecycle.clone()));
    }

    if let Some(listener) = http_listener {
        let limits = crate::http::HttpLimits {
            connections: http_limits,
            header_timeout: cfg.connections.http_header_timeout,
            body_timeout: cfg.connections.http_body_timeout,
        };
        crate::http::serve(listener, core.clone(), limits);
    }

    let (stop_tx, stop_rx) = watch::channel(false);
    // The cluster configuration: stored, followed by every replica, until
    // the server stops (the follower holds the store: an embedded store's
    // file lock outlived a stopped server, and a restart in the same
    // process could not open it).
    let follow_config = crate::config::cluster::follow(core.repo.clone(), core.config.clone(), cfg.node_id.clone(), clock.clone());
    let mut config_stop = stop_rx.clone();
    tokio::spawn(async move {
        tokio::select! {
            () = follow_config => {}
            _ = config_stop.wait_for(|s| *s) => {}
        }
    });
    let leader_loop = tokio::spawn(follow_leadership(core.clone(), cfg.timing, cfg.retention, stop_rx.clone()));

    let (health, health_svc) = tonic_health::server::health_reporter();
    health.set_serving::<TaskServiceServer<TaskSvc>>().await;
    health.set_serving::<RunServiceServer<RunSvc>>().await;
    health.set_serving::<RunnerServiceServer<RunnerSvc>>().await;
    health.set_serving::<ClusterServiceServer<ClusterSvc>>().await;
    health.set_serving::<NotificationServiceServer<NotificationSvc>>().await;
    health.set_serving::<ConfigServiceServer<ConfigSvc>>().await;
    // Both reflection versions: grpcurl speaks v1, Python's
    // grpcio-reflection and older tools only v1alpha.
    let reflection_builder = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    let reflection = reflection_builder().build_v1().map_err(|e| Error::Internal(e.to_string()))?;
    let reflection_alpha = reflection_builder().build_v1alpha().map_err(|e| Error::Internal(e.to_string()))?;

    let security = (cfg.auth.enabled(), cfg.tls.is_some(), cfg.tls.as_ref().is_some_and(|t| t.client_ca_pem.is_some()));
    // Silent connections are closed by the table's deadlines (the first
    // call within the handshake timeout, none in flight for the idle
    // timeout); dead peers by unanswered HTTP/2 PINGs.
    let mut builder = tonic::transport::Server::builder()
        .http2_keepalive_interval(cfg.connections.grpc_keepalive)
        .http2_keepalive_timeout(Some(crate::conns::ConnectionLimits::KEEPALIVE_TIMEOUT));
    if let Some(tls) = &cfg.tls {
        use tonic::transport::{Certificate, Identity, ServerTlsConfig};
        let mut t = ServerTlsConfig::new()
            .identity(Identity::from_pem(&tls.cert_pem, &tls.key_pem))
            .timeout(cfg.connections.grpc_handshake_timeout);
        if let Some(ca) = &tls.client_ca_pem {
            // Optional: the CLI and token-carrying clients present no
            // certificate; a runner that does is bound to it.
            t = t.client_ca_root(Certificate::from_pem(ca)).client_auth_optional(true);
        }
        builder = builder.tls_config(t).map_err(|e| Error::invalid("tls-cert", format!("the certificate or key is not usable: {e}")))?;
    }
    let conns = crate::conns::Conns::new("gRPC", grpc_limits);
    let router = builder
        .layer(conns.layer())
        .layer(AuthLayer(cfg.auth.clone()))
        .add_service(health_svc)
        .add_service(reflection)
        .add_service(reflection_alpha)
        .add_service(TaskServiceServer::new(TaskSvc(core.clone())))
        .add_service(RunServiceServer::new(RunSvc(core.clone())))
        .add_service(RunnerServiceServer::new(RunnerSvc(core.clone())))
        .add_service(ClusterServiceServer::new(ClusterSvc(core.clone())))
        .add_service(NotificationServiceServer::new(NotificationSvc(core.clone())))
        .add_service(ConfigServiceServer::new(ConfigSvc(core.clone())));
    let core2 = core.clone();
    let join = tokio::spawn(async move {
        let mut stop_rx2 = stop_rx.clone();
        // Admitted under the port's caps, with TCP_NODELAY (tonic's own
        // `tcp_nodelay` does not apply to a listener we pass in; without it
        // every unary call took ~45 ms): see `Conns::accept`.
        let incoming = conns.incoming(listener);
        let served = router.serve_with_incoming_shutdown(incoming, async move {
            let _ = stop_rx2.wait_for(|s| *s).await;
        });
        let stopper = async move {
            shutdown.await;
            // Write what the engine keeps lazily, then hand over at once.
            let engine = core2.engine.read().ok().and_then(|g| g.clone());
            if let Some(engine) = engine {
                let _ = tokio::time::timeout(ENGINE_STOP_WAIT, engine.stop()).await;
            }
            tracing::info!("shutting down: resigning leadership");
            core2.election.resign().await;
            let _ = stop_tx.send(true);
        };
        // Open streams (a runner, a `WatchRuns` client) would hold a graceful
        // shutdown forever: past the drain they are cut.
        let mut stop_rx3 = stop_rx.clone();
        let drain = cfg.timing.shutdown_drain();
        let drained = async move {
            let _ = stop_rx3.wait_for(|s| *s).await;
            tokio::time::sleep(drain).await;
        };
        let served = async move {
            tokio::select! {
                r = served => r.map_err(|e| Error::Internal(e.to_string())),
                _ = drained => {
                    tracing::warn!(drain_ms = drain.as_millis() as u64, "streams still open after the drain; no longer waiting for them");
                    Ok(())
                }
            }
        };
        let (served, _) = tokio::join!(served, stopper);
        let _ = leader_loop.await;
        served
    });
    tracing::info!(%addr, store = %store.describe(), tokens = security.0, tls = security.1, mtls = security.2, "control plane serving");
    tracing::info!(
        open_files = connections.open_files,
        grpc_max = grpc_limits.max,
        grpc_per_ip = grpc_limits.per_ip,
        http_max = http_limits.max,
        http_per_ip = http_limits.per_ip,
        "connection caps (the connection idle longest is closed for a new one at a cap)"
    );
    if !security.0 {
        tracing::warn!(%addr, "authentication is off: anyone who can reach this address may do anything (give --auth-file)");
    }
    Ok(RunningServer { addr, http_addr, core, join })
}

/// Starts the engine when this replica becomes leader and stops it when it
/// is not (or on shutdown). While it does not lead, stored run changes are
/// relayed onto the lifecycle bus for this replica's run watchers.
async fn follow_leadership(
    core: Arc<Core>,
    timing: Timing,
    retention: crate::engine::retention::RetentionConfig,
    mut stop: watch::Receiver<bool>,
) {
    let mut lead = core.election.leadership();
    let mut running: Option<tokio::task::JoinHandle<EngineExit>> = None;
    let mut relay: Option<tokio::task::JoinHandle<()>> = None;
    let mut token = 0;
    // The term a fenced write ended: no engine is started for it again,
    // even while the election has yet to publish the step-down.
    let mut deposed: Option<u64> = None;
    // An engine that failed to start is retried after this instant.
    let mut retry_at: Option<tokio::time::Instant> = None;
    // Restart pause, doubled while engines keep failing soon after they
    // start (a store that rejects every write must not flood the log).
    let mut pause = ENGINE_RESTART_PAUSE;
    let mut started_at = tokio::time::Instant::now();
    // Engines in a row that failed to start or stopped soon after.
    let mut failures = 0u32;
    loop {
        let current = lead.borrow_and_update().clone();
        match (&current, running.is_some()) {
            (Some(l), false) if deposed != Some(l.token) && retry_at.is_none_or(|t| tokio::time::Instant::now() >= t) => {
                if let Some(r) = relay.take() {
                    r.abort();
                }
                let cfg = EngineConfig {
                    repo: core.repo.clone(),
                    clock: core.clock.clone(),
                    timing,
                    retention,
                    leadership: l.clone(),
                    leader_id: core.election.id(),
                    bus: core.lifecycle.clone(),
                    config: core.config.clone(),
                    consumer_health: core.consumers.clone(),
                    archive: core.archive.clone(),
                    notifier: crate::notify::deliver::Notifier {
                        repo: core.repo.clone(),
                        config: core.config.clone(),
                        clock: core.clock.clone(),
                        metrics: core.metrics.clone(),
                    },
                };
                let started = if std::env::var_os(FAIL_ENGINE_ENV).is_some() {
                    Err(Error::Internal(format!("{FAIL_ENGINE_ENV} is set: this replica's engine never starts")))
                } else {
                    Engine::start(cfg).await
                };
                match started {
                    Ok((handle, join)) => {
                        tracing::info!(token = l.token, "leading: engine started");
                        if core.traces && token != l.token {
                            tokio::spawn(crate::telemetry::reemit_recent(core.repo.clone(), core.clock.now()));
                        }
                        core.set_engine_problem(None);
                        token = l.token;
                        retry_at = None;
                        started_at = tokio::time::Instant::now();
                        if let Ok(mut g) = core.engine.write() {
                            *g = Some(handle);
                        }
                        running = Some(join);
                    }
                    Err(e) => {
                        tracing::error!(error = %e, pause_ms = pause.as_millis() as u64, "engine failed to start; retrying");
                        core.set_engine_problem(Some(format!("leading, but the engine cannot start: {e}")));
                        failures += 1;
                        step_down_if_failing(&core, l.token, &mut failures, timing).await;
                        retry_at = Some(tokio::time::Instant::now() + pause);
                        pause = (pause * 2).min(ENGINE_RESTART_MAX_PAUSE);
                        started_at = tokio::time::Instant::now();
                    }
                }
            }
            (None, true) => {
                stop_engine(&core, &mut running).await;
            }
            _ => {}
        }
        if current.is_none() && running.is_none() && relay.is_none() {
            let (repo, bus) = (core.repo.clone(), core.lifecycle.clone());
            relay = Some(tokio::spawn(crate::api::relay_stored_runs(repo, bus, futures::future::pending::<()>())));
        }
        let engine_done = async {
            match running.as_mut() {
                Some(j) => j.await,
                None => std::future::pending().await,
            }
        };
        let retry = async {
            match retry_at {
                Some(t) => tokio::time::sleep_until(t).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            changed = lead.changed() => if changed.is_err() { break },
            _ = async { let _ = stop.wait_for(|s| *s).await.map(|_| ()); } => break,
            _ = retry => {}
            ended = engine_done => {
                running = None;
                if let Ok(mut g) = core.engine.write() {
                    *g = None;
                }
                match ended {
                    // A newer leader exists: step down now (the watch then
                    // says `None` and the engine stays stopped).
                    // Stopped for a graceful handover: the resignation follows.
                    Ok(EngineExit::Handover) => {
                        tracing::info!(token, "engine stopped for a handover");
                        let _ = tokio::time::timeout(ENGINE_STOP_WAIT, lead.wait_for(|l| l.as_ref().is_none_or(|l| l.token != token))).await;
                    }
                    Ok(EngineExit::Fenced) => {
                        deposed = Some(token);
                        core.election.deposed(token);
                        let _ = tokio::time::timeout(ENGINE_RESTART_PAUSE, lead.wait_for(|l| l.as_ref().is_none_or(|l| l.token != token))).await;
                    }
                    // A bug, a failed store write, or a broken watch while this
                    // replica still leads: start again from the store after a
                    // pause rather than lead with no engine.
                    ended => {
                        let healthy = started_at.elapsed() > ENGINE_HEALTHY_RUN;
                        if healthy {
                            pause = ENGINE_RESTART_PAUSE;
                            failures = 0;
                        } else {
                            failures += 1;
                        }
                        let why = match &ended {
                            Ok(EngineExit::Failed(why)) => format!(": {why}"),
                            _ => " (see the log)".into(),
                        };
                        core.set_engine_problem(Some(format!("leading, but the engine stopped{why}; restarting it")));
                        step_down_if_failing(&core, token, &mut failures, timing).await;
                        match ended {
                            Err(e) if e.is_panic() => tracing::error!(error = %e, pause_ms = pause.as_millis() as u64, "engine panicked; restarting it"),
                            _ => tracing::warn!(pause_ms = pause.as_millis() as u64, "engine stopped while leading; restarting it"),
                        }
                        tokio::time::sleep(pause).await;
                        if !healthy {
                            pause = (pause * 2).min(ENGINE_RESTART_MAX_PAUSE);
                        }
                    }
                }
            }
        }
    }
    stop_engine(&core, &mut running).await;
    if let Some(r) = relay.take() {
        r.abort();
    }
}

/// Pause before restarting an engine that stopped on its own.
const ENGINE_RESTART_PAUSE: std::time::Duration = std::time::Duration::from_secs(1);
/// Longest pause between restarts of engines that keep failing.
const ENGINE_RESTART_MAX_PAUSE: std::time::Duration = std::time::Duration::from_secs(30);
/// An engine that ran this long was healthy: the next restart pause resets.
const ENGINE_HEALTHY_RUN: std::time::Duration = std::time::Duration::from_secs(60);
/// How long a graceful stop may take to write what the engine keeps lazily.
const ENGINE_STOP_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

async fn stop_engine(core: &Core, running: &mut Option<tokio::task::JoinHandle<EngineExit>>) {
    if let Ok(mut g) = core.engine.write() {
        *g = None;
    }
    if let Some(j) = running.take() {
        j.abort();
        let _ = j.await;
        tracing::info!("engine stopped");
    }
}

/// Test hook: with this variable set, this replica's engine fails to start
/// (a leader that cannot lead, for the step-down test).
pub const FAIL_ENGINE_ENV: &str = "PUNCHCLOCK_TEST_FAIL_ENGINE";

/// Engines in a row that may fail before a leader steps down.
const MAX_ENGINE_FAILURES: u32 = 5;

/// After [`MAX_ENGINE_FAILURES`] engines in a row failed, a replica that
/// has others beside it steps down for three lease TTLs so one of them can
/// lead (its store connection, disk or data may be what fails); alone, it
/// keeps trying.
async fn step_down_if_failing(core: &Core, token: u64, failures: &mut u32, timing: Timing) {
    if *failures < MAX_ENGINE_FAILURES {
        return;
    }
    *failures = 0;
    if core.election.members().await.len() > 1 {
        tracing::error!(token, "the engine keeps failing; stepping down so another replica can lead");
        core.election.step_down(token, timing.lease_ttl * 3);
    }
}

/// Connects to etcd, waiting for it: a replica started before its etcd
/// (or while etcd has no quorum) says so in one line per attempt and
/// keeps trying (1 s doubling to 10 s), rather than exiting.
async fn connect_etcd(endpoints: &[String], security: &EtcdSecurity) -> EtcdStore {
    let endpoints: Vec<String> =
        if security.tls() { endpoints.iter().map(|e| e.replacen("http://", "https://", 1)).collect() } else { endpoints.to_vec() };
    let mut pause = std::time::Duration::from_secs(1);
    loop {
        match EtcdStore::connect_with(&endpoints, security).await {
            Ok(store) => return store,
            Err(e) => {
                tracing::warn!(error = %e, retry_in_s = pause.as_secs(), "waiting for etcd");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(std::time::Duration::from_secs(10));
            }
        }
    }
}
