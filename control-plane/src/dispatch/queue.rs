//! The ready queue: runs waiting for dispatch (PENDING, due, no open
//! attempt), in dispatch order — higher priority first, then older slot,
//! then run id. Ordering compares the priority as it is (`Reverse`), never
//! negated: `-priority` of `i32::MIN` overflows.

use std::cmp::Reverse;
use std::collections::{BTreeSet, HashMap};

use chrono::{DateTime, Utc};

/// Position of a run in the queue.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct ReadyKey {
    /// Higher first.
    pub priority: Reverse<i32>,
    /// Older first.
    pub scheduled_at: DateTime<Utc>,
    /// Tie-break.
    pub run_id: String,
}

/// Runs ready for dispatch, in order. Insert, remove and iteration in order
/// cost O(log n) per run; no scan over runs that are not ready.
#[derive(Debug, Default)]
pub struct ReadyQueue {
    order: BTreeSet<ReadyKey>,
    keys: HashMap<String, ReadyKey>,
}

impl ReadyQueue {
    /// Adds (or repositions) a run.
    pub fn insert(&mut self, run_id: &str, priority: i32, scheduled_at: DateTime<Utc>) {
        self.remove(run_id);
        let key = ReadyKey { priority: Reverse(priority), scheduled_at, run_id: run_id.to_string() };
        self.order.insert(key.clone());
        self.keys.insert(run_id.to_string(), key);
    }

    /// Removes a run (no-op if absent).
    pub fn remove(&mut self, run_id: &str) {
        if let Some(k) = self.keys.remove(run_id) {
            self.order.remove(&k);
        }
    }

    /// Whether the run is queued.
    pub fn contains(&self, run_id: &str) -> bool {
        self.keys.contains_key(run_id)
    }

    /// Run ids in dispatch order.
    pub fn in_order(&self) -> Vec<String> {
        self.order.iter().map(|k| k.run_id.clone()).collect()
    }

    /// How many runs are queued.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extreme_priorities_order_without_overflow() {
        let t: DateTime<Utc> = "2026-12-01T00:00:00Z".parse().expect("t");
        let mut q = ReadyQueue::default();
        q.insert("low", i32::MIN, t);
        q.insert("high", i32::MAX, t + chrono::Duration::seconds(5));
        q.insert("mid-old", 0, t);
        q.insert("mid-new", 0, t + chrono::Duration::seconds(1));
        assert_eq!(q.in_order(), vec!["high", "mid-old", "mid-new", "low"]);
        q.insert("low", 10, t);
        assert_eq!(q.in_order(), vec!["high", "low", "mid-old", "mid-new"]);
        q.remove("high");
        assert_eq!(q.len(), 3);
        assert!(!q.contains("high"));
    }
}
