//! Admission as a chain of policies (STYLE.md item 19; the models are
//! quinn-proto's `congestion::Controller` and GreptimeDB meta-srv's
//! heartbeat handler chain). At each decision point the core asks the
//! registered policies in order; each answers with a decision and the
//! state it wants written, and the first that does not pass decides:
//!
//! | decision point | asked | answers |
//! |---|---|---|
//! | a run asks to be created (slot, trigger, event, follower, backfill, re-run: `admission.rs`) | [`Policy::admit`] | pass, admit waiting (a reason), skip (a reason) |
//! | it was created | [`Policy::created`] | — (the policy commits what it reserved) |
//! | a ready run asks to be dispatched | [`Policy::dispatch`] | pass, wait (a reason, until when), skip (a reason; only a run that never had an attempt) |
//! | it was dispatched | [`Policy::dispatched`] | — (the policy takes what it needs: resource holds, budget charges) |
//! | an attempt ended | [`Policy::attempt_ended`] | pass, retry at (counted against `max_retries` or not), fail; and state to write with the attempt (a resource's hold-back) |
//! | a run ended | [`Policy::finished`] | — (the state to write with the run) |
//!
//! Each policy is a file of its own with its state and its unit tests,
//! none needs a runtime: `paused.rs` (what each run source's request gets
//! while its task is paused), `overlap.rs` (concurrency limit and overlap
//! policy), `breaker.rs` (circuit breaker), `retry.rs` (retries, backoff
//! and the agent's outcome contract), `resources.rs` (cluster-wide
//! concurrency, request and token rates, hold-backs), `budgets.rs` (spend
//! limits over windows, reserved at admission, settled with the run),
//! `dependencies.rs` (tasks that follow tasks: a run's end starts its
//! followers' runs). Adding one touches
//! its file and [`Policies`].

pub mod breaker;
pub mod budgets;
pub mod dependencies;
pub mod overlap;
pub mod paused;
pub mod resources;
pub mod retry;

use chrono::{DateTime, Utc};

use crate::config::Config;
use crate::model::breaker::Breaker;
use crate::model::run::{Outcome, ResourceHold, SkipReason};
use crate::model::task::TaskSpec;
use crate::model::{RunRecord, RunStatus};
use crate::repo::StoreOp;
use crate::views::PolicyViews;

/// A run that holds a slot of its task (for the overlap policy).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActiveRun {
    /// Its slot.
    pub scheduled_at: DateTime<Utc>,
    /// Its id.
    pub run_id: String,
    /// Ended, but its agent may still be alive (it cannot be cancelled again).
    pub terminal: bool,
}

/// A run asking to be created.
#[derive(Debug)]
pub struct AdmitQuery<'a> {
    /// Now (wall clock).
    pub now: DateTime<Utc>,
    /// The run, not yet created.
    pub run: &'a RunRecord,
    /// Its task.
    pub task: &'a TaskSpec,
    /// The task is paused (see [`paused`]).
    pub paused: bool,
    /// How many of the task's runs hold a slot (a `run_all` catch-up's
    /// own runs left out).
    pub active: usize,
    /// Those runs, listed only when the task's overlap policy is
    /// `cancel_running` (the only one that picks among them); else empty.
    pub active_runs: &'a [ActiveRun],
    /// The task's circuit breaker state, if it has any.
    pub breaker: Option<&'a Breaker>,
}

/// What a policy says about a run asking to be created.
#[derive(Debug, Clone, PartialEq)]
pub enum Admit {
    /// No objection.
    Pass,
    /// Admit it; it will wait for this reason (`pending_reason`).
    Waiting(String),
    /// Admit it after these runs are cancelled for it (`cancel_running`).
    AfterCancelling {
        /// The runs to cancel.
        cancel: Vec<String>,
        /// The reason they are cancelled.
        reason: String,
        /// The new run's pending reason meanwhile.
        waiting: String,
    },
    /// Do not create it: a SKIPPED record.
    Skip {
        /// Why, as a reason code.
        reason: SkipReason,
        /// Why, in words (the record's error).
        why: String,
    },
    /// Do not create it (a SKIPPED record), and pause its task.
    SkipAndPause {
        /// Why, as a reason code.
        reason: SkipReason,
        /// Why, in words.
        why: String,
    },
}

/// A ready run asking to be dispatched.
#[derive(Debug)]
pub struct DispatchQuery<'a> {
    /// Now (wall clock).
    pub now: DateTime<Utc>,
    /// The run.
    pub run: &'a RunRecord,
    /// Its task.
    pub task: &'a TaskSpec,
    /// Agents of the task alive or not confirmed gone.
    pub live_agents: usize,
}

/// What a policy says about dispatching a run now.
#[derive(Debug, Clone, PartialEq)]
pub enum Dispatch {
    /// No objection.
    Pass,
    /// Not now: the run waits, saying why (`waiting_for`), until something
    /// changes or `until` (a wall clock instant) comes.
    Wait {
        /// Why (shown as the run's `pending_reason`).
        reason: String,
        /// When it may go at the earliest, if known.
        until: Option<DateTime<Utc>>,
    },
    /// Never: the run ends SKIPPED for this reason. Only for a run that
    /// had no attempt yet (a `skip` task whose resource turned out busy
    /// when it could go; a run admitted before its budget could estimate
    /// it, which turned out not to fit). The core turns any other run's
    /// skip into a wait.
    Skip {
        /// Why, as a reason code.
        reason: SkipReason,
        /// Why, in words (the record's error).
        why: String,
    },
}

/// What the agent said about an attempt in its result (the outcome
/// contract, README "Writing an agent"), when it said anything.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AgentOutcome {
    /// `outcome`.
    pub kind: Option<AgentOutcomeKind>,
    /// `retry_at`, or now + `retry_after_seconds`.
    pub retry_at: Option<DateTime<Utc>>,
    /// `resource`: the shared resource that answered so.
    pub resource: Option<String>,
    /// `class`: free text (`invalid_input`), at most 64 characters.
    pub class: Option<String>,
}

/// The agent's `outcome`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AgentOutcomeKind {
    /// It worked.
    Success,
    /// It failed (retried as exit codes are).
    Failure,
    /// It failed and no retry can help: the run FAILS now.
    NonRetryable,
    /// A provider said "too many requests": retry after `retry_at`
    /// without spending an attempt; the resource is held back meanwhile.
    RateLimited,
    /// A quota ran out: FAILED, not retried; the resource is held back.
    QuotaExhausted,
}

/// An attempt that ended.
#[derive(Debug)]
pub struct AttemptQuery<'a> {
    /// Now (wall clock).
    pub now: DateTime<Utc>,
    /// The run, the attempt ended in it.
    pub run: &'a RunRecord,
    /// Its task (`None`: deleted meanwhile).
    pub task: Option<&'a TaskSpec>,
    /// How the attempt ended.
    pub outcome: Outcome,
    /// What the agent said of it, if anything.
    pub agent: &'a AgentOutcome,
    /// The error text of the attempt.
    pub error: Option<&'a str>,
}

/// What a policy says after an attempt ended.
#[derive(Debug, Clone, PartialEq)]
pub enum AfterAttempt {
    /// No objection (the next policy decides; the last, retry, always does).
    Pass,
    /// Dispatch it again at `at`; `counted`: the attempt spent one of
    /// `max_retries`.
    RetryAt {
        /// When.
        at: DateTime<Utc>,
        /// Whether it counts against `max_retries`.
        counted: bool,
    },
    /// Dispatch it again now, free (an interruption).
    Requeue,
    /// The run ends with this status and error.
    Finish {
        /// Terminal status.
        status: RunStatus,
        /// Why (empty: the attempt's error stands).
        why: String,
    },
}

/// A run that reached a terminal status.
#[derive(Debug)]
pub struct FinishQuery<'a> {
    /// Now (wall clock).
    pub now: DateTime<Utc>,
    /// The run, terminal.
    pub run: &'a RunRecord,
    /// Its task (`None`: deleted meanwhile).
    pub task: Option<&'a TaskSpec>,
    /// Its task's breaker, if any.
    pub breaker: Option<&'a Breaker>,
}

/// State a policy wants written, and where.
#[derive(Debug, Clone, PartialEq)]
pub enum Write {
    /// The task's breaker, in its cursor, in the task's group.
    Breaker {
        /// Task.
        task_id: String,
        /// The breaker as it is now.
        breaker: Breaker,
        /// It opened (an `on_breaker_open` notification goes with it).
        opened: bool,
    },
    /// A store operation in the group of the run that caused it (a ledger
    /// entry it settles).
    Op(StoreOp),
    /// What the new run is charged against budgets (from
    /// [`Policy::created`]: it goes on the run record, created with it; from
    /// [`Policy::dispatched`]: they replace the run's charges of the same
    /// budgets, estimated now).
    Charges(Vec<crate::model::budget::BudgetCharge>),
    /// What the dispatched attempt holds of the cluster's resources while
    /// its agent lives (from [`Policy::dispatched`]: on the attempt).
    Holds(Vec<ResourceHold>),
    /// A task follows the run that ended (`after`): its run — or, with
    /// `unmet`, its SKIPPED `upstream_unmet` record — is created in the
    /// ended run's group.
    Follow {
        /// The following task.
        task_id: String,
        /// What its run carries of the ended one.
        upstream: crate::model::event::Upstream,
        /// Why it does not run, if it does not.
        unmet: Option<String>,
    },
    /// The task is to be paused (its definition is written by the shell,
    /// as a user's pause is).
    PauseTask {
        /// Task.
        task_id: String,
        /// Why.
        why: String,
    },
}

/// One policy. Every method has a default that passes, so a policy only
/// says what it cares about.
pub trait Policy {
    /// Its name (logs, `waiting_for`).
    fn name(&self) -> &'static str;
    /// The configuration changed (or the term began).
    fn configure(&mut self, _config: &Config) {}
    /// A run in memory changed, or was loaded: the policy's state derived
    /// from runs (permits held by live agents) follows.
    fn run_changed(&mut self, _run: &RunRecord) {}
    /// A run left memory.
    fn run_forgotten(&mut self, _run: &RunRecord) {}
    /// A task was created or changed (`Some`), or deleted (`None`).
    fn task_changed(&mut self, _task_id: &str, _spec: Option<&TaskSpec>) {}
    /// A run asks to be created.
    fn admit(&mut self, _q: &AdmitQuery<'_>) -> Admit {
        Admit::Pass
    }
    /// The run was created (every policy admitted it): what it reserved is
    /// taken.
    fn created(&mut self, _q: &AdmitQuery<'_>) -> Vec<Write> {
        Vec::new()
    }
    /// A ready run asks to be dispatched.
    fn dispatch(&mut self, _q: &DispatchQuery<'_>) -> Dispatch {
        Dispatch::Pass
    }
    /// It was dispatched as `execution_id` (every policy let it go): what
    /// the policy takes, as [`Write::Holds`] (the attempt's resources) and
    /// [`Write::Charges`] (budgets estimated at dispatch).
    fn dispatched(&mut self, _q: &DispatchQuery<'_>, _execution_id: &str) -> Vec<Write> {
        Vec::new()
    }
    /// An attempt ended: what follows; state to write with the attempt
    /// goes in `writes` (committed in the run's group).
    fn attempt_ended(&mut self, _q: &AttemptQuery<'_>, _writes: &mut Vec<Write>) -> AfterAttempt {
        AfterAttempt::Pass
    }
    /// A run ended (terminal).
    fn finished(&mut self, _q: &FinishQuery<'_>) -> Vec<Write> {
        Vec::new()
    }
    /// What the policy shows of its state at `now` (`resources list`,
    /// `budgets list`, `/metrics`, the dashboard): it fills its own part
    /// of `into` and leaves the rest.
    fn snapshot(&self, _now: DateTime<Utc>, _into: &mut PolicyViews) {}
}

/// The registered policies, in the order they are asked.
#[derive(Debug, Default)]
pub struct Policies {
    /// A paused task's rule per source.
    pub paused: paused::Paused,
    /// Circuit breaker.
    pub breaker: breaker::BreakerPolicy,
    /// Cluster-wide resources.
    pub resources: resources::Resources,
    /// Spend limits.
    pub budgets: budgets::Budgets,
    /// Concurrency limit and overlap policy.
    pub overlap: overlap::Overlap,
    /// Retries and the outcome contract.
    pub retry: retry::Retry,
    /// Tasks that follow tasks.
    pub dependencies: dependencies::Dependencies,
}

impl Policies {
    /// Every policy, in order: the one list they are registered in.
    pub fn chain(&mut self) -> [&mut dyn Policy; 7] {
        [
            &mut self.paused,
            &mut self.breaker,
            &mut self.overlap,
            &mut self.resources,
            &mut self.budgets,
            &mut self.retry,
            &mut self.dependencies,
        ]
    }

    /// Every policy, in order, to read.
    pub fn all(&self) -> [&dyn Policy; 7] {
        [&self.paused, &self.breaker, &self.overlap, &self.resources, &self.budgets, &self.retry, &self.dependencies]
    }

    /// Each policy's view of its state at `now`.
    pub fn snapshot(&self, now: DateTime<Utc>) -> PolicyViews {
        let mut views = PolicyViews::default();
        for p in self.all() {
            p.snapshot(now, &mut views);
        }
        views
    }

    /// The configuration changed (or the term began): each policy takes
    /// its part.
    pub fn configure(&mut self, config: &Config) {
        for p in self.chain() {
            p.configure(config);
        }
    }

    /// A run in memory changed (or was loaded).
    pub fn run_changed(&mut self, run: &RunRecord) {
        for p in self.chain() {
            p.run_changed(run);
        }
    }

    /// A run left memory.
    pub fn run_forgotten(&mut self, run: &RunRecord) {
        for p in self.chain() {
            p.run_forgotten(run);
        }
    }

    /// A task was created or changed (`Some`), or deleted (`None`).
    pub fn task_changed(&mut self, task_id: &str, spec: Option<&TaskSpec>) {
        for p in self.chain() {
            p.task_changed(task_id, spec);
        }
    }

    /// Asks each policy about a new run; the first that does not pass
    /// decides (a policy may admit it waiting and let the next ones speak:
    /// the last such reason stands).
    pub fn admit(&mut self, q: &AdmitQuery<'_>) -> Admit {
        let mut verdict = Admit::Pass;
        for p in self.chain() {
            match p.admit(q) {
                Admit::Pass => {}
                a @ (Admit::Skip { .. } | Admit::SkipAndPause { .. }) => return a,
                a => verdict = a,
            }
        }
        verdict
    }

    /// Tells every policy the run was created; the writes they want.
    pub fn created(&mut self, q: &AdmitQuery<'_>) -> Vec<Write> {
        self.chain().into_iter().flat_map(|p| p.created(q)).collect()
    }

    /// Asks each policy whether a ready run may go now; the first that
    /// does not pass decides. A skip of a run that had an attempt already
    /// is a wait (SKIPPED means it never ran).
    pub fn dispatch(&mut self, q: &DispatchQuery<'_>) -> Dispatch {
        for p in self.chain() {
            match p.dispatch(q) {
                Dispatch::Pass => {}
                Dispatch::Skip { why, .. } if !q.run.attempts.is_empty() => return Dispatch::Wait { reason: why, until: None },
                d => return d,
            }
        }
        Dispatch::Pass
    }

    /// Tells every policy the run was dispatched; what they take.
    pub fn dispatched(&mut self, q: &DispatchQuery<'_>, execution_id: &str) -> Vec<Write> {
        self.chain().into_iter().flat_map(|p| p.dispatched(q, execution_id)).collect()
    }

    /// Asks each policy what follows an ended attempt; the first that does
    /// not pass decides (every policy is told: resources settle either
    /// way). Also the writes they want with the attempt's end.
    pub fn attempt_ended(&mut self, q: &AttemptQuery<'_>) -> (AfterAttempt, Vec<Write>) {
        let mut decided = AfterAttempt::Pass;
        let mut writes = Vec::new();
        for p in self.chain() {
            let d = p.attempt_ended(q, &mut writes);
            if decided == AfterAttempt::Pass {
                decided = d;
            }
        }
        (decided, writes)
    }

    /// Tells every policy the run ended; the writes they want.
    pub fn finished(&mut self, q: &FinishQuery<'_>) -> Vec<Write> {
        self.chain().into_iter().flat_map(|p| p.finished(q)).collect()
    }
}
