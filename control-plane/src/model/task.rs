//! Task definitions as users write them (JSON or YAML), and their validation.
//!
//! The seed format of `DESIGN.md` is accepted as is. Unknown fields are
//! rejected; every error names the dotted path of the offending field.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::schedule::{self, Schedule};

/// Longest accepted `task_id`, in characters.
pub const MAX_TASK_ID_LEN: usize = 128;
/// Largest `execution.timeout_seconds`: one year.
pub const MAX_TIMEOUT_SECONDS: i64 = 365 * 86_400;
/// Largest `execution.misfire_grace_seconds`: one year.
pub const MAX_GRACE_SECONDS: u64 = 365 * 86_400;
/// Largest `retry_backoff` value in seconds: seven days.
pub const MAX_BACKOFF_SECONDS: f64 = 7.0 * 86_400.0;
/// Largest `execution.concurrency_limit`.
pub const MAX_CONCURRENCY: u32 = 10_000;
/// Dispatch priority bounds: `-1000..=1000` (higher dispatches first).
pub const PRIORITY_RANGE: std::ops::RangeInclusive<i32> = -1000..=1000;
/// Default `execution.start_timeout_seconds`: one hour.
pub const DEFAULT_START_TIMEOUT_SECONDS: i64 = 3600;
/// Largest task definition, as JSON: 256 KiB (it rides in every run's context).
pub const MAX_SPEC_BYTES: usize = 256 * 1024;
/// Largest `context` of a task, as JSON: 128 KiB. The context is given
/// whole to every attempt; it is an input, never trimmed, so it is
/// refused beyond this at apply.
pub const MAX_CONTEXT_BYTES: usize = 128 * 1024;
/// Largest params of a run, as JSON: 64 KiB — the task's `context.params`,
/// a `TriggerTask`'s `params`, and the two merged. Params are kept whole
/// with the run record (at most [`crate::repo::MAX_RUN_RECORD_BYTES`],
/// 512 KiB) and given to every attempt: an input is never trimmed, so a
/// larger one is refused, naming the field and this limit.
pub const MAX_PARAMS_BYTES: usize = 64 * 1024;

/// The encoded JSON size of `v`.
pub fn json_bytes(v: &serde_json::Value) -> usize {
    serde_json::to_vec(v).map_or(usize::MAX, |b| b.len())
}

/// Refuses params over [`MAX_PARAMS_BYTES`], naming `field`.
///
/// Errors: [`Error::InvalidArgument`] at `field` with the size and the limit.
pub fn check_params_size(field: &str, params: &serde_json::Map<String, serde_json::Value>) -> Result<()> {
    let n = json_bytes(&serde_json::Value::Object(params.clone()));
    if n > MAX_PARAMS_BYTES {
        return Err(Error::invalid(
            field,
            format!("{n} bytes of JSON; at most {MAX_PARAMS_BYTES} (params are kept whole with every run; pass large inputs by reference)"),
        ));
    }
    Ok(())
}
/// Deepest nesting of objects and arrays in a definition. Stored records
/// wrap a definition in more levels (a task record, a run's params, an
/// apply journal), and serde_json refuses documents deeper than 128: a
/// definition that validated must always be readable again.
pub const MAX_SPEC_DEPTH: usize = 64;

/// The nesting depth of the JSON `text` if it is over `max` (strings are
/// skipped; the text need not be valid: the parser judges that).
fn nesting_over(text: &str, max: usize) -> Option<usize> {
    let (mut depth, mut deepest, mut in_string, mut escaped) = (0usize, 0usize, false, false);
    for b in text.bytes() {
        if in_string {
            match (escaped, b) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'{' | b'[' => {
                depth += 1;
                deepest = deepest.max(depth);
            }
            b'}' | b']' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    (deepest > max).then_some(deepest)
}

/// One task definition.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskSpec {
    /// Letters, digits, `_` and `-`; 1..=128 characters. Unique per cluster.
    pub task_id: String,
    /// The agent that runs it; only runners advertising this id get its runs.
    pub agent_id: String,
    /// Free text (an empty one is as none: it is not serialized).
    #[serde(default, skip_serializing_if = "none_or_empty")]
    pub description: Option<String>,
    /// Labels of the task (`{team: data}`): a budget's `scope: {label}`
    /// counts the tasks that have them. At most 32; keys and values 1 to
    /// 63 letters, digits, `_ - .`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// One trigger (the seed form) ...
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trigger: Option<TriggerSpec>,
    /// ... or several. A task with neither runs only when triggered manually.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub triggers: Vec<TriggerSpec>,
    /// How runs execute: timeout, retries, concurrency, misfires.
    #[serde(default)]
    pub execution: ExecutionSpec,
    /// Passed to the agent; `context.params` is merged with manual-trigger params.
    #[serde(default, skip_serializing_if = "serde_json::Map::is_empty")]
    pub context: serde_json::Map<String, serde_json::Value>,
    /// Notification sinks per event (see README "Notifications").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub notify: Option<NotifySpec>,
    /// How long finished runs are kept (default: the server's
    /// `--history-keep-last` and `--history-max-age`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub history: Option<HistorySpec>,
}

/// Most finished runs `history.keep_last` may keep.
pub const MAX_KEEP_LAST: u32 = 1_000_000;
/// Shortest `history.max_age`: 1 minute.
pub const MIN_MAX_AGE_SECONDS: u64 = 60;
/// Longest `history.max_age`: 100 years (36,500 days).
pub const MAX_MAX_AGE_SECONDS: u64 = 36_500 * 86_400;

/// `history`: the retention of a task's finished runs. A run is deleted
/// when it is not among the task's newest `keep_last` finished runs, or
/// when it finished longer than `max_age` ago. Runs not finished, or whose
/// agent may still be alive, are never deleted.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HistorySpec {
    /// Finished runs kept, newest first (1..=1,000,000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keep_last: Option<u32>,
    /// Age after which a finished run is deleted: `"30d"`, `"12h"`,
    /// `"90m"` (at least 1 minute).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_age: Option<String>,
}

impl HistorySpec {
    /// `max_age` in seconds, if given and valid.
    pub fn max_age_seconds(&self) -> Option<u64> {
        self.max_age.as_deref().and_then(|s| crate::schedule::parse_duration(s).ok())
    }
}

use super::trigger::PATH_MARK;
pub use super::trigger::{MAX_JITTER_SECONDS, TriggerSpec};
pub use crate::schedule::{CronTrigger, IntervalTrigger, MisfirePolicy, OnceTrigger};

/// What to do when a slot comes while `concurrency_limit` runs are active.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OverlapPolicy {
    /// Record a SKIPPED run with `skip_reason: concurrency_limit` (default).
    #[default]
    Skip,
    /// Keep the run PENDING until a slot frees.
    Queue,
    /// Cancel the oldest active run, then start the new one.
    CancelRunning,
}

/// `retry_backoff`: delay before retry k (1-based) is
/// `min(base_seconds * 2^(k-1), cap_seconds) + uniform(0, jitter_seconds)`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetryBackoff {
    /// Seconds; default 2.
    pub base_seconds: f64,
    /// Seconds; default 60.
    pub cap_seconds: f64,
    /// Seconds of uniform random extra delay; default 0.5.
    pub jitter_seconds: f64,
}

impl Default for RetryBackoff {
    fn default() -> Self {
        Self { base_seconds: 2.0, cap_seconds: 60.0, jitter_seconds: 0.5 }
    }
}

/// `selector`: only runners whose labels include all of these.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Selector {
    /// Required runner labels (none: any runner; not serialized then).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
}

fn none_or_empty(s: &Option<String>) -> bool {
    s.as_deref().is_none_or(str::is_empty)
}

/// `execution`: how runs of the task execute.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ExecutionSpec {
    /// Seconds an attempt may run before it is killed; default 3600; > 0.
    pub timeout_seconds: i64,
    /// Retries after the first attempt; default 0.
    pub max_retries: u32,
    /// Delay between attempts.
    pub retry_backoff: RetryBackoff,
    /// Runs of this task active at once; default 1; >= 1.
    pub concurrency_limit: u32,
    /// When the limit is reached; default `skip`.
    pub overlap_policy: OverlapPolicy,
    /// Missed slots; default `run_once`.
    pub misfire_policy: MisfirePolicy,
    /// How late (seconds) a missed slot may still run; default 60.
    pub misfire_grace_seconds: u64,
    /// Higher dispatches first; default 0; `-1000..=1000`.
    pub priority: i32,
    /// Seconds a run may wait for dispatch (a runner serving its agent, a
    /// free slot, the concurrency limit) before it ends TIMEOUT; retries do
    /// not apply to it. Default 3600; `1..=31536000`.
    pub start_timeout_seconds: i64,
    /// Runner label selector.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub selector: Option<Selector>,
    /// Stop running the task for a while after failures in a row; off
    /// when absent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub circuit_breaker: Option<CircuitBreakerSpec>,
    /// Cluster-wide resources each attempt takes (`["search-api", {name:
    /// openai, tokens: 8000}]`), declared in the control plane's config;
    /// an unknown one is refused at apply.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub resources: Vec<ResourceUse>,
    /// A run whose resource is busy: `wait` (default) or `skip` (a SKIPPED
    /// `resource_busy` record naming it).
    pub on_resource_busy: OnResourceBusy,
    /// Seconds of wall clock a run keeps retrying `rate_limited` attempts
    /// (which do not spend `max_retries`) before it gives up FAILED;
    /// default 1800; `1..=86400`.
    pub rate_limit_max_wait_seconds: u64,
    /// CPU, memory and process limits of each attempt of a process agent,
    /// within its agent's own (`limits` in the runner's agents file): the
    /// runner applies the tighter of each.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limits: Option<LimitsSpec>,
}

/// `execution.limits`: `{memory_max: 512Mi, cpu: 0.5, pids_max: 64}`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitsSpec {
    /// Bytes (a number, or `512Mi`, `1Gi`, `64M`); at least 4 MiB.
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "bytes_or_size")]
    pub memory_max: Option<u64>,
    /// Cores; `0.01..=1024`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu: Option<f64>,
    /// Processes and threads (the agent's supervisor included); at least 2.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pids_max: Option<u64>,
}

/// A size as a number of bytes or a string with a unit.
fn bytes_or_size<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Form {
        Bytes(u64),
        Text(String),
    }
    match Option::<Form>::deserialize(d)? {
        None => Ok(None),
        Some(Form::Bytes(n)) => Ok(Some(n)),
        Some(Form::Text(t)) => punchclock_units::parse_bytes(&t).map(Some).map_err(serde::de::Error::custom),
    }
}

/// What a run does when a resource it needs is busy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnResourceBusy {
    /// Wait (PENDING, `waiting_for` says what for), served by priority,
    /// then slot; past `start_timeout_seconds` TIMEOUT.
    #[default]
    Wait,
    /// A SKIPPED `resource_busy` record.
    Skip,
}

/// One resource a task's attempts take: its name, how many units of its
/// concurrency (default 1), and an estimate of the tokens an attempt
/// spends (reserved against `tokens_per_minute`, settled with the usage
/// it reports). Written as `"name"` or `{name, units, tokens}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ResourceUse {
    /// A resource of the config's `resources:`.
    pub name: String,
    /// Units of its concurrency; `1..=1000`. Always serialized, so a
    /// definition that wrote `units: 1` is told from one that did not
    /// ([`TaskSpec::written_fields`]).
    pub units: u32,
    /// Estimated tokens per attempt.
    #[serde(skip_serializing_if = "is_zero")]
    pub tokens: u64,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

impl<'de> Deserialize<'de> for ResourceUse {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Full {
            name: String,
            #[serde(default = "one")]
            units: u32,
            #[serde(default)]
            tokens: u64,
        }
        fn one() -> u32 {
            1
        }
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Form {
            Name(String),
            Full(Full),
        }
        Ok(match Form::deserialize(d).map_err(|_| serde::de::Error::custom("a resource is a name or {name, units, tokens}"))? {
            Form::Name(name) => ResourceUse { name, units: 1, tokens: 0 },
            Form::Full(f) => ResourceUse { name: f.name, units: f.units, tokens: f.tokens },
        })
    }
}

/// Default `rate_limit_max_wait_seconds`: 30 minutes.
pub const DEFAULT_RATE_LIMIT_MAX_WAIT_SECONDS: u64 = 1800;

/// Most `circuit_breaker.failure_threshold`.
pub const MAX_FAILURE_THRESHOLD: u32 = 1000;
/// Longest `circuit_breaker.cooldown_seconds`: one year.
pub const MAX_COOLDOWN_SECONDS: u64 = 365 * 86_400;

/// `circuit_breaker`: after `failure_threshold` FAILED or TIMEOUT runs in a
/// row, new runs are SKIPPED (`circuit_open`) for `cooldown_seconds`; then
/// one trial run decides (see [`crate::model::breaker`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CircuitBreakerSpec {
    /// Failed runs in a row that open the breaker; `1..=1000`.
    pub failure_threshold: u32,
    /// Seconds the breaker stays open before the trial; `1..=31536000`.
    pub cooldown_seconds: u64,
}

impl Default for ExecutionSpec {
    fn default() -> Self {
        Self {
            timeout_seconds: 3600,
            max_retries: 0,
            retry_backoff: RetryBackoff::default(),
            concurrency_limit: 1,
            overlap_policy: OverlapPolicy::default(),
            misfire_policy: MisfirePolicy::default(),
            misfire_grace_seconds: 60,
            priority: 0,
            start_timeout_seconds: DEFAULT_START_TIMEOUT_SECONDS,
            selector: None,
            circuit_breaker: None,
            resources: Vec::new(),
            on_resource_busy: OnResourceBusy::default(),
            rate_limit_max_wait_seconds: DEFAULT_RATE_LIMIT_MAX_WAIT_SECONDS,
            limits: None,
        }
    }
}

/// `notify`: sinks per outcome (`http(s)://` URLs or `webhook://NAME`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NotifySpec {
    /// Sinks told about a SUCCEEDED run.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub on_success: Vec<String>,
    /// Sinks told about a FAILED or TIMEOUT run.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub on_failure: Vec<String>,
    /// Sinks told about a SKIPPED slot (or coalesced range of slots).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub on_skipped: Vec<String>,
    /// Sinks told when the task's circuit breaker opens (once per opening).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub on_breaker_open: Vec<String>,
}

/// Most sinks one `notify` list may name.
pub const MAX_SINKS_PER_EVENT: usize = 10;

impl NotifySpec {
    /// The sinks of one event.
    pub fn sinks(&self, event: crate::model::notification::NotifyEvent) -> &[String] {
        use crate::model::notification::NotifyEvent as E;
        match event {
            E::OnSuccess => &self.on_success,
            E::OnFailure => &self.on_failure,
            E::OnSkipped => &self.on_skipped,
            E::OnBreakerOpen => &self.on_breaker_open,
            // A budget's, in the config (`budgets[].notify`).
            E::OnBudget => &[],
        }
    }
}

impl TaskSpec {
    /// Parses one task definition from JSON and validates it, finding
    /// every problem rather than only the first.
    ///
    /// Errors: [`Error::InvalidArgument`] naming the first problem's field
    /// (`execution.timeout_seconds`, `trigger.expr`, `trigger.timezone`, an
    /// unknown field's path, ...); its reason lists the others, one per
    /// line (`also execution.priority: ...`), at most [`MAX_PROBLEMS`].
    pub fn from_json(text: &str) -> Result<TaskSpec> {
        Self::parse(text).map(|(spec, _)| spec)
    }

    /// [`TaskSpec::from_json`], with the document read (unchanged: it is
    /// only altered on the way to an error).
    fn parse(text: &str) -> Result<(TaskSpec, serde_json::Value)> {
        if text.len() > MAX_SPEC_BYTES {
            return Err(Error::invalid("task", format!("definition is {} bytes; at most {MAX_SPEC_BYTES}", text.len())));
        }
        if let Some(depth) = nesting_over(text, MAX_SPEC_DEPTH) {
            return Err(Error::invalid("task", format!("nested {depth} levels deep; at most {MAX_SPEC_DEPTH}")));
        }
        let mut value: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| Error::invalid("task", format!("not a JSON document: {}", clean_serde_message(&e.to_string()))))?;
        // Structure first: a field serde refuses is noted and taken out,
        // and the rest read again, to find the next one.
        let mut problems = Problems::default();
        loop {
            match serde_path_to_error::deserialize::<_, TaskSpec>(&value) {
                Ok(spec) => {
                    // The rest is checked too (issue 34: a type error hid
                    // every other problem): the fields taken out read as
                    // their defaults, which pass.
                    spec.check(&mut problems);
                    return problems.into_result().map(|()| (spec, value));
                }
                Err(e) => {
                    let segments: Vec<String> = e
                        .path()
                        .iter()
                        .map(|s| match s {
                            serde_path_to_error::Segment::Map { key } => key.clone(),
                            serde_path_to_error::Segment::Seq { index } => format!("[{index}]"),
                            _ => "?".into(),
                        })
                        .collect();
                    let path = e.path().to_string();
                    let field = if path == "." { "task".to_string() } else { path };
                    let msg = clean_serde_message(&e.inner().to_string());
                    // A trigger's own error carries its inner path: `trigger` + `every_seconds`.
                    let err = match msg.strip_prefix(PATH_MARK).and_then(|m| m.split_once(PATH_MARK)) {
                        Some((sub, reason)) => Error::invalid(format!("{field}.{sub}"), reason),
                        None => Error::invalid(field, msg.clone()),
                    };
                    problems.push(err);
                    // An unknown field is named in the message, under the path.
                    let unknown = msg.strip_prefix("unknown field `").and_then(|m| m.split('`').next()).map(str::to_string);
                    if problems.len() >= MAX_PROBLEMS || !remove_at(&mut value, &segments, unknown.as_deref()) {
                        return problems.into_result().map(|()| (unreachable_spec(), serde_json::Value::Null));
                    }
                }
            }
        }
    }

    /// All triggers, whichever of `trigger`/`triggers` was used.
    pub fn all_triggers(&self) -> Vec<&TriggerSpec> {
        self.trigger.iter().chain(self.triggers.iter()).collect()
    }

    /// Field path prefix of the i-th trigger, for error messages.
    pub fn trigger_path(&self, i: usize) -> String {
        if self.trigger.is_some() && i == 0 {
            "trigger".into()
        } else {
            let j = if self.trigger.is_some() { i - 1 } else { i };
            format!("triggers[{j}]")
        }
    }

    /// Checks every rule that serde cannot: id syntax, ranges, that each
    /// trigger parses and can fire. Errors name the field; the first one
    /// found is the error, and its reason lists the others.
    pub fn validate(&self) -> Result<()> {
        let mut p = Problems::default();
        self.check(&mut p);
        p.into_result()
    }

    /// [`TaskSpec::validate`]'s checks, each problem added to `p`.
    fn check(&self, p: &mut Problems) {
        p.check(validate_id("task_id", &self.task_id));
        p.check(validate_id("agent_id", &self.agent_id));
        let ex = &self.execution;
        if ex.timeout_seconds <= 0 || ex.timeout_seconds > MAX_TIMEOUT_SECONDS {
            p.push(Error::invalid(
                "execution.timeout_seconds",
                format!("must be in 1..={MAX_TIMEOUT_SECONDS} (got {})", ex.timeout_seconds),
            ));
        }
        if ex.start_timeout_seconds <= 0 || ex.start_timeout_seconds > MAX_TIMEOUT_SECONDS {
            p.push(Error::invalid(
                "execution.start_timeout_seconds",
                format!("must be in 1..={MAX_TIMEOUT_SECONDS} (got {})", ex.start_timeout_seconds),
            ));
        }
        if !PRIORITY_RANGE.contains(&ex.priority) {
            p.push(Error::invalid(
                "execution.priority",
                format!("must be in {}..={} (got {})", PRIORITY_RANGE.start(), PRIORITY_RANGE.end(), ex.priority),
            ));
        }
        if ex.concurrency_limit == 0 || ex.concurrency_limit > MAX_CONCURRENCY {
            p.push(Error::invalid("execution.concurrency_limit", format!("must be in 1..={MAX_CONCURRENCY}")));
        }
        if ex.misfire_grace_seconds > MAX_GRACE_SECONDS {
            p.push(Error::invalid("execution.misfire_grace_seconds", format!("must be at most {MAX_GRACE_SECONDS} (1 year)")));
        }
        if ex.max_retries > 1000 {
            p.push(Error::invalid("execution.max_retries", "must be <= 1000"));
        }
        let b = &ex.retry_backoff;
        for (name, v) in [("base_seconds", b.base_seconds), ("cap_seconds", b.cap_seconds), ("jitter_seconds", b.jitter_seconds)] {
            if !v.is_finite() || !(0.0..=MAX_BACKOFF_SECONDS).contains(&v) {
                p.push(Error::invalid(
                    format!("execution.retry_backoff.{name}"),
                    format!("must be a number in 0..={MAX_BACKOFF_SECONDS} (7 days)"),
                ));
            }
        }
        if b.cap_seconds < b.base_seconds {
            p.push(Error::invalid("execution.retry_backoff.cap_seconds", "must be >= base_seconds"));
        }
        if let Some(cb) = &ex.circuit_breaker {
            if !(1..=MAX_FAILURE_THRESHOLD).contains(&cb.failure_threshold) {
                p.push(Error::invalid(
                    "execution.circuit_breaker.failure_threshold",
                    format!("must be in 1..={MAX_FAILURE_THRESHOLD} (got {})", cb.failure_threshold),
                ));
            }
            if !(1..=MAX_COOLDOWN_SECONDS).contains(&cb.cooldown_seconds) {
                p.push(Error::invalid(
                    "execution.circuit_breaker.cooldown_seconds",
                    format!("must be in 1..={MAX_COOLDOWN_SECONDS} (1 year; got {})", cb.cooldown_seconds),
                ));
            }
        }
        for (i, r) in ex.resources.iter().enumerate() {
            if !(1..=1000).contains(&r.units) {
                p.push(Error::invalid(format!("execution.resources[{i}].units"), "must be in 1..=1000"));
            }
            if ex.resources[..i].iter().any(|o| o.name == r.name) {
                p.push(Error::invalid(format!("execution.resources[{i}]"), format!("{:?} is named twice", r.name)));
            }
        }
        if ex.resources.len() > 16 {
            p.push(Error::invalid("execution.resources", "at most 16"));
        }
        if !(1..=86_400).contains(&ex.rate_limit_max_wait_seconds) {
            p.push(Error::invalid("execution.rate_limit_max_wait_seconds", "must be in 1..=86400"));
        }
        if let Some(l) = &ex.limits {
            if l.memory_max.is_some_and(|m| m < 4 << 20) {
                p.push(Error::invalid("execution.limits.memory_max", "must be at least 4Mi (the agent's supervisor shares the cgroup)"));
            }
            if l.cpu.is_some_and(|c| !(c.is_finite() && (0.01..=1024.0).contains(&c))) {
                p.push(Error::invalid("execution.limits.cpu", "cores: must be in 0.01..=1024"));
            }
            if l.pids_max.is_some_and(|n| !(2..=1 << 22).contains(&n)) {
                p.push(Error::invalid(
                    "execution.limits.pids_max",
                    "must be in 2..=4194304 (the agent and its supervisor; the kernel's PID_MAX_LIMIT)",
                ));
            }
        }
        if self.labels.len() > 32 {
            p.push(Error::invalid("labels", "at most 32"));
        }
        for (k, v) in &self.labels {
            if !label_ok(k) || !label_ok(v) {
                p.push(Error::invalid(format!("labels.{k}"), "keys and values are 1 to 63 letters, digits, _ - ."));
            }
        }
        match self.context.get("params") {
            Some(serde_json::Value::Object(params)) => p.check(check_params_size("context.params", params)),
            Some(_) => p.push(Error::invalid("context.params", "must be an object")),
            None => {}
        }
        let context_bytes = json_bytes(&serde_json::Value::Object(self.context.clone()));
        if context_bytes > MAX_CONTEXT_BYTES {
            p.push(Error::invalid(
                "context",
                format!("{context_bytes} bytes of JSON; at most {MAX_CONTEXT_BYTES} (given whole to every attempt)"),
            ));
        }
        if let Some(n) = &self.notify {
            for (name, list) in [
                ("on_success", &n.on_success),
                ("on_failure", &n.on_failure),
                ("on_skipped", &n.on_skipped),
                ("on_breaker_open", &n.on_breaker_open),
            ] {
                if list.len() > MAX_SINKS_PER_EVENT {
                    p.push(Error::invalid(format!("notify.{name}"), format!("at most {MAX_SINKS_PER_EVENT} sinks (got {})", list.len())));
                }
                for (i, sink) in list.iter().enumerate() {
                    if !(sink.starts_with("http://") || sink.starts_with("https://") || sink.starts_with("webhook://"))
                        || sink.ends_with("://")
                    {
                        p.push(Error::invalid(
                            format!("notify.{name}[{i}]"),
                            format!("{sink:?} is not an http(s):// URL or webhook://NAME sink"),
                        ));
                    }
                    let field = format!("notify.{name}[{i}]");
                    match sink.strip_prefix("webhook://") {
                        Some(sink_name) => p.check(validate_id(&field, sink_name)),
                        None => {
                            if let Err(e) = reqwest::Url::parse(sink) {
                                p.push(Error::invalid(field, format!("{sink:?} is not a valid URL: {e}")));
                            }
                        }
                    }
                }
            }
        }
        if let Some(h) = &self.history {
            if let Some(n) = h.keep_last
                && !(1..=MAX_KEEP_LAST).contains(&n)
            {
                p.push(Error::invalid("history.keep_last", format!("must be in 1..={MAX_KEEP_LAST} (got {n})")));
            }
            if let Some(age) = &h.max_age {
                match crate::schedule::parse_duration(age) {
                    Err(e) => p.push(Error::invalid("history.max_age", e)),
                    Ok(secs) if secs < MIN_MAX_AGE_SECONDS => {
                        p.push(Error::invalid("history.max_age", format!("{age:?} is shorter than 1 minute")));
                    }
                    Ok(secs) if secs > MAX_MAX_AGE_SECONDS => {
                        p.push(Error::invalid("history.max_age", format!("{age:?} is longer than 36500d (100 years)")));
                    }
                    Ok(_) => {}
                }
            }
        }
        if self.trigger.is_some() && !self.triggers.is_empty() {
            p.push(Error::invalid("triggers", "give either trigger or triggers, not both"));
        }
        // `max_runs` is counted per task (its cursor): on one time trigger.
        let bounded: Vec<usize> = (0..self.all_triggers().len())
            .filter(|i| match self.all_triggers()[*i] {
                TriggerSpec::Cron(c) => c.max_runs.is_some(),
                TriggerSpec::Interval(iv) => iv.max_runs.is_some(),
                _ => false,
            })
            .collect();
        let times = self.all_triggers().iter().filter(|t| t.is_time()).count();
        if let Some(i) = bounded.first()
            && times > 1
        {
            p.push(Error::invalid(
                format!("{}.max_runs", self.trigger_path(*i)),
                "counts the task's time slots: give it on a task with one time trigger",
            ));
        }
        for (i, t) in self.all_triggers().iter().enumerate() {
            for e in t.problems(&self.trigger_path(i)) {
                p.push(e);
            }
            if let TriggerSpec::After(a) = t {
                if a.task == self.task_id {
                    p.push(Error::invalid(format!("{}.task", self.trigger_path(i)), "a task cannot follow itself"));
                }
                // One upstream run makes one run id (`{task}.after-{run}`):
                // a second trigger on it could never start a run.
                let earlier = self.all_triggers()[..i].iter().position(|e| matches!(e, TriggerSpec::After(x) if x.task == a.task));
                if let Some(j) = earlier {
                    p.push(Error::invalid(
                        format!("{}.task", self.trigger_path(i)),
                        format!(
                            "{} follows {:?} already: one upstream run starts one run: use one after trigger with status: any",
                            self.trigger_path(j),
                            a.task
                        ),
                    ));
                }
            }
        }
    }

    /// Compiles the i-th trigger into a [`Schedule`] if it is a time
    /// trigger (`None` for the others); errors name the field.
    pub fn compile_trigger(&self, i: usize) -> Option<Result<Schedule>> {
        let t = self.all_triggers()[i].time()?;
        Some(schedule::compile(t, &self.trigger_path(i)))
    }

    /// Compiles every time trigger (the others have no schedule). Only
    /// fails for specs that skipped [`TaskSpec::validate`].
    pub fn schedules(&self) -> Result<Vec<Schedule>> {
        (0..self.all_triggers().len()).filter_map(|i| self.compile_trigger(i)).collect()
    }

    /// The topics of its event triggers.
    pub fn event_topics(&self) -> Vec<&str> {
        self.all_triggers()
            .into_iter()
            .filter_map(|t| match t {
                TriggerSpec::Event(e) => Some(e.topic.as_str()),
                _ => None,
            })
            .collect()
    }

    /// Its webhook triggers.
    pub fn webhooks(&self) -> Vec<&super::trigger::WebhookTrigger> {
        self.all_triggers()
            .into_iter()
            .filter_map(|t| match t {
                TriggerSpec::Webhook(w) => Some(w),
                _ => None,
            })
            .collect()
    }

    /// Its queue triggers.
    pub fn queues(&self) -> Vec<&super::trigger::QueueTrigger> {
        self.all_triggers()
            .into_iter()
            .filter_map(|t| match t {
                TriggerSpec::Queue(q) => Some(q),
                _ => None,
            })
            .collect()
    }

    /// Its `after` triggers: the tasks it follows.
    pub fn follows(&self) -> Vec<&super::trigger::AfterTrigger> {
        self.all_triggers()
            .into_iter()
            .filter_map(|t| match t {
                TriggerSpec::After(a) => Some(a),
                _ => None,
            })
            .collect()
    }

    /// `context.params`, or an empty object.
    pub fn params(&self) -> serde_json::Map<String, serde_json::Value> {
        match self.context.get("params") {
            Some(serde_json::Value::Object(m)) => m.clone(),
            _ => serde_json::Map::new(),
        }
    }

    /// The fields `doc` — the document this spec was read from — writes,
    /// each with the value this spec holds for it: a size in bytes where
    /// the document wrote `"512Mi"`, a resource named alone (`"search"`)
    /// as `{name: search}`, `trigger` as the first of `triggers`, numbers
    /// as the model keeps them (`cpu: 1` is `1.0`), an instant in UTC.
    /// Left out: a field the spec does not keep apart from its default
    /// when the document wrote that default (a zero `jitter_seconds` or
    /// `tokens`, an empty list, map, `prefix` or `description`), and
    /// `context` (the spec holds it as written).
    ///
    /// This is what a definition as applied is: two applies of a task are
    /// the same when their specs mean the same and these are equal
    /// ([`TaskRecord::same_as`]), and the typed `TaskDefinition` of a task
    /// carries exactly these fields (README "Definitions as applied").
    pub fn written_fields(&self, doc: &serde_json::Value) -> serde_json::Value {
        use serde_json::Value;
        /// The spec without its context, `trigger` among `triggers`.
        #[derive(Serialize)]
        struct Fields<'a> {
            task_id: &'a str,
            agent_id: &'a str,
            #[serde(skip_serializing_if = "none_or_empty")]
            description: &'a Option<String>,
            #[serde(skip_serializing_if = "BTreeMap::is_empty")]
            labels: &'a BTreeMap<String, String>,
            #[serde(skip_serializing_if = "Vec::is_empty")]
            triggers: Vec<&'a TriggerSpec>,
            execution: &'a ExecutionSpec,
            #[serde(skip_serializing_if = "Option::is_none")]
            notify: &'a Option<NotifySpec>,
            #[serde(skip_serializing_if = "Option::is_none")]
            history: &'a Option<HistorySpec>,
        }
        let fields = Fields {
            task_id: &self.task_id,
            agent_id: &self.agent_id,
            description: &self.description,
            labels: &self.labels,
            triggers: self.all_triggers(),
            execution: &self.execution,
            notify: &self.notify,
            history: &self.history,
        };
        // Serializing the model's own types cannot fail.
        let full = serde_json::to_value(&fields).unwrap_or(Value::Null);
        let Value::Object(doc) = doc else { return Value::Object(serde_json::Map::new()) };
        let mut doc: serde_json::Map<String, Value> =
            doc.iter().filter(|(k, _)| *k != "context").map(|(k, v)| (k.clone(), v.clone())).collect();
        if let Some(one) = doc.remove("trigger") {
            let mut list = vec![one];
            if let Some(Value::Array(more)) = doc.remove("triggers") {
                list.extend(more);
            }
            doc.insert("triggers".into(), Value::Array(list));
        }
        if let Some(Value::Array(uses)) = doc.get_mut("execution").and_then(|e| e.get_mut("resources")) {
            for u in uses {
                if let Value::String(name) = u {
                    *u = serde_json::json!({ "name": name });
                }
            }
        }
        project(&full, &Value::Object(doc))
    }

    /// Whether two specs mean the same: equal once a `trigger` is read as
    /// the first of `triggers` (the typed form knows only `triggers`) and
    /// the context's whole numbers as integers (`1.0` as `1`: a typed
    /// definition's `Struct` has only doubles).
    pub fn same_meaning(&self, other: &TaskSpec) -> bool {
        if self == other {
            return true;
        }
        let plain = |s: &TaskSpec| {
            let mut p = TaskSpec { trigger: None, triggers: s.all_triggers().into_iter().cloned().collect(), ..s.clone() };
            p.context.values_mut().for_each(whole_numbers);
            p
        };
        plain(self) == plain(other)
    }
}

/// Turns every whole-valued float of `v` that an `f64` holds exactly
/// (|x| < 2^53) into an integer, recursively.
fn whole_numbers(v: &mut serde_json::Value) {
    use serde_json::Value;
    match v {
        Value::Number(n) if n.is_f64() => {
            if let Some(x) = n.as_f64().filter(|x| x.fract() == 0.0 && x.abs() < 9.007_199_254_740_992e15) {
                *v = Value::from(x as i64);
            }
        }
        Value::Array(a) => a.iter_mut().for_each(whole_numbers),
        Value::Object(o) => o.values_mut().for_each(whole_numbers),
        _ => {}
    }
}

/// `full`'s values at the keys `doc` has (recursively; lists of the same
/// length element by element).
fn project(full: &serde_json::Value, doc: &serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    match (full, doc) {
        (Value::Object(f), Value::Object(d)) => {
            Value::Object(d.iter().filter_map(|(k, dv)| f.get(k).map(|fv| (k.clone(), project(fv, dv)))).collect())
        }
        (Value::Array(f), Value::Array(d)) if f.len() == d.len() => Value::Array(f.iter().zip(d).map(|(fv, dv)| project(fv, dv)).collect()),
        _ => full.clone(),
    }
}

/// A validated definition as it was applied: what it means (`spec`,
/// every default filled) and the document the user wrote (`applied`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Definition {
    /// The validated spec.
    pub spec: TaskSpec,
    /// The JSON document applied (a task file's, or a typed definition's
    /// fields set), as written.
    pub applied: serde_json::Value,
}

impl Definition {
    /// Parses and validates one definition ([`TaskSpec::from_json`]),
    /// keeping the document.
    ///
    /// Errors: those of [`TaskSpec::from_json`].
    pub fn from_json(text: &str) -> Result<Definition> {
        TaskSpec::parse(text).map(|(spec, applied)| Definition { spec, applied })
    }
}

/// Most problems one definition's error lists.
pub const MAX_PROBLEMS: usize = 20;

/// The problems found in one definition, in order.
#[derive(Debug, Default)]
struct Problems(Vec<Error>);

impl Problems {
    fn push(&mut self, e: Error) {
        if self.0.len() < MAX_PROBLEMS {
            self.0.push(e);
        }
    }

    fn check(&mut self, r: Result<()>) {
        if let Err(e) = r {
            self.push(e);
        }
    }

    fn len(&self) -> usize {
        self.0.len()
    }

    /// The first problem, its reason listing the others (`also FIELD:
    /// REASON`, one a line).
    fn into_result(self) -> Result<()> {
        let mut it = self.0.into_iter();
        let Some(first) = it.next() else { return Ok(()) };
        let rest: Vec<String> = it.map(|e| format!("also {e}")).collect();
        if rest.is_empty() {
            return Err(first);
        }
        Err(match first {
            Error::InvalidArgument { field, reason } => Error::invalid(field, format!("{reason}\n{}", rest.join("\n"))),
            other => other,
        })
    }
}

/// Removes from `v` the element at `path` (map keys and `[i]` indexes),
/// or, with `unknown`, that key of the object at `path`. Returns false when
/// there is nothing to remove there (the error cannot be stepped over).
fn remove_at(v: &mut serde_json::Value, path: &[String], unknown: Option<&str>) -> bool {
    let (target, last) = match unknown {
        // serde_path_to_error names the unknown key itself, or its parent.
        Some(k) if path.last().is_none_or(|l| l != k) => (path, Some(k.to_string())),
        _ => match path.split_last() {
            Some((last, parent)) => (parent, Some(last.clone())),
            None => return false,
        },
    };
    let mut cur = v;
    for seg in target {
        let next = match (seg.strip_prefix('[').and_then(|s| s.strip_suffix(']')).and_then(|i| i.parse::<usize>().ok()), cur) {
            (Some(i), serde_json::Value::Array(a)) => a.get_mut(i),
            (None, serde_json::Value::Object(o)) => o.get_mut(seg),
            _ => None,
        };
        let Some(n) = next else { return false };
        cur = n;
    }
    let Some(last) = last else { return false };
    match (last.strip_prefix('[').and_then(|s| s.strip_suffix(']')).and_then(|i| i.parse::<usize>().ok()), cur) {
        (Some(i), serde_json::Value::Array(a)) if i < a.len() => {
            a.remove(i);
            true
        }
        (None, serde_json::Value::Object(o)) => o.remove(&last).is_some(),
        _ => false,
    }
}

/// Never called: [`Problems::into_result`] is an error whenever problems
/// were found, which is when this stands in for a spec.
fn unreachable_spec() -> TaskSpec {
    TaskSpec {
        task_id: String::new(),
        agent_id: String::new(),
        description: None,
        labels: BTreeMap::new(),
        trigger: None,
        triggers: Vec::new(),
        execution: ExecutionSpec::default(),
        context: serde_json::Map::new(),
        notify: None,
        history: None,
    }
}

/// Whether `s` may be a task label's key or value: 1 to 63 letters,
/// digits, `_ - .`.
pub fn label_ok(s: &str) -> bool {
    !s.is_empty() && s.len() <= 63 && s.chars().all(|c| c.is_ascii_alphanumeric() || "_-.".contains(c))
}

/// Ids are 1..=128 of `[A-Za-z0-9_-]`: they appear in store keys and run ids.
pub fn validate_id(field: &str, id: &str) -> Result<()> {
    if id.is_empty() {
        return Err(Error::invalid(field, "must not be empty"));
    }
    if id.chars().count() > MAX_TASK_ID_LEN {
        return Err(Error::invalid(field, format!("longer than {MAX_TASK_ID_LEN} characters")));
    }
    if let Some(c) = id.chars().find(|c| !(c.is_ascii_alphanumeric() || *c == '_' || *c == '-')) {
        return Err(Error::invalid(field, format!("{id:?} has {c:?}; use letters, digits, '_' and '-'")));
    }
    Ok(())
}

/// serde's messages end with " at line 1 column 7"; the field path says where.
pub(crate) fn clean_serde_message(msg: &str) -> String {
    match msg.rfind(" at line ") {
        Some(i) => msg[..i].to_string(),
        None => msg.to_string(),
    }
}

/// A task as stored under `tasks/{task_id}`: the spec plus user-controlled state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskRecord {
    /// The validated definition.
    pub spec: TaskSpec,
    /// The document applied, as written ([`Definition::applied`]). Absent
    /// in records written before it was kept (then the spec stands for it:
    /// [`TaskRecord::applied_doc`]); the engine, which needs only the
    /// spec, drops it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub applied: Option<serde_json::Value>,
    /// Paused tasks fire nothing.
    #[serde(default)]
    pub paused: bool,
    /// When it was last paused (UTC).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused_at: Option<DateTime<Utc>>,
    /// Why, when the scheduler paused it (a budget with `on_exceeded:
    /// pause`); empty for a user's pause.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub paused_reason: String,
    /// When it was last resumed (UTC); slots up to here are covered by a
    /// `paused` SKIPPED record.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resumed_at: Option<DateTime<Utc>>,
    /// First apply (UTC); kept across re-applies. Slots start after it.
    pub created_at: DateTime<Utc>,
    /// Last apply, pause or resume (UTC).
    pub updated_at: DateTime<Utc>,
}

impl TaskRecord {
    /// The record a definition makes, with nothing paused, at `now`.
    pub fn new(def: Definition, now: DateTime<Utc>) -> TaskRecord {
        TaskRecord {
            spec: def.spec,
            applied: Some(def.applied),
            paused: false,
            paused_at: None,
            paused_reason: String::new(),
            resumed_at: None,
            created_at: now,
            updated_at: now,
        }
    }

    /// The definition as applied: the document kept, or, in a record
    /// written before documents were kept, the spec serialized (every
    /// default filled: all that is known of it).
    pub fn applied_doc(&self) -> serde_json::Value {
        match &self.applied {
            Some(doc) => doc.clone(),
            None => serde_json::to_value(&self.spec).unwrap_or(serde_json::Value::Null),
        }
    }

    /// [`TaskSpec::written_fields`] of the definition as applied.
    pub fn written_fields(&self) -> serde_json::Value {
        match &self.applied {
            Some(doc) => self.spec.written_fields(doc),
            None => self.spec.written_fields(&self.applied_doc()),
        }
    }

    /// Whether applying `def` leaves this record as it is: the same
    /// meaning and the same fields written (with the same values), however
    /// they were spelled (`"512Mi"` or `536870912`, `trigger` or
    /// `triggers`, a task file's JSON or a typed definition).
    pub fn same_as(&self, def: &Definition) -> bool {
        self.spec.same_meaning(&def.spec) && self.written_fields() == def.spec.written_fields(&def.applied)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by breaking it: a definition nested 127 deep validated, and its
    /// stored record (one level more) could never be read again.
    #[test]
    fn a_definition_nested_too_deep_is_refused() {
        let nested = |depth: usize| {
            format!(r#"{{"task_id": "deep", "agent_id": "a", "context": {{"x": {}1{}}}}}"#, "[".repeat(depth), "]".repeat(depth))
        };
        assert!(TaskSpec::from_json(&nested(MAX_SPEC_DEPTH - 2)).is_ok());
        let e = TaskSpec::from_json(&nested(125)).expect_err("too deep").to_string();
        assert!(e.contains("nested 127 levels deep; at most 64"), "{e}");
        // Brackets inside strings are text, not nesting.
        let text = format!(r#"{{"task_id": "t", "agent_id": "a", "description": "{}"}}"#, "[".repeat(200));
        assert!(TaskSpec::from_json(&text).is_ok());
    }

    /// Issue 19: params over the record were trimmed and a retry got a
    /// marker instead. Inputs over their limit are refused, naming the
    /// field and the limit; at the limit they are accepted.
    #[test]
    fn params_and_context_over_their_limits_are_refused() {
        let with_params =
            |n: usize| format!(r#"{{"task_id": "t", "agent_id": "a", "context": {{"params": {{"p": "{}"}}}}}}"#, "x".repeat(n));
        assert!(TaskSpec::from_json(&with_params(MAX_PARAMS_BYTES - 16)).is_ok());
        match TaskSpec::from_json(&with_params(MAX_PARAMS_BYTES)) {
            Err(Error::InvalidArgument { field, reason }) => {
                assert_eq!(field, "context.params");
                assert!(reason.contains(&format!("at most {MAX_PARAMS_BYTES}")), "{reason}");
            }
            other => panic!("{other:?}"),
        }
        let big_context = format!(r#"{{"task_id": "t", "agent_id": "a", "context": {{"doc": "{}"}}}}"#, "x".repeat(MAX_CONTEXT_BYTES));
        assert_eq!(err_field(&big_context), "context");
    }

    /// `execution.limits`: sizes with units, and each bad value named.
    #[test]
    fn execution_limits_are_checked() {
        let with = |l: &str| format!(r#"{{"task_id": "t", "agent_id": "a", "execution": {{"limits": {l}}}}}"#);
        let ok = TaskSpec::from_json(&with(r#"{"memory_max": "64Mi", "cpu": 0.5, "pids_max": 32}"#)).expect("valid");
        assert_eq!(ok.execution.limits, Some(LimitsSpec { memory_max: Some(64 << 20), cpu: Some(0.5), pids_max: Some(32) }));
        assert_eq!(
            TaskSpec::from_json(&with(r#"{"memory_max": 8388608}"#)).expect("bytes").execution.limits.and_then(|l| l.memory_max),
            Some(8 << 20)
        );
        assert_eq!(err_field(&with(r#"{"memory_max": "1Ki"}"#)), "execution.limits.memory_max");
        assert_eq!(err_field(&with(r#"{"cpu": 5000}"#)), "execution.limits.cpu");
        assert_eq!(err_field(&with(r#"{"pids_max": 1}"#)), "execution.limits.pids_max");
        // Found by breaking it: the kernel refused 5000000, and the agent ran without any limit.
        assert_eq!(err_field(&with(r#"{"pids_max": 5000000}"#)), "execution.limits.pids_max");
        assert!(TaskSpec::from_json(&with(r#"{"memory_max": "lots"}"#)).is_err());
    }

    /// Issue 34, point 11: what a definition writes, with what it means.
    #[test]
    fn written_fields_are_what_the_document_wrote_as_the_spec_reads_it() {
        let doc: serde_json::Value = serde_json::from_str(
            r#"{"task_id": "t", "agent_id": "a", "description": "", "labels": {},
                "trigger": {"type": "cron", "expr": "0 * * * *", "jitter_seconds": 0},
                "execution": {"limits": {"memory_max": "512Mi", "cpu": 1}, "resources": ["search", {"name": "llm", "units": 1, "tokens": 0}],
                              "selector": {"labels": {}}, "retry_backoff": {"base_seconds": 3}},
                "context": {"params": {"a": 1}}}"#,
        )
        .expect("json");
        let def = Definition::from_json(&doc.to_string()).expect("valid");
        let want = serde_json::json!({"task_id": "t", "agent_id": "a",
            "triggers": [{"type": "cron", "expr": "0 * * * *"}],
            "execution": {"limits": {"memory_max": 536870912u64, "cpu": 1.0}, "resources": [{"name": "search"}, {"name": "llm", "units": 1}],
                          "selector": {}, "retry_backoff": {"base_seconds": 3.0}}});
        assert_eq!(def.spec.written_fields(&def.applied), want);
        assert_eq!(def.applied, doc, "the document is kept as written");
    }

    const SEED: &str = r#"{ "task_id": "daily_report_001", "agent_id": "report_agent",
  "trigger": { "type": "cron", "expr": "0 30 8 * * *", "timezone": "Asia/Shanghai" },
  "execution": { "timeout_seconds": 600, "max_retries": 3, "concurrency_limit": 2 },
  "context": { "params": { "region": "cn-north", "output_format": "markdown" } },
  "notify": { "on_success": ["webhook://report-sink"], "on_failure": ["webhook://alert"] } }"#;

    #[test]
    fn seed_task_is_accepted_as_is() {
        let spec = TaskSpec::from_json(SEED).expect("seed parses");
        assert_eq!(spec.execution.timeout_seconds, 600);
        assert_eq!(spec.execution.max_retries, 3);
        assert_eq!(spec.execution.concurrency_limit, 2);
        assert_eq!(spec.execution.misfire_grace_seconds, 60);
        assert_eq!(spec.params()["region"], "cn-north");
    }

    fn err_field(json: &str) -> String {
        match TaskSpec::from_json(json) {
            Err(Error::InvalidArgument { field, .. }) => field,
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    #[test]
    fn unknown_fields_are_named() {
        let j = SEED.replace("\"max_retries\"", "\"max_retrys\"");
        assert_eq!(err_field(&j), "execution.max_retrys");
        let j = SEED.replace("\"notify\"", "\"notifyy\"");
        assert_eq!(err_field(&j), "notifyy");
        let j = SEED.replace("\"timezone\": \"Asia/Shanghai\"", "\"timezone\": \"Asia/Shanghai\", \"foo\": 1");
        assert_eq!(err_field(&j), "trigger.foo");
        let interval = |t: &str| SEED.replace(r#"{ "type": "cron", "expr": "0 30 8 * * *", "timezone": "Asia/Shanghai" }"#, t);
        assert_eq!(err_field(&interval(r#"{"type": "interval", "every_seconds": -10}"#)), "trigger.every_seconds");
        assert_eq!(err_field(&interval(r#"{"type": "once", "at": "tomorrow"}"#)), "trigger.at");
        let e = TaskSpec::from_json(&interval(r#"{"type": "once", "at": "tomorrow"}"#)).expect_err("bad").to_string();
        assert!(e.contains("expected an RFC 3339 instant such as"), "{e}");
        let e = TaskSpec::from_json(&interval(r#"{"type": "once", "at": "2026-12-31T23:59:60Z"}"#)).expect_err("leap").to_string();
        assert!(e.starts_with("trigger.at: is a leap second"), "{e}");
        assert_eq!(err_field(&interval(r#"{"type": "weekly"}"#)), "trigger.type");
    }

    /// Issue 19: a definition's error named only its first problem; a
    /// user fixed one and met the next. Every problem is listed, structural
    /// (unknown fields, wrong types) and semantic alike; the first is the
    /// error's field.
    #[test]
    fn every_problem_of_a_definition_is_listed() {
        let j = r#"{"task_id": "bad id", "agent_id": "a", "colour": "blue",
            "execution": {"timeout_seconds": "ten", "max_retrys": 3},
            "trigger": {"type": "cron", "expr": "61 * * * *"}}"#;
        let e = TaskSpec::from_json(j).expect_err("bad");
        let Error::InvalidArgument { field, reason } = &e else { panic!("{e:?}") };
        assert_eq!(field, "colour");
        for want in ["also execution.timeout_seconds:", "also execution.max_retrys:"] {
            assert!(reason.contains(want), "{want} in {reason}");
        }
        // Structure fixed: the semantic problems, all of them.
        let j = r#"{"task_id": "bad id", "agent_id": "", "execution": {"timeout_seconds": 0, "priority": 5000},
            "trigger": {"type": "cron", "expr": "61 * * * *"}}"#;
        let e = TaskSpec::from_json(j).expect_err("bad").to_string();
        assert!(e.starts_with("task_id: "), "{e}");
        for want in ["also agent_id:", "also execution.timeout_seconds:", "also execution.priority:", "also trigger.expr:"] {
            assert!(e.contains(want), "{want} in {e}");
        }
    }

    #[test]
    fn bad_values_are_named() {
        assert_eq!(err_field(&SEED.replace("600", "0")), "execution.timeout_seconds");
        assert_eq!(err_field(&SEED.replace("600", "-5")), "execution.timeout_seconds");
        assert_eq!(err_field(&SEED.replace("Asia/Shanghai", "Mars/Olympus")), "trigger.timezone");
        assert_eq!(err_field(&SEED.replace("0 30 8 * * *", "0 0 30 2 *")), "trigger.expr");
        assert_eq!(err_field(&SEED.replace("daily_report_001", "daily report")), "task_id");
        assert_eq!(err_field(&SEED.replace("webhook://alert", "mailto:x")), "notify.on_failure[0]");
        assert_eq!(err_field(&SEED.replace("\"concurrency_limit\": 2", "\"concurrency_limit\": 0")), "execution.concurrency_limit");
    }

    /// Issue 6: `priority: -2147483648` overflowed a negation in dispatch
    /// ordering (and panicked a debug engine at every restart).
    #[test]
    fn priority_and_start_timeout_are_bounded() {
        let with = |extra: &str| SEED.replace("\"max_retries\": 3", &format!("\"max_retries\": 3, {extra}"));
        assert_eq!(err_field(&with(r#""priority": -2147483648"#)), "execution.priority");
        assert_eq!(err_field(&with(r#""priority": 1001"#)), "execution.priority");
        TaskSpec::from_json(&with(r#""priority": -1000"#)).expect("lower bound accepted");
        TaskSpec::from_json(&with(r#""priority": 1000"#)).expect("upper bound accepted");
        assert_eq!(err_field(&with(r#""start_timeout_seconds": 0"#)), "execution.start_timeout_seconds");
        let spec = TaskSpec::from_json(SEED).expect("seed");
        assert_eq!(spec.execution.start_timeout_seconds, 3600);
        assert_eq!(spec.execution.circuit_breaker, None);
        let cb = |v: &str| with(&format!(r#""circuit_breaker": {v}"#));
        assert_eq!(err_field(&cb(r#"{"failure_threshold": 0, "cooldown_seconds": 10}"#)), "execution.circuit_breaker.failure_threshold");
        assert_eq!(err_field(&cb(r#"{"failure_threshold": 3, "cooldown_seconds": 0}"#)), "execution.circuit_breaker.cooldown_seconds");
        assert_eq!(err_field(&cb(r#"{"failure_threshold": 3}"#)), "execution.circuit_breaker");
        let ok = TaskSpec::from_json(&cb(r#"{"failure_threshold": 3, "cooldown_seconds": 10}"#)).unwrap();
        assert_eq!(ok.execution.circuit_breaker, Some(CircuitBreakerSpec { failure_threshold: 3, cooldown_seconds: 10 }));
    }

    /// Values that validated but overflowed the engine's time arithmetic
    /// (found by breaking it): each is rejected, naming the field.
    #[test]
    fn values_that_would_overflow_time_arithmetic_are_rejected() {
        assert_eq!(err_field(&SEED.replace("600", "9223372036854775807")), "execution.timeout_seconds");
        let with = |extra: &str| SEED.replace("\"max_retries\": 3", &format!("\"max_retries\": 3, {extra}"));
        assert_eq!(
            err_field(&with(r#""retry_backoff": {"base_seconds": 1e300, "cap_seconds": 1e308}"#)),
            "execution.retry_backoff.base_seconds"
        );
        assert_eq!(err_field(&with(r#""misfire_grace_seconds": 18446744073709551615"#)), "execution.misfire_grace_seconds");
        let interval = |t: &str| SEED.replace(r#"{ "type": "cron", "expr": "0 30 8 * * *", "timezone": "Asia/Shanghai" }"#, t);
        assert_eq!(
            err_field(&interval(r#"{"type": "interval", "every": "10s", "jitter_seconds": 100000000000000}"#)),
            "trigger.jitter_seconds"
        );
        assert_eq!(err_field(&interval(r#"{"type": "interval", "every": "10s", "jitter_seconds": 10}"#)), "trigger.jitter_seconds");
        let both = SEED.replace(r#""execution""#, r#""triggers": [{"type": "once", "at": "2030-01-01T00:00:00Z"}], "execution""#);
        assert_eq!(err_field(&both), "triggers");
    }

    /// Issue 34, finding 16: a type error hid every other problem of the
    /// definition (only `max_retries` was named); each is listed.
    #[test]
    fn type_errors_do_not_hide_the_other_problems() {
        let j = r#"{"task_id": "bad", "agent_id": "a",
            "trigger": {"type": "cron", "expr": "0 0 * * *", "timezone": "Nowhere/City"},
            "execution": {"max_retries": "three", "timeout_seconds": "ten", "concurrency_limit": 0, "priority": 5000}}"#;
        let e = TaskSpec::from_json(j).expect_err("invalid").to_string();
        for field in
            ["execution.max_retries", "execution.timeout_seconds", "execution.priority", "execution.concurrency_limit", "trigger.timezone"]
        {
            assert!(e.contains(field), "{field} not named: {e}");
        }
    }
}
