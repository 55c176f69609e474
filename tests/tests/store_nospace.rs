//! Issue 19, finding 6: etcd out of space (its `NOSPACE` alarm, past
//! `--quota-backend-bytes`) left `/readyz` saying ready with no leader, and
//! the API saying only "not the leader". On a real etcd with a 24 MiB
//! quota, filled with run records:
//!
//! - `/readyz` answers 503 naming the alarm and what to do; a write's error
//!   names it too;
//! - `punchclock runs prune` runs while the alarm is on (no leader can be
//!   elected): it deletes the runs beyond their task's history and says
//!   what else frees the space;
//! - done what it says (defragment, disarm — here with etcd's client API,
//!   as `etcdctl defrag` and `etcdctl alarm disarm` do), the cluster leads
//!   and schedules again.

use std::time::Duration;

use punchclock_control_plane::model::run::{TriggerKind, slot_run_id};
use punchclock_control_plane::model::{RunRecord, RunStatus};
use punchclock_control_plane::repo::{Keys, encode_run};
use punchclock_control_plane::store::KvStore;
use punchclock_proto::v1 as pb;
use punchclock_tests::etcd::{Etcd, free_port};
use punchclock_tests::{KeepLogsOnPanic, Proc, apply, cli_command, http_get, tasks, wait_leader};
use serde_json::json;

async fn readyz(server: &Proc) -> (u16, serde_json::Value) {
    let (code, body) = http_get(&server.http_addr(), "/readyz");
    (code, serde_json::from_str(&body).unwrap_or(serde_json::Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_etcd_is_named_in_readiness_and_can_be_pruned_without_a_leader() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "store_nospace");
    let etcd = Etcd::start_args(1, &["--quota-backend-bytes", &(24 * 1024 * 1024).to_string()]).await;
    let server = Proc::server_with(&etcd.store_url(), "cp0", free_port(), dir.path(), &[], &["--http-listen", "127.0.0.1:0"]);
    wait_leader(std::slice::from_ref(&server.addr), Duration::from_secs(30), |_| true).await;
    apply(&server.addr, json!({"task_id": "hist", "agent_id": "true_agent", "history": {"keep_last": 5}})).await;
    assert_eq!(readyz(&server).await.0, 200);

    // Finished runs with 64 KiB tails until etcd says it is full.
    let store = etcd.connect().await.expect("etcd");
    let keys = Keys::default();
    let tail = "t".repeat(64 * 1024);
    let mut written = 0;
    let start = chrono::Utc::now() - chrono::Duration::days(1);
    for i in 0..10_000i64 {
        let slot = start + chrono::Duration::seconds(i);
        let mut run = RunRecord::pending(slot_run_id("hist", slot), "hist", "true_agent", TriggerKind::Cron, slot, slot);
        run.status = RunStatus::Succeeded;
        run.finished_at = Some(slot);
        run.stdout_tail = tail.clone();
        run.stderr_tail = tail.clone();
        match store.put(&keys.run(&run.run_id), encode_run(&run).expect("encode")).await {
            Ok(_) => written += 1,
            Err(e) => {
                assert!(e.to_string().contains("database space exceeded"), "{e}");
                break;
            }
        }
    }
    assert!(written > 10, "etcd took {written} runs before it was full");
    assert_eq!(store.alarms().await.expect("alarms"), vec!["NOSPACE".to_string()]);

    // Readiness names the alarm and what to do.
    let (code, body) = readyz(&server).await;
    assert_eq!(code, 503, "{body}");
    let reasons = body["reasons"].to_string();
    assert!(reasons.contains("NOSPACE") && reasons.contains("runs prune") && reasons.contains("defrag"), "{reasons}");
    // A write says so too.
    let e = tasks(&server.addr)
        .await
        .apply_task(pb::ApplyTaskRequest { spec_json: json!({"task_id": "new", "agent_id": "a"}).to_string(), dry_run: false, task: None })
        .await
        .expect_err("etcd is full");
    assert!(e.message().contains("database space exceeded") && e.message().contains("NOSPACE"), "{}", e.message());

    // Retention runs while the alarm is on.
    let out = cli_command(&server.addr).args(["runs", "prune", "--task", "hist"]).output().expect("prune");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "prune: {stderr}");
    assert!(stdout.contains(&format!("{} finished runs deleted, 5 runs kept", written - 5)), "{stdout}");
    assert!(stderr.contains("NOSPACE") && stderr.contains("defrag"), "the answer says what else to do: {stderr}");

    // The operator defragments and disarms, as the answer says.
    let mut client = etcd_client::Client::connect(etcd.endpoints(), None).await.expect("etcd client");
    client.defragment().await.expect("defrag");
    // The prune compacted past its own deletes: defragmenting gave the space
    // back (compacted only up to where the prune started, it kept every
    // deleted value and the alarm came back on the next write).
    let size = client.status().await.expect("status").db_size();
    assert!(size < 8 * 1024 * 1024, "etcd's database is {size} bytes after prune and defrag");
    // `etcdctl alarm disarm`: deactivate each member's alarm.
    let alarms = client.alarm(etcd_client::AlarmAction::Get, etcd_client::AlarmType::None, None).await.expect("alarm list");
    for a in alarms.alarms() {
        let mut o = etcd_client::AlarmOptions::new();
        o.with_member(a.member_id());
        client.alarm(etcd_client::AlarmAction::Deactivate, a.alarm(), Some(o)).await.expect("disarm");
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let (code, body) = readyz(&server).await;
        if code == 200 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "not ready again: {body}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    apply(&server.addr, json!({"task_id": "new", "agent_id": "a"})).await;
}
