//! Retries, backoff and the agent's outcome contract: what follows an
//! ended attempt. Always the last policy asked, and it always decides.
//!
//! | attempt outcome | next |
//! |---|---|
//! | `succeeded` | SUCCEEDED |
//! | `cancelled` | CANCELLED |
//! | `interrupted` (first [`MAX_FREE_INTERRUPTIONS`]) | dispatched again, free |
//! | `non_retryable`, `quota_exhausted` | FAILED now, whatever `max_retries` says |
//! | `rate_limited` | again no earlier than the agent's `retry_at`, free, until `rate_limit_max_wait_seconds` of wall clock have passed since the first rate-limited attempt in a row: then FAILED |
//! | `failed`, `lost`, `timeout`, more interruptions | again after `retry_backoff` — and no earlier than the agent's `retry_at` when it gave one (an HTTP agent's `Retry-After`) — while `max_retries` allow, else FAILED (TIMEOUT) |
//!
//! The contract (README "Writing an agent") is optional fields of the
//! agent's result: `outcome`, `retry_after_seconds` or `retry_at`,
//! `resource`, `class`; [`AgentOutcome::parse`] reads them. Without them,
//! exit codes keep their meaning.

use chrono::{DateTime, Duration, Utc};

use super::{AfterAttempt, AgentOutcome, AgentOutcomeKind, AttemptQuery, Policy};
use crate::dispatch::retry::{self, RetryDecision};
use crate::model::run::{MAX_FREE_INTERRUPTIONS, Outcome};
use crate::model::task::{DEFAULT_RATE_LIMIT_MAX_WAIT_SECONDS, RetryBackoff};
use crate::model::{RunRecord, RunStatus};

/// Longest `class` kept: 64 characters.
pub const MAX_CLASS_CHARS: usize = 64;

/// See the module docs.
#[derive(Debug)]
pub struct Retry {
    /// Cap of an agent's `retry_at` from now (config `rate_limit_max_hold`).
    pub max_hold: Duration,
}

impl Default for Retry {
    fn default() -> Self {
        Retry { max_hold: Duration::from_std(crate::config::DEFAULT_RATE_LIMIT_MAX_HOLD).unwrap_or(Duration::hours(1)) }
    }
}

impl AgentOutcome {
    /// The contract's fields of an agent's result, if it has any; a
    /// `retry_at` (or `retry_after_seconds`) is capped at `now + max_hold`
    /// and never before `now`. Unknown `outcome` values and malformed
    /// fields are ignored (exit codes decide then).
    pub fn parse(result: Option<&serde_json::Value>, now: DateTime<Utc>, max_hold: Duration) -> AgentOutcome {
        let Some(obj) = result.and_then(serde_json::Value::as_object) else { return AgentOutcome::default() };
        let kind = match obj.get("outcome").and_then(serde_json::Value::as_str) {
            Some("success") => Some(AgentOutcomeKind::Success),
            Some("failure") => Some(AgentOutcomeKind::Failure),
            Some("non_retryable") => Some(AgentOutcomeKind::NonRetryable),
            Some("rate_limited") => Some(AgentOutcomeKind::RateLimited),
            Some("quota_exhausted") => Some(AgentOutcomeKind::QuotaExhausted),
            _ => None,
        };
        let after = obj
            .get("retry_after_seconds")
            .and_then(serde_json::Value::as_f64)
            .filter(|s| s.is_finite() && *s >= 0.0)
            .map(|s| now + Duration::milliseconds((s.min(1e9) * 1000.0) as i64));
        let at = obj.get("retry_at").and_then(serde_json::Value::as_str).and_then(|s| DateTime::parse_from_rfc3339(s).ok());
        let retry_at = at.map(|t| t.with_timezone(&Utc)).or(after).map(|t| t.clamp(now, now + max_hold));
        let text = |k: &str| {
            obj.get(k)
                .and_then(serde_json::Value::as_str)
                .map(|s| s.chars().filter(|c| !c.is_control()).take(MAX_CLASS_CHARS).collect::<String>())
                .filter(|s| !s.is_empty())
        };
        AgentOutcome { kind, retry_at, resource: text("resource"), class: text("class") }
    }

    /// The attempt's outcome, given what its runner reported (exit codes)
    /// and what the agent said: the agent's word refines a success or a
    /// failure; a timeout, cancellation, loss or interruption stands.
    pub fn refine(&self, reported: Outcome) -> Outcome {
        if !matches!(reported, Outcome::Succeeded | Outcome::Failed) {
            return reported;
        }
        match self.kind {
            Some(AgentOutcomeKind::RateLimited) => Outcome::RateLimited,
            Some(AgentOutcomeKind::QuotaExhausted) => Outcome::QuotaExhausted,
            Some(AgentOutcomeKind::NonRetryable) => Outcome::NonRetryable,
            Some(AgentOutcomeKind::Failure) => Outcome::Failed,
            // A non-zero exit is a failure whatever the result says.
            Some(AgentOutcomeKind::Success) | None => reported,
        }
    }
}

/// When the run's trailing streak of rate-limited attempts began (the
/// first one's dispatch), if its last attempt was rate limited.
pub fn rate_limited_since(run: &RunRecord) -> Option<DateTime<Utc>> {
    run.attempts.iter().rev().take_while(|a| a.outcome == Some(Outcome::RateLimited)).last().map(|a| a.dispatched_at)
}

/// The shortest wait after a `rate_limited` attempt (an agent answering
/// `retry_after_seconds: 0` in a loop would start thousands of agents).
pub const MIN_RATE_LIMIT_WAIT: Duration = Duration::seconds(1);

impl Policy for Retry {
    fn name(&self) -> &'static str {
        "retry"
    }

    fn configure(&mut self, config: &crate::config::Config) {
        self.max_hold = Duration::from_std(config.rate_limit_max_hold).unwrap_or(Duration::hours(1));
    }

    fn attempt_ended(&mut self, q: &AttemptQuery<'_>, _writes: &mut Vec<super::Write>) -> AfterAttempt {
        let run = q.run;
        let (max_retries, backoff, max_wait) = q.task.map_or((0, RetryBackoff::default(), DEFAULT_RATE_LIMIT_MAX_WAIT_SECONDS), |t| {
            (t.execution.max_retries, t.execution.retry_backoff, t.execution.rate_limit_max_wait_seconds)
        });
        let error = q.error.unwrap_or_default();
        let with_class = |what: &str| match &q.agent.class {
            Some(c) if error.is_empty() => format!("{what} ({c})"),
            Some(c) => format!("{what} ({c}): {error}"),
            None if error.is_empty() => what.to_string(),
            None => format!("{what}: {error}"),
        };
        match q.outcome {
            Outcome::Succeeded => AfterAttempt::Finish { status: RunStatus::Succeeded, why: String::new() },
            Outcome::Cancelled => AfterAttempt::Finish { status: RunStatus::Cancelled, why: q.error.unwrap_or("cancelled").to_string() },
            Outcome::Interrupted if interruptions(run) <= MAX_FREE_INTERRUPTIONS => AfterAttempt::Requeue,
            Outcome::NonRetryable => AfterAttempt::Finish { status: RunStatus::Failed, why: with_class("non_retryable, not retried") },
            Outcome::QuotaExhausted => {
                let on = q.agent.resource.as_deref().map(|r| format!(" on {r}")).unwrap_or_default();
                AfterAttempt::Finish { status: RunStatus::Failed, why: with_class(&format!("quota exhausted{on}, not retried")) }
            }
            Outcome::RateLimited => {
                let since = rate_limited_since(run).unwrap_or(q.now);
                let give_up_at = since + Duration::seconds(max_wait as i64);
                let streak = run.attempts.iter().rev().take_while(|a| a.outcome == Some(Outcome::RateLimited)).count() as u32;
                // A retry_at not in the future (retry_after_seconds 0, a
                // past instant) is no wait at all: the streak's backoff
                // stands instead, and any wait is at least MIN_RATE_LIMIT_WAIT.
                let at = match q.agent.retry_at {
                    Some(t) if t > q.now => t.max(q.now + MIN_RATE_LIMIT_WAIT),
                    _ => q.now + retry::backoff(&backoff, streak.max(1), &run.run_id).max(MIN_RATE_LIMIT_WAIT),
                };
                if at > give_up_at {
                    let waited = (q.now - since).num_seconds();
                    let why = format!(
                        "rate limited for {waited} s; the next attempt ({}) would pass rate_limit_max_wait_seconds {max_wait}",
                        at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
                    );
                    return AfterAttempt::Finish { status: RunStatus::Failed, why };
                }
                AfterAttempt::RetryAt { at, counted: false }
            }
            Outcome::Failed | Outcome::Timeout | Outcome::Lost | Outcome::Interrupted => {
                match retry::decide(q.now, run.counted_attempts(), max_retries, &backoff, &run.run_id) {
                    // An agent that said when (an HTTP agent's 503 with
                    // Retry-After) is not asked again before.
                    RetryDecision::RetryAt(at) => AfterAttempt::RetryAt { at: q.agent.retry_at.map_or(at, |t| t.max(at)), counted: true },
                    RetryDecision::GiveUp => {
                        let status = if q.outcome == Outcome::Timeout { RunStatus::Timeout } else { RunStatus::Failed };
                        AfterAttempt::Finish { status, why: error.to_string() }
                    }
                }
            }
        }
    }
}

fn interruptions(run: &RunRecord) -> u32 {
    let kept = run.attempts.iter().filter(|a| a.outcome == Some(Outcome::Interrupted)).count() as u32;
    kept.saturating_add(run.elided_attempts.interrupted)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::run::TriggerKind;
    use crate::model::{Attempt, TaskSpec};

    fn t(s: &str) -> DateTime<Utc> {
        s.parse().expect("t")
    }

    fn task(max_retries: u32, max_wait: u64) -> TaskSpec {
        let j = serde_json::json!({"task_id": "t", "agent_id": "a", "execution": {
            "max_retries": max_retries, "rate_limit_max_wait_seconds": max_wait,
            "retry_backoff": {"base_seconds": 5, "cap_seconds": 60, "jitter_seconds": 0}}});
        TaskSpec::from_json(&j.to_string()).expect("task")
    }

    /// A run whose attempts ended with these outcomes, one a minute from `t0`.
    fn run_with(outcomes: &[Outcome]) -> RunRecord {
        let t0 = t("2026-12-01T10:00:00Z");
        let mut run = RunRecord::pending("t.1".into(), "t", "a", TriggerKind::Manual, t0, t0);
        for (i, o) in outcomes.iter().enumerate() {
            let at = t0 + Duration::minutes(i as i64);
            run.attempts.push(Attempt {
                attempt: i as u32 + 1,
                execution_id: format!("e{i}"),
                dispatched_at: at,
                finished_at: Some(at),
                outcome: Some(*o),
                ..Default::default()
            });
        }
        run
    }

    fn decide(run: &RunRecord, spec: &TaskSpec, now: DateTime<Utc>, agent: &AgentOutcome) -> AfterAttempt {
        let outcome = run.attempts.last().and_then(|a| a.outcome).expect("ended");
        Retry::default().attempt_ended(&AttemptQuery { now, run, task: Some(spec), outcome, agent, error: None }, &mut Vec::new())
    }

    #[test]
    fn the_contract_is_parsed_and_capped() {
        let now = t("2026-12-01T10:00:00Z");
        let hour = Duration::hours(1);
        let r = serde_json::json!({"outcome": "rate_limited", "retry_after_seconds": 2.5, "resource": "openai", "class": "429"});
        let a = AgentOutcome::parse(Some(&r), now, hour);
        assert_eq!(a.kind, Some(AgentOutcomeKind::RateLimited));
        assert_eq!(a.retry_at, Some(now + Duration::milliseconds(2500)));
        assert_eq!((a.resource.as_deref(), a.class.as_deref()), (Some("openai"), Some("429")));
        // retry_at wins over retry_after_seconds, and is capped at the max hold.
        let r = serde_json::json!({"outcome": "rate_limited", "retry_at": "2026-12-02T10:00:00Z", "retry_after_seconds": 1});
        assert_eq!(AgentOutcome::parse(Some(&r), now, hour).retry_at, Some(now + hour));
        // A past retry_at is now; a class is cut at 64 characters.
        let r = serde_json::json!({"outcome": "rate_limited", "retry_at": "2020-01-01T00:00:00Z", "class": "x".repeat(100)});
        let a = AgentOutcome::parse(Some(&r), now, hour);
        assert_eq!(a.retry_at, Some(now));
        assert_eq!(a.class.map(|c| c.len()), Some(64));
        // Unknown outcomes and non-objects say nothing.
        assert_eq!(AgentOutcome::parse(Some(&serde_json::json!({"outcome": "meh"})), now, hour).kind, None);
        assert_eq!(AgentOutcome::parse(Some(&serde_json::json!([1])), now, hour), AgentOutcome::default());
    }

    /// Issue 22: an HTTP agent's 503 with `Retry-After` is retried (a
    /// counted attempt) no earlier than it asked, nor than the backoff.
    #[test]
    fn a_failure_that_says_when_is_not_retried_before() {
        let spec = task(2, 1800);
        let now = t("2026-12-01T10:30:00Z");
        let r = serde_json::json!({"outcome": "failure", "retry_after_seconds": 30});
        let agent = AgentOutcome::parse(Some(&r), now, Duration::hours(1));
        match decide(&run_with(&[Outcome::Failed]), &spec, now, &agent) {
            AfterAttempt::RetryAt { at, counted } => assert_eq!((at, counted), (now + Duration::seconds(30), true)),
            other => panic!("{other:?}"),
        }
        let soon = AgentOutcome::parse(Some(&serde_json::json!({"outcome": "failure", "retry_after_seconds": 1})), now, Duration::hours(1));
        match decide(&run_with(&[Outcome::Failed]), &spec, now, &soon) {
            AfterAttempt::RetryAt { at, .. } => assert_eq!(at, now + Duration::seconds(5), "the backoff (5 s) is longer"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_agent_refines_exit_codes_but_not_timeouts() {
        let said = |k| AgentOutcome { kind: Some(k), ..Default::default() };
        assert_eq!(said(AgentOutcomeKind::RateLimited).refine(Outcome::Failed), Outcome::RateLimited);
        assert_eq!(said(AgentOutcomeKind::RateLimited).refine(Outcome::Succeeded), Outcome::RateLimited);
        assert_eq!(said(AgentOutcomeKind::QuotaExhausted).refine(Outcome::Failed), Outcome::QuotaExhausted);
        assert_eq!(said(AgentOutcomeKind::NonRetryable).refine(Outcome::Failed), Outcome::NonRetryable);
        assert_eq!(said(AgentOutcomeKind::Failure).refine(Outcome::Succeeded), Outcome::Failed);
        assert_eq!(said(AgentOutcomeKind::Success).refine(Outcome::Failed), Outcome::Failed, "a non-zero exit stays a failure");
        assert_eq!(said(AgentOutcomeKind::RateLimited).refine(Outcome::Timeout), Outcome::Timeout);
        assert_eq!(AgentOutcome::default().refine(Outcome::Succeeded), Outcome::Succeeded);
    }

    #[test]
    fn each_outcome_decides() {
        let spec = task(2, 1800);
        let now = t("2026-12-01T10:30:00Z");
        let none = AgentOutcome::default();
        let finish = |d: AfterAttempt| match d {
            AfterAttempt::Finish { status, .. } => status,
            other => panic!("{other:?}"),
        };
        assert_eq!(finish(decide(&run_with(&[Outcome::Succeeded]), &spec, now, &none)), RunStatus::Succeeded);
        assert_eq!(finish(decide(&run_with(&[Outcome::Cancelled]), &spec, now, &none)), RunStatus::Cancelled);
        // Non-retryable and quota fail at once although retries are left.
        assert_eq!(finish(decide(&run_with(&[Outcome::NonRetryable]), &spec, now, &none)), RunStatus::Failed);
        assert_eq!(finish(decide(&run_with(&[Outcome::QuotaExhausted]), &spec, now, &none)), RunStatus::Failed);
        // Failures retry with backoff (5 s, 10 s) while max_retries allow.
        assert_eq!(
            decide(&run_with(&[Outcome::Failed]), &spec, now, &none),
            AfterAttempt::RetryAt { at: now + Duration::seconds(5), counted: true }
        );
        assert_eq!(
            decide(&run_with(&[Outcome::Failed, Outcome::Lost]), &spec, now, &none),
            AfterAttempt::RetryAt { at: now + Duration::seconds(10), counted: true }
        );
        assert_eq!(finish(decide(&run_with(&[Outcome::Failed, Outcome::Failed, Outcome::Timeout]), &spec, now, &none)), RunStatus::Timeout);
        // Three interruptions are free; the fourth counts.
        let i = Outcome::Interrupted;
        assert_eq!(decide(&run_with(&[i, i, i]), &spec, now, &none), AfterAttempt::Requeue);
        assert!(matches!(decide(&run_with(&[i, i, i, i]), &spec, now, &none), AfterAttempt::RetryAt { counted: true, .. }));
    }

    /// Rate-limited attempts never spend `max_retries` (0 here): the run
    /// waits for the agent's `retry_at` until the wait would pass
    /// `rate_limit_max_wait_seconds`, counted from the first in the streak.
    #[test]
    fn rate_limited_attempts_are_free_until_the_max_wait() {
        let spec = task(0, 600);
        let rl = Outcome::RateLimited;
        let run = run_with(&[rl, rl, rl]);
        let since = rate_limited_since(&run).expect("streak");
        assert_eq!(since, t("2026-12-01T10:00:00Z"));
        let now = t("2026-12-01T10:02:00Z");
        let agent =
            AgentOutcome { kind: Some(AgentOutcomeKind::RateLimited), retry_at: Some(now + Duration::seconds(2)), ..Default::default() };
        assert_eq!(decide(&run, &spec, now, &agent), AfterAttempt::RetryAt { at: now + Duration::seconds(2), counted: false });
        assert_eq!(run.counted_attempts(), 0);
        // Without retry_at: the backoff of the streak (3rd: 5 * 2^2 = 20 s).
        assert_eq!(
            decide(&run, &spec, now, &AgentOutcome::default()),
            AfterAttempt::RetryAt { at: now + Duration::seconds(20), counted: false }
        );
        // Found by an attack: retry_after_seconds 0 (or a past retry_at)
        // retried at once, 35 agents in 10 s; the streak's backoff stands.
        let now_again = AgentOutcome { retry_at: Some(now), ..agent.clone() };
        assert_eq!(decide(&run, &spec, now, &now_again), AfterAttempt::RetryAt { at: now + Duration::seconds(20), counted: false });
        let soon = AgentOutcome { retry_at: Some(now + Duration::milliseconds(10)), ..agent.clone() };
        assert_eq!(decide(&run, &spec, now, &soon), AfterAttempt::RetryAt { at: now + MIN_RATE_LIMIT_WAIT, counted: false });
        // A retry_at past 10:10 (600 s after the streak began) gives up.
        let late = AgentOutcome { retry_at: Some(t("2026-12-01T10:10:01Z")), ..agent.clone() };
        assert_eq!(
            decide(&run, &spec, now, &late),
            AfterAttempt::Finish {
                status: RunStatus::Failed,
                why: "rate limited for 120 s; the next attempt (2026-12-01T10:10:01Z) would pass rate_limit_max_wait_seconds 600".into()
            }
        );
        // A failure before the streak does not count toward the wait, but
        // it still counts against max_retries.
        let run = run_with(&[Outcome::Failed, rl]);
        assert_eq!(rate_limited_since(&run), Some(t("2026-12-01T10:01:00Z")));
        assert_eq!(run.counted_attempts(), 1);
    }
}
