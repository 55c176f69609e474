//! `RunnerService.Connect`: one bidi stream per runner, served by the
//! leader. The first message must be Hello; the rest are converted to the
//! engine's protocol types, stamped with their arrival time and forwarded
//! tagged with the stream's session, so a late end of an old stream cannot
//! tear down a newer one. Messages from the engine are converted back as
//! they are streamed out.
//!
//! The engine never waits on a runner: it `try_send`s into the bounded
//! outbound queue and drops the runner's sender when the queue is full.
//! That ends the response stream, and dropping the kill switch stops the
//! reader below.

use std::pin::Pin;
use std::sync::Arc;

use futures::{Stream, StreamExt};
use punchclock_proto::time::{from_timestamp_opt, to_timestamp};
use punchclock_proto::v1 as pb;
use punchclock_proto::v1::runner_message::Msg;
use punchclock_proto::v1::runner_service_server::RunnerService;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use super::status;
use crate::api::Core;
use crate::auth::Principal;
use crate::engine::protocol::{FinishedReport, FromRunner, InFlightExec, ReportedOutcome, RunnerHello, ToRunner};
use crate::error::Error;

/// Outbound messages buffered per runner stream beyond two per slot (a
/// burst can assign every slot at once, each with an ack to follow): a
/// runner that leaves this many unread is disconnected.
const OUTBOUND_BUFFER: usize = 256;
/// Upper bound of a runner stream's buffer.
const MAX_OUTBOUND_BUFFER: usize = 65_536;
/// Longest runner id (and agent id offered in a Hello).
pub const MAX_RUNNER_ID_LEN: usize = 128;
/// Most agents one runner may offer.
const MAX_AGENTS: usize = 1024;
/// Longest error text and progress message kept from a runner, in bytes.
const MAX_TEXT_BYTES: usize = 4096;
/// Longest output tail kept from a runner, in bytes (the runner keeps 64 KiB).
const MAX_TAIL_BYTES: usize = 64 * 1024;
/// Largest result or checkpoint kept from a runner, as JSON text, in
/// bytes; larger ones are replaced by a marker (a run record must fit a
/// store transaction).
const MAX_JSON_BYTES: usize = 512 * 1024;

/// `punchclock.v1.RunnerService`.
pub struct RunnerSvc(pub Arc<Core>);

#[tonic::async_trait]
impl RunnerService for RunnerSvc {
    type ConnectStream = Pin<Box<dyn Stream<Item = Result<pb::ControlMessage, Status>> + Send + 'static>>;

    async fn connect(&self, req: Request<Streaming<pb::RunnerMessage>>) -> Result<Response<Self::ConnectStream>, Status> {
        let engine = self.0.engine().await.map_err(status)?;
        let principal = req.extensions().get::<Principal>().cloned();
        let mut inbound = req.into_inner();
        let hello = match inbound.message().await? {
            Some(pb::RunnerMessage { msg: Some(Msg::Hello(h)) }) => hello_from_pb(h).map_err(status)?,
            _ => return Err(status(Error::invalid("msg", "the first message on the stream must be Hello"))),
        };
        // The runner is who its token (or client certificate) says.
        if let Some(p) = &principal {
            if let Err(refused) = p.check_hello(&hello.runner_id, &hello.agents, &hello.labels) {
                if let Some(repeats) = crate::auth::refusal_due(&format!("runner|{}|{}|{}", p.name, hello.runner_id, refused.message())) {
                    tracing::warn!(target: "punchclock::audit", token = %p.name, runner_id = %hello.runner_id, reason = %refused.message(), repeats, "runner refused");
                }
                return Err(refused);
            }
            tracing::info!(target: "punchclock::audit", token = %p.name, runner_id = %hello.runner_id, "runner connected");
        }
        let runner_id = hello.runner_id.clone();
        let capacity = (hello.slots as usize).saturating_mul(2).saturating_add(OUTBOUND_BUFFER).min(MAX_OUTBOUND_BUFFER);
        let (tx, rx) = mpsc::channel(capacity);
        let (kill, mut killed) = oneshot::channel::<()>();
        let session = engine.runner_hello(hello, tx, kill).await.map_err(status)?;
        let clock = self.0.clock.clone();
        tokio::spawn(async move {
            loop {
                let next = tokio::select! {
                    // The engine dropped this session (not draining, silent, replaced).
                    _ = &mut killed => break,
                    m = inbound.message() => m,
                };
                match next {
                    Ok(Some(pb::RunnerMessage { msg: Some(msg) })) => {
                        let received_at = clock.read();
                        let Some(msg) = from_pb(msg) else { continue };
                        if engine.runner_message(runner_id.clone(), session, received_at, msg).await.is_err() {
                            break;
                        }
                    }
                    Ok(Some(_)) => {}
                    Ok(None) => break,
                    Err(e) => {
                        tracing::debug!(runner_id = %runner_id, error = %e, "runner stream error");
                        break;
                    }
                }
            }
            engine.runner_gone(runner_id, session).await;
        });
        Ok(Response::new(ReceiverStream::new(rx).map(|m| Ok(to_pb(m))).boxed()))
    }
}

/// Validates and converts a Hello.
///
/// Errors: [`Error::InvalidArgument`] naming `hello.runner_id` when it is
/// empty, longer than 128 characters, or has characters other than
/// letters, digits, `_`, `-`, `.`, `:` and `@` (it appears in logs and records).
pub fn hello_from_pb(h: pb::Hello) -> crate::error::Result<RunnerHello> {
    let id = &h.runner_id;
    if id.is_empty() {
        return Err(Error::invalid("hello.runner_id", "must not be empty"));
    }
    if id.chars().count() > MAX_RUNNER_ID_LEN {
        return Err(Error::invalid("hello.runner_id", format!("longer than {MAX_RUNNER_ID_LEN} characters")));
    }
    if let Some(c) = id.chars().find(|c| !(c.is_ascii_alphanumeric() || "_-.:@".contains(*c))) {
        return Err(Error::invalid("hello.runner_id", format!("has {c:?}; use letters, digits and _ - . : @")));
    }
    // Agent ids appear in logs, metrics labels and refusals: bounded.
    if h.agents.len() > MAX_AGENTS {
        return Err(Error::invalid("hello.agents", format!("{} agents; at most {MAX_AGENTS}", h.agents.len())));
    }
    if let Some(a) = h.agents.iter().find(|a| a.is_empty() || a.chars().count() > MAX_RUNNER_ID_LEN || a.chars().any(char::is_control)) {
        let shown: String = a.chars().take(32).collect();
        return Err(Error::invalid(
            "hello.agents",
            format!("{shown:?}: agent ids are 1 to {MAX_RUNNER_ID_LEN} characters, no control characters"),
        ));
    }
    Ok(RunnerHello {
        runner_id: h.runner_id,
        agents: h.agents,
        slots: h.slots,
        labels: h.labels.into_iter().collect(),
        version: cap(h.version, MAX_TEXT_BYTES),
        in_flight: h
            .in_flight
            .into_iter()
            .map(|f| InFlightExec {
                run_id: f.run_id,
                execution_id: f.execution_id,
                attempt: f.attempt,
                started_at: from_timestamp_opt(f.started_at.as_ref()),
            })
            .collect(),
        instance_id: cap(h.instance_id, MAX_TEXT_BYTES),
    })
}

/// Cuts `s` to at most `max` bytes (at a character boundary), keeping the
/// end and saying how much was cut ([`punchclock_proto::output::tail`]).
fn cap_tail(s: String, max: usize) -> String {
    if s.len() <= max { s } else { punchclock_proto::output::tail(&s, 0, max) }
}

/// Cuts `s` to at most `max` bytes (at a character boundary), keeping the start.
fn cap(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut end = max;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
    }
    s
}

/// A JSON document from a runner: parsed (non-JSON text becomes a string),
/// or a marker object when it is too large to keep.
fn json_from(s: String) -> Option<serde_json::Value> {
    if s.is_empty() {
        return None;
    }
    if s.len() > MAX_JSON_BYTES {
        return Some(serde_json::json!({ "trimmed": true, "bytes": s.len(), "limit": MAX_JSON_BYTES }));
    }
    Some(serde_json::from_str(&s).unwrap_or(serde_json::Value::String(s)))
}

fn outcome_from_pb(o: i32) -> ReportedOutcome {
    match pb::Outcome::try_from(o).unwrap_or(pb::Outcome::Unspecified) {
        pb::Outcome::Succeeded => ReportedOutcome::Succeeded,
        pb::Outcome::Timeout => ReportedOutcome::Timeout,
        pb::Outcome::Cancelled => ReportedOutcome::Cancelled,
        pb::Outcome::Refused => ReportedOutcome::Refused,
        pb::Outcome::Interrupted => ReportedOutcome::Interrupted,
        pb::Outcome::Failed | pb::Outcome::Unspecified => ReportedOutcome::Failed,
    }
}

/// A runner message after Hello, in the engine's terms (`None`: a second
/// Hello, which is ignored).
pub fn from_pb(m: Msg) -> Option<FromRunner> {
    Some(match m {
        Msg::Hello(_) => return None,
        Msg::Heartbeat(h) => FromRunner::Heartbeat { seq: h.seq, draining: h.draining, acked_seq: h.acked_seq },
        Msg::Started(s) => {
            FromRunner::Started { run_id: s.run_id, execution_id: s.execution_id, started_at: from_timestamp_opt(s.started_at.as_ref()) }
        }
        Msg::Progress(p) => FromRunner::Progress {
            run_id: p.run_id,
            execution_id: p.execution_id,
            percent: p.percent.filter(|v| v.is_finite()).map(|v| v.clamp(0.0, 100.0)),
            message: cap(p.message, MAX_TEXT_BYTES),
            checkpoint: json_from(p.checkpoint_json),
        },
        Msg::Finished(f) => FromRunner::Finished(Box::new(FinishedReport {
            run_id: f.run_id,
            execution_id: f.execution_id,
            outcome: outcome_from_pb(f.outcome),
            result: json_from(f.result_json),
            error: cap(f.error, MAX_TEXT_BYTES),
            exit_code: f.exit_code,
            stdout_tail: cap_tail(f.stdout_tail, MAX_TAIL_BYTES),
            stderr_tail: cap_tail(f.stderr_tail, MAX_TAIL_BYTES),
            started_at: from_timestamp_opt(f.started_at.as_ref()),
            finished_at: from_timestamp_opt(f.finished_at.as_ref()),
            class: Some(f.class.chars().filter(|c| !c.is_control()).take(64).collect::<String>()).filter(|c| !c.is_empty()),
            machine: crate::model::run::MachineUse::from_report(f.peak_memory_bytes, f.cpu_seconds),
        })),
    })
}

fn in_flight_pb(f: InFlightExec) -> pb::InFlight {
    pb::InFlight { run_id: f.run_id, execution_id: f.execution_id, attempt: f.attempt, started_at: f.started_at.map(to_timestamp) }
}

/// An engine message on the wire.
pub fn to_pb(m: ToRunner) -> pb::ControlMessage {
    use pb::control_message::Msg as Out;
    let msg = match m {
        ToRunner::Welcome { fencing_token, heartbeat_interval_ms, leader_id, unknown, fence_ms, stop_lead_ms } => {
            Out::Welcome(pb::Welcome {
                fencing_token,
                heartbeat_interval_ms,
                leader_id,
                unknown: unknown.into_iter().map(in_flight_pb).collect(),
                fence_ms,
                stop_lead_ms,
            })
        }
        ToRunner::Assign(a) => Out::Assign(pb::Assign {
            run_id: a.run_id,
            execution_id: a.execution_id,
            attempt: a.attempt,
            task_id: a.task_id,
            agent_id: a.agent_id,
            context_json: a.context_json,
            checkpoint_json: a.checkpoint_json,
            deadline: Some(to_timestamp(a.deadline)),
            timeout_seconds: a.timeout_seconds,
            fencing_token: a.fencing_token,
            traceparent: if a.trace_id.is_empty() {
                String::new()
            } else {
                punchclock_proto::tracecontext::format(&a.trace_id, &a.span_id)
            },
            scheduled_at: Some(to_timestamp(a.scheduled_at)),
            tracestate: a.trace_state,
            baggage: a.baggage,
            limits: a.limits.map(|l| pb::ExecutionLimits { memory_max_bytes: l.memory_max, cpu: l.cpu, pids_max: l.pids_max }),
        }),
        ToRunner::Cancel { run_id, execution_id, reason } => Out::Cancel(pb::Cancel { run_id, execution_id, reason }),
        ToRunner::FinishedAck { run_id, execution_id } => Out::FinishedAck(pb::FinishedAck { run_id, execution_id }),
        ToRunner::HeartbeatAck { fencing_token, seq } => Out::HeartbeatAck(pb::HeartbeatAck { fencing_token, seq }),
    };
    pb::ControlMessage { msg: Some(msg) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runner_ids_are_bounded_and_plain() {
        let hello = |id: &str| hello_from_pb(pb::Hello { runner_id: id.into(), ..Default::default() });
        assert!(hello("runner-host1.example:7@x").is_ok());
        assert!(matches!(hello(""), Err(Error::InvalidArgument { .. })));
        assert!(matches!(hello(&"r".repeat(129)), Err(Error::InvalidArgument { .. })));
        match hello("bad\nid") {
            Err(Error::InvalidArgument { field, .. }) => assert_eq!(field, "hello.runner_id"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn oversized_runner_text_is_capped() {
        let f = pb::Finished {
            result_json: format!("\"{}\"", "x".repeat(MAX_JSON_BYTES + 10)),
            stdout_tail: "é".repeat(MAX_TAIL_BYTES),
            error: "e".repeat(10_000),
            outcome: pb::Outcome::Interrupted as i32,
            ..Default::default()
        };
        let Some(FromRunner::Finished(f)) = from_pb(Msg::Finished(f)) else { panic!("finished") };
        assert_eq!(f.outcome, ReportedOutcome::Interrupted);
        assert_eq!(f.result.as_ref().and_then(|r| r.get("trimmed")), Some(&serde_json::Value::Bool(true)));
        assert!(f.stdout_tail.len() <= MAX_TAIL_BYTES);
        assert!(f.error.len() <= MAX_TEXT_BYTES);
    }
}
