//! A real PostgreSQL server for tests, from Debian's `postgresql`
//! package: `initdb` into a temporary directory, `postgres` on a free
//! loopback port (trust authentication, fsync off), stopped when dropped.
//! As root, both run as the `postgres` user (PostgreSQL refuses root).

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::etcd::free_port;

/// The directory of `initdb` and `postgres`: the newest
/// `/usr/lib/postgresql/*/bin` (Debian's layout), else `PATH`'s.
pub fn bin_dir() -> Option<PathBuf> {
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| Some((e.file_name().to_str()?.parse().ok()?, e.path().join("bin"))))
        .filter(|(_, p)| p.join("postgres").exists())
        .collect();
    versions.sort();
    versions.pop().map(|(_, p)| p).or_else(|| {
        let out = Command::new("sh").args(["-c", "command -v postgres"]).output().ok()?;
        let p = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        p.parent().map(Path::to_path_buf)
    })
}

/// A running PostgreSQL server.
pub struct Postgres {
    dir: tempfile::TempDir,
    bin: PathBuf,
    /// Its port on 127.0.0.1.
    pub port: u16,
    child: Option<Child>,
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// The `postgres` user's uid and gid.
fn postgres_user() -> (u32, u32) {
    let name = std::ffi::CString::new("postgres").expect("name");
    // SAFETY: `name` is a valid C string; the record is read before any
    // other getpw* call of this thread.
    let pw = unsafe { libc::getpwnam(name.as_ptr()) };
    assert!(!pw.is_null(), "no postgres user (Debian's postgresql package makes it)");
    // SAFETY: non-null, from getpwnam.
    unsafe { ((*pw).pw_uid, (*pw).pw_gid) }
}

/// `program`, as the `postgres` user when this process is root (the
/// process itself: killing it stops the server).
fn command(program: &Path) -> Command {
    use std::os::unix::process::CommandExt;
    let mut c = Command::new(program);
    if is_root() {
        let (uid, gid) = postgres_user();
        c.uid(uid).gid(gid);
    }
    c
}

impl Postgres {
    /// `initdb` and a server, ready to accept connections; `None` (with
    /// the reason printed) when PostgreSQL is not installed.
    pub async fn start() -> Option<Postgres> {
        let Some(bin) = bin_dir() else {
            eprintln!("postgresql is not installed (no initdb/postgres): `make deps` installs it");
            return None;
        };
        let dir = tempfile::tempdir().expect("tempdir");
        if is_root() {
            let (uid, gid) = postgres_user();
            std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid)).expect("chown the data dir to postgres");
        }
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).expect("chmod");
        let data = dir.path().join("data");
        let out = command(&bin.join("initdb"))
            .args(["-D"])
            .arg(&data)
            .args(["-U", "punchclock", "--auth=trust", "--encoding=UTF8", "--locale=C", "--no-sync"])
            .stdout(Stdio::null())
            .output()
            .expect("run initdb");
        assert!(out.status.success(), "initdb failed: {}", String::from_utf8_lossy(&out.stderr));
        let mut pg = Postgres { dir, bin, port: free_port(), child: None };
        pg.spawn();
        pg.wait_ready().await;
        Some(pg)
    }

    fn spawn(&mut self) {
        let log = std::fs::File::create(self.dir.path().join("postgres.log")).expect("log file");
        let child = command(&self.bin.join("postgres"))
            .arg("-D")
            .arg(self.dir.path().join("data"))
            .args(["-p", &self.port.to_string(), "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "max_connections=100"])
            .arg("-k")
            .arg(self.dir.path())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start postgres");
        self.child = Some(child);
    }

    /// The URL a control plane takes (`--history`).
    pub fn url(&self) -> String {
        format!("postgres://punchclock@127.0.0.1:{}/postgres", self.port)
    }

    /// The postmaster and its backends' pids.
    fn pids(&self) -> Vec<i32> {
        let Some(main) = self.child.as_ref().map(|c| c.id() as i32) else { return Vec::new() };
        let mut pids = vec![main];
        for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else { continue };
            let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
            // "pid (comm) state ppid ...": the fields after the last ')'.
            let ppid = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<i32>().ok());
            if ppid == Some(main) {
                pids.push(pid);
            }
        }
        pids
    }

    /// Stops the server and every backend (SIGSTOP): connections stay
    /// open and nothing answers, as with a hung host or disk.
    pub fn pause(&self) {
        for pid in self.pids() {
            // SAFETY: a signal to a process this harness started.
            unsafe { libc::kill(pid, libc::SIGSTOP) };
        }
    }

    /// Lets a [`Postgres::pause`]d server go on (SIGCONT).
    pub fn resume(&self) {
        for pid in self.pids() {
            // SAFETY: as in `pause`.
            unsafe { libc::kill(pid, libc::SIGCONT) };
        }
    }

    /// Creates the database `name` (`CREATE DATABASE name OPTIONS`, through
    /// `psql`) and returns its URL.
    pub fn create_database(&self, name: &str, options: &str) -> String {
        let out = Command::new(self.bin.join("psql"))
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "-U", "punchclock", "-d", "postgres", "-v", "ON_ERROR_STOP=1", "-c"])
            .arg(format!("CREATE DATABASE {name} {options}"))
            .output()
            .expect("run psql");
        assert!(out.status.success(), "CREATE DATABASE {name} failed: {}", String::from_utf8_lossy(&out.stderr));
        format!("postgres://punchclock@127.0.0.1:{}/{name}", self.port)
    }

    /// Waits until the server accepts connections (30 s at most).
    pub async fn wait_ready(&self) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            if std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok()
                && Command::new(self.bin.join("pg_isready"))
                    .args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "-U", "punchclock", "-q"])
                    .status()
                    .is_ok_and(|s| s.success())
            {
                return;
            }
            assert!(tokio::time::Instant::now() < deadline, "postgres did not become ready: {}", self.log());
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The server's log.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("postgres.log")).unwrap_or_default()
    }

    /// Stops the server at once (SIGKILL of the postmaster and, by group,
    /// its children): an outage.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
            // The backends of a killed postmaster exit on their own; wait
            // for the port so a restart can bind it.
            let pid_file = self.dir.path().join("data").join("postmaster.pid");
            for _ in 0..100 {
                if std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = std::fs::remove_file(pid_file);
        }
    }

    /// Starts the server again on its data (after [`Postgres::kill`]).
    pub async fn restart(&mut self) {
        self.kill();
        self.spawn();
        self.wait_ready().await;
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        self.kill();
    }
}
