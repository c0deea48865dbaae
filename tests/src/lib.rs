//! The end-to-end harness. A [`Stack`] is one gateway and one writer started as real processes
//! on topics and a consumer group of their own, against the PostgreSQL, Redis and Kafka-compatible
//! broker that `deploy/test.sh` started; tests talk to it over real HTTP.
//!
//! Needed in the environment (test.sh sets them): `INTAKE_BIN_DIR`, `DATABASE_URL`,
//! `INTAKE_KAFKA_BROKERS`, `INTAKE_REDIS_URL`, and optionally `INTAKE_KAFKA_OPTIONS`.

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use serde_json;

pub mod raw_http1;

pub fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set: run the tests with deploy/test.sh"))
}

/// The repository the tests run from. Taken at run time (cargo and nextest set the variable
/// for every test) before the path compiled in: checkouts that share one target directory
/// share its artifacts, and a test built in another checkout would use that checkout's files.
/// The address of PostgreSQL node `n` (1 to 3) of an HA layout whose ports start at `base`
/// (deploy/ha.sh ha_port).
pub fn ha_node_address(base: u16, n: u16) -> String {
    format!("127.0.0.1:{}", base + 19 + n)
}

/// `database` on the three nodes of that layout in libpq's multi-host form, the writers'
/// `DATABASE_URL` as deploy/up.sh --ha gives it (deploy/ha.sh ha_nodes_url).
pub fn ha_nodes_url(base: u16, database: &str) -> String {
    let hosts: Vec<String> = (1..=3).map(|n| ha_node_address(base, n)).collect();
    format!("postgres://postgres@{}/{database}", hosts.join(","))
}

pub fn repo() -> PathBuf {
    let tests = std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_else(|| env!("CARGO_MANIFEST_DIR").into());
    PathBuf::from(tests).join("..")
}

fn bin(name: &str) -> PathBuf {
    PathBuf::from(env("INTAKE_BIN_DIR")).join(name)
}

/// The `intake-send` binary, with none of its settings from the test's own environment.
pub fn intake_send() -> Command {
    let mut command = Command::new(bin("intake-send"));
    for (name, _) in std::env::vars().filter(|(name, _)| name.starts_with("INTAKE_SEND_")) {
        command.env_remove(name);
    }
    command.env_remove("INTAKE_BASE_URL").env_remove("INTAKE_API_KEY");
    command
}

/// Ports the tests listen on are chosen below Linux's ephemeral range (32768-60999), so that the
/// local port of some outgoing connection never takes a listener's port while the listener is
/// down (a killed gateway restarted on its port, PostgreSQL or a broker started again): that
/// made the fault tests fail about one run in ten. 20000-28999 for `free_port`, 29000-29999 for
/// the fault harness's fixed ports (deploy/faults.sh), 30000-32767 for a `KafkaCluster` of a test.
pub const FREE_PORTS: std::ops::Range<u16> = 20_000..29_000;

/// Polls `condition` every 20 ms until it holds; panics saying `what` did not happen within
/// `patience`. Tests wait with this instead of sleeping for a time that is usually enough.
pub async fn wait_until<F, Fut>(what: &str, patience: Duration, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + patience;
    while !condition().await {
        assert!(Instant::now() < deadline, "{what} did not happen within {patience:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A port that nothing listens on now and that no other test took lately, from [`FREE_PORTS`],
/// tried from a random place. Tests run in processes of their own, and a port free when one
/// looks can be taken by another before the first one's gateway binds it ("Address already in
/// use"): a port handed out is claimed for a while with a file only one process can create.
pub fn free_port() -> u16 {
    let span = FREE_PORTS.end - FREE_PORTS.start;
    let first = (ulid::Ulid::new().random() % u128::from(span)) as u16;
    (0..span)
        .map(|i| FREE_PORTS.start + (first + i) % span)
        .find(|port| claim(*port) && std::net::TcpListener::bind(("127.0.0.1", *port)).is_ok())
        .unwrap_or_else(|| panic!("no free port in {FREE_PORTS:?}"))
}

/// Longer than a test run, shorter than the time a suite takes to use up [`FREE_PORTS`].
const PORT_CLAIM: Duration = Duration::from_secs(600);

/// Whether this process may hand out `port`: it created the port's claim file, or nothing
/// could be created there at all (no claims, then, rather than no ports).
fn claim(port: u16) -> bool {
    let dir = std::env::temp_dir().join("intake-tests").join("ports");
    let _ = std::fs::create_dir_all(&dir);
    let path = dir.join(port.to_string());
    let modified = std::fs::metadata(&path).and_then(|m| m.modified());
    if modified.is_ok_and(|at| at.elapsed().unwrap_or_default() > PORT_CLAIM) {
        let _ = std::fs::remove_file(&path);
    }
    match std::fs::OpenOptions::new().write(true).create_new(true).open(&path) {
        Ok(_) => true,
        Err(error) => error.kind() != std::io::ErrorKind::AlreadyExists,
    }
}

/// Options of a stack; the defaults are the production defaults.
#[derive(Clone, Debug)]
pub struct StackOptions {
    pub write_timeout_ms: u64,
    pub auth_cache_ttl_ms: u64,
    pub requests_per_minute: u64,
    pub conversions_per_minute: u64,
    /// The rate-limit window (a minute by default): a test that needs a fresh window starts its
    /// stack with a window of a few seconds and waits for it with [`Stack::window_with_at_least`].
    pub rate_limit_window_ms: u64,
    pub redis_url: Option<String>,
    /// How long a rate-limit check waits for Redis before letting the request through: long,
    /// so that a loaded machine does not fail checks open and break exact counts; the tests of
    /// failing open set it short.
    pub redis_timeout_ms: u64,
    pub start_writer: bool,
    /// A database of the stack's own instead of `DATABASE_URL`.
    pub database_url: Option<String>,
    /// Brokers of the stack's own (a [`KafkaCluster`]) instead of `INTAKE_KAFKA_BROKERS`.
    pub kafka_brokers: Option<String>,
    /// Replication of the stack's topics (3 on a [`KafkaCluster`]).
    pub replication: u32,
    pub request_partitions: u32,
    /// Writers started with the stack (when `start_writer`).
    pub writers: usize,
    /// More arguments for the gateway (`--max-connections 5`, ...).
    pub gateway_args: Vec<String>,
    /// More arguments for `intake-writer run`.
    pub writer_args: Vec<String>,
    /// More environment for the writers (`INTAKE_LOG`, `INTAKE_KAFKA_OPTIONS`, ...).
    pub writer_env: Vec<(String, String)>,
    /// Gateways started with the stack, each reading a reply partition of its own.
    pub gateways: usize,
    /// Certificate and key files (PEM): the API speaks HTTPS and the base URLs are
    /// `https://localhost:PORT`; `Stack::http` does not trust the certificate, the test's own
    /// client does.
    pub tls: Option<(PathBuf, PathBuf)>,
}

impl StackOptions {
    /// Limits no test traffic reaches: [`Traffic`] re-sends what fails at once, and on a fast
    /// machine passes the production limits of one key.
    pub fn unlimited() -> Self {
        StackOptions { requests_per_minute: 1_000_000, conversions_per_minute: 100_000_000, ..Default::default() }
    }
}

impl Default for StackOptions {
    fn default() -> Self {
        StackOptions {
            write_timeout_ms: 10_000,
            auth_cache_ttl_ms: 2_000,
            requests_per_minute: 600,
            conversions_per_minute: 30_000,
            rate_limit_window_ms: 60_000,
            redis_url: None,
            redis_timeout_ms: 2_000,
            start_writer: true,
            database_url: None,
            kafka_brokers: None,
            replication: 1,
            request_partitions: 4,
            writers: 1,
            gateway_args: Vec::new(),
            writer_args: Vec::new(),
            writer_env: Vec::new(),
            gateways: 1,
            tls: None,
        }
    }
}

pub struct Stack {
    pub base_url: String,
    pub ops_url: String,
    pub http: reqwest::Client,
    pub log_dir: PathBuf,
    pub topic_prefix: String,
    gateway: Child,
    /// Gateways beyond the first (`StackOptions::gateways`), and their API addresses.
    more_gateways: Vec<Child>,
    pub more_base_urls: Vec<String>,
    writers: Vec<Child>,
    /// The ops address of each running writer, in the order of `writers`.
    pub writer_ops_urls: Vec<String>,
    options: StackOptions,
}

/// The partition of a requests topic of `partitions` that a workspace's writes go to:
/// librdkafka's default partitioner (consistent_random: CRC32 of the key).
pub fn request_partition_among(workspace_id: &str, partitions: u32) -> u32 {
    crc32fast::hash(workspace_id.as_bytes()) % partitions
}

impl Stack {
    pub async fn start() -> Stack {
        Self::start_with(StackOptions::default()).await
    }

    pub async fn start_with(options: StackOptions) -> Stack {
        let topic_prefix = format!("t{}", ulid::Ulid::new().to_string().to_lowercase());
        let log_dir = std::env::temp_dir().join("intake-tests").join(&topic_prefix);
        std::fs::create_dir_all(&log_dir).unwrap_or_else(|e| panic!("log dir: {e}"));
        let (port, ops_port) = (free_port(), free_port());
        let https = options.tls.is_some();
        let api_url = move |port: u16| match https {
            true => format!("https://localhost:{port}"),
            false => format!("http://127.0.0.1:{port}"),
        };
        let mut stack = Stack {
            base_url: api_url(port),
            ops_url: format!("http://127.0.0.1:{ops_port}"),
            http: http_client(),
            log_dir,
            topic_prefix,
            gateway: Command::new("true").spawn().unwrap_or_else(|e| panic!("{e}")),
            more_gateways: Vec::new(),
            more_base_urls: Vec::new(),
            writers: Vec::new(),
            writer_ops_urls: Vec::new(),
            options,
        };
        stack.create_topics().unwrap_or_else(|e| panic!("creating topics: {e:#}"));
        stack.gateway = stack.spawn_gateway(port, ops_port, 1);
        let mut more_ops_urls = Vec::new();
        for index in 1..stack.options.gateways {
            let (port, ops_port) = (free_port(), free_port());
            let reply_partition = i32::try_from(index + 1).unwrap_or(i32::MAX);
            stack.more_gateways.push(stack.spawn_gateway(port, ops_port, reply_partition));
            stack.more_base_urls.push(api_url(port));
            more_ops_urls.push(format!("http://127.0.0.1:{ops_port}"));
        }
        if stack.options.start_writer {
            for _ in 0..stack.options.writers {
                stack.start_writer();
            }
        }
        stack.wait_ready(&stack.ops_url).await;
        for ops_url in &more_ops_urls {
            stack.wait_ready(ops_url).await;
        }
        stack
    }

    /// The environment of every process of the stack: its topics, group and database.
    pub fn child_env(&self, command: &mut Command) {
        if let Some(url) = &self.options.database_url {
            command.env("DATABASE_URL", url);
        }
        if let Some(brokers) = &self.options.kafka_brokers {
            command.env("INTAKE_KAFKA_BROKERS", brokers);
        }
        command
            .env("INTAKE_REQUESTS_TOPIC", format!("{}.requests", self.topic_prefix))
            .env("INTAKE_REPLIES_TOPIC", format!("{}.replies", self.topic_prefix))
            .env("INTAKE_DLQ_TOPIC", format!("{}.requests.dlq", self.topic_prefix))
            .env("INTAKE_WRITER_GROUP", format!("{}-writers", self.topic_prefix));
    }

    fn log_file(&self, name: &str) -> std::fs::File {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_dir.join(format!("{name}.log")))
            .unwrap_or_else(|e| panic!("log file: {e}"))
    }

    fn spawn_gateway(&self, port: u16, ops_port: u16, reply_partition: i32) -> Child {
        self.gateway_command(port, ops_port, reply_partition)
            .stdout(self.log_file("gateway"))
            .stderr(self.log_file("gateway"))
            .spawn()
            .unwrap_or_else(|e| panic!("starting the gateway: {e}"))
    }

    /// The command that starts one of this stack's gateways (its topics, database and options),
    /// for a test that starts another one with some of it changed.
    pub fn gateway_command(&self, port: u16, ops_port: u16, reply_partition: i32) -> Command {
        let mut command = Command::new(bin("intake-gateway"));
        self.child_env(&mut command);
        let options = &self.options;
        command
            .args(["--listen", &format!("127.0.0.1:{port}"), "--ops-listen", &format!("127.0.0.1:{ops_port}")])
            .args(["--write-timeout-ms", &options.write_timeout_ms.to_string()])
            .args(["--auth-cache-ttl-ms", &options.auth_cache_ttl_ms.to_string()])
            .args(["--requests-per-minute", &options.requests_per_minute.to_string()])
            .args(["--conversions-per-minute", &options.conversions_per_minute.to_string()])
            .args(["--rate-limit-window-ms", &options.rate_limit_window_ms.to_string()])
            .args(["--redis-timeout-ms", &options.redis_timeout_ms.to_string()])
            .args(["--reply-partition", &reply_partition.to_string()]);
        if let Some(url) = &options.redis_url {
            command.args(["--redis-url", url]);
        }
        if let Some((cert, key)) = &options.tls {
            command.arg("--tls-cert").arg(cert).arg("--tls-key").arg(key);
        }
        command.args(&options.gateway_args);
        command
    }

    /// A stack under `options`, a key of it, and the end of a rate-limit window that has at least
    /// `needed` left: the start of every test that counts requests within one window.
    pub async fn with_window(options: StackOptions, needed: Duration) -> (Stack, TestKey, Instant) {
        let stack = Stack::start_with(options).await;
        let key = stack.workspace();
        let window_end = stack.window_with_at_least(needed).await;
        (stack, key, window_end)
    }

    /// Waits until the stack's current rate-limit window has at least `needed` left, so that a
    /// test's requests fall into one window; returns when that window ends. Windows are aligned
    /// to multiples of their length since the Unix epoch, on the clock the gateway shares.
    pub async fn window_with_at_least(&self, needed: Duration) -> Instant {
        let window = self.options.rate_limit_window_ms;
        let needed_ms = u64::try_from(needed.as_millis()).unwrap_or(u64::MAX);
        assert!(needed_ms < window, "{needed:?} is more than a window of {window} ms");
        loop {
            let left = window - u64::try_from(now_ms()).unwrap_or(0) % window;
            if left >= needed_ms {
                return Instant::now() + Duration::from_millis(left);
            }
            // The clock is the condition: the next window starts `left` from now.
            tokio::time::sleep(Duration::from_millis(left + 10)).await;
        }
    }

    /// Starts one more writer in the stack's consumer group.
    pub fn start_writer(&mut self) {
        let mut command = Command::new(bin("intake-writer"));
        self.child_env(&mut command);
        let ops = format!("127.0.0.1:{}", free_port());
        let child = command
            .args(["run", "--ops-listen", &ops])
            .args(&self.options.writer_args)
            .envs(self.options.writer_env.iter().cloned())
            .stdout(self.log_file("writer"))
            .stderr(self.log_file("writer"))
            .spawn()
            .unwrap_or_else(|e| panic!("starting a writer: {e}"));
        self.writers.push(child);
        self.writer_ops_urls.push(format!("http://{ops}"));
    }

    /// Stops every writer: gracefully (SIGTERM) or by SIGKILL.
    pub fn stop_writers(&mut self, graceful: bool) {
        self.writer_ops_urls.clear();
        for mut writer in self.writers.drain(..) {
            let signal = if graceful { "-TERM" } else { "-KILL" };
            let _ = Command::new("kill").args([signal, &writer.id().to_string()]).status();
            let _ = writer.wait();
        }
    }

    /// Kills one writer with SIGKILL (no goodbye to the group) and returns how many are left.
    pub fn kill_writer(&mut self, index: usize) -> usize {
        let mut writer = self.writers.remove(index);
        self.writer_ops_urls.remove(index);
        let _ = writer.kill();
        let _ = writer.wait();
        self.writers.len()
    }

    /// SIGTERM to one writer; returns how long it took to exit and its status.
    pub fn terminate_writer(
        &mut self,
        index: usize,
    ) -> std::thread::JoinHandle<(Duration, Option<std::process::ExitStatus>)> {
        let mut writer = self.writers.remove(index);
        self.writer_ops_urls.remove(index);
        let _ = Command::new("kill").args(["-TERM", &writer.id().to_string()]).status();
        let started = Instant::now();
        std::thread::spawn(move || {
            let status = writer.wait().ok();
            (started.elapsed(), status)
        })
    }

    /// The partition of the requests topic a workspace's writes go to.
    pub fn request_partition(&self, workspace_id: &str) -> u32 {
        request_partition_among(workspace_id, self.options.request_partitions)
    }

    pub fn request_partitions(&self) -> u32 {
        self.options.request_partitions
    }

    /// The stack's requests topic has `count` partitions now (after `topics` grew it).
    pub fn set_request_partitions(&mut self, count: u32) {
        self.options.request_partitions = count;
    }

    /// Workspaces until every request partition has at least one.
    pub fn workspaces_on_every_partition(&self) -> Vec<TestKey> {
        let mut keys: Vec<TestKey> = Vec::new();
        let mut covered = std::collections::BTreeSet::new();
        while covered.len() < self.options.request_partitions as usize {
            let key = self.workspace();
            if covered.insert(self.request_partition(&key.workspace_id)) {
                keys.push(key);
            }
        }
        keys
    }

    /// Sends SIGTERM to the gateway and returns a handle on its exit.
    pub fn terminate_gateway(&mut self) -> std::thread::JoinHandle<Option<std::process::ExitStatus>> {
        let _ = Command::new("kill").args(["-TERM", &self.gateway.id().to_string()]).status();
        let mut gateway =
            std::mem::replace(&mut self.gateway, Command::new("true").spawn().unwrap_or_else(|e| panic!("{e}")));
        std::thread::spawn(move || gateway.wait().ok())
    }

    /// Stops the gateway and starts it again on the same ports (a new producer, with the
    /// topics' metadata as they are now); returns once it is ready.
    pub async fn restart_gateway(&mut self) {
        let _ = self.terminate_gateway().join();
        let port = self.base_url.rsplit(':').next().and_then(|p| p.parse().ok()).unwrap_or(0);
        let ops_port = self.ops_url.rsplit(':').next().and_then(|p| p.parse().ok()).unwrap_or(0);
        self.gateway = self.spawn_gateway(port, ops_port, 1);
        self.wait_ready(&self.ops_url).await;
    }

    /// Process ids of the gateways and of the writers (for the benchmark's CPU and memory).
    pub fn pids(&self) -> (Vec<u32>, Vec<u32>) {
        let gateways = std::iter::once(&self.gateway).chain(&self.more_gateways).map(Child::id).collect();
        (gateways, self.writers.iter().map(Child::id).collect())
    }

    async fn wait_ready(&self, ops_url: &str) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Ok(response) = self.http.get(format!("{ops_url}/readyz")).send().await {
                if response.status().is_success() {
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("the gateway did not become ready; see {}", self.log_dir.display());
    }

    /// Waits until every writer answers /readyz 200: in the group, its partitions rewound to the
    /// database's positions (a test that times requests starts after that).
    pub async fn wait_writers_ready(&self) {
        for ops_url in &self.writer_ops_urls {
            let url = format!("{ops_url}/readyz");
            let ready = || async { self.http.get(&url).send().await.is_ok_and(|r| r.status().is_success()) };
            wait_until("the writer ready", Duration::from_secs(30), ready).await;
        }
    }

    /// Runs an operator command with this stack's topics and returns its JSON output.
    pub fn run_writer_command(&self, args: &[&str]) -> Result<Value> {
        self.run_writer_command_with_input(args, "")
    }

    /// The same, with `input` on the command's standard input.
    pub fn run_writer_command_with_input(&self, args: &[&str], input: &str) -> Result<Value> {
        use std::io::Write;
        let mut child = self
            .writer_command()
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("running intake-writer")?;
        if let Some(mut stdin) = child.stdin.take() {
            let _ = stdin.write_all(input.as_bytes());
        }
        let output = child.wait_with_output().context("running intake-writer")?;
        if !output.status.success() {
            bail!("intake-writer {args:?} failed: {}", String::from_utf8_lossy(&output.stderr));
        }
        serde_json::from_slice(&output.stdout).context("intake-writer printed no JSON")
    }

    /// An `intake-writer` command with this stack's environment (topics, group, database).
    pub fn writer_command(&self) -> Command {
        let mut command = Command::new(bin("intake-writer"));
        self.child_env(&mut command);
        command
    }

    /// A new workspace with one key of the given scopes.
    pub fn workspace_with_scopes(&self, scopes: &str) -> TestKey {
        let workspace = self
            .run_writer_command(&["workspace", "create", "--name", "Test", "--site", "shop.example"])
            .unwrap_or_else(|e| panic!("{e:#}"));
        let workspace_id = workspace["id"].as_str().unwrap_or_default().to_owned();
        let key = self
            .run_writer_command(&["key", "create", "--workspace", &workspace_id, "--scopes", scopes])
            .unwrap_or_else(|e| panic!("{e:#}"));
        TestKey {
            workspace_id,
            key_id: key["id"].as_str().unwrap_or_default().to_owned(),
            secret: key["secret"].as_str().unwrap_or_default().to_owned(),
        }
    }

    pub fn workspace(&self) -> TestKey {
        self.workspace_with_scopes("workspace:read,conversions:write")
    }

    /// A client of this stack's API that can be moved into a spawned task.
    pub fn client(&self) -> Client {
        Client { http: self.http.clone(), base_url: self.base_url.clone() }
    }

    pub async fn send(
        &self,
        method: reqwest::Method,
        path: &str,
        authorization: Option<&str>,
        body: Option<&Value>,
    ) -> Reply {
        self.client().send(method, path, authorization, body).await
    }

    pub async fn post(&self, path: &str, key: &TestKey, body: &Value) -> Reply {
        self.client().post(path, key, body).await
    }

    pub async fn post_text(&self, path: &str, key: &TestKey, body: String) -> Reply {
        self.client().post_text(path, key, body).await
    }

    /// [`Stack::post`] as a client that honours Retry-After: a 503 or 429 is sent again after
    /// the time it names, for up to 30 s.
    pub async fn post_honouring_retry_after(&self, path: &str, key: &TestKey, body: &Value) -> Reply {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let reply = self.post(path, key, body).await;
            if ![429, 503].contains(&reply.status) || Instant::now() > deadline {
                return reply;
            }
            let wait = reply.header("retry-after").and_then(|v| v.parse().ok()).unwrap_or(1);
            tokio::time::sleep(Duration::from_secs(wait)).await;
        }
    }

    pub async fn get(&self, path: &str, key: &TestKey) -> Reply {
        self.send(reqwest::Method::GET, path, Some(&key.bearer()), None).await
    }

    /// The gateway's Prometheus metrics.
    pub async fn metrics(&self) -> Metrics {
        Metrics::scrape(&self.http, &self.ops_url).await
    }

    /// Waits until the gateway counts `count` writes admitted and not yet answered.
    pub async fn wait_writes_in_flight(&self, count: f64) {
        let in_flight = || async { self.metrics().await.value("intake_gateway_writes_in_flight") == count };
        wait_until(&format!("{count} writes in flight"), Duration::from_secs(10), in_flight).await;
    }

    /// GET of an ops URL (a gateway's or a writer's /readyz, /healthz, /metrics): its status and
    /// body, or (0, "") while nothing answers there.
    pub async fn ops_get(&self, url: &str) -> (u16, String) {
        match self.http.get(url).send().await {
            Ok(response) => (response.status().as_u16(), response.text().await.unwrap_or_default()),
            Err(_) => (0, String::new()),
        }
    }

    /// Waits until the gateway counts at least `count` API connections open.
    pub async fn wait_connections(&self, count: f64) {
        let open = || async { self.metrics().await.value("intake_gateway_connections") >= count };
        wait_until(&format!("{count} connections open"), Duration::from_secs(10), open).await;
    }

    /// Waits until the gateway's /readyz answers 503 (after SIGTERM: it is shutting down).
    pub async fn wait_not_ready(&self) {
        let readyz = format!("{}/readyz", self.ops_url);
        let not_ready = || async { self.http.get(&readyz).send().await.is_ok_and(|r| r.status().as_u16() == 503) };
        wait_until("/readyz answering 503", Duration::from_secs(5), not_ready).await;
    }

    /// The Prometheus metrics of the stack's writer `index` (in the order of `writer_ops_urls`).
    pub async fn writer_metrics(&self, index: usize) -> Metrics {
        Metrics::scrape(&self.http, &self.writer_ops_urls[index]).await
    }

    /// `intake-send` aimed at this stack with a key, both given through the environment as a
    /// user would.
    pub fn intake_send(&self, key: &TestKey) -> Command {
        let mut command = intake_send();
        command.env("INTAKE_BASE_URL", format!("{}/v1", self.base_url)).env("INTAKE_API_KEY", &key.secret);
        command
    }

    /// Everything the stack's processes logged.
    pub fn logs(&self) -> String {
        ["gateway", "writer"]
            .iter()
            .map(|name| std::fs::read_to_string(self.log_dir.join(format!("{name}.log"))).unwrap_or_default())
            .collect::<Vec<_>>()
            .join("\n")
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        for gateway in std::iter::once(&mut self.gateway).chain(&mut self.more_gateways) {
            let _ = gateway.kill();
            let _ = gateway.wait();
        }
        for writer in &mut self.writers {
            let _ = writer.kill();
            let _ = writer.wait();
        }
        self.delete_topics(&["requests", "replies", "requests.dlq"]);
        // A failed test keeps its logs and says where; a passed one leaves nothing, so that run
        // after run does not fill /tmp (a benchmark's access logs are gigabytes), unless
        // INTAKE_KEEP_LOGS asks for them (to place a benchmark's stall in its services' logs).
        if std::thread::panicking() || std::env::var_os("INTAKE_KEEP_LOGS").is_some() {
            eprintln!("the gateway and writer logs of this stack: {}", self.log_dir.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.log_dir);
        }
    }
}

impl Stack {
    /// `intake-writer topics` for the stack's topics (created where missing).
    fn create_topics(&self) -> Result<Value> {
        let (partitions, replication) =
            (self.options.request_partitions.to_string(), self.options.replication.to_string());
        // Gateway i reads reply partition i + 1.
        let reply_partitions = (self.options.gateways.max(1) + 1).to_string();
        self.run_writer_command(&[
            "topics",
            "--request-partitions",
            &partitions,
            "--reply-partitions",
            &reply_partitions,
            "--replication",
            &replication,
        ])
    }

    /// Deletes the stack's requests topic and creates it again, empty, as a new Kafka cluster's
    /// would be. Kafka deletes a topic in the background: it is created again once it is gone.
    pub async fn make_requests_topic_again(&self) {
        use rdkafka::consumer::{BaseConsumer, Consumer};
        let topic = format!("{}.requests", self.topic_prefix);
        self.delete_topics(&["requests"]);
        let brokers = self.options.kafka_brokers.clone().unwrap_or_else(|| env("INTAKE_KAFKA_BROKERS"));
        let consumer: BaseConsumer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .create()
            .unwrap_or_else(|e| panic!("consumer: {e}"));
        let gone = || {
            let metadata = consumer.fetch_metadata(Some(&topic), Duration::from_secs(5));
            let exists =
                metadata.is_ok_and(|m| m.topics().iter().any(|t| t.error().is_none() && !t.partitions().is_empty()));
            std::future::ready(!exists)
        };
        wait_until("the requests topic deleted", Duration::from_secs(30), gone).await;
        self.create_topics().unwrap_or_else(|e| panic!("creating the requests topic again: {e:#}"));
    }

    /// Deletes the stack's topics of these names (after its prefix), so that a broker that
    /// serves test run after test run does not pile up thousands of partitions. Bounded: a broker
    /// that does not answer keeps them.
    fn delete_topics(&self, names: &[&str]) {
        use rdkafka::admin::{AdminClient, AdminOptions};
        let brokers = self.options.kafka_brokers.clone().unwrap_or_else(|| env("INTAKE_KAFKA_BROKERS"));
        let topics: Vec<String> = names.iter().map(|t| format!("{}.{t}", self.topic_prefix)).collect();
        let deleting = std::thread::spawn(move || {
            let Ok(runtime) = tokio::runtime::Builder::new_current_thread().enable_all().build() else { return };
            let Ok(admin) = rdkafka::ClientConfig::new().set("bootstrap.servers", &brokers).create::<AdminClient<_>>()
            else {
                return;
            };
            let names: Vec<&str> = topics.iter().map(String::as_str).collect();
            let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(3)));
            // The timeout is made inside the runtime: a timer needs the runtime's reactor.
            let _ = runtime.block_on(async {
                tokio::time::timeout(Duration::from_secs(5), admin.delete_topics(&names, &options)).await
            });
        });
        let _ = deleting.join();
    }
}

/// The HTTP client of a stack's tests. Idle connections are dropped before the gateway's
/// keep-alive timeout (5 s) closes them: reusing one just as the server closes it fails the
/// request (IncompleteMessage).
fn http_client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .pool_idle_timeout(Duration::from_secs(3))
        .build()
        .unwrap_or_default()
}

#[derive(Clone)]
pub struct Client {
    http: reqwest::Client,
    base_url: String,
}

impl Client {
    pub async fn send(
        &self,
        method: reqwest::Method,
        path: &str,
        authorization: Option<&str>,
        body: Option<&Value>,
    ) -> Reply {
        let mut request = self.http.request(method, format!("{}{path}", self.base_url));
        if let Some(authorization) = authorization {
            request = request.header("Authorization", authorization);
        }
        if let Some(body) = body {
            request = request.json(body);
        }
        Reply::from(request.send().await.unwrap_or_else(|e| panic!("request failed: {e}: {e:?}"))).await
    }

    pub async fn post(&self, path: &str, key: &TestKey, body: &Value) -> Reply {
        self.send(reqwest::Method::POST, path, Some(&key.bearer()), Some(body)).await
    }

    /// A POST of a JSON body as written, for what a `Value` cannot hold (a duplicate key, a
    /// number's exact text, invalid UTF-8 escapes).
    pub async fn post_text(&self, path: &str, key: &TestKey, body: String) -> Reply {
        let request = self
            .http
            .post(format!("{}{path}", self.base_url))
            .header("Authorization", key.bearer())
            .header("Content-Type", "application/json")
            .body(body);
        Reply::from(
            request.send().await.unwrap_or_else(|e| panic!("request failed (a dropped connection is a bug): {e}")),
        )
        .await
    }
}

/// A scrape of Prometheus metrics in the text format.
#[derive(Debug)]
pub struct Metrics(pub String);

impl Metrics {
    /// `GET {ops_url}/metrics`; panics unless it answers 200.
    pub async fn scrape(http: &reqwest::Client, ops_url: &str) -> Metrics {
        Self::try_scrape(http, ops_url).await.unwrap_or_else(|e| panic!("scraping {ops_url}/metrics: {e}"))
    }

    /// [`Metrics::scrape`] for a poll of a process that may not listen yet.
    pub async fn try_scrape(http: &reqwest::Client, ops_url: &str) -> Result<Metrics> {
        let response = http.get(format!("{ops_url}/metrics")).send().await?.error_for_status()?;
        Ok(Metrics(response.text().await?))
    }

    /// The value of one series, e.g. `intake_gateway_key_cache_total{result="miss"}`; labels in
    /// the order the exporter writes them. Panics when the series is absent: a series that is
    /// not exported is a failure, never a zero.
    pub fn value(&self, series: &str) -> f64 {
        self.get(series).unwrap_or_else(|| panic!("no series {series} in the scrape:\n{}", self.0))
    }

    /// The value of one series, or None while it is absent (a labelled counter appears with
    /// its first count): for polls.
    pub fn get(&self, series: &str) -> Option<f64> {
        self.0
            .lines()
            .filter_map(|line| line.rsplit_once(' '))
            .find(|(name, _)| *name == series)
            .map(|(_, value)| value.parse().unwrap_or_else(|e| panic!("{series} {value}: {e}")))
    }
}

/// Runs the futures concurrently on the runtime and returns their outputs in order.
pub async fn join_all<F>(futures: impl IntoIterator<Item = F>) -> Vec<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    let handles: Vec<_> = futures.into_iter().map(tokio::spawn).collect();
    let mut outputs = Vec::with_capacity(handles.len());
    for handle in handles {
        outputs.push(handle.await.unwrap_or_else(|e| panic!("task failed: {e}")));
    }
    outputs
}

#[derive(Clone, Debug)]
pub struct TestKey {
    pub workspace_id: String,
    pub key_id: String,
    pub secret: String,
}

impl TestKey {
    pub fn bearer(&self) -> String {
        format!("Bearer {}", self.secret)
    }
}

/// What the client saw.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub body: Value,
    /// The body's length as sent.
    pub bytes: usize,
}

impl Reply {
    async fn from(response: reqwest::Response) -> Reply {
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let text = response.text().await.unwrap_or_default();
        let bytes = text.len();
        let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
        Reply { status, headers, body, bytes }
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// Asserts an error response of the documented shape and returns its code.
    pub fn error_code(&self) -> &str {
        let request_id = self.header("x-request-id").unwrap_or_else(|| panic!("no X-Request-ID: {self:?}"));
        assert_eq!(self.body["error"]["request_id"], json!(request_id), "{self:?}");
        assert!(self.body["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{self:?}");
        self.body["error"]["code"].as_str().unwrap_or_else(|| panic!("no error code: {self:?}"))
    }
}

pub async fn database() -> sqlx::PgPool {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(&env("DATABASE_URL"))
        .await
        .unwrap_or_else(|e| panic!("database: {e}"))
}

/// Takes workspace `workspace_id`'s apply lock on `session`, the lock every writer and operator
/// command takes before it applies anything of that workspace (writer/src/store.rs), as a long
/// erasure or an operator's session left idle would hold it: until [`release_workspace`] or the
/// session's end.
pub async fn hold_workspace(session: &mut sqlx::PgConnection, workspace_id: &str) {
    workspace_lock(session, "SELECT pg_advisory_lock(hashtextextended($1, 0))", workspace_id).await;
}

/// Gives back a lock [`hold_workspace`] took on the same session.
pub async fn release_workspace(session: &mut sqlx::PgConnection, workspace_id: &str) {
    workspace_lock(session, "SELECT pg_advisory_unlock(hashtextextended($1, 0))", workspace_id).await;
}

async fn workspace_lock(session: &mut sqlx::PgConnection, statement: &'static str, workspace_id: &str) {
    sqlx::query(statement)
        .bind(workspace_id)
        .execute(session)
        .await
        .unwrap_or_else(|e| panic!("{statement} for {workspace_id}: {e}"));
}

/// How many conversions a workspace has stored.
pub async fn stored_count(db: &sqlx::PgPool, workspace_id: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM conversions WHERE workspace_id = $1")
        .bind(workspace_id)
        .fetch_one(db)
        .await
        .unwrap_or_else(|e| panic!("counting the conversions of {workspace_id}: {e}"))
}

/// Columns (or expressions) of one stored conversion as PostgreSQL prints them, `NULL` as
/// `None`, in the order asked; `None` while the conversion is not stored.
pub async fn stored_fields(
    db: &sqlx::PgPool,
    workspace_id: &str,
    event: &str,
    external_id: &str,
    columns: &[&str],
) -> Option<Vec<Option<String>>> {
    let list: Vec<String> = columns
        .iter()
        .map(|column| match column.strip_suffix("_sha256") {
            // A digest is stored as its bytes (migration 0036; as hex in rows written before):
            // read as the hex that senders send.
            Some(kind @ ("email" | "phone" | "address")) => {
                format!("coalesce(encode({kind}_digest, 'hex'), {kind}_sha256)")
            }
            _ => format!("({column})::text"),
        })
        .collect();
    let sql = format!(
        "SELECT ARRAY[{}] FROM conversions WHERE {} AND event = $2 AND external_id = $3",
        list.join(", "),
        intake_model::in_workspace!()
    );
    sqlx::query_scalar(&sql)
        .bind(workspace_id)
        .bind(event)
        .bind(external_id)
        .fetch_optional(db)
        .await
        .unwrap_or_else(|e| panic!("reading {columns:?} of {workspace_id}'s {event} {external_id}: {e}"))
}

/// The conversions a workspace has stored: external id → value (as PostgreSQL prints it).
pub async fn stored_values(
    db: &sqlx::PgPool,
    workspace_id: &str,
) -> std::collections::BTreeMap<String, Option<String>> {
    by_external_id(db, workspace_id, "value::text").await
}

/// One column of each conversion of `workspace_id` (an expression of `conversions`), by
/// external id.
async fn by_external_id<T>(db: &sqlx::PgPool, workspace_id: &str, column: &str) -> std::collections::BTreeMap<String, T>
where
    T: for<'r> sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres> + Send + Unpin,
{
    sqlx::query_as::<_, (String, T)>(&format!("SELECT external_id, {column} FROM conversions WHERE workspace_id = $1"))
        .bind(workspace_id)
        .fetch_all(db)
        .await
        .unwrap_or_else(|e| panic!("reading the conversions of {workspace_id}: {e}"))
        .into_iter()
        .collect()
}

/// Topics of a test's own, made as `intake-writer topics` makes them, and the environment that
/// names them: for an operator command run without a [`Stack`] that records in the requests
/// topic (`erase`).
pub fn own_topics() -> Vec<(String, String)> {
    let prefix = format!("t{}", ulid::Ulid::new().to_string().to_lowercase());
    let env = vec![
        ("INTAKE_REQUESTS_TOPIC".to_owned(), format!("{prefix}.requests")),
        ("INTAKE_REPLIES_TOPIC".to_owned(), format!("{prefix}.replies")),
        ("INTAKE_DLQ_TOPIC".to_owned(), format!("{prefix}.requests.dlq")),
    ];
    let output = Command::new(bin("intake-writer"))
        .args(["topics", "--request-partitions", "1", "--reply-partitions", "1", "--replication", "1"])
        .envs(env.iter().map(|(k, v)| (k, v)))
        .output()
        .unwrap_or_else(|e| panic!("intake-writer topics: {e}"));
    assert!(output.status.success(), "intake-writer topics: {}", String::from_utf8_lossy(&output.stderr));
    env
}

/// The id of each conversion of `workspace_id`, by external id.
pub async fn stored_conversion_ids(
    db: &sqlx::PgPool,
    workspace_id: &str,
) -> std::collections::BTreeMap<String, String> {
    by_external_id(db, workspace_id, "id").await
}

/// A conversion input with the required fields and a fresh external id.
/// A database of a test's own on the test server, migrated by the writer under test: for a
/// test that needs DDL (a trigger), which on the shared database would lock out every concurrent
/// test's writes, or that fills tables with many rows. Dropped when it goes out of scope, even
/// when the test fails; `deploy/test.sh` drops any a killed run left behind.
pub struct OwnDatabase {
    admin_url: String,
    name: String,
    pub url: String,
}

impl OwnDatabase {
    /// A database with every migration applied.
    pub async fn create(purpose: &str) -> OwnDatabase {
        let own = OwnDatabase::empty(purpose).await;
        own.migrate(&["--contract"]);
        own
    }

    /// A database without a table.
    pub async fn empty(purpose: &str) -> OwnDatabase {
        let shared = env("DATABASE_URL");
        let (server, _) = shared.rsplit_once('/').unwrap_or_else(|| panic!("DATABASE_URL has no database"));
        let name = format!("intake_own_{purpose}_{}", ulid::Ulid::new().to_string().to_lowercase());
        let admin = sqlx::PgPool::connect(&shared).await.unwrap_or_else(|e| panic!("{e}"));
        sqlx::raw_sql(&format!("CREATE DATABASE {name}")).execute(&admin).await.unwrap_or_else(|e| panic!("{e}"));
        admin.close().await;
        OwnDatabase { admin_url: shared.clone(), url: format!("{server}/{name}"), name }
    }

    /// `intake-writer migrate` with `args`: what it printed.
    pub fn migrate(&self, args: &[&str]) -> Value {
        let migrated = self.writer_migrate(args);
        assert!(migrated.status.success(), "migrate {args:?}: {}", String::from_utf8_lossy(&migrated.stderr));
        serde_json::from_slice(&migrated.stdout).unwrap_or_else(|e| panic!("migrate {args:?} printed no JSON: {e}"))
    }

    /// `intake-writer migrate` with `args`, as it ended. Its `--contract` asks Kafka for the
    /// members of a group no writer joins (unless `args` name another with `--group-id`): this
    /// database's writers are a stack's, of this build, never the quick start's.
    pub fn writer_migrate(&self, args: &[&str]) -> std::process::Output {
        Command::new(bin("intake-writer"))
            .arg("migrate")
            .args(args)
            .env("DATABASE_URL", &self.url)
            .env("INTAKE_WRITER_GROUP", "intake-tests-no-writers")
            .output()
            .unwrap_or_else(|e| panic!("migrate: {e}"))
    }

    pub async fn pool(&self) -> sqlx::PgPool {
        sqlx::PgPool::connect(&self.url).await.unwrap_or_else(|e| panic!("{e}"))
    }
}

impl Drop for OwnDatabase {
    fn drop(&mut self) {
        let _ = Command::new("psql")
            .args([&self.admin_url, "-qc", &format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name)])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

pub fn conversion(event: &str) -> Value {
    json!({
        "event": event,
        "external_id": ulid::Ulid::new().to_string(),
        "occurred_at": now_ms(),
    })
}

pub fn now_ms() -> i64 {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    i64::try_from(now.as_millis()).unwrap_or(i64::MAX)
}

/// Sends raw bytes as one HTTP/1.1 exchange and returns the status and the body text; for
/// requests a well-behaved client cannot make (chunked without length, lying Content-Length).
pub async fn raw_http(base_url: &str, request: &[u8]) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let address = base_url.trim_start_matches("http://");
    let mut stream = tokio::net::TcpStream::connect(address).await.unwrap_or_else(|e| panic!("connect: {e}"));
    // The server may answer and close before the whole request is written.
    let _ = stream.write_all(request).await;
    let mut response = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut response)).await;
    let text = String::from_utf8_lossy(&response).into_owned();
    let status = text.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let body = text.split_once("\r\n\r\n").map(|(_, body)| body.to_owned()).unwrap_or_default();
    (status, body)
}

/// A PostgreSQL server of the test's own, so that stopping it disturbs no other test. Stopped
/// (immediate mode, as a crash) and removed on drop.
pub struct PrivatePostgres {
    data: std::path::PathBuf,
    port: u16,
}

impl PrivatePostgres {
    /// The project's schema, by the operator command.
    pub fn migrate(&self) {
        let migrate = Command::new(std::path::PathBuf::from(env("INTAKE_BIN_DIR")).join("intake-writer"))
            .args(["migrate", "--contract"])
            .env("DATABASE_URL", self.url())
            .output()
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(migrate.status.success(), "{}", String::from_utf8_lossy(&migrate.stderr));
    }

    fn bin(name: &str) -> std::path::PathBuf {
        let mut versions: Vec<_> =
            std::fs::read_dir("/usr/lib/postgresql").into_iter().flatten().flatten().map(|e| e.path()).collect();
        versions.sort();
        versions.pop().unwrap_or_default().join("bin").join(name)
    }

    /// Runs a PostgreSQL tool as the postgres user when we are root (PostgreSQL refuses root).
    fn run(args: &[&str]) -> bool {
        let is_root = Command::new("id").arg("-u").output().map(|o| o.stdout.starts_with(b"0")).unwrap_or(false);
        let mut command = if is_root {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]);
            c
        } else {
            Command::new(args[0])
        };
        let args = if is_root { args } else { &args[1..] };
        command
            .args(args)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    pub fn start_new() -> Self {
        let port = free_port();
        let data = std::env::temp_dir().join(format!("intake-pg-{}", ulid::Ulid::new()));
        std::fs::create_dir_all(&data).unwrap_or_else(|e| panic!("{e}"));
        let _ = Command::new("chown").args(["postgres:postgres", &data.display().to_string()]).status();
        let initdb = Self::bin("initdb");
        assert!(
            Self::run(&[
                &initdb.display().to_string(),
                "-D",
                &data.display().to_string(),
                "-U",
                "postgres",
                "--auth=trust"
            ]),
            "initdb"
        );
        let server = Self { data, port };
        server.start();
        server
    }

    pub fn start(&self) {
        let options = format!("-c listen_addresses=127.0.0.1 -p {} -k /tmp -c fsync=off", self.port);
        let pg_ctl = Self::bin("pg_ctl").display().to_string();
        assert!(
            Self::run(&[&pg_ctl, "-D", &self.data.display().to_string(), "-w", "-o", &options, "start"]),
            "pg_ctl start"
        );
    }

    pub fn stop(&self) {
        let pg_ctl = Self::bin("pg_ctl").display().to_string();
        Self::run(&[&pg_ctl, "-D", &self.data.display().to_string(), "-m", "immediate", "stop"]);
    }

    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.data);
    }
}

/// A Kafka cluster of a test's own, for a test that takes every broker down: one node (KRaft,
/// broker and controller) on loopback, started by `deploy/lib.sh`'s `kafka_node`; killed and
/// removed on drop. (The leader of a partition killed in a cluster of three is a scenario of the
/// fault harness, deploy/faults.sh.)
pub struct KafkaCluster {
    pub dir: PathBuf,
    pub base_port: u16,
    pub bootstrap: String,
}

impl KafkaCluster {
    pub fn start() -> KafkaCluster {
        let dir = std::env::temp_dir().join(format!("intake-kafka-{}", ulid::Ulid::new()));
        // 30000-32767, below the ephemeral range (see FREE_PORTS), 20 ports a cluster. From a
        // random place: two test processes starting clusters at the same moment (a
        // developer's run beside CI's) would otherwise both pick the first free one.
        const SLOTS: u16 = 138;
        let first = (ulid::Ulid::new().random() % u128::from(SLOTS)) as u16;
        let base_port = (0..SLOTS)
            .map(|i| 30_000 + ((first + i) % SLOTS) * 20)
            .find(|base| [0, 10].iter().all(|offset| std::net::TcpListener::bind(("127.0.0.1", base + offset)).is_ok()))
            .unwrap_or_else(|| panic!("no free ports for a Kafka cluster"));
        let mut cluster = KafkaCluster { dir, base_port, bootstrap: String::new() };
        let bootstrap = cluster.start_what_is_down().unwrap_or_else(|e| panic!("{e:#}"));
        cluster.bootstrap = bootstrap.lines().last().unwrap_or_default().trim().to_owned();
        cluster
    }

    /// Starts the node if it is down; prints the bootstrap server.
    fn start_what_is_down(&self) -> Result<String> {
        let lib = repo().join("deploy/lib.sh");
        let (dir, base) = (self.dir.display(), self.base_port);
        let script = format!(
            "source {} && RUN={dir}/run LOGS={dir}/logs && mkdir -p $RUN $LOGS \
             && kafka_for_a_test && kafka_node kafka-1 1 {base} {} standalone {dir}/kafka-1 && echo 127.0.0.1:{base}",
            lib.display(),
            base + 10
        );
        let output = Command::new("bash").args(["-c", &script]).stdin(Stdio::null()).output().context("bash")?;
        if !output.status.success() {
            bail!(
                "starting Kafka failed: {}{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    }

    /// SIGKILL to the node.
    pub fn kill(&self) {
        let pid = std::fs::read_to_string(self.dir.join("run").join("kafka-1.pid")).unwrap_or_default();
        let _ = Command::new("kill").args(["-KILL", pid.trim()]).status();
    }

    /// Starts the node again if it is down.
    pub fn restart_stopped(&self) {
        self.start_what_is_down().unwrap_or_else(|e| panic!("{e:#}"));
    }
}

impl Drop for KafkaCluster {
    fn drop(&mut self) {
        self.kill();
        // A failed test keeps the broker's log for its report.
        if std::thread::panicking() {
            eprintln!("the Kafka cluster of this test, its logs kept: {}", self.dir.join("logs").display());
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// What the writers told the gateways: each applied chunk's results by correlation id, as the
/// replies topic holds them (within its retention).
pub fn replies_told(topic: &str) -> std::collections::HashMap<String, Vec<intake_model::message::ItemResult>> {
    use intake_model::message::{ChunkOutcome, WriteReply};
    topic_contents(topic)
        .lines()
        .filter_map(|line| match WriteReply::from_slice(line.as_bytes()) {
            Ok(WriteReply::V1(reply)) => match reply.outcome {
                ChunkOutcome::Applied { results, .. } => Some((reply.correlation_id, results)),
                _ => None,
            },
            Err(_) => None,
        })
        .collect()
}

/// Each chunk told against what the database recorded for its message (`applied_messages`):
/// ids, chains and results item by item.
#[derive(Debug, Default, serde::Serialize)]
pub struct ToldCheck {
    pub compared: usize,
    /// Told applied, and not in the database.
    pub missing: Vec<String>,
    /// Recorded with other results than told.
    pub differing: Vec<String>,
}

pub async fn check_told(
    db: &sqlx::PgPool,
    told: &std::collections::HashMap<String, Vec<intake_model::message::ItemResult>>,
) -> ToldCheck {
    let ids: Vec<&str> = told.keys().map(String::as_str).collect();
    let mut check = ToldCheck::default();
    for page in ids.chunks(5_000) {
        let rows: Vec<(String, sqlx::types::Json<Vec<intake_model::message::ItemResult>>)> =
            sqlx::query_as("SELECT correlation_id, results FROM applied_messages WHERE correlation_id = ANY($1)")
                .bind(page)
                .fetch_all(db)
                .await
                .unwrap_or_else(|e| panic!("reading applied_messages: {e}"));
        let recorded: std::collections::HashMap<String, Vec<intake_model::message::ItemResult>> =
            rows.into_iter().map(|(id, results)| (id, results.0)).collect();
        for id in page {
            match recorded.get(*id) {
                None => check.missing.push((*id).to_owned()),
                Some(results) if Some(results) != told.get(*id) => check.differing.push((*id).to_owned()),
                Some(_) => check.compared += 1,
            }
        }
    }
    check
}

/// Every message on a topic, from the beginning, as text.
pub fn topic_contents(topic: &str) -> String {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::message::Message;
    let mut config = rdkafka::ClientConfig::new();
    config
        .set("bootstrap.servers", env("INTAKE_KAFKA_BROKERS"))
        .set("group.id", format!("inspect-{}", ulid::Ulid::new()))
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false");
    let consumer: BaseConsumer = config.create().unwrap_or_else(|e| panic!("consumer: {e}"));
    let metadata =
        consumer.fetch_metadata(Some(topic), Duration::from_secs(10)).unwrap_or_else(|e| panic!("metadata: {e}"));
    let mut assignment = rdkafka::TopicPartitionList::new();
    let mut remaining = 0;
    for partition in metadata.topics().iter().flat_map(|t| t.partitions()) {
        let (low, high) = consumer.fetch_watermarks(topic, partition.id(), Duration::from_secs(10)).unwrap_or((0, 0));
        remaining += high - low;
        let _ = assignment.add_partition_offset(topic, partition.id(), rdkafka::Offset::Beginning);
    }
    let _ = consumer.assign(&assignment);
    let mut text = String::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while remaining > 0 && Instant::now() < deadline {
        if let Some(Ok(message)) = consumer.poll(Duration::from_millis(200)) {
            text.push_str(&String::from_utf8_lossy(message.payload().unwrap_or_default()));
            text.push('\n');
            remaining -= 1;
        }
    }
    assert_eq!(remaining, 0, "could not read all of {topic}");
    text
}

/// One request of [`Traffic`]: which workspace, what it sent, what it got, and when.
#[derive(Clone, Debug)]
pub struct Sent {
    pub workspace: usize,
    pub external_ids: Vec<String>,
    /// The conversion id the answer gave each of them (none for a request not answered 2xx).
    pub ids: Vec<Option<String>>,
    /// The value every conversion of the request carried: each send of a pair carries a new one.
    pub value: String,
    pub status: u16,
    pub started: Instant,
    pub took: Duration,
}

/// One conversion of [`Traffic`]: a purchase with a value, so that a re-send updates its row.
pub fn purchase(external_id: &str, value: &str) -> Value {
    json!({
        "event": "purchase", "external_id": external_id, "occurred_at": now_ms() - 1000,
        "value": value, "currency": "EUR",
    })
}

/// Writes in a loop from one task per workspace until stopped, as the fault harness's clients
/// do (tests/src/bin/faults.rs): singles, every other one an earlier pair of the workspace sent
/// again with a new value (an update), and a 20-item batch every fifth request. Every request
/// and its outcome is recorded, so that [`check_ledger`] finds a lost write and a stale value.
///
/// The tasks run on a thread and runtime of their own, with connections of their own: a test
/// that blocks its own runtime (a `pg_ctl` call, building a backlog) neither pauses the traffic
/// nor leaves a response unread while the gateway's keep-alive timeout closes its connection.
pub struct Traffic {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Vec<Sent>>,
    /// Per workspace, when its latest successful request was sent.
    last_ok: Arc<Vec<std::sync::Mutex<Option<Instant>>>>,
    /// Requests answered 2xx so far, all workspaces together.
    acknowledged: Arc<AtomicUsize>,
}

impl Traffic {
    pub fn start(client: Client, keys: &[TestKey]) -> Traffic {
        let stop = Arc::new(AtomicBool::new(false));
        let last_ok = Arc::new(keys.iter().map(|_| std::sync::Mutex::new(None)).collect::<Vec<_>>());
        let acknowledged = Arc::new(AtomicUsize::new(0));
        let (keys, shared) = (keys.to_vec(), (stop.clone(), last_ok.clone(), acknowledged.clone()));
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap_or_else(|e| panic!("the traffic's runtime: {e}"));
            runtime.block_on(async move {
                let client = Client { http: http_client(), base_url: client.base_url };
                let tasks: Vec<_> = keys
                    .into_iter()
                    .enumerate()
                    .map(|(workspace, key)| {
                        let (stop, last_ok, acknowledged) = shared.clone();
                        tokio::spawn(write_in_a_loop(client.clone(), key, workspace, stop, last_ok, acknowledged))
                    })
                    .collect();
                let mut all = Vec::new();
                for task in tasks {
                    all.extend(task.await.unwrap_or_else(|e| panic!("a traffic task failed: {e}")));
                }
                all
            })
        });
        Traffic { stop, thread, last_ok, acknowledged }
    }

    /// Requests answered 2xx so far.
    pub fn acknowledged(&self) -> usize {
        self.acknowledged.load(Ordering::Relaxed)
    }

    /// Waits until every workspace has had a success of a request sent after `fault_at`, for at
    /// most `patience` (the report that [`Traffic::stop`] leads to says whether it came).
    pub async fn wait_recovered(&self, fault_at: Instant, patience: Duration) {
        let deadline = Instant::now() + patience;
        let recovered =
            || self.last_ok.iter().all(|last| last.lock().is_ok_and(|at| at.is_some_and(|at| at >= fault_at)));
        while !recovered() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Stops the traffic and returns every request it sent, in the order they were sent.
    pub async fn stop(self) -> Vec<Sent> {
        self.stop.store(true, Ordering::Relaxed);
        let thread = self.thread;
        let joined = tokio::task::spawn_blocking(move || thread.join()).await;
        let mut all = match joined {
            Ok(Ok(all)) => all,
            Ok(Err(panic)) => std::panic::resume_unwind(panic),
            Err(e) => panic!("joining the traffic: {e}"),
        };
        all.sort_by_key(|s| s.started);
        all
    }
}

/// One workspace's requests of [`Traffic`], until `stop`.
async fn write_in_a_loop(
    client: Client,
    key: TestKey,
    workspace: usize,
    stop: Arc<AtomicBool>,
    last_ok: Arc<Vec<std::sync::Mutex<Option<Instant>>>>,
    acknowledged: Arc<AtomicUsize>,
) -> Vec<Sent> {
    let mut sent = Vec::new();
    let mut singles: Vec<String> = Vec::new();
    let prefix = ulid::Ulid::new().to_string();
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        n += 1;
        let started = Instant::now();
        let value = format!("{n}.{:02}", ulid::Ulid::new().random() % 100);
        let id_of = |conversion: &Value| conversion["id"].as_str().map(str::to_owned);
        let (external_ids, ids, status) = if n.is_multiple_of(5) {
            let external_ids: Vec<String> = (0..20).map(|i| format!("{prefix}-b{n}-{i}")).collect();
            let items: Vec<Value> = external_ids.iter().map(|id| purchase(id, &value)).collect();
            let reply = client.post("/v1/conversions/batch", &key, &json!({ "conversions": items })).await;
            let results = reply.body["results"].as_array().cloned().unwrap_or_default();
            let all_ok = !results.is_empty() && results.iter().all(|i| i["ok"] == json!(true));
            let ids = results.iter().map(|r| id_of(&r["conversion"])).collect();
            (external_ids, ids, if reply.status == 200 && !all_ok { 599 } else { reply.status })
        } else {
            let earlier = (n.is_multiple_of(2) && !singles.is_empty())
                .then(|| singles[(ulid::Ulid::new().random() % singles.len() as u128) as usize].clone());
            let id = earlier.unwrap_or_else(|| {
                singles.push(format!("{prefix}-s{n}"));
                format!("{prefix}-s{n}")
            });
            let reply = client.post("/v1/conversions", &key, &purchase(&id, &value)).await;
            (vec![id], vec![id_of(&reply.body["conversion"])], reply.status)
        };
        if (200..300).contains(&status) {
            if let Ok(mut last) = last_ok[workspace].lock() {
                *last = Some(started);
            }
            acknowledged.fetch_add(1, Ordering::Relaxed);
        }
        sent.push(Sent { workspace, external_ids, ids, value, status, started, took: started.elapsed() });
        if !(200..300).contains(&status) {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    sent
}

/// What a fault did to [`Traffic`], measured from the moment of the fault.
#[derive(Debug)]
pub struct FaultReport {
    pub acknowledged: usize,
    pub failed: usize,
    /// Statuses other than 2xx, 500 and 503.
    pub unexpected: Vec<u16>,
    pub longest: Duration,
    /// From the fault until every workspace had a success of a request sent after it.
    pub recovered_after: Option<Duration>,
}

impl FaultReport {
    pub fn of(sent: &[Sent], workspaces: usize, fault_at: Instant) -> FaultReport {
        let ok = |s: &Sent| (200..300).contains(&s.status);
        let mut recovered = vec![None; workspaces];
        for s in sent.iter().filter(|s| s.started >= fault_at && ok(s)) {
            recovered[s.workspace].get_or_insert(s.started + s.took - fault_at);
        }
        FaultReport {
            acknowledged: sent.iter().filter(|s| ok(s)).count(),
            failed: sent.iter().filter(|s| !ok(s)).count(),
            unexpected: sent
                .iter()
                .map(|s| s.status)
                .filter(|s| !(200..300).contains(s) && *s != 500 && *s != 503)
                .collect(),
            longest: sent.iter().map(|s| s.took).max().unwrap_or_default(),
            recovered_after: recovered.into_iter().collect::<Option<Vec<_>>>().and_then(|r| r.into_iter().max()),
        }
    }
}

/// PostgreSQL against what [`Traffic`] was told, as the fault harness checks it.
#[derive(Debug, Default)]
pub struct LedgerCheck {
    /// Acknowledged pairs that are not stored.
    pub missing: Vec<String>,
    /// Pairs stored with a value sent before the last one acknowledged for them (a lost update
    /// or a stale overwrite): the pair, the value stored, the values it may have.
    pub wrong: Vec<(String, Option<String>, Vec<String>)>,
    /// Pairs with an acknowledged update (a value acknowledged after another was sent).
    pub updated: usize,
    /// Pairs stored under another id than an answer gave them: the pair, the id stored, the
    /// ids the answers gave.
    pub other_ids: Vec<(String, String, Vec<String>)>,
}

impl LedgerCheck {
    pub fn is_clean(&self) -> bool {
        self.missing.is_empty() && self.wrong.is_empty() && self.other_ids.is_empty()
    }
}

/// Every pair acknowledged in `sent` is stored, with the value last acknowledged for it or one
/// sent after it; waits up to `patience` for writes still in flight (a write answered 500 is
/// applied later) and returns what is still off then.
pub async fn check_ledger(keys: &[TestKey], sent: &[Sent], patience: Duration) -> LedgerCheck {
    check_ledger_in(&database().await, keys, sent, patience).await
}

/// [`check_ledger`] against the database `db` (a [`PrivatePostgres`]'s).
pub async fn check_ledger_in(db: &sqlx::PgPool, keys: &[TestKey], sent: &[Sent], patience: Duration) -> LedgerCheck {
    /// Every value sent for a pair, in order, the index of the last acknowledged, and the ids
    /// the answers gave it.
    type Sends<'a> = (Vec<&'a str>, Option<usize>, Vec<&'a str>);
    let mut ledger: std::collections::BTreeMap<(usize, &str), Sends> = Default::default();
    let mut in_order: Vec<&Sent> = sent.iter().collect();
    in_order.sort_by_key(|s| s.started);
    for s in in_order {
        for (n, id) in s.external_ids.iter().enumerate() {
            let (values, last, told) = ledger.entry((s.workspace, id.as_str())).or_default();
            values.push(&s.value);
            if (200..300).contains(&s.status) {
                *last = Some(values.len() - 1);
                told.extend(s.ids.get(n).and_then(|id| id.as_deref()));
            }
        }
    }
    let deadline = Instant::now() + patience;
    loop {
        let mut stored = Vec::new();
        let mut stored_ids = Vec::new();
        for key in keys {
            stored.push(stored_values(db, &key.workspace_id).await);
            stored_ids.push(stored_conversion_ids(db, &key.workspace_id).await);
        }
        let mut check = LedgerCheck::default();
        for ((workspace, id), (values, last, told)) in &ledger {
            let Some(last) = *last else { continue };
            check.updated += usize::from(last > 0);
            if let Some(stored_id) = stored_ids[*workspace].get(*id) {
                if told.iter().any(|t| t != stored_id) {
                    check.other_ids.push((
                        (*id).to_owned(),
                        stored_id.clone(),
                        told.iter().map(|t| (*t).to_owned()).collect(),
                    ));
                }
            }
            match stored[*workspace].get(*id) {
                None => check.missing.push((*id).to_owned()),
                Some(value) => {
                    let acceptable = &values[last..];
                    if !value.as_deref().is_some_and(|v| acceptable.iter().any(|a| same_decimal(a, v))) {
                        let acceptable = acceptable.iter().map(|a| (*a).to_owned()).collect();
                        check.wrong.push(((*id).to_owned(), value.clone(), acceptable));
                    }
                }
            }
        }
        if check.is_clean() || Instant::now() > deadline {
            return check;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Two decimals as text are the same number ("12.50" is stored as 12.5 or 12.50).
pub fn same_decimal(a: &str, b: &str) -> bool {
    let norm =
        |s: &str| if s.contains('.') { s.trim_end_matches('0').trim_end_matches('.').to_owned() } else { s.to_owned() };
    norm(a) == norm(b)
}

/// Produces one write request message straight into a requests topic, as a gateway would (for
/// messages a gateway never sends: a missing reply partition, an unknown workspace).
pub async fn produce_request(topic: &str, workspace_id: &str, reply_partition: i32, input: &Value) -> String {
    produce_request_with_deadline(topic, workspace_id, reply_partition, input, now_ms() + 10_000).await
}

/// [`produce_request`] with the deadline the message carries (epoch ms).
pub async fn produce_request_with_deadline(
    topic: &str,
    workspace_id: &str,
    reply_partition: i32,
    input: &Value,
    deadline_ms: i64,
) -> String {
    use intake_model::message::{WriteRequest, WriteRequestV1};
    let conversion = intake_model::validate::validate_conversion(&input.into(), now_ms())
        .unwrap_or_else(|e| panic!("invalid test input: {e:?}"))
        .conversion;
    let correlation_id = format!("test-{}", ulid::Ulid::new());
    let request = WriteRequest::V1(WriteRequestV1 {
        correlation_id: correlation_id.clone(),
        reply_partition,
        deadline_ms,
        received_at_ms: now_ms(),
        workspace_id: workspace_id.to_owned(),
        items: vec![conversion],
        request: None,
        position: None,
    });
    produce_payload(topic, workspace_id, &serde_json::to_vec(&request).unwrap_or_default()).await;
    correlation_id
}

/// Produces `payload` as it is into a requests topic, keyed by the workspace as a gateway keys
/// it: a message in a format frozen in a test.
pub async fn produce_payload(topic: &str, workspace_id: &str, payload: &[u8]) {
    let producer: rdkafka::producer::FutureProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", env("INTAKE_KAFKA_BROKERS"))
        .create()
        .unwrap_or_else(|e| panic!("producer: {e}"));
    let record = rdkafka::producer::FutureRecord::to(topic).key(workspace_id).payload(payload);
    producer.send(record, Duration::from_secs(10)).await.unwrap_or_else(|(e, _)| panic!("produce: {e}"));
}

/// The headers of every message on a topic (the dead-letter topic), waiting up to `patience`
/// for at least `expected` messages.
pub fn topic_headers(
    topic: &str,
    expected: usize,
    patience: Duration,
) -> Vec<std::collections::BTreeMap<String, String>> {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::message::{Headers, Message};
    let consumer: BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", env("INTAKE_KAFKA_BROKERS"))
        .set("group.id", format!("inspect-{}", ulid::Ulid::new()))
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .create()
        .unwrap_or_else(|e| panic!("consumer: {e}"));
    consumer.subscribe(&[topic]).unwrap_or_else(|e| panic!("{e}"));
    let mut all = Vec::new();
    let deadline = Instant::now() + patience;
    while all.len() < expected && Instant::now() < deadline {
        if let Some(Ok(message)) = consumer.poll(Duration::from_millis(200)) {
            let headers = message.headers().map(|h| {
                h.iter()
                    .map(|h| (h.key.to_owned(), String::from_utf8_lossy(h.value.unwrap_or_default()).into_owned()))
                    .collect()
            });
            all.push(headers.unwrap_or_default());
        }
    }
    all
}
