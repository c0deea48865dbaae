//! The fault harness (`deploy/faults.sh` starts the infrastructure and runs this): 2 gateways,
//! 2 writers, a supervisor that restarts what dies (as systemd or Kubernetes would, including
//! a writer whose /healthz says it is stalled), mixed traffic from clients that record every
//! acknowledged item with the value acknowledged and re-send what got 5xx as a real client
//! would; one fault per scenario; then PostgreSQL is checked against the ledger. One JSON line
//! per scenario; exit 1 if anything acknowledged is missing or wrong, or writes do not come back.
//!
//! Environment (set by faults.sh): INTAKE_BIN_DIR, DATABASE_URL, INTAKE_KAFKA_BROKERS,
//! INTAKE_REDIS_URL, FAULTS_DIR (scratch), FAULTS_PG_DATA, FAULTS_REDIS_PORT, FAULTS_KAFKA_DIR,
//! FAULTS_KAFKA_BASE_PORT, FAULTS_LIB (deploy/lib.sh), FAULTS_PARTITION_USER (optional),
//! FAULTS_WRITERS_DATABASE_URL (optional: the writers' own, the HA layout's nodes).

use intake_tests::serde_json::{json, Value};
#[path = "faults/ha.rs"]
mod ha;

use intake_tests::{free_port, same_decimal};
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const DEADLINE: Duration = Duration::from_secs(10);
const RECOVERY_LIMIT: Duration = Duration::from_secs(30);
const WORKSPACES: usize = 4;
const CLIENTS: usize = 6;
const BATCH: usize = 20;

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set: run deploy/faults.sh"))
}

fn shell(script: &str) -> bool {
    Command::new("bash")
        .args(["-c", script])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

// ---------------------------------------------------------------------------------------------
// The supervisor

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Gateway,
    Writer,
}

struct Process {
    name: String,
    kind: Kind,
    args: Vec<String>,
    ops_url: String,
    /// Run as this user (a writer the partition scenario cuts off by its uid).
    user: Option<String>,
    child: Option<Child>,
}

impl Process {
    fn spawn(&mut self) {
        let dir = PathBuf::from(env("FAULTS_DIR"));
        let log = std::fs::OpenOptions::new().create(true).append(true).open(dir.join(format!("{}.log", self.name)));
        let log = log.unwrap_or_else(|e| panic!("log: {e}"));
        let binary = dir.join("bin").join(match self.kind {
            Kind::Gateway => "intake-gateway",
            Kind::Writer => "intake-writer",
        });
        let mut command = match &self.user {
            Some(user) => {
                let mut c = Command::new("runuser");
                c.args(["-u", user, "--"]).arg(&binary);
                c
            }
            None => Command::new(&binary),
        };
        // On the HA layout the writers reach the nodes themselves (deploy/faults.sh).
        if let (Kind::Writer, Ok(url)) = (&self.kind, std::env::var("FAULTS_WRITERS_DATABASE_URL")) {
            command.env("DATABASE_URL", url);
        }
        command
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap_or_else(|e| panic!("{e}")))
            .stderr(log);
        self.child = Some(command.spawn().unwrap_or_else(|e| panic!("starting {}: {e}", self.name)));
    }

    /// SIGKILL (through runuser's child when run as another user: kill the process group).
    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let pid = child.id();
            let _ = Command::new("pkill").args(["-KILL", "-P", &pid.to_string()]).status();
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn exited(&mut self) -> bool {
        match &mut self.child {
            Some(child) => matches!(child.try_wait(), Ok(Some(_))),
            None => true,
        }
    }
}

struct Supervisor {
    processes: Mutex<Vec<Process>>,
    /// While set, Kafka nodes that are down are left down (the all-brokers-stopped scenario).
    hold_kafka: AtomicBool,
    /// While set, writers that are down are left down (a restore from a backup).
    hold_writers: AtomicBool,
    /// Set with every process killed at the end: nothing is restarted after it (a process
    /// restarted then would outlive the harness).
    stopped: AtomicBool,
    restarts: Mutex<Vec<String>>,
    http: reqwest::Client,
}

impl Supervisor {
    /// Every quarter second: restart any process that exited, a writer whose /healthz says it
    /// is stalled, and any Kafka node that is down.
    async fn watch(self: Arc<Self>) {
        loop {
            tokio::time::sleep(Duration::from_millis(250)).await;
            let mut stalled = Vec::new();
            let writers: Vec<(usize, String)> = {
                let processes = self.lock();
                processes
                    .iter()
                    .enumerate()
                    .filter(|(_, p)| p.kind == Kind::Writer)
                    .map(|(i, p)| (i, p.ops_url.clone()))
                    .collect()
            };
            for (index, ops) in writers {
                if let Ok(response) =
                    self.http.get(format!("{ops}/healthz")).timeout(Duration::from_secs(1)).send().await
                {
                    if response.status().as_u16() == 503 {
                        stalled.push(index);
                    }
                }
            }
            {
                let mut processes = self.lock();
                if self.stopped.load(Ordering::Relaxed) {
                    return;
                }
                let hold_writers = self.hold_writers.load(Ordering::Relaxed);
                for (index, process) in processes.iter_mut().enumerate() {
                    if hold_writers && process.kind == Kind::Writer {
                        continue;
                    }
                    let is_stalled = stalled.contains(&index);
                    if process.exited() || is_stalled {
                        let why = if is_stalled { "stalled" } else { "exited" };
                        process.kill();
                        process.spawn();
                        self.restarts
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .push(format!("{} ({why})", process.name));
                    }
                }
            }
            if !self.hold_kafka.load(Ordering::Relaxed) && (1..=3).any(|node| !kafka_node_alive(node)) {
                let script = format!(
                    "source {} && start_kafka_cluster {} {}",
                    env("FAULTS_LIB"),
                    env("FAULTS_KAFKA_DIR"),
                    env("FAULTS_KAFKA_BASE_PORT")
                );
                let restarted = tokio::task::spawn_blocking(move || shell(&script)).await.unwrap_or(false);
                self.restarts.lock().unwrap_or_else(|p| p.into_inner()).push(format!("kafka (restarted: {restarted})"));
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Process>> {
        self.processes.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn kill(&self, name: &str) {
        if let Some(process) = self.lock().iter_mut().find(|p| p.name == name) {
            process.kill();
        }
    }

    /// Kills every process for good. Under the lock the watcher restarts under, so that it
    /// cannot restart one in between.
    fn stop_all(&self) {
        let mut processes = self.lock();
        self.stopped.store(true, Ordering::Relaxed);
        for process in processes.iter_mut() {
            process.kill();
        }
    }

    fn take_restarts(&self) -> Vec<String> {
        std::mem::take(&mut *self.restarts.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Every process answers /readyz with 200.
    async fn all_ready(&self) -> bool {
        let urls: Vec<String> = self.lock().iter().map(|p| p.ops_url.clone()).collect();
        for url in urls {
            let ready = self.http.get(format!("{url}/readyz")).timeout(Duration::from_secs(1)).send().await;
            if !ready.is_ok_and(|r| r.status().is_success()) {
                return false;
            }
        }
        true
    }
}

fn kafka_pid(node: u32) -> Option<String> {
    std::fs::read_to_string(PathBuf::from(env("FAULTS_KAFKA_DIR")).join("run").join(format!("kafka-{node}.pid"))).ok()
}

fn kafka_node_alive(node: u32) -> bool {
    kafka_pid(node).is_some_and(|pid| {
        Command::new("kill").args(["-0", pid.trim()]).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
    })
}

fn signal_kafka(node: u32, signal: &str) {
    if let Some(pid) = kafka_pid(node) {
        let _ = Command::new("kill").args([signal, pid.trim()]).status();
    }
}

// ---------------------------------------------------------------------------------------------
// Traffic and the ledger

#[derive(Clone)]
struct Key {
    workspace_id: String,
    bearer: String,
}

/// What the clients sent and what was acknowledged, per (workspace, external id).
#[derive(Default)]
struct Ledger {
    /// Every value sent for a pair, in order, and the index of the last acknowledged one.
    pairs: HashMap<(String, String), (Vec<String>, Option<usize>)>,
    /// Pairs sent together in one batch, linked as a chain: they must end in one chain.
    chains: Vec<(String, Vec<String>)>,
    requests: Vec<Outcome>,
}

struct Outcome {
    workspace: String,
    started: Instant,
    took: Duration,
    /// HTTP status, or 0 for a connection error.
    status: u16,
}

struct Traffic {
    keys: Vec<Key>,
    gateways: Vec<String>,
    http: reqwest::Client,
    ledger: Mutex<Ledger>,
    stop: AtomicBool,
}

impl Traffic {
    async fn client(self: Arc<Self>, seed: u64) {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut n = 0u64;
        while !self.stop.load(Ordering::Relaxed) {
            n += 1;
            let key = self.keys[rng.gen_range(0..self.keys.len())].clone();
            let value = format!("{}.{:02}", rng.gen_range(1..100_000), rng.gen_range(0..100));
            let (path, body, pairs) = if n.is_multiple_of(4) {
                let prefix = format!("c{seed}-{n}-{}", rng.gen::<u32>());
                let items: Vec<Value> = (0..BATCH)
                    .map(|i| {
                        let mut item = item(&format!("{prefix}-{i}"), &value);
                        if i > 0 {
                            item["parent_external_id"] = json!(format!("{prefix}-{}", i - 1));
                        }
                        item
                    })
                    .collect();
                let ids: Vec<String> = (0..BATCH).map(|i| format!("{prefix}-{i}")).collect();
                self.lock().chains.push((key.workspace_id.clone(), ids.clone()));
                ("/v1/conversions/batch", json!({ "conversions": items }), ids)
            } else {
                // Half the singles re-send an earlier pair with a new value (an update).
                let id = if n.is_multiple_of(2) && n > 4 {
                    format!("s{seed}-{}", rng.gen_range(1..n))
                } else {
                    format!("s{seed}-{n}")
                };
                (("/v1/conversions"), item(&id, &value), vec![id])
            };
            let indexes: Vec<usize> = {
                let mut ledger = self.lock();
                pairs
                    .iter()
                    .map(|id| {
                        let entry = ledger.pairs.entry((key.workspace_id.clone(), id.clone())).or_default();
                        entry.0.push(value.clone());
                        entry.0.len() - 1
                    })
                    .collect()
            };
            self.send_until_answered(&key, path, &body, &pairs, &indexes, &mut rng).await;
        }
    }

    /// Sends, and re-sends on 5xx or a connection error (to the next gateway), honouring
    /// Retry-After, until the request is answered or the traffic stops.
    async fn send_until_answered(
        &self,
        key: &Key,
        path: &str,
        body: &Value,
        pairs: &[String],
        indexes: &[usize],
        rng: &mut rand::rngs::StdRng,
    ) {
        let mut gateway = rng.gen_range(0..self.gateways.len());
        loop {
            let started = Instant::now();
            let sent = self
                .http
                .post(format!("{}{path}", self.gateways[gateway]))
                .header("Authorization", &key.bearer)
                .json(body)
                .timeout(DEADLINE * 3)
                .send()
                .await;
            let (status, retry_after, reply) = match sent {
                Ok(response) => {
                    let status = response.status().as_u16();
                    let retry_after = response
                        .headers()
                        .get("retry-after")
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.parse::<u64>().ok());
                    (status, retry_after, response.json::<Value>().await.unwrap_or(Value::Null))
                }
                Err(_) => (0, None, Value::Null),
            };
            self.lock().requests.push(Outcome {
                workspace: key.workspace_id.clone(),
                started,
                took: started.elapsed(),
                status,
            });
            if (200..300).contains(&status) {
                let acknowledged: Vec<bool> = match reply.get("results").and_then(Value::as_array) {
                    Some(results) => results.iter().map(|r| r["ok"] == json!(true)).collect(),
                    None => vec![true],
                };
                let mut ledger = self.lock();
                for ((id, index), ok) in pairs.iter().zip(indexes).zip(acknowledged) {
                    if ok {
                        let entry = ledger.pairs.entry((key.workspace_id.clone(), id.clone())).or_default();
                        entry.1 = Some(entry.1.map_or(*index, |last| last.max(*index)));
                    }
                }
                return;
            }
            if self.stop.load(Ordering::Relaxed) || ((400..500).contains(&status) && status != 429) {
                return;
            }
            let wait = retry_after.map_or(Duration::from_millis(200), Duration::from_secs);
            tokio::time::sleep(wait.min(Duration::from_secs(5))).await;
            gateway = (gateway + 1) % self.gateways.len();
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits until every workspace has had `count` requests sent at or after `since` answered
    /// 2xx, for at most `patience`; whether they were.
    async fn wait_acknowledged(&self, since: Instant, count: usize, patience: Duration) -> bool {
        let deadline = Instant::now() + patience;
        loop {
            let done = {
                let ledger = self.lock();
                self.keys.iter().all(|key| {
                    let ok = |r: &&Outcome| {
                        r.workspace == key.workspace_id && r.started >= since && (200..300).contains(&r.status)
                    };
                    ledger.requests.iter().filter(ok).count() >= count
                })
            };
            if done || Instant::now() > deadline {
                return done;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

fn item(external_id: &str, value: &str) -> Value {
    json!({
        "event": "purchase", "external_id": external_id, "occurred_at": intake_tests::now_ms() - 1000,
        "email": format!("{external_id}@example.com"), "value": value, "currency": "EUR",
    })
}

// ---------------------------------------------------------------------------------------------
// Scenarios

#[derive(Clone, Copy, Debug)]
enum Fault {
    WriterKill,
    GatewayKill,
    BrokerLeaderKill,
    BrokersStop,
    PostgresStop,
    RedisStop,
    WriterPartition,
    /// PostgreSQL restored from a backup taken before some writes were acknowledged, then the
    /// requests topic replayed (deploy/RUNBOOK.md).
    RestoreReplay,
    /// A fault of the database's HA layout (faults.sh --ha).
    Ha(ha::Fault),
}

impl Fault {
    fn name(self) -> &'static str {
        match self {
            Fault::WriterKill => "writer_kill",
            Fault::GatewayKill => "gateway_kill",
            Fault::BrokerLeaderKill => "broker_leader_kill",
            Fault::BrokersStop => "brokers_stop",
            Fault::PostgresStop => "postgres_stop",
            Fault::RedisStop => "redis_stop",
            Fault::WriterPartition => "writer_partition",
            Fault::RestoreReplay => "restore_replay",
            Fault::Ha(fault) => fault.name(),
        }
    }

    fn parse(name: &str) -> Option<Fault> {
        ALL.iter().copied().find(|f| f.name() == name).or_else(|| ha::Fault::parse(name).map(Fault::Ha))
    }
}

const ALL: [Fault; 8] = [
    Fault::WriterKill,
    Fault::GatewayKill,
    Fault::BrokerLeaderKill,
    Fault::BrokersStop,
    Fault::PostgresStop,
    Fault::RedisStop,
    Fault::WriterPartition,
    Fault::RestoreReplay,
];

struct Harness {
    /// What `intake-writer replay` printed in the restore scenario.
    replayed: Mutex<Option<Value>>,
    /// The pair whose email an erasure after the backup cleared: it must stay cleared.
    erased: Mutex<Option<(String, String)>>,
    supervisor: Arc<Supervisor>,
    traffic: Arc<Traffic>,
    outage: Duration,
    requests_topic: String,
    /// The HA layout, under faults.sh --ha, and the fault injected in it, until it is settled.
    ha: Option<ha::Layout>,
    ha_injected: Mutex<Option<ha::Injected>>,
}

impl Harness {
    /// Injects the fault; returns when the fault is over (the process killed, or the outage
    /// lifted), which is when recovery is measured from.
    async fn inject(&self, fault: Fault) -> Instant {
        let pg = || {
            format!(
                "runuser -u postgres -- $(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n1)/pg_ctl -D {}",
                env("FAULTS_PG_DATA")
            )
        };
        match fault {
            Fault::WriterKill => self.supervisor.kill("writer-0"),
            Fault::GatewayKill => self.supervisor.kill("gateway-0"),
            Fault::BrokerLeaderKill => {
                let leader = leader_of(&self.requests_topic, 0);
                signal_kafka(u32::try_from(leader).unwrap_or(1), "-KILL");
            }
            Fault::BrokersStop => {
                self.supervisor.hold_kafka.store(true, Ordering::Relaxed);
                for node in 1..=3 {
                    signal_kafka(node, "-TERM");
                }
                tokio::time::sleep(self.outage).await;
                // "Started again" is part of the fault; recovery is measured from there.
                let script = format!(
                    "source {} && start_kafka_cluster {} {}",
                    env("FAULTS_LIB"),
                    env("FAULTS_KAFKA_DIR"),
                    env("FAULTS_KAFKA_BASE_PORT")
                );
                tokio::task::spawn_blocking(move || shell(&script)).await.unwrap_or(false);
                self.supervisor.hold_kafka.store(false, Ordering::Relaxed);
            }
            Fault::PostgresStop => {
                shell(&format!("{} -m immediate stop", pg()));
                tokio::time::sleep(self.outage).await;
                let start = format!(
                    "{} -w -l {}/logs/postgres.log -o \"-c listen_addresses=127.0.0.1 -p {} -k /tmp\" start",
                    pg(),
                    env("FAULTS_DIR"),
                    env("FAULTS_PG_PORT")
                );
                shell(&start);
            }
            Fault::RedisStop => {
                shell(&format!("redis-cli -p {} shutdown nosave", env("FAULTS_REDIS_PORT")));
                tokio::time::sleep(self.outage).await;
                shell(&format!(
                    "redis-server --bind 127.0.0.1 --port {0} --daemonize yes --save '' --appendonly no --dir {1} --logfile {1}/redis.log",
                    env("FAULTS_REDIS_PORT"),
                    env("FAULTS_DIR")
                ));
            }
            Fault::WriterPartition => {
                let user = env("FAULTS_PARTITION_USER");
                let base: u16 = env("FAULTS_KAFKA_BASE_PORT").parse().unwrap_or(0);
                let rule =
                    format!("OUTPUT -o lo -p tcp -m owner --uid-owner {user} --dport {}:{} -j DROP", base, base + 12);
                shell(&format!("iptables -I {rule}"));
                tokio::time::sleep(self.outage + Duration::from_secs(5)).await;
                shell(&format!("iptables -D {rule}"));
            }
            Fault::RestoreReplay => self.restore_and_replay().await,
            Fault::Ha(fault) => {
                let layout = self.ha.as_ref().unwrap_or_else(|| panic!("{}: run deploy/faults.sh --ha", fault.name()));
                let injected = layout.inject(fault).await;
                let at = ha::Layout::at(&injected);
                *self.ha_injected.lock().unwrap_or_else(|p| p.into_inner()) = Some(injected);
                return at;
            }
        }
        Instant::now()
    }

    /// The runbook's restore: a backup, writes acknowledged after it, an erasure after it; then
    /// writers stopped, what the restore undoes exported, the backup restored, the export
    /// applied (the erasure among it), the requests topic replayed from before the backup,
    /// writers started. On the HA layout the
    /// "backup" is a point in time: the whole cluster is restored to it from pgBackRest's base
    /// backup and WAL archive (deploy/ha.sh ha_restore_cluster), as the runbook does.
    async fn restore_and_replay(&self) {
        let dir = env("FAULTS_DIR");
        let url = env("DATABASE_URL");
        let restore_to = time::OffsetDateTime::now_utc();
        let backup_at = restore_to - time::Duration::seconds(30);
        if self.ha.is_none() {
            assert!(shell(&format!("pg_dump -Fc -d {url} -f {dir}/backup.dump")), "pg_dump");
        }
        tokio::time::sleep(self.outage).await;
        // An erasure after the backup, of one acknowledged item's email (the identifier on stdin).
        // A pair of a batch: batches are never sent again once acknowledged (singles may be).
        let erased = self
            .traffic
            .lock()
            .pairs
            .iter()
            .find(|((_, id), (_, last))| id.starts_with('c') && last.is_some())
            .map(|((ws, id), _)| (ws.clone(), id.clone()));
        let writer = format!("{dir}/bin/intake-writer");
        let erase = |(ws, id): &(String, String)| {
            shell(&format!("echo '{id}@example.com' | {writer} erase --workspace {ws} --email"))
        };
        if let Some(target) = &erased {
            assert!(erase(target), "erase");
        }
        self.supervisor.hold_writers.store(true, Ordering::Relaxed);
        self.supervisor.kill("writer-0");
        self.supervisor.kill("writer-1");
        let export = format!("{dir}/restore-export-{}.json", ulid::Ulid::new());
        assert!(shell(&format!("{writer} restore export --to {export} > /dev/null")), "restore export");
        if let Some(layout) = &self.ha {
            if let Err(error) = layout.restore_to(restore_to).await {
                panic!("the HA layout's restore: {error}");
            }
        } else {
            let database = url.rsplit('/').next().unwrap_or_default().to_owned();
            let admin = url.replace(&format!("/{database}"), "/postgres");
            assert!(shell(&format!("psql {admin} -qc 'DROP DATABASE {database} WITH (FORCE)' && psql {admin} -qc 'CREATE DATABASE {database}'")), "drop");
            assert!(shell(&format!("pg_restore -d {url} {dir}/backup.dump")), "pg_restore");
        }
        assert!(shell(&format!("{writer} restore apply --from {export} > /dev/null")), "restore apply");
        let from = backup_at.format(&time::format_description::well_known::Rfc3339).unwrap_or_default();
        assert!(shell(&format!("{writer} replay --from-time {from} > {dir}/replay.json")), "replay");
        let replayed = std::fs::read_to_string(format!("{dir}/replay.json")).unwrap_or_default();
        *self.replayed.lock().unwrap_or_else(|p| p.into_inner()) = intake_tests::serde_json::from_str(&replayed).ok();
        if let Some(target) = &erased {
            *self.erased.lock().unwrap_or_else(|p| p.into_inner()) = Some(target.clone());
        }
        self.supervisor.hold_writers.store(false, Ordering::Relaxed);
    }

    async fn run(&self, fault: Fault, seed: u64) -> Value {
        self.supervisor.take_restarts();
        let fault_started = Instant::now();
        let clients: Vec<_> =
            (0..CLIENTS as u64).map(|c| tokio::spawn(self.traffic.clone().client(seed * 100 + c))).collect();
        // Traffic flows on every workspace before the fault: polled, not a fixed time.
        self.traffic.wait_acknowledged(fault_started, 1, RECOVERY_LIMIT).await;
        let fault_at = Instant::now();
        let over = self.inject(fault).await;
        // Let traffic run until writes succeed again on every workspace (each on its own
        // partition of the requests topic), or the limit passes.
        let mut recovered = None;
        while over.elapsed() < RECOVERY_LIMIT + Duration::from_secs(5) {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let ledger = self.traffic.lock();
            let firsts: Vec<Option<Instant>> = self
                .traffic
                .keys
                .iter()
                .map(|key| {
                    let ok = |r: &&Outcome| {
                        r.workspace == key.workspace_id && r.started >= over && (200..300).contains(&r.status)
                    };
                    ledger.requests.iter().filter(ok).map(|r| r.started + r.took).min()
                })
                .collect();
            if let Some(last) = firsts.into_iter().collect::<Option<Vec<_>>>().and_then(|all| all.into_iter().max()) {
                recovered = Some(last.saturating_duration_since(over));
                break;
            }
        }
        // Writes go on after the recovery: two more answered on every workspace.
        if let Some(recovered) = recovered {
            self.traffic.wait_acknowledged(over + recovered, 2, Duration::from_secs(10)).await;
        }
        // An HA fault ends under traffic: what was killed or cut comes back and rejoins.
        let injected = self.ha_injected.lock().unwrap_or_else(|p| p.into_inner()).take();
        let ha = match (&self.ha, injected) {
            (Some(layout), Some(injected)) => layout.settle(injected).await,
            _ => Value::Null,
        };
        self.traffic.stop.store(true, Ordering::Relaxed);
        for client in clients {
            let _ = client.await;
        }
        self.traffic.stop.store(false, Ordering::Relaxed);
        let mut ready = false;
        for _ in 0..300 {
            if self.supervisor.all_ready().await {
                ready = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let mut check = check_database(&self.traffic).await;
        let erased = self.erased.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some((workspace, id)) = erased {
            check.erasures_undone = usize::from(!email_cleared(&workspace, &id).await);
        }
        // After a restore and its replay: what the writers told, chunk by chunk, is what the
        // database recorded (ids, chains and results from the message, wherever applied).
        let told = match fault {
            Fault::RestoreReplay => Some(told_check().await),
            _ => None,
        };
        let ledger = self.traffic.lock();
        let during: Vec<&Outcome> = ledger.requests.iter().filter(|r| r.started >= fault_started).collect();
        let acknowledged = ledger.pairs.values().filter(|(_, last)| last.is_some()).count();
        let unexpected: Vec<u16> =
            during.iter().map(|r| r.status).filter(|s| !matches!(s, 200..=299 | 500 | 503 | 429)).collect();
        let connection_errors = unexpected.iter().filter(|s| **s == 0).count();
        let longest = during.iter().map(|r| r.took).max().unwrap_or_default();
        let mut took: Vec<Duration> = during.iter().map(|r| r.took).collect();
        took.sort();
        let p99 = took.get(took.len().saturating_sub(1) * 99 / 100).copied().unwrap_or_default();
        let replayed = self.replayed.lock().unwrap_or_else(|p| p.into_inner()).take();
        json!({
            "scenario": fault.name(),
            "replay": replayed,
            "told": told,
            "fault_at_s": fault_at.duration_since(fault_started).as_secs_f64(),
            "acknowledged": acknowledged,
            "missing": check.missing,
            "wrong": check.wrong,
            "duplicated": check.duplicated,
            "split_chains": check.split_chains,
            "erasures_undone": check.erasures_undone,
            "requests": during.len(),
            "5xx": during.iter().filter(|r| r.status >= 500).count(),
            "connection_errors": connection_errors,
            "other_statuses": unexpected.iter().filter(|s| **s != 0).collect::<Vec<_>>(),
            "longest_request_ms": longest.as_millis(),
            "p99_ms": p99.as_millis(),
            "writes_back_after_s": recovered.map(|r| r.as_secs_f64()),
            "all_ready": ready,
            "restarts": self.supervisor.take_restarts(),
            "scenario_s": fault_started.elapsed().as_secs_f64(),
            "ha": ha,
        })
    }
}

fn leader_of(topic: &str, partition: i32) -> i32 {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let consumer: BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", env("INTAKE_KAFKA_BROKERS"))
        .create()
        .unwrap_or_else(|e| panic!("{e}"));
    consumer
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .ok()
        .and_then(|m| {
            m.topics().first().and_then(|t| t.partitions().iter().find(|p| p.id() == partition).map(|p| p.leader()))
        })
        .unwrap_or(1)
}

#[derive(Default)]
struct Check {
    missing: usize,
    wrong: usize,
    duplicated: usize,
    split_chains: usize,
    erasures_undone: usize,
}

/// The email hash of a conversion is still cleared (or it was sent again since: then it is new
/// data, stored again as docs/api.md, "Erasure" says; the harness's clients never re-send an erased pair's email
/// after the erasure within the check, so a hash here means the erasure was undone).
async fn email_cleared(workspace: &str, external_id: &str) -> bool {
    let db = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&env("DATABASE_URL"))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let hash: Option<Option<String>> = sqlx::query_scalar(concat!(
        "SELECT encode(email_digest, 'hex') FROM conversions WHERE ",
        intake_model::in_workspace!(),
        " AND external_id = $2"
    ))
    .bind(workspace)
    .bind(external_id)
    .fetch_optional(&db)
    .await
    .unwrap_or_default();
    hash.flatten().is_none()
}

/// Every acknowledged pair is stored with the value last acknowledged or a later one sent; no
/// pair is stored twice; every batch's chain is one chain. Waits up to 60 s for what is still in
/// flight (writes answered 500 are applied later).
/// Every applied chunk the replies topic holds against the database's record of it.
async fn told_check() -> intake_tests::ToldCheck {
    let topic = std::env::var("INTAKE_REPLIES_TOPIC").unwrap_or_else(|_| "intake.replies".to_owned());
    let told = tokio::task::spawn_blocking(move || intake_tests::replies_told(&topic)).await.unwrap_or_default();
    let db = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&env("DATABASE_URL"))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    intake_tests::check_told(&db, &told).await
}

async fn check_database(traffic: &Traffic) -> Check {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let check = check_database_once(traffic).await;
        if (check.missing == 0 && check.wrong == 0) || Instant::now() > deadline {
            return check;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

async fn check_database_once(traffic: &Traffic) -> Check {
    let db = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(&env("DATABASE_URL"))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    {
        let rows: Vec<(String, String, Option<String>, String)> =
            sqlx::query_as("SELECT workspace_id, external_id, value::text, chain_id FROM conversions")
                .fetch_all(&db)
                .await
                .unwrap_or_default();
        // (workspace, external id) → every stored (value, chain) of it: more than one is a duplicate.
        type Stored = HashMap<(String, String), Vec<(Option<String>, String)>>;
        let mut stored: Stored = HashMap::new();
        for (workspace, external_id, value, chain) in rows {
            stored.entry((workspace, external_id)).or_default().push((value, chain));
        }
        let mut check = Check::default();
        let ledger = traffic.lock();
        for (pair, (values, last)) in &ledger.pairs {
            let Some(last) = last else { continue };
            match stored.get(pair).map(Vec::as_slice) {
                None | Some([]) => check.missing += 1,
                Some([(value, _)]) => {
                    let acceptable = &values[*last..];
                    if !value.as_deref().is_some_and(|v| acceptable.iter().any(|a| same_decimal(a, v))) {
                        check.wrong += 1;
                    }
                }
                Some(_) => check.duplicated += 1,
            }
        }
        for (workspace, ids) in &ledger.chains {
            let chains: std::collections::BTreeSet<&String> = ids
                .iter()
                .filter_map(|id| {
                    stored.get(&(workspace.clone(), id.clone())).and_then(|rows| rows.first()).map(|(_, chain)| chain)
                })
                .collect();
            if chains.len() > 1 {
                check.split_chains += 1;
            }
        }
        drop(ledger);
        check
    }
}

// ---------------------------------------------------------------------------------------------

async fn setup(http: &reqwest::Client) -> (Arc<Supervisor>, Vec<Key>, String) {
    let dir = PathBuf::from(env("FAULTS_DIR"));
    let bin_dir = dir.join("bin");
    let writer_bin = bin_dir.join("intake-writer");
    let run = |args: &[&str]| -> Value {
        let output = Command::new(&writer_bin).args(args).output().unwrap_or_else(|e| panic!("{e}"));
        assert!(output.status.success(), "intake-writer {args:?}: {}", String::from_utf8_lossy(&output.stderr));
        intake_tests::serde_json::from_slice(&output.stdout).unwrap_or(Value::Null)
    };
    run(&["migrate", "--contract"]);
    run(&["topics", "--request-partitions", "4", "--reply-partitions", "2", "--replication", "3"]);
    let keys: Vec<Key> = (0..WORKSPACES)
        .map(|i| {
            let workspace = run(&["workspace", "create", "--name", &format!("faults {i}")]);
            let id = workspace["id"].as_str().unwrap_or_default().to_owned();
            let key = run(&["key", "create", "--workspace", &id]);
            Key { workspace_id: id, bearer: format!("Bearer {}", key["secret"].as_str().unwrap_or_default()) }
        })
        .collect();
    let mut processes = Vec::new();
    let mut gateways = Vec::new();
    for i in 0..2 {
        let (port, ops) = (free_port(), free_port());
        gateways.push(format!("http://127.0.0.1:{port}"));
        processes.push(Process {
            name: format!("gateway-{i}"),
            kind: Kind::Gateway,
            args: [
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--ops-listen",
                &format!("127.0.0.1:{ops}"),
                "--reply-partition",
                &i.to_string(),
                "--requests-per-minute",
                "10000000",
                "--conversions-per-minute",
                "100000000",
            ]
            .map(str::to_owned)
            .to_vec(),
            ops_url: format!("http://127.0.0.1:{ops}"),
            user: None,
            child: None,
        });
    }
    for i in 0..2 {
        let ops = free_port();
        processes.push(Process {
            name: format!("writer-{i}"),
            kind: Kind::Writer,
            args: ["run", "--ops-listen", &format!("127.0.0.1:{ops}"), "--stall-timeout-ms", "8000"]
                .map(str::to_owned)
                .to_vec(),
            ops_url: format!("http://127.0.0.1:{ops}"),
            // The second writer runs as its own user, so that the partition scenario can cut
            // exactly its traffic to the brokers.
            user: if i == 1 { std::env::var("FAULTS_PARTITION_USER").ok() } else { None },
            child: None,
        });
    }
    for process in &mut processes {
        process.spawn();
    }
    let supervisor = Arc::new(Supervisor {
        processes: Mutex::new(processes),
        hold_kafka: AtomicBool::new(false),
        hold_writers: AtomicBool::new(false),
        stopped: AtomicBool::new(false),
        restarts: Mutex::default(),
        http: http.clone(),
    });
    for _ in 0..600 {
        if supervisor.all_ready().await {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    (supervisor, keys, gateways.join(","))
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let seed: u64 = args.iter().find_map(|a| a.strip_prefix("--seed=")).and_then(|s| s.parse().ok()).unwrap_or(1);
    let outage = Duration::from_secs(
        args.iter().find_map(|a| a.strip_prefix("--outage-s=")).and_then(|s| s.parse().ok()).unwrap_or(15),
    );
    let scenarios: Vec<Fault> = match args.iter().find_map(|a| a.strip_prefix("--scenarios=")) {
        Some(list) => list
            .split(',')
            .map(|name| Fault::parse(name).unwrap_or_else(|| panic!("unknown scenario {name}")))
            .collect(),
        // Under faults.sh --ha, the faults of the database's HA layout.
        None if ha::Layout::from_env().is_some() => {
            ha::ALL.iter().copied().map(Fault::Ha).chain([Fault::RestoreReplay]).collect()
        }
        None => ALL.to_vec(),
    };
    let http = reqwest::Client::builder().pool_max_idle_per_host(0).build().unwrap_or_default();
    let (supervisor, keys, gateways) = setup(&http).await;
    tokio::spawn(supervisor.clone().watch());
    let traffic = Arc::new(Traffic {
        keys,
        gateways: gateways.split(',').map(str::to_owned).collect(),
        http: http.clone(),
        ledger: Mutex::default(),
        stop: AtomicBool::new(false),
    });
    let harness = Harness {
        replayed: Mutex::default(),
        erased: Mutex::default(),
        supervisor: supervisor.clone(),
        traffic,
        outage,
        requests_topic: "intake.requests".to_owned(),
        ha: ha::Layout::from_env(),
        ha_injected: Mutex::default(),
    };
    let mut failed = false;
    for (n, fault) in scenarios.into_iter().enumerate() {
        let line = harness.run(fault, seed + n as u64).await;
        let ok = line["missing"] == json!(0)
            && line["wrong"] == json!(0)
            && line["duplicated"] == json!(0)
            && line["split_chains"] == json!(0)
            && line["erasures_undone"] == json!(0)
            && (line["told"].is_null()
                || (line["told"]["missing"].as_array().is_some_and(Vec::is_empty)
                    && line["told"]["differing"].as_array().is_some_and(Vec::is_empty)))
            && line["all_ready"] == json!(true)
            && line["writes_back_after_s"].as_f64().is_some_and(|s| s <= RECOVERY_LIMIT.as_secs_f64())
            && line["other_statuses"].as_array().is_some_and(Vec::is_empty)
            && line["longest_request_ms"]
                .as_u64()
                .is_some_and(|ms| ms <= (DEADLINE + Duration::from_secs(3)).as_millis() as u64)
            && (matches!(fault, Fault::GatewayKill) || line["connection_errors"] == json!(0))
            && ha_ok(fault, &line);
        failed |= !ok;
        println!("{}", json!({ "ok": ok, "result": line }));
    }
    if args.iter().any(|a| a == "--self-check") {
        failed |= !self_check(&harness.traffic).await;
    }
    supervisor.stop_all();
    std::process::exit(i32::from(failed));
}

/// The rules of an HA fault beyond the ledger's: its own (a new leader, no write taken by two
/// primaries, the layout whole again), no refused write where the primary stays or moves by
/// plan, and a switchover's latency (p99 under 3 s, no write over 8 s).
fn ha_ok(fault: Fault, line: &Value) -> bool {
    let Fault::Ha(fault) = fault else { return true };
    let below = |field: &str, ms: u64| line[field].as_u64().is_some_and(|v| v < ms);
    line["ha"]["ok"] == json!(true)
        && (!fault.refuses_nothing() || line["5xx"] == json!(0))
        && (fault != ha::Fault::Switchover || (below("p99_ms", 3_000) && below("longest_request_ms", 8_000)))
}

/// The checker must notice a loss: one acknowledged conversion is deleted behind the service's
/// back, and the check must report exactly it as missing.
async fn self_check(traffic: &Traffic) -> bool {
    let victim = traffic.lock().pairs.iter().find(|(_, (_, last))| last.is_some()).map(|(pair, _)| pair.clone());
    let Some((workspace, external_id)) = victim else { return false };
    let db = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&env("DATABASE_URL"))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let deleted = sqlx::query(concat!(
        "WITH gone AS (DELETE FROM conversions WHERE ",
        intake_model::in_workspace!(),
        " AND external_id = $2 RETURNING id)
         DELETE FROM conversion_matches WHERE conversion_id IN (SELECT id FROM gone)"
    ))
    .bind(&workspace)
    .bind(&external_id)
    .execute(&db)
    .await;
    let check = check_database_once(traffic).await;
    let ok = deleted.is_ok() && check.missing == 1;
    println!("{}", json!({ "ok": ok, "self_check": { "deleted": 1, "missing_found": check.missing } }));
    ok
}
