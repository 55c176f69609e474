//! The notification outbox: `outbox/{id}` holds notifications to deliver
//! and dead letters; `notifications/{id}` the delivery records of
//! delivered ones (the payload left out). The engine puts outbox records
//! with the run state they report ([`super::StoreOp::PutNotification`]);
//! the leader's notifier reads and updates them here, each write fenced and
//! conditional on the record's mod revision, so two leaders never both
//! record an outcome.

use super::{Repo, codec};
use crate::election::Leadership;
use crate::error::{Error, Result};
use crate::model::notification::{DeliveryStatus, Notification};
use crate::store::{Compare, Revision, Txn, TxnOp, WatchStream};

/// A notification with its key's mod revision.
pub type Versioned = (Notification, Revision);

impl Repo {
    /// Every outbox record (pending and dead), in key order, read in pages.
    pub async fn outbox(&self) -> Result<Vec<Versioned>> {
        self.notifications_under(&self.keys.outbox()).await
    }

    /// Delivery records of delivered notifications, in key order.
    pub async fn delivered(&self) -> Result<Vec<Versioned>> {
        self.notifications_under(&self.keys.delivered()).await
    }

    /// One run's notifications, pending, dead and delivered: those whose id
    /// starts with `{base}.` ([`crate::model::notification::notification_base`]),
    /// outbox first; two prefix reads, whatever the outbox holds.
    pub async fn notifications_of(&self, base: &str) -> Result<Vec<Versioned>> {
        let mut v = self.notifications_under(&format!("{}{base}.", self.keys.outbox())).await?;
        v.extend(self.notifications_under(&format!("{}{base}.", self.keys.delivered())).await?);
        Ok(v)
    }

    async fn notifications_under(&self, prefix: &str) -> Result<Vec<Versioned>> {
        const PAGE: usize = 256;
        let mut out: Vec<Versioned> = Vec::new();
        let mut after = String::new();
        loop {
            let page = self.store.range_page(prefix, &after, PAGE, false).await?;
            let full = page.len() == PAGE;
            for kv in &page {
                match codec::decode::<Notification>("notification", &kv.value) {
                    Ok(n) => out.push((n, kv.mod_revision)),
                    Err(e) => tracing::error!(key = %kv.key, error = %e, "unreadable notification; skipped"),
                }
            }
            match page.into_iter().last() {
                Some(kv) if full => after = kv.key,
                _ => return Ok(out),
            }
        }
    }

    /// One notification: from the outbox, else from the delivery records.
    pub async fn get_notification(&self, id: &str) -> Result<Option<Versioned>> {
        for key in [self.keys.outbox_item(id), self.keys.delivered_item(id)] {
            if let Some(kv) = self.store.get(&key).await? {
                return Ok(Some((codec::decode("notification", &kv.value)?, kv.mod_revision)));
            }
        }
        Ok(None)
    }

    /// Changes under `outbox/` committed after this call returns.
    pub async fn watch_outbox(&self) -> Result<WatchStream> {
        self.store.watch(&self.keys.outbox()).await
    }

    /// Records an attempt's outcome under the fence, if the outbox record
    /// is still at `rev`: a delivered notification moves to
    /// `notifications/{id}` without its payload; any other is put back as
    /// given. Returns the record's new revision, or `None` (writing
    /// nothing) when it changed meanwhile (a `notifications retry`).
    ///
    /// Errors: [`Error::Fenced`]; store errors.
    pub async fn record_delivery(&self, lead: &Leadership, n: &Notification, rev: Revision) -> Result<Option<Revision>> {
        let key = self.keys.outbox_item(&n.id);
        let success = if n.status == DeliveryStatus::Delivered {
            let mut done = n.clone();
            done.payload = serde_json::Value::Null;
            vec![TxnOp::delete(&key), TxnOp::put(self.keys.delivered_item(&n.id), codec::encode(&done)?)]
        } else {
            vec![TxnOp::put(&key, codec::encode(n)?)]
        };
        let txn = Txn { compares: vec![Compare::mod_revision(&key, rev)], success, failure: Vec::new() };
        Ok(self.fenced_txn(lead, txn).await?.ok())
    }

    /// Deletes delivery records delivered before `cutoff` and dead letters
    /// last tried before it, each only if unchanged since read, in fenced
    /// batches (retention: they would otherwise grow without bound).
    /// Returns how many were deleted.
    ///
    /// Errors: [`Error::Fenced`]; store errors.
    pub async fn prune_notifications(&self, lead: &Leadership, cutoff: chrono::DateTime<chrono::Utc>) -> Result<usize> {
        const BATCH: usize = 50;
        let mut doomed: Vec<(String, Revision)> = Vec::new();
        for (n, rev) in self.delivered().await? {
            if n.delivered_at.unwrap_or(n.updated_at) < cutoff {
                doomed.push((self.keys.delivered_item(&n.id), rev));
            }
        }
        for (n, rev) in self.outbox().await? {
            if n.status == DeliveryStatus::Dead && n.updated_at < cutoff {
                doomed.push((self.keys.outbox_item(&n.id), rev));
            }
        }
        let mut deleted = 0;
        for batch in doomed.chunks(BATCH) {
            let txn = Txn {
                compares: batch.iter().map(|(k, rev)| Compare::mod_revision(k, *rev)).collect(),
                success: batch.iter().map(|(k, _)| TxnOp::delete(k)).collect(),
                failure: Vec::new(),
            };
            if self.fenced_txn(lead, txn).await?.is_ok() {
                deleted += batch.len();
            }
        }
        Ok(deleted)
    }

    /// `notifications retry`: a dead (or pending) outbox record becomes
    /// pending with its attempts reset, due now. Not fenced: any replica
    /// may, and the change is conditional on the record's revision.
    ///
    /// Errors: `NotFound`; `FailedPrecondition` for a delivered one; store
    /// errors.
    pub async fn retry_notification(&self, id: &str, now: chrono::DateTime<chrono::Utc>) -> Result<Notification> {
        let key = self.keys.outbox_item(id);
        for _ in 0..5 {
            let Some(kv) = self.store.get(&key).await? else {
                if self.store.get(&self.keys.delivered_item(id)).await?.is_some() {
                    return Err(Error::FailedPrecondition(format!("notification {id} was delivered already")));
                }
                return Err(Error::NotFound { kind: "notification", id: id.to_string() });
            };
            let mut n: Notification = codec::decode("notification", &kv.value)?;
            n.status = DeliveryStatus::Pending;
            n.attempts = 0;
            n.next_attempt_at = now;
            n.updated_at = now;
            let txn = Txn {
                compares: vec![Compare::mod_revision(&key, kv.mod_revision)],
                success: vec![TxnOp::put(&key, codec::encode(&n)?)],
                failure: Vec::new(),
            };
            if self.store.txn(txn).await?.succeeded {
                return Ok(n);
            }
        }
        Err(Error::Unavailable { reason: format!("notification {id} keeps changing; try again"), leader: None })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use chrono::{DateTime, Duration, Utc};

    use super::*;
    use crate::model::RunRecord;
    use crate::model::notification::{NotifyEvent, for_sinks};
    use crate::model::run::TriggerKind;
    use crate::repo::{Keys, StoreOp};
    use crate::store::embedded::EmbeddedStore;

    /// Delivery outcomes are conditional on the revision read; retention
    /// deletes only old delivery records and old dead letters.
    #[tokio::test]
    async fn outcomes_are_conditional_and_old_records_are_pruned() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Arc::new(EmbeddedStore::open(dir.path()).await.expect("store"));
        let repo = Repo::new(store, Keys::default());
        let lead = Leadership { token: 1, fence: Vec::new() };
        let t0: DateTime<Utc> = "2026-12-01T10:00:00Z".parse().unwrap();
        let run = RunRecord::pending("t.1".into(), "t", "a", TriggerKind::Cron, t0, t0);
        let sinks = vec!["webhook://a".to_string(), "webhook://b".to_string(), "webhook://c".to_string()];
        let notes = for_sinks(&sinks, NotifyEvent::OnSuccess, "t.1", t0, &run, None);
        let ops = notes.iter().map(|n| StoreOp::PutNotification(Box::new(n.clone()))).collect();
        repo.commit(&lead, vec![ops]).await.expect("outbox written");
        let outbox = repo.outbox().await.expect("read");
        assert_eq!(outbox.len(), 3);
        // a: delivered long ago; b: dead long ago; c: stale revision → not recorded.
        let (mut a, rev_a) = outbox[0].clone();
        a.status = DeliveryStatus::Delivered;
        a.delivered_at = Some(t0);
        assert!(repo.record_delivery(&lead, &a, rev_a).await.unwrap().is_some());
        assert!(repo.record_delivery(&lead, &a, rev_a).await.unwrap().is_none(), "a second outcome for the same revision is refused");
        let (mut b, rev_b) = outbox[1].clone();
        b.status = DeliveryStatus::Dead;
        b.updated_at = t0;
        assert!(repo.record_delivery(&lead, &b, rev_b).await.unwrap().is_some());
        assert_eq!(repo.delivered().await.unwrap().len(), 1);
        assert!(repo.delivered().await.unwrap()[0].0.payload.is_null(), "delivery records carry no body");
        // Nothing is older than a cutoff before t0; everything old is after.
        assert_eq!(repo.prune_notifications(&lead, t0 - Duration::days(1)).await.unwrap(), 0);
        assert_eq!(repo.prune_notifications(&lead, t0 + Duration::days(1)).await.unwrap(), 2);
        let left: Vec<String> = repo.outbox().await.unwrap().into_iter().map(|(n, _)| n.id).collect();
        assert_eq!(left, vec!["t.1.on_success.2".to_string()], "the pending one stays");
        // A retry makes a dead one pending again; a delivered one cannot be retried.
        assert!(matches!(repo.retry_notification("t.1.on_success.0", t0).await, Err(Error::NotFound { .. })));
    }
}
