//! The request body the handlers get: hyper's, plus what becomes of it when a handler answers
//! without reading it (a write refused with 401, 403, 429 or 503 before its body).
//!
//! On HTTP/1.1 the connection can serve another request only once the unread body has gone by.
//! A body of at most [`DRAIN_MAX`] bytes is therefore read and dropped after the refusal, for at
//! most [`DRAIN_TIME`], and the connection stays open: a sender over its limit does not pay a
//! new connection (a new TLS handshake) for every 429. A body declared larger, one that turns
//! out larger or comes too slowly, one the client waits to be asked for (`Expect:
//! 100-continue`), and one a handler began to read and gave up on (413, 408) close the
//! connection after the response, which then says `Connection: close`.
//!
//! On HTTP/2 an unread body only ends its own stream (hyper resets it after the response); the
//! connection and its other streams go on.

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

/// The most an unread body may be for the connection to be kept: a single send fits.
pub const DRAIN_MAX: u64 = 64 * 1024;
/// How long the rest of an unread body may take to arrive.
pub const DRAIN_TIME: Duration = Duration::from_secs(1);

const OPEN: u8 = 0;
const KEEP: u8 = 1;
const CLOSE: u8 = 2;

pub struct RequestBody {
    inner: Option<Incoming>,
    polled: bool,
    /// Whether an unread rest may be drained (HTTP/1, small enough, not waiting for 100-continue).
    drainable: bool,
    http1: bool,
    fate: Arc<AtomicU8>,
}

/// Tells the server, once the response is made, whether the connection closes after it because
/// its request's body was left unread.
#[derive(Clone)]
pub struct Fate(Arc<AtomicU8>);

impl Fate {
    pub fn closes_connection(&self) -> bool {
        self.0.load(Ordering::Acquire) == CLOSE
    }
}

impl RequestBody {
    /// Wraps the body of a request that came over HTTP/1 (`http1`) or HTTP/2.
    pub fn wrap(request: http::Request<Incoming>, http1: bool) -> (http::Request<RequestBody>, Fate) {
        let (parts, incoming) = request.into_parts();
        let expects_continue = parts
            .headers
            .get(http::header::EXPECT)
            .is_some_and(|value| value.as_bytes().eq_ignore_ascii_case(b"100-continue"));
        // Chunked bodies have no upper bound in their hint: they are drained up to the budget.
        let small = incoming.size_hint().upper().is_none_or(|length| length <= DRAIN_MAX);
        let fate = Arc::new(AtomicU8::new(OPEN));
        let body = RequestBody {
            inner: Some(incoming),
            polled: false,
            drainable: http1 && small && !expects_continue,
            http1,
            fate: fate.clone(),
        };
        (http::Request::from_parts(parts, body), Fate(fate))
    }

    /// Whether the body came over HTTP/1, where a body given up on closes the connection.
    pub fn is_http1(&self) -> bool {
        self.http1
    }
}

impl Body for RequestBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        self.polled = true;
        match self.inner.as_mut() {
            Some(inner) => Pin::new(inner).poll_frame(cx),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.as_ref().map(Body::size_hint).unwrap_or_default()
    }
}

impl Drop for RequestBody {
    fn drop(&mut self) {
        let Some(inner) = self.inner.take() else { return };
        if inner.is_end_stream() || !self.http1 {
            self.fate.store(KEEP, Ordering::Release);
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) if self.drainable && !self.polled => {
                self.fate.store(KEEP, Ordering::Release);
                runtime.spawn(drain(inner));
            }
            _ => self.fate.store(CLOSE, Ordering::Release),
        }
    }
}

/// Reads the rest of a body and drops it, within the budget and the time. Dropped unfinished,
/// hyper closes the connection after the response; finished, it reads the next request.
async fn drain(mut body: Incoming) {
    let mut budget = DRAIN_MAX;
    let read = async {
        while let Some(frame) = body.frame().await {
            let Ok(frame) = frame else { return false };
            let length = frame.data_ref().map_or(0, |data| data.len() as u64);
            if length > budget {
                return false;
            }
            budget -= length;
        }
        true
    };
    if !matches!(tokio::time::timeout(DRAIN_TIME, read).await, Ok(true)) {
        tracing::debug!("an unread request body was too large or too slow; closing the connection");
    }
}
