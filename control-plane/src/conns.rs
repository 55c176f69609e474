//! Open connections on the control plane's two ports — the gRPC API and
//! the HTTP port — kept so that connections that send nothing cannot take
//! either down (issue 34: at 1,024 open files, 1,100 half-sent HTTP
//! requests or 1,100 silent TCP connections kept every real client out, and
//! nothing was ever closed).
//!
//! - **A cap per port and per source address.** A port holds at most
//!   [`PortLimits::max`] connections, [`PortLimits::per_ip`] of them from
//!   one address. At a cap, the connection idle longest is closed for the
//!   new one — idle: no request in flight (one that never sent one, or one
//!   between requests) — of the new one's address when that address is at
//!   its cap, else of the whole port. A connection serving a request (a
//!   runner's stream, a call, a body being read) is never closed so; when
//!   every one is, the new connection is refused (closed at once). So idle
//!   connections make room for real clients, and one address can push out
//!   only its own.
//! - **Deadlines.** A connection that has not begun a request within
//!   [`PortLimits::first_request`] (on the gRPC port: TCP, TLS, the HTTP/2
//!   preface and the first call — hyper has no HTTP/2 handshake timeout),
//!   or that has had none in flight for [`PortLimits::idle`], is closed by
//!   a sweep. (The HTTP port leaves both to hyper's `header_read_timeout`.)
//! - **Descriptors.** The caps default to shares of what the open-files
//!   limit leaves after a reserve ([`ConnectionLimits::resolve`]), so the
//!   ports run out of connections before the process runs out of
//!   descriptors; an `accept` that fails for want of one pauses
//!   ([`ACCEPT_PAUSE`]) instead of spinning.
//!
//! A connection is closed by failing its socket's next read or write
//! ([`Tracked`]): whatever serves it (hyper, rustls) then ends it.

use std::collections::{BTreeSet, HashMap};
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use futures::task::AtomicWaker;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;
use tonic::codegen::http;

use crate::error::{Error, Result};

/// Pause after an `accept` that failed for want of a descriptor (or of
/// memory) before the next: without it the loop spins on `EMFILE`.
pub const ACCEPT_PAUSE: Duration = Duration::from_millis(100);

/// Descriptors kept out of both ports' caps: the store, etcd, brokers,
/// notification deliveries, logs. An eighth of the limit, at least 64.
pub fn reserve(open_files: u64) -> u64 {
    (open_files / 8).max(64)
}

/// The connection settings of both ports, as the server's flags give them;
/// [`ConnectionLimits::resolve`] turns them into each port's
/// [`PortLimits`] once the open-files limit is known.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// The process's open-files (soft) limit once raised; `None`: unknown
    /// or unlimited (then each port's default cap is
    /// [`ConnectionLimits::DEFAULT_MAX`]).
    pub open_files: Option<u64>,
    /// Connections on the gRPC port (default: half of what the open-files
    /// limit leaves after [`reserve`], at most
    /// [`ConnectionLimits::DEFAULT_MAX`]).
    pub grpc_max: Option<usize>,
    /// Of those, from one source address (default: a quarter of
    /// `grpc_max`).
    pub grpc_max_per_ip: Option<usize>,
    /// A gRPC connection must begin its first call within this (TCP, TLS,
    /// the HTTP/2 preface, the call's headers).
    pub grpc_handshake_timeout: Duration,
    /// A gRPC connection with no call in flight for this long is closed
    /// (`None`: never). A runner's stream is a call in flight for as long
    /// as it is open.
    pub grpc_idle_timeout: Option<Duration>,
    /// HTTP/2 PING every this long on each gRPC connection; one not
    /// answered within [`ConnectionLimits::KEEPALIVE_TIMEOUT`] closes it
    /// (`None`: no pings).
    pub grpc_keepalive: Option<Duration>,
    /// Connections on the HTTP port (default: half of what the open-files
    /// limit leaves after [`reserve`], at most
    /// [`ConnectionLimits::DEFAULT_MAX`]).
    pub http_max: Option<usize>,
    /// Of those, from one source address (default: a quarter of
    /// `http_max`).
    pub http_max_per_ip: Option<usize>,
    /// A request's headers must arrive within this — and so must the next
    /// request's on a kept-alive connection (hyper's `header_read_timeout`).
    pub http_header_timeout: Duration,
    /// A webhook's, event's or dashboard form's body must arrive within this (else `408`).
    pub http_body_timeout: Duration,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self {
            open_files: None,
            grpc_max: None,
            grpc_max_per_ip: None,
            grpc_handshake_timeout: Duration::from_secs(10),
            grpc_idle_timeout: Some(Duration::from_secs(300)),
            grpc_keepalive: Some(Duration::from_secs(30)),
            http_max: None,
            http_max_per_ip: None,
            http_header_timeout: Duration::from_secs(10),
            http_body_timeout: Duration::from_secs(10),
        }
    }
}

impl ConnectionLimits {
    /// Each port's default cap when the open-files limit allows more (or
    /// is unknown): memory then bounds connections before descriptors do —
    /// each holds buffers (an HTTP/2 one some tens of KiB), and under a
    /// systemd default hard limit of 524,288 half of the rest would be
    /// 229,376 per port. A control plane's runners and clients fit well
    /// within it; `--grpc-max-connections` sets more.
    pub const DEFAULT_MAX: usize = 16_384;
    /// How long an HTTP/2 PING may go unanswered.
    pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);

    /// The gRPC and HTTP ports' limits.
    ///
    /// Errors: `InvalidArgument` naming the flag — a cap of 0, a per-address
    /// cap above its port's, or caps that together need more descriptors
    /// than the open-files limit leaves after [`reserve`].
    pub fn resolve(&self) -> Result<(PortLimits, PortLimits)> {
        let budget = self.open_files.map(|n| n.saturating_sub(reserve(n)));
        let share = budget.map_or(Self::DEFAULT_MAX, |b| usize::try_from(b / 2).unwrap_or(usize::MAX).clamp(1, Self::DEFAULT_MAX));
        let grpc_max = self.grpc_max.unwrap_or(share);
        let http_max = self.http_max.unwrap_or(share);
        for (flag, v) in [("grpc-max-connections", grpc_max), ("http-max-connections", http_max)] {
            if v == 0 {
                return Err(Error::invalid(flag, "must be at least 1"));
            }
        }
        if let (Some(b), Some(n)) = (budget, self.open_files)
            && (grpc_max + http_max) as u64 > b
        {
            let flag = match (self.grpc_max.is_some(), self.http_max.is_some()) {
                (true, false) => "grpc-max-connections",
                (false, true) => "http-max-connections",
                _ => "grpc-max-connections",
            };
            return Err(Error::invalid(
                flag,
                format!(
                    "the ports' caps ({grpc_max} gRPC + {http_max} HTTP) need more descriptors than the open-files limit ({n}) leaves \
                     after a reserve of {} for the store, etcd, brokers and logs ({b}): lower them or raise the limit (LimitNOFILE)",
                    reserve(n)
                ),
            ));
        }
        let per_ip = |flag: &str, given: Option<usize>, max: usize| -> Result<usize> {
            match given {
                None => Ok((max / 4).max(1)),
                Some(0) => Err(Error::invalid(flag, "must be at least 1")),
                Some(v) if v > max => Err(Error::invalid(flag, format!("{v} is above its port's cap ({max})"))),
                Some(v) => Ok(v),
            }
        };
        let grpc = PortLimits {
            max: grpc_max,
            per_ip: per_ip("grpc-max-connections-per-ip", self.grpc_max_per_ip, grpc_max)?,
            first_request: Some(self.grpc_handshake_timeout),
            idle: self.grpc_idle_timeout,
        };
        let http = PortLimits {
            max: http_max,
            per_ip: per_ip("http-max-connections-per-ip", self.http_max_per_ip, http_max)?,
            // hyper's header read timeout covers both on HTTP/1.
            first_request: None,
            idle: None,
        };
        Ok((grpc, http))
    }
}

/// One port's limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortLimits {
    /// Open connections at most.
    pub max: usize,
    /// Open connections from one source address at most.
    pub per_ip: usize,
    /// A connection that has begun no request this long after it was
    /// accepted is closed (`None`: never).
    pub first_request: Option<Duration>,
    /// A connection with no request in flight this long is closed (`None`:
    /// never).
    pub idle: Option<Duration>,
}

/// One port's open connections (cheap to clone: one shared table).
#[derive(Clone)]
pub struct Conns(Arc<Shared>);

struct Shared {
    /// The port's name in log lines (`gRPC`, `HTTP`).
    port: &'static str,
    limits: PortLimits,
    table: Mutex<Table>,
}

#[derive(Default)]
struct Table {
    next_id: u64,
    conns: HashMap<u64, Entry>,
    by_peer: HashMap<SocketAddr, u64>,
    /// Idle connections, longest idle first.
    idle: BTreeSet<(Instant, u64)>,
    ips: HashMap<IpAddr, PerIp>,
}

#[derive(Default)]
struct PerIp {
    open: usize,
    idle: BTreeSet<(Instant, u64)>,
}

struct Entry {
    peer: SocketAddr,
    /// Requests in flight.
    busy: usize,
    /// Since when it has had none (while `busy` is 0).
    idle_since: Instant,
    /// It has begun a request.
    served: bool,
    signal: Arc<Signal>,
}

/// Tells a connection's socket it is closed.
#[derive(Default)]
struct Signal {
    closed: AtomicBool,
    waker: AtomicWaker,
}

impl Signal {
    fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.waker.wake();
    }
}

/// Why a connection ends here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Closed {
    /// Closed for a new connection at a cap.
    PushedOut,
    /// Past its first-request or idle deadline.
    TimedOut,
}

impl Table {
    fn remove(&mut self, id: u64) -> Option<Entry> {
        let e = self.conns.remove(&id)?;
        if self.by_peer.get(&e.peer) == Some(&id) {
            self.by_peer.remove(&e.peer);
        }
        if e.busy == 0 {
            self.idle.remove(&(e.idle_since, id));
        }
        let ip = e.peer.ip();
        if let Some(p) = self.ips.get_mut(&ip) {
            p.open = p.open.saturating_sub(1);
            if e.busy == 0 {
                p.idle.remove(&(e.idle_since, id));
            }
            if p.open == 0 {
                self.ips.remove(&ip);
            }
        }
        Some(e)
    }

    /// The connection to close for a new one from `ip`: `Ok(None)` when
    /// there is room, `Err(())` when the cap is reached and every
    /// connection it counts is serving a request.
    fn victim(&self, ip: IpAddr, limits: &PortLimits) -> std::result::Result<Option<u64>, ()> {
        let of_ip = self.ips.get(&ip);
        if of_ip.map_or(0, |p| p.open) >= limits.per_ip {
            return of_ip.and_then(|p| p.idle.first()).map(|&(_, id)| Some(id)).ok_or(());
        }
        if self.conns.len() >= limits.max {
            return self.idle.first().map(|&(_, id)| Some(id)).ok_or(());
        }
        Ok(None)
    }
}

impl Conns {
    /// The connections of the port named `port` (in log lines), under
    /// `limits`; with a deadline set, a sweep runs for as long as this
    /// table is used.
    pub fn new(port: &'static str, limits: PortLimits) -> Conns {
        let shared = Arc::new(Shared { port, limits, table: Mutex::default() });
        let deadlines = [limits.first_request, limits.idle];
        if let Some(shortest) = deadlines.into_iter().flatten().min() {
            let every = (shortest / 10).clamp(Duration::from_millis(100), Duration::from_secs(1));
            tokio::spawn(sweep(Arc::downgrade(&shared), every));
        }
        Conns(shared)
    }

    /// This port's limits.
    pub fn limits(&self) -> PortLimits {
        self.0.limits
    }

    /// Open connections now.
    pub fn open(&self) -> usize {
        self.0.table().conns.len()
    }

    /// Admits a connection from `peer`, closing the connection idle longest
    /// when a cap is reached (see the module's doc). `None`: refused — the
    /// cap is reached and every connection it counts serves a request.
    pub fn admit(&self, peer: SocketAddr) -> Option<Admitted> {
        let s = &self.0;
        let now = Instant::now();
        let mut guard = s.table();
        let t = &mut *guard;
        match t.victim(peer.ip(), &s.limits) {
            Ok(None) => {}
            Ok(Some(id)) => {
                if let Some(e) = t.remove(id) {
                    e.signal.close();
                    s.said(Closed::PushedOut, e.peer, t.conns.len());
                }
            }
            Err(()) => {
                if let Some(repeats) = crate::auth::refusal_due(&format!("conns {} refused", s.port)) {
                    tracing::warn!(
                        port = s.port,
                        %peer,
                        max = s.limits.max,
                        per_ip = s.limits.per_ip,
                        repeats,
                        "connection refused: the port is at its cap and every connection serves a request"
                    );
                }
                return None;
            }
        }
        let id = t.next_id;
        t.next_id += 1;
        let signal = Arc::new(Signal::default());
        t.conns.insert(id, Entry { peer, busy: 0, idle_since: now, served: false, signal: signal.clone() });
        t.by_peer.insert(peer, id);
        t.idle.insert((now, id));
        let p = t.ips.entry(peer.ip()).or_default();
        p.open += 1;
        p.idle.insert((now, id));
        Some(Admitted { conn: Conn { shared: self.0.clone(), id }, signal })
    }

    /// A request in flight on the connection from `peer` (the gRPC port's
    /// calls are found by their peer address): `None` when it is not open
    /// here (closed meanwhile).
    pub fn busy_of(&self, peer: SocketAddr) -> Option<Busy> {
        let id = *self.0.table().by_peer.get(&peer)?;
        Conn { shared: self.0.clone(), id }.busy()
    }

    /// The next connection on `listener` this port admits ([`Conns::admit`];
    /// refused ones are closed at once), with `TCP_NODELAY` set: without it
    /// each gRPC reply's trailers wait for the client's delayed ACK (~40 ms
    /// on Linux loopback). An `accept` that fails for want of a descriptor
    /// or of memory is retried after [`ACCEPT_PAUSE`] (said once a minute).
    pub async fn accept(&self, listener: &TcpListener) -> (Tracked<TcpStream>, SocketAddr) {
        loop {
            match listener.accept().await {
                Ok((stream, peer)) => {
                    if let Err(e) = stream.set_nodelay(true) {
                        tracing::debug!(error = %e, "cannot set TCP_NODELAY");
                    }
                    if let Some(admitted) = self.admit(peer) {
                        return (Tracked { io: stream, admitted }, peer);
                    }
                }
                // The client gave up before it was accepted.
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::ConnectionAborted | io::ErrorKind::ConnectionReset | io::ErrorKind::Interrupted
                    ) => {}
                Err(e) => {
                    if let Some(repeats) = crate::auth::refusal_due(&format!("conns {} accept", self.0.port)) {
                        tracing::error!(
                            port = self.0.port,
                            error = %e,
                            open = self.open(),
                            repeats,
                            "cannot accept connections (out of descriptors? see --{}-max-connections and LimitNOFILE); retrying",
                            self.0.port.to_ascii_lowercase()
                        );
                    }
                    tokio::time::sleep(ACCEPT_PAUSE).await;
                }
            }
        }
    }

    /// [`Conns::accept`] on `listener` for ever, as a stream (tonic's
    /// `serve_with_incoming`).
    pub fn incoming(self, listener: TcpListener) -> impl futures::Stream<Item = io::Result<Tracked<TcpStream>>> + Send + 'static {
        futures::stream::unfold((self, listener), |(conns, listener)| async move {
            let (io, _) = conns.accept(&listener).await;
            Some((Ok(io), (conns, listener)))
        })
    }

    /// A tower layer for the gRPC server: each call is a request in flight
    /// on its connection (found by the peer address tonic puts in the
    /// request) until its response body ends.
    pub fn layer(&self) -> ActivityLayer {
        ActivityLayer(self.clone())
    }
}

impl Shared {
    fn table(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Says (once a minute per port and reason) that a connection was closed.
    fn said(&self, why: Closed, peer: SocketAddr, open: usize) {
        if let Some(repeats) = crate::auth::refusal_due(&format!("conns {} {why:?}", self.port)) {
            match why {
                Closed::PushedOut => tracing::warn!(
                    port = self.port,
                    %peer,
                    open,
                    max = self.limits.max,
                    per_ip = self.limits.per_ip,
                    repeats,
                    "connection cap reached: closed the connection idle longest for a new one"
                ),
                Closed::TimedOut => tracing::info!(
                    port = self.port,
                    %peer,
                    repeats,
                    first_request_s = self.limits.first_request.map(|d| d.as_secs_f64()),
                    idle_s = self.limits.idle.map(|d| d.as_secs_f64()),
                    "closed a connection past its deadline (no request begun, or none in flight)"
                ),
            }
        }
    }

    /// Closes the idle connections past their deadline at `now`.
    fn sweep(&self, now: Instant) {
        let (first, idle) = (self.limits.first_request, self.limits.idle);
        let Some(shortest) = [first, idle].into_iter().flatten().min() else { return };
        let mut guard = self.table();
        let t = &mut *guard;
        let mut expired = Vec::new();
        for &(since, id) in &t.idle {
            if since + shortest > now {
                break;
            }
            let limit = t.conns.get(&id).and_then(|e| if e.served { idle } else { first });
            if limit.is_some_and(|l| since + l <= now) {
                expired.push(id);
            }
        }
        for id in expired {
            if let Some(e) = t.remove(id) {
                e.signal.close();
                self.said(Closed::TimedOut, e.peer, t.conns.len());
            }
        }
    }
}

async fn sweep(shared: Weak<Shared>, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(s) = shared.upgrade() else { return };
        s.sweep(Instant::now());
    }
}

/// One open connection's place in its port's table.
#[derive(Clone)]
pub struct Conn {
    shared: Arc<Shared>,
    id: u64,
}

impl Conn {
    /// A request in flight on this connection until the guard is dropped;
    /// `None` when the connection is closed already.
    pub fn busy(&self) -> Option<Busy> {
        let mut guard = self.shared.table();
        let t = &mut *guard;
        let e = t.conns.get_mut(&self.id)?;
        if e.busy == 0 {
            t.idle.remove(&(e.idle_since, self.id));
            if let Some(p) = t.ips.get_mut(&e.peer.ip()) {
                p.idle.remove(&(e.idle_since, self.id));
            }
        }
        e.busy += 1;
        e.served = true;
        Some(Busy { conn: self.clone() })
    }
}

/// An admitted connection: leaves its port's table when dropped.
pub struct Admitted {
    conn: Conn,
    signal: Arc<Signal>,
}

impl Admitted {
    /// This connection's place in the table (to mark requests in flight).
    pub fn conn(&self) -> Conn {
        self.conn.clone()
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.conn.shared.table().remove(self.conn.id);
    }
}

/// A request in flight on a connection: while one is, the connection is
/// neither closed for a new one nor past its idle deadline.
pub struct Busy {
    conn: Conn,
}

impl Drop for Busy {
    fn drop(&mut self) {
        let now = Instant::now();
        let mut guard = self.conn.shared.table();
        let t = &mut *guard;
        let id = self.conn.id;
        let Some(e) = t.conns.get_mut(&id) else { return };
        e.busy = e.busy.saturating_sub(1);
        if e.busy == 0 {
            e.idle_since = now;
            t.idle.insert((now, id));
            t.ips.entry(e.peer.ip()).or_default().idle.insert((now, id));
        }
    }
}

/// A socket of an admitted connection: once the connection is closed
/// here (pushed out or past a deadline), its reads and writes fail, and
/// whatever serves it ends it.
pub struct Tracked<IO> {
    io: IO,
    admitted: Admitted,
}

impl<IO> Tracked<IO> {
    /// The connection itself (to set a socket option).
    pub fn get_ref(&self) -> &IO {
        &self.io
    }

    /// This connection's place in the table.
    pub fn conn(&self) -> Conn {
        self.admitted.conn()
    }

    fn closed(&self) -> Option<io::Error> {
        self.admitted
            .signal
            .closed
            .load(Ordering::Acquire)
            .then(|| io::Error::new(io::ErrorKind::ConnectionAborted, "closed by the control plane: connection cap or deadline"))
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Tracked<IO> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        self.admitted.signal.waker.register(cx.waker());
        if let Some(e) = self.closed() {
            return Poll::Ready(Err(e));
        }
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Tracked<IO> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        if let Some(e) = self.closed() {
            return Poll::Ready(Err(e));
        }
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(mut self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[io::IoSlice<'_>]) -> Poll<io::Result<usize>> {
        if let Some(e) = self.closed() {
            return Poll::Ready(Err(e));
        }
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if let Some(e) = self.closed() {
            return Poll::Ready(Err(e));
        }
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// tonic finds the peer address (and, under TLS, the client certificate)
/// as it would on a bare `TcpStream`.
impl tonic::transport::server::Connected for Tracked<TcpStream> {
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

/// A response body that keeps its connection's request in flight until it
/// ends (or is dropped).
pub struct BusyBody<B> {
    inner: B,
    _busy: Option<Busy>,
}

impl<B> BusyBody<B> {
    /// `inner`, holding `busy` until it is done.
    pub fn new(inner: B, busy: Option<Busy>) -> Self {
        Self { inner, _busy: busy }
    }
}

impl<B: http_body::Body + Unpin> http_body::Body for BusyBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<std::result::Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// See [`Conns::layer`].
#[derive(Clone)]
pub struct ActivityLayer(Conns);

impl<S> tower::Layer<S> for ActivityLayer {
    type Service = Activity<S>;
    fn layer(&self, inner: S) -> Self::Service {
        Activity { conns: self.0.clone(), inner }
    }
}

/// See [`Conns::layer`].
#[derive(Clone)]
pub struct Activity<S> {
    conns: Conns,
    inner: S,
}

type BoxFuture<T> = Pin<Box<dyn std::future::Future<Output = T> + Send + 'static>>;

impl<S, B> tower::Service<http::Request<B>> for Activity<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = BoxFuture<std::result::Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<std::result::Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};
        let ext = req.extensions();
        let peer = ext
            .get::<TcpConnectInfo>()
            .or_else(|| ext.get::<TlsConnectInfo<TcpConnectInfo>>().map(|t| t.get_ref()))
            .and_then(|c| c.remote_addr());
        let busy = peer.and_then(|p| self.conns.busy_of(p));
        let call = self.inner.call(req);
        Box::pin(async move {
            let resp = call.await?;
            Ok(match busy {
                Some(b) => resp.map(|body| tonic::body::Body::new(BusyBody::new(body, Some(b)))),
                None => resp,
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(max: usize, per_ip: usize) -> PortLimits {
        PortLimits { max, per_ip, first_request: None, idle: None }
    }

    fn addr(ip: u8, port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, ip], port))
    }

    fn closed(a: &Admitted) -> bool {
        a.signal.closed.load(Ordering::Acquire)
    }

    /// Lets the monotonic clock move on, so idle-since instants differ.
    async fn later() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    /// An address at its cap pushes out its own connection idle longest,
    /// never another address's (one source cannot evict the others).
    #[tokio::test]
    async fn an_address_at_its_cap_pushes_out_its_own_oldest_idle() {
        let c = Conns::new("test", limits(10, 2));
        let other = c.admit(addr(2, 1)).expect("room");
        later().await;
        let a1 = c.admit(addr(1, 1)).expect("room");
        later().await;
        let a2 = c.admit(addr(1, 2)).expect("room");
        let a3 = c.admit(addr(1, 3)).expect("its oldest idle makes room");
        assert!(closed(&a1) && !closed(&a2) && !closed(&a3) && !closed(&other));
        assert_eq!(c.open(), 3);
    }

    /// At the port's cap the connection idle longest goes; one serving a
    /// request never does, and when all do, the new one is refused.
    #[tokio::test]
    async fn the_port_cap_spares_connections_serving_a_request() {
        let c = Conns::new("test", limits(2, 2));
        let a = c.admit(addr(1, 1)).expect("room");
        let busy_a = a.conn().busy().expect("open");
        later().await;
        let b = c.admit(addr(2, 1)).expect("room");
        let n = c.admit(addr(3, 1)).expect("b is idle");
        assert!(!closed(&a) && closed(&b));
        let _busy_n = n.conn().busy().expect("open");
        assert!(c.admit(addr(4, 1)).is_none(), "every connection serves a request: refused");
        drop(busy_a);
        assert!(c.admit(addr(4, 1)).is_some(), "a, idle again, makes room");
        assert!(closed(&a));
        assert!(c.busy_of(addr(1, 1)).is_none(), "a left the table");
    }

    /// A connection idle since a later request is younger than one that
    /// never sent any: the half-open one goes first.
    #[tokio::test]
    async fn longest_idle_is_measured_from_the_last_request() {
        let c = Conns::new("test", limits(2, 2));
        let served = c.admit(addr(1, 1)).expect("room");
        later().await;
        let silent = c.admit(addr(2, 1)).expect("room");
        later().await;
        drop(c.busy_of(addr(1, 1)).expect("found by its peer address"));
        let _new = c.admit(addr(3, 1)).expect("room made");
        assert!(closed(&silent) && !closed(&served));
    }

    /// A connection that begins no request within `first_request`, or has
    /// none in flight for `idle`, is closed by the sweep; one serving a
    /// request is not.
    #[tokio::test]
    async fn deadlines_close_silent_and_idle_connections() {
        let ms = Duration::from_millis;
        let l = PortLimits { max: 10, per_ip: 10, first_request: Some(ms(300)), idle: Some(ms(900)) };
        let c = Conns::new("test", l);
        let silent = c.admit(addr(1, 1)).expect("room");
        let streaming = c.admit(addr(1, 2)).expect("room");
        let busy = streaming.conn().busy().expect("open");
        let served = c.admit(addr(1, 3)).expect("room");
        drop(served.conn().busy());
        // Sweeps every 100 ms: closed within one after the deadline.
        tokio::time::sleep(ms(500)).await;
        assert!(closed(&silent) && !closed(&served) && !closed(&streaming));
        tokio::time::sleep(ms(700)).await;
        assert!(closed(&served), "idle past its deadline");
        assert!(!closed(&streaming), "a call in flight (a runner's stream) is never idle");
        drop(busy);
        tokio::time::sleep(ms(1100)).await;
        assert!(closed(&streaming));
        assert_eq!(c.open(), 0);
    }

    /// A closed connection's socket fails its next read, and the reader
    /// waiting on it is woken.
    #[tokio::test]
    async fn a_closed_connections_reader_is_woken_with_an_error() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let c = Conns::new("test", limits(1, 1));
        let to = listener.local_addr().expect("addr");
        let _first = TcpStream::connect(to).await.expect("connect");
        let (mut io, _) = c.accept(&listener).await;
        let reader = tokio::spawn(async move {
            let mut buf = [0u8; 8];
            tokio::io::AsyncReadExt::read(&mut io, &mut buf).await
        });
        later().await;
        let _second = TcpStream::connect(to).await.expect("connect");
        let (_io2, _) = c.accept(&listener).await;
        let read = tokio::time::timeout(Duration::from_secs(5), reader).await.expect("woken").expect("joined");
        assert_eq!(read.map_err(|e| e.kind()), Err(io::ErrorKind::ConnectionAborted));
    }

    /// The caps default to halves of what the open-files limit leaves,
    /// and caps the limit cannot hold are refused naming the flag.
    #[test]
    fn caps_follow_the_open_files_limit() {
        let at = |n| ConnectionLimits { open_files: Some(n), ..Default::default() };
        let (grpc, http) = at(1024).resolve().expect("defaults");
        assert_eq!((grpc.max, grpc.per_ip, http.max, http.per_ip), (448, 112, 448, 112));
        assert!((grpc.max + http.max) as u64 + reserve(1024) <= 1024);
        let (grpc, _) = at(16_384).resolve().expect("defaults");
        assert_eq!(grpc.max, 7_168);
        let (grpc, http) = at(524_288).resolve().expect("defaults");
        assert_eq!((grpc.max, http.max), (ConnectionLimits::DEFAULT_MAX, ConnectionLimits::DEFAULT_MAX), "memory bounds them first");
        let (grpc, http) = ConnectionLimits::default().resolve().expect("unlimited");
        assert_eq!((grpc.max, http.max), (ConnectionLimits::DEFAULT_MAX, ConnectionLimits::DEFAULT_MAX));
        let (grpc, _) = ConnectionLimits { grpc_max: Some(40_000), ..at(524_288) }.resolve().expect("more when asked");
        assert_eq!(grpc.max, 40_000);
        let e = ConnectionLimits { grpc_max: Some(2000), ..at(1024) }.resolve().expect_err("over the limit");
        assert!(e.to_string().contains("grpc-max-connections") && e.to_string().contains("LimitNOFILE"), "{e}");
        let e = ConnectionLimits { http_max_per_ip: Some(500), ..at(1024) }.resolve().expect_err("per ip above the cap");
        assert!(e.to_string().contains("http-max-connections-per-ip"), "{e}");
        let e = ConnectionLimits { grpc_max: Some(0), ..Default::default() }.resolve().expect_err("zero");
        assert!(e.to_string().contains("grpc-max-connections"), "{e}");
    }
}
