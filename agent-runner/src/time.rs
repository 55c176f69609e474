//! Wall-clock access; timestamp conversions are the proto crate's.
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

pub(crate) use punchclock_proto::time::{from_timestamp, to_timestamp};

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
        assert_eq!(from_timestamp(&prost_types::Timestamp { seconds: 0, nanos: -1 }), None);
    }
}
