//! Issue 10, acceptance 5: no token, password or `env_from_file` value in
//! any log line or run record. A secure cluster (TLS and tokens on the API
//! and runner stream; etcd over TLS with a user and password) runs an agent
//! that reads a secret through `env_from_file`; then every log the test's
//! processes wrote, and every run record as the API returns it, is
//! searched for each secret.

use std::time::Duration;

use punchclock_proto::v1 as pb;
use punchclock_tests::etcd::{Etcd, free_port};
use punchclock_tests::pki::{Pki, use_client_credentials};
use punchclock_tests::{KeepLogsOnPanic, Proc, apply, cli, status, wait_leader, wait_n_runs};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_appear_in_no_log_and_no_run_record() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "secrets");
    let pki = Pki::make(&["r1"]);
    use_client_credentials(&pki, "admin");
    let etcd = Etcd::start_tls(1, &pki).await;
    // etcd's RBAC: a root user (required to turn auth on) and punchclock's user.
    let etcd_password = format!("etcd-pw-{}", pki.token("reader").get(3..15).expect("token chars"));
    {
        let mut c = etcd.connect().await.expect("etcd").client();
        c.role_add("root").await.expect("role");
        c.user_add("root", etcd_password.clone(), None).await.expect("root user");
        c.user_grant_role("root", "root").await.expect("grant");
        c.user_add("punchclock", etcd_password.clone(), None).await.expect("user");
        c.user_grant_role("punchclock", "root").await.expect("grant");
        c.auth_enable().await.expect("auth enable");
    }
    let password_file = dir.path().join("etcd.password");
    std::fs::write(&password_file, format!("{etcd_password}\n")).expect("password file");
    let secret_value = "sk-live-0123456789abcdef-very-secret";
    let secret_file = dir.path().join("api_key");
    std::fs::write(&secret_file, format!("{secret_value}\n")).expect("secret");

    let mut extra = [pki.server_args(), pki.etcd_client_args()].concat();
    extra.extend(["--etcd-user".into(), "punchclock".into(), "--etcd-password-file".into(), password_file.to_string_lossy().into_owned()]);
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    let server = Proc::server_with(&etcd.store_url(), "cp0", free_port(), dir.path(), &[("PUNCHCLOCK_LOG", "debug")], &extra);
    let agents = dir.path().join("agents.yaml");
    std::fs::write(
        &agents,
        format!(
            "agents:\n  secret_agent:\n    type: process\n    command: [\"sh\", \"-c\", \"printf '{{\\\"key_length\\\": %d, \\\"runner_credentials\\\": \\\"%s\\\"}}' ${{#API_KEY}} \\\"$PUNCHCLOCK_TOKEN_FILE$PUNCHCLOCK_CA_FILE$PUNCHCLOCK_TOKEN\\\" > $PUNCHCLOCK_RESULT_FILE\"]\n    env_from_file: {{API_KEY: {}}}\n",
            secret_file.display()
        ),
    )
    .expect("agents");
    let work = dir.path().join("work").to_string_lossy().into_owned();
    let runner_token = pki.token_file("runner-r1");
    let ca = pki.path("ca.crt");
    let _runner = Proc::start_with_env(
        &["runner", "--control-plane", &server.addr, "--agents", &agents.to_string_lossy(), "--runner-id", "r1", "--work-dir", &work],
        // The runner's credentials from its environment, as the systemd
        // unit gives them: the agent must not inherit them.
        &[("PUNCHCLOCK_LOG", "debug"), ("PUNCHCLOCK_TOKEN_FILE", &runner_token), ("PUNCHCLOCK_CA_FILE", &ca)],
        &dir.path().join("r1.log"),
        false,
    );
    wait_leader(std::slice::from_ref(&server.addr), Duration::from_secs(30), |_| true).await;
    apply(&server.addr, json!({"task_id": "uses_secret", "agent_id": "secret_agent"})).await;
    cli(&server.addr, &["task", "trigger", "uses_secret"]);
    let run =
        wait_n_runs(&server.addr, "uses_secret", 1, Duration::from_secs(30), |r| status(r) == pb::RunStatus::Succeeded).await.remove(0);
    let result: serde_json::Value = serde_json::from_str(&run.result_json).expect("result");
    assert_eq!(result["key_length"], secret_value.len(), "the agent got the secret from its file");
    assert_eq!(result["runner_credentials"], "", "the agent does not inherit the runner's token or CA variables");

    // Everything written: the processes' logs, and the run records.
    let mut texts: Vec<(String, String)> = Vec::new();
    for entry in std::fs::read_dir(dir.path()).expect("dir").flatten() {
        if entry.path().extension().is_some_and(|e| e == "log") {
            texts.push((entry.path().display().to_string(), std::fs::read_to_string(entry.path()).unwrap_or_default()));
        }
    }
    assert!(texts.len() >= 2, "server and runner logs: {texts:?}");
    texts.push(("runs list -o json".into(), cli(&server.addr, &["-o", "json", "runs", "list"])));
    texts.push(("runs get -o json".into(), cli(&server.addr, &["-o", "json", "runs", "get", &run.run_id])));
    texts.push(("task get -o json".into(), cli(&server.addr, &["-o", "json", "task", "get", "uses_secret"])));
    let secrets = [
        ("the admin token", pki.token("admin")),
        ("the runner token", pki.token("runner-r1")),
        ("the etcd password", etcd_password.clone()),
        ("the env_from_file value", secret_value.to_string()),
    ];
    for (what, secret) in &secrets {
        for (name, text) in &texts {
            assert!(!text.contains(secret.as_str()), "{what} appears in {name}");
        }
    }
    // The audit line names who applied and triggered.
    let log = server.log_text();
    assert!(log.contains("token=admin") && log.contains("TriggerTask"), "audit lines");
}
