//! The leader's engine: a sans-IO decision core ([`core::EngineCore`])
//! driven by a thin async shell (`shell.rs`).
//!
//! The engine starts when this replica becomes leader and stops when it is
//! not. The shell feeds the core task changes (a store watch), runner
//! messages and API commands (through an [`EngineHandle`]) and timers, and
//! performs what the core decides: store writes first (fenced, grouped into
//! as few transactions as the store allows), then messages to runners,
//! lifecycle events ([`lifecycle`]) and replies. Runner messages use the
//! engine's own types ([`protocol`]); `service/runner.rs` converts the wire.
//!
//! Where things go:
//! - a new trigger kind: `model::run::TriggerKind`, `schedule/` (its
//!   next-fire), and `core/sources/generator.rs` only if it fires differently;
//! - a new lifecycle subscriber: subscribe to [`crate::api::Core::lifecycle`]
//!   (a [`lifecycle::LifecycleBus`]) — no change here;
//! - a new store: `store/` (a `KvStore` impl) — the engine never sees it.

pub mod archive;
pub mod core;
pub mod lifecycle;
pub mod protocol;
pub mod retention;
mod shell;

use chrono::{DateTime, Utc};
use tokio::sync::{mpsc, oneshot};

pub use self::core::{MAX_DELAY_SECONDS, MAX_RUNS_PER_FIRE};
pub use shell::{Engine, EngineConfig, EngineExit, MAX_TIMERS_PER_TURN};

use crate::error::{Error, Result};
use crate::model::RunRecord;
use protocol::{FromRunner, RunnerHello, ToRunner};

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
    /// How long an explicit key finds its run (`None`: 24 h): a dedup key
    /// is written with the run, and afterwards the key makes a new run.
    pub idempotency_window: Option<chrono::Duration>,
    /// The caller's trace context: the run joins that trace, under that span.
    pub caller_trace: Option<CallerTrace>,
    /// The caller's W3C `baggage` (empty = none), given to the agent.
    pub baggage: String,
}

/// An event for one task, from any source (a webhook's request, a queue's
/// message, a published event): it enters through the same admission as a
/// slot, and its run id derives from its id (`model::event`), so the same
/// event never makes a second run.
#[derive(Debug, Clone)]
pub struct EventRequest {
    /// Task.
    pub task_id: String,
    /// Its run (`event_run_id`, `published_run_id`).
    pub run_id: String,
    /// What the agent gets as `context.event` (the body in it when at
    /// most `EVENT_INLINE_BYTES`).
    pub info: crate::model::event::EventInfo,
    /// A larger body: stored beside the run, in the same transaction.
    pub stored_body: Option<std::sync::Arc<Vec<u8>>>,
    /// Added to the task's priority (AMQP message priority), within bounds.
    pub priority: i32,
    /// The trigger cannot take it: recorded SKIPPED `invalid_event` with
    /// this reason.
    pub invalid: Option<String>,
    /// How long its id deduplicates (a webhook's `dedup.ttl`, a queue
    /// trigger's `dedup.ttl`, a published event's `idempotency_ttl`; 24 h
    /// by default): a dedup key `dedup/{run_id}` is written with the run,
    /// and once the window ends the same id makes a new run. `None` (only
    /// the core's unit tests): the id deduplicates as long as its run is
    /// kept.
    pub dedup_window: Option<chrono::Duration>,
    /// A re-run (`runs rerun`): the input of the run it re-runs, which the
    /// new run gets instead of the task's and the event's own; its run id
    /// (`{of}.rerun-{n}`) makes it create-if-absent like an event's.
    pub rerun: Option<Box<Rerun>>,
}

/// What a re-run carries over from the run it re-runs.
#[derive(Debug, Clone)]
pub struct Rerun {
    /// The run re-run.
    pub of: String,
    /// Its params, as it had them.
    pub params: serde_json::Map<String, serde_json::Value>,
    /// Its event (`context.event`), if an event started it.
    pub event: Option<crate::model::event::EventInfo>,
    /// The run it followed (`context.upstream`), if any.
    pub upstream: Option<crate::model::event::Upstream>,
}

impl EventRequest {
    /// The request of a re-run of `run` under `run_id`: a manual run with
    /// `run`'s params, event (its stored body, `body`, stored again beside
    /// the new run) and upstream, and `rerun_of`.
    pub fn rerun(run: &crate::model::RunRecord, run_id: String, body: Option<Vec<u8>>, now: chrono::DateTime<chrono::Utc>) -> EventRequest {
        use crate::model::event::{BodyEncoding, EventInfo};
        use crate::model::run::TriggerKind;
        let info = EventInfo {
            source: TriggerKind::Manual,
            name: "rerun".into(),
            key: run.run_id.clone(),
            received_at: now,
            headers: Default::default(),
            attributes: Default::default(),
            body: None,
            body_encoding: BodyEncoding::Json,
            body_bytes: 0,
            body_stored: false,
        };
        EventRequest {
            task_id: run.task_id.clone(),
            run_id,
            info,
            stored_body: body.map(std::sync::Arc::new),
            priority: 0,
            invalid: None,
            dedup_window: None,
            rerun: Some(Box::new(Rerun {
                of: run.run_id.clone(),
                params: run.params.clone(),
                event: run.event.clone(),
                upstream: run.upstream.clone(),
            })),
        }
    }
}

/// What became of one [`EventRequest`], once committed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventAdmitted {
    /// Its run (or SKIPPED record).
    pub run_id: String,
    /// False: its id had made this run already (a duplicate).
    pub created: bool,
    /// It was recorded SKIPPED, for this reason.
    pub skipped: Option<crate::model::run::SkipReason>,
    /// The task's runs waiting for dispatch (PENDING, RETRYING) after it.
    pub waiting: u64,
}

/// The trace context of a `TriggerTask` caller (W3C Trace Context).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CallerTrace {
    /// Trace id, 32 hex digits.
    pub trace_id: String,
    /// The caller's span, 16 hex digits: the run's span is its child.
    pub span_id: String,
    /// The caller's `tracestate` (empty = none).
    pub trace_state: String,
}

/// Requests to the engine's shell.
#[derive(Debug)]
pub(crate) enum Command {
    RunnerHello {
        hello: RunnerHello,
        tx: mpsc::Sender<ToRunner>,
        kill: oneshot::Sender<()>,
        reply: oneshot::Sender<Result<u64>>,
    },
    RunnerMessage {
        runner_id: String,
        session: u64,
        received_at: crate::clock::Now,
        msg: FromRunner,
    },
    RunnerGone {
        runner_id: String,
        session: u64,
    },
    Trigger {
        req: TriggerRequest,
        reply: oneshot::Sender<Result<self::core::Triggered>>,
    },
    CancelRun {
        run_id: String,
        reason: String,
        reply: oneshot::Sender<Result<RunRecord>>,
    },
    ResetBreaker {
        task_id: String,
        reply: oneshot::Sender<Result<crate::model::breaker::Breaker>>,
    },
    Backfill {
        op: core::sources::backfill::BackfillOp,
        reply: oneshot::Sender<Result<crate::model::backfill::Backfill>>,
    },
    ReleaseResource {
        resource: String,
        reply: oneshot::Sender<Result<crate::views::ResourceView>>,
    },
    Events {
        events: Vec<EventRequest>,
        reply: oneshot::Sender<Vec<Result<EventAdmitted>>>,
    },
    /// A read of the core's state (see [`EngineHandle::query`]).
    Query(Query),
    Stop {
        reply: oneshot::Sender<()>,
    },
}

/// A read of the core with the wall clock's now (UTC).
type Read = Box<dyn FnOnce(&core::EngineCore, DateTime<Utc>) + Send>;

/// A read of the core, run in the engine's turn with the wall clock's now.
pub(crate) struct Query(Read);

impl Query {
    /// Runs the read.
    pub(crate) fn answer(self, core: &core::EngineCore, now: DateTime<Utc>) {
        (self.0)(core, now)
    }
}

impl std::fmt::Debug for Query {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Query")
    }
}

/// Cheap handle for talking to a running engine.
#[derive(Debug, Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Command>,
    leadership: crate::election::Leadership,
}

/// A handle that does not keep the engine alive (its workers hold one):
/// [`WeakEngineHandle::upgrade`] fails once the engine is gone.
#[derive(Debug, Clone)]
pub struct WeakEngineHandle {
    tx: mpsc::WeakSender<Command>,
    leadership: crate::election::Leadership,
}

impl WeakEngineHandle {
    /// The handle, while the engine runs.
    pub fn upgrade(&self) -> Option<EngineHandle> {
        self.tx.upgrade().map(|tx| EngineHandle { tx, leadership: self.leadership.clone() })
    }
}

fn gone() -> Error {
    Error::Unavailable { reason: "leadership changed; the engine stopped".into(), leader: None }
}

impl EngineHandle {
    /// The leadership (fencing token and fence) the engine runs under:
    /// writes made on its behalf outside the engine (`ApplyTasks`) carry
    /// the same fence.
    pub fn leadership(&self) -> &crate::election::Leadership {
        &self.leadership
    }

    async fn send(&self, cmd: Command) -> Result<()> {
        self.tx.send(cmd).await.map_err(|_| gone())
    }

    async fn ask<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> Command) -> Result<T> {
        let (tx, rx) = oneshot::channel();
        self.send(make(tx)).await?;
        rx.await.map_err(|_| gone())
    }

    /// Reads the core's state in the engine's turn, between two inputs:
    /// `read` gets the core and the wall clock's now (UTC) and its answer
    /// comes back. The one door for views of the leader's live state
    /// (runners, resources, budgets, active runs, gauges): a new view is a
    /// core method read here, not a command of its own. `read` must be
    /// quick: the engine waits for it.
    ///
    /// Errors: `Unavailable` when the engine stopped.
    pub async fn query<T: Send + 'static>(&self, read: impl FnOnce(&core::EngineCore, DateTime<Utc>) -> T + Send + 'static) -> Result<T> {
        self.ask(|reply| {
            Command::Query(Query(Box::new(move |c, now| {
                let _ = reply.send(read(c, now));
            })))
        })
        .await
    }

    /// A handle that does not keep the engine alive.
    pub fn downgrade(&self) -> WeakEngineHandle {
        WeakEngineHandle { tx: self.tx.downgrade(), leadership: self.leadership.clone() }
    }

    /// Registers a runner stream; returns its session number. Messages for
    /// the runner go to `tx`, which is never awaited on: a runner whose
    /// stream does not drain is disconnected. Dropping `kill`'s receiver
    /// side is how the engine tells the stream's reader to stop.
    pub async fn runner_hello(&self, hello: RunnerHello, tx: mpsc::Sender<ToRunner>, kill: oneshot::Sender<()>) -> Result<u64> {
        self.ask(|reply| Command::RunnerHello { hello, tx, kill, reply }).await?
    }

    /// A message on a runner's stream, stamped with its arrival time (UTC).
    /// Waits while the engine's queue is full (backpressure on the stream).
    pub async fn runner_message(&self, runner_id: String, session: u64, received_at: crate::clock::Now, msg: FromRunner) -> Result<()> {
        self.send(Command::RunnerMessage { runner_id, session, received_at, msg }).await
    }

    /// A runner's stream ended.
    pub async fn runner_gone(&self, runner_id: String, session: u64) {
        let _ = self.send(Command::RunnerGone { runner_id, session }).await;
    }

    /// Manual trigger: the run's id, its earliest start, and whether it was created.
    pub async fn trigger(&self, req: TriggerRequest) -> Result<self::core::Triggered> {
        self.ask(|reply| Command::Trigger { req, reply }).await?
    }

    /// Cancels a run; returns it as stored.
    pub async fn cancel_run(&self, run_id: String, reason: String) -> Result<RunRecord> {
        self.ask(|reply| Command::CancelRun { run_id, reason, reply }).await?
    }

    /// Closes a task's circuit breaker by hand; returns it as stored.
    ///
    /// Errors: `NotFound` (no such task), `FailedPrecondition` (the task
    /// has no `execution.circuit_breaker`).
    pub async fn reset_breaker(&self, task_id: String) -> Result<crate::model::breaker::Breaker> {
        self.ask(|reply| Command::ResetBreaker { task_id, reply }).await?
    }

    /// Creates, pauses, resumes or cancels a backfill; returns it once the
    /// change is committed.
    ///
    /// Errors: `NotFound` (no such backfill or task), `FailedPrecondition`
    /// (it has finished; an id taken).
    pub async fn backfill(&self, op: core::sources::backfill::BackfillOp) -> Result<crate::model::backfill::Backfill> {
        self.ask(|reply| Command::Backfill { op, reply }).await?
    }

    /// Ends a resource's hold-back by hand; returns the resource once the
    /// hold's deletion is committed.
    ///
    /// Errors: `NotFound` (no such resource in the config).
    pub async fn release_resource(&self, resource: String) -> Result<crate::views::ResourceView> {
        self.ask(|reply| Command::ReleaseResource { resource, reply }).await?
    }

    /// The engine's state for `/metrics`.
    pub async fn gauges(&self) -> Result<core::EngineGauges> {
        self.query(|c, now| c.gauges(now)).await
    }

    /// The tasks with an event trigger on `topic` (not deleted), by id.
    pub async fn topic_tasks(&self, topic: String) -> Result<Vec<String>> {
        self.query(move |c, _| c.topic_tasks(&topic)).await
    }

    /// Admits a batch of events: answers, in order, once every record they
    /// made is committed (an error for an event whose task is gone).
    pub async fn events(&self, events: Vec<EventRequest>) -> Result<Vec<Result<EventAdmitted>>> {
        self.ask(|reply| Command::Events { events, reply }).await
    }

    /// The task and trigger a webhook path belongs to, if any.
    pub async fn webhook(&self, path: String) -> Result<Option<(String, crate::model::trigger::WebhookTrigger)>> {
        self.query(move |c, _| c.webhook(&path)).await
    }

    /// The task's runs waiting for dispatch (PENDING, RETRYING).
    pub async fn waiting(&self, task_id: String) -> Result<u64> {
        self.query(move |c, _| c.waiting(&task_id)).await
    }

    /// A run as the leader knows it now, if it is active (its memory may be
    /// ahead of the store for lazily written changes: start, progress).
    pub async fn active_run(&self, run_id: String) -> Result<Option<RunRecord>> {
        self.query(move |c, _| c.active_run(&run_id)).await
    }

    /// The runs in the leader's memory (all, or of one task), as it knows
    /// them now.
    pub async fn active_runs(&self, task_id: String) -> Result<Vec<RunRecord>> {
        self.query(move |c, _| c.active_runs(&task_id)).await
    }

    /// Those of `run_ids` in the leader's memory, as it knows them now.
    pub async fn active_runs_among(&self, run_ids: Vec<String>) -> Result<Vec<RunRecord>> {
        self.query(move |c, _| run_ids.iter().filter_map(|id| c.active_run(id)).collect()).await
    }

    /// Whether a connected runner serves `agent_id` with the labels of `selector`.
    pub async fn serves_agent(&self, agent_id: String, selector: std::collections::BTreeMap<String, String>) -> Result<bool> {
        self.query(move |c, _| c.serves_agent(&agent_id, &selector)).await
    }

    /// Writes what is persisted lazily, then stops the engine (a graceful
    /// handover). Returns when it stopped.
    pub async fn stop(&self) {
        let _ = self.ask(|reply| Command::Stop { reply }).await;
    }
}
