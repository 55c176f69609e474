//! The decision core: every scheduling and run-lifecycle decision, as plain
//! code with no runtime, store or socket (STYLE.md item 15; the model is
//! quinn-proto's `Connection`).
//!
//! The shell feeds it [`Input`]s (task changes, runner messages, API
//! commands, stored runs it asked for) and [`EngineCore::runner_hello`];
//! asks [`EngineCore::poll_timeout`] when to call
//! [`EngineCore::handle_timeout`]; and after each turn drains
//! [`EngineCore::poll_effects`]: store writes (one fenced transaction per
//! turn as far as the store allows), then messages to runners, lifecycle
//! events and replies — in that order, so nothing is sent or announced
//! before it is stored. If a write fails the shell stops and the next
//! engine starts from the store: memory never outlives a failed write.
//!
//! Files: `tasks.rs` (definitions, firing, misfires, pause/resume/delete
//! settlement), `runs.rs` (admission, dispatch, attempts, retries,
//! cancellation, the one `finish`), `runners.rs` (sessions, reports and
//! their ownership, re-declaration, silence, loss).

mod breaker;
mod deadlines;
mod notify;
mod runners;
mod runs;
mod tasks;

pub use runs::MAX_DELAY_SECONDS;
#[cfg(test)]
mod tests;

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap, HashSet, VecDeque};
use std::sync::Arc;

use chrono::{DateTime, Utc};

use super::lifecycle::Lifecycle;
use super::protocol::{FinishedReport, FromRunner, ToRunner};
use super::{RunnerSnapshot, TriggerRequest};
use crate::clock::{Mono, Now};
use crate::dispatch::queue::AgentQueues;
use crate::dispatch::registry::Registry;
use crate::error::Result;
use crate::model::{Cursor, RunRecord, TaskRecord};
use crate::repo::StoreOp;
use crate::timing::Timing;

/// Most slot runs one task admits per fire; a longer `run_all` catch-up
/// continues at once in the next turn, so one task's group of writes stays
/// within one etcd transaction (`max-txn-ops` 128).
pub const MAX_RUNS_PER_FIRE: usize = 50;

/// Identifies a pending reply of the shell.
pub type ReplyId = u64;

/// Static configuration of one engine (one leadership term).
#[derive(Debug, Clone)]
pub struct CoreConfig {
    /// Timing constants.
    pub timing: Timing,
    /// This term's fencing token.
    pub token: u64,
    /// This replica's id (told to runners in Welcome).
    pub leader_id: String,
}

/// The result of a manual trigger.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Triggered {
    /// The run (new, or the one the idempotency key named).
    pub run_id: String,
    /// Its earliest start (UTC).
    pub scheduled_at: DateTime<Utc>,
    /// False when the idempotency key matched an existing run.
    pub created: bool,
}

/// A reply to an API command, sent once the command's writes committed.
#[derive(Debug)]
pub enum Reply {
    /// To [`Input::Trigger`].
    Trigger(Result<Triggered>),
    /// To [`Input::Cancel`]: the run as stored.
    Cancel(Result<Box<RunRecord>>),
    /// To [`Input::ResetBreaker`]: the breaker as stored.
    ResetBreaker(Result<crate::model::breaker::Breaker>),
}

/// Why the core asked the shell to read a run.
#[derive(Debug, Clone)]
pub enum ReadPurpose {
    /// A trigger with an explicit idempotency key: does its run exist?
    Trigger {
        /// Reply to.
        reply: ReplyId,
        /// The request.
        req: TriggerRequest,
    },
    /// Cancel of a run not active here: why not?
    Cancel {
        /// Reply to.
        reply: ReplyId,
    },
    /// A `once` slot before the task's creation, of a task that never
    /// fired: its run may exist from an earlier task with this id.
    PastOnce {
        /// Task.
        task_id: String,
        /// The slot.
        at: DateTime<Utc>,
    },
    /// A `Finished` for an execution of a run no longer in memory: kept
    /// as evidence if that runner owns it.
    LateReport {
        /// Reporter.
        runner_id: String,
        /// Its session.
        session: u64,
        /// The report.
        report: Box<FinishedReport>,
    },
}

/// Something the core is told.
#[derive(Debug, Clone)]
pub enum Input {
    /// A task was created or replaced (also paused, resumed). `cursor` is
    /// the stored cursor when the core did not know the task
    /// ([`EngineCore::knows_task`]), else `None`.
    TaskPut {
        /// The definition.
        record: Box<TaskRecord>,
        /// Its stored cursor (for a task new to the core).
        cursor: Option<Cursor>,
    },
    /// A task was deleted.
    TaskDeleted {
        /// Task.
        task_id: String,
    },
    /// The task watch broke and every task was read again.
    TasksReloaded {
        /// Every task with its stored cursor.
        tasks: Vec<(TaskRecord, Option<Cursor>)>,
    },
    /// A message on a runner's stream.
    Runner {
        /// Sender.
        runner_id: String,
        /// Its session (stream generation).
        session: u64,
        /// When the message arrived at this replica, before queueing.
        received_at: Now,
        /// The message.
        msg: FromRunner,
    },
    /// A runner's stream ended (or its sender was dropped for not draining).
    RunnerGone {
        /// Runner.
        runner_id: String,
        /// The session that ended.
        session: u64,
    },
    /// `TriggerTask`.
    Trigger {
        /// Reply to.
        reply: ReplyId,
        /// The request (the shell fills a fresh idempotency key if none).
        req: TriggerRequest,
        /// The caller gave the key (so the run may exist already).
        explicit_key: bool,
    },
    /// `CancelRun`.
    Cancel {
        /// Reply to.
        reply: ReplyId,
        /// Run.
        run_id: String,
        /// Why.
        reason: String,
    },
    /// `ResetBreaker`: close a task's circuit breaker by hand.
    ResetBreaker {
        /// Reply to.
        reply: ReplyId,
        /// Task.
        task_id: String,
    },
    /// A run the core asked for ([`Effects::reads`]).
    RunLoaded {
        /// Run.
        run_id: String,
        /// As stored (`None`: no such run).
        run: Option<Box<RunRecord>>,
        /// Why it was asked for.
        purpose: ReadPurpose,
    },
}

/// A message for one runner session.
#[derive(Debug, Clone, PartialEq)]
pub struct Outbound {
    /// Runner.
    pub runner_id: String,
    /// Session it is for (dropped if the runner has a newer one).
    pub session: u64,
    /// The message.
    pub msg: ToRunner,
}

/// What the shell must do after a turn, in this order: commit `writes`
/// (each inner group atomically, groups in order), close `disconnects`,
/// send `sends`, publish `events`, deliver `replies`, then perform `reads`
/// and feed each back as [`Input::RunLoaded`].
#[derive(Debug, Default)]
pub struct Effects {
    /// Groups of store operations.
    pub writes: Vec<Vec<StoreOp>>,
    /// Runner sessions to close (their streams did not drain, or they went silent).
    pub disconnects: Vec<(String, u64)>,
    /// Messages to runners.
    pub sends: Vec<Outbound>,
    /// Lifecycle events.
    pub events: Vec<Lifecycle>,
    /// Replies to API commands.
    pub replies: Vec<(ReplyId, Reply)>,
    /// Runs to read from the store: `(run_id, purpose)`.
    pub reads: Vec<(String, ReadPurpose)>,
}

impl Effects {
    /// Nothing to do.
    pub fn is_empty(&self) -> bool {
        self.writes.is_empty()
            && self.disconnects.is_empty()
            && self.sends.is_empty()
            && self.events.is_empty()
            && self.replies.is_empty()
            && self.reads.is_empty()
    }
}

/// What a timer does when it fires. `Fire` and a delayed run's `RunDue`
/// wait for the wall clock (a slot, a `not_before` is a time of day);
/// every other timer waits elapsed time ([`Mono`]).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Timer {
    /// Handle the due slots of a task (if `generation` is still current).
    Fire { task_id: String, generation: u64 },
    /// A delayed, retrying or requeued run may be dispatched, if it still
    /// waits for `at` (its `next_attempt_at`).
    RunDue { run_id: String, at: DateTime<Utc> },
    /// An attempt whose old runner process may still be alive stops
    /// holding its concurrency slot (that process's fence has passed).
    ReleaseOrphan { run_id: String, execution_id: String },
    /// Check for silent and lost runners.
    RunnerCheck,
    /// Write the lazily persisted changes (progress).
    Flush,
}

/// A task the core tracks.
#[derive(Debug)]
struct TaskEntry {
    record: TaskRecord,
    cursor: Option<Cursor>,
    /// Bumped on every arm; stale `Fire` timers are ignored.
    generation: u64,
    /// Earlier definitions whose slots due before they changed are still to
    /// be settled (misfire policy first), oldest first: `(definition, until)`.
    settle: VecDeque<(TaskRecord, DateTime<Utc>)>,
    /// Deleted: removed once `settle` is done.
    deleted: bool,
    /// A `Fire` waits for recovered runs to be re-declared.
    deferred: bool,
    /// Runs of an unfinished `run_all` catch-up: they queue behind each
    /// other instead of being skipped for overlapping each other.
    catchup: HashSet<String>,
}

/// How soon a changed run must reach the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Urgency {
    /// In this turn's transaction.
    Now,
    /// With the next transaction, or at the next flush (a run started,
    /// progress, a pending reason): never a transaction of its own per change.
    Lazy,
}

/// The engine's state. See the module docs.
pub struct EngineCore {
    cfg: CoreConfig,
    tasks: HashMap<String, TaskEntry>,
    /// Runs in memory: every non-terminal run, terminal runs until written,
    /// and terminal runs whose agent is not confirmed gone.
    runs: HashMap<String, RunRecord>,
    /// Run ids in memory per task.
    by_task: HashMap<String, BTreeSet<String>>,
    ready: AgentQueues,
    registry: Registry,
    /// Timers on the wall clock (slots, delays).
    timers: BinaryHeap<Reverse<(DateTime<Utc>, u64, Timer)>>,
    /// Timers on elapsed time (backoffs, checks, releases, flushes).
    mono_timers: BinaryHeap<Reverse<(Mono, u64, Timer)>>,
    /// Start deadlines of runs waiting for dispatch (`start_timeout_seconds`).
    start_by: deadlines::Deadlines<String>,
    /// The control plane's backstop deadline of each open attempt: `(run, execution)`.
    attempt_deadlines: deadlines::Deadlines<(String, String)>,
    timer_seq: u64,
    next_session: u64,
    exec_seq: u64,
    /// When this leader took over (UTC): slots due before were missed while
    /// no leader ran (misfire policy).
    loaded_at: DateTime<Utc>,
    /// The last reading of the clocks an input came with: a wall clock
    /// step shows as a difference between the two clocks since then.
    last_now: Option<Now>,
    /// The last forward step of the wall clock seen: the wall clock range
    /// it skipped, `(from, to]` (a slot in it was late because of it).
    last_step: Option<(DateTime<Utc>, DateTime<Utc>)>,
    runner_check_armed: bool,
    flush_armed: bool,
    dispatch_needed: bool,
    /// Tasks whose fire waits for re-declaration.
    deferred: BTreeSet<String>,
    /// (execution, runner) pairs already logged as forged.
    forgeries: HashSet<(String, String)>,
    /// (execution, runner) pairs whose late report already asked the store.
    late_reads: HashSet<(String, String)>,
    // ---- this turn's output
    created: Vec<String>,
    created_set: HashSet<String>,
    cursors: BTreeMap<String, Option<Cursor>>,
    dirty: BTreeSet<String>,
    lazy: BTreeSet<String>,
    /// Runs changed this turn whose write goes with their task's cursor
    /// (their end changed the task's circuit breaker).
    with_cursor: BTreeSet<String>,
    /// Store ops (notifications) to commit in the same group as a run's
    /// write this turn.
    companions: HashMap<String, Vec<StoreOp>>,
    flush_requested: bool,
    fx: Effects,
}

/// Cap of the forged-report log dedupe set.
const MAX_FORGERIES_REMEMBERED: usize = 10_000;
/// Cap of the late-report read dedupe set.
const MAX_LATE_READS_REMEMBERED: usize = 10_000;

impl EngineCore {
    /// An empty core for one leadership term.
    pub fn new(cfg: CoreConfig) -> Self {
        EngineCore {
            cfg,
            tasks: HashMap::new(),
            runs: HashMap::new(),
            by_task: HashMap::new(),
            ready: AgentQueues::default(),
            registry: Registry::default(),
            timers: BinaryHeap::new(),
            mono_timers: BinaryHeap::new(),
            start_by: deadlines::Deadlines::default(),
            attempt_deadlines: deadlines::Deadlines::default(),
            timer_seq: 0,
            next_session: 0,
            exec_seq: 0,
            loaded_at: DateTime::<Utc>::MIN_UTC,
            last_now: None,
            last_step: None,
            runner_check_armed: false,
            flush_armed: false,
            dispatch_needed: false,
            deferred: BTreeSet::new(),
            forgeries: HashSet::new(),
            late_reads: HashSet::new(),
            created: Vec::new(),
            created_set: HashSet::new(),
            cursors: BTreeMap::new(),
            dirty: BTreeSet::new(),
            lazy: BTreeSet::new(),
            with_cursor: BTreeSet::new(),
            companions: HashMap::new(),
            flush_requested: false,
            fx: Effects::default(),
        }
    }

    /// Takes over from the store: tasks with their cursors, and the runs of
    /// the `active/` index. Attempts open at load wait
    /// [`Timing::redeclare_wait`] for their runner to re-declare them.
    pub fn load(&mut self, now: Now, tasks: Vec<(TaskRecord, Option<Cursor>)>, runs: Vec<RunRecord>) {
        self.observe(now);
        self.loaded_at = now.wall;
        self.fx.events.push(Lifecycle::LeadershipGained { token: self.cfg.token });
        // Tasks first (runs need their timeouts), then runs (admission needs
        // them), then the tasks' first decisions.
        let ids: Vec<String> = tasks.into_iter().filter_map(|(rec, cursor)| self.insert_task(rec, cursor)).collect();
        self.recover_runs(now, runs);
        self.recover_breakers(now);
        for id in ids {
            self.task_started(now, &id);
        }
        tracing::info!(tasks = self.tasks.len(), runs = self.runs.len(), token = self.cfg.token, "engine loaded");
        self.arm_runner_check(now);
        self.dispatch_needed = true;
        self.after_input(now);
    }

    /// Whether the core tracks this task (else [`Input::TaskPut`] needs its cursor).
    pub fn knows_task(&self, task_id: &str) -> bool {
        self.tasks.contains_key(task_id)
    }

    /// Handles one input.
    pub fn handle(&mut self, now: Now, input: Input) {
        self.observe(now);
        match input {
            Input::TaskPut { record, cursor } => self.task_put(now, *record, cursor),
            Input::TaskDeleted { task_id } => self.task_deleted(now, &task_id),
            Input::TasksReloaded { tasks } => self.tasks_reloaded(now, tasks),
            Input::Runner { runner_id, session, received_at, msg } => self.on_runner_message(now, &runner_id, session, received_at, msg),
            Input::RunnerGone { runner_id, session } => self.on_runner_gone(&runner_id, session),
            Input::Trigger { reply, req, explicit_key } => self.trigger(now, reply, req, explicit_key),
            Input::Cancel { reply, run_id, reason } => self.cancel_command(now, reply, &run_id, &reason),
            Input::ResetBreaker { reply, task_id } => self.reset_breaker(now, reply, &task_id),
            Input::RunLoaded { run_id, run, purpose } => self.on_run_loaded(now, &run_id, run.map(|r| *r), purpose),
        }
        self.after_input(now);
    }

    /// When [`EngineCore::handle_timeout`] should next be called, on the
    /// monotonic clock: wall clock timers are converted with the reading
    /// `now` (the shell sleeps at most 30 s at a time, so a wall clock step
    /// is seen within that).
    pub fn poll_timeout(&self, now: Now) -> Option<Mono> {
        let wall = self.timers.peek().map(|Reverse((t, _, _))| now.mono_at(*t));
        [wall, self.mono_timers.peek().map(|Reverse((t, _, _))| *t), self.start_by.next(), self.attempt_deadlines.next()]
            .into_iter()
            .flatten()
            .min()
    }

    /// Fires up to `max` due timers; returns whether more are due (the
    /// shell then serves other inputs before coming back, so a burst of
    /// timers never starves runner messages).
    pub fn handle_timeout(&mut self, now: Now, max: usize) -> bool {
        self.observe(now);
        let mut fired = 0;
        while fired < max {
            fired += 1;
            if let Some((run_id, execution_id)) = self.attempt_deadlines.pop_due(now.mono) {
                self.on_deadline(now, &run_id, &execution_id);
                continue;
            }
            if let Some(run_id) = self.start_by.pop_due(now.mono) {
                self.on_start_by(now, &run_id);
                continue;
            }
            let timer = match (self.timers.peek(), self.mono_timers.peek()) {
                (Some(Reverse((at, _, _))), _) if *at <= now.wall => self.timers.pop().map(|Reverse((_, _, t))| t),
                (_, Some(Reverse((at, _, _)))) if *at <= now.mono => self.mono_timers.pop().map(|Reverse((_, _, t))| t),
                _ => None,
            };
            let Some(timer) = timer else { break };
            match timer {
                Timer::Fire { task_id, generation } => self.on_fire(now, &task_id, generation),
                Timer::RunDue { run_id, at } => self.on_run_due(now, &run_id, at),
                Timer::ReleaseOrphan { run_id, execution_id } => self.release_orphan(now, &run_id, &execution_id),
                Timer::RunnerCheck => self.on_runner_check(now),
                Timer::Flush => {
                    self.flush_armed = false;
                    self.flush_requested = true;
                }
            }
        }
        self.after_input(now);
        self.poll_timeout(now).is_some_and(|at| at <= now.mono)
    }

    /// Writes everything persisted lazily with the next effects (a graceful
    /// stop).
    pub fn flush(&mut self) {
        self.flush_requested = true;
    }

    /// Drains the effects decided so far. See [`Effects`] for the order the
    /// shell performs them in.
    pub fn poll_effects(&mut self) -> Effects {
        let mut groups: Vec<Vec<StoreOp>> = Vec::new();
        // Per task: the runs created this turn, then its cursor, in one
        // group: a slot's record and the cursor moving past it commit
        // together (a later leader never re-creates a handled slot).
        let mut by_task: BTreeMap<String, Vec<StoreOp>> = BTreeMap::new();
        let mut written: Vec<String> = Vec::new();
        for run_id in std::mem::take(&mut self.created) {
            if let Some(run) = self.runs.get(&run_id) {
                let (task_id, op) = (run.task_id.clone(), StoreOp::CreateRun(Box::new(run.clone())));
                let companions = self.take_companions(&run_id);
                let group = by_task.entry(task_id).or_default();
                group.push(op);
                group.extend(companions);
                written.push(run_id.clone());
            }
            self.dirty.remove(&run_id);
            self.lazy.remove(&run_id);
        }
        self.created_set.clear();
        // A run whose end moved its task's breaker commits with the cursor.
        for run_id in std::mem::take(&mut self.with_cursor) {
            let Some(run) = self.runs.get(&run_id) else { continue };
            if self.dirty.remove(&run_id) || self.lazy.remove(&run_id) {
                let (task_id, op) = (run.task_id.clone(), StoreOp::PutRun(Box::new(run.clone())));
                let companions = self.take_companions(&run_id);
                let group = by_task.entry(task_id).or_default();
                group.push(op);
                group.extend(companions);
                written.push(run_id);
            }
        }
        for (task_id, cursor) in std::mem::take(&mut self.cursors) {
            let op = match cursor {
                Some(cursor) => StoreOp::PutCursor { task_id: task_id.clone(), cursor },
                None => StoreOp::DeleteCursor { task_id: task_id.clone() },
            };
            by_task.entry(task_id).or_default().push(op);
        }
        groups.extend(by_task.into_values());
        for run_id in std::mem::take(&mut self.dirty) {
            self.lazy.remove(&run_id);
            if let Some(run) = self.runs.get(&run_id) {
                let mut group = vec![StoreOp::PutRun(Box::new(run.clone()))];
                group.extend(self.take_companions(&run_id));
                groups.push(group);
                written.push(run_id);
            }
        }
        if !groups.is_empty() || self.flush_requested {
            for run_id in std::mem::take(&mut self.lazy) {
                if let Some(run) = self.runs.get(&run_id) {
                    let mut group = vec![StoreOp::PutRun(Box::new(run.clone()))];
                    group.extend(self.take_companions(&run_id));
                    groups.push(group);
                    written.push(run_id);
                }
            }
            self.flush_requested = false;
        }
        // Companions of runs not written this turn (none are expected: a run
        // is written in the turn it ends) go on their own rather than be lost.
        for (run_id, ops) in std::mem::take(&mut self.companions) {
            tracing::warn!(run_id, "notifications written without their run's change");
            groups.push(ops);
        }
        // A written run that is terminal and holds no agent leaves memory.
        for run_id in written {
            if self.runs.get(&run_id).is_some_and(|r| r.status.is_terminal() && !r.holds_agent()) {
                self.forget_run(&run_id);
            }
        }
        let mut fx = std::mem::take(&mut self.fx);
        fx.writes = groups;
        fx
    }

    /// The registry as `ListRunners` shows it.
    pub fn runner_snapshots(&self) -> Vec<RunnerSnapshot> {
        let mut v: Vec<RunnerSnapshot> = self
            .registry
            .iter()
            .map(|r| {
                let mut agents: Vec<String> = r.agents.iter().cloned().collect();
                agents.sort();
                let mut running: Vec<String> = r.running.values().cloned().collect();
                running.sort();
                RunnerSnapshot {
                    runner_id: r.runner_id.clone(),
                    agents,
                    slots: r.slots,
                    busy: u32::try_from(r.running.len()).unwrap_or(u32::MAX),
                    labels: r.labels.clone(),
                    version: r.version.clone(),
                    connected: r.connected,
                    connected_at: r.connected_at,
                    last_seen: r.last_seen,
                    running,
                }
            })
            .collect();
        v.sort_by(|a, b| a.runner_id.cmp(&b.runner_id));
        v
    }

    /// What `/metrics` reports of this leader's state: pending runs per
    /// agent, connected runners and their slots, breakers.
    pub fn gauges(&self) -> crate::metrics::EngineGauges {
        let mut g = crate::metrics::EngineGauges { active_runs: self.runs.len() as u64, ..Default::default() };
        for run in self.runs.values() {
            if !run.status.is_terminal() && run.current_attempt().is_none() {
                *g.pending.entry(run.agent_id.clone()).or_default() += 1;
            }
        }
        for r in self.registry.iter().filter(|r| r.connected) {
            g.runners_connected += 1;
            g.slots_total += u64::from(r.slots);
            g.slots_busy += r.running.len() as u64;
        }
        for (id, e) in &self.tasks {
            if e.record.spec.execution.circuit_breaker.is_some() && !e.deleted {
                let phase = e.cursor.as_ref().and_then(|c| c.breaker.as_ref()).map_or("closed", |b| b.phase.as_str());
                g.breakers.push((id.clone(), phase));
            }
        }
        g.breakers.sort();
        g
    }

    /// A run as this leader knows it right now (its memory may be ahead of
    /// the store for lazily persisted changes), if it is in memory.
    pub fn active_run(&self, run_id: &str) -> Option<RunRecord> {
        self.runs.get(run_id).cloned()
    }

    /// Every run in memory (of `task_id`, or all when empty).
    pub fn active_runs(&self, task_id: &str) -> Vec<RunRecord> {
        if task_id.is_empty() {
            return self.runs.values().cloned().collect();
        }
        self.by_task.get(task_id).map(|ids| ids.iter().filter_map(|id| self.runs.get(id).cloned()).collect()).unwrap_or_default()
    }

    /// Whether a connected runner serves `agent_id` with every label of `selector`.
    pub fn serves_agent(&self, agent_id: &str, selector: &BTreeMap<String, String>) -> bool {
        self.registry.iter().any(|r| r.serves(agent_id, selector))
    }

    // ------------------------------------------------------------ helpers

    /// A timer for when the wall clock reads `at`.
    fn push_timer(&mut self, at: DateTime<Utc>, t: Timer) {
        self.timer_seq += 1;
        self.timers.push(Reverse((at, self.timer_seq, t)));
    }

    /// A timer for when the monotonic clock reaches `at`.
    fn push_mono_timer(&mut self, at: Mono, t: Timer) {
        self.timer_seq += 1;
        self.mono_timers.push(Reverse((at, self.timer_seq, t)));
    }

    /// Notes the clocks an input came with: a wall clock that moved more
    /// than 2 s further than elapsed time since the last input was stepped
    /// (NTP, an operator, a VM resumed); slots it skipped are late because
    /// of it, and the misfire log says so.
    fn observe(&mut self, now: Now) {
        if let Some(prev) = self.last_now {
            let step = now.wall_step_since(prev);
            if step > WALL_STEP {
                tracing::warn!(step_ms = step.num_milliseconds(), from = %prev.wall, to = %now.wall, "the wall clock stepped forward: slots it skipped are misfires");
                self.last_step = Some((now.wall - step, now.wall));
            } else if step < -WALL_STEP {
                tracing::warn!(step_ms = step.num_milliseconds(), from = %prev.wall, to = %now.wall, "the wall clock stepped back: slots already handled do not run again");
            }
        }
        self.last_now = Some(now);
    }

    fn timing(&self) -> &Timing {
        &self.cfg.timing
    }

    fn dur(d: std::time::Duration) -> chrono::Duration {
        chrono::Duration::from_std(d).unwrap_or(chrono::Duration::MAX)
    }

    /// Marks a run changed: stamps it and queues its write.
    fn touch(&mut self, now: Now, run_id: &str, urgency: Urgency) {
        let token = self.cfg.token;
        let Some(run) = self.runs.get_mut(run_id) else { return };
        run.updated_at = now.wall;
        run.fencing_token = token;
        if self.created_set.contains(run_id) {
            return;
        }
        match urgency {
            Urgency::Now => {
                self.lazy.remove(run_id);
                self.dirty.insert(run_id.to_string());
            }
            Urgency::Lazy if !self.dirty.contains(run_id) => {
                self.lazy.insert(run_id.to_string());
            }
            Urgency::Lazy => {}
        }
    }

    /// Asks for a lazy flush within `timing.progress_flush`.
    fn arm_flush(&mut self, now: Now) {
        if !self.flush_armed {
            self.flush_armed = true;
            self.push_mono_timer(now.mono.after(Self::dur(PROGRESS_FLUSH)), Timer::Flush);
        }
    }

    /// Adds a run to memory (new, or loaded).
    fn remember_run(&mut self, run: RunRecord) {
        self.by_task.entry(run.task_id.clone()).or_default().insert(run.run_id.clone());
        self.runs.insert(run.run_id.clone(), run);
    }

    fn forget_run(&mut self, run_id: &str) {
        self.start_by.remove(&run_id.to_string());
        if let Some(run) = self.runs.remove(run_id)
            && let Some(set) = self.by_task.get_mut(&run.task_id)
        {
            set.remove(run_id);
            if set.is_empty() {
                self.by_task.remove(&run.task_id);
            }
        }
        self.ready.remove(run_id);
    }

    fn event_run(&self, run_id: &str) -> Option<Arc<RunRecord>> {
        self.runs.get(run_id).map(|r| Arc::new(r.clone()))
    }

    fn send(&mut self, runner_id: &str, msg: ToRunner) {
        let Some(r) = self.registry.get(runner_id) else { return };
        if !r.connected {
            return;
        }
        self.fx.sends.push(Outbound { runner_id: runner_id.to_string(), session: r.session, msg });
    }

    fn send_to(&mut self, runner_id: &str, session: u64, msg: ToRunner) {
        self.fx.sends.push(Outbound { runner_id: runner_id.to_string(), session, msg });
    }

    /// Logs a report about an execution of another runner, once per pair.
    fn log_forgery(&mut self, what: &str, execution_id: &str, reporter: &str, owner: &str) {
        if self.forgeries.len() >= MAX_FORGERIES_REMEMBERED {
            self.forgeries.clear();
        }
        if self.forgeries.insert((execution_id.to_string(), reporter.to_string())) {
            tracing::warn!(
                execution_id,
                runner_id = reporter,
                owner_runner_id = owner,
                what,
                "report about an execution assigned to another runner; ignored"
            );
        }
    }

    /// After every input and timer batch: release deferred fires whose runs
    /// were re-declared or lost, then dispatch if anything could move.
    fn after_input(&mut self, now: Now) {
        self.release_deferred(now);
        self.dispatch(now);
    }
}

/// How much further the wall clock must move than elapsed time between two
/// inputs to count as stepped: 2 s (a busy turn moves both alike).
const WALL_STEP: chrono::Duration = chrono::Duration::seconds(2);

/// Longest a lazily persisted change (progress, a start) waits for a
/// transaction to ride with before it is written on its own: 1 s.
pub const PROGRESS_FLUSH: std::time::Duration = std::time::Duration::from_secs(1);
