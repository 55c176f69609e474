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
//! the stream.
//!
//! **A message's id** ([`message_key`]) is its `Nats-Msg-Id` header;
//! without one, `{stream}:{stream sequence}:{published}`, `published` the
//! time JetStream stored the message (nanoseconds since the Unix epoch, as
//! every delivery of it carries), scoped by broker and stream. The
//! sequence alone is not enough: a stream deleted and made again (`nats
//! stream rm`/`add`, a move done so) counts from 1 again, and its messages
//! took the old stream's ids — found "duplicates", acknowledged, lost. The
//! time tells them apart, and a message keeps it wherever JetStream keeps
//! the message: across a server restart, on every replica (the stream
//! leader's time), through `nats stream backup`/`restore` (nats-server
//! restores the messages with their sequences and times, and the
//! consumers with their state), so a restored message that had run is
//! not run again.
//!
//! Versions before issue 34 keyed `{stream}:{sequence}`. A durable one of
//! them made may hold messages delivered and not yet acknowledged whose
//! records were committed under that id; the first time this version
//! attaches to such a durable it writes in the durable's description the
//! last stream sequence delivered so far ([`mark`]), and messages up to
//! it keep the old id — every later leader reads the same mark. A durable
//! this version makes gets the mark too (0, or what the task's durable of
//! an older subject had reached).
//!
//! **Redelivery.** JetStream redelivers a message not acknowledged within
//! the durable's [`ACK_WAIT`] (10 s; a durable made with another value is
//! updated when attached): what a killed or stopped leader had pulled
//! comes back to the next one about that long after it was delivered.
//! A batch whose commit takes longer (a slow disk, a busy engine) is not
//! redelivered meanwhile, and needs no in-progress acks: JetStream
//! redelivers only into a waiting pull, a pull waits at most
//! [`PULL_EXPIRES`], and the next one is sent only once the batch is
//! acknowledged.
//!
//! While no message comes, the consumer checks every
//! [`LIVENESS_EVERY`] that its connection is up and its durable still
//! exists. A durable gone while its stream is there (found so, or by a
//! failed pull: the stream was deleted and made again, or the durable
//! deleted) is made again at once, from the stream's start; a stream
//! gone, or a server, is a failure the supervisor reports (`/readyz`
//! degraded) and retries.

use std::collections::BTreeMap;
use std::time::Duration;

use async_nats::jetstream;
use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, FromConsumer, PullConsumer, pull};
use async_nats::jetstream::context::ConsumerInfoErrorKind;
use futures::{FutureExt, StreamExt};
use sha2::Digest as _;

use super::consumers::{ConsumerContext, Ended, admit, message_request, room};
use crate::config::Broker;
use crate::model::trigger::{QueueTrigger, SECRET_HEADERS};

/// How long a pull waits for messages before it is asked again.
const PULL_EXPIRES: Duration = Duration::from_secs(1);
/// How long a delivered message may stay unacknowledged before JetStream
/// redelivers it: the time a killed leader's pulled messages wait for the
/// next leader (which takes over within the lease TTL, 5 s by default).
/// A consumer acknowledges once its batch is committed; a commit slower
/// than this makes no redelivery (see the module doc).
const ACK_WAIT: Duration = Duration::from_secs(10);
/// Most headers of a message given to the agent.
const MAX_HEADERS: usize = 32;
/// How often an idle consumer checks its connection and durable.
const LIVENESS_EVERY: Duration = Duration::from_secs(5);
/// How a durable's description starts, before the last stream sequence
/// whose messages keep the id of earlier versions (see [`mark`]).
const MARK: &str = "punchclock queue trigger; ids without Nats-Msg-Id are {stream}:{sequence}:{published} after stream sequence ";

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

/// The description of a durable whose messages up to stream sequence
/// `old_ids_through` keep the id earlier versions gave them
/// (`{stream}:{sequence}`): [`MARK`] and the sequence.
fn mark(old_ids_through: u64) -> String {
    format!("{MARK}{old_ids_through}")
}

/// The sequence a durable's description marks ([`mark`]); `None` for a
/// durable an earlier version made (no mark).
fn marked(description: Option<&str>) -> Option<u64> {
    description?.strip_prefix(MARK)?.parse().ok()
}

/// Up to which stream sequence a durable's messages keep the old id: its
/// mark, or for a durable an earlier version made, the last message it
/// delivered (any later one was never delivered under the old id).
fn old_ids_through(info: &jetstream::consumer::Info) -> u64 {
    marked(info.config.description.as_deref()).unwrap_or(info.delivered.stream_sequence)
}

/// Where a new durable starts, and up to which sequence its messages keep
/// the old id: after the highest acknowledged floor of the task's other
/// durables on the stream (its subject changed), inheriting what they
/// delivered under the old id; else at the start of the stream, with
/// none. Returns those durables too, to delete once the new one exists.
async fn start_of_new(
    stream: &jetstream::stream::Stream,
    task_id: &str,
    durable: &str,
) -> Result<(DeliverPolicy, u64, Vec<String>), String> {
    let mut infos = stream.consumers();
    let mut floor = None::<u64>;
    let mut through = 0;
    let mut old = Vec::new();
    while let Some(info) = infos.next().await {
        let info = info.map_err(|e| format!("list consumers: {e}"))?;
        if info.name != durable && is_durable_of(task_id, &info.name) {
            floor = Some(floor.unwrap_or(0).max(info.ack_floor.stream_sequence));
            through = through.max(old_ids_through(&info));
            old.push(info.name);
        }
    }
    Ok(match floor {
        Some(f) => (DeliverPolicy::ByStartSequence { start_sequence: f + 1 }, through, old),
        None => (DeliverPolicy::All, 0, old),
    })
}

/// The trigger's durable on `stream` — made when missing (see
/// [`start_of_new`]), or brought to this version's settings (ack wait,
/// `prefetch`, the mark) — and up to which stream sequence its messages
/// keep the old id.
async fn attach(
    stream: &jetstream::stream::Stream,
    name: &str,
    task_id: &str,
    q: &QueueTrigger,
    durable: &str,
) -> Result<(PullConsumer, u64), String> {
    let max_ack_pending = i64::from(q.prefetch()).max(1);
    match stream.consumer_info(durable).await {
        Ok(info) => {
            let through = old_ids_through(&info);
            let unmarked = marked(info.config.description.as_deref()).is_none();
            let c = &info.config;
            if !unmarked && c.ack_wait == ACK_WAIT && c.max_ack_pending == max_ack_pending {
                let consumer = stream.get_consumer(durable).await.map_err(|e| format!("consumer {durable}: {e}"))?;
                return Ok((consumer, through));
            }
            if unmarked {
                tracing::info!(consumer = %name, durable, old_ids_through = through, "a durable of an earlier version: its messages up to this stream sequence keep their ids ({{stream}}:{{sequence}})");
            }
            let mut config = pull::Config::try_from_consumer_config(info.config).map_err(|e| format!("consumer {durable}: {e}"))?;
            config.ack_wait = ACK_WAIT;
            config.max_ack_pending = max_ack_pending;
            config.description = Some(mark(through));
            let consumer = stream.create_consumer(config).await.map_err(|e| format!("update consumer {durable}: {e}"))?;
            Ok((consumer, through))
        }
        Err(e) if e.kind() == ConsumerInfoErrorKind::NotFound => {
            let (deliver_policy, through, old) = start_of_new(stream, task_id, durable).await?;
            let config = pull::Config {
                durable_name: Some(durable.to_string()),
                description: Some(mark(through)),
                filter_subject: q.subject.clone().unwrap_or_default(),
                ack_policy: AckPolicy::Explicit,
                ack_wait: ACK_WAIT,
                deliver_policy,
                max_ack_pending,
                ..Default::default()
            };
            let consumer = stream.create_consumer(config).await.map_err(|e| format!("create consumer {durable}: {e}"))?;
            for o in old {
                tracing::info!(consumer = %name, old = o, durable, ?deliver_policy, "the trigger's subject changed: the new durable starts after the old one's acknowledged floor");
                if let Err(e) = stream.delete_consumer(&o).await {
                    tracing::warn!(consumer = %name, old = o, error = %e, "cannot delete the old durable");
                }
            }
            Ok((consumer, through))
        }
        Err(e) => Err(format!("consumer {durable}: {e}")),
    }
}

/// How one attachment to the durable ended.
enum Session {
    /// The engine stopped.
    Ended(Ended),
    /// The durable is gone while the server answers: attach again.
    DurableGone,
    /// The broker failed.
    Failed(String),
}

/// Consumes until the engine stops (`Ok`) or the broker fails (`Err`).
pub(crate) async fn consume(ctx: &ConsumerContext, name: &str, task_id: &str, q: &QueueTrigger, broker: &Broker) -> Result<Ended, String> {
    let client = connect(name, broker).await?;
    let js = jetstream::new(client.clone());
    let stream_name = q.stream.clone().unwrap_or_default();
    let durable = durable(task_id, q);
    loop {
        let stream = js.get_stream(&stream_name).await.map_err(|e| format!("stream {stream_name}: {e}"))?;
        let (consumer, old_ids_through) =
            attach(&stream, name, task_id, q, &durable).await.map_err(|e| format!("stream {stream_name}: {e}"))?;
        ctx.health.set(name, &q.broker, None);
        tracing::info!(consumer = %name, durable, old_ids_through, "consuming");
        match session(ctx, name, task_id, q, &client, broker, &consumer, old_ids_through).await {
            Session::Ended(ended) => return Ok(ended),
            Session::Failed(why) => return Err(why),
            Session::DurableGone => {
                tracing::warn!(consumer = %name, durable, "the durable is gone (its stream deleted and made again, or the durable deleted): a new one from the stream's start");
            }
        }
    }
}

/// What a failed pull means: the durable gone (the server says so), or
/// a failed broker.
async fn failure(consumer: &PullConsumer, why: String) -> Session {
    match consumer.get_info().await {
        Err(e) if e.kind() == ConsumerInfoErrorKind::NotFound => Session::DurableGone,
        _ => Session::Failed(why),
    }
}

/// Pulls, admits and acknowledges on one attachment to the durable.
#[allow(clippy::too_many_arguments)]
async fn session(
    ctx: &ConsumerContext,
    name: &str,
    task_id: &str,
    q: &QueueTrigger,
    client: &async_nats::Client,
    broker: &Broker,
    consumer: &PullConsumer,
    old_ids_through: u64,
) -> Session {
    let (stream_name, durable) = (&consumer.cached_info().stream_name, &consumer.cached_info().name);
    let mut bus = ctx.bus.subscribe();
    let mut checked = tokio::time::Instant::now();
    loop {
        if checked.elapsed() >= LIVENESS_EVERY {
            checked = tokio::time::Instant::now();
            if client.connection_state() != async_nats::connection::State::Connected {
                return Session::Failed(format!("disconnected from {}", broker.url));
            }
            match consumer.get_info().await {
                Ok(_) => {}
                Err(e) if e.kind() == ConsumerInfoErrorKind::NotFound => return Session::DurableGone,
                Err(e) => return Session::Failed(format!("consumer {durable} on {stream_name}: {e}")),
            }
        }
        let left = match room(ctx, task_id, q, &mut bus).await {
            Ok(n) => n,
            Err(ended) => return Session::Ended(ended),
        };
        let mut messages = match consumer.batch().max_messages(left).expires(PULL_EXPIRES).messages().await {
            Ok(m) => m,
            Err(e) => return failure(consumer, format!("pull from {stream_name}: {e}")).await,
        };
        let mut taken = 0;
        while taken < left {
            let first = match messages.next().await {
                Some(Ok(m)) => m,
                Some(Err(e)) => return failure(consumer, format!("pull from {stream_name}: {e}")).await,
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
            let events = match batch.iter().map(|m| request(task_id, q, stream_name, old_ids_through, m, received_at)).collect() {
                Ok(events) => events,
                Err(why) => return Session::Failed(why),
            };
            // However long this takes, nothing is redelivered meanwhile:
            // JetStream redelivers a message into a waiting pull once its
            // ack wait has passed, this pull waits 1 s, and the next is
            // sent only after these acks.
            if let Err(ended) = admit(ctx, name, events).await {
                return Session::Ended(ended);
            }
            for m in &batch {
                if let Err(e) = m.ack().await {
                    return Session::Failed(format!("ack: {e}"));
                }
            }
            taken += batch.len();
        }
    }
}

/// A message's id, unique within its broker and stream: its
/// `Nats-Msg-Id` when it has one (the publisher's, across streams and
/// their incarnations); else `{stream}:{sequence}:{published}`, the time
/// JetStream stored it in nanoseconds since the Unix epoch — so a stream
/// made again, counting from 1 again, gives new ids. A message up to
/// stream sequence `old_ids_through` keeps the id earlier versions gave
/// it, `{stream}:{sequence}` (its record may have been committed under
/// it; see the module doc).
fn message_key(msg_id: Option<&str>, stream: &str, sequence: u64, published_ns: i128, old_ids_through: u64) -> String {
    match msg_id.filter(|v| !v.is_empty()) {
        Some(id) => id.to_string(),
        None if sequence <= old_ids_through => format!("{stream}:{sequence}"),
        None => format!("{stream}:{sequence}:{published_ns}"),
    }
}

/// One message as an event of the task. Errors: a message without
/// JetStream's delivery metadata (its reply subject), which has no
/// sequence to key it by and could not be acknowledged either.
fn request(
    task_id: &str,
    q: &QueueTrigger,
    stream: &str,
    old_ids_through: u64,
    m: &jetstream::Message,
    received_at: chrono::DateTime<chrono::Utc>,
) -> Result<crate::engine::EventRequest, String> {
    let info = m.info().map_err(|e| format!("a message on {} without JetStream metadata: {e}", m.subject))?;
    let published_ns = info.published.unix_timestamp_nanos();
    let msg_id = m.headers.as_ref().and_then(|h| h.get("Nats-Msg-Id")).map(|v| v.as_str());
    let key = message_key(msg_id, stream, info.stream_sequence, published_ns, old_ids_through);
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
    attributes.insert("stream_sequence".to_string(), info.stream_sequence.to_string());
    attributes.insert("delivered".to_string(), info.delivered.to_string());
    if let Ok(ns) = i64::try_from(published_ns) {
        let published = chrono::DateTime::from_timestamp_nanos(ns);
        attributes.insert("published".to_string(), published.to_rfc3339_opts(chrono::SecondsFormat::Nanos, true));
    }
    Ok(message_request(task_id, q, &key, received_at, headers, attributes, &m.payload, 0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_tell_a_stream_made_again_from_the_old_one() {
        // Sequence 1 of the old stream and of the new one.
        let old = message_key(None, "WORK", 1, 1_767_225_600_000_000_001, 0);
        let new = message_key(None, "WORK", 1, 1_767_225_900_000_000_002, 0);
        assert_eq!(old, "WORK:1:1767225600000000001");
        assert_ne!(old, new);
        // A redelivery of the same message: the same id.
        assert_eq!(new, message_key(None, "WORK", 1, 1_767_225_900_000_000_002, 0));
        // The publisher's id wins; an empty one is none.
        assert_eq!(message_key(Some("m1"), "WORK", 1, 5, 0), "m1");
        assert_eq!(message_key(Some(""), "WORK", 1, 5, 0), "WORK:1:5");
    }

    #[test]
    fn messages_an_earlier_version_delivered_keep_its_ids() {
        // What versions before the publish time keyed: `{stream}:{sequence}`.
        assert_eq!(message_key(None, "WORK", 7, 5, 7), "WORK:7");
        assert_eq!(message_key(None, "WORK", 8, 5, 7), "WORK:8:5");
        assert_eq!(marked(Some(&mark(7))), Some(7));
        assert_eq!(marked(Some(&mark(0))), Some(0));
        assert_eq!(marked(None), None);
        assert_eq!(marked(Some("a durable someone described")), None);
    }

    #[test]
    fn durables_of_a_task_are_its_own() {
        assert!(is_durable_of("a", "punchclock-a-0123abcd"));
        assert!(!is_durable_of("a", "punchclock-a-b-0123abcd"));
        assert!(!is_durable_of("a", "punchclock-a-0123abc"));
    }
}
