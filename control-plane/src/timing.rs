//! Every timing constant of the control plane, derived from a few base
//! values so they stay consistent when one is overridden by a flag.
//!
//! - Runners send a heartbeat every `heartbeat_interval` (told in Welcome);
//!   the leader answers each with an ack carrying the heartbeat's `seq`.
//! - A runner silent for `3 × heartbeat_interval` is *silent*
//!   ([`Timing::runner_silent_after`], DESIGN "silent for 3 heartbeat
//!   intervals"): it gets no new assignment and its stream is closed. Its
//!   attempts stay open: the runner may only be cut off, its agents alive.
//! - **Runner self-fence.** A runner none of whose heartbeats has been
//!   acknowledged for [`Timing::runner_fence`] — counted from *sending* the
//!   last acknowledged one — stops its agents (TERM, `kill_grace`, KILL;
//!   the agent shim does it even while the runner process is stopped), so
//!   they are gone by then. The leader declares the runner lost — its
//!   attempts end `lost` and their concurrency slots free up — only after
//!   [`Timing::runner_lost_after`] = fence + margin of silence, counted from
//!   the *arrival* of its last message, which is later than the send of
//!   any heartbeat it acknowledged. So a task never has more live agents
//!   than its `concurrency_limit`, through a SIGSTOPped or partitioned
//!   runner. The fence is longer than a failover
//!   ([`Timing::failover_bound`]): runners keep their agents across a
//!   leader change.
//! - A new leader does not know when a runner last heard its predecessor,
//!   so attempts open at load wait the same `runner_lost_after` for their
//!   runner to re-declare them ([`Timing::redeclare_wait`]).
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

/// A runner with no acknowledgement starts stopping its agents this long
/// plus its kill grace before the fence deadline (TERM, the grace, KILL,
/// and a second to report), so they are gone by the deadline; sent in
/// every Welcome (`stop_lead_ms`). The fence is that much longer than a
/// failover, so agents survive a leader change.
pub const RUNNER_STOP_LEAD: Duration = Duration::from_secs(1);

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

    /// A runner silent this long gets no new assignment and its stream is
    /// closed: 3 heartbeat intervals. Its attempts stay open.
    pub fn runner_silent_after(&self) -> Duration {
        self.heartbeat_interval * 3
    }

    /// Longest time runners need to find a new leader after the old one
    /// stops: its lease runs out (`lease_ttl`), a replica wins and renews
    /// once (under another `lease_ttl`), and runners notice the silence
    /// (`runner_silent_after`) and reconnect. Default 16 s.
    pub fn failover_bound(&self) -> Duration {
        self.lease_ttl * 2 + self.runner_silent_after()
    }

    /// Runner self-fence deadline (told to runners in Welcome): with no
    /// acknowledged heartbeat for this long, counted from sending the last
    /// acknowledged one, a runner's agents are gone. A runner starts
    /// stopping them `kill_grace` + [`RUNNER_STOP_LEAD`] (1 s) before, so
    /// the fence is [`Timing::failover_bound`] plus both: agents survive a
    /// leader change (when runners use the control plane's kill grace, as
    /// `--kill-grace-ms` on both sets it). Default 22 s.
    pub fn runner_fence(&self) -> Duration {
        self.failover_bound() + self.kill_grace + RUNNER_STOP_LEAD
    }

    /// Added to the fence before the leader declares a runner lost: one
    /// heartbeat interval (clock-rate drift between hosts is far below it).
    pub fn fence_margin(&self) -> Duration {
        self.heartbeat_interval
    }

    /// A runner silent this long (since the arrival of its last message) is
    /// lost: its attempts end `lost`, their agents were stopped by the
    /// self-fence. `runner_fence + fence_margin`; default 24 s.
    pub fn runner_lost_after(&self) -> Duration {
        self.runner_fence() + self.fence_margin()
    }

    /// How long a new leader waits for runners to re-declare the attempts
    /// open at load before declaring them lost: [`Timing::runner_lost_after`]
    /// (it cannot know when a runner last heard the previous leader).
    pub fn redeclare_wait(&self) -> Duration {
        self.runner_lost_after()
    }

    /// Extra time past an attempt's deadline before the control plane marks
    /// it TIMEOUT on its own.
    pub fn deadline_slack(&self) -> Duration {
        self.kill_grace + self.heartbeat_interval * 2
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fence must outlast a failover (runners keep their agents across
    /// a leader change) and the leader must wait past it (no two agents).
    /// The runner's own stop (TERM at the deadline less its kill grace and
    /// a second) must come after a failover too: before, the fence was the
    /// failover bound itself, so a runner stopped its agents 5.5 s into a
    /// failover the bound allows 7.5 s for (the tests' timing; CI caught it
    /// in `inv_failover_agents`).
    #[test]
    fn fence_outlasts_a_failover_and_loss_outlasts_the_fence() {
        for t in [
            Timing::default(),
            Timing {
                heartbeat_interval: Duration::from_millis(500),
                kill_grace: Duration::from_secs(1),
                lease_ttl: Duration::from_secs(3),
            },
        ] {
            let failover = t.lease_ttl * 2 + t.runner_silent_after();
            assert!(t.runner_fence() >= failover);
            assert!(t.runner_fence() - t.kill_grace - RUNNER_STOP_LEAD >= failover, "a runner stops its agents inside a failover");
            assert!(t.runner_lost_after() > t.runner_fence());
            assert!(t.runner_silent_after() < t.runner_fence());
            assert_eq!(t.redeclare_wait(), t.runner_lost_after());
        }
        assert_eq!(Timing::default().runner_lost_after(), Duration::from_secs(24));
    }
}
