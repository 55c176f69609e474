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
