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

    /// Protobuf timestamp → UTC instant; `None` when out of chrono's range or
    /// malformed (negative nanos).
    pub fn from_timestamp(ts: &Timestamp) -> Option<DateTime<Utc>> {
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
        }
    }
}
