//! The etcd store (etcd v3 API through `etcd-client`): the production
//! backend for any number of control-plane replicas. Keys are used as given
//! (the [`super::Keys`] prefix namespaces them). Every request has a
//! deadline, so a cluster without quorum answers with an error instead of
//! hanging the caller (etcd blocks writes and linearizable reads without
//! quorum: etcd docs, "Failure modes").

use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{Client, ConnectOptions, EventType, GetOptions, WatchOptions};
use futures::StreamExt;

use super::{CompareOp, CompareTarget, KeyValue, KvStore, LeaseId, Revision, Txn, TxnOp, TxnResult, WatchEvent, WatchStream};
use crate::error::{Error, Result};

/// etcd's default `--max-txn-ops` (etcd docs, "Configuration flags").
pub const MAX_TXN_OPS: usize = 128;
/// etcd's default `--max-request-bytes` is 1.5 MiB; batches stay at 1 MiB
/// so keys, compares and framing fit.
pub const MAX_TXN_BYTES: usize = 1024 * 1024;

/// Largest etcd response this client decodes (tonic's default is 4 MiB).
/// Ranges are read in pages sized to stay near [`RANGE_PAGE_BYTES`]; this
/// is the margin for a page of records of the largest size (a run record
/// is at most 512 KiB, a task about 260 KiB) and for watch responses.
pub const MAX_RESPONSE_BYTES: usize = 64 * 1024 * 1024;
/// What a range page aims at: the next page's key count is chosen from the
/// average record size so far.
pub const RANGE_PAGE_BYTES: usize = 2 * 1024 * 1024;
/// Keys in the first page of a range (and the most in any page).
const FIRST_PAGE_KEYS: usize = 64;
const MAX_PAGE_KEYS: usize = 1024;

/// HTTP/2 keepalive pings to etcd: above etcd's default
/// `--grpc-keepalive-min-time` of 5 s (etcd docs, "Configuration flags").
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);

/// Deadline of one etcd request.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(3);

fn err(e: etcd_client::Error) -> Error {
    let text = e.to_string();
    if text.contains("database space exceeded") {
        return Error::Store(format!("etcd: {text} ({NOSPACE_HELP})"));
    }
    Error::Store(format!("etcd: {text}"))
}

/// What to do when etcd's database reached its quota (its `NOSPACE`
/// alarm): etcd then takes only reads and deletes, so no leader can be
/// elected or write.
pub const NOSPACE_HELP: &str = "etcd's database reached its quota (--quota-backend-bytes) and it raised the NOSPACE alarm: \
it takes only reads and deletes, so nothing is scheduled. Free space: `punchclock runs prune` deletes finished runs beyond \
their history even without a leader while the alarm is on; then defragment every member and disarm the alarm \
(`etcdctl --endpoints=... defrag --cluster && etcdctl --endpoints=... alarm disarm`, etcdctl from Debian's etcd-client); \
then raise --quota-backend-bytes or shorten the history (--history-max-age, a task's history.keep_last)";

fn kv_of(kv: &etcd_client::KeyValue) -> KeyValue {
    KeyValue {
        key: String::from_utf8_lossy(kv.key()).into_owned(),
        value: kv.value().to_vec(),
        create_revision: kv.create_revision(),
        mod_revision: kv.mod_revision(),
        version: kv.version(),
        lease: kv.lease(),
    }
}

/// The etcd-backed [`KvStore`].
#[derive(Clone)]
pub struct EtcdStore {
    client: Client,
    endpoints: Vec<String>,
}

/// TLS and authentication for the etcd client (`server --etcd-ca`,
/// `--etcd-cert`, `--etcd-key`, `--etcd-user`). The default is plain
/// `http://` with no user.
#[derive(Clone, Default)]
pub struct EtcdSecurity {
    /// CA certificate (PEM) that signed etcd's server certificate.
    pub ca_pem: Option<Vec<u8>>,
    /// Client certificate and key (PEM), for etcd's `--client-cert-auth`.
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
    /// etcd user and password.
    pub user: Option<(String, String)>,
}

impl EtcdSecurity {
    /// Whether the endpoints are `https://`.
    pub fn tls(&self) -> bool {
        self.ca_pem.is_some() || self.identity.is_some()
    }
}

impl std::fmt::Debug for EtcdSecurity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the password.
        f.debug_struct("EtcdSecurity")
            .field("tls", &self.tls())
            .field("client_cert", &self.identity.is_some())
            .field("user", &self.user.as_ref().map(|(u, _)| u))
            .finish()
    }
}

impl EtcdStore {
    /// Connects to `endpoints` (`host:port` or `http://host:port`).
    ///
    /// Errors: [`Error::Store`] when no endpoint answers within the timeout.
    pub async fn connect(endpoints: &[String]) -> Result<Self> {
        EtcdStore::connect_with(endpoints, &EtcdSecurity::default()).await
    }

    /// [`EtcdStore::connect`] with TLS and etcd authentication: the
    /// endpoints must then be `https://` (etcd's `--client-cert-auth`,
    /// `--trusted-ca-file`; users per etcd's RBAC, `etcdctl user add`).
    ///
    /// Errors: as [`EtcdStore::connect`]; a certificate or key that does
    /// not parse; a refused user or password (`authentication failed`).
    pub async fn connect_with(endpoints: &[String], security: &EtcdSecurity) -> Result<Self> {
        let mut opts = ConnectOptions::new();
        if security.ca_pem.is_some() || security.identity.is_some() {
            let mut tls = etcd_client::TlsOptions::new();
            if let Some(ca) = &security.ca_pem {
                tls = tls.ca_certificate(etcd_client::Certificate::from_pem(ca));
            }
            if let Some((cert, key)) = &security.identity {
                tls = tls.identity(etcd_client::Identity::from_pem(cert, key));
            }
            opts = opts.with_tls(tls);
        }
        if let Some((user, password)) = &security.user {
            opts = opts.with_user(user.clone(), password.clone());
        }
        let opts = opts
            .with_connect_timeout(REQUEST_TIMEOUT)
            .with_timeout(REQUEST_TIMEOUT)
            // etcd closes connections that ping more often than its
            // `--grpc-keepalive-min-time` (5 s by default): pinging every
            // 2 s, a quiet connection was dropped every ~8 s and every
            // watch broke with it. Requests have their own deadline.
            .with_keep_alive(KEEPALIVE_INTERVAL, Duration::from_secs(3));
        // One line saying why (the innermost cause: "Connection refused"),
        // not the transport's whole chain.
        let unreachable = |e: etcd_client::Error| {
            let mut cause: &dyn std::error::Error = match &e {
                etcd_client::Error::GRpcStatus(status) => status,
                etcd_client::Error::TransportError(t) => t,
                other => other,
            };
            while let Some(next) = cause.source() {
                cause = next;
            }
            Error::Store(format!("etcd at {} unreachable: {cause}", endpoints.join(",")))
        };
        let client = Client::connect(endpoints, Some(opts)).await.map_err(unreachable)?;
        let store = EtcdStore { client, endpoints: endpoints.to_vec() };
        // Fail fast when etcd is not there at all.
        store.kv().get("/punchclock-probe", None).await.map_err(unreachable)?;
        Ok(store)
    }

    /// A clone of the underlying client (for the election).
    pub fn client(&self) -> Client {
        self.client.clone()
    }
}

fn compare(c: &super::Compare) -> etcd_client::Compare {
    use etcd_client::CompareOp as Op;
    let op = match c.op {
        CompareOp::Equal => Op::Equal,
        CompareOp::NotEqual => Op::NotEqual,
        CompareOp::Less => Op::Less,
        CompareOp::Greater => Op::Greater,
    };
    let key = c.key.as_bytes().to_vec();
    match &c.target {
        CompareTarget::CreateRevision(r) => etcd_client::Compare::create_revision(key, op, *r),
        CompareTarget::ModRevision(r) => etcd_client::Compare::mod_revision(key, op, *r),
        CompareTarget::Version(v) => etcd_client::Compare::version(key, op, *v),
        CompareTarget::Value(v) => etcd_client::Compare::value(key, op, v.clone()),
    }
}

fn op(o: &TxnOp) -> etcd_client::TxnOp {
    match o {
        TxnOp::Put { key, value, lease } => {
            let opts = (*lease != 0).then(|| etcd_client::PutOptions::new().with_lease(*lease));
            etcd_client::TxnOp::put(key.as_bytes().to_vec(), value.clone(), opts)
        }
        TxnOp::Delete { key } => etcd_client::TxnOp::delete(key.as_bytes().to_vec(), None),
        TxnOp::Get { key } => etcd_client::TxnOp::get(key.as_bytes().to_vec(), None),
    }
}

impl EtcdStore {
    /// The KV client, decoding responses up to [`MAX_RESPONSE_BYTES`].
    fn kv(&self) -> etcd_client::KvClient {
        self.client.kv_client().max_decoding_message_size(MAX_RESPONSE_BYTES)
    }

    /// At most `limit` keys under `prefix` strictly after `after`, read at
    /// `revision` (0: the latest); returns them, the revision read at, and
    /// whether more keys follow.
    async fn page(
        &self,
        prefix: &str,
        after: &str,
        limit: usize,
        keys_only: bool,
        revision: Revision,
    ) -> Result<(Vec<KeyValue>, Revision, bool)> {
        // Start just after `after` (a key followed by a NUL byte is the
        // next possible key); end where the prefix ends.
        let start: Vec<u8> = if after > prefix { [after.as_bytes(), &[0]].concat() } else { prefix.as_bytes().to_vec() };
        let mut options = GetOptions::new().with_range(prefix_end(prefix.as_bytes())).with_limit(limit as i64).with_revision(revision);
        if keys_only {
            options = options.with_keys_only();
        }
        let r = self.kv().get(start, Some(options)).await.map_err(err)?;
        let rev = r.header().map_or(0, |h| h.revision());
        Ok((r.kvs().iter().map(kv_of).collect(), rev, r.more()))
    }
}

#[async_trait]
impl KvStore for EtcdStore {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>> {
        let r = self.kv().get(key, None).await.map_err(err)?;
        Ok(r.kvs().first().map(kv_of))
    }

    /// In pages (every page at the first page's revision, so the whole is
    /// one consistent read): no response grows with the number of keys.
    async fn range(&self, prefix: &str) -> Result<(Vec<KeyValue>, Revision)> {
        let (mut out, mut after, mut limit, mut revision) = (Vec::new(), String::new(), FIRST_PAGE_KEYS, 0);
        loop {
            let (page, rev, more) = self.page(prefix, &after, limit, false, revision).await?;
            revision = rev;
            let bytes: usize = page.iter().map(|kv| kv.key.len() + kv.value.len()).sum();
            limit = (RANGE_PAGE_BYTES / (bytes / page.len().max(1)).max(1)).clamp(1, MAX_PAGE_KEYS);
            after = page.last().map(|kv| kv.key.clone()).unwrap_or_default();
            out.extend(page);
            if !more {
                return Ok((out, revision));
            }
        }
    }

    async fn range_page(&self, prefix: &str, after: &str, limit: usize, keys_only: bool) -> Result<Vec<KeyValue>> {
        Ok(self.page(prefix, after, limit, keys_only, 0).await?.0)
    }

    async fn range_page_rev(&self, prefix: &str, before: &str, limit: usize, keys_only: bool) -> Result<Vec<KeyValue>> {
        let end: Vec<u8> =
            if !before.is_empty() && before.starts_with(prefix) { before.as_bytes().to_vec() } else { prefix_end(prefix.as_bytes()) };
        let mut options = GetOptions::new()
            .with_range(end)
            .with_limit(limit as i64)
            .with_sort(etcd_client::SortTarget::Key, etcd_client::SortOrder::Descend);
        if keys_only {
            options = options.with_keys_only();
        }
        let r = self.kv().get(prefix, Some(options)).await.map_err(err)?;
        Ok(r.kvs().iter().map(kv_of).collect())
    }

    fn max_txn_ops(&self) -> usize {
        MAX_TXN_OPS
    }

    fn max_txn_bytes(&self) -> usize {
        MAX_TXN_BYTES
    }

    async fn txn(&self, txn: Txn) -> Result<TxnResult> {
        let t = etcd_client::Txn::new()
            .when(txn.compares.iter().map(compare).collect::<Vec<_>>())
            .and_then(txn.success.iter().map(op).collect::<Vec<_>>())
            .or_else(txn.failure.iter().map(op).collect::<Vec<_>>());
        let r = self.kv().txn(t).await.map_err(err)?;
        let gets = r
            .op_responses()
            .into_iter()
            .filter_map(|resp| match resp {
                etcd_client::TxnOpResponse::Get(g) => Some(g.kvs().first().map(kv_of)),
                _ => None,
            })
            .collect();
        Ok(TxnResult { succeeded: r.succeeded(), revision: r.header().map_or(0, |h| h.revision()), gets })
    }

    async fn watch(&self, prefix: &str) -> Result<WatchStream> {
        let stream = self
            .client
            .watch_client()
            .max_decoding_message_size(MAX_RESPONSE_BYTES)
            .watch(prefix, Some(WatchOptions::new().with_prefix()))
            .await
            .map_err(err)?;
        let s = futures::stream::unfold(Some(stream), |state| async move {
            let mut stream = state?;
            match stream.message().await {
                Ok(Some(resp)) => {
                    if resp.canceled() {
                        let reason = resp.cancel_reason().to_string();
                        return Some((vec![Err(Error::Store(format!("etcd watch cancelled: {reason}")))], None));
                    }
                    let evs: Vec<Result<WatchEvent>> = resp
                        .events()
                        .iter()
                        .filter_map(|e| {
                            let kv = e.kv()?;
                            Some(Ok(match e.event_type() {
                                EventType::Put => WatchEvent::Put(kv_of(kv)),
                                EventType::Delete => WatchEvent::Delete {
                                    key: String::from_utf8_lossy(kv.key()).into_owned(),
                                    mod_revision: kv.mod_revision(),
                                },
                            }))
                        })
                        .collect();
                    Some((evs, Some(stream)))
                }
                Ok(None) => Some((vec![Err(Error::Store("etcd watch ended".into()))], None)),
                Err(e) => Some((vec![Err(err(e))], None)),
            }
        })
        .flat_map(futures::stream::iter);
        Ok(s.boxed())
    }

    async fn grant_lease(&self, ttl_seconds: i64) -> Result<LeaseId> {
        Ok(self.client.lease_client().grant(ttl_seconds, None).await.map_err(err)?.id())
    }

    async fn keep_alive(&self, lease: LeaseId) -> Result<i64> {
        let (mut keeper, mut stream) = self.client.lease_client().keep_alive(lease).await.map_err(err)?;
        keeper.keep_alive().await.map_err(err)?;
        match tokio::time::timeout(REQUEST_TIMEOUT, stream.message()).await {
            Ok(Ok(Some(r))) if r.ttl() > 0 => Ok(r.ttl()),
            Ok(Ok(_)) => Err(Error::Store(format!("lease {lease} expired"))),
            Ok(Err(e)) => Err(err(e)),
            Err(_) => Err(Error::Store(format!("lease {lease} keep-alive timed out"))),
        }
    }

    async fn revoke_lease(&self, lease: LeaseId) -> Result<()> {
        self.client.lease_client().revoke(lease).await.map_err(err)?;
        Ok(())
    }

    async fn ready(&self) -> Result<()> {
        self.get("/punchclock-probe").await.map(|_| ())
    }

    async fn alarms(&self) -> Result<Vec<String>> {
        let r =
            self.client.maintenance_client().alarm(etcd_client::AlarmAction::Get, etcd_client::AlarmType::None, None).await.map_err(err)?;
        let mut names: Vec<String> = r.alarms().iter().map(|a| a.alarm().as_str_name().to_string()).collect();
        names.sort();
        names.dedup();
        Ok(names)
    }

    async fn compact(&self, revision: Revision) -> Result<()> {
        // Physical: the answer waits until etcd has removed the old
        // revisions, so a defragmentation right after it frees their space
        // (a logical compaction returns first and frees it later; a
        // defragment in between freed nothing and the NOSPACE alarm came
        // back on the next write).
        match self.kv().compact(revision, Some(etcd_client::CompactionOptions::new().with_physical())).await {
            Ok(_) => Ok(()),
            // Someone (etcd's own auto-compaction) compacted further already.
            Err(e) if e.to_string().contains("required revision has been compacted") => Ok(()),
            Err(e) => Err(err(e)),
        }
    }

    fn describe(&self) -> String {
        format!("etcd://{}", self.endpoints.iter().map(|e| e.trim_start_matches("http://")).collect::<Vec<_>>().join(","))
    }
}

/// The first key after every key starting with `prefix` (etcd's range end
/// for a prefix): the prefix with its last byte below 0xff incremented.
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // Every byte 0xff (or empty): to the end of the keyspace.
    vec![0]
}
