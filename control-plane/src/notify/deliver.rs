//! The leader's delivery worker: spawned with the engine, stopped with it.
//!
//! It reads the outbox, then follows it with a store watch (new
//! notifications from the engine, retries from `notifications retry` on
//! any replica, its own writes); delivers what is due, at most
//! `concurrency` requests at a time; and records each outcome with a
//! fenced write conditional on the record's revision
//! ([`Repo::record_delivery`]). A broken watch makes it read the outbox
//! again.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::StreamExt;
use tokio::task::JoinSet;

use super::{NotifyConfig, Target, redact_sink, signature};
use crate::clock::SharedClock;
use crate::election::Leadership;
use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::model::notification::{DeliveryStatus, Notification};
use crate::repo::Repo;
use crate::store::{Revision, WatchEvent};

/// What a notifier needs besides the leadership.
#[derive(Clone)]
pub struct Notifier {
    /// Store access.
    pub repo: Repo,
    /// Sinks and delivery settings.
    pub config: crate::config::ConfigHandle,
    /// Clock.
    pub clock: SharedClock,
    /// Delivery counters.
    pub metrics: Arc<Metrics>,
}

impl std::fmt::Debug for Notifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Notifier").finish_non_exhaustive()
    }
}

/// Pause before reading the outbox again after a store error.
const RETRY_PAUSE: Duration = Duration::from_secs(1);

/// Delivers the outbox while `lead` holds (see the module docs); spawned
/// with the engine as a [`crate::worker::Worker`].
pub async fn run(n: Notifier, lead: Leadership) {
    // rustls needs a process-wide crypto provider for reqwest's TLS.
    let _ = rustls::crypto::ring::default_provider().install_default();
    // Redirects are not followed: a 3xx is a failed delivery (the body
    // would not be sent again to the new location).
    let client = match reqwest::Client::builder()
        .user_agent(concat!("punchclock/", env!("CARGO_PKG_VERSION")))
        .redirect(reqwest::redirect::Policy::none())
        .build()
    {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "cannot build the notification HTTP client; notifications are not delivered");
            return;
        }
    };
    loop {
        match pass(&n, &lead, &client).await {
            Err(Error::Fenced(e)) => {
                tracing::info!(error = %e, "notifier stops: a newer leader exists");
                return;
            }
            Err(e) => tracing::warn!(error = %e, "notifier: reading the outbox again"),
            Ok(()) => {}
        }
        tokio::time::sleep(RETRY_PAUSE).await;
    }
}

/// The outbox as this worker knows it.
#[derive(Default)]
struct Book {
    items: HashMap<String, (Notification, Revision)>,
    /// Pending, by when due.
    due: BTreeSet<(DateTime<Utc>, String)>,
    inflight: HashSet<String>,
    /// Requests in flight per sink: a slow sink holds at most
    /// `per_sink_concurrency` of them, so it cannot delay the others.
    sink_inflight: HashMap<String, usize>,
    /// Pending notifications per sink (the cap and the gauge).
    pending: HashMap<String, usize>,
}

impl Book {
    /// Adds or replaces a notification (unless the book has this revision
    /// or a newer one).
    fn put(&mut self, n: Notification, rev: Revision) {
        if let Some((old, old_rev)) = self.items.get(&n.id) {
            if *old_rev >= rev {
                return;
            }
            self.due.remove(&(old.next_attempt_at, old.id.clone()));
        }
        if let Some((old, _)) = self.items.insert(n.id.clone(), (n.clone(), rev))
            && old.status == DeliveryStatus::Pending
        {
            self.count(&old.sink, -1);
        }
        if n.status == DeliveryStatus::Pending {
            self.due.insert((n.next_attempt_at, n.id.clone()));
            self.count(&n.sink, 1);
        }
    }

    fn remove(&mut self, id: &str) {
        if let Some((n, _)) = self.items.remove(id) {
            self.due.remove(&(n.next_attempt_at, n.id.clone()));
            if n.status == DeliveryStatus::Pending {
                self.count(&n.sink, -1);
            }
        }
    }

    fn count(&mut self, sink: &str, d: isize) {
        let c = self.pending.entry(sink.to_string()).or_default();
        *c = c.saturating_add_signed(d);
    }

    fn pending_of(&self, sink: &str) -> usize {
        self.pending.get(sink).copied().unwrap_or(0)
    }

    /// The pending gauge, per metrics label (direct URLs share `url`).
    fn publish(&self, metrics: &Metrics) {
        let mut by_label: HashMap<String, usize> = HashMap::new();
        for (sink, n) in &self.pending {
            *by_label.entry(sink_label(sink)).or_default() += n;
        }
        for (label, n) in by_label {
            metrics.notifications_pending(&label, n);
        }
    }
}

/// One read of the outbox and the watch after it, until the watch breaks
/// (`Ok`) or a write fails (`Err`).
async fn pass(n: &Notifier, lead: &Leadership, client: &reqwest::Client) -> Result<()> {
    let mut watch = n.repo.watch_outbox().await?;
    let mut book = Book::default();
    for (note, rev) in n.repo.outbox().await? {
        admit(n, lead, &mut book, note, rev).await?;
    }
    book.publish(&n.metrics);
    tracing::info!(pending = book.due.len(), stored = book.items.len(), "notifier: outbox read");
    let mut inflight: JoinSet<(Notification, Revision, std::result::Result<(), String>)> = JoinSet::new();
    loop {
        let now = n.clock.now();
        // Start what is due, oldest first, up to the concurrency, skipping
        // sinks that have their share in flight.
        // The configuration as of this turn (a reload applies from the next).
        let config = n.config.current();
        let settings = &config.notify;
        while inflight.len() < settings.concurrency {
            let per_sink = settings.per_sink_concurrency;
            let next = book
                .due
                .iter()
                .take_while(|(at, _)| *at <= now)
                .find(|(_, id)| {
                    !book.inflight.contains(id)
                        && book.items.get(id).is_none_or(|(note, _)| book.sink_inflight.get(&note.sink).copied().unwrap_or(0) < per_sink)
                })
                .cloned();
            let Some((at, id)) = next else { break };
            let Some((note, rev)) = book.items.get(&id).cloned() else {
                book.due.remove(&(at, id));
                continue;
            };
            book.inflight.insert(id);
            *book.sink_inflight.entry(note.sink.clone()).or_default() += 1;
            let (client, config) = (client.clone(), config.clone());
            inflight.spawn(async move {
                let r = send(&client, &config.notify, &note, Utc::now()).await;
                (note, rev, r)
            });
        }
        // Wake for the next due item (one whose sink is busy is woken by
        // that sink's answer).
        let next_due = book.due.iter().find(|(t, id)| *t > now && !book.inflight.contains(id)).map(|(t, _)| *t);
        let has_room = inflight.len() < settings.concurrency;
        let wait = async {
            match next_due {
                Some(t) if has_room => {
                    let d = (t - n.clock.now()).to_std().unwrap_or(Duration::ZERO);
                    tokio::time::sleep(d).await
                }
                _ => std::future::pending().await,
            }
        };
        tokio::select! {
            ev = watch.next() => match ev {
                Some(Ok(WatchEvent::Put(kv))) => match crate::repo::codec::decode::<Notification>("notification", &kv.value) {
                    Ok(note) => {
                        admit(n, lead, &mut book, note, kv.mod_revision).await?;
                        book.publish(&n.metrics);
                    }
                    Err(e) => tracing::error!(key = %kv.key, error = %e, "unreadable notification; skipped"),
                },
                Some(Ok(WatchEvent::Delete { key, .. })) => {
                    if let Some(id) = n.repo.keys().id_after(&n.repo.keys().outbox(), &key) {
                        let id = id.to_string();
                        book.remove(&id);
                    }
                }
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "outbox watch broke");
                    return Ok(());
                }
                None => return Ok(()),
            },
            Some(done) = inflight.join_next(), if !inflight.is_empty() => {
                let Ok((note, rev, result)) = done else { continue };
                book.inflight.remove(&note.id);
                if let Some(c) = book.sink_inflight.get_mut(&note.sink) {
                    *c = c.saturating_sub(1);
                }
                record(n, lead, &mut book, note, rev, result).await?;
                book.publish(&n.metrics);
            }
            _ = wait => {}
        }
    }
}

/// Takes a notification into the book, unless it is new, pending, and its
/// sink already has `max_pending_per_sink` waiting: then it is
/// dead-lettered at once, with the reason (a fenced write conditional on
/// its revision, like every outcome).
async fn admit(n: &Notifier, lead: &Leadership, book: &mut Book, mut note: Notification, rev: Revision) -> Result<()> {
    let cap = n.config.current().notify.max_pending_per_sink;
    let new = !book.items.contains_key(&note.id);
    if !(new && note.status == DeliveryStatus::Pending && book.pending_of(&note.sink) >= cap) {
        book.put(note, rev);
        return Ok(());
    }
    let kind = sink_label(&note.sink);
    note.status = DeliveryStatus::Dead;
    note.updated_at = n.clock.now();
    note.last_error =
        Some(format!("{cap} notifications are waiting for this sink (notifications.max_pending_per_sink); dead-lettered without delivery"));
    n.metrics.notification_dead(&kind);
    tracing::warn!(id = %note.id, sink = %redact_sink(&note.sink), pending = cap, "sink backlog full: notification dead-lettered at once");
    if let Some(new_rev) = n.repo.record_delivery(lead, &note, rev).await? {
        book.put(note, new_rev);
    }
    Ok(())
}

/// Writes one attempt's outcome and updates the book.
async fn record(
    n: &Notifier,
    lead: &Leadership,
    book: &mut Book,
    mut note: Notification,
    rev: Revision,
    result: std::result::Result<(), String>,
) -> Result<()> {
    let now = n.clock.now();
    let kind = sink_label(&note.sink);
    note.attempts += 1;
    note.updated_at = now;
    match result {
        Ok(()) => {
            note.status = DeliveryStatus::Delivered;
            note.delivered_at = Some(now);
            note.last_error = None;
            n.metrics.notification_delivered(&kind);
            tracing::info!(id = %note.id, sink = %redact_sink(&note.sink), attempts = note.attempts, "notification delivered");
        }
        Err(e) => {
            n.metrics.notification_failed(&kind);
            note.last_error = Some(e.clone());
            if note.attempts >= n.config.current().notify.max_attempts {
                note.status = DeliveryStatus::Dead;
                n.metrics.notification_dead(&kind);
                tracing::warn!(id = %note.id, sink = %redact_sink(&note.sink), attempts = note.attempts, error = %e, "notification dead-lettered");
            } else {
                let delay = n.config.current().notify.backoff(note.attempts);
                note.next_attempt_at = now + chrono::Duration::from_std(delay).unwrap_or(chrono::Duration::MAX);
                tracing::info!(id = %note.id, sink = %redact_sink(&note.sink), attempts = note.attempts, retry_in_ms = delay.as_millis() as u64, error = %e, "notification not delivered; will retry");
            }
        }
    }
    match n.repo.record_delivery(lead, &note, rev).await? {
        Some(_) if note.status == DeliveryStatus::Delivered => book.remove(&note.id),
        // Known at once (not only when the watch brings it), so it is not sent again before.
        Some(new_rev) => {
            book.put(note, new_rev);
        }
        None => {
            // Changed meanwhile (a retry by hand): wait for the watch's version.
            tracing::info!(id = %note.id, "notification changed during its delivery; its outcome is not recorded");
            if book.items.get(&note.id).is_none_or(|(_, r)| *r <= rev) {
                book.remove(&note.id);
            }
        }
    }
    Ok(())
}

/// The `sink` label of the delivery metrics: the sink's name for
/// `webhook://NAME`, `url` for direct URLs (unbounded).
fn sink_label(sink: &str) -> String {
    sink.strip_prefix("webhook://").map_or_else(|| "url".to_string(), str::to_string)
}

/// One POST. `Err` with the reason for anything but a 2xx answer.
async fn send(client: &reqwest::Client, config: &NotifyConfig, note: &Notification, now: DateTime<Utc>) -> std::result::Result<(), String> {
    let target: Target = config.target(&note.sink).map_err(|e| e.to_string())?;
    let body = serde_json::to_vec(&note.payload).map_err(|e| e.to_string())?;
    let mut req = client
        .post(target.url.clone())
        .timeout(target.timeout)
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .header("Punchclock-Notification-Id", &note.id)
        .header("Idempotency-Key", &note.id)
        .header("Punchclock-Event", note.event.as_str());
    if let Some(secret) = &target.secret {
        req = req.header("Punchclock-Signature", signature(secret, now.timestamp(), &body));
    }
    for (k, v) in &target.headers {
        req = req.header(k.clone(), v.clone());
    }
    match req.body(body).send().await {
        Ok(resp) if resp.status().is_success() => Ok(()),
        Ok(resp) => {
            let status = resp.status();
            let text = read_capped(resp, MAX_ERROR_BODY_BYTES).await;
            let text: String = String::from_utf8_lossy(&text).chars().take(200).collect();
            Err(format!("HTTP {status}: {text}"))
        }
        // Without the URL: it may hold a token.
        Err(e) => Err(error_chain(&e.without_url())),
    }
}

/// How much of a failed answer's body is read (for the error text): a
/// sink answering a 300 MB `500` took the leader to 2 GiB when the whole
/// body was read (issue 19). The rest is never read; the connection closes.
const MAX_ERROR_BODY_BYTES: usize = 4096;

/// At most `max` bytes of `resp`'s body.
async fn read_capped(mut resp: reqwest::Response, max: usize) -> Vec<u8> {
    let mut buf = Vec::new();
    while buf.len() < max {
        match resp.chunk().await {
            Ok(Some(c)) => buf.extend_from_slice(&c[..c.len().min(max - buf.len())]),
            _ => break,
        }
    }
    buf
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}
