//! A real HTTP receiver for notification tests: a tokio TCP listener that
//! speaks enough HTTP/1.1 to take POSTs, checks each request's
//! `Punchclock-Signature` with its own HMAC-SHA256 (the `hmac` crate, not
//! the control plane's code), records it, and answers 200 — or 500 while
//! told to fail. It can be stopped (connections refused) and started again
//! on the same port.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hmac::{Hmac, Mac};
use sha2::Sha256;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;

/// One request as received.
#[derive(Debug, Clone)]
pub struct Received {
    /// `Punchclock-Notification-Id`.
    pub id: String,
    /// `Punchclock-Event`.
    pub event: String,
    /// The signature header verified against the body with the secret.
    pub signature_ok: bool,
    /// `Idempotency-Key` equals the id.
    pub idempotency_ok: bool,
    /// The JSON body.
    pub body: serde_json::Value,
    /// What the receiver answered.
    pub answered: u16,
    /// When it was answered.
    pub at: std::time::Instant,
}

#[derive(Default)]
struct Shared {
    log: Mutex<Vec<Received>>,
    fail: AtomicBool,
    notify: Notify,
}

/// See the module docs.
pub struct Receiver {
    /// Its port on 127.0.0.1.
    pub port: u16,
    secret: String,
    shared: Arc<Shared>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Receiver {
    /// Listens on a free port.
    pub async fn start(secret: &str) -> Receiver {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let mut r = Receiver { port, secret: secret.to_string(), shared: Arc::default(), task: None };
        r.serve(listener);
        r
    }

    /// `http://127.0.0.1:PORT/hook`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}/hook", self.port)
    }

    fn serve(&mut self, listener: TcpListener) {
        let (shared, secret) = (self.shared.clone(), self.secret.clone());
        self.task = Some(tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                let (shared, secret) = (shared.clone(), secret.clone());
                tokio::spawn(async move {
                    let _ = handle(conn, &shared, &secret).await;
                });
            }
        }));
    }

    /// Stops listening: connections are refused until [`Receiver::restart`].
    pub fn stop(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }

    /// Listens again on the same port.
    pub async fn restart(&mut self) {
        self.stop();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            match TcpListener::bind(("127.0.0.1", self.port)).await {
                Ok(l) => return self.serve(l),
                Err(e) => {
                    assert!(tokio::time::Instant::now() < deadline, "cannot bind port {} again: {e}", self.port);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }

    /// Answer 500 (true) or 200 (false) from now on.
    pub fn set_failing(&self, failing: bool) {
        self.shared.fail.store(failing, Ordering::SeqCst);
    }

    /// Every request so far.
    pub fn received(&self) -> Vec<Received> {
        self.shared.log.lock().expect("log").clone()
    }

    /// Waits until `pred` holds for the requests received; false after `within`.
    pub async fn wait_for(&self, within: Duration, pred: impl Fn(&[Received]) -> bool) -> bool {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let notified = self.shared.notify.notified();
            if pred(&self.received()) {
                return true;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return pred(&self.received());
            }
        }
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Verifies `t=…,v1=…` against `body`.
pub fn verify(secret: &str, header: &str, body: &[u8]) -> bool {
    let mut t = None;
    let mut v1 = None;
    for part in header.split(',') {
        match part.split_once('=') {
            Some(("t", v)) => t = Some(v),
            Some(("v1", v)) => v1 = Some(v),
            _ => {}
        }
    }
    let (Some(t), Some(v1)) = (t, v1) else { return false };
    let Ok(sig) = hex::decode(v1) else { return false };
    let mut mac = Hmac::<Sha256>::new_from_slice(secret.as_bytes()).expect("key");
    mac.update(t.as_bytes());
    mac.update(b".");
    mac.update(body);
    mac.verify_slice(&sig).is_ok()
}

async fn handle(mut conn: TcpStream, shared: &Shared, secret: &str) -> std::io::Result<()> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let head_end = loop {
        let n = conn.read(&mut chunk).await?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let header = |name: &str| {
        head.lines().find_map(|l| l.split_once(':').filter(|(k, _)| k.trim().eq_ignore_ascii_case(name)).map(|(_, v)| v.trim().to_string()))
    };
    let len: usize = header("content-length").and_then(|v| v.parse().ok()).unwrap_or(0);
    while buf.len() < head_end + len {
        let n = conn.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let body = &buf[head_end..(head_end + len).min(buf.len())];
    let id = header("punchclock-notification-id").unwrap_or_default();
    let failing = shared.fail.load(Ordering::SeqCst);
    let answered = if failing { 500 } else { 200 };
    let rec = Received {
        idempotency_ok: header("idempotency-key").as_deref() == Some(id.as_str()),
        id,
        event: header("punchclock-event").unwrap_or_default(),
        signature_ok: header("punchclock-signature").is_some_and(|h| verify(secret, &h, body)),
        body: serde_json::from_slice(body).unwrap_or(serde_json::Value::Null),
        answered,
        at: std::time::Instant::now(),
    };
    let reply = if failing { "HTTP/1.1 500 Internal Server Error" } else { "HTTP/1.1 200 OK" };
    conn.write_all(format!("{reply}\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok").as_bytes()).await?;
    conn.flush().await?;
    shared.log.lock().expect("log").push(rec);
    shared.notify.notify_waiters();
    Ok(())
}
