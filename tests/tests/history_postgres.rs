//! Issue 35: the history store on a real PostgreSQL (Debian's package,
//! started by the test on a free port): records upserted by run id, read
//! back a page at a time by the keyset (slot, run id) in either order with
//! every filter a listing takes, counted, found by id, and dropped by
//! month partition; the schema's migrations apply once, also when two
//! control planes start at once.

use std::collections::HashSet;

use chrono::{DateTime, Duration, Utc};
use punchclock_control_plane::model::run::TriggerKind;
use punchclock_control_plane::model::{RunRecord, RunStatus};
use punchclock_control_plane::repo::history::postgres::{PgHistory, PgSpec};
use punchclock_control_plane::repo::history::{Count, HistoryQuery, HistoryStore, scan};
use punchclock_tests::postgres::Postgres;

fn run(i: i64, t0: DateTime<Utc>) -> RunRecord {
    let task = format!("t{}", i % 3);
    // Two runs per slot (ties are ordered by run id); three months.
    let at = t0 + Duration::hours(i / 2 * 20);
    let kind = if i % 5 == 0 { TriggerKind::Webhook } else { TriggerKind::Cron };
    let mut r = RunRecord::pending(format!("{task}.r{:05}", 99_999 - i), &task, "a", kind, at, at);
    r.status = if i % 7 == 0 { RunStatus::Failed } else { RunStatus::Succeeded };
    r.finished_at = Some(at + Duration::seconds(3));
    r
}

async fn read_all(h: &PgHistory, q: HistoryQuery) -> Vec<String> {
    let mut out = Vec::new();
    scan(h, &q, |r| out.push(r.run_id)).await.expect("scan");
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_postgres_history_pages_filters_and_drops_by_month() {
    let Some(pg) = Postgres::start().await else {
        punchclock_tests::skip("history_postgres", "PUNCHCLOCK_SKIP_POSTGRES_TESTS", "PostgreSQL is not installed");
        return;
    };
    let spec = PgSpec { url: pg.url(), password_file: None, ca_file: None };
    // Two replicas migrating at once: one schema.
    let (a, b) = tokio::join!(PgHistory::connect(&spec), PgHistory::connect(&spec));
    let (h, _) = (a.expect("connect"), b.expect("connect twice"));
    let t0: DateTime<Utc> = "2026-10-01T00:00:00Z".parse().expect("t");
    let runs: Vec<RunRecord> = (0..240).map(|i| run(i, t0)).collect();
    for chunk in runs.chunks(100) {
        h.record(chunk).await.expect("record");
    }
    // Again, with a change: an upsert, not a second record.
    let mut changed = runs[3].clone();
    changed.status = RunStatus::Cancelled;
    h.record(&[changed.clone()]).await.expect("record again");
    let mut want = runs.clone();
    want[3] = changed;
    want.sort_by(|a, b| (a.scheduled_at, &a.run_id).cmp(&(b.scheduled_at, &b.run_id)));
    let ids = |rs: &[&RunRecord]| rs.iter().map(|r| r.run_id.clone()).collect::<Vec<_>>();
    let all: Vec<&RunRecord> = want.iter().collect();

    assert_eq!(read_all(&h, HistoryQuery { limit: 7, ..Default::default() }).await, ids(&all));
    let mut newest = ids(&all);
    newest.reverse();
    assert_eq!(read_all(&h, HistoryQuery { limit: 50, newest_first: true, ..Default::default() }).await, newest);
    let (from, to) = (t0 + Duration::days(20), t0 + Duration::days(45));
    let window: Vec<&RunRecord> = want.iter().filter(|r| r.scheduled_at >= from && r.scheduled_at < to).collect();
    assert!(!window.is_empty());
    assert_eq!(read_all(&h, HistoryQuery { from: Some(from), to: Some(to), limit: 9, ..Default::default() }).await, ids(&window));
    let q = HistoryQuery {
        task_prefix: "t1".into(),
        status: Some(RunStatus::Succeeded),
        trigger: Some(TriggerKind::Cron),
        from: Some(from),
        limit: 4,
        newest_first: true,
        ..Default::default()
    };
    let mut filtered: Vec<&RunRecord> = want
        .iter()
        .filter(|r| r.task_id == "t1" && r.status == RunStatus::Succeeded && r.trigger == TriggerKind::Cron && r.scheduled_at >= from)
        .collect();
    filtered.reverse();
    assert_eq!(read_all(&h, q.clone()).await, ids(&filtered));
    assert_eq!(h.count(&q).await.expect("count"), Count { runs: filtered.len() as u64, exact: true });
    let one_task: Vec<&RunRecord> = want.iter().filter(|r| r.task_id == "t2").collect();
    assert_eq!(read_all(&h, HistoryQuery { task_id: "t2".into(), limit: 1000, ..Default::default() }).await, ids(&one_task));
    // A prefix with LIKE's wildcards matches them literally.
    assert!(read_all(&h, HistoryQuery { task_prefix: "t_".into(), limit: 10, ..Default::default() }).await.is_empty());

    let got = h.get(&runs[3].run_id).await.expect("get").expect("found");
    assert_eq!(got.status, RunStatus::Cancelled);
    assert!(h.get("t0.nope").await.expect("get").is_none());

    // Retention drops whole months: October goes, November and later stay.
    let dropped = h.drop_partitions_before("2026-11-01T00:00:00Z".parse().expect("t")).await.expect("drop");
    assert_eq!(dropped, vec!["punchclock_runs_y2026m10".to_string()]);
    let left: HashSet<String> = read_all(&h, HistoryQuery { limit: 1000, ..Default::default() }).await.into_iter().collect();
    let november: DateTime<Utc> = "2026-11-01T00:00:00Z".parse().expect("t");
    assert_eq!(left, want.iter().filter(|r| r.scheduled_at >= november).map(|r| r.run_id.clone()).collect());
    // A record of a dropped month comes back into a new partition.
    h.record(&[runs[0].clone()]).await.expect("record after drop");
    assert!(h.get(&runs[0].run_id).await.expect("get").is_some());
}

/// A database with a linguistic collation (ICU's en-US, as a server
/// initialised with `en_US.UTF-8` or a managed PostgreSQL has by default):
/// ids still page in byte order, as the store's keys and the merge of live
/// and archived runs sort them. Before the ids' columns were `COLLATE "C"`,
/// `Ab.*` sorted after `aa.*` here and pages that split a slot lost runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ids_page_in_byte_order_under_a_linguistic_collation() {
    let Some(pg) = Postgres::start().await else {
        punchclock_tests::skip("history_postgres", "PUNCHCLOCK_SKIP_POSTGRES_TESTS", "PostgreSQL is not installed");
        return;
    };
    let url = pg.create_database("icu", "TEMPLATE template0 LOCALE_PROVIDER icu ICU_LOCALE 'en-US' LOCALE 'C'");
    let h = PgHistory::connect(&PgSpec { url, password_file: None, ca_file: None }).await.expect("connect");
    let t0: DateTime<Utc> = "2026-12-07T10:00:00Z".parse().expect("t");
    let mut runs = Vec::new();
    for task in ["Ab", "aa", "B-c", "b", "load", "load_x", "load.y", "a b"] {
        for k in 0..3 {
            let at = t0 + Duration::seconds(k);
            let mut r = RunRecord::pending(format!("{task}.s{k}"), task, "a", TriggerKind::Interval, at, at);
            r.status = RunStatus::Succeeded;
            runs.push(r);
        }
    }
    h.record(&runs).await.expect("record");
    let mut want: Vec<(DateTime<Utc>, String)> = runs.iter().map(|r| (r.scheduled_at, r.run_id.clone())).collect();
    want.sort();
    let oldest: Vec<String> = want.iter().map(|(_, id)| id.clone()).collect();
    let newest: Vec<String> = oldest.iter().rev().cloned().collect();
    for limit in 1..=5 {
        assert_eq!(read_all(&h, HistoryQuery { limit, ..Default::default() }).await, oldest, "oldest first, pages of {limit}");
        assert_eq!(
            read_all(&h, HistoryQuery { limit, newest_first: true, ..Default::default() }).await,
            newest,
            "newest first, pages of {limit}"
        );
    }
    let prefixed: Vec<String> = oldest.iter().filter(|id| id.starts_with("load")).cloned().collect();
    assert_eq!(read_all(&h, HistoryQuery { task_prefix: "load".into(), limit: 2, ..Default::default() }).await, prefixed);
}
