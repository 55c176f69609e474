//! Runner sessions: Hello and re-declaration, reports and who may make
//! them, the end of a stream, silence and loss.
//!
//! **Ownership.** A report (`Started`, `Progress`, `Finished`) or a
//! re-declaration in Hello counts only from the runner its execution was
//! assigned to (`Attempt::runner_id`); anything else changes nothing and
//! is logged once with both runner ids.
//!
//! **Terminal is final.** A report for an attempt the control plane had
//! already ended (presumed lost, timed out, cancelled) is kept on that
//! attempt as evidence; the run does not change.

use std::collections::HashMap;

use chrono::{DateTime, Utc};

use crate::clock::Now;

use super::runs::AttemptEnd;
use super::{EngineCore, MAX_LATE_READS_REMEMBERED, ReadPurpose, Timer, Urgency};
use crate::dispatch::registry::RunnerEntry;
use crate::engine::lifecycle::Lifecycle;
use crate::engine::protocol::{FinishedReport, FromRunner, InFlightExec, ReportedOutcome, RunnerHello, ToRunner};
use crate::error::{Error, Result};
use crate::model::run::{AttemptReport, Outcome};
use crate::model::{Progress, RunRecord};

/// Heartbeats a runner's acknowledgements may lag before it counts as not
/// reading its stream: 10, so a runner working through a burst of
/// assignments (acks queue behind them) is not taken for one that does not
/// read.
const UNREAD_HEARTBEATS: u64 = 10;

/// Whose execution a report is about, as far as this leader knows.
#[derive(Debug, PartialEq, Eq)]
enum Whose {
    /// The open attempt of its run, assigned to the reporter.
    Current,
    /// An attempt of the reporter that the control plane already ended.
    Ended,
    /// An attempt assigned to another runner.
    Foreign(String),
    /// Not a run in memory, or not an attempt of that run.
    Unknown,
}

fn outcome_of(o: ReportedOutcome) -> Outcome {
    match o {
        ReportedOutcome::Succeeded => Outcome::Succeeded,
        ReportedOutcome::Failed | ReportedOutcome::Refused => Outcome::Failed,
        ReportedOutcome::Timeout => Outcome::Timeout,
        ReportedOutcome::Cancelled => Outcome::Cancelled,
        ReportedOutcome::Interrupted => Outcome::Interrupted,
    }
}

impl EngineCore {
    fn whose(&self, runner_id: &str, run_id: &str, execution_id: &str) -> Whose {
        let Some(run) = self.runs.get(run_id) else { return Whose::Unknown };
        let Some(a) = run.attempts.iter().find(|a| a.execution_id == execution_id) else { return Whose::Unknown };
        if a.runner_id != runner_id {
            return Whose::Foreign(a.runner_id.clone());
        }
        if run.current_execution() == Some(execution_id) { Whose::Current } else { Whose::Ended }
    }

    /// A runner opened a stream and said Hello: registers the session,
    /// matches its in-flight executions against what this leader assigned
    /// to it, and welcomes it. Executions this leader thinks it has and it
    /// no longer declares end (or, never started by this same process, are
    /// dispatched again). Returns the session number.
    ///
    /// Errors: [`Error::InvalidArgument`] for an empty runner id;
    /// [`Error::FailedPrecondition`] when a live runner has this id.
    pub fn runner_hello(&mut self, now: Now, hello: RunnerHello) -> Result<u64> {
        self.observe(now);
        if hello.runner_id.is_empty() {
            return Err(Error::invalid("hello.runner_id", "must not be empty"));
        }
        let id = hello.runner_id.clone();
        let silent_after = Self::dur(self.timing().runner_silent_after());
        if let Some(existing) = self.registry.get(&id)
            && existing.connected
            && now.mono.since(existing.last_heard) <= silent_after
        {
            // Two processes with one id would take the session from each
            // other and lose each other's runs.
            return Err(Error::FailedPrecondition(format!(
                "runner id {id:?} is already connected (last heard {} ms ago); give each runner its own --runner-id",
                now.mono.since(existing.last_heard).num_milliseconds()
            )));
        }
        self.ids.session += 1;
        let session = self.ids.session;
        let previous = self.registry.remove(&id);
        let mut running: HashMap<String, String> = HashMap::new();
        let mut unknown = Vec::new();
        let mut redeclared = Vec::new();
        for f in hello.in_flight {
            match self.whose(&id, &f.run_id, &f.execution_id) {
                Whose::Current => {
                    running.insert(f.execution_id.clone(), f.run_id.clone());
                    redeclared.push((f.run_id, f.execution_id, f.started_at));
                }
                Whose::Ended => {
                    // Ended here, maybe still alive there: it keeps its slot
                    // until the runner reports it gone, and is stopped.
                    let awaiting = self
                        .runs
                        .get(&f.run_id)
                        .and_then(|r| r.attempts.iter().find(|a| a.execution_id == f.execution_id))
                        .is_some_and(|a| a.awaiting_runner);
                    if awaiting {
                        running.insert(f.execution_id.clone(), f.run_id.clone());
                    }
                    unknown.push(f);
                }
                Whose::Foreign(owner) => {
                    self.log_forgery("Hello.in_flight", &f.execution_id, &id, &owner);
                    unknown.push(f);
                }
                Whose::Unknown => unknown.push(f),
            }
        }
        let prev_last_heard = previous.as_ref().map_or(now.mono, |p| p.last_heard);
        let forgotten: Vec<(String, String)> =
            previous.map(|p| p.running.into_iter().filter(|(exec, _)| !running.contains_key(exec)).collect()).unwrap_or_default();
        tracing::info!(runner_id = %id, session, agents = ?hello.agents, slots = hello.slots, redeclared = redeclared.len(), unknown = unknown.len(), "runner connected");
        let agents = hello.agents.clone();
        self.registry.insert(RunnerEntry {
            runner_id: id.clone(),
            session,
            connected: true,
            draining: false,
            agents: hello.agents.into_iter().collect(),
            slots: hello.slots,
            labels: hello.labels,
            version: hello.version,
            instance_id: hello.instance_id.clone(),
            running,
            connected_at: now.wall,
            last_seen: now.wall,
            last_heard: now.mono,
        });
        self.send_to(
            &id,
            session,
            ToRunner::Welcome {
                fencing_token: self.cfg.token,
                heartbeat_interval_ms: u32::try_from(self.timing().heartbeat_interval.as_millis()).unwrap_or(u32::MAX),
                leader_id: self.cfg.leader_id.clone(),
                unknown,
                fence_ms: u64::try_from(self.timing().runner_fence().as_millis()).unwrap_or(u64::MAX),
                stop_lead_ms: u64::try_from(crate::timing::RUNNER_STOP_LEAD.as_millis()).unwrap_or(u64::MAX),
            },
        );
        // Re-declared means started, even if the Started report was lost
        // with the previous leader.
        for (run_id, exec, started_at) in redeclared {
            self.mark_started(now, &run_id, &exec, started_at);
        }
        let release_at = prev_last_heard.after(Self::dur(self.timing().runner_lost_after()));
        for (exec, run_id) in forgotten {
            self.forgotten(now, &id, &hello.instance_id, &run_id, &exec, release_at);
        }
        self.fx.events.push(Lifecycle::RunnerJoined { runner_id: id, agents, slots: hello.slots });
        self.arm_runner_check(now);
        self.dispatch_needed = true;
        self.after_input(now);
        Ok(session)
    }

    /// An execution this leader had on a runner that came back without it.
    /// The same process never having started it: dispatched again as the
    /// same attempt. Otherwise it is lost; when the runner is another
    /// process (restarted, or a second one with the id), the old one may
    /// still run the agent until its fence: the attempt holds its task's
    /// slot until `release_at`.
    fn forgotten(&mut self, now: Now, runner_id: &str, instance: &str, run_id: &str, exec: &str, release_at: crate::clock::Mono) {
        let Some(run) = self.runs.get(run_id) else { return };
        let Some(a) = run.attempts.iter().find(|a| a.execution_id == exec) else { return };
        let same_process = !instance.is_empty() && a.runner_instance == instance;
        if a.is_open() {
            if same_process
                && self.requeue_unstarted(now, run_id, exec, format!("runner {runner_id} reconnected without it; it never started"))
            {
                return;
            }
            let why = format!("runner {runner_id} reconnected without this execution");
            self.end_attempt(now, run_id, exec, AttemptEnd::presumed(Outcome::Lost, why, !same_process));
        } else if !a.awaiting_runner {
            return;
        } else if same_process {
            self.release_orphan(now, run_id, exec);
            return;
        }
        if !same_process {
            self.registry.release(exec);
            self.timers.push_mono(release_at, Timer::ReleaseOrphan { run_id: run_id.to_string(), execution_id: exec.to_string() });
        }
    }

    /// A message on a runner's stream (older sessions are ignored).
    pub(super) fn on_runner_message(&mut self, now: Now, runner_id: &str, session: u64, received_at: Now, msg: FromRunner) {
        let Some(r) = self.registry.get_mut(runner_id) else { return };
        if r.session != session {
            return;
        }
        r.last_seen = r.last_seen.max(received_at.wall);
        r.last_heard = r.last_heard.max(received_at.mono);
        if matches!(msg, FromRunner::Heartbeat { draining: true, .. }) && !r.draining {
            r.draining = true;
            tracing::info!(runner_id, "runner shutting down: no new work for it");
        }
        // A runner whose acks lag 10 heartbeats behind does not read its
        // stream: what is sent to it sits in buffers. Cut it off; it comes
        // back (or is lost) like any disconnected runner.
        if let FromRunner::Heartbeat { seq, acked_seq, .. } = &msg
            && seq.saturating_sub(*acked_seq) > UNREAD_HEARTBEATS
        {
            tracing::warn!(runner_id, seq, acked_seq, "runner does not read its stream; disconnecting it");
            r.connected = false;
            self.fx.disconnects.push((runner_id.to_string(), session));
            self.dispatch_needed = true;
            return;
        }
        match msg {
            FromRunner::Heartbeat { seq, .. } => {
                self.send_to(runner_id, session, ToRunner::HeartbeatAck { fencing_token: self.cfg.token, seq });
            }
            FromRunner::Started { run_id, execution_id, started_at } => match self.whose(runner_id, &run_id, &execution_id) {
                Whose::Current => self.mark_started(now, &run_id, &execution_id, started_at),
                Whose::Foreign(owner) => self.log_forgery("Started", &execution_id, runner_id, &owner),
                Whose::Ended | Whose::Unknown => {}
            },
            FromRunner::Progress { run_id, execution_id, percent, message, checkpoint } => {
                match self.whose(runner_id, &run_id, &execution_id) {
                    Whose::Current => {
                        let Some(run) = self.runs.get_mut(&run_id) else { return };
                        let checkpoint = checkpoint.or_else(|| run.progress.as_ref().and_then(|p| p.checkpoint.clone()));
                        run.progress = Some(Progress { percent, message, checkpoint, updated_at: now.wall });
                        self.touch(now, &run_id, Urgency::Lazy);
                        self.arm_flush(now);
                        if let Some(r) = self.event_run(&run_id) {
                            self.fx.events.push(Lifecycle::RunProgress(r));
                        }
                    }
                    Whose::Foreign(owner) => self.log_forgery("Progress", &execution_id, runner_id, &owner),
                    Whose::Ended | Whose::Unknown => {}
                }
            }
            FromRunner::Finished(report) => self.on_finished(now, runner_id, session, *report),
        }
    }

    fn mark_started(&mut self, now: Now, run_id: &str, exec: &str, at: Option<DateTime<Utc>>) {
        let Some(run) = self.runs.get_mut(run_id) else { return };
        let Some(a) = run.current_attempt_mut().filter(|a| a.execution_id == exec) else { return };
        if a.started_at.is_some() {
            return;
        }
        let t = at.unwrap_or(now.wall);
        a.started_at = Some(t);
        run.actual_started_at.get_or_insert(t);
        run.start_by = None;
        self.touch(now, run_id, Urgency::Lazy);
        if let Some(r) = self.event_run(run_id) {
            self.fx.events.push(Lifecycle::RunStarted(r));
        }
    }

    /// A runner's `Finished`, acknowledged once what it changes is stored.
    fn on_finished(&mut self, now: Now, runner_id: &str, session: u64, f: FinishedReport) {
        let ack = ToRunner::FinishedAck { run_id: f.run_id.clone(), execution_id: f.execution_id.clone() };
        match self.whose(runner_id, &f.run_id, &f.execution_id) {
            Whose::Current => {
                if f.outcome == ReportedOutcome::Refused {
                    let why = format!("runner {runner_id} refused it: {}", f.error);
                    if self.requeue_unstarted(now, &f.run_id, &f.execution_id, why) {
                        self.send_to(runner_id, session, ack);
                        return;
                    }
                }
                let end = AttemptEnd {
                    outcome: Some(outcome_of(f.outcome)),
                    error: (!f.error.is_empty()).then(|| f.error.clone()),
                    exit_code: f.exit_code,
                    result: f.result,
                    stdout_tail: Some(f.stdout_tail),
                    stderr_tail: Some(f.stderr_tail),
                    started_at: f.started_at,
                    finished_at: f.finished_at,
                    awaiting_runner: false,
                    class: f.class,
                    machine: f.machine,
                };
                self.end_attempt(now, &f.run_id, &f.execution_id, end);
            }
            Whose::Ended => self.record_late(now, &f),
            Whose::Foreign(owner) => self.log_forgery("Finished", &f.execution_id, runner_id, &owner),
            // Ended and written earlier (or never ours): the store says, once
            // per execution and runner, and only for runs of known tasks (a
            // flood of made-up reports costs no reads).
            Whose::Unknown
                if !self.runs.contains_key(&f.run_id)
                    && self.tasks.contains_key(crate::model::run::task_of_run(&f.run_id))
                    && self.remember_late_read(&f.execution_id, runner_id) =>
            {
                let run_id = f.run_id.clone();
                let purpose = ReadPurpose::LateReport { runner_id: runner_id.to_string(), session, report: Box::new(f) };
                self.fx.reads.push((run_id, purpose));
                return;
            }
            Whose::Unknown => {
                tracing::debug!(run_id = %f.run_id, execution_id = %f.execution_id, runner_id, "Finished for an unknown execution; ignored")
            }
        }
        self.send_to(runner_id, session, ack);
    }

    /// True the first time a late report of this (execution, runner) asks
    /// for the store.
    fn remember_late_read(&mut self, execution_id: &str, runner_id: &str) -> bool {
        if self.seen.late_reads.len() >= MAX_LATE_READS_REMEMBERED {
            self.seen.late_reads.clear();
        }
        self.seen.late_reads.insert((execution_id.to_string(), runner_id.to_string()))
    }

    /// Keeps a late report on its attempt as evidence; the agent is gone,
    /// so the attempt stops holding its slots.
    fn record_late(&mut self, now: Now, f: &FinishedReport) {
        let Some(run) = self.runs.get_mut(&f.run_id) else { return };
        let Some(a) = run.attempt_mut(&f.execution_id) else { return };
        let mut changed = false;
        if a.awaiting_runner {
            a.awaiting_runner = false;
            changed = true;
        }
        if a.report.is_none() && f.outcome != ReportedOutcome::Refused {
            a.report = Some(AttemptReport {
                outcome: outcome_of(f.outcome),
                error: (!f.error.is_empty()).then(|| f.error.clone()),
                exit_code: f.exit_code,
                result: f.result.clone(),
                finished_at: f.finished_at.unwrap_or(now.wall),
            });
            changed = true;
            tracing::info!(run_id = %f.run_id, execution_id = %f.execution_id, "late report kept as evidence; the run does not change");
        }
        if changed {
            self.registry.release(&f.execution_id);
            self.dispatch_needed = true;
            self.touch(now, &f.run_id, Urgency::Now);
            if let Some(r) = self.event_run(&f.run_id) {
                self.fx.events.push(Lifecycle::RunUpdated(r));
            }
        }
    }

    /// The stored run a late `Finished` named.
    pub(super) fn late_report_loaded(&mut self, now: Now, runner_id: &str, session: u64, stored: Option<RunRecord>, f: FinishedReport) {
        let ack = ToRunner::FinishedAck { run_id: f.run_id.clone(), execution_id: f.execution_id.clone() };
        if self.runs.contains_key(&f.run_id) {
            // Loaded meanwhile (a new run with this id cannot be; a run
            // recovered later can): decide on what memory says.
            self.on_finished(now, runner_id, session, f);
            return;
        }
        match stored {
            Some(run) => match run.attempts.iter().find(|a| a.execution_id == f.execution_id).map(|a| a.runner_id.clone()) {
                Some(owner) if owner == runner_id => {
                    if run.status.is_terminal() {
                        self.remember_run(run);
                        self.record_late(now, &f);
                        // Written this turn, then it leaves memory again.
                        if !self.writes.pending(&f.run_id) {
                            self.forget_run(&f.run_id);
                        }
                    }
                }
                Some(owner) => self.log_forgery("Finished", &f.execution_id, runner_id, &owner),
                None => {
                    tracing::warn!(run_id = %f.run_id, execution_id = %f.execution_id, runner_id, "Finished for an unknown execution; ignored")
                }
            },
            None => tracing::warn!(run_id = %f.run_id, execution_id = %f.execution_id, runner_id, "Finished for an unknown run; ignored"),
        }
        self.send_to(runner_id, session, ack);
    }

    /// A runner's stream ended. Its executions stay assigned until it comes
    /// back and re-declares them, or is lost by silence.
    pub(super) fn on_runner_gone(&mut self, runner_id: &str, session: u64) {
        let Some(r) = self.registry.get_mut(runner_id) else { return };
        if r.session != session {
            return;
        }
        r.connected = false;
        tracing::info!(runner_id, running = r.running.len(), "runner stream ended");
        if r.running.is_empty() {
            self.registry.remove(runner_id);
        }
    }

    pub(super) fn arm_runner_check(&mut self, now: Now) {
        if !self.timers.runner_check_armed && !self.registry.is_empty() {
            self.timers.runner_check_armed = true;
            let at = now.mono.after(Self::dur(self.timing().heartbeat_interval));
            self.timers.push_mono(at, Timer::RunnerCheck);
        }
    }

    /// Silent runners get no new work and their stream is closed; runners
    /// silent past the fence deadline are lost: their attempts end `lost`
    /// (their agents were stopped by the runner's self-fence).
    pub(super) fn on_runner_check(&mut self, now: Now) {
        self.timers.runner_check_armed = false;
        let silent_after = Self::dur(self.timing().runner_silent_after());
        let lost_after = Self::dur(self.timing().runner_lost_after());
        for id in self.registry.silent(now.mono, silent_after) {
            if let Some(r) = self.registry.get_mut(&id)
                && r.connected
            {
                r.connected = false;
                tracing::warn!(runner_id = %id, silent_ms = now.mono.since(r.last_heard).num_milliseconds(), "runner silent; no new work, closing its stream");
                self.fx.disconnects.push((id.clone(), r.session));
            }
        }
        for id in self.registry.silent(now.mono, lost_after) {
            let Some(r) = self.registry.remove(&id) else { continue };
            tracing::warn!(runner_id = %id, running = r.running.len(), "runner lost");
            for (exec, run_id) in r.running {
                match self.whose(&id, &run_id, &exec) {
                    Whose::Current => {
                        let why = format!("runner {id} lost: silent for more than {} s", lost_after.num_seconds());
                        self.end_attempt(now, &run_id, &exec, AttemptEnd::presumed(Outcome::Lost, why, false));
                    }
                    // Cancelled or timed out, not confirmed: the fence has passed.
                    Whose::Ended => self.release_orphan(now, &run_id, &exec),
                    _ => {}
                }
            }
            self.fx.events.push(Lifecycle::RunnerLost { runner_id: id });
        }
        self.dispatch_needed = true;
        self.arm_runner_check(now);
    }
}

impl InFlightExec {
    /// Shorthand for tests and conversions.
    pub fn new(run_id: &str, execution_id: &str, attempt: u32) -> Self {
        InFlightExec { run_id: run_id.into(), execution_id: execution_id.into(), attempt, started_at: None }
    }
}
