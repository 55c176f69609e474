//! Security flags: the server's tokens file, TLS and etcd credentials; the
//! runner's token and certificates; the client's token and CA; the safe
//! default (no plaintext, unauthenticated port beyond loopback unless
//! `--insecure`); and `punchclock token`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use clap::{Args, Subcommand, ValueEnum};
use punchclock_control_plane::auth::{self, Auth};
use punchclock_control_plane::bootstrap::TlsFiles;
use punchclock_control_plane::store::etcd::EtcdSecurity;

/// Reads a file a flag names; the error names the flag.
fn read(flag: &str, path: &Path) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("--{flag} {}: {e}", path.display()))
}

/// A secret from a file: trimmed of surrounding whitespace (an editor's
/// trailing newline), never empty.
pub fn read_secret(flag: &str, path: &Path) -> Result<String, String> {
    let text = String::from_utf8(read(flag, path)?).map_err(|_| format!("--{flag} {}: not UTF-8", path.display()))?;
    let secret = text.trim().to_string();
    if secret.is_empty() {
        return Err(format!("--{flag} {}: empty", path.display()));
    }
    Ok(secret)
}

/// The server's security flags (`server`).
#[derive(Args, Debug)]
pub struct ServerSecurityArgs {
    /// Tokens file (YAML: name, role, sha256 of the token; README
    /// "Security"). Every call then needs a token; reloaded on SIGHUP.
    #[arg(long)]
    auth_file: Option<PathBuf>,
    /// Certificate chain (PEM) for TLS on the gRPC port.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// Private key (PEM) of --tls-cert.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// CA (PEM) that signs runners' client certificates (mTLS): a runner
    /// presenting one is bound to the id in its first DNS subjectAltName.
    #[arg(long, requires = "tls_cert")]
    client_ca: Option<PathBuf>,
    /// Listen beyond loopback without TLS or without an auth file.
    #[arg(long)]
    insecure: bool,
    /// CA (PEM) of etcd's server certificates: etcd over TLS (https).
    #[arg(long)]
    etcd_ca: Option<PathBuf>,
    /// Client certificate (PEM) for etcd's --client-cert-auth.
    #[arg(long, requires = "etcd_key")]
    etcd_cert: Option<PathBuf>,
    /// Private key (PEM) of --etcd-cert.
    #[arg(long, requires = "etcd_cert")]
    etcd_key: Option<PathBuf>,
    /// etcd user (etcd's RBAC); the password comes from
    /// --etcd-password-file.
    #[arg(long, requires = "etcd_password_file")]
    etcd_user: Option<String>,
    /// File holding the etcd user's password.
    #[arg(long, env = "PUNCHCLOCK_ETCD_PASSWORD_FILE", requires = "etcd_user")]
    etcd_password_file: Option<PathBuf>,
}

/// What the server's flags give.
pub struct ServerSecurity {
    pub auth: Arc<Auth>,
    pub tls: Option<TlsFiles>,
    pub etcd: EtcdSecurity,
}

impl ServerSecurityArgs {
    /// Reads the files and applies the safe default for `listen`.
    ///
    /// Errors: a file that cannot be read or parsed (naming the flag); a
    /// non-loopback `listen` without TLS and an auth file, unless
    /// `--insecure`.
    pub fn load(&self, listen: SocketAddr) -> Result<ServerSecurity, String> {
        let auth = match &self.auth_file {
            Some(f) => Auth::from_file(f).map_err(|e| e.to_string())?,
            None => Auth::off(),
        };
        let tls = match (&self.tls_cert, &self.tls_key) {
            (Some(c), Some(k)) => Some(TlsFiles {
                cert_pem: read("tls-cert", c)?,
                key_pem: read("tls-key", k)?,
                client_ca_pem: self.client_ca.as_deref().map(|p| read("client-ca", p)).transpose()?,
            }),
            _ => None,
        };
        check_listen(listen, auth.enabled(), tls.is_some(), self.insecure, false)?;
        let etcd = EtcdSecurity {
            ca_pem: self.etcd_ca.as_deref().map(|p| read("etcd-ca", p)).transpose()?,
            identity: match (&self.etcd_cert, &self.etcd_key) {
                (Some(c), Some(k)) => Some((read("etcd-cert", c)?, read("etcd-key", k)?)),
                _ => None,
            },
            user: match (&self.etcd_user, &self.etcd_password_file) {
                (Some(u), Some(p)) => Some((u.clone(), read_secret("etcd-password-file", p)?)),
                _ => None,
            },
        };
        Ok(ServerSecurity { auth, tls, etcd })
    }
}

/// The safe default: a port beyond loopback needs TLS and tokens, or an
/// explicit `--insecure` (then a warning).
///
/// Errors: the message says what is missing and the flags that fix it.
pub fn check_listen(listen: SocketAddr, auth: bool, tls: bool, insecure: bool, dev: bool) -> Result<(), String> {
    if listen.ip().is_loopback() || (auth && tls) {
        return Ok(());
    }
    let missing: Vec<&str> =
        [(!tls).then_some("TLS (--tls-cert, --tls-key)"), (!auth).then_some("an auth file (--auth-file)")].into_iter().flatten().collect();
    if !insecure && !auth && !tls && dev {
        return Err(format!(
            "refusing to listen on {listen}: `dev` has no TLS and no tokens, so anyone who reaches that address could do anything. \
             Listen on 127.0.0.1, run `punchclock server` with --tls-cert/--tls-key and --auth-file for a network (README \"Security\"), \
             or pass --insecure to accept the risk"
        ));
    }
    if !insecure {
        return Err(format!(
            "refusing to listen on {listen} without {}: anyone who reaches that address could apply, delete and cancel tasks, \
             and pose as a runner to receive their parameters. Give them (README \"Security\"; deploy/tls/make-certs.sh makes a \
             CA, certificates and tokens), listen on 127.0.0.1, or pass --insecure to accept the risk",
            missing.join(" and ")
        ));
    }
    tracing::warn!(%listen, missing = %missing.join(" and "), "--insecure: listening beyond loopback without TLS and tokens");
    Ok(())
}

/// Reloads the tokens file on every SIGHUP (the old tokens stay when the
/// new file is invalid).
pub fn reload_on_sighup(auth: Arc<Auth>) {
    if !auth.enabled() {
        return;
    }
    tokio::spawn(async move {
        let Ok(mut hup) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) else { return };
        while hup.recv().await.is_some() {
            match auth.reload() {
                Ok(n) => tracing::info!(tokens = n, "SIGHUP: tokens file reloaded"),
                Err(e) => tracing::error!(error = %e, "SIGHUP: tokens file not reloaded; the previous tokens stay"),
            }
        }
    });
}

/// The runner's client certificate (its token and CA are the global
/// `--token-file` and `--ca-file`).
#[derive(Args, Debug)]
pub struct RunnerSecurityArgs {
    /// Client certificate (PEM) for mTLS; its first DNS subjectAltName is
    /// the runner id.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// Private key (PEM) of --tls-cert.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
}

impl RunnerSecurityArgs {
    /// The runner's credentials.
    ///
    /// Errors: a file that cannot be read (naming the flag).
    pub fn load(&self, client: &ClientAuthArgs) -> Result<punchclock_agent_runner::Credentials, String> {
        Ok(punchclock_agent_runner::Credentials {
            token: client.token()?,
            token_file: client.token_file.clone().filter(|_| client.token.as_deref().is_none_or(|t| t.trim().is_empty())),
            ca_pem: client.ca()?,
            identity: match (&self.tls_cert, &self.tls_key) {
                (Some(c), Some(k)) => Some((read("tls-cert", c)?, read("tls-key", k)?)),
                _ => None,
            },
        })
    }
}

/// The client's credentials (global flags of every command).
#[derive(Args, Debug)]
pub struct ClientAuthArgs {
    /// Bearer token for the API (prefer PUNCHCLOCK_TOKEN or --token-file:
    /// a flag shows in `ps`).
    #[arg(long, global = true, env = "PUNCHCLOCK_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// File holding the bearer token.
    #[arg(long = "token-file", global = true, env = "PUNCHCLOCK_TOKEN_FILE", id = "client_token_file", value_name = "FILE")]
    token_file: Option<PathBuf>,
    /// CA (PEM) of the control plane's certificate; bare host:port
    /// endpoints then use https.
    #[arg(long = "ca-file", global = true, env = "PUNCHCLOCK_CA_FILE", id = "client_ca_file", value_name = "FILE")]
    ca_file: Option<PathBuf>,
}

impl ClientAuthArgs {
    /// The token: `--token`/`PUNCHCLOCK_TOKEN`, else `--token-file`.
    ///
    /// Errors: the file cannot be read or is empty.
    pub fn token(&self) -> Result<Option<String>, String> {
        match (&self.token, &self.token_file) {
            (Some(t), _) if !t.trim().is_empty() => Ok(Some(t.trim().to_string())),
            (_, Some(f)) => Ok(Some(read_secret("token-file", f)?)),
            _ => Ok(None),
        }
    }

    /// The CA certificate (PEM) of `--ca-file`.
    ///
    /// Errors: the file cannot be read.
    pub fn ca(&self) -> Result<Option<Vec<u8>>, String> {
        self.ca_file.as_deref().map(|p| read("ca-file", p)).transpose()
    }

    /// Configures every later connection of this process.
    ///
    /// Errors: a file that cannot be read; a token that is not ASCII.
    pub fn configure(&self) -> Result<(), String> {
        crate::client::configure(crate::client::ClientOptions { token: self.token()?, ca_pem: self.ca()? })
    }
}

/// `punchclock token …`.
#[derive(Subcommand, Debug)]
pub enum TokenCmd {
    /// Make a new random token: writes it to --out (mode 0600) and prints
    /// its tokens-file entry (with the hash, never the token) on stdout.
    New {
        /// Who the token is for (in audit lines).
        #[arg(long)]
        name: String,
        #[arg(long, value_enum)]
        role: RoleArg,
        /// File to write the token to (created, mode 0600; must not exist).
        #[arg(long)]
        out: PathBuf,
        /// runner tokens: the runner id it is bound to.
        #[arg(long)]
        runner_id: Option<String>,
        /// runner tokens: the runner id prefix it is bound to.
        #[arg(long)]
        runner_id_prefix: Option<String>,
        /// runner tokens: the agents it may offer, comma-separated (default: any).
        #[arg(long)]
        agents: Option<String>,
        /// runner tokens: the labels it may claim, `k=v,...` (default: none;
        /// a runner claiming a label its token does not bind is refused).
        #[arg(long)]
        labels: Option<String>,
    },
    /// Print the SHA-256 (the tokens file's `sha256`) of the token read
    /// from stdin.
    Hash,
}

/// `--role` values.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum RoleArg {
    Admin,
    Operator,
    Reader,
    Runner,
}

/// Runs `punchclock token …`.
pub fn token(cmd: TokenCmd) -> Result<(), String> {
    match cmd {
        TokenCmd::Hash => {
            let mut s = String::new();
            std::io::Read::read_to_string(&mut std::io::stdin(), &mut s).map_err(|e| format!("stdin: {e}"))?;
            let t = s.trim();
            if t.is_empty() {
                return Err("no token on stdin".into());
            }
            println!("{}", auth::token_hash(t));
            Ok(())
        }
        TokenCmd::New { name, role, out, runner_id, runner_id_prefix, agents, labels } => {
            let role_name = format!("{role:?}").to_lowercase();
            let role = match role {
                RoleArg::Admin => auth::Role::Admin,
                RoleArg::Operator => auth::Role::Operator,
                RoleArg::Reader => auth::Role::Reader,
                RoleArg::Runner => auth::Role::Runner,
            };
            let agent_list: Option<Vec<String>> =
                agents.as_deref().map(|a| a.split(',').map(str::trim).filter(|s| !s.is_empty()).map(str::to_string).collect());
            let label_map = match labels.as_deref() {
                None => None,
                Some(l) => Some(crate::commands::parse_labels(l).map_err(|e| format!("--labels: {e}"))?),
            };
            // The entry the server would refuse is refused here, before a token exists.
            if let Err(punchclock_control_plane::Error::InvalidArgument { field, reason }) =
                auth::principal(name.clone(), role, runner_id.clone(), runner_id_prefix.clone(), agent_list.clone(), label_map.clone())
            {
                return Err(format!("--{}: {reason}", field.replace('_', "-")));
            }
            if let Some(bad) = agent_list.iter().flatten().find(|a| a.chars().any(|c| c.is_control() || c == '"' || c == '\\')) {
                return Err(format!("--agents: {bad:?} is not an agent id"));
            }
            let role = role_name;
            let token = auth::new_token();
            {
                use std::io::Write;
                use std::os::unix::fs::OpenOptionsExt;
                let mut f = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .open(&out)
                    .map_err(|e| format!("--out {}: {e}", out.display()))?;
                writeln!(f, "{token}").map_err(|e| format!("--out {}: {e}", out.display()))?;
            }
            let mut entry = format!("  - name: {name}\n    role: {role}\n    sha256: {}\n", auth::token_hash(&token));
            if let Some(id) = runner_id {
                entry += &format!("    runner_id: {id:?}\n");
            }
            if let Some(p) = runner_id_prefix {
                entry += &format!("    runner_id_prefix: {p:?}\n");
            }
            if let Some(list) = agent_list {
                let list: Vec<String> = list.iter().map(|s| format!("{s:?}")).collect();
                entry += &format!("    agents: [{}]\n", list.join(", "));
            }
            if let Some(map) = label_map {
                let pairs: Vec<String> = map.iter().map(|(k, v)| format!("{k:?}: {v:?}")).collect();
                entry += &format!("    labels: {{{}}}\n", pairs.join(", "));
            }
            print!("{entry}");
            Ok(())
        }
    }
}
