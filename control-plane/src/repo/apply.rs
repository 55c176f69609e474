//! Applying many task definitions at once (`ApplyTasks`): all or nothing.
//!
//! When every write fits one transaction of the store (always on the
//! embedded store; on etcd while the set is within `--max-txn-ops` and the
//! request size) the set is written in that one transaction. Otherwise the
//! whole set is first recorded in a journal under `applies/{id}/` (chunks,
//! then a `ready` key in the last journal transaction), then the tasks are
//! written in as few transactions as the limits allow, then the journal is
//! deleted. A leader that starts finds any journal left by an interrupted
//! apply: with `ready` it finishes the apply, without it deletes the chunks
//! (no task of that apply was written yet). Every write is under the
//! leader's fence, so a deposed leader cannot go on with an apply.
//!
//! Each task is written with a compare on its key's mod revision, from the
//! record read just before: a concurrent pause, resume or apply of the same
//! task is read again and kept (its `paused` state), never overwritten.

use chrono::{DateTime, Utc};

use super::{Limits, Part, Repo, codec};
use crate::election::Leadership;
use crate::error::{Error, Result};
use crate::model::{Definition, TaskRecord, TaskSpec};
use crate::store::{Compare, Revision, Txn, TxnOp};

/// Attempts of one batch's read-compare-write before giving up.
const CAS_ATTEMPTS: usize = 5;
/// Largest journal chunk (bytes of encoded specs), well under etcd's
/// request limit.
const JOURNAL_CHUNK_BYTES: usize = 512 * 1024;

/// What an apply did (or, validating only, would do) to one task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApplyOutcome {
    /// No task had this id.
    Created,
    /// The task existed with another definition.
    Updated,
    /// The task existed with this very definition: nothing written.
    Unchanged,
}

impl ApplyOutcome {
    /// `created`, `updated`, `unchanged`.
    pub fn as_str(self) -> &'static str {
        match self {
            ApplyOutcome::Created => "created",
            ApplyOutcome::Updated => "updated",
            ApplyOutcome::Unchanged => "unchanged",
        }
    }
}

/// What [`Repo::apply_tasks`] did.
#[derive(Debug, Clone, Default)]
pub struct ApplyReport {
    /// One per spec, in order.
    pub outcomes: Vec<ApplyOutcome>,
    /// Store transactions committed (journal included).
    pub transactions: usize,
    /// Whether the set needed a journal (it did not fit one transaction).
    pub journaled: bool,
}

/// The record a definition makes, given the current one: state the user
/// did not write (pause, creation time) is kept; a definition that means
/// the same and writes the same fields leaves the record as it is
/// (`Unchanged`, [`TaskRecord::same_as`]), its document as first written.
pub fn record_for(def: &Definition, prev: Option<&TaskRecord>, now: DateTime<Utc>) -> (TaskRecord, ApplyOutcome) {
    match prev {
        Some(p) if p.same_as(def) => (p.clone(), ApplyOutcome::Unchanged),
        _ => {
            let rec = TaskRecord {
                paused: prev.is_some_and(|p| p.paused),
                paused_at: prev.and_then(|p| p.paused_at),
                paused_reason: prev.map(|p| p.paused_reason.clone()).unwrap_or_default(),
                resumed_at: prev.and_then(|p| p.resumed_at),
                created_at: prev.map_or(now, |p| p.created_at),
                ..TaskRecord::new(def.clone(), now)
            };
            (rec, if prev.is_some() { ApplyOutcome::Updated } else { ApplyOutcome::Created })
        }
    }
}

/// One entry of an apply journal chunk: a definition, or — in a journal a
/// leader of an older version wrote — a bare spec (its document is then
/// unknown, and the spec stands for it).
#[derive(serde::Serialize, serde::Deserialize)]
#[serde(untagged)]
enum JournalEntry {
    Definition(Definition),
    Spec(TaskSpec),
}

impl Repo {
    fn limits(&self, lead: Option<&Leadership>) -> Limits {
        Limits { ops: self.store.max_txn_ops(), bytes: self.store.max_txn_bytes(), fence: lead.map_or(0, |l| l.fence.len()) }
    }

    /// The current records of `ids` with their keys' mod revisions (0 when
    /// absent), read in transactions of gets within the store's limits.
    async fn read_tasks(&self, ids: &[&str]) -> Result<Vec<(Option<TaskRecord>, Revision)>> {
        let gets = self.get_many(ids.iter().map(|id| self.keys.task(id)), usize::MAX).await?;
        gets.into_iter()
            .map(|kv| match kv {
                Some(kv) => Ok((Some(codec::decode::<TaskRecord>("task", &kv.value)?), kv.mod_revision)),
                None => Ok((None, 0)),
            })
            .collect()
    }

    /// What applying `specs` would do, without writing.
    pub async fn preview_apply(&self, specs: &[Definition], now: DateTime<Utc>) -> Result<Vec<ApplyOutcome>> {
        let ids: Vec<&str> = specs.iter().map(|s| s.spec.task_id.as_str()).collect();
        let prevs = self.read_tasks(&ids).await?;
        Ok(specs.iter().zip(&prevs).map(|(s, (p, _))| record_for(s, p.as_ref(), now).1).collect())
    }

    /// Creates or replaces every task of `specs` (validated, ids unique),
    /// all or nothing — see the module doc for how. Returns one outcome per
    /// spec, in order. One apply at a time per leader (they would
    /// interleave), and none while a new engine recovers journals.
    ///
    /// Once its journal is complete, an apply is finished: store errors
    /// and tasks changing concurrently are retried (with backoff) until it
    /// is done or this leader is fenced, when the next leader finishes it.
    /// Run it in a task of its own so a caller that goes away does not stop
    /// it halfway.
    ///
    /// Errors: [`Error::Fenced`] when a newer leader exists (a journaled
    /// apply is then finished by that leader); [`Error::Unavailable`] when
    /// a task kept changing concurrently (one-transaction applies: nothing
    /// written); store errors before the journal is complete (nothing
    /// applied; the partial journal is deleted, or rolled back by the next
    /// leader).
    ///
    /// `config_rev`: the mod revision of the cluster configuration the
    /// specs were validated against (0: none stored); every transaction
    /// that writes tasks compares it ([`crate::repo::config`]), and fails
    /// with `FailedPrecondition` when it moved.
    pub async fn apply_tasks(
        &self,
        lead: &Leadership,
        specs: &[Definition],
        now: DateTime<Utc>,
        config_rev: Revision,
    ) -> Result<ApplyReport> {
        let _one_at_a_time = self.apply_lock.lock().await;
        let limits = self.limits(Some(lead));
        let encoded: Vec<usize> = specs.iter().map(|s| codec::encode(s).map(|b| b.len())).collect::<Result<_>>()?;
        // A record is its spec and document plus ~200 bytes of state.
        let fits_one = specs.len() < limits.ops.saturating_sub(limits.fence)
            && encoded.iter().map(|n| n + 300 + self.keys.task("").len() + 128).sum::<usize>() <= limits.bytes;
        let mut outcomes = vec![None; specs.len()];
        if fits_one {
            let transactions = self.write_tasks(lead, specs, now, &limits, &mut outcomes, Some(config_rev)).await?;
            return Ok(ApplyReport { outcomes: outcomes.into_iter().flatten().collect(), transactions, journaled: false });
        }
        // Zero-padded: journals sort (and are recovered) in the order made.
        let id = format!("{:020}-{:020}", lead.token, now.timestamp_nanos_opt().unwrap_or_default());
        let mut transactions = match self.write_journal(lead, &id, specs, &limits).await {
            Ok(n) => n,
            Err(e) => {
                // Nothing of it is applied; without `ready` the rest is
                // only clean-up (the next leader's, if this fails too).
                let _ = self.delete_journal(lead, &id, &limits).await;
                return Err(e);
            }
        };
        let mut pause = std::time::Duration::from_millis(200);
        loop {
            match self.write_tasks(lead, specs, now, &limits, &mut outcomes, Some(config_rev)).await {
                Ok(n) => {
                    transactions += n;
                    break;
                }
                Err(e @ (Error::Fenced(_) | Error::FailedPrecondition(_))) => return Err(e),
                Err(e) => {
                    tracing::warn!(apply = %id, error = %e, pause_ms = pause.as_millis() as u64, "apply not finished yet; going on");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(std::time::Duration::from_secs(30));
                }
            }
        }
        loop {
            match self.delete_journal(lead, &id, &limits).await {
                Ok(n) => {
                    transactions += n;
                    break;
                }
                Err(e @ Error::Fenced(_)) => return Err(e),
                Err(e) => {
                    tracing::warn!(apply = %id, error = %e, "cannot delete a finished apply's journal yet; going on");
                    tokio::time::sleep(pause).await;
                }
            }
        }
        tracing::info!(apply = %id, tasks = specs.len(), transactions, "journaled apply done");
        Ok(ApplyReport { outcomes: outcomes.into_iter().flatten().collect(), transactions, journaled: true })
    }

    /// Records `specs` under `applies/{id}/`: chunks, `ready` last.
    async fn write_journal(&self, lead: &Leadership, id: &str, specs: &[Definition], limits: &Limits) -> Result<usize> {
        let mut chunks: Vec<Vec<&Definition>> = vec![Vec::new()];
        let mut bytes = 0;
        for spec in specs {
            let n = codec::encode(spec)?.len();
            if bytes + n > JOURNAL_CHUNK_BYTES.min(limits.bytes / 2) && !chunks.last().is_some_and(Vec::is_empty) {
                chunks.push(Vec::new());
                bytes = 0;
            }
            bytes += n;
            chunks.last_mut().expect("one chunk at least").push(spec);
        }
        let mut ops: Vec<TxnOp> = Vec::with_capacity(chunks.len() + 1);
        for (i, chunk) in chunks.iter().enumerate() {
            ops.push(TxnOp::put(self.keys.apply_chunk(id, i), codec::encode(chunk)?));
        }
        ops.push(TxnOp::put(self.keys.apply_ready(id), codec::encode(&chunks.len())?));
        self.commit_ops(lead, ops, limits).await
    }

    /// Deletes an apply's journal, `ready` first (chunks without it are
    /// deleted as an unfinished journal, never replayed).
    async fn delete_journal(&self, lead: &Leadership, id: &str, limits: &Limits) -> Result<usize> {
        let ready = self.keys.apply_ready(id);
        let mut keys = vec![ready.clone()];
        keys.extend(self.keys_under(&self.keys.apply(id)).await?.into_iter().map(|kv| kv.key).filter(|k| *k != ready));
        self.commit_ops(lead, keys.into_iter().map(TxnOp::delete).collect(), limits).await
    }

    /// Commits `ops` in order, as few fenced transactions as fit.
    async fn commit_ops(&self, lead: &Leadership, ops: Vec<TxnOp>, limits: &Limits) -> Result<usize> {
        let mut txns = 0;
        let mut part = Part::default();
        for op in ops {
            let add = Part::from((Vec::new(), vec![op], Vec::new()));
            if !part.success.is_empty() && !limits.fits(part.size(), add.size()) {
                self.fenced_or_fail(lead, std::mem::take(&mut part).into_txn()).await?;
                txns += 1;
            }
            part.extend(add);
        }
        if !part.success.is_empty() {
            self.fenced_or_fail(lead, part.into_txn()).await?;
            txns += 1;
        }
        Ok(txns)
    }

    async fn fenced_or_fail(&self, lead: &Leadership, txn: Txn) -> Result<Revision> {
        match self.fenced_txn(lead, txn).await? {
            Ok(rev) => Ok(rev),
            Err(_) => Err(Error::Store("a journal transaction's compares failed for no known reason".into())),
        }
    }

    /// Writes the records of `specs` in batches that fit one transaction
    /// each: read the batch, compute, write if nothing changed meanwhile
    /// (else read again). `outcomes[i]` is set once spec `i`'s batch has
    /// committed; a call after a failed one goes on from the first unset.
    /// Returns the transactions committed.
    async fn write_tasks(
        &self,
        lead: &Leadership,
        specs: &[Definition],
        now: DateTime<Utc>,
        limits: &Limits,
        outcomes: &mut [Option<ApplyOutcome>],
        config_rev: Option<Revision>,
    ) -> Result<usize> {
        let mut transactions = 0;
        let mut start = outcomes.iter().position(Option::is_none).unwrap_or(specs.len());
        while start < specs.len() {
            let (batch_outcomes, end, committed) = self.write_batch(lead, specs, start, now, limits, config_rev).await?;
            for (slot, outcome) in outcomes[start..end].iter_mut().zip(batch_outcomes) {
                *slot = Some(outcome);
            }
            transactions += committed;
            start = end;
        }
        Ok(transactions)
    }

    /// Writes specs from `start` on, as many as one transaction takes;
    /// returns their outcomes, where the next batch starts, and whether a
    /// transaction was committed (0 or 1). Each transaction puts the tasks'
    /// change mark and, with `config_rev`, compares the configuration's
    /// revision (a journal a previous leader left is finished without it:
    /// no configuration apply can come between, both hold the apply lock).
    async fn write_batch(
        &self,
        lead: &Leadership,
        specs: &[Definition],
        start: usize,
        now: DateTime<Utc>,
        limits: &Limits,
        config_rev: Option<Revision>,
    ) -> Result<(Vec<ApplyOutcome>, usize, usize)> {
        // How many fit is known only once encoded; read what one
        // transaction of gets can hold, then write the prefix that fits.
        let window = &specs[start..specs.len().min(start.saturating_add(limits.ops.saturating_sub(limits.fence).max(1)))];
        for _ in 0..CAS_ATTEMPTS {
            let ids: Vec<&str> = window.iter().map(|s| s.spec.task_id.as_str()).collect();
            let prevs = self.read_tasks(&ids).await?;
            let (guard, mark) = self.task_write_guard(config_rev.unwrap_or_default());
            let mut part = Part::from((config_rev.map(|_| guard).into_iter().collect(), vec![mark], Vec::new()));
            let guard_ops = part.success.len();
            let mut outcomes = Vec::with_capacity(window.len());
            for (spec, (prev, rev)) in window.iter().zip(&prevs) {
                let (rec, outcome) = record_for(spec, prev.as_ref(), now);
                if outcome != ApplyOutcome::Unchanged {
                    let key = self.keys.task(&spec.spec.task_id);
                    let add =
                        Part::from((vec![Compare::mod_revision(&key, *rev)], vec![TxnOp::put(&key, codec::encode(&rec)?)], Vec::new()));
                    if !limits.fits(part.size(), add.size()) {
                        break;
                    }
                    part.extend(add);
                }
                outcomes.push(outcome);
            }
            if outcomes.is_empty() {
                return Err(Error::invalid(
                    format!("tasks[{start}]"),
                    "the task's record does not fit one store transaction (etcd --max-request-bytes)",
                ));
            }
            let end = start + outcomes.len();
            if part.success.len() == guard_ops {
                return Ok((outcomes, end, 0));
            }
            if self.fenced_txn(lead, part.into_txn()).await?.is_ok() {
                return Ok((outcomes, end, 1));
            }
            if let Some(rev) = config_rev
                && self.get_config().await?.map_or(0, |c| c.revision) != rev
            {
                return Err(Error::FailedPrecondition(
                    "the cluster configuration changed after these tasks were validated: apply them again".into(),
                ));
            }
            // A task of the batch changed since it was read: read again.
        }
        Err(Error::Unavailable { reason: "tasks of this apply are being changed concurrently; try again".into(), leader: None })
    }

    /// Finishes or rolls back the applies a previous leader left (see the
    /// module doc). Returns how many journals it found.
    ///
    /// Errors: [`Error::Fenced`]; store errors (the next start tries again).
    pub async fn recover_applies(&self, lead: &Leadership, now: DateTime<Utc>) -> Result<usize> {
        let _one_at_a_time = self.apply_lock.lock().await;
        let mut journals: std::collections::BTreeSet<String> = std::collections::BTreeSet::new();
        for kv in self.keys_under(&self.keys.applies()).await? {
            let Some(rest) = self.keys.id_after(&self.keys.applies(), &kv.key) else { continue };
            journals.insert(rest.split('/').next().unwrap_or(rest).to_string());
        }
        let limits = self.limits(Some(lead));
        for id in &journals {
            match self.read_journal(id).await {
                Ok(Some(specs)) => {
                    tracing::warn!(apply = %id, tasks = specs.len(), "finishing an apply a previous leader left");
                    let mut outcomes = vec![None; specs.len()];
                    self.write_tasks(lead, &specs, now, &limits, &mut outcomes, None).await?;
                }
                Ok(None) => tracing::warn!(apply = %id, "rolling back an apply a previous leader left unrecorded"),
                // A journal that cannot be read cannot be finished; kept,
                // it would stop every leader from starting.
                Err(e) => tracing::error!(apply = %id, error = %e, "deleting an apply journal that cannot be read; that apply is lost"),
            }
            self.delete_journal(lead, id, &limits).await?;
        }
        Ok(journals.len())
    }

    /// The definitions of a complete journal, `None` without `ready`.
    ///
    /// Errors: store errors; [`Error::Internal`] for a journal that is
    /// complete but unreadable (a chunk missing or undecodable).
    async fn read_journal(&self, id: &str) -> Result<Option<Vec<Definition>>> {
        let Some(ready) = self.store.get(&self.keys.apply_ready(id)).await? else { return Ok(None) };
        // Chunk by chunk: each is one get of at most 512 KiB.
        let chunks: usize = codec::decode("apply journal", &ready.value)?;
        let mut specs: Vec<Definition> = Vec::new();
        for i in 0..chunks {
            let kv = self
                .store
                .get(&self.keys.apply_chunk(id, i))
                .await?
                .ok_or_else(|| Error::Internal(format!("apply journal {id} is ready but chunk {i} of {chunks} is missing")))?;
            specs.extend(codec::decode::<Vec<JournalEntry>>("apply journal", &kv.value)?.into_iter().map(|e| match e {
                JournalEntry::Definition(d) => d,
                JournalEntry::Spec(spec) => {
                    let applied = serde_json::to_value(&spec).unwrap_or(serde_json::Value::Null);
                    Definition { spec, applied }
                }
            }));
        }
        Ok(Some(specs))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 34, point 11: a journal chunk holds definitions with their
    /// documents now; one a leader of the previous version wrote (bare
    /// specs) is still finished by a new leader.
    #[test]
    fn journal_chunks_of_both_versions_decode() {
        let def =
            Definition::from_json(r#"{"task_id": "t", "agent_id": "a", "execution": {"limits": {"memory_max": "64Mi"}}}"#).expect("def");
        let new = codec::encode(&vec![&def]).expect("encode");
        let old = codec::encode(&vec![&def.spec]).expect("encode");
        match codec::decode::<Vec<JournalEntry>>("apply journal", &new).expect("new").pop() {
            Some(JournalEntry::Definition(d)) => assert_eq!(d, def),
            _ => panic!("a definition"),
        }
        match codec::decode::<Vec<JournalEntry>>("apply journal", &old).expect("old").pop() {
            Some(JournalEntry::Spec(s)) => assert_eq!(s, def.spec),
            _ => panic!("a spec"),
        }
    }
}
