//! The history in PostgreSQL (`server --history postgres://USER@HOST:PORT/DB`):
//! finished runs' records in one table partitioned by month of their slot
//! (`punchclock_runs`, a partition `punchclock_runs_yYYYYmMM` made when a
//! record of that month first comes; retention drops whole partitions),
//! with indexes for the filters a listing takes. Pages follow the keyset
//! `(scheduled_at, run_id)`, the table's primary key.
//!
//! The schema is versioned (`punchclock_schema`): [`PgHistory::connect`]
//! applies what is missing under an advisory lock, so replicas starting at
//! once apply each migration once.
//!
//! Records are the store's own JSON (`codec`), kept as `jsonb`.

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Datelike, TimeZone, Utc};
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};

use super::{Count, Cursor, HistoryPage, HistoryQuery, HistoryStore};
use crate::error::{Error, Result};
use crate::model::RunRecord;
use crate::repo::codec;

/// Schema migrations, in order: `(version, SQL)`. Applied once each.
const MIGRATIONS: &[(i32, &str)] = &[
    (
        1,
        "CREATE TABLE punchclock_runs (
        run_id text NOT NULL,
        task_id text NOT NULL,
        scheduled_at timestamptz NOT NULL,
        status text NOT NULL,
        trigger_kind text NOT NULL,
        event_key text NOT NULL DEFAULT '',
        finished_at timestamptz,
        record jsonb NOT NULL,
        PRIMARY KEY (scheduled_at, run_id)
    ) PARTITION BY RANGE (scheduled_at);
    CREATE INDEX punchclock_runs_task ON punchclock_runs (task_id, scheduled_at, run_id);
    CREATE INDEX punchclock_runs_status ON punchclock_runs (status, scheduled_at, run_id);
    CREATE INDEX punchclock_runs_run_id ON punchclock_runs (run_id);",
    ),
    (
        // Byte order for ids, as the store's keys and the merge of the live and
        // archived runs sort them: under a linguistic collation (a database
        // made with en_US.UTF-8 or ICU, the usual default) `ORDER BY run_id`
        // and the keyset's `>` disagreed with the merge, and pages lost runs
        // that shared a slot (`Ab.x` and `aa.x`, `load.x` and `load_x.x`).
        2,
        "ALTER TABLE punchclock_runs
        ALTER COLUMN run_id TYPE text COLLATE \"C\",
        ALTER COLUMN task_id TYPE text COLLATE \"C\",
        ALTER COLUMN status TYPE text COLLATE \"C\",
        ALTER COLUMN trigger_kind TYPE text COLLATE \"C\",
        ALTER COLUMN event_key TYPE text COLLATE \"C\";",
    ),
];

/// Longest any one statement may take, measured here: a PostgreSQL that
/// hangs (stopped, or its disk stalled) holds a connection without closing
/// it, and the mover must see that as the archive away, not wait for ever.
const STATEMENT_TIMEOUT: Duration = Duration::from_secs(10);

/// `f` within [`STATEMENT_TIMEOUT`], else a store error naming `what`.
async fn within<T>(what: &str, f: impl std::future::Future<Output = Result<T>>) -> Result<T> {
    match tokio::time::timeout(STATEMENT_TIMEOUT, f).await {
        Ok(r) => r,
        Err(_) => Err(Error::Store(format!("postgres ({what}): no answer within {} s", STATEMENT_TIMEOUT.as_secs()))),
    }
}

/// The advisory lock migrations take (any constant: "punchclock" in ASCII).
const MIGRATION_LOCK: i64 = 0x7075_6e63_6863_6c6b;

/// Where and how to reach PostgreSQL.
#[derive(Debug, Clone)]
pub struct PgSpec {
    /// `postgres://USER@HOST:PORT/DB[?sslmode=require]` (libpq's URL form).
    pub url: String,
    /// A file holding the password (its first line), if any.
    pub password_file: Option<std::path::PathBuf>,
    /// PEM CA certificates to verify the server with (TLS); the web PKI
    /// roots when unset.
    pub ca_file: Option<std::path::PathBuf>,
}

/// [`HistoryStore`] on PostgreSQL.
pub struct PgHistory {
    pool: Pool,
    /// Months whose partition exists (first day of the month, UTC).
    partitions: Mutex<HashSet<(i32, u32)>>,
}

fn pg_err(what: &str) -> impl Fn(tokio_postgres::Error) -> Error + '_ {
    move |e| {
        let detail = e.as_db_error().map(|d| format!("{}: {}", d.code().code(), d.message())).unwrap_or_else(|| e.to_string());
        Error::Store(format!("postgres ({what}): {detail}"))
    }
}

fn pool_err(e: deadpool_postgres::PoolError) -> Error {
    Error::Store(format!("postgres: {e}"))
}

/// The first instants of the month of `t` and of the next one (UTC).
fn month_bounds(t: DateTime<Utc>) -> (DateTime<Utc>, DateTime<Utc>) {
    let start = Utc.with_ymd_and_hms(t.year(), t.month(), 1, 0, 0, 0).single().unwrap_or(t);
    let (y, m) = if t.month() == 12 { (t.year() + 1, 1) } else { (t.year(), t.month() + 1) };
    (start, Utc.with_ymd_and_hms(y, m, 1, 0, 0, 0).single().unwrap_or(t))
}

impl PgHistory {
    /// Connects (a pool of up to 8 connections) and applies the schema's
    /// missing migrations.
    ///
    /// Errors: `InvalidArgument` naming `--history` (a malformed URL) or
    /// `--history-password-file`/`--history-ca-file` (unreadable);
    /// [`Error::Store`] when PostgreSQL does not answer or refuses.
    pub async fn connect(spec: &PgSpec) -> Result<PgHistory> {
        let mut cfg: tokio_postgres::Config = spec.url.parse().map_err(|e| Error::invalid("--history", format!("{e}")))?;
        if let Some(f) = &spec.password_file {
            let text =
                std::fs::read_to_string(f).map_err(|e| Error::invalid("--history-password-file", format!("{}: {e}", f.display())))?;
            cfg.password(text.lines().next().unwrap_or_default());
        }
        cfg.connect_timeout(Duration::from_secs(5));
        let tls = tls_connector(spec.ca_file.as_deref())?;
        let manager = Manager::from_config(cfg, tls, ManagerConfig { recycling_method: RecyclingMethod::Fast });
        let pool = Pool::builder(manager)
            .max_size(8)
            .wait_timeout(Some(Duration::from_secs(10)))
            .create_timeout(Some(Duration::from_secs(5)))
            .recycle_timeout(Some(Duration::from_secs(5)))
            .runtime(deadpool_postgres::Runtime::Tokio1)
            .build()
            .map_err(|e| Error::Internal(format!("postgres pool: {e}")))?;
        let h = PgHistory { pool, partitions: Mutex::new(HashSet::new()) };
        h.migrate().await?;
        Ok(h)
    }

    /// Applies the migrations the schema lacks, under an advisory lock.
    async fn migrate(&self) -> Result<()> {
        let mut c = self.pool.get().await.map_err(pool_err)?;
        let tx = c.transaction().await.map_err(pg_err("begin"))?;
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK]).await.map_err(pg_err("lock"))?;
        tx.batch_execute(
            "CREATE TABLE IF NOT EXISTS punchclock_schema (version integer PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())",
        )
        .await
        .map_err(pg_err("schema table"))?;
        let applied: HashSet<i32> =
            tx.query("SELECT version FROM punchclock_schema", &[]).await.map_err(pg_err("schema"))?.iter().map(|r| r.get(0)).collect();
        for (version, sql) in MIGRATIONS {
            if applied.contains(version) {
                continue;
            }
            tx.batch_execute(sql).await.map_err(pg_err("migration"))?;
            tx.execute("INSERT INTO punchclock_schema (version) VALUES ($1)", &[version]).await.map_err(pg_err("schema"))?;
            tracing::info!(version, "history schema migrated");
        }
        tx.commit().await.map_err(pg_err("commit"))
    }

    /// Makes the month partitions of `slots` that are not known to exist.
    async fn ensure_partitions(&self, c: &deadpool_postgres::Client, slots: impl Iterator<Item = DateTime<Utc>>) -> Result<()> {
        let wanted: HashSet<(i32, u32)> = slots.map(|t| (t.year(), t.month())).collect();
        let missing: Vec<(i32, u32)> = {
            let known = self.partitions.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            wanted.into_iter().filter(|m| !known.contains(m)).collect()
        };
        for (y, m) in missing {
            let (from, to) = month_bounds(Utc.with_ymd_and_hms(y, m, 1, 0, 0, 0).single().unwrap_or_default());
            let sql = format!(
                "CREATE TABLE IF NOT EXISTS punchclock_runs_y{y:04}m{m:02} PARTITION OF punchclock_runs FOR VALUES FROM ('{}') TO ('{}')",
                from.to_rfc3339(),
                to.to_rfc3339()
            );
            c.batch_execute(&sql).await.map_err(pg_err("partition"))?;
            self.partitions.lock().unwrap_or_else(std::sync::PoisonError::into_inner).insert((y, m));
        }
        Ok(())
    }

    /// Drops the month partitions that ended before `cutoff`; returns
    /// their names.
    ///
    /// Errors: [`Error::Store`].
    pub async fn drop_partitions_before(&self, cutoff: DateTime<Utc>) -> Result<Vec<String>> {
        let c = self.pool.get().await.map_err(pool_err)?;
        let rows = c
            .query(
                "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
                 WHERE i.inhparent = 'punchclock_runs'::regclass ORDER BY c.relname",
                &[],
            )
            .await
            .map_err(pg_err("partitions"))?;
        let mut dropped = Vec::new();
        for row in rows {
            let name: String = row.get(0);
            let Some((y, m)) = name.strip_prefix("punchclock_runs_y").and_then(|r| r.split_once('m')) else { continue };
            let (Ok(y), Ok(m)) = (y.parse::<i32>(), m.parse::<u32>()) else { continue };
            let Some(start) = Utc.with_ymd_and_hms(y, m, 1, 0, 0, 0).single() else { continue };
            if month_bounds(start).1 <= cutoff {
                c.batch_execute(&format!("DROP TABLE IF EXISTS {name}")).await.map_err(pg_err("drop partition"))?;
                self.partitions.lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(&(y, m));
                dropped.push(name);
            }
        }
        Ok(dropped)
    }

    /// The statement and parameters of a page (or, with `count`, its count).
    fn select(q: &HistoryQuery, count: bool) -> (String, Vec<Box<dyn tokio_postgres::types::ToSql + Sync + Send>>) {
        let mut sql = String::from(if count {
            "SELECT count(*) FROM punchclock_runs WHERE true"
        } else {
            "SELECT record::text FROM punchclock_runs WHERE true"
        });
        let mut params: Vec<Box<dyn tokio_postgres::types::ToSql + Sync + Send>> = Vec::new();
        let mut add = |sql: &mut String, clause: &str, p: Box<dyn tokio_postgres::types::ToSql + Sync + Send>| {
            params.push(p);
            sql.push_str(&clause.replace('$', &format!("${}", params.len())));
        };
        if !q.task_id.is_empty() {
            add(&mut sql, " AND task_id = $", Box::new(q.task_id.clone()));
        }
        if !q.task_prefix.is_empty() {
            let like = q.task_prefix.replace('\\', "\\\\").replace('%', "\\%").replace('_', "\\_") + "%";
            add(&mut sql, " AND task_id LIKE $", Box::new(like));
        }
        if let Some(f) = q.from {
            add(&mut sql, " AND scheduled_at >= $", Box::new(f));
        }
        if let Some(t) = q.to {
            add(&mut sql, " AND scheduled_at < $", Box::new(t));
        }
        if let Some(s) = q.status {
            add(&mut sql, " AND status = $", Box::new(s.as_str().to_string()));
        }
        if let Some(k) = q.trigger {
            add(&mut sql, " AND trigger_kind = $", Box::new(k.as_str().to_string()));
        }
        if !q.event_key.is_empty() {
            add(&mut sql, " AND event_key = $", Box::new(q.event_key.clone()));
        }
        if count {
            return (sql, params);
        }
        if let Some(c) = &q.after {
            let op = if q.newest_first { "<" } else { ">" };
            add(&mut sql, &format!(" AND (scheduled_at, run_id) {op} ($::timestamptz"), Box::new(c.slot));
            add(&mut sql, ", $::text)", Box::new(c.run_id.clone()));
        }
        let dir = if q.newest_first { "DESC" } else { "ASC" };
        sql.push_str(&format!(" ORDER BY scheduled_at {dir}, run_id {dir} LIMIT {}", q.limit.clamp(1, 10_000) + 1));
        (sql, params)
    }
}

/// rustls for PostgreSQL connections: the CA file's roots, else the web
/// PKI's (used only when the URL's `sslmode` asks for TLS or the server
/// offers it).
fn tls_connector(ca_file: Option<&std::path::Path>) -> Result<tokio_postgres_rustls::MakeRustlsConnect> {
    let mut roots = rustls::RootCertStore::empty();
    match ca_file {
        Some(f) => {
            let pem = std::fs::read(f).map_err(|e| Error::invalid("--history-ca-file", format!("{}: {e}", f.display())))?;
            use rustls_pki_types::pem::PemObject as _;
            for cert in rustls_pki_types::CertificateDer::pem_slice_iter(&pem) {
                let cert = cert.map_err(|e| Error::invalid("--history-ca-file", format!("{}: {e}", f.display())))?;
                roots.add(cert).map_err(|e| Error::invalid("--history-ca-file", format!("{}: {e}", f.display())))?;
            }
        }
        None => roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::Internal(format!("tls: {e}")))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(tokio_postgres_rustls::MakeRustlsConnect::new(config))
}

#[async_trait]
impl HistoryStore for PgHistory {
    fn kind(&self) -> &'static str {
        "postgres"
    }

    /// One statement for the batch (`UNNEST` of arrays), replacing an
    /// earlier record of the same run.
    async fn record(&self, runs: &[RunRecord]) -> Result<()> {
        if runs.is_empty() {
            return Ok(());
        }
        within("record", self.record_now(runs)).await
    }

    async fn get(&self, run_id: &str) -> Result<Option<RunRecord>> {
        within("get", async {
            let c = self.pool.get().await.map_err(pool_err)?;
            let row = c
                .query_opt("SELECT record::text FROM punchclock_runs WHERE run_id = $1 LIMIT 1", &[&run_id])
                .await
                .map_err(pg_err("get"))?;
            row.map(|r| codec::decode::<RunRecord>("run", r.get::<_, &str>(0).as_bytes())).transpose()
        })
        .await
    }

    async fn page(&self, q: &HistoryQuery) -> Result<HistoryPage> {
        within("page", self.page_now(q)).await
    }

    async fn expire_before(&self, cutoff: DateTime<Utc>) -> Result<u64> {
        Ok(within("expire", self.drop_partitions_before(cutoff)).await?.len() as u64)
    }

    async fn contains(&self, run_ids: &[String]) -> Result<Vec<bool>> {
        within("contains", async {
            let c = self.pool.get().await.map_err(pool_err)?;
            let rows =
                c.query("SELECT run_id FROM punchclock_runs WHERE run_id = ANY($1)", &[&run_ids]).await.map_err(pg_err("contains"))?;
            let found: HashSet<String> = rows.iter().map(|r| r.get(0)).collect();
            Ok(run_ids.iter().map(|id| found.contains(id)).collect())
        })
        .await
    }

    /// Exact (the indexes answer it).
    async fn count(&self, q: &HistoryQuery) -> Result<Count> {
        within("count", async {
            let c = self.pool.get().await.map_err(pool_err)?;
            let (sql, params) = Self::select(q, true);
            let refs: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = params.iter().map(|p| p.as_ref() as _).collect();
            let n: i64 = c.query_one(&sql, &refs).await.map_err(pg_err("count"))?.get(0);
            Ok(Count { runs: u64::try_from(n).unwrap_or(0), exact: true })
        })
        .await
    }
}

impl PgHistory {
    /// [`HistoryStore::record`] without its time limit.
    async fn record_now(&self, runs: &[RunRecord]) -> Result<()> {
        let c = self.pool.get().await.map_err(pool_err)?;
        self.ensure_partitions(&c, runs.iter().map(|r| r.scheduled_at)).await?;
        let mut ids = Vec::with_capacity(runs.len());
        let (mut tasks, mut slots, mut statuses, mut kinds, mut keys, mut finished, mut records) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for r in runs {
            ids.push(r.run_id.clone());
            tasks.push(r.task_id.clone());
            slots.push(r.scheduled_at);
            statuses.push(r.status.as_str().to_string());
            kinds.push(r.trigger.as_str().to_string());
            keys.push(r.event.as_ref().map(|e| e.key.clone()).unwrap_or_default());
            finished.push(r.finished_at);
            records.push(String::from_utf8(codec::encode(r)?).map_err(|e| Error::Internal(format!("run JSON: {e}")))?);
        }
        c.execute(
            "INSERT INTO punchclock_runs (run_id, task_id, scheduled_at, status, trigger_kind, event_key, finished_at, record)
             SELECT i, t, s, st, k, e, f, r::jsonb FROM UNNEST($1::text[], $2::text[], $3::timestamptz[], $4::text[], $5::text[], $6::text[], $7::timestamptz[], $8::text[])
                 AS u(i, t, s, st, k, e, f, r)
             ON CONFLICT (scheduled_at, run_id) DO UPDATE SET status = EXCLUDED.status, finished_at = EXCLUDED.finished_at, record = EXCLUDED.record",
            &[&ids, &tasks, &slots, &statuses, &kinds, &keys, &finished, &records],
        )
        .await
        .map_err(pg_err("record"))?;
        Ok(())
    }

    /// [`HistoryStore::page`] without its time limit.
    async fn page_now(&self, q: &HistoryQuery) -> Result<HistoryPage> {
        let c = self.pool.get().await.map_err(pool_err)?;
        let (sql, params) = Self::select(q, false);
        let refs: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = params.iter().map(|p| p.as_ref() as _).collect();
        let rows = c.query(&sql, &refs).await.map_err(pg_err("page"))?;
        let limit = q.limit.clamp(1, 10_000);
        let more = rows.len() > limit;
        let mut runs = Vec::with_capacity(rows.len().min(limit));
        for row in rows.iter().take(limit) {
            runs.push(codec::decode::<RunRecord>("run", row.get::<_, &str>(0).as_bytes())?);
        }
        let next = if more { runs.last().map(Cursor::of) } else { None };
        Ok(HistoryPage { runs, next })
    }
}
