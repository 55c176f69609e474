//! OpenTelemetry traces: the OTLP exporter, and the control plane's spans
//! of each run.
//!
//! **Setup** ([`init`]): off until an endpoint is given, by `--otlp-endpoint`
//! or the standard `OTEL_EXPORTER_OTLP_ENDPOINT` /
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`; OTLP over gRPC (tonic, the
//! workspace's one version). `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`
//! and `OTEL_TRACES_SAMPLER(_ARG)` are honoured by the SDK. Spans go through
//! the SDK's batch processor, on a thread of its own: ending a span never
//! waits for the collector; when the collector is down the batch is lost
//! and counted ([`spans_dropped`], `punchclock_trace_spans_dropped_total`).
//!
//! **Spans** ([`follow`]): one trace per run, emitted from the leader's
//! lifecycle events when each part ends, with the ids stored on the run
//! ([`crate::model::trace`]), so a failover continues the same trace:
//! - `run {task_id}`: the root (or a child of the `TriggerTask` caller's
//!   span), from the slot to the run's end, with `punchclock.task_id`,
//!   `run_id`, `scheduled_at`, trigger kind, lag, status and the summed
//!   `gen_ai.usage.*` of its attempts;
//! - `attempt {n}`: a child per attempt, from dispatch to its end, with the
//!   runner id, execution id and fencing token; the runner's `invoke_agent`
//!   span is its child (context in `Assign.traceparent`);
//! - a SKIPPED slot is a short `run {task_id}` span with the reason.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use chrono::{DateTime, Utc};
use opentelemetry::trace::{Span, SpanContext, SpanKind, Status, TraceContextExt, TraceFlags, TraceId, TraceState, Tracer, TracerProvider};
use opentelemetry::{Context, KeyValue, SpanId};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{SdkTracerProvider, SpanData, SpanExporter};
use tokio::sync::broadcast::error::RecvError;

use crate::engine::lifecycle::{Lifecycle, LifecycleBus};
use crate::error::{Error, Result};
use crate::model::run::Usage;
use crate::model::{Attempt, RunRecord, RunStatus};

static DROPPED: AtomicU64 = AtomicU64::new(0);

/// Spans lost because their export failed (collector down or slow).
pub fn spans_dropped() -> u64 {
    DROPPED.load(Ordering::Relaxed)
}

/// Counts the spans of failed exports.
#[derive(Debug)]
struct Counting<E>(E);

impl<E: SpanExporter> SpanExporter for Counting<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let n = batch.len() as u64;
        let r = self.0.export(batch).await;
        if r.is_err() {
            DROPPED.fetch_add(n, Ordering::Relaxed);
        }
        r
    }

    fn shutdown_with_timeout(&mut self, timeout: Duration) -> OTelSdkResult {
        self.0.shutdown_with_timeout(timeout)
    }

    fn force_flush(&mut self) -> OTelSdkResult {
        self.0.force_flush()
    }

    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        self.0.set_resource(resource);
    }
}

/// The OTLP endpoint from the flag or the standard environment variables.
pub fn endpoint(flag: Option<&str>) -> Option<String> {
    flag.map(str::to_string)
        .or_else(|| std::env::var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").ok())
        .or_else(|| std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT").ok())
        .filter(|e| !e.trim().is_empty())
}

/// The installed exporter; [`Telemetry::shutdown`] at exit flushes the
/// last spans (bounded by the exporter's 5 s timeout).
#[derive(Debug)]
pub struct Telemetry(SdkTracerProvider);

impl Telemetry {
    /// Starts tracing when [`endpoint`] finds one (`flag` first); `None`
    /// when tracing is off. See [`init`].
    ///
    /// Errors: as [`init`].
    pub fn start(flag: Option<&str>, service: &str) -> Result<Option<Telemetry>> {
        endpoint(flag).map(|ep| init(&ep, service).map(Telemetry)).transpose()
    }

    /// Flushes and stops the exporter.
    pub fn shutdown(self) {
        if let Err(e) = self.0.shutdown() {
            tracing::warn!(error = %e, "trace exporter did not shut down cleanly");
        }
    }
}

/// Installs the global tracer provider exporting to `endpoint` (see the
/// module docs); `service` names the process when `OTEL_SERVICE_NAME` does
/// not. Must be called within a tokio runtime. Keep the provider and call
/// `shutdown` on it at exit, so the last spans are flushed.
///
/// Errors: `InvalidArgument` (`--otlp-endpoint`) when the exporter cannot
/// be built.
pub fn init(endpoint: &str, service: &str) -> Result<SdkTracerProvider> {
    use opentelemetry_otlp::WithExportConfig;
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(endpoint)
        .with_timeout(Duration::from_secs(5))
        .build()
        .map_err(|e| Error::invalid("--otlp-endpoint", format!("cannot export traces to {endpoint:?}: {e}")))?;
    let mut resource = opentelemetry_sdk::Resource::builder();
    if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
        resource = resource.with_service_name(service.to_string());
    }
    let provider = SdkTracerProvider::builder().with_batch_exporter(Counting(exporter)).with_resource(resource.build()).build();
    opentelemetry::global::set_tracer_provider(provider.clone());
    tracing::info!(endpoint, "exporting traces over OTLP");
    Ok(provider)
}

fn system_time(t: DateTime<Utc>) -> SystemTime {
    SystemTime::from(t)
}

fn trace_id(hex: &str) -> Option<TraceId> {
    TraceId::from_hex(hex).ok().filter(|t| *t != TraceId::INVALID)
}

fn span_id(hex: &str) -> Option<SpanId> {
    SpanId::from_hex(hex).ok().filter(|s| *s != SpanId::INVALID)
}

/// A context whose current span is the remote `(trace, span)`.
fn remote_parent(trace: TraceId, span: SpanId) -> Context {
    Context::new().with_remote_span_context(SpanContext::new(trace, span, TraceFlags::SAMPLED, true, TraceState::default()))
}

fn usage_attributes(u: &Usage) -> Vec<KeyValue> {
    vec![
        KeyValue::new("gen_ai.usage.input_tokens", u.input_tokens as i64),
        KeyValue::new("gen_ai.usage.output_tokens", u.output_tokens as i64),
        KeyValue::new("gen_ai.usage.cache_read_input_tokens", u.cache_read_input_tokens as i64),
        KeyValue::new("punchclock.usage.cost", u.cost),
    ]
}

/// Emits the span of one ended attempt of `run`.
fn attempt_span(run: &RunRecord, a: &Attempt) {
    let (Some(trace), Some(parent)) = (trace_id(&run.trace_id), span_id(&run.span_id)) else { return };
    let Some(own) = span_id(&crate::model::trace::attempt_span_id(&a.execution_id)) else { return };
    let tracer = opentelemetry::global::tracer_provider().tracer("punchclock");
    let mut attrs = vec![
        KeyValue::new("punchclock.task_id", run.task_id.clone()),
        KeyValue::new("punchclock.run_id", run.run_id.clone()),
        KeyValue::new("punchclock.execution_id", a.execution_id.clone()),
        KeyValue::new("punchclock.attempt", i64::from(a.attempt)),
        KeyValue::new("punchclock.runner_id", a.runner_id.clone()),
        KeyValue::new("punchclock.fencing_token", run.fencing_token as i64),
        KeyValue::new("punchclock.outcome", a.outcome.map(|o| o.as_str()).unwrap_or("open")),
    ];
    for (k, v) in [("punchclock.class", &a.class), ("punchclock.resource", &a.resource), ("gen_ai.request.model", &a.model)] {
        if let Some(v) = v {
            attrs.push(KeyValue::new(k, v.clone()));
        }
    }
    if let Some(t) = a.retry_at {
        attrs.push(KeyValue::new("punchclock.retry_at", t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true)));
    }
    if !a.holds.is_empty() {
        let names: Vec<&str> = a.holds.iter().map(|h| h.name.as_str()).collect();
        attrs.push(KeyValue::new("punchclock.resources", names.join(",")));
    }
    if let Some(u) = &a.usage {
        attrs.extend(usage_attributes(u));
    }
    let mut span = tracer
        .span_builder(format!("attempt {}", a.attempt))
        .with_kind(SpanKind::Producer)
        .with_span_id(own)
        .with_start_time(system_time(a.dispatched_at))
        .with_attributes(attrs)
        .start_with_context(&tracer, &remote_parent(trace, parent));
    if a.outcome != Some(crate::model::run::Outcome::Succeeded) {
        span.set_status(Status::error(a.error.clone().unwrap_or_default()));
    }
    span.end_with_timestamp(system_time(a.finished_at.unwrap_or_else(Utc::now)));
}

/// Emits the run's root span (when it ended or was skipped).
fn run_span(run: &RunRecord) {
    let (Some(trace), Some(own)) = (trace_id(&run.trace_id), span_id(&run.span_id)) else { return };
    let tracer = opentelemetry::global::tracer_provider().tracer("punchclock");
    let mut attrs = vec![
        KeyValue::new("punchclock.task_id", run.task_id.clone()),
        KeyValue::new("punchclock.run_id", run.run_id.clone()),
        KeyValue::new("punchclock.agent_id", run.agent_id.clone()),
        KeyValue::new("punchclock.scheduled_at", run.scheduled_at.to_rfc3339()),
        KeyValue::new("punchclock.trigger", run.trigger.as_str()),
        KeyValue::new("punchclock.status", run.status.as_str()),
        KeyValue::new("punchclock.attempts", i64::from(run.attempt_count())),
    ];
    if let Some(a) = run.attempts.first() {
        attrs.push(KeyValue::new("punchclock.dispatch_lag_ms", (a.dispatched_at - run.scheduled_at).num_milliseconds().max(0)));
    }
    if let Some(t) = run.actual_started_at {
        attrs.push(KeyValue::new("punchclock.start_lag_ms", (t - run.scheduled_at).num_milliseconds().max(0)));
    }
    if let Some(reason) = run.skip_reason {
        attrs.push(KeyValue::new("punchclock.skip_reason", reason.as_str()));
    }
    let usage = run.attempts.iter().filter_map(|a| a.usage).reduce(Usage::plus);
    if let Some(u) = &usage {
        attrs.extend(usage_attributes(u));
    }
    let start = run.attempts.first().map_or(run.scheduled_at, |a| a.dispatched_at.min(run.scheduled_at));
    let start = if run.status == RunStatus::Skipped { run.updated_at } else { start };
    let parent = match (trace_id(&run.trace_id), span_id(&run.parent_span_id)) {
        (Some(t), Some(p)) => remote_parent(t, p),
        _ => Context::new(),
    };
    let mut builder = tracer
        .span_builder(format!("run {}", run.task_id))
        .with_kind(SpanKind::Internal)
        .with_span_id(own)
        .with_start_time(system_time(start))
        .with_attributes(attrs);
    builder.trace_id = Some(trace);
    let mut span = builder.start_with_context(&tracer, &parent);
    match run.status {
        RunStatus::Succeeded | RunStatus::Skipped => {}
        _ => span.set_status(Status::error(run.error.clone().unwrap_or_else(|| run.status.as_str().to_string()))),
    }
    span.end_with_timestamp(system_time(run.finished_at.unwrap_or(run.updated_at)));
}

/// How many of the store's last writes before a new term a new leader
/// looks through for runs whose spans may not have been exported.
const REEMIT_REVISIONS: i64 = 10_000;
/// How long before a new term a run must have ended for its spans to be
/// emitted again: well past the batch exporter's 5 s delay.
const REEMIT_WINDOW: chrono::Duration = chrono::Duration::minutes(2);

/// A new leader emits again the run and attempt spans of runs that ended
/// just before it took over: the previous leader may have died before its
/// batch exporter sent them (issue 19: 9 runs over two kill -9s left
/// orphan runner spans). Span ids are derived from run and execution ids,
/// so a span sent twice is one span to the backend. Looks at the runs
/// among the store's last [`REEMIT_REVISIONS`] writes (keys only, then
/// those runs) that ended within [`REEMIT_WINDOW`] of `now`.
pub async fn reemit_recent(repo: crate::repo::Repo, now: DateTime<Utc>) {
    let r = async {
        let top = repo.current_revision().await?;
        let keys = repo.run_keys("").await?;
        let ids: Vec<String> = keys.into_iter().filter(|k| k.mod_revision > top - REEMIT_REVISIONS).map(|k| k.run_id).collect();
        let mut emitted = 0usize;
        for chunk in ids.chunks(64) {
            let refs: Vec<&str> = chunk.iter().map(String::as_str).collect();
            for run in repo.get_runs(&refs).await? {
                let ended = run.finished_at.unwrap_or(run.updated_at);
                if !run.status.is_terminal() || ended < now - REEMIT_WINDOW {
                    continue;
                }
                for a in run.attempts.iter().filter(|a| a.outcome.is_some()) {
                    attempt_span(&run, a);
                }
                run_span(&run);
                emitted += 1;
            }
        }
        Ok::<usize, crate::Error>(emitted)
    };
    match r.await {
        Ok(0) => {}
        Ok(n) => tracing::info!(runs = n, "spans of runs that ended before this term emitted again (in case they were not exported)"),
        Err(e) => tracing::warn!(error = %e, "cannot emit again the spans of runs that ended before this term"),
    }
}

/// Emits spans for the leader's lifecycle events until `bus` closes (see
/// the module docs). Spawn it only when tracing is on.
pub async fn follow(bus: LifecycleBus) {
    let mut rx = bus.subscribe();
    loop {
        match rx.recv().await {
            Ok(Lifecycle::AttemptEnded { run, execution_id, .. }) => {
                if let Some(a) = run.attempts.iter().find(|a| a.execution_id == execution_id) {
                    attempt_span(&run, a);
                }
            }
            Ok(Lifecycle::RunFinished(run)) => run_span(&run),
            Ok(Lifecycle::SlotSkipped { run, .. }) => run_span(&run),
            Ok(_) => {}
            Err(RecvError::Lagged(n)) => {
                tracing::warn!(missed = n, "trace exporter fell behind the lifecycle events; their spans are lost");
                DROPPED.fetch_add(n, Ordering::Relaxed);
            }
            Err(RecvError::Closed) => return,
        }
    }
}
