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
//! settlement), `runs.rs` (runs through the decision points — admission,
//! dispatch, attempts, the one `finish` — asking the policies, and
//! cancellation), `policy/` (what is decided at those points: overlap,
//! breaker, retry and the agent's outcome contract, each a file),
//! `breaker.rs` (a breaker's state in its task's cursor), `runners.rs`
//! (sessions, reports and their ownership, re-declaration, silence, loss),
//! `writes.rs` (this turn's writes by atomic group), `timers.rs`.

mod admission;
mod breaker;
mod counts;
mod deadlines;
mod notify;
pub mod policy;
mod routes;
mod runners;
mod runs;
pub mod sources;
mod tasks;
mod timers;
mod writes;

pub use sources::manual::MAX_DELAY_SECONDS;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::Arc;

use chrono::{DateTime, Utc};

use super::lifecycle::Lifecycle;
use super::protocol::{FinishedReport, FromRunner, ToRunner};
use super::{EventAdmitted, EventRequest, TriggerRequest};
use crate::clock::{Mono, Now};
use crate::dispatch::queue::AgentQueues;
use crate::dispatch::registry::Registry;
use crate::error::Result;
use crate::model::{Cursor, RunRecord, TaskRecord};
use crate::repo::StoreOp;
use crate::timing::Timing;
use crate::views::RunnerView;
use timers::{Timer, Timers};
use writes::{Urgency, WriteSet};

/// Most slot runs one task admits per fire; a longer `run_all` catch-up
/// fires again at once (`fire_now`), in the same turn while the turn's
/// budget lasts ([`EngineCore::handle_timeout`]: each fire spends its
/// runs), so a turn holds about `max` runs. One task's group of writes (its
/// runs and its cursor) can still pass an etcd transaction's limits
/// (`max-txn-ops` 128): `repo::commit` then writes it op by op, the cursor
/// last, and a crash in between leaves runs the next leader meets as
/// existing (the shell's conflict recovery moves the cursor past them).
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
    /// To [`Input::ReleaseResource`]: the resource now, once its hold-back's
    /// deletion is committed.
    ReleaseResource(Result<crate::views::ResourceView>),
    /// To [`Input::Events`]: one answer per event, in order.
    Events(Vec<Result<EventAdmitted>>),
    /// To [`Input::Backfill`]: the backfill once its change is committed.
    Backfill(Result<crate::model::backfill::Backfill>),
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
    /// A backfill's slot: its run (`slot_run` `None`), or the linked
    /// re-run of that slot run (`slot_run` holding what the first read found).
    Backfill {
        /// The backfill.
        id: String,
        /// The slot.
        slot: DateTime<Utc>,
        /// The slot's run, once read.
        slot_run: Option<Option<Box<RunRecord>>>,
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
    /// A backfill created, paused, resumed or cancelled.
    Backfill {
        /// Reply to.
        reply: ReplyId,
        /// What to do.
        op: sources::backfill::BackfillOp,
    },
    /// `ResetBreaker`: close a task's circuit breaker by hand.
    ResetBreaker {
        /// Reply to.
        reply: ReplyId,
        /// Task.
        task_id: String,
    },
    /// `ReleaseResource`: end a resource's hold-back by hand.
    ReleaseResource {
        /// Reply to.
        reply: ReplyId,
        /// The resource.
        resource: String,
    },
    /// A batch of events (webhook requests, queue messages, published events).
    Events {
        /// Reply to.
        reply: ReplyId,
        /// The events, each for one task.
        events: Vec<EventRequest>,
    },
    /// What the store holds of a batch of events' ids ([`Effects::run_checks`]).
    EventsLoaded {
        /// The batch's reply.
        reply: ReplyId,
        /// One per id asked, in order.
        found: Vec<StoredId>,
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

/// An event's id to look up in the store ([`Effects::run_checks`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdLookup {
    /// The id's run (`event_run_id`, `published_run_id`).
    pub run_id: String,
    /// The id deduplicates within a window: its dedup key `dedup/{run_id}`
    /// says, or, once that is swept, the claim in its run's record.
    pub windowed: bool,
}

/// What the store holds of an [`IdLookup`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoredId {
    /// Nothing: the id is new.
    Absent,
    /// Its run, with no dedup claim (an id without a window, or a run
    /// written before dedup keys): a duplicate while the run is kept.
    Run,
    /// Its dedup claim: a duplicate of the claim's run until it expires.
    Claim(crate::model::event::DedupClaim),
    /// Not in the store, and the history archive did not answer (why): the
    /// event is refused (`Unavailable`) rather than risk a second run.
    Unavailable(String),
}

/// What the shell must do after a turn, in this order: commit `writes`
/// (each inner group atomically, groups in order), close `disconnects`,
/// send `sends`, publish `events`, deliver `replies`, write `pauses`, then
/// perform `reads` and feed each back as [`Input::RunLoaded`], and
/// `run_checks`, each fed back as [`Input::EventsLoaded`].
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
    /// Ids of a batch of events the store must tell about (one read per
    /// batch): `(reply, ids)`, answered as [`StoredId`]s.
    pub run_checks: Vec<(ReplyId, Vec<IdLookup>)>,
    /// Tasks to pause, with why (a policy asked): the shell writes their
    /// definitions as a user's pause does, after this turn's writes.
    pub pauses: Vec<(String, String)>,
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
            && self.run_checks.is_empty()
            && self.pauses.is_empty()
    }
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
    /// The task's latest record, when it is a SKIPPED time slot: the next
    /// slot skipped for the same reason extends it (count, range, latest
    /// why) instead of writing a record of its own. Any other record of
    /// the task ends the chain.
    skips: Option<Box<RunRecord>>,
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
    /// What is decided at each decision point, and the state it keeps.
    policies: policy::Policies,
    timers: Timers,
    clocks: Clocks,
    ids: Ids,
    /// Tasks whose fire waits for re-declaration.
    deferred: BTreeSet<String>,
    /// Something changed that may let a ready run go.
    dispatch_needed: bool,
    seen: Seen,
    /// This turn's writes.
    writes: WriteSet,
    /// This turn's other effects.
    fx: Effects,
    /// Batches of events waiting for their store lookup.
    pending_events: HashMap<ReplyId, sources::events::PendingEvents>,
    /// Manual triggers with a key waiting for the store's word on it.
    pending_triggers: HashMap<ReplyId, TriggerRequest>,
    /// Dedup claims this leader made or read, by key (expired ones are
    /// dropped as more come).
    claims: HashMap<String, crate::model::event::DedupClaim>,
    /// Where events find their tasks.
    routes: routes::Routes,
    /// Each task's runs holding slots, waiting, alive: counted as they change.
    counts: counts::Counts,
    /// Backfills by id (`sources/backfill.rs`).
    backfills: BTreeMap<String, sources::backfill::BackfillEntry>,
    /// Backfills changed this turn, with the runs whose write groups carry
    /// their record (none: a group of its own).
    backfills_changed: BTreeMap<String, BTreeSet<String>>,
}

/// What the core knows of the clocks.
#[derive(Debug)]
struct Clocks {
    /// When this leader took over (UTC): slots due before were missed while
    /// no leader ran (misfire policy).
    loaded_at: DateTime<Utc>,
    /// The last reading of the clocks an input came with: a wall clock
    /// step shows as a difference between the two clocks since then.
    last_now: Option<Now>,
    /// The last forward step of the wall clock seen: the wall clock range
    /// it skipped, `(from, to]` (a slot in it was late because of it).
    last_step: Option<(DateTime<Utc>, DateTime<Utc>)>,
}

/// Counters that make ids unique in this term.
#[derive(Debug, Default)]
struct Ids {
    /// The last runner session handed out.
    session: u64,
    /// Executions created (part of each execution id).
    execution: u64,
}

/// Reports already logged or looked up, so a repeating one costs once.
#[derive(Debug, Default)]
struct Seen {
    /// (execution, runner) pairs already logged as forged.
    forgeries: HashSet<(String, String)>,
    /// (execution, runner) pairs whose late report already asked the store.
    late_reads: HashSet<(String, String)>,
}

/// Cap of the forged-report log dedupe set.
const MAX_FORGERIES_REMEMBERED: usize = 10_000;
/// Cap of the late-report read dedupe set.
const MAX_LATE_READS_REMEMBERED: usize = 10_000;

/// The leader engine's state that `/metrics` reads at each scrape.
#[derive(Debug, Clone, Default)]
pub struct EngineGauges {
    /// Runs waiting for dispatch (PENDING or RETRYING, no open attempt), per agent.
    pub pending: BTreeMap<String, u64>,
    /// Runners with an open stream.
    pub runners_connected: u64,
    /// Slots of connected runners.
    pub slots_total: u64,
    /// Of those, busy (an attempt holds them).
    pub slots_busy: u64,
    /// Tasks with a circuit breaker and its phase.
    pub breakers: Vec<(String, &'static str)>,
    /// Runs in the engine's memory (not yet final, or final and not yet written).
    pub active_runs: u64,
    /// The config's shared resources.
    pub resources: Vec<crate::views::ResourceView>,
    /// The config's budgets.
    pub budgets: Vec<crate::views::BudgetView>,
}

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
            policies: policy::Policies::default(),
            timers: Timers::default(),
            clocks: Clocks { loaded_at: DateTime::<Utc>::MIN_UTC, last_now: None, last_step: None },
            ids: Ids::default(),
            deferred: BTreeSet::new(),
            dispatch_needed: false,
            seen: Seen::default(),
            writes: WriteSet::default(),
            fx: Effects::default(),
            pending_events: HashMap::new(),
            pending_triggers: HashMap::new(),
            claims: HashMap::new(),
            routes: routes::Routes::default(),
            counts: counts::Counts::default(),
            backfills: BTreeMap::new(),
            backfills_changed: BTreeMap::new(),
        }
    }

    /// The backfills stored when this leader took over (after [`Self::load`]):
    /// each goes on from its cursor.
    pub fn restore_backfills(&mut self, now: Now, backfills: Vec<crate::model::backfill::Backfill>) {
        self.load_backfills(now, backfills);
        self.after_input(now);
    }

    /// Takes over from the store: tasks with their cursors, and the runs of
    /// the `active/` index. Attempts open at load wait
    /// [`Timing::redeclare_wait`] for their runner to re-declare them.
    pub fn load(&mut self, now: Now, tasks: Vec<(TaskRecord, Option<Cursor>)>, runs: Vec<RunRecord>) {
        self.observe(now);
        self.clocks.loaded_at = now.wall;
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

    /// The running configuration (at the start of the term, and each one
    /// replaced on SIGHUP): the policies take their parts of it.
    pub fn configure(&mut self, config: Arc<crate::config::Config>) {
        self.policies.configure(&config);
        self.dispatch_needed = true;
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
            Input::Backfill { reply, op } => {
                let r = self.backfill_op(now, op);
                self.fx.replies.push((reply, Reply::Backfill(r)));
            }
            Input::ReleaseResource { reply, resource } => self.release_resource(now, reply, &resource),
            Input::Events { reply, events } => self.events(now, reply, events),
            Input::EventsLoaded { reply, found } => self.events_loaded(now, reply, found),
            Input::RunLoaded { run_id, run, purpose } => self.on_run_loaded(now, &run_id, run.map(|r| *r), purpose),
        }
        self.after_input(now);
    }

    /// When [`EngineCore::handle_timeout`] should next be called, on the
    /// monotonic clock: wall clock timers are converted with the reading
    /// `now` (the shell sleeps at most 30 s at a time, so a wall clock step
    /// is seen within that).
    pub fn poll_timeout(&self, now: Now) -> Option<Mono> {
        self.timers.next(now)
    }

    /// Fires due timers until `max` is spent; returns whether more are due
    /// (the shell then serves other inputs before coming back, so a burst
    /// of timers never starves runner messages). A timer spends the run
    /// writes it adds to the turn, at least one: a turn of catch-up fires
    /// (up to [`MAX_RUNS_PER_FIRE`] runs each) stops at about `max` runs,
    /// not `max` x 50, so the engine is held no longer than by a turn of
    /// one-run slots. (Turns taken while a commit is in flight still add
    /// up in the next commit.)
    pub fn handle_timeout(&mut self, now: Now, max: usize) -> bool {
        self.observe(now);
        let mut spent = 0;
        while spent < max {
            let Some(timer) = self.timers.pop_due(now) else { break };
            let writes = self.writes.runs();
            match timer {
                Timer::Deadline { run_id, execution_id } => self.on_deadline(now, &run_id, &execution_id),
                Timer::StartBy { run_id } => self.on_start_by(now, &run_id),
                Timer::Fire { task_id, generation } => self.on_fire(now, &task_id, generation),
                Timer::RunDue { run_id, at } => self.on_run_due(now, &run_id, at),
                Timer::ReleaseOrphan { run_id, execution_id } => self.release_orphan(now, &run_id, &execution_id),
                Timer::RunnerCheck => self.on_runner_check(now),
                Timer::Flush => {
                    self.timers.flush_armed = false;
                    self.writes.request_flush();
                }
                Timer::Wake => self.dispatch_needed = true,
                Timer::BackfillStep { id } => self.backfill_step(now, &id),
            }
            spent += self.writes.runs().saturating_sub(writes).max(1);
        }
        self.after_input(now);
        self.poll_timeout(now).is_some_and(|at| at <= now.mono)
    }

    /// Writes everything persisted lazily with the next effects (a graceful
    /// stop).
    pub fn flush(&mut self) {
        self.writes.request_flush();
    }

    /// Drains the effects decided so far. See [`Effects`] for the order the
    /// shell performs them in.
    pub fn poll_effects(&mut self) -> Effects {
        self.flush_backfills();
        let (groups, written) = self.writes.drain(&self.runs);
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
    pub fn runner_views(&self) -> Vec<RunnerView> {
        let mut v: Vec<RunnerView> = self
            .registry
            .iter()
            .map(|r| {
                let mut agents: Vec<String> = r.agents.iter().cloned().collect();
                agents.sort();
                let mut running: Vec<String> = r.running.values().cloned().collect();
                running.sort();
                RunnerView {
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
                    draining: r.draining,
                }
            })
            .collect();
        v.sort_by(|a, b| a.runner_id.cmp(&b.runner_id));
        v
    }

    /// What `/metrics` reports of this leader's state: pending runs per
    /// agent, connected runners and their slots, breakers.
    pub fn gauges(&self, now: DateTime<Utc>) -> EngineGauges {
        let views = self.policy_views(now);
        let mut g =
            EngineGauges { active_runs: self.runs.len() as u64, resources: views.resources, budgets: views.budgets, ..Default::default() };
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

    /// Each policy's state at `now`: every resource of the running config
    /// (in use, waiting, what its rates allow now, held back until when),
    /// every budget's current window (spend and reservations).
    pub fn policy_views(&self, now: DateTime<Utc>) -> crate::views::PolicyViews {
        self.policies.snapshot(now)
    }

    /// The tasks that follow `task_id` (`after` triggers), by id.
    pub fn followers_of(&self, task_id: &str) -> Vec<String> {
        self.policies.dependencies.followers_of(task_id).into_iter().map(|(t, _)| t).collect()
    }

    /// The tasks (not deleted) with an event trigger on `topic`, by id.
    pub fn topic_tasks(&self, topic: &str) -> Vec<String> {
        self.routes.topic(topic).into_iter().filter(|id| self.tasks.get(id).is_some_and(|e| !e.deleted)).collect()
    }

    /// A task's runs waiting for dispatch (PENDING, RETRYING).
    pub fn waiting(&self, task_id: &str) -> u64 {
        self.waiting_runs(task_id)
    }

    /// Takes the resources' hold-backs from the store (after the config).
    pub fn load_holds(&mut self, now: DateTime<Utc>, holds: Vec<(String, crate::model::run::HoldBack)>) {
        self.policies.resources.load_holds(holds, now);
    }

    /// `ReleaseResource`: ends the resource's hold-back now; its stored
    /// record is deleted in a write of its own, and the answer follows
    /// the commit.
    fn release_resource(&mut self, now: Now, reply: ReplyId, resource: &str) {
        let r = self.policies.resources.release_hold(resource, now.wall).map(|_| {
            self.writes.alone(vec![StoreOp::DeleteHoldBack { resource: resource.to_string() }]);
            self.dispatch_needed = true;
            self.policies.resources.views(now.wall).into_iter().find(|s| s.name == resource)
        });
        let r = r.and_then(|s| s.ok_or_else(|| crate::error::Error::NotFound { kind: "resource", id: resource.to_string() }));
        self.fx.replies.push((reply, Reply::ReleaseResource(r)));
    }

    /// Takes the budgets' ledger from the store (before [`EngineCore::load`]).
    pub fn load_ledgers(&mut self, windows: Vec<crate::repo::budgets::LedgerWindow>) {
        self.policies.budgets.load(windows);
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

    /// Notes the clocks an input came with: a wall clock that moved more
    /// than 2 s further than elapsed time since the last input was stepped
    /// (NTP, an operator, a VM resumed); slots it skipped are late because
    /// of it, and the misfire log says so.
    fn observe(&mut self, now: Now) {
        if let Some(prev) = self.clocks.last_now {
            let step = now.wall_step_since(prev);
            if step > WALL_STEP {
                tracing::warn!(step_ms = step.num_milliseconds(), from = %prev.wall, to = %now.wall, "the wall clock stepped forward: slots it skipped are misfires");
                self.clocks.last_step = Some((now.wall - step, now.wall));
            } else if step < -WALL_STEP {
                tracing::warn!(step_ms = step.num_milliseconds(), from = %prev.wall, to = %now.wall, "the wall clock stepped back: slots already handled do not run again");
            }
        }
        self.clocks.last_now = Some(now);
    }

    fn timing(&self) -> &Timing {
        &self.cfg.timing
    }

    fn dur(d: std::time::Duration) -> chrono::Duration {
        chrono::Duration::from_std(d).unwrap_or(chrono::Duration::MAX)
    }

    /// Marks a run changed: stamps it, queues its write, and tells the
    /// policies (a resource permit follows its attempts' agents).
    fn touch(&mut self, now: Now, run_id: &str, urgency: Urgency) {
        let token = self.cfg.token;
        let Some(run) = self.runs.get_mut(run_id) else { return };
        run.updated_at = now.wall;
        run.fencing_token = token;
        self.policies.run_changed(run);
        self.counts.update(run);
        let backfill = run.backfill_id.is_some() && run.status.is_terminal();
        self.writes.changed(run_id, urgency);
        if backfill {
            self.backfill_run_changed(now, run_id);
        }
    }

    /// Asks for a lazy flush within `timing.progress_flush`.
    fn arm_flush(&mut self, now: Now) {
        if !self.timers.flush_armed {
            self.timers.flush_armed = true;
            self.timers.push_mono(now.mono.after(Self::dur(PROGRESS_FLUSH)), Timer::Flush);
        }
    }

    /// Adds a run to memory (new, or loaded).
    fn remember_run(&mut self, run: RunRecord) {
        self.policies.run_changed(&run);
        self.counts.update(&run);
        self.by_task.entry(run.task_id.clone()).or_default().insert(run.run_id.clone());
        self.runs.insert(run.run_id.clone(), run);
    }

    fn forget_run(&mut self, run_id: &str) {
        self.timers.start_by.remove(&run_id.to_string());
        if let Some(run) = self.runs.remove(run_id) {
            self.policies.run_forgotten(&run);
            self.counts.remove(&run);
            if let Some(set) = self.by_task.get_mut(&run.task_id) {
                set.remove(run_id);
                if set.is_empty() {
                    self.by_task.remove(&run.task_id);
                }
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
        if self.seen.forgeries.len() >= MAX_FORGERIES_REMEMBERED {
            self.seen.forgeries.clear();
        }
        if self.seen.forgeries.insert((execution_id.to_string(), reporter.to_string())) {
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
