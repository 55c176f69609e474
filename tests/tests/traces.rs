//! Issue 9, acceptance 1: one OpenTelemetry trace per run. A test OTLP
//! receiver (the real OTLP/gRPC `TraceService` from `opentelemetry-proto`)
//! gets, for a run that fails once and then succeeds: the control plane's
//! run span, two attempt spans under it, the runner's two `invoke_agent`
//! spans (GenAI attributes, one under each attempt), and the spans the
//! example agent (`examples/agents/brief.py`) sent itself, under its
//! `TRACEPARENT`, to the same receiver (OTLP/HTTP JSON); the usage the
//! agent reported is on its `invoke_agent` span and summed on the run's.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::common::v1::{AnyValue as AnyValueMsg, KeyValue};
use opentelemetry_proto::tonic::trace::v1::{Span, Status};
use punchclock_proto::v1 as pb;
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
    /// One receiver on one port for both OTLP transports: OTLP/gRPC
    /// (`TraceService`, what the control plane and runner export) and
    /// OTLP/HTTP JSON on `POST /v1/traces` (what the example agent sends).
    async fn start() -> (Collector, u16) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let c = Collector::default();
        let http = {
            let c = c.clone();
            axum::routing::post(move |body: axum::body::Bytes| {
                let c = c.clone();
                async move {
                    let doc: Value = serde_json::from_slice(&body).expect("OTLP/HTTP JSON body");
                    c.add_json(&doc);
                    axum::Json(json!({}))
                }
            })
        };
        let routes = tonic::service::Routes::new(TraceServiceServer::new(c.clone())).into_axum_router().route("/v1/traces", http);
        tokio::spawn(async move {
            let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
            let _ = tonic::transport::Server::builder()
                .accept_http1(true)
                .add_routes(tonic::service::Routes::from(routes))
                .serve_with_incoming(incoming)
                .await;
        });
        (c, port)
    }

    /// Spans from an OTLP/HTTP JSON export request (ids in hex, per the
    /// OTLP JSON mapping).
    fn add_json(&self, doc: &Value) {
        let empty = Vec::new();
        for rs in doc["resourceSpans"].as_array().unwrap_or(&empty) {
            let service = rs["resource"]["attributes"]
                .as_array()
                .unwrap_or(&empty)
                .iter()
                .find(|kv| kv["key"] == "service.name")
                .and_then(|kv| kv["value"]["stringValue"].as_str())
                .unwrap_or_default()
                .to_string();
            for ss in rs["scopeSpans"].as_array().unwrap_or(&empty) {
                for s in ss["spans"].as_array().unwrap_or(&empty) {
                    let id = |k: &str| hex::decode(s[k].as_str().unwrap_or_default()).expect("hex id");
                    let attributes = s["attributes"]
                        .as_array()
                        .unwrap_or(&empty)
                        .iter()
                        .map(|kv| KeyValue {
                            key: kv["key"].as_str().unwrap_or_default().to_string(),
                            value: Some(AnyValueMsg {
                                value: if let Some(v) = kv["value"]["stringValue"].as_str() {
                                    Some(AnyValue::StringValue(v.to_string()))
                                } else {
                                    kv["value"]["intValue"].as_str().and_then(|v| v.parse().ok()).map(AnyValue::IntValue)
                                },
                            }),
                        })
                        .collect();
                    let span = Span {
                        trace_id: id("traceId"),
                        span_id: id("spanId"),
                        parent_span_id: id("parentSpanId"),
                        name: s["name"].as_str().unwrap_or_default().to_string(),
                        attributes,
                        status: s["status"]["code"].as_i64().map(|code| Status { code: code as i32, ..Default::default() }),
                        ..Default::default()
                    };
                    self.spans.lock().expect("spans").push((service.clone(), span));
                }
            }
        }
        self.arrived.notify_waiters();
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

/// One etcd, two control-plane replicas and a runner, all exporting
/// traces to `endpoint`.
struct TracedCluster {
    _etcd: punchclock_tests::etcd::Etcd,
    servers: [Proc; 2],
    addrs: Vec<String>,
    _runner: Proc,
}

impl TracedCluster {
    async fn start(dir: &std::path::Path, endpoint: &str) -> TracedCluster {
        use punchclock_tests::etcd::{Etcd, free_port};
        let etcd = Etcd::start(1).await;
        let ports = [free_port(), free_port()];
        let start = |i: usize| Proc::server_with(&etcd.store_url(), &format!("cp{i}"), ports[i], dir, &[], &["--otlp-endpoint", endpoint]);
        let servers = [start(0), start(1)];
        let addrs: Vec<String> = servers.iter().map(|s| s.addr.clone()).collect();
        let work = dir.join("work-r1").to_string_lossy().into_owned();
        let args = [
            "runner",
            "--control-plane",
            &addrs.join(","),
            "--agents",
            "tests/agents.yaml",
            "--runner-id",
            "r1",
            "--work-dir",
            &work,
            "--otlp-endpoint",
            endpoint,
        ];
        let runner = Proc::start(&args, &dir.join("r1.log"), false);
        TracedCluster { _etcd: etcd, servers, addrs, _runner: runner }
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
    let endpoint = format!("http://127.0.0.1:{port}");
    // The example agent, told (in its env, as a user would in agents.yaml)
    // to send its spans as OTLP/HTTP JSON to the same receiver.
    let agents = dir.path().join("agents.yaml");
    std::fs::write(
        &agents,
        format!(
            "agents:\n  brief_agent:\n    type: process\n    command: [\"python3\", \"examples/agents/brief.py\"]\n    working_dir: \".\"\n    env:\n      OTEL_EXPORTER_OTLP_TRACES_ENDPOINT: \"{endpoint}/v1/traces\"\n      OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: \"http/json\"\n"
        ),
    )
    .expect("agents file");
    let dev = Proc::dev_agents(&dir.path().join("data"), 8, &dir.path().join("dev.log"), &agents, &["--otlp-endpoint", &endpoint]);
    apply(
        &dev.addr,
        json!({"task_id": "traced", "agent_id": "brief_agent",
               "execution": {"max_retries": 1, "retry_backoff": {"base_seconds": 0.2, "cap_seconds": 0.2, "jitter_seconds": 0}},
               "context": {"params": {"topic": "chips", "fail_attempts": 1}}}),
    )
    .await;
    cli(&dev.addr, &["task", "trigger", "traced"]);
    let run = wait_n_runs(&dev.addr, "traced", 1, Duration::from_secs(30), |r| status(r) == pb::RunStatus::Succeeded).await.remove(0);
    assert_eq!(run.attempts.len(), 2);
    let stored: Value = serde_json::from_str(&cli(&dev.addr, &["-o", "json", "runs", "get", &run.run_id])).expect("json");
    let trace = stored["trace_id"].as_str().expect("trace_id").to_string();
    let run_span = stored["span_id"].as_str().expect("span_id").to_string();
    assert_eq!(run.trace_id, trace);
    let usage = &stored["result"]["usage"];
    let input_tokens = usage["input_tokens"].as_i64().expect("the agent reported usage");
    let output_tokens = usage["output_tokens"].as_i64().expect("output_tokens");

    let spans = collector
        .wait(&trace, Duration::from_secs(30), |s| {
            s.iter().any(|(_, x)| x.name.starts_with("run ")) && s.iter().filter(|(svc, _)| svc == "brief-agent").count() >= 4
        })
        .await;
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
    assert_eq!(int(root, "gen_ai.usage.input_tokens"), Some(input_tokens));
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
        spans.iter().filter(|(_, s)| s.name == "invoke_agent brief_agent").map(|(_, s)| (s.parent_span_id.clone(), s.clone())).collect();
    assert_eq!(invokes.len(), 2, "{names:?}");
    for a in &attempts {
        let inv = invokes.get(&a.span_id).expect("an invoke_agent span under each attempt");
        assert_eq!(text(inv, "gen_ai.operation.name").as_deref(), Some("invoke_agent"));
        assert_eq!(text(inv, "gen_ai.agent.id").as_deref(), Some("brief_agent"));
        assert_eq!(text(inv, "punchclock.execution_id"), text(a, "punchclock.execution_id"));
    }
    let first = invokes.get(&attempts[0].span_id).expect("first");
    let second = invokes.get(&attempts[1].span_id).expect("second");
    assert_eq!(int(second, "gen_ai.usage.input_tokens"), Some(input_tokens));
    assert_eq!(int(second, "gen_ai.usage.output_tokens"), Some(output_tokens));
    assert_eq!(int(second, "process.exit.code"), Some(0));
    assert_eq!(int(first, "process.exit.code"), Some(75));
    // The agent's own spans, sent by the agent under its TRACEPARENT: in
    // each attempt a "chat offline" span under that attempt's invoke_agent
    // (the first marked as an error), with the usage it reported.
    let agent_chats: Vec<&Span> =
        spans.iter().filter(|(svc, s)| svc == "brief-agent" && s.name == "chat offline").map(|(_, s)| s).collect();
    assert_eq!(agent_chats.len(), 2, "{names:?}");
    let under = |inv: &Span| agent_chats.iter().find(|s| s.parent_span_id == inv.span_id).copied();
    let failed = under(first).expect("the first attempt's agent span is under its invoke_agent");
    assert_eq!(failed.status.as_ref().map(|s| s.code), Some(2), "the failed call is marked as an error");
    let ok = under(second).expect("the agent's span is under the second invoke_agent");
    assert_eq!(text(ok, "gen_ai.operation.name").as_deref(), Some("chat"));
    assert_eq!(int(ok, "gen_ai.usage.input_tokens"), Some(input_tokens));
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
    use punchclock_tests::{wait_leader, wait_run};
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "traces_failover");
    let (collector, port) = Collector::start().await;
    let endpoint = format!("http://127.0.0.1:{port}");
    let TracedCluster { _etcd, mut servers, addrs, _runner } = TracedCluster::start(dir.path(), &endpoint).await;
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

/// Issue 19: the spans of runs a leader finished in its last seconds
/// before kill -9 were lost with its batch exporter's queue. The new
/// leader emits them again (same ids): every run that succeeded has its
/// run span, and the outcome reads the same on the runner's span as on the
/// control plane's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_of_runs_finished_just_before_a_kill_are_not_lost() {
    use punchclock_tests::{list_runs, wait_leader};
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "traces_reemit");
    let (collector, port) = Collector::start().await;
    let endpoint = format!("http://127.0.0.1:{port}");
    let TracedCluster { _etcd, mut servers, addrs, _runner } = TracedCluster::start(dir.path(), &endpoint).await;
    let first = wait_leader(&addrs, Duration::from_secs(20), |_| true).await;
    apply(&first.leader_address, json!({"task_id": "quick", "agent_id": "fail_agent", "execution": {"concurrency_limit": 10}})).await;
    for i in 0..6 {
        cli(&first.leader_address, &["task", "trigger", "quick", "--key", &format!("k{i}")]);
    }
    wait_n_runs(&first.leader_address, "quick", 6, Duration::from_secs(30), |r| status(r) == pb::RunStatus::Failed).await;
    // At once, before the 5 s batch export: the leader dies with its queue.
    let leader = addrs.iter().position(|a| *a == first.leader_address).expect("ours");
    servers[leader].kill9();
    let other = addrs[1 - leader].clone();
    wait_leader(std::slice::from_ref(&other), Duration::from_secs(20), |s| s.leader_id != first.leader_id).await;
    for run in list_runs(&other, "quick").await {
        let spans = collector
            .wait(&run.trace_id, Duration::from_secs(30), |s| {
                s.iter().any(|(_, x)| x.name == "run quick") && s.iter().any(|(_, x)| x.name.starts_with("attempt "))
            })
            .await;
        assert!(
            spans.iter().any(|(_, x)| x.name == "run quick"),
            "run {} has its run span: {:?}",
            run.run_id,
            spans.iter().map(|(_, s)| &s.name).collect::<Vec<_>>()
        );
        let outcomes: std::collections::BTreeSet<String> = spans.iter().filter_map(|(_, s)| text(s, "punchclock.outcome")).collect();
        assert_eq!(outcomes, ["failed".to_string()].into(), "one vocabulary for the outcome across spans");
    }
}

/// The OpenTelemetry environment carrier beyond `TRACEPARENT`: a
/// `TriggerTask` caller's `tracestate` and `baggage` reach the agent as
/// `TRACESTATE` and `BAGGAGE` (and bad ones are refused, naming the field).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_callers_tracestate_and_baggage_reach_the_agent() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "traces_carrier");
    let agents = dir.path().join("agents.yaml");
    std::fs::write(
        &agents,
        "agents:\n  env_agent:\n    type: process\n    command: [\"sh\", \"-c\", \"printf '{\\\"tp\\\":\\\"%s\\\",\\\"ts\\\":\\\"%s\\\",\\\"bg\\\":\\\"%s\\\"}' \\\"$TRACEPARENT\\\" \\\"$TRACESTATE\\\" \\\"$BAGGAGE\\\" > \\\"$PUNCHCLOCK_RESULT_FILE\\\"\"]\n",
    )
    .expect("agents file");
    let dev = Proc::dev_agents(&dir.path().join("data"), 2, &dir.path().join("dev.log"), &agents, &[]);
    apply(&dev.addr, json!({"task_id": "carrier", "agent_id": "env_agent"})).await;
    let caller = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    cli(
        &dev.addr,
        &["task", "trigger", "carrier", "--traceparent", caller, "--tracestate", "vendor=abc,other=1", "--baggage", "user=alice"],
    );
    let run = wait_n_runs(&dev.addr, "carrier", 1, Duration::from_secs(30), |r| status(r) == pb::RunStatus::Succeeded).await.remove(0);
    let result: Value = serde_json::from_str(&run.result_json).expect("result");
    assert_eq!(result["ts"], "vendor=abc,other=1");
    assert_eq!(result["bg"], "user=alice");
    assert!(result["tp"].as_str().expect("tp").contains("4bf92f3577b34da6a3ce929d0e0e4736"), "{result}");
    // A value with a control character is refused before any run exists.
    let out = punchclock_tests::cli_fails(&dev.addr, &["task", "trigger", "carrier", "--baggage", "a=1\u{7}"]);
    assert!(out.contains("baggage") && out.contains("printable ASCII"), "{out}");
    assert_eq!(punchclock_tests::list_runs(&dev.addr, "carrier").await.len(), 1);
}
