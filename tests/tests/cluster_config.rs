//! Issue 34, findings 8 and 9: one cluster, one configuration, with real
//! control planes on a real etcd, a runner and agent processes.
//!
//! - **replicas with different files enforce one limit** (and `cluster
//!   status` right after the leader's kill says that the leader it still
//!   names does not answer): `cp0` starts with
//!   `search: {concurrency: 2}` and stores it; `cp1` starts with a file
//!   that says 6, and says that its file differs; 6 tasks every second
//!   share `search`; after `cp0` is killed (-9) and `cp1` leads, live agents
//!   (sampled every 50 ms) never pass 2 (they reached 6 before); `config
//!   get` shows version 1, `config diff -f` shows the difference (exit 1),
//!   and `config apply -f` makes 3 the limit, cluster-wide (version 2);
//! - **tasks and configuration are checked against each other, whichever
//!   comes second**: a configuration that drops a resource a task uses, or
//!   lowers its concurrency below a task's units, is refused naming the task
//!   and field, nothing stored; 30 rounds of a task apply (on a follower)
//!   racing a configuration apply that drops its resource (on the leader)
//!   never leave a task naming a resource the configuration lacks.

use std::time::Duration;

use punchclock_proto::v1 as pb;
use punchclock_tests::etcd::{Etcd, free_port};
use punchclock_tests::{KeepLogsOnPanic, Proc, apply, cli, cli_command, cli_fails, max_live_agents_until, tasks, wait_engine, wait_leader};
use serde_json::json;

const MARKER: &str = "pc-shared-agent";

fn write(dir: &std::path::Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write");
    path.to_string_lossy().into_owned()
}

fn concurrency(addr: &str, name: &str) -> Option<u64> {
    let all: serde_json::Value = serde_json::from_str(&cli(addr, &["resources", "list", "-o", "json"])).expect("json");
    all.as_array()?.iter().find(|r| r["name"] == name)?["concurrency"].as_u64()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_with_different_files_enforce_one_limit() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "cluster_config_files");
    let two = write(dir.path(), "two.yaml", "resources:\n  search: {concurrency: 2}\n");
    let six = write(dir.path(), "six.yaml", "# another replica's file\nresources:\n  search: {concurrency: 6}\n");
    let three = write(dir.path(), "three.yaml", "resources:\n  search: {concurrency: 3}\n");
    let etcd = Etcd::start(1).await;
    let ports = [free_port(), free_port()];
    let mut cp0 = Proc::server_with(&etcd.store_url(), "cp0", ports[0], dir.path(), &[], &["--config", &two]);
    let first = wait_leader(std::slice::from_ref(&cp0.addr), Duration::from_secs(30), |s| s.leader_id == "cp0").await;
    wait_engine(&first.leader_address).await;
    let cp1 = Proc::server_with(&etcd.store_url(), "cp1", ports[1], dir.path(), &[], &["--config", &six]);
    let addrs = [cp0.addr.clone(), cp1.addr.clone()];
    assert!(punchclock_tests::wait_log(&cp1, "differs from the cluster's configuration", Duration::from_secs(30)).await, "cp1 says so");
    let _r1 = Proc::runner(&addrs.join(","), "r1", dir.path());
    for i in 0..6 {
        apply(
            &cp0.addr,
            json!({"task_id": format!("search{i}"), "agent_id": "shared_agent", "trigger": {"type": "interval", "every": "1s"},
                   "execution": {"resources": ["search"], "concurrency_limit": 1, "max_retries": 0, "start_timeout_seconds": 300}}),
        )
        .await;
    }
    let failover = async {
        tokio::time::sleep(Duration::from_secs(4)).await;
        cp0.kill9();
        // Until its lease ends every replica names the dead leader: saying
        // so (issue 34, finding 16: `cluster status` named it as if alive).
        let out = cli_command(&cp1.addr).args(["cluster", "status", "-o", "json"]).output().expect("status");
        let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        if status["leader_id"] == "cp0" {
            assert_eq!(status["leader_unresponsive"], true, "the dead leader is named as alive: {status:#}");
        }
        let next = wait_leader(std::slice::from_ref(&cp1.addr), Duration::from_secs(30), |s| s.leader_id == "cp1").await;
        wait_engine(&next.leader_address).await;
        // Load under the new leader.
        tokio::time::sleep(Duration::from_secs(8)).await;
        next
    };
    let (max, next) = max_live_agents_until(MARKER, failover).await;
    assert!(max <= 2, "{max} agents of a resource of 2 were alive at once (cp1's file says 6)");
    assert_eq!(max, 2, "the resource was never fully used: the test proves nothing");
    let addr = next.leader_address.clone();
    assert_eq!(concurrency(&addr, "search"), Some(2), "the new leader runs on the stored configuration");
    let got = cli(&addr, &["config", "get"]);
    assert!(got.starts_with("# version 1, applied") && got.contains("concurrency: 2"), "{got}");
    let status: serde_json::Value = serde_json::from_str(&cli(&addr, &["cluster", "status", "-o", "json"])).expect("json");
    assert_eq!(status["config_version"], 1, "{status:#}");
    // The difference, by meaning (the comment is not one).
    let out = cli_command(&addr).args(["config", "diff", "-f", &six]).output().expect("diff");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "a difference exits 1: {text}");
    assert!(text.contains("-    concurrency: 2") && text.contains("+    concurrency: 6"), "{text}");
    assert!(cli(&addr, &["config", "diff", "-f", &two]).contains("no difference from version 1"));
    // Applied through the API: cluster-wide, version 2.
    assert!(cli(&addr, &["config", "apply", "-f", &three]).contains("applied: version 2 (was 1)"));
    assert_eq!(concurrency(&addr, "search"), Some(3));
    assert!(cli(&addr, &["config", "apply", "-f", &three]).contains("unchanged: version 2"));
    assert!(cli(&addr, &["config", "get", "--version", "1"]).contains("concurrency: 2"), "earlier versions are kept");
    for i in 0..6 {
        cli(&addr, &["task", "pause", &format!("search{i}")]);
    }
}

/// The configuration of `addr`'s cluster, as stored.
fn stored_config(addr: &str) -> serde_json::Value {
    serde_json::from_str(&cli(addr, &["config", "get", "-o", "json"])).expect("json")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tasks_and_configuration_are_checked_against_each_other() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "cluster_config_checks");
    let with = write(dir.path(), "with.yaml", "resources:\n  search: {concurrency: 4}\n  other: {concurrency: 1}\n");
    let without = write(dir.path(), "without.yaml", "resources:\n  other: {concurrency: 1}\n");
    let lower = write(dir.path(), "lower.yaml", "resources:\n  search: {concurrency: 2}\n  other: {concurrency: 1}\n");
    let etcd = Etcd::start(1).await;
    let ports = [free_port(), free_port()];
    let cp0 = Proc::server_with(&etcd.store_url(), "cp0", ports[0], dir.path(), &[], &["--config", &with]);
    let leader = wait_leader(std::slice::from_ref(&cp0.addr), Duration::from_secs(30), |s| s.leader_id == "cp0").await;
    wait_engine(&leader.leader_address).await;
    let cp1 = Proc::server_with(&etcd.store_url(), "cp1", ports[1], dir.path(), &[], &["--config", &with]);
    wait_leader(std::slice::from_ref(&cp1.addr), Duration::from_secs(30), |s| s.leader_id == "cp0").await;
    let task =
        |units: u32| json!({"task_id": "needs", "agent_id": "ok_agent", "execution": {"resources": [{"name": "search", "units": units}]}});
    apply(&cp0.addr, task(3)).await;

    // Dropping the resource, or lowering it below the task's units: refused, named.
    let err = cli_fails(&cp0.addr, &["config", "apply", "-f", &without]);
    assert!(err.contains("task \"needs\": execution.resources[0]: resource \"search\" is not defined"), "{err}");
    let err = cli_fails(&cp0.addr, &["config", "apply", "-f", &lower]);
    assert!(err.contains("task \"needs\": execution.resources[0].units: 3 units of resource \"search\", whose concurrency is 2"), "{err}");
    assert_eq!(stored_config(&cp0.addr)["version"], 1, "nothing stored");
    assert!(cli(&cp0.addr, &["config", "apply", "--dry-run", "-f", &with]).contains("unchanged"));
    // A task that cannot fit the configuration in force: refused.
    let mut tc = tasks(&cp1.addr).await;
    let err = tc.apply_task(pb::ApplyTaskRequest { spec_json: task(5).to_string(), ..Default::default() }).await.expect_err("5 units of 4");
    assert!(err.message().contains("whose concurrency is 4"), "{err:?}");

    // Races: a task apply naming `search` on the follower against a
    // configuration apply dropping `search` on the leader.
    let mut outcomes = (0, 0);
    for round in 0..30 {
        // Gone already when the last round's configuration went first.
        let _ = cli_command(&cp0.addr).args(["task", "delete", "needs"]).output();
        cli(&cp0.addr, &["config", "apply", "-f", &with]);
        let mut tc = tc.clone();
        let task_apply = async move { tc.apply_task(pb::ApplyTaskRequest { spec_json: task(1).to_string(), ..Default::default() }).await };
        let leader = cp0.addr.clone();
        let without = without.clone();
        let config_apply = tokio::task::spawn_blocking(move || cli_command(&leader).args(["config", "apply", "-f", &without]).output());
        let (t, c) = tokio::join!(task_apply, config_apply);
        let c = c.expect("join").expect("cli");
        outcomes.0 += usize::from(t.is_ok());
        outcomes.1 += usize::from(c.status.success());
        let config = stored_config(&cp0.addr);
        let defines_search = config["text"].as_str().is_some_and(|t| t.contains("search"));
        let mut tc2 = tasks(&cp0.addr).await;
        let stored = tc2.get_task(pb::GetTaskRequest { task_id: "needs".into() }).await.is_ok();
        assert!(!stored || defines_search, "round {round}: task \"needs\" names search, which the configuration lacks: {config:#}");
        assert!(t.is_ok() || c.status.success(), "round {round}: neither went: {t:?} {}", String::from_utf8_lossy(&c.stderr));
    }
    println!("30 rounds: task applied {} times, configuration dropping its resource {} times", outcomes.0, outcomes.1);
}
