//! The budgets' ledger in the store. Each finished run that counts against
//! a budget writes its spend under its own key,
//! `budgets/{name}/{window_start}/runs/{run_id}`, in the same fenced
//! transaction as its final record ([`super::StoreOp::PutCharge`]): no
//! read-modify-write races between runs settling in one turn, no ordering
//! between write groups, and a run is counted at most once (its key) and
//! only when the store holds it finished. The leader folds those entries
//! into the window's `total` every few seconds ([`Repo::fold_ledgers`], one
//! fenced transaction per batch: the total moves and the entries go
//! together), so a window's keys stay few; windows that ended longer ago
//! than run retention's `max_age` are deleted.

use std::collections::BTreeMap;

use chrono::{DateTime, TimeZone, Utc};

use super::{Limits, Part, Repo, codec};
use crate::election::Leadership;
use crate::error::Result;
use crate::model::budget::Amount;
use crate::store::{Compare, KeyValue, Revision, TxnOp};

/// One window of one budget as the store holds it.
#[derive(Debug, Clone, PartialEq)]
pub struct LedgerWindow {
    /// Budget.
    pub budget: String,
    /// Window start (UTC).
    pub window_start: DateTime<Utc>,
    /// The spend settled in it: the total plus the entries not yet folded.
    pub used: Amount,
}

/// A window's keys as listed.
#[derive(Debug, Default)]
struct Listed {
    total: Option<(Amount, Revision)>,
    entries: Vec<(String, Amount)>,
}

impl Repo {
    async fn list_ledgers(&self) -> Result<BTreeMap<(String, i64), Listed>> {
        // In pages: between folds a busy window holds thousands of entries.
        const PAGE: usize = 1000;
        let prefix = self.keys.budgets();
        let mut kvs: Vec<KeyValue> = Vec::new();
        loop {
            let after = kvs.last().map(|kv| kv.key.clone()).unwrap_or_default();
            let page = self.store.range_page(&prefix, &after, PAGE, false).await?;
            let full = page.len() == PAGE;
            kvs.extend(page);
            if !full {
                break;
            }
        }
        let mut out: BTreeMap<(String, i64), Listed> = BTreeMap::new();
        for KeyValue { key, value, mod_revision, .. } in kvs {
            let Some((name, start, run)) = self.keys.parse_budget_key(&key) else { continue };
            let amount = match codec::decode::<Amount>("ledger entry", &value) {
                Ok(a) => a,
                Err(e) => {
                    tracing::error!(key, error = %e, "unreadable ledger entry left out");
                    continue;
                }
            };
            let w = out.entry((name.to_string(), start)).or_default();
            match run {
                None => w.total = Some((amount, mod_revision)),
                Some(_) => w.entries.push((key.clone(), amount)),
            }
        }
        Ok(out)
    }

    /// Every window of every budget the store holds, with its settled
    /// spend (for a new leader).
    ///
    /// Errors: store errors.
    pub async fn load_ledgers(&self) -> Result<Vec<LedgerWindow>> {
        Ok(self
            .list_ledgers()
            .await?
            .into_iter()
            .map(|((budget, start), w)| LedgerWindow {
                budget,
                window_start: Utc.timestamp_opt(start, 0).single().unwrap_or_default(),
                used: w.entries.iter().fold(w.total.map(|t| t.0).unwrap_or_default(), |acc, (_, a)| acc.plus(*a)),
            })
            .collect())
    }

    /// Folds runs' entries into their window's total, and deletes whole
    /// windows that ended before `cutoff` (`end_of` gives a window's end;
    /// `None` for a budget no longer configured: kept until `cutoff` passes
    /// its start). Each batch is one fenced transaction that compares the
    /// total's revision, so the sum never changes. Returns the entries
    /// folded and the windows deleted.
    ///
    /// Errors: [`crate::Error::Fenced`]; store errors.
    pub async fn fold_ledgers(
        &self,
        lead: &Leadership,
        cutoff: DateTime<Utc>,
        end_of: impl Fn(&str, DateTime<Utc>) -> Option<DateTime<Utc>>,
    ) -> Result<(usize, usize)> {
        let limits = Limits { ops: self.store.max_txn_ops(), bytes: self.store.max_txn_bytes(), fence: lead.fence.len() };
        // Each batch: the total's compare and put, then its entries' deletes.
        let per_batch = limits.ops.saturating_sub(2).clamp(1, 100);
        let (mut folded, mut dropped) = (0, 0);
        for ((name, start), w) in self.list_ledgers().await? {
            let total_key = self.keys.budget_total(&name, start);
            let begins = Utc.timestamp_opt(start, 0).single().unwrap_or_default();
            if end_of(&name, begins).unwrap_or(begins) < cutoff {
                let mut ops: Vec<TxnOp> = w.entries.iter().map(|(k, _)| TxnOp::delete(k.clone())).collect();
                ops.push(TxnOp::delete(total_key));
                for chunk in ops.chunks(per_batch + 1) {
                    self.fenced_txn(lead, Part::from((Vec::new(), chunk.to_vec(), Vec::new())).into_txn()).await?.ok();
                }
                dropped += 1;
                continue;
            }
            let (mut total, mut rev) = w.total.unwrap_or_default();
            for chunk in w.entries.chunks(per_batch) {
                let next = chunk.iter().fold(total, |acc, (_, a)| acc.plus(*a));
                let compare = if rev == 0 { Compare::absent(&total_key) } else { Compare::mod_revision(&total_key, rev) };
                let mut puts = vec![TxnOp::put(&total_key, codec::encode(&next)?)];
                puts.extend(chunk.iter().map(|(k, _)| TxnOp::delete(k.clone())));
                match self.fenced_txn(lead, Part::from((vec![compare], puts, Vec::new())).into_txn()).await? {
                    Ok(r) => {
                        (total, rev) = (next, r);
                        folded += chunk.len();
                    }
                    // Another fold moved the total (a previous leader's, just
                    // fenced): the next pass starts over from the store.
                    Err(_) => break,
                }
            }
        }
        Ok((folded, dropped))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::repo::{Keys, StoreOp};
    use crate::store::embedded::EmbeddedStore;

    /// Entries written with runs fold into the total without changing the
    /// sum; a fold again finds nothing; an old window goes.
    #[tokio::test]
    async fn folding_keeps_the_sum_and_old_windows_go() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Arc::new(EmbeddedStore::open(dir.path()).await.expect("open"));
        let repo = Repo::new(store, Keys::default());
        let lead = Leadership { token: 1, fence: Vec::new() };
        let t0: DateTime<Utc> = "2026-12-01T00:00:00Z".parse().expect("t");
        let old: DateTime<Utc> = "2026-01-01T00:00:00Z".parse().expect("t");
        let mut groups = Vec::new();
        for i in 0..250u64 {
            let amount = Amount { input_tokens: i, output_tokens: 2, cost: 0.5, runs: 1 };
            groups.push(vec![StoreOp::PutCharge { budget: "b".into(), window_start: t0, run_id: format!("r{i}"), amount }]);
        }
        groups.push(vec![StoreOp::PutCharge { budget: "b".into(), window_start: old, run_id: "x".into(), amount: Amount::default() }]);
        repo.commit(&lead, groups).await.expect("commit");
        let want = Amount { input_tokens: (0..250).sum(), output_tokens: 500, cost: 125.0, runs: 250 };
        let before = repo.load_ledgers().await.expect("load");
        assert_eq!(before.len(), 2);
        assert_eq!(before[1].used, want);
        let end = |_: &str, s: DateTime<Utc>| Some(s + chrono::Duration::days(1));
        let cutoff: DateTime<Utc> = "2026-06-01T00:00:00Z".parse().expect("t");
        assert_eq!(repo.fold_ledgers(&lead, cutoff, end).await.expect("fold"), (250, 1));
        let after = repo.load_ledgers().await.expect("load");
        assert_eq!(after, vec![LedgerWindow { budget: "b".into(), window_start: t0, used: want }]);
        let (kvs, _) = repo.store.range(&repo.keys.budgets()).await.expect("range");
        assert_eq!(kvs.len(), 1, "only the total is left");
        assert_eq!(repo.fold_ledgers(&lead, cutoff, end).await.expect("fold"), (0, 0));
    }
}
