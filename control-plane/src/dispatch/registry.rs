//! Runners as the leader sees them: what they serve, which executions hold
//! their slots, when they were last heard from. Liveness (`last_seen`) is
//! bumped by any message; [`Registry::silent`] is a pure function of the
//! registry and `now` (STYLE.md item 7). Runner choice and the reason a run
//! waits are computed here too.

use std::collections::{BTreeMap, HashMap, HashSet};

use chrono::{DateTime, Duration, Utc};

use crate::clock::{Mono, Now};

/// One runner.
#[derive(Debug, Clone)]
pub struct RunnerEntry {
    /// Runner id (from Hello).
    pub runner_id: String,
    /// Stream generation: a late end-of-stream of an older connection must
    /// not tear down a newer one. 0 = a placeholder made at load for a
    /// runner that held open attempts under the previous leader.
    pub session: u64,
    /// Its stream is open.
    pub connected: bool,
    /// It said it is shutting down: no new assignment.
    pub draining: bool,
    /// Agent ids it serves.
    pub agents: HashSet<String>,
    /// Concurrent executions it accepts.
    pub slots: u32,
    /// Its labels.
    pub labels: BTreeMap<String, String>,
    /// Its version string.
    pub version: String,
    /// `Hello.instance_id` of the connected process (empty: unknown).
    pub instance_id: String,
    /// Executions holding its slots — open attempts and attempts the
    /// control plane ended but the runner has not confirmed gone:
    /// `execution_id → run_id`.
    pub running: HashMap<String, String>,
    /// When the current stream was opened (UTC).
    pub connected_at: DateTime<Utc>,
    /// When a message of it last arrived (UTC, as shown).
    pub last_seen: DateTime<Utc>,
    /// When a message of it last arrived, on the monotonic clock: silence
    /// is elapsed time, whatever the wall clock does.
    pub last_heard: Mono,
}

impl RunnerEntry {
    /// A placeholder for a runner known only from stored attempts.
    pub fn placeholder(runner_id: &str, now: Now) -> Self {
        RunnerEntry {
            runner_id: runner_id.to_string(),
            session: 0,
            connected: false,
            draining: false,
            agents: HashSet::new(),
            slots: 0,
            labels: BTreeMap::new(),
            version: String::new(),
            instance_id: String::new(),
            running: HashMap::new(),
            connected_at: now.wall,
            last_seen: now.wall,
            last_heard: now.mono,
        }
    }

    /// Free slots.
    pub fn free(&self) -> u32 {
        self.slots.saturating_sub(u32::try_from(self.running.len()).unwrap_or(u32::MAX))
    }

    /// Connected, not draining, serves `agent_id` and has every label of `selector`.
    pub fn serves(&self, agent_id: &str, selector: &BTreeMap<String, String>) -> bool {
        self.connected && !self.draining && self.agents.contains(agent_id) && selector.iter().all(|(k, v)| self.labels.get(k) == Some(v))
    }
}

/// Every runner the leader knows, by id.
#[derive(Debug, Default)]
pub struct Registry {
    runners: HashMap<String, RunnerEntry>,
}

impl Registry {
    /// One runner.
    pub fn get(&self, id: &str) -> Option<&RunnerEntry> {
        self.runners.get(id)
    }

    /// One runner, mutable.
    pub fn get_mut(&mut self, id: &str) -> Option<&mut RunnerEntry> {
        self.runners.get_mut(id)
    }

    /// Adds or replaces a runner; returns the previous entry.
    pub fn insert(&mut self, e: RunnerEntry) -> Option<RunnerEntry> {
        self.runners.insert(e.runner_id.clone(), e)
    }

    /// Removes a runner.
    pub fn remove(&mut self, id: &str) -> Option<RunnerEntry> {
        self.runners.remove(id)
    }

    /// The runner for `id`, made a placeholder if unknown.
    pub fn entry_or_placeholder(&mut self, id: &str, now: Now) -> &mut RunnerEntry {
        self.runners.entry(id.to_string()).or_insert_with(|| RunnerEntry::placeholder(id, now))
    }

    /// Every runner, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = &RunnerEntry> {
        self.runners.values()
    }

    /// Whether no runner is known.
    pub fn is_empty(&self) -> bool {
        self.runners.is_empty()
    }

    /// Whether some placeholder (a runner not heard from since this leader
    /// loaded) still exists.
    pub fn has_placeholders(&self) -> bool {
        self.runners.values().any(|r| r.session == 0)
    }

    /// Frees the slot `execution_id` holds on whichever runner holds it.
    pub fn release(&mut self, execution_id: &str) {
        for r in self.runners.values_mut() {
            r.running.remove(execution_id);
        }
    }

    /// The runner for a run of `agent_id` with `selector`: connected, serving
    /// it, with a free slot; the one with most free slots, then the smallest
    /// id (deterministic).
    pub fn choose(&self, agent_id: &str, selector: &BTreeMap<String, String>) -> Option<String> {
        self.runners
            .values()
            .filter(|r| r.free() > 0 && r.serves(agent_id, selector))
            .max_by(|a, b| a.free().cmp(&b.free()).then_with(|| b.runner_id.cmp(&a.runner_id)))
            .map(|r| r.runner_id.clone())
    }

    /// Whether some runner serving `agent_id` (any labels) has a free slot.
    pub fn any_free(&self, agent_id: &str) -> bool {
        self.runners.values().any(|r| r.free() > 0 && r.connected && !r.draining && r.agents.contains(agent_id))
    }

    /// Whether some connected runner serves `agent_id` (any labels).
    pub fn anyone_serves(&self, agent_id: &str) -> bool {
        self.runners.values().any(|r| r.connected && !r.draining && r.agents.contains(agent_id))
    }

    /// Why a run of `agent_id` with `selector` cannot be assigned now
    /// (shown as the run's `pending_reason`).
    pub fn waiting_reason(&self, agent_id: &str, selector: &BTreeMap<String, String>) -> String {
        if self.runners.values().any(|r| r.serves(agent_id, selector)) {
            format!("waiting for a free slot on runners serving agent {agent_id:?}")
        } else if !selector.is_empty() && self.anyone_serves(agent_id) {
            format!("no connected runner serving agent {agent_id:?} has the labels {selector:?}")
        } else if selector.is_empty() {
            format!("no connected runner serves agent {agent_id:?}")
        } else {
            format!("no connected runner serves agent {agent_id:?} with labels {selector:?}")
        }
    }

    /// Runners not heard from for longer than `after` (elapsed) at `now`, by id.
    pub fn silent(&self, now: Mono, after: Duration) -> Vec<String> {
        let mut ids: Vec<String> = self.runners.values().filter(|r| now.since(r.last_heard) > after).map(|r| r.runner_id.clone()).collect();
        ids.sort();
        ids
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(id: &str, last_heard_ms: u64) -> RunnerEntry {
        let t: DateTime<Utc> = "2026-01-01T00:00:00Z".parse().expect("t");
        let mut e = RunnerEntry::placeholder(id, Now::new(t, Mono::from_elapsed(std::time::Duration::from_millis(last_heard_ms))));
        e.session = 1;
        e.connected = true;
        e.slots = 1;
        e.agents.insert("a".into());
        e
    }

    #[test]
    fn silence_is_strictly_after_the_bound() {
        let mut r = Registry::default();
        r.insert(entry("a", 0));
        r.insert(entry("b", 5000));
        let ms = |n| Mono::from_elapsed(std::time::Duration::from_millis(n));
        assert_eq!(r.silent(ms(6000), Duration::seconds(6)), Vec::<String>::new());
        assert_eq!(r.silent(ms(6001), Duration::seconds(6)), vec!["a".to_string()]);
    }

    #[test]
    fn choice_prefers_free_slots_then_id_and_respects_labels() {
        let mut r = Registry::default();
        let mut a = entry("a", 0);
        a.slots = 2;
        let mut b = entry("b", 0);
        b.slots = 2;
        b.labels.insert("zone".into(), "x".into());
        r.insert(a);
        r.insert(b);
        let none = BTreeMap::new();
        assert_eq!(r.choose("a", &none), Some("a".into()), "equal free slots: smallest id");
        r.get_mut("a").expect("a").running.insert("e1".into(), "r1".into());
        assert_eq!(r.choose("a", &none), Some("b".into()), "more free slots wins");
        let zone: BTreeMap<String, String> = [("zone".to_string(), "y".to_string())].into();
        assert_eq!(r.choose("a", &zone), None);
        assert!(r.waiting_reason("a", &zone).contains("has the labels"), "{}", r.waiting_reason("a", &zone));
        assert_eq!(r.waiting_reason("x", &none), "no connected runner serves agent \"x\"");
        r.get_mut("b").expect("b").running.insert("e2".into(), "r2".into());
        r.get_mut("b").expect("b").running.insert("e3".into(), "r3".into());
        r.get_mut("a").expect("a").running.insert("e4".into(), "r4".into());
        assert_eq!(r.choose("a", &none), None);
        assert!(r.waiting_reason("a", &none).starts_with("waiting for a free slot"));
        r.release("e4");
        assert_eq!(r.choose("a", &none), Some("a".into()));
    }
}
