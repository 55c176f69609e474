//! The trigger router's sources: what turns a request or a message into an
//! [`EventRequest`] for the engine, whatever it came through — published
//! events (`api.rs`), webhooks (`webhook.rs`, with `signature.rs`), queue
//! messages (`consumers.rs` over `amqp.rs` and `nats.rs`). Each source
//! gives an event an id; its run id derives from the task and that id
//! (`model::event`), so one event makes one record however often it is
//! delivered. Time triggers are not here: `schedule/` plans them.

mod amqp;
pub mod consumers;
mod nats;
pub mod signature;
pub mod webhook;

use std::collections::BTreeMap;
use std::sync::Arc;

use chrono::{DateTime, Utc};

use crate::engine::EventRequest;
use crate::model::event::{BodyEncoding, EVENT_INLINE_BYTES, EventInfo, body_value};
use crate::model::run::TriggerKind;

/// The request for one task's run of an event whose body is `body`: the
/// body goes in the record when it is small, else beside it.
#[allow(clippy::too_many_arguments)]
pub fn event_request(
    task_id: &str,
    run_id: String,
    source: TriggerKind,
    name: &str,
    key: &str,
    received_at: DateTime<Utc>,
    headers: BTreeMap<String, String>,
    attributes: BTreeMap<String, String>,
    body: &[u8],
) -> EventRequest {
    let stored = body.len() > EVENT_INLINE_BYTES;
    let (value, encoding) = body_value(body);
    let info = EventInfo {
        source,
        name: name.to_string(),
        key: key.to_string(),
        received_at,
        headers,
        attributes,
        body: (!stored).then_some(value),
        body_encoding: encoding,
        body_bytes: body.len() as u64,
        body_stored: stored,
    };
    EventRequest {
        task_id: task_id.to_string(),
        run_id,
        info,
        stored_body: stored.then(|| Arc::new(body.to_vec())),
        priority: 0,
        invalid: None,
        dedup_window: Some(chrono::Duration::seconds(crate::model::trigger::DEFAULT_DEDUP_TTL_SECONDS as i64)),
        rerun: None,
    }
}

/// Whether a body is a JSON document (what a `format: json` trigger wants).
pub fn is_json(info: &EventInfo) -> bool {
    info.body_encoding == BodyEncoding::Json
}
