//! Runs that events start: a batch of events (webhook requests, queue
//! messages, published events) enters the one admission path slots and
//! manual triggers take, and runs that follow a run that ended (`after`).
//!
//! An event's run id derives from its task and its id, so its creation is
//! create-if-absent: an id whose run is in memory is a duplicate at once;
//! the others are looked up in the store first (one read for the batch),
//! then admitted — a run, or a SKIPPED record saying why not (`paused`,
//! `circuit_open`, `budget_exceeded`, `invalid_event`, ...): every event
//! leaves exactly one record. The answer goes out once the records are
//! committed, so a source acknowledges only what is stored.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use super::{EngineCore, IdLookup, Reply, ReplyId, StoredId};
use crate::clock::Now;
use crate::engine::lifecycle::Lifecycle;
use crate::engine::{EventAdmitted, EventRequest};
use crate::error::{Error, Result};
use crate::model::RunRecord;
use crate::model::event::{Upstream, after_run_id};
use crate::model::run::{SkipReason, TriggerKind};
use crate::model::task::{PRIORITY_RANGE, TaskSpec};
use crate::model::trigger::{QueueTrigger, WebhookTrigger};
use crate::repo::StoreOp;

/// Where events find their tasks: webhook paths, published topics and
/// queue triggers, indexed as tasks change.
#[derive(Debug, Default)]
pub(super) struct Routes {
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

/// A batch waiting for its store lookup.
#[derive(Debug)]
pub(super) struct PendingEvents {
    events: Vec<EventRequest>,
    answers: Vec<Option<Result<EventAdmitted>>>,
    /// The events looked up, in the order of the read.
    looked_up: Vec<usize>,
}

/// Claims kept in memory before expired ones are dropped.
const CLAIMS_KEPT: usize = 4096;

impl EngineCore {
    /// A batch of events arrived: duplicates in memory are answered, the
    /// rest are looked up in the store ([`super::Effects::run_checks`]).
    pub(super) fn events(&mut self, now: Now, reply: ReplyId, events: Vec<EventRequest>) {
        let mut answers: Vec<Option<Result<EventAdmitted>>> = Vec::with_capacity(events.len());
        let mut looked_up = Vec::new();
        for (i, ev) in events.iter().enumerate() {
            if self.tasks.get(&ev.task_id).is_none_or(|e| e.deleted) {
                answers.push(Some(Err(Error::NotFound { kind: "task", id: ev.task_id.clone() })));
            } else if let Some(Some(run_id)) = self.known(now, ev) {
                answers.push(Some(Ok(self.duplicate(&run_id))));
            } else {
                answers.push(None);
                looked_up.push(i);
            }
        }
        if looked_up.is_empty() {
            self.events_checked(now, reply, PendingEvents { events, answers, looked_up }, Vec::new());
            return;
        }
        let ids =
            looked_up.iter().map(|i| IdLookup { run_id: events[*i].run_id.clone(), windowed: events[*i].dedup_window.is_some() }).collect();
        self.fx.run_checks.push((reply, ids));
        self.pending_events.insert(reply, PendingEvents { events, answers, looked_up });
    }

    /// What memory says of an event's id: `Some(Some(run))` a duplicate of
    /// that run, `Some(None)` new (its claim expired), `None` not known.
    fn known(&self, now: Now, ev: &EventRequest) -> Option<Option<String>> {
        if ev.dedup_window.is_some() {
            // A windowed id is decided by its claim alone: its first run
            // may still be active past the window.
            return self.claims.get(&ev.run_id).map(|c| (now.wall < c.expires_at).then(|| c.run_id.clone()));
        }
        self.runs.contains_key(&ev.run_id).then(|| Some(ev.run_id.clone()))
    }

    /// The store's answer for a batch: what it holds of each id.
    pub(super) fn events_loaded(&mut self, now: Now, reply: ReplyId, found: Vec<StoredId>) {
        if let Some(req) = self.pending_triggers.remove(&reply) {
            self.trigger_loaded(now, reply, req, found.into_iter().next().unwrap_or(StoredId::Absent));
            return;
        }
        let Some(batch) = self.pending_events.remove(&reply) else {
            tracing::error!(reply, "a store lookup for no batch of events");
            return;
        };
        self.events_checked(now, reply, batch, found);
    }

    fn events_checked(&mut self, now: Now, reply: ReplyId, batch: PendingEvents, found: Vec<StoredId>) {
        let PendingEvents { events, mut answers, looked_up } = batch;
        let stored: HashMap<usize, StoredId> = looked_up.into_iter().zip(found).collect();
        let mut waiting: HashMap<String, u64> = HashMap::new();
        for (i, ev) in events.into_iter().enumerate() {
            let source = ev.info.source;
            let a = match answers[i].take() {
                // Answered before the lookup (a duplicate in memory, a task gone).
                Some(a) => a,
                None => {
                    // Memory first (an earlier event of this batch, or of
                    // one answered meanwhile), then the store.
                    let verdict = self.known(now, &ev).or_else(|| match stored.get(&i) {
                        Some(StoredId::Claim(c)) => Some((now.wall < c.expires_at).then(|| c.run_id.clone())),
                        Some(StoredId::Run) => Some(Some(ev.run_id.clone())),
                        Some(StoredId::Absent | StoredId::Unavailable(_)) | None => None,
                    });
                    let unavailable = match stored.get(&i) {
                        Some(StoredId::Unavailable(why)) if verdict.is_none() => Some(why.clone()),
                        _ => None,
                    };
                    match verdict {
                        _ if unavailable.is_some() => Err(Error::Unavailable {
                            reason: format!("cannot tell whether event {} made a run: {}", ev.info.key, unavailable.unwrap_or_default()),
                            leader: None,
                        }),
                        Some(Some(run_id)) => Ok(self.duplicate(&run_id)),
                        // A claim that expired: a new run of its own id.
                        Some(None) => {
                            let run_id = format!("{}-{}", ev.run_id, now.wall.timestamp_millis());
                            self.admit_event(now, ev, run_id)
                        }
                        None => {
                            let run_id = ev.run_id.clone();
                            self.admit_event(now, ev, run_id)
                        }
                    }
                }
            };
            if let Ok(a) = &a {
                let result = match (a.created, a.skipped) {
                    (false, _) => "deduplicated",
                    (true, Some(_)) => "skipped",
                    (true, None) => "created",
                };
                self.fx.events.push(Lifecycle::EventAdmitted { source, result });
            }
            answers[i] = Some(a);
        }
        let mut out = Vec::with_capacity(answers.len());
        for a in answers.into_iter().flatten() {
            out.push(a.map(|mut a| {
                let task = crate::model::run::task_of_run(&a.run_id).to_string();
                a.waiting = *waiting.entry(task.clone()).or_insert_with(|| self.waiting_runs(&task));
                a
            }));
        }
        self.fx.replies.push((reply, Reply::Events(out)));
    }

    /// Remembers a claim (dropping expired ones when many are kept).
    pub(super) fn claim(&mut self, now: Now, claim: crate::model::event::DedupClaim) {
        if self.claims.len() >= CLAIMS_KEPT {
            self.claims.retain(|_, c| c.expires_at > now.wall);
        }
        self.claims.insert(claim.key.clone(), claim);
    }

    fn duplicate(&self, run_id: &str) -> EventAdmitted {
        EventAdmitted { run_id: run_id.to_string(), created: false, skipped: None, waiting: 0 }
    }

    /// Creates an event's record: a run through the policies, or SKIPPED
    /// (`invalid_event`, `paused`) without them.
    ///
    /// `run_id` is the event id's run (`ev.run_id`), or a later run of an
    /// id whose dedup window ended; a windowed id's claim goes with it.
    fn admit_event(&mut self, now: Now, ev: EventRequest, run_id: String) -> Result<EventAdmitted> {
        let e =
            self.tasks.get(&ev.task_id).filter(|e| !e.deleted).ok_or_else(|| Error::NotFound { kind: "task", id: ev.task_id.clone() })?;
        let spec = e.record.spec.clone();
        let paused = e.record.paused;
        let kind = ev.info.source;
        let mut run = RunRecord::pending(run_id, &ev.task_id, &spec.agent_id, kind, now.wall, now.wall);
        if let Some(window) = ev.dedup_window {
            let claim = crate::model::event::DedupClaim {
                key: ev.run_id.clone(),
                run_id: run.run_id.clone(),
                expires_at: now.wall.checked_add_signed(window).unwrap_or(now.wall),
                scheduled_at: Some(run.scheduled_at),
            };
            run.dedup = Some(claim.clone());
            self.claim(now, claim);
        }
        run.params = spec.params();
        run.priority = spec.execution.priority.saturating_add(ev.priority).clamp(*PRIORITY_RANGE.start(), *PRIORITY_RANGE.end());
        let name = ev.info.name.clone();
        match ev.rerun {
            // A re-run: the input of the run it re-runs, as it had it.
            Some(r) => {
                run.params = r.params;
                run.event = r.event;
                run.upstream = r.upstream;
                run.rerun_of = Some(r.of);
            }
            None => run.event = Some(ev.info),
        }
        let run_id = run.run_id.clone();
        if let Some(why) = ev.invalid {
            self.skip_one(now, &run, SkipReason::InvalidEvent, why);
        } else if paused {
            // Every event is recorded: a paused task says so.
            self.skip_one(now, &run, SkipReason::Paused, format!("{} {name} while the task is paused", kind.as_str()));
        } else {
            self.admit(now, run, &spec, &HashSet::new());
        }
        if let Some(body) = ev.stored_body {
            self.writes.with_run(&run_id, [StoreOp::PutEventBody { run_id: run_id.clone(), body }]);
        }
        let skipped = self.runs.get(&run_id).and_then(|r| r.skip_reason);
        tracing::debug!(run_id, kind = kind.as_str(), skipped = skipped.map(SkipReason::as_str), "event admitted");
        Ok(EventAdmitted { run_id, created: true, skipped, waiting: 0 })
    }

    /// A run of `task_id` follows the run that ended (`after`, from the
    /// dependencies policy): its run — or its SKIPPED `upstream_unmet`
    /// record — is created in the ended run's group.
    pub(super) fn follow(&mut self, now: Now, task_id: &str, upstream: Upstream, unmet: Option<String>) {
        let Some(e) = self.tasks.get(task_id).filter(|e| !e.deleted) else { return };
        let spec = e.record.spec.clone();
        let paused = e.record.paused;
        let run_id = after_run_id(task_id, &upstream.run_id);
        if self.runs.contains_key(&run_id) {
            return;
        }
        let mut run = RunRecord::pending(run_id, task_id, &spec.agent_id, TriggerKind::After, now.wall, now.wall);
        run.params = spec.params();
        run.priority = spec.execution.priority;
        let up = format!("{} ({})", upstream.run_id, upstream.status.as_str());
        run.upstream = Some(upstream);
        match unmet {
            Some(why) => self.skip_one(now, &run, SkipReason::UpstreamUnmet, why),
            None if paused => self.skip_one(now, &run, SkipReason::Paused, format!("upstream run {up} ended while the task is paused")),
            None => {
                self.admit(now, run, &spec, &HashSet::new());
            }
        }
    }

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

    /// A task's runs waiting for dispatch (PENDING, RETRYING: no open attempt).
    pub(super) fn waiting_runs(&self, task_id: &str) -> u64 {
        self.counts.waiting(task_id)
    }
}
