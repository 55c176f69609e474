//! Leader election on etcd (STYLE.md items 3–6; DESIGN "Store and leadership").
//!
//! Campaign: grant a lease of `lease_ttl`, then create the election key
//! `{prefix}election/leader` with it if absent (one transaction). The key's
//! create revision is the fencing token: etcd revisions only grow, so every
//! new leader's token is larger than every old one's. Leadership is
//! announced only after the first renewal succeeds.
//!
//! Leading: renew every `lease_ttl / 3` (each renewal must answer within one
//! interval). Step down on the first failed or late renewal, and in any case
//! once `lease_ttl - margin` has passed since the last acknowledged renewal
//! — checked first on every wake-up, so a process resumed after SIGSTOP
//! steps down before anything else. Every leader write carries the fence
//! `create_revision(election key) == token`, so a write that slips through
//! anyway is rejected by etcd; the engine then reports the rejection
//! ([`Election::deposed`]) and the term ends at once.
//!
//! Test hook: with `PUNCHCLOCK_TEST_IGNORE_LEASE_LOSS=1` a leader never steps
//! down for lease trouble, only on a fenced write or resign (see
//! [`IGNORE_LEASE_LOSS_ENV`]); `tests/tests/ha_sigstop.rs` uses it.
//!
//! Following: watch the key; when it disappears (resign or lease expiry),
//! campaign at once. `resign` revokes the lease, deleting the key, so a
//! rolling restart hands over without waiting for the TTL.
//!
//! Every replica also keeps `{prefix}members/{id}` alive on a lease of its
//! own, so `cluster status` can list the members.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use tokio::sync::{Notify, watch};
use tokio::time::Instant;

use super::{Election, LeaderInfo, Leadership};
use crate::repo::{Keys, codec};
use crate::store::{Compare, KvStore, LeaseId, Txn, TxnOp};
use crate::timing::Timing;

/// What the election key and member keys hold.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberInfo {
    /// Replica id.
    pub id: String,
    /// Advertised API address.
    pub advertise_address: String,
    /// Its HTTP port's address (empty: none).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub http_address: String,
}

/// Resolves when the flag is set (returns `()`, not a borrow guard, so it
/// can sit in a `select!` whose other branches await).
async fn wait_set(rx: &mut watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await.map(|_| ());
}

fn is_set(rx: &watch::Receiver<bool>) -> bool {
    *rx.borrow()
}

/// The etcd election of one replica.
pub struct EtcdElection {
    store: Arc<dyn KvStore>,
    keys: Keys,
    me: MemberInfo,
    timing: Timing,
    tx: watch::Sender<Option<Leadership>>,
    resign: Notify,
    resigned: watch::Sender<bool>,
    /// No campaign before this instant (after a step-down).
    hold_until: std::sync::Mutex<Option<Instant>>,
    /// The last token a fenced write reported as deposed.
    deposed: watch::Sender<u64>,
    /// Test hook (`PUNCHCLOCK_TEST_IGNORE_LEASE_LOSS=1`): never step down for
    /// a failed, late or missing renewal, like a leader that cannot tell its
    /// lease is gone. Only a fenced write (or resign) ends its term; tests use
    /// it to show that the fence alone rejects such a leader's writes.
    ignore_lease_loss: bool,
}

/// Environment variable of the test hook [`EtcdElection`] documents. Never
/// set it in production: it turns off the lease checks.
pub const IGNORE_LEASE_LOSS_ENV: &str = "PUNCHCLOCK_TEST_IGNORE_LEASE_LOSS";

impl EtcdElection {
    /// Starts campaigning (and the member heartbeat) in the background.
    pub fn start(store: Arc<dyn KvStore>, keys: Keys, id: String, advertise: String, http_address: String, timing: Timing) -> Arc<Self> {
        let (tx, _) = watch::channel(None);
        let (resigned, _) = watch::channel(false);
        let e = Arc::new(EtcdElection {
            store,
            keys,
            me: MemberInfo { id, advertise_address: advertise, http_address },
            timing,
            tx,
            resign: Notify::new(),
            resigned,
            hold_until: std::sync::Mutex::new(None),
            deposed: watch::channel(0).0,
            ignore_lease_loss: std::env::var(IGNORE_LEASE_LOSS_ENV).is_ok_and(|v| v == "1"),
        });
        if e.ignore_lease_loss {
            tracing::warn!("{IGNORE_LEASE_LOSS_ENV}=1: this replica will not step down when its lease is lost (test hook)");
        }
        tokio::spawn(e.clone().campaign_loop());
        tokio::spawn(e.clone().member_loop());
        e
    }

    fn leader_key(&self) -> String {
        self.keys.election_leader()
    }

    async fn campaign_loop(self: Arc<Self>) {
        let key = self.leader_key();
        let renew = self.timing.renew_interval();
        let mut stopped = self.resigned.subscribe();
        loop {
            if is_set(&stopped) {
                return;
            }
            // Follow until the key is gone.
            match self.store.get(&key).await {
                Ok(Some(_)) => {
                    let watch = self.store.watch(&key).await;
                    let gone = async {
                        match watch {
                            Ok(mut w) => {
                                while let Some(ev) = w.next().await {
                                    match ev {
                                        Ok(crate::store::WatchEvent::Delete { .. }) | Err(_) => return,
                                        Ok(_) => {}
                                    }
                                }
                            }
                            Err(_) => tokio::time::sleep(renew).await,
                        }
                    };
                    tokio::select! {
                        _ = gone => {}
                        // Re-check now and then even if the watch is quiet.
                        _ = tokio::time::sleep(self.timing.lease_ttl) => {}
                        _ = wait_set(&mut stopped) => return,
                    }
                    continue;
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "election: cannot read the leader key");
                    tokio::time::sleep(renew).await;
                    continue;
                }
            }
            let hold = self.hold_until.lock().ok().and_then(|h| *h).filter(|t| *t > Instant::now());
            if let Some(until) = hold {
                tokio::select! {
                    _ = tokio::time::sleep_until(until) => {}
                    _ = wait_set(&mut stopped) => return,
                }
                continue;
            }
            match self.try_lead(&key).await {
                Some((lease, token)) => {
                    self.lead(lease, token, &key).await;
                    // Best effort: free the key for the next leader at once.
                    let _ = tokio::time::timeout(renew, self.store.revoke_lease(lease)).await;
                    if is_set(&self.resigned.subscribe()) {
                        return;
                    }
                }
                None => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }

    /// Creates the election key on a fresh lease; `Some((lease, token))` after
    /// the first successful renewal.
    async fn try_lead(&self, key: &str) -> Option<(LeaseId, u64)> {
        let renew = self.timing.renew_interval();
        let lease = match self.store.grant_lease(self.timing.lease_ttl_seconds()).await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "election: cannot grant a lease");
                tokio::time::sleep(renew).await;
                return None;
            }
        };
        let value = codec::encode(&self.me).unwrap_or_default();
        let txn =
            Txn { compares: vec![Compare::absent(key)], success: vec![TxnOp::Put { key: key.to_string(), value, lease }], failure: vec![] };
        let created = match self.store.txn(txn).await {
            Ok(r) if r.succeeded => Some(r.revision),
            Ok(_) => None,
            Err(e) => {
                tracing::warn!(error = %e, "election: campaign write failed");
                None
            }
        };
        let first_renewal = match created {
            Some(_) => matches!(tokio::time::timeout(renew, self.store.keep_alive(lease)).await, Ok(Ok(ttl)) if ttl > 0),
            None => false,
        };
        match (created, first_renewal) {
            (Some(rev), true) => Some((lease, rev as u64)),
            _ => {
                let _ = tokio::time::timeout(renew, self.store.revoke_lease(lease)).await;
                None
            }
        }
    }

    async fn lead(&self, lease: LeaseId, token: u64, key: &str) {
        let renew = self.timing.renew_interval();
        let cutoff = self.timing.leader_write_cutoff();
        let mut last_ack = Instant::now();
        self.tx.send_replace(Some(Leadership { token, fence: vec![Compare::create_revision(key, token as i64)] }));
        tracing::info!(token, id = %self.me.id, "election: leading");
        let mut stopped = self.resigned.subscribe();
        let mut deposed = self.deposed.subscribe();
        let lost = |why: &'static str| if self.ignore_lease_loss { None } else { Some(why) };
        let why = loop {
            // Checked first on every wake-up: after a pause (SIGSTOP, GC,
            // swap) the cutoff has passed before any other timer runs.
            if last_ack.elapsed() >= cutoff
                && let Some(why) = lost("no acknowledged renewal within lease_ttl - margin")
            {
                break why;
            }
            tokio::select! {
                biased;
                _ = wait_set(&mut stopped) => break "resigned",
                _ = async { let _ = deposed.wait_for(|t| *t == token).await; } => break "a write was rejected by the fencing token: a newer leader exists",
                _ = tokio::time::sleep_until(last_ack + cutoff), if !self.ignore_lease_loss => {}
                _ = tokio::time::sleep(renew) => {
                    if last_ack.elapsed() >= cutoff && !self.ignore_lease_loss {
                        continue;
                    }
                    let outcome = match tokio::time::timeout(renew, self.store.keep_alive(lease)).await {
                        Ok(Ok(ttl)) if ttl > 0 => {
                            last_ack = Instant::now();
                            None
                        }
                        Ok(Ok(_)) => lost("lease expired"),
                        Ok(Err(e)) => {
                            tracing::warn!(error = %e, "election: renewal failed");
                            lost("renewal failed")
                        }
                        Err(_) => lost("renewal late"),
                    };
                    if let Some(why) = outcome {
                        break why;
                    }
                }
            }
        };
        self.tx.send_replace(None);
        tracing::warn!(token, reason = why, "election: stepped down");
    }

    async fn member_loop(self: Arc<Self>) {
        let key = self.keys.election_member(&self.me.id);
        let value = codec::encode(&self.me).unwrap_or_default();
        let mut stopped = self.resigned.subscribe();
        let mut lease: Option<LeaseId> = None;
        loop {
            let ok = match lease {
                Some(l) => matches!(self.store.keep_alive(l).await, Ok(t) if t > 0),
                None => false,
            };
            if !ok {
                lease = match self.store.grant_lease(self.timing.lease_ttl_seconds()).await {
                    Ok(l) => {
                        let put = Txn { success: vec![TxnOp::Put { key: key.clone(), value: value.clone(), lease: l }], ..Txn::default() };
                        self.store.txn(put).await.ok().map(|_| l)
                    }
                    Err(_) => None,
                };
            }
            tokio::select! {
                _ = tokio::time::sleep(self.timing.renew_interval()) => {}
                _ = wait_set(&mut stopped) => {
                    if let Some(l) = lease {
                        let _ = tokio::time::timeout(self.timing.renew_interval(), self.store.revoke_lease(l)).await;
                    }
                    return;
                }
            }
        }
    }

    /// Every live member, by id.
    pub async fn members(&self) -> Vec<MemberInfo> {
        match self.store.range(&self.keys.election_members()).await {
            Ok((kvs, _)) => kvs.iter().filter_map(|kv| codec::decode("member", &kv.value).ok()).collect(),
            Err(_) => Vec::new(),
        }
    }
}

#[async_trait]
impl Election for EtcdElection {
    fn leadership(&self) -> watch::Receiver<Option<Leadership>> {
        self.tx.subscribe()
    }

    async fn leader(&self) -> Option<LeaderInfo> {
        let kv = self.store.get(&self.leader_key()).await.ok()??;
        let m: MemberInfo = codec::decode("member", &kv.value).ok()?;
        Some(LeaderInfo {
            leader_id: m.id,
            advertise_address: m.advertise_address,
            http_address: m.http_address,
            token: kv.create_revision as u64,
        })
    }

    fn id(&self) -> String {
        self.me.id.clone()
    }

    async fn resign(&self) {
        self.resigned.send_replace(true);
        self.resign.notify_waiters();
        // Wait until the leader loop has stepped down (bounded).
        let mut rx = self.tx.subscribe();
        let _ = tokio::time::timeout(self.timing.lease_ttl, rx.wait_for(|l| l.is_none())).await;
        // The campaign loop revokes the lease; give it a moment to land.
        let key = self.leader_key();
        let deadline = Instant::now() + self.timing.renew_interval();
        while Instant::now() < deadline {
            match self.store.get(&key).await {
                Ok(Some(kv)) if codec::decode::<MemberInfo>("member", &kv.value).is_ok_and(|m| m.id == self.me.id) => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                _ => break,
            }
        }
    }

    fn deposed(&self, token: u64) {
        tracing::warn!(token, "election: told a write was fenced");
        self.deposed.send_replace(token);
    }

    fn step_down(&self, token: u64, hold: Duration) {
        tracing::warn!(token, hold_ms = hold.as_millis() as u64, "election: stepping down so another replica can lead");
        if let Ok(mut until) = self.hold_until.lock() {
            *until = Some(Instant::now() + hold);
        }
        self.deposed.send_replace(token);
    }

    async fn members(&self) -> Vec<(String, String)> {
        EtcdElection::members(self).await.into_iter().map(|m| (m.id, m.advertise_address)).collect()
    }
}
