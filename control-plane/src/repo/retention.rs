//! What run retention reads and deletes: run keys with their revisions
//! (keys only, paged), the `active/` index, tasks' `history`, the time of
//! manual runs, and fenced batched deletes that never remove a run that is
//! active or changed since it was listed. The policy is
//! [`crate::engine::retention`]'s.

use std::collections::{HashMap, HashSet};

use chrono::{DateTime, Utc};

use super::{Limits, Part, Repo, codec};
use crate::election::Leadership;
use crate::error::Result;
use crate::model::task::HistorySpec;
use crate::model::{RunRecord, TaskRecord};
use crate::store::{Compare, Revision, Txn, TxnOp};

/// The value of `meta/history-index` once the time index covers every run.
pub const HISTORY_INDEX_DONE: &[u8] = b"done";

/// A stored run as a key listing sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunKey {
    /// The run.
    pub run_id: String,
    /// When its key was created (orders runs by creation).
    pub create_revision: Revision,
    /// Its last write: a delete only happens if it is still this.
    pub mod_revision: Revision,
}

impl Repo {
    /// Every stored run (of one task when `task_id` is not empty), keys
    /// only, in key order.
    pub async fn run_keys(&self, task_id: &str) -> Result<Vec<RunKey>> {
        let prefix = if task_id.is_empty() { self.keys.runs() } else { self.keys.runs_of(task_id) };
        let runs = self.keys.runs();
        Ok(self
            .keys_under(&prefix)
            .await?
            .into_iter()
            .filter_map(|kv| {
                let run_id = self.keys.id_after(&runs, &kv.key)?.to_string();
                Some(RunKey { run_id, create_revision: kv.create_revision, mod_revision: kv.mod_revision })
            })
            .collect())
    }

    /// The runs in the `active/` index (not finished, or holding an agent).
    pub async fn active_run_ids(&self) -> Result<HashSet<String>> {
        let prefix = self.keys.active_runs();
        Ok(self.keys_under(&prefix).await?.iter().filter_map(|kv| self.keys.id_after(&prefix, &kv.key).map(str::to_string)).collect())
    }

    /// The retention of each task of `ids` that exists: its `history`
    /// (`None`: it has none) and its webhooks' longest dedup window, in
    /// seconds (0: none); tasks that do not exist are left out.
    pub async fn task_histories(&self, ids: &[&str]) -> Result<HashMap<String, (Option<HistorySpec>, u64)>> {
        let mut out = HashMap::new();
        let gets = self.get_many(ids.iter().map(|id| self.keys.task(id)), usize::MAX).await?;
        for (id, kv) in ids.iter().zip(gets) {
            if let Some(kv) = kv {
                match codec::decode::<TaskRecord>("task", &kv.value) {
                    Ok(rec) => {
                        let dedup = rec.spec.webhooks().iter().map(|w| w.dedup_ttl_seconds()).max().unwrap_or(0);
                        out.insert(id.to_string(), (rec.spec.history, dedup));
                    }
                    Err(e) => tracing::error!(task_id = %id, error = %e, "unreadable task"),
                }
            }
        }
        Ok(out)
    }

    /// When each run of `ids` finished (its slot when it has no finish
    /// time); runs gone or unreadable are left out.
    pub async fn run_times(&self, ids: &[&str]) -> Result<HashMap<String, DateTime<Utc>>> {
        let mut out = HashMap::new();
        // Run records are up to 512 KiB: a few per read.
        let gets = self.get_many(ids.iter().map(|id| self.keys.run(id)), 8).await?;
        for (id, kv) in ids.iter().zip(gets) {
            if let Some(Ok(run)) = kv.map(|kv| codec::decode::<RunRecord>("run", &kv.value)) {
                out.insert(id.to_string(), run.finished_at.unwrap_or(run.scheduled_at));
            }
        }
        Ok(out)
    }

    /// Deletes `runs` under the leader's fence, in as few transactions as
    /// fit, each run only if it is not in the `active/` index and has not
    /// been written since it was listed. A transaction whose compares fail
    /// is retried run by run (skipping the ones that changed). Returns how
    /// many were deleted.
    ///
    /// Errors: [`crate::Error::Fenced`]; store errors.
    pub async fn delete_runs(&self, lead: &Leadership, runs: &[RunKey]) -> Result<usize> {
        let part_of = |r: &RunKey| {
            let key = self.keys.run(&r.run_id);
            let mut deletes = vec![TxnOp::delete(key.clone())];
            if crate::model::event::may_store_body(&r.run_id) {
                deletes.push(TxnOp::delete(self.keys.event_body(&r.run_id)));
            }
            Part::from((
                vec![Compare::mod_revision(&key, r.mod_revision), Compare::absent(self.keys.active_run(&r.run_id))],
                deletes,
                Vec::new(),
            ))
        };
        self.commit_parts(lead, runs.iter().map(part_of).collect()).await
    }

    /// Commits `parts` under the leader's fence, packed into as few
    /// transactions as the store allows; a transaction whose compares fail
    /// is tried again part by part, so one changed key does not hold up the
    /// others. Returns how many parts committed.
    ///
    /// Errors: [`crate::Error::Fenced`]; store errors.
    async fn commit_parts(&self, lead: &Leadership, parts: Vec<Part>) -> Result<usize> {
        let limits = Limits { ops: self.store.max_txn_ops(), bytes: self.store.max_txn_bytes(), fence: lead.fence.len() };
        let (mut done, mut batch, mut packed) = (0, Vec::new(), Part::default());
        for p in parts {
            if !batch.is_empty() && !limits.fits(packed.size(), p.size()) {
                done += self.commit_batch(lead, std::mem::take(&mut packed), std::mem::take(&mut batch)).await?;
            }
            packed.extend(p.clone());
            batch.push(p);
        }
        if !batch.is_empty() {
            done += self.commit_batch(lead, packed, batch).await?;
        }
        Ok(done)
    }

    async fn commit_batch(&self, lead: &Leadership, packed: Part, batch: Vec<Part>) -> Result<usize> {
        if self.fenced_txn(lead, packed.into_txn()).await?.is_ok() {
            return Ok(batch.len());
        }
        let mut done = 0;
        if batch.len() > 1 {
            for p in batch {
                if self.fenced_txn(lead, p.into_txn()).await?.is_ok() {
                    done += 1;
                }
            }
        }
        Ok(done)
    }

    /// Deletes the time index entries (`hist/` and `hist-task/`) of runs
    /// that are gone (pruned), under the leader's fence, each only while
    /// its run is still absent, in as few transactions as fit. Returns how
    /// many runs' entries were deleted.
    ///
    /// Errors: [`crate::Error::Fenced`]; store errors.
    pub async fn sweep_history_index(&self, lead: &Leadership) -> Result<usize> {
        const PAGE: usize = 512;
        let prefix = self.keys.history();
        let (mut after, mut swept) = (String::new(), 0);
        loop {
            let page = self.store.range_page(&prefix, &after, PAGE, true).await?;
            let full = page.len() == PAGE;
            let entries: Vec<(DateTime<Utc>, String)> = page
                .iter()
                .filter_map(|kv| kv.key.strip_prefix(&prefix).and_then(super::Keys::history_parts).map(|(t, id)| (t, id.to_string())))
                .collect();
            let exist = self.runs_exist(&entries.iter().map(|(_, id)| id.clone()).collect::<Vec<_>>()).await?;
            let parts = entries
                .iter()
                .zip(exist)
                .filter(|(_, exists)| !exists)
                .map(|((at, id), _)| {
                    // Task ids have no `.`: a run id is `{task}.{...}`.
                    let task = id.split_once('.').map_or(id.as_str(), |(t, _)| t);
                    Part::from((
                        vec![Compare::absent(self.keys.run(id))],
                        vec![TxnOp::delete(self.keys.history_entry(*at, id)), TxnOp::delete(self.keys.task_history_entry(task, *at, id))],
                        Vec::new(),
                    ))
                })
                .collect();
            swept += self.commit_parts(lead, parts).await?;
            match page.last() {
                Some(kv) if full => after = kv.key.clone(),
                _ => return Ok(swept),
            }
        }
    }

    /// Up to `limit` runs waiting for the archive (`hist-out/`, in key
    /// order), each with the revision it was read at; queue entries whose
    /// run is gone are deleted on the way (fenced).
    ///
    /// Errors: [`crate::Error::Fenced`]; store errors.
    pub async fn archive_batch(&self, lead: &Leadership, limit: usize) -> Result<Vec<(RunRecord, Revision)>> {
        let prefix = self.keys.archive_out();
        let page = self.store.range_page(&prefix, "", limit, true).await?;
        let ids: Vec<String> = page.iter().filter_map(|kv| kv.key.strip_prefix(&prefix).map(str::to_string)).collect();
        let kvs = self.get_many(ids.iter().map(|id| self.keys.run(id)), 8).await?;
        let mut out = Vec::with_capacity(ids.len());
        let mut stale = Vec::new();
        for (id, kv) in ids.iter().zip(kvs) {
            match kv {
                Some(kv) => out.push((codec::decode::<RunRecord>("run", &kv.value)?, kv.mod_revision)),
                None => stale.push(TxnOp::delete(self.keys.archive_out_item(id))),
            }
        }
        if !stale.is_empty() {
            let _ = self.fenced_txn(lead, Txn { success: stale, ..Txn::default() }).await?;
        }
        Ok(out)
    }

    /// Deletes from the store the runs the archive now holds — each with
    /// its queue entry, time index entries and stored event body — only
    /// while unchanged since read (`rev`), under the leader's fence, in as
    /// few transactions as fit. Returns how many were deleted (a run
    /// written since stays, queued again by that write).
    ///
    /// Errors: [`crate::Error::Fenced`]; store errors.
    pub async fn forget_archived(&self, lead: &Leadership, runs: &[(RunRecord, Revision)]) -> Result<usize> {
        let parts = runs
            .iter()
            .map(|(r, rev)| {
                Part::from((
                    vec![Compare::mod_revision(self.keys.run(&r.run_id), *rev)],
                    vec![
                        TxnOp::delete(self.keys.run(&r.run_id)),
                        TxnOp::delete(self.keys.archive_out_item(&r.run_id)),
                        TxnOp::delete(self.keys.history_entry(r.scheduled_at, &r.run_id)),
                        TxnOp::delete(self.keys.task_history_entry(&r.task_id, r.scheduled_at, &r.run_id)),
                        TxnOp::delete(self.keys.event_body(&r.run_id)),
                    ],
                    Vec::new(),
                ))
            })
            .collect();
        self.commit_parts(lead, parts).await
    }

    /// How many runs wait for the archive (a keys-only count of `hist-out/`).
    pub async fn archive_pending(&self) -> Result<u64> {
        const PAGE: usize = 1000;
        let prefix = self.keys.archive_out();
        let (mut after, mut n) = (String::new(), 0u64);
        loop {
            let page = self.store.range_page(&prefix, &after, PAGE, true).await?;
            n += page.len() as u64;
            match page.last() {
                Some(kv) if page.len() == PAGE => after = kv.key.clone(),
                _ => return Ok(n),
            }
        }
    }

    /// Deletes the dedup keys (`dedup/`) whose window ended before `now`,
    /// each only while unchanged, under the leader's fence, in as few
    /// transactions as fit. Returns how many were deleted.
    ///
    /// Errors: [`crate::Error::Fenced`]; store errors.
    pub async fn sweep_dedup(&self, lead: &Leadership, now: DateTime<Utc>) -> Result<usize> {
        const PAGE: usize = 256;
        let prefix = self.keys.dedups();
        let (mut after, mut swept) = (String::new(), 0);
        loop {
            let page = self.store.range_page(&prefix, &after, PAGE, false).await?;
            let full = page.len() == PAGE;
            let parts = page
                .iter()
                // An unreadable key is left to be looked at.
                .filter(|kv| codec::decode::<crate::model::event::DedupClaim>("dedup claim", &kv.value).is_ok_and(|c| c.expires_at <= now))
                .map(|kv| Part::from((vec![Compare::mod_revision(&kv.key, kv.mod_revision)], vec![TxnOp::delete(&kv.key)], Vec::new())))
                .collect();
            swept += self.commit_parts(lead, parts).await?;
            match page.last() {
                Some(kv) if full => after = kv.key.clone(),
                _ => return Ok(swept),
            }
        }
    }

    /// Puts the time index entries of runs written before the index
    /// existed (a store of an earlier version), once: resumable (after the
    /// last run key indexed, kept in `meta/history-index`), fenced, in as
    /// few transactions as fit; then marks the index whole (`done`).
    /// Returns how many runs were read (0 when already whole). It pauses
    /// `pause` between pages of 64 runs, so the leader's own writes go
    /// between them.
    ///
    /// Errors: [`crate::Error::Fenced`]; store errors.
    pub async fn build_history_index(&self, lead: &Leadership, pause: std::time::Duration) -> Result<u64> {
        const DONE: &[u8] = HISTORY_INDEX_DONE;
        const PAGE: usize = 64;
        let state_key = self.keys.history_index_state();
        let mut after = match self.store.get(&state_key).await? {
            Some(kv) if kv.value == DONE => {
                // A leader of an earlier version (a rolling upgrade, or a
                // downgrade and back) writes runs without entries and prunes
                // runs leaving theirs: with those swept, fewer entries than
                // runs means building again (idempotent puts).
                self.sweep_history_index(lead).await?;
                let runs = self.count_keys(&self.keys.runs()).await?;
                let entries = self.count_keys(&self.keys.history()).await?;
                if entries >= runs {
                    return Ok(0);
                }
                tracing::warn!(
                    runs,
                    entries,
                    "runs without time index entries (an earlier version led meanwhile): building the index again"
                );
                String::new()
            }
            Some(kv) => String::from_utf8_lossy(&kv.value).into_owned(),
            None => String::new(),
        };
        let limits = Limits { ops: self.store.max_txn_ops(), bytes: self.store.max_txn_bytes(), fence: lead.fence.len() };
        let mut read = 0u64;
        loop {
            let (runs, next) = self.runs_page("", &after, PAGE).await?;
            read += runs.len() as u64;
            let mut part = Part::default();
            for r in &runs {
                let add = Part::from((
                    Vec::new(),
                    vec![
                        TxnOp::put(self.keys.history_entry(r.scheduled_at, &r.run_id), Vec::new()),
                        TxnOp::put(self.keys.task_history_entry(&r.task_id, r.scheduled_at, &r.run_id), Vec::new()),
                    ],
                    Vec::new(),
                ));
                if !limits.fits(part.size(), add.size()) {
                    let _ = self.fenced_txn(lead, std::mem::take(&mut part).into_txn()).await?;
                }
                part.extend(add);
            }
            let state = match &next {
                Some(key) => key.as_bytes().to_vec(),
                None => DONE.to_vec(),
            };
            // The progress goes with the page's last entries.
            let progress = Part::from((Vec::new(), vec![TxnOp::put(&state_key, state)], Vec::new()));
            if !limits.fits(part.size(), progress.size()) {
                let _ = self.fenced_txn(lead, std::mem::take(&mut part).into_txn()).await?;
            }
            part.extend(progress);
            let _ = self.fenced_txn(lead, part.into_txn()).await?;
            match next {
                Some(key) => {
                    after = key;
                    tokio::time::sleep(pause).await;
                }
                None => {
                    tracing::info!(runs = read, "time index of runs built");
                    return Ok(read);
                }
            }
        }
    }

    /// How many keys are under `prefix`, read in pages of keys only.
    async fn count_keys(&self, prefix: &str) -> Result<u64> {
        const KEY_PAGE: usize = 1000;
        let (mut after, mut n) = (String::new(), 0u64);
        loop {
            let page = self.store.range_page(prefix, &after, KEY_PAGE, true).await?;
            n += page.len() as u64;
            match page.last() {
                Some(kv) if page.len() == KEY_PAGE => after = kv.key.clone(),
                _ => return Ok(n),
            }
        }
    }

    /// The store's current revision.
    pub async fn current_revision(&self) -> Result<Revision> {
        Ok(self.store.txn(Txn::default()).await?.revision)
    }
}
