//! Issue 21, tasks that follow tasks (`{type: after, task, status}`), with
//! 3 real control planes on etcd, a runner and agent processes:
//!
//! - A → B → C with A every 2 s, while the leader is killed (SIGKILL) 3
//!   times: C runs exactly once per run of A that succeeded (and B once per
//!   run of A), each carrying its upstream's run (`upstream.run_id`);
//! - a failed run of A leaves B a SKIPPED `upstream_unmet` record naming
//!   A's run and status, and C nothing;
//! - a cycle is refused at apply, naming it.

use std::collections::HashMap;
use std::time::Duration;

use punchclock_proto::v1 as pb;
use punchclock_tests::etcd::{Etcd, free_port};
use punchclock_tests::{KeepLogsOnPanic, Proc, apply, cli, list_runs, status, tasks, terminal, wait_leader, wait_run};
use serde_json::{Value, json};

fn upstream_of(r: &pb::Run) -> String {
    serde_json::from_str::<Value>(&r.upstream_json).ok().and_then(|u| u["run_id"].as_str().map(str::to_string)).unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chain_runs_once_per_upstream_run_across_leader_kills() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "chains");
    let etcd = Etcd::start(1).await;
    let ports = [free_port(), free_port(), free_port()];
    let start = |i: usize| Proc::server(&etcd.store_url(), &format!("cp{i}"), ports[i], dir.path());
    let mut servers: Vec<Proc> = (0..3).map(start).collect();
    let addrs: Vec<String> = servers.iter().map(|s| s.addr.clone()).collect();
    let _r1 = Proc::runner(&addrs.join(","), "r1", dir.path());
    let first = wait_leader(&addrs, Duration::from_secs(30), |_| true).await;
    let addr = first.leader_address.clone();
    let follow = |id: &str, up: &str, st: &str| {
        json!({"task_id": id, "agent_id": "event_agent", "trigger": {"type": "after", "task": up, "status": st},
               "execution": {"overlap_policy": "queue", "concurrency_limit": 4, "start_timeout_seconds": 600}})
    };
    // The followers first: A's first run has them.
    apply(&addr, follow("b", "a", "succeeded")).await;
    apply(&addr, follow("c", "b", "succeeded")).await;
    // A cycle is refused at apply, naming it; nothing is written.
    let mut t = tasks(&addr).await;
    let cyc = json!({"task_id": "a", "agent_id": "ok_agent", "triggers": [{"type": "after", "task": "c"}]});
    let err = t.apply_task(pb::ApplyTaskRequest { spec_json: cyc.to_string(), dry_run: false, task: None }).await.expect_err("a cycle");
    assert!(err.message().contains("a → b → c → a") || err.message().contains("cycle"), "{}", err.message());
    assert!(err.message().starts_with("triggers[0].task"), "{}", err.message());
    apply(
        &addr,
        json!({"task_id": "a", "agent_id": "ok_agent", "trigger": {"type": "interval", "every": "2s"},
                        "execution": {"misfire_policy": "run_all", "misfire_grace_seconds": 600}}),
    )
    .await;

    let mut leader = first;
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_secs(5)).await;
        let i = servers.iter().position(|s| s.addr == leader.leader_address).expect("leader is ours");
        servers[i].kill9();
        let others: Vec<String> = addrs.iter().filter(|a| **a != addrs[i]).cloned().collect();
        let old = leader.leader_id.clone();
        leader = wait_leader(&others, Duration::from_secs(30), |s| !s.leader_id.is_empty() && s.leader_id != old).await;
        servers[i] = start(i);
    }
    tokio::time::sleep(Duration::from_secs(4)).await;
    let addr = leader.leader_address.clone();
    cli(&addr, &["task", "pause", "a"]);
    // Everything settles: A's runs ended, and what follows them.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    let (a, b, c) = loop {
        let (a, b, c) = (list_runs(&addr, "a").await, list_runs(&addr, "b").await, list_runs(&addr, "c").await);
        let a_done: Vec<&pb::Run> = a.iter().filter(|r| status(r) == pb::RunStatus::Succeeded).collect();
        let b_done = b.iter().filter(|r| status(r) == pb::RunStatus::Succeeded).count();
        if a.iter().all(terminal) && b.iter().all(terminal) && c.iter().all(terminal) && b.len() >= a_done.len() && c.len() >= b_done {
            break (a, b, c);
        }
        assert!(tokio::time::Instant::now() < deadline, "the chain did not settle: a {} b {} c {}", a.len(), b.len(), c.len());
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let a_ok: Vec<&pb::Run> = a.iter().filter(|r| status(r) == pb::RunStatus::Succeeded).collect();
    assert!(a_ok.len() >= 8, "A ran only {} times", a_ok.len());
    // B: one per run of A that ran, each naming it; C: one per B.
    let count = |runs: &[pb::Run]| -> HashMap<String, usize> {
        let mut m = HashMap::new();
        for r in runs {
            *m.entry(upstream_of(r)).or_default() += 1;
        }
        m
    };
    let b_by_a = count(&b);
    let c_by_b = count(&c);
    for r in &a_ok {
        assert_eq!(b_by_a.get(&r.run_id), Some(&1), "B ran {:?} times after {}", b_by_a.get(&r.run_id), r.run_id);
    }
    let b_ok: Vec<&pb::Run> = b.iter().filter(|r| status(r) == pb::RunStatus::Succeeded).collect();
    assert_eq!(b_ok.len(), a_ok.len(), "B succeeded after each A");
    for r in &b_ok {
        assert_eq!(c_by_b.get(&r.run_id), Some(&1), "C ran {:?} times after {}", c_by_b.get(&r.run_id), r.run_id);
        let res: Value = serde_json::from_str(&r.result_json).expect("result");
        assert_eq!(res["upstream"]["task"], "a");
        assert_eq!(res["trigger"], "after");
    }
    assert_eq!(c.len(), b_ok.len(), "C exactly once per B");
    assert!(c.iter().all(|r| status(r) == pb::RunStatus::Succeeded), "{c:#?}");

    // A failed run of A: B records upstream_unmet, C gets nothing.
    apply(&addr, json!({"task_id": "x", "agent_id": "fail_agent"})).await;
    apply(&addr, follow("y", "x", "succeeded")).await;
    apply(&addr, follow("z", "y", "any")).await;
    cli(&addr, &["task", "trigger", "x", "--key", "boom"]);
    let y = wait_run(&addr, "y", Duration::from_secs(60), terminal).await;
    assert_eq!((status(&y), y.skip_reason.as_str()), (pb::RunStatus::Skipped, "upstream_unmet"), "{y:#?}");
    assert!(y.error.contains("x.manual-boom") && y.error.contains("FAILED"), "{}", y.error);
    assert!(list_runs(&addr, "z").await.is_empty(), "a SKIPPED record starts nothing");
}
