//! The HTTP server under both ports: hyper connections, HTTP/1.1 and HTTP/2, over TCP or TLS,
//! driving a tower service, with slow and idle clients bounded.
//!
//! - The protocol: over TLS, what ALPN agreed (`h2` or `http/1.1`); over TCP (or TLS without
//!   ALPN), HTTP/2 when the connection opens with HTTP/2's preface (h2c with prior knowledge,
//!   as a load balancer that ends TLS sends it), else HTTP/1.1.
//! - A TLS handshake must be over within the handshake timeout of the connection's accept
//!   (and within the header read timeout).
//! - An HTTP/1 connection must deliver a request's head within the header read timeout of being
//!   ready for it (opened, or its previous response sent): hyper's own header timer. The first
//!   bytes that tell the protocol are bound by the same timeout.
//! - A connection with no request in progress for the keep-alive timeout after its last
//!   response is closed (HTTP/2 with GOAWAY); an HTTP/2 connection also when no request came in
//!   within the header read timeout of its preface. A client that does not take the close (a
//!   response it does not read, a GOAWAY ping it does not answer) holds it up for at most the
//!   keep-alive timeout more.
//! - HTTP/2: at most `max_concurrent_streams` streams at once and `max_header_list_size` bytes
//!   of headers per request (a larger header list is refused with 431 on its stream); a
//!   keep-alive ping every `keep_alive_interval`, and a connection whose peer does not answer
//!   one within `keep_alive_timeout` is closed. The body read deadline is per request, so per
//!   stream (`body.rs`).
//! - At most `max_connections` are open, of either protocol; beyond that, new connections wait
//!   in the kernel's listen backlog until one closes (the timeouts bound how long that can take).
//! - An HTTP/1 connection that ends with part of a request unread (a body refused with 413 or
//!   408, or too large to drain, see `request_body.rs`) is closed in stages, as RFC 9112
//!   section 9.6 asks: the response is sent, the write side shut, and what the client still
//!   sends is read and dropped for a moment, so that the client reads the response instead of a
//!   TCP reset. HTTP/2 needs none of this: a refused stream ends alone.
//! - On shutdown the listener closes, idle connections close, and busy ones finish their
//!   request (answered with `Connection: close`, or GOAWAY), for at most the grace period.

use crate::parse_errors::{OnRefusedHead, ShapedParseErrors};
use crate::request_body::RequestBody;
use bytes::{Buf, Bytes};
use hyper::body::Incoming;
use hyper::server::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use prometheus_client::metrics::gauge::Gauge;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::ServiceExt;

/// How long a closing connection reads and drops what its client still sends, and how much.
const LINGER: Duration = Duration::from_secs(2);
const LINGER_MAX_BYTES: usize = 64 * 1024 * 1024;
/// After a failed accept (out of file descriptors, say), before trying again.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);
/// A timer that does not fire until reset.
const NEVER: Duration = Duration::from_secs(365 * 24 * 3600);
/// What an HTTP/2 connection with prior knowledge opens with (RFC 9113 section 3.4).
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

#[derive(Debug, Clone, Copy)]
pub struct Settings {
    pub header_read_timeout: Duration,
    pub keep_alive_timeout: Duration,
    pub max_connections: usize,
    pub shutdown_grace: Duration,
    pub tls_handshake_timeout: Duration,
    pub http2: Http2Settings,
}

#[derive(Debug, Clone, Copy)]
pub struct Http2Settings {
    pub max_concurrent_streams: u32,
    pub max_header_list_size: u32,
    pub keep_alive_interval: Option<Duration>,
    pub keep_alive_timeout: Duration,
}

/// The service `serve` drives on every connection (the API's tower stack): one cloned per
/// connection, its futures run on any worker.
pub trait ApiService:
    tower::Service<
        http::Request<RequestBody>,
        Response = http::Response<Self::Body>,
        Error = Infallible,
        Future: Send + 'static,
    > + Clone
    + Send
    + Unpin
    + 'static
{
    type Body: ResponseBody;
}

impl<S, B> ApiService for S
where
    S: tower::Service<
            http::Request<RequestBody>,
            Response = http::Response<B>,
            Error = Infallible,
            Future: Send + 'static,
        > + Clone
        + Send
        + Unpin
        + 'static,
    B: ResponseBody,
{
    type Body = B;
}

/// A response body either protocol can send from any worker.
pub trait ResponseBody:
    hyper::body::Body<Data: Send, Error: Into<Box<dyn std::error::Error + Send + Sync>>> + Send + 'static
{
}

impl<B> ResponseBody for B where
    B: hyper::body::Body<Data: Send, Error: Into<Box<dyn std::error::Error + Send + Sync>>> + Send + 'static
{
}

/// Serves connections until `shutdown` is cancelled, then lets open ones finish (up to the grace
/// period). With `tls`, every connection is TLS. `open` counts the connections being served.
pub async fn serve<S: ApiService>(
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    service: S,
    settings: Settings,
    on_refused_head: OnRefusedHead,
    open: Gauge,
    shutdown: CancellationToken,
) {
    let slots = Arc::new(Semaphore::new(settings.max_connections));
    let connections = TaskTracker::new();
    let protocols = Arc::new(Protocols::new(&settings));
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
        let connection = Connection {
            protocols: protocols.clone(),
            settings,
            service: service.clone(),
            on_refused_head: on_refused_head.clone(),
            shutdown: shutdown.clone(),
            _slot: Slot::take(slot, &open),
        };
        connections.spawn(connection.run(stream, tls.clone()));
    }
    drop(listener);
    connections.close();
    if tokio::time::timeout(settings.shutdown_grace, connections.wait()).await.is_err() {
        tracing::warn!("shutdown grace period over; closing remaining connections");
    }
}

/// hyper's connection builders, configured once.
struct Protocols {
    http1: http1::Builder,
    http2: http2::Builder<TokioExecutor>,
}

impl Protocols {
    fn new(settings: &Settings) -> Protocols {
        let mut http1 = http1::Builder::new();
        http1.timer(TokioTimer::new()).header_read_timeout(settings.header_read_timeout);
        let mut http2 = http2::Builder::new(TokioExecutor::new());
        let h2 = settings.http2;
        http2
            .timer(TokioTimer::new())
            .max_concurrent_streams(h2.max_concurrent_streams)
            // The setting is the size at most; h2 refuses a header list of its limit or more.
            .max_header_list_size(h2.max_header_list_size.saturating_add(1))
            .keep_alive_interval(h2.keep_alive_interval)
            .keep_alive_timeout(h2.keep_alive_timeout);
        Protocols { http1, http2 }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Protocol {
    Http1,
    Http2,
}

struct Connection<S> {
    protocols: Arc<Protocols>,
    settings: Settings,
    service: S,
    /// Told of each HTTP/1 head hyper's parser refused (parse_errors.rs).
    on_refused_head: OnRefusedHead,
    shutdown: CancellationToken,
    _slot: Slot,
}

/// One of `max_connections`, counted in the open connections' gauge while held.
struct Slot {
    _permit: OwnedSemaphorePermit,
    open: Gauge,
}

impl Slot {
    fn take(permit: OwnedSemaphorePermit, open: &Gauge) -> Slot {
        open.inc();
        Slot { _permit: permit, open: open.clone() }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.open.dec();
    }
}

impl<S: ApiService> Connection<S> {
    async fn run(self, stream: TcpStream, tls: Option<TlsAcceptor>) {
        let Some(tls) = tls else {
            return self.detect_and_serve(stream).await;
        };
        // Nor may the handshake take longer than a head would: a silent client is closed as soon
        // as on a plain port.
        let deadline = self.settings.tls_handshake_timeout.min(self.settings.header_read_timeout);
        let stream = match tokio::time::timeout(deadline, tls.accept(stream)).await {
            Ok(Ok(stream)) => stream,
            Ok(Err(error)) => return tracing::debug!(%error, "TLS handshake failed"),
            Err(_) => return tracing::debug!("TLS handshake timed out"),
        };
        match stream.get_ref().1.alpn_protocol() {
            Some(crate::tls::ALPN_H2) => self.serve(Protocol::Http2, Prefixed::new(stream, Bytes::new())).await,
            Some(_) => self.serve(Protocol::Http1, Prefixed::new(stream, Bytes::new())).await,
            None => self.detect_and_serve(stream).await,
        }
    }

    /// Tells HTTP/2 with prior knowledge from HTTP/1 by the first bytes, then serves.
    async fn detect_and_serve<I>(self, mut io: I)
    where
        I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let mut first = Vec::with_capacity(H2_PREFACE.len());
        let read = async {
            while first.len() < H2_PREFACE.len() && H2_PREFACE.starts_with(&first) {
                let mut chunk = [0u8; 24];
                let wanted = H2_PREFACE.len() - first.len();
                match io.read(&mut chunk[..wanted]).await {
                    Ok(0) | Err(_) => return false,
                    Ok(read) => first.extend_from_slice(&chunk[..read]),
                }
            }
            true
        };
        let protocol = match tokio::time::timeout(self.settings.header_read_timeout, read).await {
            Ok(true) if first == H2_PREFACE => Protocol::Http2,
            Ok(true) => Protocol::Http1,
            Ok(false) | Err(_) => return,
        };
        self.serve(protocol, Prefixed::new(io, Bytes::from(first))).await;
    }

    async fn serve<I>(self, protocol: Protocol, io: Prefixed<I>)
    where
        I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        // Before the first request: on HTTP/1 hyper's header timer governs; HTTP/2 has none, so
        // this connection's own timer counts the header read timeout from now.
        let first_request = (protocol == Protocol::Http2).then_some(self.settings.header_read_timeout);
        let activity = Arc::new(Activity::new(self.settings.keep_alive_timeout, first_request));
        let idle_expired = activity.clone().idle();
        let inner = self.service.clone();
        let http1 = protocol == Protocol::Http1;
        let service = hyper::service::service_fn(move |request: http::Request<Incoming>| {
            let busy = Activity::start(&activity);
            let (request, fate) = RequestBody::wrap(request, http1);
            let response = inner.clone().oneshot(request);
            // Boxed: HTTP/1's poll_without_shutdown wants an Unpin future.
            Box::pin(async move {
                let Ok(mut response) = response.await;
                if http1 && fate.closes_connection() {
                    // hyper closes the connection after this response: say so, or a client
                    // would reuse it and lose its next request to the close.
                    response.headers_mut().insert(http::header::CONNECTION, http::HeaderValue::from_static("close"));
                }
                drop(busy);
                Ok::<_, Infallible>(response)
            })
        });
        match protocol {
            Protocol::Http1 => {
                let io = TokioIo::new(ShapedParseErrors::new(io, self.on_refused_head.clone()));
                let mut connection = self.protocols.http1.serve_connection(io, service);
                // Without shutting the I/O down: the lingering close below needs it.
                let done = drive(
                    Pin::new(&mut connection),
                    |connection, cx| connection.get_mut().poll_without_shutdown(cx),
                    |connection| connection.graceful_shutdown(),
                    idle_expired,
                    &self.shutdown,
                    self.settings.keep_alive_timeout,
                )
                .await;
                match done {
                    None => {}
                    // A client too slow with its head gets no more of the server's time.
                    Some(Err(error)) if error.is_timeout() => {}
                    Some(Ok(()) | Err(_)) => linger_close(connection.into_parts().io.into_inner()).await,
                }
            }
            Protocol::Http2 => {
                let connection = self.protocols.http2.serve_connection(TokioIo::new(io), service);
                tokio::pin!(connection);
                let done = drive(
                    connection,
                    |connection, cx| connection.poll(cx),
                    |connection| connection.graceful_shutdown(),
                    idle_expired,
                    &self.shutdown,
                    self.settings.keep_alive_timeout,
                )
                .await;
                if let Some(Err(error)) = done {
                    tracing::debug!(%error, "HTTP/2 connection ended with an error");
                }
            }
        }
    }
}

/// Serves a connection of either protocol until it ends (`poll`), closing it gracefully
/// (`close`) on `shutdown` or once `idle_expired`. `None` when a connection closed for being idle
/// had not ended `keep_alive` later, and was given up on.
async fn drive<C>(
    mut connection: Pin<&mut C>,
    poll: fn(Pin<&mut C>, &mut Context<'_>) -> Poll<hyper::Result<()>>,
    close: fn(Pin<&mut C>),
    idle_expired: impl Future<Output = ()>,
    shutdown: &CancellationToken,
    keep_alive: Duration,
) -> Option<hyper::Result<()>> {
    tokio::pin!(idle_expired);
    // Closing an idle connection gracefully waits for what is still being sent (and, on HTTP/2,
    // for the client to acknowledge the GOAWAY's ping); a client that stopped reading gets the
    // keep-alive timeout once more, then the connection is dropped.
    let give_up = tokio::time::sleep(NEVER);
    tokio::pin!(give_up);
    let mut closing = false;
    loop {
        tokio::select! {
            done = std::future::poll_fn(|cx| poll(connection.as_mut(), cx)) => return Some(done),
            () = shutdown.cancelled(), if !closing => {
                closing = true;
                close(connection.as_mut());
            }
            () = &mut idle_expired, if !closing => {
                closing = true;
                close(connection.as_mut());
                give_up.as_mut().reset(Instant::now() + keep_alive);
            }
            () = &mut give_up => return None,
        }
    }
}

/// What the connection is doing, for the keep-alive timeout: how many requests are in progress
/// (HTTP/2 streams, or one HTTP/1 request), and when the last one ended. hyper 1 has a header
/// read timer but no keep-alive idle timeout of its own.
///
/// Requests only update atomics; the timer ([`Activity::idle`]) is not told, but looks again
/// each time it wakes, never later than the connection could expire. A channel telling the
/// timer of each request's start and end would wake the connection's own task twice a request
/// and set a timer each time: a few per cent of the CPU of a small request.
struct Activity {
    opened: Instant,
    keep_alive: Duration,
    /// HTTP/2: the connection expires this long after it opened without a request.
    first_request: Option<Duration>,
    in_progress: AtomicUsize,
    /// Nanoseconds after `opened` at which the connection expires if no request starts before
    /// then: the latest end of a request plus the keep-alive timeout; 0 until a request ends.
    idle_until: AtomicU64,
}

/// A request in progress on the connection (see [`Activity`]).
struct Busy(Arc<Activity>);

impl Activity {
    fn new(keep_alive: Duration, first_request: Option<Duration>) -> Activity {
        Activity {
            opened: Instant::now(),
            keep_alive,
            first_request,
            in_progress: AtomicUsize::new(0),
            idle_until: AtomicU64::new(0),
        }
    }

    fn start(activity: &Arc<Activity>) -> Busy {
        activity.in_progress.fetch_add(1, Ordering::AcqRel);
        Busy(activity.clone())
    }

    /// When the connection expires if nothing starts before then; `None` while a request is in
    /// progress, or while another timer governs (HTTP/1 before its first request).
    fn expires(&self) -> Option<Instant> {
        // The end's time is stored before its count is taken back (`Busy::drop`): no request in
        // progress means the latest end is seen.
        if self.in_progress.load(Ordering::Acquire) > 0 {
            return None;
        }
        match self.idle_until.load(Ordering::Acquire) {
            0 => self.first_request.map(|first| self.opened + first),
            nanos => Some(self.opened + Duration::from_nanos(nanos)),
        }
    }

    /// Resolves once the connection has been idle (no request in progress) for the keep-alive
    /// timeout after a response, or for the header read timeout after it opened (HTTP/2)
    /// without a request. While it cannot expire, it looks again a keep-alive timeout later:
    /// a request in progress then ends after now, so its connection expires after that look.
    async fn idle(self: Arc<Self>) {
        loop {
            let now = Instant::now();
            match self.expires() {
                Some(at) if at <= now => return,
                Some(at) => tokio::time::sleep_until(at).await,
                None => tokio::time::sleep_until(now + self.keep_alive).await,
            }
        }
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        let activity = &self.0;
        let ended = activity.opened.elapsed() + activity.keep_alive;
        let nanos = u64::try_from(ended.as_nanos()).unwrap_or(u64::MAX).max(1);
        // The latest end wins also when two streams' ends are stored out of order.
        activity.idle_until.fetch_max(nanos, Ordering::AcqRel);
        activity.in_progress.fetch_sub(1, Ordering::AcqRel);
    }
}

/// RFC 9112 section 9.6: close the write side after the response, then read and drop what the
/// client still sends until it closes, for a bounded time and amount, then close. Closing at
/// once with unread data would send a TCP reset that can destroy the response in the client's
/// receive buffer before it is read.
async fn linger_close<I: AsyncRead + AsyncWrite + Unpin>(mut stream: I) {
    // Bounded: the shutdown first writes what is still buffered (parse_errors.rs), which a
    // client that stopped reading would hold up for good.
    if !matches!(tokio::time::timeout(LINGER, stream.shutdown()).await, Ok(Ok(()))) {
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

/// A connection with the bytes read to tell its protocol put back in front. Hand-written:
/// hyper-util's automatic HTTP/1-or-2 connection does the same internally, but does not hand its
/// connection back at the end, which the lingering close of HTTP/1 needs.
struct Prefixed<I> {
    prefix: Bytes,
    io: I,
}

impl<I> Prefixed<I> {
    fn new(io: I, prefix: Bytes) -> Self {
        Prefixed { prefix, io }
    }
}

impl<I: AsyncRead + Unpin> AsyncRead for Prefixed<I> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        if self.prefix.has_remaining() {
            let count = self.prefix.len().min(buf.remaining());
            buf.put_slice(&self.prefix[..count]);
            self.prefix.advance(count);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for Prefixed<I> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_prefix_is_read_before_the_rest() {
        let rest: &[u8] = b" world";
        let mut prefixed = Prefixed::new(rest, Bytes::from_static(b"hello"));
        let mut all = String::new();
        let _ = prefixed.read_to_string(&mut all).await;
        assert_eq!(all, "hello world");
    }

    #[tokio::test]
    async fn idle_counts_from_the_last_of_concurrent_requests() {
        let limit = Duration::from_millis(300);
        let activity = Arc::new(Activity::new(limit, None));
        let (first, second) = (Activity::start(&activity), Activity::start(&activity));
        let idle = tokio::spawn(activity.clone().idle());
        drop(first);
        tokio::time::sleep(limit * 2).await;
        assert!(!idle.is_finished(), "a request is still in progress");
        drop(second);
        let ended = Instant::now();
        let _ = idle.await;
        assert!(ended.elapsed() >= limit, "idle for the limit after the last response");
    }

    #[tokio::test]
    async fn a_connection_without_a_request_expires_only_with_a_first_request_timeout() {
        let (limit, first_request) = (Duration::from_millis(100), Duration::from_millis(300));
        let opened = Instant::now();
        Arc::new(Activity::new(limit, Some(first_request))).idle().await;
        assert!(opened.elapsed() >= first_request, "the header read timeout, not the keep-alive");
        let waiting = tokio::spawn(Arc::new(Activity::new(limit, None)).idle());
        tokio::time::sleep(limit * 4).await;
        assert!(!waiting.is_finished(), "HTTP/1 before its first request: hyper's timer governs");
    }
}
