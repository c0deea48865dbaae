//! The long database outage (`deploy/faults.sh --long-outage`, on the fault harness's private
//! PostgreSQL and three-node Kafka cluster): 3 gateways and one writer, `--workspaces` (120)
//! workspaces, `--clients` (32) clients sending 500-item batches to the workspaces and gateways
//! in turn and honouring Retry-After up to 1 s. PostgreSQL is stopped for `--outage-s` (300)
//! and started again while the load goes on.
//!
//! Measured: the writer's RSS idle (before any load) and at its peak, each gateway's peak RSS,
//! the seconds from PostgreSQL's return until every workspace wrote again (a single conversion
//! per workspace, sent after the return, acknowledged), and the drain: the backlog Kafka kept,
//! the messages and items the writer answered from the return until its lag was down to the
//! load's own, and their rates. Prints one JSON line; exits 1 if anything acknowledged is
//! missing, the writer's RSS went past its idle size + 128 MiB, the writer left its group, or a
//! workspace did not write again within 60 s.
//!
//! Environment (set by faults.sh): INTAKE_BIN_DIR, DATABASE_URL, INTAKE_KAFKA_BROKERS,
//! INTAKE_REDIS_URL, FAULTS_DIR, FAULTS_PG_DATA, FAULTS_PG_PORT.

use intake_tests::serde_json::{json, Value};
use intake_tests::{free_port, now_ms, Metrics};
use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const GATEWAYS: usize = 3;
const BATCH: usize = 500;
/// What the writer may add to its idle RSS through the outage.
const RSS_ALLOWANCE_MIB: f64 = 128.0;
const RECOVERY_LIMIT: Duration = Duration::from_secs(60);

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set: run deploy/faults.sh --long-outage"))
}

fn arg(args: &[String], name: &str, default: u64) -> u64 {
    let prefix = format!("--{name}=");
    args.iter().find_map(|a| a.strip_prefix(&prefix)).map_or(default, |v| v.parse().unwrap_or(default))
}

fn rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kib = status.lines().find_map(|l| l.strip_prefix("VmRSS:")).and_then(|r| r.split_whitespace().next());
    kib.and_then(|k| k.parse::<f64>().ok()).unwrap_or(0.0) / 1024.0
}

fn pg_ctl(action: &str) -> bool {
    let pg_ctl = format!(
        "runuser -u postgres -- $(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n1)/pg_ctl -D {}",
        env("FAULTS_PG_DATA")
    );
    let script = match action {
        "stop" => format!("{pg_ctl} -m immediate stop"),
        _ => format!(
            "{pg_ctl} -w -l {}/logs/postgres.log -o \"-c listen_addresses=127.0.0.1 -p {} -k /tmp\" start",
            env("FAULTS_DIR"),
            env("FAULTS_PG_PORT")
        ),
    };
    Command::new("bash")
        .args(["-c", &script])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn writer_command(args: &[&str]) -> Value {
    let bin = PathBuf::from(env("INTAKE_BIN_DIR")).join("intake-writer");
    let output = Command::new(bin).args(args).output().unwrap_or_else(|e| panic!("{e}"));
    assert!(output.status.success(), "intake-writer {args:?}: {}", String::from_utf8_lossy(&output.stderr));
    intake_tests::serde_json::from_slice(&output.stdout).unwrap_or(Value::Null)
}

struct Key {
    workspace_id: String,
    bearer: String,
}

/// A workspace and a key of it, by the operator commands.
fn create_key(n: usize) -> Key {
    let workspace = writer_command(&["workspace", "create", "--name", &format!("outage {n}")]);
    let workspace_id = workspace["id"].as_str().unwrap_or_default().to_owned();
    let key = writer_command(&["key", "create", "--workspace", &workspace_id]);
    Key { workspace_id, bearer: format!("Bearer {}", key["secret"].as_str().unwrap_or_default()) }
}

struct Service {
    child: Child,
    ops_url: String,
}

fn spawn(name: &str, program: &str, args: &[String]) -> Service {
    let log = std::fs::File::create(PathBuf::from(env("FAULTS_DIR")).join(format!("{name}.log")))
        .unwrap_or_else(|e| panic!("{e}"));
    let ops = args.iter().position(|a| a == "--ops-listen").map(|i| args[i + 1].clone()).unwrap_or_default();
    let child = Command::new(PathBuf::from(env("INTAKE_BIN_DIR")).join(program))
        .args(args)
        .stdout(log.try_clone().unwrap_or_else(|e| panic!("{e}")))
        .stderr(log)
        .spawn()
        .unwrap_or_else(|e| panic!("{program}: {e}"));
    Service { child, ops_url: format!("http://{ops}") }
}

/// What the clients saw.
#[derive(Default)]
struct Ledger {
    /// Acknowledged external ids, per workspace.
    acknowledged: Vec<Vec<String>>,
    statuses: HashMap<u16, usize>,
}

struct Load {
    keys: Vec<Key>,
    gateways: Vec<String>,
    http: reqwest::Client,
    next: AtomicUsize,
    ledger: Mutex<Ledger>,
    stop: AtomicBool,
}

impl Load {
    fn lock(&self) -> std::sync::MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(|e| e.into_inner())
    }

    async fn client(self: Arc<Self>, client: usize) {
        let mut n = 0usize;
        while !self.stop.load(Ordering::Relaxed) {
            n += 1;
            let turn = self.next.fetch_add(1, Ordering::Relaxed);
            let (workspace, gateway) = (turn % self.keys.len(), turn % self.gateways.len());
            let ids: Vec<String> = (0..BATCH).map(|i| format!("c{client}-{n}-{i}")).collect();
            let items: Vec<Value> = ids
                .iter()
                .map(|id| {
                    json!({
                        "event": "purchase", "external_id": id, "occurred_at": now_ms() - 1000,
                        "email": format!("{id}@example.com"), "value": "19.90", "currency": "EUR",
                    })
                })
                .collect();
            let response = self
                .http
                .post(format!("{}/v1/conversions/batch", self.gateways[gateway]))
                .header("Authorization", &self.keys[workspace].bearer)
                .json(&json!({ "conversions": items }))
                .timeout(Duration::from_secs(30))
                .send()
                .await;
            let (status, retry_after, body) = match response {
                Ok(response) => {
                    let status = response.status().as_u16();
                    let retry_after = retry_after(&response);
                    (status, retry_after, response.json::<Value>().await.unwrap_or(Value::Null))
                }
                Err(_) => (0, None, Value::Null),
            };
            {
                let mut ledger = self.lock();
                *ledger.statuses.entry(status).or_default() += 1;
                if status == 200 {
                    let results = body["results"].as_array().cloned().unwrap_or_default();
                    let ok: Vec<String> = ids
                        .into_iter()
                        .zip(&results)
                        .filter(|(_, r)| r["ok"] == json!(true))
                        .map(|(id, _)| id)
                        .collect();
                    ledger.acknowledged[workspace].extend(ok);
                }
            }
            if let Some(seconds) = retry_after {
                tokio::time::sleep(Duration::from_secs(seconds).min(Duration::from_secs(1))).await;
            }
        }
    }
}

fn retry_after(response: &reqwest::Response) -> Option<u64> {
    response.headers().get("retry-after").and_then(|v| v.to_str().ok()).and_then(|v| v.parse().ok())
}

/// An authenticated read through every gateway with every key, so that each gateway's key cache
/// has each key's answer.
async fn prime_keys(http: &reqwest::Client, gateways: &[String], keys: &[Key]) {
    let mut pending = Vec::new();
    for (n, (gateway, key)) in gateways.iter().flat_map(|g| keys.iter().map(move |k| (g, k))).enumerate() {
        let request = http.get(format!("{gateway}/v1/workspace")).header("Authorization", &key.bearer).send();
        pending.push(request);
        if pending.len() == 32 || n + 1 == gateways.len() * keys.len() {
            for request in pending.drain(..) {
                let status = request.await.map(|r| r.status().as_u16()).unwrap_or(0);
                assert_eq!(status, 200, "priming the key caches");
            }
        }
    }
}

/// After PostgreSQL's return, one single conversion per workspace (256 workspaces at a time,
/// through the gateways in turn), sent again until it is acknowledged: returns once every
/// workspace wrote again. The load's own batches go on meanwhile; it would take them longer than
/// the drain to come round to every one of many workspaces, and fewer probers would measure
/// their own queue.
async fn probe_every_workspace(http: reqwest::Client, gateways: Vec<String>, bearers: Vec<String>) {
    let next = Arc::new(AtomicUsize::new(0));
    let probers: Vec<_> = (0..256)
        .map(|_| {
            let (http, gateways, bearers, next) = (http.clone(), gateways.clone(), bearers.clone(), next.clone());
            tokio::spawn(async move {
                loop {
                    let workspace = next.fetch_add(1, Ordering::Relaxed);
                    let Some(bearer) = bearers.get(workspace) else { return };
                    for attempt in 0.. {
                        let item = json!({
                            "event": "lead", "external_id": format!("probe-{workspace}-{attempt}"),
                            "occurred_at": now_ms() - 1000,
                        });
                        let response = http
                            .post(format!("{}/v1/conversions", gateways[(workspace + attempt) % gateways.len()]))
                            .header("Authorization", bearer)
                            .json(&item)
                            .timeout(Duration::from_secs(30))
                            .send()
                            .await;
                        let Ok(response) = response else { continue };
                        if response.status().is_success() {
                            break;
                        }
                        tokio::time::sleep(retry_after(&response).map_or(Duration::from_millis(100), |s| {
                            Duration::from_secs(s).min(Duration::from_secs(1))
                        }))
                        .await;
                    }
                }
            })
        })
        .collect();
    for prober in probers {
        let _ = prober.await;
    }
}

/// Peak RSS of each process, sampled until `stop`.
async fn sample_rss(pids: Vec<u32>, peaks: Arc<Mutex<Vec<f64>>>, stop: Arc<AtomicBool>) {
    while !stop.load(Ordering::Relaxed) {
        if let Ok(mut peaks) = peaks.lock() {
            for (peak, pid) in peaks.iter_mut().zip(&pids) {
                *peak = peak.max(rss_mib(*pid));
            }
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

async fn writer_metrics(http: &reqwest::Client, ops_url: &str) -> Metrics {
    let text = match http.get(format!("{ops_url}/metrics")).send().await {
        Ok(response) => response.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    };
    Metrics(text)
}

/// Messages of the requests topic that the writers' group has not committed: the backlog Kafka
/// keeps. (The writer's own lag gauge is stale for paused partitions: it learns the high
/// watermark from fetches, and a paused partition is not fetched.)
fn kafka_backlog() -> i64 {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let topic = "intake.requests";
    let consumer: BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", env("INTAKE_KAFKA_BROKERS"))
        .set("group.id", "intake-writer")
        .create()
        .unwrap_or_else(|e| panic!("{e}"));
    let timeout = Duration::from_secs(10);
    let Ok(metadata) = consumer.fetch_metadata(Some(topic), timeout) else { return -1 };
    let mut partitions = rdkafka::TopicPartitionList::new();
    for partition in metadata.topics().iter().flat_map(|t| t.partitions()) {
        partitions.add_partition(topic, partition.id());
    }
    let Ok(committed) = consumer.committed_offsets(partitions, timeout) else { return -1 };
    committed
        .elements()
        .iter()
        .map(|element| {
            let (low, high) = consumer.fetch_watermarks(topic, element.partition(), timeout).unwrap_or((0, 0));
            let from = element.offset().to_raw().filter(|offset| *offset >= 0).unwrap_or(low);
            high - from
        })
        .sum()
}

/// Sums every series of a metric family (all labels).
fn family_sum(metrics: &Metrics, family: &str) -> f64 {
    let prefix = format!("{family}{{");
    metrics
        .0
        .lines()
        .filter(|line| line.starts_with(&prefix) || line.split_whitespace().next() == Some(family))
        .filter_map(|line| line.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()))
        .sum()
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let workspaces = usize::try_from(arg(&args, "workspaces", 120)).unwrap_or(120);
    let clients = usize::try_from(arg(&args, "clients", 32)).unwrap_or(32);
    let outage = Duration::from_secs(arg(&args, "outage-s", 300));
    let warmup = Duration::from_secs(arg(&args, "warmup-s", 30));
    let http = reqwest::Client::builder().pool_max_idle_per_host(64).build().unwrap_or_else(|e| panic!("{e}"));

    writer_command(&["migrate", "--contract"]);
    let reply_partitions = (GATEWAYS + 1).to_string();
    writer_command(&[
        "topics",
        "--request-partitions",
        "8",
        "--reply-partitions",
        &reply_partitions,
        "--replication",
        "3",
    ]);
    let started = Instant::now();
    let keys: Vec<Key> = {
        let mut handles = Vec::new();
        for chunk in (0..workspaces).collect::<Vec<_>>().chunks(workspaces.div_ceil(8)) {
            let chunk = chunk.to_vec();
            handles.push(tokio::task::spawn_blocking(move || chunk.into_iter().map(create_key).collect::<Vec<_>>()));
        }
        let mut keys = Vec::new();
        for handle in handles {
            keys.extend(handle.await.unwrap_or_default());
        }
        keys
    };
    eprintln!("outage: {} workspaces created in {:?}", keys.len(), started.elapsed());

    let mut gateways = Vec::new();
    for i in 0..GATEWAYS {
        let (port, ops) = (free_port(), free_port());
        let args: Vec<String> = [
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--ops-listen",
            &format!("127.0.0.1:{ops}"),
            "--reply-partition",
            &(i + 1).to_string(),
            "--requests-per-minute",
            "10000000",
            "--conversions-per-minute",
            "1000000000",
        ]
        .map(str::to_owned)
        .to_vec();
        gateways.push((format!("http://127.0.0.1:{port}"), spawn(&format!("gateway-{i}"), "intake-gateway", &args)));
    }
    let writer_ops = format!("127.0.0.1:{}", free_port());
    let writer = spawn("writer", "intake-writer", &["run".into(), "--ops-listen".into(), writer_ops.clone()]);
    let ready = |url: String| {
        let http = http.clone();
        async move { http.get(format!("{url}/readyz")).send().await.is_ok_and(|r| r.status().is_success()) }
    };
    let deadline = Instant::now() + Duration::from_secs(120);
    for service in gateways.iter().map(|(_, s)| s).chain([&writer]) {
        while !ready(service.ops_url.clone()).await {
            assert!(Instant::now() < deadline, "{} not ready", service.ops_url);
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let writer_idle = rss_mib(writer.child.id());
    let gateway_urls: Vec<String> = gateways.iter().map(|(url, _)| url.clone()).collect();
    // Every gateway knows every key before the outage, as gateways that served for a while
    // would: a key first seen while PostgreSQL is down cannot be looked up.
    prime_keys(&http, &gateway_urls, &keys).await;
    let gateways_idle: Vec<f64> = gateways.iter().map(|(_, s)| rss_mib(s.child.id())).collect();

    let load = Arc::new(Load {
        ledger: Mutex::new(Ledger { acknowledged: vec![Vec::new(); keys.len()], ..Ledger::default() }),
        keys,
        gateways: gateway_urls.clone(),
        http: http.clone(),
        next: AtomicUsize::new(0),
        stop: AtomicBool::new(false),
    });
    let tasks: Vec<_> = (0..clients).map(|c| tokio::spawn(load.clone().client(c))).collect();
    tokio::time::sleep(warmup).await;
    let writer_loaded = rss_mib(writer.child.id());

    // Peaks from the outage on.
    let pids: Vec<u32> = std::iter::once(writer.child.id()).chain(gateways.iter().map(|(_, s)| s.child.id())).collect();
    let peaks = Arc::new(Mutex::new(vec![0.0; pids.len()]));
    let sampling = Arc::new(AtomicBool::new(false));
    let sampler = tokio::spawn(sample_rss(pids, peaks.clone(), sampling.clone()));
    eprintln!("outage: PostgreSQL stopped for {outage:?} under load");
    assert!(pg_ctl("stop"), "pg_ctl stop");
    let (mut held_max, mut paused_max) = (0.0_f64, 0.0_f64);
    let outage_started = Instant::now();
    while outage_started.elapsed() < outage {
        let metrics = writer_metrics(&http, &format!("http://{writer_ops}")).await;
        held_max = held_max.max(metrics.value("intake_writer_backlog_bytes"));
        paused_max = paused_max.max(metrics.value("intake_writer_paused_partitions"));
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let paused_in_outage = paused_max;
    assert!(pg_ctl("start"), "pg_ctl start");
    let back = Instant::now();
    let probing = tokio::spawn(probe_every_workspace(
        http.clone(),
        gateway_urls.clone(),
        load.keys.iter().map(|k| k.bearer.clone()).collect(),
    ));
    let at_return = writer_metrics(&http, &format!("http://{writer_ops}")).await;
    let (messages_at_return, items_at_return) =
        (family_sum(&at_return, "intake_writer_messages_total"), family_sum(&at_return, "intake_writer_items_total"));
    let backlog_at_return = tokio::task::spawn_blocking(kafka_backlog).await.unwrap_or_default();
    // Drained: the lag is down to what the load itself keeps in flight (5 chunks a client).
    let in_flight = f64::from(u32::try_from(clients * BATCH.div_ceil(100)).unwrap_or(u32::MAX));

    // The drain: until the writer's lag is gone (the load goes on meanwhile).
    let mut drained = None;
    let mut recovered_after = None;
    while back.elapsed() < Duration::from_secs(600) && (drained.is_none() || recovered_after.is_none()) {
        let metrics = writer_metrics(&http, &format!("http://{writer_ops}")).await;
        held_max = held_max.max(metrics.value("intake_writer_backlog_bytes"));
        paused_max = paused_max.max(metrics.value("intake_writer_paused_partitions"));
        if drained.is_none()
            && back.elapsed() > Duration::from_secs(5)
            && family_sum(&metrics, "intake_writer_consumer_lag") <= in_flight
        {
            let messages = family_sum(&metrics, "intake_writer_messages_total") - messages_at_return;
            let items = family_sum(&metrics, "intake_writer_items_total") - items_at_return;
            drained = Some((back.elapsed(), messages, items));
        }
        if recovered_after.is_none() && probing.is_finished() {
            recovered_after = Some(back.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    load.stop.store(true, Ordering::Relaxed);
    for task in tasks {
        let _ = task.await;
    }
    sampling.store(true, Ordering::Relaxed);
    let _ = sampler.await;
    let peaks = peaks.lock().map(|p| p.clone()).unwrap_or_default();

    // Nothing acknowledged missing (the writer is given a minute for what is still in Kafka).
    let db = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(&env("DATABASE_URL"))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let check_deadline = Instant::now() + Duration::from_secs(60);
    let (acknowledged, missing) = loop {
        let ledger = load.lock().acknowledged.iter().map(|ids| ids.to_vec()).collect::<Vec<_>>();
        let mut missing = 0usize;
        for (key, ids) in load.keys.iter().zip(&ledger) {
            let stored: i64 = sqlx::query_scalar(concat!(
                "SELECT count(*) FROM conversions WHERE ",
                intake_model::in_workspace!(),
                " AND external_id = ANY($2)"
            ))
            .bind(&key.workspace_id)
            .bind(ids)
            .fetch_one(&db)
            .await
            .unwrap_or(0);
            missing += ids.len().saturating_sub(usize::try_from(stored).unwrap_or(0));
        }
        let acknowledged: usize = ledger.iter().map(Vec::len).sum();
        if missing == 0 || Instant::now() > check_deadline {
            break (acknowledged, missing);
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    };
    let writer_log = std::fs::read_to_string(PathBuf::from(env("FAULTS_DIR")).join("writer.log")).unwrap_or_default();
    let stayed_in_group =
        writer_log.matches("partitions assigned").count() == 1 && !writer_log.contains("partitions revoked");
    let writer_peak = peaks.first().copied().unwrap_or_default();
    let (drain_s, drain_messages, drain_items) =
        drained.map_or((None, 0.0, 0.0), |(at, m, i)| (Some(at.as_secs_f64()), m, i));
    let statuses = load.lock().statuses.clone();
    let report = json!({
        "scenario": "long_postgres_outage",
        "workspaces": load.keys.len(),
        "clients": clients,
        "gateways": GATEWAYS,
        "outage_s": outage.as_secs(),
        "writer_rss_mib": { "idle": writer_idle, "loaded": writer_loaded, "peak": writer_peak },
        "gateway_rss_mib": gateways_idle.iter().zip(peaks.iter().skip(1)).map(|(idle, peak)| json!({"idle": idle, "peak": peak})).collect::<Vec<_>>(),
        "writer_held_mib_max": held_max / 1_048_576.0,
        "writer_paused_partitions_max": { "outage": paused_in_outage, "drain": paused_max },
        "writer_stayed_in_group": stayed_in_group,
        "every_workspace_wrote_again_s": recovered_after.map(|d| d.as_secs_f64()),
        "drain": {
            "backlog_messages_at_return": backlog_at_return,
            "seconds": drain_s,
            "messages": drain_messages,
            "items": drain_items,
            "messages_per_s": drain_s.map(|s| drain_messages / s),
            "items_per_s": drain_s.map(|s| drain_items / s),
        },
        "statuses": statuses.iter().map(|(s, n)| (s.to_string(), json!(n))).collect::<intake_tests::serde_json::Map<_, _>>(),
        "acknowledged_items": acknowledged,
        "missing": missing,
    });
    println!("{report}");
    for (_, mut service) in gateways {
        let _ = service.child.kill();
    }
    let mut writer = writer;
    let _ = writer.child.kill();
    let ok = missing == 0
        && stayed_in_group
        && writer_peak <= writer_idle + RSS_ALLOWANCE_MIB
        && recovered_after.is_some_and(|after| after <= RECOVERY_LIMIT);
    std::process::exit(i32::from(!ok));
}
