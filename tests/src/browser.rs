//! A real browser for the dashboard's tests: Debian's `chromium`, headless,
//! driven through its `chromedriver` (started here on a free loopback port)
//! over WebDriver with fantoccini. `make deps` installs both.
//!
//! Chromium runs with a fresh profile and without its background
//! networking (these machines' network is closed: it would try to reach
//! Google at every start), `--no-sandbox` when the tests run as root.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use fantoccini::{Client, ClientBuilder};

/// The chromium and chromedriver binaries, when both are installed.
pub fn installed() -> Option<(PathBuf, PathBuf)> {
    let chromium = ["/usr/bin/chromium", "/usr/bin/chromium-browser"].iter().map(PathBuf::from).find(|p| p.exists())?;
    let driver = ["/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver"].iter().map(PathBuf::from).find(|p| p.exists())?;
    Some((chromium, driver))
}

/// A running chromedriver (stopped on drop).
pub struct Driver {
    child: Child,
    port: u16,
    chromium: PathBuf,
    profiles: tempfile::TempDir,
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Driver {
    /// Starts chromedriver; `None` (with the reason printed) when chromium
    /// or chromedriver is missing.
    pub fn start(log: &Path) -> Option<Driver> {
        let Some((chromium, driver)) = installed() else {
            eprintln!("chromium or chromium-driver is not installed: `make deps` installs them");
            return None;
        };
        let port = crate::etcd::free_port();
        let mut child = Command::new(driver)
            .arg(format!("--port={port}"))
            .arg(format!("--log-path={}", log.display()))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start chromedriver");
        for _ in 0..200 {
            if TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return Some(Driver { child, port, chromium, profiles: tempfile::tempdir().expect("tempdir") });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        let _ = child.wait();
        panic!("chromedriver did not listen on {port}");
    }

    /// A new browser session (its own profile: its own cookies), window
    /// 1280×900; a page that does not load within 30 s is an error, not a
    /// test that waits for ever.
    pub async fn session(&self) -> Client {
        let profile = tempfile::tempdir_in(self.profiles.path()).expect("profile").keep();
        let mut caps = serde_json::Map::new();
        caps.insert(
            "goog:chromeOptions".into(),
            serde_json::json!({
                "binary": self.chromium,
                "args": [
                    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
                    "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    "--window-size=1280,900", format!("--user-data-dir={}", profile.display()),
                ],
            }),
        );
        caps.insert("timeouts".into(), serde_json::json!({"pageLoad": 30_000, "script": 30_000}));
        let connector = hyper_util::client::legacy::connect::HttpConnector::new();
        ClientBuilder::new(connector)
            .capabilities(caps)
            .connect(&format!("http://127.0.0.1:{}", self.port))
            .await
            .expect("a WebDriver session")
    }
}

/// Waits up to `within` for `f` to give `Some`, polling every 100 ms (a
/// page's live update, an element's text).
pub async fn wait_for<T, F, Fut>(within: Duration, what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(tokio::time::Instant::now() < deadline, "waited {within:?} for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Saves a screenshot of what `c` shows as `target/ui-screenshots/NAME.png`.
pub async fn screenshot(c: &Client, name: &str) {
    let dir = crate::repo_root().join("target").join("ui-screenshots");
    std::fs::create_dir_all(&dir).expect("screenshot dir");
    let png = c.screenshot().await.expect("screenshot");
    std::fs::write(dir.join(format!("{name}.png")), png).expect("write screenshot");
}
