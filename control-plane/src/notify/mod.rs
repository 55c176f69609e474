//! Notification delivery: the `notifications:` and `sinks:` sections of
//! the control plane's config file ([`crate::config`]: named `webhook://`
//! sinks and delivery settings), request signing, and the leader's
//! delivery worker ([`deliver`]).
//!
//! The engine writes each notification to the outbox in the same
//! transaction as the run state it reports
//! ([`crate::model::notification`]); the leader's worker POSTs it, retries
//! failures with exponential backoff and jitter, dead-letters it after
//! `max_attempts`, and records each outcome with a fenced write, so a new
//! leader resumes where the last one stopped. A receiver sees a repeat only
//! when its acknowledgement was lost (the leader died between the answer
//! and its write), and then with the same `Punchclock-Notification-Id`.
//!
//! The signature follows Stripe's scheme: `Punchclock-Signature:
//! t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>.<body>")>`.

pub mod deliver;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use crate::error::{Error, Result};

/// `notifications:` of the config file:
///
/// ```yaml
/// notifications:
///   max_attempts: 10          # then dead-lettered
///   retry_base_seconds: 1     # delay before retry k: min(base * 2^(k-1), cap) + up to 25% jitter
///   retry_cap_seconds: 300
///   timeout_seconds: 10       # per request, unless the sink says
///   concurrency: 8            # requests in flight
///   secret_file: /etc/punchclock/notify-secret   # signs direct http(s):// sinks
/// sinks:
///   report-sink:
///     url: https://reports.example.com/hooks/punchclock
///     secret_file: /etc/punchclock/report-sink-secret
///     headers: {X-Team: data}
///     timeout_seconds: 5
/// ```
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Settings {
    /// Delivery attempts before a notification is dead-lettered; `1..=100`, default 10.
    pub max_attempts: u32,
    /// Seconds; default 1.
    pub retry_base_seconds: f64,
    /// Seconds; default 300.
    pub retry_cap_seconds: f64,
    /// Seconds per request unless the sink sets its own; `1..=300`, default 10.
    pub timeout_seconds: u64,
    /// Requests in flight at once; `1..=256`, default 8.
    pub concurrency: usize,
    /// Of those, to one sink; `1..=concurrency`, default 2 (a slow sink
    /// does not hold up the others).
    pub per_sink_concurrency: usize,
    /// Notifications waiting for one sink before new ones for it are
    /// dead-lettered at once (a sink that hangs cannot grow the outbox
    /// without bound); `1..=1,000,000`, default 10,000.
    pub max_pending_per_sink: usize,
    /// Signs requests to direct `http(s)://` sinks.
    pub secret: Option<String>,
    /// The same, read from a file (trailing newline dropped).
    pub secret_file: Option<PathBuf>,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            max_attempts: 10,
            retry_base_seconds: 1.0,
            retry_cap_seconds: 300.0,
            timeout_seconds: 10,
            concurrency: 8,
            per_sink_concurrency: 2,
            max_pending_per_sink: 10_000,
            secret: None,
            secret_file: None,
        }
    }
}

/// One named sink.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SinkConfig {
    /// `http://` or `https://` URL.
    pub url: String,
    /// HMAC secret for `Punchclock-Signature`.
    #[serde(default)]
    pub secret: Option<String>,
    /// The same, read from a file (trailing newline dropped).
    #[serde(default)]
    pub secret_file: Option<PathBuf>,
    /// Extra request headers.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// Seconds per request (default: `notifications.timeout_seconds`).
    #[serde(default)]
    pub timeout_seconds: Option<u64>,
}

/// Where and how one notification is sent, resolved from its sink.
#[derive(Debug, Clone)]
pub struct Target {
    /// URL.
    pub url: reqwest::Url,
    /// Signing secret.
    pub secret: Option<String>,
    /// Extra headers.
    pub headers: Vec<(reqwest::header::HeaderName, reqwest::header::HeaderValue)>,
    /// Request timeout.
    pub timeout: Duration,
}

/// The validated configuration the notifier works with.
#[derive(Debug, Clone)]
pub struct NotifyConfig {
    /// Attempts before dead-lettering.
    pub max_attempts: u32,
    /// Backoff base.
    pub retry_base: Duration,
    /// Backoff cap.
    pub retry_cap: Duration,
    /// Requests in flight.
    pub concurrency: usize,
    /// Requests in flight to one sink.
    pub per_sink_concurrency: usize,
    /// Pending notifications per sink before new ones are dead-lettered.
    pub max_pending_per_sink: usize,
    default_timeout: Duration,
    default_secret: Option<String>,
    sinks: BTreeMap<String, Target>,
}

impl Default for NotifyConfig {
    fn default() -> Self {
        NotifyConfig::from_sections(&Settings::default(), &BTreeMap::new()).expect("defaults are valid")
    }
}

fn read_secret(field: &str, inline: &Option<String>, file: &Option<PathBuf>) -> Result<Option<String>> {
    let secret = match (inline, file) {
        (Some(_), Some(_)) => return Err(Error::invalid(field, "give secret or secret_file, not both")),
        (Some(s), None) => s.clone(),
        (None, Some(p)) => std::fs::read_to_string(p)
            .map(|s| s.trim_end_matches(['\n', '\r']).to_string())
            .map_err(|e| Error::invalid(format!("{field}_file"), format!("cannot read {}: {e}", p.display())))?,
        (None, None) => return Ok(None),
    };
    if secret.is_empty() {
        let which = if inline.is_some() { field.to_string() } else { format!("{field}_file") };
        return Err(Error::invalid(which, "is empty: an empty key signs nothing"));
    }
    Ok(Some(secret))
}

/// Headers a sink's `headers` may not set: punchclock sets them.
const RESERVED_HEADERS: [&str; 6] =
    ["content-type", "content-length", "idempotency-key", "punchclock-signature", "punchclock-notification-id", "punchclock-event"];

/// A sink for logs and listings: a `webhook://NAME` as is; a URL without
/// its user info, path and query (they often hold tokens, as Slack's
/// webhook URLs do): `https://hooks.example.com/…`.
pub fn redact_sink(sink: &str) -> String {
    if sink.starts_with("webhook://") {
        return sink.to_string();
    }
    match reqwest::Url::parse(sink) {
        Ok(u) => {
            let host = u.host_str().unwrap_or("?");
            let port = u.port().map(|p| format!(":{p}")).unwrap_or_default();
            let more = if u.path() != "/" || u.query().is_some() { "/…" } else { "/" };
            format!("{}://{host}{port}{more}", u.scheme())
        }
        Err(_) => "(malformed URL)".to_string(),
    }
}

impl NotifyConfig {
    /// Validates the `notifications:` and `sinks:` sections of the config
    /// file ([`crate::config`]).
    ///
    /// Errors: `InvalidArgument` naming the field (`sinks.alert.url`,
    /// `notifications.max_attempts`).
    pub fn from_sections(n: &Settings, sink_specs: &BTreeMap<String, SinkConfig>) -> Result<NotifyConfig> {
        if !(1..=100).contains(&n.max_attempts) {
            return Err(Error::invalid("notifications.max_attempts", format!("must be in 1..=100 (got {})", n.max_attempts)));
        }
        for (name, v) in [("retry_base_seconds", n.retry_base_seconds), ("retry_cap_seconds", n.retry_cap_seconds)] {
            if !v.is_finite() || !(0.01..=86_400.0).contains(&v) {
                return Err(Error::invalid(format!("notifications.{name}"), "must be a number of seconds in 0.01..=86400"));
            }
        }
        if n.retry_cap_seconds < n.retry_base_seconds {
            return Err(Error::invalid("notifications.retry_cap_seconds", "must be >= retry_base_seconds"));
        }
        if !(1..=300).contains(&n.timeout_seconds) {
            return Err(Error::invalid("notifications.timeout_seconds", "must be in 1..=300"));
        }
        if !(1..=256).contains(&n.concurrency) {
            return Err(Error::invalid("notifications.concurrency", "must be in 1..=256"));
        }
        if !(1..=n.concurrency).contains(&n.per_sink_concurrency) {
            return Err(Error::invalid("notifications.per_sink_concurrency", format!("must be in 1..={} (concurrency)", n.concurrency)));
        }
        if !(1..=1_000_000).contains(&n.max_pending_per_sink) {
            return Err(Error::invalid("notifications.max_pending_per_sink", "must be in 1..=1000000"));
        }
        let default_secret = read_secret("notifications.secret", &n.secret, &n.secret_file)?;
        let default_timeout = Duration::from_secs(n.timeout_seconds);
        let mut sinks = BTreeMap::new();
        for (name, s) in sink_specs {
            crate::model::task::validate_id(&format!("sinks.{name}"), name)?;
            let field = |f: &str| format!("sinks.{name}.{f}");
            let url = reqwest::Url::parse(&s.url).map_err(|e| Error::invalid(field("url"), format!("{:?} is not a URL: {e}", s.url)))?;
            if !matches!(url.scheme(), "http" | "https") {
                return Err(Error::invalid(field("url"), "must be http:// or https://"));
            }
            let secret = read_secret(&field("secret"), &s.secret, &s.secret_file)?;
            let mut headers = Vec::new();
            for (k, v) in &s.headers {
                let header = reqwest::header::HeaderName::from_bytes(k.as_bytes())
                    .map_err(|_| Error::invalid(field(&format!("headers.{k}")), "is not a valid header name"))?;
                if RESERVED_HEADERS.contains(&header.as_str()) {
                    return Err(Error::invalid(field(&format!("headers.{k}")), "is set by punchclock and cannot be configured"));
                }
                let value = reqwest::header::HeaderValue::from_str(v)
                    .map_err(|_| Error::invalid(field(&format!("headers.{k}")), "is not a valid header value"))?;
                headers.push((header, value));
            }
            let timeout = match s.timeout_seconds {
                Some(t) if (1..=300).contains(&t) => Duration::from_secs(t),
                Some(_) => return Err(Error::invalid(field("timeout_seconds"), "must be in 1..=300")),
                None => default_timeout,
            };
            sinks.insert(name.clone(), Target { url, secret, headers, timeout });
        }
        Ok(NotifyConfig {
            max_attempts: n.max_attempts,
            retry_base: Duration::from_secs_f64(n.retry_base_seconds),
            retry_cap: Duration::from_secs_f64(n.retry_cap_seconds),
            concurrency: n.concurrency,
            per_sink_concurrency: n.per_sink_concurrency,
            max_pending_per_sink: n.max_pending_per_sink,
            default_timeout,
            default_secret,
            sinks,
        })
    }

    /// Whether `webhook://NAME` names a configured sink.
    pub fn has_sink(&self, name: &str) -> bool {
        self.sinks.contains_key(name)
    }

    /// Where a task's sink string sends.
    ///
    /// Errors: `FailedPrecondition` for a `webhook://NAME` not in the
    /// config file, `InvalidArgument` for a malformed URL.
    pub fn target(&self, sink: &str) -> Result<Target> {
        if let Some(name) = sink.strip_prefix("webhook://") {
            return self.sinks.get(name).cloned().ok_or_else(|| {
                Error::FailedPrecondition(format!("sink webhook://{name} is not defined in the control plane's --config file"))
            });
        }
        let url = reqwest::Url::parse(sink).map_err(|e| Error::invalid("sink", format!("{}: {e}", redact_sink(sink))))?;
        Ok(Target { url, secret: self.default_secret.clone(), headers: Vec::new(), timeout: self.default_timeout })
    }

    /// Delay before delivery attempt `attempts + 1` after `attempts`
    /// failed ones: `min(base * 2^(attempts-1), cap)` plus up to 25% of it
    /// at random.
    pub fn backoff(&self, attempts: u32) -> Duration {
        let exp = 2f64.powi(attempts.saturating_sub(1).min(60) as i32);
        let d = (self.retry_base.as_secs_f64() * exp).min(self.retry_cap.as_secs_f64());
        Duration::from_secs_f64(d + d * 0.25 * rand::random::<f64>())
    }
}

/// `Punchclock-Signature` for `body` at `unix_seconds`: `t=…,v1=…`
/// (HMAC-SHA256 over `"{t}.{body}"`, hex): the one scheme, shared with the
/// runner's HTTP agents ([`punchclock_proto::signature`]).
pub fn signature(secret: &str, unix_seconds: i64, body: &[u8]) -> String {
    punchclock_proto::signature::sign(secret, unix_seconds, body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use hmac::{Hmac, Mac};
    use sha2::Sha256;

    #[test]
    fn signature_is_hmac_sha256_of_timestamp_and_body() {
        // RFC 4231 test case 2 key/data, framed as "t.body".
        let s = signature("Jefe", 1, b"hello");
        let mut mac = Hmac::<Sha256>::new_from_slice(b"Jefe").unwrap();
        mac.update(b"1.hello");
        assert_eq!(s, format!("t=1,v1={}", hex::encode(mac.finalize().into_bytes())));
        assert_eq!(s.len(), "t=1,v1=".len() + 64);
    }

    #[test]
    fn config_errors_name_the_field() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.yaml");
        let load = |text: &str| {
            std::fs::write(&p, text).unwrap();
            crate::config::Config::load(&p).map(|c| c.notify)
        };
        let err = |text: &str| load(text).expect_err("invalid").to_string();
        assert!(err("sinks:\n  a:\n    url: ftp://x\n").starts_with("sinks.a.url"), "{}", err("sinks:\n  a:\n    url: ftp://x\n"));
        assert!(err("notifications:\n  max_attempts: 0\n").starts_with("notifications.max_attempts"));
        assert!(err("sinks:\n  a:\n    url: http://x\n    sekret: y\n").contains("sekret"));
        assert!(err("sinks:\n  a:\n    url: http://x\n    secret_file: /nonexistent/s\n").starts_with("sinks.a.secret_file"));
        assert!(err("sinks:\n  a:\n    url: http://x\n    headers: {X-Ok: \"bad\\nvalue\"}\n").starts_with("sinks.a.headers.X-Ok"));
        assert!(err("sinks:\n  a:\n    url: http://x\n    headers: {Punchclock-Signature: x}\n").contains("set by punchclock"));
        assert!(err("sinks:\n  a:\n    url: http://x\n    secret: \"\"\n").starts_with("sinks.a.secret: is empty"));
        assert!(err("notifications:\n  retry_base_seconds: 0\n").starts_with("notifications.retry_base_seconds"));
        let e = err("notifications:\n  timeout_seconds: abc\n");
        assert!(e.starts_with("notifications.timeout_seconds: ") && !e.contains("timeout_seconds: notifications"), "{e}");
        assert_eq!(redact_sink("https://u:p@hooks.example.com:8443/services/T0/B0/XX?token=1"), "https://hooks.example.com:8443/…");
        assert_eq!(redact_sink("webhook://alert"), "webhook://alert");
        let c = load("notifications:\n  retry_base_seconds: 2\n  retry_cap_seconds: 5\nsinks:\n  a:\n    url: http://x/h\n    secret: s\n")
            .unwrap();
        assert!(c.has_sink("a"));
        assert_eq!(c.target("webhook://a").unwrap().secret.as_deref(), Some("s"));
        assert!(c.target("webhook://b").is_err());
        let d = c.backoff(3);
        assert!(d >= Duration::from_secs(5) && d <= Duration::from_secs_f64(6.25), "{d:?}");
    }
}
