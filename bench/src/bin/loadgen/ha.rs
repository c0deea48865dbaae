//! The cost of synchronous replication: batch_ingest, single_32 and single_200rps, after their
//! runs on the single node, again on the HA layout of PostgreSQL (deploy/ha.sh: three etcd
//! members, three PostgreSQL nodes under Patroni in `synchronous_mode_strict` with one
//! synchronous standby, HAProxy as the primary's address), on a stack of their own; then the
//! runs at size (sized.rs) on a database loaded through the primary. Every commit on the
//! layout returns once the synchronous standby has flushed its WAL: one more round trip and one
//! more fsync per commit than on the single node.
//!
//! The layout is started here, after the single node's runs, and stopped with its directory
//! removed before the report, so that neither side runs beside the other's idle processes
//! (three Patroni loops a second, etcd's heartbeats). Its nodes have the single node's
//! `shared_buffers` and no WAL archive (the single node has none); every other setting is
//! deploy/ha/'s, and the report lists each one in which the two servers differ.

use crate::machine::Roles;
use crate::{say, sized, Config, Plans, Scenario};
use intake_tests::serde_json::{json, Map, Value};
use intake_tests::TestKey;
use sqlx::postgres::PgPoolOptions;
use sqlx::{Connection, PgPool};
use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The scenarios run on both, in the order they run.
pub const SCENARIOS: [&str; 3] = ["batch_ingest", "single_32", "single_200rps"];

/// A scenario's name on the HA layout.
/// The same scenario on the layout with asynchronous replication (`deploy/up.sh --ha --async`).
pub fn ha_async_name(scenario: &str) -> &'static str {
    match scenario {
        "batch_ingest" => "batch_ingest_ha_async",
        "single_32" => "single_32_ha_async",
        _ => "single_200rps_ha_async",
    }
}

pub fn ha_name(scenario: &str) -> &'static str {
    match scenario {
        "batch_ingest" => "batch_ingest_ha",
        "single_32" => "single_32_ha",
        _ => "single_200rps_ha",
    }
}

/// Stops the layout at "$1", whatever state it is in: Patroni stops each node (the standbys
/// first, so that none takes over), then etcd; whatever is left of a node or of the pid files
/// is killed.
const STOP: &str = r#"stop_ha_cluster "$1" || true
for n in 1 2 3; do ha_node_signal "$1" "$n" KILL || true; done
for file in "$1"/run/ha-*.pid; do [ -f "$file" ] && kill -KILL "$(cat "$file")" 2>/dev/null; done
true"#;

/// An HA layout of the benchmark's own; stopped, its directory removed, on drop.
struct Layout {
    dir: PathBuf,
    primary: u16,
    shared_buffers: String,
    /// deploy/ha.sh's INTAKE_HA_REPLICATION: sync or async.
    replication: &'static str,
}

impl Layout {
    /// A new layout in `dir` (what an interrupted run left there is stopped and removed first),
    /// returned once its primary takes writes with a synchronous standby.
    fn start(
        dir: &Path,
        base: u16,
        primary: u16,
        shared_buffers: &str,
        replication: &'static str,
    ) -> anyhow::Result<Layout> {
        let layout = Layout { dir: dir.to_path_buf(), primary, shared_buffers: shared_buffers.to_owned(), replication };
        if dir.join("run").exists() {
            layout.lib(STOP)?;
        }
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir_all(dir)?;
        // The nodes run as users of their own (as root), who must reach their directories.
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))?;
        layout.lib(&format!(r#"start_ha_cluster "$1" {base} {primary} >/dev/null"#))?;
        Ok(layout)
    }

    /// Runs `script` with deploy/lib.sh sourced and the layout's directory as "$1"; its
    /// messages go to this program's standard error.
    fn lib(&self, script: &str) -> anyhow::Result<()> {
        let lib = intake_tests::repo().join("deploy/lib.sh");
        let status = Command::new("bash")
            .arg("-c")
            .arg(format!("source \"$0\" && {script}"))
            .arg(&lib)
            .arg(&self.dir)
            .env("INTAKE_HOME", &self.dir)
            .env("INTAKE_HA_BACKUPS", "0")
            .env("INTAKE_HA_SHARED_BUFFERS", &self.shared_buffers)
            .env("INTAKE_HA_REPLICATION", self.replication)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .status()?;
        anyhow::ensure!(status.success(), "deploy/lib.sh: {script}: {status}");
        Ok(())
    }

    /// `postgres://` URL of the primary's address (HAProxy), without a database.
    fn server_url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}", self.primary)
    }

    /// Node n's postmaster and port, from its postmaster.pid.
    fn node(&self, n: u8) -> Option<(u32, u16)> {
        let file = std::fs::read_to_string(self.dir.join(format!("ha/node-{n}/data/postmaster.pid"))).ok()?;
        let lines: Vec<&str> = file.lines().collect();
        Some((lines.first()?.trim().parse().ok()?, lines.get(3)?.trim().parse().ok()?))
    }

    fn pid_file(&self, name: &str) -> Option<u32> {
        std::fs::read_to_string(self.dir.join(format!("run/{name}.pid"))).ok()?.trim().parse().ok()
    }

    /// The layout's processes by role, the primary being the node on `primary_port`; and the
    /// other nodes' ports.
    fn roles(&self, infrastructure: &Roles, primary_port: u16) -> (Roles, Vec<u16>) {
        let mut roles = Roles { postmaster: None, proxy: self.pid_file("ha-haproxy"), ..infrastructure.clone() };
        let mut standby_ports = Vec::new();
        for n in 1..=3 {
            match self.node(n) {
                Some((pid, port)) if port == primary_port => roles.postmaster = Some(pid),
                Some((pid, port)) => {
                    roles.standbys.push(pid);
                    standby_ports.push(port);
                }
                None => say(&format!("HA node {n} has no postmaster.pid: its CPU is not counted")),
            }
            roles.patroni.extend(self.pid_file(&format!("ha-node-{n}")));
            roles.etcd.extend(self.pid_file(&format!("ha-etcd-{n}")));
        }
        (roles, standby_ports)
    }
}

impl Drop for Layout {
    fn drop(&mut self) {
        say("stopping the HA layout");
        if let Err(error) = self.lib(STOP) {
            say(&format!("stopping the HA layout: {error:#}"));
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The scenarios of [`SCENARIOS`] that ran on the single node, again on an HA layout started
/// in `dir` for them (the database of `single_url` by the same name, migrated); and what the
/// report says of the layout.
pub async fn scenarios(
    config: &Config,
    dir: &Path,
    single_db: &PgPool,
    single_url: &str,
    infrastructure: &Roles,
    single: &[(&'static str, Scenario)],
) -> anyhow::Result<(Vec<(&'static str, Scenario)>, Value)> {
    let which: Vec<&str> = SCENARIOS.into_iter().filter(|s| single.iter().any(|(n, _)| n == s)).collect();
    if which.is_empty() {
        let reason = "none of batch_ingest, single_32 and single_200rps ran on the single node";
        say(&format!("no runs on the HA layout: {reason}"));
        return Ok((Vec::new(), json!({ "skipped": reason })));
    }
    let shared_buffers = match config.ha_shared_buffers.as_str() {
        "" => sqlx::query_scalar::<_, String>("SELECT current_setting('shared_buffers')").fetch_one(single_db).await?,
        set => set.to_owned(),
    };
    // The single node's vacuum and checkpoint due are not the layout's to run beside.
    crate::settle(single_url).await?;
    let (base, primary) = (config.ha_base_port, config.ha_primary_port);
    say(&format!(
        "starting the HA layout in {} (ports from {base}, the primary on {primary}; shared_buffers {shared_buffers} a node)",
        dir.display()
    ));
    let started = Instant::now();
    let layout = {
        let (dir, shared_buffers) = (dir.to_path_buf(), shared_buffers.clone());
        tokio::task::spawn_blocking(move || Layout::start(&dir, base, primary, &shared_buffers, "sync")).await??
    };
    let start_seconds = started.elapsed().as_secs();
    let outcome = on_layout(config, &layout, single_db, single_url, infrastructure, &which).await;
    // Stopped before anything else runs (and on failure too).
    tokio::task::spawn_blocking(move || drop(layout)).await?;
    let (mut scenarios, mut described) = outcome?;
    // The same scenarios on the layout with asynchronous replication, on empty tables: what a
    // commit that waits for no standby saves (docs/architecture.md, "The log is the record").
    if config.ha_async {
        say("starting the HA layout again, with asynchronous replication");
        let layout = {
            let (dir, shared_buffers) = (dir.to_path_buf(), shared_buffers.clone());
            tokio::task::spawn_blocking(move || Layout::start(&dir, base, primary, &shared_buffers, "async")).await??
        };
        let outcome = on_async_layout(config, &layout, single_url, infrastructure, &which).await;
        tokio::task::spawn_blocking(move || drop(layout)).await?;
        scenarios.extend(outcome?);
    }
    described["shared_buffers_per_node"] = json!(shared_buffers);
    described["base_port"] = json!(base);
    described["primary_port"] = json!(primary);
    described["seconds_to_start"] = json!(start_seconds);
    Ok((scenarios, described))
}

async fn on_layout(
    config: &Config,
    layout: &Layout,
    single_db: &PgPool,
    single_url: &str,
    infrastructure: &Roles,
    which: &[&str],
) -> anyhow::Result<(Vec<(&'static str, Scenario)>, Value)> {
    let database = database_on(layout, single_url).await?;
    let OnLayout { mut scenarios, layout_roles, standbys, primary_port } =
        run_scenarios(config, layout, &database, infrastructure, which, "replicated", ha_name).await?;
    let db = database.db;
    let (at_size, sized) = at_sizes(config, layout, &layout_roles, &standbys).await?;
    scenarios.extend(at_size);
    // Which standby the commits waited for, as the primary saw it at the end.
    let replication: Vec<(String, String, String)> = sqlx::query_as(
        "SELECT application_name::text, state::text, sync_state::text FROM pg_stat_replication ORDER BY 1",
    )
    .fetch_all(&db)
    .await?;
    let primary_node = (1..=3).find(|&n| layout.node(n).is_some_and(|(_, port)| i32::from(port) == primary_port));
    let differing = settings_differing(single_db, &db).await?;
    db.close().await;
    Ok((
        scenarios,
        json!({
            "scenarios": which,
            "nodes": 3,
            "primary": primary_node.map(|n| format!("node-{n}")),
            "standbys": replication
                .iter()
                .map(|(name, state, sync)| json!({ "name": name, "state": state, "sync_state": sync }))
                .collect::<Vec<_>>(),
            "wal_archive": false,
            "settings_differing": differing,
            "sized": sized,
        }),
    ))
}

/// The scenarios on a layout with asynchronous replication: commits wait for the primary's disk
/// alone (the writers' `flushed`).
async fn on_async_layout(
    config: &Config,
    layout: &Layout,
    single_url: &str,
    infrastructure: &Roles,
    which: &[&str],
) -> anyhow::Result<Vec<(&'static str, Scenario)>> {
    let database = database_on(layout, single_url).await?;
    let on_layout = run_scenarios(config, layout, &database, infrastructure, which, "flushed", ha_async_name).await;
    database.db.close().await;
    Ok(on_layout?.scenarios)
}

/// A database on a layout, migrated.
struct LayoutDatabase {
    url: String,
    db: PgPool,
}

/// The database of `single_url`'s name on the layout, created and migrated.
async fn database_on(layout: &Layout, single_url: &str) -> anyhow::Result<LayoutDatabase> {
    let (_, database) = single_url.rsplit_once('/').ok_or_else(|| anyhow::anyhow!("DATABASE_URL has no database"))?;
    let admin = format!("{}/postgres", layout.server_url());
    let mut conn = sqlx::PgConnection::connect(&admin).await?;
    sqlx::raw_sql(&format!("CREATE DATABASE \"{database}\"")).execute(&mut conn).await?;
    conn.close().await?;
    let url = format!("{}/{database}", layout.server_url());
    let writer = PathBuf::from(intake_tests::env("INTAKE_BIN_DIR")).join("intake-writer");
    let migrated = Command::new(writer)
        .args(["migrate", "--contract"])
        .env("DATABASE_URL", &url)
        .stdout(Stdio::null())
        .output()?;
    anyhow::ensure!(migrated.status.success(), "migrate: {}", String::from_utf8_lossy(&migrated.stderr));
    let db = sqlx::postgres::PgPoolOptions::new().max_connections(2).connect(&url).await?;
    Ok(LayoutDatabase { url, db })
}

/// INTAKE_BENCH_HA_VIA_HAPROXY=1: the layout's writers behind HAProxy.
fn via_haproxy() -> bool {
    std::env::var("INTAKE_BENCH_HA_VIA_HAPROXY").as_deref() == Ok("1")
}

/// How the layout's writers reach the primary, for the report.
pub fn writers_path() -> &'static str {
    if via_haproxy() {
        "the writers through HAProxy to the primary"
    } else {
        "the writers on the primary's own port, following it among the nodes (the gateways through HAProxy)"
    }
}

/// `url`'s database on the layout's three nodes.
fn nodes_url(base: u16, url: &str) -> String {
    intake_tests::ha_nodes_url(base, url.rsplit_once('/').map_or("postgres", |(_, database)| database))
}

/// What the scenarios on a layout measured, and where its servers are.
struct OnLayout {
    scenarios: Vec<(&'static str, Scenario)>,
    layout_roles: Roles,
    /// The standbys' URLs.
    standbys: Vec<String>,
    primary_port: i32,
}

/// `which` on a stack of its own on the layout, its writers answering once `ack_when` holds;
/// each scenario under the name `name_of` gives it.
async fn run_scenarios(
    config: &Config,
    layout: &Layout,
    database: &LayoutDatabase,
    infrastructure: &Roles,
    which: &[&str],
    ack_when: &str,
    name_of: fn(&str) -> &'static str,
) -> anyhow::Result<OnLayout> {
    let LayoutDatabase { url, db } = database;
    let primary_port: i32 = sqlx::query_scalar("SELECT inet_server_port()").fetch_one(db).await?;
    let (layout_roles, standby_ports) = layout.roles(infrastructure, u16::try_from(primary_port)?);
    let standbys: Vec<String> =
        standby_ports.iter().map(|port| format!("postgres://postgres@127.0.0.1:{port}/postgres")).collect();
    say(&format!("on the HA layout: {} gateway(s) and {} writer(s)", config.gateways, config.writers));
    // The writers on the nodes themselves, following the primary, as deploy/up.sh --ha runs
    // them; INTAKE_BENCH_HA_VIA_HAPROXY=1 puts them behind HAProxy, as the gateways are, for
    // what the proxy's relay of each round trip costs.
    let writers_url = if via_haproxy() { url.clone() } else { nodes_url(config.ha_base_port, url) };
    let stack =
        crate::start_stack_on(config.gateways, config.writers, Some(url.clone()), Some(writers_url), ack_when).await;
    let keys: Vec<TestKey> = (0..config.workspaces).map(|_| stack.workspace()).collect();
    let plans = Plans { keys: Arc::new(keys) };
    let roles = crate::roles_of(&stack, &layout_roles);
    crate::warm_up(&stack, &plans, config.warmup_seconds).await;
    crate::analyze(url).await?;
    let mut scenarios = Vec::new();
    for &scenario in which {
        let name = name_of(scenario);
        let measured = match scenario {
            "batch_ingest" => {
                let generator = Arc::new(crate::bodies::Generator::new("ingest"));
                crate::batch_ingest(&stack, &roles, &plans, config, name, generator).await.0
            }
            "single_32" => crate::single_32(&stack, &roles, &plans, config, name).await,
            _ => crate::single_200rps(&stack, &roles, &plans, config, name, url, &standbys).await?,
        };
        scenarios.push((name, measured));
    }
    drop(stack);
    Ok(OnLayout { scenarios, layout_roles, standbys, primary_port })
}

/// The runs at size of the single node (sized.rs) again on the layout, at each of its sizes:
/// the data loaded through the primary (its standbys replaying it as it goes), then every
/// scenario at that size. The database goes with the layout's directory.
async fn at_sizes(
    config: &Config,
    layout: &Layout,
    roles: &Roles,
    standbys: &[String],
) -> anyhow::Result<(Vec<(&'static str, Scenario)>, Vec<Value>)> {
    if config.sizes.is_empty() {
        return Ok((Vec::new(), Vec::new()));
    }
    let server = layout.server_url();
    let admin = PgPoolOptions::new().max_connections(2).connect(&format!("{server}/postgres")).await?;
    let bin_dir = intake_tests::env("INTAKE_BIN_DIR");
    let mut preloaded = sized::Preloaded::create(&admin, &server, &config.sized_database, &bin_dir, 3).await?;
    let (mut scenarios, mut rows) = (Vec::new(), Vec::new());
    // A size that fails (the disk check of a large one, say) is reported as failed, and the
    // sizes before it and the rest of the run are kept.
    for &size in &config.sizes {
        say(&format!("on the HA layout: loading to {size} conversions (COPY, indexes after)"));
        let load = match preloaded.grow_to(size).await {
            Ok(load) => load,
            Err(error) => {
                say(&format!("no runs at {size} on the HA layout: {error:#}"));
                rows.push(json!({ "size": size, "label": sized::label(size), "failed": format!("{error:#}") }));
                break;
            }
        };
        say(&format!("loaded on the HA layout: {load}"));
        let bytes = crate::capped::bytes_per_conversion(&preloaded.db, "conversions")
            .await
            .unwrap_or_else(|e| json!({ "failed": e.to_string() }));
        match sized::scenarios_at(config, &preloaded, roles, size, sized::Setting::Ha { standbys }).await {
            Ok((measured, extra)) => {
                scenarios.extend(measured);
                rows.push(json!({
                    "size": size,
                    "label": sized::label(size),
                    "load": load,
                    "bytes_per_conversion": bytes,
                    "erase": extra["erase"],
                    "wal_per_item": extra["wal_per_item"],
                }));
            }
            Err(error) => {
                say(&format!("the runs at {size} on the HA layout failed: {error:#}"));
                rows.push(json!({ "size": size, "label": sized::label(size), "failed": format!("{error:#}") }));
                break;
            }
        }
    }
    preloaded.db.close().await;
    admin.close().await;
    Ok((scenarios, rows))
}

/// Each standby's own write-back of what it replayed (a restartpoint, at the primary's last
/// checkpoint once it has replayed that far): for the standbys what `settle` does for the
/// primary, so that neither's is left to fall into the next scenario.
pub async fn checkpoint_standbys(primary_url: &str, standbys: &[String]) -> anyhow::Result<()> {
    if standbys.is_empty() {
        return Ok(());
    }
    let mut primary = sqlx::PgConnection::connect(primary_url).await?;
    let lsn: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text").fetch_one(&mut primary).await?;
    primary.close().await?;
    let started = Instant::now();
    for url in standbys {
        let mut standby = sqlx::PgConnection::connect(url).await?;
        loop {
            let replayed: bool = sqlx::query_scalar("SELECT coalesce(pg_last_wal_replay_lsn() >= $1::pg_lsn, false)")
                .bind(&lsn)
                .fetch_one(&mut standby)
                .await?;
            if replayed || started.elapsed() > Duration::from_secs(60) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        sqlx::raw_sql("CHECKPOINT").execute(&mut standby).await?;
        standby.close().await?;
    }
    say(&format!(
        "settled the standbys: replayed to {lsn} and checkpointed in {:.1} s",
        started.elapsed().as_secs_f64()
    ));
    Ok(())
}

/// Every setting in which the two servers differ, but where they are (ports, directories).
async fn settings_differing(single: &PgPool, ha: &PgPool) -> anyhow::Result<Value> {
    const PLACE: [&str; 8] = [
        "port",
        "data_directory",
        "config_file",
        "hba_file",
        "ident_file",
        "external_pid_file",
        "cluster_name",
        "listen_addresses",
    ];
    let read = |db: &PgPool| {
        let db = db.clone();
        async move {
            let rows: Vec<(String, String)> =
                sqlx::query_as("SELECT name, current_setting(name) FROM pg_settings").fetch_all(&db).await?;
            anyhow::Ok(rows.into_iter().collect::<BTreeMap<String, String>>())
        }
    };
    let (single, ha) = (read(single).await?, read(ha).await?);
    let mut differing = Map::new();
    let names: std::collections::BTreeSet<&String> = single.keys().chain(ha.keys()).collect();
    for name in names {
        let (a, b) = (single.get(name), ha.get(name));
        if a != b && !PLACE.contains(&name.as_str()) {
            differing.insert(name.clone(), json!({ "single": a, "ha": b }));
        }
    }
    Ok(Value::Object(differing))
}
