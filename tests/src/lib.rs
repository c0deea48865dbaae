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
use std::time::{Duration, Instant};

pub use serde_json;

pub fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set: run the tests with deploy/test.sh"))
}

fn bin(name: &str) -> PathBuf {
    PathBuf::from(env("INTAKE_BIN_DIR")).join(name)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).unwrap_or(0)
}

/// Options of a stack; the defaults are the production defaults.
#[derive(Clone, Debug)]
pub struct StackOptions {
    pub write_timeout_ms: u64,
    pub auth_cache_ttl_ms: u64,
    pub requests_per_minute: u64,
    pub conversions_per_minute: u64,
    pub redis_url: Option<String>,
    pub start_writer: bool,
    /// A database of the stack's own instead of `DATABASE_URL`.
    pub database_url: Option<String>,
}

impl Default for StackOptions {
    fn default() -> Self {
        StackOptions {
            write_timeout_ms: 10_000,
            auth_cache_ttl_ms: 2_000,
            requests_per_minute: 600,
            conversions_per_minute: 30_000,
            redis_url: None,
            start_writer: true,
            database_url: None,
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
    writers: Vec<Child>,
    options: StackOptions,
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
        let mut stack = Stack {
            base_url: format!("http://127.0.0.1:{port}"),
            ops_url: format!("http://127.0.0.1:{ops_port}"),
            http: reqwest::Client::builder().timeout(Duration::from_secs(60)).build().unwrap_or_default(),
            log_dir,
            topic_prefix,
            gateway: Command::new("true").spawn().unwrap_or_else(|e| panic!("{e}")),
            writers: Vec::new(),
            options,
        };
        stack.run_writer_command(&["topics", "--request-partitions", "4", "--reply-partitions", "2"])
            .unwrap_or_else(|e| panic!("creating topics: {e:#}"));
        stack.gateway = stack.spawn_gateway(port, ops_port);
        if stack.options.start_writer {
            stack.start_writer();
        }
        stack.wait_ready().await;
        stack
    }

    /// The environment of every process of the stack: its topics, group and database.
    fn child_env(&self, command: &mut Command) {
        if let Some(url) = &self.options.database_url {
            command.env("DATABASE_URL", url);
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

    fn spawn_gateway(&self, port: u16, ops_port: u16) -> Child {
        let mut command = Command::new(bin("intake-gateway"));
        self.child_env(&mut command);
        let options = &self.options;
        command
            .args(["--listen", &format!("127.0.0.1:{port}"), "--ops-listen", &format!("127.0.0.1:{ops_port}")])
            .args(["--write-timeout-ms", &options.write_timeout_ms.to_string()])
            .args(["--auth-cache-ttl-ms", &options.auth_cache_ttl_ms.to_string()])
            .args(["--requests-per-minute", &options.requests_per_minute.to_string()])
            .args(["--conversions-per-minute", &options.conversions_per_minute.to_string()])
            .args(["--reply-partition", "1"]);
        if let Some(url) = &options.redis_url {
            command.args(["--redis-url", url]);
        }
        command
            .stdout(self.log_file("gateway"))
            .stderr(self.log_file("gateway"))
            .spawn()
            .unwrap_or_else(|e| panic!("starting the gateway: {e}"))
    }

    /// Starts one more writer in the stack's consumer group.
    pub fn start_writer(&mut self) {
        let mut command = Command::new(bin("intake-writer"));
        self.child_env(&mut command);
        let child = command
            .arg("run")
            .stdout(self.log_file("writer"))
            .stderr(self.log_file("writer"))
            .spawn()
            .unwrap_or_else(|e| panic!("starting a writer: {e}"));
        self.writers.push(child);
    }

    /// Stops every writer: gracefully (SIGTERM) or by SIGKILL.
    pub fn stop_writers(&mut self, graceful: bool) {
        for mut writer in self.writers.drain(..) {
            let signal = if graceful { "-TERM" } else { "-KILL" };
            let _ = Command::new("kill").args([signal, &writer.id().to_string()]).status();
            let _ = writer.wait();
        }
    }

    /// Sends SIGTERM to the gateway and returns a handle on its exit.
    pub fn terminate_gateway(&mut self) -> std::thread::JoinHandle<Option<std::process::ExitStatus>> {
        let _ = Command::new("kill").args(["-TERM", &self.gateway.id().to_string()]).status();
        let mut gateway = std::mem::replace(&mut self.gateway, Command::new("true").spawn().unwrap_or_else(|e| panic!("{e}")));
        std::thread::spawn(move || gateway.wait().ok())
    }

    async fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Ok(response) = self.http.get(format!("{}/readyz", self.ops_url)).send().await {
                if response.status().is_success() {
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("the gateway did not become ready; see {}", self.log_dir.display());
    }

    /// Runs an operator command with this stack's topics and returns its JSON output.
    pub fn run_writer_command(&self, args: &[&str]) -> Result<Value> {
        let mut command = Command::new(bin("intake-writer"));
        self.child_env(&mut command);
        let output = command.args(args).stdin(Stdio::null()).output().context("running intake-writer")?;
        if !output.status.success() {
            bail!("intake-writer {args:?} failed: {}", String::from_utf8_lossy(&output.stderr));
        }
        serde_json::from_slice(&output.stdout).context("intake-writer printed no JSON")
    }

    /// A new workspace with one key of the given scopes.
    pub fn workspace_with_scopes(&self, scopes: &str) -> TestKey {
        let workspace = self.run_writer_command(&["workspace", "create", "--name", "Test", "--site", "shop.example"])
            .unwrap_or_else(|e| panic!("{e:#}"));
        let workspace_id = workspace["id"].as_str().unwrap_or_default().to_owned();
        let key = self.run_writer_command(&["key", "create", "--workspace", &workspace_id, "--scopes", scopes])
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

    pub async fn send(&self, method: reqwest::Method, path: &str, authorization: Option<&str>, body: Option<&Value>) -> Reply {
        self.client().send(method, path, authorization, body).await
    }

    pub async fn post(&self, path: &str, key: &TestKey, body: &Value) -> Reply {
        self.client().post(path, key, body).await
    }

    pub async fn get(&self, path: &str, key: &TestKey) -> Reply {
        self.send(reqwest::Method::GET, path, Some(&key.bearer()), None).await
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
        let _ = self.gateway.kill();
        let _ = self.gateway.wait();
        for writer in &mut self.writers {
            let _ = writer.kill();
            let _ = writer.wait();
        }
    }
}

#[derive(Clone)]
pub struct Client {
    http: reqwest::Client,
    base_url: String,
}

impl Client {
    pub async fn send(&self, method: reqwest::Method, path: &str, authorization: Option<&str>, body: Option<&Value>) -> Reply {
        let mut request = self.http.request(method, format!("{}{path}", self.base_url));
        if let Some(authorization) = authorization {
            request = request.header("Authorization", authorization);
        }
        if let Some(body) = body {
            request = request.json(body);
        }
        Reply::from(request.send().await.unwrap_or_else(|e| panic!("request failed: {e}"))).await
    }

    pub async fn post(&self, path: &str, key: &TestKey, body: &Value) -> Reply {
        self.send(reqwest::Method::POST, path, Some(&key.bearer()), Some(body)).await
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
}

impl Reply {
    async fn from(response: reqwest::Response) -> Reply {
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let text = response.text().await.unwrap_or_default();
        let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
        Reply { status, headers, body }
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

/// A conversion input with the required fields and a fresh external id.
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
    let metadata = consumer.fetch_metadata(Some(topic), Duration::from_secs(10)).unwrap_or_else(|e| panic!("metadata: {e}"));
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
