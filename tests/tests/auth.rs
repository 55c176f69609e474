//! Issue 10: who may call what.
//!
//! Acceptance 1: every RPC of every service (read from the proto's
//! descriptor, so a new RPC without a row here fails), called with no
//! token, an unknown token and a token of each role: `Unauthenticated`
//! without a valid token, and allowed or `PermissionDenied` exactly as
//! the README's roles table says (written out again here, not read from
//! the server's table).
//!
//! Acceptance 2: a runner token bound to `r1` cannot connect as `r2` nor
//! offer an agent outside its list; an mTLS runner whose certificate says
//! `r1` cannot say Hello as `r2`. Real runner processes.
//!
//! Acceptance 4: a server on 0.0.0.0 without TLS and tokens exits with a
//! clear message; with `--insecure` it starts and warns.

use std::collections::BTreeSet;
use std::time::Duration;

use prost::Message;
use punchclock_proto::v1 as pb;
use punchclock_tests::etcd::free_port;
use punchclock_tests::pki::Pki;
use punchclock_tests::{KeepLogsOnPanic, Proc, bin, endpoint, wait_log};
use tonic::Code;

/// What a method needs, per the README's roles table.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Needs {
    Open,
    AnyToken,
    Read,
    Operate,
    Admin,
    Runner,
}

/// The roles table: every method of every service.
const TABLE: &[(&str, Needs)] = &[
    ("/grpc.health.v1.Health/Check", Needs::Open),
    ("/grpc.health.v1.Health/Watch", Needs::Open),
    ("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo", Needs::Read),
    ("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", Needs::Read),
    ("/punchclock.v1.TaskService/ApplyTask", Needs::Operate),
    ("/punchclock.v1.TaskService/ApplyTasks", Needs::Operate),
    ("/punchclock.v1.TaskService/GetTask", Needs::Read),
    ("/punchclock.v1.TaskService/ListTasks", Needs::Read),
    ("/punchclock.v1.TaskService/DeleteTask", Needs::Operate),
    ("/punchclock.v1.TaskService/PauseTask", Needs::Operate),
    ("/punchclock.v1.TaskService/PublishEvent", Needs::Operate),
    ("/punchclock.v1.TaskService/ResumeTask", Needs::Operate),
    ("/punchclock.v1.TaskService/TriggerTask", Needs::Operate),
    ("/punchclock.v1.TaskService/ResetBreaker", Needs::Operate),
    ("/punchclock.v1.TaskService/PreviewSchedule", Needs::Read),
    ("/punchclock.v1.RunService/ListRuns", Needs::Read),
    ("/punchclock.v1.RunService/GetRun", Needs::Read),
    ("/punchclock.v1.RunService/CancelRun", Needs::Operate),
    ("/punchclock.v1.RunService/PruneRuns", Needs::Admin),
    ("/punchclock.v1.RunService/WatchRuns", Needs::Read),
    ("/punchclock.v1.RunService/GetSchedulingStats", Needs::Read),
    ("/punchclock.v1.RunService/RerunRuns", Needs::Operate),
    ("/punchclock.v1.TaskService/BackfillTask", Needs::Operate),
    ("/punchclock.v1.TaskService/ListBackfills", Needs::Read),
    ("/punchclock.v1.TaskService/GetBackfill", Needs::Read),
    ("/punchclock.v1.TaskService/ChangeBackfill", Needs::Operate),
    ("/punchclock.v1.NotificationService/ListNotifications", Needs::Read),
    ("/punchclock.v1.NotificationService/RetryNotification", Needs::Operate),
    ("/punchclock.v1.RunnerService/Connect", Needs::Runner),
    ("/punchclock.v1.ClusterService/GetLeader", Needs::AnyToken),
    ("/punchclock.v1.ClusterService/GetClusterStatus", Needs::Read),
    ("/punchclock.v1.ClusterService/ListRunners", Needs::Read),
    ("/punchclock.v1.ClusterService/ListResources", Needs::Read),
    ("/punchclock.v1.ClusterService/ReleaseResource", Needs::Operate),
    ("/punchclock.v1.ClusterService/ListBudgets", Needs::Read),
    ("/punchclock.v1.ConfigService/ApplyConfig", Needs::Admin),
    ("/punchclock.v1.ConfigService/GetConfig", Needs::Admin),
];

fn allowed(needs: Needs, role: &str) -> bool {
    match needs {
        Needs::Open | Needs::AnyToken => true,
        Needs::Read => matches!(role, "admin" | "operator" | "reader"),
        Needs::Operate => matches!(role, "admin" | "operator"),
        Needs::Admin => role == "admin",
        Needs::Runner => matches!(role, "admin" | "runner-r1"),
    }
}

/// Every `/package.Service/Method` of punchclock's proto.
fn proto_methods() -> BTreeSet<String> {
    let set = prost_types::FileDescriptorSet::decode(pb::FILE_DESCRIPTOR_SET).expect("descriptor set");
    set.file
        .iter()
        .flat_map(|f| f.service.iter().map(move |s| (f.package().to_string(), s)))
        .flat_map(|(pkg, s)| s.method.iter().map(move |m| format!("/{pkg}.{}/{}", s.name(), m.name())))
        .collect()
}

/// Calls `path` with one empty request message (every request type
/// decodes from zero bytes) and returns the code of the response headers:
/// the auth layer answers before any service runs (a trailers-only
/// response), and so do the services' own errors on an empty request.
async fn call(addr: &str, path: &str, token: Option<&str>) -> Code {
    let ch = endpoint(addr).connect().await.expect("connect");
    let mut grpc = tonic::client::Grpc::new(ch);
    grpc.ready().await.expect("ready");
    let mut req = tonic::Request::new(tokio_stream::iter(vec![()]));
    if let Some(t) = token {
        req.metadata_mut().insert("authorization", format!("Bearer {t}").parse().expect("header"));
    }
    let codec = tonic_prost::ProstCodec::<(), ()>::default();
    let path: tonic::codegen::http::uri::PathAndQuery = path.parse().expect("path");
    match grpc.streaming(req, path, codec).await {
        Err(s) => s.code(),
        Ok(_) => Code::Ok,
    }
}

fn token_server(pki: &Pki, dir: &std::path::Path, extra: &[&str]) -> Proc {
    let port = free_port().to_string();
    let data = format!("embedded:{}", dir.join("data").display());
    let listen = format!("127.0.0.1:{port}");
    let mut args = vec!["server", "--store", &data, "--listen", &listen, "--heartbeat-ms", "500"];
    let auth = pki.path("tokens.yaml");
    args.extend_from_slice(&["--auth-file", &auth]);
    args.extend_from_slice(extra);
    Proc::start(&args, &dir.join("server.log"), true)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_rpc_answers_each_role_as_the_roles_table_says() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "auth_table");
    let pki = Pki::make(&["r1"]);
    let server = token_server(&pki, dir.path(), &[]);

    // The table covers every RPC the proto defines, and nothing else.
    let in_table: BTreeSet<String> = TABLE.iter().filter(|(m, _)| m.starts_with("/punchclock.")).map(|(m, _)| m.to_string()).collect();
    assert_eq!(in_table, proto_methods(), "the roles table and the proto differ");

    let roles = ["admin", "operator", "reader", "runner-r1"];
    let tokens: Vec<(String, String)> = roles.iter().map(|r| (r.to_string(), pki.token(r))).collect();
    let mut wrong = Vec::new();
    for (method, needs) in TABLE {
        let none = call(&server.addr, method, None).await;
        let want_none = if *needs == Needs::Open { "allowed" } else { "Unauthenticated" };
        let bogus = call(&server.addr, method, Some("pc_not-a-real-token")).await;
        let verdict = |c: Code| match c {
            Code::Unauthenticated => "Unauthenticated",
            Code::PermissionDenied => "PermissionDenied",
            _ => "allowed",
        };
        if verdict(none) != want_none {
            wrong.push(format!("{method} without a token: {none:?}"));
        }
        if *needs != Needs::Open && bogus != Code::Unauthenticated {
            wrong.push(format!("{method} with an unknown token: {bogus:?}"));
        }
        for (role, token) in &tokens {
            let got = call(&server.addr, method, Some(token)).await;
            let want = if allowed(*needs, role) { "allowed" } else { "PermissionDenied" };
            if verdict(got) != want {
                wrong.push(format!("{method} as {role}: {got:?}, want {want}"));
            }
        }
    }
    assert!(wrong.is_empty(), "calls that do not follow the roles table:\n{}", wrong.join("\n"));

    // The denial names the role needed; the audit log names the token, never the token itself.
    let out = punchclock_tests::cli_command(&server.addr)
        .env("PUNCHCLOCK_TOKEN", pki.token("reader"))
        .args(["task", "delete", "nope"])
        .output()
        .expect("cli");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("operator or admin") && err.contains("PermissionDenied"), "{err}");
    let log = server.log_text();
    assert!(log.contains("punchclock::audit") && log.contains("token=operator"), "audit lines name the token");
    for (_, t) in &tokens {
        assert!(!log.contains(t.as_str()), "a token appears in the server log");
    }
}

/// A runner process with a token (and optionally a client certificate);
/// returns its log once the server's answer is in it.
fn runner(dir: &std::path::Path, addr: &str, id: &str, agents: &std::path::Path, extra: &[&str]) -> Proc {
    let work = dir.join(format!("work-{id}")).to_string_lossy().into_owned();
    let agents = agents.to_string_lossy().into_owned();
    let mut args = vec!["runner", "--control-plane", addr, "--agents", &agents, "--runner-id", id, "--work-dir", &work];
    args.extend_from_slice(extra);
    Proc::start(&args, &dir.join(format!("runner-{id}-{}.log", extra.len())), false)
}

/// The runners the leader lists (`ca`: the CA file for an https server).
async fn runner_ids(addr: &str, admin: &str, ca: Option<&str>) -> Vec<String> {
    let mut cmd = punchclock_tests::cli_command(addr);
    if let Some(ca) = ca {
        cmd.env("PUNCHCLOCK_CA_FILE", ca);
    }
    let out = cmd.env("PUNCHCLOCK_TOKEN", admin).args(["-o", "json", "runners", "list"]).output().expect("cli");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    v.as_array().expect("array").iter().map(|r| r["runner_id"].as_str().unwrap_or_default().to_string()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_is_who_its_token_or_certificate_says() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "auth_runner");
    let pki = Pki::make(&["r1", "r2"]);
    // A runner token for r1 limited to two agents, beside the script's.
    let bound = dir.path().join("bound.token");
    let entry = std::process::Command::new(bin())
        .args([
            "token",
            "new",
            "--name",
            "r1-limited",
            "--role",
            "runner",
            "--runner-id",
            "r1",
            "--agents",
            "light_agent,ok_agent",
            "--out",
        ])
        .arg(&bound)
        .output()
        .expect("token new");
    assert!(entry.status.success());
    let tokens =
        format!("{}{}", std::fs::read_to_string(pki.root.join("tokens.yaml")).expect("tokens"), String::from_utf8_lossy(&entry.stdout));
    std::fs::write(pki.root.join("tokens.yaml"), tokens).expect("write tokens");
    let server = token_server(&pki, dir.path(), &pki.server_args()[2..].iter().map(String::as_str).collect::<Vec<_>>());
    assert!(server.addr.starts_with("https://"), "{}", server.addr);
    // (No process-wide client credentials in this file: its tests run side by side.)
    let admin = pki.token("admin");
    let ca = pki.path("ca.crt");
    let two_agents = dir.path().join("two.yaml");
    std::fs::write(
        &two_agents,
        "agents:\n  light_agent: {type: process, command: [\"true\"]}\n  ok_agent: {type: process, command: [\"true\"]}\n",
    )
    .expect("agents");
    let three_agents = dir.path().join("three.yaml");
    std::fs::write(
        &three_agents,
        "agents:\n  light_agent: {type: process, command: [\"true\"]}\n  ok_agent: {type: process, command: [\"true\"]}\n  secret_agent: {type: process, command: [\"true\"]}\n",
    )
    .expect("agents");
    let bound = bound.to_string_lossy().into_owned();
    let r1_token = pki.token_file("runner-r1");
    let within = Duration::from_secs(20);

    // r1's token, saying r2: refused, naming why.
    let p = runner(dir.path(), &server.addr, "r2", &two_agents, &["--token-file", &r1_token, "--ca-file", &ca]);
    assert!(wait_log(&p, "is bound to runner id \\\"r1\\\", not \\\"r2\\\"", within).await, "{}", p.log_text());
    assert!(p.log_text().contains("PermissionDenied") || p.log_text().contains("permission"), "{}", p.log_text());
    drop(p);
    // The limited token, offering an agent outside its list: refused.
    let p = runner(dir.path(), &server.addr, "r1", &three_agents, &["--token-file", &bound, "--ca-file", &ca]);
    assert!(wait_log(&p, "may not offer agents [\\\"secret_agent\\\"]", within).await, "{}", p.log_text());
    drop(p);
    // A certificate naming r1, saying r2 (with r2's own token): refused.
    let (r1_cert, r1_key) = (pki.path("runner-r1.crt"), pki.path("runner-r1.key"));
    let r2_token = pki.token_file("runner-r2");
    let p = runner(
        dir.path(),
        &server.addr,
        "r2",
        &two_agents,
        &["--token-file", &r2_token, "--ca-file", &ca, "--tls-cert", &r1_cert, "--tls-key", &r1_key],
    );
    assert!(wait_log(&p, "does not match the client certificate, which names \\\"r1\\\"", within).await, "{}", p.log_text());
    drop(p);
    // The same certificate and no token at all, saying r2: refused too.
    let p = runner(dir.path(), &server.addr, "r2", &two_agents, &["--ca-file", &ca, "--tls-cert", &r1_cert, "--tls-key", &r1_key]);
    assert!(wait_log(&p, "which names \\\"r1\\\"", within).await, "{}", p.log_text());
    drop(p);
    assert!(runner_ids(&server.addr, &admin, Some(&ca)).await.is_empty(), "no refused runner was registered");

    // Who they say they are: accepted.
    let ok_token = runner(dir.path(), &server.addr, "r1", &two_agents, &["--token-file", &bound, "--ca-file", &ca]);
    assert!(wait_log(&ok_token, "connected to the control plane", within).await, "{}", ok_token.log_text());
    drop(ok_token);
    let ok_cert = runner(dir.path(), &server.addr, "r1", &three_agents, &["--ca-file", &ca, "--tls-cert", &r1_cert, "--tls-key", &r1_key]);
    assert!(wait_log(&ok_cert, "connected to the control plane", within).await, "{}", ok_cert.log_text());
    assert_eq!(runner_ids(&server.addr, &admin, Some(&ca)).await, vec!["r1".to_string()]);
    // A client without the CA does not trust the server.
    let out = std::process::Command::new(bin())
        .env("PUNCHCLOCK_ENDPOINT", &server.addr)
        .env("PUNCHCLOCK_TOKEN", &admin)
        .args(["task", "list"])
        .output()
        .expect("cli");
    assert!(
        !out.status.success() && String::from_utf8_lossy(&out.stderr).contains("UnknownIssuer"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_beyond_loopback_needs_tls_and_tokens_or_insecure() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = format!("embedded:{}", dir.path().join("data").display());
    let out = std::process::Command::new(bin())
        .args(["server", "--store", &data, "--listen", "0.0.0.0:0"])
        .current_dir(punchclock_tests::repo_root())
        .output()
        .expect("server");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "it must not start: {err}");
    assert!(
        err.contains("refusing to listen on 0.0.0.0:0 without TLS") && err.contains("--auth-file") && err.contains("--insecure"),
        "{err}"
    );
    assert!(!dir.path().join("data").exists(), "nothing was opened before refusing");
    // dev too.
    let out = std::process::Command::new(bin())
        .args(["dev", "--data-dir", &dir.path().join("dev").to_string_lossy(), "--listen", "0.0.0.0:0"])
        .current_dir(punchclock_tests::repo_root())
        .output()
        .expect("dev");
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("refusing to listen"));
    // --insecure: it starts, and says so.
    let p = Proc::start(&["server", "--store", &data, "--listen", "0.0.0.0:0", "--insecure"], &dir.path().join("insecure.log"), true);
    let log = p.log_text();
    assert!(log.contains("--insecure: listening beyond loopback without TLS and tokens"), "{log}");
    assert!(log.contains("authentication is off"), "{log}");
}

/// SIGHUP after removing tokens: new calls with them are `Unauthenticated`,
/// and the streams they opened end — the runner's (the leader drops it and
/// it cannot come back) and a `WatchRuns` — while other tokens go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_token_ends_its_open_streams() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "auth_revoke");
    let pki = Pki::make(&["r1"]);
    let server = token_server(&pki, dir.path(), &[]);
    let (admin, reader) = (pki.token("admin"), pki.token("reader"));
    let agents = dir.path().join("agents.yaml");
    std::fs::write(&agents, "agents:\n  light_agent: {type: process, command: [\"true\"]}\n").expect("agents");
    let r1_token = pki.token_file("runner-r1");
    let runner = runner(dir.path(), &server.addr, "r1", &agents, &["--token-file", &r1_token]);
    assert!(wait_log(&runner, "connected to the control plane", Duration::from_secs(20)).await, "{}", runner.log_text());
    assert_eq!(runner_ids(&server.addr, &admin, None).await, vec!["r1".to_string()]);
    // A reader's open WatchRuns stream.
    let ch = endpoint(&server.addr).connect().await.expect("connect");
    let mut watch_req = tonic::Request::new(pb::WatchRunsRequest::default());
    watch_req.metadata_mut().insert("authorization", format!("Bearer {reader}").parse().expect("header"));
    let mut watch = pb::run_service_client::RunServiceClient::new(ch).watch_runs(watch_req).await.expect("watch opens").into_inner();

    // Remove the reader's and r1's tokens; SIGHUP.
    let tokens = std::fs::read_to_string(pki.root.join("tokens.yaml")).expect("tokens");
    let kept: Vec<&str> = tokens.split("\n  - ").filter(|e| !e.contains("name: reader") && !e.contains("name: runner-r1")).collect();
    std::fs::write(pki.root.join("tokens.yaml"), kept.join("\n  - ")).expect("write");
    server.signal(libc::SIGHUP);
    assert!(wait_log(&server, "SIGHUP: tokens file reloaded", Duration::from_secs(10)).await, "{}", server.log_text());

    // The watch ends with Unauthenticated.
    let ended = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match watch.message().await {
                Ok(Some(_)) => continue,
                Ok(None) => return None,
                Err(s) => return Some(s.code()),
            }
        }
    })
    .await
    .expect("the stream ends");
    assert_eq!(ended, Some(Code::Unauthenticated));
    // New calls with the removed token are refused; the admin's go on.
    assert_eq!(call(&server.addr, "/punchclock.v1.TaskService/ListTasks", Some(&reader)).await, Code::Unauthenticated);
    assert_eq!(call(&server.addr, "/punchclock.v1.TaskService/ListTasks", Some(&admin)).await, Code::Ok);
    // The runner's stream ends, and it cannot reconnect.
    assert!(wait_log(&runner, "removed from the tokens file", Duration::from_secs(20)).await, "{}", runner.log_text());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !runner_ids(&server.addr, &admin, None).await.is_empty() {
        assert!(tokio::time::Instant::now() < deadline, "the revoked runner is still registered");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let log = server.log_text();
    assert!(log.contains("denied") && log.contains("Unauthenticated"), "refusals are audited");

    // Rotation: a new token for r1 in the tokens file and in the runner's
    // token file; the runner, still running, reads it when it reconnects.
    let fresh = dir.path().join("fresh.token");
    let entry = std::process::Command::new(bin())
        .args(["token", "new", "--name", "runner-r1-2", "--role", "runner", "--runner-id", "r1", "--out"])
        .arg(&fresh)
        .output()
        .expect("token new");
    assert!(entry.status.success(), "{}", String::from_utf8_lossy(&entry.stderr));
    let tokens = std::fs::read_to_string(pki.root.join("tokens.yaml")).expect("tokens");
    std::fs::write(pki.root.join("tokens.yaml"), format!("{}\n{}", tokens.trim_end(), String::from_utf8_lossy(&entry.stdout)))
        .expect("write");
    std::fs::copy(&fresh, &r1_token).expect("rotate the runner's token file");
    server.signal(libc::SIGHUP);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while runner_ids(&server.addr, &admin, None).await.is_empty() {
        assert!(tokio::time::Instant::now() < deadline, "the runner did not come back with its rotated token: {}", runner.log_text());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_server_refuses_a_plaintext_advertise_address() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pki = Pki::make(&[]);
    let data = format!("embedded:{}", dir.path().join("data").display());
    let mut args = vec!["server".to_string(), "--store".into(), data, "--listen".into(), "127.0.0.1:0".into()];
    args.extend(pki.server_args());
    args.extend(["--advertise".into(), "http://127.0.0.1:7700".into()]);
    let out = std::process::Command::new(bin()).args(&args).current_dir(punchclock_tests::repo_root()).output().expect("server");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--advertise http://127.0.0.1:7700: TLS is on, so it must be https://"), "{err}");
}

/// Issue 19: runner labels were self-declared — a runner token bound to
/// r2, its runner started with `--labels zone=secure`, received a
/// `selector: {labels: {zone: secure}}` task and its params. A runner may
/// claim only the labels its token binds; the one whose token binds
/// `zone=secure` gets the task.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_claims_only_the_labels_its_token_binds() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "auth_labels");
    let pki = Pki::make(&["r2"]);
    let secure_token = dir.path().join("secure.token");
    let entry = std::process::Command::new(bin())
        .args(["token", "new", "--name", "secure-1", "--role", "runner", "--runner-id", "secure-1", "--labels", "zone=secure", "--out"])
        .arg(&secure_token)
        .output()
        .expect("token new");
    assert!(entry.status.success(), "{}", String::from_utf8_lossy(&entry.stderr));
    assert!(
        String::from_utf8_lossy(&entry.stdout).contains("labels: {\"zone\": \"secure\"}"),
        "{}",
        String::from_utf8_lossy(&entry.stdout)
    );
    let tokens =
        format!("{}{}", std::fs::read_to_string(pki.root.join("tokens.yaml")).expect("tokens"), String::from_utf8_lossy(&entry.stdout));
    std::fs::write(pki.root.join("tokens.yaml"), tokens).expect("write tokens");
    let server = token_server(&pki, dir.path(), &pki.server_args()[2..].iter().map(String::as_str).collect::<Vec<_>>());
    let (admin, ca) = (pki.token("admin"), pki.path("ca.crt"));
    let agents = dir.path().join("agents.yaml");
    std::fs::write(&agents, "agents:\n  light_agent: {type: process, command: [\"true\"]}\n").expect("agents");
    let within = Duration::from_secs(20);

    // r2's token binds no label: claiming zone=secure is refused.
    let r2_token = pki.token_file("runner-r2");
    let p = runner(dir.path(), &server.addr, "r2", &agents, &["--token-file", &r2_token, "--ca-file", &ca, "--labels", "zone=secure"]);
    assert!(wait_log(&p, "may not claim labels [\\\"zone=secure\\\"]", within).await, "{}", p.log_text());
    drop(p);
    assert!(runner_ids(&server.addr, &admin, Some(&ca)).await.is_empty());

    // The token that binds it: accepted, and the secure task runs there.
    let secure_token = secure_token.to_string_lossy().into_owned();
    let ok = runner(
        dir.path(),
        &server.addr,
        "secure-1",
        &agents,
        &["--token-file", &secure_token, "--ca-file", &ca, "--labels", "zone=secure"],
    );
    assert!(wait_log(&ok, "connected to the control plane", within).await, "{}", ok.log_text());
    let mut cmd = punchclock_tests::cli_command(&server.addr);
    let spec = dir.path().join("secure.json");
    std::fs::write(
        &spec,
        serde_json::json!({"task_id": "secure", "agent_id": "light_agent", "execution": {"selector": {"labels": {"zone": "secure"}}},
                           "context": {"params": {"secret": "for secure runners"}}})
        .to_string(),
    )
    .expect("spec");
    let out = cmd
        .env("PUNCHCLOCK_TOKEN", &admin)
        .env("PUNCHCLOCK_CA_FILE", &ca)
        .args(["task", "apply", "-f"])
        .arg(&spec)
        .output()
        .expect("apply");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let out = punchclock_tests::cli_command(&server.addr)
        .env("PUNCHCLOCK_TOKEN", &admin)
        .env("PUNCHCLOCK_CA_FILE", &ca)
        .args(["task", "trigger", "secure", "--key", "one"])
        .output()
        .expect("trigger");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let out = punchclock_tests::cli_command(&server.addr)
            .env("PUNCHCLOCK_TOKEN", &admin)
            .env("PUNCHCLOCK_CA_FILE", &ca)
            .args(["-o", "json", "runs", "get", "secure.manual-one"])
            .output()
            .expect("runs get");
        let run: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        if run["status"] == "SUCCEEDED" {
            assert_eq!(run["attempts"][0]["runner_id"], "secure-1", "{run}");
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the secure task did not run: {run}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// Issue 19: a runner refused for good (an unknown token) retried every
/// 2 s forever, and the server wrote an audit line per retry. It backs
/// off (5 s doubling to 5 minutes) and says so once a minute; the server
/// writes one line a minute per caller and refusal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_runner_backs_off_and_the_audit_log_does_not_flood() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "auth_refused");
    let pki = Pki::make(&["r1"]);
    let server = token_server(&pki, dir.path(), &pki.server_args()[2..].iter().map(String::as_str).collect::<Vec<_>>());
    let ca = pki.path("ca.crt");
    let bogus = dir.path().join("bogus.token");
    std::fs::write(&bogus, "pc_not_a_real_token\n").expect("token");
    let agents = dir.path().join("agents.yaml");
    std::fs::write(&agents, "agents:\n  light_agent: {type: process, command: [\"true\"]}\n").expect("agents");
    let p = runner(dir.path(), &server.addr, "r1", &agents, &["--token-file", &bogus.to_string_lossy(), "--ca-file", &ca]);
    assert!(wait_log(&p, "refuses this runner", Duration::from_secs(20)).await, "{}", p.log_text());
    // The scenario: 25 s of a runner that cannot get in.
    tokio::time::sleep(Duration::from_secs(25)).await;
    let runner_lines = p.log_text().matches("refuses this runner").count();
    assert_eq!(runner_lines, 1, "said once a minute: {}", p.log_text());
    let audit = server.log_text().lines().filter(|l| l.contains("punchclock::audit") && l.contains("RunnerService/Connect")).count();
    assert_eq!(audit, 1, "one audit line a minute for the same refusal: {}", server.log_text());
    // It did retry, with a growing pause (5 s, 10 s: three tries in 25 s;
    // the 2 s backoff made a dozen).
    assert!(["retry_in_s=4", "retry_in_s=5", "retry_in_s=6"].iter().any(|d| p.log_text().contains(d)), "{}", p.log_text());
}
