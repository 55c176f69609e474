//! Invariant 4 (issue 6): no runner can stall the engine. A runner says
//! Hello, then floods reports and never reads its stream. The engine never
//! waits on it (its full stream gets it disconnected), so a task firing
//! every second keeps firing on time (lag p99 < 1 s) and the API answers.
//! Before, the engine blocked on the flooding runner's full channel and
//! scheduling of every task stopped (81 s in the report).

use std::time::{Duration, Instant};

use punchclock_proto::v1 as pb;
use punchclock_tests::{KeepLogsOnPanic, Proc, RawRunner, apply, at, cli, list_runs, status, wait_n_runs};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_that_floods_and_never_reads_stalls_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "inv_no_stall");
    let dev = Proc::dev(&dir.path().join("data"));
    apply(&dev.addr, json!({"task_id": "victim", "agent_id": "remote_agent"})).await;
    apply(&dev.addr, json!({"task_id": "tick", "agent_id": "ok_agent", "trigger": {"type": "interval", "every": "1s"}})).await;
    wait_n_runs(&dev.addr, "tick", 2, Duration::from_secs(30), |r| status(r) == pb::RunStatus::Succeeded).await;

    // The flooder: Hello, then Finished reports (each wants an ack) and
    // heartbeats as fast as it can; it never reads what comes back. Cut
    // off, it connects again and goes on, for 20 s.
    let addr = dev.addr.clone();
    let flood_start = chrono::Utc::now();
    let flood = tokio::spawn(async move {
        let mut sent = 0u64;
        let mut streams = 0;
        let until = Instant::now() + Duration::from_secs(20);
        while Instant::now() < until {
            let RawRunner { tx, inbound, .. } = RawRunner::connect(&addr, "flooder", &["remote_agent"], "f1", vec![]).await;
            streams += 1;
            while Instant::now() < until {
                let f = pb::Finished {
                    run_id: format!("victim.manual-{}", sent % 50),
                    execution_id: format!("forged-{}", sent % 50),
                    outcome: pb::Outcome::Succeeded as i32,
                    ..Default::default()
                };
                let hb = pb::Heartbeat { running: 0, seq: sent, draining: false, acked_seq: sent };
                let msgs = [pb::runner_message::Msg::Finished(f), pb::runner_message::Msg::Heartbeat(hb)];
                let mut cut = false;
                for m in msgs {
                    // The stream is cut once the engine disconnects the flooder.
                    cut |= tx.send(pb::RunnerMessage { msg: Some(m) }).await.is_err();
                    sent += 1;
                }
                if cut {
                    break;
                }
                tokio::task::yield_now().await;
            }
            drop(inbound);
        }
        (sent, streams)
    });

    // The API answers meanwhile.
    let mut slowest = Duration::ZERO;
    for i in 0..8 {
        let t = Instant::now();
        cli(&dev.addr, &["runners", "list"]);
        cli(&dev.addr, &["task", "trigger", "tick", "--key", &format!("during-flood-{i}")]);
        slowest = slowest.max(t.elapsed());
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let (sent, streams) = flood.await.expect("flooder");
    let flood_end = chrono::Utc::now();
    println!("flooder sent {sent} messages on {streams} streams; slowest API round {slowest:?}");
    assert!(slowest < Duration::from_secs(3), "the API answered slowly: {slowest:?}");

    // Every slot of the flood window ran, on time.
    wait_n_runs(&dev.addr, "tick", 1, Duration::from_secs(10), |r| {
        at(&r.scheduled_at).is_some_and(|t| t > flood_end) && status(r) == pb::RunStatus::Succeeded
    })
    .await;
    let runs = list_runs(&dev.addr, "tick").await;
    let mut lags: Vec<i64> = runs
        .iter()
        .filter(|r| r.trigger_kind == "interval")
        .filter(|r| at(&r.scheduled_at).is_some_and(|t| t > flood_start && t < flood_end))
        .map(|r| {
            assert_eq!(status(r), pb::RunStatus::Succeeded, "{r:#?}");
            (at(&r.actual_started_at).expect("started") - at(&r.scheduled_at).expect("slot")).num_milliseconds()
        })
        .collect();
    lags.sort();
    let window = (flood_end - flood_start).num_seconds();
    assert!(window >= 19 && lags.len() as i64 >= window - 1, "every slot of the {window} s flood window ran: {lags:?}");
    let p99 = lags[(lags.len() * 99).div_ceil(100) - 1];
    println!("lag over {} slots: p50 {} ms, p99 {p99} ms", lags.len(), lags[lags.len() / 2]);
    assert!(p99 < 1000, "lag p99 {p99} ms: {lags:?}");
    assert!(dev.log_text().contains("its stream does not drain"), "the flooder was disconnected for not reading");
}

/// A runner that heartbeats but never reads its stream (its acks never
/// come back in its heartbeats) is cut off after 10 heartbeats, although
/// its stream buffers are far from full; the run assigned to it meanwhile
/// goes elsewhere. Before, such a runner kept its slot and its run for the
/// run's whole timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_that_heartbeats_but_never_reads_is_cut_off() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "inv_no_read");
    let dev = Proc::dev(&dir.path().join("data"));
    // Hello, retried while the control plane is not leading yet.
    let (tx, _inbound) = loop {
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        let hello = pb::Hello {
            runner_id: "deaf".into(),
            agents: vec!["remote_agent".into()],
            slots: 4,
            instance_id: "d1".into(),
            ..Default::default()
        };
        tx.send(pb::RunnerMessage { msg: Some(pb::runner_message::Msg::Hello(hello)) }).await.expect("hello");
        match pb::runner_service_client::RunnerServiceClient::new(punchclock_tests::channel(&dev.addr).await)
            .connect(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
        {
            Ok(inbound) => break (tx, inbound),
            Err(e) if e.code() == tonic::Code::Unavailable => tokio::time::sleep(Duration::from_millis(50)).await,
            Err(e) => panic!("stream does not open: {e}"),
        }
    };
    let heartbeats = tokio::spawn(async move {
        for seq in 1..=40u64 {
            tokio::time::sleep(Duration::from_millis(300)).await;
            let hb = pb::Heartbeat { running: 0, seq, draining: false, acked_seq: 0 };
            if tx.send(pb::RunnerMessage { msg: Some(pb::runner_message::Msg::Heartbeat(hb)) }).await.is_err() {
                return;
            }
        }
    });
    assert!(
        punchclock_tests::wait_log(&dev, "runner does not read its stream; disconnecting it", Duration::from_secs(10)).await,
        "{}",
        dev.log_text()
    );
    heartbeats.abort();
}
