//! Issue 37, acceptance: a 30-day hourly backfill (720 slots) of a task
//! with 100 records in the range, `missing`, on etcd with 3 replicas, its
//! leader killed (SIGKILL) in the middle: exactly 620 new runs, no slot
//! twice, and never more than `max_concurrent: 3` agents alive across the
//! failover — the new leader goes on from the cursor the old one committed
//! with each run.

use std::collections::BTreeSet;
use std::time::Duration;

use chrono::{DateTime, DurationRound, Utc};
use punchclock_proto::v1 as pb;
use punchclock_tests::etcd::{Etcd, free_port};
use punchclock_tests::{KeepLogsOnPanic, Proc, apply, at, list_runs, max_live_agents_until, tasks, wait_engine, wait_leader};

fn req(from: DateTime<Utc>, to: DateTime<Utc>, max: u32) -> pb::BackfillTaskRequest {
    pb::BackfillTaskRequest {
        task_id: "hourly".into(),
        from: Some(punchclock_proto::time::to_timestamp(from)),
        to: Some(punchclock_proto::time::to_timestamp(to)),
        reprocess: "missing".into(),
        max_concurrent: max,
        ..Default::default()
    }
}

async fn get(addrs: &[String], id: &str) -> pb::Backfill {
    loop {
        for a in addrs {
            // A replica killed a moment ago refuses connections: ask the next.
            if let Ok(Some(mut c)) = tokio::time::timeout(Duration::from_secs(2), punchclock_tests::try_tasks(a)).await
                && let Ok(Ok(b)) =
                    tokio::time::timeout(Duration::from_secs(5), c.get_backfill(pb::GetBackfillRequest { id: id.into() })).await
            {
                return b.into_inner();
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backfill_goes_on_from_its_cursor_across_a_leader_kill() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _keep = KeepLogsOnPanic::new(dir.path(), "ha_backfill");
    let etcd = Etcd::start(1).await;
    let ports = [free_port(), free_port(), free_port()];
    let start = |i: usize| Proc::server(&etcd.store_url(), &format!("cp{i}"), ports[i], dir.path());
    let mut servers: Vec<Proc> = (0..3).map(start).collect();
    let addrs: Vec<String> = servers.iter().map(|s| s.addr.clone()).collect();
    let _runner = Proc::runner(&addrs.join(","), "r1", dir.path());
    let s = wait_leader(&addrs, Duration::from_secs(30), |_| true).await;
    wait_engine(&s.leader_address).await;
    apply(
        &s.leader_address,
        serde_json::json!({"task_id": "hourly", "agent_id": "backfill_agent",
        "trigger": {"type": "cron", "expr": "0 0 * * * *"},
        "execution": {"overlap_policy": "queue", "concurrency_limit": 10}}),
    )
    .await;
    let hour = chrono::Duration::hours(1);
    let h0 = (Utc::now() - chrono::Duration::days(31)).duration_trunc(hour).expect("trunc");
    let b = tasks(&s.leader_address).await.backfill_task(req(h0 + hour * 500, h0 + hour * 599, 4)).await.expect("first").into_inner();
    let first = b.backfill.expect("started").id;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        let b = get(&addrs, &first).await;
        if b.state == "done" {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the first backfill ends: {b:?}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }

    let b = tasks(&s.leader_address).await.backfill_task(req(h0, h0 + hour * 719, 3)).await.expect("backfill").into_inner();
    let id = b.backfill.expect("started").id;
    let run = async {
        // Half way, the leader is killed.
        while get(&addrs, &id).await.created < 250 {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let leader = wait_leader(&addrs, Duration::from_secs(30), |_| true).await;
        let i = addrs.iter().position(|a| *a == leader.leader_address).expect("ours");
        servers[i].kill9();
        println!("killed the leader cp{i} (token {}) at {:?}", leader.fencing_token, get(&addrs, &id).await);
        servers[i] = start(i);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(300);
        loop {
            let b = get(&addrs, &id).await;
            if b.state == "done" {
                return b;
            }
            assert!(tokio::time::Instant::now() < deadline, "the backfill goes on under the new leader: {b:?}");
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    };
    let (most, done) = max_live_agents_until("pc-backfill-agent", run).await;
    assert!(most <= 3, "max_concurrent 3 across the failover: {most} agents alive at once");
    assert_eq!((done.planned, done.created, done.left, done.remaining), (720, 620, 100, 0), "{done:?}");
    let leader = wait_leader(&addrs, Duration::from_secs(30), |_| true).await;
    let all = list_runs(&leader.leader_address, "hourly").await;
    assert_eq!(all.len(), 720, "one record per slot");
    let slots: BTreeSet<DateTime<Utc>> = all.iter().filter_map(|r| at(&r.scheduled_at)).collect();
    assert_eq!(slots.len(), 720, "no slot twice");
    assert_eq!(all.iter().filter(|r| r.backfill_id == id).count(), 620, "exactly 620 new runs");
}
