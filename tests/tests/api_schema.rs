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

use std::io::Write;
use std::time::Duration;

use punchclock_proto::v1 as pb;
use punchclock_tests::{Proc, channel, cli_command, tasks};
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
