//! One HTTP/1.1 connection driven by hand: for clients a well-behaved library will not be (half
//! a head, a body that never comes, a body sent after its response) and to see exactly whether
//! and when the server closes the connection.

use crate::Stack;
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

pub struct Raw {
    stream: TcpStream,
    buffered: Vec<u8>,
}

#[derive(Debug)]
pub struct RawResponse {
    pub status: u16,
    /// Names in lower case.
    pub headers: Vec<(String, String)>,
    /// The body as JSON, or as a JSON string when it is not JSON.
    pub body: Value,
}

impl RawResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    /// The error code, after checking the body's request_id against X-Request-ID.
    pub fn error_code(&self) -> &str {
        let request_id = self.header("x-request-id").unwrap_or_else(|| panic!("no X-Request-ID: {self:?}"));
        assert_eq!(self.body["error"]["request_id"], json!(request_id), "{self:?}");
        self.body["error"]["code"].as_str().unwrap_or_else(|| panic!("no error code: {self:?}"))
    }
}

impl Raw {
    /// A plain TCP connection to the stack's API port.
    pub async fn connect(stack: &Stack) -> Raw {
        let port: u16 = stack
            .base_url
            .rsplit(':')
            .next()
            .and_then(|port| port.trim_end_matches('/').parse().ok())
            .unwrap_or_else(|| panic!("no port in {}", stack.base_url));
        let stream = TcpStream::connect(("127.0.0.1", port)).await.unwrap_or_else(|e| panic!("connect: {e}"));
        Raw { stream, buffered: Vec::new() }
    }

    pub async fn send(&mut self, bytes: &[u8]) {
        self.try_send(bytes).await.unwrap_or_else(|e| panic!("write: {e}"));
    }

    /// For a write the server may refuse by closing the connection.
    pub async fn try_send(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.stream.write_all(bytes).await
    }

    /// Reads more into the buffer; false when the server closed (or reset) the connection.
    async fn fill(&mut self) -> bool {
        let mut chunk = [0u8; 8192];
        match self.stream.read(&mut chunk).await {
            Ok(0) | Err(_) => false,
            Ok(read) => {
                self.buffered.extend_from_slice(&chunk[..read]);
                true
            }
        }
    }

    /// The next response (with a Content-Length body), or None if the connection closed first.
    pub async fn response(&mut self) -> Option<RawResponse> {
        let head_end = loop {
            if let Some(at) = self.buffered.windows(4).position(|w| w == b"\r\n\r\n") {
                break at;
            }
            if !self.fill().await {
                return None;
            }
        };
        let head = String::from_utf8_lossy(&self.buffered[..head_end]).into_owned();
        let mut lines = head.split("\r\n");
        let status = lines.next()?.split(' ').nth(1)?.parse().ok()?;
        let headers: Vec<(String, String)> = lines
            .filter_map(|line| line.split_once(':'))
            .map(|(name, value)| (name.trim().to_ascii_lowercase(), value.trim().to_owned()))
            .collect();
        let length: usize =
            headers.iter().find(|(n, _)| n == "content-length").and_then(|(_, v)| v.parse().ok()).unwrap_or(0);
        while self.buffered.len() < head_end + 4 + length {
            if !self.fill().await {
                return None;
            }
        }
        let body: Vec<u8> = self.buffered.drain(..head_end + 4 + length).skip(head_end + 4).collect();
        let body = serde_json::from_slice(&body)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&body).into_owned()));
        Some(RawResponse { status, headers, body })
    }

    /// How long until the server closes the connection, waiting at most `patience`.
    pub async fn closed_after(&mut self, patience: Duration) -> Option<Duration> {
        let started = Instant::now();
        let read_to_end = async { while self.fill().await {} };
        tokio::time::timeout(patience, read_to_end).await.ok().map(|()| started.elapsed())
    }
}
