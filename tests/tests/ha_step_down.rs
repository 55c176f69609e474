//! Issue 8: a leader that cannot lead steps down. Two replicas on a real
//! etcd; the first to lead has an engine that never starts (the test hook
//! `PUNCHCLOCK_TEST_FAIL_ENGINE`). While it leads without an engine its
//! `/readyz` answers 503 saying so; after five failed starts it steps down,
//! the other replica leads, and a task runs. Meanwhile the runner,
//! redirected by the engineless leader to itself, backs off.

use std::time::Duration;

use punchclock_proto::v1 as pb;
use punchclock_tests::etcd::{Etcd, free_port};
use punchclock_tests::{KeepLogsOnPanic, Proc, apply, http_get, status, wait_leader, wait_run};

fn server(etcd: &Etcd, id: &str, port: u16, http: &str, dir: &std::path::Path, env: &[(&str, &str)]) -> Proc {
    let listen = format!("127.0.0.1:{port}");
    Proc::start_with_env(
        &[
            "server",
            "--store",
            &etcd.store_url(),
            "--listen",
            &listen,
            "--http-listen",
            http,
            "--node-id",
            id,
            "--heartbeat-ms",
            "500",
            "--lease-ttl-ms",
            "3000",
        ],
        env,
        &dir.join(format!("{id}.log")),
        true,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_whose_engine_never_starts_steps_down() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "ha_step_down");
    let etcd = Etcd::start(1).await;
    let http_a = format!("127.0.0.1:{}", free_port());
    let a = server(&etcd, "cpa", free_port(), &http_a, dir.path(), &[("PUNCHCLOCK_TEST_FAIL_ENGINE", "1")]);
    wait_leader(std::slice::from_ref(&a.addr), Duration::from_secs(30), |s| s.leader_id == "cpa").await;
    let b = server(&etcd, "cpb", free_port(), &format!("127.0.0.1:{}", free_port()), dir.path(), &[]);
    let runner = Proc::runner(&format!("{},{}", a.addr, b.addr), "r1", dir.path());

    // Leading without an engine: not ready, and it says why.
    let mut said = String::new();
    for _ in 0..100 {
        let (code, body) = http_get(&http_a, "/readyz");
        if code == 503 {
            said = body;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(said.contains("the engine cannot start"), "/readyz of the engineless leader: {said:?}");
    assert_eq!(http_get(&http_a, "/livez").0, 200, "alive all the same");

    // It steps down; the other replica leads and runs the task.
    let addrs = [a.addr.clone(), b.addr.clone()];
    let engineless = std::time::Instant::now();
    wait_leader(&addrs, Duration::from_secs(90), |s| s.leader_id == "cpb").await;
    // Meanwhile the runner, sent back to the engineless leader by itself,
    // backed off instead of asking it 80-90 times a second.
    let redirects = runner.log_text().matches("not the leader; redirected").count();
    let secs = engineless.elapsed().as_secs_f64();
    println!("{redirects} redirects in {secs:.1} s without a leader engine");
    assert!((redirects as f64) < 5.0 * secs + 10.0, "{redirects} redirects in {secs:.0} s");
    apply(&b.addr, serde_json::json!({"task_id": "tick", "agent_id": "ok_agent", "trigger": {"type": "interval", "every": "2s"}})).await;
    wait_run(&b.addr, "tick", Duration::from_secs(30), |r| status(r) == pb::RunStatus::Succeeded).await;
    assert!(a.log_text().contains("stepping down so another replica can lead"), "the step-down is logged");
}
