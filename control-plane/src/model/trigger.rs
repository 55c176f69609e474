//! Triggers: what starts a task's runs. A task has any mix of them
//! (`trigger`, or a list in `triggers`), tagged by `type`:
//!
//! | type | starts a run | where it is handled |
//! |---|---|---|
//! | `cron`, `interval`, `once` | at each slot | `schedule/` plans the slots, the engine fires them |
//! | `webhook` | at each authenticated POST to its path on the HTTP port | `events/webhook.rs` |
//! | `queue` | at each message of a RabbitMQ queue or a NATS JetStream subject | `events/amqp.rs`, `events/nats.rs` |
//! | `event` | at each `PublishEvent` on its topic | `api.rs` |
//! | `after` | when a run of another task ends | the engine's `dependencies` policy |
//!
//! Whatever the source, a run that is not a time slot enters through one
//! admission path with an idempotency key (its run id derives from the
//! task and the key, so creation is create-if-absent), and every policy
//! applies to it as to a slot.

use serde::{Deserialize, Serialize};

use super::run::{RunStatus, TriggerKind};
use crate::error::Error;
use crate::schedule::{self, CronTrigger, IntervalTrigger, OnceTrigger, Schedule, TimeTrigger};

/// A trigger, tagged by `type`. Deserialized by hand (below) so that
/// errors inside a trigger keep their field path (`trigger.every_seconds`),
/// which serde's internally tagged enums lose.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum TriggerSpec {
    /// Cron expression in an IANA zone.
    Cron(CronTrigger),
    /// Fixed period anchored at `start_at`.
    Interval(IntervalTrigger),
    /// A single instant.
    Once(OnceTrigger),
    /// POSTs to a path of the control plane's HTTP port.
    Webhook(WebhookTrigger),
    /// Messages of a broker's queue (RabbitMQ) or subject (NATS JetStream).
    Queue(QueueTrigger),
    /// A published event's topic (`PublishEvent`, `punchclock event publish`).
    Event(EventTrigger),
    /// The end of another task's runs.
    After(AfterTrigger),
}

impl TriggerSpec {
    /// The time trigger it is, if it is one (`schedule/` plans it).
    pub fn time(&self) -> Option<TimeTrigger<'_>> {
        match self {
            TriggerSpec::Cron(c) => Some(TimeTrigger::Cron(c)),
            TriggerSpec::Interval(i) => Some(TimeTrigger::Interval(i)),
            TriggerSpec::Once(o) => Some(TimeTrigger::Once(o)),
            _ => None,
        }
    }

    /// Whether `schedule/` plans it (cron, interval, once).
    pub fn is_time(&self) -> bool {
        self.time().is_some()
    }

    /// The trigger kind of the runs it starts.
    pub fn kind(&self) -> TriggerKind {
        match self {
            TriggerSpec::Cron(_) => TriggerKind::Cron,
            TriggerSpec::Interval(_) => TriggerKind::Interval,
            TriggerSpec::Once(_) => TriggerKind::Once,
            TriggerSpec::Webhook(_) => TriggerKind::Webhook,
            TriggerSpec::Queue(_) => TriggerKind::Queue,
            TriggerSpec::Event(_) => TriggerKind::Event,
            TriggerSpec::After(_) => TriggerKind::After,
        }
    }

    /// Every problem of this trigger, its fields named under `path`
    /// (`trigger`, `triggers[2]`). A time trigger is compiled to find them.
    pub fn problems(&self, path: &str) -> Vec<Error> {
        let mut p = Vec::new();
        if let Some(t) = self.time() {
            if let TimeTrigger::Once(o) = t
                && o.at.timestamp_subsec_nanos() >= 1_000_000_000
            {
                p.push(Error::invalid(
                    format!("{path}.at"),
                    "is a leap second (:60), which UTC clocks here never show; use :59 or the next minute",
                ));
            }
            let jitter = t.jitter_seconds();
            if jitter > MAX_JITTER_SECONDS {
                p.push(Error::invalid(format!("{path}.jitter_seconds"), format!("must be at most {MAX_JITTER_SECONDS} (1 day)")));
            }
            match schedule::compile(t, path) {
                Ok(Schedule { shape: schedule::Shape::Interval { period_ms, .. }, .. }) if (jitter as i64) * 1000 >= period_ms => {
                    p.push(Error::invalid(format!("{path}.jitter_seconds"), "must be shorter than the interval"));
                }
                Ok(_) => {}
                Err(e) => p.push(e),
            }
            return p;
        }
        match self {
            TriggerSpec::Webhook(w) => w.problems(path, &mut p),
            TriggerSpec::Queue(q) => q.problems(path, &mut p),
            TriggerSpec::Event(e) => {
                if let Err(e) = validate_topic(&format!("{path}.topic"), &e.topic) {
                    p.push(e);
                }
            }
            TriggerSpec::After(a) => {
                if let Err(e) = super::task::validate_id(&format!("{path}.task"), &a.task) {
                    p.push(e);
                }
            }
            TriggerSpec::Cron(_) | TriggerSpec::Interval(_) | TriggerSpec::Once(_) => {}
        }
        p
    }
}

/// Largest `jitter_seconds` of a time trigger: one day.
pub const MAX_JITTER_SECONDS: u64 = 86_400;

/// Checks an event topic: 1 to 128 letters, digits, `_ - .`.
///
/// Errors: `InvalidArgument` naming `field`.
pub fn validate_topic(field: &str, topic: &str) -> crate::error::Result<()> {
    if topic.is_empty() || topic.len() > 128 || !topic.chars().all(|c| c.is_ascii_alphanumeric() || "_-.".contains(c)) {
        return Err(Error::invalid(field, format!("{topic:?}: 1 to 128 letters, digits, _ - .")));
    }
    Ok(())
}

// ------------------------------------------------------------ webhook

/// Largest webhook body: 1 MiB (the default of `max_body_bytes` and its
/// bound; a body is stored whole, in one store write, beside its run).
pub const MAX_EVENT_BODY_BYTES: u64 = 1024 * 1024;

/// `{type: webhook, path, auth, dedup, headers, max_body_bytes}`: each
/// authenticated `POST` to `path` on the control plane's HTTP port starts
/// a run whose context has the request as `event` (README "Event triggers").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebhookTrigger {
    /// `/hooks/...`: segments of letters, digits, `_ - . ~`; at most 200
    /// characters. One task per path.
    pub path: String,
    /// How a request proves it comes from the sender (required; `none`
    /// said explicitly).
    pub auth: WebhookAuth,
    /// How a sender's retry of one delivery is recognised (default: the
    /// `Idempotency-Key` header when a request has one, else none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dedup: Option<WebhookDedup>,
    /// Request headers the agent sees in `event.headers` (lower case;
    /// default [`DEFAULT_EVENT_HEADERS`] and the dedup header).
    /// `authorization`, `cookie` and `proxy-authorization` are never given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub headers: Option<Vec<String>>,
    /// Largest body accepted (413 above); default and most 1 MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_body_bytes: Option<u64>,
}

/// Headers a webhook's agent sees when its trigger names none.
pub const DEFAULT_EVENT_HEADERS: &[&str] =
    &["content-type", "user-agent", "x-github-event", "x-github-delivery", "x-gitlab-event", "x-request-id", "idempotency-key"];

/// Headers never given to an agent, from a request or a queue message:
/// they carry credentials.
pub const SECRET_HEADERS: &[&str] = &["authorization", "cookie", "proxy-authorization"];

impl WebhookTrigger {
    /// The body limit in bytes.
    pub fn max_body(&self) -> u64 {
        self.max_body_bytes.unwrap_or(MAX_EVENT_BODY_BYTES)
    }

    /// The headers the agent sees (lower case).
    pub fn allowed_headers(&self) -> Vec<String> {
        let mut v: Vec<String> = match &self.headers {
            Some(h) => h.iter().map(|h| h.to_ascii_lowercase()).collect(),
            None => DEFAULT_EVENT_HEADERS.iter().map(|h| h.to_string()).collect(),
        };
        if let Some(h) = self.dedup.as_ref().and_then(|d| d.header.as_ref()) {
            v.push(h.to_ascii_lowercase());
        }
        v.retain(|h| !SECRET_HEADERS.contains(&h.as_str()));
        v.sort();
        v.dedup();
        v
    }

    /// The dedup window in seconds.
    pub fn dedup_ttl_seconds(&self) -> u64 {
        dedup_window_seconds(self.dedup.as_ref().and_then(|d| d.ttl.as_deref()))
    }

    fn problems(&self, path: &str, p: &mut Vec<Error>) {
        if let Err(why) = check_hook_path(&self.path) {
            p.push(Error::invalid(format!("{path}.path"), why));
        }
        match &self.auth {
            WebhookAuth::None => {}
            WebhookAuth::Bearer(b) => check_file(&format!("{path}.auth.bearer.token_file"), &b.token_file, p),
            WebhookAuth::Hmac(h) => {
                let at = |f: &str| format!("{path}.auth.hmac.{f}");
                check_file(&at("secret_file"), &h.secret_file, p);
                if !header_name_ok(&h.header) {
                    p.push(Error::invalid(at("header"), format!("{:?} is not a header name", h.header)));
                }
                if let Some(t) = &h.timestamp_header
                    && !header_name_ok(t)
                {
                    p.push(Error::invalid(at("timestamp_header"), format!("{t:?} is not a header name")));
                }
                if !(1..=86_400).contains(&h.tolerance_seconds) {
                    p.push(Error::invalid(at("tolerance_seconds"), "must be in 1..=86400"));
                }
                if h.prefix.len() > 64 {
                    p.push(Error::invalid(at("prefix"), "at most 64 characters"));
                }
            }
        }
        if let Some(d) = &self.dedup {
            match (&d.header, &d.body_field) {
                (Some(_), Some(_)) | (None, None) => {
                    p.push(Error::invalid(format!("{path}.dedup"), "give one of header or body_field"));
                }
                (Some(h), None) if !header_name_ok(h) => {
                    p.push(Error::invalid(format!("{path}.dedup.header"), format!("{h:?} is not a header name")))
                }
                (None, Some(f)) if f.is_empty() || f.len() > 128 || f.split('.').any(str::is_empty) => p.push(Error::invalid(
                    format!("{path}.dedup.body_field"),
                    "a field name or dotted path (data.id), at most 128 characters",
                )),
                _ => {}
            }
            if let Some(ttl) = &d.ttl {
                check_ttl(&format!("{path}.dedup.ttl"), ttl, p);
            }
        }
        if let Some(h) = &self.headers {
            if h.len() > 32 {
                p.push(Error::invalid(format!("{path}.headers"), "at most 32"));
            }
            for (i, name) in h.iter().enumerate() {
                if !header_name_ok(name) {
                    p.push(Error::invalid(format!("{path}.headers[{i}]"), format!("{name:?} is not a header name")));
                } else if SECRET_HEADERS.contains(&name.to_ascii_lowercase().as_str()) {
                    p.push(Error::invalid(
                        format!("{path}.headers[{i}]"),
                        format!("{name:?} carries credentials and is never given to an agent"),
                    ));
                }
            }
        }
        if let Some(n) = self.max_body_bytes
            && !(1..=MAX_EVENT_BODY_BYTES).contains(&n)
        {
            p.push(Error::invalid(format!("{path}.max_body_bytes"), format!("must be in 1..={MAX_EVENT_BODY_BYTES} (1 MiB)")));
        }
    }
}

/// A webhook's authentication.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum WebhookAuth {
    /// `{hmac: {...}}`: a signature over the raw body (GitHub's, Stripe's
    /// and most senders' scheme).
    Hmac(HmacAuth),
    /// `{bearer: {token_file}}`: `Authorization: Bearer <token>`.
    Bearer(BearerAuth),
    /// `"none"`: anyone who reaches the HTTP port may start runs.
    None,
}

/// `auth.hmac`: the request carries `HMAC(secret, payload)` in `header`.
/// The payload is the raw body, or `"{timestamp}.{body}"` with a
/// `timestamp_header` (whose Unix time must be within `tolerance_seconds`
/// of now). When `timestamp_header` is the signature header itself, its
/// value is a comma-separated list of `key=value` (Stripe's
/// `Stripe-Signature: t=...,v1=...`): `t` is the timestamp, and each entry
/// starting with `prefix` (`v1=`) is a candidate signature.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HmacAuth {
    /// A file on every control plane host holding the secret (its bytes,
    /// one trailing newline dropped); read at each request, so a rotated
    /// file takes effect at once. Never stored.
    pub secret_file: String,
    /// The header with the signature (`X-Hub-Signature-256`).
    pub header: String,
    /// `sha256` (default) or `sha1`.
    #[serde(default)]
    pub algorithm: HmacAlgorithm,
    /// How the signature is written: `hex` (default) or `base64`.
    #[serde(default)]
    pub encoding: SignatureEncoding,
    /// Text before the signature in the header (`sha256=`); default none.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub prefix: String,
    /// The header with the Unix time the signature covers, if the sender
    /// signs one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timestamp_header: Option<String>,
    /// How far that time may be from now, seconds; default 300.
    #[serde(default = "default_tolerance")]
    pub tolerance_seconds: u64,
}

fn default_tolerance() -> u64 {
    300
}

/// The hash of an HMAC signature.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HmacAlgorithm {
    /// HMAC-SHA256.
    #[default]
    Sha256,
    /// HMAC-SHA1 (older senders).
    Sha1,
}

/// How a signature is written in its header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SignatureEncoding {
    /// Lower- or upper-case hex digits.
    #[default]
    Hex,
    /// Standard base64.
    Base64,
}

/// `auth.bearer`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BearerAuth {
    /// A file on every control plane host holding the token (one trailing
    /// newline dropped); read at each request. Never stored.
    pub token_file: String,
}

/// `dedup`: where a delivery's id is, and how long it is remembered.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebhookDedup {
    /// A request header (`X-GitHub-Delivery`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
    /// A field of the JSON body, a dotted path (`id`, `data.object.id`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body_field: Option<String>,
    /// How long a delivery id finds its run: `"24h"` (default), 1 second
    /// to 30 days; afterwards the same id makes a new run (a dedup key of
    /// its own, apart from the run: see [`crate::model::event::DedupClaim`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl: Option<String>,
}

/// Default dedup window: 24 hours.
pub const DEFAULT_DEDUP_TTL_SECONDS: u64 = 86_400;

fn check_ttl(field: &str, ttl: &str, p: &mut Vec<Error>) {
    match schedule::parse_duration(ttl) {
        Err(e) => p.push(Error::invalid(field, e)),
        Ok(s) if !(1..=30 * 86_400).contains(&s) => p.push(Error::invalid(field, format!("{ttl:?}: 1s to 30d"))),
        Ok(_) => {}
    }
}

fn check_file(field: &str, path: &str, p: &mut Vec<Error>) {
    if !path.starts_with('/') || path.len() > 4096 || path.contains('\0') {
        p.push(Error::invalid(field, format!("{path:?}: an absolute path of a file on the control plane hosts")));
    }
}

/// Whether `h` may be an HTTP header name (RFC 9110 token, at most 64).
pub fn header_name_ok(h: &str) -> bool {
    !h.is_empty() && h.len() <= 64 && h.bytes().all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// Checks a webhook path: `/hooks/` and segments of letters, digits,
/// `_ - . ~` (no empty, `.` or `..` segment), at most 200 characters.
pub fn check_hook_path(path: &str) -> std::result::Result<(), String> {
    let Some(rest) = path.strip_prefix("/hooks/") else {
        return Err(format!("{path:?} must start with /hooks/"));
    };
    if path.len() > 200 {
        return Err("at most 200 characters".into());
    }
    for seg in rest.split('/') {
        if seg.is_empty() || seg == "." || seg == ".." || !seg.chars().all(|c| c.is_ascii_alphanumeric() || "_-.~".contains(c)) {
            return Err(format!("{path:?}: segments of letters, digits, _ - . ~ after /hooks/ (no empty, . or .. segment)"));
        }
    }
    Ok(())
}

// ------------------------------------------------------------ queue

/// `{type: queue, broker, queue | subject + stream, format, max_pending,
/// prefetch, max_body_bytes, dedup}`: each message starts a run. The leader
/// consumes; a message is acknowledged once its run record (or SKIPPED
/// record) is committed — never when the run ends.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QueueTrigger {
    /// A broker of the control plane's config (`brokers:`).
    pub broker: String,
    /// RabbitMQ: the queue (it must exist; punchclock does not declare it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue: Option<String>,
    /// NATS JetStream: the subject consumed (wildcards allowed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subject: Option<String>,
    /// NATS JetStream: the stream holding `subject` (it must exist).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<String>,
    /// `json` (default: a body that is not JSON becomes a SKIPPED
    /// `invalid_event` record) or `raw` (any bytes; base64 when not JSON).
    #[serde(default)]
    pub format: EventFormat,
    /// Consumption pauses while the task has this many runs waiting
    /// (PENDING or RETRYING) and resumes below it; default 1,000; `1..=100000`.
    #[serde(default = "default_max_pending")]
    pub max_pending: u32,
    /// Messages held unacknowledged at once; default 100 (and at most
    /// `max_pending`); `1..=1000`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefetch: Option<u32>,
    /// A larger message becomes a SKIPPED `invalid_event` record; default
    /// and most 1 MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_body_bytes: Option<u64>,
    /// How long a message id finds its run (`{ttl: "24h"}`, the default):
    /// a message redelivered or published again with its id within the
    /// window makes no second run; afterwards it makes a new one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dedup: Option<DedupWindow>,
}

/// `dedup` of a queue trigger: how long a message id is remembered.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DedupWindow {
    /// `"24h"` (default), 1 second to 30 days.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl: Option<String>,
}

/// A dedup window given as a duration (`"2h"`; empty: the default, 24 h):
/// 1 second to 30 days, `field` named in the error. Used by the API's
/// `idempotency_ttl` of manual triggers and published events.
pub fn dedup_window(field: &str, ttl: &str) -> Result<chrono::Duration, Error> {
    if ttl.is_empty() {
        return Ok(chrono::Duration::seconds(DEFAULT_DEDUP_TTL_SECONDS as i64));
    }
    let mut p = Vec::new();
    check_ttl(field, ttl, &mut p);
    if let Some(e) = p.pop() {
        return Err(e);
    }
    Ok(chrono::Duration::seconds(schedule::parse_duration(ttl).map_err(|e| Error::invalid(field, e))? as i64))
}

fn default_max_pending() -> u32 {
    DEFAULT_MAX_PENDING
}

/// Default `max_pending` of a queue trigger.
pub const DEFAULT_MAX_PENDING: u32 = 1000;

/// What a queue trigger expects in a message body.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EventFormat {
    /// A JSON document.
    #[default]
    Json,
    /// Any bytes.
    Raw,
}

impl QueueTrigger {
    /// Messages held unacknowledged at once.
    pub fn prefetch(&self) -> u32 {
        self.prefetch.unwrap_or(100).min(self.max_pending).max(1)
    }

    /// The body limit in bytes.
    pub fn max_body(&self) -> u64 {
        self.max_body_bytes.unwrap_or(MAX_EVENT_BODY_BYTES)
    }

    /// Where its messages' ids are unique, in their run ids: the queue
    /// (`rabbit/reports`), or the stream whatever subject it filters on
    /// (`nats/DATA`), so a subject that changes finds the same runs.
    pub fn dedup_scope(&self) -> String {
        match (&self.queue, &self.stream) {
            (Some(q), _) => format!("{}/{q}", self.broker),
            (None, Some(st)) => format!("{}/{st}", self.broker),
            _ => self.broker.clone(),
        }
    }

    /// The dedup window in seconds.
    pub fn dedup_ttl_seconds(&self) -> u64 {
        dedup_window_seconds(self.dedup.as_ref().and_then(|d| d.ttl.as_deref()))
    }

    /// What it consumes, for logs and the event's `name`:
    /// `rabbit/reports`, `nats/DATA/data.updated`.
    pub fn source_name(&self) -> String {
        match (&self.queue, &self.stream, &self.subject) {
            (Some(q), _, _) => format!("{}/{q}", self.broker),
            (None, Some(st), Some(su)) => format!("{}/{st}/{su}", self.broker),
            _ => self.broker.clone(),
        }
    }

    fn problems(&self, path: &str, p: &mut Vec<Error>) {
        if let Err(e) = super::task::validate_id(&format!("{path}.broker"), &self.broker) {
            p.push(e);
        }
        let name_ok = |s: &str, extra: &str| {
            !s.is_empty() && s.len() <= 255 && s.chars().all(|c| c.is_ascii_alphanumeric() || "_-.:".contains(c) || extra.contains(c))
        };
        match (&self.queue, &self.subject, &self.stream) {
            (Some(q), None, None) => {
                if !name_ok(q, "") {
                    p.push(Error::invalid(format!("{path}.queue"), format!("{q:?}: 1 to 255 letters, digits, _ - . :")));
                }
            }
            (None, Some(su), Some(st)) => {
                if !name_ok(su, "*>") || su.split('.').any(str::is_empty) {
                    p.push(Error::invalid(format!("{path}.subject"), format!("{su:?} is not a NATS subject")));
                }
                if !name_ok(st, "") || st.contains('.') {
                    p.push(Error::invalid(format!("{path}.stream"), format!("{st:?}: 1 to 255 letters, digits, _ -")));
                }
            }
            _ => p.push(Error::invalid(path, "give queue (RabbitMQ) or subject and stream (NATS JetStream)")),
        }
        if !(1..=100_000).contains(&self.max_pending) {
            p.push(Error::invalid(format!("{path}.max_pending"), "must be in 1..=100000"));
        }
        if let Some(n) = self.prefetch
            && !(1..=1000).contains(&n)
        {
            p.push(Error::invalid(format!("{path}.prefetch"), "must be in 1..=1000"));
        }
        if let Some(n) = self.max_body_bytes
            && !(1..=MAX_EVENT_BODY_BYTES).contains(&n)
        {
            p.push(Error::invalid(format!("{path}.max_body_bytes"), format!("must be in 1..={MAX_EVENT_BODY_BYTES} (1 MiB)")));
        }
        if let Some(ttl) = self.dedup.as_ref().and_then(|d| d.ttl.as_ref()) {
            check_ttl(&format!("{path}.dedup.ttl"), ttl, p);
        }
    }
}

// ------------------------------------------------------------ event, after

/// `{type: event, topic}`: every event published on `topic` starts a run,
/// exactly one per idempotency key.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventTrigger {
    /// 1 to 128 letters, digits, `_ - .` (`data.updated`).
    pub topic: String,
}

/// `{type: after, task, status}`: a run of this task follows each run of
/// `task` that ends; the edge lives on this (the following) task only.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AfterTrigger {
    /// The task followed.
    pub task: String,
    /// Which ends start a run (`succeeded`, default; `failed`; `any`);
    /// another end leaves a SKIPPED `upstream_unmet` record.
    #[serde(default)]
    pub status: AfterStatus,
}

/// Which ends of the followed task's runs start a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AfterStatus {
    /// SUCCEEDED.
    #[default]
    Succeeded,
    /// FAILED or TIMEOUT.
    Failed,
    /// Any end: SUCCEEDED, FAILED, TIMEOUT or CANCELLED.
    Any,
}

impl AfterStatus {
    /// Whether a run of the followed task ending `status` starts a run.
    pub fn matches(self, status: RunStatus) -> bool {
        match self {
            AfterStatus::Succeeded => status == RunStatus::Succeeded,
            AfterStatus::Failed => matches!(status, RunStatus::Failed | RunStatus::Timeout),
            AfterStatus::Any => status.is_terminal() && status != RunStatus::Skipped,
        }
    }

    /// Lower-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            AfterStatus::Succeeded => "succeeded",
            AfterStatus::Failed => "failed",
            AfterStatus::Any => "any",
        }
    }
}

// ------------------------------------------------------------ across tasks

/// A problem of a definition found against the other tasks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CrossProblem {
    /// The applied task.
    pub task_id: String,
    /// Its field (`trigger.path`, `triggers[1].task`).
    pub field: String,
    /// Why.
    pub reason: String,
}

/// The rules that need every task: one task per webhook path; no cycle of
/// `after` triggers (named: `a → b → a`, each following the one before);
/// at most `max_followers` tasks follow one task. `applied` replace the
/// stored tasks of the same id.
pub fn check_across<'a>(
    applied: &[&'a super::task::TaskSpec],
    stored: impl IntoIterator<Item = &'a super::task::TaskSpec>,
    max_followers: usize,
) -> Vec<CrossProblem> {
    use std::collections::{BTreeMap, BTreeSet};
    let mut all: BTreeMap<&str, &super::task::TaskSpec> = stored.into_iter().map(|s| (s.task_id.as_str(), s)).collect();
    for s in applied {
        all.insert(s.task_id.as_str(), s);
    }
    let mut problems = Vec::new();
    let path_of = |spec: &super::task::TaskSpec, pred: &dyn Fn(&TriggerSpec) -> bool| {
        spec.all_triggers().iter().position(|t| pred(t)).map(|i| spec.trigger_path(i)).unwrap_or_else(|| "triggers".into())
    };
    // Webhook paths: a path a stored task (not replaced by this apply)
    // claims is its; among the applied, the first in the file keeps it.
    let applied_ids: BTreeSet<&str> = applied.iter().map(|s| s.task_id.as_str()).collect();
    let mut owner: BTreeMap<&str, &str> = BTreeMap::new();
    for (id, spec) in &all {
        if applied_ids.contains(id) {
            continue;
        }
        for w in spec.webhooks() {
            owner.entry(w.path.as_str()).or_insert(id);
        }
    }
    for spec in applied {
        for w in spec.webhooks() {
            match owner.get(w.path.as_str()) {
                Some(other) if *other != spec.task_id => problems.push(CrossProblem {
                    task_id: spec.task_id.clone(),
                    field: format!("{}.path", path_of(spec, &|t| matches!(t, TriggerSpec::Webhook(x) if x.path == w.path))),
                    reason: format!("{} is task {other:?}'s webhook already: one task per path", w.path),
                }),
                Some(_) => {}
                None => {
                    owner.insert(w.path.as_str(), spec.task_id.as_str());
                }
            }
        }
    }
    // Followers per task, and cycles (B after A: an edge A → B).
    let mut followers: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for (id, spec) in &all {
        for a in spec.follows() {
            followers.entry(a.task.as_str()).or_default().insert(id);
        }
    }
    for spec in applied {
        for a in spec.follows() {
            let n = followers.get(a.task.as_str()).map_or(0, BTreeSet::len);
            if n > max_followers {
                problems.push(CrossProblem {
                    task_id: spec.task_id.clone(),
                    field: format!("{}.task", path_of(spec, &|t| matches!(t, TriggerSpec::After(x) if x.task == a.task))),
                    reason: format!("{n} tasks would follow {:?}; at most {max_followers} may", a.task),
                });
            }
        }
        // A path from this task along follower edges back to itself.
        let start = spec.task_id.as_str();
        let mut stack: Vec<(&str, Vec<&str>)> = vec![(start, vec![start])];
        let mut seen: BTreeSet<&str> = BTreeSet::new();
        while let Some((node, path)) = stack.pop() {
            for next in followers.get(node).into_iter().flatten() {
                if *next == start {
                    let mut cycle = path.clone();
                    cycle.push(start);
                    let upstream = path.last().copied().unwrap_or(start);
                    problems.push(CrossProblem {
                        task_id: spec.task_id.clone(),
                        field: format!(
                            "{}.task",
                            path_of(all.get(start).copied().unwrap_or(spec), &|t| matches!(t, TriggerSpec::After(x) if x.task == upstream))
                        ),
                        reason: format!("a cycle of after triggers: {} (each follows the one before)", cycle.join(" → ")),
                    });
                    stack.clear();
                    break;
                }
                if seen.insert(next) {
                    let mut p = path.clone();
                    p.push(next);
                    stack.push((next, p));
                }
            }
        }
    }
    problems
}

// ------------------------------------------------------------ parsing

/// Separates a nested field path from its message inside a serde error.
pub(crate) const PATH_MARK: char = '\u{1}';

const TYPES: &str = "cron, interval, once, webhook, queue, event or after";

impl<'de> Deserialize<'de> for TriggerSpec {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        use serde::de::Error as _;
        let v = serde_json::Value::deserialize(d)?;
        let serde_json::Value::Object(mut obj) = v else {
            return Err(D::Error::custom(format!("must be an object with a \"type\" ({TYPES})")));
        };
        let ty = match obj.remove("type") {
            Some(serde_json::Value::String(t)) => t,
            Some(_) => return Err(D::Error::custom(format!("{PATH_MARK}type{PATH_MARK}must be a string"))),
            None => return Err(D::Error::custom(format!("{PATH_MARK}type{PATH_MARK}missing ({TYPES})"))),
        };
        fn inner<T: serde::de::DeserializeOwned>(obj: serde_json::Map<String, serde_json::Value>) -> std::result::Result<T, String> {
            serde_path_to_error::deserialize(serde_json::Value::Object(obj)).map_err(|e| {
                let path = e.path().to_string();
                let mut msg = super::task::clean_serde_message(&e.inner().to_string());
                // chrono's "input contains invalid characters" does not say
                // what it wanted.
                if matches!(path.as_str(), "at" | "start_at") {
                    msg = format!("{msg}; expected an RFC 3339 instant such as \"2026-12-01T08:30:00Z\" or \"2026-12-01T16:30:00+08:00\"");
                }
                if path == "." { msg } else { format!("{PATH_MARK}{path}{PATH_MARK}{msg}") }
            })
        }
        let r = match ty.as_str() {
            "cron" => inner(obj).map(TriggerSpec::Cron),
            "interval" => inner(obj).map(TriggerSpec::Interval),
            "once" => inner(obj).map(TriggerSpec::Once),
            "webhook" => inner(obj).map(TriggerSpec::Webhook),
            // The founding document's `{type: queue, topic}` (no broker) is
            // a published event's topic.
            "queue" if obj.contains_key("topic") && !obj.contains_key("broker") => inner(obj).map(TriggerSpec::Event),
            "queue" => inner(obj).map(TriggerSpec::Queue),
            "event" => inner(obj).map(TriggerSpec::Event),
            "after" => inner(obj).map(TriggerSpec::After),
            other => Err(format!("{PATH_MARK}type{PATH_MARK}unknown trigger type {other:?} ({TYPES})")),
        };
        r.map_err(D::Error::custom)
    }
}

/// A trigger's `dedup.ttl` in seconds ([`DEFAULT_DEDUP_TTL_SECONDS`] when
/// unset; checked when the task was applied).
fn dedup_window_seconds(ttl: Option<&str>) -> u64 {
    ttl.and_then(|t| schedule::parse_duration(t).ok()).unwrap_or(DEFAULT_DEDUP_TTL_SECONDS)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(v: serde_json::Value) -> std::result::Result<TriggerSpec, String> {
        serde_json::from_value(v).map_err(|e| e.to_string().replace(PATH_MARK, "|"))
    }

    #[test]
    fn every_kind_parses_and_round_trips() {
        for v in [
            serde_json::json!({"type": "cron", "expr": "0 8 * * *", "timezone": "Asia/Shanghai"}),
            serde_json::json!({"type": "webhook", "path": "/hooks/gh", "auth": {"hmac": {"secret_file": "/etc/s", "header": "X-Hub-Signature-256", "prefix": "sha256="}}, "dedup": {"header": "X-GitHub-Delivery"}}),
            serde_json::json!({"type": "webhook", "path": "/hooks/open", "auth": "none"}),
            serde_json::json!({"type": "queue", "broker": "rabbit", "queue": "reports"}),
            serde_json::json!({"type": "queue", "broker": "nats", "subject": "data.>", "stream": "DATA", "format": "raw"}),
            serde_json::json!({"type": "event", "topic": "data.updated"}),
            serde_json::json!({"type": "after", "task": "a", "status": "any"}),
        ] {
            let t = parse(v.clone()).expect("parses");
            assert!(t.problems("trigger").is_empty(), "{v}: {:?}", t.problems("trigger"));
            let back = serde_json::to_value(&t).expect("serializes");
            assert_eq!(parse(back).expect("again"), t);
        }
        // The founding document's spelling of a published topic.
        assert_eq!(
            parse(serde_json::json!({"type": "queue", "topic": "x"})).expect("alias"),
            TriggerSpec::Event(EventTrigger { topic: "x".into() })
        );
    }

    #[test]
    fn bad_event_triggers_name_the_field() {
        let fields = |v: serde_json::Value| -> Vec<String> {
            parse(v)
                .expect("parses")
                .problems("trigger")
                .into_iter()
                .map(|e| match e {
                    Error::InvalidArgument { field, .. } => field,
                    other => other.to_string(),
                })
                .collect()
        };
        assert_eq!(fields(serde_json::json!({"type": "webhook", "path": "/other", "auth": "none"})), vec!["trigger.path"]);
        assert_eq!(fields(serde_json::json!({"type": "webhook", "path": "/hooks/../x", "auth": "none"})), vec!["trigger.path"]);
        assert_eq!(
            fields(serde_json::json!({"type": "webhook", "path": "/hooks/x", "auth": {"hmac": {"secret_file": "rel", "header": "X"}}})),
            vec!["trigger.auth.hmac.secret_file"]
        );
        assert_eq!(
            fields(serde_json::json!({"type": "webhook", "path": "/hooks/x", "auth": "none", "dedup": {"header": "a", "body_field": "b"}})),
            vec!["trigger.dedup"]
        );
        assert_eq!(
            fields(serde_json::json!({"type": "webhook", "path": "/hooks/x", "auth": "none", "headers": ["Authorization"]})),
            vec!["trigger.headers[0]"]
        );
        assert_eq!(
            fields(serde_json::json!({"type": "webhook", "path": "/hooks/x", "auth": "none", "max_body_bytes": 2_000_000})),
            vec!["trigger.max_body_bytes"]
        );
        assert_eq!(fields(serde_json::json!({"type": "queue", "broker": "r"})), vec!["trigger"]);
        assert_eq!(
            fields(serde_json::json!({"type": "queue", "broker": "r", "queue": "q", "dedup": {"ttl": "31d"}})),
            vec!["trigger.dedup.ttl"]
        );
        assert!(fields(serde_json::json!({"type": "queue", "broker": "r", "queue": "q", "dedup": {"ttl": "30d"}})).is_empty());
        assert_eq!(super::dedup_window("idempotency_ttl", "").expect("default"), chrono::Duration::hours(24));
        assert!(
            matches!(super::dedup_window("idempotency_ttl", "0s"), Err(Error::InvalidArgument { field, .. }) if field == "idempotency_ttl")
        );
        assert_eq!(
            fields(serde_json::json!({"type": "queue", "broker": "r", "queue": "q", "max_pending": 0})),
            vec!["trigger.max_pending"]
        );
        assert_eq!(fields(serde_json::json!({"type": "after", "task": "a b"})), vec!["trigger.task"]);
        let e = parse(serde_json::json!({"type": "webhook", "path": "/hooks/x"})).expect_err("auth is required");
        assert!(e.contains("auth"), "{e}");
        let e = parse(serde_json::json!({"type": "weekly"})).expect_err("unknown");
        assert!(e.contains("webhook, queue, event or after"), "{e}");
    }

    #[test]
    fn cycles_paths_and_fan_out_are_checked_across_tasks() {
        let t = |id: &str, triggers: serde_json::Value| {
            super::super::task::TaskSpec::from_json(&serde_json::json!({"task_id": id, "agent_id": "ag", "triggers": triggers}).to_string())
                .expect("spec")
        };
        let a = t("a", serde_json::json!([{"type": "after", "task": "c"}]));
        let b = t("b", serde_json::json!([{"type": "after", "task": "a"}]));
        let c = t("c", serde_json::json!([{"type": "cron", "expr": "* * * * *"}, {"type": "after", "task": "b"}]));
        let p = check_across(&[&c], [&a, &b], 16);
        assert_eq!(p.len(), 1, "{p:?}");
        assert_eq!(p[0].field, "triggers[1].task");
        assert!(p[0].reason.contains("c → a → b → c"), "{}", p[0].reason);
        let c_ok = t("c", serde_json::json!([{"type": "after", "task": "x"}]));
        assert!(check_across(&[&c_ok], [&a, &b], 16).is_empty());
        let hook = |id: &str| t(id, serde_json::json!([{"type": "webhook", "path": "/hooks/same", "auth": "none"}]));
        let (h1, h2) = (hook("h1"), hook("h2"));
        let p = check_across(&[&h2], [&h1], 16);
        assert_eq!((p[0].field.as_str(), p[0].task_id.as_str()), ("triggers[0].path", "h2"));
        assert!(check_across(&[&h1], [&h1], 16).is_empty(), "re-applying the owner is fine");
        let p = check_across(&[&h1, &h2], [], 16);
        assert_eq!(p.len(), 1, "two in one file: the second is refused: {p:?}");
        assert_eq!(p[0].task_id, "h2");
        let p = check_across(&[&h2, &h1], [], 16);
        assert_eq!(p[0].task_id, "h1", "the first in the file keeps it, whatever the ids");
        // Found by a walkthrough: a task whose id sorts first took a stored
        // task's path (and its requests, bypassing its auth).
        let a0 = hook("a0");
        let p = check_across(&[&a0], [&h1], 16);
        assert_eq!((p.len(), p[0].task_id.as_str()), (1, "a0"), "{p:?}");
        let fans: Vec<_> = (0..3).map(|i| t(&format!("f{i}"), serde_json::json!([{"type": "after", "task": "a"}]))).collect();
        let refs: Vec<&_> = fans.iter().collect();
        assert_eq!(check_across(&refs, [], 2).len(), 3);
    }

    /// Found by an attack: two after triggers on one upstream make one run
    /// id, so the second could never start a run.
    #[test]
    fn one_upstream_is_followed_once_per_task() {
        let spec = |triggers: serde_json::Value| {
            super::super::task::TaskSpec::from_json(
                &serde_json::json!({"task_id": "b", "agent_id": "ag", "triggers": triggers}).to_string(),
            )
        };
        let twice = spec(serde_json::json!([{"type": "after", "task": "a"}, {"type": "after", "task": "a", "status": "failed"}]));
        let e = twice.expect_err("refused").to_string();
        assert!(e.contains("triggers[1].task") && e.contains("triggers[0]") && e.contains("status: any"), "{e}");
        assert!(spec(serde_json::json!([{"type": "after", "task": "a"}, {"type": "after", "task": "c"}])).is_ok());
    }

    #[test]
    fn after_status_matches_ends() {
        use RunStatus::*;
        assert!(AfterStatus::Succeeded.matches(Succeeded) && !AfterStatus::Succeeded.matches(Failed));
        assert!(AfterStatus::Failed.matches(Failed) && AfterStatus::Failed.matches(Timeout) && !AfterStatus::Failed.matches(Cancelled));
        assert!(AfterStatus::Any.matches(Cancelled) && !AfterStatus::Any.matches(Skipped) && !AfterStatus::Any.matches(Running));
    }
}
