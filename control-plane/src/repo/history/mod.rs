//! Run history: the records of runs, read a page at a time by slot, apart
//! from execution state (Temporal's `VisibilityManager` is the model:
//! records written, pages read, filters on what a user asks about).
//!
//! Module map:
//! - this file: [`HistoryStore`] (the seam), [`HistoryQuery`] and its
//!   [`Cursor`], page tokens ([`encode_token`], [`decode_token`]), [`scan`];
//! - [`kv`]: the history kept in the cluster's own store (embedded or
//!   etcd) through the time index `hist/` written in each run's
//!   creating transaction;
//! - [`postgres`]: finished runs in PostgreSQL, partitioned by month;
//! - [`tiered`]: the store's runs and an archive's read as one.
//!
//! Order is the keyset `(scheduled_at, run_id)`: a cursor names the last
//! run a page gave, so a page is found without an offset and runs written
//! meanwhile neither repeat nor shift a page.

pub mod kv;
pub mod postgres;
pub mod tiered;

use async_trait::async_trait;
use base64::Engine as _;
use chrono::{DateTime, Utc};
use sha2::Digest as _;

use crate::error::{Error, Result};
use crate::model::run::TriggerKind;
use crate::model::{RunRecord, RunStatus};

/// Where a page ends: the slot and run id of the last run it gave.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cursor {
    /// The run's slot (`scheduled_at`).
    pub slot: DateTime<Utc>,
    /// The run's id (ties of one slot in id order).
    pub run_id: String,
}

impl Cursor {
    /// The cursor just past `run` (a page that ended with it).
    pub fn of(run: &RunRecord) -> Cursor {
        Cursor { slot: run.scheduled_at, run_id: run.run_id.clone() }
    }
}

/// What a page of history holds: runs of a window and filters, in slot
/// order, after a cursor.
#[derive(Debug, Clone, Default)]
pub struct HistoryQuery {
    /// One task's runs (empty: any task).
    pub task_id: String,
    /// Runs of tasks whose id starts with this (empty: any).
    pub task_prefix: String,
    /// Slots from (inclusive).
    pub from: Option<DateTime<Utc>>,
    /// Slots until (exclusive).
    pub to: Option<DateTime<Utc>>,
    /// Runs in this state only.
    pub status: Option<RunStatus>,
    /// Runs of this trigger kind only.
    pub trigger: Option<TriggerKind>,
    /// Only runs an event with this id started (empty: any).
    pub event_key: String,
    /// Continue after this run (a previous page's last).
    pub after: Option<Cursor>,
    /// Runs at most (at least 1).
    pub limit: usize,
    /// Newest slot first (else oldest first).
    pub newest_first: bool,
}

impl HistoryQuery {
    /// Whether `run` passes the query's filters (not its window or cursor).
    pub fn matches(&self, run: &RunRecord) -> bool {
        (self.task_id.is_empty() || run.task_id == self.task_id)
            && run.task_id.starts_with(&self.task_prefix)
            && self.status.is_none_or(|s| run.status == s)
            && self.trigger.is_none_or(|k| run.trigger == k)
            && (self.event_key.is_empty() || run.event.as_ref().is_some_and(|e| e.key == self.event_key))
    }

    /// Whether a run at `(slot, run_id)` is inside the window and past the
    /// cursor, in the query's order.
    pub fn in_range(&self, slot: DateTime<Utc>, run_id: &str) -> bool {
        let in_window = self.from.is_none_or(|f| slot >= f) && self.to.is_none_or(|t| slot < t);
        let past = self.after.as_ref().is_none_or(|c| {
            let ord = (slot, run_id).cmp(&(c.slot, c.run_id.as_str()));
            if self.newest_first { ord.is_lt() } else { ord.is_gt() }
        });
        in_window && past
    }

    /// A digest of what the query selects (not its cursor or size): a
    /// page token is good only for the query that made it.
    fn fingerprint(&self) -> String {
        let text = format!(
            "{}\u{1f}{}\u{1f}{:?}\u{1f}{:?}\u{1f}{:?}\u{1f}{:?}\u{1f}{}\u{1f}{}",
            self.task_id, self.task_prefix, self.from, self.to, self.status, self.trigger, self.event_key, self.newest_first
        );
        hex::encode(&sha2::Sha256::digest(text.as_bytes())[..8])
    }
}

/// One page: runs in the query's order, and where the next starts
/// (`None`: the window has no more). A page may hold fewer runs than
/// asked while `next` is set (a store reads a bounded part of its index
/// per page when filters pass over many runs).
#[derive(Debug, Clone, Default)]
pub struct HistoryPage {
    /// Runs, in the query's order.
    pub runs: Vec<RunRecord>,
    /// Continue after this (`None`: the last page).
    pub next: Option<Cursor>,
}

/// How many runs a query selects: `exact` false when the store gave an
/// estimate (a lower bound).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Count {
    /// Runs.
    pub runs: u64,
    /// The count is exact (else at least this many).
    pub exact: bool,
}

/// A store of run history.
///
/// `record` is an idempotent upsert keyed by run id carrying the run's
/// final state; `page` reads by the keyset `(scheduled_at, run_id)` within
/// the query's window. Errors: store errors ([`Error::Store`]/unavailable);
/// never [`Error::NotFound`] (an absent run is `Ok(None)`).
#[async_trait]
pub trait HistoryStore: Send + Sync + 'static {
    /// The store's kind, as `/readyz` and metrics name it ("kv", "postgres").
    fn kind(&self) -> &'static str;
    /// Keeps `runs` (finished), replacing any earlier record of each.
    async fn record(&self, runs: &[RunRecord]) -> Result<()>;
    /// One run.
    async fn get(&self, run_id: &str) -> Result<Option<RunRecord>>;
    /// One page of `q`.
    async fn page(&self, q: &HistoryQuery) -> Result<HistoryPage>;
    /// How many runs `q` selects (its cursor and limit ignored).
    async fn count(&self, q: &HistoryQuery) -> Result<Count>;
    /// Drops what it holds of slots before `cutoff` where that is cheap (a
    /// whole partition); returns how many parts went. The store's own
    /// history is pruned by the retention pass instead (0).
    async fn expire_before(&self, _cutoff: DateTime<Utc>) -> Result<u64> {
        Ok(0)
    }
    /// Which of `run_ids` it holds, in order (event ids' dedup once their
    /// runs left the store).
    async fn contains(&self, run_ids: &[String]) -> Result<Vec<bool>> {
        let mut out = Vec::with_capacity(run_ids.len());
        for id in run_ids {
            out.push(self.get(id).await?.is_some());
        }
        Ok(out)
    }
}

/// Every run `q` selects, page by page, handed to `f` in order (an export,
/// `stats`): memory stays one page. Returns how many were handed.
pub async fn scan(store: &dyn HistoryStore, q: &HistoryQuery, mut f: impl FnMut(RunRecord)) -> Result<u64> {
    let mut q = q.clone();
    q.limit = q.limit.clamp(1, 1000);
    let mut seen = 0;
    loop {
        let page = store.page(&q).await?;
        for run in page.runs {
            seen += 1;
            f(run);
        }
        match page.next {
            Some(c) => q.after = Some(c),
            None => return Ok(seen),
        }
    }
}

/// The page token naming `cursor` for `q` (opaque to clients: URL-safe
/// base64 of a version, the query's fingerprint, the slot in nanoseconds
/// and the run id).
pub fn encode_token(q: &HistoryQuery, cursor: &Cursor) -> String {
    let nanos = cursor.slot.timestamp_nanos_opt().unwrap_or(i64::MAX);
    let text = format!("1:{}:{nanos}:{}", q.fingerprint(), cursor.run_id);
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(text)
}

/// The cursor of `token` for `q`. Errors: [`Error::InvalidArgument`] on
/// `field` when the token is malformed or was made for another query
/// (other filters, window or order).
pub fn decode_token(field: &str, q: &HistoryQuery, token: &str) -> Result<Cursor> {
    let bad = |why: &str| Error::invalid(field, why.to_string());
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(token).map_err(|_| bad("not a page token"))?;
    let text = String::from_utf8(bytes).map_err(|_| bad("not a page token"))?;
    let mut parts = text.splitn(4, ':');
    let (Some("1"), Some(fp), Some(nanos), Some(run_id)) = (parts.next(), parts.next(), parts.next(), parts.next()) else {
        return Err(bad("not a page token"));
    };
    if fp != q.fingerprint() {
        return Err(bad("made for another query: keep the filters, window and order of the request that returned it"));
    }
    let nanos: i64 = nanos.parse().map_err(|_| bad("not a page token"))?;
    Ok(Cursor { slot: DateTime::from_timestamp_nanos(nanos), run_id: run_id.to_string() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_names_its_cursor_for_its_query_only() {
        let q = HistoryQuery { task_id: "t".into(), newest_first: true, ..HistoryQuery::default() };
        let c = Cursor { slot: "2026-12-01T00:00:00.5Z".parse().expect("t"), run_id: "t.1".into() };
        let tok = encode_token(&q, &c);
        assert_eq!(decode_token("page_token", &q, &tok).expect("decode"), c);
        let other = HistoryQuery { newest_first: false, ..q.clone() };
        let e = decode_token("page_token", &other, &tok).expect_err("other order").to_string();
        assert!(e.contains("page_token") && e.contains("another query"), "{e}");
        assert!(decode_token("page_token", &q, "!!").is_err());
    }

    #[test]
    fn the_window_and_cursor_bound_a_page_in_either_order() {
        let t = |s: i64| DateTime::from_timestamp(s, 0).expect("t");
        let mut q = HistoryQuery { from: Some(t(10)), to: Some(t(20)), ..HistoryQuery::default() };
        assert!(q.in_range(t(10), "a") && !q.in_range(t(20), "a") && !q.in_range(t(9), "z"));
        q.after = Some(Cursor { slot: t(12), run_id: "b".into() });
        assert!(!q.in_range(t(12), "a") && !q.in_range(t(12), "b") && q.in_range(t(12), "c"));
        q.newest_first = true;
        assert!(q.in_range(t(12), "a") && !q.in_range(t(12), "c") && q.in_range(t(11), "z"));
    }
}
