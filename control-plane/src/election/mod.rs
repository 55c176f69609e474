//! Leadership: who schedules and dispatches. An [`Election`] publishes the
//! current [`Leadership`] of this replica through a watch channel; the
//! bootstrap starts the engine (scheduler, dispatcher, reaper) when it
//! becomes `Some` and stops it when it becomes `None` (STYLE.md item 3).
//!
//! The fencing token is the create revision of the leader's election key: it
//! only grows, rides on every assignment and guards every leader write.

pub mod etcd;
pub mod single;

use async_trait::async_trait;
use tokio::sync::watch;

use crate::store::Compare;

/// This replica leads, with this fencing token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leadership {
    /// The epoch: create revision of the election key (1 for single-node).
    pub token: u64,
    /// Compares that every leader write must include (the fence).
    pub fence: Vec<Compare>,
}

/// Who leads the cluster, as far as this replica knows.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LeaderInfo {
    /// Leader's id.
    pub leader_id: String,
    /// Leader's advertised API address.
    pub advertise_address: String,
    /// Leader's HTTP port (`http://host:port`; empty when it has none or
    /// did not say): a follower forwards webhook requests there.
    pub http_address: String,
    /// Leader's fencing token.
    pub token: u64,
}

/// A leader election.
#[async_trait]
pub trait Election: Send + Sync + 'static {
    /// `Some` while this replica leads.
    fn leadership(&self) -> watch::Receiver<Option<Leadership>>;
    /// The current leader, if known.
    async fn leader(&self) -> Option<LeaderInfo>;
    /// This replica's id.
    fn id(&self) -> String;
    /// Gives up leadership at once (on shutdown), so another replica takes over.
    async fn resign(&self);
    /// The store rejected a write fenced with `token`: a newer leader holds
    /// the election key. If this replica still leads with `token`, it steps
    /// down at once, without waiting for its own lease checks (which a
    /// paused or clock-skewed process may not have run yet).
    fn deposed(&self, token: u64);
    /// Live members as `(id, advertised address)`.
    async fn members(&self) -> Vec<(String, String)>;
    /// Gives up leadership of `token` (when it is still held) and stays
    /// out of the next elections for `hold`, so another replica can lead:
    /// for a leader that cannot run its engine. A single node has nobody
    /// to hand over to: it keeps leading.
    fn step_down(&self, token: u64, hold: std::time::Duration) {
        let _ = (token, hold);
    }
}
