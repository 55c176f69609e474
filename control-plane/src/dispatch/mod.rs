//! Dispatch helpers: the runner registry with its pure expiry function, and
//! retry backoff. The engine owns the state; these are its parts.

pub mod registry;

use rand::Rng;

use crate::model::task::RetryBackoff;

/// Delay before retry `k` (1-based), in seconds without jitter:
/// `min(base * 2^(k-1), cap)` (DESIGN "retry_backoff").
pub fn backoff_base(b: &RetryBackoff, k: u32) -> f64 {
    let exp = 2f64.powi(k.saturating_sub(1).min(62) as i32);
    (b.base_seconds * exp).min(b.cap_seconds)
}

/// Delay before retry `k`: [`backoff_base`] + uniform(0, jitter), as a duration.
pub fn backoff(b: &RetryBackoff, k: u32) -> chrono::Duration {
    let jitter = if b.jitter_seconds > 0.0 { rand::rng().random_range(0.0..b.jitter_seconds) } else { 0.0 };
    chrono::Duration::milliseconds(((backoff_base(b, k) + jitter) * 1000.0).round() as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let b = RetryBackoff { base_seconds: 2.0, cap_seconds: 10.0, jitter_seconds: 0.0 };
        let got: Vec<f64> = (1..=5).map(|k| backoff_base(&b, k)).collect();
        assert_eq!(got, vec![2.0, 4.0, 8.0, 10.0, 10.0]);
        let j = RetryBackoff { base_seconds: 2.0, cap_seconds: 10.0, jitter_seconds: 0.5 };
        for _ in 0..100 {
            let d = backoff(&j, 1).num_milliseconds();
            assert!((2000..=2500).contains(&d), "{d}");
        }
    }
}
