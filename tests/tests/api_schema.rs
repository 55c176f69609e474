//! Issue 19, section 7 — the API for gRPC clients, on a real `dev`:
//!
//! - `a_task_can_be_applied_and_read_typed`: `ApplyTask` takes a typed
//!   `TaskDefinition` (trigger oneof, execution, context as a Struct,
//!   notify, history) as well as `spec_json`, and `Task.definition` gives
//!   it back typed; both forms are one validation (the same errors).
//! - `reflection_answers_v1_and_v1alpha`: Python's grpcio-reflection asks
//!   `grpc.reflection.v1alpha` and got UNIMPLEMENTED; both versions answer.
//! - `task_apply_reads_stdin_and_lists_every_problem`: `task apply -f -`
//!   and a definition with several problems names all of them.
//! - `every_field_of_a_task_file_round_trips`: issue 34, point 11 — a
//!   typed get-then-apply dropped `execution.limits` (the typed `Execution`
//!   had none), and a definition came back with a dozen defaults filled
//!   (queue `max_pending` yes, `prefetch` no), so re-applying it was never
//!   `unchanged`. Task files with every field set, and one with only the
//!   required ones, go in as JSON and typed, come back as applied, and
//!   applied again (JSON, typed, `task apply -f` of `task get`'s `spec`)
//!   are `unchanged`; `Task.effective` has the defaults.

use std::io::Write;
use std::time::Duration;

use punchclock_proto::v1 as pb;
use punchclock_tests::{Proc, channel, cli, cli_command, tasks};
use tokio_stream::StreamExt;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_can_be_applied_and_read_typed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dev = Proc::dev(&dir.path().join("data"));
    let mut params = prost_types::Struct::default();
    params.fields.insert("region".into(), prost_types::Value { kind: Some(prost_types::value::Kind::StringValue("cn-north".into())) });
    let mut context = prost_types::Struct::default();
    context.fields.insert("params".into(), prost_types::Value { kind: Some(prost_types::value::Kind::StructValue(params)) });
    let def = pb::TaskDefinition {
        task_id: "typed".into(),
        agent_id: "true_agent".into(),
        triggers: vec![pb::Trigger {
            kind: Some(pb::trigger::Kind::Cron(pb::CronTrigger {
                expr: "0 30 8 * * *".into(),
                timezone: "Asia/Shanghai".into(),
                jitter_seconds: 0,
                ..Default::default()
            })),
        }],
        execution: Some(pb::Execution {
            timeout_seconds: Some(600),
            max_retries: Some(3),
            concurrency_limit: Some(2),
            overlap_policy: pb::OverlapPolicy::Queue as i32,
            ..Default::default()
        }),
        context: Some(context),
        notify: Some(pb::Notify { on_failure: vec!["webhook://alert".into()], ..Default::default() }),
        history: Some(pb::History { keep_last: Some(50), max_age: "7d".into() }),
        ..Default::default()
    };
    let mut c = tasks(&dev.addr).await;
    let applied = c
        .apply_task(pb::ApplyTaskRequest { spec_json: String::new(), dry_run: false, task: Some(def.clone()) })
        .await
        .expect("typed apply")
        .into_inner();
    let task = applied.task.expect("task");
    let stored: serde_json::Value = serde_json::from_str(&task.spec_json).expect("spec json");
    assert_eq!(stored["trigger"], serde_json::Value::Null);
    assert_eq!(stored["triggers"][0]["expr"], "0 30 8 * * *");
    assert_eq!(stored["execution"]["overlap_policy"], "queue");
    assert_eq!(stored["context"]["params"]["region"], "cn-north");
    let got =
        c.get_task(pb::GetTaskRequest { task_id: "typed".into() }).await.expect("get").into_inner().definition.expect("typed definition");
    assert_eq!(got.triggers, def.triggers);
    assert_eq!(got.execution.as_ref().and_then(|e| e.max_retries), Some(3));
    assert_eq!(got.execution.as_ref().map(|e| e.overlap_policy), Some(pb::OverlapPolicy::Queue as i32));
    assert_eq!(got.context, def.context);
    assert_eq!(got.history, def.history);
    // One validation path: a typed definition's errors name the field.
    let mut bad = def.clone();
    bad.execution.as_mut().expect("execution").timeout_seconds = Some(0);
    let e = c.apply_task(pb::ApplyTaskRequest { spec_json: String::new(), dry_run: false, task: Some(bad) }).await.expect_err("bad");
    assert!(e.message().starts_with("execution.timeout_seconds:"), "{}", e.message());
    let e = c.apply_task(pb::ApplyTaskRequest { spec_json: "{}".into(), dry_run: false, task: Some(def) }).await.expect_err("both forms");
    assert!(e.message().contains("exactly one of spec_json and task"), "{}", e.message());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reflection_answers_v1_and_v1alpha() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dev = Proc::dev(&dir.path().join("data"));
    use tonic_reflection::pb::v1alpha::ServerReflectionRequest as AlphaRequest;
    use tonic_reflection::pb::v1alpha::server_reflection_client::ServerReflectionClient as Alpha;
    use tonic_reflection::pb::v1alpha::server_reflection_request::MessageRequest as AlphaReq;
    use tonic_reflection::pb::v1alpha::server_reflection_response::MessageResponse as AlphaResp;
    let mut alpha = Alpha::new(channel(&dev.addr).await);
    let req = AlphaRequest { host: String::new(), message_request: Some(AlphaReq::ListServices(String::new())) };
    let mut answers = alpha.server_reflection_info(tokio_stream::iter(vec![req])).await.expect("v1alpha answers").into_inner();
    let first = tokio::time::timeout(Duration::from_secs(10), answers.next()).await.expect("in time").expect("one").expect("ok");
    let Some(AlphaResp::ListServicesResponse(list)) = first.message_response else { panic!("{first:?}") };
    let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    assert!(names.contains(&"punchclock.v1.TaskService".to_string()), "{names:?}");
    use tonic_reflection::pb::v1::ServerReflectionRequest as V1Request;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient as V1;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest as V1Req;
    let mut v1 = V1::new(channel(&dev.addr).await);
    let req = V1Request { host: String::new(), message_request: Some(V1Req::FileContainingSymbol("punchclock.v1.TaskDefinition".into())) };
    let mut answers = v1.server_reflection_info(tokio_stream::iter(vec![req])).await.expect("v1 answers").into_inner();
    let first = tokio::time::timeout(Duration::from_secs(10), answers.next()).await.expect("in time").expect("one").expect("ok");
    assert!(
        matches!(
            first.message_response,
            Some(tonic_reflection::pb::v1::server_reflection_response::MessageResponse::FileDescriptorResponse(_))
        ),
        "{first:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn task_apply_reads_stdin_and_lists_every_problem() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dev = Proc::dev(&dir.path().join("data"));
    let apply = |input: &str| {
        let mut child = cli_command(&dev.addr)
            .args(["task", "apply", "-f", "-"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("cli");
        child.stdin.take().expect("stdin").write_all(input.as_bytes()).expect("write");
        child.wait_with_output().expect("wait")
    };
    let out = apply("task_id: from_stdin\nagent_id: true_agent\n");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("from_stdin"), "{}", String::from_utf8_lossy(&out.stdout));
    let out =
        apply(r#"{"task_id": "bad", "agent_id": "a", "execution": {"timeout_seconds": 0, "priority": 5000, "concurrency_limit": 0}}"#);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    for field in ["execution.timeout_seconds", "execution.priority", "execution.concurrency_limit"] {
        assert!(err.contains(field), "{field} is named: {err}");
    }
}

/// Every field of the task file (three tasks between them: the
/// alternatives of a webhook's auth, of a queue's broker, of an interval's
/// period, `trigger` and `triggers`), limits included.
fn full_files() -> Vec<serde_json::Value> {
    use serde_json::json;
    vec![
        json!({"task_id": "full_a", "agent_id": "true_agent", "description": "every field",
            "labels": {"team": "growth", "tier": "1"},
            "triggers": [
                {"type": "cron", "expr": "0 30 8 * * *", "timezone": "Asia/Shanghai", "jitter_seconds": 5},
                {"type": "interval", "every": "10m", "start_at": "2026-01-01T08:00:00+08:00", "jitter_seconds": 3},
                {"type": "once", "at": "2099-01-01T00:00:00Z"},
                {"type": "event", "topic": "data.updated"},
                {"type": "webhook", "path": "/hooks/full-a",
                 "auth": {"hmac": {"secret_file": "/etc/punchclock/hook.secret", "header": "X-Signature", "algorithm": "sha1",
                          "encoding": "base64", "prefix": "v1=", "timestamp_header": "X-Timestamp", "tolerance_seconds": 120}},
                 "dedup": {"header": "X-Delivery", "ttl": "2h"}, "headers": ["X-Request-Id", "User-Agent"], "max_body_bytes": 65536},
                {"type": "queue", "broker": "rabbit", "queue": "reports", "format": "raw", "max_pending": 50, "prefetch": 10,
                 "max_body_bytes": 4096, "dedup": {"ttl": "7d"}},
                {"type": "after", "task": "full_b", "status": "any"}],
            "execution": {"timeout_seconds": 600, "max_retries": 3, "concurrency_limit": 2, "overlap_policy": "queue",
                "misfire_policy": "run_all", "misfire_grace_seconds": 120, "priority": 7, "start_timeout_seconds": 900,
                "retry_backoff": {"base_seconds": 1.5, "cap_seconds": 30, "jitter_seconds": 0.25},
                "selector": {"labels": {"zone": "a"}}, "circuit_breaker": {"failure_threshold": 3, "cooldown_seconds": 60},
                "resources": ["search", {"name": "llm", "units": 2, "tokens": 4000}], "on_resource_busy": "skip",
                "rate_limit_max_wait_seconds": 600, "limits": {"memory_max": "512Mi", "cpu": 0.5, "pids_max": 64}},
            "context": {"params": {"region": "cn-north", "n": 7, "x": 1.5, "list": [true, null, "s"]}, "doc": {"k": "v"}},
            "notify": {"on_success": ["webhook://report-sink"], "on_failure": ["webhook://alert"],
                       "on_skipped": ["https://example.com/skipped"], "on_breaker_open": ["webhook://alert"]},
            "history": {"keep_last": 10, "max_age": "7d"}}),
        json!({"task_id": "full_b", "agent_id": "true_agent",
            "trigger": {"type": "webhook", "path": "/hooks/full-b", "auth": {"bearer": {"token_file": "/etc/punchclock/hook.token"}},
                        "dedup": {"body_field": "data.id"}, "headers": []},
            "execution": {"limits": {"memory_max": 8388608}, "resources": [{"name": "search", "units": 1}],
                          "selector": {}, "retry_backoff": {}, "overlap_policy": "queue"},
            "notify": {}, "history": {}}),
        json!({"task_id": "full_c", "agent_id": "true_agent",
            "triggers": [{"type": "interval", "every_seconds": 90},
                         {"type": "queue", "broker": "nats", "subject": "data.>", "stream": "DATA", "format": "json"},
                         {"type": "webhook", "path": "/hooks/full-c", "auth": "none"},
                         {"type": "after", "task": "full_a", "status": "succeeded"}],
            "execution": {"overlap_policy": "queue"}}),
        // Issue 37: bounds, jitter: auto, DST policies, a wall-clock interval.
        json!({"task_id": "full_d", "agent_id": "true_agent",
            "trigger": {"type": "cron", "expr": "0 30 2 * * *", "timezone": "Europe/Berlin", "jitter": "auto",
                        "dst": {"gap": "skip", "repeat": "both"}, "start_at": "2026-01-01T00:00:00Z",
                        "end_at": "2036-01-01T00:00:00Z", "max_runs": 100}}),
        json!({"task_id": "full_e", "agent_id": "true_agent",
            "trigger": {"type": "interval", "every": "1d", "start_at": "2026-03-27T08:00:00Z", "wall_clock": true,
                        "timezone": "Europe/Berlin", "dst": {"gap": "shift"}, "jitter": "auto",
                        "end_at": "2036-01-01T00:00:00Z", "max_runs": 5}}),
        // Only what is required.
        json!({"task_id": "bare", "agent_id": "true_agent"}),
    ]
}

/// Issue 34, point 11: see the module doc. On the previous version the
/// typed get-then-apply of `full_a` stored it without its limits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_field_of_a_task_file_round_trips() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("config.yaml");
    // Brokers nobody listens on: the tasks are applied and read, never run.
    std::fs::write(
        &config,
        "resources:\n  search: {concurrency: 4}\n  llm: {concurrency: 4, tokens_per_minute: 100000}\n\
         brokers:\n  rabbit: {amqp: {url: \"amqp://127.0.0.1:1/%2f\"}}\n  nats: {nats: {url: \"nats://127.0.0.1:1\"}}\n",
    )
    .expect("config");
    let config = config.to_string_lossy().to_string();
    let dev = Proc::dev_with(&dir.path().join("data"), 1, &dir.path().join("dev.log"), &["--config", &config]);
    let mut c = tasks(&dev.addr).await;
    let files = full_files();
    let json_apply = |doc: String| pb::ApplyTaskRequest { spec_json: doc, dry_run: false, task: None };
    let typed_apply = |d: pb::TaskDefinition| pb::ApplyTaskRequest { spec_json: String::new(), dry_run: false, task: Some(d) };
    let parse = |text: &str| serde_json::from_str::<serde_json::Value>(text).expect("JSON");

    // The JSON path: in as a task file, back as written, again unchanged.
    let mut typed = Vec::new();
    for doc in &files {
        let id = doc["task_id"].as_str().expect("id").to_string();
        let r = c.apply_task(json_apply(doc.to_string())).await.expect("apply").into_inner();
        assert_eq!(r.outcome, "created", "{id}");
        let got = c.get_task(pb::GetTaskRequest { task_id: id.clone() }).await.expect("get").into_inner();
        assert_eq!(&parse(&got.spec_json), doc, "{id}: the definition as applied, nothing added");
        let r = c.apply_task(json_apply(got.spec_json.clone())).await.expect("apply").into_inner();
        assert_eq!(r.outcome, "unchanged", "{id}: its spec_json applied again");
        // The typed get-then-apply: unchanged, nothing lost.
        let def = got.definition.clone().expect("definition");
        let r = c.apply_task(typed_apply(def.clone())).await.expect("typed apply").into_inner();
        assert_eq!(r.outcome, "unchanged", "{id}: its typed definition applied again");
        let again = c.get_task(pb::GetTaskRequest { task_id: id.clone() }).await.expect("get").into_inner();
        assert_eq!(&parse(&again.spec_json), doc, "{id}: still as first written");
        assert_eq!(again.definition.as_ref(), Some(&def), "{id}");
        assert!(!again.effective_json.is_empty(), "{id}: GetTask has the effective definition");
        typed.push((def, again.effective.expect("effective")));
    }
    let full_a = &typed[0].0;
    let ex = full_a.execution.as_ref().expect("execution");
    assert_eq!(ex.limits, Some(pb::ExecutionLimits { memory_max_bytes: Some(512 << 20), cpu: Some(0.5), pids_max: Some(64) }));
    let Some(pb::trigger::Kind::Queue(q)) = &full_a.triggers[5].kind else { panic!("queue") };
    assert_eq!((q.max_pending, q.prefetch), (50, 10));
    // Nothing the user did not write: the bare task has no execution.
    assert_eq!(
        typed[5].0,
        pb::TaskDefinition { task_id: "bare".into(), agent_id: "true_agent".into(), ..Default::default() },
        "only the fields written"
    );
    // The effective definition has the defaults: the engine's values.
    let bare_ex = typed[5].1.execution.as_ref().expect("effective execution");
    assert_eq!((bare_ex.timeout_seconds, bare_ex.concurrency_limit, bare_ex.misfire_grace_seconds), (Some(3600), Some(1), Some(60)));
    assert_eq!(typed[5].1.history.as_ref().and_then(|h| h.keep_last), Some(1000), "the server's history default");
    let Some(pb::trigger::Kind::Queue(q)) = &typed[2].1.triggers[1].kind else { panic!("queue") };
    assert_eq!((q.max_pending, q.prefetch), (1000, 100), "queue defaults, prefetch too");
    // A list does not carry the effective definitions.
    let list = c.list_tasks(pb::ListTasksRequest::default()).await.expect("list").into_inner();
    assert!(list.tasks.iter().all(|t| t.effective.is_none() && t.effective_json.is_empty() && t.definition.is_some()));

    // The CLI: `task get -o json`'s spec, applied as a file, is unchanged.
    let shown = parse(&cli(&dev.addr, &["-o", "json", "task", "get", "full_a"]));
    assert_eq!(shown["spec"], files[0]);
    assert_eq!(shown["effective"]["execution"]["limits"]["memory_max"], 512u64 << 20);
    let file = dir.path().join("again.json");
    std::fs::write(&file, shown["spec"].to_string()).expect("write");
    let out = cli(&dev.addr, &["task", "apply", "-f", &file.to_string_lossy()]);
    assert!(out.contains("task full_a unchanged"), "{out}");

    // The typed path: the typed definitions on tasks made afresh.
    for (def, _) in &typed {
        c.delete_task(pb::DeleteTaskRequest { task_id: def.task_id.clone() }).await.expect("delete");
    }
    for (def, effective) in &typed {
        let id = &def.task_id;
        let r = c.apply_task(typed_apply(def.clone())).await.expect("typed apply").into_inner();
        assert_eq!(r.outcome, "created", "{id}");
        let got = c.get_task(pb::GetTaskRequest { task_id: id.clone() }).await.expect("get").into_inner();
        assert_eq!(got.definition.as_ref(), Some(def), "{id}: the typed definition as applied");
        assert_eq!(got.effective.as_ref(), Some(effective), "{id}: the same meaning as the file's");
        let r = c.apply_task(typed_apply(got.definition.clone().expect("definition"))).await.expect("apply").into_inner();
        assert_eq!(r.outcome, "unchanged", "{id}: typed again");
        let r = c.apply_task(json_apply(got.spec_json.clone())).await.expect("apply").into_inner();
        assert_eq!(r.outcome, "unchanged", "{id}: its spec_json");
    }
    // And the task files over the typed ones: the same definitions.
    for doc in &files {
        let r = c.apply_task(json_apply(doc.to_string())).await.expect("apply").into_inner();
        assert_eq!(r.outcome, "unchanged", "{}: the file over its typed form", doc["task_id"]);
    }
}
