//! Runs: one record per due slot (or manual trigger), its attempts, and the
//! state machine of `DESIGN.md`:
//!
//! ```text
//! PENDING → RUNNING → SUCCEEDED | FAILED | TIMEOUT | CANCELLED
//! RUNNING → RETRYING → PENDING
//! SKIPPED (concurrency limit, misfire, paused) — always with a reason
//! ```

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

/// Run states; serialized as `PENDING`, `RUNNING`, ...
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum RunStatus {
    /// Waiting for its time, a concurrency slot, or a runner.
    Pending,
    /// An attempt is executing on a runner.
    Running,
    /// Finished with exit code 0.
    Succeeded,
    /// The last attempt failed and no retry is left.
    Failed,
    /// An attempt failed; the next waits for its backoff.
    Retrying,
    /// The last attempt ran out of time.
    Timeout,
    /// Cancelled by a user or by `overlap_policy: cancel_running`.
    Cancelled,
    /// Never ran; `skip_reason` says why.
    Skipped,
}

impl RunStatus {
    /// Terminal states never change again.
    pub fn is_terminal(self) -> bool {
        matches!(self, RunStatus::Succeeded | RunStatus::Failed | RunStatus::Timeout | RunStatus::Cancelled | RunStatus::Skipped)
    }

    /// Upper-case name, as in the API.
    pub fn as_str(self) -> &'static str {
        match self {
            RunStatus::Pending => "PENDING",
            RunStatus::Running => "RUNNING",
            RunStatus::Succeeded => "SUCCEEDED",
            RunStatus::Failed => "FAILED",
            RunStatus::Retrying => "RETRYING",
            RunStatus::Timeout => "TIMEOUT",
            RunStatus::Cancelled => "CANCELLED",
            RunStatus::Skipped => "SKIPPED",
        }
    }

    /// Parses an upper- or lower-case name.
    pub fn parse(s: &str) -> Option<RunStatus> {
        serde_json::from_value(serde_json::Value::String(s.to_ascii_uppercase())).ok()
    }
}

/// What created a run; stored and shown as `cron`, `interval`, `once`,
/// `manual`, `event`, `webhook`, `queue`, `after`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TriggerKind {
    /// A cron trigger's slot.
    Cron,
    /// An interval trigger's slot.
    Interval,
    /// A `once` trigger's instant.
    Once,
    /// `TriggerTask`.
    Manual,
    /// A published event on one of its `event` triggers' topics.
    Event,
    /// A request to one of its `webhook` triggers' paths.
    Webhook,
    /// A message of one of its `queue` triggers.
    Queue,
    /// The end of a run of a task it follows (`after`).
    After,
    /// A backfill of the task's slots (`task backfill`).
    Backfill,
}

impl From<crate::schedule::TimeKind> for TriggerKind {
    fn from(k: crate::schedule::TimeKind) -> TriggerKind {
        match k {
            crate::schedule::TimeKind::Cron => TriggerKind::Cron,
            crate::schedule::TimeKind::Interval => TriggerKind::Interval,
            crate::schedule::TimeKind::Once => TriggerKind::Once,
        }
    }
}

impl TriggerKind {
    /// Lower-case name, as stored and in the API's `trigger_kind`.
    pub fn as_str(self) -> &'static str {
        match self {
            TriggerKind::Cron => "cron",
            TriggerKind::Interval => "interval",
            TriggerKind::Once => "once",
            TriggerKind::Manual => "manual",
            TriggerKind::Event => "event",
            TriggerKind::Webhook => "webhook",
            TriggerKind::Queue => "queue",
            TriggerKind::After => "after",
            TriggerKind::Backfill => "backfill",
        }
    }

    /// Whether its runs are time slots (their records commit with the
    /// task's cursor).
    pub fn is_slot(self) -> bool {
        matches!(self, TriggerKind::Cron | TriggerKind::Interval | TriggerKind::Once)
    }
}

/// Why a SKIPPED record exists; stored as `concurrency_limit`, `misfired`, `paused`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SkipReason {
    /// `concurrency_limit` runs were active and `overlap_policy` is `skip`.
    ConcurrencyLimit,
    /// Slots missed by more than the misfire grace (coalesced), or
    /// `misfire_policy: skip`.
    Misfired,
    /// Slots due while the task was paused (coalesced).
    Paused,
    /// The task's circuit breaker was open (or half-open, its trial active).
    CircuitOpen,
    /// A resource it needs was busy, held back or out of rate, and the
    /// task says `execution.on_resource_busy: skip`.
    ResourceBusy,
    /// A budget covering the task was over a hard limit.
    BudgetExceeded,
    /// An event the trigger cannot take (not JSON when it wants JSON, over
    /// its size limit).
    InvalidEvent,
    /// The run of the task it follows ended in a status it did not ask for.
    UpstreamUnmet,
    /// Slots whose local time a daylight-saving change skipped, under
    /// `dst.gap: skip` (recorded at the jump).
    DstGap,
}

impl SkipReason {
    /// Lower-case name, as stored and in the API's `skip_reason`.
    pub fn as_str(self) -> &'static str {
        match self {
            SkipReason::ConcurrencyLimit => "concurrency_limit",
            SkipReason::Misfired => "misfired",
            SkipReason::Paused => "paused",
            SkipReason::CircuitOpen => "circuit_open",
            SkipReason::ResourceBusy => "resource_busy",
            SkipReason::BudgetExceeded => "budget_exceeded",
            SkipReason::InvalidEvent => "invalid_event",
            SkipReason::UpstreamUnmet => "upstream_unmet",
            SkipReason::DstGap => "dst_gap",
        }
    }
}

/// How an attempt ended, as the control plane records it; stored as the
/// lower-case name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Exit code 0.
    Succeeded,
    /// Non-zero exit, or the agent could not start.
    Failed,
    /// Killed at its deadline (or the runner never reported by then).
    Timeout,
    /// Cancelled (by a user, `overlap_policy: cancel_running`, or a task deletion).
    Cancelled,
    /// Its runner was silent past the runner fence deadline (its agent was
    /// stopped by the runner's self-fence), or a restarted runner came back
    /// without it.
    Lost,
    /// Stopped because its runner shut down or lost the leader: not counted
    /// against `max_retries` (at most [`MAX_FREE_INTERRUPTIONS`] per run).
    Interrupted,
    /// The agent said `"outcome": "rate_limited"`: retried no earlier than
    /// its `retry_at`, not counted against `max_retries`.
    RateLimited,
    /// The agent said `"outcome": "quota_exhausted"`: the run FAILS, not retried.
    QuotaExhausted,
    /// The agent said `"outcome": "non_retryable"`: the run FAILS now.
    NonRetryable,
}

impl Outcome {
    /// Lower-case name, as stored and in the API's `outcome`.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Succeeded => "succeeded",
            Outcome::Failed => "failed",
            Outcome::Timeout => "timeout",
            Outcome::Cancelled => "cancelled",
            Outcome::Lost => "lost",
            Outcome::Interrupted => "interrupted",
            Outcome::RateLimited => "rate_limited",
            Outcome::QuotaExhausted => "quota_exhausted",
            Outcome::NonRetryable => "non_retryable",
        }
    }
}

/// Interruptions per run that do not count as attempts (issue 6: "at most 3
/// interruptions per run, then the attempt counts").
pub const MAX_FREE_INTERRUPTIONS: u32 = 3;

/// How many of its newest attempts a run keeps when its record must shed
/// attempts to fit the store (besides its first): 64.
pub const KEPT_LATEST_ATTEMPTS: usize = 64;

/// Attempts a run no longer lists ([`RunRecord::elide_attempts`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ElidedAttempts {
    /// How many.
    pub total: u32,
    /// Of those, interrupted ones (they may have been free).
    pub interrupted: u32,
    /// Of those, rate-limited ones (never counted against `max_retries`).
    #[serde(default)]
    pub rate_limited: u32,
}

impl ElidedAttempts {
    /// None elided.
    pub fn is_none(&self) -> bool {
        self.total == 0
    }
}

/// A runner's report about an attempt the control plane had already ended
/// (presumed lost, timed out by the backstop, cancelled). Evidence only:
/// it never changes the run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AttemptReport {
    /// What the runner says happened.
    pub outcome: Outcome,
    /// The runner's error text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The agent's exit code.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// The agent's result.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<serde_json::Value>,
    /// When the runner says it ended (UTC).
    pub finished_at: DateTime<Utc>,
}

/// One execution of a run on a runner.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Attempt {
    /// 1-based.
    pub attempt: u32,
    /// Unique per attempt (UUID v4).
    pub execution_id: String,
    /// The runner it was assigned to: the only runner whose reports about
    /// this execution count.
    pub runner_id: String,
    /// That runner process's `Hello.instance_id` (empty if it sent none).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub runner_instance: String,
    /// When it was assigned (UTC).
    pub dispatched_at: DateTime<Utc>,
    /// When the runner started the agent (UTC).
    #[serde(default)]
    pub started_at: Option<DateTime<Utc>>,
    /// When it ended (UTC).
    #[serde(default)]
    pub finished_at: Option<DateTime<Utc>>,
    /// `None` while open.
    #[serde(default)]
    pub outcome: Option<Outcome>,
    /// Why it failed.
    #[serde(default)]
    pub error: Option<String>,
    /// The agent's exit code, when it exited.
    #[serde(default)]
    pub exit_code: Option<i32>,
    /// The control plane ended this attempt (cancel, deadline backstop) and
    /// its runner has not yet confirmed that the agent is gone: it still
    /// holds a concurrency slot of its task and a slot of its runner.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub awaiting_runner: bool,
    /// The runner's own report, when it came after the control plane had
    /// ended the attempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub report: Option<AttemptReport>,
    /// What the agent reported using (`usage` in its result), if it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// The model the agent named (`usage.model` or `model` in its result),
    /// for the price table of budgets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// The agent's `class` (free text, e.g. `invalid_input`; at most 64
    /// characters), with any outcome.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class: Option<String>,
    /// The resource the agent's outcome named (`rate_limited`,
    /// `quota_exhausted`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource: Option<String>,
    /// For `rate_limited`: no next attempt before this instant (UTC).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_at: Option<DateTime<Utc>>,
    /// The cluster-wide resources the attempt holds while its agent lives
    /// (`execution.resources` at dispatch): a new leader rebuilds the
    /// resources' permits from these.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub holds: Vec<ResourceHold>,
    /// What the execution used of its runner's machine (process agents in
    /// a cgroup).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub machine: Option<MachineUse>,
}

/// What one execution used of its runner's machine, read from its cgroup
/// when it ended.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct MachineUse {
    /// Highest memory use, bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_memory_bytes: Option<u64>,
    /// CPU time of all its processes, seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_seconds: Option<f64>,
}

impl MachineUse {
    /// From a runner's report; `None` when it says nothing (a negative or
    /// non-finite CPU time is dropped).
    pub fn from_report(peak_memory_bytes: Option<u64>, cpu_seconds: Option<f64>) -> Option<MachineUse> {
        let cpu_seconds = cpu_seconds.filter(|s| s.is_finite() && *s >= 0.0);
        (peak_memory_bytes.is_some() || cpu_seconds.is_some()).then_some(MachineUse { peak_memory_bytes, cpu_seconds })
    }
}

/// A resource an attempt holds: its name, the concurrency units taken and
/// the tokens reserved (settled against the attempt's usage when it ends).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResourceHold {
    /// The resource (`resources.NAME` of the config).
    pub name: String,
    /// Concurrency units.
    #[serde(default = "one")]
    pub units: u32,
    /// Tokens reserved at dispatch (the task's estimate).
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub tokens: u64,
}

/// A resource held back for every task (an agent answered
/// `rate_limited` or `quota_exhausted` naming it), as stored under
/// `holds/{resource}` so that a new leader holds it too.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HoldBack {
    /// Held back until (UTC).
    pub until: DateTime<Utc>,
    /// Why, naming the run whose agent said so.
    pub why: String,
}

fn one() -> u32 {
    1
}

fn is_zero_u64(n: &u64) -> bool {
    *n == 0
}

/// Model usage an agent reports in its result: `{"usage": {"input_tokens":
/// N, "output_tokens": N, "cache_read_input_tokens": N, "cost": X}}` (each
/// optional). Shown on traces as `gen_ai.usage.*` (OpenTelemetry GenAI
/// semantic conventions) and summed over a run's attempts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Usage {
    /// Input (prompt) tokens.
    #[serde(default)]
    pub input_tokens: u64,
    /// Output (completion) tokens.
    #[serde(default)]
    pub output_tokens: u64,
    /// Input tokens read from a cache.
    #[serde(default)]
    pub cache_read_input_tokens: u64,
    /// Cost, in the agent's currency unit: as reported, or (with
    /// `cost_priced`) its tokens times the model's price from the config's
    /// `prices` when the agent reported none.
    #[serde(default)]
    pub cost: f64,
    /// `cost` is the price table's, not the agent's report.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub cost_priced: bool,
}

/// The model an agent's result names: `usage.model`, else `model` (at
/// most 128 characters).
pub fn model_of(result: &serde_json::Value) -> Option<String> {
    let m = result.get("usage").and_then(|u| u.get("model")).or_else(|| result.get("model"))?.as_str()?;
    (!m.is_empty()).then(|| m.chars().take(128).collect())
}

/// Most tokens of one kind one attempt may report (10^12): a larger
/// report is cut to it, so sums never overflow and a rate's debt stays
/// bounded.
pub const MAX_USAGE_TOKENS: u64 = 1_000_000_000_000;
/// Most cost one attempt may report (10^12 units): a larger one is cut to
/// it, so a budget's sum stays finite.
pub const MAX_USAGE_COST: f64 = 1e12;

impl Usage {
    /// The `usage` object of a result, if it has one of the known fields.
    /// Tokens and cost are cut to [`MAX_USAGE_TOKENS`] and
    /// [`MAX_USAGE_COST`]; a negative, non-finite or non-numeric value
    /// counts as 0.
    pub fn from_result(result: &serde_json::Value) -> Option<Usage> {
        let u = result.get("usage")?.as_object()?;
        let int = |k: &str| u.get(k).and_then(serde_json::Value::as_u64).unwrap_or(0).min(MAX_USAGE_TOKENS);
        let cost = u.get("cost").and_then(serde_json::Value::as_f64).filter(|c| c.is_finite()).unwrap_or(0.0).clamp(0.0, MAX_USAGE_COST);
        let usage = Usage {
            input_tokens: int("input_tokens"),
            output_tokens: int("output_tokens"),
            cache_read_input_tokens: int("cache_read_input_tokens"),
            cost,
            cost_priced: false,
        };
        (usage != Usage::default()).then_some(usage)
    }

    /// The sum of two reports.
    pub fn plus(self, o: Usage) -> Usage {
        Usage {
            input_tokens: self.input_tokens.saturating_add(o.input_tokens),
            output_tokens: self.output_tokens.saturating_add(o.output_tokens),
            cache_read_input_tokens: self.cache_read_input_tokens.saturating_add(o.cache_read_input_tokens),
            cost: self.cost + o.cost,
            cost_priced: self.cost_priced || o.cost_priced,
        }
    }
}

impl Attempt {
    /// Still running as far as the control plane knows.
    pub fn is_open(&self) -> bool {
        self.outcome.is_none()
    }
}

/// Latest progress report of a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Progress {
    /// 0..=100.
    pub percent: Option<f64>,
    /// Free text.
    pub message: String,
    /// Latest checkpoint (kept across attempts and given to the next one).
    pub checkpoint: Option<serde_json::Value>,
    /// When it arrived (UTC).
    pub updated_at: DateTime<Utc>,
}

/// A run record, stored under `runs/{run_id}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunRecord {
    /// Deterministic per slot: see [`slot_run_id`].
    pub run_id: String,
    /// Owning task.
    pub task_id: String,
    /// Agent that runs it.
    pub agent_id: String,
    /// What created it.
    pub trigger: TriggerKind,
    /// Current state.
    pub status: RunStatus,
    /// Nominal slot time (UTC); for manual runs, the earliest start.
    pub scheduled_at: DateTime<Utc>,
    /// When the latest attempt was assigned to a runner (UTC).
    #[serde(default)]
    pub dispatched_at: Option<DateTime<Utc>>,
    /// When the first attempt actually started (UTC).
    #[serde(default)]
    pub actual_started_at: Option<DateTime<Utc>>,
    /// When it reached a terminal state (UTC).
    #[serde(default)]
    pub finished_at: Option<DateTime<Utc>>,
    /// Every attempt, oldest first.
    #[serde(default)]
    pub attempts: Vec<Attempt>,
    /// The agent's result JSON (from its result file).
    #[serde(default)]
    pub result: Option<serde_json::Value>,
    /// Latest progress.
    #[serde(default)]
    pub progress: Option<Progress>,
    /// For SKIPPED: why.
    #[serde(default)]
    pub skip_reason: Option<SkipReason>,
    /// For a coalesced SKIPPED record: how many slots.
    #[serde(default)]
    pub missed_count: Option<u64>,
    /// First slot covered (UTC).
    #[serde(default)]
    pub missed_from: Option<DateTime<Utc>>,
    /// Last slot covered (UTC).
    #[serde(default)]
    pub missed_until: Option<DateTime<Utc>>,
    /// Why a PENDING run is waiting.
    #[serde(default)]
    pub pending_reason: Option<String>,
    /// Earliest start of the next attempt (RETRYING, delayed PENDING).
    #[serde(default)]
    pub next_attempt_at: Option<DateTime<Utc>>,
    /// When a jittered slot fired: `scheduled_at` (the nominal slot) plus
    /// its trigger's jitter (`jitter_seconds`, `jitter: auto`). Lags count
    /// from here. Absent without jitter.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fire_at: Option<DateTime<Utc>>,
    /// Params given to the agent (task params merged with trigger params).
    #[serde(default)]
    pub params: serde_json::Map<String, serde_json::Value>,
    /// Last error (also in the attempt).
    #[serde(default)]
    pub error: Option<String>,
    /// Tail of the latest attempt's stdout.
    #[serde(default)]
    pub stdout_tail: String,
    /// Tail of the latest attempt's stderr.
    #[serde(default)]
    pub stderr_tail: String,
    /// Dispatch priority (copied from the task), `-1000..=1000`.
    #[serde(default)]
    pub priority: i32,
    /// A PENDING run not dispatched by this instant (UTC) ends TIMEOUT
    /// (`execution.start_timeout_seconds`, counted from when it became
    /// ready for dispatch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_by: Option<DateTime<Utc>>,
    /// Attempts interrupted by a runner shutdown or self-fence.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub interruptions: u32,
    /// Earlier attempts no longer in `attempts`: a run with hundreds of
    /// attempts keeps its first and its newest [`KEPT_LATEST_ATTEMPTS`]
    /// when its record would not fit the store otherwise
    /// (`repo::trim_run`); they still count.
    #[serde(default, skip_serializing_if = "ElidedAttempts::is_none")]
    pub elided_attempts: ElidedAttempts,
    /// The dedup key its creation claimed (event runs with a dedup window).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dedup: Option<super::event::DedupClaim>,
    /// A delayed run not yet admitted: its task's policies (overlap,
    /// breaker, resources, budgets) decide it at its `next_attempt_at`, as
    /// they decide a slot when it is due; until then it holds nothing.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub awaiting_admission: bool,
    /// Fencing token of the leader that last wrote the record.
    #[serde(default)]
    pub fencing_token: u64,
    /// Last write (UTC).
    pub updated_at: DateTime<Utc>,
    /// OpenTelemetry trace of the run (32 hex digits; see [`crate::model::trace`]).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub trace_id: String,
    /// The run's root span (16 hex digits).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub span_id: String,
    /// The caller's span when `TriggerTask` carried a `traceparent`: the
    /// run's span is its child.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub parent_span_id: String,
    /// The caller's W3C `tracestate` (with its `traceparent`), for the
    /// agent's `TRACESTATE`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub trace_state: String,
    /// The caller's W3C `baggage`, for the agent's `BAGGAGE`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub baggage: String,
    /// The budgets it counts against, with what each reserved at
    /// admission (a new leader re-reserves them for the runs it loads).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub charges: Vec<super::budget::BudgetCharge>,
    /// The event that started it (webhook, queue, published event): the
    /// agent gets it as `context.event`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub event: Option<super::event::EventInfo>,
    /// The run it follows (`after`): the agent gets it as
    /// `context.upstream`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upstream: Option<super::event::Upstream>,
    /// The run this one re-runs (`runs rerun`): with its params, event and
    /// upstream, under id `{rerun_of}.rerun-{n}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rerun_of: Option<String>,
    /// The backfill that made it (`trigger: backfill`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backfill_id: Option<String>,
}

impl RunRecord {
    /// A fresh PENDING run.
    pub fn pending(
        run_id: String,
        task_id: &str,
        agent_id: &str,
        trigger: TriggerKind,
        scheduled_at: DateTime<Utc>,
        now: DateTime<Utc>,
    ) -> Self {
        RunRecord {
            run_id,
            task_id: task_id.to_string(),
            agent_id: agent_id.to_string(),
            trigger,
            status: RunStatus::Pending,
            scheduled_at,
            dispatched_at: None,
            actual_started_at: None,
            finished_at: None,
            attempts: Vec::new(),
            result: None,
            progress: None,
            skip_reason: None,
            missed_count: None,
            missed_from: None,
            missed_until: None,
            pending_reason: None,
            next_attempt_at: None,
            fire_at: None,
            params: serde_json::Map::new(),
            error: None,
            stdout_tail: String::new(),
            stderr_tail: String::new(),
            priority: 0,
            start_by: None,
            interruptions: 0,
            elided_attempts: ElidedAttempts::default(),
            dedup: None,
            awaiting_admission: false,
            fencing_token: 0,
            updated_at: now,
            trace_id: String::new(),
            span_id: String::new(),
            parent_span_id: String::new(),
            trace_state: String::new(),
            baggage: String::new(),
            charges: Vec::new(),
            event: None,
            upstream: None,
            rerun_of: None,
            backfill_id: None,
        }
    }

    /// A SKIPPED record covering `count` slots from `from` to `until`.
    #[allow(clippy::too_many_arguments)]
    pub fn skipped(
        run_id: String,
        task_id: &str,
        agent_id: &str,
        trigger: TriggerKind,
        reason: SkipReason,
        (count, from, until): (u64, DateTime<Utc>, DateTime<Utc>),
        error: String,
        now: DateTime<Utc>,
    ) -> Self {
        let mut r = RunRecord::pending(run_id, task_id, agent_id, trigger, from, now);
        r.status = RunStatus::Skipped;
        r.skip_reason = Some(reason);
        r.missed_count = Some(count);
        r.missed_from = Some(from);
        r.missed_until = Some(until);
        r.finished_at = Some(now);
        r.error = Some(error);
        r
    }

    /// A PENDING run that may not start before a later instant (a delayed
    /// manual trigger) and has never been dispatched.
    pub fn is_delayed(&self, now: DateTime<Utc>) -> bool {
        self.status == RunStatus::Pending && self.attempts.is_empty() && self.next_attempt_at.is_some_and(|t| t > now)
    }

    /// The open (latest, unfinished) attempt.
    pub fn current_attempt(&self) -> Option<&Attempt> {
        self.attempts.last().filter(|a| a.is_open())
    }

    /// The open (latest, unfinished) attempt, mutable.
    pub fn current_attempt_mut(&mut self) -> Option<&mut Attempt> {
        self.attempts.last_mut().filter(|a| a.is_open())
    }

    /// Execution id of the open attempt.
    pub fn current_execution(&self) -> Option<&str> {
        self.current_attempt().map(|a| a.execution_id.as_str())
    }

    /// The attempt with this execution id.
    pub fn attempt_mut(&mut self, execution_id: &str) -> Option<&mut Attempt> {
        self.attempts.iter_mut().find(|a| a.execution_id == execution_id)
    }

    /// How many attempts the run has had, elided ones included.
    pub fn attempt_count(&self) -> u32 {
        u32::try_from(self.attempts.len()).unwrap_or(u32::MAX).saturating_add(self.elided_attempts.total)
    }

    /// Keeps the first attempt and the newest [`KEPT_LATEST_ATTEMPTS`],
    /// counting the ones in between in `elided_attempts`. Returns whether
    /// any was elided.
    pub fn elide_attempts(&mut self) -> bool {
        let keep_from = self.attempts.len().saturating_sub(KEPT_LATEST_ATTEMPTS);
        if keep_from <= 1 {
            return false;
        }
        for a in self.attempts.drain(1..keep_from) {
            self.elided_attempts.total += 1;
            if a.outcome == Some(Outcome::Interrupted) {
                self.elided_attempts.interrupted += 1;
            }
            if a.outcome == Some(Outcome::RateLimited) {
                self.elided_attempts.rate_limited += 1;
            }
        }
        true
    }

    /// Attempts that count against `max_retries`: all but the first
    /// [`MAX_FREE_INTERRUPTIONS`] interrupted ones and the rate-limited
    /// ones. Elided attempts came after the first kept one and before the
    /// rest.
    pub fn counted_attempts(&self) -> u32 {
        let e = self.elided_attempts;
        let failed = e.total.saturating_sub(e.interrupted).saturating_sub(e.rate_limited);
        let outcomes = self
            .attempts
            .first()
            .map(|a| a.outcome)
            .into_iter()
            .chain(std::iter::repeat_n(Some(Outcome::Interrupted), e.interrupted as usize))
            .chain(std::iter::repeat_n(Some(Outcome::Failed), failed as usize))
            .chain(self.attempts.iter().skip(1).map(|a| a.outcome));
        let (mut interrupted, mut counted) = (0, 0);
        for o in outcomes {
            if o == Some(Outcome::RateLimited) {
                continue;
            }
            if o == Some(Outcome::Interrupted) {
                interrupted += 1;
                if interrupted <= MAX_FREE_INTERRUPTIONS {
                    continue;
                }
            }
            counted += 1;
        }
        counted
    }

    /// When it was due: the jittered fire time of a slot, else its
    /// `scheduled_at`. Lags count from here.
    pub fn due_at(&self) -> DateTime<Utc> {
        self.fire_at.unwrap_or(self.scheduled_at)
    }

    /// Whether some attempt still holds a concurrency slot: open, or ended
    /// by the control plane and not yet confirmed gone by its runner.
    pub fn holds_agent(&self) -> bool {
        self.attempts.iter().any(|a| a.is_open() || a.awaiting_runner)
    }
}

/// Compact UTC stamp used in run ids: `20261130T003000Z`, with `.123` ms if any.
pub fn stamp(t: DateTime<Utc>) -> String {
    if t.timestamp_subsec_millis() == 0 { t.format("%Y%m%dT%H%M%SZ").to_string() } else { t.format("%Y%m%dT%H%M%S%.3fZ").to_string() }
}

/// Run id of a time-trigger slot: `{task_id}.{stamp}`. Task ids have no
/// dots, so `runs/{task_id}.` is an exact prefix of the task's runs.
pub fn slot_run_id(task_id: &str, slot: DateTime<Utc>) -> String {
    format!("{task_id}.{}", stamp(slot))
}

/// The task and slot of a time-trigger run id (`{task_id}.{stamp}`), or
/// `None` for a manual run id.
pub fn slot_of_run_id(run_id: &str) -> Option<(&str, DateTime<Utc>)> {
    let (task, stamp) = run_id.split_once('.')?;
    let format = if stamp.contains('.') { "%Y%m%dT%H%M%S%.3fZ" } else { "%Y%m%dT%H%M%SZ" };
    let t = chrono::NaiveDateTime::parse_from_str(stamp, format).ok()?;
    Some((task, t.and_utc()))
}

/// What a re-run's id adds to the id of the run it re-runs.
pub const RERUN_INFIX: &str = ".rerun-";

/// Run id of the `n`-th re-run (1-based) of `run_id`: `{run_id}.rerun-{n}`.
pub fn rerun_run_id(run_id: &str, n: usize) -> String {
    format!("{run_id}{RERUN_INFIX}{n}")
}

/// Run id of a manual trigger: `{task_id}.manual-{key}`.
pub fn manual_run_id(task_id: &str, key: &str) -> String {
    format!("{task_id}.manual-{key}")
}

/// The task id part of a run id.
pub fn task_of_run(run_id: &str) -> &str {
    run_id.split('.').next().unwrap_or(run_id)
}

fn is_zero(v: &u32) -> bool {
    *v == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by an attack: input_tokens of u64::MAX panicked the engine
    /// (an overflow summing tokens), again at every re-report; a cost of
    /// 1e308 twice made a ledger of inf that could not be read back.
    #[test]
    fn usage_is_cut_to_its_bounds() {
        let r = serde_json::json!({"usage": {"input_tokens": u64::MAX, "output_tokens": 1, "cost": 1e308}});
        let u = Usage::from_result(&r).expect("usage");
        assert_eq!((u.input_tokens, u.output_tokens, u.cost), (MAX_USAGE_TOKENS, 1, MAX_USAGE_COST));
        let r = serde_json::json!({"usage": {"input_tokens": -5, "cost": -2.0, "output_tokens": "7"}});
        assert_eq!(Usage::from_result(&r), None, "nothing usable");
        let sum = (0..1000).fold(u, |acc, _| acc.plus(u));
        assert!(sum.cost.is_finite() && sum.input_tokens == 1001 * MAX_USAGE_TOKENS);
    }

    #[test]
    fn slot_run_ids_round_trip() {
        for t in ["2026-11-30T00:30:00Z", "2026-11-30T00:30:00.250Z"] {
            let t: DateTime<Utc> = t.parse().expect("t");
            let id = slot_run_id("task_1", t);
            assert_eq!(slot_of_run_id(&id), Some(("task_1", t)));
        }
        assert_eq!(slot_of_run_id("task_1.manual-abc"), None);
    }
}
