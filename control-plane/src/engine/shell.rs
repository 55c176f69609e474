//! The engine's async shell: one tokio task that feeds the decision core
//! and performs its effects. It owns everything with I/O in it — the store
//! (through [`Repo`]), the clock, the runner streams' senders, the reply
//! channels, the lifecycle bus — and decides nothing.
//!
//! One turn: take one input (a batch of up to [`MAX_COMMANDS_PER_TURN`]
//! queued commands, a task change, or up to [`MAX_TIMERS_PER_TURN`] due
//! timers — whichever `select!` picks, at random when several are ready, so
//! neither starves the other; a timer turn also takes the commands already
//! queued, within the same bound) and hand it to the core.
//!
//! Effects are performed in batches, in the order the core decided them,
//! with **group commit**: a batch's writes go to the store as one fenced
//! transaction (as far as the store allows) while the engine keeps taking
//! inputs; everything the core decides meanwhile forms the next batch,
//! whose commit starts when this one has committed and its other effects
//! are performed: close and send to runners (`try_send`: a runner whose
//! stream does not drain is disconnected, never awaited), publish lifecycle
//! events, deliver replies, feed back the runs the core asked to read. At
//! most one commit is in flight, and nothing of a batch leaves the engine
//! before its writes (and every earlier batch's) have committed. Under load
//! batches grow by themselves: a burst's slots and the reports that arrive
//! during one commit share the next.
//!
//! A failed write ends the engine ([`EngineExit::Fenced`] when the fence
//! rejected it, else [`EngineExit::Failed`]); the bootstrap starts a new one
//! from the store. Memory is never trusted past a write that did not commit.

use std::collections::HashMap;

use futures::StreamExt;
use futures::stream::BoxStream;
use tokio::sync::mpsc::error::TrySendError;
use tokio::sync::{mpsc, oneshot};

use super::core::{CoreConfig, Effects, EngineCore, IdLookup, Input, Reply, ReplyId, StoredId, Triggered};
use super::lifecycle::{Lifecycle, LifecycleBus};
use super::protocol::ToRunner;
use super::{Command, EngineHandle};
use crate::clock::SharedClock;
use crate::election::Leadership;
use crate::error::{Error, Result};
use crate::model::RunRecord;
use crate::repo::{CommitStats, Repo, TaskChange};
use crate::timing::Timing;

/// Commands handled per turn before effects are performed.
pub const MAX_COMMANDS_PER_TURN: usize = 256;
/// Timers fired per turn, or fewer: a timer counts the run writes it adds
/// (`EngineCore::handle_timeout`). A batch's writes commit together (one fsync on
/// the embedded store; on etcd as few transactions as its limits allow),
/// and a batch's assignments leave only once it committed: an instant of
/// up to this many due slots goes out in one commit. With 256, 1,000 HTTP
/// runs due every second went out in three or four chained commits, the
/// last ending 65-117 ms after the slot; with 1,024, in one ending 41-80
/// ms after it (`bench-load --agent http`, dev, 2 cores). The core decides
/// a turn of 1,024 one-run timers in about 14 ms (`bench-core`: 13 µs a
/// slot), the longest a queued command waits behind one. A catch-up fire
/// creates up to `MAX_RUNS_PER_FIRE` (50) runs and counts them all, so a
/// turn after an outage decides about 1,024 runs too, not 50 times that
/// (turns taken while a commit is in flight add up in the next commit).
pub const MAX_TIMERS_PER_TURN: usize = 1024;
/// Commands queued for the engine; senders wait when it is full.
const COMMAND_QUEUE: usize = 1024;

/// Why the engine task ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EngineExit {
    /// Every handle was dropped.
    Stopped,
    /// It was told to stop ([`EngineHandle::stop`]): a graceful handover.
    Handover,
    /// The store rejected a write for this leader's fencing token: a newer
    /// leader exists, and this replica must step down
    /// ([`crate::election::Election::deposed`]).
    Fenced,
    /// A store read or write failed, or the task watch ended (why): the
    /// next engine starts from the store.
    Failed(String),
}

/// Options for [`Engine::start`].
pub struct EngineConfig {
    /// Typed store access.
    pub repo: Repo,
    /// Clock.
    pub clock: SharedClock,
    /// Timing constants.
    pub timing: Timing,
    /// The leadership this engine runs under (token and fence).
    pub leadership: Leadership,
    /// This replica's id (told to runners in Welcome).
    pub leader_id: String,
    /// Where lifecycle events go.
    pub bus: LifecycleBus,
    /// Run retention while this engine leads.
    pub retention: super::retention::RetentionConfig,
    /// Notification delivery while this engine leads.
    pub notifier: crate::notify::deliver::Notifier,
    /// The running configuration (resources, budgets, ...): the core is
    /// told each new one.
    pub config: crate::config::ConfigHandle,
    /// Where this leader's queue consumers say how they are.
    pub consumer_health: std::sync::Arc<crate::events::consumers::ConsumerHealth>,
    /// The history archive (`--history postgres://`): finished runs move
    /// there ([`super::archive`]), and event ids gone from the store are
    /// looked up there.
    pub archive: Option<(std::sync::Arc<dyn crate::repo::history::HistoryStore>, std::sync::Arc<super::archive::ArchiveStatus>)>,
}

struct Link {
    session: u64,
    tx: mpsc::Sender<ToRunner>,
    /// Dropped with the link: the stream's reader stops.
    _kill: oneshot::Sender<()>,
}

enum Pending {
    Trigger(oneshot::Sender<Result<Triggered>>),
    Cancel(oneshot::Sender<Result<RunRecord>>),
    ResetBreaker(oneshot::Sender<Result<crate::model::breaker::Breaker>>),
    ReleaseResource(oneshot::Sender<Result<crate::views::ResourceView>>),
    Events(oneshot::Sender<Vec<Result<super::EventAdmitted>>>),
    Backfill(oneshot::Sender<Result<crate::model::backfill::Backfill>>),
}

/// The engine task's state.
pub struct Engine {
    core: EngineCore,
    repo: Repo,
    clock: SharedClock,
    leadership: Leadership,
    bus: LifecycleBus,
    rx: mpsc::Receiver<Command>,
    links: HashMap<String, Link>,
    pending: HashMap<ReplyId, Pending>,
    next_reply: ReplyId,
    stop_reply: Option<oneshot::Sender<()>>,
    /// Store transactions committed by this engine.
    transactions: u64,
    /// Each configuration replaced on SIGHUP.
    config: tokio::sync::watch::Receiver<std::sync::Arc<crate::config::Config>>,
    /// Deletes expired runs; stops with the engine.
    _retention: crate::worker::Worker,
    /// Builds the time index of runs written before it, once.
    _indexer: crate::worker::Worker,
    /// Moves finished runs to the archive, when there is one.
    _mover: Option<crate::worker::Worker>,
    /// The history archive (event ids' lookups).
    archive: Option<std::sync::Arc<dyn crate::repo::history::HistoryStore>>,
    /// Folds the budgets' ledger; stops with the engine.
    _ledger: crate::worker::Worker,
    _notifier: crate::worker::Worker,
    /// The queue consumers; stop with the engine.
    _consumers: Option<crate::worker::Worker>,
    /// The tasks' queue triggers, for the consumers.
    sources: tokio::sync::watch::Sender<(u64, Vec<(String, crate::model::trigger::QueueTrigger)>)>,
}

impl Engine {
    /// Loads state from the store and starts the engine task. Returns its
    /// handle and the task's join handle; dropping every handle (or
    /// aborting the join handle) stops it.
    ///
    /// Errors: the store cannot be read.
    pub async fn start(cfg: EngineConfig) -> Result<(EngineHandle, tokio::task::JoinHandle<EngineExit>)> {
        let (tx, rx) = mpsc::channel(COMMAND_QUEUE);
        // An apply a previous leader left half done is finished (or rolled
        // back) before the tasks are read.
        cfg.repo.recover_applies(&cfg.leadership, cfg.clock.now()).await?;
        // Never lead on a configuration other than the stored one: read it
        // now (a replica's follower may lag), or store this replica's file
        // when none is stored yet.
        crate::config::cluster::ensure_stored(&cfg.repo, &cfg.config, &cfg.leader_id, cfg.clock.now()).await?;
        // Watch first, then read: no change falls in between.
        let watch = cfg.repo.watch_tasks().await?;
        let tasks = cfg.repo.load_tasks().await?;
        let runs = cfg.repo.load_active_runs().await?;
        let ledgers = cfg.repo.load_ledgers().await?;
        let holds = cfg.repo.load_holds().await?;
        let backfills = cfg.repo.load_backfills().await?;
        let mut core = EngineCore::new(CoreConfig { timing: cfg.timing, token: cfg.leadership.token, leader_id: cfg.leader_id });
        let mut config = cfg.config.subscribe();
        core.configure(config.borrow_and_update().clone());
        core.load_ledgers(ledgers);
        core.load_holds(cfg.clock.now(), holds);
        // Seconds of CPU for a big store: off the async workers (the
        // election's lease renewals must keep running meanwhile).
        let now = cfg.clock.read();
        let core = tokio::task::spawn_blocking(move || {
            core.load(now, tasks, runs);
            core.restore_backfills(now, backfills);
            core
        })
        .await
        .map_err(|e| crate::error::Error::Internal(format!("loading the engine: {e}")))?;
        let retention =
            crate::worker::Worker::spawn(super::retention::run(cfg.repo.clone(), cfg.leadership.clone(), cfg.retention, cfg.clock.clone()));
        // Runs of a store written before the time index: indexed once, in
        // the background (resumable by the next leader).
        let (repo, lead) = (cfg.repo.clone(), cfg.leadership.clone());
        let indexer = crate::worker::Worker::spawn(async move {
            if let Err(e) = repo.build_history_index(&lead, INDEX_BUILD_PAUSE).await {
                tracing::warn!(error = %e, "the time index of runs is not built yet (the next leader goes on)");
            }
        });
        let mover = cfg.archive.as_ref().map(|(archive, status)| {
            crate::worker::Worker::spawn(super::archive::run(
                cfg.repo.clone(),
                cfg.leadership.clone(),
                archive.clone(),
                status.clone(),
                cfg.notifier.metrics.clone(),
                cfg.retention.max_age,
            ))
        });
        let ledger = crate::worker::Worker::spawn(super::retention::fold_ledgers(
            cfg.repo.clone(),
            cfg.leadership.clone(),
            cfg.retention,
            cfg.clock.clone(),
            cfg.config.clone(),
        ));
        let notifier = crate::worker::Worker::spawn(crate::notify::deliver::run(cfg.notifier, cfg.leadership.clone()));
        let (sources, sources_rx) = tokio::sync::watch::channel(core.queue_sources());
        let engine = Engine {
            core,
            repo: cfg.repo,
            clock: cfg.clock,
            leadership: cfg.leadership,
            bus: cfg.bus,
            rx,
            links: HashMap::new(),
            pending: HashMap::new(),
            next_reply: 0,
            stop_reply: None,
            transactions: 0,
            config,
            _retention: retention,
            _indexer: indexer,
            _mover: mover,
            archive: cfg.archive.map(|(a, _)| a),
            _ledger: ledger,
            _notifier: notifier,
            _consumers: None,
            sources,
        };
        let leadership = engine.leadership.clone();
        let handle = EngineHandle { tx, leadership };
        let ctx = crate::events::consumers::ConsumerContext {
            engine: handle.downgrade(),
            bus: engine.bus.clone(),
            clock: engine.clock.clone(),
            health: cfg.consumer_health,
        };
        let mut engine = engine;
        engine._consumers = Some(crate::worker::Worker::spawn(crate::events::consumers::run(ctx, sources_rx, cfg.config)));
        let join = tokio::spawn(engine.run(watch));
        Ok((handle, join))
    }

    async fn run(mut self, mut watch: BoxStream<'static, Result<TaskChange>>) -> EngineExit {
        // The batch whose writes are being committed: its other effects wait
        // for the commit; meanwhile the core keeps taking inputs, and what it
        // decides goes in the next batch (group commit).
        let mut in_flight: Option<InFlight> = None;
        let mut config_open = true;
        let exit = loop {
            if in_flight.is_none() {
                match self.perform().await {
                    Ok(batch) => in_flight = batch,
                    Err(exit) => break exit,
                }
            }
            if in_flight.is_none()
                && let Some(reply) = self.stop_reply.take()
            {
                let _ = reply.send(());
                break EngineExit::Handover;
            }
            let next = self.core.poll_timeout(self.clock.read());
            let clock = self.clock.clone();
            let sleep = async move {
                match next {
                    Some(t) => clock.sleep_until_mono(t).await,
                    None => futures::future::pending::<()>().await,
                }
            };
            tokio::select! {
                committed = async { (&mut in_flight.as_mut().expect("guarded").commit).await }, if in_flight.is_some() => {
                    let Some(batch) = in_flight.take() else { continue };
                    if let Err(exit) = self.committed(committed, batch.rest).await {
                        break exit;
                    }
                }
                cmd = self.rx.recv() => match cmd {
                    None => break EngineExit::Stopped,
                    Some(cmd) => {
                        self.command(cmd);
                        self.queued_commands(MAX_COMMANDS_PER_TURN - 1);
                    }
                },
                ev = watch.next() => match ev {
                    Some(Ok(change)) => {
                        if let Err(e) = self.task_change(change).await {
                            tracing::error!(error = %e, "cannot read a task's cursor; the engine restarts");
                            break EngineExit::Failed(format!("cannot read a task's cursor: {e}"));
                        }
                    }
                    Some(Err(e)) => {
                        tracing::warn!(error = %e, "task watch broke; reading tasks again");
                        match self.reload_tasks().await {
                            Ok(w) => watch = w,
                            Err(e) => {
                                tracing::error!(error = %e, "cannot read tasks again; the engine restarts");
                                break EngineExit::Failed(format!("cannot read tasks again: {e}"));
                            }
                        }
                    }
                    None => {
                        tracing::error!("task watch ended; the engine restarts");
                        break EngineExit::Failed("the task watch ended".to_string());
                    }
                },
                changed = self.config.changed(), if config_open => {
                    match changed {
                        Ok(()) => {
                            let config = self.config.borrow_and_update().clone();
                            self.core.configure(config);
                            self.core.handle_timeout(self.clock.read(), 0);
                        }
                        // The handle is gone: the configuration stays.
                        Err(_) => config_open = false,
                    }
                }
                _ = sleep => {
                    let now = self.clock.read();
                    self.core.handle_timeout(now, MAX_TIMERS_PER_TURN);
                    self.queued_commands(MAX_COMMANDS_PER_TURN);
                }
            }
        };
        let _ = self.bus.send(Lifecycle::LeadershipLost { token: self.leadership.token });
        tracing::info!(?exit, token = self.leadership.token, transactions = self.transactions, "engine stopped");
        // The consumers first: nothing is taken from a broker once the
        // engine stops (what they hold is redelivered to the next leader).
        if let Some(c) = self._consumers.as_mut() {
            c.stop().await;
        }
        // The workers hold the store (an embedded store's file lock): they
        // are gone before the engine says it stopped.
        self._notifier.stop().await;
        self._retention.stop().await;
        exit
    }

    /// Takes in up to `max` commands already queued (never waits): a timer
    /// turn holds the runner reports that arrived meanwhile too, within
    /// bounds, and its writes go out in one commit — a burst's slots and
    /// those reports share the fsync instead of taking turns for it.
    fn queued_commands(&mut self, max: usize) {
        for _ in 0..max {
            match self.rx.try_recv() {
                Ok(cmd) => self.command(cmd),
                Err(_) => break,
            }
        }
    }

    async fn task_change(&mut self, change: TaskChange) -> Result<()> {
        let now = self.clock.read();
        match change {
            TaskChange::Put(record) => {
                let cursor =
                    if self.core.knows_task(&record.spec.task_id) { None } else { self.repo.get_cursor(&record.spec.task_id).await? };
                self.core.handle(self.clock.read(), Input::TaskPut { record, cursor });
            }
            TaskChange::Deleted(task_id) => self.core.handle(now, Input::TaskDeleted { task_id }),
        }
        Ok(())
    }

    async fn reload_tasks(&mut self) -> Result<BoxStream<'static, Result<TaskChange>>> {
        let watch = self.repo.watch_tasks().await?;
        let tasks = self.repo.load_tasks().await?;
        self.core.handle(self.clock.read(), Input::TasksReloaded { tasks });
        Ok(watch)
    }

    fn reply_id(&mut self, p: Pending) -> ReplyId {
        self.next_reply += 1;
        self.pending.insert(self.next_reply, p);
        self.next_reply
    }

    fn command(&mut self, cmd: Command) {
        let now = self.clock.read();
        match cmd {
            Command::RunnerHello { hello, tx, kill, reply } => {
                if tx.is_closed() {
                    let _ = reply.send(Err(Error::Unavailable { reason: "runner stream closed".into(), leader: None }));
                    return;
                }
                let runner_id = hello.runner_id.clone();
                let r = self.core.runner_hello(now, hello);
                if let Ok(session) = r {
                    // Replaces (and so closes) an older stream of this runner.
                    self.links.insert(runner_id, Link { session, tx, _kill: kill });
                }
                let _ = reply.send(r);
            }
            Command::RunnerMessage { runner_id, session, received_at, msg } => {
                self.core.handle(now, Input::Runner { runner_id, session, received_at, msg });
            }
            Command::RunnerGone { runner_id, session } => {
                if self.links.get(&runner_id).is_some_and(|l| l.session == session) {
                    self.links.remove(&runner_id);
                }
                self.core.handle(now, Input::RunnerGone { runner_id, session });
            }
            Command::Trigger { mut req, reply } => {
                let explicit_key = req.idempotency_key.is_some();
                if req.idempotency_key.is_none() {
                    req.idempotency_key = Some(uuid::Uuid::new_v4().simple().to_string());
                }
                let id = self.reply_id(Pending::Trigger(reply));
                self.core.handle(now, Input::Trigger { reply: id, req, explicit_key });
            }
            Command::CancelRun { run_id, reason, reply } => {
                let id = self.reply_id(Pending::Cancel(reply));
                self.core.handle(now, Input::Cancel { reply: id, run_id, reason });
            }
            Command::ResetBreaker { task_id, reply } => {
                let id = self.reply_id(Pending::ResetBreaker(reply));
                self.core.handle(now, Input::ResetBreaker { reply: id, task_id });
            }
            Command::Backfill { op, reply } => {
                let id = self.reply_id(Pending::Backfill(reply));
                self.core.handle(now, Input::Backfill { reply: id, op });
            }
            Command::ReleaseResource { resource, reply } => {
                let id = self.reply_id(Pending::ReleaseResource(reply));
                self.core.handle(now, Input::ReleaseResource { reply: id, resource });
            }
            Command::Events { events, reply } => {
                let id = self.reply_id(Pending::Events(reply));
                self.core.handle(now, Input::Events { reply: id, events });
            }
            Command::Query(q) => q.answer(&self.core, now.wall),
            Command::Stop { reply } => {
                self.core.flush();
                self.stop_reply = Some(reply);
            }
        }
    }

    /// Performs the core's effects until it has none left, or until a batch
    /// with writes: that one is returned with its commit started, the rest
    /// of its effects to be performed once it commits
    /// ([`Engine::committed`]).
    async fn perform(&mut self) -> std::result::Result<Option<InFlight>, EngineExit> {
        // The consumers follow the tasks' queue triggers.
        if self.core.queues_version() != self.sources.borrow().0 {
            self.sources.send_replace(self.core.queue_sources());
        }
        loop {
            let mut fx = self.core.poll_effects();
            if fx.is_empty() {
                return Ok(None);
            }
            if !fx.writes.is_empty() {
                let (repo, leadership, writes) = (self.repo.clone(), self.leadership.clone(), std::mem::take(&mut fx.writes));
                // On a task of its own: encoding the records is CPU this
                // engine task would otherwise spend between its turns (the
                // embedded store's write itself is on a blocking thread).
                // Aborted if the engine ends first, as the future was dropped before.
                let task = AbortOnDrop(tokio::spawn(async move { repo.commit(&leadership, writes).await }));
                let commit = Box::pin(async move {
                    let mut task = task;
                    (&mut task.0).await.unwrap_or_else(|e| Err(Error::Internal(format!("the commit task ended: {e}"))))
                });
                return Ok(Some(InFlight { commit, rest: fx }));
            }
            self.after_commit(fx).await?;
        }
    }

    /// A batch's commit ended: on success, performs the rest of its effects;
    /// else the engine ends (how, by the error).
    async fn committed(&mut self, result: Result<CommitStats>, rest: Effects) -> std::result::Result<(), EngineExit> {
        match result {
            Ok(stats) => self.transactions += stats.transactions as u64,
            Err(Error::Fenced(e)) => {
                tracing::error!(error = %e, token = self.leadership.token, "leader write rejected by fencing token; stepping down");
                return Err(EngineExit::Fenced);
            }
            // A slot's run exists although the cursor says the slot is still
            // to come (a crash between the pieces of an oversized write, or a
            // bug): the slot has its record, so the cursor moves past it —
            // else the next engine would decide the same and fail the same
            // way, forever.
            Err(Error::AlreadyExists { id, .. }) => {
                tracing::error!(run_id = %id, "a run to create exists already; the engine restarts from the store");
                if let Some((task_id, slot)) = crate::model::run::slot_of_run_id(&id)
                    && let Err(e) = self.repo.advance_cursor(&self.leadership, task_id, slot, self.clock.now()).await
                {
                    tracing::error!(error = %e, task_id, "cannot move the cursor past the existing run");
                }
                return Err(EngineExit::Failed("a slot's run exists already (cursor moved past it)".to_string()));
            }
            Err(e) => {
                tracing::error!(error = %e, "store write failed; the engine restarts from the store");
                return Err(EngineExit::Failed(format!("store write failed: {e}")));
            }
        }
        self.after_commit(rest).await
    }

    /// Performs what follows a batch's writes (or a batch without any):
    /// closes and sends to runners, publishes events, delivers replies,
    /// feeds back the runs the core asked to read.
    async fn after_commit(&mut self, fx: Effects) -> std::result::Result<(), EngineExit> {
        for (runner_id, session) in fx.disconnects {
            if self.links.get(&runner_id).is_some_and(|l| l.session == session) {
                self.links.remove(&runner_id);
            }
        }
        let now = self.clock.read();
        let mut sends = fx.sends;
        self.fill_event_bodies(&mut sends).await?;
        for out in sends {
            let failed = match self.links.get(&out.runner_id) {
                Some(link) if link.session == out.session => match link.tx.try_send(out.msg) {
                    Ok(()) => None,
                    Err(TrySendError::Full(_)) => Some("its stream does not drain"),
                    Err(TrySendError::Closed(_)) => Some("its stream closed"),
                },
                // A message for an older session, or a closed one: dropped.
                _ => None,
            };
            if let Some(why) = failed {
                tracing::warn!(runner_id = %out.runner_id, session = out.session, why, "disconnecting runner");
                self.links.remove(&out.runner_id);
                self.core.handle(now, Input::RunnerGone { runner_id: out.runner_id, session: out.session });
            }
        }
        for ev in fx.events {
            let _ = self.bus.send(ev);
        }
        for (id, reply) in fx.replies {
            match (self.pending.remove(&id), reply) {
                (Some(Pending::Trigger(tx)), Reply::Trigger(r)) => {
                    let _ = tx.send(r);
                }
                (Some(Pending::Cancel(tx)), Reply::Cancel(r)) => {
                    let _ = tx.send(r.map(|b| *b));
                }
                (Some(Pending::ResetBreaker(tx)), Reply::ResetBreaker(r)) => {
                    let _ = tx.send(r);
                }
                (Some(Pending::ReleaseResource(tx)), Reply::ReleaseResource(r)) => {
                    let _ = tx.send(r);
                }
                (Some(Pending::Backfill(tx)), Reply::Backfill(r)) => {
                    let _ = tx.send(r);
                }
                (Some(Pending::Events(tx)), Reply::Events(r)) => {
                    let _ = tx.send(r);
                }
                _ => tracing::error!(reply = id, "reply of the wrong kind or to nobody"),
            }
        }
        for (task_id, why) in fx.pauses {
            match self.repo.pause_task_for(&task_id, &why, self.clock.now()).await {
                Ok(true) => tracing::warn!(task_id, why, "task paused by the scheduler"),
                Ok(false) => {}
                Err(e) => tracing::error!(error = %e, task_id, "cannot pause the task"),
            }
        }
        for (reply, ids) in fx.run_checks {
            match look_up_ids(&self.repo, self.archive.as_deref(), &ids).await {
                Ok(found) => self.core.handle(self.clock.read(), Input::EventsLoaded { reply, found }),
                Err(e) => {
                    tracing::error!(error = %e, "cannot look up the runs of a batch of events; the engine restarts");
                    return Err(EngineExit::Failed(format!("cannot look up the runs of a batch of events: {e}")));
                }
            }
        }
        for (run_id, purpose) in fx.reads {
            let read = match (self.repo.get_run(&run_id).await, &self.archive) {
                // A run gone from the store may be in the archive.
                (Ok(None), Some(archive)) => archive.get(&run_id).await.or_else(|e| {
                    tracing::warn!(error = %e, run_id, "the history archive does not answer; the run reads as absent");
                    Ok(None)
                }),
                (other, _) => other,
            };
            match read {
                Ok(run) => self.core.handle(self.clock.read(), Input::RunLoaded { run_id, run: run.map(Box::new), purpose }),
                Err(e) => {
                    tracing::error!(error = %e, run_id, "cannot read a run; the engine restarts");
                    return Err(EngineExit::Failed(format!("cannot read a run: {e}")));
                }
            }
        }
        Ok(())
    }
}

impl Engine {
    /// Puts each assignment's stored event body (`events/{run_id}`) into
    /// its context's `event.body`: the core never holds large bodies. A
    /// body that is gone (a crash between the pieces of an oversized
    /// write) is given as `null`, and said.
    async fn fill_event_bodies(&self, sends: &mut [super::core::Outbound]) -> std::result::Result<(), EngineExit> {
        let want: Vec<usize> = sends
            .iter()
            .enumerate()
            .filter(|(_, o)| matches!(&o.msg, ToRunner::Assign(a) if a.stored_event_body))
            .map(|(i, _)| i)
            .collect();
        if want.is_empty() {
            return Ok(());
        }
        let ids: Vec<String> = want
            .iter()
            .filter_map(|i| match &sends[*i].msg {
                ToRunner::Assign(a) => Some(a.run_id.clone()),
                _ => None,
            })
            .collect();
        let bodies = match self.repo.event_bodies(&ids).await {
            Ok(b) => b,
            Err(e) => {
                tracing::error!(error = %e, "cannot read stored event bodies; the engine restarts");
                return Err(EngineExit::Failed(format!("cannot read stored event bodies: {e}")));
            }
        };
        for (i, body) in want.into_iter().zip(bodies) {
            let ToRunner::Assign(a) = &mut sends[i].msg else { continue };
            let Ok(mut ctx) = serde_json::from_str::<serde_json::Value>(&a.context_json) else { continue };
            let value = match body {
                Some(bytes) => crate::model::event::body_value(&bytes).0,
                None => {
                    tracing::error!(run_id = %a.run_id, "the run's stored event body is missing; the agent gets null");
                    serde_json::Value::Null
                }
            };
            if let Some(ev) = ctx.get_mut("event").and_then(|e| e.as_object_mut()) {
                ev.insert("body".into(), value);
            }
            a.context_json = ctx.to_string();
            a.stored_event_body = false;
        }
        Ok(())
    }
}

/// A spawned task that is aborted when this is dropped.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A batch being committed: the commit, and the effects that wait for it.
struct InFlight {
    commit: futures::future::BoxFuture<'static, Result<CommitStats>>,
    rest: Effects,
}

/// The pause between pages of a one-time time index build: the engine's
/// own writes go between them (35,000 runs of an earlier version slowed a
/// live burst enough to miss a test's minute).
const INDEX_BUILD_PAUSE: std::time::Duration = std::time::Duration::from_millis(5);

/// What the store holds of events' ids (one batched read each of dedup
/// keys and runs; a windowed id's run record read only when its dedup key
/// was swept: the record's own claim then says its window ended).
///
/// With an archive, ids whose runs are not in the store are looked up
/// there too; an archive that does not answer makes those ids
/// [`StoredId::Unavailable`] (their events are refused, to come again),
/// never absent.
async fn look_up_ids(
    repo: &Repo,
    archive: Option<&dyn crate::repo::history::HistoryStore>,
    ids: &[IdLookup],
) -> crate::error::Result<Vec<StoredId>> {
    let run_ids: Vec<String> = ids.iter().map(|l| l.run_id.clone()).collect();
    let mut exists = repo.runs_exist(&run_ids).await?;
    let mut unavailable = None;
    if let Some(archive) = archive {
        let gone: Vec<String> = run_ids.iter().zip(&exists).filter(|(_, e)| !**e).map(|(id, _)| id.clone()).collect();
        if !gone.is_empty() {
            match archive.contains(&gone).await {
                Ok(found) => {
                    let found: std::collections::HashSet<&String> = gone.iter().zip(found).filter(|(_, f)| *f).map(|(id, _)| id).collect();
                    for (id, e) in run_ids.iter().zip(exists.iter_mut()) {
                        *e = *e || found.contains(id);
                    }
                }
                Err(e) => unavailable = Some(e.to_string()),
            }
        }
    }
    let windowed: Vec<String> = ids.iter().filter(|l| l.windowed).map(|l| l.run_id.clone()).collect();
    let mut claims = if windowed.is_empty() { Vec::new() } else { repo.dedup_claims(&windowed).await? }.into_iter();
    let mut out = Vec::with_capacity(ids.len());
    for (l, exists) in ids.iter().zip(exists) {
        let claim = if l.windowed { claims.next().flatten() } else { None };
        out.push(match (claim, exists) {
            (Some(c), _) => StoredId::Claim(c),
            (None, false) if unavailable.is_some() => StoredId::Unavailable(unavailable.clone().unwrap_or_default()),
            (None, false) => StoredId::Absent,
            // The run's own claim, wherever the run is (an archived one's
            // too): without one the id deduplicates as long as it is kept.
            (None, true) if l.windowed => {
                let run = match (repo.get_run(&l.run_id).await?, archive) {
                    (Some(r), _) => Some(r),
                    (None, Some(a)) => a.get(&l.run_id).await.ok().flatten(),
                    (None, None) => None,
                };
                match run.and_then(|r| r.dedup) {
                    Some(c) => StoredId::Claim(c),
                    None => StoredId::Run,
                }
            }
            (None, true) => StoredId::Run,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use async_trait::async_trait;

    use super::*;
    use crate::model::event::DedupClaim;
    use crate::model::run::TriggerKind;
    use crate::repo::Keys;
    use crate::repo::history::{Count, HistoryPage, HistoryQuery, HistoryStore};
    use crate::store::embedded::EmbeddedStore;

    /// An archive holding some runs (a fake inside this unit's test).
    struct Held(Vec<RunRecord>);

    #[async_trait]
    impl HistoryStore for Held {
        fn kind(&self) -> &'static str {
            "held"
        }
        async fn record(&self, _: &[RunRecord]) -> Result<()> {
            Ok(())
        }
        async fn get(&self, run_id: &str) -> Result<Option<RunRecord>> {
            Ok(self.0.iter().find(|r| r.run_id == run_id).cloned())
        }
        async fn page(&self, _: &HistoryQuery) -> Result<HistoryPage> {
            Ok(HistoryPage::default())
        }
        async fn count(&self, _: &HistoryQuery) -> Result<Count> {
            Ok(Count { runs: 0, exact: true })
        }
    }

    /// Issue 35: a webhook id whose run moved to the archive and whose
    /// dedup key was swept (its window ended) makes a new run: the archived
    /// run's own claim says the window ended. Before, the archived run read
    /// as a run without a window: a duplicate for as long as it was kept.
    #[tokio::test]
    async fn an_archived_runs_expired_claim_lets_its_id_run_again() {
        let dir = tempfile::tempdir().expect("tempdir");
        let repo = Repo::new(Arc::new(EmbeddedStore::open(dir.path()).await.expect("open")), Keys::default());
        let at = chrono::DateTime::from_timestamp(1_800_000_000, 0).expect("t");
        let id = "w.webhook-0123".to_string();
        let mut run = RunRecord::pending(id.clone(), "w", "a", TriggerKind::Webhook, at, at);
        let claim = DedupClaim { key: id.clone(), run_id: id.clone(), expires_at: at, scheduled_at: None };
        run.dedup = Some(claim.clone());
        let archive = Held(vec![run]);
        let found = look_up_ids(&repo, Some(&archive), &[IdLookup { run_id: id.clone(), windowed: true }]).await.expect("look up");
        assert_eq!(found, vec![StoredId::Claim(claim)]);
        // Without a window the archived run is a duplicate, as before.
        let found = look_up_ids(&repo, Some(&archive), &[IdLookup { run_id: id, windowed: false }]).await.expect("look up");
        assert_eq!(found, vec![StoredId::Run]);
    }
}
