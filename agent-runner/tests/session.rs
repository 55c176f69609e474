//! The runner session against a scriptable fake control plane: a real tonic
//! server whose `Connect` streams are handed to the test to drive by hand.

mod common;

use std::collections::BTreeMap;
use std::future::Future;
use std::path::Path;
use std::time::Duration;

use common::{PATIENCE, sh_agent, wait_until_gone};
use punchclock_agent_runner::{AgentSpec, AgentsFile, ProcessAgent, RunnerConfig, run};
use punchclock_proto::v1::runner_service_server::{RunnerService, RunnerServiceServer};
use punchclock_proto::v1::{
    Assign, Cancel, ControlMessage, Finished, FinishedAck, Hello, InFlight, Outcome, RunnerMessage, Started, Welcome,
    control_message::Msg as Control, runner_message::Msg as Report,
};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::{Request, Response, Status, Streaming};

/// The fake control plane: hands every `Connect` stream to the test.
struct FakeControlPlane {
    connections: mpsc::Sender<FakeConnection>,
}

#[tonic::async_trait]
impl RunnerService for FakeControlPlane {
    type ConnectStream = ReceiverStream<Result<ControlMessage, Status>>;

    async fn connect(&self, request: Request<Streaming<RunnerMessage>>) -> Result<Response<Self::ConnectStream>, Status> {
        let (outbound, stream) = mpsc::channel(16);
        let connection = FakeConnection { inbound: request.into_inner(), outbound };
        self.connections.send(connection).await.map_err(|_| Status::unavailable("test is over"))?;
        Ok(Response::new(ReceiverStream::new(stream)))
    }
}

/// One runner stream, seen from the control plane. Dropping it ends the
/// stream.
struct FakeConnection {
    inbound: Streaming<RunnerMessage>,
    outbound: mpsc::Sender<Result<ControlMessage, Status>>,
}

impl FakeConnection {
    async fn send(&self, msg: Control) {
        self.outbound.send(Ok(ControlMessage { msg: Some(msg) })).await.expect("runner stream open");
    }

    /// The next message other than a heartbeat, or `None` at end of stream.
    async fn next(&mut self) -> Option<Report> {
        loop {
            let message = tokio::time::timeout(PATIENCE, self.inbound.message()).await.expect("a runner message in time");
            match message {
                Ok(Some(RunnerMessage { msg: Some(Report::Heartbeat(_)) })) => continue,
                Ok(Some(RunnerMessage { msg })) => return Some(msg.expect("message has a body")),
                Ok(None) | Err(_) => return None,
            }
        }
    }

    async fn recv(&mut self) -> Report {
        self.next().await.expect("runner stream open")
    }

    async fn hello(&mut self) -> Hello {
        match self.recv().await {
            Report::Hello(hello) => hello,
            other => panic!("expected Hello, got {other:?}"),
        }
    }

    async fn started(&mut self) -> Started {
        match self.recv().await {
            Report::Started(started) => started,
            other => panic!("expected Started, got {other:?}"),
        }
    }

    async fn finished(&mut self) -> Finished {
        loop {
            match self.recv().await {
                Report::Finished(finished) => return finished,
                Report::Progress(_) => continue,
                other => panic!("expected Finished, got {other:?}"),
            }
        }
    }

    async fn welcome(&self, fencing_token: u64, unknown: Vec<InFlight>) {
        self.send(Control::Welcome(Welcome {
            fencing_token,
            heartbeat_interval_ms: 60_000,
            leader_id: "fake-leader".into(),
            unknown,
            fence_ms: 0,
            stop_lead_ms: 0,
        }))
        .await;
    }

    async fn ack(&self, finished: &Finished) {
        self.send(Control::FinishedAck(FinishedAck { run_id: finished.run_id.clone(), execution_id: finished.execution_id.clone() })).await;
    }

    /// Everything the runner still sends until it closes the stream.
    async fn rest(&mut self) -> Vec<Report> {
        let mut rest = Vec::new();
        while let Some(message) = self.next().await {
            rest.push(message);
        }
        rest
    }
}

/// Serves the fake on 127.0.0.1:0; returns its address and the stream of
/// runner connections.
async fn fake_control_plane() -> (String, mpsc::Receiver<FakeConnection>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = format!("http://{}", listener.local_addr().expect("local address"));
    let (connections, accepted) = mpsc::channel(4);
    let service = RunnerServiceServer::new(FakeControlPlane { connections });
    tokio::spawn(tonic::transport::Server::builder().add_service(service).serve_with_incoming(TcpListenerStream::new(listener)));
    (address, accepted)
}

async fn accept(accepted: &mut mpsc::Receiver<FakeConnection>) -> FakeConnection {
    tokio::time::timeout(PATIENCE, accepted.recv()).await.expect("the runner connects in time").expect("server running")
}

fn config(address: String, work_dir: &Path, agents: Vec<(&str, ProcessAgent)>) -> RunnerConfig {
    let agents = AgentsFile { agents: agents.into_iter().map(|(id, agent)| (id.to_owned(), AgentSpec::Process(agent))).collect() };
    let mut config = RunnerConfig::new("runner-1", vec![address], agents);
    config.slots = 2;
    config.labels = BTreeMap::from([("zone".to_owned(), "test".to_owned())]);
    config.kill_grace = Duration::from_millis(300);
    config.work_dir = work_dir.to_owned();
    config
}

/// Runs the runner in the background; send on the returned channel to shut
/// it down.
fn spawn_runner(config: RunnerConfig) -> (oneshot::Sender<()>, JoinHandle<()>) {
    let (stop, stopped) = oneshot::channel::<()>();
    let shutdown = async {
        let _ = stopped.await;
    };
    let runner = tokio::spawn(async move { run(config, shutdown).await.expect("runner config is valid") });
    (stop, runner)
}

async fn shut_down(stop: oneshot::Sender<()>, runner: impl Future<Output = Result<(), tokio::task::JoinError>>) {
    stop.send(()).expect("runner still running");
    tokio::time::timeout(PATIENCE, runner).await.expect("runner stops in time").expect("runner did not panic");
}

fn assignment(execution_id: &str, agent_id: &str, fencing_token: u64) -> Assign {
    Assign {
        run_id: format!("run-{execution_id}"),
        execution_id: execution_id.into(),
        attempt: 1,
        task_id: "task-1".into(),
        agent_id: agent_id.into(),
        context_json: "{}".into(),
        fencing_token,
        ..Assign::default()
    }
}

fn mentions(report: &Report, execution_id: &str) -> bool {
    match report {
        Report::Started(m) => m.execution_id == execution_id,
        Report::Progress(m) => m.execution_id == execution_id,
        Report::Finished(m) => m.execution_id == execution_id,
        Report::Hello(m) => m.in_flight.iter().any(|f| f.execution_id == execution_id),
        Report::Heartbeat(_) => false,
    }
}

/// An agent that runs until the file `gate` exists, then reports a result.
fn gated_agent(gate: &Path) -> ProcessAgent {
    let mut agent = sh_agent(r#"while [ ! -e "$GATE" ]; do sleep 0.02; done; printf '{"done":true}' > "$PUNCHCLOCK_RESULT_FILE""#);
    agent.env.insert("GATE".into(), gate.display().to_string());
    agent
}

#[tokio::test]
async fn runs_assignments_and_refuses_stale_or_impossible_ones() {
    let work = tempfile::tempdir().expect("tempdir");
    let (address, mut accepted) = fake_control_plane().await;
    let ok = sh_agent(r#"printf '%s' '{"ok":true}' > "$PUNCHCLOCK_RESULT_FILE""#);
    let (stop, runner) = spawn_runner(config(address, work.path(), vec![("ok", ok)]));

    let mut conn = accept(&mut accepted).await;
    let hello = conn.hello().await;
    assert_eq!(hello.runner_id, "runner-1");
    assert_eq!(hello.agents, ["ok"]);
    assert_eq!(hello.slots, 2);
    assert_eq!(hello.labels.get("zone").map(String::as_str), Some("test"));
    assert_eq!(hello.version, env!("CARGO_PKG_VERSION"));
    assert!(hello.in_flight.is_empty());
    assert_eq!(hello.max_token_seen, 0);

    conn.welcome(7, vec![]).await;
    // Agents start in tasks of their own, so reports come in any order.
    conn.send(Control::Assign(assignment("stale", "ok", 6))).await;
    conn.send(Control::Assign(assignment("e1", "ok", 7))).await;
    conn.send(Control::Assign(assignment("e-nope", "nope", 7))).await;

    let (mut started, mut finished) = (Vec::new(), Vec::new());
    while started.is_empty() || finished.len() < 2 {
        match conn.recv().await {
            Report::Started(s) => started.push(s),
            Report::Finished(f) => finished.push(f),
            Report::Progress(_) => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    let started = started.remove(0);
    assert_eq!((started.run_id.as_str(), started.execution_id.as_str()), ("run-e1", "e1"));
    assert!(started.pid > 0);
    assert!(started.started_at.is_some());
    let (e1, refused) =
        if finished[0].execution_id == "e1" { (finished.remove(0), finished.remove(0)) } else { (finished.remove(1), finished.remove(0)) };

    assert_eq!(e1.execution_id, "e1");
    assert_eq!(e1.outcome(), Outcome::Succeeded, "{e1:?}");
    assert_eq!(e1.result_json, r#"{"ok":true}"#);
    assert_eq!(refused.execution_id, "e-nope");
    assert_eq!(refused.outcome(), Outcome::Refused);
    assert!(refused.error.contains("unknown agent"), "{}", refused.error);
    conn.ack(&e1).await;
    conn.ack(&refused).await;

    shut_down(stop, runner).await;
    let rest = conn.rest().await;
    assert!(!rest.iter().any(|m| mentions(m, "stale")), "stale assignment was run: {rest:?}");
    assert!(!rest.iter().any(|m| matches!(m, Report::Finished(_))), "acked reports re-sent: {rest:?}");
}

#[tokio::test]
async fn reconnects_redeclares_in_flight_and_resends_finished_until_acked() {
    let work = tempfile::tempdir().expect("tempdir");
    let gate = work.path().join("gate");
    let (address, mut accepted) = fake_control_plane().await;
    let agents = vec![("slow", gated_agent(&gate)), ("quick", sh_agent("true"))];
    let (stop, runner) = spawn_runner(config(address, &work.path().join("runs"), agents));

    // 1st stream: start the slow agent, then drop the stream.
    let mut conn = accept(&mut accepted).await;
    assert!(conn.hello().await.in_flight.is_empty());
    conn.welcome(3, vec![]).await;
    conn.send(Control::Assign(assignment("e-slow", "slow", 3))).await;
    assert_eq!(conn.started().await.execution_id, "e-slow");
    drop(conn);

    // 2nd stream: the execution is still running and re-declared.
    let mut conn = accept(&mut accepted).await;
    let hello = conn.hello().await;
    assert_eq!(hello.in_flight.len(), 1);
    let declared = &hello.in_flight[0];
    assert_eq!((declared.run_id.as_str(), declared.execution_id.as_str(), declared.attempt), ("run-e-slow", "e-slow", 1));
    assert!(declared.started_at.is_some(), "the start time travels with the re-declaration");
    assert_eq!(hello.max_token_seen, 3);
    conn.welcome(3, vec![]).await;
    std::fs::write(&gate, "").expect("open the gate");
    let finished = conn.finished().await;
    assert_eq!(finished.execution_id, "e-slow");
    assert_eq!(finished.outcome(), Outcome::Succeeded, "{finished:?}");
    assert_eq!(finished.result_json, r#"{"done":true}"#);
    drop(conn); // without acknowledging it

    // 3rd stream: the finished-but-unacknowledged execution is still
    // declared in Hello (so a new leader does not presume it lost), and its
    // Finished is sent again right after Welcome.
    let mut conn = accept(&mut accepted).await;
    let declared = conn.hello().await.in_flight;
    assert_eq!(declared.iter().map(|f| f.execution_id.as_str()).collect::<Vec<_>>(), ["e-slow"]);
    conn.welcome(3, vec![]).await;
    assert_eq!(conn.finished().await, finished);
    conn.ack(&finished).await;
    conn.send(Control::Assign(assignment("e-quick", "quick", 3))).await;
    assert_eq!(conn.started().await.execution_id, "e-quick");
    let quick = conn.finished().await;
    assert_eq!(quick.outcome(), Outcome::Succeeded);
    conn.ack(&quick).await;
    drop(conn);

    // 4th stream: nothing left to re-send, so the first report is Started.
    let mut conn = accept(&mut accepted).await;
    conn.hello().await;
    conn.welcome(3, vec![]).await;
    conn.send(Control::Assign(assignment("e-quick-2", "quick", 3))).await;
    assert_eq!(conn.started().await.execution_id, "e-quick-2");
    let quick = conn.finished().await;
    conn.ack(&quick).await;

    shut_down(stop, runner).await;
    assert!(common::dir_entries(&work.path().join("runs")).is_empty());
}

#[tokio::test]
async fn cancels_and_stops_executions_unknown_to_the_leader() {
    let work = tempfile::tempdir().expect("tempdir");
    let (address, mut accepted) = fake_control_plane().await;
    let sleeper = sh_agent("exec sleep 3600");
    let (stop, runner) = spawn_runner(config(address, work.path(), vec![("sleeper", sleeper)]));

    let mut conn = accept(&mut accepted).await;
    conn.hello().await;
    conn.welcome(1, vec![]).await;
    conn.send(Control::Assign(assignment("e-orphan", "sleeper", 1))).await;
    let orphan = conn.started().await;
    conn.send(Control::Assign(assignment("e-cancel", "sleeper", 1))).await;
    conn.started().await;

    // All slots are busy: a third assignment is refused at once.
    conn.send(Control::Assign(assignment("e-extra", "sleeper", 1))).await;
    let refused = conn.finished().await;
    assert_eq!(refused.execution_id, "e-extra");
    assert!(refused.error.contains("slot"), "{}", refused.error);
    conn.ack(&refused).await;

    conn.send(Control::Cancel(Cancel { run_id: "run-e-cancel".into(), execution_id: "e-cancel".into(), reason: "user asked".into() }))
        .await;
    let cancelled = conn.finished().await;
    assert_eq!(cancelled.execution_id, "e-cancel");
    assert_eq!(cancelled.outcome(), Outcome::Cancelled);
    assert_eq!(cancelled.error, "cancelled: user asked");
    conn.ack(&cancelled).await;
    drop(conn);

    // The new leader does not know e-orphan: the runner stops it and says
    // so (a leader that ended it keeps its slot until it hears this).
    let mut conn = accept(&mut accepted).await;
    let in_flight = conn.hello().await.in_flight;
    assert_eq!(in_flight.len(), 1);
    conn.welcome(2, in_flight).await;
    let pid = i32::try_from(orphan.pid).expect("pid fits");
    assert!(wait_until_gone(pid).await, "unknown execution {pid} still running");
    let stopped = conn.finished().await;
    assert_eq!((stopped.execution_id.as_str(), stopped.outcome()), ("e-orphan", Outcome::Cancelled), "{stopped:?}");
    conn.ack(&stopped).await;

    shut_down(stop, runner).await;
    let rest = conn.rest().await;
    assert!(!rest.iter().any(|m| matches!(m, Report::Finished(_))), "acked report re-sent: {rest:?}");
}

#[tokio::test]
/// Shutdown interrupts executions and reports them INTERRUPTED, so the
/// control plane dispatches them again without spending an attempt;
/// CANCELLED would end the run for good, FAILED would spend an attempt.
async fn shutdown_interrupts_running_executions_and_reports_them() {
    let work = tempfile::tempdir().expect("tempdir");
    let (address, mut accepted) = fake_control_plane().await;
    let (stop, runner) = spawn_runner(config(address, work.path(), vec![("sleeper", sh_agent("exec sleep 3600"))]));

    let mut conn = accept(&mut accepted).await;
    conn.hello().await;
    conn.welcome(1, vec![]).await;
    conn.send(Control::Assign(assignment("e-long", "sleeper", 1))).await;
    let started = conn.started().await;

    stop.send(()).expect("runner running");
    let finished = conn.finished().await;
    assert_eq!(finished.execution_id, "e-long");
    assert_eq!(finished.outcome(), Outcome::Interrupted);
    assert_eq!(finished.error, "interrupted: runner shutting down");
    conn.ack(&finished).await;
    tokio::time::timeout(PATIENCE, runner).await.expect("runner stops in time").expect("runner did not panic");
    assert!(wait_until_gone(i32::try_from(started.pid).expect("pid fits")).await);
}

/// Self-fence: agents keep running while a leader acknowledges the
/// runner's heartbeats, and are interrupted (reported INTERRUPTED) once no
/// acknowledgement came for the fence deadline, though the stream is open.
#[tokio::test]
async fn agents_stop_once_no_leader_acknowledged_the_runner_for_the_fence_deadline() {
    let work = tempfile::tempdir().expect("tempdir");
    let (address, mut accepted) = fake_control_plane().await;
    let (stop, runner) = spawn_runner(config(address, work.path(), vec![("sleeper", sh_agent("exec sleep 3600"))]));
    let mut conn = accept(&mut accepted).await;
    conn.hello().await;
    let fence = Duration::from_secs(3);
    conn.send(Control::Welcome(Welcome {
        fencing_token: 1,
        heartbeat_interval_ms: 1000,
        leader_id: "fake-leader".into(),
        unknown: vec![],
        fence_ms: u64::try_from(fence.as_millis()).expect("fits"),
        // A leader before the field: the runner counts on 1 s.
        stop_lead_ms: 0,
    }))
    .await;
    conn.send(Control::Assign(assignment("e-fenced", "sleeper", 1))).await;
    let started = match conn.inbound.message().await {
        Ok(Some(RunnerMessage { msg: Some(Report::Started(s)) })) => s,
        other => panic!("expected Started, got {other:?}"),
    };
    let fence_file = work.path().join(punchclock_agent_runner::fence::FENCE_FILE);
    assert!(punchclock_agent_runner::fence::read_deadline(&fence_file).is_some(), "the shims' deadline file is written");

    // Acknowledge every heartbeat for longer than the fence: the agent lives.
    let acked_until = tokio::time::Instant::now() + fence + Duration::from_secs(1);
    while tokio::time::Instant::now() < acked_until {
        match tokio::time::timeout(PATIENCE, conn.inbound.message()).await.expect("a message") {
            Ok(Some(RunnerMessage { msg: Some(Report::Heartbeat(h)) })) => {
                conn.send(Control::HeartbeatAck(punchclock_proto::v1::HeartbeatAck { fencing_token: 1, seq: h.seq })).await;
            }
            other => panic!("the execution must keep running while acknowledged: {other:?}"),
        }
    }
    let pid = i32::try_from(started.pid).expect("pid fits");
    assert!(!common::process_gone(pid), "agent alive while its runner is acknowledged");

    // Stop acknowledging: interrupted by the fence, still on this stream.
    let stopped_at = tokio::time::Instant::now();
    let finished = conn.finished().await;
    assert_eq!(finished.outcome(), Outcome::Interrupted, "{finished:?}");
    assert!(finished.error.contains(punchclock_agent_runner::fence::FENCE_REASON), "{}", finished.error);
    assert!(stopped_at.elapsed() < fence, "stopped before the deadline: {:?}", stopped_at.elapsed());
    assert!(wait_until_gone(pid).await);
    conn.ack(&finished).await;
    shut_down(stop, runner).await;
}

/// Found by breaking it: SIGTERM while the runner was between leaders
/// dropped its interrupted report, and the run came back `lost` (an
/// attempt spent). It now makes one bounded try to deliver it first.
#[tokio::test]
async fn shutdown_while_disconnected_still_delivers_the_interrupted_report() {
    let work = tempfile::tempdir().expect("tempdir");
    let (address, mut accepted) = fake_control_plane().await;
    let (stop, runner) = spawn_runner(config(address, work.path(), vec![("sleeper", sh_agent("exec sleep 3600"))]));
    let mut conn = accept(&mut accepted).await;
    conn.hello().await;
    conn.welcome(1, vec![]).await;
    conn.send(Control::Assign(assignment("e-long", "sleeper", 1))).await;
    conn.started().await;
    drop(conn);
    // The runner reconnects; this leader never answers its Hello.
    let mut silent = accept(&mut accepted).await;
    silent.hello().await;
    stop.send(()).expect("runner running");
    // It delivers the interrupted execution's report on a new stream.
    let mut conn = accept(&mut accepted).await;
    let hello = conn.hello().await;
    assert!(hello.in_flight.iter().any(|f| f.execution_id == "e-long"), "{hello:?}");
    conn.welcome(1, vec![]).await;
    let finished = conn.finished().await;
    assert_eq!((finished.execution_id.as_str(), finished.outcome()), ("e-long", Outcome::Interrupted), "{finished:?}");
    conn.ack(&finished).await;
    tokio::time::timeout(PATIENCE, runner).await.expect("runner stops in time").expect("runner did not panic");
    drop(silent);
}
