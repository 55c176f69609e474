//! Runner sessions: Hello and in-flight re-declaration, messages, the end
//! of a stream, and loss by silence.

use std::collections::{HashMap, HashSet};

use chrono::{DateTime, Utc};

use tokio::sync::mpsc;

use punchclock_proto::v1::{ControlMessage, FinishedAck, HeartbeatAck, Hello, InFlight, Started, Welcome, control_message, runner_message};

use super::runs::AttemptEnd;
use super::{Engine, RunnerSnapshot, Timer};
use crate::dispatch::registry::{RunnerEntry, expired};
use crate::error::{Error, Result};
use crate::model::run::outcome;

/// Runs read per transaction when a new leader loads (etcd allows 128 ops).
const LOAD_BATCH: usize = 100;

impl Engine {
    /// Registers a runner stream, matches its in-flight executions against
    /// the runs this leader knows, and welcomes it. Executions the leader
    /// assigned to it that it no longer has end as lost.
    pub(super) async fn on_hello(&mut self, hello: Hello, tx: mpsc::Sender<ControlMessage>) -> Result<u64> {
        if hello.runner_id.is_empty() {
            return Err(Error::invalid("hello.runner_id", "must not be empty"));
        }
        let now = self.now();
        let lost_after = chrono::Duration::from_std(self.timing.runner_lost_after()).unwrap_or_default();
        if let Some(existing) = self.runners.get(&hello.runner_id) {
            let live = existing.tx.as_ref().is_some_and(|tx| !tx.is_closed()) && now - existing.last_seen <= lost_after;
            if live {
                // Two processes with one id would take the session from each
                // other and lose each other's runs.
                return Err(Error::FailedPrecondition(format!(
                    "runner id {:?} is already connected (last heard {} ms ago); give each runner its own --runner-id",
                    hello.runner_id,
                    (now - existing.last_seen).num_milliseconds()
                )));
            }
        }
        // Nothing changes until the Welcome is out: a stream that closed
        // meanwhile (the runner gave up on a slow leader) leaves the registry
        // as it was, placeholders of recovered runs included.
        let mut running = HashMap::new();
        let mut unknown = Vec::new();
        for f in hello.in_flight {
            let known = self.runs.get(&f.run_id).is_some_and(|r| r.current_execution() == Some(f.execution_id.as_str()));
            if known {
                running.insert(f.execution_id.clone(), f.run_id.clone());
            } else {
                unknown.push(InFlight { run_id: f.run_id, execution_id: f.execution_id, attempt: f.attempt });
            }
        }
        let welcome = ControlMessage {
            msg: Some(control_message::Msg::Welcome(Welcome {
                fencing_token: self.leadership.token,
                heartbeat_interval_ms: self.timing.heartbeat_interval.as_millis() as u32,
                leader_id: self.leader_id.clone(),
                unknown: unknown.clone(),
            })),
        };
        tx.send(welcome).await.map_err(|_| Error::Unavailable { reason: "runner stream closed".into(), leader: None })?;
        self.next_session += 1;
        let session = self.next_session;
        let previous = self.runners.remove(&hello.runner_id);
        for exec in running.keys() {
            for r in self.runners.values_mut() {
                r.running.remove(exec);
            }
        }
        let forgotten: Vec<(String, String)> =
            previous.map(|p| p.running.into_iter().filter(|(exec, _)| !running.contains_key(exec)).collect()).unwrap_or_default();
        tracing::info!(runner_id = %hello.runner_id, session, agents = ?hello.agents, slots = hello.slots, redeclared = running.len(), unknown = unknown.len(), "runner connected");
        let redeclared: Vec<(String, String)> = running.iter().map(|(e, r)| (e.clone(), r.clone())).collect();
        let instance_id = hello.instance_id;
        self.runners.insert(
            hello.runner_id.clone(),
            RunnerEntry {
                runner_id: hello.runner_id.clone(),
                session,
                tx: Some(tx),
                agents: hello.agents.into_iter().collect::<HashSet<_>>(),
                slots: hello.slots,
                labels: hello.labels.into_iter().collect(),
                version: hello.version,
                instance_id: instance_id.clone(),
                running,
                connected_at: now,
                last_seen: now,
            },
        );
        // Re-declared means started, even if the Started report was lost
        // with the previous leader.
        for (exec, run_id) in redeclared {
            self.on_started(Started { run_id, execution_id: exec, started_at: None, pid: 0 }).await;
        }
        for (exec, run_id) in forgotten {
            // The same runner process, which never had it (the Assign was lost
            // with the old stream or leader), never ran it: dispatched again as
            // the same attempt. Otherwise (a restarted runner, or it started)
            // it is lost, and the retry policy decides.
            let same_process = !instance_id.is_empty()
                && self
                    .runs
                    .get(&run_id)
                    .and_then(|r| r.attempts.last())
                    .is_some_and(|a| a.execution_id == exec && a.runner_instance == instance_id);
            let requeued = same_process
                && self
                    .requeue_unstarted(&run_id, &exec, |runner| format!("runner {runner} reconnected without it; it never started"))
                    .await;
            if !requeued {
                let why = format!("runner {} reconnected without this execution", hello.runner_id);
                self.end_attempt(&run_id, &exec, AttemptEnd::simple(outcome::LOST, why)).await;
            }
        }
        self.arm_runner_check();
        self.try_dispatch().await;
        Ok(session)
    }

    /// A message from a runner's current session (older sessions are ignored).
    pub(super) async fn on_runner_message(&mut self, runner_id: &str, session: u64, msg: runner_message::Msg) {
        let now = self.now();
        let Some(r) = self.runners.get_mut(runner_id) else { return };
        if r.session != session {
            return;
        }
        r.last_seen = now;
        match msg {
            runner_message::Msg::Heartbeat(_) => {
                let ack =
                    ControlMessage { msg: Some(control_message::Msg::HeartbeatAck(HeartbeatAck { fencing_token: self.leadership.token })) };
                if let Some(tx) = self.runners.get(runner_id).and_then(|r| r.tx.clone()) {
                    let _ = tx.try_send(ack);
                }
            }
            runner_message::Msg::Hello(_) => {}
            runner_message::Msg::Started(s) => self.on_started(s).await,
            runner_message::Msg::Progress(p) => self.on_progress(p).await,
            runner_message::Msg::Finished(f) => {
                let ack = ControlMessage {
                    msg: Some(control_message::Msg::FinishedAck(FinishedAck {
                        run_id: f.run_id.clone(),
                        execution_id: f.execution_id.clone(),
                    })),
                };
                self.on_finished(f).await;
                // The execution's runner slot is free now, whatever its record said.
                self.try_dispatch().await;
                if let Some(tx) = self.runners.get(runner_id).and_then(|r| r.tx.clone()) {
                    let _ = tx.send(ack).await;
                }
            }
        }
    }

    /// A runner's stream ended. Its executions stay assigned until it comes
    /// back and re-declares them, or is lost by silence.
    pub(super) fn on_runner_gone(&mut self, runner_id: &str, session: u64) {
        let Some(r) = self.runners.get_mut(runner_id) else { return };
        if r.session != session {
            return;
        }
        r.tx = None;
        tracing::info!(runner_id, running = r.running.len(), "runner stream ended");
        if r.running.is_empty() {
            self.runners.remove(runner_id);
        }
    }

    pub(super) fn arm_runner_check(&mut self) {
        if !self.runner_check_armed && !self.runners.is_empty() {
            self.runner_check_armed = true;
            let at = self.now() + chrono::Duration::from_std(self.timing.heartbeat_interval).unwrap_or_default();
            self.push_timer(at, Timer::RunnerCheck);
        }
    }

    /// Runners silent for `runner_lost_after` are lost; their attempts end as lost.
    pub(super) async fn on_runner_check(&mut self) {
        self.runner_check_armed = false;
        // Messages that queued up behind a long batch of timers (heartbeats
        // among them) count before silence does.
        while let Ok(cmd) = self.rx.try_recv() {
            self.handle(cmd).await;
        }
        let lost_after = chrono::Duration::from_std(self.timing.runner_lost_after()).unwrap_or_default();
        for id in expired(&self.runners, self.now(), lost_after) {
            let Some(r) = self.runners.remove(&id) else { continue };
            tracing::warn!(runner_id = %id, running = r.running.len(), "runner lost");
            for (exec, run_id) in r.running {
                let why = format!("runner {id} lost: silent for more than {} s", lost_after.num_seconds());
                self.end_attempt(&run_id, &exec, AttemptEnd::simple(outcome::LOST, why)).await;
            }
        }
        self.arm_runner_check();
    }

    /// After loading: attempts that were open when the previous leader
    /// stopped wait for their runner to re-declare them, as if that runner
    /// had been heard from just now; retries and delayed runs get timers.
    pub(super) fn recover_runs(&mut self) {
        let now = self.now();
        let slack = chrono::Duration::from_std(self.timing.deadline_slack()).unwrap_or_default();
        let redeclare_extra =
            chrono::Duration::from_std(self.timing.redeclare_wait().saturating_sub(self.timing.runner_lost_after())).unwrap_or_default();
        let mut timers = Vec::new();
        for run in self.runs.values() {
            if let Some(a) = run.attempts.last().filter(|a| a.outcome.is_none()) {
                let entry = self.runners.entry(a.runner_id.clone()).or_insert_with(|| RunnerEntry {
                    runner_id: a.runner_id.clone(),
                    session: 0,
                    tx: None,
                    agents: HashSet::new(),
                    slots: 0,
                    labels: Default::default(),
                    version: String::new(),
                    running: HashMap::new(),
                    instance_id: String::new(),
                    connected_at: now,
                    // Expires `redeclare_wait` from now (expiry is `last_seen + runner_lost_after`).
                    last_seen: now + redeclare_extra,
                });
                entry.running.insert(a.execution_id.clone(), run.run_id.clone());
                let timeout_s = self.tasks.get(&run.task_id).map_or(3600, |t| t.record.spec.execution.timeout_seconds);
                timers.push((
                    // Never before the runners had their chance to re-declare and report.
                    std::cmp::max(
                        a.dispatched_at
                            .checked_add_signed(chrono::Duration::seconds(timeout_s.min(i64::MAX / 1000)) + slack)
                            .unwrap_or(DateTime::<Utc>::MAX_UTC),
                        now + redeclare_extra + chrono::Duration::from_std(self.timing.runner_lost_after()).unwrap_or_default(),
                    ),
                    Timer::Deadline { run_id: run.run_id.clone(), execution_id: a.execution_id.clone() },
                ));
            } else if let Some(at) = run.next_attempt_at {
                timers.push((at, Timer::RunDue { run_id: run.run_id.clone() }));
            }
        }
        for (at, t) in timers {
            self.push_timer(at, t);
        }
        self.arm_runner_check();
    }

    /// Reads every non-terminal run through the `active/` index, in batched
    /// transactions of reads (one round trip per 100 runs, not per run: a
    /// new leader must be up quickly even with a backlog).
    pub(super) async fn load_active_runs(&mut self) -> Result<()> {
        let (index, _) = self.store.range(&self.keys.active_runs()).await?;
        let ids: Vec<String> =
            index.iter().filter_map(|kv| self.keys.id_after(&self.keys.active_runs(), &kv.key).map(str::to_string)).collect();
        for chunk in ids.chunks(LOAD_BATCH) {
            let txn = crate::store::Txn {
                success: chunk.iter().map(|id| crate::store::TxnOp::get(self.keys.run(id))).collect(),
                ..Default::default()
            };
            let r = self.store.txn(txn).await?;
            for (id, kv) in chunk.iter().zip(r.gets) {
                match kv.map(|kv| serde_json::from_slice::<crate::model::RunRecord>(&kv.value)) {
                    Some(Ok(run)) if !run.status.is_terminal() => {
                        self.runs.insert(run.run_id.clone(), run);
                    }
                    Some(Ok(_)) => {}
                    Some(Err(e)) => tracing::error!(run_id = %id, error = %e, "unreadable run"),
                    None => tracing::warn!(run_id = %id, "active index names a missing run"),
                }
            }
        }
        Ok(())
    }

    pub(super) fn runner_snapshots(&self) -> Vec<RunnerSnapshot> {
        let mut v: Vec<RunnerSnapshot> = self
            .runners
            .values()
            .map(|r| RunnerSnapshot {
                runner_id: r.runner_id.clone(),
                agents: {
                    let mut a: Vec<String> = r.agents.iter().cloned().collect();
                    a.sort();
                    a
                },
                slots: r.slots,
                busy: r.running.len() as u32,
                labels: r.labels.clone(),
                version: r.version.clone(),
                connected: r.tx.is_some(),
                connected_at: r.connected_at,
                last_seen: r.last_seen,
                running: r.running.values().cloned().collect(),
            })
            .collect();
        v.sort_by(|a, b| a.runner_id.cmp(&b.runner_id));
        v
    }
}
