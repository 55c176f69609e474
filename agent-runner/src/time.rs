//! Wall-clock access and timestamp conversions.
//!
//! [`now`] is the only place in the crate that reads the wall clock; all
//! waiting is done with `tokio::time` (monotonic).

use chrono::{DateTime, SecondsFormat, Utc};
use prost_types::Timestamp;

/// The current UTC time.
#[allow(clippy::disallowed_methods)] // the crate's single wall-clock read
pub(crate) fn now() -> DateTime<Utc> {
    Utc::now()
}

/// The current UTC time as a protobuf timestamp.
pub(crate) fn now_timestamp() -> Timestamp {
    to_timestamp(now())
}

/// Converts a UTC instant to a protobuf timestamp.
pub(crate) fn to_timestamp(t: DateTime<Utc>) -> Timestamp {
    Timestamp {
        seconds: t.timestamp(),
        // Always < 2e9 (leap-second representation included), so it fits.
        nanos: i32::try_from(t.timestamp_subsec_nanos()).unwrap_or(i32::MAX),
    }
}

/// Converts a protobuf timestamp to a UTC instant; `None` when out of range
/// or malformed (negative nanos).
pub(crate) fn from_timestamp(ts: &Timestamp) -> Option<DateTime<Utc>> {
    let nanos = u32::try_from(ts.nanos).ok()?;
    DateTime::from_timestamp(ts.seconds, nanos)
}

/// RFC 3339 in UTC with a `Z` suffix and only as many fractional digits as
/// needed, e.g. `2025-01-31T09:00:00Z`.
pub(crate) fn rfc3339(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::AutoSi, true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamp_round_trip_and_format() {
        let t = DateTime::from_timestamp(1_700_000_000, 250_000_000).expect("valid instant");
        let ts = to_timestamp(t);
        assert_eq!(from_timestamp(&ts), Some(t));
        assert_eq!(rfc3339(t), "2023-11-14T22:13:20.250Z");
        assert_eq!(from_timestamp(&Timestamp { seconds: 0, nanos: -1 }), None);
    }
}
