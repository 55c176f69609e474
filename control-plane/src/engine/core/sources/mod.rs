//! Run sources (issue 37; the model is Temporal's scheduler, where a
//! generator and a backfiller feed one invoker): each source turns what
//! asks for runs into [`RunRequest`]s and hands them to the one admission
//! (`admission.rs`, `EngineCore::submit`): one lookup of the task and
//! the run id, then every policy — `paused` among them
//! (`policy/paused.rs`: what each source's request gets while its task is
//! paused).
//!
//! | source | file | asks for | run id |
//! |---|---|---|---|
//! | time slots | [`generator`] | each due slot of a task's triggers (misfires coalesced) | `{task}.{slot}` |
//! | manual triggers | [`manual`] | `TriggerTask`; a delayed one admitted when due | `{task}.manual-{key}` |
//! | events and re-runs | [`events`] | webhook requests, queue messages, published events; `RerunRuns` | from the event id; `{run}.rerun-N` |
//! | followers | [`follow`] | a run of a task that follows a run that ended | `{task}.after-{upstream run}` |
//! | backfills | [`backfill`] | a range of a task's slots, a cursor the fenced leader advances | the slot's own, or `{slot run}.rerun-1` |
//!
//! A new source is a file here, its request type and its API.

pub mod backfill;
pub mod events;
pub mod follow;
pub mod generator;
pub mod manual;

use std::collections::HashSet;

use crate::model::run::SkipReason;
use crate::model::{RunRecord, TaskRecord};

/// One run a source asks for. The source builds the run with what only
/// it knows — its id (derived from what asked, so asking twice makes
/// one), trigger, slot and links (`event`, `upstream`, `rerun_of`,
/// `backfill_id`, `fire_at`, `dedup`, the caller's trace) — with
/// [`RunRecord::pending`] and no agent; the admission completes it from
/// the task's definition (agent, params, priority) after its one lookup.
#[derive(Debug)]
pub(in crate::engine::core) struct RunRequest<'a> {
    /// The run, not yet created.
    pub run: RunRecord,
    /// Its params.
    pub input: Input,
    /// Added to the task's `execution.priority` (kept within
    /// `PRIORITY_RANGE`): an event's own, a backfill's drop.
    pub priority_delta: i32,
    /// The definition it is due under, with its pause state, when not the
    /// task's current one (a slot settled under the definition before a
    /// change — a pause among them: a slot due before the pause runs).
    pub def: Option<&'a TaskRecord>,
    /// Runs of the same `run_all` catch-up: the new run queues behind them
    /// instead of counting them as overlap.
    pub batch: Option<&'a HashSet<String>>,
    /// Recorded SKIPPED for this reason without asking the policies (an
    /// `invalid_event`, an `upstream_unmet` follower).
    pub skip: Option<(SkipReason, String)>,
    /// Recorded now, admitted when due at `run.scheduled_at` (a delayed
    /// manual trigger): the policies decide then, as for a slot.
    pub delayed: bool,
}

/// A requested run's params.
#[derive(Debug, Clone)]
pub(in crate::engine::core) enum Input {
    /// The task's `context.params`.
    Task,
    /// The task's, with these on top (a manual trigger's); merged at most
    /// `MAX_PARAMS_BYTES` of JSON, else `InvalidArgument` naming `params`.
    Merged(serde_json::Map<String, serde_json::Value>),
    /// Exactly these: a re-run's (the input of the run it re-runs).
    Exact(serde_json::Map<String, serde_json::Value>),
}

impl RunRequest<'_> {
    /// A request for `run` under the task's current definition, with its params.
    pub fn new(run: RunRecord) -> Self {
        RunRequest { run, input: Input::Task, priority_delta: 0, def: None, batch: None, skip: None, delayed: false }
    }
}
