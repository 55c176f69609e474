//! CPU, memory and process limits for process agents, through the
//! kernel's control groups: each execution gets a cgroup of its own, its
//! agent is born in it (the supervisor joins it before it starts the
//! agent), and when the execution ends the runner reads what it used —
//! peak memory, CPU seconds, whether the OOM killer struck — kills
//! whatever is left in it and removes it.
//!
//! Two layouts, found at start ([`Cgroups::detect`]):
//! - **cgroup v2** (the unified hierarchy with `memory`, `cpu` and `pids`
//!   delegated to the runner's own cgroup): the runner moves itself into a
//!   leaf `runner/` of its cgroup, enables the controllers below it, and
//!   puts executions under `agents/<execution>/`: `memory.max`,
//!   `memory.high` (90 % of it), `memory.oom.group`, `cpu.max`,
//!   `pids.max`; `cgroup.kill` ends them (also processes that left the
//!   agent's process group); `memory.events`' `oom_kill`, `memory.peak`
//!   and `cpu.stat`'s `usage_usec` are read at the end;
//! - **cgroup v1** (separate `memory`, `cpu`, `cpuacct` and `pids`
//!   hierarchies, as on this project's CI machines): a
//!   `punchclock-<runner>/<execution>/` in each, under the runner's own
//!   cgroup there: `memory.limit_in_bytes` (and `memory.memsw.limit_in_bytes`
//!   when swap is accounted), `cpu.cfs_quota_us` / `cpu.cfs_period_us`,
//!   `pids.max`; `memory.oom_control`'s `oom_kill`,
//!   `memory.max_usage_in_bytes` and `cpuacct.usage` at the end; what is
//!   left is SIGKILLed by pid.
//!
//! A runner with neither has no limits ([`Capability::None`]); an agent
//! whose limits are `enforce: required` is then refused at start, with the
//! reason. The runner advertises what it has as the label `cgroup`
//! (`v2`, `v1` or `none`), so a task's selector can ask for it.

use std::io;
use std::path::{Path, PathBuf};

/// Limits of one execution (`None`: no limit of that kind).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Limits {
    /// Bytes of memory (RAM, and swap where it is accounted).
    pub memory_max: Option<u64>,
    /// Cores (0.5: half of one).
    pub cpu: Option<f64>,
    /// Processes and threads.
    pub pids_max: Option<u64>,
}

// `cpu` is never NaN (the agents file and the task refuse it).
impl Eq for Limits {}

impl Limits {
    /// Whether any limit is set.
    pub fn any(&self) -> bool {
        self.memory_max.is_some() || self.cpu.is_some() || self.pids_max.is_some()
    }

    /// The tighter of each (a task may lower its agent's limits, never
    /// raise them).
    pub fn within(self, bound: Limits) -> Limits {
        fn min<T: PartialOrd>(a: Option<T>, b: Option<T>) -> Option<T> {
            match (a, b) {
                (Some(a), Some(b)) => Some(if a < b { a } else { b }),
                (a, b) => a.or(b),
            }
        }
        Limits {
            memory_max: min(self.memory_max, bound.memory_max),
            cpu: min(self.cpu, bound.cpu),
            pids_max: min(self.pids_max, bound.pids_max),
        }
    }
}

/// What the runner's host lets it limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Capability {
    /// cgroup v2, delegated.
    V2,
    /// cgroup v1 hierarchies.
    V1,
    /// Neither.
    None,
}

impl Capability {
    /// `v2`, `v1` or `none` (the runner's `cgroup` label).
    pub fn as_str(self) -> &'static str {
        match self {
            Capability::V2 => "v2",
            Capability::V1 => "v1",
            Capability::None => "none",
        }
    }
}

/// The runner's cgroups: where executions' cgroups go.
#[derive(Debug, Clone)]
pub struct Cgroups {
    layout: Layout,
    /// The runner's `agent_nice`: an execution's cgroup gets the CPU
    /// weight of that nice value ([`nice_weight`]), so an agent with limits
    /// yields to the runner as one without does (0: the default weight).
    agent_nice: u8,
}

#[derive(Debug, Clone)]
enum Layout {
    /// `agents/` under the runner's cgroup, controllers enabled.
    V2 {
        agents: PathBuf,
    },
    /// The parent directory in each hierarchy (`None`: not mounted).
    V1 {
        memory: Option<PathBuf>,
        cpu: Option<PathBuf>,
        cpuacct: Option<PathBuf>,
        pids: Option<PathBuf>,
    },
    None {
        why: String,
    },
}

impl Cgroups {
    /// Finds what the host offers under `root` (`/sys/fs/cgroup`), for the
    /// process whose `/proc/self/cgroup` is `own` (its text), and prepares
    /// the runner's part of it (`runner_id` names it in v1). Never fails:
    /// what cannot be used is [`Capability::None`], with the reason.
    pub fn detect(root: &Path, own: &str, runner_id: &str) -> Cgroups {
        Self::detect_on(root, own, runner_id, true)
    }

    /// [`Cgroups::detect`]; `check_fs`: a hierarchy counts only when it is
    /// a cgroup filesystem (`statfs`), not a directory that looks like one
    /// (off only for the unit tests' fake trees).
    fn detect_on(root: &Path, own: &str, runner_id: &str, check_fs: bool) -> Cgroups {
        match Self::try_v2(root, own, check_fs) {
            Ok(Some(agents)) => return Cgroups::of(Layout::V2 { agents }),
            Ok(None) => {}
            Err(e) => tracing::warn!(error = %e, "cgroup v2 is there but cannot be delegated to this runner; trying v1"),
        }
        let v1 = |controller: &str| -> Option<PathBuf> {
            let mount = root.join(controller);
            if !mount.join("cgroup.procs").exists() || (check_fs && !is_cgroup_fs(&mount, false)) {
                return None;
            }
            // The runner's own cgroup in that hierarchy: `N:controller,...:/path`.
            let path = own.lines().find_map(|l| {
                let mut parts = l.splitn(3, ':');
                let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
                controllers.split(',').any(|c| c == controller).then(|| path.trim_start_matches('/').to_string())
            });
            let own = mount.join(path.unwrap_or_default());
            // Made at the first execution with limits, or when the agent
            // zygote starts (`shared`); here only whether it could be.
            let writable = std::ffi::CString::new(own.as_os_str().as_encoded_bytes())
                // SAFETY: access(2) reads a NUL-terminated path.
                .is_ok_and(|c| unsafe { libc::access(c.as_ptr(), libc::W_OK) } == 0);
            if !writable {
                tracing::warn!(dir = %own.display(), "cannot create cgroups under the runner's own {controller} cgroup");
                return None;
            }
            Some(own.join(format!("punchclock-{runner_id}")))
        };
        let (memory, cpu, cpuacct, pids) = (v1("memory"), v1("cpu"), v1("cpuacct"), v1("pids"));
        if memory.is_none() && cpu.is_none() && pids.is_none() {
            return Cgroups::none(&format!(
                "no cgroup v2 with memory, cpu and pids delegated, and no cgroup v1 hierarchy under {}",
                root.display()
            ));
        }
        Cgroups::of(Layout::V1 { memory, cpu, cpuacct, pids })
    }

    /// No limits at all (a runner told not to use cgroups).
    pub fn none(why: &str) -> Cgroups {
        Cgroups::of(Layout::None { why: why.to_string() })
    }

    /// `layout`, with the default CPU weight ([`Cgroups::with_agent_nice`] sets another).
    fn of(layout: Layout) -> Cgroups {
        Cgroups { layout, agent_nice: 0 }
    }

    /// Executions' cgroups get the CPU weight of nice `nice` (the runner's
    /// `agent_nice`): v1 `cpu.shares`, v2 `cpu.weight`.
    pub fn with_agent_nice(mut self, nice: u8) -> Cgroups {
        self.agent_nice = nice;
        self
    }

    /// Prepares the cgroup all agents share and returns its `cgroup.procs`
    /// file, for the runner's agent zygote to join before it execs (so
    /// every supervisor and agent it forks starts in it): on cgroup v1, the
    /// runner's `punchclock-<id>` in the cpu hierarchy, with the
    /// `cpu.shares` of nice `agent_nice` ([`nice_weight`]), which weighs as
    /// one group against the runner. An execution with limits moves on to
    /// its own cgroup, a child of it.
    ///
    /// Why a group: a nice value weighs a process by the virtual runtime it
    /// has used, and the kernel places each new process at the average, so
    /// a stream of short-lived agents at nice 19 still took ~75 % of the
    /// CPU from the runner's threads during a burst (300 `/bin/true` due at
    /// once, 2 cores: the runner's threads waited up to 49 ms for a core);
    /// a cgroup's weight holds for all its processes, new or old.
    ///
    /// Not on v2 yet: there the executions with limits are `agents/<id>`,
    /// siblings a shared leaf would weigh against one by one (the zygote
    /// and every agent without limits as much as one limited execution);
    /// that wants `agents/limited/<id>` first.
    ///
    /// `Ok(None)`: nothing to join (v2, no cgroups, no cpu controller, or
    /// `agent_nice` 0).
    ///
    /// # Errors
    ///
    /// A directory or file that cannot be written, naming it.
    pub fn shared(&self) -> io::Result<Option<PathBuf>> {
        let Layout::V1 { cpu: Some(group), .. } = &self.layout else { return Ok(None) };
        if self.agent_nice == 0 {
            return Ok(None);
        }
        std::fs::create_dir_all(group)?;
        let shares = nice_weight(self.agent_nice).max(2).to_string();
        std::fs::write(group.join("cpu.shares"), &shares)
            .map_err(|e| io::Error::new(e.kind(), format!("{}/cpu.shares = {shares}: {e}", group.display())))?;
        Ok(Some(group.join("cgroup.procs")))
    }

    /// cgroup v2: the runner's own cgroup (`0::/path`) must offer memory,
    /// cpu and pids; the runner moves into `runner/` under it and executions
    /// go under `agents/`. `Ok(None)`: no usable v2 here.
    fn try_v2(root: &Path, own: &str, check_fs: bool) -> io::Result<Option<PathBuf>> {
        let unified = if root.join("cgroup.controllers").exists() { root.to_path_buf() } else { root.join("unified") };
        if check_fs && !is_cgroup_fs(&unified, true) {
            return Ok(None);
        }
        let Some(path) = own.lines().find_map(|l| l.strip_prefix("0::")) else { return Ok(None) };
        let mine = unified.join(path.trim_start_matches('/'));
        let available = std::fs::read_to_string(mine.join("cgroup.controllers")).unwrap_or_default();
        let wanted = ["memory", "cpu", "pids"];
        if !wanted.iter().all(|c| available.split_whitespace().any(|a| a == *c)) {
            return Ok(None);
        }
        // No process may stay in a cgroup whose controllers are enabled for
        // its children: the runner moves into a leaf of its own.
        let runner = mine.join("runner");
        std::fs::create_dir_all(&runner)?;
        std::fs::write(runner.join("cgroup.procs"), std::process::id().to_string())?;
        std::fs::write(mine.join("cgroup.subtree_control"), "+memory +cpu +pids")?;
        let agents = mine.join("agents");
        std::fs::create_dir_all(&agents)?;
        std::fs::write(agents.join("cgroup.subtree_control"), "+memory +cpu +pids")?;
        Ok(Some(agents))
    }

    /// Removes the cgroups a previous process of this runner left (killed
    /// with SIGKILL before it could): each empty one goes; one that still
    /// holds processes (another runner process with the same id, or an
    /// agent its shim has not killed yet) is left alone. Returns how many
    /// were removed.
    pub fn sweep(&self) -> usize {
        let parents: Vec<&PathBuf> = match &self.layout {
            Layout::V2 { agents } => vec![agents],
            Layout::V1 { memory, cpu, cpuacct, pids } => [memory, cpu, cpuacct, pids].into_iter().flatten().collect(),
            Layout::None { .. } => Vec::new(),
        };
        let mut removed = 0;
        for parent in parents {
            for entry in std::fs::read_dir(parent).into_iter().flatten().flatten() {
                if entry.file_type().is_ok_and(|t| t.is_dir()) && std::fs::remove_dir(entry.path()).is_ok() {
                    removed += 1;
                }
            }
        }
        removed
    }

    /// What this runner can limit.
    pub fn capability(&self) -> Capability {
        match self.layout {
            Layout::V2 { .. } => Capability::V2,
            Layout::V1 { .. } => Capability::V1,
            Layout::None { .. } => Capability::None,
        }
    }

    /// Why `limits` cannot all be applied here, if they cannot.
    pub fn missing(&self, limits: &Limits) -> Option<String> {
        match &self.layout {
            Layout::V2 { .. } => None,
            Layout::None { why } => limits.any().then(|| why.clone()),
            Layout::V1 { memory, cpu, pids, .. } => {
                let mut gone = Vec::new();
                if limits.memory_max.is_some() && memory.is_none() {
                    gone.push("memory");
                }
                if limits.cpu.is_some() && cpu.is_none() {
                    gone.push("cpu");
                }
                if limits.pids_max.is_some() && pids.is_none() {
                    gone.push("pids");
                }
                (!gone.is_empty()).then(|| format!("no cgroup v1 {} controller on this host", gone.join(", ")))
            }
        }
    }

    /// The cgroup of one execution, with `limits` applied (and, for the
    /// accounting of what it used, one even without limits where the host
    /// has cgroups). `None` without cgroups.
    ///
    /// # Errors
    ///
    /// A directory or file of the cgroup that cannot be written.
    pub fn create(&self, execution_id: &str, limits: &Limits) -> io::Result<Option<ExecCgroup>> {
        let mut made = ExecCgroup::default();
        match self.try_create(execution_id, limits, &mut made) {
            Ok(cg) => Ok(cg),
            Err(e) => {
                // Nothing of a cgroup that could not be made is left behind.
                made.kill_and_remove();
                Err(e)
            }
        }
    }

    /// [`Cgroups::create`]; what it made so far is in `made` (to remove on
    /// an error). Errors name the file.
    fn try_create(&self, execution_id: &str, limits: &Limits, made: &mut ExecCgroup) -> io::Result<Option<ExecCgroup>> {
        let write = |dir: &Path, file: &str, value: String| {
            std::fs::write(dir.join(file), &value).map_err(|e| io::Error::new(e.kind(), format!("{file} = {value}: {e}")))
        };
        let name = sanitize(execution_id);
        match &self.layout {
            Layout::None { .. } => Ok(None),
            Layout::V2 { agents } => {
                let dir = agents.join(&name);
                std::fs::create_dir_all(&dir)?;
                made.v2 = Some(dir.clone());
                if self.agent_nice > 0 {
                    // cpu.weight 100 is nice 0's 1,024 (1..=10000).
                    write(&dir, "cpu.weight", (nice_weight(self.agent_nice) * 100 / 1024).max(1).to_string())?;
                }
                if let Some(m) = limits.memory_max {
                    write(&dir, "memory.max", m.to_string())?;
                    write(&dir, "memory.high", (m / 10 * 9).max(1).to_string())?;
                    let _ = std::fs::write(dir.join("memory.oom.group"), "1");
                }
                if let Some(c) = limits.cpu {
                    write(&dir, "cpu.max", format!("{} 100000", ((c * 100_000.0).round() as u64).max(1000)))?;
                }
                if let Some(p) = limits.pids_max {
                    write(&dir, "pids.max", p.to_string())?;
                }
                Ok(Some(std::mem::take(made)))
            }
            Layout::V1 { memory, cpu, cpuacct, pids } => {
                let make = |parent: &Option<PathBuf>, slot: &mut Option<PathBuf>| -> io::Result<()> {
                    if let Some(p) = parent {
                        let d = p.join(&name);
                        std::fs::create_dir_all(&d)?;
                        *slot = Some(d);
                    }
                    Ok(())
                };
                make(memory, &mut made.memory)?;
                make(cpu, &mut made.cpu)?;
                make(cpuacct, &mut made.cpuacct)?;
                make(pids, &mut made.pids)?;
                if let (Some(m), Some(d)) = (limits.memory_max, &made.memory) {
                    write(d, "memory.limit_in_bytes", m.to_string())?;
                    // RAM and swap together: no way around the limit by swapping.
                    let _ = std::fs::write(d.join("memory.memsw.limit_in_bytes"), m.to_string());
                }
                if let (true, Some(d)) = (self.agent_nice > 0, &made.cpu) {
                    write(d, "cpu.shares", nice_weight(self.agent_nice).max(2).to_string())?;
                }
                if let (Some(c), Some(d)) = (limits.cpu, &made.cpu) {
                    write(d, "cpu.cfs_period_us", "100000".into())?;
                    write(d, "cpu.cfs_quota_us", ((c * 100_000.0).round() as u64).max(1000).to_string())?;
                }
                if let (Some(p), Some(d)) = (limits.pids_max, &made.pids) {
                    write(d, "pids.max", p.to_string())?;
                }
                Ok(Some(std::mem::take(made)))
            }
        }
    }
}

/// The kernel's CPU weight of a nice value 0-19 (`sched_prio_to_weight`,
/// kernel/sched/core.c): nice 0 is 1,024, each step about 1.25 times less,
/// nice 19 is 15. What a cgroup's `cpu.shares` (v1) weighs against a
/// process at that nice value in the same parent.
pub fn nice_weight(nice: u8) -> u64 {
    const WEIGHTS: [u64; 20] = [1024, 820, 655, 526, 423, 335, 272, 215, 172, 137, 110, 87, 70, 56, 45, 36, 29, 23, 18, 15];
    WEIGHTS[usize::from(nice.min(19))]
}

/// Whether `dir` is on a cgroup filesystem (`v2`: cgroup2, else cgroup v1).
fn is_cgroup_fs(dir: &Path, v2: bool) -> bool {
    const CGROUP_SUPER_MAGIC: i64 = 0x0027_e0eb;
    const CGROUP2_SUPER_MAGIC: i64 = 0x6367_7270;
    let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()) else { return false };
    // SAFETY: statfs(2) writes into the zeroed struct we own.
    let mut s: libc::statfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statfs(c.as_ptr(), &mut s) } != 0 {
        return false;
    }
    #[allow(clippy::unnecessary_cast)]
    let magic = s.f_type as i64;
    magic == if v2 { CGROUP2_SUPER_MAGIC } else { CGROUP_SUPER_MAGIC }
}

/// A cgroup name from an execution id (UUID-shaped: kept as is).
fn sanitize(id: &str) -> String {
    id.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' }).take(128).collect()
}

/// One execution's cgroup (one directory in v2, one per hierarchy in v1).
#[derive(Debug, Default)]
pub struct ExecCgroup {
    v2: Option<PathBuf>,
    memory: Option<PathBuf>,
    cpu: Option<PathBuf>,
    cpuacct: Option<PathBuf>,
    pids: Option<PathBuf>,
}

/// What an execution used, read from its cgroup at the end.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Usage {
    /// The OOM killer killed a process of it.
    pub oom_killed: bool,
    /// Highest memory use, bytes.
    pub peak_memory_bytes: Option<u64>,
    /// CPU time of all its processes, seconds.
    pub cpu_seconds: Option<f64>,
}

impl ExecCgroup {
    fn dirs(&self) -> Vec<&PathBuf> {
        [&self.v2, &self.memory, &self.cpu, &self.cpuacct, &self.pids].into_iter().flatten().collect()
    }

    /// The `cgroup.procs` files a process joins (writing its pid, or `0`
    /// for itself, to each).
    pub fn procs_files(&self) -> Vec<PathBuf> {
        self.dirs().into_iter().map(|d| d.join("cgroup.procs")).collect()
    }

    /// Moves `pid` into it.
    ///
    /// # Errors
    ///
    /// A `cgroup.procs` that cannot be written (the process is gone).
    pub fn add(&self, pid: u32) -> io::Result<()> {
        for f in self.procs_files() {
            std::fs::write(f, pid.to_string())?;
        }
        Ok(())
    }

    /// What it used.
    pub fn usage(&self) -> Usage {
        let read = |d: &Option<PathBuf>, f: &str| d.as_ref().and_then(|d| std::fs::read_to_string(d.join(f)).ok());
        let field = |text: Option<String>, key: &str| {
            text.and_then(|t| t.lines().find_map(|l| l.strip_prefix(key).and_then(|v| v.trim().parse::<u64>().ok())))
        };
        match &self.v2 {
            Some(_) => Usage {
                oom_killed: field(read(&self.v2, "memory.events"), "oom_kill ").is_some_and(|n| n > 0),
                peak_memory_bytes: read(&self.v2, "memory.peak").and_then(|t| t.trim().parse().ok()),
                cpu_seconds: field(read(&self.v2, "cpu.stat"), "usage_usec ").map(|us| us as f64 / 1e6),
            },
            None => Usage {
                oom_killed: field(read(&self.memory, "memory.oom_control"), "oom_kill ").is_some_and(|n| n > 0),
                peak_memory_bytes: read(&self.memory, "memory.max_usage_in_bytes").and_then(|t| t.trim().parse().ok()),
                cpu_seconds: read(&self.cpuacct, "cpuacct.usage").and_then(|t| t.trim().parse::<u64>().ok()).map(|ns| ns as f64 / 1e9),
            },
        }
    }

    /// Kills every process still in it (v2: `cgroup.kill`; v1: SIGKILL by
    /// pid until none is left, at most 20 rounds), then removes it.
    pub fn kill_and_remove(self) {
        if let Some(d) = &self.v2
            && std::fs::write(d.join("cgroup.kill"), "1").is_err()
        {
            self.kill_by_pid();
        }
        if self.v2.is_none() {
            self.kill_by_pid();
        }
        for d in self.dirs() {
            for _ in 0..50 {
                match std::fs::remove_dir(d) {
                    Ok(()) => break,
                    Err(e) if e.kind() == io::ErrorKind::NotFound => break,
                    // EBUSY while the last processes are being reaped.
                    Err(_) => std::thread::sleep(std::time::Duration::from_millis(10)),
                }
            }
        }
    }

    fn kill_by_pid(&self) {
        for _ in 0..20 {
            let mut any = false;
            for f in self.procs_files() {
                for pid in std::fs::read_to_string(&f).unwrap_or_default().lines().filter_map(|l| l.trim().parse::<libc::pid_t>().ok()) {
                    // Never the runner itself or its parent (an agent running
                    // as root could move them in), nor init.
                    // SAFETY: getppid(2) has no preconditions.
                    if pid <= 1 || pid.unsigned_abs() == std::process::id() || pid == unsafe { libc::getppid() } {
                        continue;
                    }
                    any = true;
                    // SAFETY: kill(2) has no memory-safety preconditions.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
            }
            if !any {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }
}

pub use punchclock_units::parse_bytes;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn task_limits_stay_within_the_agents() {
        let agent = Limits { memory_max: Some(512 << 20), cpu: Some(1.0), pids_max: None };
        let task = Limits { memory_max: Some(1 << 30), cpu: Some(0.5), pids_max: Some(64) };
        assert_eq!(
            task.within(agent),
            Limits { memory_max: Some(512 << 20), cpu: Some(0.5), pids_max: Some(64) },
            "never above the agent's"
        );
    }

    /// v1 on a fake tree: the files a limit writes, and what is read back.
    #[test]
    fn v1_layout_writes_limits_and_reads_usage() {
        let root = tempfile::tempdir().expect("tempdir");
        fake_v1(root.path(), "sandbox");
        let own = "4:memory:/sandbox\n1:cpu:/\n2:cpuacct:/\n8:pids:/\n0::/\n";
        let cgs = Cgroups::detect_on(root.path(), own, "r1", false).with_agent_nice(19);
        assert_eq!(cgs.capability(), Capability::V1);
        assert!(!root.path().join("memory/sandbox/punchclock-r1").exists(), "made at the first execution only");
        let limits = Limits { memory_max: Some(64 << 20), cpu: Some(0.5), pids_max: Some(32) };
        assert_eq!(cgs.missing(&limits), None);
        let cg = cgs.create("e-1", &limits).expect("create").expect("some");
        assert!(root.path().join("memory/sandbox/punchclock-r1").is_dir(), "under the runner's own memory cgroup");
        let read = |p: &str| std::fs::read_to_string(root.path().join(p)).expect(p);
        assert_eq!(read("memory/sandbox/punchclock-r1/e-1/memory.limit_in_bytes"), (64u64 << 20).to_string());
        assert_eq!(read("cpu/punchclock-r1/e-1/cpu.cfs_quota_us"), "50000");
        assert_eq!(read("cpu/punchclock-r1/e-1/cpu.shares"), "15", "the weight of nice 19");
        assert_eq!(read("pids/punchclock-r1/e-1/pids.max"), "32");
        std::fs::write(
            root.path().join("memory/sandbox/punchclock-r1/e-1/memory.oom_control"),
            "oom_kill_disable 0\nunder_oom 0\noom_kill 1\n",
        )
        .expect("w");
        std::fs::write(root.path().join("memory/sandbox/punchclock-r1/e-1/memory.max_usage_in_bytes"), "1234\n").expect("w");
        std::fs::write(root.path().join("cpuacct/punchclock-r1/e-1/cpuacct.usage"), "2500000000\n").expect("w");
        assert_eq!(cg.usage(), Usage { oom_killed: true, peak_memory_bytes: Some(1234), cpu_seconds: Some(2.5) });
    }

    /// Found by breaking it: a limit the kernel refused left the
    /// execution's directories behind, and a runner killed with SIGKILL
    /// left its executions' cgroups for good.
    #[test]
    fn a_cgroup_that_cannot_be_made_leaves_nothing_and_leftovers_are_swept() {
        let root = tempfile::tempdir().expect("tempdir");
        fake_v1(root.path(), "punchclock-r1");
        let cgs = Cgroups::detect_on(
            root.path(),
            "4:memory:/
1:cpu:/
2:cpuacct:/
8:pids:/
",
            "r1",
            false,
        );
        // The pids directory cannot be made (a file is in the way).
        std::fs::write(root.path().join("pids/punchclock-r1/e-3"), "").expect("file");
        let err = cgs.create("e-3", &Limits { memory_max: Some(64 << 20), cpu: None, pids_max: Some(8) }).expect_err("cannot");
        assert!(!root.path().join("memory/punchclock-r1/e-3").exists(), "{err}: memory cgroup left behind");
        assert!(!root.path().join("cpu/punchclock-r1/e-3").exists(), "{err}: cpu cgroup left behind");
        std::fs::remove_file(root.path().join("pids/punchclock-r1/e-3")).expect("rm");
        // Leftovers of a killed runner process: empty ones go.
        for c in ["memory", "pids"] {
            std::fs::create_dir_all(root.path().join(c).join("punchclock-r1/old")).expect("mkdir");
        }
        std::fs::create_dir_all(root.path().join("cpu/punchclock-r1/busy/child")).expect("mkdir");
        assert_eq!(cgs.sweep(), 2);
        assert!(root.path().join("cpu/punchclock-r1/busy").exists(), "one that is not empty stays");
    }

    #[test]
    fn no_cgroups_says_why_for_limits_only() {
        let root = tempfile::tempdir().expect("tempdir");
        let cgs = Cgroups::detect_on(root.path(), "0::/\n", "r1", false);
        assert_eq!(cgs.capability(), Capability::None);
        assert_eq!(cgs.missing(&Limits::default()), None);
        assert!(cgs.missing(&Limits { cpu: Some(1.0), ..Default::default() }).is_some_and(|w| w.contains("no cgroup")));
        assert!(cgs.create("e", &Limits::default()).expect("ok").is_none());
    }

    /// v2 on a fake tree: the runner moves into its leaf, controllers are
    /// enabled below it, and an execution's files are written.
    #[test]
    fn v2_layout_delegates_and_writes_limits() {
        let root = tempfile::tempdir().expect("tempdir");
        let mine = fake_v2(root.path(), "cpuset cpu io memory pids");
        let cgs = Cgroups::detect_on(root.path(), "0::/svc\n", "r1", false).with_agent_nice(10);
        assert_eq!(cgs.capability(), Capability::V2);
        assert_eq!(std::fs::read_to_string(mine.join("runner/cgroup.procs")).expect("moved"), std::process::id().to_string());
        assert_eq!(std::fs::read_to_string(mine.join("agents/cgroup.subtree_control")).expect("enabled"), "+memory +cpu +pids");
        let cg = cgs.create("e-2", &Limits { memory_max: Some(1000), cpu: Some(2.0), pids_max: None }).expect("create").expect("some");
        assert_eq!(std::fs::read_to_string(mine.join("agents/e-2/cpu.max")).expect("cpu"), "200000 100000");
        assert_eq!(std::fs::read_to_string(mine.join("agents/e-2/cpu.weight")).expect("weight"), "10", "nice 10's 110 of 1,024");
        assert_eq!(std::fs::read_to_string(mine.join("agents/e-2/memory.high")).expect("high"), "900");
        std::fs::write(mine.join("agents/e-2/memory.events"), "low 0\nhigh 3\nmax 2\noom 1\noom_kill 1\n").expect("w");
        std::fs::write(mine.join("agents/e-2/cpu.stat"), "usage_usec 1500000\nuser_usec 1\n").expect("w");
        let u = cg.usage();
        assert!(u.oom_killed && u.cpu_seconds == Some(1.5), "{u:?}");
    }

    /// The agents' shared cgroup weighs nice `agent_nice` as one group: v1
    /// the runner's `punchclock-<id>` in the cpu hierarchy; nothing at nice
    /// 0 or on v2.
    #[test]
    fn the_agents_share_one_cgroup_of_the_agent_nice_weight() {
        let root = tempfile::tempdir().expect("tempdir");
        fake_v1(root.path(), "");
        let own = "4:memory:/\n1:cpu:/\n2:cpuacct:/\n8:pids:/\n0::/\n";
        assert_eq!(Cgroups::detect_on(root.path(), own, "r1", false).shared().expect("nice 0"), None);
        let procs = Cgroups::detect_on(root.path(), own, "r1", false).with_agent_nice(19).shared().expect("v1").expect("some");
        assert_eq!(procs, root.path().join("cpu/punchclock-r1/cgroup.procs"));
        assert_eq!(std::fs::read_to_string(root.path().join("cpu/punchclock-r1/cpu.shares")).expect("shares"), "15");

        let root = tempfile::tempdir().expect("tempdir");
        fake_v2(root.path(), "cpu memory pids");
        let v2 = Cgroups::detect_on(root.path(), "0::/svc\n", "r1", false).with_agent_nice(19);
        assert_eq!(v2.capability(), Capability::V2);
        assert_eq!(v2.shared().expect("v2"), None, "not on v2 yet");
        assert_eq!(Cgroups::none("off").with_agent_nice(19).shared().expect("none"), None);
    }

    /// A fake v1 tree under `root`: the four hierarchies, each with an
    /// empty `cgroup.procs` and the directory `own` (the runner's cgroup).
    fn fake_v1(root: &Path, own: &str) {
        for c in ["memory", "cpu", "cpuacct", "pids"] {
            std::fs::create_dir_all(root.join(c).join(own)).expect("mkdir");
            std::fs::write(root.join(c).join("cgroup.procs"), "").expect("procs");
        }
    }

    /// A fake v2 tree under `root` whose runner cgroup `svc` offers
    /// `controllers`; returns `svc`'s path.
    fn fake_v2(root: &Path, controllers: &str) -> PathBuf {
        let mine = root.join("svc");
        std::fs::create_dir_all(&mine).expect("mkdir");
        std::fs::write(root.join("cgroup.controllers"), "cpu memory pids").expect("w");
        std::fs::write(mine.join("cgroup.controllers"), controllers).expect("w");
        mine
    }
}
