//! The runs at size under a memory budget. PostgreSQL of its own for them (a cluster initialised
//! for the run, on a port of its own), started inside a memory cgroup (quota.rs), so that the
//! budget covers its processes, its shared buffers and the page cache of its files, and nothing
//! of anyone else's. The uncapped runs at size use the same cluster with the same
//! `shared_buffers` (a quarter of the budget); the capped ones lower the group's limit, which
//! makes the kernel drop its page cache down to the budget, so that the data set (11 GiB at
//! 10 M) is read from disk as on a machine it outgrew.
//!
//! What proves the cap held, per capped scenario: the group's memory sampled every 200 ms (its
//! peak, and what it held by kind), PostgreSQL's reads that missed its buffers with their time
//! (`track_io_timing`), and the reads of the disk under the data directory (/proc/diskstats) with
//! theirs: a disk that the host serves from its own cache answers in microseconds, and the
//! numbers say which it was.

use crate::quota::{Memory, MemoryGroup};
use intake_tests::serde_json::{json, Value};
use sqlx::PgPool;
use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

const MIB: u64 = 1 << 20;

/// PostgreSQL's newest installed server binaries (Debian's layout).
fn pg_bin(name: &str) -> PathBuf {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|entries| entries.flatten().map(|e| e.path().join("bin")).filter(|p| p.join(name).exists()).collect())
        .unwrap_or_default();
    dirs.sort_by_key(|p| {
        p.parent().and_then(|v| v.file_name()).and_then(|v| v.to_str()).and_then(|v| v.parse::<u32>().ok())
    });
    dirs.pop().map(|d| d.join(name)).unwrap_or_else(|| PathBuf::from(name))
}

/// PostgreSQL refuses to run as root: as the postgres user then.
fn as_postgres(program: &Path) -> Command {
    // The effective uid, from /proc.
    let root = std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|v| v.split_whitespace().nth(1).map(|uid| uid == "0"))
        .unwrap_or(false);
    if root {
        let mut command = Command::new("runuser");
        command.args(["-u", "postgres", "--"]).arg(program);
        command
    } else {
        Command::new(program)
    }
}

/// A cluster of the benchmark's own inside a memory group.
pub struct Cluster {
    pub port: u16,
    pub postmaster: u32,
    pub budget_bytes: u64,
    pub shared_buffers_mib: u64,
    pub cgroup: &'static str,
    dir: PathBuf,
    pub group: MemoryGroup,
}

impl Cluster {
    /// initdb in `dir` (emptied first), then the server started inside a memory group without a
    /// limit yet, with `shared_buffers` a quarter of `budget_bytes`.
    pub fn start(dir: &Path, budget_bytes: u64) -> anyhow::Result<Cluster> {
        let memory = Memory::detect().ok_or_else(|| {
            anyhow::anyhow!("no writable cgroup memory controller (v1 /sys/fs/cgroup/memory, v2 memory.max)")
        })?;
        let cgroup = memory.version();
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir_all(dir)?;
        let data = dir.join("data");
        let log = dir.join("postgres.log");
        let status = Command::new("chown").args(["-R", "postgres:postgres"]).arg(dir).status();
        if status.is_err() {
            crate::say("chown of the capped cluster's directory failed (not root?): going on");
        }
        let initdb = as_postgres(&pg_bin("initdb"))
            .arg("-D")
            .arg(&data)
            .args(["-U", "postgres", "--auth=trust", "-E", "UTF8"])
            .stdout(Stdio::null())
            .output()?;
        anyhow::ensure!(initdb.status.success(), "initdb: {}", String::from_utf8_lossy(&initdb.stderr));
        let port = {
            let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
            listener.local_addr()?.port()
        };
        let shared_buffers_mib = (budget_bytes / 4 / MIB).max(16);
        let group = memory.group(&format!("intake-bench-postgresql-{}", std::process::id()))?;
        // The deploy's settings (deploy/lib.sh start_postgres), but shared_buffers; I/O timing on;
        // INTAKE_BENCH_PG_OPTIONS adds server options of a trial (`-c name=value ...`).
        let trial = std::env::var("INTAKE_BENCH_PG_OPTIONS").unwrap_or_default();
        let options = format!(
            "-c listen_addresses=127.0.0.1 -p {port} -k /tmp -c max_connections=300 \
             -c shared_buffers={shared_buffers_mib}MB -c max_wal_size=8GB -c min_wal_size=1GB \
             -c checkpoint_timeout=15min -c wal_compression=lz4 -c wal_init_zero=off \
             -c track_io_timing=on {trial}"
        );
        // The shell moves itself into the group, then becomes pg_ctl: the server it forks, and
        // every backend after, starts in the group.
        let pg_ctl = pg_bin("pg_ctl");
        let script = format!("echo $$ > '{procs}' && exec \"$@\"", procs = group.procs_file().display());
        let mut start = Command::new("sh");
        start.args(["-c", &script, "sh"]);
        let inner = as_postgres(&pg_ctl);
        start.arg(inner.get_program());
        start.args(inner.get_args());
        start.arg("-D").arg(&data).arg("-l").arg(&log).args(["-w", "-o", &options, "start"]);
        let started = start.stdout(Stdio::null()).output()?;
        anyhow::ensure!(
            started.status.success(),
            "pg_ctl start: {}{}",
            String::from_utf8_lossy(&started.stderr),
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        let postmaster: u32 = std::fs::read_to_string(data.join("postmaster.pid"))?
            .lines()
            .next()
            .and_then(|l| l.trim().parse().ok())
            .ok_or_else(|| anyhow::anyhow!("no postmaster.pid"))?;
        Ok(Cluster { port, postmaster, budget_bytes, shared_buffers_mib, cgroup, dir: dir.to_path_buf(), group })
    }

    pub fn data_dir(&self) -> PathBuf {
        self.dir.join("data")
    }

    /// `postgres://` URL of the server, without a database.
    pub fn server_url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}", self.port)
    }

    /// The budget on: the kernel reclaims the group's page cache down to it first.
    pub fn cap(&self) -> anyhow::Result<()> {
        self.group.limit(Some(self.budget_bytes))
    }

    pub fn uncap(&self) -> anyhow::Result<()> {
        self.group.limit(None)
    }

    pub fn describe(&self) -> Value {
        json!({
            "cgroup": self.cgroup,
            "budget_mib": self.budget_bytes / MIB,
            "shared_buffers_mib": self.shared_buffers_mib,
            "port": self.port,
            "data_directory": self.data_dir().display().to_string(),
        })
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = as_postgres(&pg_bin("pg_ctl"))
            .arg("-D")
            .arg(self.dir.join("data"))
            .args(["-m", "fast", "-w", "stop"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Reads of the block device under `path`: (reads completed, sectors read, ms spent reading).
fn disk_reads(path: &Path) -> Option<(u64, u64, u64)> {
    let dev = std::fs::metadata(path).ok()?.dev();
    // Linux's encoding of a dev_t.
    let (major, minor) = (((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff), (dev & 0xff) | ((dev >> 12) & !0xff));
    let stats = std::fs::read_to_string("/proc/diskstats").ok()?;
    let line = stats.lines().find(|line| {
        let mut f = line.split_whitespace();
        f.next().and_then(|v| v.parse::<u64>().ok()) == Some(major)
            && f.next().and_then(|v| v.parse::<u64>().ok()) == Some(minor)
    })?;
    let f: Vec<u64> = line.split_whitespace().skip(3).take(4).filter_map(|v| v.parse().ok()).collect();
    // Fields 4, 6 and 7 of the line: reads completed, sectors read, milliseconds reading.
    Some((*f.first()?, *f.get(2)?, *f.get(3)?))
}

/// PostgreSQL's block reads (misses of its buffers) and their time in the database, by table
/// and index too, and the disk's reads, at one moment.
pub struct Io {
    blks_read: i64,
    blks_hit: i64,
    read_ms: f64,
    by_relation: BTreeMap<String, i64>,
    disk: Option<(u64, u64, u64)>,
}

pub async fn io(db: &PgPool, data_dir: &Path) -> anyhow::Result<Io> {
    let (blks_read, blks_hit, read_ms): (i64, i64, f64) = sqlx::query_as(
        "SELECT blks_read, blks_hit, blk_read_time FROM pg_stat_database WHERE datname = current_database()",
    )
    .fetch_one(db)
    .await?;
    let by_relation: Vec<(String, i64)> = sqlx::query_as(
        "SELECT relname::text, coalesce(heap_blks_read, 0) FROM pg_statio_user_tables
         UNION ALL
         SELECT indexrelname::text, coalesce(idx_blks_read, 0) FROM pg_statio_user_indexes",
    )
    .fetch_all(db)
    .await?;
    Ok(Io { blks_read, blks_hit, read_ms, by_relation: by_relation.into_iter().collect(), disk: disk_reads(data_dir) })
}

/// `x` to `digits` decimals.
fn round(x: f64, digits: i32) -> f64 {
    let scale = 10f64.powi(digits);
    (x * scale).round() / scale
}

impl Io {
    /// What happened between `self` and `later`, over `seconds`.
    pub fn until(&self, later: &Io, seconds: f64) -> Value {
        let seconds = seconds.max(1e-9);
        let reads = (later.blks_read - self.blks_read).max(0);
        let hits = (later.blks_hit - self.blks_hit).max(0);
        let read_ms = later.read_ms - self.read_ms;
        let mean = |ms: f64, n: u64| if n > 0 { round(ms / n as f64, 3) } else { 0.0 };
        let mut value = json!({
            "postgresql_block_reads_per_s": round(reads as f64 / seconds, 1),
            "postgresql_buffer_hit_ratio": round(hits as f64 / (hits + reads).max(1) as f64, 4),
            "postgresql_read_ms_mean": mean(read_ms, reads.unsigned_abs()),
        });
        // Which table or index the reads were of, the most read first: the random pages that
        // a narrower key would save.
        let mut by_relation: Vec<(&String, i64)> = later
            .by_relation
            .iter()
            .map(|(name, &n)| (name, n - self.by_relation.get(name).copied().unwrap_or(0)))
            .filter(|&(_, n)| n > 0)
            .collect();
        by_relation.sort_by_key(|&(_, n)| std::cmp::Reverse(n));
        value["postgresql_block_reads_per_s_by_relation"] = Value::Array(
            by_relation.into_iter().map(|(name, n)| json!([name, round(n as f64 / seconds, 1)])).collect(),
        );
        if let (Some((r0, s0, t0)), Some((r1, s1, t1))) = (self.disk, later.disk) {
            let reads = r1.saturating_sub(r0);
            value["disk_reads_per_s"] = json!(round(reads as f64 / seconds, 1));
            value["disk_read_mib_per_s"] = json!(round((s1.saturating_sub(s0) * 512) as f64 / MIB as f64 / seconds, 2));
            value["disk_read_ms_mean"] = json!(mean(t1.saturating_sub(t0) as f64, reads));
        }
        value
    }
}

/// The group's memory sampled every 200 ms until stopped: the peaks of its use and of its dirty
/// page cache, and the last sample by kind.
pub struct Sampler {
    stop: Arc<AtomicBool>,
    peak: Arc<AtomicU64>,
    dirty_peak: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Sampler {
    pub fn start(group: &MemoryGroup) -> Sampler {
        let (stop, peak, dirty_peak) =
            (Arc::new(AtomicBool::new(false)), Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let (usage_file, dirty) = (group.usage_file(), group.dirty_reader());
        let (stop_task, peak_task, dirty_task) = (stop.clone(), peak.clone(), dirty_peak.clone());
        let task = tokio::spawn(async move {
            while !stop_task.load(Ordering::Relaxed) {
                let usage = std::fs::read_to_string(&usage_file).ok().and_then(|v| v.trim().parse().ok()).unwrap_or(0);
                peak_task.fetch_max(usage, Ordering::Relaxed);
                dirty_task.fetch_max(dirty(), Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        });
        Sampler { stop, peak, dirty_peak, task }
    }

    pub async fn finish(self, group: &MemoryGroup) -> Value {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.task.await;
        let mib = |b: u64| round(b as f64 / MIB as f64, 1);
        let mut by_kind = intake_tests::serde_json::Map::new();
        for (kind, bytes) in group.breakdown() {
            by_kind.insert(format!("{kind}_mib"), json!(mib(bytes)));
        }
        json!({
            "limit_mib": group.limit_bytes().map(mib),
            "peak_mib": mib(self.peak.load(Ordering::Relaxed)),
            "dirty_peak_mib": mib(self.dirty_peak.load(Ordering::Relaxed)),
            "at_end": Value::Object(by_kind),
            "limit_hits": group.limit_hits(),
        })
    }
}

/// Bytes per stored conversion in `table`: the heap (its TOAST included) and each index, over
/// the rows it holds.
pub async fn bytes_per_conversion(db: &PgPool, table: &str) -> anyhow::Result<Value> {
    let rows: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {table}")).fetch_one(db).await?;
    let heap: i64 = sqlx::query_scalar(
        "SELECT pg_relation_size(oid) + coalesce(pg_total_relation_size(nullif(reltoastrelid, 0)), 0)
           FROM pg_class WHERE oid = $1::regclass",
    )
    .bind(table)
    .fetch_one(db)
    .await?;
    let indexes: Vec<(String, i64)> = sqlx::query_as(
        "SELECT c.relname::text, pg_relation_size(c.oid) FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
          WHERE i.indrelid = $1::regclass ORDER BY c.relname",
    )
    .bind(table)
    .fetch_all(db)
    .await?;
    let per = |bytes: i64| round(bytes as f64 / rows.max(1) as f64, 1);
    let index_total: i64 = indexes.iter().map(|(_, b)| b).sum();
    Ok(json!({
        "table": table,
        "rows": rows,
        "heap_bytes": per(heap),
        "index_bytes": per(index_total),
        "total_bytes": per(heap + index_total),
        "indexes": indexes
            .iter()
            .map(|(name, b)| (name.clone(), json!(per(*b))))
            .collect::<intake_tests::serde_json::Map<_, _>>(),
    }))
}

/// The server's WAL position, bytes.
pub async fn wal_lsn(db: &PgPool) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::int8").fetch_one(db).await?)
}
