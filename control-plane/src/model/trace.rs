//! The trace identity of runs and attempts (OpenTelemetry, W3C Trace
//! Context). Ids are derived, not drawn at random, so whatever replica
//! emits a run's spans — before or after a failover — gives them the same
//! ids: one run is one trace.
//!
//! - the run's trace id and root span id: from its run id and creation
//!   time (stored on the run; a `TriggerTask` with a `traceparent` puts the
//!   run in the caller's trace instead, under the caller's span);
//! - an attempt's span id: from its execution id (unique per attempt).

use sha2::{Digest, Sha256};

fn hex_of(domain: &str, key: &str, bytes: usize) -> String {
    let digest = Sha256::new().chain_update(domain.as_bytes()).chain_update([0]).chain_update(key.as_bytes()).finalize();
    let mut s = hex::encode(&digest[..bytes]);
    // An all-zero id is invalid (W3C); vanishingly unlikely, but never sent.
    if s.bytes().all(|b| b == b'0') {
        s.replace_range(s.len() - 1.., "1");
    }
    s
}

/// A new run's `(trace_id, span_id)` (32 and 16 hex digits).
pub fn run_ids(run_id: &str, created_nanos: i64) -> (String, String) {
    let key = format!("{run_id}@{created_nanos}");
    (hex_of("punchclock.trace", &key, 16), hex_of("punchclock.run-span", &key, 8))
}

/// The span id (16 hex digits) of the attempt with this execution id.
pub fn attempt_span_id(execution_id: &str) -> String {
    hex_of("punchclock.attempt-span", execution_id, 8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_stable_and_well_formed() {
        let (t, s) = run_ids("task.20261201T100000Z", 42);
        assert_eq!((t.len(), s.len()), (32, 16));
        assert_eq!(run_ids("task.20261201T100000Z", 42), (t.clone(), s.clone()));
        assert_ne!(run_ids("task.20261201T100000Z", 43).0, t);
        assert_eq!(attempt_span_id("e1"), attempt_span_id("e1"));
        assert_ne!(attempt_span_id("e1"), attempt_span_id("e2"));
        assert!(t.bytes().chain(s.bytes()).all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
    }
}
