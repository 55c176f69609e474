//! Lifecycle events: what happened to runs, runners and leadership, in the
//! order it happened. The engine's shell publishes them on a broadcast
//! [`LifecycleBus`] once the writes they describe have committed (events of
//! changes that are persisted lazily — a run started, progress — are
//! published when decided). `WatchRuns` subscribes; so will metrics,
//! traces, notifications and breakers: none of them is called from the
//! decision code.

use std::sync::Arc;

use chrono::{DateTime, Utc};
use tokio::sync::broadcast;

use crate::model::RunRecord;
use crate::model::run::{Outcome, SkipReason};

/// Events kept for slow subscribers; one that falls further behind gets
/// `Lagged` and should re-read what it needs from the store.
pub const BUS_CAPACITY: usize = 16_384;

/// The broadcast channel of [`Lifecycle`] events of one replica.
pub type LifecycleBus = broadcast::Sender<Lifecycle>;

/// A new bus.
pub fn bus() -> LifecycleBus {
    broadcast::channel(BUS_CAPACITY).0
}

/// Something that happened. Run events carry the run as it is after the
/// change (shared, not copied per subscriber).
#[derive(Debug, Clone)]
pub enum Lifecycle {
    /// This replica became leader with this fencing token (its engine runs).
    LeadershipGained {
        /// Fencing token.
        token: u64,
    },
    /// This replica's term ended (step-down, fenced, shutdown).
    LeadershipLost {
        /// Fencing token of the term that ended.
        token: u64,
    },
    /// A run record was created (PENDING, or delayed).
    RunCreated(Arc<RunRecord>),
    /// A slot (or a coalesced range of slots) got a SKIPPED record.
    SlotSkipped {
        /// The record.
        run: Arc<RunRecord>,
        /// Why.
        reason: SkipReason,
        /// How many slots it covers.
        count: u64,
        /// First slot covered (UTC).
        from: DateTime<Utc>,
        /// Last slot covered (UTC).
        until: DateTime<Utc>,
    },
    /// An attempt was assigned to a runner.
    RunDispatched {
        /// The run.
        run: Arc<RunRecord>,
        /// Runner.
        runner_id: String,
        /// New execution id.
        execution_id: String,
        /// Attempt number.
        attempt: u32,
    },
    /// The runner started the agent.
    RunStarted(Arc<RunRecord>),
    /// The agent reported progress.
    RunProgress(Arc<RunRecord>),
    /// An attempt ended; the run goes on (retry, re-dispatch) or finishes.
    AttemptEnded {
        /// The run.
        run: Arc<RunRecord>,
        /// Execution.
        execution_id: String,
        /// How it ended.
        outcome: Outcome,
    },
    /// The run reached a terminal status (SUCCEEDED, FAILED, TIMEOUT, CANCELLED).
    RunFinished(Arc<RunRecord>),
    /// A run record changed in another way (pending reason, evidence of a
    /// late report, an agent confirmed gone), or — on a replica that does
    /// not lead — any stored change seen through the store.
    RunUpdated(Arc<RunRecord>),
    /// A runner said Hello.
    RunnerJoined {
        /// Runner.
        runner_id: String,
        /// Agents it serves.
        agents: Vec<String>,
        /// Its slots.
        slots: u32,
    },
    /// A runner was silent past its fence deadline: its attempts ended lost.
    RunnerLost {
        /// Runner.
        runner_id: String,
    },
    /// A task's circuit breaker changed (counted a failure, opened, went
    /// half-open, closed, was reset).
    BreakerChanged {
        /// Task.
        task_id: String,
        /// The breaker as stored.
        breaker: crate::model::breaker::Breaker,
        /// This change is a new opening (`notify.on_breaker_open` fires
        /// once per opening).
        opened: bool,
    },
    /// An event (webhook request, queue message, published event) was
    /// admitted: it made a record, or found the one its id had made.
    EventAdmitted {
        /// `webhook`, `queue` or `event`.
        source: crate::model::run::TriggerKind,
        /// `created`, `deduplicated`, or `skipped` (recorded SKIPPED).
        result: &'static str,
    },
    /// A run that waited for a shared resource was dispatched.
    ResourceWaited {
        /// The resource (a name of the config's `resources:`).
        resource: String,
        /// How long it waited (seconds).
        seconds: f64,
    },
}

impl Lifecycle {
    /// The run this event is about, if any.
    pub fn run(&self) -> Option<&Arc<RunRecord>> {
        match self {
            Lifecycle::RunCreated(r)
            | Lifecycle::RunStarted(r)
            | Lifecycle::RunProgress(r)
            | Lifecycle::RunFinished(r)
            | Lifecycle::RunUpdated(r)
            | Lifecycle::SlotSkipped { run: r, .. }
            | Lifecycle::RunDispatched { run: r, .. }
            | Lifecycle::AttemptEnded { run: r, .. } => Some(r),
            _ => None,
        }
    }
}
