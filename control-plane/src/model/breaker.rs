//! The circuit breaker of one task (`execution.circuit_breaker`): a pure
//! state machine, stored with the task's cursor so that it survives a
//! leader failover, and driven by the engine core.
//!
//! The classic three states (Nygard, *Release It!*; the shape of
//! Hystrix and resilience4j):
//! - **closed**: runs are admitted; each FAILED or TIMEOUT run adds to
//!   `consecutive_failures`, a SUCCEEDED run resets it; at
//!   `failure_threshold` the breaker **opens** for `cooldown_seconds`.
//! - **open**: every new run (slot, manual trigger) is SKIPPED with reason
//!   `circuit_open`. Once the cooldown is over, the next run admitted is the
//!   **trial** and the breaker is **half-open**.
//! - **half-open**: new runs are SKIPPED until the trial finishes: SUCCEEDED
//!   closes the breaker, FAILED or TIMEOUT opens it again (a new opening),
//!   CANCELLED lets the next run be the trial.
//!
//! While open or half-open, runs that were already active when it opened
//! finish without changing it: only the trial decides. CANCELLED and
//! SKIPPED runs never count.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::RunStatus;
use super::task::CircuitBreakerSpec;

/// The breaker's phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BreakerPhase {
    /// Runs are admitted.
    #[default]
    Closed,
    /// Runs are skipped (`circuit_open`) until `open_until`, then the next
    /// one is the trial.
    Open,
    /// The trial run is active; others are skipped.
    HalfOpen,
}

impl BreakerPhase {
    /// Lower-case name, as stored and shown: `closed`, `open`, `half_open`.
    pub fn as_str(self) -> &'static str {
        match self {
            BreakerPhase::Closed => "closed",
            BreakerPhase::Open => "open",
            BreakerPhase::HalfOpen => "half_open",
        }
    }
}

/// A task's breaker, stored in its cursor (`schedule/{task_id}`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Breaker {
    /// Phase.
    pub phase: BreakerPhase,
    /// FAILED or TIMEOUT runs in a row (reset by a SUCCEEDED run or a reset).
    pub consecutive_failures: u32,
    /// When the current (or last) opening began (UTC).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub opened_at: Option<DateTime<Utc>>,
    /// End of the cooldown (UTC): from then on the next run is the trial.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub open_until: Option<DateTime<Utc>>,
    /// The half-open trial run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trial_run_id: Option<String>,
    /// How many times it opened since the task was created (each opening
    /// fires `notify.on_breaker_open` once).
    #[serde(default)]
    pub openings: u64,
    /// The run whose failure last counted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_failure_run_id: Option<String>,
}

/// What the breaker says about a new run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admission {
    /// Admit it.
    Allow,
    /// Admit it as the half-open trial (call [`Breaker::trial_started`] if
    /// it was created).
    Trial,
    /// Skip it (`circuit_open`), with this explanation.
    Skip(String),
}

/// What a finished run did to the breaker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// Nothing stored changed.
    None,
    /// Counters changed; the phase did not.
    Counted,
    /// It opened (from closed, or a failed trial): a new opening.
    Opened,
    /// The trial succeeded: closed.
    Closed,
    /// The trial was cancelled: the next run is the trial.
    TrialCancelled,
}

impl Breaker {
    /// Whether a new run may start now (UTC).
    pub fn admission(&self, now: DateTime<Utc>) -> Admission {
        match self.phase {
            BreakerPhase::Closed => Admission::Allow,
            BreakerPhase::Open => match self.open_until {
                Some(until) if now < until => Admission::Skip(format!(
                    "circuit breaker open after {} failed run(s) in a row; the next run after {} is a trial",
                    self.consecutive_failures,
                    until.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
                )),
                _ => Admission::Trial,
            },
            BreakerPhase::HalfOpen => Admission::Skip(format!(
                "circuit breaker half-open: waiting for the trial run {}",
                self.trial_run_id.as_deref().unwrap_or("?")
            )),
        }
    }

    /// The trial run was created: half-open.
    pub fn trial_started(&mut self, run_id: &str) {
        self.phase = BreakerPhase::HalfOpen;
        self.trial_run_id = Some(run_id.to_string());
    }

    /// A run of the task finished with `status` at `now` (UTC).
    pub fn run_finished(&mut self, spec: &CircuitBreakerSpec, run_id: &str, status: RunStatus, now: DateTime<Utc>) -> Change {
        let failed = matches!(status, RunStatus::Failed | RunStatus::Timeout);
        let is_trial = self.trial_run_id.as_deref() == Some(run_id);
        match self.phase {
            BreakerPhase::Closed => {
                if failed {
                    self.consecutive_failures = self.consecutive_failures.saturating_add(1);
                    self.last_failure_run_id = Some(run_id.to_string());
                    if self.consecutive_failures >= spec.failure_threshold {
                        self.open(spec, now);
                        return Change::Opened;
                    }
                    Change::Counted
                } else if status == RunStatus::Succeeded && self.consecutive_failures > 0 {
                    self.consecutive_failures = 0;
                    Change::Counted
                } else {
                    Change::None
                }
            }
            BreakerPhase::HalfOpen if is_trial => match status {
                RunStatus::Succeeded => {
                    self.close();
                    Change::Closed
                }
                _ if failed => {
                    self.consecutive_failures = self.consecutive_failures.saturating_add(1);
                    self.last_failure_run_id = Some(run_id.to_string());
                    self.open(spec, now);
                    Change::Opened
                }
                _ => {
                    // Cancelled: no verdict; the next run is the trial.
                    self.phase = BreakerPhase::Open;
                    self.trial_run_id = None;
                    Change::TrialCancelled
                }
            },
            _ => Change::None,
        }
    }

    /// The trial run is gone without finishing here (not among the runs a
    /// new leader loaded): the next run is the trial.
    pub fn trial_lost(&mut self) {
        if self.phase == BreakerPhase::HalfOpen {
            self.phase = BreakerPhase::Open;
            self.trial_run_id = None;
        }
    }

    /// Closed by hand (`ResetBreaker`) or by a successful trial.
    pub fn close(&mut self) {
        self.phase = BreakerPhase::Closed;
        self.consecutive_failures = 0;
        self.open_until = None;
        self.trial_run_id = None;
    }

    fn open(&mut self, spec: &CircuitBreakerSpec, now: DateTime<Utc>) {
        self.phase = BreakerPhase::Open;
        self.opened_at = Some(now);
        self.open_until = now.checked_add_signed(chrono::Duration::seconds(spec.cooldown_seconds as i64));
        self.trial_run_id = None;
        self.openings += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + s, 0).unwrap()
    }

    const SPEC: CircuitBreakerSpec = CircuitBreakerSpec { failure_threshold: 3, cooldown_seconds: 10 };

    #[test]
    fn opens_after_threshold_failures_in_a_row_and_a_success_resets_the_count() {
        let mut b = Breaker::default();
        assert_eq!(b.run_finished(&SPEC, "r1", RunStatus::Failed, t(1)), Change::Counted);
        assert_eq!(b.run_finished(&SPEC, "r2", RunStatus::Succeeded, t(2)), Change::Counted);
        assert_eq!(b.consecutive_failures, 0);
        assert_eq!(b.run_finished(&SPEC, "r3", RunStatus::Cancelled, t(3)), Change::None);
        assert_eq!(b.run_finished(&SPEC, "r4", RunStatus::Failed, t(4)), Change::Counted);
        assert_eq!(b.run_finished(&SPEC, "r5", RunStatus::Timeout, t(5)), Change::Counted);
        assert_eq!(b.admission(t(5)), Admission::Allow);
        assert_eq!(b.run_finished(&SPEC, "r6", RunStatus::Failed, t(6)), Change::Opened);
        assert_eq!((b.phase, b.openings, b.open_until), (BreakerPhase::Open, 1, Some(t(16))));
        assert!(matches!(b.admission(t(15)), Admission::Skip(_)));
        assert_eq!(b.admission(t(16)), Admission::Trial);
    }

    #[test]
    fn the_trial_decides_and_other_runs_do_not() {
        let mut b = Breaker::default();
        for i in 0..3 {
            b.run_finished(&SPEC, &format!("r{i}"), RunStatus::Failed, t(i));
        }
        // A run active when it opened finishes: no change.
        assert_eq!(b.run_finished(&SPEC, "old", RunStatus::Succeeded, t(5)), Change::None);
        b.trial_started("trial1");
        assert!(matches!(b.admission(t(100)), Admission::Skip(s) if s.contains("trial1")));
        assert_eq!(b.run_finished(&SPEC, "other", RunStatus::Failed, t(20)), Change::None);
        // A failed trial is a new opening.
        assert_eq!(b.run_finished(&SPEC, "trial1", RunStatus::Failed, t(20)), Change::Opened);
        assert_eq!((b.phase, b.openings, b.open_until), (BreakerPhase::Open, 2, Some(t(30))));
        // A cancelled trial leaves the next run to be the trial.
        b.trial_started("trial2");
        assert_eq!(b.run_finished(&SPEC, "trial2", RunStatus::Cancelled, t(31)), Change::TrialCancelled);
        assert_eq!(b.admission(t(31)), Admission::Trial);
        b.trial_started("trial3");
        assert_eq!(b.run_finished(&SPEC, "trial3", RunStatus::Succeeded, t(40)), Change::Closed);
        assert_eq!((b.phase, b.consecutive_failures, b.openings), (BreakerPhase::Closed, 0, 2));
        assert_eq!(b.admission(t(41)), Admission::Allow);
    }

    #[test]
    fn stored_form_is_stable() {
        let mut b = Breaker::default();
        for i in 0..3 {
            b.run_finished(&SPEC, &format!("r{i}"), RunStatus::Failed, t(i));
        }
        let json = serde_json::to_value(&b).unwrap();
        assert_eq!(json["phase"], "open");
        assert_eq!(json["consecutive_failures"], 3);
        assert_eq!(serde_json::from_value::<Breaker>(json).unwrap(), b);
    }
}
