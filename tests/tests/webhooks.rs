//! Issue 21, webhook triggers, with real control planes, HTTP requests,
//! agent processes and (for the follower) etcd:
//!
//! - the same GitHub-signed delivery (GitHub's documented example: secret
//!   "It's a Secret to Everybody", body "Hello, World!") sent 5 times at
//!   once gets one run and four `deduplicated: true`, all naming that run;
//!   the agent gets the event (headers allowed through, never the
//!   signature's secret);
//! - a bad signature gets 401 and leaves no record; an unknown path 404; a
//!   10 MB body 413 before it is sent; a delivery without its dedup header
//!   400; a body over 16 KiB reaches the agent whole; one address that
//!   trickles bodies holds at most 8 turns to read one, another still gets
//!   in;
//! - a webhook posted to a follower (3 control planes on etcd) is
//!   forwarded to the leader and runs once; a retry of it through another
//!   follower is deduplicated;
//! - `POST /events/{topic}` (issue 34, finding 17: no test had it) makes one
//!   run per listening task per `Idempotency-Key`, 400 without a key or
//!   with a body that is not JSON; a replica that cannot admit (it leads,
//!   but its engine never starts) answers a webhook and an event `503` with
//!   `Retry-After`, and makes nothing.

use std::time::Duration;

use punchclock_proto::v1 as pb;
use punchclock_tests::etcd::{Etcd, free_port};
use punchclock_tests::{KeepLogsOnPanic, Proc, apply, http_post, list_runs, status, terminal, wait_leader, wait_run};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const GITHUB_SECRET: &str = "It's a Secret to Everybody";
const GITHUB_BODY: &str = "Hello, World!";
const GITHUB_SIGNATURE: &str = "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17";

fn github_task(id: &str, path: &str, secret_file: &str) -> Value {
    json!({"task_id": id, "agent_id": "event_agent",
           "trigger": {"type": "webhook", "path": path,
                       "auth": {"hmac": {"secret_file": secret_file, "header": "X-Hub-Signature-256", "prefix": "sha256="}},
                       "dedup": {"header": "X-GitHub-Delivery"}},
           "execution": {"overlap_policy": "queue", "concurrency_limit": 4}})
}

fn post_delivery(http: &str, path: &str, delivery: &str, signature: &str, body: &[u8]) -> (u16, Value) {
    let (code, text) = http_post(
        http,
        path,
        &[("X-Hub-Signature-256", signature), ("X-GitHub-Delivery", delivery), ("X-GitHub-Event", "ping"), ("Content-Type", "text/plain")],
        Some(body),
    );
    (code, serde_json::from_str(&text).unwrap_or(Value::Null))
}

/// A GitHub delivery from `from` (a loopback address) whose headers are
/// sent and whose body is not, yet.
async fn held(from: &str, http: &str, delivery: &str) -> tokio::net::TcpStream {
    let sock = tokio::net::TcpSocket::new_v4().expect("socket");
    sock.bind(format!("{from}:0").parse().expect("from")).expect("bind");
    let mut s = sock.connect(http.parse().expect("http address")).await.expect("connect");
    let head = format!(
        "POST /hooks/github HTTP/1.1\r\nHost: {http}\r\nX-Hub-Signature-256: {GITHUB_SIGNATURE}\r\nX-GitHub-Delivery: {delivery}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        GITHUB_BODY.len()
    );
    s.write_all(head.as_bytes()).await.expect("head");
    s
}

/// The whole answer on `s` (the server closes it).
async fn answer_of(s: &mut tokio::net::TcpStream) -> String {
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out).await;
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signed_delivery_runs_once_and_a_bad_one_leaves_no_record() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "webhooks");
    let secret = dir.path().join("gh.secret");
    std::fs::write(&secret, format!("{GITHUB_SECRET}\n")).expect("secret");
    let secret = secret.to_string_lossy().to_string();
    let dev = Proc::dev_with(&dir.path().join("data"), 4, &dir.path().join("dev.log"), &[]);
    let http = dev.http_addr();
    apply(&dev.addr, github_task("gh", "/hooks/github", &secret)).await;

    // The same delivery 5 times at once: one run.
    let delivery = "72d3162e-cc78-11e3-81ab-4c9367dc0958";
    let sends: Vec<_> = (0..5)
        .map(|_| {
            let http = http.clone();
            std::thread::spawn(move || post_delivery(&http, "/hooks/github", delivery, GITHUB_SIGNATURE, GITHUB_BODY.as_bytes()))
        })
        .collect();
    let answers: Vec<(u16, Value)> = sends.into_iter().map(|t| t.join().expect("sender")).collect();
    assert!(answers.iter().all(|(c, _)| *c == 202), "{answers:?}");
    let fresh: Vec<&Value> = answers.iter().map(|(_, a)| a).filter(|a| a["deduplicated"] == false).collect();
    assert_eq!(fresh.len(), 1, "exactly one delivery made the run: {answers:?}");
    let run_id = fresh[0]["run_id"].as_str().expect("run id").to_string();
    assert!(answers.iter().all(|(_, a)| a["run_id"] == run_id.as_str()), "{answers:?}");
    let run = wait_run(&dev.addr, "gh", Duration::from_secs(30), terminal).await;
    assert_eq!((status(&run), run.trigger_kind.as_str()), (pb::RunStatus::Succeeded, "webhook"), "{run:#?}");
    let result: Value = serde_json::from_str(&run.result_json).expect("result");
    let event = &result["event"];
    assert_eq!(event["body"], "SGVsbG8sIFdvcmxkIQ==", "not JSON: base64 ({event})");
    assert_eq!((event["body_encoding"].as_str(), event["key"].as_str()), (Some("base64"), Some(delivery)));
    assert_eq!(event["headers"]["x-github-event"], "ping");
    assert!(event["headers"].get("x-hub-signature-256").is_none(), "the signature is not given: {event}");
    // Again later: still the same run.
    let (code, again) = post_delivery(&http, "/hooks/github", delivery, GITHUB_SIGNATURE, GITHUB_BODY.as_bytes());
    assert_eq!((code, again["deduplicated"].as_bool(), again["run_id"].as_str()), (202, Some(true), Some(run_id.as_str())));

    // A bad signature: 401, no record.
    let forged = GITHUB_SIGNATURE.replace("757107", "757108");
    let (code, _) = post_delivery(&http, "/hooks/github", "other-delivery", &forged, GITHUB_BODY.as_bytes());
    assert_eq!(code, 401);
    let (code, _) = post_delivery(&http, "/hooks/github", "other-delivery", GITHUB_SIGNATURE, b"Hello, World?");
    assert_eq!(code, 401, "the body is signed");
    assert_eq!(list_runs(&dev.addr, "gh").await.len(), 1, "a refused request made a record");
    assert!(dev.log_text().contains("webhook request refused"), "refusals are logged");
    // Unknown path, missing dedup id, a 10 MB body.
    assert_eq!(post_delivery(&http, "/hooks/nobody", "d", GITHUB_SIGNATURE, GITHUB_BODY.as_bytes()).0, 404);
    let (code, text) = http_post(&http, "/hooks/github", &[("X-Hub-Signature-256", GITHUB_SIGNATURE)], Some(GITHUB_BODY.as_bytes()));
    assert_eq!(code, 400, "{text}");
    assert!(text.contains("X-GitHub-Delivery"), "{text}");
    let (code, _) = http_post(&http, "/hooks/github", &[("Content-Length", "10485760"), ("X-GitHub-Delivery", "big")], None);
    assert_eq!(code, 413);
    assert_eq!(list_runs(&dev.addr, "gh").await.len(), 1);

    // A JSON body over 16 KiB (stored beside its run) reaches the agent whole.
    let token = dir.path().join("token");
    std::fs::write(&token, "t0ken\n").expect("token");
    apply(
        &dev.addr,
        json!({"task_id": "big", "agent_id": "event_agent",
               "trigger": {"type": "webhook", "path": "/hooks/big", "auth": {"bearer": {"token_file": token.to_string_lossy()}}, "dedup": {"body_field": "data.id"}}}),
    )
    .await;
    let doc = json!({"data": {"id": 42, "blob": "x".repeat(100_000)}});
    let body = doc.to_string();
    let (code, a) =
        http_post(&http, "/hooks/big", &[("Authorization", "Bearer t0ken"), ("Content-Type", "application/json")], Some(body.as_bytes()));
    assert_eq!(code, 202, "{a}");
    let (code, _) = http_post(&http, "/hooks/big", &[("Authorization", "Bearer nope")], Some(body.as_bytes()));
    assert_eq!(code, 401);
    let run = wait_run(&dev.addr, "big", Duration::from_secs(30), terminal).await;
    assert_eq!(status(&run), pb::RunStatus::Succeeded, "{run:#?}");
    let result: Value = serde_json::from_str(&run.result_json).expect("result");
    assert_eq!(result["event"]["body"], doc, "the stored body reached the agent");
    assert_eq!(result["event"]["key"], "42");
    let ev: Value = serde_json::from_str(&run.event_json).expect("event json");
    assert_eq!((ev["body_stored"].as_bool(), ev["body_bytes"].as_u64()), (Some(true), Some(body.len() as u64)));

    // Found by an attack: one client trickling bodies held every turn to
    // read one (64), so nobody else's webhook got through. Now one address
    // holds at most 8: its 9th waits for nothing (503), another address
    // still gets in.
    let mut slow = Vec::new();
    for i in 0..9 {
        slow.push(held("127.0.0.1", &http, &format!("slow-{i}")).await);
    }
    let first = futures::future::select_all(slow.iter_mut().map(|s| Box::pin(answer_of(s))));
    let (refused, which, _) = tokio::time::timeout(Duration::from_secs(10), first).await.expect("one of 9 slow requests answered at once");
    assert!(refused.starts_with("HTTP/1.1 503"), "{refused}");
    slow.remove(which);
    let mut other = held("127.0.0.2", &http, "from-another-address").await;
    other.write_all(GITHUB_BODY.as_bytes()).await.expect("body");
    let got = tokio::time::timeout(Duration::from_secs(10), answer_of(&mut other)).await.expect("another address is read");
    assert!(got.starts_with("HTTP/1.1 202"), "{got}");
    for mut s in slow {
        s.write_all(GITHUB_BODY.as_bytes()).await.expect("body");
        let got = answer_of(&mut s).await;
        assert!(got.starts_with("HTTP/1.1 202"), "a held request completes: {got}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webhook_posted_to_a_follower_runs_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "webhooks_follower");
    let secret = dir.path().join("gh.secret");
    std::fs::write(&secret, GITHUB_SECRET).expect("secret");
    let etcd = Etcd::start(1).await;
    let ports = [free_port(), free_port(), free_port()];
    let servers: Vec<Proc> = (0..3)
        .map(|i| Proc::server_with(&etcd.store_url(), &format!("cp{i}"), ports[i], dir.path(), &[], &["--http-listen", "127.0.0.1:0"]))
        .collect();
    let addrs: Vec<String> = servers.iter().map(|s| s.addr.clone()).collect();
    let _r1 = Proc::runner(&addrs.join(","), "r1", dir.path());
    let leader = wait_leader(&addrs, Duration::from_secs(30), |_| true).await;
    apply(&leader.leader_address, github_task("gh", "/hooks/github", &secret.to_string_lossy())).await;
    let followers: Vec<&Proc> = servers.iter().filter(|s| s.addr != leader.leader_address).collect();
    assert_eq!(followers.len(), 2);
    let delivery = "f0110w3r-delivery";
    let (code, a) = post_delivery(&followers[0].http_addr(), "/hooks/github", delivery, GITHUB_SIGNATURE, GITHUB_BODY.as_bytes());
    assert_eq!((code, a["deduplicated"].as_bool()), (202, Some(false)), "{a}");
    let (code, b) = post_delivery(&followers[1].http_addr(), "/hooks/github", delivery, GITHUB_SIGNATURE, GITHUB_BODY.as_bytes());
    assert_eq!((code, b["deduplicated"].as_bool(), &b["run_id"]), (202, Some(true), &a["run_id"]), "{b}");
    let (code, _) = post_delivery(&followers[1].http_addr(), "/hooks/github", "x", "sha256=00", GITHUB_BODY.as_bytes());
    assert_eq!(code, 401, "the leader refuses a forwarded forgery");
    let run = wait_run(&leader.leader_address, "gh", Duration::from_secs(30), terminal).await;
    assert_eq!(status(&run), pb::RunStatus::Succeeded, "{run:#?}");
    let result: Value = serde_json::from_str(&run.result_json).expect("result");
    assert_eq!(result["event"]["attributes"]["forwarded_for"], "127.0.0.1", "the original sender, as the follower saw it");
    assert_eq!(result["event"]["attributes"]["peer"], "127.0.0.1", "the connection's own address");
    assert_eq!(list_runs(&leader.leader_address, "gh").await.len(), 1);
    // A path is one task's.
    let mut t = punchclock_tests::tasks(&leader.leader_address).await;
    let spec = github_task("gh2", "/hooks/github", &secret.to_string_lossy());
    let err = t.apply_task(pb::ApplyTaskRequest { spec_json: spec.to_string(), dry_run: false, task: None }).await.expect_err("taken path");
    assert!(err.message().contains("trigger.path") && err.message().contains("\"gh\""), "{}", err.message());
}

/// `POST /events/{topic}` on the HTTP port, with its key; status and body.
fn post_event(http: &str, topic: &str, key: Option<&str>, body: &[u8]) -> (u16, Value) {
    let mut headers = vec![("Content-Type", "application/json")];
    if let Some(k) = key {
        headers.push(("Idempotency-Key", k));
    }
    let (code, text) = http_post(http, &format!("/events/{topic}"), &headers, Some(body));
    (code, serde_json::from_str(&text).unwrap_or(Value::String(text)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_over_http_run_once_per_key_and_a_replica_that_cannot_admit_answers_503() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "webhooks_events_http");
    let dev = Proc::dev_with(&dir.path().join("data"), 4, &dir.path().join("dev.log"), &[]);
    let http = dev.http_addr();
    apply(
        &dev.addr,
        json!({"task_id": "on_topic", "agent_id": "event_agent", "trigger": {"type": "event", "topic": "data.updated"},
                            "execution": {"overlap_policy": "queue"}}),
    )
    .await;
    let (code, body) = post_event(&http, "data.updated", Some("k1"), br#"{"id": 1}"#);
    assert_eq!(code, 202, "{body}");
    assert_eq!(body["runs"][0]["task_id"], "on_topic");
    assert_eq!(body["runs"][0]["created"], true);
    let run_id = body["runs"][0]["run_id"].as_str().expect("run id").to_string();
    let (code, again) = post_event(&http, "data.updated", Some("k1"), br#"{"id": 1}"#);
    assert_eq!(
        (code, again["runs"][0]["created"].clone(), again["runs"][0]["run_id"].as_str()),
        (202, Value::Bool(false), Some(run_id.as_str()))
    );
    let r = wait_run(&dev.addr, "on_topic", Duration::from_secs(30), |r| r.run_id == run_id && terminal(r)).await;
    assert_eq!(status(&r), pb::RunStatus::Succeeded, "{r:#?}");
    let (code, body) = post_event(&http, "data.updated", None, b"{}");
    assert!(code == 400 && body.to_string().contains("Idempotency-Key"), "{code} {body}");
    let (code, body) = post_event(&http, "data.updated", Some("k2"), b"{not json");
    assert!(code == 400 && body.to_string().contains("payload_json"), "{code} {body}");
    assert_eq!(list_runs(&dev.addr, "on_topic").await.len(), 1, "one run for k1, none for the refused ones");
    drop(dev);

    // A replica that leads but cannot admit: 503, Retry-After, nothing made.
    let secret = dir.path().join("github.secret");
    std::fs::write(&secret, GITHUB_SECRET).expect("secret");
    let data = dir.path().join("data2");
    let stuck = Proc::dev_env(
        &data,
        4,
        &dir.path().join("stuck.log"),
        std::path::Path::new("tests/agents.yaml"),
        &[],
        &[(punchclock_control_plane::bootstrap::FAIL_ENGINE_ENV, "1")],
    );
    // Tasks are written by any replica, engine or not.
    apply(&stuck.addr, github_task("hooked", "/hooks/github", &secret.to_string_lossy())).await;
    apply(&stuck.addr, json!({"task_id": "on_topic", "agent_id": "event_agent", "trigger": {"type": "event", "topic": "data.updated"}}))
        .await;
    let http = stuck.http_addr();
    let (code, body) = post_delivery(&http, "/hooks/github", "d-503", GITHUB_SIGNATURE, GITHUB_BODY.as_bytes());
    assert_eq!(code, 503, "{body}");
    let (code, body) = post_event(&http, "data.updated", Some("k503"), b"{}");
    assert_eq!(code, 503, "{body}");
    let raw = {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(&http).expect("connect");
        let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
        write!(
            s,
            "POST /events/data.updated HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k504\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{{}}"
        )
        .expect("write");
        let mut t = String::new();
        let _ = s.read_to_string(&mut t);
        t
    };
    assert!(raw.starts_with("HTTP/1.1 503") && raw.to_ascii_lowercase().contains("retry-after:"), "{raw}");
    for id in ["hooked", "on_topic"] {
        assert!(list_runs(&stuck.addr, id).await.is_empty(), "{id}: a 503 made a record");
    }
}
