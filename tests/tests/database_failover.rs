//! Losing the database's primary machine under traffic: writes come back within 30 s with no
//! operator, nothing acknowledged is lost or stale, and the old primary rejoins as a standby.
//! On an HA layout of the test's own (deploy/ha.sh: three etcd members, three PostgreSQL nodes
//! under Patroni with a synchronous standby, HAProxy as the primary's address). With
//! asynchronous replication, a standby promoted behind the lost primary gets back from the
//! requests topic every write it lacked, under the ids its clients were told.

use intake_tests::serde_json::Value;
use intake_tests::{check_ledger_in, env, wait_until, FaultReport, Sent, Stack, StackOptions, Traffic};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

/// Bases of a layout's ports: below the suite's own (tests/src/lib.rs FREE_PORTS, 20000 and up;
/// KafkaCluster takes 30000-32767, up.sh --ha 30400-30460) and the kernel's ephemeral range, so
/// that no outgoing connection takes the port of a node that is down. A layout uses B+0..55.
const BASES: std::ops::Range<u16> = 10_000..19_900;
const SLOT: u16 = 60;
/// Offsets from the base of every port the layout listens on without backups (deploy/ha.sh
/// ha_port), and of the primary's address.
const OFFSETS: [u16; 14] = [0, 1, 2, 10, 11, 12, 20, 21, 22, 30, 31, 32, 50, PRIMARY_OFFSET];
const PRIMARY_OFFSET: u16 = 55;

/// An HA layout in a scratch directory, started by deploy/ha.sh's start_ha_cluster; every
/// process of it is killed on drop, even when the test fails.
struct HaLayout {
    dir: PathBuf,
    base: u16,
    /// deploy/ha.sh's INTAKE_HA_REPLICATION: sync or async.
    replication: &'static str,
}

impl HaLayout {
    fn start() -> HaLayout {
        HaLayout::start_with("sync")
    }

    fn start_with(replication: &'static str) -> HaLayout {
        let slots = (BASES.end - BASES.start) / SLOT;
        let first = (ulid::Ulid::new().random() % u128::from(slots)) as u16;
        let base = (0..slots)
            .map(|i| BASES.start + ((first + i) % slots) * SLOT)
            .find(|base| OFFSETS.iter().all(|o| std::net::TcpListener::bind(("127.0.0.1", base + o)).is_ok()))
            .unwrap_or_else(|| panic!("no free ports for an HA layout in {BASES:?}"));
        let dir = std::env::temp_dir().join(format!("intake-ha-{}", ulid::Ulid::new().to_string().to_lowercase()));
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
        // The nodes run as users of their own (as root), who must reach their directories.
        let _ = Command::new("chmod").arg("755").arg(&dir).status();
        let layout = HaLayout { dir, base, replication };
        layout.start_what_is_down();
        layout
    }

    /// start_ha_cluster: starts whatever is down and returns once the primary takes writes
    /// with a synchronous standby.
    fn start_what_is_down(&self) {
        let script = format!("start_ha_cluster {} {} {}", self.dir.display(), self.base, self.primary_port());
        self.lib(&script).unwrap_or_else(|e| panic!("{e}"));
    }

    /// Runs `script` with deploy/lib.sh sourced; its output or why it failed.
    fn lib(&self, script: &str) -> Result<String, String> {
        let lib = intake_tests::repo().join("deploy/lib.sh");
        let output = Command::new("bash")
            .args(["-c", &format!("source {} && {script}", lib.display())])
            .env("INTAKE_HOME", &self.dir)
            // No WAL archive and no backups, and small nodes: a short-lived layout.
            .env("INTAKE_HA_BACKUPS", "0")
            .env("INTAKE_HA_REPLICATION", self.replication)
            .env("INTAKE_HA_SHARED_BUFFERS", "128MB")
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("bash: {e}"))?;
        let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
        if output.status.success() {
            Ok(text(&output.stdout))
        } else {
            Err(format!("{script} failed: {}{}", text(&output.stdout), text(&output.stderr)))
        }
    }

    /// `intake-writer migrate --contract` on the layout's primary.
    fn migrate(&self) {
        let migrated = Command::new(PathBuf::from(env("INTAKE_BIN_DIR")).join("intake-writer"))
            .args(["migrate", "--contract"])
            .env("DATABASE_URL", self.database_url())
            .output()
            .unwrap_or_else(|e| panic!("migrate: {e}"));
        assert!(migrated.status.success(), "migrate: {}", String::from_utf8_lossy(&migrated.stderr));
    }

    fn primary_port(&self) -> u16 {
        self.base + PRIMARY_OFFSET
    }

    fn database_url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.primary_port())
    }

    /// The writers' address, as deploy/up.sh --ha gives it (deploy/ha.sh ha_nodes_url): the
    /// three nodes, among which a writer follows the primary itself.
    fn nodes_url(&self) -> String {
        intake_tests::ha_nodes_url(self.base, "postgres")
    }

    /// The writers' environment on the layout: its nodes, and `more`.
    fn writer_env(&self, more: &[(&str, &str)]) -> Vec<(String, String)> {
        std::iter::once(("DATABASE_URL".to_owned(), self.nodes_url()))
            .chain(more.iter().map(|(name, value)| ((*name).to_owned(), (*value).to_owned())))
            .collect()
    }

    fn rest_url(&self, node: u16, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.base + 29 + node)
    }

    /// A stack on the layout: its writers follow the primary among the nodes, with `writer_env`
    /// besides; production's write timeout and stall rule, and no rate limit in the way.
    async fn stack(&self, writer_env: &[(&str, &str)]) -> Stack {
        Stack::start_with(StackOptions {
            database_url: Some(self.database_url()),
            writer_env: self.writer_env(writer_env),
            ..StackOptions::unlimited()
        })
        .await
    }

    /// Whether Patroni lists node `name` as a standby that runs or streams.
    async fn is_standby(&self, http: &reqwest::Client, name: &str) -> bool {
        self.members(http).await.iter().any(|(member, role, state)| {
            member == name
                && (role == "replica" || role == "sync_standby")
                && (state == "running" || state == "streaming")
        })
    }

    /// The name of the node Patroni lists as the leader, if a node answers.
    async fn leader(&self, http: &reqwest::Client) -> Option<String> {
        self.members(http).await.into_iter().find(|(_, role, _)| role == "leader").map(|(name, _, _)| name)
    }

    /// The members as Patroni's /cluster lists them, from the first node that answers (none if
    /// none does).
    async fn members(&self, http: &reqwest::Client) -> Vec<(String, String, String)> {
        for node in 1..=3 {
            let Ok(response) = http.get(self.rest_url(node, "/cluster")).send().await else { continue };
            if let Ok(cluster) = response.json::<Value>().await {
                return members(&cluster);
            }
        }
        Vec::new()
    }

    /// SIGKILL to every process of node `node` (1 to 3): Patroni, the postmaster, its children.
    fn kill_node(&self, node: u16) {
        self.lib(&format!("ha_node_signal {} {node} KILL", self.dir.display())).unwrap_or_else(|e| panic!("{e}"));
    }

    /// How node `node`'s Patroni brought it back (pg_rewind or a new copy): its log's lines of
    /// the rewind, with their times.
    fn how_rejoined(&self, node: u16) -> String {
        let log = std::fs::read_to_string(self.logs().join(format!("ha-node-{node}.log"))).unwrap_or_default();
        let steps: Vec<&str> = log
            .lines()
            .filter(|line| {
                let step = [
                    "running pg_rewind from node",
                    "pg_rewind exit code",
                    "checkpoint on",
                    "emoving data",
                    "reinitializ",
                ];
                step.iter().any(|s| line.contains(s)) && !line.ends_with("in progress")
            })
            .map(|line| line.get(11..).unwrap_or(line))
            .collect();
        if steps.is_empty() {
            "no rewind needed".to_owned()
        } else {
            steps.join("; ")
        }
    }

    fn logs(&self) -> PathBuf {
        self.dir.join("logs")
    }
}

impl Drop for HaLayout {
    fn drop(&mut self) {
        // Patroni first, so that it restarts nothing; then an immediate shutdown of each
        // postmaster (it removes its shared memory, which a SIGKILL leaves behind); then
        // SIGKILL to whatever of a node is left, to HAProxy and to etcd.
        let stopping = Instant::now();
        let dir = self.dir.display();
        let script = format!(
            r#"set +e
               postmasters=()
               for n in 1 2 3; do
                 group="$(cat {dir}/run/ha-node-$n.pid 2>/dev/null)" && kill -KILL -- "-$group" 2>/dev/null
                 postmaster="$(head -n 1 {dir}/ha/node-$n/data/postmaster.pid 2>/dev/null)"
                 if [ -n "$postmaster" ] && ha_node_pids {dir} $n | grep -x "$postmaster" >/dev/null; then
                   kill -QUIT "$postmaster" && postmasters+=("$postmaster")
                 fi
               done
               for _ in $(seq 50); do
                 alive=0
                 for postmaster in "${{postmasters[@]}}"; do ha_pid_alive "$postmaster" && alive=1; done
                 [ "$alive" = 0 ] && break
                 sleep 0.1
               done
               for n in 1 2 3; do ha_node_signal {dir} $n KILL; done
               for file in {dir}/run/ha-*.pid; do [ -f "$file" ] && kill -KILL "$(cat "$file")" 2>/dev/null; done
               true"#
        );
        if let Err(error) = self.lib(&script) {
            eprintln!("stopping the HA layout: {error}");
        }
        eprintln!("HA layout stopped in {:.1} s", stopping.elapsed().as_secs_f64());
        if std::thread::panicking() {
            eprintln!("the HA layout's logs (Patroni, PostgreSQL, HAProxy, etcd): {}", self.logs().display());
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// A layout's stack under traffic on every partition, each workspace acknowledged three times,
/// and the leader before the fault.
struct UnderTraffic {
    stack: Stack,
    keys: Vec<intake_tests::TestKey>,
    http: reqwest::Client,
    old: String,
    old_node: u16,
    traffic: Traffic,
}

async fn under_traffic(layout: &HaLayout) -> UnderTraffic {
    layout.migrate();
    let stack = layout.stack(&[]).await;
    let keys = stack.workspaces_on_every_partition();
    let http = reqwest::Client::builder().timeout(Duration::from_secs(2)).build().unwrap_or_default();
    let old = layout.leader(&http).await.unwrap_or_else(|| panic!("no leader"));
    let old_node: u16 = old.trim_start_matches("node-").parse().unwrap_or_else(|e| panic!("{old}: {e}"));
    let traffic = Traffic::start(stack.client(), &keys);
    wait_until("traffic acknowledged", Duration::from_secs(30), || async { traffic.acknowledged() >= keys.len() * 3 })
        .await;
    UnderTraffic { stack, keys, http, old, old_node, traffic }
}

/// Returns once every workspace had a write acknowledged after `at` (waited for up to
/// `patience`), and two more each after that: writes on the new primary.
async fn writing_again(traffic: &Traffic, workspaces: usize, at: Instant, patience: Duration) {
    traffic.wait_recovered(at, patience).await;
    let back = traffic.acknowledged();
    wait_until("writes on the new primary", Duration::from_secs(30), || async {
        traffic.acknowledged() >= back + workspaces * 2
    })
    .await;
}

/// The address of node `name` (`node-N`) as the writers' URL names it.
fn new_leader_address(layout: &HaLayout, name: &str) -> String {
    let n: u16 = name.trim_start_matches("node-").parse().unwrap_or_else(|e| panic!("{name}: {e}"));
    intake_tests::ha_node_address(layout.base, n)
}

/// A member of Patroni's /cluster: name, role, state.
fn members(cluster: &Value) -> Vec<(String, String, String)> {
    let text = |m: &Value, k: &str| m[k].as_str().unwrap_or_default().to_owned();
    cluster["members"]
        .as_array()
        .map(|all| all.iter().map(|m| (text(m, "name"), text(m, "role"), text(m, "state"))).collect())
        .unwrap_or_default()
}

/// What the layout's own interfaces showed during the failover, from the kill.
#[derive(Debug, Default)]
struct Seen {
    /// Patroni's /cluster lists a running leader other than the old one.
    leader_listed: Option<Duration>,
    /// HAProxy's check marks a node other than the old primary up.
    routed: Option<Duration>,
}

/// Polls Patroni's /cluster and HAProxy's stats every 100 ms until stopped.
fn watch(layout: &HaLayout, old: &str, killed_at: Instant) -> (Arc<Mutex<Seen>>, tokio::task::JoinHandle<()>) {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let http = reqwest::Client::builder().timeout(Duration::from_secs(1)).build().unwrap_or_default();
    let rest: Vec<String> = (1..=3).map(|n| layout.rest_url(n, "/cluster")).collect();
    let stats = format!("http://127.0.0.1:{}/;csv", layout.base + 50);
    let (old, record) = (old.to_owned(), seen.clone());
    let task = tokio::spawn(async move {
        loop {
            let at = killed_at.elapsed();
            for url in &rest {
                let Ok(response) = http.get(url).send().await else { continue };
                let Ok(cluster) = response.json::<Value>().await else { continue };
                let new_leader = members(&cluster)
                    .iter()
                    .any(|(name, role, state)| *name != old && role == "leader" && state == "running");
                if new_leader {
                    record.lock().unwrap_or_else(|p| p.into_inner()).leader_listed.get_or_insert(at);
                }
                break;
            }
            if let Ok(response) = http.get(&stats).send().await {
                let csv = response.text().await.unwrap_or_default();
                // pxname, svname, ..., status (column 17 of HAProxy's CSV).
                let up = csv.lines().map(|line| line.split(',').collect::<Vec<_>>()).any(|row| {
                    row.len() > 17
                        && row[0] == "primary"
                        && row[1].starts_with("node-")
                        && row[1] != old
                        && row[17] == "UP"
                });
                if up {
                    record.lock().unwrap_or_else(|p| p.into_inner()).routed.get_or_insert(at);
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    (seen, task)
}

/// Seconds from `from` (wall clock) to an RFC 3339 time.
fn seconds_after(from: SystemTime, rfc3339: &str) -> Option<f64> {
    let at = time::OffsetDateTime::parse(rfc3339, &time::format_description::well_known::Rfc3339).ok()?;
    let from = time::OffsetDateTime::from(from);
    Some((at - from).as_seconds_f64())
}

/// Asserts that the layout's primary has every acknowledged write, at its acknowledged value.
async fn assert_ledger_clean(layout: &HaLayout, keys: &[intake_tests::TestKey], sent: &[Sent]) {
    // Right after a fault a node may still be restarting (the old primary rejoining): a
    // connection it takes and then drops is tried again, as the services' own are.
    let deadline = Instant::now() + Duration::from_secs(20);
    let db = loop {
        match sqlx::postgres::PgPoolOptions::new().max_connections(2).connect(&layout.database_url()).await {
            Ok(db) => break db,
            Err(error) if Instant::now() < deadline => {
                eprintln!("connecting for the ledger's check: {error}; trying again");
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            Err(error) => panic!("connecting for the ledger's check: {error}"),
        }
    };
    let check = check_ledger_in(&db, keys, sent, Duration::from_secs(20)).await;
    assert!(check.is_clean(), "acknowledged but not stored, or stored with an older value: {check:?}");
}

/// Asserts that every workspace's first success after the fault came within `bound` of `fault`.
fn each_wrote_within(first: &[Option<Duration>], bound: Duration, fault: &str, writer_logs: &str) {
    for (workspace, first) in first.iter().enumerate() {
        assert!(
            first.is_some_and(|d| d <= bound),
            "workspace {workspace} had no success within {} s of {fault}: {first:?} (writer logs {writer_logs})",
            bound.as_secs()
        );
    }
}

/// What the traffic saw of a fault at `at`: each workspace's first success among requests sent
/// after it (counted to its answer), and the tally of every answer.
struct Outcome {
    first: Vec<Option<Duration>>,
    report: FaultReport,
    requests: usize,
}

impl Outcome {
    fn of(sent: &[Sent], workspaces: usize, at: Instant) -> Outcome {
        let mut first = vec![None; workspaces];
        for s in sent.iter().filter(|s| s.started >= at && (200..300).contains(&s.status)) {
            let answered = s.started + s.took - at;
            let slot: &mut Option<Duration> = &mut first[s.workspace];
            if slot.is_none_or(|earlier| answered < earlier) {
                *slot = Some(answered);
            }
        }
        Outcome { first, report: FaultReport::of(sent, workspaces, at), requests: sent.len() }
    }

    /// The part of each failover test's printed line that they share.
    fn summary(&self) -> String {
        let secs = |d: &Option<Duration>| d.map_or("none".to_owned(), |d| format!("{:.1}", d.as_secs_f64()));
        format!(
            "first success per workspace {:?} s; {} requests, {} acknowledged, {} failed, longest {:.1} s",
            self.first.iter().map(secs).collect::<Vec<_>>(),
            self.requests,
            self.report.acknowledged,
            self.report.failed,
            self.report.longest.as_secs_f64(),
        )
    }
}

// Several threads: the layout's scripts block one while the traffic goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_primary_machine_lost_under_traffic_loses_nothing_acknowledged_and_heals() {
    let started = Instant::now();
    let layout = tokio::task::block_in_place(HaLayout::start);
    let layout_up = started.elapsed();
    layout.migrate();
    let stack = layout.stack(&[]).await;
    let keys = stack.workspaces_on_every_partition();
    let http = reqwest::Client::builder().timeout(Duration::from_secs(2)).build().unwrap_or_default();
    let cluster = || layout.members(&http);
    let before = cluster().await;
    let old = before.iter().find(|(_, role, _)| role == "leader").map(|(name, _, _)| name.clone());
    let old = old.unwrap_or_else(|| panic!("no leader: {before:?}"));
    let old_node: u16 = old.trim_start_matches("node-").parse().unwrap_or_else(|e| panic!("{old}: {e}"));

    let traffic = Traffic::start(stack.client(), &keys);
    let each_wrote = keys.len() * 3;
    wait_until("traffic acknowledged", Duration::from_secs(30), || async { traffic.acknowledged() >= each_wrote })
        .await;

    // The machine is lost: every process of the primary's node stopped, then killed.
    let killed_wall = SystemTime::now();
    tokio::task::block_in_place(|| layout.kill_node(old_node));
    let killed_at = Instant::now();
    let (seen, watcher) = watch(&layout, &old, killed_at);
    // When the leader key expires: its last renewal's expiry, as etcd holds it (v2 API).
    let etcd = format!("http://127.0.0.1:{}/v2/keys/service/intake/leader", layout.base);
    let leader_key: Value = match http.get(&etcd).send().await {
        Ok(response) => response.json().await.unwrap_or_default(),
        Err(_) => Value::Null,
    };
    let key_expires = leader_key["node"]["expiration"].as_str().and_then(|at| seconds_after(killed_wall, at));

    writing_again(&traffic, keys.len(), killed_at, Duration::from_secs(45)).await;
    watcher.abort();
    let seen = std::mem::take(&mut *seen.lock().unwrap_or_else(|p| p.into_inner()));
    // The promotion, as Patroni recorded it: the new timeline's start, once its history lists it.
    let history_url = layout.rest_url(1 + old_node % 3, "/history");
    let deadline = Instant::now() + Duration::from_secs(20);
    let promotion = loop {
        let history: Value = match http.get(&history_url).send().await {
            Ok(response) => response.json().await.unwrap_or_default(),
            Err(_) => Value::Null,
        };
        let last = history.as_array().and_then(|h| h.last()).cloned().unwrap_or_default();
        if last[4].as_str().is_some_and(|leader| leader != old) || Instant::now() > deadline {
            break last;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let promoted = promotion[3].as_str().and_then(|at| seconds_after(killed_wall, at));
    let new_leader = promotion[4].as_str().unwrap_or("?").to_owned();

    // The old primary's machine comes back: it rejoins as a standby by itself, under traffic.
    let restarted_at = Instant::now();
    tokio::task::block_in_place(|| layout.start_what_is_down());
    let layout_back = restarted_at.elapsed();
    let rejoined = || layout.is_standby(&http, &old);
    wait_until(&format!("{old} rejoining as a standby"), Duration::from_secs(90), rejoined).await;
    let rejoined_after = restarted_at.elapsed();
    let sent = traffic.stop().await;

    let outcome = Outcome::of(&sent, keys.len(), killed_at);
    let secs = |d: Option<Duration>| d.map_or("none".to_owned(), |d| format!("{:.1}", d.as_secs_f64()));
    let opt = |s: Option<f64>| s.map_or("?".to_owned(), |s| format!("{s:.1}"));
    eprintln!(
        "failover of {old} to {new_leader}: leader key expiring {} s after the kill, promotion at {} s, \
         listed as leader at {} s, HAProxy routing to it at {} s; {old} rejoined {:.1} s after its restart \
         (start_ha_cluster {:.1} s; {}); layout up in {:.1} s; test {:.1} s so far; {}",
        opt(key_expires),
        opt(promoted),
        secs(seen.leader_listed),
        secs(seen.routed),
        rejoined_after.as_secs_f64(),
        layout_back.as_secs_f64(),
        layout.how_rejoined(old_node),
        layout_up.as_secs_f64(),
        started.elapsed().as_secs_f64(),
        outcome.summary(),
    );
    let Outcome { first, report, .. } = outcome;

    each_wrote_within(&first, Duration::from_secs(30), "the kill", &stack.log_dir.display().to_string());
    assert!(report.unexpected.is_empty(), "statuses other than 2xx, 500 and 503: {report:?}");
    // The writer found the new primary among the nodes itself, not through HAProxy.
    let writer_log = std::fs::read_to_string(stack.log_dir.join("writer.log")).unwrap_or_default();
    assert!(
        writer_log
            .lines()
            .any(|line| line.contains("the primary moved") && line.contains(&new_leader_address(&layout, &new_leader))),
        "the writer did not follow the primary to {new_leader} (writer logs {})",
        stack.log_dir.display()
    );
    let db = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(&layout.database_url())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let checking = Instant::now();
    let check = check_ledger_in(&db, &keys, &sent, Duration::from_secs(20)).await;
    eprintln!(
        "ledger checked in {:.1} s: {} conversions updated after an acknowledged value",
        checking.elapsed().as_secs_f64(),
        check.updated
    );
    assert!(check.is_clean(), "acknowledged but not stored, or stored with an older value: {check:?}");
    assert!(check.updated > 0, "the traffic updated rows: {check:?}");
    // An operator command given the nodes finds the new primary among them by itself.
    let created = stack
        .writer_command()
        .env("DATABASE_URL", layout.nodes_url())
        .args(["workspace", "create", "--name", "After the failover", "--site", "after.example"])
        .output()
        .unwrap_or_else(|e| panic!("intake-writer workspace create: {e}"));
    assert!(created.status.success(), "workspace create on the nodes: {}", String::from_utf8_lossy(&created.stderr));
    let created: Value = intake_tests::serde_json::from_slice(&created.stdout).unwrap_or_else(|e| panic!("{e}"));
    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM workspaces WHERE id = $1")
        .bind(created["id"].as_str().unwrap_or_default())
        .fetch_one(&db)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(stored, 1, "the workspace created on the nodes is on the primary: {created}");
    let metrics = stack.writer_metrics(0).await;
    let dead_lettered: Vec<&str> = metrics
        .0
        .lines()
        .filter(|l| l.starts_with("intake_writer_dead_lettered_total{") && !l.ends_with(" 0"))
        .collect();
    assert!(dead_lettered.is_empty(), "the failover dead-lettered messages: {dead_lettered:?}");
    let after = cluster().await;
    assert!(after.iter().any(|(_, role, _)| role == "sync_standby"), "synchronous replication resumed: {after:?}");
}

/// The primary's Patroni frozen, its PostgreSQL still up and taking writes (Patroni's watchdog
/// off): another node is promoted once the leader key expires, and the writer, which asks the
/// nodes themselves, leaves the old primary for the one on the later timeline, whose standby
/// confirms its commits. Writes come back while the old primary still takes writes, and nothing
/// acknowledged is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_whose_patroni_froze_is_left_for_the_node_promoted_in_its_place() {
    let layout = tokio::task::block_in_place(HaLayout::start);
    let UnderTraffic { stack, keys, http, old, old_node, traffic } = under_traffic(&layout).await;
    let leader = || layout.leader(&http);

    let freeze = format!("kill -STOP -- \"-$(cat {}/run/ha-node-{old_node}.pid)\"", layout.dir.display());
    layout.lib(&freeze).unwrap_or_else(|e| panic!("{e}"));
    // Its standbys stream from it until their own Patroni follows the new leader: the writes
    // to watch are those after the promotion.
    wait_until("another node promoted", Duration::from_secs(45), || async {
        leader().await.is_some_and(|leader| leader != old)
    })
    .await;
    let promoted_at = Instant::now();
    writing_again(&traffic, keys.len(), promoted_at, Duration::from_secs(30)).await;
    let sent = traffic.stop().await;
    let new = leader().await.unwrap_or_default();
    // Still frozen: the old node's PostgreSQL takes writes all along.
    let old_address = intake_tests::ha_node_address(layout.base, old_node);
    let old_url = format!("postgres://postgres@{old_address}/postgres");
    let old_in_recovery: Option<bool> = match sqlx::postgres::PgPool::connect(&old_url).await {
        Ok(old) => sqlx::query_scalar("SELECT pg_is_in_recovery()").fetch_one(&old).await.ok(),
        Err(_) => None,
    };

    let outcome = Outcome::of(&sent, keys.len(), promoted_at);
    eprintln!("{old}'s Patroni frozen, {new} leading; after the promotion: {}", outcome.summary());
    let Outcome { first, report, .. } = outcome;
    assert_ne!(new, old, "another node leads");
    assert_eq!(old_in_recovery, Some(false), "the old primary, its Patroni frozen, still takes writes");
    each_wrote_within(&first, Duration::from_secs(15), "the promotion", &stack.log_dir.display().to_string());
    assert!(report.unexpected.is_empty(), "statuses other than 2xx, 500 and 503: {report:?}");
    // The writer saw both nodes take writes (asked every second) and moved.
    let writer_log = || std::fs::read_to_string(stack.log_dir.join("writer.log")).unwrap_or_default();
    for said in ["more than one node takes writes", "the primary moved"] {
        wait_until(&format!("the writer's log saying {said:?}"), Duration::from_secs(10), || async {
            writer_log().contains(said)
        })
        .await;
    }
    assert_ledger_clean(&layout, &keys, &sent).await;
}

/// Only the primary's PostgreSQL crashes (its postmaster SIGKILLed), its Patroni alive: Patroni
/// hands the leader key to the synchronous standby at once rather than recovering in place
/// (`primary_start_timeout: 0`, deploy/ha/dcs.yml), the writers follow, and every workspace
/// writes again within 15 s with nothing acknowledged lost: the design's bound (DESIGN.md,
/// section 12) when Patroni lives. The crashed node then rejoins as a standby by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_primary_s_postgresql_crashed_under_traffic_writes_again_within_15_s() {
    let layout = tokio::task::block_in_place(HaLayout::start);
    let UnderTraffic { stack, keys, http, old, old_node, traffic } = under_traffic(&layout).await;
    let leader = || layout.leader(&http);

    let crash = format!(
        "postmaster=\"$(head -n 1 {}/ha/node-{old_node}/data/postmaster.pid)\" && kill -KILL \"$postmaster\"",
        layout.dir.display()
    );
    layout.lib(&crash).unwrap_or_else(|e| panic!("{e}"));
    let crashed_at = Instant::now();
    writing_again(&traffic, keys.len(), crashed_at, Duration::from_secs(30)).await;
    let sent = traffic.stop().await;
    let now_leading = leader().await.unwrap_or_default();

    let outcome = Outcome::of(&sent, keys.len(), crashed_at);
    eprintln!("{old}'s postmaster killed, {now_leading} leading after it; {}", outcome.summary());
    let Outcome { first, report, .. } = outcome;
    let logs = format!("{}; the layout's {}", stack.log_dir.display(), layout.logs().display());
    each_wrote_within(&first, Duration::from_secs(15), "the crash", &logs);
    assert!(report.unexpected.is_empty(), "statuses other than 2xx, 500 and 503: {report:?}");
    assert_ledger_clean(&layout, &keys, &sent).await;
    wait_until(&format!("{old} rejoining as a standby"), Duration::from_secs(60), || layout.is_standby(&http, &old))
        .await;

    // The node promoted in its place runs at its full share, and both standbys' replay, the
    // rejoined one's included, yields to the processes a commit waits for.
    let mut last = String::new();
    let patience = Duration::from_secs(10);
    let checked = tokio::time::timeout(patience, async {
        loop {
            match replay_yields(&layout, &layout.members(&http).await) {
                Ok(()) => break,
                Err(why) => last = why,
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    assert!(checked.await.is_ok(), "within {patience:?} after {old} rejoined: {last}");
}

/// The niceness and title of node `node`'s postmaster, then of each of its children.
fn server_processes(layout: &HaLayout, node: u16) -> Vec<(i32, String)> {
    let pid_file = layout.dir.join(format!("ha/node-{node}/data/postmaster.pid"));
    let Some(postmaster) = std::fs::read_to_string(pid_file).ok().and_then(|s| s.lines().next().map(str::to_owned))
    else {
        return Vec::new();
    };
    let postmaster = postmaster.trim();
    let list = |selection: &str| {
        let listed = Command::new("ps").args(["-o", "ni=,args=", selection, postmaster]).output();
        let listed = listed.unwrap_or_else(|e| panic!("ps: {e}"));
        String::from_utf8_lossy(&listed.stdout)
            .lines()
            .filter_map(|line| {
                let (nice, title) = line.trim_start().split_once(' ')?;
                Some((nice.parse().ok()?, title.trim().to_owned()))
            })
            .collect::<Vec<_>>()
    };
    let mut processes = list("-p");
    if processes.len() == 1 {
        processes.extend(list("--ppid"));
    }
    processes
}

/// deploy/ha/replay-yields.sh on every node of `cluster`: a standby's replay (its startup
/// process) at nice 10, and every other process of the three servers at its postmaster's.
fn replay_yields(layout: &HaLayout, cluster: &[(String, String, String)]) -> Result<(), String> {
    if cluster.len() != 3 {
        return Err(format!("Patroni lists {cluster:?}"));
    }
    for (name, role, _) in cluster {
        let node: u16 = name.trim_start_matches("node-").parse().map_err(|e| format!("{name}: {e}"))?;
        let processes = server_processes(layout, node);
        let Some(((own, _), children)) = processes.split_first() else {
            return Err(format!("{name} ({role}): no postmaster"));
        };
        let replay: Vec<_> = children.iter().filter(|(_, title)| title.contains(": startup ")).collect();
        let others = children.iter().filter(|(_, title)| !title.contains(": startup "));
        let lowered: Vec<_> = others.filter(|(nice, _)| nice != own).collect();
        let replay_ok = match role.as_str() {
            "leader" => replay.is_empty(),
            _ => replay.len() == 1 && replay[0].0 == 10,
        };
        if !replay_ok || !lowered.is_empty() || children.is_empty() {
            return Err(format!("{name} ({role}): {processes:?}"));
        }
    }
    Ok(())
}

/// The HA layout's standbys, as (node, its PostgreSQL's port).
fn standbys(layout: &HaLayout, cluster: &[(String, String, String)]) -> Vec<(u16, u16)> {
    cluster
        .iter()
        .filter(|(_, role, _)| role != "leader")
        .filter_map(|(name, _, _)| name.trim_start_matches("node-").parse::<u16>().ok())
        .map(|node| (node, layout.base + 19 + node))
        .collect()
}

/// Every standby's WAL receiver stopped (SIGSTOP) or let go on (SIGCONT): while stopped, no
/// standby flushes anything, so every commit on the primary is on the primary alone. Kept
/// well under `wal_sender_timeout` (5 s, deploy/ha/dcs.yml), past which the primary drops them.
async fn signal_wal_receivers(standbys: &[(u16, u16)], signal: &str) {
    for &(node, port) in standbys {
        let url = format!("postgres://postgres@127.0.0.1:{port}/postgres");
        let mut connection = <sqlx::PgConnection as sqlx::Connection>::connect(&url)
            .await
            .unwrap_or_else(|e| panic!("node-{node}: {e}"));
        let pid: i32 = sqlx::query_scalar("SELECT pid FROM pg_stat_wal_receiver")
            .fetch_one(&mut connection)
            .await
            .unwrap_or_else(|e| panic!("node-{node}'s WAL receiver: {e}"));
        let status = Command::new("kill").args([&format!("-{signal}"), &pid.to_string()]).status();
        assert!(status.is_ok_and(|s| s.success()), "kill -{signal} {pid}");
    }
}

/// The backends of the primary that wait for a synchronous standby.
async fn waiting_for_standby(primary: &sqlx::PgPool) -> Vec<i32> {
    sqlx::query_scalar("SELECT pid FROM pg_stat_activity WHERE wait_event = 'SyncRep'")
        .fetch_all(primary)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

/// How a commit's wait for the standby is interrupted.
#[derive(Clone, Copy, Debug)]
enum Interrupt {
    /// `pg_cancel_backend`: COMMIT returns success with a WARNING, committed on the primary alone.
    Cancel,
    /// `pg_terminate_backend`: the connection ends after the local commit; a retry finds the
    /// message applied and would answer from it.
    Terminate,
    /// Nobody: the writer's own bound ends the wait (strict synchronous mode with no standby
    /// waits for ever), and cancels it so that no backend holds the workspace's lock.
    None,
}

// Several threads: the layout's scripts block one while the test goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_answer_leaves_before_a_synchronous_standby_has_the_commit_however_its_wait_ends() {
    let layout = tokio::task::block_in_place(HaLayout::start);
    layout.migrate();
    let bound = Duration::from_millis(1_000);
    let stack = layout
        .stack(&[
            ("INTAKE_WRITER_ACK_WHEN", "replicated"),
            ("INTAKE_WRITER_REPLICATION_WAIT_MS", &bound.as_millis().to_string()),
        ])
        .await;
    let key = stack.workspace();
    let first = stack.post("/v1/conversions", &key, &intake_tests::conversion("lead")).await;
    assert_eq!(first.status, 201, "{first:?}");
    let primary = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(&layout.database_url())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let http = reqwest::Client::new();
    let cluster: Value = http
        .get(layout.rest_url(1, "/cluster"))
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .json()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let standbys = standbys(&layout, &members(&cluster));
    assert_eq!(standbys.len(), 2, "{cluster}");

    for interrupt in [Interrupt::Cancel, Interrupt::Terminate, Interrupt::None] {
        let body = intake_tests::conversion("lead");
        let external_id = body["external_id"].as_str().unwrap_or_default().to_owned();
        signal_wal_receivers(&standbys, "STOP").await;
        let frozen = Instant::now();
        let client = stack.client();
        let (sending_key, sending) = (key.clone(), body.clone());
        let send = tokio::spawn(async move {
            let reply = client.post("/v1/conversions", &sending_key, &sending).await;
            (reply, Instant::now())
        });
        let looking = Instant::now();
        let waiting = loop {
            let waiting = waiting_for_standby(&primary).await;
            if !waiting.is_empty() {
                break waiting;
            }
            assert!(looking.elapsed() < Duration::from_secs(2), "{interrupt:?}: no commit waited for the standby");
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        let interrupted: Vec<bool> = match interrupt {
            Interrupt::Cancel => sqlx::query_scalar("SELECT pg_cancel_backend(pid) FROM unnest($1::int4[]) AS w(pid)")
                .bind(&waiting)
                .fetch_all(&primary)
                .await
                .unwrap_or_else(|e| panic!("{e}")),
            Interrupt::Terminate => {
                sqlx::query_scalar("SELECT pg_terminate_backend(pid) FROM unnest($1::int4[]) AS w(pid)")
                    .bind(&waiting)
                    .fetch_all(&primary)
                    .await
                    .unwrap_or_else(|e| panic!("{e}"))
            }
            Interrupt::None => Vec::new(),
        };
        // A backend the writer's own bound cancelled first is gone from the list by now.
        assert!(matches!(interrupt, Interrupt::None) || interrupted.contains(&true), "{interrupt:?}: {interrupted:?}");
        // The commit happened on the primary alone...
        wait_until(&format!("{interrupt:?}: the row on the primary"), Duration::from_secs(3), || async {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM conversions WHERE external_id = $1")
                .bind(&external_id)
                .fetch_one(&primary)
                .await
                .is_ok_and(|n| n == 1)
        })
        .await;
        // ...and the writer gives up its own waits past the bound: no backend is left waiting
        // for the standby, holding the workspace's lock.
        wait_until(&format!("{interrupt:?}: no commit left waiting"), bound * 2, || async {
            waiting_for_standby(&primary).await.is_empty()
        })
        .await;
        // Still frozen: no answer may have left.
        let still = frozen.elapsed() < Duration::from_millis(4_000);
        if send.is_finished() {
            panic!("{interrupt:?}: answered while only the primary had the commit: {:?}", send.await);
        }
        assert!(still, "{interrupt:?}: the standbys were held too long for the check to mean anything");
        let let_go = Instant::now();
        signal_wal_receivers(&standbys, "CONT").await;
        let (reply, answered) = send.await.unwrap_or_else(|e| panic!("{e}"));
        assert!(answered >= let_go, "{interrupt:?}");
        assert_eq!(reply.status, 201, "{interrupt:?}, once the standby has it: {reply:?}");
        assert_eq!(reply.body["conversion"]["result"], "created", "{interrupt:?}: {reply:?}");
        eprintln!(
            "{interrupt:?}: answered 201 {:.0} ms after the standbys went on ({:.0} ms after the send)",
            (answered - let_go).as_secs_f64() * 1e3,
            (answered - frozen).as_secs_f64() * 1e3
        );
    }
    let metrics = stack.writer_metrics(0).await;
    assert!(metrics.value("intake_writer_unreplicated_commits_total") >= 1.0, "counted");
    assert!(
        metrics.value("intake_writer_confirmations_rechecked_total") >= 1.0,
        "the confirmations that found no standby with the commit looked again before giving up"
    );
    let (status, _) = stack.ops_get(&format!("{}/healthz", stack.writer_ops_urls[0])).await;
    assert_eq!(status, 200, "an outage, not a stall");

    // An operator command's write whose wait is cancelled fails instead of printing success.
    signal_wal_receivers(&standbys, "STOP").await;
    let mut revoke = stack.writer_command();
    revoke
        .args(["key", "revoke", &key.key_id])
        .env("DATABASE_URL", layout.database_url())
        .env("INTAKE_WRITER_ACK_WHEN", "replicated")
        .env("INTAKE_WRITER_REPLICATION_WAIT_MS", "1000")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let revoking = revoke.spawn().unwrap_or_else(|e| panic!("{e}"));
    wait_until("the revocation waiting for the standby", Duration::from_secs(3), || async {
        !waiting_for_standby(&primary).await.is_empty()
    })
    .await;
    let _ = sqlx::query("SELECT pg_cancel_backend(pid) FROM pg_stat_activity WHERE wait_event = 'SyncRep'")
        .execute(&primary)
        .await;
    let output = tokio::task::block_in_place(|| revoking.wait_with_output()).unwrap_or_else(|e| panic!("{e}"));
    signal_wal_receivers(&standbys, "CONT").await;
    assert!(!output.status.success(), "revoked on the primary alone, yet reported done: {output:?}");
    assert!(String::from_utf8_lossy(&output.stderr).contains("not acknowledged"), "{output:?}");
}

/// The primary's WAL senders stopped (SIGSTOP) or let go on (SIGCONT): while stopped, nothing
/// more reaches any standby. Kept under the standbys' `wal_receiver_timeout` (5 s), past which
/// they connect again to a new sender.
async fn signal_wal_senders(primary_port: u16, signal: &str) -> usize {
    let url = format!("postgres://postgres@127.0.0.1:{primary_port}/postgres");
    let mut connection =
        <sqlx::PgConnection as sqlx::Connection>::connect(&url).await.unwrap_or_else(|e| panic!("the primary: {e}"));
    let pids: Vec<i32> = sqlx::query_scalar("SELECT pid FROM pg_stat_replication")
        .fetch_all(&mut connection)
        .await
        .unwrap_or_else(|e| panic!("the primary's WAL senders: {e}"));
    for pid in &pids {
        let status = Command::new("kill").args([&format!("-{signal}"), &pid.to_string()]).status();
        assert!(status.is_ok_and(|s| s.success()), "kill -{signal} {pid}");
    }
    pids.len()
}

/// WAL bytes between the primary's current position and the furthest a standby has received.
async fn standby_lag_bytes(primary_port: u16) -> Option<i64> {
    let url = format!("postgres://postgres@127.0.0.1:{primary_port}/postgres");
    let mut connection = <sqlx::PgConnection as sqlx::Connection>::connect(&url).await.ok()?;
    sqlx::query_scalar(
        "SELECT min(pg_wal_lsn_diff(pg_current_wal_lsn(), coalesce(flush_lsn, '0/0')))::int8 FROM pg_stat_replication",
    )
    .fetch_one(&mut connection)
    .await
    .ok()
    .flatten()
}

// Several threads: the layout's scripts block one while the test goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_asynchronous_standby_promoted_behind_the_lost_primary_gets_every_acknowledged_write_back_from_the_log() {
    let started = Instant::now();
    let layout = tokio::task::block_in_place(|| HaLayout::start_with("async"));
    layout.migrate();
    // `auto`: no synchronous standby is named, so an answer waits for the primary's disk alone.
    let stack = layout.stack(&[("INTAKE_LOG", "info,intake_writer::rewind=debug")]).await;
    let keys = stack.workspaces_on_every_partition();
    let http = reqwest::Client::builder().timeout(Duration::from_secs(2)).build().unwrap_or_default();
    let leader = || async {
        for node in 1..=3 {
            let Ok(response) = http.get(layout.rest_url(node, "/cluster")).send().await else { continue };
            if let Ok(cluster) = response.json::<Value>().await {
                let members = members(&cluster);
                if let Some((name, _, _)) = members.iter().find(|(_, role, _)| role == "leader") {
                    return Some(name.clone());
                }
            }
        }
        None
    };
    let old = leader().await.unwrap_or_else(|| panic!("no leader"));
    let old_node: u16 = old.trim_start_matches("node-").parse().unwrap_or_else(|e| panic!("{old}: {e}"));
    let old_port = layout.base + 19 + old_node;

    let traffic = Traffic::start(stack.client(), &keys);
    wait_until("traffic acknowledged", Duration::from_secs(30), || async { traffic.acknowledged() >= keys.len() * 3 })
        .await;
    // A person's conversion that every standby has...
    let person = &keys[0];
    let email = "someone.erased@example.com";
    let with_email = |external_id: &str| {
        let mut item = intake_tests::purchase(external_id, "1.00");
        item["email"] = email.into();
        item
    };
    let replicated = stack.post("/v1/conversions", person, &with_email("person-before")).await;
    assert_eq!(replicated.status, 201, "{:?}", replicated.body);
    wait_until("the standbys have the person's conversion", Duration::from_secs(10), || async {
        standby_lag_bytes(old_port).await == Some(0)
    })
    .await;
    // ...then the standbys fall behind: what the primary commits from here on reaches none of
    // them, and is acknowledged all the same: a second conversion of the person, the person's
    // erasure, and the traffic.
    let senders = signal_wal_senders(old_port, "STOP").await;
    assert_eq!(senders, 2, "both standbys streamed from the primary");
    let behind_from = traffic.acknowledged();
    let alone = stack.post("/v1/conversions", person, &with_email("person-after")).await;
    assert_eq!(alone.status, 201, "{:?}", alone.body);
    let erased = stack
        .run_writer_command_with_input(
            &["erase", "--workspace", &person.workspace_id, "--email"],
            &format!("{email}\n"),
        )
        .unwrap_or_else(|e| panic!("erase: {e:#}"));
    assert_eq!(erased["conversions"], 2, "{erased}");
    wait_until("writes acknowledged on the primary alone", Duration::from_secs(3), || async {
        traffic.acknowledged() >= behind_from + keys.len() * 2
    })
    .await;
    let lag = standby_lag_bytes(old_port).await;
    let acknowledged_alone = traffic.acknowledged() - behind_from;
    // The primary's machine is lost, and Patroni promotes a standby that lacks those writes.
    tokio::task::block_in_place(|| layout.kill_node(old_node));
    let killed_at = Instant::now();
    writing_again(&traffic, keys.len(), killed_at, Duration::from_secs(60)).await;
    let sent = traffic.stop().await;
    let new = leader().await.unwrap_or_default();
    let report = FaultReport::of(&sent, keys.len(), killed_at);
    let db = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(&layout.database_url())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let check = check_ledger_in(&db, &keys, &sent, Duration::from_secs(30)).await;
    let metrics = stack.writer_metrics(0).await;
    let reapplied = metrics.value("intake_writer_reapplied_messages_total");
    eprintln!(
        "asynchronous failover of {old} to {new}: {acknowledged_alone} requests acknowledged on the primary alone, \
         the standbys {} bytes of WAL behind at the loss; rewinds read {} messages again and applied {reapplied} \
         the new primary lacked; {} requests, {} acknowledged, {} failed, recovered after {:?}; \
         ledger {} missing, {} wrong, {} under other ids ({} updated); test {:.1} s",
        lag.map_or("?".to_owned(), |l| l.to_string()),
        metrics.value("intake_writer_rewound_messages_total"),
        sent.len(),
        report.acknowledged,
        report.failed,
        report.recovered_after,
        check.missing.len(),
        check.wrong.len(),
        check.other_ids.len(),
        check.updated,
        started.elapsed().as_secs_f64(),
    );
    // The erasure the promoted standby lacked came back from the log after the person's data
    // that the rewind applied again: neither conversion keeps the email.
    let person_rows: Vec<(String, bool)> = sqlx::query_as(
        "SELECT external_id, email_digest IS NOT NULL FROM conversions
          WHERE workspace_id = $1 AND external_id LIKE 'person-%' ORDER BY external_id",
    )
    .bind(&person.workspace_id)
    .fetch_all(&db)
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        person_rows,
        [("person-after".to_owned(), false), ("person-before".to_owned(), false)],
        "both of the person's conversions, erased"
    );
    assert_ne!(new, old, "a standby was promoted");
    assert!(report.unexpected.is_empty(), "statuses other than 2xx, 500 and 503: {report:?}");
    assert!(check.is_clean(), "acknowledged but not stored, stale, or under another id: {check:?}");
    assert!(reapplied > 0.0, "the promoted standby lacked acknowledged writes, which the rewind applied again");
    assert!(metrics.value("intake_writer_lineage_changes_total") >= 1.0);
    assert_eq!(metrics.value("intake_writer_rewind_lost_messages_total"), 0.0);
}
