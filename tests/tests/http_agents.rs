//! Issue 22, agents served over HTTP (`type: http` in the agents file),
//! against a real HTTP server in this test process (axum on a free port)
//! and a real `punchclock dev` (or `server` + `runner`):
//!
//! - 200 with a JSON body: SUCCEEDED, the body is the result; the request
//!   carries the context as its body, `Idempotency-Key` (the attempt's
//!   execution id), `traceparent`, and a `Punchclock-Signature` the server
//!   verifies with the shared secret;
//! - 429 with `Retry-After: 2`: retried no earlier than 2 s later, without
//!   spending `max_retries` (0); 503 retried (a counted attempt); 400 not
//!   retried although retries are left;
//! - a request past `timeout_seconds` is aborted (the server sees its
//!   connection dropped) and the attempt ends TIMEOUT;
//! - `202`: the agent reports progress and its result through the
//!   runner's callback, and the run SUCCEEDS with that result; one that
//!   never calls back ends TIMEOUT and its `cancel_url` is called;
//! - a runner killed (SIGKILL) during an asynchronous run: its attempt is
//!   lost and retried on another runner, like a process agent's.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use punchclock_proto::v1 as pb;
use punchclock_tests::etcd::free_port;
use punchclock_tests::{KeepLogsOnPanic, Proc, apply, at, status, terminal, wait_run};
use serde_json::{Value, json};

/// What the agent server saw.
#[derive(Default)]
struct Seen {
    /// Requests by scenario: (headers, body, when).
    requests: HashMap<String, Vec<(HeaderMap, Value, Instant)>>,
    /// Requests whose connection was dropped before they were answered.
    aborted: Vec<String>,
    /// cancel_url calls.
    cancels: Vec<Value>,
    /// 503s answered so far.
    unavailable: u32,
}

type S = Arc<Mutex<Seen>>;

const SECRET: &str = "agent-signing-secret";

/// Records `Drop` of a request that was never answered.
struct AbortGuard(S, String, bool);

impl Drop for AbortGuard {
    fn drop(&mut self) {
        if !self.2 {
            self.0.lock().unwrap().aborted.push(self.1.clone());
        }
    }
}

async fn agent(State(s): State<S>, Path(scenario): Path<String>, headers: HeaderMap, body: axum::body::Bytes) -> axum::response::Response {
    let ctx: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    s.lock().unwrap().requests.entry(scenario.clone()).or_default().push((headers.clone(), ctx.clone(), Instant::now()));
    match scenario.as_str() {
        "ok" => {
            // The signature, verified as a receiver would.
            let sig = headers.get("punchclock-signature").and_then(|v| v.to_str().ok()).unwrap_or_default().to_string();
            let t: i64 = sig.split(',').find_map(|p| p.strip_prefix("t=")).and_then(|t| t.parse().ok()).unwrap_or(0);
            let good = punchclock_proto::signature::sign(SECRET, t, &body) == sig;
            Json(json!({"summary": "done", "run_id": ctx["run_id"], "signature_ok": good})).into_response()
        }
        "limited" => {
            let n = s.lock().unwrap().requests["limited"].len();
            if n == 1 {
                (StatusCode::TOO_MANY_REQUESTS, [("retry-after", "2")], "slow down").into_response()
            } else {
                Json(json!({"after": n})).into_response()
            }
        }
        "flaky" => {
            let mut g = s.lock().unwrap();
            g.unavailable += 1;
            if g.unavailable == 1 {
                (StatusCode::SERVICE_UNAVAILABLE, "busy").into_response()
            } else {
                Json(json!({"ok": true})).into_response()
            }
        }
        "bad" => (StatusCode::BAD_REQUEST, "your input is wrong").into_response(),
        "slow" => {
            let mut guard = AbortGuard(s.clone(), "slow".into(), false);
            tokio::time::sleep(Duration::from_secs(30)).await;
            guard.2 = true;
            Json(json!({"late": true})).into_response()
        }
        "async" | "silent" => {
            let url = headers.get("punchclock-callback-url").and_then(|v| v.to_str().ok()).unwrap_or_default().to_string();
            let token = headers.get("punchclock-callback-token").and_then(|v| v.to_str().ok()).unwrap_or_default().to_string();
            if scenario == "async" && !url.is_empty() {
                tokio::spawn(async move {
                    let c = reqwest::Client::new();
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    let bearer = format!("Bearer {token}");
                    let p = c
                        .post(format!("{url}/progress"))
                        .header("authorization", &bearer)
                        .body(r#"{"percent": 50, "message": "half way"}"#)
                        .send()
                        .await;
                    assert_eq!(p.map(|r| r.status().as_u16()).unwrap_or(0), 204);
                    let bad = c.post(format!("{url}/result")).header("authorization", "Bearer nope").body("{}").send().await;
                    assert_eq!(bad.map(|r| r.status().as_u16()).unwrap_or(0), 401);
                    tokio::time::sleep(Duration::from_millis(700)).await;
                    let r = c.post(format!("{url}/result")).header("authorization", &bearer).body(r#"{"answer": 42}"#).send().await;
                    assert_eq!(r.map(|r| r.status().as_u16()).unwrap_or(0), 204);
                });
            }
            (StatusCode::ACCEPTED, "accepted").into_response()
        }
        "long" => {
            // Asynchronous, and slow to report: the runner dies meanwhile.
            let n = s.lock().unwrap().requests["long"].len();
            if n == 1 { (StatusCode::ACCEPTED, "working").into_response() } else { Json(json!({"attempt": n})).into_response() }
        }
        _ => StatusCode::NOT_FOUND.into_response(),
    }
}

use axum::Json;

async fn cancel(State(s): State<S>, body: axum::body::Bytes) -> StatusCode {
    s.lock().unwrap().cancels.push(serde_json::from_slice(&body).unwrap_or(Value::Null));
    StatusCode::NO_CONTENT
}

/// The agent server on a free port: its base URL and what it saw.
async fn agent_server() -> (String, S) {
    // The agent's own HTTP client (its callbacks) needs a TLS provider.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let seen: S = Arc::default();
    let app = axum::Router::new().route("/agent/{scenario}", post(agent)).route("/cancel", post(cancel)).with_state(seen.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(async move { axum::serve(listener, app).await.expect("serve") });
    (base, seen)
}

fn agents_file(dir: &std::path::Path, base: &str) -> std::path::PathBuf {
    let secret = dir.join("agent.secret");
    std::fs::write(&secret, format!("{SECRET}\n")).expect("secret");
    let mut yaml = String::from("agents:\n");
    for s in ["ok", "limited", "flaky", "bad", "slow", "async", "silent", "long"] {
        yaml.push_str(&format!(
            "  http_{s}:\n    type: http\n    url: {base}/agent/{s}\n    headers: {{X-Scenario: {s}}}\n    signing_secret_file: {}\n    cancel_url: {base}/cancel\n",
            secret.display()
        ));
        if s == "slow" {
            yaml.push_str("    timeout_seconds: 2\n");
        }
    }
    let path = dir.join("agents.yaml");
    std::fs::write(&path, yaml).expect("agents file");
    path
}

fn task(id: &str, agent: &str, execution: Value) -> Value {
    json!({"task_id": id, "agent_id": agent, "execution": execution})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_agents_answer_and_each_answer_decides() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "http_agents");
    let (base, seen) = agent_server().await;
    let agents = agents_file(dir.path(), &base);
    let dev = Proc::dev_agents(&dir.path().join("data"), 8, &dir.path().join("dev.log"), &agents, &[]);
    let fast = json!({"retry_backoff": {"base_seconds": 0.2, "cap_seconds": 1, "jitter_seconds": 0}});
    apply(&dev.addr, task("ok", "http_ok", json!({}))).await;
    apply(&dev.addr, task("limited", "http_limited", json!({"max_retries": 0}))).await;
    let mut flaky = fast.clone();
    flaky["max_retries"] = 1.into();
    apply(&dev.addr, task("flaky", "http_flaky", flaky)).await;
    let mut bad = fast.clone();
    bad["max_retries"] = 3.into();
    apply(&dev.addr, task("bad", "http_bad", bad)).await;
    apply(&dev.addr, task("slow", "http_slow", json!({}))).await;
    apply(&dev.addr, task("async", "http_async", json!({"timeout_seconds": 60}))).await;
    apply(&dev.addr, task("silent", "http_silent", json!({"timeout_seconds": 3}))).await;
    for t in ["ok", "limited", "flaky", "bad", "slow", "async", "silent"] {
        punchclock_tests::cli(&dev.addr, &["task", "trigger", t, "--key", "k1"]);
    }
    let done = |t: &'static str| wait_run(&dev.addr, t, Duration::from_secs(60), terminal);

    // 200: the body is the result; the request was signed and keyed.
    let ok = done("ok").await;
    assert_eq!(status(&ok), pb::RunStatus::Succeeded, "{ok:#?}");
    let result: Value = serde_json::from_str(&ok.result_json).expect("result");
    assert_eq!((result["summary"].as_str(), result["signature_ok"].as_bool()), (Some("done"), Some(true)), "{result}");
    assert_eq!(result["run_id"], ok.run_id.as_str(), "the body is the run's context");
    {
        let g = seen.lock().unwrap();
        let (h, _, _) = &g.requests["ok"][0];
        assert_eq!(h.get("idempotency-key").and_then(|v| v.to_str().ok()), Some(ok.attempts[0].execution_id.as_str()));
        assert!(h.get("traceparent").is_some_and(|v| v.to_str().is_ok_and(|t| t.starts_with("00-"))), "{h:?}");
        assert_eq!(h.get("x-scenario").and_then(|v| v.to_str().ok()), Some("ok"));
    }

    // 429 Retry-After 2: retried at that time, not counted.
    let limited = done("limited").await;
    assert_eq!(status(&limited), pb::RunStatus::Succeeded, "{limited:#?}");
    assert_eq!(limited.attempts.len(), 2);
    assert_eq!(limited.attempts[0].outcome, "rate_limited");
    let gap = at(&limited.attempts[1].dispatched_at).expect("second") - at(&limited.attempts[0].finished_at).expect("first");
    assert!(gap >= chrono::Duration::milliseconds(1900), "retried after {gap}");
    {
        let g = seen.lock().unwrap();
        let reqs = &g.requests["limited"];
        assert!(reqs[1].2 - reqs[0].2 >= Duration::from_millis(1900));
        let keys: Vec<&str> = reqs.iter().map(|(h, _, _)| h.get("idempotency-key").and_then(|v| v.to_str().ok()).unwrap_or("")).collect();
        assert_ne!(keys[0], keys[1], "each attempt has its own key");
    }

    // 503: retried (counted); 400: not retried although 3 retries are left.
    let flaky = done("flaky").await;
    assert_eq!((status(&flaky), flaky.attempts.len()), (pb::RunStatus::Succeeded, 2), "{flaky:#?}");
    assert_eq!(flaky.attempts[0].outcome, "failed");
    let bad = done("bad").await;
    assert_eq!((status(&bad), bad.attempts.len()), (pb::RunStatus::Failed, 1), "{bad:#?}");
    assert_eq!(bad.attempts[0].outcome, "non_retryable");
    assert!(bad.error.contains("HTTP 400"), "{}", bad.error);

    // A request past its timeout is aborted: TIMEOUT.
    let slow = done("slow").await;
    assert_eq!(status(&slow), pb::RunStatus::Timeout, "{slow:#?}");
    let aborted = async {
        loop {
            if seen.lock().unwrap().aborted.contains(&"slow".to_string()) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), aborted).await.expect("the server saw the request aborted");

    // 202 and a callback: progress, then the result.
    let asy = done("async").await;
    assert_eq!(status(&asy), pb::RunStatus::Succeeded, "{asy:#?}");
    assert_eq!(serde_json::from_str::<Value>(&asy.result_json).expect("result"), json!({"answer": 42}));
    assert_eq!(asy.progress.as_ref().map(|p| p.message.as_str()), Some("half way"));
    // 202 and silence: TIMEOUT, and cancel_url called.
    let silent = done("silent").await;
    assert_eq!(status(&silent), pb::RunStatus::Timeout, "{silent:#?}");
    let cancels = seen.lock().unwrap().cancels.clone();
    assert!(cancels.iter().any(|c| c["execution_id"] == silent.attempts[0].execution_id.as_str()), "{cancels:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_killed_during_an_asynchronous_run_loses_its_attempt() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "http_agents_lost");
    let (base, seen) = agent_server().await;
    let agents = agents_file(dir.path(), &base);
    let store = format!("embedded:{}", dir.path().join("store").display());
    let port = free_port();
    let server = Proc::server_with(&store, "cp0", port, dir.path(), &[], &[]);
    let runner = |id: &str| {
        let work = dir.path().join(format!("work-{id}")).to_string_lossy().into_owned();
        let log = dir.path().join(format!("{id}.log"));
        Proc::start(
            &[
                "runner",
                "--control-plane",
                &server.addr,
                "--agents",
                &agents.to_string_lossy(),
                "--runner-id",
                id,
                "--work-dir",
                &work,
                "--callback-listen",
                "127.0.0.1:0",
            ],
            &log,
            false,
        )
    };
    let mut r1 = runner("r1");
    apply(&server.addr, task("long", "http_long", json!({"max_retries": 1, "timeout_seconds": 600, "retry_backoff": {"base_seconds": 0.2, "cap_seconds": 1, "jitter_seconds": 0}}))).await;
    punchclock_tests::cli(&server.addr, &["task", "trigger", "long", "--key", "k"]);
    wait_run(&server.addr, "long", Duration::from_secs(30), |r| status(r) == pb::RunStatus::Running).await;
    // Accepted (202), waiting for a callback that r1 will never get.
    let accepted = async {
        while seen.lock().unwrap().requests.get("long").is_none_or(Vec::is_empty) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), accepted).await.expect("the agent got the request");
    r1.kill9();
    let _r2 = runner("r2");
    let run = wait_run(&server.addr, "long", Duration::from_secs(90), terminal).await;
    assert_eq!(status(&run), pb::RunStatus::Succeeded, "{run:#?}");
    assert_eq!(run.attempts[0].outcome, "lost", "{run:#?}");
    assert_eq!(run.attempts[1].runner_id, "r2");
    assert_eq!(serde_json::from_str::<Value>(&run.result_json).expect("result"), json!({"attempt": 2}));
}
