//! The single-node election used by `punchclock dev` and `server --store
//! embedded:`: this replica always leads, with fencing token 1 and no fence
//! compares (nobody else can write the embedded store).

use async_trait::async_trait;
use tokio::sync::watch;

use super::{Election, LeaderInfo, Leadership};

/// Always the leader.
#[derive(Debug)]
pub struct SingleNode {
    id: String,
    advertise: String,
    tx: watch::Sender<Option<Leadership>>,
}

impl SingleNode {
    /// Leader `id`, reachable at `advertise`.
    pub fn new(id: impl Into<String>, advertise: impl Into<String>) -> Self {
        let (tx, _) = watch::channel(Some(Leadership { token: 1, fence: Vec::new() }));
        SingleNode { id: id.into(), advertise: advertise.into(), tx }
    }
}

#[async_trait]
impl Election for SingleNode {
    fn leadership(&self) -> watch::Receiver<Option<Leadership>> {
        self.tx.subscribe()
    }

    async fn leader(&self) -> Option<LeaderInfo> {
        Some(LeaderInfo { leader_id: self.id.clone(), advertise_address: self.advertise.clone(), http_address: String::new(), token: 1 })
    }

    fn id(&self) -> String {
        self.id.clone()
    }

    async fn resign(&self) {
        self.tx.send_replace(None);
    }

    fn deposed(&self, token: u64) {
        // Nobody else writes the embedded store, so no write is ever fenced.
        tracing::error!(token, "single-node leader told it was fenced; ignoring");
    }

    async fn members(&self) -> Vec<(String, String)> {
        vec![(self.id.clone(), self.advertise.clone())]
    }
}
