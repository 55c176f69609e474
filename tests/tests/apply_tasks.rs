//! Issue 8, `ApplyTasks`: a task file is applied all or none, in one call.
//! - on `dev` (the embedded store): a whole file created, the same file
//!   again changes nothing and says `unchanged` per task, a file with a bad
//!   definition and a repeated id changes nothing and names both;
//! - on a real etcd, where 5,000 tasks need many transactions: the server
//!   is killed (-9) while the tasks are being written, and again while the
//!   journal is being written; after a restart the new leader has finished
//!   or rolled back the apply: all 5,000 tasks or none, and no journal left;
//!   a CLI killed mid-apply does not stop it (all 5,000, no journal, no
//!   restart); two applies of the same ids at once end as one file or the
//!   other, never a mix.

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use punchclock_control_plane::store::KvStore;
use punchclock_control_plane::store::etcd::EtcdStore;
use punchclock_tests::etcd::{Etcd, free_port};
use punchclock_tests::{KeepLogsOnPanic, Proc, bin, repo_root, wait_leader};

/// `n` cron tasks (never due soon) as one JSON file; `tag` goes in their
/// context so two files differ.
fn task_file(dir: &std::path::Path, name: &str, n: usize, tag: &str) -> std::path::PathBuf {
    let specs: Vec<serde_json::Value> = (0..n)
        .map(|i| {
            serde_json::json!({"task_id": format!("bulk{i:05}"), "agent_id": "ok_agent",
                "trigger": {"type": "cron", "expr": "0 0 0 1 1 *"}, "context": {"params": {"tag": tag}}})
        })
        .collect();
    let path = dir.join(name);
    std::fs::write(&path, serde_json::to_string(&specs).expect("json")).expect("write task file");
    path
}

fn apply_cmd(addr: &str, file: &std::path::Path) -> Command {
    let mut c = Command::new(bin());
    c.args(["task", "apply", "-f", &file.to_string_lossy()]).env("PUNCHCLOCK_ENDPOINT", addr).current_dir(repo_root());
    c
}

/// Task ids stored (keys under `tasks/`), read straight from the store.
async fn stored(store: &dyn KvStore, prefix: &str) -> usize {
    store.range(prefix).await.expect("range").0.len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_is_applied_whole_reapplied_unchanged_and_refused_whole() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "apply_tasks_dev");
    let dev = Proc::dev(&dir.path().join("data"));
    let file = task_file(dir.path(), "bulk.json", 2000, "a");

    let out = apply_cmd(&dev.addr, &file).output().expect("apply");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(text.lines().filter(|l| l.ends_with(" created")).count(), 2000, "{text}");

    let again = apply_cmd(&dev.addr, &file).output().expect("apply again");
    let text = String::from_utf8_lossy(&again.stdout);
    assert!(again.status.success());
    assert_eq!(text.lines().filter(|l| l.ends_with(" unchanged")).count(), 2000, "{text}");

    // A changed file with one bad definition and a repeated id: refused
    // whole, both named, nothing of the rest written.
    let mut specs: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(task_file(dir.path(), "b.json", 2000, "b")).expect("read")).expect("json");
    specs[7]["trigger"]["expr"] = "61 * * * *".into();
    specs[9]["task_id"] = "bulk00003".into();
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, serde_json::to_string(&specs).expect("json")).expect("write");
    let refused = apply_cmd(&dev.addr, &bad).output().expect("apply bad");
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success());
    assert!(err.contains("task #8 (bulk00007): trigger.expr: minute field"), "{err}");
    assert!(err.contains("task #10 (bulk00003): task_id: appears more than once"), "{err}");
    assert!(err.contains("nothing applied"), "{err}");
    let again = apply_cmd(&dev.addr, &file).output().expect("apply the first file again");
    let text = String::from_utf8_lossy(&again.stdout);
    assert_eq!(text.lines().filter(|l| l.ends_with(" unchanged")).count(), 2000, "the refused file changed tasks: {text}");
}

/// Starts an apply of `file` through the CLI, kills the server with -9 at
/// the first change under `at` (a key prefix), restarts it, and returns
/// the tasks stored once the new leader is up. `round` names the servers
/// (`{round}-0`, `{round}-1`): each waits until it leads itself, not
/// until it names a leader — the previous round's killed one could still
/// hold the lease, and the apply then went to a dead leader and never
/// wrote (seen once in a fresh-image run: "the apply writes: Elapsed").
async fn kill_during_apply(etcd: &Etcd, dir: &std::path::Path, file: &std::path::Path, at: &str, round: &str) -> (usize, usize) {
    let port = free_port();
    let (first, next) = (format!("{round}-0"), format!("{round}-1"));
    let mut server = Proc::server(&etcd.store_url(), &first, port, dir);
    wait_leader(std::slice::from_ref(&server.addr), Duration::from_secs(30), |s| s.leader_id == first).await;
    punchclock_tests::wait_engine(&server.addr).await;
    let store = EtcdStore::connect(&etcd.endpoints()).await.expect("etcd");
    let mut changes = store.watch(at).await.expect("watch");
    let mut cli = apply_cmd(&server.addr, file).stdout(Stdio::null()).stderr(Stdio::null()).spawn().expect("cli");
    tokio::time::timeout(Duration::from_secs(60), changes.next()).await.expect("the apply writes").expect("a change").expect("watch");
    server.kill9();
    let _ = cli.wait();
    let store: Arc<dyn KvStore> = Arc::new(store);
    let tasks_before = stored(&*store, "/punchclock/tasks/").await;

    let restarted = Proc::server(&etcd.store_url(), &next, free_port(), dir);
    wait_leader(std::slice::from_ref(&restarted.addr), Duration::from_secs(30), |s| s.leader_id == next).await;
    // The leader recovers the journal before its engine starts; the engine
    // is up once it answers ListRunners.
    let mut cluster =
        punchclock_proto::v1::cluster_service_client::ClusterServiceClient::new(punchclock_tests::channel(&restarted.addr).await);
    for _ in 0..600 {
        if cluster.list_runners(punchclock_proto::v1::ListRunnersRequest {}).await.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let journal = stored(&*store, "/punchclock/applies/").await;
    assert_eq!(journal, 0, "the new leader left a journal");
    let tasks = stored(&*store, "/punchclock/tasks/").await;
    println!("killed at the first change under {at}: {tasks_before} tasks then, {tasks} after the restart");
    drop(restarted);
    (tasks_before, tasks)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_killed_mid_apply_leaves_all_tasks_or_none() {
    const N: usize = 5000;
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "apply_tasks_etcd");
    let etcd = Etcd::start(1).await;

    // Killed while writing tasks (the journal is complete): finished.
    let file = task_file(dir.path(), "a.json", N, "a");
    let (before, after) = kill_during_apply(&etcd, dir.path(), &file, "/punchclock/tasks/", "tasks").await;
    assert!(before < N, "the kill came after the whole apply ({before} tasks): nothing was tested");
    assert_eq!(after, N, "killed with {before} of {N} written: the next leader must finish the apply");

    // Killed while writing the journal of a new file: all of it or none.
    let store = EtcdStore::connect(&etcd.endpoints()).await.expect("etcd");
    for kv in store.range("/punchclock/tasks/").await.expect("range").0 {
        store.delete(&kv.key).await.expect("delete");
    }
    let file = task_file(dir.path(), "b.json", N, "b");
    let (before, after) = kill_during_apply(&etcd, dir.path(), &file, "/punchclock/applies/", "journal").await;
    assert!(after == 0 || after == N, "{after} of {N} tasks after the restart ({before} at the kill)");

    // The client goes away mid-apply: the leader finishes it anyway.
    let server = Proc::server(&etcd.store_url(), "cp2", free_port(), dir.path());
    wait_leader(std::slice::from_ref(&server.addr), Duration::from_secs(30), |s| s.leader_id == "cp2").await;
    let mut changes = store.watch("/punchclock/tasks/").await.expect("watch");
    let file = task_file(dir.path(), "c.json", N, "c");
    let mut cli = apply_cmd(&server.addr, &file).stdout(Stdio::null()).stderr(Stdio::null()).spawn().expect("cli");
    tokio::time::timeout(Duration::from_secs(60), changes.next()).await.expect("the apply writes").expect("a change").expect("watch");
    cli.kill().expect("kill the CLI");
    let _ = cli.wait();
    let tagged = |tag: &'static str| {
        let store = &store;
        async move {
            let all = store.range("/punchclock/tasks/").await.expect("range").0;
            all.iter().filter(|kv| String::from_utf8_lossy(&kv.value).contains(&format!("\"tag\":\"{tag}\""))).count()
        }
    };
    let mut done = false;
    for _ in 0..300 {
        if tagged("c").await == N && stored(&store, "/punchclock/applies/").await == 0 {
            done = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(done, "the apply stopped with its client: {} of {N} tasks written", tagged("c").await);

    // Two applies of the same ids at once: one file or the other, whole.
    let reversed: Vec<serde_json::Value> = {
        let text = std::fs::read_to_string(task_file(dir.path(), "d.json", N, "d")).expect("read");
        let mut v: Vec<serde_json::Value> = serde_json::from_str(&text).expect("json");
        v.reverse();
        v
    };
    let d = dir.path().join("d-reversed.json");
    std::fs::write(&d, serde_json::to_string(&reversed).expect("json")).expect("write");
    let e = task_file(dir.path(), "e.json", N, "e");
    let mut first = apply_cmd(&server.addr, &d).stdout(Stdio::null()).spawn().expect("cli d");
    let mut second = apply_cmd(&server.addr, &e).stdout(Stdio::null()).spawn().expect("cli e");
    assert!(first.wait().expect("d").success() && second.wait().expect("e").success());
    let (d_count, e_count) = (tagged("d").await, tagged("e").await);
    assert!((d_count, e_count) == (N, 0) || (d_count, e_count) == (0, N), "a mix of two applies: {d_count} d, {e_count} e");
}
