//! The retry policy: whether a failed attempt is retried, and when.
//!
//! Delay before retry `k` (1-based) is `min(base * 2^(k-1), cap)` plus a
//! jitter uniform in `[0, jitter)` seconds (DESIGN "retry_backoff"). The
//! jitter is derived from the run id and `k` (FNV-1a), so deciding twice
//! gives the same instant and unit tests need no random source.

use chrono::{DateTime, Duration, Utc};

use crate::model::task::RetryBackoff;

/// Delay before retry `k` (1-based), in seconds without jitter:
/// `min(base * 2^(k-1), cap)`.
pub fn backoff_base(b: &RetryBackoff, k: u32) -> f64 {
    let exp = 2f64.powi(k.saturating_sub(1).min(62) as i32);
    (b.base_seconds * exp).min(b.cap_seconds)
}

/// A value uniform in `[0, 1)` derived from `seed` and `k`.
fn unit(seed: &str, k: u32) -> f64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in seed.bytes().chain(k.to_le_bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    (h >> 11) as f64 / (1u64 << 53) as f64
}

/// Delay before retry `k` of the run `seed`: [`backoff_base`] + jitter.
pub fn backoff(b: &RetryBackoff, k: u32, seed: &str) -> Duration {
    let jitter = if b.jitter_seconds > 0.0 { unit(seed, k) * b.jitter_seconds } else { 0.0 };
    Duration::milliseconds(((backoff_base(b, k) + jitter) * 1000.0).round() as i64)
}

/// What to do after a counted attempt failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryDecision {
    /// Retry at this instant (UTC).
    RetryAt(DateTime<Utc>),
    /// No retry left: the run ends.
    GiveUp,
}

/// `counted` attempts ran and the last one failed: retry while
/// `counted <= max_retries` (the first attempt is not a retry).
pub fn decide(now: DateTime<Utc>, counted: u32, max_retries: u32, b: &RetryBackoff, seed: &str) -> RetryDecision {
    if counted > max_retries {
        return RetryDecision::GiveUp;
    }
    RetryDecision::RetryAt(now.checked_add_signed(backoff(b, counted, seed)).unwrap_or(DateTime::<Utc>::MAX_UTC))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_the_cap_with_bounded_jitter() {
        let b = RetryBackoff { base_seconds: 2.0, cap_seconds: 10.0, jitter_seconds: 0.0 };
        let got: Vec<f64> = (1..=5).map(|k| backoff_base(&b, k)).collect();
        assert_eq!(got, vec![2.0, 4.0, 8.0, 10.0, 10.0]);
        let j = RetryBackoff { base_seconds: 2.0, cap_seconds: 10.0, jitter_seconds: 0.5 };
        let mut distinct = std::collections::HashSet::new();
        for i in 0..200 {
            let d = backoff(&j, 1, &format!("run-{i}")).num_milliseconds();
            assert!((2000..2500).contains(&d), "{d}");
            distinct.insert(d);
        }
        assert!(distinct.len() > 50, "jitter spreads runs: {}", distinct.len());
        assert_eq!(backoff(&j, 1, "r"), backoff(&j, 1, "r"), "deterministic");
    }

    #[test]
    fn retries_while_counted_attempts_within_max_retries() {
        let now: DateTime<Utc> = "2026-12-01T00:00:00Z".parse().expect("t");
        let b = RetryBackoff { base_seconds: 3.0, cap_seconds: 60.0, jitter_seconds: 0.0 };
        assert_eq!(decide(now, 1, 0, &b, "r"), RetryDecision::GiveUp);
        assert_eq!(decide(now, 1, 2, &b, "r"), RetryDecision::RetryAt(now + Duration::seconds(3)));
        assert_eq!(decide(now, 2, 2, &b, "r"), RetryDecision::RetryAt(now + Duration::seconds(6)));
        assert_eq!(decide(now, 3, 2, &b, "r"), RetryDecision::GiveUp);
    }
}
