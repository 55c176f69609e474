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
//!   lost and retried on another runner, like a process agent's;
//! - issue 34, point 16: a second result callback of a finished execution
//!   is answered `409` as the README says (it was `404`, as for an
//!   execution the runner never had, which still answers `404`);
//! - issue 34, point 15: a 429 holds back the shared resource its agent's
//!   `rate_limit_resource` names, or its `Punchclock-Resource` header
//!   (which wins): another task on it waits, "held back", until the
//!   429's `Retry-After` (a plain 429 could name no resource before, so
//!   nothing was held back and the other task ran into the limit).

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
    /// The callback URL and token of each asynchronous scenario's last
    /// request.
    callbacks: HashMap<String, (String, String)>,
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
        "limited" | "limited_file" | "limited_header" => {
            let n = s.lock().unwrap().requests[&scenario].len();
            if n == 1 && scenario == "limited_header" {
                // Names the resource itself; the agents file says `search`.
                (StatusCode::TOO_MANY_REQUESTS, [("retry-after", "2"), ("punchclock-resource", "llm")], "slow down").into_response()
            } else if n == 1 {
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
            s.lock().unwrap().callbacks.insert(scenario.clone(), (url.clone(), token.clone()));
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
    // Once it is over: a second result is a conflict (the README's 409),
    // not an unknown execution; another token is still 401, a progress
    // report 404 (over), and an execution never here 404.
    let (url, token) = seen.lock().unwrap().callbacks["async"].clone();
    let c = reqwest::Client::new();
    let post = |path: String, bearer: String| {
        let c = c.clone();
        async move {
            c.post(path)
                .header("authorization", format!("Bearer {bearer}"))
                .body(r#"{"answer": 43}"#)
                .send()
                .await
                .expect("callback")
                .status()
                .as_u16()
        }
    };
    assert_eq!(post(format!("{url}/result"), token.clone()).await, 409, "a second result");
    assert_eq!(post(format!("{url}/result"), "nope".into()).await, 401, "another token");
    assert_eq!(post(format!("{url}/progress"), token.clone()).await, 404, "progress of an execution that is over");
    let never = url.rsplit_once('/').map(|(b, _)| format!("{b}/never-here/result")).expect("url");
    assert_eq!(post(never, token.clone()).await, 404, "an execution never on this runner");
    let again = wait_run(&dev.addr, "async", Duration::from_secs(5), terminal).await;
    assert_eq!(serde_json::from_str::<Value>(&again.result_json).expect("result"), json!({"answer": 42}), "the first result stands");
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

fn resource(addr: &str, name: &str) -> Value {
    let all: Value = serde_json::from_str(&punchclock_tests::cli(addr, &["resources", "list", "-o", "json"])).expect("json");
    all.as_array().and_then(|a| a.iter().find(|r| r["name"] == name).cloned()).unwrap_or_else(|| panic!("no resource {name}: {all:#}"))
}

/// Issue 34, point 15: a 429 from an HTTP agent held nothing back (only a
/// 200 with an outcome body could name a resource), so every other task
/// calling the same provider ran into its limit too. Now the agents
/// file's `rate_limit_resource`, or the answer's `Punchclock-Resource`
/// header (which wins over the file), names the resource, and the control
/// plane holds it back until the 429's `Retry-After`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_holds_back_the_resource_its_agent_names() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "http_agents_429_resource");
    let (base, _seen) = agent_server().await;
    let agents = dir.path().join("agents.yaml");
    std::fs::write(
        &agents,
        format!(
            "agents:
  http_ok: {{type: http, url: {base}/agent/ok}}
  http_limited_file: {{type: http, url: {base}/agent/limited_file, rate_limit_resource: llm}}
  http_limited_header: {{type: http, url: {base}/agent/limited_header, rate_limit_resource: search}}
"
        ),
    )
    .expect("agents file");
    let cfg = dir.path().join("config.yaml");
    std::fs::write(&cfg, "resources:\n  llm: {concurrency: 4}\n  search: {concurrency: 4}\n").expect("config");
    let dev = Proc::dev_agents(&dir.path().join("data"), 8, &dir.path().join("dev.log"), &agents, &["--config", &cfg.to_string_lossy()]);
    apply(&dev.addr, task("file_named", "http_limited_file", json!({"resources": ["llm"], "max_retries": 0}))).await;
    apply(&dev.addr, task("waiter", "http_ok", json!({"resources": ["llm"], "max_retries": 0}))).await;
    apply(&dev.addr, task("header_named", "http_limited_header", json!({"resources": ["llm", "search"], "max_retries": 0}))).await;
    let limited = |r: &pb::Run| r.attempts.first().is_some_and(|a| a.outcome == "rate_limited");

    // (a) The agents file names the resource: the 429 holds llm back.
    punchclock_tests::cli(&dev.addr, &["task", "trigger", "file_named", "--key", "k1"]);
    let first = wait_run(&dev.addr, "file_named", Duration::from_secs(30), limited).await;
    assert_eq!(first.attempts[0].resource, "llm", "{first:#?}");
    let retry_at = at(&first.attempts[0].retry_at).expect("retry_at");
    let held = resource(&dev.addr, "llm");
    assert!(held["held_until"].is_string(), "llm is held back: {held:#}");
    // Another task on llm waits for the hold, and says so.
    let waiter_id = punchclock_tests::tasks(&dev.addr)
        .await
        .trigger_task(pb::TriggerTaskRequest { task_id: "waiter".into(), ..Default::default() })
        .await
        .expect("trigger")
        .into_inner()
        .run_id;
    let mut rc = punchclock_tests::runs(&dev.addr).await;
    let mut reason = String::new();
    for _ in 0..200 {
        let r = rc.get_run(pb::GetRunRequest { run_id: waiter_id.clone() }).await.expect("get").into_inner();
        if r.pending_reason.contains("held back") || r.actual_started_at.is_some() {
            reason = r.pending_reason;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(reason.contains("resource llm held back until"), "the waiting run says why: {reason:?}");
    let waiter = wait_run(&dev.addr, "waiter", Duration::from_secs(30), terminal).await;
    assert_eq!(status(&waiter), pb::RunStatus::Succeeded, "{waiter:#?}");
    let lag = (at(&waiter.actual_started_at).expect("started") - retry_at).num_milliseconds();
    assert!((0..1000).contains(&lag), "the waiting run started {lag} ms after the hold's end");
    let done = wait_run(&dev.addr, "file_named", Duration::from_secs(30), terminal).await;
    assert_eq!((status(&done), done.attempts.len()), (pb::RunStatus::Succeeded, 2), "{done:#?}");

    // (b) The answer's header names it, over the file's `search`.
    punchclock_tests::cli(&dev.addr, &["task", "trigger", "header_named", "--key", "k1"]);
    let first = wait_run(&dev.addr, "header_named", Duration::from_secs(30), limited).await;
    assert_eq!(first.attempts[0].resource, "llm", "the header wins over the file: {first:#?}");
    let llm = resource(&dev.addr, "llm");
    assert!(llm["held_until"].is_string() && llm["held_until"] != held["held_until"], "llm is held back again: {llm:#}");
    let search = resource(&dev.addr, "search");
    assert!(search["held_until"].is_null(), "search is not held back: {search:#}");
    let done = wait_run(&dev.addr, "header_named", Duration::from_secs(30), terminal).await;
    assert_eq!((status(&done), done.attempts.len()), (pb::RunStatus::Succeeded, 2), "{done:#?}");
}
