//! A queue trigger on NATS JetStream (async-nats): a durable pull consumer
//! of the trigger's stream, filtered on its subject, with explicit acks.
//! Each pull asks for at most the room the task has (`max_pending` less
//! its waiting runs, and `prefetch`), so nothing is held while the task
//! is full. See `consumers.rs` for the delivery rules.
//!
//! The durable consumer is `punchclock-{task}-{h}` (`h` a digest of the
//! subject): every task listening on a subject gets every message, and a
//! new leader resumes where the last one acknowledged. A message's id is
//! its `Nats-Msg-Id` header; without one, `{stream}:{stream sequence}`
//! (the same for every redelivery of that message).

use std::collections::BTreeMap;
use std::time::Duration;

use async_nats::jetstream;
use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, pull};
use futures::{FutureExt, StreamExt};
use sha2::Digest as _;

use super::consumers::{ConsumerContext, Ended, admit, message_request, room};
use crate::config::Broker;
use crate::model::trigger::QueueTrigger;

/// How long a pull waits for messages before it is asked again.
const PULL_EXPIRES: Duration = Duration::from_secs(1);
/// How long a message may stay unacknowledged before JetStream redelivers
/// it (a consumer acks once its batch is committed: well within).
const ACK_WAIT: Duration = Duration::from_secs(60);
/// Most headers of a message given to the agent.
const MAX_HEADERS: usize = 32;

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

/// Consumes until the engine stops (`Ok`) or the broker fails (`Err`).
pub(crate) async fn consume(ctx: &ConsumerContext, name: &str, task_id: &str, q: &QueueTrigger, broker: &Broker) -> Result<Ended, String> {
    let client = connect(name, broker).await?;
    let js = jetstream::new(client);
    let stream_name = q.stream.clone().unwrap_or_default();
    let subject = q.subject.clone().unwrap_or_default();
    let stream = js.get_stream(&stream_name).await.map_err(|e| format!("stream {stream_name}: {e}"))?;
    let durable = durable(task_id, q);
    let config = pull::Config {
        durable_name: Some(durable.clone()),
        filter_subject: subject.clone(),
        ack_policy: AckPolicy::Explicit,
        ack_wait: ACK_WAIT,
        deliver_policy: DeliverPolicy::All,
        max_ack_pending: i64::from(q.prefetch()).max(1),
        ..Default::default()
    };
    let consumer: jetstream::consumer::PullConsumer =
        stream.get_or_create_consumer(&durable, config).await.map_err(|e| format!("consumer {durable} on {stream_name}: {e}"))?;
    ctx.health.set(name, &q.broker, None);
    tracing::info!(consumer = %name, durable, "consuming");
    let mut bus = ctx.bus.subscribe();
    loop {
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
        for (k, vs) in h.iter().take(MAX_HEADERS) {
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
