//! The history kept in the cluster's own store (embedded redb or etcd):
//! run records under `runs/`, read in slot order through the time index
//! (`hist/{slot}.{run}` and `hist-task/{task}/{slot}.{run}`, written in the
//! transaction that creates the run; see [`crate::repo::Keys::history`]).
//! Bounded by the tasks' retention: etcd's quota bounds it in turn (README
//! "Run history").
//!
//! A store written before the index (an earlier version) is read by
//! scanning every run until the leader has built the index once
//! ([`Repo::build_history_index`]; `meta/history-index` says `done`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};

use async_trait::async_trait;

use super::{Count, Cursor, HistoryPage, HistoryQuery, HistoryStore};
use crate::error::Result;
use crate::model::RunRecord;
use crate::repo::{Keys, Repo};

/// Index entries read per store request.
const INDEX_PAGE: usize = 256;
/// Index entries one page reads at most: a page of a rare status over a
/// long window ends short (with a cursor) rather than read the window.
const MAX_SCAN: usize = 16 * INDEX_PAGE;
/// Index entries a count reads before it answers with a lower bound.
const MAX_COUNT: u64 = 1_000_000;

/// [`HistoryStore`] over a [`Repo`].
pub struct KvHistory {
    repo: Repo,
    /// `meta/history-index` said `done` (it never goes back).
    whole: AtomicBool,
}

impl KvHistory {
    /// The history of `repo`'s store.
    pub fn new(repo: Repo) -> KvHistory {
        KvHistory { repo, whole: AtomicBool::new(false) }
    }

    /// Whether the time index covers every run.
    async fn index_whole(&self) -> Result<bool> {
        if self.whole.load(Ordering::Relaxed) {
            return Ok(true);
        }
        let whole = self.repo.history_index_whole().await?;
        self.whole.store(whole, Ordering::Relaxed);
        Ok(whole)
    }

    fn index_prefix(&self, q: &HistoryQuery) -> String {
        if q.task_id.is_empty() { self.repo.keys.history() } else { self.repo.keys.task_history(&q.task_id) }
    }

    /// Where a read of the index starts (exclusive): the cursor's entry,
    /// else the window's edge, else the end.
    fn start(&self, prefix: &str, q: &HistoryQuery) -> String {
        match (&q.after, q.newest_first) {
            (Some(c), _) => Keys::history_key(prefix, c.slot, &c.run_id),
            // `{from}` sorts before every entry of that slot.
            (None, false) => q.from.map(|f| Keys::history_key(prefix, f, "")).unwrap_or_default(),
            // `{to}` sorts after every entry of an earlier slot.
            (None, true) => q.to.map(|t| Keys::history_key(prefix, t, "")).unwrap_or_default(),
        }
    }

    /// The index path: entries in order from the start, their records
    /// read a batch at a time, at most [`MAX_SCAN`] entries.
    async fn index_page(&self, q: &HistoryQuery) -> Result<HistoryPage> {
        let prefix = self.index_prefix(q);
        let limit = q.limit.max(1);
        let mut cursor = self.start(&prefix, q);
        let (mut out, mut scanned) = (Vec::new(), 0);
        loop {
            let page = if q.newest_first {
                self.repo.store.range_page_rev(&prefix, &cursor, INDEX_PAGE, true).await?
            } else {
                self.repo.store.range_page(&prefix, &cursor, INDEX_PAGE, true).await?
            };
            let full = page.len() == INDEX_PAGE;
            let mut entries = Vec::new();
            let mut ended = !full;
            for kv in &page {
                let Some((slot, run_id)) = kv.key.strip_prefix(&prefix).and_then(Keys::history_parts) else { continue };
                let in_window = if q.newest_first { q.from.is_none_or(|f| slot >= f) } else { q.to.is_none_or(|t| slot < t) };
                if !in_window {
                    ended = true;
                    break;
                }
                entries.push((kv.key.clone(), Cursor { slot, run_id: run_id.to_string() }));
            }
            // Task ids have no `.`: a run id starts with its task's id.
            let wanted: Vec<&str> = entries.iter().map(|(_, c)| c.run_id.as_str()).filter(|id| id.starts_with(&q.task_prefix)).collect();
            let mut found: HashMap<String, RunRecord> =
                self.repo.get_runs(&wanted).await?.into_iter().map(|r| (r.run_id.clone(), r)).collect();
            for (i, (key, at)) in entries.iter().enumerate() {
                cursor.clone_from(key);
                scanned += 1;
                if let Some(run) = found.remove(&at.run_id).filter(|r| q.matches(r)) {
                    out.push(run);
                }
                let last_of_window = ended && i + 1 == entries.len();
                if out.len() == limit || scanned >= MAX_SCAN {
                    return Ok(HistoryPage { runs: out, next: (!last_of_window).then(|| at.clone()) });
                }
            }
            if ended {
                return Ok(HistoryPage { runs: out, next: None });
            }
        }
    }

    /// The path before the index is whole: every run read and sorted.
    async fn scan_page(&self, q: &HistoryQuery) -> Result<HistoryPage> {
        let mut runs = self.all_matching(q).await?;
        runs.retain(|r| q.in_range(r.scheduled_at, &r.run_id));
        let limit = q.limit.max(1);
        let more = runs.len() > limit;
        runs.truncate(limit);
        let next = if more { runs.last().map(Cursor::of) } else { None };
        Ok(HistoryPage { runs, next })
    }

    /// Every run of `q`'s filters, in its order (the scan path).
    async fn all_matching(&self, q: &HistoryQuery) -> Result<Vec<RunRecord>> {
        let (mut runs, _) = self.repo.list_runs(&q.task_id).await?;
        runs.retain(|r| q.matches(r));
        runs.sort_by(|a, b| (a.scheduled_at, &a.run_id).cmp(&(b.scheduled_at, &b.run_id)));
        if q.newest_first {
            runs.reverse();
        }
        Ok(runs)
    }
}

#[async_trait]
impl HistoryStore for KvHistory {
    fn kind(&self) -> &'static str {
        "kv"
    }

    /// The record is the run's own, written in its transactions: nothing
    /// more to keep.
    async fn record(&self, _runs: &[RunRecord]) -> Result<()> {
        Ok(())
    }

    async fn get(&self, run_id: &str) -> Result<Option<RunRecord>> {
        self.repo.get_run(run_id).await
    }

    async fn page(&self, q: &HistoryQuery) -> Result<HistoryPage> {
        if self.index_whole().await? { self.index_page(q).await } else { self.scan_page(q).await }
    }

    /// Exact from the index's keys alone when the query filters by task
    /// and window only; else reads the records; a lower bound past
    /// 1,000,000 entries.
    async fn count(&self, q: &HistoryQuery) -> Result<Count> {
        let q = HistoryQuery { after: None, limit: 1000, ..q.clone() };
        if !self.index_whole().await? {
            let runs = self.all_matching(&q).await?;
            return Ok(Count { runs: runs.iter().filter(|r| q.in_range(r.scheduled_at, &r.run_id)).count() as u64, exact: true });
        }
        let keys_only = q.task_prefix.is_empty() && q.status.is_none() && q.trigger.is_none() && q.event_key.is_empty();
        if !keys_only {
            let mut runs = 0;
            let mut q = q;
            loop {
                let page = self.index_page(&q).await?;
                runs += page.runs.len() as u64;
                match page.next {
                    Some(c) if runs < MAX_COUNT => q.after = Some(c),
                    Some(_) => return Ok(Count { runs, exact: false }),
                    None => return Ok(Count { runs, exact: true }),
                }
            }
        }
        let prefix = self.index_prefix(&q);
        let mut cursor = self.start(&prefix, &HistoryQuery { newest_first: false, ..q.clone() });
        let mut runs = 0u64;
        loop {
            let page = self.repo.store.range_page(&prefix, &cursor, INDEX_PAGE, true).await?;
            let full = page.len() == INDEX_PAGE;
            for kv in &page {
                let Some((slot, _)) = kv.key.strip_prefix(&prefix).and_then(Keys::history_parts) else { continue };
                if q.to.is_some_and(|t| slot >= t) {
                    return Ok(Count { runs, exact: true });
                }
                runs += 1;
            }
            match page.last() {
                Some(kv) if full && runs < MAX_COUNT => cursor.clone_from(&kv.key),
                _ => return Ok(Count { runs, exact: !full }),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use chrono::{DateTime, Utc};

    use super::*;
    use crate::election::Leadership;
    use crate::model::RunStatus;
    use crate::model::run::TriggerKind;
    use crate::repo::history::{Count, scan};
    use crate::repo::{Keys, StoreOp};
    use crate::store::embedded::EmbeddedStore;
    use crate::store::{KvStore, Txn, TxnOp};

    /// Issue 35: runs read by slot through the time index, a page at a
    /// time, within a window, of one task or all, pruned ones passed over;
    /// a store written before the index is read by scanning until the
    /// index is built, with the same answers.
    #[tokio::test]
    async fn runs_are_paged_by_slot_through_the_time_index() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Arc::new(EmbeddedStore::open(dir.path()).await.expect("open"));
        let repo = Repo::new(store.clone(), Keys::default());
        let lead = Leadership { token: 1, fence: Vec::new() };
        assert_eq!(
            repo.build_history_index(&lead, std::time::Duration::ZERO).await.expect("build"),
            0,
            "a new store's index is whole at once"
        );
        let t0: DateTime<Utc> = "2026-12-01T00:00:00Z".parse().expect("t");
        let secs = |s: i64| t0 + chrono::Duration::seconds(s);
        // Run ids do not sort by slot (an event's): the index does.
        let mut made = Vec::new();
        for i in 0..10i64 {
            let task = if i % 2 == 0 { "even" } else { "odd" };
            let mut r = RunRecord::pending(format!("{task}.{}", 99 - i), task, "a", TriggerKind::Manual, secs(i), secs(i));
            if i == 3 {
                r.status = RunStatus::Failed;
            }
            made.push(r.clone());
            repo.commit(&lead, vec![vec![StoreOp::CreateRun(Box::new(r))]]).await.expect("commit");
        }
        let history = KvHistory::new(repo.clone());
        let read_all = |q: HistoryQuery| {
            let history = &history;
            async move {
                let (mut q, mut all, mut pages) = (q, Vec::new(), 0);
                loop {
                    let page = history.page(&q).await.expect("page");
                    pages += 1;
                    all.extend(page.runs.into_iter().map(|r| r.run_id));
                    match page.next {
                        Some(n) => q.after = Some(n),
                        None => return (all, pages),
                    }
                }
            }
        };
        let ids = |rs: &[RunRecord]| rs.iter().map(|r| r.run_id.clone()).collect::<Vec<_>>();
        let rev = |v: Vec<String>| v.into_iter().rev().collect::<Vec<_>>();
        let window = |task: &str, limit, newest_first| HistoryQuery {
            task_id: task.into(),
            from: Some(secs(2)),
            to: Some(secs(7)),
            limit,
            newest_first,
            ..HistoryQuery::default()
        };
        let check = |pass: &'static str| {
            let (read_all, made) = (&read_all, &made);
            async move {
                let (all, pages) = read_all(HistoryQuery { limit: 3, ..Default::default() }).await;
                assert_eq!((all, pages), (ids(made), 4), "{pass}");
                let (newest, _) = read_all(HistoryQuery { limit: 4, newest_first: true, ..Default::default() }).await;
                assert_eq!(newest, rev(ids(made)), "{pass}");
                assert_eq!(read_all(window("", 2, true)).await.0, rev(ids(&made[2..7])), "{pass}");
                assert_eq!(read_all(window("", 2, false)).await.0, ids(&made[2..7]), "{pass}");
                let even_window: Vec<String> = ids(&made[2..7]).into_iter().filter(|id| id.starts_with("even")).collect();
                assert_eq!(read_all(window("even", 1, false)).await.0, even_window, "{pass}: one task's window");
                assert_eq!(read_all(window("even", 1, true)).await.0, rev(even_window), "{pass}");
                let odd: Vec<String> = ids(made).into_iter().filter(|id| id.starts_with("odd")).collect();
                assert_eq!(read_all(HistoryQuery { task_prefix: "od".into(), limit: 2, ..Default::default() }).await.0, odd, "{pass}");
                let failed = HistoryQuery { status: Some(RunStatus::Failed), limit: 5, ..Default::default() };
                assert_eq!(read_all(failed).await.0, vec![made[3].run_id.clone()], "{pass}");
            }
        };
        check("index").await;
        let q = window("", 10, false);
        assert_eq!(history.count(&q).await.expect("count"), Count { runs: 5, exact: true });
        let odd_count = HistoryQuery { task_prefix: "odd".into(), ..q.clone() };
        assert_eq!(history.count(&odd_count).await.expect("count"), Count { runs: 2, exact: true });
        let mut scanned = Vec::new();
        assert_eq!(scan(&history, &HistoryQuery { limit: 2, ..q }, |r| scanned.push(r.run_id)).await.expect("scan"), 5);
        assert_eq!(scanned, ids(&made[2..7]));
        // A run pruned since: passed over, and its entries swept.
        store.txn(Txn { success: vec![TxnOp::delete(repo.keys.run(&made[0].run_id))], ..Default::default() }).await.expect("delete");
        let (after_prune, _) = read_all(HistoryQuery { limit: 4, ..Default::default() }).await;
        assert_eq!(after_prune, ids(&made[1..]));
        let index_len = |prefix: String| {
            let store = store.clone();
            async move { store.range(&prefix).await.expect("range").0.len() }
        };
        assert_eq!((index_len(repo.keys.history()).await, index_len(repo.keys.task_history("even")).await), (10, 5));
        assert_eq!(repo.sweep_history_index(&lead).await.expect("sweep"), 1);
        assert_eq!((index_len(repo.keys.history()).await, index_len(repo.keys.task_history("even")).await), (9, 4));
        assert_eq!(repo.sweep_history_index(&lead).await.expect("sweep"), 0);
        made.remove(0);
        // A store written before the index (no entries, no `done`): read
        // by scanning, the same answers; then built once, and whole.
        let (kvs, _) = store.range(&repo.keys.history()).await.expect("range");
        let (tkvs, _) = store.range(&repo.keys.task_history("")).await.expect("range");
        let mut gone: Vec<TxnOp> = kvs.iter().chain(&tkvs).map(|kv| TxnOp::delete(kv.key.clone())).collect();
        gone.push(TxnOp::delete(repo.keys.history_index_state()));
        store.txn(Txn { success: gone, ..Default::default() }).await.expect("delete");
        let old = KvHistory::new(repo.clone());
        let (read_all, made_now) = (
            |q: HistoryQuery| {
                let old = &old;
                async move {
                    let mut q = q;
                    let mut all = Vec::new();
                    loop {
                        let page = old.page(&q).await.expect("page");
                        all.extend(page.runs.into_iter().map(|r| r.run_id));
                        match page.next {
                            Some(n) => q.after = Some(n),
                            None => return all,
                        }
                    }
                }
            },
            &made,
        );
        assert_eq!(read_all(HistoryQuery { limit: 4, ..Default::default() }).await, ids(made_now), "scan path");
        assert_eq!(read_all(HistoryQuery { limit: 3, newest_first: true, ..window("odd", 0, false) }).await, vec!["odd.94", "odd.96"]);
        assert_eq!(repo.build_history_index(&lead, std::time::Duration::ZERO).await.expect("build"), 9);
        assert_eq!(read_all(HistoryQuery { limit: 4, ..Default::default() }).await, ids(made_now), "index path");
        assert_eq!(repo.build_history_index(&lead, std::time::Duration::ZERO).await.expect("build"), 0, "once");

        // A leader of the earlier version again (a rolling upgrade): a run
        // written without entries, a pruned run's entries left behind. The
        // next term's build finds the run short of its entries and indexes
        // it; the orphans are swept.
        let late = RunRecord::pending("odd.late".into(), "odd", "a", TriggerKind::Manual, secs(20), secs(20));
        let pruned = &made[0];
        store
            .txn(Txn {
                success: vec![
                    TxnOp::put(repo.keys.run(&late.run_id), crate::repo::codec::encode(&late).expect("encode")),
                    TxnOp::delete(repo.keys.run(&pruned.run_id)),
                ],
                ..Default::default()
            })
            .await
            .expect("old leader's writes");
        assert!(!read_all(HistoryQuery { limit: 4, ..Default::default() }).await.contains(&late.run_id), "unseen before");
        assert_eq!(repo.build_history_index(&lead, std::time::Duration::ZERO).await.expect("build"), 9, "built again");
        let mut want = ids(&made[1..]);
        want.push(late.run_id.clone());
        assert_eq!(read_all(HistoryQuery { limit: 4, ..Default::default() }).await, want, "the late run is listed");
        assert_eq!(repo.build_history_index(&lead, std::time::Duration::ZERO).await.expect("build"), 0, "whole again");
    }
}
