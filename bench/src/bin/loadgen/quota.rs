//! CPU quotas for the scale runs: each capped gateway or writer in a cgroup of its own, so that
//! on a small shared machine the tier under test, not the machine, bounds throughput. cgroup v1
//! (`/sys/fs/cgroup/cpu/<group>/cpu.cfs_quota_us`) or v2 (`cpu.max`), whichever is writable.
//! The groups are removed when dropped (their processes go back to the root group first).
//! Memory budgets ([`Memory`]) for PostgreSQL in the runs at size, the same way.

use std::path::{Path, PathBuf};

const PERIOD_US: u64 = 100_000;

#[derive(Clone, Debug)]
pub enum Cgroups {
    V1(PathBuf),
    V2(PathBuf),
}

impl Cgroups {
    /// The writable hierarchy with a CPU controller, if any.
    pub fn detect() -> Option<Cgroups> {
        let v1 = Path::new("/sys/fs/cgroup/cpu");
        if v1.join("cpu.cfs_quota_us").exists() && writable(v1) {
            return Some(Cgroups::V1(v1.to_path_buf()));
        }
        for root in ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"] {
            let root = Path::new(root);
            let controllers = std::fs::read_to_string(root.join("cgroup.controllers")).unwrap_or_default();
            if controllers.split_whitespace().any(|c| c == "cpu") && writable(root) {
                // Children get the cpu controller only when the parent hands it down.
                let _ = std::fs::write(root.join("cgroup.subtree_control"), "+cpu");
                return Some(Cgroups::V2(root.to_path_buf()));
            }
        }
        None
    }

    pub fn version(&self) -> &'static str {
        match self {
            Cgroups::V1(_) => "v1 (cpu.cfs_quota_us)",
            Cgroups::V2(_) => "v2 (cpu.max)",
        }
    }

    /// A group `name` capped at `cores` (0.5 = half a core), holding `pid`.
    pub fn cap(&self, name: &str, cores: f64, pid: u32) -> anyhow::Result<Group> {
        let (root, path) = match self {
            Cgroups::V1(root) | Cgroups::V2(root) => (root.clone(), root.join(name)),
        };
        std::fs::create_dir_all(&path)?;
        let quota = ((cores * PERIOD_US as f64) as u64).max(1_000);
        // A weight ten times the default as well: the quota, not the other processes of a busy
        // machine, is what may hold a capped process back. The quota still bounds it.
        match self {
            Cgroups::V1(_) => {
                std::fs::write(path.join("cpu.cfs_period_us"), PERIOD_US.to_string())?;
                std::fs::write(path.join("cpu.cfs_quota_us"), quota.to_string())?;
                std::fs::write(path.join("cpu.shares"), "10240")?;
            }
            Cgroups::V2(_) => {
                std::fs::write(path.join("cpu.max"), format!("{quota} {PERIOD_US}"))?;
                std::fs::write(path.join("cpu.weight"), "1000")?;
            }
        }
        std::fs::write(path.join("cgroup.procs"), pid.to_string())?;
        Ok(Group { root, path })
    }
}

fn writable(dir: &Path) -> bool {
    let probe = dir.join(format!("intake-probe-{}", std::process::id()));
    let made = std::fs::create_dir(&probe).is_ok();
    let _ = std::fs::remove_dir(&probe);
    made
}

pub struct Group {
    root: PathBuf,
    path: PathBuf,
}

impl Group {
    /// Periods in which the group was throttled, from `cpu.stat`.
    pub fn throttled_periods(&self) -> u64 {
        std::fs::read_to_string(self.path.join("cpu.stat"))
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("nr_throttled "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        let procs = std::fs::read_to_string(self.path.join("cgroup.procs")).unwrap_or_default();
        for pid in procs.lines() {
            let _ = std::fs::write(self.root.join("cgroup.procs"), pid);
        }
        let _ = std::fs::remove_dir(&self.path);
    }
}

/// Memory budgets for the runs at size: PostgreSQL in a memory cgroup of its own, page cache
/// included (cgroup v1 `memory.limit_in_bytes`, v2 `memory.max`), so that a data set larger
/// than the budget is read from disk as it would be on a machine whose memory it outgrew.
#[derive(Clone, Debug)]
pub enum Memory {
    V1(PathBuf),
    V2(PathBuf),
}

impl Memory {
    /// The writable hierarchy with a memory controller, if any.
    pub fn detect() -> Option<Memory> {
        let v1 = Path::new("/sys/fs/cgroup/memory");
        if v1.join("memory.limit_in_bytes").exists() && writable(v1) {
            return Some(Memory::V1(v1.to_path_buf()));
        }
        for root in ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"] {
            let root = Path::new(root);
            let controllers = std::fs::read_to_string(root.join("cgroup.controllers")).unwrap_or_default();
            if controllers.split_whitespace().any(|c| c == "memory") && writable(root) {
                let _ = std::fs::write(root.join("cgroup.subtree_control"), "+memory");
                return Some(Memory::V2(root.to_path_buf()));
            }
        }
        None
    }

    pub fn version(&self) -> &'static str {
        match self {
            Memory::V1(_) => "v1 (memory.limit_in_bytes, page cache included)",
            Memory::V2(_) => "v2 (memory.max, page cache included)",
        }
    }

    /// A group `name` without a limit yet; the processes started through
    /// [`MemoryGroup::procs_file`] and their children belong to it.
    pub fn group(&self, name: &str) -> anyhow::Result<MemoryGroup> {
        let (root, v2) = match self {
            Memory::V1(root) => (root.clone(), false),
            Memory::V2(root) => (root.clone(), true),
        };
        let path = root.join(name);
        std::fs::create_dir_all(&path)?;
        Ok(MemoryGroup { root, path, v2 })
    }
}

pub struct MemoryGroup {
    root: PathBuf,
    path: PathBuf,
    v2: bool,
}

impl MemoryGroup {
    /// Writing a pid here moves that process into the group.
    pub fn procs_file(&self) -> PathBuf {
        self.path.join("cgroup.procs")
    }

    /// Caps the group at `bytes` (None: no limit). Lowering the limit below what the group holds
    /// makes the kernel reclaim its page cache down to it first.
    pub fn limit(&self, bytes: Option<u64>) -> anyhow::Result<()> {
        let (file, value) = match (self.v2, bytes) {
            (false, Some(b)) => ("memory.limit_in_bytes", b.to_string()),
            (false, None) => ("memory.limit_in_bytes", "-1".to_owned()),
            (true, Some(b)) => ("memory.max", b.to_string()),
            (true, None) => ("memory.max", "max".to_owned()),
        };
        std::fs::write(self.path.join(file), value).map_err(|e| anyhow::anyhow!("{file}: {e}"))
    }

    /// The limit in force (None: none).
    pub fn limit_bytes(&self) -> Option<u64> {
        let file = if self.v2 { "memory.max" } else { "memory.limit_in_bytes" };
        std::fs::read_to_string(self.path.join(file))
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .filter(|&b| b < (1 << 60))
    }

    /// The file that says what the group holds now: its processes' memory and the page cache
    /// charged to it, in bytes.
    pub fn usage_file(&self) -> PathBuf {
        self.path.join(if self.v2 { "memory.current" } else { "memory.usage_in_bytes" })
    }

    /// Page cache (shared memory included), anonymous memory and shared memory alone, from
    /// `memory.stat`.
    pub fn breakdown(&self) -> [(&'static str, u64); 3] {
        let stat = std::fs::read_to_string(self.path.join("memory.stat")).unwrap_or_default();
        let field = |name: &str| {
            stat.lines()
                .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')))
                .and_then(|v| v.trim().parse::<u64>().ok())
                .unwrap_or(0)
        };
        if self.v2 {
            [("page_cache", field("file")), ("anonymous", field("anon")), ("shared_memory", field("shmem"))]
        } else {
            [
                ("page_cache", field("total_cache")),
                ("anonymous", field("total_rss")),
                ("shared_memory", field("total_shmem")),
            ]
        }
    }

    /// Reads the bytes of the group's page cache dirty or under writeback: what reclaim has to
    /// wait for. A cgroup v1 group has no dirty limit of its own (the machine's `vm.dirty_*`
    /// apply to all of memory), so without early flushes this can grow to most of the group.
    pub fn dirty_reader(&self) -> impl Fn() -> u64 + Send + 'static {
        let stat_file = self.path.join("memory.stat");
        let names: [&str; 2] =
            if self.v2 { ["file_dirty", "file_writeback"] } else { ["total_dirty", "total_writeback"] };
        move || {
            std::fs::read_to_string(&stat_file)
                .unwrap_or_default()
                .lines()
                .filter_map(|l| l.split_once(' '))
                .filter(|(name, _)| names.contains(name))
                .filter_map(|(_, v)| v.trim().parse::<u64>().ok())
                .sum()
        }
    }

    /// Times the group hit its limit (v1 `memory.failcnt`, v2 `max` in `memory.events`).
    pub fn limit_hits(&self) -> u64 {
        if self.v2 {
            std::fs::read_to_string(self.path.join("memory.events"))
                .unwrap_or_default()
                .lines()
                .find_map(|l| l.strip_prefix("max "))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0)
        } else {
            std::fs::read_to_string(self.path.join("memory.failcnt"))
                .ok()
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0)
        }
    }
}

impl Drop for MemoryGroup {
    fn drop(&mut self) {
        let procs = std::fs::read_to_string(self.procs_file()).unwrap_or_default();
        for pid in procs.lines() {
            let _ = std::fs::write(self.root.join("cgroup.procs"), pid);
        }
        let _ = std::fs::remove_dir(&self.path);
    }
}
