//! A queue trigger on RabbitMQ (AMQP 0.9.1, with lapin): consumes its
//! queue with manual acknowledgements and a prefetch, in sessions — a
//! channel takes messages while the task has room; when it has none the
//! channel is closed (RabbitMQ requeues what it held) and a new one is
//! opened once room comes back. See `consumers.rs` for the delivery rules.
//!
//! A message's id is its `message_id` property; without one, a digest of
//! its body, exchange, routing key, `timestamp`, `correlation_id` and
//! `type` (what a redelivery keeps), so identical messages without ids are
//! one event. Its `priority` (0–255) is added to the task's.

use std::collections::BTreeMap;

use futures::{FutureExt, StreamExt};
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Connection, ConnectionProperties};

use super::consumers::{ConsumerContext, Ended, admit, message_request, room};
use crate::config::Broker;
use crate::model::event::digest_id;
use crate::model::trigger::{QueueTrigger, SECRET_HEADERS};

/// Most headers of a message given to the agent.
const MAX_HEADERS: usize = 32;

/// A header's value as the agent sees it: strings as they are, numbers,
/// booleans and timestamps as text, tables and arrays as JSON.
fn header_text(v: &AMQPValue) -> String {
    fn json(v: &AMQPValue) -> serde_json::Value {
        use serde_json::Value as J;
        match v {
            AMQPValue::Boolean(b) => J::Bool(*b),
            AMQPValue::ShortShortInt(n) => J::from(*n),
            AMQPValue::ShortShortUInt(n) => J::from(*n),
            AMQPValue::ShortInt(n) => J::from(*n),
            AMQPValue::ShortUInt(n) => J::from(*n),
            AMQPValue::LongInt(n) => J::from(*n),
            AMQPValue::LongUInt(n) => J::from(*n),
            AMQPValue::LongLongInt(n) => J::from(*n),
            AMQPValue::Float(f) => J::from(*f),
            AMQPValue::Double(f) => J::from(*f),
            AMQPValue::Timestamp(t) => J::from(*t),
            AMQPValue::ShortString(s) => J::from(s.as_str()),
            AMQPValue::LongString(s) => J::from(String::from_utf8_lossy(s.as_bytes()).to_string()),
            AMQPValue::ByteArray(b) => J::from(base64::Engine::encode(&base64::engine::general_purpose::STANDARD, b.as_slice())),
            AMQPValue::FieldArray(a) => J::Array(a.as_slice().iter().map(json).collect()),
            AMQPValue::FieldTable(t) => J::Object(t.inner().iter().map(|(k, v)| (k.as_str().to_string(), json(v))).collect()),
            AMQPValue::DecimalValue(d) => J::from(format!("{}e-{}", d.value, d.scale)),
            AMQPValue::Void => J::Null,
        }
    }
    match json(v) {
        serde_json::Value::String(s) => s,
        other => other.to_string(),
    }
}

/// The broker's URL with the credentials of its `credentials_file`
/// (`user:password`), if any.
fn uri(broker: &Broker) -> Result<lapin::uri::AMQPUri, String> {
    let mut uri: lapin::uri::AMQPUri = broker.url.parse().map_err(|e| format!("{}: {e}", broker.url))?;
    if let Some(f) = &broker.credentials_file {
        let text = std::fs::read_to_string(f).map_err(|e| format!("credentials_file {f}: {e}"))?;
        let (user, pass) = text.trim_end().split_once(':').ok_or_else(|| format!("credentials_file {f}: expected user:password"))?;
        uri.authority.userinfo = lapin::uri::AMQPUserInfo { username: user.to_string(), password: pass.to_string() };
    }
    // Heartbeats every 10 s: a dead connection is seen within 30 s.
    uri.query.heartbeat.get_or_insert(10);
    Ok(uri)
}

async fn connect(name: &str, broker: &Broker) -> Result<Connection, String> {
    let uri = uri(broker)?;
    let props = ConnectionProperties::default().with_connection_name(format!("punchclock {name}").into());
    let conn = match &broker.ca_file {
        Some(ca) => {
            let pem = std::fs::read_to_string(ca).map_err(|e| format!("tls.ca_file {ca}: {e}"))?;
            let tls = lapin::tcp::OwnedTLSConfig { identity: None, cert_chain: Some(pem) };
            let rt = lapin::runtime::default_runtime().map_err(|e| e.to_string())?;
            Connection::connect_uri_with_config(uri, props, tls, rt).await
        }
        None => Connection::connect_uri(uri, props).await,
    };
    conn.map_err(|e| format!("cannot connect: {e}"))
}

/// Consumes until the engine stops (`Ok`) or the broker fails (`Err`).
pub(crate) async fn consume(ctx: &ConsumerContext, name: &str, task_id: &str, q: &QueueTrigger, broker: &Broker) -> Result<Ended, String> {
    let conn = connect(name, broker).await?;
    let queue = q.queue.clone().unwrap_or_default();
    let mut bus = ctx.bus.subscribe();
    let tag = format!("punchclock {name}");
    let mut first = true;
    loop {
        let channel = conn.create_channel().await.map_err(|e| format!("cannot open a channel: {e}"))?;
        if first {
            // The queue must exist: punchclock does not declare it.
            channel
                .queue_declare(queue.as_str().into(), QueueDeclareOptions { passive: true, ..Default::default() }, FieldTable::default())
                .await
                .map_err(|e| format!("queue {queue}: {e}"))?;
            ctx.health.set(name, &q.broker, None);
            tracing::info!(consumer = %name, "consuming");
            first = false;
        }
        let mut left = match room(ctx, task_id, q, &mut bus).await {
            Ok(n) => n,
            Err(ended) => return Ok(ended),
        };
        channel
            .basic_qos(q.prefetch().min(u32::from(u16::MAX)) as u16, BasicQosOptions::default())
            .await
            .map_err(|e| format!("basic.qos: {e}"))?;
        let mut consumer = channel
            .basic_consume(queue.as_str().into(), tag.as_str().into(), BasicConsumeOptions::default(), FieldTable::default())
            .await
            .map_err(|e| format!("basic.consume on {queue}: {e}"))?;
        // Take messages while there is room; then this channel closes
        // (dropped), giving back whatever it still holds.
        while left > 0 {
            let d = match consumer.next().await {
                Some(Ok(d)) => d,
                Some(Err(e)) => return Err(format!("consuming {queue}: {e}")),
                None => return Err(format!("the broker cancelled the consumer of {queue}")),
            };
            let mut batch = vec![d];
            while batch.len() < left {
                match consumer.next().now_or_never() {
                    Some(Some(Ok(d))) => batch.push(d),
                    _ => break,
                }
            }
            let received_at = ctx.clock.now();
            let events = batch.iter().map(|d| request(task_id, q, d, received_at)).collect();
            if let Err(ended) = admit(ctx, name, events).await {
                return Ok(ended);
            }
            // Committed: acknowledged, all at once (one channel, in order).
            let last = batch.last().map(|d| d.delivery_tag).unwrap_or_default();
            channel.basic_ack(last, BasicAckOptions { multiple: true }).await.map_err(|e| format!("basic.ack: {e}"))?;
            left -= batch.len();
            if left == 0 {
                // More room already? Go on with this channel.
                left = match ctx.engine.upgrade() {
                    Some(e) => match e.waiting(task_id.to_string()).await {
                        Ok(w) => (u64::from(q.max_pending).saturating_sub(w) as usize).min(q.prefetch() as usize),
                        Err(_) => return Ok(Ended::EngineGone),
                    },
                    None => return Ok(Ended::EngineGone),
                };
            }
        }
        drop(consumer);
        let _ = channel.close(200, "no room: the task has max_pending runs waiting".into()).await;
    }
}

/// One delivery as an event of the task.
fn request(
    task_id: &str,
    q: &QueueTrigger,
    d: &lapin::message::Delivery,
    received_at: chrono::DateTime<chrono::Utc>,
) -> crate::engine::EventRequest {
    let p = &d.properties;
    let key = match p.message_id() {
        Some(id) if !id.as_str().is_empty() => id.as_str().to_string(),
        _ => {
            let ts = p.timestamp().map(|t| t.to_string()).unwrap_or_default();
            let corr = p.correlation_id().as_ref().map(|c| c.as_str().to_string()).unwrap_or_default();
            let kind = p.kind().as_ref().map(|k| k.as_str().to_string()).unwrap_or_default();
            digest_id(&d.data, &[d.exchange.as_str(), d.routing_key.as_str(), &ts, &corr, &kind])
        }
    };
    let mut headers = BTreeMap::new();
    if let Some(t) = p.headers() {
        let kept = t.inner().iter().filter(|(k, _)| !SECRET_HEADERS.contains(&k.as_str().to_ascii_lowercase().as_str()));
        for (k, v) in kept.take(MAX_HEADERS) {
            headers.insert(k.as_str().to_ascii_lowercase(), header_text(v).chars().take(1024).collect());
        }
    }
    let mut attributes = BTreeMap::new();
    attributes.insert("exchange".to_string(), d.exchange.as_str().to_string());
    attributes.insert("routing_key".to_string(), d.routing_key.as_str().to_string());
    attributes.insert("redelivered".to_string(), d.redelivered.to_string());
    if let Some(prio) = p.priority() {
        attributes.insert("priority".to_string(), prio.to_string());
    }
    if let Some(ct) = p.content_type() {
        attributes.insert("content_type".to_string(), ct.as_str().to_string());
    }
    let priority = p.priority().map_or(0, i32::from);
    message_request(task_id, q, &key, received_at, headers, attributes, &d.data, priority)
}
