//! The cluster configuration in the store: one validated, versioned
//! document (resources, budgets, prices, brokers, sinks and notification
//! settings) that every replica follows and the leader enforces (issue 34:
//! replicas started with different `--config` files enforced different
//! limits after a failover, silently).
//!
//! Keys:
//! - `config/current`: the [`StoredConfig`] in force (its version, its text
//!   as applied, when and by whom);
//! - `config/history/{version:020}`: the last [`HISTORY_KEPT`] versions;
//! - `meta/tasks-changed`: an empty key every task write puts in its own
//!   transaction, so that a configuration apply can tell, by its mod
//!   revision, that no task changed between its check and its write.
//!
//! Tasks and configuration are checked against each other in one step,
//! whichever comes second: a task write compares `config/current`'s mod
//! revision with the one it was validated against; a configuration write
//! compares `meta/tasks-changed`'s with the one it read the tasks at, and
//! its own key's (and goes through the leader, under the lock that
//! serializes `ApplyTasks`).

use chrono::{DateTime, Utc};
use futures::StreamExt;
use futures::stream::BoxStream;
use serde::{Deserialize, Serialize};

use super::{Repo, codec};
use crate::election::Leadership;
use crate::error::Result;
use crate::store::{Compare, Revision, Txn, TxnOp, WatchEvent};

/// Versions of the configuration kept in `config/history/`.
pub const HISTORY_KEPT: u64 = 20;

/// The cluster configuration as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoredConfig {
    /// 1, 2, ...: each apply that changes it adds one.
    pub version: u64,
    /// The document as applied (YAML or JSON), validated.
    pub text: String,
    /// When it was applied (UTC).
    pub applied_at: DateTime<Utc>,
    /// Who applied it: the caller's principal (`config apply`), or
    /// `replica ID: --config PATH` (a replica's file, the first time or at
    /// SIGHUP).
    pub applied_by: String,
}

/// A stored configuration with the mod revision of `config/current`.
#[derive(Debug, Clone)]
pub struct ConfigAt {
    /// As stored.
    pub stored: StoredConfig,
    /// `config/current`'s mod revision.
    pub revision: Revision,
}

impl Repo {
    /// The configuration in force (`None`: none was ever stored: the
    /// defaults apply).
    ///
    /// Errors: store errors; an unreadable record.
    pub async fn get_config(&self) -> Result<Option<ConfigAt>> {
        match self.store.get(&self.keys.config_current()).await? {
            Some(kv) => Ok(Some(ConfigAt { stored: codec::decode("cluster configuration", &kv.value)?, revision: kv.mod_revision })),
            None => Ok(None),
        }
    }

    /// An earlier version from `config/history/` (the last
    /// [`HISTORY_KEPT`] are kept).
    ///
    /// Errors: store errors; an unreadable record.
    pub async fn get_config_version(&self, version: u64) -> Result<Option<StoredConfig>> {
        match self.store.get(&self.keys.config_version(version)).await? {
            Some(kv) => Ok(Some(codec::decode("cluster configuration", &kv.value)?)),
            None => Ok(None),
        }
    }

    /// The mod revision of `meta/tasks-changed` (0: no task was written
    /// since it existed).
    ///
    /// Errors: store errors.
    pub async fn tasks_changed_revision(&self) -> Result<Revision> {
        Ok(self.store.get(&self.keys.tasks_changed()).await?.map_or(0, |kv| kv.mod_revision))
    }

    /// Stores `next` as the configuration in force if `config/current` is
    /// still at `config_rev` (0: absent) and no task was written since
    /// `tasks_rev` (see the module doc); with `lead`, under its fence.
    /// Returns the new mod revision, `None` when a compare failed (read
    /// again and check again).
    ///
    /// Errors: [`crate::Error::Fenced`]; store errors.
    pub async fn put_config_if(
        &self,
        lead: Option<&Leadership>,
        next: &StoredConfig,
        config_rev: Revision,
        tasks_rev: Revision,
    ) -> Result<Option<Revision>> {
        let current = self.keys.config_current();
        let bytes = codec::encode(next)?;
        let mut success = vec![TxnOp::put(&current, bytes.clone()), TxnOp::put(self.keys.config_version(next.version), bytes)];
        if next.version > HISTORY_KEPT {
            success.push(TxnOp::delete(self.keys.config_version(next.version - HISTORY_KEPT)));
        }
        let compares = vec![Compare::mod_revision(&current, config_rev), Compare::mod_revision(self.keys.tasks_changed(), tasks_rev)];
        let txn = Txn { compares, success, failure: Vec::new() };
        match lead {
            Some(lead) => Ok(self.fenced_txn(lead, txn).await?.ok()),
            None => {
                let r = self.store.txn(txn).await?;
                Ok(r.succeeded.then_some(r.revision))
            }
        }
    }

    /// Every change of `config/current` from now on (the configuration
    /// each time; a deletion is ignored: nothing deletes it).
    ///
    /// Errors: store errors (the watch could not start).
    pub async fn watch_config(&self) -> Result<BoxStream<'static, Result<ConfigAt>>> {
        let key = self.keys.config_current();
        let watch = self.store.watch(&key).await?;
        Ok(watch
            .filter_map(move |ev| {
                let key = key.clone();
                async move {
                    match ev {
                        Ok(WatchEvent::Put(kv)) if kv.key == key => {
                            match codec::decode::<StoredConfig>("cluster configuration", &kv.value) {
                                Ok(stored) => Some(Ok(ConfigAt { stored, revision: kv.mod_revision })),
                                Err(e) => {
                                    tracing::error!(error = %e, "unreadable cluster configuration in the store");
                                    None
                                }
                            }
                        }
                        Ok(_) => None,
                        Err(e) => Some(Err(e)),
                    }
                }
            })
            .boxed())
    }

    /// The compare and put every task write adds: the configuration it was
    /// validated against (`config_rev`, 0: none stored) is still the one
    /// in force, and configuration applies see that a task changed.
    pub(crate) fn task_write_guard(&self, config_rev: Revision) -> (Compare, TxnOp) {
        (Compare::mod_revision(self.keys.config_current(), config_rev), TxnOp::put(self.keys.tasks_changed(), Vec::new()))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::model::{Definition, TaskRecord};
    use crate::repo::Keys;
    use crate::store::embedded::EmbeddedStore;

    fn stored(version: u64, text: &str) -> StoredConfig {
        StoredConfig { version, text: text.into(), applied_at: "2026-12-05T10:00:00Z".parse().expect("t"), applied_by: "test".into() }
    }

    fn task(now: DateTime<Utc>) -> TaskRecord {
        TaskRecord::new(Definition::from_json(r#"{"task_id": "t", "agent_id": "a"}"#).expect("task"), now)
    }

    /// A configuration write fails when a task was written after the tasks
    /// were read for its check, and a task write fails when the
    /// configuration changed after it was validated: neither can strand
    /// the other. History keeps the last versions.
    #[tokio::test]
    async fn task_and_configuration_writes_see_each_other() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Arc::new(EmbeddedStore::open(dir.path()).await.expect("open"));
        let repo = Repo::new(store, Keys::default());
        assert!(repo.get_config().await.expect("get").is_none());
        let tasks_rev = repo.tasks_changed_revision().await.expect("rev");
        let rev = repo.put_config_if(None, &stored(1, "a"), 0, tasks_rev).await.expect("put").expect("stored");
        // A task validated against version 1 is written, and says so.
        let now = stored(1, "").applied_at;
        assert!(repo.put_task_checked(&task(now), 0, rev).await.expect("put task"));
        // A configuration checked against the tasks before that write fails.
        assert!(repo.put_config_if(None, &stored(2, "b"), rev, tasks_rev).await.expect("put").is_none());
        let tasks_rev = repo.tasks_changed_revision().await.expect("rev");
        let rev2 = repo.put_config_if(None, &stored(2, "b"), rev, tasks_rev).await.expect("put").expect("stored");
        // A task validated against version 1 now fails.
        let (_, task_rev) = repo.get_task("t").await.expect("get").expect("task");
        assert!(!repo.put_task_checked(&task(now), task_rev, rev).await.expect("put task"));
        assert!(repo.put_task_checked(&task(now), task_rev, rev2).await.expect("put task"));
        let mut rev = rev2;
        for v in 3..=HISTORY_KEPT + 3 {
            let tasks_rev = repo.tasks_changed_revision().await.expect("rev");
            rev = repo.put_config_if(None, &stored(v, "c"), rev, tasks_rev).await.expect("put").expect("stored");
        }
        assert_eq!(repo.get_config().await.expect("get").expect("some").stored.version, HISTORY_KEPT + 3);
        assert!(repo.get_config_version(3).await.expect("get").is_none(), "old versions go");
        assert!(repo.get_config_version(4).await.expect("get").is_some());
    }
}
