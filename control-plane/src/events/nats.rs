//! A queue trigger on NATS JetStream (async-nats): a durable pull consumer
//! of the trigger's stream, filtered on its subject, with explicit acks.
//! Each pull asks for at most the room the task has (`max_pending` less
//! its waiting runs, and `prefetch`), so nothing is held while the task
//! is full. See `consumers.rs` for the delivery rules.
//!
//! The durable consumer is `punchclock-{task}-{h}` (`h` a digest of the
//! subject): every task listening on a subject gets every message, and a
//! new leader resumes where the last one acknowledged. A trigger whose
//! subject changes gets a new durable that starts after the old one's
//! acknowledged floor (the old one is deleted): a change does not replay
//! the stream. A message's id is its `Nats-Msg-Id` header; without one,
//! `{stream}:{stream sequence}` (the same for every redelivery of that
//! message), scoped by broker and stream.
//!
//! While no message comes, the consumer checks every
//! [`LIVENESS_EVERY`] that its connection is up and its durable still
//! exists: a stream or durable deleted under it, or a server gone, is a
//! failure the supervisor reports (`/readyz` degraded) and retries.

use std::collections::BTreeMap;
use std::time::Duration;

use async_nats::jetstream;
use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, pull};
use futures::{FutureExt, StreamExt};
use sha2::Digest as _;

use super::consumers::{ConsumerContext, Ended, admit, message_request, room};
use crate::config::Broker;
use crate::model::trigger::{QueueTrigger, SECRET_HEADERS};

/// How long a pull waits for messages before it is asked again.
const PULL_EXPIRES: Duration = Duration::from_secs(1);
/// How long a message may stay unacknowledged before JetStream redelivers
/// it (a consumer acks once its batch is committed: well within).
const ACK_WAIT: Duration = Duration::from_secs(60);
/// Most headers of a message given to the agent.
const MAX_HEADERS: usize = 32;
/// How often an idle consumer checks its connection and durable.
const LIVENESS_EVERY: Duration = Duration::from_secs(5);

async fn connect(name: &str, broker: &Broker) -> Result<async_nats::Client, String> {
    let mut opts = async_nats::ConnectOptions::new().name(format!("punchclock {name}")).connection_timeout(Duration::from_secs(5));
    if let Some(f) = &broker.credentials_file {
        let text = std::fs::read_to_string(f).map_err(|e| format!("credentials_file {f}: {e}"))?;
        if text.contains("BEGIN NATS USER JWT") {
            opts = opts.credentials_file(f).await.map_err(|e| format!("credentials_file {f}: {e}"))?;
        } else {
            let (user, pass) =
                text.trim_end().split_once(':').ok_or_else(|| format!("credentials_file {f}: expected a .creds file or user:password"))?;
            opts = opts.user_and_password(user.to_string(), pass.to_string());
        }
    }
    if let Some(ca) = &broker.ca_file {
        opts = opts.add_root_certificates(ca.into()).require_tls(true);
    }
    opts.connect(broker.url.as_str()).await.map_err(|e| format!("cannot connect: {e}"))
}

/// The durable consumer of a task's trigger.
fn durable(task_id: &str, q: &QueueTrigger) -> String {
    let h = hex::encode(sha2::Sha256::digest(q.subject.as_deref().unwrap_or_default().as_bytes()));
    format!("punchclock-{task_id}-{}", &h[..8])
}

/// Whether `name` is a durable [`durable`] made for `task_id` (another
/// subject's): `punchclock-{task}-` and 8 hex digits, so task `a` does
/// not claim task `a-b`'s.
fn is_durable_of(task_id: &str, name: &str) -> bool {
    name.strip_prefix("punchclock-")
        .and_then(|r| r.strip_prefix(task_id))
        .and_then(|r| r.strip_prefix('-'))
        .is_some_and(|h| h.len() == 8 && h.chars().all(|c| c.is_ascii_hexdigit()))
}

/// Where a new durable starts: after the highest acknowledged floor of
/// the task's other durables on the stream (its subject changed), else
/// at the start of the stream. Returns those durables too, to delete once
/// the new one exists.
async fn start_of_new(stream: &jetstream::stream::Stream, task_id: &str, durable: &str) -> Result<(DeliverPolicy, Vec<String>), String> {
    let mut infos = stream.consumers();
    let mut floor = None::<u64>;
    let mut old = Vec::new();
    while let Some(info) = infos.next().await {
        let info = info.map_err(|e| format!("list consumers: {e}"))?;
        if info.name != durable && is_durable_of(task_id, &info.name) {
            floor = Some(floor.unwrap_or(0).max(info.ack_floor.stream_sequence));
            old.push(info.name);
        }
    }
    Ok(match floor {
        Some(f) => (DeliverPolicy::ByStartSequence { start_sequence: f + 1 }, old),
        None => (DeliverPolicy::All, old),
    })
}

/// Consumes until the engine stops (`Ok`) or the broker fails (`Err`).
pub(crate) async fn consume(ctx: &ConsumerContext, name: &str, task_id: &str, q: &QueueTrigger, broker: &Broker) -> Result<Ended, String> {
    let client = connect(name, broker).await?;
    let js = jetstream::new(client.clone());
    let stream_name = q.stream.clone().unwrap_or_default();
    let subject = q.subject.clone().unwrap_or_default();
    let stream = js.get_stream(&stream_name).await.map_err(|e| format!("stream {stream_name}: {e}"))?;
    let durable = durable(task_id, q);
    let mut consumer: jetstream::consumer::PullConsumer = match stream.get_consumer(&durable).await {
        Ok(c) => c,
        Err(_) => {
            let (deliver_policy, old) = start_of_new(&stream, task_id, &durable).await.map_err(|e| format!("stream {stream_name}: {e}"))?;
            let config = pull::Config {
                durable_name: Some(durable.clone()),
                filter_subject: subject.clone(),
                ack_policy: AckPolicy::Explicit,
                ack_wait: ACK_WAIT,
                deliver_policy,
                max_ack_pending: i64::from(q.prefetch()).max(1),
                ..Default::default()
            };
            let c =
                stream.get_or_create_consumer(&durable, config).await.map_err(|e| format!("consumer {durable} on {stream_name}: {e}"))?;
            for o in old {
                tracing::info!(consumer = %name, old = o, durable, ?deliver_policy, "the trigger's subject changed: the new durable starts after the old one's acknowledged floor");
                if let Err(e) = stream.delete_consumer(&o).await {
                    tracing::warn!(consumer = %name, old = o, error = %e, "cannot delete the old durable");
                }
            }
            c
        }
    };
    ctx.health.set(name, &q.broker, None);
    tracing::info!(consumer = %name, durable, "consuming");
    let mut bus = ctx.bus.subscribe();
    let mut checked = tokio::time::Instant::now();
    loop {
        if checked.elapsed() >= LIVENESS_EVERY {
            checked = tokio::time::Instant::now();
            if client.connection_state() != async_nats::connection::State::Connected {
                return Err(format!("disconnected from {}", broker.url));
            }
            consumer.info().await.map_err(|e| format!("consumer {durable} on {stream_name}: {e}"))?;
        }
        let left = match room(ctx, task_id, q, &mut bus).await {
            Ok(n) => n,
            Err(ended) => return Ok(ended),
        };
        let mut messages = consumer
            .batch()
            .max_messages(left)
            .expires(PULL_EXPIRES)
            .messages()
            .await
            .map_err(|e| format!("pull from {stream_name}: {e}"))?;
        let mut taken = 0;
        while taken < left {
            let first = match messages.next().await {
                Some(Ok(m)) => m,
                Some(Err(e)) => return Err(format!("pull from {stream_name}: {e}")),
                // The pull expired: ask again (with the room there is then).
                None => break,
            };
            checked = tokio::time::Instant::now();
            let mut batch = vec![first];
            while taken + batch.len() < left {
                match messages.next().now_or_never() {
                    Some(Some(Ok(m))) => batch.push(m),
                    _ => break,
                }
            }
            let received_at = ctx.clock.now();
            let events = batch.iter().map(|m| request(task_id, q, &stream_name, m, received_at)).collect();
            if let Err(ended) = admit(ctx, name, events).await {
                return Ok(ended);
            }
            for m in &batch {
                m.ack().await.map_err(|e| format!("ack: {e}"))?;
            }
            taken += batch.len();
        }
    }
}

/// One message as an event of the task.
fn request(
    task_id: &str,
    q: &QueueTrigger,
    stream: &str,
    m: &jetstream::Message,
    received_at: chrono::DateTime<chrono::Utc>,
) -> crate::engine::EventRequest {
    let seq = m.info().map(|i| i.stream_sequence).unwrap_or_default();
    let delivered = m.info().map(|i| i.delivered).unwrap_or_default();
    let msg_id = m.headers.as_ref().and_then(|h| h.get("Nats-Msg-Id")).map(|v| v.as_str().to_string()).filter(|v| !v.is_empty());
    let key = msg_id.unwrap_or_else(|| format!("{stream}:{seq}"));
    let mut headers = BTreeMap::new();
    if let Some(h) = &m.headers {
        let kept = h.iter().filter(|(k, _)| !SECRET_HEADERS.contains(&k.to_string().to_ascii_lowercase().as_str()));
        for (k, vs) in kept.take(MAX_HEADERS) {
            if let Some(v) = vs.first() {
                headers.insert(k.to_string().to_ascii_lowercase(), v.as_str().chars().take(1024).collect());
            }
        }
    }
    let mut attributes = BTreeMap::new();
    attributes.insert("subject".to_string(), m.subject.to_string());
    attributes.insert("stream_sequence".to_string(), seq.to_string());
    attributes.insert("delivered".to_string(), delivered.to_string());
    message_request(task_id, q, &key, received_at, headers, attributes, &m.payload, 0)
}
