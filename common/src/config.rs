//! Settings both programs take, from flags or environment variables.

use clap::Args;

#[derive(Debug, Clone, Args)]
pub struct DatabaseArgs {
    /// PostgreSQL connection URL. The writer and its commands also take the nodes of an HA
    /// cluster in libpq's multi-host form (postgres://user@node-1:5432,node-2:5432/intake) and
    /// use whichever takes writes, following it through a failover; the gateway takes one
    /// address.
    #[arg(long = "database-url", env = "DATABASE_URL")]
    pub url: String,
    /// Connections in the pool.
    #[arg(long = "database-pool-size", env = "INTAKE_DATABASE_POOL_SIZE", default_value_t = 8)]
    pub pool_size: u32,
}

#[derive(Debug, Clone, Args)]
pub struct KafkaArgs {
    /// Bootstrap brokers, comma-separated host:port.
    #[arg(long = "kafka-brokers", env = "INTAKE_KAFKA_BROKERS", default_value = "127.0.0.1:9092")]
    pub brokers: String,
    /// Extra librdkafka properties as key=value, comma-separated or repeated; they override the
    /// defaults of common/src/kafka.rs. Security and broker-specific tuning go here
    /// (security.protocol=SASL_SSL,sasl.mechanism=SCRAM-SHA-512,...).
    #[arg(long = "kafka-option", env = "INTAKE_KAFKA_OPTIONS", value_delimiter = ',', value_parser = parse_key_value)]
    pub options: Vec<(String, String)>,
    /// Topic of write requests, keyed by workspace id.
    #[arg(long, env = "INTAKE_REQUESTS_TOPIC", default_value = "intake.requests")]
    pub requests_topic: String,
    /// Topic of the writer's replies; one partition per gateway.
    #[arg(long, env = "INTAKE_REPLIES_TOPIC", default_value = "intake.replies")]
    pub replies_topic: String,
    /// Dead-letter topic for requests that cannot be applied.
    #[arg(long, env = "INTAKE_DLQ_TOPIC", default_value = "intake.requests.dlq")]
    pub dlq_topic: String,
}

fn parse_key_value(text: &str) -> Result<(String, String), String> {
    let (key, value) = text.split_once('=').ok_or_else(|| format!("expected key=value, got {text:?}"))?;
    Ok((key.trim().to_owned(), value.trim().to_owned()))
}

#[derive(Debug, Clone, Args)]
pub struct LogArgs {
    /// Log filter (tracing's EnvFilter syntax).
    #[arg(long = "log", env = "INTAKE_LOG", default_value = "info")]
    pub filter: String,
    /// Log lines as JSON objects instead of text.
    #[arg(long = "log-json", env = "INTAKE_LOG_JSON")]
    pub json: bool,
}

/// Milliseconds since the Unix epoch, by the system clock.
pub fn now_ms() -> i64 {
    let now = time::OffsetDateTime::now_utc();
    i64::try_from(now.unix_timestamp_nanos() / 1_000_000).unwrap_or(i64::MAX)
}

/// Microseconds since the Unix epoch, by the system clock: the instants a write's stages are
/// timed by across processes.
pub fn now_us() -> i64 {
    let now = time::OffsetDateTime::now_utc();
    i64::try_from(now.unix_timestamp_nanos() / 1_000).unwrap_or(i64::MAX)
}

pub use crate::log_writer::LogGuard;

/// Structured log lines to stderr, through a buffer that a thread of its own writes
/// (`log_writer.rs`): a request never waits on the log. Request bodies are never logged
/// anywhere in the project. Hold the guard until the process ends.
#[must_use = "dropping the guard stops the log"]
pub fn init_logging(args: &LogArgs) -> LogGuard {
    let filter = tracing_subscriber::EnvFilter::try_new(&args.filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let (writer, guard) = crate::log_writer::buffered_stderr();
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(writer);
    if args.json {
        builder.json().init();
    } else {
        builder.with_ansi(false).init();
    }
    guard
}
