//! Where events find their tasks: webhook paths, published topics and
//! queue triggers, indexed as tasks change (the event intake is
//! `sources/events.rs`).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use super::EngineCore;
use crate::model::task::TaskSpec;
use crate::model::trigger::{QueueTrigger, WebhookTrigger};

/// Where events find their tasks: webhook paths, published topics and
/// queue triggers, indexed as tasks change.
#[derive(Debug, Default)]
pub(in crate::engine::core) struct Routes {
    /// Webhook path → task (the first by id when two claim one).
    hooks: BTreeMap<String, BTreeSet<String>>,
    /// Topic → tasks.
    topics: HashMap<String, BTreeSet<String>>,
    /// Task → its queue triggers.
    queues: BTreeMap<String, Vec<QueueTrigger>>,
    /// Task → the paths and topics it claimed (to drop them when it changes).
    claimed: HashMap<String, (Vec<String>, Vec<String>)>,
    /// Bumped whenever a queue trigger comes, goes or changes.
    pub(super) queues_version: u64,
}

impl Routes {
    /// A task was created or changed (`Some`), or deleted (`None`).
    pub(super) fn task_changed(&mut self, task_id: &str, spec: Option<&TaskSpec>) {
        if let Some((hooks, topics)) = self.claimed.remove(task_id) {
            for h in hooks {
                if let Some(s) = self.hooks.get_mut(&h) {
                    s.remove(task_id);
                    if s.is_empty() {
                        self.hooks.remove(&h);
                    }
                }
            }
            for t in topics {
                if let Some(s) = self.topics.get_mut(&t) {
                    s.remove(task_id);
                    if s.is_empty() {
                        self.topics.remove(&t);
                    }
                }
            }
        }
        let queues: Vec<QueueTrigger> = spec.map(|s| s.queues().into_iter().cloned().collect()).unwrap_or_default();
        let before = self.queues.get(task_id).cloned().unwrap_or_default();
        if before != queues {
            self.queues_version += 1;
            if queues.is_empty() {
                self.queues.remove(task_id);
            } else {
                self.queues.insert(task_id.to_string(), queues);
            }
        }
        let Some(spec) = spec else { return };
        let hooks: Vec<String> = spec.webhooks().iter().map(|w| w.path.clone()).collect();
        let topics: Vec<String> = spec.event_topics().iter().map(|t| t.to_string()).collect();
        for h in &hooks {
            self.hooks.entry(h.clone()).or_default().insert(task_id.to_string());
        }
        for t in &topics {
            self.topics.entry(t.clone()).or_default().insert(task_id.to_string());
        }
        if !hooks.is_empty() || !topics.is_empty() {
            self.claimed.insert(task_id.to_string(), (hooks, topics));
        }
    }

    /// The task a webhook path belongs to (the first by id if two claim it).
    pub(super) fn hook(&self, path: &str) -> Option<&str> {
        self.hooks.get(path).and_then(|s| s.iter().next()).map(String::as_str)
    }

    /// The tasks listening on a topic, by id.
    pub(super) fn topic(&self, topic: &str) -> Vec<String> {
        self.topics.get(topic).map(|s| s.iter().cloned().collect()).unwrap_or_default()
    }

    /// Every queue trigger, by task.
    pub(super) fn queues(&self) -> Vec<(String, QueueTrigger)> {
        self.queues.iter().flat_map(|(t, qs)| qs.iter().map(move |q| (t.clone(), q.clone()))).collect()
    }
}

impl EngineCore {
    /// The task and trigger of a webhook path (a task not deleted).
    pub fn webhook(&self, path: &str) -> Option<(String, WebhookTrigger)> {
        let task_id = self.routes.hook(path)?;
        let e = self.tasks.get(task_id).filter(|e| !e.deleted)?;
        let w = e.record.spec.webhooks().into_iter().find(|w| w.path == path)?.clone();
        Some((task_id.to_string(), w))
    }

    /// Every queue trigger of the tasks, and a version that changes
    /// whenever they do (the consumers follow it).
    pub fn queue_sources(&self) -> (u64, Vec<(String, QueueTrigger)>) {
        (self.routes.queues_version, self.routes.queues())
    }

    /// The version of [`EngineCore::queue_sources`].
    pub fn queues_version(&self) -> u64 {
        self.routes.queues_version
    }
}
