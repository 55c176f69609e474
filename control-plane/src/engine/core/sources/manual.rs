//! Manual triggers (`TriggerTask`, `punchclock task trigger`): one run of
//! a task now, or at a delay. Its run id derives from the task and the
//! idempotency key (`manual_run_id`), so a key makes the trigger
//! create-if-absent for its window: memory's claim first, then the store's
//! (one lookup, as an event id's). A run due now is admitted at once
//! ([`EngineCore::submit`]); a delayed one is recorded at once
//! (`awaiting_admission`: an accepted trigger is never lost) and admitted
//! when due through the same admission as a slot (issue 37). Manual runs
//! run on a paused task (the `paused` policy: an explicit ask).

use chrono::{DateTime, Utc};

use super::{Input, RunRequest};
use crate::clock::Now;
use crate::engine::TriggerRequest;
use crate::engine::core::admission::Submitted;
use crate::engine::core::{EngineCore, IdLookup, ReadPurpose, Reply, ReplyId, StoredId, Triggered};
use crate::error::{Error, Result};
use crate::model::RunRecord;
use crate::model::run::{TriggerKind, manual_run_id};

/// Longest manual-trigger delay: one year.
pub const MAX_DELAY_SECONDS: u64 = 365 * 86_400;

impl EngineCore {
    /// Manual `TriggerTask`.
    pub(in crate::engine::core) fn trigger(&mut self, now: Now, reply: ReplyId, req: TriggerRequest, explicit_key: bool) {
        let r = self.trigger_checked(now, reply, req, explicit_key);
        if let Err(e) = r {
            self.fx.replies.push((reply, Reply::Trigger(Err(e))));
        }
    }

    fn trigger_checked(&mut self, now: Now, reply: ReplyId, mut req: TriggerRequest, explicit_key: bool) -> Result<()> {
        self.tasks.get(&req.task_id).filter(|e| !e.deleted).ok_or_else(|| Error::NotFound { kind: "task", id: req.task_id.clone() })?;
        if explicit_key && req.idempotency_window.is_none() {
            req.idempotency_window = Some(chrono::Duration::seconds(crate::model::trigger::DEFAULT_DEDUP_TTL_SECONDS as i64));
        }
        let key = req.idempotency_key.clone().unwrap_or_default();
        crate::model::task::validate_id("idempotency_key", &key)?;
        if req.delay_seconds > MAX_DELAY_SECONDS {
            return Err(Error::invalid("delay_seconds", format!("must be at most {MAX_DELAY_SECONDS} (1 year)")));
        }
        let at = req.not_before.unwrap_or_else(|| now.wall + chrono::Duration::seconds(req.delay_seconds as i64));
        let year = chrono::Duration::seconds(MAX_DELAY_SECONDS as i64);
        if at > now.wall + year {
            return Err(Error::invalid("not_before", "must be within 1 year from now"));
        }
        // A past `not_before` runs now, as of that slot; bounded like the
        // future (year 0001 was accepted and made a run of that year).
        if at < now.wall - year {
            return Err(Error::invalid("not_before", "must be at most 1 year in the past"));
        }
        let run_id = manual_run_id(&req.task_id, &key);
        if explicit_key {
            // A key finds its run for its window: the claim decides (in
            // memory, else the store's, looked up as an event id's is).
            if self.trigger_known(now, reply, &run_id, &req) {
                return Ok(());
            }
            if let Some(existing) = self.runs.get(&run_id) {
                match existing.dedup.clone() {
                    // Its own claim, live (a new leader's memory has runs,
                    // not claims); an expired one may have a successor: the
                    // store's dedup key says.
                    Some(c) if now.wall < c.expires_at => {
                        self.trigger_claimed(now, reply, req, Some(c));
                        return Ok(());
                    }
                    Some(_) => {}
                    // A run of an earlier version, without a claim.
                    None => {
                        let scheduled_at = existing.scheduled_at;
                        self.fx.replies.push((reply, Reply::Trigger(Ok(Triggered { run_id, scheduled_at, created: false }))));
                        return Ok(());
                    }
                }
            }
            self.fx.run_checks.push((reply, vec![IdLookup { run_id, windowed: true }]));
            self.pending_triggers.insert(reply, req);
            return Ok(());
        }
        self.trigger_create(now, reply, req, run_id, at)
    }

    /// What memory's claim says of a manual trigger's key: answered (a
    /// duplicate, or a new run once its window ended) or not known.
    fn trigger_known(&mut self, now: Now, reply: ReplyId, key_run: &str, req: &TriggerRequest) -> bool {
        let Some(c) = self.claims.get(key_run).cloned() else { return false };
        self.trigger_claimed(now, reply, req.clone(), Some(c));
        true
    }

    /// A manual trigger's key with its claim: a duplicate of the claim's
    /// run within the window, else a new run `{key run}-{unix ms}` (no
    /// claim: the key's own run).
    fn trigger_claimed(&mut self, now: Now, reply: ReplyId, req: TriggerRequest, claim: Option<crate::model::event::DedupClaim>) {
        let key_run = manual_run_id(&req.task_id, req.idempotency_key.as_deref().unwrap_or_default());
        let run_id = match claim {
            Some(c) if now.wall < c.expires_at => {
                let scheduled_at = self.runs.get(&c.run_id).map(|r| r.scheduled_at).or(c.scheduled_at).unwrap_or(c.expires_at);
                self.fx.replies.push((reply, Reply::Trigger(Ok(Triggered { run_id: c.run_id, scheduled_at, created: false }))));
                return;
            }
            Some(_) => format!("{key_run}-{}", now.wall.timestamp_millis()),
            None => key_run,
        };
        let at = req.not_before.unwrap_or_else(|| now.wall + chrono::Duration::seconds(req.delay_seconds as i64));
        if let Err(e) = self.trigger_create(now, reply, req, run_id, at) {
            self.fx.replies.push((reply, Reply::Trigger(Err(e))));
        }
    }

    /// The store's word on a manual trigger's key.
    pub(in crate::engine::core) fn trigger_loaded(&mut self, now: Now, reply: ReplyId, req: TriggerRequest, found: StoredId) {
        let key_run = manual_run_id(&req.task_id, req.idempotency_key.as_deref().unwrap_or_default());
        // Memory first: a trigger of the same key answered meanwhile.
        if self.trigger_known(now, reply, &key_run, &req) {
            return;
        }
        match found {
            StoredId::Claim(c) => self.trigger_claimed(now, reply, req, Some(c)),
            StoredId::Absent => self.trigger_claimed(now, reply, req, None),
            // A run of an earlier version without a claim: a duplicate
            // while it is kept (its record says when it was).
            StoredId::Run => self.fx.reads.push((key_run, ReadPurpose::Trigger { reply, req })),
            StoredId::Unavailable(why) => {
                let e = Error::Unavailable {
                    reason: format!("cannot tell whether idempotency key {} made a run: {why}", req.idempotency_key.unwrap_or_default()),
                    leader: None,
                };
                self.fx.replies.push((reply, Reply::Trigger(Err(e))));
            }
        }
    }

    /// Creates a manual trigger's run `run_id` due at `at`; with an
    /// explicit key, its claim goes with it.
    fn trigger_create(&mut self, now: Now, reply: ReplyId, req: TriggerRequest, run_id: String, at: DateTime<Utc>) -> Result<()> {
        let mut run = RunRecord::pending(run_id.clone(), &req.task_id, "", TriggerKind::Manual, at, now.wall);
        crate::model::task::check_params_size("params", &req.params)?;
        // The caller's trace: the run's span is a child of its span.
        if let Some(caller) = req.caller_trace {
            run.trace_id = caller.trace_id;
            run.parent_span_id = caller.span_id;
            run.trace_state = caller.trace_state;
        }
        run.baggage = req.baggage;
        // An explicit key's claim (its window set above); a fresh key has none.
        let claim = match (&req.idempotency_key, req.idempotency_window) {
            (Some(key), Some(window)) => Some(crate::model::event::DedupClaim {
                key: manual_run_id(&req.task_id, key),
                run_id: run.run_id.clone(),
                expires_at: now.wall.checked_add_signed(window).unwrap_or(now.wall),
                scheduled_at: Some(at),
            }),
            _ => None,
        };
        run.dedup.clone_from(&claim);
        // A delayed run is admitted when due, through the same policies as
        // a slot (issue 37): recorded now (an accepted trigger is never
        // lost), holding nothing until then.
        let req = RunRequest { input: Input::Merged(req.params), delayed: at > now.wall, ..RunRequest::new(run) };
        let created = self.submit(now, req)? == Submitted::Recorded;
        if let Some(claim) = claim.filter(|_| created) {
            self.claim(now, claim);
        }
        self.fx.replies.push((reply, Reply::Trigger(Ok(Triggered { run_id, scheduled_at: at, created }))));
        Ok(())
    }
}
