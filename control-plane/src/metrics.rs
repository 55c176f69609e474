//! Prometheus metrics (`GET /metrics` on the HTTP port), with the
//! `prometheus-client` crate, in the OpenMetrics text format.
//!
//! Two sources:
//! - **events**: [`Metrics::observe`] counts the engine's lifecycle events
//!   (lags, finished runs, ended attempts, skipped slots, leadership) as
//!   they are published — only the leader's engine publishes these, so a
//!   replica counts what it decided while it led;
//! - **state at scrape**: [`EngineGauges`] (pending runs per agent,
//!   runners and their slots, breakers) is read from the leader's engine
//!   when `/metrics` is scraped; a follower reports zero for them and
//!   `punchclock_is_leader 0`.
//!
//! Lags are labelled by agent, never by task (a task label would make one
//! series per task: unbounded). The breaker gauge is per task, but only for
//! tasks that have `execution.circuit_breaker`.
//!
//! Names and meanings are listed in README "Metrics".

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};
use tokio::sync::broadcast::error::RecvError;

use crate::engine::lifecycle::{Lifecycle, LifecycleBus};
use crate::model::RunRecord;

/// `agent_id`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
pub struct AgentLabel {
    /// Agent.
    pub agent_id: String,
}

/// `agent_id`, `status`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StatusLabels {
    /// Agent.
    pub agent_id: String,
    /// Final status (`SUCCEEDED`, ...) or attempt outcome (`failed`, ...).
    pub status: String,
}

/// `agent_id`, `status` (the attempt's outcome), `class` (the agent's).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AttemptLabels {
    /// Agent.
    pub agent_id: String,
    /// Attempt outcome (`failed`, `rate_limited`, ...).
    pub status: String,
    /// The agent's `class` (empty when it gave none; `other` past
    /// [`MAX_CLASSES`] distinct ones: the label stays bounded).
    pub class: String,
}

/// Distinct `class` label values one replica reports; later ones are `other`.
pub const MAX_CLASSES: usize = 32;

/// `agent_id`, `reason`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SkipLabels {
    /// Agent.
    pub agent_id: String,
    /// `skip_reason`.
    pub reason: String,
}

/// `task_id`, `state` (`closed`, `open`, `half_open`).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BreakerLabels {
    /// Task.
    pub task_id: String,
    /// Phase.
    pub state: String,
}

/// `task_id` (only for tasks with a circuit breaker: bounded).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TaskLabel {
    /// Task.
    pub task_id: String,
}

/// `sink`: a configured sink's name, or `url` for direct URLs.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SinkLabel {
    /// Sink.
    pub sink: String,
}

/// `source` (`webhook`, `queue`, `event`) and `result` (`created`,
/// `deduplicated`, `skipped`).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EventLabels {
    /// What it came through.
    pub source: String,
    /// What became of it.
    pub result: String,
}

/// `consumer` (`task/broker/queue`, bounded by the tasks) and `broker`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ConsumerLabels {
    /// The consumer.
    pub consumer: String,
    /// Its broker (a name of the config's `brokers:`).
    pub broker: String,
}

/// `resource`: a name of the config's `resources:` (bounded by the config).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResourceLabel {
    /// Resource.
    pub resource: String,
}

/// `budget` (a name of the config's `budgets:`) and `measure` (`cost`,
/// `input_tokens`, `output_tokens`, `runs`: the ones it limits).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BudgetLabels {
    /// Budget.
    pub budget: String,
    /// Measure.
    pub measure: String,
}

/// `op` (`txn`).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OpLabel {
    /// Store operation.
    pub op: String,
}

use crate::engine::core::EngineGauges;

fn lag_histogram() -> Histogram {
    // 5 ms .. ~82 s.
    Histogram::new(exponential_buckets(0.005, 2.0, 15))
}

/// Every metric of one replica.
pub struct Metrics {
    registry: Registry,
    dispatch_lag: Family<AgentLabel, Histogram>,
    start_lag: Family<AgentLabel, Histogram>,
    runs_finished: Family<StatusLabels, Counter>,
    attempts_ended: Family<AttemptLabels, Counter>,
    attempt_peak_memory: Family<AgentLabel, Histogram>,
    attempt_cpu: Family<AgentLabel, Histogram>,
    classes: std::sync::Mutex<std::collections::HashSet<String>>,
    slots_skipped: Family<SkipLabels, Counter>,
    runs_created: Family<AgentLabel, Counter>,
    runners_lost: Counter,
    leadership_changes: Counter,
    events_missed: Counter,
    runs_pending: Family<AgentLabel, Gauge>,
    runners_connected: Gauge,
    runner_slots: Gauge,
    runner_slots_busy: Gauge,
    active_runs: Gauge,
    is_leader: Gauge,
    fencing_token: Gauge<u64, AtomicU64>,
    breaker_state: Family<BreakerLabels, Gauge>,
    breaker_openings: Family<TaskLabel, Counter>,
    store_txn: Family<OpLabel, Histogram>,
    events: Family<EventLabels, Counter>,
    consumer_up: Family<ConsumerLabels, Gauge>,
    history_outbox: Gauge,
    history_up: Gauge,
    resource_in_use: Family<ResourceLabel, Gauge>,
    resource_limit: Family<ResourceLabel, Gauge>,
    resource_waiting: Family<ResourceLabel, Gauge>,
    resource_held: Family<ResourceLabel, Gauge>,
    resource_wait: Family<ResourceLabel, Histogram>,
    budget_used: Family<BudgetLabels, Gauge<f64, AtomicU64>>,
    budget_limit: Family<BudgetLabels, Gauge<f64, AtomicU64>>,
    notify_delivered: Family<SinkLabel, Counter>,
    notify_failed: Family<SinkLabel, Counter>,
    notify_dead: Family<SinkLabel, Counter>,
    notify_pending: Family<SinkLabel, Gauge>,
    /// Agents that had pending runs (their gauge then reads 0, not nothing).
    pending_agents: std::sync::Mutex<std::collections::BTreeSet<AgentLabel>>,
    spans_dropped: Counter,
    /// [`crate::telemetry::spans_dropped`] at the last scrape.
    spans_dropped_seen: AtomicU64,
}

/// Most agents whose pending gauge is kept at 0 once seen.
const MAX_PENDING_AGENTS: usize = 10_000;

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Metrics {
    /// A registry with every metric registered (all at zero).
    pub fn new() -> Arc<Metrics> {
        let mut registry = Registry::with_prefix("punchclock");
        let dispatch_lag = Family::<AgentLabel, Histogram>::new_with_constructor(lag_histogram as fn() -> Histogram);
        let start_lag = Family::<AgentLabel, Histogram>::new_with_constructor(lag_histogram as fn() -> Histogram);
        let store_txn = Family::<OpLabel, Histogram>::new_with_constructor(
            // 0.5 ms .. ~8 s.
            (|| Histogram::new(exponential_buckets(0.0005, 2.0, 15))) as fn() -> Histogram,
        );
        let m = Metrics {
            registry: Registry::default(),
            dispatch_lag,
            start_lag,
            runs_finished: Family::default(),
            attempts_ended: Family::default(),
            // 1 MiB .. 16 GiB.
            attempt_peak_memory: Family::<AgentLabel, Histogram>::new_with_constructor(
                (|| Histogram::new(exponential_buckets(1_048_576.0, 2.0, 15))) as fn() -> Histogram,
            ),
            // 10 ms .. ~2.7 h.
            attempt_cpu: Family::<AgentLabel, Histogram>::new_with_constructor(
                (|| Histogram::new(exponential_buckets(0.01, 2.0, 20))) as fn() -> Histogram,
            ),
            classes: std::sync::Mutex::new(std::collections::HashSet::new()),
            slots_skipped: Family::default(),
            runs_created: Family::default(),
            runners_lost: Counter::default(),
            leadership_changes: Counter::default(),
            events_missed: Counter::default(),
            runs_pending: Family::default(),
            runners_connected: Gauge::default(),
            runner_slots: Gauge::default(),
            runner_slots_busy: Gauge::default(),
            active_runs: Gauge::default(),
            is_leader: Gauge::default(),
            fencing_token: Gauge::default(),
            breaker_state: Family::default(),
            breaker_openings: Family::default(),
            store_txn,
            events: Family::default(),
            consumer_up: Family::default(),
            history_outbox: Gauge::default(),
            // 1 until a leader's mover finds the archive away: followers
            // and replicas without an archive have nothing waiting.
            history_up: {
                let g = Gauge::default();
                g.set(1);
                g
            },
            resource_in_use: Family::default(),
            resource_limit: Family::default(),
            resource_waiting: Family::default(),
            resource_held: Family::default(),
            resource_wait: Family::<ResourceLabel, Histogram>::new_with_constructor(lag_histogram as fn() -> Histogram),
            budget_used: Family::default(),
            budget_limit: Family::default(),
            notify_delivered: Family::default(),
            notify_failed: Family::default(),
            notify_dead: Family::default(),
            notify_pending: Family::default(),
            pending_agents: std::sync::Mutex::default(),
            spans_dropped: Counter::default(),
            spans_dropped_seen: AtomicU64::new(0),
        };
        let r = &mut registry;
        r.register_with_unit(
            "dispatch_lag",
            "Slot (scheduled_at) to the first attempt's dispatch, per agent",
            Unit::Seconds,
            m.dispatch_lag.clone(),
        );
        r.register_with_unit(
            "start_lag",
            "Slot (scheduled_at) to the agent's start (actual_started_at), per agent; one observation per run that started",
            Unit::Seconds,
            m.start_lag.clone(),
        );
        r.register("runs_finished", "Runs that reached a final status (SUCCEEDED, FAILED, TIMEOUT, CANCELLED)", m.runs_finished.clone());
        r.register(
            "attempts_ended",
            "Attempts that ended, by outcome (succeeded, failed, timeout, cancelled, lost, interrupted, rate_limited, quota_exhausted, non_retryable) and the agent's class",
            m.attempts_ended.clone(),
        );
        r.register_with_unit(
            "attempt_peak_memory",
            "Highest memory use of an attempt's processes, from its cgroup (process agents with limits), per agent",
            Unit::Bytes,
            m.attempt_peak_memory.clone(),
        );
        r.register_with_unit(
            "attempt_cpu",
            "CPU time of an attempt's processes, from its cgroup (process agents with limits), per agent",
            Unit::Seconds,
            m.attempt_cpu.clone(),
        );
        r.register(
            "slots_skipped",
            "Slots recorded as SKIPPED, by skip_reason (a coalesced record counts every slot)",
            m.slots_skipped.clone(),
        );
        r.register("runs_created", "Runs created (slots, triggers), per agent", m.runs_created.clone());
        r.register("runners_lost", "Runners declared lost (silent past their fence)", m.runners_lost.clone());
        r.register("leadership_changes", "Times this replica gained or lost leadership", m.leadership_changes.clone());
        r.register(
            "metrics_events_missed",
            "Lifecycle events the metrics subscriber missed because it fell behind",
            m.events_missed.clone(),
        );
        r.register("runs_pending", "Runs waiting for dispatch (PENDING or RETRYING), per agent (leader only)", m.runs_pending.clone());
        r.register("runners_connected", "Runners with an open stream to this leader", m.runners_connected.clone());
        r.register("runner_slots", "Slots of the connected runners", m.runner_slots.clone());
        r.register("runner_slots_busy", "Slots of the connected runners held by an attempt", m.runner_slots_busy.clone());
        r.register("engine_active_runs", "Runs in the leader engine's memory", m.active_runs.clone());
        r.register("is_leader", "1 while this replica leads (its engine runs), else 0", m.is_leader.clone());
        r.register("fencing_token", "Fencing token of this replica's current term (0 when not leading)", m.fencing_token.clone());
        r.register(
            "breaker_state",
            "Circuit breaker of each task that has one: 1 for its current state (closed, open, half_open)",
            m.breaker_state.clone(),
        );
        r.register("breaker_openings", "Circuit breaker openings decided by this replica, per task", m.breaker_openings.clone());
        r.register_with_unit("store_txn_duration", "Latency of the leader's fenced store transactions", Unit::Seconds, m.store_txn.clone());
        r.register(
            "events",
            "Events admitted (webhook requests, queue messages, published events), by source and result",
            m.events.clone(),
        );
        r.register(
            "history_outbox_runs",
            "Finished runs waiting in the store to move to the history archive (PostgreSQL; leader only)",
            m.history_outbox.clone(),
        );
        r.register(
            "history_archive_up",
            "0 while the leader cannot reach the history archive (PostgreSQL; runs wait in the store), else 1 (followers and replicas without --history: 1)",
            m.history_up.clone(),
        );
        r.register(
            "queue_consumer_up",
            "Each queue consumer of the leader: 1 while it consumes, 0 while its broker is down or refuses (retrying)",
            m.consumer_up.clone(),
        );
        r.register(
            "resource_in_use",
            "Concurrency units of each shared resource held by live agents (leader only)",
            m.resource_in_use.clone(),
        );
        r.register("resource_limit", "Each shared resource's concurrency limit (0: none)", m.resource_limit.clone());
        r.register(
            "budget_used",
            "Spend settled in each budget's current window, per limited measure (leader only)",
            m.budget_used.clone(),
        );
        r.register("budget_limit", "Each budget's hard limit, per limited measure", m.budget_limit.clone());
        r.register("resource_waiting", "Runs waiting for each shared resource (leader only)", m.resource_waiting.clone());
        r.register(
            "resource_held_back",
            "1 while a shared resource is held back (an agent answered rate_limited or quota_exhausted naming it)",
            m.resource_held.clone(),
        );
        r.register_with_unit(
            "resource_wait",
            "How long a run waited for a shared resource before its dispatch",
            Unit::Seconds,
            m.resource_wait.clone(),
        );
        r.register("notifications_delivered", "Notifications delivered (a 2xx answer), per sink", m.notify_delivered.clone());
        r.register(
            "notification_failures",
            "Notification delivery attempts that failed (error, timeout, non-2xx), per sink",
            m.notify_failed.clone(),
        );
        r.register(
            "notifications_dead",
            "Notifications dead-lettered (after max_attempts, or at once past max_pending_per_sink), per sink",
            m.notify_dead.clone(),
        );
        r.register(
            "notifications_pending",
            "Notifications waiting for delivery in the leader's outbox, per sink",
            m.notify_pending.clone(),
        );
        r.register(
            "trace_spans_dropped",
            "Trace spans lost: their OTLP export failed, or the exporter fell behind",
            m.spans_dropped.clone(),
        );
        Arc::new(Metrics { registry, ..m })
    }

    /// The histogram a [`crate::repo::Repo`] times its transactions with.
    pub fn store_txn_histogram(&self) -> Histogram {
        self.store_txn.get_or_create(&OpLabel { op: "txn".into() }).clone()
    }

    /// A notification was delivered to `sink`.
    pub fn notification_delivered(&self, sink: &str) {
        self.notify_delivered.get_or_create(&SinkLabel { sink: sink.into() }).inc();
    }

    /// A delivery attempt to `sink` failed.
    pub fn notification_failed(&self, sink: &str) {
        self.notify_failed.get_or_create(&SinkLabel { sink: sink.into() }).inc();
    }

    /// `n` notifications wait for delivery to `sink` (leader).
    pub fn notifications_pending(&self, sink: &str, n: usize) {
        self.notify_pending.get_or_create(&SinkLabel { sink: sink.into() }).set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// A notification to `sink` was dead-lettered.
    pub fn notification_dead(&self, sink: &str) {
        self.notify_dead.get_or_create(&SinkLabel { sink: sink.into() }).inc();
    }

    /// A class as its label value: at most [`MAX_CLASSES`] distinct ones.
    fn bounded_class(&self, class: Option<String>) -> String {
        let Some(c) = class else { return String::new() };
        let Ok(mut seen) = self.classes.lock() else { return "other".into() };
        if seen.contains(&c) || (seen.len() < MAX_CLASSES && seen.insert(c.clone())) { c } else { "other".into() }
    }

    /// Counts one lifecycle event.
    pub fn observe(&self, ev: &Lifecycle) {
        let agent = |r: &RunRecord| AgentLabel { agent_id: r.agent_id.clone() };
        let secs =
            |r: &RunRecord, t: chrono::DateTime<chrono::Utc>| ((t - r.due_at()).num_microseconds().unwrap_or(i64::MAX).max(0) as f64) / 1e6;
        match ev {
            Lifecycle::LeadershipGained { .. } | Lifecycle::LeadershipLost { .. } => {
                self.leadership_changes.inc();
            }
            Lifecycle::RunCreated(r) => {
                self.runs_created.get_or_create(&agent(r)).inc();
            }
            Lifecycle::SlotSkipped { run, reason, count, .. } => {
                self.slots_skipped
                    .get_or_create(&SkipLabels { agent_id: run.agent_id.clone(), reason: reason.as_str().into() })
                    .inc_by(*count);
            }
            Lifecycle::RunDispatched { run, attempt, .. } => {
                // The first attempt only (a refused attempt that is re-dispatched is attempt 1 again).
                if *attempt == 1
                    && let Some(a) = run.attempts.first()
                {
                    self.dispatch_lag.get_or_create(&agent(run)).observe(secs(run, a.dispatched_at));
                }
            }
            Lifecycle::RunStarted(r) => {
                // The run's first start: the attempt that started is the one
                // whose start became the run's `actual_started_at`.
                let started = r.attempts.iter().rev().find_map(|a| a.started_at);
                if let Some(t) = r.actual_started_at
                    && started == Some(t)
                {
                    self.start_lag.get_or_create(&agent(r)).observe(secs(r, t));
                }
            }
            Lifecycle::AttemptEnded { run, outcome, execution_id } => {
                let attempt = run.attempts.iter().rev().find(|a| &a.execution_id == execution_id);
                if let Some(m) = attempt.and_then(|a| a.machine) {
                    if let Some(b) = m.peak_memory_bytes {
                        self.attempt_peak_memory.get_or_create(&agent(run)).observe(b as f64);
                    }
                    if let Some(s) = m.cpu_seconds {
                        self.attempt_cpu.get_or_create(&agent(run)).observe(s);
                    }
                }
                let class = self.bounded_class(attempt.and_then(|a| a.class.clone()));
                let labels = AttemptLabels { agent_id: run.agent_id.clone(), status: outcome.as_str().to_string(), class };
                self.attempts_ended.get_or_create(&labels).inc();
            }
            Lifecycle::RunFinished(r) => {
                self.runs_finished.get_or_create(&StatusLabels { agent_id: r.agent_id.clone(), status: r.status.as_str().into() }).inc();
            }
            Lifecycle::RunnerLost { .. } => {
                self.runners_lost.inc();
            }
            Lifecycle::EventAdmitted { source, result } => {
                self.events.get_or_create(&EventLabels { source: source.as_str().into(), result: (*result).into() }).inc();
            }
            Lifecycle::ResourceWaited { resource, seconds } => {
                self.resource_wait.get_or_create(&ResourceLabel { resource: resource.clone() }).observe(*seconds);
            }
            Lifecycle::BreakerChanged { task_id, opened: true, .. } => {
                self.breaker_openings.get_or_create(&TaskLabel { task_id: task_id.clone() }).inc();
            }
            _ => {}
        }
    }

    /// Counts the events of `bus` until it closes. A subscriber that falls
    /// behind counts what it missed in `punchclock_metrics_events_missed_total`.
    pub async fn follow(self: Arc<Self>, bus: LifecycleBus) {
        let mut rx = bus.subscribe();
        loop {
            match rx.recv().await {
                Ok(ev) => self.observe(&ev),
                Err(RecvError::Lagged(n)) => {
                    self.events_missed.inc_by(n);
                }
                Err(RecvError::Closed) => return,
            }
        }
    }

    /// Sets the scrape-time gauges: the leader's state (`Some`, with its
    /// fencing token), or a follower's zeros.
    pub fn set_engine(&self, leading: Option<(u64, EngineGauges)>) {
        let dropped = crate::telemetry::spans_dropped();
        let seen = self.spans_dropped_seen.swap(dropped, std::sync::atomic::Ordering::Relaxed);
        self.spans_dropped.inc_by(dropped.saturating_sub(seen));
        // Agents seen before read 0 rather than vanish; breakers of deleted
        // tasks go.
        self.breaker_state.clear();
        // Resources dropped from the config go.
        for f in [&self.resource_in_use, &self.resource_limit, &self.resource_waiting, &self.resource_held] {
            f.clear();
        }
        self.budget_used.clear();
        self.budget_limit.clear();
        let agents: Vec<AgentLabel> = self.pending_agents.lock().map(|a| a.iter().cloned().collect()).unwrap_or_default();
        for agent in &agents {
            self.runs_pending.get_or_create(agent).set(0);
        }
        let Some((token, g)) = leading else {
            self.is_leader.set(0);
            self.fencing_token.set(0);
            self.runners_connected.set(0);
            self.runner_slots.set(0);
            self.runner_slots_busy.set(0);
            self.active_runs.set(0);
            return;
        };
        self.is_leader.set(1);
        self.fencing_token.set(token);
        for (agent_id, n) in g.pending {
            let label = AgentLabel { agent_id };
            self.runs_pending.get_or_create(&label).set(n as i64);
            if let Ok(mut seen) = self.pending_agents.lock()
                && seen.len() < MAX_PENDING_AGENTS
            {
                seen.insert(label);
            }
        }
        self.runners_connected.set(g.runners_connected as i64);
        self.runner_slots.set(g.slots_total as i64);
        self.runner_slots_busy.set(g.slots_busy as i64);
        self.active_runs.set(g.active_runs as i64);
        for r in g.resources {
            let label = ResourceLabel { resource: r.name };
            self.resource_in_use.get_or_create(&label).set(i64::from(r.in_use));
            self.resource_limit.get_or_create(&label).set(i64::from(r.limits.concurrency.unwrap_or(0)));
            self.resource_waiting.get_or_create(&label).set(i64::from(r.waiting));
            self.resource_held.get_or_create(&label).set(i64::from(r.held_until.is_some()));
        }
        for b in g.budgets {
            let l = b.limits;
            let measures = [
                ("cost", l.cost, b.used.cost),
                ("input_tokens", l.input_tokens.map(|v| v as f64), b.used.input_tokens as f64),
                ("output_tokens", l.output_tokens.map(|v| v as f64), b.used.output_tokens as f64),
                ("runs", l.runs.map(|v| v as f64), b.used.runs as f64),
            ];
            for (measure, limit, used) in measures {
                if let Some(limit) = limit {
                    let label = BudgetLabels { budget: b.name.clone(), measure: measure.into() };
                    self.budget_used.get_or_create(&label).set(used);
                    self.budget_limit.get_or_create(&label).set(limit);
                }
            }
        }
        for (task_id, phase) in g.breakers {
            for state in ["closed", "open", "half_open"] {
                let v = i64::from(state == phase);
                self.breaker_state.get_or_create(&BreakerLabels { task_id: task_id.clone(), state: state.into() }).set(v);
            }
        }
    }

    /// Sets the history archive's gauges: runs waiting, and whether the
    /// archive answered last.
    pub fn set_history_archive(&self, waiting: u64, up: bool) {
        self.history_outbox.set(i64::try_from(waiting).unwrap_or(i64::MAX));
        self.history_up.set(i64::from(up));
    }

    /// Sets each queue consumer's gauge (none on a follower).
    pub fn set_consumers(&self, consumers: &std::collections::BTreeMap<String, crate::events::consumers::ConsumerState>) {
        self.consumer_up.clear();
        for (name, s) in consumers {
            self.consumer_up
                .get_or_create(&ConsumerLabels { consumer: name.clone(), broker: s.broker.clone() })
                .set(i64::from(s.error.is_none()));
        }
    }

    /// The OpenMetrics text of every metric.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &self.registry) {
            tracing::error!(error = %e, "cannot encode metrics");
        }
        out
    }
}

/// The `Content-Type` of [`Metrics::encode`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Whether an `Accept` header asks for OpenMetrics over the classic text
/// format: its q-value (RFC 9110 §12.5.1; media types compared without
/// case) is above 0 and at least that of `text/plain` (or `*/*`).
pub fn prefers_openmetrics(accept: &str) -> bool {
    let (mut om, mut text) = (0.0f64, 0.0f64);
    for item in accept.split(',') {
        let mut parts = item.split(';');
        let media = parts.next().unwrap_or("").trim().to_ascii_lowercase();
        let q = parts
            .filter_map(|p| p.trim().strip_prefix("q=").or_else(|| p.trim().strip_prefix("Q=")))
            .find_map(|v| v.trim().parse::<f64>().ok())
            .unwrap_or(1.0);
        match media.as_str() {
            "application/openmetrics-text" => om = om.max(q),
            "text/plain" | "*/*" | "text/*" => text = text.max(q),
            _ => {}
        }
    }
    om > 0.0 && om >= text
}

/// The `Content-Type` of [`to_prometheus_text`]'s text.
pub const PROMETHEUS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// OpenMetrics text as the classic Prometheus text format (0.0.4), for
/// clients that do not ask for OpenMetrics (`promtool check metrics`,
/// curl): a counter family's `HELP`/`TYPE` name gets the `_total` of its
/// samples, and the `UNIT` and `EOF` lines go (the Prometheus
/// "Exposition formats" document has neither).
pub fn to_prometheus_text(openmetrics: &str) -> String {
    let mut counters = std::collections::HashSet::new();
    for line in openmetrics.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ")
            && let Some(name) = rest.strip_suffix(" counter")
        {
            counters.insert(name.to_string());
        }
    }
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let meta = line.strip_prefix("# HELP ").map(|r| ("# HELP ", r)).or_else(|| line.strip_prefix("# TYPE ").map(|r| ("# TYPE ", r)));
        match meta {
            Some((kind, rest)) => {
                let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
                let name = if counters.contains(name) { format!("{name}_total") } else { name.to_string() };
                out.push_str(&format!("{kind}{name} {tail}\n"));
            }
            None => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::run::{SkipReason, TriggerKind};

    #[test]
    fn events_become_series() {
        let m = Metrics::new();
        let t0: chrono::DateTime<chrono::Utc> = "2026-12-01T10:00:00Z".parse().unwrap();
        let mut run = RunRecord::pending("t.1".into(), "t", "ag", TriggerKind::Cron, t0, t0);
        run.actual_started_at = Some(t0 + chrono::Duration::milliseconds(250));
        run.attempts = vec![
            serde_json::from_value(serde_json::json!({"attempt": 1, "execution_id": "e", "runner_id": "r",
                "dispatched_at": t0 + chrono::Duration::milliseconds(20), "started_at": t0 + chrono::Duration::milliseconds(250)}))
            .unwrap(),
        ];
        let run = Arc::new(run);
        m.observe(&Lifecycle::RunStarted(run.clone()));
        m.observe(&Lifecycle::SlotSkipped { run: run.clone(), reason: SkipReason::Misfired, count: 4, from: t0, until: t0 });
        m.set_engine(Some((9, EngineGauges { runners_connected: 2, breakers: vec![("t".into(), "open")], ..Default::default() })));
        let text = m.encode();
        assert!(text.contains("punchclock_start_lag_seconds_count{agent_id=\"ag\"} 1"), "{text}");
        assert!(text.contains("punchclock_start_lag_seconds_sum{agent_id=\"ag\"} 0.25"), "{text}");
        assert!(text.contains("punchclock_slots_skipped_total{agent_id=\"ag\",reason=\"misfired\"} 4"), "{text}");
        assert!(text.contains("punchclock_fencing_token 9"), "{text}");
        assert!(text.contains("punchclock_breaker_state{task_id=\"t\",state=\"open\"} 1"), "{text}");
        assert!(text.ends_with("# EOF\n"));
        let classic = to_prometheus_text(&text);
        assert!(classic.contains("# TYPE punchclock_slots_skipped_total counter\n"), "{classic}");
        assert!(classic.contains("# HELP punchclock_slots_skipped_total Slots"), "{classic}");
        assert!(classic.contains("# TYPE punchclock_start_lag_seconds histogram\n"), "{classic}");
        assert!(!classic.contains("# EOF") && !classic.contains("# UNIT"), "{classic}");
        // Content negotiation.
        assert!(prefers_openmetrics("application/openmetrics-text; version=1.0.0; charset=utf-8,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"));
        assert!(!prefers_openmetrics("text/plain;q=1.0, application/openmetrics-text;q=0.1"));
        assert!(prefers_openmetrics("Application/OpenMetrics-Text"));
        assert!(!prefers_openmetrics("application/openmetrics-text;q=0"));
        assert!(!prefers_openmetrics("*/*"));
    }
}
