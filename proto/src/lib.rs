//! Generated code for the `punchclock.v1` gRPC API (tonic + prost), and the
//! one conversion between protobuf timestamps and UTC instants.
//!
//! The `.proto` source is `proto/punchclock/v1/punchclock.proto`.

/// `punchclock.v1`: task, run, runner and cluster services.
#[allow(clippy::all, missing_docs)]
pub mod v1 {
    tonic::include_proto!("punchclock.v1");

    /// Encoded `FileDescriptorSet` of the API, for gRPC reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("punchclock_descriptor");
}

pub use v1::*;

/// Runner labels that a runner measures rather than claims.
pub mod labels {
    /// What the runner can limit: `v2`, `v1` or `none` (issue 22; set by
    /// the runner from its host unless its operator set the label).
    pub const CGROUP: &str = "cgroup";

    /// The capability labels: a runner reports them from what its host
    /// has, so a token's or certificate's label binding does not have to
    /// list them (issue 19's binding is about labels that route tasks to
    /// a runner by trust, like `zone=secure`). A binding that does name
    /// one still holds the runner to its value.
    pub const CAPABILITIES: &[&str] = &[CGROUP];

    /// Whether `key` is a capability label.
    pub fn is_capability(key: &str) -> bool {
        CAPABILITIES.contains(&key)
    }
}

/// Shared resources (the cluster configuration's `resources:`), as both
/// sides name them: the control plane's configuration and an agents file's
/// `rate_limit_resource` follow one rule.
pub mod resources {
    /// The rule [`is_valid_name`] checks, for error messages.
    pub const NAME_RULE: &str = "a resource name is 1 to 64 letters, digits, _ - .";

    /// Whether `name` can name a resource: 1 to 64 ASCII letters, digits,
    /// `_`, `-` and `.`.
    pub fn is_valid_name(name: &str) -> bool {
        !name.is_empty() && name.len() <= 64 && name.chars().all(|c| c.is_ascii_alphanumeric() || "_-.".contains(c))
    }
}

/// `google.protobuf.Timestamp` ⇄ `chrono::DateTime<Utc>`: the only place
/// either side of the wire converts instants.
pub mod time {
    use chrono::{DateTime, Utc};
    use prost_types::Timestamp;

    /// UTC instant → protobuf timestamp.
    pub fn to_timestamp(t: DateTime<Utc>) -> Timestamp {
        // Sub-second nanos are always < 2e9 (leap seconds included): they fit.
        Timestamp { seconds: t.timestamp(), nanos: i32::try_from(t.timestamp_subsec_nanos()).unwrap_or(i32::MAX) }
    }

    /// Optional instant → optional timestamp.
    pub fn to_timestamp_opt(t: Option<DateTime<Utc>>) -> Option<Timestamp> {
        t.map(to_timestamp)
    }

    /// Protobuf timestamp → UTC instant; `None` when malformed: nanos
    /// outside 0..=999,999,999, or seconds outside 0001-01-01 ..=
    /// 9999-12-31 (the range `google.protobuf.Timestamp` defines).
    pub fn from_timestamp(ts: &Timestamp) -> Option<DateTime<Utc>> {
        const MIN_SECONDS: i64 = -62_135_596_800;
        const MAX_SECONDS: i64 = 253_402_300_799;
        if !(0..1_000_000_000).contains(&ts.nanos) || !(MIN_SECONDS..=MAX_SECONDS).contains(&ts.seconds) {
            return None;
        }
        DateTime::from_timestamp(ts.seconds, u32::try_from(ts.nanos).ok()?)
    }

    /// [`from_timestamp`] of an optional field.
    pub fn from_timestamp_opt(ts: Option<&Timestamp>) -> Option<DateTime<Utc>> {
        ts.and_then(from_timestamp)
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn round_trip_and_malformed() {
            let t = DateTime::from_timestamp(1_700_000_000, 250_000_000).expect("valid instant");
            assert_eq!(from_timestamp(&to_timestamp(t)), Some(t));
            assert_eq!(from_timestamp(&Timestamp { seconds: 0, nanos: -1 }), None);
            assert_eq!(from_timestamp(&Timestamp { seconds: i64::MAX, nanos: 0 }), None);
            assert_eq!(from_timestamp(&Timestamp { seconds: 1_700_000_000, nanos: 1_000_000_000 }), None, "a leap second's nanos");
            assert_eq!(from_timestamp(&Timestamp { seconds: -62_135_596_801, nanos: 0 }), None, "year 0");
        }
    }
}

/// Output tails on the wire (`Finished.stdout_tail`/`stderr_tail`): the
/// end of an agent's output, bounded, saying how much was cut before it.
pub mod output {
    /// The end of `text`, at most `max` bytes of UTF-8. When `cut` earlier
    /// bytes were already dropped, or `text` itself is longer than `max`,
    /// it starts with `[trimmed: N earlier bytes not kept] ` (N counts
    /// both) and keeps the last characters that fit after that marker.
    pub fn tail(text: &str, cut: u64, max: usize) -> String {
        if cut == 0 && text.len() <= max {
            return text.to_string();
        }
        // The marker's length depends on N, N on where the kept part
        // starts: move the start on until it stays (it only grows, so this
        // ends; a digit more in N is the most one round adds).
        let mut start = 0;
        loop {
            let marker_len = format!("[trimmed: {} earlier bytes not kept] ", cut + start as u64).len();
            let mut next = text.len().saturating_sub(max.saturating_sub(marker_len)).max(start);
            while !text.is_char_boundary(next) {
                next += 1;
            }
            if next == start {
                break;
            }
            start = next;
        }
        let mut out = format!("[trimmed: {} earlier bytes not kept] ", cut + start as u64);
        out.push_str(&text[start..]);
        if out.len() > max {
            // A marker longer than `max` itself: keep the end only.
            let mut from = out.len() - max;
            while !out.is_char_boundary(from) {
                from += 1;
            }
            out.drain(..from);
        }
        out
    }

    #[cfg(test)]
    mod tests {
        use super::tail;

        #[test]
        fn short_text_is_kept_and_long_text_is_marked_within_max() {
            assert_eq!(tail("hello", 0, 100), "hello");
            let t = tail(&"x".repeat(1000), 0, 100);
            assert!(t.len() <= 100 && t.starts_with("[trimmed: ") && t.ends_with('x'), "{t}");
            let n: u64 = t["[trimmed: ".len()..].split(' ').next().and_then(|n| n.parse().ok()).expect("count");
            assert_eq!(n as usize + t.len() - t.find("] ").expect("marker") - 2, 1000, "N plus what is kept is the whole");
            let t = tail("abc", 5000, 100);
            assert_eq!(t, "[trimmed: 5000 earlier bytes not kept] abc");
            let t = tail(&"é".repeat(100), 0, 51);
            assert!(t.len() <= 51 && !t.contains('\u{FFFD}'), "{t}");
            // Found by breaking it: where N gains a digit, the marker lost its "[".
            for n in 65_000..66_000usize {
                let t = tail(&"x".repeat(n + 100_000), 0, 65_536);
                assert!(t.starts_with("[trimmed: ") && t.len() <= 65_536, "{n}: {:.40}", t);
            }
        }
    }
}

/// W3C Trace Context (`traceparent`, <https://www.w3.org/TR/trace-context/>):
/// the one parser and formatter both sides use. Ids are lower-case hex:
/// 32 digits for a trace id, 16 for a span id; all-zero ids are invalid.
pub mod tracecontext {
    /// `00-{trace_id}-{span_id}-01` (version 00, sampled).
    pub fn format(trace_id: &str, span_id: &str) -> String {
        format!("00-{trace_id}-{span_id}-01")
    }

    /// `(trace_id, span_id, sampled)` of a `traceparent`; `None` when it is
    /// malformed (wrong lengths, upper case, non-hex, all-zero ids, version
    /// `ff`). Later versions are read by their first four fields, as the
    /// specification says.
    pub fn parse(s: &str) -> Option<(String, String, bool)> {
        let mut parts = s.trim().split('-');
        let (version, trace, span, flags) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        let hex = |v: &str, n: usize| v.len() == n && v.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        if !hex(version, 2) || version == "ff" || !hex(trace, 32) || !hex(span, 16) || !hex(flags, 2) {
            return None;
        }
        if version == "00" && parts.next().is_some() {
            return None;
        }
        if trace.bytes().all(|b| b == b'0') || span.bytes().all(|b| b == b'0') {
            return None;
        }
        let sampled = u8::from_str_radix(flags, 16).ok()? & 1 == 1;
        Some((trace.to_string(), span.to_string(), sampled))
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn parses_the_spec_example_and_refuses_malformed_ones() {
            let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
            assert_eq!(parse(tp), Some(("4bf92f3577b34da6a3ce929d0e0e4736".into(), "00f067aa0ba902b7".into(), true)));
            assert_eq!(format("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"), tp);
            for bad in [
                "",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
                "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
                "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
                "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            ] {
                assert_eq!(parse(bad), None, "{bad}");
            }
            assert!(parse("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00-future").is_some_and(|p| !p.2));
        }
    }
}

/// Bearer tokens on the client side: the `authorization: Bearer TOKEN`
/// metadata every call to a control plane with an auth file carries (the
/// CLI, the runner, the tests).
pub mod bearer {
    use tonic::metadata::AsciiMetadataValue;

    /// The `authorization` value for `token`; `None` when the token is not
    /// a valid header value (a newline, non-ASCII).
    pub fn header(token: &str) -> Option<AsciiMetadataValue> {
        AsciiMetadataValue::try_from(format!("Bearer {token}")).ok()
    }

    /// An interceptor adding the header (when there is a token) to every call.
    #[derive(Clone, Debug, Default)]
    pub struct Bearer(pub Option<AsciiMetadataValue>);

    impl Bearer {
        /// The interceptor for `token` (none, or an invalid one: no header).
        pub fn new(token: Option<&str>) -> Self {
            Bearer(token.and_then(header))
        }
    }

    impl tonic::service::Interceptor for Bearer {
        fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
            if let Some(v) = &self.0 {
                req.metadata_mut().insert("authorization", v.clone());
            }
            Ok(req)
        }
    }
}

/// `Punchclock-Signature`: how punchclock signs what it sends over HTTP —
/// notifications to sinks (control plane) and requests to HTTP agents
/// (runner) — in Stripe's scheme: `t=<unix seconds>,v1=<hex
/// HMAC-SHA256(secret, "<t>.<body>")>`. One function, so a receiver
/// verifies both the same way.
pub mod signature {
    use hmac::{Hmac, Mac};
    use sha2::Sha256;

    /// The header's value for `body` signed at `unix_seconds`.
    pub fn sign(secret: &str, unix_seconds: i64, body: &[u8]) -> String {
        let mut mac = Hmac::<Sha256>::new_from_slice(secret.as_bytes()).expect("HMAC takes keys of any length");
        mac.update(format!("{unix_seconds}.").as_bytes());
        mac.update(body);
        format!("t={unix_seconds},v1={}", hex::encode(mac.finalize().into_bytes()))
    }
}
