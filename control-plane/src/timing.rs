//! Every timing constant of the control plane, derived from a few base
//! values so they stay consistent when one is overridden by a flag.
//!
//! - Runners send a heartbeat every `heartbeat_interval` (told in Welcome).
//! - A runner silent for `3 × heartbeat_interval` is lost (DESIGN: "silent
//!   for 3 heartbeat intervals"); its open attempts end as `lost` and follow
//!   the retry policy.
//! - After the control plane starts leading, runners get the same
//!   `runner_lost_after` to reconnect and re-declare in-flight runs before
//!   those runs are declared lost.
//! - The runner kills an agent at its deadline (TERM, `kill_grace`, KILL);
//!   the control plane marks the attempt TIMEOUT itself if no result came by
//!   `deadline + kill_grace + 2 × heartbeat_interval` (the runner had time to
//!   kill and to report over a healthy stream).
//! - Leadership (etcd): the leader's lease has `lease_ttl` (default 5 s,
//!   DESIGN). It renews every `lease_ttl / 3`, so two renewals can fail
//!   before the lease could expire; each renewal RPC must answer within one
//!   renew interval. Leadership is announced only after the first renewal
//!   succeeds. The leader stops writing once `lease_ttl - margin` has passed
//!   since its last acknowledged renewal, without waiting for etcd to say so:
//!   `margin = lease_ttl / 5` covers clock-rate drift between this process
//!   and etcd and the time a write spends in flight.

use std::time::Duration;

/// The control plane's timing, derived from `heartbeat_interval` and `kill_grace`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    /// How often runners send a heartbeat. Default 2 s.
    pub heartbeat_interval: Duration,
    /// TERM → KILL grace the runner uses on timeout and cancel. Default 5 s.
    pub kill_grace: Duration,
    /// TTL of the leader's etcd lease. Default 5 s.
    pub lease_ttl: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Timing { heartbeat_interval: Duration::from_secs(2), kill_grace: Duration::from_secs(5), lease_ttl: Duration::from_secs(5) }
    }
}

impl Timing {
    /// The leader renews its lease this often: `lease_ttl / 3`.
    pub fn renew_interval(&self) -> Duration {
        self.lease_ttl / 3
    }

    /// Safety margin before the lease could expire: `lease_ttl / 5`.
    pub fn lease_margin(&self) -> Duration {
        self.lease_ttl / 5
    }

    /// The leader stops writing this long after its last acknowledged
    /// renewal: `lease_ttl - lease_margin`.
    pub fn leader_write_cutoff(&self) -> Duration {
        self.lease_ttl - self.lease_margin()
    }

    /// The lease TTL in whole seconds, as etcd takes it (at least 1).
    pub fn lease_ttl_seconds(&self) -> i64 {
        (self.lease_ttl.as_secs() as i64).max(1)
    }

    /// How long a stopping server lets open calls and streams finish before
    /// it cuts them: 3 s, fixed. A runner or `WatchRuns` client that never
    /// hangs up must not hold a SIGTERM forever; runners reconnect to the
    /// next leader anyway.
    pub fn shutdown_drain(&self) -> Duration {
        Duration::from_secs(3)
    }

    /// A runner silent this long is lost: 3 heartbeat intervals.
    pub fn runner_lost_after(&self) -> Duration {
        self.heartbeat_interval * 3
    }

    /// How long a new leader waits for runners to re-declare in-flight runs:
    /// a lease TTL (runners may take that long to learn who leads) plus the
    /// silence that would declare a connected runner lost.
    pub fn redeclare_wait(&self) -> Duration {
        self.lease_ttl + self.runner_lost_after()
    }

    /// Extra time past an attempt's deadline before the control plane marks
    /// it TIMEOUT on its own.
    pub fn deadline_slack(&self) -> Duration {
        self.kill_grace + self.heartbeat_interval * 2
    }
}
