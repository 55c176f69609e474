//! The API core: what each RPC does, without transport types. Task
//! definitions are plain store writes (any replica may serve them); run
//! creation, cancellation and runner sessions go to the leader's engine.

use std::sync::{Arc, RwLock};

use chrono::{DateTime, Utc};
use futures::StreamExt;

use crate::clock::SharedClock;
use crate::election::{Election, LeaderInfo};
use crate::engine::{EngineHandle, RunnerSnapshot, TriggerRequest};
use crate::error::{Error, Result};
use crate::model::{Cursor, RunRecord, RunStatus, TaskRecord, TaskSpec};
use crate::schedule::{CronSchedule, Schedule, next_slot};
use crate::store::{Compare, Keys, KvStore, Txn, TxnOp, WatchEvent};

/// Most fire times one preview returns.
pub const MAX_PREVIEW: u32 = 1000;
/// Default page of `ListTasks`.
pub const DEFAULT_TASK_PAGE: u32 = 500;
/// Largest page of `ListTasks`.
pub const MAX_TASK_PAGE: u32 = 1000;
/// Default page of `ListRuns`.
pub const DEFAULT_RUN_LIMIT: u32 = 100;
/// Attempts of an optimistic read-modify-write before giving up.
const CAS_ATTEMPTS: usize = 5;

/// A task with its scheduler state, as `GetTask`/`ListTasks` show it.
#[derive(Debug, Clone)]
pub struct TaskView {
    /// The stored record.
    pub record: TaskRecord,
    /// Its cursor, if it ever fired.
    pub cursor: Option<Cursor>,
    /// Next nominal slot (UTC), if any and not paused.
    pub next_fire_at: Option<DateTime<Utc>>,
}

/// Shared state of the API services.
pub struct Core {
    /// The store.
    pub store: Arc<dyn KvStore>,
    /// Key layout.
    pub keys: Keys,
    /// Clock.
    pub clock: SharedClock,
    /// Election.
    pub election: Arc<dyn Election>,
    /// The engine while this replica leads.
    pub engine: RwLock<Option<EngineHandle>>,
}

fn decode<T: serde::de::DeserializeOwned>(what: &str, bytes: &[u8]) -> Result<T> {
    serde_json::from_slice(bytes).map_err(|e| Error::Internal(format!("stored {what} unreadable: {e}")))
}

fn encode<T: serde::Serialize>(v: &T) -> Result<Vec<u8>> {
    serde_json::to_vec(v).map_err(|e| Error::Internal(e.to_string()))
}

impl Core {
    /// The engine, or `Unavailable` naming the leader when this replica is not it.
    pub async fn engine(&self) -> Result<EngineHandle> {
        if let Some(e) = self.engine.read().ok().and_then(|g| g.clone()) {
            return Ok(e);
        }
        let leader = self.election.leader().await.map(|l| l.advertise_address).filter(|a| !a.is_empty());
        Err(Error::Unavailable { reason: "this replica is not the leader".into(), leader })
    }

    /// Current leader as known here.
    pub async fn leader(&self) -> Option<LeaderInfo> {
        self.election.leader().await
    }

    /// Validates and stores a task (create or replace). Nothing is written
    /// when validation fails. Returns the stored record and whether it is new.
    pub async fn apply_task(&self, spec_json: &str, dry_run: bool) -> Result<(TaskRecord, bool)> {
        let spec = TaskSpec::from_json(spec_json)?;
        let now = self.clock.now();
        let schedules = spec.schedules()?;
        for (i, s) in schedules.iter().enumerate() {
            if !matches!(s, Schedule::Once { .. }) && s.next_after(now).is_none() {
                let path = if spec.trigger.is_some() && i == 0 {
                    "trigger".to_string()
                } else {
                    format!("triggers[{}]", i - usize::from(spec.trigger.is_some()))
                };
                return Err(Error::invalid(format!("{path}.expr"), "has no fire time after now"));
            }
        }
        let key = self.keys.task(&spec.task_id);
        for _ in 0..CAS_ATTEMPTS {
            let prev = self.store.get(&key).await?;
            let prev_rec: Option<TaskRecord> = prev.as_ref().map(|kv| decode("task", &kv.value)).transpose()?;
            let rec = TaskRecord {
                spec: spec.clone(),
                paused: prev_rec.as_ref().is_some_and(|p| p.paused),
                paused_at: prev_rec.as_ref().and_then(|p| p.paused_at),
                resumed_at: prev_rec.as_ref().and_then(|p| p.resumed_at),
                created_at: prev_rec.as_ref().map_or(now, |p| p.created_at),
                updated_at: now,
            };
            if dry_run {
                return Ok((rec, prev.is_none()));
            }
            let guard = Compare::mod_revision(&key, prev.as_ref().map_or(0, |kv| kv.mod_revision));
            let r = self.store.txn(Txn { compares: vec![guard], success: vec![TxnOp::put(&key, encode(&rec)?)], failure: vec![] }).await?;
            if r.succeeded {
                tracing::info!(task_id = %spec.task_id, created = prev.is_none(), "task applied");
                return Ok((rec, prev.is_none()));
            }
        }
        Err(Error::Unavailable { reason: format!("task {} is being changed concurrently; try again", spec.task_id), leader: None })
    }

    async fn modify_task(&self, task_id: &str, f: impl Fn(&mut TaskRecord, DateTime<Utc>)) -> Result<TaskRecord> {
        let key = self.keys.task(task_id);
        for _ in 0..CAS_ATTEMPTS {
            let kv = self.store.get(&key).await?.ok_or_else(|| Error::NotFound { kind: "task", id: task_id.to_string() })?;
            let mut rec: TaskRecord = decode("task", &kv.value)?;
            f(&mut rec, self.clock.now());
            let r = self
                .store
                .txn(Txn {
                    compares: vec![Compare::mod_revision(&key, kv.mod_revision)],
                    success: vec![TxnOp::put(&key, encode(&rec)?)],
                    failure: vec![],
                })
                .await?;
            if r.succeeded {
                return Ok(rec);
            }
        }
        Err(Error::Unavailable { reason: format!("task {task_id} is being changed concurrently; try again"), leader: None })
    }

    /// Pauses a task (idempotent).
    pub async fn pause_task(&self, task_id: &str) -> Result<TaskRecord> {
        self.modify_task(task_id, |r, now| {
            if !r.paused {
                r.paused = true;
                r.paused_at = Some(now);
                r.updated_at = now;
            }
        })
        .await
    }

    /// Resumes a task (idempotent); the engine covers the paused slots.
    pub async fn resume_task(&self, task_id: &str) -> Result<TaskRecord> {
        self.modify_task(task_id, |r, now| {
            if r.paused {
                r.paused = false;
                r.resumed_at = Some(now);
                r.updated_at = now;
            }
        })
        .await
    }

    /// Deletes a task; its runs are kept.
    pub async fn delete_task(&self, task_id: &str) -> Result<()> {
        if self.store.delete(&self.keys.task(task_id)).await? {
            Ok(())
        } else {
            Err(Error::NotFound { kind: "task", id: task_id.to_string() })
        }
    }

    fn view(&self, record: TaskRecord, cursor: Option<Cursor>) -> TaskView {
        let next_fire_at = if record.paused {
            None
        } else {
            let base = cursor.as_ref().and_then(|c| c.last_slot).unwrap_or(record.created_at);
            record.spec.schedules().ok().and_then(|s| next_slot(&s, base).map(|(t, _)| t))
        };
        TaskView { record, cursor, next_fire_at }
    }

    /// One task with its cursor.
    pub async fn get_task(&self, task_id: &str) -> Result<TaskView> {
        let kv =
            self.store.get(&self.keys.task(task_id)).await?.ok_or_else(|| Error::NotFound { kind: "task", id: task_id.to_string() })?;
        let rec: TaskRecord = decode("task", &kv.value)?;
        let cursor = self.store.get(&self.keys.cursor(task_id)).await?.map(|kv| decode("cursor", &kv.value)).transpose()?;
        Ok(self.view(rec, cursor))
    }

    /// Tasks by id, `limit` of them after `page_token` (a task id; empty =
    /// from the start). Returns the page and the next token (empty at the end).
    pub async fn list_tasks_page(&self, page_token: &str, limit: u32) -> Result<(Vec<TaskView>, String)> {
        let limit = if limit == 0 { DEFAULT_TASK_PAGE } else { limit.min(MAX_TASK_PAGE) } as usize;
        let mut all = self.list_tasks().await?;
        all.retain(|v| v.record.spec.task_id.as_str() > page_token);
        let next = if all.len() > limit { all[limit - 1].record.spec.task_id.clone() } else { String::new() };
        all.truncate(limit);
        Ok((all, next))
    }

    /// Every task, by id.
    pub async fn list_tasks(&self) -> Result<Vec<TaskView>> {
        let (kvs, _) = self.store.range(&self.keys.tasks()).await?;
        let (cursors, _) = self.store.range(&self.keys.cursors()).await?;
        let mut cursors: std::collections::HashMap<String, Cursor> = cursors
            .into_iter()
            .filter_map(|kv| {
                Some((self.keys.id_after(&self.keys.cursors(), &kv.key)?.to_string(), serde_json::from_slice(&kv.value).ok()?))
            })
            .collect();
        kvs.iter()
            .map(|kv| {
                let rec: TaskRecord = decode("task", &kv.value)?;
                let c = cursors.remove(&rec.spec.task_id);
                Ok(self.view(rec, c))
            })
            .collect()
    }

    /// Fire times of `expr` in `tz` strictly after `after`, or of a task's triggers.
    pub async fn preview(
        &self,
        expr: &str,
        tz: &str,
        task_id: &str,
        after: Option<DateTime<Utc>>,
        count: u32,
    ) -> Result<(Vec<DateTime<Utc>>, Option<chrono_tz::Tz>)> {
        let after = after.unwrap_or_else(|| self.clock.now());
        let count = if count == 0 { 5 } else { count.min(MAX_PREVIEW) };
        let (schedules, zone) = match (expr.is_empty(), task_id.is_empty()) {
            (false, true) => {
                let tz = if tz.is_empty() { "UTC" } else { tz };
                let c = CronSchedule::parse(expr, tz, 0).map_err(|e| e.at("preview"))?;
                let z = c.timezone();
                (vec![Schedule::Cron(Box::new(c))], Some(z))
            }
            (true, false) => {
                let view = self.get_task(task_id).await?;
                let s = view.record.spec.schedules()?;
                let z = s.iter().find_map(|s| match s {
                    Schedule::Cron(c) => Some(c.timezone()),
                    _ => None,
                });
                (s, z)
            }
            _ => return Err(Error::invalid("expr", "give either expr (with timezone) or task_id")),
        };
        Ok((preview_times(&schedules, after, count), zone))
    }

    /// Manual trigger (leader).
    pub async fn trigger(&self, req: TriggerRequest) -> Result<(String, DateTime<Utc>, bool)> {
        if self.store.get(&self.keys.task(&req.task_id)).await?.is_none() {
            return Err(Error::NotFound { kind: "task", id: req.task_id });
        }
        self.engine().await?.trigger(req).await
    }

    /// One run.
    pub async fn get_run(&self, run_id: &str) -> Result<RunRecord> {
        let kv = self.store.get(&self.keys.run(run_id)).await?.ok_or_else(|| Error::NotFound { kind: "run", id: run_id.to_string() })?;
        decode("run", &kv.value)
    }

    /// Runs, newest slot first, filtered by task and status.
    pub async fn list_runs(&self, task_id: &str, status: Option<RunStatus>, limit: u32) -> Result<Vec<RunRecord>> {
        let prefix = if task_id.is_empty() { self.keys.runs() } else { self.keys.runs_of(task_id) };
        let (kvs, _) = self.store.range(&prefix).await?;
        let mut runs: Vec<RunRecord> = kvs.iter().map(|kv| decode::<RunRecord>("run", &kv.value)).collect::<Result<_>>()?;
        runs.retain(|r| status.is_none_or(|s| r.status == s));
        runs.sort_by(|a, b| b.scheduled_at.cmp(&a.scheduled_at).then_with(|| b.run_id.cmp(&a.run_id)));
        runs.truncate(if limit == 0 { DEFAULT_RUN_LIMIT } else { limit } as usize);
        // Listings leave out the output tails (up to 64 KiB each); GetRun has them.
        for r in &mut runs {
            r.stdout_tail.clear();
            r.stderr_tail.clear();
        }
        Ok(runs)
    }

    /// Cancels a run (leader).
    pub async fn cancel_run(&self, run_id: &str, reason: &str) -> Result<RunRecord> {
        self.get_run(run_id).await?;
        let reason = if reason.is_empty() { "cancelled by user" } else { reason };
        self.engine().await?.cancel_run(run_id.to_string(), reason.to_string()).await
    }

    /// Matching runs now, then every stored change of a matching run.
    pub async fn watch_runs(&self, task_id: &str, run_id: &str) -> Result<futures::stream::BoxStream<'static, Result<RunRecord>>> {
        let prefix = if !run_id.is_empty() {
            self.keys.run(run_id)
        } else if !task_id.is_empty() {
            self.keys.runs_of(task_id)
        } else {
            self.keys.runs()
        };
        let exact = (!run_id.is_empty()).then(|| self.keys.run(run_id));
        let watch = self.store.watch(&prefix).await?;
        let (kvs, rev) = self.store.range(&prefix).await?;
        let initial: Vec<Result<RunRecord>> =
            kvs.iter().filter(|kv| exact.as_ref().is_none_or(|k| &kv.key == k)).map(|kv| decode("run", &kv.value)).collect();
        let changes = watch.filter_map(move |ev| {
            let out = match ev {
                Ok(WatchEvent::Put(kv)) if kv.mod_revision > rev && exact.as_ref().is_none_or(|k| &kv.key == k) => {
                    Some(decode("run", &kv.value))
                }
                Ok(_) => None,
                Err(e) => Some(Err(e)),
            };
            futures::future::ready(out)
        });
        Ok(futures::stream::iter(initial).chain(changes).boxed())
    }

    /// Connected runners (leader).
    pub async fn list_runners(&self) -> Result<Vec<RunnerSnapshot>> {
        self.engine().await?.list_runners().await
    }
}

/// `count` fire times strictly after `after`.
pub fn preview_times(schedules: &[Schedule], after: DateTime<Utc>, count: u32) -> Vec<DateTime<Utc>> {
    let mut out = Vec::new();
    let mut t = after;
    while out.len() < count as usize {
        match next_slot(schedules, t) {
            Some((n, _)) => {
                out.push(n);
                t = n;
            }
            None => break,
        }
    }
    out
}
