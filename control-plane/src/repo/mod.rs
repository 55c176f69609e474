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

pub mod codec;
mod keys;

use std::collections::HashMap;
use std::sync::Arc;

use chrono::{DateTime, Utc};
use futures::StreamExt;
use futures::stream::BoxStream;

pub use keys::Keys;

use crate::election::Leadership;
use crate::error::{Error, Result};
use crate::model::{Cursor, RunRecord, TaskRecord};
use crate::store::{Compare, KvStore, Revision, Txn, TxnOp, WatchEvent};

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
}

impl Repo {
    /// The repository over `store`, keys under `keys`' prefix.
    pub fn new(store: Arc<dyn KvStore>, keys: Keys) -> Self {
        Repo { store, keys }
    }

    /// The key layout.
    pub fn keys(&self) -> &Keys {
        &self.keys
    }

    /// The underlying store.
    pub fn store(&self) -> &Arc<dyn KvStore> {
        &self.store
    }

    // ------------------------------------------------------------ tasks

    /// One task definition, with the store's mod revision of its key.
    pub async fn get_task(&self, task_id: &str) -> Result<Option<(TaskRecord, Revision)>> {
        match self.store.get(&self.keys.task(task_id)).await? {
            Some(kv) => Ok(Some((codec::decode("task", &kv.value)?, kv.mod_revision))),
            None => Ok(None),
        }
    }

    /// Writes a task if its key's mod revision is still `expected` (0 =
    /// absent): optimistic concurrency for read-modify-write. Returns false
    /// when someone else changed it first.
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
        let mut cursors: HashMap<String, Cursor> = HashMap::new();
        for kv in cursor_kvs {
            let Some(id) = self.keys.id_after(&self.keys.cursors(), &kv.key) else { continue };
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
        Ok(out)
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
        for chunk in ids.chunks(LOAD_BATCH) {
            let txn = Txn { success: chunk.iter().map(|id| TxnOp::get(self.keys.run(id))).collect(), ..Default::default() };
            let r = self.store.txn(txn).await?;
            for (id, kv) in chunk.iter().zip(r.gets) {
                match kv.map(|kv| codec::decode::<RunRecord>("run", &kv.value)) {
                    Some(Ok(run)) => out.push(run),
                    Some(Err(e)) => tracing::error!(run_id = %id, error = %e, "unreadable run"),
                    None => tracing::warn!(run_id = %id, "active index names a missing run"),
                }
            }
        }
        Ok(out)
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
                let puts = vec![TxnOp::put(&key, codec::encode(run.as_ref())?), index];
                match op {
                    StoreOp::CreateRun(_) => (vec![Compare::absent(&key)], puts, vec![TxnOp::get(key)]),
                    _ => (Vec::new(), puts, Vec::new()),
                }
            }
            StoreOp::PutCursor { task_id, cursor } => {
                (Vec::new(), vec![TxnOp::put(self.keys.cursor(task_id), codec::encode(cursor)?)], Vec::new())
            }
            StoreOp::DeleteCursor { task_id } => (Vec::new(), vec![TxnOp::delete(self.keys.cursor(task_id))], Vec::new()),
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
        let max_ops = self.store.max_txn_ops();
        let max_bytes = self.store.max_txn_bytes();
        let mut stats = CommitStats::default();
        let mut txn = Txn::default();
        let mut bytes = 0usize;
        for group in groups {
            let mut compares = Vec::new();
            let mut success = Vec::new();
            let mut failure = Vec::new();
            for op in &group {
                let (c, s, f) = self.txn_ops(op)?;
                compares.extend(c);
                success.extend(s);
                failure.extend(f);
            }
            let group_bytes: usize = success.iter().map(op_bytes).sum();
            let fits = |t: &Txn, b: usize| {
                let fence = lead.fence.len();
                t.compares.len() + compares.len() + fence <= max_ops
                    && t.success.len() + success.len() <= max_ops
                    && t.failure.len() + failure.len() + fence <= max_ops
                    && b + group_bytes <= max_bytes
            };
            if !txn.success.is_empty() && !fits(&txn, bytes) {
                stats.revision = self.commit_one(lead, std::mem::take(&mut txn)).await?;
                stats.transactions += 1;
                bytes = 0;
            }
            txn.compares.extend(compares);
            txn.success.extend(success);
            txn.failure.extend(failure);
            bytes += group_bytes;
        }
        if !txn.success.is_empty() {
            stats.revision = self.commit_one(lead, txn).await?;
            stats.transactions += 1;
        }
        Ok(stats)
    }

    async fn commit_one(&self, lead: &Leadership, mut txn: Txn) -> Result<Revision> {
        // The failure branch reads the fence key and every run to create, to
        // tell "fenced" from "already exists".
        let fence_gets: Vec<TxnOp> = lead.fence.iter().map(|c| TxnOp::get(&c.key)).collect();
        let creates: Vec<String> =
            txn.failure.iter().filter_map(|op| if let TxnOp::Get { key } = op { Some(key.clone()) } else { None }).collect();
        txn.compares.extend(lead.fence.iter().cloned());
        txn.failure.splice(0..0, fence_gets);
        let r = self.store.txn(txn).await?;
        if r.succeeded {
            return Ok(r.revision);
        }
        let fence_holds = lead.fence.iter().zip(&r.gets).all(|(c, kv)| c.holds(kv.as_ref()));
        if !fence_holds {
            return Err(Error::Fenced(format!("fencing token {} is stale: a newer leader exists", lead.token)));
        }
        let taken = creates.iter().zip(r.gets.iter().skip(lead.fence.len())).find(|(_, kv)| kv.is_some());
        match taken {
            Some((key, _)) => {
                let id = self.keys.id_after(&self.keys.runs(), key).unwrap_or(key).to_string();
                Err(Error::AlreadyExists { kind: "run", id })
            }
            None => Err(Error::Store("a transaction's compares failed for no known reason".into())),
        }
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

fn op_bytes(op: &TxnOp) -> usize {
    match op {
        TxnOp::Put { key, value, .. } => key.len() + value.len() + 16,
        TxnOp::Delete { key } | TxnOp::Get { key } => key.len() + 16,
    }
}
