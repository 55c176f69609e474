//! The leader's engine: one task that owns the schedule heap, the active
//! runs and the runner registry, and serializes every decision.
//!
//! It starts when this replica becomes leader and stops when it is not.
//! Inputs arrive as [`Command`]s (API calls, runner messages), as store
//! watch events (task definitions written by any replica) and as timers it
//! set itself (slot fires, retry backoffs, deadlines, runner expiry). It
//! sleeps until the earliest timer: there is no per-second scan over tasks.
//!
//! Files: `tasks.rs` (tracking definitions, firing slots, misfires, pauses),
//! `runs.rs` (admission, dispatch, attempt lifecycle, retries), `runners.rs`
//! (sessions, in-flight re-declaration, expiry).

mod runners;
mod runs;

pub use runs::write_run;
mod tasks;

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::Arc;

use chrono::{DateTime, Utc};
use futures::StreamExt;
use tokio::sync::{mpsc, oneshot};

use punchclock_proto::v1::{ControlMessage, Hello, runner_message};

use crate::clock::SharedClock;
use crate::dispatch::registry::RunnerEntry;
use crate::election::Leadership;
use crate::error::{Error, Result};
use crate::model::{Cursor, RunRecord, TaskRecord};
use crate::store::{Keys, KvStore, WatchEvent, WatchStream};
use crate::timing::Timing;

/// Requests to the engine.
#[derive(Debug)]
pub enum Command {
    /// A runner opened a stream and said Hello; the reply is its session number.
    RunnerHello {
        /// The Hello.
        hello: Hello,
        /// Outbound stream to the runner.
        tx: mpsc::Sender<ControlMessage>,
        /// Session number (stream generation).
        reply: oneshot::Sender<Result<u64>>,
    },
    /// A message on a runner's stream.
    RunnerMessage {
        /// Sender.
        runner_id: String,
        /// Its session.
        session: u64,
        /// The message.
        msg: runner_message::Msg,
    },
    /// A runner's stream ended.
    RunnerGone {
        /// Runner.
        runner_id: String,
        /// The session that ended.
        session: u64,
    },
    /// Manual trigger.
    Trigger {
        /// Request.
        req: TriggerRequest,
        /// `(run_id, scheduled_at, created)`.
        reply: oneshot::Sender<Result<(String, DateTime<Utc>, bool)>>,
    },
    /// Cancel a run.
    CancelRun {
        /// Run.
        run_id: String,
        /// Why.
        reason: String,
        /// The run after cancelling.
        reply: oneshot::Sender<Result<RunRecord>>,
    },
    /// Snapshot of the runner registry.
    ListRunners {
        /// Reply.
        reply: oneshot::Sender<Vec<RunnerSnapshot>>,
    },
}

/// A manual `TriggerTask`.
#[derive(Debug, Clone)]
pub struct TriggerRequest {
    /// Task.
    pub task_id: String,
    /// Params merged over the task's `context.params`.
    pub params: serde_json::Map<String, serde_json::Value>,
    /// Earliest start (UTC); `None` = now + `delay_seconds`.
    pub not_before: Option<DateTime<Utc>>,
    /// Seconds from now.
    pub delay_seconds: u64,
    /// Idempotency key; `None` = a fresh one.
    pub idempotency_key: Option<String>,
}

/// A runner as listed by `ClusterService.ListRunners`.
#[derive(Debug, Clone)]
pub struct RunnerSnapshot {
    /// Id.
    pub runner_id: String,
    /// Agents served.
    pub agents: Vec<String>,
    /// Slots.
    pub slots: u32,
    /// Busy slots.
    pub busy: u32,
    /// Labels.
    pub labels: std::collections::BTreeMap<String, String>,
    /// Version.
    pub version: String,
    /// Connected now.
    pub connected: bool,
    /// Stream opened (UTC).
    pub connected_at: DateTime<Utc>,
    /// Last message (UTC).
    pub last_seen: DateTime<Utc>,
    /// Run ids executing.
    pub running: Vec<String>,
}

/// Cheap handle for talking to a running engine.
#[derive(Debug, Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Command>,
}

fn gone() -> Error {
    Error::Unavailable { reason: "leadership changed; the engine stopped".into(), leader: None }
}

impl EngineHandle {
    /// Sends a command (used by the runner stream service).
    pub async fn send(&self, cmd: Command) -> Result<()> {
        self.tx.send(cmd).await.map_err(|_| gone())
    }

    async fn ask<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> Command) -> Result<T> {
        let (tx, rx) = oneshot::channel();
        self.send(make(tx)).await?;
        rx.await.map_err(|_| gone())
    }

    /// Manual trigger: `(run_id, scheduled_at, created)`.
    pub async fn trigger(&self, req: TriggerRequest) -> Result<(String, DateTime<Utc>, bool)> {
        self.ask(|reply| Command::Trigger { req, reply }).await?
    }

    /// Cancels a run; returns it as stored.
    pub async fn cancel_run(&self, run_id: String, reason: String) -> Result<RunRecord> {
        self.ask(|reply| Command::CancelRun { run_id, reason, reply }).await?
    }

    /// Runner registry snapshot.
    pub async fn list_runners(&self) -> Result<Vec<RunnerSnapshot>> {
        self.ask(|reply| Command::ListRunners { reply }).await
    }

    /// Registers a runner stream; returns its session number.
    pub async fn runner_hello(&self, hello: Hello, tx: mpsc::Sender<ControlMessage>) -> Result<u64> {
        self.ask(|reply| Command::RunnerHello { hello, tx, reply }).await?
    }
}

/// What a timer does when it fires.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Timer {
    /// Handle the due slots of a task (if `generation` is still current).
    Fire { task_id: String, generation: u64 },
    /// A delayed or retrying run may start.
    RunDue { run_id: String },
    /// An attempt's control-plane deadline.
    Deadline { run_id: String, execution_id: String },
    /// Check for lost runners.
    RunnerCheck,
}

/// A task the engine tracks.
struct TaskEntry {
    record: TaskRecord,
    cursor: Option<Cursor>,
    /// Bumped on every change; stale `Fire` timers are ignored.
    generation: u64,
    /// Next slot and the instant it fires (slot + jitter).
    next: Option<(DateTime<Utc>, DateTime<Utc>)>,
}

/// The engine's state. See the module docs.
pub struct Engine {
    store: Arc<dyn KvStore>,
    keys: Keys,
    clock: SharedClock,
    timing: Timing,
    leadership: Leadership,
    leader_id: String,
    tasks: HashMap<String, TaskEntry>,
    /// Non-terminal runs.
    runs: HashMap<String, RunRecord>,
    runners: HashMap<String, RunnerEntry>,
    timers: BinaryHeap<Reverse<(DateTime<Utc>, u64, Timer)>>,
    timer_seq: u64,
    next_session: u64,
    runner_check_armed: bool,
    /// Tasks whose due slots wait for their recovered in-flight runs to be
    /// re-declared or lost (see [`Engine::awaits_redeclare`]).
    deferred_fires: std::collections::HashSet<String>,
    /// A leader write was rejected by the fence (see [`EngineExit::Fenced`]).
    fenced: bool,
    rx: mpsc::Receiver<Command>,
}

/// Why the engine task ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineExit {
    /// Every handle was dropped, or the task watch failed for good.
    Stopped,
    /// The store rejected a write for this leader's fencing token: a newer
    /// leader exists, and this replica must step down
    /// ([`crate::election::Election::deposed`]).
    Fenced,
}

/// Options for [`Engine::start`].
pub struct EngineConfig {
    /// The store.
    pub store: Arc<dyn KvStore>,
    /// Key layout.
    pub keys: Keys,
    /// Clock.
    pub clock: SharedClock,
    /// Timing constants.
    pub timing: Timing,
    /// The leadership this engine runs under (token and fence).
    pub leadership: Leadership,
    /// This replica's id (told to runners in Welcome).
    pub leader_id: String,
}

impl Engine {
    /// Loads state from the store, applies misfire policies and starts the
    /// engine task. Returns its handle and the task's join handle; dropping
    /// every handle (or aborting the join handle) stops it.
    pub async fn start(cfg: EngineConfig) -> Result<(EngineHandle, tokio::task::JoinHandle<EngineExit>)> {
        let (tx, rx) = mpsc::channel(1024);
        let mut engine = Engine {
            store: cfg.store,
            keys: cfg.keys,
            clock: cfg.clock,
            timing: cfg.timing,
            leadership: cfg.leadership,
            leader_id: cfg.leader_id,
            tasks: HashMap::new(),
            runs: HashMap::new(),
            runners: HashMap::new(),
            timers: BinaryHeap::new(),
            timer_seq: 0,
            next_session: 0,
            runner_check_armed: false,
            deferred_fires: Default::default(),
            fenced: false,
            rx,
        };
        let watch = engine.load().await?;
        let join = tokio::spawn(async move { engine.run(watch).await });
        Ok((EngineHandle { tx }, join))
    }

    fn now(&self) -> DateTime<Utc> {
        self.clock.now()
    }

    fn push_timer(&mut self, at: DateTime<Utc>, t: Timer) {
        self.timer_seq += 1;
        self.timers.push(Reverse((at, self.timer_seq, t)));
    }

    /// Reads tasks, cursors and active runs; returns the task watch, opened
    /// before the read so no change is missed.
    async fn load(&mut self) -> Result<WatchStream> {
        let watch = self.store.watch(&self.keys.tasks()).await?;
        let (task_kvs, _) = self.store.range(&self.keys.tasks()).await?;
        let (cursor_kvs, _) = self.store.range(&self.keys.cursors()).await?;
        let mut cursors: HashMap<String, Cursor> = HashMap::new();
        for kv in cursor_kvs {
            if let Some(id) = self.keys.id_after(&self.keys.cursors(), &kv.key) {
                match serde_json::from_slice(&kv.value) {
                    Ok(c) => {
                        cursors.insert(id.to_string(), c);
                    }
                    Err(e) => tracing::error!(key = %kv.key, error = %e, "unreadable cursor"),
                }
            }
        }
        self.load_active_runs().await?;
        let n = task_kvs.len();
        for kv in task_kvs {
            match serde_json::from_slice::<TaskRecord>(&kv.value) {
                Ok(rec) => {
                    let cursor = cursors.remove(&rec.spec.task_id);
                    self.upsert_task(rec, cursor).await;
                }
                Err(e) => tracing::error!(key = %kv.key, error = %e, "unreadable task"),
            }
        }
        tracing::info!(tasks = n, active_runs = self.runs.len(), token = self.leadership.token, "engine loaded");
        self.recover_runs();
        self.try_dispatch().await;
        Ok(watch)
    }

    async fn run(mut self, mut watch: WatchStream) -> EngineExit {
        loop {
            let next = self.timers.peek().map(|Reverse((t, _, _))| *t);
            let sleep = async {
                match next {
                    Some(t) => self.clock.sleep_until(t).await,
                    None => futures::future::pending::<()>().await,
                }
            };
            tokio::select! {
                biased;
                cmd = self.rx.recv() => match cmd {
                    Some(cmd) => self.handle(cmd).await,
                    None => break,
                },
                ev = watch.next() => match ev {
                    Some(Ok(ev)) => self.on_task_event(ev).await,
                    Some(Err(e)) => {
                        tracing::warn!(error = %e, "task watch broke; re-reading tasks");
                        match self.resync_tasks().await {
                            Ok(w) => watch = w,
                            Err(e) => {
                                tracing::error!(error = %e, "cannot re-read tasks; engine stops");
                                break;
                            }
                        }
                    }
                    None => {
                        tracing::error!("task watch ended; engine stops");
                        break;
                    }
                },
                _ = sleep => self.fire_timers().await,
            }
        }
        tracing::info!(fenced = self.fenced, "engine stopped");
        if self.fenced { EngineExit::Fenced } else { EngineExit::Stopped }
    }

    async fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::RunnerHello { hello, tx, reply } => {
                let r = self.on_hello(hello, tx).await;
                let _ = reply.send(r);
            }
            Command::RunnerMessage { runner_id, session, msg } => self.on_runner_message(&runner_id, session, msg).await,
            Command::RunnerGone { runner_id, session } => self.on_runner_gone(&runner_id, session),
            Command::Trigger { req, reply } => {
                let r = self.trigger(req).await;
                let _ = reply.send(r);
            }
            Command::CancelRun { run_id, reason, reply } => {
                let r = self.cancel_run(&run_id, &reason).await;
                let _ = reply.send(r);
            }
            Command::ListRunners { reply } => {
                let _ = reply.send(self.runner_snapshots());
            }
        }
        self.release_deferred_fires();
    }

    async fn fire_timers(&mut self) {
        let now = self.now();
        while let Some(Reverse((at, _, _))) = self.timers.peek() {
            if *at > now {
                break;
            }
            let Some(Reverse((_, _, timer))) = self.timers.pop() else { break };
            match timer {
                Timer::Fire { task_id, generation } => self.on_fire(&task_id, generation).await,
                Timer::RunDue { run_id } => self.on_run_due(&run_id).await,
                Timer::Deadline { run_id, execution_id } => self.on_deadline(&run_id, &execution_id).await,
                Timer::RunnerCheck => self.on_runner_check().await,
            }
        }
        self.release_deferred_fires();
    }

    async fn on_task_event(&mut self, ev: WatchEvent) {
        match ev {
            WatchEvent::Put(kv) => match serde_json::from_slice::<TaskRecord>(&kv.value) {
                Ok(rec) => {
                    let cursor = if self.tasks.contains_key(&rec.spec.task_id) { None } else { self.read_cursor(&rec.spec.task_id).await };
                    self.upsert_task(rec, cursor).await;
                }
                Err(e) => tracing::error!(key = %kv.key, error = %e, "unreadable task"),
            },
            WatchEvent::Delete { key, .. } => {
                if let Some(id) = self.keys.id_after(&self.keys.tasks(), &key).map(str::to_string) {
                    self.remove_task(&id).await;
                }
            }
        }
    }

    async fn resync_tasks(&mut self) -> Result<WatchStream> {
        let watch = self.store.watch(&self.keys.tasks()).await?;
        let (kvs, _) = self.store.range(&self.keys.tasks()).await?;
        let mut seen = std::collections::HashSet::new();
        for kv in kvs {
            if let Ok(rec) = serde_json::from_slice::<TaskRecord>(&kv.value) {
                seen.insert(rec.spec.task_id.clone());
                let changed = self.tasks.get(&rec.spec.task_id).is_none_or(|e| e.record != rec);
                if changed {
                    let cursor = if self.tasks.contains_key(&rec.spec.task_id) { None } else { self.read_cursor(&rec.spec.task_id).await };
                    self.upsert_task(rec, cursor).await;
                }
            }
        }
        let gone: Vec<String> = self.tasks.keys().filter(|k| !seen.contains(*k)).cloned().collect();
        for id in gone {
            self.remove_task(&id).await;
        }
        Ok(watch)
    }

    async fn read_cursor(&self, task_id: &str) -> Option<Cursor> {
        match self.store.get(&self.keys.cursor(task_id)).await {
            Ok(Some(kv)) => serde_json::from_slice(&kv.value).ok(),
            Ok(None) => None,
            Err(e) => {
                tracing::error!(task_id, error = %e, "cannot read cursor");
                None
            }
        }
    }
}
