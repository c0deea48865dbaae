//! CPU quotas for the scale runs: each capped gateway or writer in a cgroup of its own, so that
//! on a small shared machine the tier under test, not the machine, bounds throughput. cgroup v1
//! (`/sys/fs/cgroup/cpu/<group>/cpu.cfs_quota_us`) or v2 (`cpu.max`), whichever is writable.
//! The groups are removed when dropped (their processes go back to the root group first).

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
