//! Helpers shared by the integration tests.

#![allow(dead_code)] // each test binary uses a subset

use std::collections::BTreeMap;
use std::time::Duration;

use punchclock_agent_runner::ProcessAgent;

/// Upper bound for anything a test waits for.
pub const PATIENCE: Duration = Duration::from_secs(15);

/// A process agent running `sh -c <script>`.
pub fn sh_agent(script: &str) -> ProcessAgent {
    ProcessAgent {
        command: vec!["sh".into(), "-c".into(), script.into()],
        env: BTreeMap::new(),
        env_from_file: BTreeMap::new(),
        working_dir: None,
        limits: Default::default(),
        enforce: Default::default(),
    }
}

/// Whether process `pid` is gone. A zombie counts as gone: it has exited and
/// only waits to be reaped by its new parent (some container inits never
/// reap, so `kill(pid, 0)` alone would keep succeeding).
pub fn process_gone(pid: i32) -> bool {
    // SAFETY: signal 0 only checks for existence.
    if unsafe { libc::kill(pid, 0) } == -1 {
        return std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
    }
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // Format: "pid (comm) STATE ..."; comm may contain spaces or ')'.
        Ok(stat) => {
            stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().next()).is_some_and(|state| state == "Z" || state == "X")
        }
        Err(_) => true,
    }
}

/// Polls (bounded by [`PATIENCE`]) until `pid` is gone; false if it never goes.
pub async fn wait_until_gone(pid: i32) -> bool {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while tokio::time::Instant::now() < deadline {
        if process_gone(pid) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    process_gone(pid)
}

/// The entries left in a directory (empty if it does not exist), except
/// the runner's `.lock` and `fence` files.
pub fn dir_entries(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| !p.ends_with(".lock") && !p.ends_with("fence")).collect()
        })
        .unwrap_or_default()
}

/// The files executions left under a directory, at any depth (none if it
/// does not exist), except the runner's `.lock` and `fence` files. Empty
/// directories and empty files do not count: the executor keeps emptied
/// execution directories (with an empty progress file) for the next
/// executions.
pub fn files_left(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut files = Vec::new();
    for path in entries.filter_map(|e| e.ok().map(|e| e.path())) {
        if path.is_dir() {
            files.extend(files_left(&path));
        } else if !path.ends_with(".lock") && !path.ends_with("fence") && std::fs::metadata(&path).map_or(true, |m| m.len() > 0) {
            files.push(path);
        }
    }
    files
}
