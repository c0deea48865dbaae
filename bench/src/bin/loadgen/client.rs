//! A minimal HTTP/1.1 client: one keep-alive connection per simulated client (hyper's client
//! connection, no pool, no redirects), reopened when the server closes it.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;

/// What one request asks for.
#[derive(Clone)]
pub struct Planned {
    pub method: http::Method,
    pub path: &'static str,
    pub authorization: Option<String>,
    pub body: Option<Bytes>,
}

pub struct Answer {
    pub status: u16,
    pub body: Bytes,
    /// Where a written request's time went (timing.rs), and its id in the services' logs.
    pub server_timing: Option<http::HeaderValue>,
    pub request_id: Option<http::HeaderValue>,
}

pub struct Connection {
    /// host:port
    address: String,
    sender: Option<SendRequest<Full<Bytes>>>,
    last_answer: std::time::Instant,
}

/// A connection idle this long is not reused: the gateway closes one idle for its keep-alive
/// timeout (5 s by default), and a request sent as it closes is lost with the connection, the
/// race every keep-alive client avoids by giving up its idle connections first.
const REUSE_IDLE_AT_MOST: std::time::Duration = std::time::Duration::from_secs(4);

impl Connection {
    pub fn new(base_url: &str) -> Connection {
        Connection {
            address: base_url.trim_start_matches("http://").to_owned(),
            sender: None,
            last_answer: std::time::Instant::now(),
        }
    }

    async fn connect(&self) -> anyhow::Result<SendRequest<Full<Bytes>>> {
        let stream = tokio::net::TcpStream::connect(&self.address).await?;
        stream.set_nodelay(true)?;
        let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(connection);
        Ok(sender)
    }

    /// Sends the request on the open connection, opening one first if there is none (or the
    /// last one broke). A transport error closes the connection and is returned.
    pub async fn send(&mut self, planned: &Planned) -> anyhow::Result<Answer> {
        let mut sender = match self.sender.take() {
            Some(sender) if !sender.is_closed() && self.last_answer.elapsed() < REUSE_IDLE_AT_MOST => sender,
            _ => self.connect().await?,
        };
        sender.ready().await?;
        let mut request = http::Request::builder()
            .method(planned.method.clone())
            .uri(planned.path)
            .header(http::header::HOST, &self.address);
        if let Some(authorization) = &planned.authorization {
            request = request.header(http::header::AUTHORIZATION, authorization);
        }
        let body = match &planned.body {
            Some(body) => {
                request = request.header(http::header::CONTENT_TYPE, "application/json");
                body.clone()
            }
            None => Bytes::new(),
        };
        let response = sender.send_request(request.body(Full::new(body))?).await?;
        let status = response.status().as_u16();
        let header = |name: &str| response.headers().get(name).cloned();
        let (server_timing, request_id) = (header("server-timing"), header("x-request-id"));
        let body = response.into_body().collect().await?.to_bytes();
        self.sender = Some(sender);
        self.last_answer = std::time::Instant::now();
        Ok(Answer { status, body, server_timing, request_id })
    }
}
