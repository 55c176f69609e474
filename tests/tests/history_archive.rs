//! Issue 35, acceptances 2 and 3: finished runs move to PostgreSQL.
//!
//! A cluster on a real etcd with `--history postgres://…` (a real
//! PostgreSQL, started here): 2 replicas, a runner, 60 tasks every second
//! for about 75 s; the leader is killed -9 twice, and PostgreSQL is away
//! for 30 s under the load (hung — stopped with its connections open —
//! for 18 s, then killed for 12 s). While it is away scheduling goes on, the runs
//! wait in etcd, and the leader's `/readyz` and
//! `punchclock_history_outbox_runs` say so. Afterwards: every slot of the
//! window has exactly one record in PostgreSQL and none twice, etcd holds
//! no finished run's record, and `runs get` of the window's first run
//! answers from PostgreSQL.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use chrono::{DateTime, Utc};
use punchclock_control_plane::model::{RunRecord, RunStatus};
use punchclock_control_plane::repo::history::postgres::{PgHistory, PgSpec};
use punchclock_control_plane::repo::history::{HistoryQuery, scan};
use punchclock_control_plane::store::KvStore;
use punchclock_proto::v1 as pb;
use punchclock_tests::etcd::{Etcd, free_port};
use punchclock_tests::postgres::Postgres;
use punchclock_tests::{
    KeepLogsOnPanic, Proc, apply_all, at, cli, http_get, http_post, list_runs, status, tasks, wait_engine, wait_leader,
};

const TASKS: usize = 60;

/// Runs of the store that are finished (their records still in etcd).
async fn finished_in_etcd(etcd: &Etcd) -> Vec<String> {
    let store = etcd.connect().await.expect("etcd");
    let (kvs, _) = store.range("/punchclock/runs/").await.expect("range");
    kvs.iter()
        .filter_map(|kv| serde_json::from_slice::<RunRecord>(&kv.value).ok())
        .filter(|r| r.status.is_terminal() && !r.holds_agent())
        .map(|r| r.run_id)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finished_runs_move_to_postgres_through_failovers_and_an_outage() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "history_archive");
    let Some(mut pg) = Postgres::start().await else {
        punchclock_tests::skip("history_archive", "PUNCHCLOCK_SKIP_POSTGRES_TESTS", "PostgreSQL is not installed");
        return;
    };
    let etcd = Etcd::start(1).await;
    let url = pg.url();
    let ports = [free_port(), free_port()];
    let http = [free_port(), free_port()];
    let start = |i: usize| {
        let h = format!("127.0.0.1:{}", http[i]);
        Proc::server_with(&etcd.store_url(), &format!("cp{i}"), ports[i], dir.path(), &[], &["--history", &url, "--http-listen", &h])
    };
    let mut servers: Vec<Proc> = (0..2).map(start).collect();
    let addrs: Vec<String> = servers.iter().map(|s| s.addr.clone()).collect();
    let _runner = Proc::runner(&addrs.join(","), "r1", dir.path());
    let first = wait_leader(&addrs, Duration::from_secs(30), |_| true).await;
    let specs = (0..TASKS).map(|i| {
        serde_json::json!({"task_id": format!("arc{i:02}"), "agent_id": "true_agent", "trigger": {"type": "interval", "every": "1s"},
                           "execution": {"concurrency_limit": 4}})
    });
    apply_all(&tasks(&first.leader_address).await, specs).await;
    // A webhook task: while PostgreSQL is away a new delivery id cannot be
    // told apart from an archived one, so it is refused for a retry.
    apply_all(
        &tasks(&first.leader_address).await,
        std::iter::once(serde_json::json!({"task_id": "arc_hook", "agent_id": "true_agent",
                                           "trigger": {"type": "webhook", "path": "/hooks/arc", "auth": "none"}})),
    )
    .await;

    // Two leader kills.
    let mut last_token = 0;
    for k in 0..2 {
        tokio::time::sleep(Duration::from_secs(10)).await;
        let s = wait_leader(&addrs, Duration::from_secs(30), |s| s.fencing_token != last_token).await;
        last_token = s.fencing_token;
        wait_engine(&s.leader_address).await;
        let i = addrs.iter().position(|a| *a == s.leader_address).expect("leader is ours");
        servers[i].kill9();
        servers[i] = start(i);
        println!("kill {k}: cp{i} (token {})", s.fencing_token);
    }
    tokio::time::sleep(Duration::from_secs(8)).await;

    // PostgreSQL away for 30 s under the load: hung for 18 s (stopped,
    // its connections open and silent), then gone for 12 s (killed).
    let leader = wait_leader(&addrs, Duration::from_secs(30), |s| s.fencing_token != last_token).await;
    let i = addrs.iter().position(|a| *a == leader.leader_address).expect("leader is ours");
    let leader_http = format!("127.0.0.1:{}", http[i]);
    let says_why = || {
        let (_, ready) = http_get(&leader_http, "/readyz");
        let (_, metrics) = http_get(&leader_http, "/metrics");
        let waiting = metrics
            .lines()
            .find(|l| l.starts_with("punchclock_history_outbox_runs "))
            .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
            .unwrap_or(0.0);
        ready.contains("history archive unreachable") && waiting > 0.0 && metrics.contains("punchclock_history_archive_up 0")
    };
    for (phase, secs) in [("hung", 18), ("gone", 12)] {
        if phase == "hung" {
            pg.pause();
        } else {
            pg.resume();
            pg.kill();
        }
        let outage = tokio::time::Instant::now();
        let mut said = false;
        while outage.elapsed() < Duration::from_secs(secs) {
            said |= says_why();
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        assert!(said, "PostgreSQL {phase}: /readyz and the outbox gauge say why");
        if phase == "gone" {
            let (code, body) = http_post(&leader_http, "/hooks/arc", &[("Idempotency-Key", "away-1")], Some(b"{}"));
            assert_eq!(code, 503, "a delivery PostgreSQL would have to vouch for is refused for a retry: {body}");
        }
    }
    pg.restart().await;
    tokio::time::sleep(Duration::from_secs(10)).await;

    // The window ends: the schedule stops, every run ends.
    let end = wait_leader(&addrs, Duration::from_secs(30), |_| true).await;
    let leader = end.leader_address.clone();
    for i in 0..TASKS {
        tasks(&leader).await.pause_task(pb::PauseTaskRequest { task_id: format!("arc{i:02}") }).await.expect("pause");
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        let open = list_runs(&leader, "")
            .await
            .into_iter()
            .filter(|r| matches!(status(r), pb::RunStatus::Running | pb::RunStatus::Pending | pb::RunStatus::Retrying))
            .count();
        let left = finished_in_etcd(&etcd).await.len();
        if open == 0 && left == 0 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{open} runs open and {left} finished runs still in etcd");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    // The archive back: every replica says so (a follower has nothing
    // waiting, and reports the archive up rather than an alarming 0).
    for port in &http {
        let (_, metrics) = http_get(&format!("127.0.0.1:{port}"), "/metrics");
        assert!(metrics.contains("punchclock_history_archive_up 1"), "replica on :{port} reports the archive up once drained");
    }

    // Every slot: exactly one record in PostgreSQL.
    let history = PgHistory::connect(&PgSpec { url: pg.url(), password_file: None, ca_file: None }).await.expect("postgres");
    let mut all: Vec<RunRecord> = Vec::new();
    scan(&history, &HistoryQuery { limit: 1000, ..HistoryQuery::default() }, |r| all.push(r)).await.expect("scan");
    let ids: HashSet<&str> = all.iter().map(|r| r.run_id.as_str()).collect();
    assert_eq!(ids.len(), all.len(), "a run recorded twice");
    let mut by_task: HashMap<&str, Vec<&RunRecord>> = HashMap::new();
    for r in &all {
        by_task.entry(r.task_id.as_str()).or_default().push(r);
    }
    let mut slots = 0;
    for i in 0..TASKS {
        let id = format!("arc{i:02}");
        let task = tasks(&leader).await.get_task(pb::GetTaskRequest { task_id: id.clone() }).await.expect("task").into_inner();
        let created = at(&task.created_at).expect("created");
        let last = at(&task.last_slot_at).expect("the task fired");
        let runs = by_task.get(id.as_str()).cloned().unwrap_or_default();
        let mut slot = DateTime::<Utc>::from_timestamp(created.timestamp() + 1, 0).expect("slot");
        while slot <= last {
            let covering = runs
                .iter()
                .filter(|r| {
                    r.scheduled_at == slot
                        || (r.status == RunStatus::Skipped
                            && r.missed_from.zip(r.missed_until).is_some_and(|(f, u)| f <= slot && slot <= u))
                })
                .count();
            assert_eq!(covering, 1, "{id}: slot {slot} has {covering} records in PostgreSQL");
            slots += 1;
            slot += chrono::Duration::seconds(1);
        }
    }
    assert!(finished_in_etcd(&etcd).await.is_empty(), "etcd holds no finished run's record");

    // The window's first run answers from PostgreSQL.
    let first_run = all.iter().min_by_key(|r| (r.scheduled_at, r.run_id.clone())).expect("runs");
    let store = etcd.connect().await.expect("etcd");
    assert!(store.get(&format!("/punchclock/runs/{}", first_run.run_id)).await.expect("get").is_none(), "not in etcd");
    let got: serde_json::Value = serde_json::from_str(&cli(&leader, &["runs", "get", &first_run.run_id])).expect("runs get JSON");
    assert_eq!(got["run_id"], first_run.run_id.as_str());
    println!("history archive: {} runs of {slots} slots in PostgreSQL, none in etcd, through 2 leader kills and a 30 s outage", all.len());
}
