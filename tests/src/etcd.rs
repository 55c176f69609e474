//! Real etcd processes for tests: one member or a cluster on loopback ports,
//! in a temporary directory, stopped when dropped.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use punchclock_control_plane::store::etcd::{EtcdSecurity, EtcdStore};

/// A free loopback port (bound, then released).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("free port")
}

/// One etcd member.
struct Member {
    name: String,
    client_port: u16,
    peer_port: u16,
    child: Option<Child>,
}

/// A running etcd cluster.
pub struct Etcd {
    members: Vec<Member>,
    dir: tempfile::TempDir,
    initial_cluster: String,
    /// Client TLS: the pki directory (server cert, CA for client certs).
    tls: Option<(PathBuf, EtcdSecurity)>,
    /// More arguments for every member.
    extra: Vec<String>,
}

impl Etcd {
    /// Starts `n` members and waits until the cluster answers.
    pub async fn start(n: usize) -> Etcd {
        Etcd::start_with(n, None).await
    }

    /// [`Etcd::start`] with clients over TLS: `https://` client URLs,
    /// `pki`'s etcd server certificate, and client certificates required
    /// (`--client-cert-auth`, signed by `pki`'s etcd CA, not the API's).
    pub async fn start_tls(n: usize, pki: &crate::pki::Pki) -> Etcd {
        Etcd::start_with(n, Some((pki.root.clone(), pki.etcd_security()))).await
    }

    /// [`Etcd::start`] with more arguments for every member (e.g.
    /// `--quota-backend-bytes`).
    pub async fn start_args(n: usize, extra: &[&str]) -> Etcd {
        Etcd::start_full(n, None, extra).await
    }

    async fn start_with(n: usize, tls: Option<(PathBuf, EtcdSecurity)>) -> Etcd {
        Etcd::start_full(n, tls, &[]).await
    }

    async fn start_full(n: usize, tls: Option<(PathBuf, EtcdSecurity)>, extra: &[&str]) -> Etcd {
        let dir = tempfile::tempdir().expect("tempdir");
        let members: Vec<Member> =
            (0..n).map(|i| Member { name: format!("m{i}"), client_port: free_port(), peer_port: free_port(), child: None }).collect();
        let initial_cluster = members.iter().map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer_port)).collect::<Vec<_>>().join(",");
        let mut etcd = Etcd { members, dir, initial_cluster, tls, extra: extra.iter().map(|s| s.to_string()).collect() };
        for i in 0..n {
            etcd.spawn(i, "new");
        }
        etcd.wait_ready().await;
        etcd
    }

    fn spawn(&mut self, i: usize, state: &str) {
        let data: PathBuf = self.dir.path().join(&self.members[i].name);
        let m = &mut self.members[i];
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let client = format!("{scheme}://127.0.0.1:{}", m.client_port);
        let peer = format!("http://127.0.0.1:{}", m.peer_port);
        let log = std::fs::File::create(self.dir.path().join(format!("{}.log", m.name))).expect("log file");
        let mut cmd = Command::new("etcd");
        if let Some((root, _)) = &self.tls {
            cmd.arg("--cert-file").arg(root.join("etcd-server.crt"));
            cmd.arg("--key-file").arg(root.join("etcd-server.key"));
            cmd.arg("--trusted-ca-file").arg(root.join("etcd-ca.crt"));
            cmd.arg("--client-cert-auth");
        }
        let child = cmd
            .args(["--name", &m.name, "--data-dir"])
            .arg(&data)
            .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
            .args([
                "--initial-cluster",
                &self.initial_cluster,
                "--initial-cluster-state",
                state,
                "--initial-cluster-token",
                "punchclock-test",
            ])
            .args(["--heartbeat-interval", "100", "--election-timeout", "1000"])
            .args(&self.extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn etcd (install etcd-server)");
        m.child = Some(child);
    }

    /// Client endpoints, `http://127.0.0.1:PORT` (`https://` with TLS).
    pub fn endpoints(&self) -> Vec<String> {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        self.members.iter().map(|m| format!("{scheme}://127.0.0.1:{}", m.client_port)).collect()
    }

    /// A store client of this etcd (with its TLS settings).
    pub async fn connect(&self) -> punchclock_control_plane::Result<EtcdStore> {
        EtcdStore::connect_with(&self.endpoints(), &self.security()).await
    }

    /// The client TLS settings (default: none).
    pub fn security(&self) -> EtcdSecurity {
        self.tls.as_ref().map(|(_, s)| s.clone()).unwrap_or_default()
    }

    /// `etcd://127.0.0.1:A,127.0.0.1:B` for `punchclock server --store`.
    pub fn store_url(&self) -> String {
        format!("etcd://{}", self.members.iter().map(|m| format!("127.0.0.1:{}", m.client_port)).collect::<Vec<_>>().join(","))
    }

    /// Waits until a write succeeds through each running member's client
    /// endpoint alone (at most 30 s). Not through the cluster: a write
    /// succeeds once two of three members have quorum, while the third may
    /// not accept connections yet, and a client that picks it first gets
    /// "connection refused" (a flake of `ha_quorum`'s first apply).
    pub async fn wait_ready(&self) {
        use punchclock_control_plane::store::KvStore;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        let endpoints = self.endpoints();
        for (i, endpoint) in endpoints.iter().enumerate().filter(|(i, _)| self.members[*i].child.is_some()) {
            loop {
                if let Ok(s) = EtcdStore::connect_with(std::slice::from_ref(endpoint), &self.security()).await
                    && s.put("/test/ready", b"1".to_vec()).await.is_ok()
                {
                    break;
                }
                assert!(tokio::time::Instant::now() < deadline, "etcd member m{i} did not become ready");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }

    /// Kills member `i` (SIGKILL).
    pub fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.members[i].child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Restarts a killed member on its data dir.
    pub fn restart(&mut self, i: usize) {
        self.kill(i);
        self.spawn(i, "existing");
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
    }
}
