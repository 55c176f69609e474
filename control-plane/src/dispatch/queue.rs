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

/// One [`ReadyQueue`] per agent: dispatch walks the queue of an agent only
/// while some runner serving it has a free slot, one run at a time from the
/// front, so a pass costs O(runs assigned + runs skipped), not O(all ready
/// runs), and agents with no free runner cost nothing.
#[derive(Debug, Default)]
pub struct AgentQueues {
    queues: std::collections::BTreeMap<String, ReadyQueue>,
    agent_of: HashMap<String, String>,
}

impl AgentQueues {
    /// Adds (or repositions) a run of `agent_id`.
    pub fn insert(&mut self, run_id: &str, agent_id: &str, priority: i32, scheduled_at: DateTime<Utc>) {
        self.remove(run_id);
        self.queues.entry(agent_id.to_string()).or_default().insert(run_id, priority, scheduled_at);
        self.agent_of.insert(run_id.to_string(), agent_id.to_string());
    }

    /// Removes a run (no-op if absent).
    pub fn remove(&mut self, run_id: &str) {
        if let Some(agent) = self.agent_of.remove(run_id)
            && let Some(q) = self.queues.get_mut(&agent)
        {
            q.remove(run_id);
            if q.is_empty() {
                self.queues.remove(&agent);
            }
        }
    }

    /// Whether the run is queued.
    pub fn contains(&self, run_id: &str) -> bool {
        self.agent_of.contains_key(run_id)
    }

    /// Agents with queued runs.
    pub fn agents(&self) -> Vec<String> {
        self.queues.keys().cloned().collect()
    }

    /// The first queued run of `agent_id` after `after` (from the front
    /// when `None`), in dispatch order.
    pub fn next_after(&self, agent_id: &str, after: Option<&ReadyKey>) -> Option<ReadyKey> {
        let q = self.queues.get(agent_id)?;
        match after {
            None => q.order.first().cloned(),
            Some(k) => q.order.range((std::ops::Bound::Excluded(k), std::ops::Bound::Unbounded)).next().cloned(),
        }
    }

    /// How many runs are queued.
    pub fn len(&self) -> usize {
        self.agent_of.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.agent_of.is_empty()
    }
}

#[cfg(test)]
mod agent_tests {
    use super::*;

    #[test]
    fn per_agent_queues_walk_in_order_from_any_key() {
        let t: DateTime<Utc> = "2026-12-01T00:00:00Z".parse().expect("t");
        let mut q = AgentQueues::default();
        q.insert("a1", "a", 0, t);
        q.insert("a2", "a", 5, t);
        q.insert("b1", "b", 0, t);
        assert_eq!(q.agents(), vec!["a", "b"]);
        let first = q.next_after("a", None).expect("first");
        assert_eq!(first.run_id, "a2");
        assert_eq!(q.next_after("a", Some(&first)).map(|k| k.run_id), Some("a1".into()));
        q.remove("a2");
        q.remove("a1");
        assert_eq!(q.agents(), vec!["b"]);
        assert_eq!(q.len(), 1);
        assert!(q.next_after("a", None).is_none());
    }
}
