//! The cluster configuration: one document (YAML or JSON), one typed,
//! validated whole, stored in the store and versioned (`cluster.rs`;
//! `punchclock config apply -f FILE`, `config get`, `config diff -f FILE`;
//! a replica's `--config FILE` is stored when none is yet, and applied
//! again by SIGHUP on the leader). Each feature reads its section of the
//! running configuration ([`ConfigHandle`]), which follows the store.
//!
//! ```yaml
//! notifications: {max_attempts: 10, ...}   # delivery settings (crate::notify)
//! sinks: {alert: {url: https://...}}       # named webhook:// sinks
//! resources:                               # cluster-wide resources (resources.rs)
//!   search-api: {concurrency: 3}
//!   openai: {concurrency: 50, requests_per_minute: 500, tokens_per_minute: 200000}
//! quota_backoff: 15m                       # a quota_exhausted resource is held back this long
//! rate_limit_max_hold: 1h                  # longest retry_at an agent's rate_limited may ask for
//! budgets: [...]                           # spend limits over windows (budgets.rs)
//! prices: {gpt-4o: {input_per_1k: 0.0025, output_per_1k: 0.01}}
//! brokers:                                 # what queue triggers consume (brokers.rs)
//!   rabbit: {amqp: {url: "amqp://127.0.0.1:5672/%2f", credentials_file: /etc/punchclock/rabbit.cred}}
//! ```
//!
//! Errors name the field (`resources.openai.tokens_per_minute: ...`).

pub mod brokers;
pub mod budgets;
pub mod cluster;
pub mod resources;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use tokio::sync::watch;

pub use brokers::{Broker, BrokerKind};
pub use budgets::{BudgetDef, BudgetScope, BudgetWindow, OnExceeded, Price};
pub use resources::ResourceLimits;

use crate::error::{Error, Result};
use crate::notify::NotifyConfig;

/// Default `quota_backoff`: 15 minutes.
pub const DEFAULT_QUOTA_BACKOFF: Duration = Duration::from_secs(15 * 60);
/// Default `rate_limit_max_hold`: 1 hour.
pub const DEFAULT_RATE_LIMIT_MAX_HOLD: Duration = Duration::from_secs(3600);

/// The file as written.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigFile {
    /// Notification delivery settings.
    #[serde(default)]
    pub notifications: crate::notify::Settings,
    /// Named sinks (`webhook://NAME`).
    #[serde(default)]
    pub sinks: BTreeMap<String, crate::notify::SinkConfig>,
    /// Cluster-wide resources by name.
    #[serde(default)]
    pub resources: BTreeMap<String, resources::ResourceSpec>,
    /// How long a resource that answered `quota_exhausted` is held back
    /// (`"15m"`).
    #[serde(default)]
    pub quota_backoff: Option<String>,
    /// Longest wait a `rate_limited` outcome may ask for (`"1h"`).
    #[serde(default)]
    pub rate_limit_max_hold: Option<String>,
    /// Spend limits.
    #[serde(default)]
    pub budgets: Vec<budgets::BudgetSpec>,
    /// Prices per model, for agents that report tokens and a model but no cost.
    #[serde(default)]
    pub prices: BTreeMap<String, budgets::PriceSpec>,
    /// Message brokers of queue triggers, by name.
    #[serde(default)]
    pub brokers: BTreeMap<String, brokers::BrokerSpec>,
}

/// The validated configuration.
#[derive(Debug, Default)]
pub struct Config {
    /// Sinks and delivery settings.
    pub notify: NotifyConfig,
    /// Resources by name.
    pub resources: BTreeMap<String, ResourceLimits>,
    /// `quota_backoff`.
    pub quota_backoff: Duration,
    /// `rate_limit_max_hold`.
    pub rate_limit_max_hold: Duration,
    /// Budgets, in file order.
    pub budgets: Vec<BudgetDef>,
    /// Prices per model.
    pub prices: BTreeMap<String, Price>,
    /// Brokers by name.
    pub brokers: BTreeMap<String, Broker>,
    /// Its version in the store (0: not from the store — defaults, or a
    /// replica's file before it read the store).
    pub version: u64,
    /// The store revision of that version (what a task write validated
    /// against it compares; 0: none stored).
    pub revision: crate::store::Revision,
    /// The document it was read from (empty: the defaults).
    pub text: String,
}

impl Config {
    /// Reads and validates the file at `path`.
    ///
    /// Errors: `InvalidArgument` naming the field (`sinks.alert.url`, an
    /// unknown field's path) or `--config` for a file that cannot be read.
    pub fn load(path: &Path) -> Result<Config> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::invalid("--config", format!("cannot read {}: {e}", path.display())))?;
        Config::from_text(&text)
    }

    /// Parses and validates a config document.
    ///
    /// Errors: `InvalidArgument` naming the field.
    pub fn from_text(text: &str) -> Result<Config> {
        // A key twice in one mapping (`resources: {r: ..., r: ...}`) is
        // refused, as in a task file: the typed read below would keep the
        // last, and the document could not be compared (`config diff`).
        if let Err(e) = serde_yaml_ng::from_str::<serde_yaml_ng::Value>(text) {
            let msg = e.to_string();
            if let Some(i) = msg.find("duplicate entry") {
                let field = msg[..i].trim_end_matches([' ', ':']);
                return Err(Error::invalid(if field.is_empty() { "config" } else { field }, &msg[i..]));
            }
        }
        let de = serde_yaml_ng::Deserializer::from_str(text);
        let file: ConfigFile = serde_path_to_error::deserialize(de).map_err(|e| {
            let field = e.path().to_string();
            let field = if field == "." { "config".to_string() } else { field };
            // serde_yaml_ng's message may start with the path already.
            let msg = e.inner().to_string();
            let msg = msg.strip_prefix(&format!("{field}: ")).map(str::to_string).unwrap_or(msg);
            Error::invalid(field, msg)
        })?;
        let mut c = Config::from_file(file)?;
        c.text = text.to_string();
        Ok(c)
    }

    /// Validates a parsed file as a whole (a budget naming an undefined
    /// sink, a price of a model twice, ...).
    ///
    /// Errors: `InvalidArgument` naming the field.
    pub fn from_file(file: ConfigFile) -> Result<Config> {
        let notify = NotifyConfig::from_sections(&file.notifications, &file.sinks)?;
        let mut resources = BTreeMap::new();
        for (name, spec) in &file.resources {
            resources.insert(name.clone(), resources::validate(name, spec)?);
        }
        let duration = |field: &str, v: &Option<String>, default: Duration| -> Result<Duration> {
            match v {
                None => Ok(default),
                Some(s) => match crate::schedule::parse_duration(s) {
                    Ok(0) => Err(Error::invalid(field, "must be at least 1s")),
                    Ok(secs) if secs > 366 * 86_400 => Err(Error::invalid(field, "must be at most 366d")),
                    Ok(secs) => Ok(Duration::from_secs(secs)),
                    Err(e) => Err(Error::invalid(field, e)),
                },
            }
        };
        let quota_backoff = duration("quota_backoff", &file.quota_backoff, DEFAULT_QUOTA_BACKOFF)?;
        let rate_limit_max_hold = duration("rate_limit_max_hold", &file.rate_limit_max_hold, DEFAULT_RATE_LIMIT_MAX_HOLD)?;
        let mut prices = BTreeMap::new();
        for (model, p) in &file.prices {
            prices.insert(model.clone(), budgets::validate_price(model, p)?);
        }
        let mut budgets = Vec::new();
        let mut names = std::collections::BTreeSet::new();
        for (i, b) in file.budgets.iter().enumerate() {
            let def = budgets::validate(i, b, &notify)?;
            if !names.insert(def.name.clone()) {
                return Err(Error::invalid(format!("budgets[{i}].name"), format!("{:?} is used twice", def.name)));
            }
            budgets.push(def);
        }
        let mut brokers = BTreeMap::new();
        for (name, spec) in &file.brokers {
            brokers.insert(name.clone(), brokers::validate(name, spec)?);
        }
        Ok(Config {
            notify,
            resources,
            quota_backoff,
            rate_limit_max_hold,
            budgets,
            prices,
            brokers,
            version: 0,
            revision: 0,
            text: String::new(),
        })
    }

    /// The defaults (no file).
    pub fn defaults() -> Config {
        Config::from_file(ConfigFile::default()).unwrap_or_default()
    }
}

/// The running configuration, shared by every feature, replaced whole by a
/// reload; features hold the handle and read [`ConfigHandle::current`]
/// when they need it (or follow [`ConfigHandle::subscribe`]).
#[derive(Clone)]
pub struct ConfigHandle {
    tx: Arc<watch::Sender<Arc<Config>>>,
    path: Option<PathBuf>,
    /// This replica's file is applied when it differs from the stored
    /// configuration at start (a single-node store: the one replica's file
    /// is the cluster's).
    file_wins: bool,
}

impl std::fmt::Debug for ConfigHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConfigHandle").field("path", &self.path).finish_non_exhaustive()
    }
}

impl Default for ConfigHandle {
    fn default() -> Self {
        ConfigHandle::new(Config::defaults(), None)
    }
}

impl ConfigHandle {
    /// A handle on `config`, read from `path` (reloads read it again).
    pub fn new(config: Config, path: Option<PathBuf>) -> ConfigHandle {
        let (tx, _) = watch::channel(Arc::new(config));
        ConfigHandle { tx: Arc::new(tx), path, file_wins: false }
    }

    /// The same handle, whose file is applied at start when it differs from
    /// the stored configuration (a single-node store: `dev`, `server
    /// --store embedded:`; with replicas on etcd the stored one stands and a
    /// different file is only reported).
    pub fn with_file_wins(mut self) -> ConfigHandle {
        self.file_wins = true;
        self
    }

    /// See [`ConfigHandle::with_file_wins`].
    pub fn file_wins(&self) -> bool {
        self.file_wins
    }

    /// Loads `path` (none: the defaults).
    ///
    /// Errors: as [`Config::load`].
    pub fn load(path: Option<&Path>) -> Result<ConfigHandle> {
        let config = match path {
            Some(p) => Config::load(p)?,
            None => Config::defaults(),
        };
        Ok(ConfigHandle::new(config, path.map(Path::to_path_buf)))
    }

    /// The configuration now.
    pub fn current(&self) -> Arc<Config> {
        self.tx.borrow().clone()
    }

    /// Every change from now on.
    pub fn subscribe(&self) -> watch::Receiver<Arc<Config>> {
        self.tx.subscribe()
    }

    /// This replica's `--config` file (none: defaults only).
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// The text of this replica's `--config` file now (`None`: no file, or
    /// it cannot be read: logged).
    pub fn file_text(&self) -> Option<String> {
        let path = self.path.as_deref()?;
        match std::fs::read_to_string(path) {
            Ok(t) => Some(t),
            Err(e) => {
                tracing::error!(path = %path.display(), error = %e, "cannot read --config");
                None
            }
        }
    }

    /// Replaces the configuration (a reload that passed its checks).
    pub fn replace(&self, config: Config) {
        self.tx.send_replace(Arc::new(config));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_the_field_across_sections() {
        let err = |text: &str| Config::from_text(text).expect_err("invalid").to_string();
        assert!(err("sinks:\n  a:\n    url: ftp://x\n").starts_with("sinks.a.url"));
        assert!(
            err("resources:\n  openai: {concurrency: 0}\n").starts_with("resources.openai.concurrency"),
            "{}",
            err("resources:\n  openai: {concurrency: 0}\n")
        );
        assert!(err("resources:\n  'bad name': {concurrency: 1}\n").starts_with("resources.bad name"));
        assert!(err("quota_backoff: 15x\n").starts_with("quota_backoff"));
        assert!(err("colour: blue\n").contains("colour"));
        let c = Config::from_text("resources:\n  search-api: {concurrency: 3}\nquota_backoff: 10m\n").expect("valid");
        assert_eq!(c.resources["search-api"].concurrency, Some(3));
        assert_eq!(c.quota_backoff, Duration::from_secs(600));
        assert_eq!(Config::defaults().rate_limit_max_hold, DEFAULT_RATE_LIMIT_MAX_HOLD);
        // Found attacking issue 34: a key twice was taken (the last won),
        // and the stored document then broke `config diff`.
        for twice in [
            "resources:\n  r: {concurrency: 2}\n  r: {concurrency: 9}\n",
            r#"{"resources": {"r": {"concurrency": 2}, "r": {"concurrency": 9}}}"#,
        ] {
            let e = err(twice);
            assert!(e.starts_with("resources") && e.contains("duplicate entry with key \"r\""), "{e}");
        }
    }
}
