//! The runner's span of an execution, `invoke_agent {agent_id}` (the
//! OpenTelemetry GenAI agent conventions: `gen_ai.operation.name =
//! invoke_agent`, `gen_ai.agent.id`, `gen_ai.agent.name`, and
//! `gen_ai.usage.*` from the `usage` the agent reports in its result), a
//! child of the control plane's attempt span named by `Assign.traceparent`.
//! The agent gets this span's context as `TRACEPARENT` (the OpenTelemetry
//! environment-variable carrier), so its own spans join the trace.
//!
//! Spans go to the global tracer provider the `punchclock` binary installs
//! when an OTLP endpoint is configured; without one they cost nothing.

use std::time::SystemTime;

use opentelemetry::trace::{Span, SpanContext, SpanKind, Status, TraceContextExt, TraceFlags, TraceId, TraceState, Tracer, TracerProvider};
use opentelemetry::{Context, KeyValue, SpanId};
use punchclock_proto::tracecontext;
use punchclock_proto::v1::Assign;

/// One execution's span, begun when the agent is started.
#[derive(Debug, Clone)]
pub(crate) struct InvokeSpan {
    trace: TraceId,
    parent: SpanId,
    span: SpanId,
    sampled: bool,
    agent_id: String,
    task_id: String,
    run_id: String,
    execution_id: String,
    attempt: u32,
}

impl InvokeSpan {
    /// The span of `assign`'s execution, when its `traceparent` is valid.
    pub(crate) fn begin(assign: &Assign) -> Option<InvokeSpan> {
        let (trace, parent, sampled) = tracecontext::parse(&assign.traceparent)?;
        let span = loop {
            let s = SpanId::from_bytes(rand::random::<[u8; 8]>());
            if s != SpanId::INVALID {
                break s;
            }
        };
        Some(InvokeSpan {
            trace: TraceId::from_hex(&trace).ok()?,
            parent: SpanId::from_hex(&parent).ok()?,
            span,
            sampled,
            agent_id: assign.agent_id.clone(),
            task_id: assign.task_id.clone(),
            run_id: assign.run_id.clone(),
            execution_id: assign.execution_id.clone(),
            attempt: assign.attempt,
        })
    }

    /// `TRACEPARENT` for the agent: this span.
    pub(crate) fn traceparent(&self) -> String {
        tracecontext::format(&self.trace.to_string(), &self.span.to_string())
    }

    /// Emits the span: from `started` to `finished`, with the outcome, the
    /// exit code and the usage in `result_json`.
    pub(crate) fn end(
        &self,
        started: SystemTime,
        finished: SystemTime,
        outcome: &str,
        exit_code: Option<i32>,
        result_json: &str,
        error: &str,
    ) {
        let tracer = opentelemetry::global::tracer_provider().tracer("punchclock-runner");
        let flags = if self.sampled { TraceFlags::SAMPLED } else { TraceFlags::default() };
        let parent = Context::new().with_remote_span_context(SpanContext::new(self.trace, self.parent, flags, true, TraceState::default()));
        let mut attrs = vec![
            KeyValue::new("gen_ai.operation.name", "invoke_agent"),
            KeyValue::new("gen_ai.agent.id", self.agent_id.clone()),
            KeyValue::new("gen_ai.agent.name", self.agent_id.clone()),
            KeyValue::new("punchclock.task_id", self.task_id.clone()),
            KeyValue::new("punchclock.run_id", self.run_id.clone()),
            KeyValue::new("punchclock.execution_id", self.execution_id.clone()),
            KeyValue::new("punchclock.attempt", i64::from(self.attempt)),
            KeyValue::new("punchclock.outcome", outcome.to_string()),
        ];
        if let Some(code) = exit_code {
            attrs.push(KeyValue::new("process.exit.code", i64::from(code)));
        }
        if let Ok(result) = serde_json::from_str::<serde_json::Value>(result_json)
            && let Some(u) = result.get("usage").and_then(|u| u.as_object())
        {
            for key in ["input_tokens", "output_tokens", "cache_read_input_tokens"] {
                if let Some(v) = u.get(key).and_then(serde_json::Value::as_i64) {
                    attrs.push(KeyValue::new(format!("gen_ai.usage.{key}"), v));
                }
            }
            if let Some(c) = u.get("cost").and_then(serde_json::Value::as_f64) {
                attrs.push(KeyValue::new("punchclock.usage.cost", c));
            }
        }
        let mut span = tracer
            .span_builder(format!("invoke_agent {}", self.agent_id))
            .with_kind(SpanKind::Client)
            .with_span_id(self.span)
            .with_start_time(started)
            .with_attributes(attrs)
            .start_with_context(&tracer, &parent);
        if !error.is_empty() {
            span.set_status(Status::error(error.to_string()));
        }
        span.end_with_timestamp(finished);
    }
}
