//! The KV store behind all durable state: revisions, range reads,
//! transactions with compares, watches and leases — the etcd v3 model, so
//! the embedded store (redb) and etcd are interchangeable.
//!
//! Keys are plain strings built by [`crate::repo::Keys`] under a prefix
//! (default `/punchclock/`); values are encoded by [`crate::repo`] only.

pub mod conformance;
pub mod embedded;
pub mod etcd;

use async_trait::async_trait;
use futures::stream::BoxStream;

use crate::error::Result;

/// A store revision: grows by one per committed write transaction (etcd semantics).
pub type Revision = i64;

/// A lease id; 0 means "no lease".
pub type LeaseId = i64;

/// One stored key with its etcd-style metadata.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyValue {
    /// Full key.
    pub key: String,
    /// Value bytes.
    pub value: Vec<u8>,
    /// Revision of the write that created the key (since its last deletion).
    pub create_revision: Revision,
    /// Revision of the latest write of the key.
    pub mod_revision: Revision,
    /// Writes since creation (1 after the first put).
    pub version: i64,
    /// Lease the key is attached to, 0 if none.
    pub lease: LeaseId,
}

/// What a [`Compare`] looks at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CompareTarget {
    /// The key's create revision (0 when the key is absent).
    CreateRevision(Revision),
    /// The key's mod revision (0 when absent).
    ModRevision(Revision),
    /// The key's version (0 when absent).
    Version(i64),
    /// The key's value (an absent key never equals a value).
    Value(Vec<u8>),
}

/// Comparison operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompareOp {
    /// `==`
    Equal,
    /// `!=`
    NotEqual,
    /// `<`
    Less,
    /// `>`
    Greater,
}

/// A guard of a transaction: `key.target op value`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Compare {
    /// Key compared.
    pub key: String,
    /// Operator.
    pub op: CompareOp,
    /// Target and value.
    pub target: CompareTarget,
}

impl Compare {
    /// `key` does not exist (create revision == 0): create-if-absent.
    pub fn absent(key: impl Into<String>) -> Self {
        Compare { key: key.into(), op: CompareOp::Equal, target: CompareTarget::CreateRevision(0) }
    }

    /// `key`'s mod revision equals `rev` (0 = absent): optimistic concurrency.
    pub fn mod_revision(key: impl Into<String>, rev: Revision) -> Self {
        Compare { key: key.into(), op: CompareOp::Equal, target: CompareTarget::ModRevision(rev) }
    }

    /// `key`'s create revision equals `rev`: the fencing guard of leader writes.
    pub fn create_revision(key: impl Into<String>, rev: Revision) -> Self {
        Compare { key: key.into(), op: CompareOp::Equal, target: CompareTarget::CreateRevision(rev) }
    }

    /// Evaluates against the key's current state (`None` = absent).
    pub fn holds(&self, kv: Option<&KeyValue>) -> bool {
        use std::cmp::Ordering;
        let ord = match (&self.target, kv) {
            (CompareTarget::CreateRevision(v), kv) => kv.map_or(0, |k| k.create_revision).cmp(v),
            (CompareTarget::ModRevision(v), kv) => kv.map_or(0, |k| k.mod_revision).cmp(v),
            (CompareTarget::Version(v), kv) => kv.map_or(0, |k| k.version).cmp(v),
            (CompareTarget::Value(_), None) => return false,
            (CompareTarget::Value(v), Some(k)) => k.value.as_slice().cmp(v.as_slice()),
        };
        match self.op {
            CompareOp::Equal => ord == Ordering::Equal,
            CompareOp::NotEqual => ord != Ordering::Equal,
            CompareOp::Less => ord == Ordering::Less,
            CompareOp::Greater => ord == Ordering::Greater,
        }
    }
}

/// One operation of a transaction branch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TxnOp {
    /// Put `value` at `key`, attached to `lease` (0 = none).
    Put {
        /// Key.
        key: String,
        /// Value.
        value: Vec<u8>,
        /// Lease, 0 for none.
        lease: LeaseId,
    },
    /// Delete `key` (no-op if absent).
    Delete {
        /// Key.
        key: String,
    },
    /// Read `key`; the result lands in [`TxnResult::gets`].
    Get {
        /// Key.
        key: String,
    },
}

impl TxnOp {
    /// Put without a lease.
    pub fn put(key: impl Into<String>, value: Vec<u8>) -> Self {
        TxnOp::Put { key: key.into(), value, lease: 0 }
    }
    /// Delete.
    pub fn delete(key: impl Into<String>) -> Self {
        TxnOp::Delete { key: key.into() }
    }
    /// Get.
    pub fn get(key: impl Into<String>) -> Self {
        TxnOp::Get { key: key.into() }
    }
}

/// `if all(compares) then success else failure`, atomically.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Txn {
    /// Guards (all must hold).
    pub compares: Vec<Compare>,
    /// Ops when they hold.
    pub success: Vec<TxnOp>,
    /// Ops when one fails.
    pub failure: Vec<TxnOp>,
}

/// Outcome of a [`Txn`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TxnResult {
    /// Whether every compare held (the success branch ran).
    pub succeeded: bool,
    /// Store revision after the transaction.
    pub revision: Revision,
    /// Results of the branch's `Get`s, in order.
    pub gets: Vec<Option<KeyValue>>,
}

/// A change seen by a watch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchEvent {
    /// A key was created or updated.
    Put(KeyValue),
    /// A key was deleted (or its lease expired).
    Delete {
        /// Key.
        key: String,
        /// Revision of the deletion.
        mod_revision: Revision,
    },
}

impl WatchEvent {
    /// The key concerned.
    pub fn key(&self) -> &str {
        match self {
            WatchEvent::Put(kv) => &kv.key,
            WatchEvent::Delete { key, .. } => key,
        }
    }
    /// Revision of the change.
    pub fn revision(&self) -> Revision {
        match self {
            WatchEvent::Put(kv) => kv.mod_revision,
            WatchEvent::Delete { mod_revision, .. } => *mod_revision,
        }
    }
}

/// A stream of changes under a prefix, in revision order. An `Err` item
/// means the watch fell behind or broke: re-read and watch again.
pub type WatchStream = BoxStream<'static, Result<WatchEvent>>;

/// The store interface (etcd v3 semantics).
#[async_trait]
pub trait KvStore: Send + Sync + 'static {
    /// One key.
    async fn get(&self, key: &str) -> Result<Option<KeyValue>>;
    /// Every key starting with `prefix`, in key order, and the revision read at.
    async fn range(&self, prefix: &str) -> Result<(Vec<KeyValue>, Revision)>;
    /// One page of a range: at most `limit` keys under `prefix` strictly
    /// after `after` (`""`: from the first), in key order; values left
    /// empty when `keys_only`. On etcd a page is one range request with
    /// `limit` and `keys_only` (etcd docs, "KV API: Range"), so no response
    /// grows with the number or size of the records.
    async fn range_page(&self, prefix: &str, after: &str, limit: usize, keys_only: bool) -> Result<Vec<KeyValue>>;
    /// [`KvStore::range_page`] backwards: at most `limit` keys under
    /// `prefix` strictly before `before` (`""`: from the last), in
    /// descending key order (the newest of a time index first). On etcd a
    /// range request sorted by key, descending.
    async fn range_page_rev(&self, prefix: &str, before: &str, limit: usize, keys_only: bool) -> Result<Vec<KeyValue>>;
    /// Unconditional put; returns the new revision.
    async fn put(&self, key: &str, value: Vec<u8>) -> Result<Revision> {
        Ok(self.txn(Txn { success: vec![TxnOp::put(key, value)], ..Txn::default() }).await?.revision)
    }
    /// Unconditional delete; returns whether the key existed.
    async fn delete(&self, key: &str) -> Result<bool> {
        let r = self
            .txn(Txn {
                compares: vec![Compare { key: key.into(), op: CompareOp::Greater, target: CompareTarget::CreateRevision(0) }],
                success: vec![TxnOp::delete(key)],
                failure: vec![],
            })
            .await?;
        Ok(r.succeeded)
    }
    /// Atomic compare-and-swap transaction.
    async fn txn(&self, txn: Txn) -> Result<TxnResult>;
    /// Changes under `prefix` committed after this call returns.
    async fn watch(&self, prefix: &str) -> Result<WatchStream>;
    /// A lease of `ttl_seconds`; keys put with it vanish when it expires.
    async fn grant_lease(&self, ttl_seconds: i64) -> Result<LeaseId>;
    /// Renews a lease; returns its TTL in seconds (error if it expired).
    async fn keep_alive(&self, lease: LeaseId) -> Result<i64>;
    /// Ends a lease now, deleting its keys.
    async fn revoke_lease(&self, lease: LeaseId) -> Result<()>;
    /// Drops the change history up to `revision` so its space can be
    /// reused (etcd's compaction, etcd docs "Maintenance: History
    /// compaction"): watches and reads at older revisions fail after it.
    /// The embedded store keeps no history: nothing to do.
    async fn compact(&self, revision: Revision) -> Result<()> {
        let _ = revision;
        Ok(())
    }
    /// Whether the store takes writes now (for readiness): `Err` saying
    /// why when it does not. The embedded store, after a failed write,
    /// retries with a probe write; etcd answers a linearizable read (it
    /// needs a quorum).
    async fn ready(&self) -> Result<()> {
        Ok(())
    }
    /// The store's raised alarms (etcd: `NOSPACE`, `CORRUPT`; none for a
    /// store without alarms). A store with an alarm refuses writes.
    async fn alarms(&self) -> Result<Vec<String>> {
        Ok(Vec::new())
    }
    /// Human description (`embedded:/path`, `etcd://h1:2379`).
    fn describe(&self) -> String;
    /// Most operations (and compares) one transaction may hold: etcd's
    /// `--max-txn-ops` (default 128, etcd docs "Configuration flags"); no
    /// limit for the embedded store.
    fn max_txn_ops(&self) -> usize {
        usize::MAX
    }
    /// Largest transaction request in bytes: etcd's `--max-request-bytes`
    /// (default 1.5 MiB) less headroom; no limit for the embedded store.
    fn max_txn_bytes(&self) -> usize {
        usize::MAX
    }
}
