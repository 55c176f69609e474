//! Certificates and tokens for security tests, made by the script users
//! run (`deploy/tls/make-certs.sh`, openssl + `punchclock token new`), and
//! the process-wide client credentials the test helpers then use.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// A CA, server, etcd-client and runner certificates, and tokens
/// (`admin`, `operator`, `reader`, `runner-ID`) in a temporary directory.
pub struct Pki {
    _dir: tempfile::TempDir,
    /// The script's output directory.
    pub root: PathBuf,
}

impl Pki {
    /// Runs `deploy/tls/make-certs.sh` for `runners`.
    pub fn make(runners: &[&str]) -> Pki {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().join("pki");
        let mut cmd = Command::new("sh");
        cmd.arg(crate::repo_root().join("deploy/tls/make-certs.sh"))
            .arg("--out")
            .arg(&root)
            .arg("--punchclock")
            .arg(crate::bin())
            .arg("--days")
            .arg("2");
        for r in runners {
            cmd.args(["--runner", r]);
        }
        let out = cmd.output().expect("run make-certs.sh (needs openssl)");
        assert!(out.status.success(), "make-certs.sh failed: {}", String::from_utf8_lossy(&out.stderr));
        Pki { _dir: dir, root }
    }

    /// A file of the output, as a string path.
    pub fn path(&self, name: &str) -> String {
        self.root.join(name).to_string_lossy().into_owned()
    }

    /// The token in `tokens/NAME.token`.
    pub fn token(&self, name: &str) -> String {
        std::fs::read_to_string(self.root.join("tokens").join(format!("{name}.token"))).expect("token file").trim().to_string()
    }

    /// `tokens/NAME.token`'s path.
    pub fn token_file(&self, name: &str) -> String {
        self.path(&format!("tokens/{name}.token"))
    }

    /// `server` arguments: tokens, TLS, mTLS for runners.
    pub fn server_args(&self) -> Vec<String> {
        ["--auth-file", "tokens.yaml", "--tls-cert", "server.crt", "--tls-key", "server.key", "--client-ca", "ca.crt"]
            .chunks(2)
            .flat_map(|kv| [kv[0].to_string(), self.path(kv[1])])
            .collect()
    }

    /// `server` arguments for etcd over TLS with a client certificate.
    pub fn etcd_client_args(&self) -> Vec<String> {
        ["--etcd-ca", "etcd-ca.crt", "--etcd-cert", "etcd-client.crt", "--etcd-key", "etcd-client.key"]
            .chunks(2)
            .flat_map(|kv| [kv[0].to_string(), self.path(kv[1])])
            .collect()
    }

    /// The etcd client's TLS settings (for a test talking to etcd itself).
    pub fn etcd_security(&self) -> punchclock_control_plane::store::etcd::EtcdSecurity {
        let read = |n: &str| std::fs::read(self.root.join(n)).expect("pem");
        punchclock_control_plane::store::etcd::EtcdSecurity {
            ca_pem: Some(read("etcd-ca.crt")),
            identity: Some((read("etcd-client.crt"), read("etcd-client.key"))),
            user: None,
        }
    }
}

/// What the helpers' gRPC clients and CLI runs present (set once per test
/// binary with [`use_client_credentials`]).
#[derive(Clone, Debug)]
pub struct ClientCredentials {
    /// CA of the server certificate (PEM file).
    pub ca_file: PathBuf,
    /// The token's file.
    pub token_file: PathBuf,
    /// The token.
    pub token: String,
}

static CLIENT: OnceLock<ClientCredentials> = OnceLock::new();

/// From now on, every helper client of this test binary (and every CLI
/// run) trusts `pki`'s CA and sends the `token` token.
pub fn use_client_credentials(pki: &Pki, token: &str) {
    let creds =
        ClientCredentials { ca_file: pki.root.join("ca.crt"), token_file: PathBuf::from(pki.token_file(token)), token: pki.token(token) };
    let _ = CLIENT.set(creds);
}

/// The credentials set by [`use_client_credentials`].
pub fn client_credentials() -> Option<&'static ClientCredentials> {
    CLIENT.get()
}

/// The CA PEM of the client credentials.
pub(crate) fn ca_pem(c: &ClientCredentials) -> Vec<u8> {
    std::fs::read(Path::new(&c.ca_file)).expect("ca")
}
