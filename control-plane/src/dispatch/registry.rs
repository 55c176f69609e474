//! Connected runners: what they serve, how busy they are, when they were
//! last heard from. Liveness (`last_seen`) is bumped by any message;
//! [`expired`] is a pure function of the registry and `now` (STYLE.md item 7).

use std::collections::{BTreeMap, HashMap, HashSet};

use chrono::{DateTime, Utc};
use tokio::sync::mpsc;

use punchclock_proto::v1::ControlMessage;

/// One runner as the leader sees it.
#[derive(Debug)]
pub struct RunnerEntry {
    /// Runner id (from Hello).
    pub runner_id: String,
    /// Stream generation: a late end-of-stream of an older connection must
    /// not tear down a newer one.
    pub session: u64,
    /// Outbound stream; `None` while disconnected (waiting to be lost or to reconnect).
    pub tx: Option<mpsc::Sender<ControlMessage>>,
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
    /// Execution ids assigned to it and not finished: `execution_id → run_id`.
    pub running: HashMap<String, String>,
    /// When the current stream was opened (UTC).
    pub connected_at: DateTime<Utc>,
    /// Last message (UTC).
    pub last_seen: DateTime<Utc>,
}

impl RunnerEntry {
    /// Free slots.
    pub fn free(&self) -> u32 {
        self.slots.saturating_sub(self.running.len() as u32)
    }

    /// Connected, serves `agent_id`, has a free slot and all `labels`.
    pub fn can_take(&self, agent_id: &str, labels: &BTreeMap<String, String>) -> bool {
        self.tx.is_some() && self.free() > 0 && self.agents.contains(agent_id) && labels.iter().all(|(k, v)| self.labels.get(k) == Some(v))
    }
}

/// Runners silent for longer than `lost_after` at `now`.
pub fn expired(runners: &HashMap<String, RunnerEntry>, now: DateTime<Utc>, lost_after: chrono::Duration) -> Vec<String> {
    let mut ids: Vec<String> = runners.values().filter(|r| now - r.last_seen > lost_after).map(|r| r.runner_id.clone()).collect();
    ids.sort();
    ids
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(id: &str, last_seen: &str) -> RunnerEntry {
        RunnerEntry {
            runner_id: id.into(),
            session: 1,
            tx: None,
            agents: HashSet::new(),
            slots: 1,
            labels: BTreeMap::new(),
            version: String::new(),
            instance_id: String::new(),
            running: HashMap::new(),
            connected_at: last_seen.parse().expect("t"),
            last_seen: last_seen.parse().expect("t"),
        }
    }

    #[test]
    fn expiry_is_strictly_after_the_bound() {
        let mut m = HashMap::new();
        m.insert("a".into(), entry("a", "2026-01-01T00:00:00Z"));
        m.insert("b".into(), entry("b", "2026-01-01T00:00:05Z"));
        let now: DateTime<Utc> = "2026-01-01T00:00:06Z".parse().expect("t");
        assert_eq!(expired(&m, now, chrono::Duration::seconds(6)), Vec::<String>::new());
        let now: DateTime<Utc> = "2026-01-01T00:00:06.001Z".parse().expect("t");
        assert_eq!(expired(&m, now, chrono::Duration::seconds(6)), vec!["a".to_string()]);
    }
}
