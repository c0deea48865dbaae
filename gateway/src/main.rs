//! `intake-gateway`: the HTTP API. It authenticates, rate-limits, validates and hashes each
//! request, writes through Kafka and answers with the writer's reply. It reads PostgreSQL
//! (keys, workspaces, sites) and never writes it.

mod api_error;
mod app;
mod auth;
mod body;
mod context;
mod conversions;
mod layers;
mod limits;
mod metrics;
mod openapi;
mod overload;
mod parse_errors;
mod ratelimit;
mod ready;
mod request_body;
mod response;
mod routes;
mod server;
mod sink;
mod state;
mod timing;
mod tls;
mod validate_only;
mod workspace;
mod writes;

use clap::Parser;
use intake_common::config::{init_logging, DatabaseArgs, KafkaArgs, LogArgs};
use intake_model::error::ErrorCode;
use parse_errors::OnRefusedHead;
use prometheus_client::metrics::gauge::Gauge;
use routes::Route;
use state::AppState;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// See the workspace Cargo.toml: the allocator showed in the profile.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(name = "intake-gateway", version, about)]
struct Config {
    /// Address of the API.
    #[arg(long, env = "INTAKE_LISTEN", default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// Address of /healthz, /readyz and /metrics.
    #[arg(long, env = "INTAKE_OPS_LISTEN", default_value = "127.0.0.1:8081")]
    ops_listen: SocketAddr,
    /// The partition of the replies topic this gateway reads; unique per gateway instance.
    #[arg(long, env = "INTAKE_REPLY_PARTITION", default_value_t = 0)]
    reply_partition: i32,
    /// How long a write waits for the writer before answering 500 internal_error: one deadline
    /// for the whole request, all its chunks included.
    #[arg(long, env = "INTAKE_WRITE_TIMEOUT_MS", default_value_t = 10_000)]
    write_timeout_ms: u64,
    /// How far the brokers' clocks may be behind this gateway's: a message's deadline is set
    /// this much before the gateway stops waiting, so that a writer refuses every chunk that
    /// reached Kafka after the gateway answered 500 (at most half the write timeout).
    #[arg(long, env = "INTAKE_CLOCK_SKEW_MARGIN_MS", default_value_t = 1_000)]
    clock_skew_margin_ms: u64,
    /// How long a known key's lookup is cached; revocation, suspension and deletion take effect
    /// within this time (at most 5 s).
    #[arg(long, env = "INTAKE_AUTH_CACHE_TTL_MS", default_value_t = 2_000, value_parser = clap::value_parser!(u64).range(0..=5_000))]
    auth_cache_ttl_ms: u64,
    /// How long an unknown key is remembered as unknown (capped at the known-key time).
    #[arg(long, env = "INTAKE_UNKNOWN_KEY_CACHE_TTL_MS", default_value_t = 1_000)]
    unknown_key_cache_ttl_ms: u64,
    /// Keys the cache holds at most.
    #[arg(long, env = "INTAKE_KEY_CACHE_CAPACITY", default_value_t = 100_000)]
    key_cache_capacity: u64,
    /// While PostgreSQL cannot be reached, how long a key keeps the last answer the database
    /// gave for it, counted from that answer (a database outage then delays writes instead of
    /// refusing every key); at most 10 minutes, and longer than the cache's time; 0 for none.
    #[arg(long, env = "INTAKE_AUTH_STALE_TTL_MS", default_value_t = 600_000, value_parser = clap::value_parser!(u64).range(0..=600_000))]
    auth_stale_ttl_ms: u64,
    /// How long a key look-up may take, its database connection included; past it the look-up
    /// has failed, and the key's last known answer is used.
    #[arg(long, env = "INTAKE_DATABASE_ACQUIRE_TIMEOUT_MS", default_value_t = 3_000)]
    database_acquire_timeout_ms: u64,
    /// Base address of the install script, for GET /v1/workspace.
    #[arg(long, env = "INTAKE_SCRIPT_BASE_URL", default_value = "https://cdn.intake.example")]
    script_base_url: String,
    #[arg(long, env = "INTAKE_REDIS_URL", default_value = "redis://127.0.0.1:6379")]
    redis_url: String,
    /// Past this, a rate-limit check lets the request through.
    #[arg(long, env = "INTAKE_REDIS_TIMEOUT_MS", default_value_t = 50)]
    redis_timeout_ms: u64,
    #[arg(long, env = "INTAKE_REQUESTS_PER_MINUTE", default_value_t = 600)]
    requests_per_minute: u64,
    #[arg(long, env = "INTAKE_CONVERSIONS_PER_MINUTE", default_value_t = 30_000)]
    conversions_per_minute: u64,
    /// The length of a rate-limit window, 1 to 60 s; the two limits above count per window.
    /// Windows are aligned to multiples of it since the Unix epoch. Shorter than the minute only
    /// for tests, which then need not wait for a fresh window.
    #[arg(long, env = "INTAKE_RATE_LIMIT_WINDOW_MS", default_value_t = 60_000,
        value_parser = clap::value_parser!(u64).range(*ratelimit::Window::MILLIS.start()..=*ratelimit::Window::MILLIS.end()))]
    rate_limit_window_ms: u64,
    /// A request's head must have arrived this long after the connection was ready for it
    /// (opened, or its previous response sent); else the connection is closed.
    #[arg(long, env = "INTAKE_HEADER_READ_TIMEOUT_MS", default_value_t = 10_000)]
    header_read_timeout_ms: u64,
    /// A request's whole body must have arrived this long after the gateway started reading it;
    /// else 408 request_timeout (and on HTTP/1.1 the connection is closed; on HTTP/2 the stream
    /// ends, the connection goes on).
    #[arg(long, env = "INTAKE_BODY_READ_TIMEOUT_MS", default_value_t = 10_000)]
    body_read_timeout_ms: u64,
    /// A connection with no request in progress this long after its last response is closed
    /// (HTTP/2: with GOAWAY; one that opened and asked nothing, after the header read timeout).
    /// At most the header read timeout, whose clock also runs between requests.
    #[arg(long, env = "INTAKE_KEEP_ALIVE_TIMEOUT_MS", default_value_t = 5_000)]
    keep_alive_timeout_ms: u64,
    /// Open API connections at most, HTTP/1.1 and HTTP/2 alike; beyond it, new connections wait
    /// in the listen backlog.
    #[arg(long, env = "INTAKE_MAX_CONNECTIONS", default_value_t = 1_024)]
    max_connections: usize,
    /// PEM file of the API's TLS certificate chain, leaf first. With --tls-key, the API port
    /// speaks HTTPS only (HTTP/1.1 and HTTP/2 by ALPN); the files are read again when they
    /// change. Without, plain HTTP/1.1 and HTTP/2 with prior knowledge (h2c). The ops port is
    /// always plain HTTP.
    #[arg(long, env = "INTAKE_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<std::path::PathBuf>,
    /// PEM file of the private key of --tls-cert (PKCS#8, PKCS#1 or SEC1).
    #[arg(long, env = "INTAKE_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<std::path::PathBuf>,
    /// A TLS handshake must be over this long after the connection was accepted (and within the
    /// header read timeout); else the connection is closed.
    #[arg(long, env = "INTAKE_TLS_HANDSHAKE_TIMEOUT_MS", default_value_t = 10_000)]
    tls_handshake_timeout_ms: u64,
    /// HTTP/2: requests (streams) open at once on one connection at most.
    #[arg(long, env = "INTAKE_HTTP2_MAX_CONCURRENT_STREAMS", default_value_t = 100)]
    http2_max_concurrent_streams: u32,
    /// HTTP/2: the size of a request's header list at most, in bytes as RFC 9113 counts it
    /// (names, values and 32 bytes per field); larger is refused with 431 on its stream.
    #[arg(long, env = "INTAKE_HTTP2_MAX_HEADER_LIST_SIZE", default_value_t = 16_384)]
    http2_max_header_list_size: u32,
    /// HTTP/2: how often the gateway pings each connection; 0 turns pings off.
    #[arg(long, env = "INTAKE_HTTP2_KEEP_ALIVE_INTERVAL_MS", default_value_t = 20_000)]
    http2_keep_alive_interval_ms: u64,
    /// HTTP/2: a connection whose client does not answer a ping within this is closed.
    #[arg(long, env = "INTAKE_HTTP2_KEEP_ALIVE_TIMEOUT_MS", default_value_t = 10_000)]
    http2_keep_alive_timeout_ms: u64,
    /// Requests being served at most, on every route; beyond it, 503 service_unavailable.
    #[arg(long, env = "INTAKE_MAX_REQUESTS_IN_FLIGHT", default_value_t = 512)]
    max_requests_in_flight: usize,
    /// Writes admitted and not yet answered at most; beyond it, 503 service_unavailable before
    /// the body is read.
    #[arg(long, env = "INTAKE_MAX_WRITES_IN_FLIGHT", default_value_t = 256)]
    max_writes_in_flight: usize,
    /// Percent of --max-writes-in-flight that one workspace may hold (its writes not yet
    /// answered by a writer, including those whose request gave up); beyond it, its writes get
    /// 503 service_unavailable and the others' still get in.
    #[arg(long, env = "INTAKE_WORKSPACE_WRITE_SHARE_PERCENT", default_value_t = 25, value_parser = clap::value_parser!(u8).range(1..=100))]
    workspace_write_share_percent: u8,
    /// A workspace's writes wait and no reply has answered one of them for this long: its
    /// writer is stuck or far behind on it, and its new writes get 503 service_unavailable
    /// until a reply comes (other workspaces are not affected). Default: the write timeout.
    #[arg(long, env = "INTAKE_REPLY_STALL_MS")]
    reply_stall_ms: Option<u64>,
    /// After SIGTERM, how long the API keeps serving while /readyz answers 503, so that load
    /// balancers stop sending before the listener closes.
    #[arg(long, env = "INTAKE_SHUTDOWN_DELAY_MS", default_value_t = 0)]
    shutdown_delay_ms: u64,
    /// How long shutdown waits for in-flight requests.
    #[arg(long, env = "INTAKE_SHUTDOWN_GRACE_MS", default_value_t = 15_000)]
    shutdown_grace_ms: u64,
    /// For tests only: GET /_test/panic panics inside the request, to show that a panic is
    /// answered 500 internal_error. Off unless given; no environment variable turns it on.
    #[arg(long)]
    panic_test_route: bool,
    #[command(flatten)]
    database: DatabaseArgs,
    #[command(flatten)]
    kafka: KafkaArgs,
    #[command(flatten)]
    log: LogArgs,
}

impl Config {
    /// The rules between flags that clap cannot state.
    fn check(&self) -> anyhow::Result<()> {
        if self.keep_alive_timeout_ms > self.header_read_timeout_ms {
            anyhow::bail!("--keep-alive-timeout-ms must not exceed --header-read-timeout-ms");
        }
        // A last answer is kept for the stale time less the cache's time (auth.rs), so a stale
        // time no longer than the cache's would keep none, silently.
        if self.auth_stale_ttl_ms != 0 && self.auth_stale_ttl_ms <= self.auth_cache_ttl_ms {
            anyhow::bail!(
                "--auth-stale-ttl-ms must be 0 (no stale answers) or longer than --auth-cache-ttl-ms ({} ms)",
                self.auth_cache_ttl_ms
            );
        }
        Ok(())
    }
}

const fn ms(millis: u64) -> Duration {
    Duration::from_millis(millis)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    intake_common::reference::print_if_asked::<Config>();
    let config = Config::parse();
    let _log = init_logging(&config.log);
    log_panics_without_their_message();
    config.check()?;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(config.database.pool_size)
        .acquire_timeout(ms(config.database_acquire_timeout_ms))
        .connect_lazy(&config.database.url)?;
    let metrics = metrics::Metrics::new();
    let readiness = Arc::new(ready::Readiness::default());
    let settings = server::Settings {
        header_read_timeout: ms(config.header_read_timeout_ms),
        keep_alive_timeout: ms(config.keep_alive_timeout_ms),
        max_connections: config.max_connections,
        shutdown_grace: ms(config.shutdown_grace_ms),
        tls_handshake_timeout: ms(config.tls_handshake_timeout_ms),
        http2: server::Http2Settings {
            max_concurrent_streams: config.http2_max_concurrent_streams,
            max_header_list_size: config.http2_max_header_list_size,
            keep_alive_interval: (config.http2_keep_alive_interval_ms > 0)
                .then(|| ms(config.http2_keep_alive_interval_ms)),
            keep_alive_timeout: ms(config.http2_keep_alive_timeout_ms),
        },
    };
    let shutdown = CancellationToken::new();
    // Read before anything else, so that a bad certificate stops the start at once.
    let tls = match (config.tls_cert.clone(), config.tls_key.clone()) {
        (Some(cert), Some(key)) => Some(tls::acceptor(tls::Files { cert, key }, shutdown.clone())?),
        _ => None,
    };
    // Both ports are bound at once (a port in use fails the start). The ops port serves first, so
    // that /healthz and /readyz answer while Kafka is being reached, and until the process exits
    // (so /readyz answers 503 during shutdown).
    let ops = TcpListener::bind(config.ops_listen).await?;
    let api = TcpListener::bind(config.listen).await?;
    let ops_service = {
        let (readiness, metrics) = (readiness.clone(), metrics.clone());
        tower::service_fn(move |request| {
            let (readiness, metrics) = (readiness.clone(), metrics.clone());
            async move { Ok::<_, Infallible>(app::handle_ops(&readiness, &metrics, request).await) }
        })
    };
    // The ops port's requests are not counted in the request metrics, nor are its refused heads.
    tokio::spawn(server::serve(
        ops,
        None,
        ops_service,
        settings,
        Arc::new(|_| ()),
        Gauge::default(),
        CancellationToken::new(),
    ));

    let write_timeout = ms(config.write_timeout_ms);
    let writes = writes::WriteClient::start(
        &config.kafka,
        config.reply_partition,
        write_timeout,
        ms(config.clock_skew_margin_ms),
        metrics.clone(),
    )
    .await?;
    let key_cache = auth::CacheSettings {
        ttl: ms(config.auth_cache_ttl_ms),
        unknown_ttl: ms(config.unknown_key_cache_ttl_ms),
        capacity: config.key_cache_capacity,
        stale_ttl: ms(config.auth_stale_ttl_ms),
        lookup_timeout: ms(config.database_acquire_timeout_ms),
    };
    let state = Arc::new(AppState {
        auth: Arc::new(auth::Authenticator::new(pool.clone(), key_cache, metrics.clone())),
        limiter: Arc::new(ratelimit::RateLimiter::new(
            &config.redis_url,
            ms(config.redis_timeout_ms),
            ratelimit::Window::from_millis(config.rate_limit_window_ms),
            config.requests_per_minute,
            config.conversions_per_minute,
            metrics.clone(),
        )?),
        admission: overload::Admission::new(
            config.max_writes_in_flight,
            config.workspace_write_share_percent,
            config.reply_stall_ms.map_or(write_timeout, ms),
            metrics.clone(),
        ),
        pool: pool.clone(),
        writes: writes.clone(),
        metrics,
        script_base_url: config.script_base_url,
        body_read_timeout: ms(config.body_read_timeout_ms),
        panic_test_route: config.panic_test_route,
    });

    tracing::info!(listen = %config.listen, ops = %config.ops_listen, tls = tls.is_some(), "gateway listening");
    let refused_head: OnRefusedHead = {
        let metrics = state.metrics.clone();
        Arc::new(move |code: ErrorCode| metrics.observe(Route::UNKNOWN, code.status(), Duration::ZERO))
    };
    let open_connections = state.metrics.connections.clone();
    let api_server = tokio::spawn(server::serve(
        api,
        tls,
        app::api_service(state, config.max_requests_in_flight),
        settings,
        refused_head,
        open_connections,
        shutdown.clone(),
    ));
    // Only now can it be ready: a probe that sees 200 finds the API accepting.
    tokio::spawn(readiness.clone().keep_checking(pool, writes));
    intake_common::service::shutdown_signal().await;
    readiness.shutting_down();
    tracing::info!(delay_ms = config.shutdown_delay_ms, "shutting down: not ready; finishing in-flight requests");
    tokio::time::sleep(ms(config.shutdown_delay_ms)).await;
    shutdown.cancel();
    api_server.await?;
    tracing::info!("stopped");
    Ok(())
}

/// A panic is logged with where it happened, never with its message: the message of a panic in
/// validation or normalization may quote the input (an email, a phone, an address). The request
/// it happened in is logged by the catch-panic layer, with its id.
fn log_panics_without_their_message() {
    std::panic::set_hook(Box::new(|info| {
        let location = info.location().map(|l| format!("{}:{}", l.file(), l.line())).unwrap_or_default();
        tracing::error!(%location, "panic");
    }));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Config, clap::Error> {
        Config::try_parse_from(["intake-gateway", "--database-url", "postgres://localhost/intake"].iter().chain(args))
    }

    #[test]
    fn the_documented_limits_and_deadline_are_the_defaults() {
        let config = parse(&[]).unwrap_or_else(|e| panic!("{e}"));
        // docs/api.md, "Limits" and "Authentication".
        assert_eq!(config.requests_per_minute, 600);
        assert_eq!(config.conversions_per_minute, 30_000);
        assert_eq!(config.rate_limit_window_ms, 60_000);
        assert_eq!(config.write_timeout_ms, 10_000);
        assert!(config.auth_cache_ttl_ms <= 5_000);
        assert_eq!(config.auth_stale_ttl_ms, 600_000);
    }

    #[test]
    fn key_answers_cannot_be_kept_longer_than_documented() {
        assert!(parse(&["--auth-cache-ttl-ms", "5001"]).is_err(), "a revocation is seen within 5 s");
        assert!(parse(&["--auth-stale-ttl-ms", "600001"]).is_err(), "a stale answer lives 10 minutes at most");
        assert!(parse(&["--auth-stale-ttl-ms", "600000"]).is_ok());
    }

    #[test]
    fn a_stale_time_that_would_keep_no_answer_is_refused() {
        let checked =
            |args: &[&str]| parse(args).map_err(|e| e.to_string()).and_then(|c| c.check().map_err(|e| e.to_string()));
        let refused = checked(&["--auth-stale-ttl-ms", "2000", "--auth-cache-ttl-ms", "2000"]);
        assert!(refused.is_err_and(|e| e.contains("--auth-stale-ttl-ms")));
        assert!(checked(&["--auth-stale-ttl-ms", "2001", "--auth-cache-ttl-ms", "2000"]).is_ok());
        assert!(checked(&["--auth-stale-ttl-ms", "0"]).is_ok(), "0 turns stale answers off");
        assert!(checked(&["--keep-alive-timeout-ms", "30001", "--header-read-timeout-ms", "30000"]).is_err());
    }
}
