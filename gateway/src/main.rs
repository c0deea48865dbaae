//! `intake-gateway`: the HTTP API. It authenticates, rate-limits, validates and hashes each
//! request, writes through Kafka and answers with the writer's reply. It reads PostgreSQL
//! (keys, workspaces, sites) and never writes it.

mod api_error;
mod app;
mod auth;
mod body;
mod conversions;
mod metrics;
mod openapi;
mod ratelimit;
mod response;
mod routes;
mod workspace;
mod writes;

use app::App;
use clap::Parser;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use hyper_util::server::graceful::GracefulShutdown;
use intake_common::config::{init_logging, DatabaseArgs, KafkaArgs, LogArgs};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;

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
    /// How long a write waits for the writer before answering 500 internal_error.
    #[arg(long, env = "INTAKE_WRITE_TIMEOUT_MS", default_value_t = 10_000)]
    write_timeout_ms: u64,
    /// How long a key lookup is cached; revocation takes effect within this time.
    #[arg(long, env = "INTAKE_AUTH_CACHE_TTL_MS", default_value_t = 2_000)]
    auth_cache_ttl_ms: u64,
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
    /// How long shutdown waits for in-flight requests.
    #[arg(long, env = "INTAKE_SHUTDOWN_GRACE_MS", default_value_t = 15_000)]
    shutdown_grace_ms: u64,
    #[command(flatten)]
    database: DatabaseArgs,
    #[command(flatten)]
    kafka: KafkaArgs,
    #[command(flatten)]
    log: LogArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    intake_common::reference::print_if_asked::<Config>();
    let config = Config::parse();
    init_logging(&config.log);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(config.database.pool_size)
        .acquire_timeout(Duration::from_secs(3))
        .connect_lazy(&config.database.url)?;
    let writes = writes::WriteClient::start(&config.kafka, config.reply_partition, Duration::from_millis(config.write_timeout_ms)).await?;
    let app = Arc::new(App {
        auth: auth::Authenticator::new(pool.clone(), Duration::from_millis(config.auth_cache_ttl_ms)),
        limiter: ratelimit::RateLimiter::new(
            &config.redis_url,
            Duration::from_millis(config.redis_timeout_ms),
            config.requests_per_minute,
            config.conversions_per_minute,
        )?,
        pool,
        writes,
        metrics: metrics::Metrics::new(),
        script_base_url: config.script_base_url,
    });

    let api = TcpListener::bind(config.listen).await?;
    let ops = TcpListener::bind(config.ops_listen).await?;
    tracing::info!(listen = %config.listen, ops = %config.ops_listen, "gateway ready");
    let api_app = app.clone();
    let api_server = serve(api, move |request| {
        let app = api_app.clone();
        async move { app.handle(request).await }
    }, intake_common::service::shutdown_signal(), Duration::from_millis(config.shutdown_grace_ms));
    tokio::spawn(serve(ops, move |request| {
        let app = app.clone();
        async move { app::handle_ops(&app, request).await }
    }, std::future::pending(), Duration::ZERO));
    api_server.await;
    Ok(())
}

/// Accepts HTTP/1.1 connections until `shutdown`, then waits for open connections to finish.
async fn serve<H, F>(listener: TcpListener, handler: H, shutdown: impl std::future::Future<Output = ()>, grace: Duration)
where
    H: Fn(http::Request<hyper::body::Incoming>) -> F + Clone + Send + Sync + 'static,
    F: std::future::Future<Output = response::Response> + Send + 'static,
{
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(error) => {
                    tracing::warn!(%error, "accept failed");
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let handler = handler.clone();
        let service = service_fn(move |request| {
            let handler = handler.clone();
            async move { Ok::<_, Infallible>(handler(request).await) }
        });
        let connection = http1::Builder::new().serve_connection(TokioIo::new(stream), service);
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            let _ = connection.await;
        });
    }
    tracing::info!("shutting down; finishing in-flight requests");
    if tokio::time::timeout(grace, graceful.shutdown()).await.is_err() {
        tracing::warn!("shutdown grace period over; closing remaining connections");
    }
}
