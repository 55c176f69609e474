//! Persistence in one place: the key layout ([`Keys`]) and every encoding
//! of what the control plane stores — tasks, cursors, runs (with their
//! `active/` index), election records. Callers ask for typed reads and
//! typed write operations ([`StoreOp`]); nothing else calls serde on stored
//! bytes or formats a key.
//!
//! Writes of the leader go through [`Repo::commit`]: groups of operations
//! packed into as few fenced transactions as the store allows (etcd's
//! `--max-txn-ops` and request size), a group never split, groups committed
//! in order.

pub mod apply;
pub mod budgets;
pub mod codec;
pub mod config;
pub mod history;
mod keys;
pub mod outbox;
pub mod retention;

use std::collections::HashMap;
use std::sync::Arc;

use chrono::{DateTime, Utc};
use futures::StreamExt;
use futures::stream::BoxStream;

pub use apply::{ApplyOutcome, ApplyReport, record_for};
pub use keys::Keys;
pub use retention::RunKey;

use crate::election::Leadership;
use crate::error::{Error, Result};
use crate::model::{Cursor, RunRecord, TaskRecord};
use crate::store::{Compare, KeyValue, KvStore, Revision, Txn, TxnOp, WatchEvent};

/// Largest encoded run record: 512 KiB, well below etcd's 1.5 MiB request
/// limit (etcd docs, `--max-request-bytes`) so that a record plus its index
/// entry and compares always fits one transaction. A larger record is
/// trimmed when encoded (see [`encode_run`]).
pub const MAX_RUN_RECORD_BYTES: usize = 512 * 1024;
/// What an output tail is cut to when a record must be trimmed.
const TRIMMED_TAIL_BYTES: usize = 4096;
/// What an error text is cut to when a record must be trimmed.
const TRIMMED_TEXT_BYTES: usize = 256;

/// Encodes a run record within [`MAX_RUN_RECORD_BYTES`], trimming a
/// copy as [`trim_run`] does when it is larger. The engine trims its own
/// record first (so what watchers see is what is stored); this is the
/// guard for every other writer.
pub fn encode_run(run: &RunRecord) -> Result<Vec<u8>> {
    let bytes = codec::encode(run)?;
    if bytes.len() <= MAX_RUN_RECORD_BYTES {
        return Ok(bytes);
    }
    let mut trimmed = run.clone();
    trim_run(&mut trimmed)?;
    codec::encode(&trimmed)
}

/// A result (or checkpoint) smaller than this is never replaced by a marker.
pub const MIN_TRIMMED_RESULT_BYTES: usize = 1024;

/// Trims a run record in place until it encodes within
/// [`MAX_RUN_RECORD_BYTES`] (agents can write megabytes of escaped control
/// characters). Inputs are never trimmed: params, trace state and baggage
/// are bounded when they are accepted (`model::task::MAX_PARAMS_BYTES`),
/// so that what is below always makes room. In this order:
/// 1. late reports' results (evidence of attempts already ended), each
///    replaced by `{"trimmed": true, "bytes": N}`, N its encoded size;
/// 2. error texts and the progress message, to 256 bytes (marked
///    `[trimmed]`);
/// 3. the last resort, largest first among the output tails, the result
///    and the checkpoint: a tail is cut to its last 4 KiB (marked
///    `[trimmed to fit the store]`), a result or checkpoint of at least
///    1 KiB ([`MIN_TRIMMED_RESULT_BYTES`]) is replaced by the marker; until
///    it fits;
/// 4. a run with hundreds of attempts keeps its first and its newest 64
///    (`RunRecord::elide_attempts`; the others are counted in
///    `elided_attempts`).
///
/// Returns whether anything was cut.
///
/// Errors: [`Error::Internal`] if the record cannot be encoded (a bug).
pub fn trim_run(run: &mut RunRecord) -> Result<bool> {
    let mut bytes = codec::encoded_len(run)?;
    if bytes <= MAX_RUN_RECORD_BYTES {
        return Ok(false);
    }
    fn marker(v: &serde_json::Value) -> serde_json::Value {
        serde_json::json!({ "trimmed": true, "bytes": v.to_string().len() })
    }
    fn tail(s: &mut String) {
        if s.len() > TRIMMED_TAIL_BYTES {
            let mut start = s.len() - TRIMMED_TAIL_BYTES;
            while !s.is_char_boundary(start) {
                start += 1;
            }
            *s = format!("[trimmed to fit the store] {}", &s[start..]);
        }
    }
    fn text(s: &mut String, max: usize) {
        if s.len() > max {
            let mut end = max;
            while !s.is_char_boundary(end) {
                end -= 1;
            }
            s.truncate(end);
            s.push_str(" [trimmed]");
        }
    }
    let fits = |r: &RunRecord| -> Result<(bool, usize)> {
        let n = codec::encoded_len(r)?;
        Ok((n <= MAX_RUN_RECORD_BYTES, n))
    };
    // 1. Evidence of ended attempts.
    for rep in run.attempts.iter_mut().filter_map(|a| a.report.as_mut()) {
        if let Some(v) = rep.result.as_mut() {
            *v = marker(v);
        }
    }
    // 2. Texts.
    let (ok, n) = fits(run)?;
    bytes = n;
    if !ok {
        for a in &mut run.attempts {
            if let Some(e) = a.error.as_mut() {
                text(e, TRIMMED_TEXT_BYTES);
            }
            if let Some(e) = a.report.as_mut().and_then(|rep| rep.error.as_mut()) {
                text(e, TRIMMED_TEXT_BYTES);
            }
        }
        for e in [run.error.as_mut(), run.pending_reason.as_mut(), run.progress.as_mut().map(|p| &mut p.message)].into_iter().flatten() {
            text(e, TRIMMED_TEXT_BYTES);
        }
        bytes = fits(run)?.1;
    }
    // 3. Outputs, largest first.
    #[derive(Clone, Copy)]
    enum Part {
        Stdout,
        Stderr,
        Result,
        Checkpoint,
    }
    while bytes > MAX_RUN_RECORD_BYTES {
        let size = |v: Option<&serde_json::Value>| v.map_or(0, |v| v.to_string().len());
        // A tail's size as stored (escaped), 0 once it is cut.
        let tail_size = |s: &str| if s.len() > TRIMMED_TAIL_BYTES + 32 { serde_json::to_string(s).map_or(s.len(), |j| j.len()) } else { 0 };
        let candidates = [
            (Part::Stdout, tail_size(&run.stdout_tail)),
            (Part::Stderr, tail_size(&run.stderr_tail)),
            (Part::Result, size(run.result.as_ref())),
            (Part::Checkpoint, size(run.progress.as_ref().and_then(|p| p.checkpoint.as_ref()))),
        ];
        let Some((part, _)) = candidates
            .into_iter()
            .filter(|(p, n)| match p {
                Part::Stdout | Part::Stderr => *n > 0,
                Part::Result | Part::Checkpoint => *n >= MIN_TRIMMED_RESULT_BYTES,
            })
            .max_by_key(|(_, n)| *n)
        else {
            break;
        };
        match part {
            Part::Stdout => tail(&mut run.stdout_tail),
            Part::Stderr => tail(&mut run.stderr_tail),
            Part::Result => {
                if let Some(v) = run.result.as_mut() {
                    *v = marker(v);
                }
            }
            Part::Checkpoint => {
                if let Some(c) = run.progress.as_mut().and_then(|p| p.checkpoint.as_mut()) {
                    *c = marker(c);
                }
            }
        }
        bytes = fits(run)?.1;
    }
    // 4. Hundreds of attempts: the first and the newest 64 are kept.
    if bytes > MAX_RUN_RECORD_BYTES && run.elide_attempts() {
        bytes = fits(run)?.1;
    }
    if bytes > MAX_RUN_RECORD_BYTES {
        tracing::error!(run_id = %run.run_id, bytes, "run record does not fit the store even trimmed");
    } else {
        tracing::warn!(run_id = %run.run_id, bytes, "run record trimmed to fit the store");
    }
    Ok(true)
}

/// One write the engine asks for. The run records carry their final
/// `fencing_token` and `updated_at`: the repository only encodes.
#[derive(Debug, Clone, PartialEq)]
pub enum StoreOp {
    /// Create a run record: the transaction fails if it exists (a slot's
    /// run is created once, whatever replica or term tries).
    CreateRun(Box<RunRecord>),
    /// Overwrite a run record.
    PutRun(Box<RunRecord>),
    /// Set a task's scheduler cursor.
    PutCursor {
        /// Task.
        task_id: String,
        /// New cursor.
        cursor: Cursor,
    },
    /// Delete a task's cursor (the task is gone).
    DeleteCursor {
        /// Task.
        task_id: String,
    },
    /// Put a notification in the outbox (with the run state it reports).
    PutNotification(Box<crate::model::notification::Notification>),
    /// A backfill's record (its cursor and counters, with the run that
    /// moved them).
    PutBackfill(Box<crate::model::backfill::Backfill>),
    /// The body of the event that started a run, too large for its
    /// record: stored beside it, in the same group (`events/{run_id}`).
    PutEventBody {
        /// The run.
        run_id: String,
        /// The body, as received.
        body: Arc<Vec<u8>>,
    },
    /// A finished run's spend against one budget's window (with the run's
    /// final record: the ledger never counts a run the store does not
    /// hold as finished, nor one twice — the key is the run's).
    PutCharge {
        /// Budget.
        budget: String,
        /// Window start.
        window_start: DateTime<Utc>,
        /// The run.
        run_id: String,
        /// What it used (`runs` 1).
        amount: crate::model::budget::Amount,
    },
    /// A resource held back (with the attempt whose agent asked for it):
    /// `holds/{resource}`, read by the next leader.
    PutHoldBack {
        /// The resource.
        resource: String,
        /// Until when, and why.
        hold: crate::model::run::HoldBack,
    },
    /// A resource's hold-back ended by hand (`resources release`).
    DeleteHoldBack {
        /// The resource.
        resource: String,
    },
}

/// A change to a task definition, as a watch sees it.
#[derive(Debug, Clone, PartialEq)]
pub enum TaskChange {
    /// Created or replaced (also pause and resume).
    Put(Box<TaskRecord>),
    /// Deleted.
    Deleted(String),
}

/// What [`Repo::commit`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CommitStats {
    /// Transactions committed.
    pub transactions: usize,
    /// Store revision after the last one (0 when nothing was written).
    pub revision: Revision,
}

/// Typed access to the store.
#[derive(Clone)]
pub struct Repo {
    store: Arc<dyn KvStore>,
    keys: Keys,
    /// Held by an apply and by journal recovery: one at a time.
    apply_lock: Arc<tokio::sync::Mutex<()>>,
    /// Times the leader's fenced transactions (`/metrics`).
    txn_timer: Option<prometheus_client::metrics::histogram::Histogram>,
    /// Finished runs move to an archive (`--history postgres://`): each
    /// run's final write also puts `hist-out/{run_id}`.
    archived: bool,
}

/// Keys one read of [`Repo::scan_tasks`] takes (a definition is at most
/// 256 KiB: at most 32 MiB in hand, half etcd's answer limit
/// [`crate::store::etcd::MAX_RESPONSE_BYTES`]; about 128 KiB for typical
/// ones).
pub const SCAN_STEP: usize = 128;

impl Repo {
    /// The repository over `store`, keys under `keys`' prefix.
    pub fn new(store: Arc<dyn KvStore>, keys: Keys) -> Self {
        Repo { store, keys, apply_lock: Arc::default(), txn_timer: None, archived: false }
    }

    /// The same, with finished runs queued for an archive (`hist-out/`).
    pub fn with_archive(mut self) -> Self {
        self.archived = true;
        self
    }

    /// Whether finished runs go to an archive ([`Repo::with_archive`]).
    pub fn archived(&self) -> bool {
        self.archived
    }

    /// The same, observing each fenced transaction's latency (seconds) in `h`.
    pub fn with_txn_timer(mut self, h: prometheus_client::metrics::histogram::Histogram) -> Self {
        self.txn_timer = Some(h);
        self
    }

    /// The key layout.
    pub fn keys(&self) -> &Keys {
        &self.keys
    }

    /// The underlying store.
    pub fn store(&self) -> &Arc<dyn KvStore> {
        &self.store
    }

    /// The keys `keys`, in order (`None` when absent), read in
    /// transactions of at most `per_txn` gets (and the store's limit): one
    /// round trip per batch, each answer bounded by `per_txn` records.
    pub(crate) async fn get_many(&self, keys: impl IntoIterator<Item = String>, per_txn: usize) -> Result<Vec<Option<KeyValue>>> {
        let keys: Vec<String> = keys.into_iter().collect();
        let mut out = Vec::with_capacity(keys.len());
        for chunk in keys.chunks(per_txn.min(self.store.max_txn_ops()).max(1)) {
            let txn = Txn { success: chunk.iter().map(TxnOp::get).collect(), ..Txn::default() };
            out.extend(self.store.txn(txn).await?.gets);
        }
        Ok(out)
    }

    /// Every key under `prefix` with its revisions (values left empty),
    /// read in pages of keys only.
    pub(crate) async fn keys_under(&self, prefix: &str) -> Result<Vec<KeyValue>> {
        const KEY_PAGE: usize = 1000;
        let mut keys: Vec<KeyValue> = Vec::new();
        loop {
            let after = keys.last().map(|kv| kv.key.clone()).unwrap_or_default();
            let page = self.store.range_page(prefix, &after, KEY_PAGE, true).await?;
            let full = page.len() == KEY_PAGE;
            keys.extend(page);
            if !full {
                return Ok(keys);
            }
        }
    }

    // ------------------------------------------------------------ tasks

    /// One task definition, with the store's mod revision of its key.
    pub async fn get_task(&self, task_id: &str) -> Result<Option<(TaskRecord, Revision)>> {
        match self.store.get(&self.keys.task(task_id)).await? {
            Some(kv) => Ok(Some((codec::decode("task", &kv.value)?, kv.mod_revision))),
            None => Ok(None),
        }
    }

    /// Pauses a task for the scheduler (a budget with `on_exceeded:
    /// pause`), saying why; a task already paused or gone is left as it
    /// is. A read-modify-write on the record's revision, as a user's pause.
    ///
    /// Errors: store errors; a task changed concurrently five times over.
    pub async fn pause_task_for(&self, task_id: &str, why: &str, now: DateTime<Utc>) -> Result<bool> {
        for _ in 0..5 {
            let Some((mut rec, rev)) = self.get_task(task_id).await? else { return Ok(false) };
            if rec.paused {
                return Ok(false);
            }
            rec.paused = true;
            rec.paused_at = Some(now);
            rec.paused_reason = why.chars().take(512).collect();
            rec.updated_at = now;
            if self.put_task_if(&rec, rev).await? {
                return Ok(true);
            }
        }
        Err(Error::Unavailable { reason: format!("task {task_id} is being changed concurrently"), leader: None })
    }

    /// Writes a task if its key's mod revision is still `expected` (0 =
    /// absent): optimistic concurrency for read-modify-write. Returns false
    /// when someone else changed it first.
    /// Writes a task definition validated against the cluster configuration
    /// at `config_rev` (0: none stored), if its key is still at `expected`
    /// and that configuration is still in force (see [`config`]); false
    /// when either moved.
    ///
    /// Errors: store errors.
    pub async fn put_task_checked(&self, rec: &TaskRecord, expected: Revision, config_rev: Revision) -> Result<bool> {
        let key = self.keys.task(&rec.spec.task_id);
        let (guard, mark) = self.task_write_guard(config_rev);
        let txn = Txn {
            compares: vec![Compare::mod_revision(&key, expected), guard],
            success: vec![TxnOp::put(&key, codec::encode(rec)?), mark],
            failure: vec![],
        };
        Ok(self.store.txn(txn).await?.succeeded)
    }

    /// The apply lock (held by `ApplyTasks`, journal recovery and a
    /// configuration apply: one at a time on a leader).
    pub(crate) async fn lock_applies(&self) -> tokio::sync::OwnedMutexGuard<()> {
        self.apply_lock.clone().lock_owned().await
    }

    /// Overwrites a task record whose definition did not change (pause,
    /// resume) if its key is still at `expected`.
    pub async fn put_task_if(&self, rec: &TaskRecord, expected: Revision) -> Result<bool> {
        let key = self.keys.task(&rec.spec.task_id);
        let txn = Txn {
            compares: vec![Compare::mod_revision(&key, expected)],
            success: vec![TxnOp::put(&key, codec::encode(rec)?)],
            failure: vec![],
        };
        Ok(self.store.txn(txn).await?.succeeded)
    }

    /// Deletes a task definition; false if there was none.
    pub async fn delete_task(&self, task_id: &str) -> Result<bool> {
        self.store.delete(&self.keys.task(task_id)).await
    }

    /// One task's cursor.
    pub async fn get_cursor(&self, task_id: &str) -> Result<Option<Cursor>> {
        match self.store.get(&self.keys.cursor(task_id)).await? {
            Some(kv) => Ok(Some(codec::decode("cursor", &kv.value)?)),
            None => Ok(None),
        }
    }

    /// Every task with its cursor, by task id. Unreadable records are
    /// logged and left out (one bad record must not stop a leader).
    pub async fn load_tasks(&self) -> Result<Vec<(TaskRecord, Option<Cursor>)>> {
        let (task_kvs, _) = self.store.range(&self.keys.tasks()).await?;
        let (cursor_kvs, _) = self.store.range(&self.keys.cursors()).await?;
        // Decoding tens of thousands of records takes seconds of CPU: off
        // the async workers, so the election's lease renewals (and every
        // other task) keep running meanwhile.
        let keys = self.keys.clone();
        tokio::task::spawn_blocking(move || decode_tasks(&keys, task_kvs, cursor_kvs))
            .await
            .map_err(|e| Error::Internal(format!("decoding tasks: {e}")))
    }
}

/// Tasks with their cursors, from the stored key-values; unreadable
/// records are logged and skipped.
fn decode_tasks(keys: &Keys, task_kvs: Vec<KeyValue>, cursor_kvs: Vec<KeyValue>) -> Vec<(TaskRecord, Option<Cursor>)> {
    {
        let mut cursors: HashMap<String, Cursor> = HashMap::new();
        for kv in cursor_kvs {
            let Some(id) = keys.id_after(&keys.cursors(), &kv.key) else { continue };
            match codec::decode::<Cursor>("cursor", &kv.value) {
                Ok(c) => {
                    cursors.insert(id.to_string(), c);
                }
                Err(e) => tracing::error!(key = %kv.key, error = %e, "unreadable cursor"),
            }
        }
        let mut out = Vec::with_capacity(task_kvs.len());
        for kv in task_kvs {
            match codec::decode::<TaskRecord>("task", &kv.value) {
                Ok(rec) => {
                    let cursor = cursors.remove(&rec.spec.task_id);
                    out.push((rec, cursor));
                }
                Err(e) => tracing::error!(key = %kv.key, error = %e, "unreadable task"),
            }
        }
        out
    }
}

impl Repo {
    /// One page of tasks by id: at most `limit` (fewer when they pass
    /// 3 MiB) with ids after `after_id`
    /// (`""`: from the first), each with its cursor, and the id to ask
    /// the next page after (`None` at the end). Reads only that page (and
    /// its cursors), whatever the number of tasks. Unreadable records are
    /// logged and left out.
    pub async fn tasks_page(&self, after_id: &str, limit: usize) -> Result<(Vec<(TaskRecord, Option<Cursor>)>, Option<String>)> {
        // Read in small steps, and end the page early once it holds 3 MiB:
        // a definition may be 256 KiB, and a page is one gRPC answer.
        const STEP: usize = 16;
        const PAGE_BYTES: usize = 3 * 1024 * 1024;
        let mut after = if after_id.is_empty() { String::new() } else { self.keys.task(after_id) };
        let (mut kvs, mut bytes, mut more) = (Vec::new(), 0usize, false);
        while kvs.len() < limit {
            let step = self.store.range_page(&self.keys.tasks(), &after, STEP.min(limit - kvs.len()) + 1, false).await?;
            let ends = step.len() <= STEP.min(limit - kvs.len());
            for kv in step.into_iter().take(STEP.min(limit - kvs.len())) {
                bytes += kv.value.len();
                after = kv.key.clone();
                kvs.push(kv);
            }
            // Another key follows the ones taken, or none does.
            more = !ends;
            if ends || bytes >= PAGE_BYTES {
                break;
            }
        }
        let next = if more { kvs.last().and_then(|kv| self.keys.id_after(&self.keys.tasks(), &kv.key)).map(str::to_string) } else { None };
        let mut records = Vec::with_capacity(kvs.len());
        for kv in kvs {
            match codec::decode::<TaskRecord>("task", &kv.value) {
                Ok(rec) => records.push(rec),
                Err(e) => tracing::error!(key = %kv.key, error = %e, "unreadable task"),
            }
        }
        Ok((self.with_cursors(records).await?, next))
    }

    /// Each task with its cursor (`None`: it never fired, or its cursor is
    /// unreadable — logged), read in as few transactions as the store
    /// allows.
    async fn with_cursors(&self, records: Vec<TaskRecord>) -> Result<Vec<(TaskRecord, Option<Cursor>)>> {
        let cursors = self.get_many(records.iter().map(|r| self.keys.cursor(&r.spec.task_id)), usize::MAX).await?;
        Ok(records
            .into_iter()
            .zip(cursors)
            .map(|(rec, kv)| {
                let cursor = kv.and_then(|kv| {
                    codec::decode::<Cursor>("cursor", &kv.value)
                        .map_err(|e| tracing::error!(task_id = %rec.spec.task_id, error = %e, "unreadable cursor"))
                        .ok()
                });
                (rec, cursor)
            })
            .collect())
    }

    /// Tasks after `after_id` in id order whose stored bytes pass `raw` (a
    /// test on the encoded record, made before it is decoded), read
    /// [`SCAN_STEP`] keys at a time, until `want` have passed or the tasks
    /// end: (the passing records with their cursors, the id of the
    /// last key read — the scan goes on after it — or empty when the tasks
    /// ended). A search reads every task: what it skips undecoded costs a
    /// key's bytes, not a record.
    pub async fn scan_tasks(
        &self,
        after_id: &str,
        want: usize,
        raw: impl Fn(&[u8]) -> bool,
    ) -> Result<(Vec<(TaskRecord, Option<Cursor>)>, String)> {
        let prefix = self.keys.tasks();
        let mut after = if after_id.is_empty() { String::new() } else { self.keys.task(after_id) };
        let (mut records, mut ended) = (Vec::new(), false);
        while records.len() < want {
            let step = self.store.range_page(&prefix, &after, SCAN_STEP, false).await?;
            ended = step.len() < SCAN_STEP;
            for kv in step {
                after = kv.key;
                if !raw(&kv.value) {
                    continue;
                }
                match codec::decode::<TaskRecord>("task", &kv.value) {
                    Ok(rec) => records.push(rec),
                    Err(e) => tracing::error!(key = %after, error = %e, "unreadable task"),
                }
                if records.len() == want {
                    ended = false;
                    break;
                }
            }
            if ended {
                break;
            }
        }
        let next = if ended { String::new() } else { self.keys.id_after(&prefix, &after).unwrap_or_default().to_string() };
        Ok((self.with_cursors(records).await?, next))
    }

    /// Changes to task definitions committed after this call returns.
    /// An `Err` item means the watch broke: load again and re-watch.
    pub async fn watch_tasks(&self) -> Result<BoxStream<'static, Result<TaskChange>>> {
        let keys = self.keys.clone();
        let watch = self.store.watch(&self.keys.tasks()).await?;
        Ok(watch
            .filter_map(move |ev| {
                let out = match ev {
                    Ok(WatchEvent::Put(kv)) => match codec::decode::<TaskRecord>("task", &kv.value) {
                        Ok(rec) => Some(Ok(TaskChange::Put(Box::new(rec)))),
                        Err(e) => {
                            tracing::error!(key = %kv.key, error = %e, "unreadable task");
                            None
                        }
                    },
                    Ok(WatchEvent::Delete { key, .. }) => {
                        keys.id_after(&keys.tasks(), &key).map(|id| Ok(TaskChange::Deleted(id.to_string())))
                    }
                    Err(e) => Some(Err(e)),
                };
                futures::future::ready(out)
            })
            .boxed())
    }

    // ------------------------------------------------------------- runs

    /// One run.
    pub async fn get_run(&self, run_id: &str) -> Result<Option<RunRecord>> {
        match self.store.get(&self.keys.run(run_id)).await? {
            Some(kv) => Ok(Some(codec::decode("run", &kv.value)?)),
            None => Ok(None),
        }
    }

    /// The runs of `ids` that exist, read a few per request (records are
    /// up to 512 KiB).
    pub async fn get_runs(&self, ids: &[&str]) -> Result<Vec<RunRecord>> {
        let gets = self.get_many(ids.iter().map(|id| self.keys.run(id)), 8).await?;
        gets.into_iter().flatten().map(|kv| codec::decode::<RunRecord>("run", &kv.value)).collect()
    }

    /// Up to `limit` runs of one task (`task_id` non-empty) or of all
    /// tasks, in key order, after the key `after` (the start when empty),
    /// and the key to continue after (`None`: that was the last page).
    pub async fn runs_page(&self, task_id: &str, after: &str, limit: usize) -> Result<(Vec<RunRecord>, Option<String>)> {
        let prefix = if task_id.is_empty() { self.keys.runs() } else { self.keys.runs_of(task_id) };
        let page = self.store.range_page(&prefix, after, limit, false).await?;
        let next = if page.len() == limit { page.last().map(|kv| kv.key.clone()) } else { None };
        let runs = page.iter().map(|kv| codec::decode::<RunRecord>("run", &kv.value)).collect::<Result<_>>()?;
        Ok((runs, next))
    }

    /// Whether the time index covers every run (`meta/history-index` is
    /// `done`: written by this version from the start, or built since).
    pub async fn history_index_whole(&self) -> Result<bool> {
        Ok(self.store.get(&self.keys.history_index_state()).await?.is_some_and(|kv| kv.value == retention::HISTORY_INDEX_DONE))
    }

    /// Every run of one task (`task_id` non-empty) or of all tasks, in key
    /// order, and the revision read at.
    pub async fn list_runs(&self, task_id: &str) -> Result<(Vec<RunRecord>, Revision)> {
        let prefix = if task_id.is_empty() { self.keys.runs() } else { self.keys.runs_of(task_id) };
        let (kvs, rev) = self.store.range(&prefix).await?;
        let runs = kvs.iter().map(|kv| codec::decode::<RunRecord>("run", &kv.value)).collect::<Result<_>>()?;
        Ok((runs, rev))
    }

    /// Changes to run records (all, or of one task) committed after this
    /// call returns. An `Err` item means the watch broke.
    pub async fn watch_runs(&self, task_id: &str) -> Result<BoxStream<'static, Result<RunRecord>>> {
        let prefix = if task_id.is_empty() { self.keys.runs() } else { self.keys.runs_of(task_id) };
        let watch = self.store.watch(&prefix).await?;
        Ok(watch
            .filter_map(|ev| {
                futures::future::ready(match ev {
                    Ok(WatchEvent::Put(kv)) => Some(codec::decode::<RunRecord>("run", &kv.value)),
                    Ok(WatchEvent::Delete { .. }) => None,
                    Err(e) => Some(Err(e)),
                })
            })
            .boxed())
    }

    /// Every backfill (a few hundred at most: finished ones are kept as
    /// records until deleted by hand).
    pub async fn load_backfills(&self) -> Result<Vec<crate::model::backfill::Backfill>> {
        let (kvs, _) = self.store.range(&self.keys.backfills()).await?;
        kvs.iter().map(|kv| codec::decode("backfill", &kv.value)).collect()
    }

    /// One backfill.
    pub async fn get_backfill(&self, id: &str) -> Result<Option<crate::model::backfill::Backfill>> {
        match self.store.get(&self.keys.backfill(id)).await? {
            Some(kv) => Ok(Some(codec::decode("backfill", &kv.value)?)),
            None => Ok(None),
        }
    }

    /// The ids of the re-runs of `run_id` kept in the store
    /// (`{run_id}.rerun-{n}`, `runs rerun`), in key order; at most 1,000.
    pub async fn rerun_ids(&self, run_id: &str) -> Result<Vec<String>> {
        let prefix = format!("{}{}", self.keys.run(run_id), crate::model::run::RERUN_INFIX);
        let page = self.store.range_page(&prefix, "", 1000, true).await?;
        let runs = self.keys.runs();
        // Its own re-runs only (`{run_id}.rerun-{n}`), not theirs
        // (`{run_id}.rerun-1.rerun-1`).
        Ok(page
            .iter()
            .filter(|kv| kv.key.strip_prefix(&prefix).is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit())))
            .filter_map(|kv| kv.key.strip_prefix(&runs).map(str::to_string))
            .collect())
    }

    /// The stored event bodies of `run_ids`, in order (`None`: none stored).
    pub async fn event_bodies(&self, run_ids: &[String]) -> Result<Vec<Option<Vec<u8>>>> {
        let kvs = self.get_many(run_ids.iter().map(|id| self.keys.event_body(id)), 16).await?;
        Ok(kvs.into_iter().map(|kv| kv.map(|kv| kv.value)).collect())
    }

    /// The dedup keys of `keys` (event id runs), in order (`None`: none
    /// stored), one read per 128.
    pub async fn dedup_claims(&self, keys: &[String]) -> Result<Vec<Option<crate::model::event::DedupClaim>>> {
        let kvs = self.get_many(keys.iter().map(|k| self.keys.dedup(k)), 128).await?;
        kvs.into_iter().map(|kv| kv.map(|kv| codec::decode("dedup claim", &kv.value)).transpose()).collect()
    }

    /// Which of `run_ids` exist, in order (one read per 128 runs).
    pub async fn runs_exist(&self, run_ids: &[String]) -> Result<Vec<bool>> {
        let kvs = self.get_many(run_ids.iter().map(|id| self.keys.run(id)), 128).await?;
        Ok(kvs.into_iter().map(|kv| kv.is_some()).collect())
    }

    /// Every run in the `active/` index (non-terminal, or holding an agent
    /// its runner has not confirmed gone), read in batched transactions of
    /// gets: one round trip per 100 runs, so a new leader is up quickly even
    /// with a backlog.
    pub async fn load_active_runs(&self) -> Result<Vec<RunRecord>> {
        const LOAD_BATCH: usize = 100;
        let (index, _) = self.store.range(&self.keys.active_runs()).await?;
        let ids: Vec<String> =
            index.iter().filter_map(|kv| self.keys.id_after(&self.keys.active_runs(), &kv.key).map(str::to_string)).collect();
        let mut out = Vec::with_capacity(ids.len());
        let gets = self.get_many(ids.iter().map(|id| self.keys.run(id)), LOAD_BATCH).await?;
        for (id, kv) in ids.iter().zip(gets) {
            match kv.map(|kv| codec::decode::<RunRecord>("run", &kv.value)) {
                Some(Ok(run)) => out.push(run),
                Some(Err(e)) => tracing::error!(run_id = %id, error = %e, "unreadable run"),
                None => tracing::warn!(run_id = %id, "active index names a missing run"),
            }
        }
        Ok(out)
    }

    /// The resources held back (`holds/`), for a new leader: `(resource,
    /// hold)`, ended ones included (the caller skips them). An unreadable
    /// record is logged and left out.
    ///
    /// Errors: store errors.
    pub async fn load_holds(&self) -> Result<Vec<(String, crate::model::run::HoldBack)>> {
        let prefix = self.keys.holds();
        let (kvs, _) = self.store.range(&prefix).await?;
        Ok(kvs
            .into_iter()
            .filter_map(|kv| {
                let name = self.keys.id_after(&prefix, &kv.key)?.to_string();
                match codec::decode::<crate::model::run::HoldBack>("hold", &kv.value) {
                    Ok(h) => Some((name, h)),
                    Err(e) => {
                        tracing::error!(key = %kv.key, error = %e, "unreadable hold-back left out");
                        None
                    }
                }
            })
            .collect())
    }

    // ----------------------------------------------------------- writes

    fn txn_ops(&self, op: &StoreOp) -> Result<(Vec<Compare>, Vec<TxnOp>, Vec<TxnOp>)> {
        Ok(match op {
            StoreOp::CreateRun(run) | StoreOp::PutRun(run) => {
                let key = self.keys.run(&run.run_id);
                let active = self.keys.active_run(&run.run_id);
                // The index holds runs a new leader must load: not terminal,
                // or holding an agent its runner has not confirmed gone.
                let index =
                    if run.status.is_terminal() && !run.holds_agent() { TxnOp::delete(active) } else { TxnOp::put(active, Vec::new()) };
                let mut puts = vec![TxnOp::put(&key, encode_run(run)?), index];
                // A finished run goes to the archive (the mover takes it).
                if self.archived && run.status.is_terminal() && !run.holds_agent() {
                    puts.push(TxnOp::put(self.keys.archive_out_item(&run.run_id), Vec::new()));
                }
                match op {
                    StoreOp::CreateRun(_) => {
                        // The time index, once: a run's slot never changes.
                        puts.push(TxnOp::put(self.keys.history_entry(run.scheduled_at, &run.run_id), Vec::new()));
                        puts.push(TxnOp::put(self.keys.task_history_entry(&run.task_id, run.scheduled_at, &run.run_id), Vec::new()));
                        // The event id's dedup key, with the run it names.
                        if let Some(claim) = &run.dedup {
                            puts.push(TxnOp::put(self.keys.dedup(&claim.key), codec::encode(claim)?));
                        }
                        (vec![Compare::absent(&key)], puts, vec![TxnOp::get(key)])
                    }
                    _ => (Vec::new(), puts, Vec::new()),
                }
            }
            StoreOp::PutCursor { task_id, cursor } => {
                (Vec::new(), vec![TxnOp::put(self.keys.cursor(task_id), codec::encode(cursor)?)], Vec::new())
            }
            StoreOp::DeleteCursor { task_id } => (Vec::new(), vec![TxnOp::delete(self.keys.cursor(task_id))], Vec::new()),
            StoreOp::PutNotification(n) => (Vec::new(), vec![TxnOp::put(self.keys.outbox_item(&n.id), codec::encode(n)?)], Vec::new()),
            StoreOp::PutEventBody { run_id, body } => {
                (Vec::new(), vec![TxnOp::put(self.keys.event_body(run_id), body.to_vec())], Vec::new())
            }
            StoreOp::PutBackfill(b) => (Vec::new(), vec![TxnOp::put(self.keys.backfill(&b.id), codec::encode(b)?)], Vec::new()),
            StoreOp::PutCharge { budget, window_start, run_id, amount } => (
                Vec::new(),
                vec![TxnOp::put(self.keys.budget_charge(budget, window_start.timestamp(), run_id), codec::encode(amount)?)],
                Vec::new(),
            ),
            StoreOp::PutHoldBack { resource, hold } => {
                (Vec::new(), vec![TxnOp::put(self.keys.hold(resource), codec::encode(hold)?)], Vec::new())
            }
            StoreOp::DeleteHoldBack { resource } => (Vec::new(), vec![TxnOp::delete(self.keys.hold(resource))], Vec::new()),
        })
    }

    /// Commits `groups` under the leader's fence: each group atomically, as
    /// few transactions as the store's limits allow, in order (a later
    /// group never commits before an earlier one).
    ///
    /// Errors: [`Error::Fenced`] when the fence fails (a newer leader
    /// exists); [`Error::AlreadyExists`] naming a run whose `CreateRun`
    /// found it present (nothing of that transaction is written); store
    /// errors as they come. Transactions before the failing one stay
    /// committed.
    pub async fn commit(&self, lead: &Leadership, groups: Vec<Vec<StoreOp>>) -> Result<CommitStats> {
        let limits = Limits { ops: self.store.max_txn_ops(), bytes: self.store.max_txn_bytes(), fence: lead.fence.len() };
        let mut stats = CommitStats::default();
        let mut txn = Part::default();
        for group in groups {
            let parts = group.iter().map(|op| self.txn_ops(op).map(Part::from)).collect::<Result<Vec<Part>>>()?;
            // A group too large for one transaction (many catch-up runs with
            // big params) goes op by op, in order: its cursor, last, still
            // commits after its records. A crash in between leaves records
            // without the cursor; the next leader meets them as existing runs
            // (see the shell's conflict recovery).
            let whole = parts.iter().fold(Size::default(), |acc, p| acc + p.size());
            let pieces = if limits.fits(Size::default(), whole) { vec![Part::merged(parts)] } else { parts };
            for piece in pieces {
                if !txn.success.is_empty() && !limits.fits(txn.size(), piece.size()) {
                    stats.revision = self.commit_one(lead, std::mem::take(&mut txn).into_txn()).await?;
                    stats.transactions += 1;
                }
                txn.extend(piece);
            }
        }
        if !txn.success.is_empty() {
            stats.revision = self.commit_one(lead, txn.into_txn()).await?;
            stats.transactions += 1;
        }
        Ok(stats)
    }

    /// Runs `txn` under the leader's fence. `Ok(Ok(revision))` when it
    /// committed; `Ok(Err(gets))` when the fence holds but the txn's own
    /// compares failed (`gets`: its failure branch's reads).
    ///
    /// Errors: [`Error::Fenced`] when the fence fails; store errors.
    async fn fenced_txn(&self, lead: &Leadership, mut txn: Txn) -> Result<std::result::Result<Revision, Vec<Option<KeyValue>>>> {
        // The failure branch reads the fence keys first, to tell "fenced"
        // from the txn's own compares failing.
        let fence_gets: Vec<TxnOp> = lead.fence.iter().map(|c| TxnOp::get(&c.key)).collect();
        txn.compares.extend(lead.fence.iter().cloned());
        txn.failure.splice(0..0, fence_gets);
        let started = std::time::Instant::now();
        let r = self.store.txn(txn).await;
        if let Some(h) = &self.txn_timer {
            h.observe(started.elapsed().as_secs_f64());
        }
        let r = r?;
        if r.succeeded {
            return Ok(Ok(r.revision));
        }
        let fence_holds = lead.fence.iter().zip(&r.gets).all(|(c, kv)| c.holds(kv.as_ref()));
        if !fence_holds {
            return Err(Error::Fenced(format!("fencing token {} is stale: a newer leader exists", lead.token)));
        }
        Ok(Err(r.gets.into_iter().skip(lead.fence.len()).collect()))
    }

    async fn commit_one(&self, lead: &Leadership, txn: Txn) -> Result<Revision> {
        // The failure branch reads every run to create, to tell "already
        // exists" from other failures.
        let creates: Vec<String> =
            txn.failure.iter().filter_map(|op| if let TxnOp::Get { key } = op { Some(key.clone()) } else { None }).collect();
        let gets = match self.fenced_txn(lead, txn).await? {
            Ok(revision) => return Ok(revision),
            Err(gets) => gets,
        };
        let taken = creates.iter().zip(gets.iter()).find(|(_, kv)| kv.is_some());
        match taken {
            Some((key, _)) => {
                let id = self.keys.id_after(&self.keys.runs(), key).unwrap_or(key).to_string();
                Err(Error::AlreadyExists { kind: "run", id })
            }
            None => Err(Error::Store("a transaction's compares failed for no known reason".into())),
        }
    }

    /// Moves a task's cursor up to `slot` (never back), under the fence: the
    /// recovery when a slot's run turned out to exist already.
    ///
    /// Errors: [`Error::Fenced`]; store errors.
    pub async fn advance_cursor(&self, lead: &Leadership, task_id: &str, slot: DateTime<Utc>, now: DateTime<Utc>) -> Result<()> {
        let current = self.get_cursor(task_id).await?;
        if current.as_ref().and_then(|c| c.last_slot).is_some_and(|l| l >= slot) {
            return Ok(());
        }
        // The breaker (and anything else in the cursor) is kept.
        let cursor = Cursor { last_slot: Some(slot), updated_at: Some(now), ..current.unwrap_or_default() };
        self.commit(lead, vec![vec![StoreOp::PutCursor { task_id: task_id.to_string(), cursor }]]).await.map(|_| ())
    }

    /// Creates one run if absent, under the fence: `Ok(false)` when the run
    /// already exists (another replica, or this leader before a failover,
    /// took the slot). Used by the slot-race test against a real etcd.
    ///
    /// Errors: [`Error::Fenced`] when the fence fails; store errors.
    pub async fn create_run(&self, lead: &Leadership, now: DateTime<Utc>, run: &mut RunRecord) -> Result<bool> {
        run.fencing_token = lead.token;
        run.updated_at = now;
        match self.commit(lead, vec![vec![StoreOp::CreateRun(Box::new(run.clone()))]]).await {
            Ok(_) => Ok(true),
            Err(Error::AlreadyExists { .. }) => Ok(false),
            Err(e) => Err(e),
        }
    }
}

/// Part of a transaction being packed.
#[derive(Debug, Clone, Default)]
struct Part {
    compares: Vec<Compare>,
    success: Vec<TxnOp>,
    failure: Vec<TxnOp>,
    bytes: usize,
}

impl From<(Vec<Compare>, Vec<TxnOp>, Vec<TxnOp>)> for Part {
    fn from((compares, success, failure): (Vec<Compare>, Vec<TxnOp>, Vec<TxnOp>)) -> Self {
        let bytes = success.iter().map(op_bytes).sum();
        Part { compares, success, failure, bytes }
    }
}

impl Part {
    /// The parts moved into one.
    fn merged(parts: Vec<Part>) -> Part {
        parts.into_iter().fold(Part::default(), |mut acc, p| {
            acc.extend(p);
            acc
        })
    }

    /// What [`Limits::fits`] reads of a part.
    fn size(&self) -> Size {
        Size { compares: self.compares.len(), success: self.success.len(), failure: self.failure.len(), bytes: self.bytes }
    }

    fn extend(&mut self, other: Part) {
        self.compares.extend(other.compares);
        self.success.extend(other.success);
        self.failure.extend(other.failure);
        self.bytes += other.bytes;
    }

    fn into_txn(self) -> Txn {
        Txn { compares: self.compares, success: self.success, failure: self.failure }
    }
}

/// A store's transaction limits (the fence adds a compare and a get).
struct Limits {
    ops: usize,
    bytes: usize,
    fence: usize,
}

/// A part's op counts and bytes.
#[derive(Debug, Clone, Copy, Default)]
struct Size {
    compares: usize,
    success: usize,
    failure: usize,
    bytes: usize,
}

impl std::ops::Add for Size {
    type Output = Size;
    fn add(self, o: Size) -> Size {
        Size {
            compares: self.compares + o.compares,
            success: self.success + o.success,
            failure: self.failure + o.failure,
            bytes: self.bytes + o.bytes,
        }
    }
}

impl Limits {
    /// Whether `add` fits in a transaction of size `into`.
    fn fits(&self, into: Size, add: Size) -> bool {
        let t = into + add;
        t.compares + self.fence <= self.ops && t.success <= self.ops && t.failure + self.fence <= self.ops && t.bytes <= self.bytes
    }
}

fn op_bytes(op: &TxnOp) -> usize {
    match op {
        TxnOp::Put { key, value, .. } => key.len() + value.len() + 16,
        TxnOp::Delete { key } | TxnOp::Get { key } => key.len() + 16,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::run::TriggerKind;
    use crate::store::embedded::EmbeddedStore;
    use crate::store::{LeaseId, WatchStream};

    fn run(id: &str) -> RunRecord {
        let t: DateTime<Utc> = "2026-12-01T00:00:00Z".parse().expect("t");
        RunRecord::pending(id.into(), "t", "a", TriggerKind::Manual, t, t)
    }

    /// Found by breaking it: 64 KiB tails of control characters (6 bytes
    /// each once escaped), a big result and checkpoint made a record etcd
    /// refused, and the engine restarted forever. Params (an input, at most
    /// 64 KiB) stay whole.
    #[test]
    fn a_huge_run_record_is_trimmed_to_fit() {
        let mut r = run("t.manual-1");
        r.stdout_tail = "\u{1}".repeat(64 * 1024);
        r.stderr_tail = "\u{1}".repeat(64 * 1024);
        r.result = Some(serde_json::json!({"r": "\u{1}".repeat(80_000)}));
        r.progress = Some(crate::model::Progress {
            percent: None,
            message: String::new(),
            checkpoint: Some(serde_json::json!("\u{1}".repeat(40_000))),
            updated_at: r.updated_at,
        });
        r.params.insert("p".into(), serde_json::json!("x".repeat(60_000)));
        let params = r.params.clone();
        assert!(codec::encode(&r).expect("encode").len() > 1_000_000);
        let bytes = encode_run(&r).expect("encode");
        assert!(bytes.len() <= MAX_RUN_RECORD_BYTES, "{}", bytes.len());
        let back: RunRecord = codec::decode("run", &bytes).expect("decode");
        assert!(back.stdout_tail.starts_with("[trimmed to fit the store]"));
        assert_eq!(back.result.as_ref().and_then(|v| v.get("trimmed")), Some(&serde_json::Value::Bool(true)));
        assert_eq!(back.params, params, "params are never trimmed");
        // A record that fits is stored as it is.
        let small = run("t.manual-2");
        assert_eq!(encode_run(&small).expect("encode"), codec::encode(&small).expect("encode"));
    }

    /// Issue 19: a 144-byte result was replaced by a marker because the
    /// result went before the params. The largest output goes first, and a
    /// result under 1 KiB is never replaced.
    #[test]
    fn a_small_result_is_never_replaced() {
        let mut r = run("t.manual-3");
        r.result = Some(serde_json::json!({"summary": "x".repeat(120)}));
        let result = r.result.clone();
        r.stdout_tail = "\u{1}".repeat(64 * 1024);
        r.stderr_tail = "\u{1}".repeat(64 * 1024);
        r.progress = Some(crate::model::Progress {
            percent: None,
            message: String::new(),
            checkpoint: Some(serde_json::json!("c".repeat(600_000))),
            updated_at: r.updated_at,
        });
        r.params.insert("p".into(), serde_json::json!("\u{1}".repeat(10_000)));
        let params = r.params.clone();
        let back: RunRecord = codec::decode("run", &encode_run(&r).expect("encode")).expect("decode");
        assert_eq!(back.result, result, "a 144-byte result stays");
        assert_eq!(back.params, params);
        assert_eq!(back.progress.and_then(|p| p.checkpoint).and_then(|c| c.get("trimmed").cloned()), Some(serde_json::json!(true)));
    }

    /// The worst a run record can hold, every input at its limit — 64 KiB
    /// of params escaped six times over, 8 KiB of baggage, 512 bytes of
    /// trace state, 1,004 attempts (max_retries 1,000 and three free
    /// interruptions) from 128-character runner ids with long errors and
    /// late reports, and outputs of megabytes — fits the store without
    /// touching an input.
    #[test]
    fn the_largest_possible_record_fits_with_its_inputs_whole() {
        let mut r = run("t.manual-4");
        let mut n = 0;
        while crate::model::task::json_bytes(&serde_json::Value::Object(r.params.clone())) < crate::model::task::MAX_PARAMS_BYTES - 64 {
            r.params.insert(format!("k{n}"), serde_json::json!("\u{1}".repeat(100)));
            n += 1;
        }
        r.baggage = "b".repeat(8192);
        r.trace_state = "s".repeat(512);
        let t = r.updated_at;
        for i in 0..1004u32 {
            r.attempts.push(crate::model::Attempt {
                attempt: i + 1,
                execution_id: uuid::Uuid::new_v4().to_string(),
                runner_id: "r".repeat(128),
                runner_instance: uuid::Uuid::new_v4().to_string(),
                dispatched_at: t,
                started_at: Some(t),
                finished_at: Some(t),
                outcome: Some(crate::model::run::Outcome::Failed),
                error: Some("e".repeat(4000)),
                exit_code: Some(1),
                awaiting_runner: false,
                report: Some(crate::model::run::AttemptReport {
                    outcome: crate::model::run::Outcome::Failed,
                    error: Some("e".repeat(4000)),
                    exit_code: Some(1),
                    result: Some(serde_json::json!("x".repeat(2000))),
                    finished_at: t,
                }),
                usage: None,
                ..Default::default()
            });
        }
        r.stdout_tail = "\u{1}".repeat(64 * 1024);
        r.stderr_tail = "\u{1}".repeat(64 * 1024);
        r.result = Some(serde_json::json!("\u{1}".repeat(500_000)));
        let (params, baggage, trace_state) = (r.params.clone(), r.baggage.clone(), r.trace_state.clone());
        let bytes = encode_run(&r).expect("encode");
        assert!(bytes.len() <= MAX_RUN_RECORD_BYTES, "{} bytes", bytes.len());
        let back: RunRecord = codec::decode("run", &bytes).expect("decode");
        assert_eq!((&back.params, &back.baggage, &back.trace_state), (&params, &baggage, &trace_state));
        assert_eq!(back.attempt_count(), 1004, "elided attempts still count");
        assert_eq!(back.attempts.len(), 1 + crate::model::run::KEPT_LATEST_ATTEMPTS);
        assert_eq!(back.counted_attempts(), r.counted_attempts());
    }

    /// An embedded store that says it takes at most `ops` operations per
    /// transaction, like etcd's `--max-txn-ops`.
    struct Limited(EmbeddedStore, usize);

    #[async_trait::async_trait]
    impl KvStore for Limited {
        async fn get(&self, key: &str) -> Result<Option<crate::store::KeyValue>> {
            self.0.get(key).await
        }
        async fn range(&self, prefix: &str) -> Result<(Vec<crate::store::KeyValue>, Revision)> {
            self.0.range(prefix).await
        }
        async fn range_page(&self, prefix: &str, after: &str, limit: usize, keys_only: bool) -> Result<Vec<crate::store::KeyValue>> {
            self.0.range_page(prefix, after, limit, keys_only).await
        }
        async fn range_page_rev(&self, prefix: &str, before: &str, limit: usize, keys_only: bool) -> Result<Vec<crate::store::KeyValue>> {
            self.0.range_page_rev(prefix, before, limit, keys_only).await
        }
        async fn txn(&self, txn: Txn) -> Result<crate::store::TxnResult> {
            assert!(txn.success.len() <= self.1 && txn.compares.len() <= self.1 && txn.failure.len() <= self.1, "over the limit");
            self.0.txn(txn).await
        }
        async fn watch(&self, prefix: &str) -> Result<WatchStream> {
            self.0.watch(prefix).await
        }
        async fn grant_lease(&self, ttl: i64) -> Result<LeaseId> {
            self.0.grant_lease(ttl).await
        }
        async fn keep_alive(&self, lease: LeaseId) -> Result<i64> {
            self.0.keep_alive(lease).await
        }
        async fn revoke_lease(&self, lease: LeaseId) -> Result<()> {
            self.0.revoke_lease(lease).await
        }
        fn describe(&self) -> String {
            "limited".into()
        }
        fn max_txn_ops(&self) -> usize {
            self.1
        }
    }

    /// Found by breaking it: a page of 100 tasks with 240 KiB contexts was
    /// a 22 MB answer, and 300 of them passed every message limit.
    #[tokio::test]
    async fn a_task_page_stops_near_three_mebibytes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Arc::new(EmbeddedStore::open(dir.path()).await.expect("open"));
        let repo = Repo::new(store.clone(), Keys::default());
        let t: DateTime<Utc> = "2026-12-01T00:00:00Z".parse().expect("t");
        for i in 0..20 {
            let json = serde_json::json!({"task_id": format!("big{i:02}"), "agent_id": "a", "description": "d".repeat(250_000)});
            let spec = crate::model::TaskSpec::from_json(&json.to_string()).expect("spec");
            let rec = TaskRecord {
                spec,
                applied: None,
                paused: false,
                paused_at: None,
                paused_reason: String::new(),
                resumed_at: None,
                created_at: t,
                updated_at: t,
            };
            store.put(&Keys::default().task(&rec.spec.task_id), codec::encode(&rec).expect("encode")).await.expect("put");
        }
        let (first, next) = repo.tasks_page("", 1000).await.expect("page");
        assert!(first.len() < 20 && first.len() >= 12, "{} tasks in the first page", first.len());
        let next = next.expect("more pages");
        let (rest, end) = repo.tasks_page(&next, 1000).await.expect("page");
        assert_eq!(first.len() + rest.len(), 20, "every task once");
        assert!(end.is_none());
        let (exact, after) = repo.tasks_page("big09", 10).await.expect("page");
        assert_eq!((exact.len(), after), (10, None), "a page that ends with the last task says so");
    }

    #[tokio::test]
    async fn commit_packs_groups_within_the_store_limits_in_order() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Arc::new(Limited(EmbeddedStore::open(dir.path()).await.expect("open"), 18));
        let repo = Repo::new(store.clone(), Keys::default());
        let lead = Leadership { token: 1, fence: Vec::new() };
        // 3 groups of 2 creates (8 writes each: 2 records, their active and
        // two time index entries): 2 groups fit a transaction.
        let groups: Vec<Vec<StoreOp>> =
            (0..3).map(|g| (0..2).map(|i| StoreOp::CreateRun(Box::new(run(&format!("t.manual-{g}-{i}"))))).collect()).collect();
        let stats = repo.commit(&lead, groups).await.expect("commit");
        assert_eq!(stats.transactions, 2, "{stats:?}");
        // A group too large for one transaction goes in pieces, cursor last.
        let mut big: Vec<StoreOp> = (0..6).map(|i| StoreOp::CreateRun(Box::new(run(&format!("t.manual-big-{i}"))))).collect();
        big.push(StoreOp::PutCursor { task_id: "t".into(), cursor: Cursor::default() });
        let stats = repo.commit(&lead, vec![big]).await.expect("commit");
        assert!(stats.transactions >= 2, "{stats:?}");
        assert!(repo.get_cursor("t").await.expect("cursor").is_some());
        assert_eq!(repo.list_runs("t").await.expect("runs").0.len(), 12);
        // Creating an existing run is refused and names it.
        let again = repo.commit(&lead, vec![vec![StoreOp::CreateRun(Box::new(run("t.manual-0-0")))]]).await;
        assert!(matches!(again, Err(Error::AlreadyExists { ref id, .. }) if id == "t.manual-0-0"), "{again:?}");
    }
}
