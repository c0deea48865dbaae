//! hyper's HTTP/1 parser answers a request head it cannot parse by itself, before any service
//! sees the request: 400 for a malformed request line, header, Content-Length or
//! Transfer-Encoding, 414 for a URI over 64 KiB, 431 for too many or too large headers. Its
//! answer is a bare head (`connection: close`, `content-length: 0`), while every error of the
//! API carries the error document and an X-Request-ID (docs/api.md, "Errors"). hyper has no hook
//! for that answer, so this wrapper of an HTTP/1 connection recognises the head as hyper writes
//! it and sends the whole error response in its place. The connection then closes, as hyper
//! decided. Every response of the API has a body and an X-Request-ID, so none is mistaken for
//! hyper's. The ops port is served by the same server, so its malformed heads get the same
//! answer.

use crate::api_error::ApiError;
use bytes::{Buf, Bytes};
use intake_model::error::ErrorCode;
use std::io::IoSlice;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use tokio::io::AsyncWrite;

/// The error code of a status hyper's parser answers with.
fn code_of(status: &[u8]) -> Option<ErrorCode> {
    match status {
        b"400" => Some(ErrorCode::MalformedRequest),
        b"414" => Some(ErrorCode::UriTooLong),
        b"431" => Some(ErrorCode::HeadersTooLarge),
        _ => None,
    }
}

/// Told of each head refused, by its code: no service sees these requests, so the request
/// metrics hear of them here.
pub type OnRefusedHead = Arc<dyn Fn(ErrorCode) + Send + Sync>;

pub struct ShapedParseErrors<I> {
    io: I,
    /// The error response still to be written in place of hyper's head.
    replacement: Bytes,
    on_refused: OnRefusedHead,
}

impl<I> ShapedParseErrors<I> {
    pub fn new(io: I, on_refused: OnRefusedHead) -> Self {
        ShapedParseErrors { io, replacement: Bytes::new(), on_refused }
    }
}

/// The full error response for hyper's own head `head` (the whole of a write) and its code, or
/// `None` when the write is anything else.
fn replacement_for(head: &[u8]) -> Option<(ErrorCode, Bytes)> {
    let text = std::str::from_utf8(head).ok()?;
    let lines = text.strip_suffix("\r\n\r\n")?;
    let mut lines = lines.split("\r\n");
    let status_line = lines.next()?;
    let status = status_line.strip_prefix("HTTP/1.1 ").or_else(|| status_line.strip_prefix("HTTP/1.0 "))?;
    let code = code_of(status.as_bytes().get(..3)?)?;
    let rest: Vec<&str> = lines.collect();
    let bare = rest.iter().any(|line| line.eq_ignore_ascii_case("content-length: 0"))
        && !rest.iter().any(|line| line.to_ascii_lowercase().starts_with("x-request-id:"));
    if !bare {
        return None;
    }
    let request_id = crate::context::RequestContext::default().id;
    let body = ApiError::Code(code).document(&request_id);
    tracing::info!(%request_id, status = code.status(), code = code.as_str(), "request head refused by the HTTP parser");
    let mut response = format!(
        "{status_line}\r\ncontent-type: application/json\r\nx-request-id: {request_id}\r\ncontent-length: {}\r\n",
        body.len()
    );
    for line in rest.iter().filter(|line| !line.to_ascii_lowercase().starts_with("content-length:")) {
        response.push_str(line);
        response.push_str("\r\n");
    }
    response.push_str("\r\n");
    let mut bytes = response.into_bytes();
    bytes.extend_from_slice(&body);
    Some((code, Bytes::from(bytes)))
}

impl<I: AsyncWrite + Unpin> ShapedParseErrors<I> {
    /// Writes what is left of the replacement; ready once it is all written.
    fn poll_replacement(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        while self.replacement.has_remaining() {
            let written = ready!(Pin::new(&mut self.io).poll_write(cx, &self.replacement))?;
            if written == 0 {
                return Poll::Ready(Err(std::io::ErrorKind::WriteZero.into()));
            }
            self.replacement.advance(written);
        }
        Poll::Ready(Ok(()))
    }

    fn write(&mut self, cx: &mut Context<'_>, bufs: &[IoSlice<'_>]) -> Poll<std::io::Result<usize>> {
        ready!(self.poll_replacement(cx))?;
        // hyper writes its own head alone, in one piece: the first slice, all of the write.
        let total: usize = bufs.iter().map(|buf| buf.len()).sum();
        // (HTTP/1.0 after a keep-alive request of that version.)
        let suspect = |first: &&IoSlice<'_>| {
            first.len() == total && (first.starts_with(b"HTTP/1.1 4") || first.starts_with(b"HTTP/1.0 4"))
        };
        if let Some(first) = bufs.first().filter(suspect) {
            if let Some((code, replacement)) = replacement_for(first) {
                (self.on_refused)(code);
                self.replacement = replacement;
                // Taken whole: the rest goes out on the next write, flush or shutdown.
                if let Poll::Ready(Err(error)) = self.poll_replacement(cx) {
                    return Poll::Ready(Err(error));
                }
                return Poll::Ready(Ok(total));
            }
        }
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for ShapedParseErrors<I> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        self.write(cx, &[IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        self.write(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        ready!(self.poll_replacement(cx))?;
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        ready!(self.poll_replacement(cx))?;
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

impl<I: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for ShapedParseErrors<I> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn through_the_wrapper(written: &[u8]) -> String {
        through_the_wrapper_telling(written, Arc::new(|_| ())).await
    }

    async fn through_the_wrapper_telling(written: &[u8], on_refused: OnRefusedHead) -> String {
        let (server, mut client) = tokio::io::duplex(64);
        let mut wrapped = ShapedParseErrors::new(server, on_refused);
        let written = written.to_vec();
        let writer = tokio::spawn(async move {
            wrapped.write_all(&written).await.unwrap_or_else(|e| panic!("{e}"));
            wrapped.shutdown().await.unwrap_or_else(|e| panic!("{e}"));
        });
        let mut received = String::new();
        client.read_to_string(&mut received).await.unwrap_or_else(|e| panic!("{e}"));
        writer.await.unwrap_or_else(|e| panic!("{e}"));
        received
    }

    #[tokio::test]
    async fn hypers_bare_head_becomes_the_error_document() {
        let hyper = b"HTTP/1.1 431 Request Header Fields Too Large\r\nconnection: close\r\ncontent-length: 0\r\ndate: Tue, 24 Nov 2026 16:05:17 GMT\r\n\r\n";
        let received = through_the_wrapper(hyper).await;
        let (head, body) = received.split_once("\r\n\r\n").unwrap_or_else(|| panic!("{received}"));
        assert!(head.starts_with("HTTP/1.1 431 Request Header Fields Too Large\r\n"), "{head}");
        assert!(head.contains("\r\nconnection: close\r\n") && head.contains("\r\ndate: Tue, 24 Nov 2026"), "{head}");
        assert!(head.contains(&format!("\r\ncontent-length: {}\r\n", body.len())), "{head}");
        let document: serde_json::Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"));
        assert_eq!(document["error"]["code"], "headers_too_large");
        let request_id = document["error"]["request_id"].as_str().unwrap_or_default();
        assert!(request_id.starts_with("req_") && head.contains(&format!("\r\nx-request-id: {request_id}")), "{head}");
    }

    #[tokio::test]
    async fn each_refused_head_is_told_once_by_its_code_and_no_other_response_is() {
        let told = Arc::new(std::sync::Mutex::new(Vec::new()));
        let tell: OnRefusedHead = {
            let told = told.clone();
            Arc::new(move |code| told.lock().unwrap_or_else(|p| p.into_inner()).push(code))
        };
        through_the_wrapper_telling(b"HTTP/1.1 414 URI Too Long\r\ncontent-length: 0\r\n\r\n", tell.clone()).await;
        let own = b"HTTP/1.1 400 Bad Request\r\nx-request-id: req_1\r\ncontent-length: 2\r\n\r\n{}";
        through_the_wrapper_telling(own, tell).await;
        assert_eq!(*told.lock().unwrap_or_else(|p| p.into_inner()), vec![ErrorCode::UriTooLong]);
    }

    #[tokio::test]
    async fn an_http_1_0_head_keeps_its_version() {
        let hyper = b"HTTP/1.0 400 Bad Request\r\ncontent-length: 0\r\n\r\n";
        let received = through_the_wrapper(hyper).await;
        assert!(received.starts_with("HTTP/1.0 400 Bad Request\r\n"), "{received}");
        assert!(received.contains("\"code\":\"malformed_request\""), "{received}");
    }

    #[tokio::test]
    async fn the_services_own_responses_pass_unchanged() {
        let own = b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\nx-request-id: req_1\r\ncontent-length: 2\r\n\r\n{}";
        assert_eq!(through_the_wrapper(own).await.as_bytes(), own);
        let empty_with_id = b"HTTP/1.1 400 Bad Request\r\nx-request-id: req_1\r\ncontent-length: 0\r\n\r\n";
        assert_eq!(through_the_wrapper(empty_with_id).await.as_bytes(), empty_with_id);
        let other_status = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\n\r\n";
        assert_eq!(through_the_wrapper(other_status).await.as_bytes(), other_status);
    }
}
