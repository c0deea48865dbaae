//! The HTTP/1.1 server under both ports: hyper connections driving a tower service, with slow
//! and idle clients bounded.
//!
//! - A connection must deliver a request's head within the header read timeout of being ready
//!   for it (opened, or its previous response sent): hyper's own header timer.
//! - A connection with no request for the keep-alive timeout after a response is closed.
//! - At most `max_connections` are open; beyond that, new connections wait in the kernel's
//!   listen backlog until one closes (the timeouts bound how long that can take).
//! - A connection that ends with part of a request unread (a body refused with 413, 408 or 503
//!   before it was read) is closed in stages, as RFC 9112 section 9.6 asks: the response is
//!   sent, the write side shut, and what the client still sends is read and dropped for a
//!   moment, so that the client reads the response instead of a TCP reset.
//! - On shutdown the listener closes, idle connections close, and busy ones finish their
//!   request (answered with `Connection: close`), for at most the grace period.

use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::ServiceBuilder;

/// How long a closing connection reads and drops what its client still sends, and how much.
const LINGER: Duration = Duration::from_secs(2);
const LINGER_MAX_BYTES: usize = 64 * 1024 * 1024;
/// After a failed accept (out of file descriptors, say), before trying again.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

#[derive(Debug, Clone, Copy)]
pub struct Settings {
    pub header_read_timeout: Duration,
    pub keep_alive_timeout: Duration,
    pub max_connections: usize,
    pub shutdown_grace: Duration,
}

/// Serves connections until `shutdown` is cancelled, then lets open ones finish (up to the grace
/// period).
pub async fn serve<S, B>(listener: TcpListener, service: S, settings: Settings, shutdown: CancellationToken)
where
    S: tower::Service<http::Request<Incoming>, Response = http::Response<B>, Error = Infallible>
        + Clone
        + Send
        + Unpin
        + 'static,
    S::Future: Send + 'static,
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let slots = Arc::new(Semaphore::new(settings.max_connections));
    let connections = TaskTracker::new();
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(settings.header_read_timeout);
    loop {
        let slot = tokio::select! {
            slot = slots.clone().acquire_owned() => match slot {
                Ok(slot) => slot,
                Err(_) => break,
            },
            () = shutdown.cancelled() => break,
        };
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(error) => {
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            },
            () = shutdown.cancelled() => break,
        };
        let _ = stream.set_nodelay(true);
        connections.spawn(connection(
            http.clone(),
            stream,
            service.clone(),
            settings.keep_alive_timeout,
            shutdown.clone(),
            slot,
        ));
    }
    drop(listener);
    connections.close();
    if tokio::time::timeout(settings.shutdown_grace, connections.wait()).await.is_err() {
        tracing::warn!("shutdown grace period over; closing remaining connections");
    }
}

async fn connection<S, B>(
    http: http1::Builder,
    stream: TcpStream,
    service: S,
    keep_alive_timeout: Duration,
    shutdown: CancellationToken,
    _slot: OwnedSemaphorePermit,
) where
    S: tower::Service<http::Request<Incoming>, Response = http::Response<B>, Error = Infallible>
        + Clone
        + Send
        + Unpin
        + 'static,
    S::Future: Send + 'static,
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let (activity, idle) = watch::channel(None);
    let activity = Arc::new(activity);
    let service = ServiceBuilder::new()
        .map_future(move |response| {
            let busy = Busy::start(activity.clone());
            Box::pin(async move {
                let response = response.await;
                drop(busy);
                response
            })
        })
        .service(service);
    let mut connection = http.serve_connection(TokioIo::new(stream), TowerToHyperService::new(service));
    let idle_expired = idle_for(idle, keep_alive_timeout);
    tokio::pin!(idle_expired);
    let mut closing = false;
    let done = loop {
        tokio::select! {
            done = std::future::poll_fn(|cx| std::pin::Pin::new(&mut connection).poll_without_shutdown(cx)) => break done,
            () = shutdown.cancelled(), if !closing => {
                closing = true;
                std::pin::Pin::new(&mut connection).graceful_shutdown();
            }
            () = &mut idle_expired, if !closing => {
                closing = true;
                std::pin::Pin::new(&mut connection).graceful_shutdown();
            }
        }
    };
    match done {
        Ok(()) => linger_close(connection.into_parts().io.into_inner()).await,
        // A client too slow with its head gets no more of the server's time.
        Err(error) if error.is_timeout() => {}
        Err(_) => linger_close(connection.into_parts().io.into_inner()).await,
    }
}

/// Marks the connection busy while a request is served; idle from the moment it is answered.
/// hyper 1's HTTP/1 server has a header read timer but no keep-alive idle timeout of its own.
struct Busy(Arc<watch::Sender<Option<Instant>>>);

impl Busy {
    fn start(activity: Arc<watch::Sender<Option<Instant>>>) -> Busy {
        activity.send_replace(None);
        Busy(activity)
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.send_replace(Some(Instant::now()));
    }
}

/// Resolves once the connection has been idle (answered its last request, not started another)
/// for `limit`. Before the first request, hyper's header read timeout governs alone.
async fn idle_for(mut activity: watch::Receiver<Option<Instant>>, limit: Duration) {
    loop {
        let idle_since = *activity.borrow_and_update();
        let changed = match idle_since {
            Some(since) => tokio::select! {
                () = tokio::time::sleep_until(since + limit) => return,
                changed = activity.changed() => changed,
            },
            None => activity.changed().await,
        };
        if changed.is_err() {
            return std::future::pending().await;
        }
    }
}

/// RFC 9112 section 9.6: close the write side after the response, then read and drop what the
/// client still sends until it closes, for a bounded time and amount, then close. Closing at
/// once with unread data would send a TCP reset that can destroy the response in the client's
/// receive buffer before it is read.
async fn linger_close(mut stream: TcpStream) {
    if stream.shutdown().await.is_err() {
        return;
    }
    let mut buffer = vec![0u8; 16 * 1024];
    let mut budget = LINGER_MAX_BYTES;
    let drain = async {
        while budget > 0 {
            match stream.read(&mut buffer).await {
                Ok(0) | Err(_) => break,
                Ok(read) => budget = budget.saturating_sub(read),
            }
        }
    };
    let _ = tokio::time::timeout(LINGER, drain).await;
}
