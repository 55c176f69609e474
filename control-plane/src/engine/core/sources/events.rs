//! Runs that events start: a batch of events (webhook requests, queue
//! messages, published events, re-runs) enters the one admission
//! (`EngineCore::submit`) slots and manual triggers take.
//!
//! An event's run id derives from its task and its id, so its creation is
//! create-if-absent: an id whose run is in memory is a duplicate at once;
//! the others are looked up in the store first (one read for the batch),
//! then admitted — a run, or a SKIPPED record saying why not (`paused`,
//! `circuit_open`, `budget_exceeded`, `invalid_event`, ...): every event
//! leaves exactly one record. The answer goes out once the records are
//! committed, so a source acknowledges only what is stored. A re-run
//! (`RerunRuns`) is an event of its own id (`{run}.rerun-N`) carrying the
//! input of the run it re-runs.

use std::collections::HashMap;

use super::{Input, RunRequest};
use crate::clock::Now;
use crate::engine::core::admission::Submitted;
use crate::engine::core::{EngineCore, IdLookup, Reply, ReplyId, StoredId};
use crate::engine::lifecycle::Lifecycle;
use crate::engine::{EventAdmitted, EventRequest};
use crate::error::{Error, Result};
use crate::model::RunRecord;
use crate::model::run::SkipReason;
use crate::repo::StoreOp;

/// A batch waiting for its store lookup.
#[derive(Debug)]
pub(in crate::engine::core) struct PendingEvents {
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
    pub(in crate::engine::core) fn events(&mut self, now: Now, reply: ReplyId, events: Vec<EventRequest>) {
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
    pub(in crate::engine::core) fn events_loaded(&mut self, now: Now, reply: ReplyId, found: Vec<StoredId>) {
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
    pub(in crate::engine::core) fn claim(&mut self, now: Now, claim: crate::model::event::DedupClaim) {
        if self.claims.len() >= CLAIMS_KEPT {
            self.claims.retain(|_, c| c.expires_at > now.wall);
        }
        self.claims.insert(claim.key.clone(), claim);
    }

    fn duplicate(&self, run_id: &str) -> EventAdmitted {
        EventAdmitted { run_id: run_id.to_string(), created: false, skipped: None, waiting: 0 }
    }

    /// Creates an event's record through the one admission: a run, or
    /// SKIPPED (`invalid_event` without asking the policies; `paused`,
    /// `circuit_open`, ... by them).
    ///
    /// `run_id` is the event id's run (`ev.run_id`), or a later run of an
    /// id whose dedup window ended; a windowed id's claim goes with it.
    fn admit_event(&mut self, now: Now, ev: EventRequest, run_id: String) -> Result<EventAdmitted> {
        let kind = ev.info.source;
        let mut run = RunRecord::pending(run_id, &ev.task_id, "", kind, now.wall, now.wall);
        let claim = ev.dedup_window.map(|window| crate::model::event::DedupClaim {
            key: ev.run_id.clone(),
            run_id: run.run_id.clone(),
            expires_at: now.wall.checked_add_signed(window).unwrap_or(now.wall),
            scheduled_at: Some(run.scheduled_at),
        });
        run.dedup.clone_from(&claim);
        let input = match ev.rerun {
            // A re-run: the input of the run it re-runs, as it had it.
            Some(r) => {
                run.event = r.event;
                run.upstream = r.upstream;
                run.rerun_of = Some(r.of);
                Input::Exact(r.params)
            }
            None => {
                run.event = Some(ev.info);
                Input::Task
            }
        };
        let run_id = run.run_id.clone();
        let skip = ev.invalid.map(|why| (SkipReason::InvalidEvent, why));
        let req = RunRequest { input, priority_delta: ev.priority, skip, ..RunRequest::new(run) };
        if self.submit(now, req)? == Submitted::Exists {
            return Ok(self.duplicate(&run_id));
        }
        if let Some(claim) = claim {
            self.claim(now, claim);
        }
        if let Some(body) = ev.stored_body {
            self.writes.with_run(&run_id, [StoreOp::PutEventBody { run_id: run_id.clone(), body }]);
        }
        let skipped = self.runs.get(&run_id).and_then(|r| r.skip_reason);
        tracing::debug!(run_id, kind = kind.as_str(), skipped = skipped.map(SkipReason::as_str), "event admitted");
        Ok(EventAdmitted { run_id, created: true, skipped, waiting: 0 })
    }

    /// A task's runs waiting for dispatch (PENDING, RETRYING: no open attempt).
    pub(in crate::engine::core) fn waiting_runs(&self, task_id: &str) -> u64 {
        self.counts.waiting(task_id)
    }
}
