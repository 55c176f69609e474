//! Issue 34, point 6: idle connections took the API down, without
//! credentials. At the 1,024 open files the shipped systemd unit gave the
//! server, 1,100 half-sent HTTP requests, or 1,100 silent TCP connections
//! to the gRPC port, made `task list`, `cluster status` and `/healthz` time
//! out and kept a new runner out: nothing was ever closed, and the server
//! left its open-files limit at the soft value. Slow webhook bodies from 8
//! addresses made real deliveries wait 10 s and get 503.
//!
//! Here a real `punchclock server` runs with `RLIMIT_NOFILE` 1,024 (soft
//! and hard: it raises soft to hard at start) and gets all of that at once:
//! 64 slow webhook bodies from 127.0.0.2..=127.0.0.9 (8 each), then 1,100
//! half-sent HTTP requests and 1,100 silent TCP connections to the gRPC
//! port, half of each from 127.0.0.1 (the address the real clients use)
//! and half from ten other addresses. Then `punchclock task list`,
//! `punchclock cluster status`, `GET /healthz`, a new runner's Hello and a
//! real webhook delivery each answer within 1 s (the delivery `202`); every
//! half-open connection is closed by the header or handshake timeout (10 s
//! by default) if it was not closed at once to make room; the slow bodies
//! get `408`.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use punchclock_proto::v1 as pb;
use punchclock_tests::{KeepLogsOnPanic, Proc, apply, bin, cli_command, endpoint, wait_engine, with_token};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

/// The open-files limit the server runs with (the systemd unit's old one).
const SERVER_NOFILE: u64 = 1024;
/// Half-open connections on each port.
const FLOOD: usize = 1_100;
/// What each real request must answer within.
const ANSWER_WITHIN: Duration = Duration::from_secs(1);

/// Raises this test process's own soft limit to its hard limit; `false`
/// when even that leaves too few descriptors for the attack.
fn raise_own_limit(needed: u64) -> bool {
    let mut l = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit on an rlimit we own.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) != 0 {
            return false;
        }
        l.rlim_cur = l.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &l);
    }
    l.rlim_cur >= needed
}

/// Skips (saying so) when the test cannot run here; under `CI` a skip
/// fails unless `PUNCHCLOCK_SKIP_IDLE_CONNECTIONS_TESTS=1` allows it.
fn skip(why: &str) {
    punchclock_tests::skip("idle_connections", "PUNCHCLOCK_SKIP_IDLE_CONNECTIONS_TESTS", why);
}

/// A TCP connection from `from` (a loopback address) to `to`; `None` when
/// it is not established within 3 s (a server whose accept queue is full).
async fn connect_from(from: Ipv4Addr, to: SocketAddr) -> Option<TcpStream> {
    let sock = tokio::net::TcpSocket::new_v4().ok()?;
    sock.bind(SocketAddr::new(IpAddr::V4(from), 0)).ok()?;
    tokio::time::timeout(Duration::from_secs(3), sock.connect(to)).await.ok()?.ok()
}

/// The attackers' source addresses: half of `n` from 127.0.0.1, the rest
/// spread over 127.0.0.10..=127.0.0.19.
fn sources(n: usize) -> impl Iterator<Item = Ipv4Addr> {
    (0..n).map(move |i| if i < n / 2 { Ipv4Addr::new(127, 0, 0, 1) } else { Ipv4Addr::new(127, 0, 0, 10 + (i % 10) as u8) })
}

/// Opens `n` connections to `to` and, on each, writes `first` (nothing
/// when empty); each is then watched until the server closes it. Returns
/// how many were established and a receiver of how long each was held.
async fn flood(to: SocketAddr, n: usize, first: &'static [u8]) -> (usize, tokio::sync::mpsc::UnboundedReceiver<Duration>) {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let mut opening = tokio::task::JoinSet::new();
    // 64 handshakes at a time: more overflow the listener's accept queue
    // (1,024) while the server is busy, and the kernel then holds the
    // connection half-made (SYN cookies) until a later retransmission — a
    // wait that is the kernel's, not the server's.
    let handshakes = std::sync::Arc::new(tokio::sync::Semaphore::new(64));
    for from in sources(n) {
        let tx = tx.clone();
        let handshakes = handshakes.clone();
        opening.spawn(async move {
            let permit = handshakes.acquire_owned().await.ok()?;
            let mut s = connect_from(from, to).await?;
            drop(permit);
            let opened = Instant::now();
            if !first.is_empty() {
                s.write_all(first).await.ok()?;
            }
            tokio::spawn(async move {
                let mut buf = [0u8; 512];
                // Until EOF or a reset: the server closed it.
                while matches!(s.read(&mut buf).await, Ok(n) if n > 0) {}
                let _ = tx.send(opened.elapsed());
            });
            Some(())
        });
    }
    let mut open = 0;
    while let Some(r) = opening.join_next().await {
        open += usize::from(matches!(r, Ok(Some(()))));
    }
    (open, rx)
}

/// A webhook delivery to `/hooks/slow` from `from` whose headers are sent
/// and whose body never is.
async fn slow_body(from: Ipv4Addr, http: SocketAddr, i: usize) -> TcpStream {
    let mut s = connect_from(from, http).await.expect("connect for a slow body");
    let head = format!(
        "POST /hooks/slow HTTP/1.1\r\nHost: {http}\r\nIdempotency-Key: slow-{from}-{i}\r\nContent-Length: 64\r\nConnection: close\r\n\r\n"
    );
    s.write_all(head.as_bytes()).await.expect("head");
    s
}

/// Runs the CLI with `args` against `addr`: its time to answer, or `None`
/// when it did not succeed within [`ANSWER_WITHIN`] (it is then killed).
async fn cli_within(addr: &str, args: &[&str]) -> Result<Duration, String> {
    let mut cmd = tokio::process::Command::from(cli_command(addr));
    cmd.args(args).kill_on_drop(true).stdin(std::process::Stdio::null());
    let t = Instant::now();
    match tokio::time::timeout(ANSWER_WITHIN, cmd.output()).await {
        Ok(Ok(out)) if out.status.success() => Ok(t.elapsed()),
        Ok(Ok(out)) => Err(format!("punchclock {args:?} failed: {}", String::from_utf8_lossy(&out.stderr))),
        Ok(Err(e)) => Err(format!("punchclock {args:?} did not run: {e}")),
        Err(_) => Err(format!("punchclock {args:?} did not answer within {ANSWER_WITHIN:?}")),
    }
}

/// One HTTP/1.1 request (`Connection: close`) from 127.0.0.1: its time to
/// a whole answer and the answer, within [`ANSWER_WITHIN`].
async fn http_within(http: SocketAddr, request: String) -> Result<(Duration, String), String> {
    let t = Instant::now();
    let exchange = async {
        let mut s = TcpStream::connect(http).await.map_err(|e| format!("connect: {e}"))?;
        s.write_all(request.as_bytes()).await.map_err(|e| format!("write: {e}"))?;
        let mut out = Vec::new();
        s.read_to_end(&mut out).await.map_err(|e| format!("read: {e}"))?;
        Ok::<_, String>(String::from_utf8_lossy(&out).into_owned())
    };
    match tokio::time::timeout(ANSWER_WITHIN, exchange).await {
        Ok(Ok(answer)) => Ok((t.elapsed(), answer)),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(format!("no answer within {ANSWER_WITHIN:?}")),
    }
}

/// A new runner's stream: the time from connecting to its Welcome, within
/// [`ANSWER_WITHIN`].
async fn runner_within(addr: &str) -> Result<Duration, String> {
    let t = Instant::now();
    let hello = async {
        let ch = endpoint(addr).connect().await.map_err(|e| format!("connect: {e}"))?;
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let hello = pb::Hello {
            runner_id: "late-runner".into(),
            agents: vec!["ok_agent".into()],
            slots: 1,
            instance_id: "i1".into(),
            ..Default::default()
        };
        tx.send(pb::RunnerMessage { msg: Some(pb::runner_message::Msg::Hello(hello)) }).await.map_err(|e| e.to_string())?;
        let mut client = pb::runner_service_client::RunnerServiceClient::new(with_token(ch));
        let mut inbound = client.connect(tokio_stream::wrappers::ReceiverStream::new(rx)).await.map_err(|e| e.to_string())?.into_inner();
        let first = inbound.message().await.map_err(|e| e.to_string())?;
        // The stream (and `tx`) stay open until the Welcome is read.
        drop(tx);
        match first {
            Some(pb::ControlMessage { msg: Some(pb::control_message::Msg::Welcome(_)) }) => Ok(()),
            other => Err(format!("not a Welcome: {other:?}")),
        }
    };
    match tokio::time::timeout(ANSWER_WITHIN, hello).await {
        Ok(Ok(())) => Ok(t.elapsed()),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(format!("no Welcome within {ANSWER_WITHIN:?}")),
    }
}

/// Open descriptors of process `pid`.
fn open_fds(pid: i32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map(|d| d.count()).unwrap_or(0)
}

/// `punchclock server` on an embedded store with both ports on free
/// loopback ports, started with `RLIMIT_NOFILE` = `nofile`.
fn server(dir: &std::path::Path, nofile: (u64, u64)) -> Proc {
    let data = format!("embedded:{}", dir.join("data").display());
    let args = [
        "server",
        "--store",
        &data,
        "--listen",
        "127.0.0.1:0",
        "--http-listen",
        "127.0.0.1:0",
        "--node-id",
        "idle",
        "--heartbeat-ms",
        "500",
    ];
    Proc::start_limited(&bin(), &args, &[], &dir.join("server.log"), true, Some(nofile))
}

/// (soft, hard) `Max open files` of process `pid`, from `/proc/PID/limits`.
fn nofile_of(pid: i32) -> (String, String) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).expect("limits");
    let line = limits.lines().find(|l| l.starts_with("Max open files")).expect("Max open files line").to_string();
    let mut f = line["Max open files".len()..].split_whitespace();
    (f.next().unwrap_or_default().to_string(), f.next().unwrap_or_default().to_string())
}

/// The server raises its soft open-files limit to the hard one at start,
/// as the runner does (before, it kept 1,024 under a hard limit of 524,288
/// and ran out of descriptors there).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_raises_its_open_files_limit() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "idle_connections_limit");
    let srv = server(dir.path(), (256, SERVER_NOFILE));
    assert_eq!(nofile_of(srv.pid()), (SERVER_NOFILE.to_string(), SERVER_NOFILE.to_string()), "soft raised to hard");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_do_not_take_the_api_down() {
    // Ours: 2 × 1,100 attackers, 64 slow bodies, and the test's own.
    if !raise_own_limit(2 * FLOOD as u64 + 512) {
        return skip("this process's hard RLIMIT_NOFILE is below 2,712");
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "idle_connections");
    let srv = server(dir.path(), (SERVER_NOFILE, SERVER_NOFILE));
    wait_engine(&srv.addr).await;
    let http: SocketAddr = srv.http_addr().parse().expect("http address");
    let grpc: SocketAddr = srv.addr.trim_start_matches("http://").parse().expect("grpc address");
    for (id, path) in [("slow", "/hooks/slow"), ("real", "/hooks/real")] {
        apply(&srv.addr, json!({"task_id": id, "agent_id": "event_agent", "trigger": {"type": "webhook", "path": path, "auth": "none"}}))
            .await;
    }

    // 64 slow bodies, 8 from each of 8 addresses: every turn to read one.
    let mut slow = Vec::new();
    for a in 2..=9u8 {
        for i in 0..8 {
            slow.push(slow_body(Ipv4Addr::new(127, 0, 0, a), http, i).await);
        }
    }
    // The floods: half-sent HTTP requests (no blank line ends the headers)
    // and silent TCP connections to the gRPC port.
    let rss_before = punchclock_tests::rss_bytes(srv.pid());
    let t_flood = Instant::now();
    let (http_open, mut http_held) = flood(http, FLOOD, b"GET /healthz HTTP/1.1\r\nHost: punchclock\r\nUser-Agent: slow").await;
    let (grpc_open, mut grpc_held) = flood(grpc, FLOOD, b"").await;
    eprintln!(
        "flood: {http_open} HTTP and {grpc_open} gRPC connections established in {:?}; server holds {} descriptors, RSS {} -> {} KiB",
        t_flood.elapsed(),
        open_fds(srv.pid()),
        rss_before / 1024,
        punchclock_tests::rss_bytes(srv.pid()) / 1024
    );

    // Every real client answers within 1 s.
    let mut failures = Vec::new();
    let mut note = |what: &str, r: Result<Duration, String>| match r {
        Ok(d) => eprintln!("{what}: answered in {d:?}"),
        Err(e) => failures.push(format!("{what}: {e}")),
    };
    note("punchclock task list", cli_within(&srv.addr, &["task", "list"]).await);
    note("punchclock cluster status", cli_within(&srv.addr, &["cluster", "status"]).await);
    let healthz = http_within(http, "GET /healthz HTTP/1.1\r\nHost: punchclock\r\nConnection: close\r\n\r\n".into()).await;
    note("GET /healthz", healthz.and_then(|(d, a)| if a.starts_with("HTTP/1.1 200") { Ok(d) } else { Err(format!("answered {a:?}")) }));
    note("a new runner's Hello", runner_within(&srv.addr).await);
    let delivery =
        "POST /hooks/real HTTP/1.1\r\nHost: punchclock\r\nIdempotency-Key: real-1\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}";
    let delivered = http_within(http, delivery.into()).await;
    note(
        "a real webhook delivery",
        delivered.and_then(|(d, a)| if a.starts_with("HTTP/1.1 202") { Ok(d) } else { Err(format!("answered {a:?}")) }),
    );
    assert!(
        failures.is_empty(),
        "under 64 slow bodies, {FLOOD} half-sent HTTP requests and {FLOOD} silent gRPC connections: {failures:#?}"
    );

    // The half-open connections are closed: at once to make room, or by the
    // header read (HTTP) and handshake (gRPC) timeouts, 10 s by default.
    let within = Duration::from_secs(20);
    for (port, open, held) in [("HTTP", http_open, &mut http_held), ("gRPC", grpc_open, &mut grpc_held)] {
        let mut times = Vec::with_capacity(open);
        while times.len() < open {
            match tokio::time::timeout_at(t_flood + within, held.recv()).await {
                Ok(Some(d)) => times.push(d),
                _ => break,
            }
        }
        times.sort();
        let at_once = times.iter().filter(|d| **d < Duration::from_secs(2)).count();
        eprintln!(
            "{port}: {} of {open} half-open connections closed within {within:?} ({at_once} within 2 s to make room), the longest held {:?}",
            times.len(),
            times.last().copied().unwrap_or_default()
        );
        assert_eq!(times.len(), open, "every half-open {port} connection is closed");
        assert!(times.last().is_some_and(|d| *d < Duration::from_secs(13)), "held at most the timeout (10 s) and a sweep: {times:?}");
    }
    // The slow bodies: 408 at their deadline (one, cut to make room for the
    // real delivery, at once), never a run.
    for mut s in slow {
        let mut out = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await;
        let answer = String::from_utf8_lossy(&out);
        assert!(read.is_ok() && answer.starts_with("HTTP/1.1 408"), "a slow body gets 408 and its connection closed: {answer:?}");
    }
    let runs = punchclock_tests::list_runs(&srv.addr, "slow").await;
    assert!(runs.is_empty(), "no slow body made a run: {runs:?}");
    eprintln!("after: server holds {} descriptors", open_fds(srv.pid()));
}
