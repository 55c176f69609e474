//! Issue 19, section 7: `deploy/` has a compose file (etcd, two control
//! planes, a runner, Prometheus, Grafana) and Kubernetes manifests (a
//! StatefulSet of control planes, a Deployment of runners, Services, a
//! ServiceMonitor). No container registry is reachable here, so they are
//! checked as far as can be without one:
//!
//! - the compose file with `docker-compose config` (Debian's docker-compose);
//! - the manifests with `kubernetes-validate --strict` (PyPI, ships the
//!   Kubernetes schemas; `make deps` installs it in `target/tools`); the
//!   ServiceMonitor (a Prometheus Operator resource it has no schema for)
//!   selects the control-plane Service and names a port it has;
//! - every `punchclock` command line in them uses only flags the built
//!   binary's subcommand takes, and every `$(VAR)` is defined;
//! - the image's Dockerfile copies binaries the workspace builds;
//! - compose's Prometheus config passes `promtool check config`.

use std::path::{Path, PathBuf};
use std::process::Command;

use punchclock_tests::{bin, repo_root};

fn run(cmd: &mut Command) -> (bool, String) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e} (make deps installs it)"));
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

/// Flags `punchclock SUB --help` lists.
fn flags_of(sub: &str) -> Vec<String> {
    let (ok, help) = run(Command::new(bin()).args([sub, "--help"]));
    assert!(ok, "{help}");
    help.split_whitespace().filter(|w| w.starts_with("--")).map(|w| w.trim_end_matches([',', '.']).to_string()).collect()
}

/// A punchclock command line uses only flags its subcommand takes.
fn check_command(where_: &str, args: &[String], env: &[String]) {
    let sub = args.first().unwrap_or_else(|| panic!("{where_}: empty command"));
    let known = flags_of(sub);
    for a in args.iter().filter(|a| a.starts_with("--")) {
        let flag = a.split('=').next().unwrap_or(a);
        assert!(known.iter().any(|k| k == flag), "{where_}: `punchclock {sub}` has no {flag}");
    }
    for a in args {
        let mut rest = a.as_str();
        while let Some(i) = rest.find("$(") {
            let var = &rest[i + 2..rest[i..].find(')').map_or(rest.len(), |j| i + j)];
            assert!(env.iter().any(|e| e == var), "{where_}: $({var}) is not in the container's env");
            rest = &rest[i + 2..];
        }
    }
}

fn strings(v: &serde_yaml_ng::Value) -> Vec<String> {
    v.as_sequence().map(|s| s.iter().filter_map(|x| x.as_str().map(str::to_string)).collect()).unwrap_or_default()
}

#[test]
fn the_compose_file_is_valid_and_names_real_flags() {
    let dir = repo_root().join("deploy/compose");
    let (ok, out) = run(Command::new("docker-compose")
        .arg("--project-directory")
        .arg(&dir)
        .arg("-f")
        .arg(dir.join("docker-compose.yml"))
        .arg("config"));
    assert!(ok, "docker-compose config: {out}");
    let doc: serde_yaml_ng::Value = serde_yaml_ng::from_str(&out).expect("the resolved compose file is YAML");
    let services = doc["services"].as_mapping().expect("services");
    let mut ours = 0;
    for (name, svc) in services {
        let name = name.as_str().unwrap_or("?");
        if svc["image"].as_str() != Some("punchclock:local") {
            continue;
        }
        ours += 1;
        let ctx = PathBuf::from(svc["build"]["context"].as_str().expect("build context"));
        assert!(ctx.join(svc["build"]["dockerfile"].as_str().expect("dockerfile")).exists(), "{name}: its Dockerfile");
        check_command(&format!("compose service {name}"), &strings(&svc["command"]), &[]);
    }
    assert_eq!(ours, 3, "two control planes and a runner");
    for svc in ["etcd", "prometheus", "grafana"] {
        assert!(services.contains_key(svc), "compose has {svc}");
    }
    // Its Prometheus config with the alert rules beside it.
    let tmp = tempfile::tempdir().expect("tempdir");
    std::fs::copy(dir.join("prometheus.yml"), tmp.path().join("prometheus.yml")).expect("copy");
    std::fs::copy(repo_root().join("deploy/prometheus/alerts.yml"), tmp.path().join("alerts.yml")).expect("copy");
    let (ok, out) = run(Command::new("promtool").args(["check", "config"]).arg(tmp.path().join("prometheus.yml")));
    assert!(ok, "promtool: {out}");
}

#[test]
fn the_kubernetes_manifests_are_valid_and_name_real_flags() {
    let dir = repo_root().join("deploy/kubernetes");
    let tool = std::env::var("KUBERNETES_VALIDATE")
        .map(PathBuf::from)
        .unwrap_or_else(|_| repo_root().join("target/tools/kubernetes-validate/bin/kubernetes-validate"));
    let files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("deploy/kubernetes")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    assert!(files.len() >= 4, "{files:?}");
    let (ok, out) = run(Command::new(&tool).arg("--strict").args(&files));
    assert!(ok && !out.contains("ERROR"), "kubernetes-validate: {out}");

    let mut docs = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).expect("read");
        for d in serde_yaml_ng::Deserializer::from_str(&text) {
            docs.push(<serde_yaml_ng::Value as serde::Deserialize>::deserialize(d).expect("yaml"));
        }
    }
    let kinds: Vec<&str> = docs.iter().filter_map(|d| d["kind"].as_str()).collect();
    for k in ["StatefulSet", "Deployment", "Service", "ServiceMonitor"] {
        assert!(kinds.contains(&k), "a {k}: {kinds:?}");
    }
    // Every punchclock container's arguments.
    let mut ours = 0;
    for d in docs.iter().filter(|d| matches!(d["kind"].as_str(), Some("StatefulSet" | "Deployment"))) {
        let name = d["metadata"]["name"].as_str().unwrap_or("?");
        for c in d["spec"]["template"]["spec"]["containers"].as_sequence().into_iter().flatten() {
            if c["image"].as_str() != Some("punchclock:local") {
                continue;
            }
            ours += 1;
            let env: Vec<String> =
                c["env"].as_sequence().into_iter().flatten().filter_map(|e| e["name"].as_str().map(str::to_string)).collect();
            check_command(name, &strings(&c["args"]), &env);
        }
    }
    assert_eq!(ours, 2, "the control plane and the runner");
    // The ServiceMonitor selects the control-plane Service, by a port it has.
    let sm = docs.iter().find(|d| d["kind"].as_str() == Some("ServiceMonitor")).expect("ServiceMonitor");
    let want = &sm["spec"]["selector"]["matchLabels"];
    let svc = docs
        .iter()
        .find(|d| {
            d["kind"].as_str() == Some("Service") && &d["metadata"]["labels"] == want && d["spec"]["clusterIP"].as_str() != Some("None")
        })
        .expect("a Service with the ServiceMonitor's labels");
    let port = sm["spec"]["endpoints"][0]["port"].as_str().expect("port");
    assert!(svc["spec"]["ports"].as_sequence().into_iter().flatten().any(|p| p["name"].as_str() == Some(port)), "port {port}");
}

#[test]
fn the_image_copies_binaries_the_build_makes() {
    let dockerfile = std::fs::read_to_string(repo_root().join("deploy/container/Dockerfile")).expect("Dockerfile");
    let built = bin();
    let target_dir = built.parent().expect("target/debug");
    let copied: Vec<String> = dockerfile
        .lines()
        .filter(|l| l.starts_with("COPY --from=build"))
        .flat_map(|l| {
            l.split_whitespace().filter(|w| w.contains("/target/release/")).map(|w| w.rsplit('/').next().unwrap_or("").to_string())
        })
        .collect();
    assert_eq!(copied, ["punchclock", "punchclock-agent-shim"]);
    for b in &copied {
        assert!(Path::new(target_dir).join(b).exists(), "the build makes {b} (in {})", target_dir.display());
    }
    assert!(dockerfile.contains("-p punchclock -p punchclock-agent-shim"), "the image builds both");
}
