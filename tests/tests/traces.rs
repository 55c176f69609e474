//! Issue 9, acceptance 1: one OpenTelemetry trace per run. A test OTLP
//! receiver (the real OTLP/gRPC `TraceService` from `opentelemetry-proto`)
//! gets, for a run that fails once and then succeeds: the control plane's
//! run span, two attempt spans under it, the runner's two `invoke_agent`
//! spans (GenAI attributes, one under each attempt), and — over OTLP/HTTP
//! JSON, from the agent itself, which reads `TRACEPARENT` — the agent's
//! span under the second `invoke_agent`; the usage the agent reported is
//! on its `invoke_agent` span and summed on the run's.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::trace::v1::Span;
use punchclock_proto::v1 as pb;
use punchclock_tests::receiver::Receiver;
use punchclock_tests::{KeepLogsOnPanic, Proc, apply, cli, status, wait_n_runs};
use serde_json::{Value, json};
use tokio::sync::Notify;

/// The spans received, with their service's name.
#[derive(Default, Clone)]
struct Collector {
    spans: Arc<Mutex<Vec<(String, Span)>>>,
    arrived: Arc<Notify>,
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        req: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        for rs in req.into_inner().resource_spans {
            let service = rs
                .resource
                .iter()
                .flat_map(|r| r.attributes.iter())
                .find(|kv| kv.key == "service.name")
                .and_then(|kv| kv.value.as_ref())
                .and_then(|v| match &v.value {
                    Some(AnyValue::StringValue(s)) => Some(s.clone()),
                    _ => None,
                })
                .unwrap_or_default();
            for ss in rs.scope_spans {
                for s in ss.spans {
                    self.spans.lock().expect("spans").push((service.clone(), s));
                }
            }
        }
        self.arrived.notify_waiters();
        Ok(tonic::Response::new(ExportTraceServiceResponse { partial_success: None }))
    }
}

impl Collector {
    async fn start() -> (Collector, u16) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let c = Collector::default();
        let svc = TraceServiceServer::new(c.clone());
        tokio::spawn(async move {
            let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
            let _ = tonic::transport::Server::builder().add_service(svc).serve_with_incoming(incoming).await;
        });
        (c, port)
    }

    /// The spans of `trace` (hex), once `pred` holds for them (bounded).
    async fn wait(&self, trace: &str, within: Duration, pred: impl Fn(&[(String, Span)]) -> bool) -> Vec<(String, Span)> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let notified = self.arrived.notified();
            let now: Vec<(String, Span)> =
                self.spans.lock().expect("spans").iter().filter(|(_, s)| hex::encode(&s.trace_id) == trace).cloned().collect();
            if pred(&now) || tokio::time::timeout_at(deadline, notified).await.is_err() {
                return now;
            }
        }
    }
}

fn attr<'a>(s: &'a Span, key: &str) -> Option<&'a AnyValue> {
    s.attributes.iter().find(|kv| kv.key == key).and_then(|kv| kv.value.as_ref()).and_then(|v| v.value.as_ref())
}

fn int(s: &Span, key: &str) -> Option<i64> {
    match attr(s, key) {
        Some(AnyValue::IntValue(i)) => Some(*i),
        _ => None,
    }
}

fn text(s: &Span, key: &str) -> Option<String> {
    match attr(s, key) {
        Some(AnyValue::StringValue(v)) => Some(v.clone()),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_that_fails_once_then_succeeds_is_one_trace() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "traces");
    let (collector, port) = Collector::start().await;
    let agent_spans = Receiver::start("unused").await;
    let endpoint = format!("http://127.0.0.1:{port}");
    let dev = Proc::dev_with(&dir.path().join("data"), 8, &dir.path().join("dev.log"), &["--otlp-endpoint", &endpoint]);
    apply(
        &dev.addr,
        json!({"task_id": "traced", "agent_id": "traced_agent",
               "execution": {"max_retries": 1, "retry_backoff": {"base_seconds": 0.2, "cap_seconds": 0.2, "jitter_seconds": 0}},
               "context": {"params": {"otlp_http": format!("http://127.0.0.1:{}/v1/traces", agent_spans.port)}}}),
    )
    .await;
    cli(&dev.addr, &["task", "trigger", "traced"]);
    let run = wait_n_runs(&dev.addr, "traced", 1, Duration::from_secs(30), |r| status(r) == pb::RunStatus::Succeeded).await.remove(0);
    assert_eq!(run.attempts.len(), 2);
    let stored: Value = serde_json::from_str(&cli(&dev.addr, &["-o", "json", "runs", "get", &run.run_id])).expect("json");
    let trace = stored["trace_id"].as_str().expect("trace_id").to_string();
    let run_span = stored["span_id"].as_str().expect("span_id").to_string();
    assert_eq!(run.trace_id, trace);

    let spans =
        collector.wait(&trace, Duration::from_secs(30), |s| s.len() >= 5 && s.iter().any(|(_, x)| x.name.starts_with("run "))).await;
    let names: Vec<&str> = spans.iter().map(|(_, s)| s.name.as_str()).collect();
    let by_name = |n: &str| spans.iter().filter(|(_, s)| s.name == n).map(|(svc, s)| (svc.clone(), s.clone())).collect::<Vec<_>>();
    // The run span: one, the root, with the stored id, usage summed.
    let runs = by_name("run traced");
    assert_eq!(runs.len(), 1, "{names:?}");
    let root = &runs[0].1;
    assert_eq!(hex::encode(&root.span_id), run_span);
    assert!(root.parent_span_id.is_empty(), "the run span is the root");
    assert_eq!(runs[0].0, "punchclock-dev");
    assert_eq!(text(root, "punchclock.run_id").as_deref(), Some(run.run_id.as_str()));
    assert_eq!(int(root, "gen_ai.usage.input_tokens"), Some(100));
    // Two attempt spans under it.
    let mut attempts: Vec<Span> = spans.iter().map(|(_, s)| s.clone()).filter(|s| s.name.starts_with("attempt ")).collect();
    attempts.sort_by_key(|s| int(s, "punchclock.attempt"));
    assert_eq!(attempts.len(), 2, "{names:?}");
    for (a, run_attempt) in attempts.iter().zip(&run.attempts) {
        assert_eq!(a.parent_span_id, root.span_id, "attempt spans are children of the run span");
        assert_eq!(text(a, "punchclock.execution_id").as_deref(), Some(run_attempt.execution_id.as_str()));
        assert!(text(a, "punchclock.runner_id").is_some() && int(a, "punchclock.fencing_token").is_some());
    }
    // The runner's invoke_agent spans, one under each attempt, with GenAI attributes.
    let invokes: HashMap<Vec<u8>, Span> =
        spans.iter().filter(|(_, s)| s.name == "invoke_agent traced_agent").map(|(_, s)| (s.parent_span_id.clone(), s.clone())).collect();
    assert_eq!(invokes.len(), 2, "{names:?}");
    for a in &attempts {
        let inv = invokes.get(&a.span_id).expect("an invoke_agent span under each attempt");
        assert_eq!(text(inv, "gen_ai.operation.name").as_deref(), Some("invoke_agent"));
        assert_eq!(text(inv, "gen_ai.agent.id").as_deref(), Some("traced_agent"));
        assert_eq!(text(inv, "punchclock.execution_id"), text(a, "punchclock.execution_id"));
    }
    let second = invokes.get(&attempts[1].span_id).expect("second");
    assert_eq!(int(second, "gen_ai.usage.input_tokens"), Some(100));
    assert_eq!(int(second, "gen_ai.usage.output_tokens"), Some(20));
    assert_eq!(int(second, "process.exit.code"), Some(0));
    assert_eq!(int(invokes.get(&attempts[0].span_id).expect("first"), "process.exit.code"), Some(1));
    // The agent's own span, reported by the agent under its TRACEPARENT.
    assert!(agent_spans.wait_for(Duration::from_secs(10), |r| !r.is_empty()).await, "the agent sent its span");
    let body = &agent_spans.received()[0].body;
    let span = &body["resourceSpans"][0]["scopeSpans"][0]["spans"][0];
    assert_eq!(span["traceId"].as_str(), Some(trace.as_str()));
    assert_eq!(span["parentSpanId"].as_str(), Some(hex::encode(&second.span_id).as_str()), "the agent's span is under invoke_agent");
    assert_eq!(
        stored["result"]["traceparent"].as_str().map(|t| t.split('-').nth(2).unwrap_or("").to_string()),
        Some(hex::encode(&second.span_id))
    );
}

/// A leader killed (-9) while a run is RUNNING: the new leader ends it in
/// the same trace. Every span naming the run (run, attempt, invoke_agent)
/// has the trace id stored on the run: one trace, not two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_kill_mid_run_leaves_one_trace() {
    use punchclock_tests::etcd::{Etcd, free_port};
    use punchclock_tests::{wait_leader, wait_run};
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "traces_failover");
    let (collector, port) = Collector::start().await;
    let endpoint = format!("http://127.0.0.1:{port}");
    let etcd = Etcd::start(1).await;
    let ports = [free_port(), free_port()];
    let start =
        |i: usize| Proc::server_with(&etcd.store_url(), &format!("cp{i}"), ports[i], dir.path(), &[], &["--otlp-endpoint", &endpoint]);
    let mut servers = [start(0), start(1)];
    let addrs: Vec<String> = servers.iter().map(|s| s.addr.clone()).collect();
    let _runner = Proc::start(
        &[
            "runner",
            "--control-plane",
            &addrs.join(","),
            "--agents",
            "tests/agents.yaml",
            "--runner-id",
            "r1",
            "--work-dir",
            &dir.path().join("work-r1").to_string_lossy(),
            "--otlp-endpoint",
            &endpoint,
        ],
        &dir.path().join("r1.log"),
        false,
    );
    let first = wait_leader(&addrs, Duration::from_secs(20), |_| true).await;
    apply(&first.leader_address, json!({"task_id": "long", "agent_id": "slow_agent"})).await;
    cli(&first.leader_address, &["task", "trigger", "long"]);
    let running = wait_run(&first.leader_address, "long", Duration::from_secs(20), |r| status(r) == pb::RunStatus::Running).await;
    let leader = addrs.iter().position(|a| *a == first.leader_address).expect("ours");
    servers[leader].kill9();
    let other = addrs[1 - leader].clone();
    wait_leader(std::slice::from_ref(&other), Duration::from_secs(20), |s| s.leader_id != first.leader_id).await;
    let done =
        wait_run(&other, "long", Duration::from_secs(60), |r| r.run_id == running.run_id && status(r) == pb::RunStatus::Succeeded).await;
    assert_eq!(done.trace_id, running.trace_id, "the stored trace id did not change");
    let spans = collector
        .wait(&done.trace_id, Duration::from_secs(30), |s| {
            s.iter().any(|(_, x)| x.name == "run long") && s.iter().any(|(_, x)| x.name.starts_with("invoke_agent"))
        })
        .await;
    let names: Vec<&str> = spans.iter().map(|(_, s)| s.name.as_str()).collect();
    assert_eq!(names.iter().filter(|n| **n == "run long").count(), 1, "{names:?}");
    assert!(names.iter().any(|n| n.starts_with("attempt ")), "{names:?}");
    assert!(names.contains(&"invoke_agent slow_agent"), "{names:?}");
    // No span of this run in any other trace.
    let all = collector.spans.lock().expect("spans").clone();
    let elsewhere: Vec<&Span> = all
        .iter()
        .map(|(_, s)| s)
        .filter(|s| text(s, "punchclock.run_id").as_deref() == Some(done.run_id.as_str()) && hex::encode(&s.trace_id) != done.trace_id)
        .collect();
    assert!(elsewhere.is_empty(), "spans of the run in another trace: {elsewhere:?}");
}
