//! The history of a cluster whose finished runs move to an archive
//! (PostgreSQL): runs still in the store (open, or finished and not yet
//! moved) and runs in the archive read as one. A page merges both sources'
//! pages by the keyset; a run in both (moved, not yet deleted from the
//! store) is given once.

use std::collections::HashSet;
use std::sync::Arc;

use async_trait::async_trait;

use super::kv::KvHistory;
use super::{Count, Cursor, HistoryPage, HistoryQuery, HistoryStore};
use crate::error::Result;
use crate::model::RunRecord;

/// [`HistoryStore`] over the store's runs and an archive.
pub struct TieredHistory {
    live: KvHistory,
    archive: Arc<dyn HistoryStore>,
}

impl TieredHistory {
    /// The store's runs (`live`) before `archive`'s.
    pub fn new(live: KvHistory, archive: Arc<dyn HistoryStore>) -> TieredHistory {
        TieredHistory { live, archive }
    }

    /// The archive.
    pub fn archive(&self) -> &Arc<dyn HistoryStore> {
        &self.archive
    }
}

/// The keyset position of a run in `q`'s order (larger: later in the page).
fn key(r: &RunRecord) -> (chrono::DateTime<chrono::Utc>, &str) {
    (r.scheduled_at, r.run_id.as_str())
}

/// Merges two pages of the same query: the runs up to where both sources
/// are known (a source with more to give is known only up to its page's
/// end), at most `limit`, and where the next page starts.
fn merge(q: &HistoryQuery, a: HistoryPage, b: HistoryPage) -> HistoryPage {
    let later = |x: (chrono::DateTime<chrono::Utc>, &str), y: (chrono::DateTime<chrono::Utc>, &str)| {
        if q.newest_first { x < y } else { x > y }
    };
    // The horizon: the earliest (in order) end of a source with more.
    let horizon: Option<Cursor> = [&a.next, &b.next]
        .into_iter()
        .flatten()
        .cloned()
        .reduce(|x, y| if later((x.slot, x.run_id.as_str()), (y.slot, y.run_id.as_str())) { y } else { x });
    let mut all: Vec<RunRecord> = a.runs.into_iter().chain(b.runs).collect();
    all.sort_by(|x, y| {
        let o = key(x).cmp(&key(y));
        if q.newest_first { o.reverse() } else { o }
    });
    let mut seen = HashSet::new();
    all.retain(|r| seen.insert(r.run_id.clone()));
    if let Some(h) = &horizon {
        all.retain(|r| !later(key(r), (h.slot, h.run_id.as_str())));
    }
    let limit = q.limit.max(1);
    let more = all.len() > limit;
    all.truncate(limit);
    let next = if more || (all.len() == limit && horizon.is_some()) { all.last().map(Cursor::of) } else { horizon };
    HistoryPage { runs: all, next }
}

#[async_trait]
impl HistoryStore for TieredHistory {
    fn kind(&self) -> &'static str {
        self.archive.kind()
    }

    async fn record(&self, runs: &[RunRecord]) -> Result<()> {
        self.archive.record(runs).await
    }

    async fn get(&self, run_id: &str) -> Result<Option<RunRecord>> {
        match self.live.get(run_id).await? {
            Some(r) => Ok(Some(r)),
            None => self.archive.get(run_id).await,
        }
    }

    async fn page(&self, q: &HistoryQuery) -> Result<HistoryPage> {
        let (a, b) = tokio::try_join!(self.live.page(q), self.archive.page(q))?;
        Ok(merge(q, a, b))
    }

    /// The sum (a run being moved may count twice: then not exact).
    async fn count(&self, q: &HistoryQuery) -> Result<Count> {
        let (a, b) = tokio::try_join!(self.live.count(q), self.archive.count(q))?;
        Ok(Count { runs: a.runs + b.runs, exact: a.exact && b.exact && a.runs == 0 })
    }

    async fn expire_before(&self, cutoff: chrono::DateTime<chrono::Utc>) -> Result<u64> {
        self.archive.expire_before(cutoff).await
    }

    async fn contains(&self, run_ids: &[String]) -> Result<Vec<bool>> {
        self.archive.contains(run_ids).await
    }
}

#[cfg(test)]
mod tests {
    use chrono::{DateTime, Utc};

    use super::*;
    use crate::model::run::TriggerKind;

    fn r(s: i64, id: &str) -> RunRecord {
        let t = DateTime::<Utc>::from_timestamp(s, 0).expect("t");
        RunRecord::pending(id.into(), "t", "a", TriggerKind::Cron, t, t)
    }

    #[test]
    fn a_merged_page_stops_where_a_source_with_more_is_known() {
        let q = HistoryQuery { limit: 3, ..HistoryQuery::default() };
        // Source a has more after t.3; b gave all it has.
        let a = HistoryPage { runs: vec![r(1, "t.1"), r(3, "t.3")], next: Some(Cursor::of(&r(3, "t.3"))) };
        let b = HistoryPage { runs: vec![r(2, "t.2"), r(4, "t.4"), r(3, "t.3")], next: None };
        let m = merge(&q, a, b);
        let ids: Vec<&str> = m.runs.iter().map(|r| r.run_id.as_str()).collect();
        assert_eq!(ids, vec!["t.1", "t.2", "t.3"], "t.4 waits: a may have runs before it");
        assert_eq!(m.next, Some(Cursor::of(&r(3, "t.3"))));
        // Both done: everything, no next.
        let m = merge(&q, HistoryPage { runs: vec![r(5, "t.5")], next: None }, HistoryPage { runs: vec![r(4, "t.4")], next: None });
        assert_eq!((m.runs.len(), m.next), (2, None));
        // Newest first: the horizon is the later end.
        let q = HistoryQuery { limit: 10, newest_first: true, ..HistoryQuery::default() };
        let a = HistoryPage { runs: vec![r(9, "t.9"), r(7, "t.7")], next: Some(Cursor::of(&r(7, "t.7"))) };
        let b = HistoryPage { runs: vec![r(8, "t.8"), r(6, "t.6")], next: None };
        let m = merge(&q, a, b);
        assert_eq!(m.runs.iter().map(|r| r.run_id.as_str()).collect::<Vec<_>>(), vec!["t.9", "t.8", "t.7"]);
        assert_eq!(m.next, Some(Cursor::of(&r(7, "t.7"))));
    }
}
