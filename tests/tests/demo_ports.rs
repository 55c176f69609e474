//! Issue 8, acceptance 6: `make demo` (scripts/demo.sh) with ports 7700
//! and 7701 already taken still starts and shows runs — `dev` on a free
//! port, the health port next to it or free, and the example inspection
//! task checking the health address this dev really listens on (its run
//! succeeds only if it does).

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use punchclock_tests::{bin, repo_root};

#[test]
fn the_demo_starts_and_runs_with_its_ports_taken() {
    // Taken by us, or already by someone else: taken either way.
    let _api = std::net::TcpListener::bind("127.0.0.1:7700");
    let _health = std::net::TcpListener::bind("127.0.0.1:7701");
    assert!(std::net::TcpListener::bind("127.0.0.1:7700").is_err() && std::net::TcpListener::bind("127.0.0.1:7701").is_err());

    let dir = tempfile::tempdir().expect("tempdir");
    let mut demo = Command::new("bash")
        .arg("scripts/demo.sh")
        .current_dir(repo_root())
        .env("BIN", bin())
        .env("PUNCHCLOCK_DEMO_DATA", dir.path().join("demo"))
        .env_remove("PUNCHCLOCK_DEMO_PORT")
        .env_remove("PUNCHCLOCK_ENDPOINT")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .process_group(0)
        .spawn()
        .expect("start the demo");
    let pgid = demo.id() as i32;
    let stdout = demo.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut seen = Vec::new();
    let shown = loop {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(line) => {
                let done = line.contains("demo_inspection.") && line.contains("SUCCEEDED");
                seen.push(line);
                if done {
                    break true;
                }
            }
            Err(_) => break false,
        }
    };
    // SAFETY: kill(2) on the demo's own process group.
    unsafe { libc::kill(-pgid, libc::SIGINT) };
    let _ = demo.wait();
    // SAFETY: as above; whatever did not stop on SIGINT.
    unsafe { libc::kill(-pgid, libc::SIGKILL) };
    let text = seen.join("\n");
    assert!(text.contains("port 7700 is taken; using a free one"), "{text}");
    assert!(shown, "no SUCCEEDED demo_inspection run shown within 120 s:\n{text}");
}
