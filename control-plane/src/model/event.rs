//! What an event-started run carries: the event ([`EventInfo`], the
//! agent's `context.event`) or the run it follows ([`Upstream`], the
//! agent's `context.upstream`), and the run ids events derive (one run per
//! task per event id, so creation is create-if-absent).

use std::collections::BTreeMap;

use base64::Engine as _;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sha2::Digest as _;

use super::run::{RunStatus, TriggerKind};

/// A body up to this size (16 KiB) is kept in its run's record; a larger
/// one (up to 1 MiB, [`super::trigger::MAX_EVENT_BODY_BYTES`]) is stored
/// beside it under `events/{run_id}`, written in the same transaction, and
/// read back when an attempt is dispatched: the leader never holds large
/// bodies in memory.
pub const EVENT_INLINE_BYTES: usize = 16 * 1024;

/// What a dedup key (`dedup/{key}`) says: the run an event id or a manual
/// trigger's idempotency key made, and until when the same id makes no
/// other run. Written in the transaction that creates the run, apart from
/// the run record: a webhook's `ttl`, a queue trigger's `dedup.ttl` and a
/// trigger's or published event's `idempotency_ttl` hold whatever the
/// history keeps, and a run kept longer than its window no longer stops a
/// new one (README "Event triggers").
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DedupClaim {
    /// The event's id run (`event_run_id`): the key's name.
    pub key: String,
    /// The run it made (the key itself for the first; a later one after
    /// the window is `{key}-{received unix ms}`).
    pub run_id: String,
    /// The window's end (UTC): from then on the id makes a new run.
    pub expires_at: DateTime<Utc>,
    /// The run's slot (UTC), what a duplicate's answer says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheduled_at: Option<DateTime<Utc>>,
}

/// The event that started a run (README "Event triggers").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EventInfo {
    /// `webhook`, `queue` or `event`.
    pub source: TriggerKind,
    /// What it came through: the webhook's path, `broker/queue`,
    /// `broker/stream/subject`, or the topic.
    pub name: String,
    /// Its id: the delivery id (dedup header or body field), the message
    /// id (`message_id`, `Nats-Msg-Id`, a digest when it has none), the
    /// idempotency key. The same id makes no second run.
    pub key: String,
    /// When this control plane received it (UTC).
    pub received_at: DateTime<Utc>,
    /// The request's or message's headers the trigger lets through (lower
    /// case names).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: BTreeMap<String, String>,
    /// What the source says about it beside its headers (AMQP `priority`,
    /// `redelivered`; NATS `subject`, `stream_sequence`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub attributes: BTreeMap<String, String>,
    /// The body: a JSON document as it is, other bytes as a base64 string
    /// (`body_encoding`). Absent here when it is stored beside the run
    /// (`body_stored`); the agent always gets it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body: Option<serde_json::Value>,
    /// `json` or `base64`.
    pub body_encoding: BodyEncoding,
    /// The body's size in bytes, as received.
    pub body_bytes: u64,
    /// The body is under `events/{run_id}` (larger than [`EVENT_INLINE_BYTES`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub body_stored: bool,
}

/// How an event's body is given to the agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BodyEncoding {
    /// A JSON document, as is.
    Json,
    /// Bytes that are not JSON, as a base64 string.
    Base64,
}

/// The body as the agent gets it: `bytes` parsed if they are a JSON
/// document, else a base64 string.
pub fn body_value(bytes: &[u8]) -> (serde_json::Value, BodyEncoding) {
    match serde_json::from_slice::<serde_json::Value>(bytes) {
        Ok(v) if !bytes.is_empty() => (v, BodyEncoding::Json),
        _ => (serde_json::Value::String(base64::engine::general_purpose::STANDARD.encode(bytes)), BodyEncoding::Base64),
    }
}

/// The run a run follows (`after`), as its agent gets it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Upstream {
    /// The task followed.
    pub task: String,
    /// Its run.
    pub run_id: String,
    /// How that run ended.
    pub status: RunStatus,
    /// Its result, when at most [`UPSTREAM_RESULT_BYTES`]; else
    /// `{"trimmed": true, "bytes": N}` (`punchclock runs get` has it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<serde_json::Value>,
    /// Runs in the chain up to this one (A → B: 1 on B's run; A → B → C:
    /// 2 on C's), bounding a cycle made by two applies at once.
    #[serde(default)]
    pub chain: u32,
}

/// Largest upstream result carried whole to the following run: 64 KiB.
pub const UPSTREAM_RESULT_BYTES: usize = 64 * 1024;

impl Upstream {
    /// What a run that follows `run` (terminal) carries of it.
    pub fn of(run: &super::RunRecord) -> Upstream {
        let result = run.result.as_ref().map(|r| {
            let n = super::task::json_bytes(r);
            if n <= UPSTREAM_RESULT_BYTES { r.clone() } else { serde_json::json!({"trimmed": true, "bytes": n}) }
        });
        Upstream { task: run.task_id.clone(), run_id: run.run_id.clone(), status: run.status, result, chain: 0 }
    }
}

/// The run of an event with id `key` that came through `name` (a
/// webhook's path, a queue) for one task: `{task}.{kind}-{h}`, `h` the
/// first 32 hex digits of SHA-256 over `name` and `key` — one run per
/// task, source and id, whatever characters the id has.
pub fn event_run_id(task_id: &str, kind: TriggerKind, name: &str, key: &str) -> String {
    let mut h = sha2::Sha256::new();
    h.update(name.as_bytes());
    h.update(b"\n");
    h.update(key.as_bytes());
    let digest = hex::encode(h.finalize());
    format!("{task_id}.{}-{}", kind.as_str(), &digest[..32])
}

/// The run of an event published on `topic` with `key` for one task:
/// `{task}.event-{topic}.{key}` when the key is at most 64 letters, digits,
/// `_` and `-` (and not 32 hex digits); else `{task}.event-{topic}.{h}`,
/// `h` the first 32 hex digits of its SHA-256. A plain key has no `.`, so
/// the last `.` parts topic from key: one run id per (task, topic, key),
/// and two never share one (`a-b`/`c` and `a`/`b-c` differ).
pub fn published_run_id(task_id: &str, topic: &str, key: &str) -> String {
    let hexlike = key.len() == 32 && key.chars().all(|c| c.is_ascii_hexdigit());
    let plain = !key.is_empty() && key.len() <= 64 && !hexlike && key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if plain {
        return format!("{task_id}.event-{topic}.{key}");
    }
    let digest = hex::encode(sha2::Sha256::digest(key.as_bytes()));
    format!("{task_id}.event-{topic}.{}", &digest[..32])
}

/// Checks a published event's idempotency key: 1 to 256 characters, no
/// control characters.
///
/// Errors: `InvalidArgument` naming `field`.
pub fn validate_key(field: &str, key: &str) -> crate::error::Result<()> {
    if key.is_empty() {
        return Err(crate::error::Error::invalid(field, "required: the same key never makes a second run of a task"));
    }
    if key.chars().count() > 256 || key.chars().any(char::is_control) {
        return Err(crate::error::Error::invalid(field, "1 to 256 characters, no control characters"));
    }
    Ok(())
}

/// The run of task `task_id` that follows `upstream_run_id`:
/// `{task}.after-{upstream run id}` — one per upstream run.
pub fn after_run_id(task_id: &str, upstream_run_id: &str) -> String {
    format!("{task_id}.after-{upstream_run_id}")
}

/// Whether a run may have its event's body stored beside it (an event's
/// run: `{task}.webhook-…`, `.queue-…`, `.event-…`).
pub fn may_store_body(run_id: &str) -> bool {
    run_id.split_once('.').is_some_and(|(_, rest)| ["webhook-", "queue-", "event-"].iter().any(|p| rest.starts_with(p)))
}

/// A message id when a message has none: SHA-256 (hex) over its body and
/// `extra` (properties that stay the same when it is redelivered).
pub fn digest_id(body: &[u8], extra: &[&str]) -> String {
    let mut h = sha2::Sha256::new();
    for e in extra {
        h.update(e.as_bytes());
        h.update(b"\n");
    }
    h.update(body);
    format!("sha256:{}", hex::encode(h.finalize()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_are_json_or_base64() {
        assert_eq!(body_value(br#"{"a": 1}"#), (serde_json::json!({"a": 1}), BodyEncoding::Json));
        assert_eq!(body_value(b"\xff\x00"), (serde_json::json!("/wA="), BodyEncoding::Base64));
        assert_eq!(body_value(b""), (serde_json::json!(""), BodyEncoding::Base64));
    }

    #[test]
    fn event_run_ids_are_safe_and_scoped() {
        let a = event_run_id("t", TriggerKind::Webhook, "/hooks/x", "a b/c");
        assert!(a.starts_with("t.webhook-") && a.len() == "t.webhook-".len() + 32, "{a}");
        assert_ne!(a, event_run_id("t", TriggerKind::Webhook, "/hooks/y", "a b/c"));
        assert_eq!(a, event_run_id("t", TriggerKind::Webhook, "/hooks/x", "a b/c"));
        assert_eq!(super::super::run::task_of_run(&after_run_id("b", "a.20261203T100000Z")), "b");
    }

    #[test]
    fn published_run_ids_never_collide_across_topics_and_keys() {
        let ids = [
            published_run_id("t", "a-b", "c"),
            published_run_id("t", "a", "b-c"),
            published_run_id("t", "a.b", "c"),
            published_run_id("t", "a", "b.c"),
            published_run_id("t", "a", published_run_id("t", "a", "x.y").rsplit('.').next().unwrap()),
            published_run_id("t", "a", "x.y"),
        ];
        let set: std::collections::BTreeSet<_> = ids.iter().collect();
        assert_eq!(set.len(), ids.len(), "{ids:?}");
        assert_eq!(published_run_id("t", "build", "b-42"), "t.event-build.b-42");
    }
}
