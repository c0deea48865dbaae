//! The machine the run is on, the versions it ran against, and what each process of the stack
//! costs: CPU time from /proc/PID/stat between two snapshots, peak memory from
//! /proc/PID/status. The machine is shared, so the whole machine's busy time is recorded too:
//! what no process of ours accounts for is somebody else's load.

use intake_tests::serde_json::{self, json, Value};
use std::collections::BTreeMap;
use std::time::Instant;

/// The machine, and how busy it was over `quiet_check` before the run (a shared machine shows).
pub async fn describe(quiet_check: std::time::Duration) -> Value {
    let before = machine_ticks();
    tokio::time::sleep(quiet_check).await;
    let after = machine_ticks();
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
    let busy_before = (after.busy - before.busy) as f64 / (after.total - before.total).max(1) as f64 * cores as f64;
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, m)| m.trim().to_owned())
        .unwrap_or_default();
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let memory_kib: f64 = meminfo
        .lines()
        .find(|l| l.starts_with("MemTotal:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    let os = std::fs::read_to_string("/etc/os-release")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("PRETTY_NAME="))
        .map(|v| v.trim_matches('"').to_owned())
        .unwrap_or_default();
    json!({
        "cores": cores,
        "busy_cores_before_run": round2(busy_before),
        "cpu_model": model,
        "memory_gib": (memory_kib / 1024.0 / 1024.0 * 10.0).round() / 10.0,
        "os": os,
        "kernel": command_output("uname", &["-r"]),
        "load_average_at_start": std::fs::read_to_string("/proc/loadavg").unwrap_or_default().split_whitespace().take(3).collect::<Vec<_>>().join(" "),
    })
}

pub fn command_output(program: &str, args: &[&str]) -> String {
    std::process::Command::new(program)
        .args(args)
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default()
}

pub async fn versions(db: &sqlx::PgPool, redis_url: &str) -> Value {
    let postgres: String =
        sqlx::query_scalar("SELECT current_setting('server_version')").fetch_one(db).await.unwrap_or_default();
    let fsync: String = sqlx::query_scalar("SELECT current_setting('fsync')").fetch_one(db).await.unwrap_or_default();
    let redis = match redis::Client::open(redis_url) {
        Ok(client) => match client.get_multiplexed_async_connection().await {
            Ok(mut connection) => {
                let info: String =
                    redis::cmd("INFO").arg("server").query_async(&mut connection).await.unwrap_or_default();
                info.lines().find_map(|l| l.strip_prefix("redis_version:")).unwrap_or_default().trim().to_owned()
            }
            Err(_) => String::new(),
        },
        Err(_) => String::new(),
    };
    json!({
        "kafka": std::env::var("INTAKE_KAFKA_VERSION").unwrap_or_else(|_| "unknown (INTAKE_KAFKA_VERSION unset)".into()),
        "postgresql": postgres,
        "postgresql_fsync": fsync,
        "redis": redis,
        "rustc": command_output("rustc", &["--version"]),
    })
}

/// The commit measured, and whether the work tree had changes on top of it.
pub fn git() -> (String, bool) {
    let commit = command_output("git", &["rev-parse", "HEAD"]);
    let dirty = !command_output("git", &["status", "--porcelain", "--untracked-files=no"]).is_empty();
    (commit, dirty)
}

/// The pid listening on a TCP port of this machine (the broker, Redis, the postmaster), from
/// /proc/net/tcp and the processes' socket descriptors.
pub fn pid_listening_on(port: u16) -> Option<u32> {
    let hex_port = format!(":{port:04X}");
    let inodes: Vec<String> = ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .flat_map(|table| {
            std::fs::read_to_string(table).unwrap_or_default().lines().skip(1).map(str::to_owned).collect::<Vec<_>>()
        })
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // local_address, st == 0A (LISTEN), inode
            (fields.len() > 9 && fields[1].ends_with(&hex_port) && fields[3] == "0A")
                .then(|| format!("socket:[{}]", fields[9]))
        })
        .collect();
    if inodes.is_empty() {
        return None;
    }
    for pid in all_pids() {
        let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else { continue };
        for fd in fds.flatten() {
            if let Ok(target) = std::fs::read_link(fd.path()) {
                if inodes.iter().any(|i| target.to_string_lossy() == *i) {
                    return Some(pid);
                }
            }
        }
    }
    None
}

fn all_pids() -> Vec<u32> {
    std::fs::read_dir("/proc")
        .map(|dir| dir.flatten().filter_map(|e| e.file_name().to_string_lossy().parse().ok()).collect())
        .unwrap_or_default()
}

/// A postmaster and its children: every backend and background process of its cluster.
fn cluster_processes(postmaster: u32) -> Vec<u32> {
    let mut pids: Vec<u32> = all_pids()
        .into_iter()
        .filter(|&p| cpu_ticks_and_parent(p).is_some_and(|(_, parent)| parent == postmaster))
        .collect();
    pids.push(postmaster);
    pids
}

/// What a process of a PostgreSQL cluster is, from the title it gives itself
/// ("postgres: [cluster_name: ]user database host(port) state" for a backend).
#[derive(Debug, PartialEq, Eq)]
enum PgProcess {
    /// A client's backend, connected to this database.
    Backend(String),
    /// A walsender: a standby's (or a base backup's) replication connection.
    Walsender,
    /// The postmaster, its background processes (checkpointer, WAL writer, autovacuum), and,
    /// on a standby, the replay and the WAL receiver.
    Background,
}

fn pg_process(title: &str) -> PgProcess {
    let Some(rest) = title.strip_prefix("postgres:") else { return PgProcess::Background };
    let mut words: Vec<&str> = rest.split_whitespace().collect();
    // A cluster_name (the HA nodes have one: node-1) comes first, ending with a colon.
    if words.first().is_some_and(|w| w.ends_with(':')) {
        words.remove(0);
    }
    match words.as_slice() {
        ["walsender", ..] => PgProcess::Walsender,
        [_user, database, from, ..] if from.contains('(') || from.starts_with('[') => {
            PgProcess::Backend((*database).to_owned())
        }
        _ => PgProcess::Background,
    }
}

fn title(pid: u32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|bytes| String::from_utf8_lossy(&bytes).replace('\0', " ").trim().to_owned())
        .unwrap_or_default()
}

/// utime + stime of a process (all its threads), in clock ticks, and its parent.
fn cpu_ticks_and_parent(pid: u32) -> Option<(u64, u32)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces; the fields after its closing parenthesis do not.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let parent = fields.get(1)?.parse().ok()?;
    let ticks = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some((ticks, parent))
}

/// Ticks of the whole machine (/proc/stat), all CPUs together.
#[derive(Clone, Copy)]
struct MachineTicks {
    busy: u64,
    total: u64,
    /// Of `busy`: the time a virtual machine's CPUs were runnable but the host ran something
    /// else (steal), which no process here accounts for.
    stolen: u64,
}

fn machine_ticks() -> MachineTicks {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let values: Vec<u64> =
        stat.lines().next().unwrap_or_default().split_whitespace().skip(1).filter_map(|v| v.parse().ok()).collect();
    let at = |i: usize| values.get(i).copied().unwrap_or(0);
    let total: u64 = values.iter().take(8).sum();
    MachineTicks { busy: total - at(3) - at(4), total, stolen: at(7) }
}

/// The processes whose CPU is accounted, by role.
#[derive(Clone, Default)]
pub struct Roles {
    pub gateways: Vec<u32>,
    pub writers: Vec<u32>,
    pub postmaster: Option<u32>,
    pub kafka: Option<u32>,
    pub redis: Option<u32>,
    /// On the HA layout (ha.rs): the standbys' postmasters (`postmaster` is the primary's),
    /// HAProxy, and Patroni and etcd, whose work a single node does not have.
    pub standbys: Vec<u32>,
    pub proxy: Option<u32>,
    pub patroni: Vec<u32>,
    pub etcd: Vec<u32>,
    /// The databases whose backends count as this run's (none: every backend does); a
    /// shared server's other backends are other work on the machine.
    pub databases: Vec<String>,
}

pub struct CpuSnapshot {
    at: Instant,
    by_role: BTreeMap<&'static str, u64>,
    machine: MachineTicks,
}

const TICKS_PER_SECOND: f64 = 100.0;

impl Roles {
    /// The postmaster and its children: every backend and background process of the cluster.
    pub fn postgres_processes(&self) -> Vec<u32> {
        self.postmaster.map(cluster_processes).unwrap_or_default()
    }

    /// The postmaster's processes that are this run's, apart from its walsenders: the
    /// postmaster, its background processes, and the backends of [`Roles::databases`].
    fn server_processes(&self) -> (Vec<u32>, Vec<u32>) {
        let (mut server, mut walsenders) = (Vec::new(), Vec::new());
        for pid in self.postgres_processes() {
            match pg_process(&title(pid)) {
                PgProcess::Walsender => walsenders.push(pid),
                PgProcess::Backend(database) if !self.databases.is_empty() && !self.databases.contains(&database) => {}
                _ => server.push(pid),
            }
        }
        (server, walsenders)
    }

    /// This program and the clients it runs as processes of their own (wrk, pgbench), not the
    /// gateways and writers it started: a client's CPU is the load generator's, not load that
    /// shares the machine.
    pub fn load_generator_processes(&self) -> Vec<u32> {
        let me = std::process::id();
        let mut pids: Vec<u32> = all_pids()
            .into_iter()
            .filter(|pid| !self.gateways.contains(pid) && !self.writers.contains(pid))
            .filter(|&pid| cpu_ticks_and_parent(pid).is_some_and(|(_, parent)| parent == me))
            .collect();
        pids.push(me);
        pids
    }

    /// CPU ticks per role now. "postgresql" is the server the writers write to (on the HA
    /// layout, the primary): its postmaster, background processes and the backends of this
    /// run's databases; its walsenders, which only the layout has, are a role of their own.
    /// A backend that ended between two snapshots is not counted (the pools' live throughout).
    pub fn snapshot(&self) -> CpuSnapshot {
        let sum = |pids: &[u32]| pids.iter().filter_map(|&p| cpu_ticks_and_parent(p)).map(|(t, _)| t).sum::<u64>();
        let mut by_role = BTreeMap::new();
        by_role.insert("gateway", sum(&self.gateways));
        by_role.insert("writer", sum(&self.writers));
        by_role.insert("load generator", sum(&self.load_generator_processes()));
        if self.postmaster.is_some() {
            let (server, walsenders) = self.server_processes();
            by_role.insert("postgresql", sum(&server));
            if !self.standbys.is_empty() {
                by_role.insert("postgresql walsenders", sum(&walsenders));
            }
        }
        if let Some(kafka) = self.kafka {
            by_role.insert("kafka", sum(&[kafka]));
        }
        if let Some(redis) = self.redis {
            by_role.insert("redis", sum(&[redis]));
        }
        if !self.standbys.is_empty() {
            let standbys: Vec<u32> = self.standbys.iter().flat_map(|&p| cluster_processes(p)).collect();
            by_role.insert("postgresql standbys", sum(&standbys));
        }
        if let Some(proxy) = self.proxy {
            by_role.insert("haproxy", sum(&[proxy]));
        }
        if !self.patroni.is_empty() {
            by_role.insert("patroni", sum(&self.patroni));
        }
        if !self.etcd.is_empty() {
            by_role.insert("etcd", sum(&self.etcd));
        }
        CpuSnapshot { at: Instant::now(), by_role, machine: machine_ticks() }
    }

    /// Cores per role over the middle of a scenario of `duration` starting now: from 1 s in to
    /// 1 s before its end, so that connections opened at its start and processes (pgbench's
    /// backends) gone at its end do not skew it. Run beside the scenario.
    pub async fn cores_during(self, duration: std::time::Duration) -> Value {
        let margin =
            if duration.as_secs() >= 4 { std::time::Duration::from_secs(1) } else { std::time::Duration::ZERO };
        tokio::time::sleep(margin).await;
        let first = self.snapshot();
        tokio::time::sleep(duration.saturating_sub(margin * 2)).await;
        first.cores_until(&self.snapshot())
    }

    /// Peak resident memory (VmHWM) of the largest of these processes, in MiB.
    pub fn peak_rss_mib(pids: &[u32]) -> f64 {
        pids.iter()
            .filter_map(|pid| {
                let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
                let kib: f64 =
                    status.lines().find_map(|l| l.strip_prefix("VmHWM:"))?.split_whitespace().next()?.parse().ok()?;
                Some(kib / 1024.0)
            })
            .fold(0.0, f64::max)
    }
}

/// The mean of each role's cores over turns of equal length.
pub fn mean_cores(turns: &[Value]) -> Value {
    let mut sums: BTreeMap<String, f64> = BTreeMap::new();
    for turn in turns {
        for (role, cores) in turn.as_object().into_iter().flatten() {
            *sums.entry(role.clone()).or_default() += cores.as_f64().unwrap_or(0.0);
        }
    }
    let n = turns.len().max(1) as f64;
    Value::Object(sums.into_iter().map(|(role, sum)| (role, json!(round2(sum / n)))).collect())
}

impl CpuSnapshot {
    /// Cores used per role between `self` and `later`, with the machine's busy cores and what
    /// none of the roles accounts for (other work on the machine, the kernel's softirqs).
    pub fn cores_until(&self, later: &CpuSnapshot) -> Value {
        let seconds = later.at.duration_since(self.at).as_secs_f64().max(1e-9);
        let mut cores = serde_json::Map::new();
        let mut accounted = 0.0;
        for (role, ticks) in &later.by_role {
            let used = later.by_role[role].saturating_sub(self.by_role.get(role).copied().unwrap_or(*ticks)) as f64
                / TICKS_PER_SECOND
                / seconds;
            accounted += used;
            cores.insert((*role).to_owned(), json!(round2(used)));
        }
        let (busy, total) = (later.machine.busy - self.machine.busy, later.machine.total - self.machine.total);
        let stolen = later.machine.stolen - self.machine.stolen;
        let machine_cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) as f64;
        let share = |ticks: u64| if total == 0 { 0.0 } else { ticks as f64 / total as f64 * machine_cores };
        let (machine_busy, stolen) = (share(busy), share(stolen));
        cores.insert("machine busy".into(), json!(round2(machine_busy)));
        cores.insert("stolen by the host".into(), json!(round2(stolen)));
        cores.insert("other processes".into(), json!(round2((machine_busy - stolen - accounted).max(0.0))));
        Value::Object(cores)
    }
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cores_of_turns_are_averaged_per_role() {
        let mean = mean_cores(&[json!({"writer": 1.0, "postgresql": 0.5}), json!({"writer": 0.5, "postgresql": 1.5})]);
        assert_eq!(mean, json!({"postgresql": 1.0, "writer": 0.75}));
    }

    #[test]
    fn a_servers_processes_are_told_apart_by_their_titles() {
        let backend = |db: &str| PgProcess::Backend(db.to_owned());
        assert_eq!(pg_process("postgres: postgres intake_bench 127.0.0.1(51234) idle"), backend("intake_bench"));
        assert_eq!(
            pg_process("postgres: node-1: postgres intake_bench 127.0.0.1(51234) COMMIT"),
            backend("intake_bench")
        );
        assert_eq!(pg_process("postgres: postgres postgres [local] idle"), backend("postgres"));
        assert_eq!(
            pg_process("postgres: node-2: walsender replicator 127.0.0.1(40100) streaming 0/3000148"),
            PgProcess::Walsender
        );
        for background in [
            "postgres: checkpointer ",
            "postgres: node-1: walwriter ",
            "postgres: node-1: autovacuum worker intake_bench",
            "postgres: node-3: startup recovering 000000010000000000000003",
            "postgres: node-3: walreceiver streaming 0/3000148",
            "/usr/lib/postgresql/15/bin/postgres -D /data --config-file=/data/postgresql.conf",
        ] {
            assert_eq!(pg_process(background), PgProcess::Background, "{background}");
        }
    }

    #[test]
    fn a_client_run_as_a_child_is_the_load_generators_and_a_started_gateway_is_not() {
        let spawn = || std::process::Command::new("sleep").arg("30").spawn();
        let (Ok(mut client), Ok(mut gateway)) = (spawn(), spawn()) else { panic!("sleep did not start") };
        let roles = Roles { gateways: vec![gateway.id()], ..Roles::default() };
        let pids = roles.load_generator_processes();
        let _ = (client.kill(), gateway.kill(), client.wait(), gateway.wait());
        assert!(pids.contains(&client.id()), "wrk or pgbench, started by this program");
        assert!(pids.contains(&std::process::id()));
        assert!(!pids.contains(&gateway.id()), "a gateway's CPU is the gateway's");
    }
}
