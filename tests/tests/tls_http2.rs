//! Connections: HTTPS with HTTP/1.1 and HTTP/2 (ALPN), HTTP/2 with prior knowledge (h2c), a
//! certificate renewed without a restart, the limits on slow and idle clients carried over to
//! HTTP/2, and a refused write that keeps its HTTP/1.1 connection. The certificates are made by
//! each test.

use bytes::Bytes;
use intake_tests::raw_http1::Raw;
use intake_tests::serde_json::{self, Value};
use intake_tests::{conversion, wait_until, Stack, StackOptions, TestKey};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|a| (*a).to_owned()).collect()
}

/// A self-signed certificate for localhost, written as PEM files in a directory of the test's.
struct TestCert {
    der: Vec<u8>,
    cert_pem: String,
    key_pem: String,
}

impl TestCert {
    fn new() -> TestCert {
        let made = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()])
            .unwrap_or_else(|e| panic!("certificate: {e}"));
        TestCert { der: made.cert.der().to_vec(), cert_pem: made.cert.pem(), key_pem: made.signing_key.serialize_pem() }
    }

    fn write(&self, files: &CertFiles) {
        write_atomically(&files.cert, &self.cert_pem);
        write_atomically(&files.key, &self.key_pem);
    }
}

/// As a deployment renews a certificate: a new file renamed over the old one.
fn write_atomically(path: &Path, contents: &str) {
    let temporary = path.with_extension("new");
    std::fs::write(&temporary, contents).unwrap_or_else(|e| panic!("{e}"));
    std::fs::rename(&temporary, path).unwrap_or_else(|e| panic!("{e}"));
}

/// A test's certificate and key files, in a directory removed with it (the key is a secret,
/// even a test's, and runs would otherwise pile these up).
struct CertFiles {
    dir: PathBuf,
    cert: PathBuf,
    key: PathBuf,
}

impl CertFiles {
    fn new() -> CertFiles {
        let dir = std::env::temp_dir().join(format!("intake-tls-{}", ulid::Ulid::new()));
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
        CertFiles { cert: dir.join("cert.pem"), key: dir.join("key.pem"), dir }
    }
}

impl Drop for CertFiles {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A stack whose API speaks HTTPS with a new certificate.
async fn tls_stack(gateway_args: &[&str]) -> (Stack, TestCert, CertFiles) {
    let (cert, files) = (TestCert::new(), CertFiles::new());
    cert.write(&files);
    let stack = Stack::start_with(StackOptions {
        tls: Some((files.cert.clone(), files.key.clone())),
        gateway_args: args(gateway_args),
        ..Default::default()
    })
    .await;
    (stack, cert, files)
}

fn https_client(trusted: &[&TestCert]) -> reqwest::ClientBuilder {
    trusted.iter().fold(
        reqwest::Client::builder().use_rustls_tls().timeout(Duration::from_secs(30)),
        |builder, cert| {
            let certificate = reqwest::Certificate::from_der(&cert.der).unwrap_or_else(|e| panic!("{e}"));
            builder.add_root_certificate(certificate)
        },
    )
}

fn port(stack: &Stack) -> u16 {
    stack.base_url.rsplit(':').next().and_then(|p| p.parse().ok()).unwrap_or_else(|| panic!("{}", stack.base_url))
}

async fn post_conversion(client: &reqwest::Client, stack: &Stack, key: &TestKey) -> (u16, http::Version) {
    let response = client
        .post(format!("{}/v1/conversions", stack.base_url))
        .header("authorization", key.bearer())
        .json(&conversion("lead"))
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e:?}"));
    (response.status().as_u16(), response.version())
}

#[tokio::test]
async fn https_speaks_http1_and_http2_by_alpn_and_plain_http_speaks_h2c_with_prior_knowledge() {
    let (stack, cert, _files) = tls_stack(&[]).await;
    let key = stack.workspace();

    let http1 = https_client(&[&cert]).http1_only().build().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(post_conversion(&http1, &stack, &key).await, (201, http::Version::HTTP_11));
    let http2 = https_client(&[&cert]).build().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(post_conversion(&http2, &stack, &key).await, (201, http::Version::HTTP_2), "h2 chosen by ALPN");
    let reply = http2
        .get(format!("{}/v1/workspace", stack.base_url))
        .header("authorization", key.bearer())
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!((reply.status().as_u16(), reply.version()), (200, http::Version::HTTP_2));
    assert!(reply.headers().get("x-request-id").is_some() && reply.headers().get("ratelimit-limit").is_some());

    // A client that does not trust the certificate, or speaks plain HTTP to the TLS port, gets
    // nothing.
    let untrusting = https_client(&[]).build().unwrap_or_else(|e| panic!("{e}"));
    assert!(untrusting.get(format!("{}/v1/openapi.json", stack.base_url)).send().await.is_err());
    let plain = reqwest::Client::new().get(format!("http://127.0.0.1:{}/v1/openapi.json", port(&stack))).send().await;
    assert!(plain.is_err(), "plain HTTP to the HTTPS port: {plain:?}");

    // Without a certificate: HTTP/1.1, and HTTP/2 with prior knowledge (TLS ended before it).
    let cleartext = Stack::start().await;
    let key = cleartext.workspace();
    let h2c = reqwest::Client::builder().http2_prior_knowledge().build().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(post_conversion(&h2c, &cleartext, &key).await, (201, http::Version::HTTP_2));
    assert_eq!(post_conversion(&cleartext.http, &cleartext, &key).await, (201, http::Version::HTTP_11));

    // The default header list limit, as docs/operations.md and --help state it: 16,384 bytes
    // served, one more refused with 431 on its stream alone.
    let mut connection = H2::connect(&cleartext, None).await;
    for (size, status) in [(16_384, 200), (16_385, 431), (16_384, 200)] {
        let request = padded_to(connection.request("GET", "/v1/openapi.json", None, None), size);
        assert_eq!(connection.send(request, None).await.map(|r| r.0).ok(), Some(status), "a {size}-byte header list");
    }
}

/// The certificate a new connection is served.
async fn served_certificate(stack: &Stack, trusted: &[&TestCert]) -> Vec<u8> {
    let client = https_client(trusted).tls_info(true).build().unwrap_or_else(|e| panic!("{e}"));
    let response = client
        .get(format!("{}/v1/openapi.json", stack.base_url))
        .send()
        .await
        .unwrap_or_else(|e| panic!("handshake: {e:?}"));
    let info = response.extensions().get::<reqwest::tls::TlsInfo>().unwrap_or_else(|| panic!("no TLS info"));
    info.peer_certificate().map(<[u8]>::to_vec).unwrap_or_default()
}

#[tokio::test]
async fn a_renewed_certificate_is_served_without_a_restart_and_a_broken_one_is_not() {
    let (stack, first, files) = tls_stack(&[]).await;
    let second = TestCert::new();
    let trusted = [&first, &second];
    assert_eq!(served_certificate(&stack, &trusted).await, first.der);

    // Files that do not load (a key that is not the certificate's): the old pair stays.
    write_atomically(&files.key, &second.key_pem);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !stack.logs().contains("keeping the previous certificate") {
        assert!(Instant::now() < deadline, "the broken pair was not noticed: {}", stack.logs());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(served_certificate(&stack, &trusted).await, first.der, "the last good certificate");

    // The matching certificate arrives: new handshakes get it.
    write_atomically(&files.cert, &second.cert_pem);
    let deadline = Instant::now() + Duration::from_secs(10);
    while served_certificate(&stack, &trusted).await != second.der {
        assert!(Instant::now() < deadline, "the renewed certificate was not picked up");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The log line is written by the log's own thread, a little after the swap.
    wait_until("the reload's log line", Duration::from_secs(5), || async {
        stack.logs().contains("TLS certificate reloaded")
    })
    .await;
}

/// Reads until the server closes the connection; how long that took, or None after `patience`.
async fn closed_after(stream: &mut (impl AsyncRead + Unpin), patience: Duration) -> Option<Duration> {
    let started = Instant::now();
    let mut buffer = [0u8; 4096];
    let read_to_end = async {
        while let Ok(read) = stream.read(&mut buffer).await {
            if read == 0 {
                break;
            }
        }
    };
    tokio::time::timeout(patience, read_to_end).await.ok().map(|()| started.elapsed())
}

#[tokio::test]
async fn a_client_that_never_completes_the_tls_handshake_is_closed_after_the_timeout() {
    let (stack, cert, _files) = tls_stack(&["--tls-handshake-timeout-ms", "1000", "--max-connections", "4"]).await;
    // Four connections that never send a ClientHello take every slot; each is closed after the
    // handshake timeout, and then a real client gets in.
    let mut silent = Vec::new();
    for _ in 0..4 {
        silent.push(TcpStream::connect(("127.0.0.1", port(&stack))).await.unwrap_or_else(|e| panic!("{e}")));
    }
    let client = https_client(&[&cert]).build().unwrap_or_else(|e| panic!("{e}"));
    let started = Instant::now();
    let waiting = tokio::spawn(client.get(format!("{}/v1/openapi.json", stack.base_url)).send());
    for stream in &mut silent {
        let closed =
            closed_after(stream, Duration::from_secs(5)).await.unwrap_or_else(|| panic!("still open after 5 s"));
        assert!(started.elapsed() >= Duration::from_millis(800), "closed after {closed:?}");
    }
    let served = waiting.await.unwrap_or_else(|e| panic!("{e}")).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(served.status(), 200);
    let waited = started.elapsed();
    assert!(waited >= Duration::from_millis(800) && waited < Duration::from_secs(4), "served after {waited:?}");
}

/// An HTTP/2 connection driven frame by frame; `closed` ends when the server closes it.
struct H2 {
    client: h2::client::SendRequest<Bytes>,
    closed: tokio::task::JoinHandle<Instant>,
    base: String,
}

impl H2 {
    /// Over TLS (ALPN h2) when the stack has a certificate, else h2c with prior knowledge.
    async fn connect(stack: &Stack, trusted: Option<&TestCert>) -> H2 {
        let tcp = TcpStream::connect(("127.0.0.1", port(stack))).await.unwrap_or_else(|e| panic!("{e}"));
        match trusted {
            None => Self::handshake(tcp, stack).await,
            Some(cert) => {
                let mut roots = rustls::RootCertStore::empty();
                roots.add(cert.der.clone().into()).unwrap_or_else(|e| panic!("{e}"));
                let mut config =
                    rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                        .with_safe_default_protocol_versions()
                        .unwrap_or_else(|e| panic!("{e}"))
                        .with_root_certificates(roots)
                        .with_no_client_auth();
                config.alpn_protocols = vec![b"h2".to_vec()];
                let name = rustls::pki_types::ServerName::try_from("localhost").unwrap_or_else(|e| panic!("{e}"));
                let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
                    .connect(name, tcp)
                    .await
                    .unwrap_or_else(|e| panic!("TLS: {e}"));
                assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
                Self::handshake(tls, stack).await
            }
        }
    }

    async fn handshake<I: AsyncRead + AsyncWrite + Unpin + Send + 'static>(io: I, stack: &Stack) -> H2 {
        let (client, connection) = h2::client::handshake(io).await.unwrap_or_else(|e| panic!("h2: {e}"));
        let closed = tokio::spawn(async move {
            let _ = connection.await;
            Instant::now()
        });
        H2 { client, closed, base: stack.base_url.clone() }
    }

    fn request(&self, method: &str, path: &str, key: Option<&TestKey>, length: Option<usize>) -> http::Request<()> {
        let mut request = http::Request::builder().method(method).uri(format!("{}{path}", self.base));
        if let Some(key) = key {
            request = request.header("authorization", key.bearer()).header("content-type", "application/json");
        }
        if let Some(length) = length {
            request = request.header("content-length", length);
        }
        request.body(()).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Sends a request with its whole body (or none) and returns the status and the body.
    async fn send(&mut self, request: http::Request<()>, body: Option<Vec<u8>>) -> Result<(u16, Value), h2::Error> {
        let mut client = self.client.clone().ready().await?;
        let (response, mut stream) = client.send_request(request, body.is_none())?;
        if let Some(body) = body {
            stream.send_data(Bytes::from(body), true)?;
        }
        read_response(response).await
    }
}

async fn read_response(response: h2::client::ResponseFuture) -> Result<(u16, Value), h2::Error> {
    let response = response.await?;
    let status = response.status().as_u16();
    let mut body = response.into_body();
    let mut bytes = Vec::new();
    while let Some(chunk) = body.data().await {
        let chunk = chunk?;
        let _ = body.flow_control().release_capacity(chunk.len());
        bytes.extend_from_slice(&chunk);
    }
    Ok((status, serde_json::from_slice(&bytes).unwrap_or(Value::Null)))
}

#[tokio::test]
async fn a_slow_http2_stream_gets_408_alone_while_its_connection_serves_others_and_idle_connections_close() {
    let (stack, cert, _files) = tls_stack(&[
        "--body-read-timeout-ms",
        "2000",
        "--keep-alive-timeout-ms",
        "500",
        "--header-read-timeout-ms",
        "1500",
    ])
    .await;
    let key = stack.workspace();
    let mut connection = H2::connect(&stack, Some(&cert)).await;
    // The first write of a fresh stack can wait for the writer's first fetch (a second on a
    // loaded host); the race below is between two streams, not with the writer's start.
    stack.wait_writers_ready().await;
    let first = connection
        .send(
            connection.request("POST", "/v1/conversions", Some(&key), None),
            Some(conversion("lead").to_string().into_bytes()),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(first.0, 201, "{first:?}");

    // A body trickled a byte every 200 ms: the deadline is for the whole body of the stream.
    let body = conversion("lead").to_string().into_bytes();
    let mut client = connection.client.clone().ready().await.unwrap_or_else(|e| panic!("{e}"));
    let request = connection.request("POST", "/v1/conversions", Some(&key), Some(body.len()));
    let (slow_response, mut slow_stream) = client.send_request(request, false).unwrap_or_else(|e| panic!("{e}"));
    let trickle = tokio::spawn(async move {
        for byte in body.into_iter().take(20) {
            if slow_stream.send_data(Bytes::from(vec![byte]), false).is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
    let started = Instant::now();
    let slow = tokio::spawn(async move { (read_response(slow_response).await, Instant::now()) });

    // Meanwhile another stream of the same connection is served at once.
    let fast = connection
        .send(
            connection.request("POST", "/v1/conversions", Some(&key), None),
            Some(conversion("lead").to_string().into_bytes()),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let fast_done = Instant::now();
    assert_eq!(fast.0, 201, "{fast:?}");

    let (slow, slow_done) = slow.await.unwrap_or_else(|e| panic!("{e}"));
    let slow = slow.unwrap_or_else(|e| panic!("the slow stream was reset instead of answered: {e}"));
    assert_eq!((slow.0, slow.1["error"]["code"].as_str()), (408, Some("request_timeout")), "{slow:?}");
    // Only the stream ends on HTTP/2, and the message says so.
    let message = slow.1["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("stream is ended, the connection stays open"), "{message}");
    assert!(!message.contains("connection is closed"), "{message}");
    let took = slow_done - started;
    assert!(took >= Duration::from_millis(1900) && took < Duration::from_secs(4), "408 after {took:?}");
    assert!(fast_done < slow_done, "the other stream was served while the slow one trickled");
    trickle.abort();

    // The connection lives on after the 408, then closes once idle for the keep-alive timeout.
    let next = connection.send(connection.request("GET", "/v1/openapi.json", None, None), None).await;
    assert_eq!(next.map(|r| r.0).ok(), Some(200), "the connection survived the 408");
    let last_response = Instant::now();
    let closed = tokio::time::timeout(Duration::from_secs(5), &mut connection.closed)
        .await
        .unwrap_or_else(|_| panic!("idle HTTP/2 connection still open after 5 s"))
        .unwrap_or_else(|e| panic!("{e}"));
    let idle = closed - last_response;
    assert!(idle >= Duration::from_millis(400) && idle < Duration::from_millis(2000), "closed after {idle:?} idle");

    // A connection that opens and never asks anything is closed after the header read timeout.
    let silent = H2::connect(&stack, Some(&cert)).await;
    let opened = Instant::now();
    let closed = tokio::time::timeout(Duration::from_secs(5), silent.closed)
        .await
        .unwrap_or_else(|_| panic!("silent HTTP/2 connection still open after 5 s"))
        .unwrap_or_else(|e| panic!("{e}"));
    let took = closed - opened;
    assert!(took >= Duration::from_millis(1300) && took < Duration::from_secs(3), "closed after {took:?}");
}

#[tokio::test]
async fn well_behaved_http2_clients_are_served_fast_while_50_slow_streams_hang() {
    let (stack, cert, _files) = tls_stack(&[]).await;
    let key = stack.workspace();
    // Ten connections, each with five requests whose declared bodies never come.
    let mut connections = Vec::new();
    let mut hanging = Vec::new();
    for _ in 0..10 {
        let connection = H2::connect(&stack, Some(&cert)).await;
        for _ in 0..5 {
            let mut client = connection.client.clone().ready().await.unwrap_or_else(|e| panic!("{e}"));
            let request = connection.request("POST", "/v1/conversions", Some(&key), Some(500));
            hanging.push(client.send_request(request, false).unwrap_or_else(|e| panic!("{e}")));
        }
        connections.push(connection);
    }
    let all_hanging = || async { stack.metrics().await.value("intake_gateway_writes_reading") == 50.0 };
    wait_until("the 50 slow writes waiting for their bodies", Duration::from_secs(10), all_hanging).await;
    // The writes timed below are not to wait for the writer's start.
    stack.wait_writers_ready().await;

    let mut connection = H2::connect(&stack, Some(&cert)).await;
    let mut took = Vec::new();
    for n in 0..30 {
        let started = Instant::now();
        let reply = if n % 2 == 0 {
            connection.send(connection.request("GET", "/v1/workspace", Some(&key), None), None).await
        } else {
            let body = conversion("lead").to_string().into_bytes();
            connection.send(connection.request("POST", "/v1/conversions", Some(&key), None), Some(body)).await
        };
        took.push(started.elapsed());
        let status = reply.map(|r| r.0).unwrap_or_else(|e| panic!("{e}"));
        assert!(status == 200 || status == 201, "{status}");
    }
    took.sort();
    println!("with 50 slow streams hanging: median {:?}, max {:?}", took[took.len() / 2], took[took.len() - 1]);
    assert!(took[took.len() / 2] < Duration::from_millis(250), "median {:?}", took[took.len() / 2]);
    assert!(took[took.len() - 1] < Duration::from_secs(1), "slowest {:?}", took[took.len() - 1]);
    drop((hanging, connections));
}

#[tokio::test]
async fn an_http2_client_that_stops_answering_pings_is_closed() {
    let stack = Stack::start_with(StackOptions {
        gateway_args: args(&["--http2-keep-alive-interval-ms", "300", "--http2-keep-alive-timeout-ms", "300"]),
        ..Default::default()
    })
    .await;
    // The preface and an empty SETTINGS frame, then silence: the server's pings go unanswered.
    let mut stream = TcpStream::connect(("127.0.0.1", port(&stack))).await.unwrap_or_else(|e| panic!("{e}"));
    stream.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await.unwrap_or_else(|e| panic!("{e}"));
    stream.write_all(&[0, 0, 0, 4, 0, 0, 0, 0, 0]).await.unwrap_or_else(|e| panic!("{e}"));
    let closed = closed_after(&mut stream, Duration::from_secs(4)).await;
    let closed = closed.unwrap_or_else(|| panic!("still open after 4 s (the idle timeout is 5 s)"));
    assert!(closed >= Duration::from_millis(400) && closed < Duration::from_secs(3), "closed after {closed:?}");
}

#[tokio::test]
async fn silent_and_half_sent_http2_connections_are_cut_off() {
    let stack = Stack::start_with(StackOptions {
        gateway_args: args(&["--header-read-timeout-ms", "1500", "--keep-alive-timeout-ms", "500"]),
        ..Default::default()
    })
    .await;
    let connect = || async {
        let mut stream = TcpStream::connect(("127.0.0.1", port(&stack))).await.unwrap_or_else(|e| panic!("{e}"));
        stream.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await.unwrap_or_else(|e| panic!("{e}"));
        stream
    };
    // Each within the header read timeout (plus, where the GOAWAY goes unanswered, the
    // keep-alive timeout), as an HTTP/1.1 client that sends nothing or half a head.
    // The preface and SETTINGS, then nothing (no answer to the server's pings either).
    let mut silent = connect().await;
    silent.write_all(&[0, 0, 0, 4, 0, 0, 0, 0, 0]).await.unwrap_or_else(|e| panic!("{e}"));
    // Half the preface.
    let mut half = TcpStream::connect(("127.0.0.1", port(&stack))).await.unwrap_or_else(|e| panic!("{e}"));
    half.write_all(b"PRI * HTTP/2.0\r\n").await.unwrap_or_else(|e| panic!("{e}"));
    // A HEADERS frame whose header block never ends (no END_HEADERS, no CONTINUATION).
    let mut half_head = connect().await;
    half_head.write_all(&[0, 0, 0, 4, 0, 0, 0, 0, 0]).await.unwrap_or_else(|e| panic!("{e}"));
    // Length 1, type HEADERS, flags 0, stream 1; one byte of HPACK (:method GET, indexed 2).
    half_head.write_all(&[0, 0, 1, 1, 0, 0, 0, 0, 1, 0x82]).await.unwrap_or_else(|e| panic!("{e}"));
    let patience = Duration::from_secs(6);
    let (silent, half, half_head) = tokio::join!(
        closed_after(&mut silent, patience),
        closed_after(&mut half, patience),
        closed_after(&mut half_head, patience)
    );
    for (client, closed) in [("silent", silent), ("half a preface", half), ("half a header block", half_head)] {
        let closed = closed.unwrap_or_else(|| panic!("{client}: still open after 6 s"));
        println!("{client}: closed after {closed:?}");
        assert!(
            closed >= Duration::from_millis(1300) && closed < Duration::from_secs(4),
            "{client}: closed after {closed:?}"
        );
    }
}

#[tokio::test]
async fn on_sigterm_an_http2_connection_finishes_its_request_then_closes() {
    let mut stack = Stack::start_with(StackOptions { start_writer: false, ..Default::default() }).await;
    let key = stack.workspace();
    let mut connection = H2::connect(&stack, None).await;
    let mut client = connection.client.clone().ready().await.unwrap_or_else(|e| panic!("{e}"));
    let (response, mut stream) = client
        .send_request(connection.request("POST", "/v1/conversions", Some(&key), None), false)
        .unwrap_or_else(|e| panic!("{e}"));
    stream.send_data(Bytes::from(conversion("lead").to_string()), true).unwrap_or_else(|e| panic!("{e}"));
    let in_flight = tokio::spawn(read_response(response));
    stack.wait_writes_in_flight(1.0).await;

    // No writer yet: the write waits. SIGTERM, then a writer: the write is answered on the
    // connection, which then closes (GOAWAY) and the gateway exits.
    let exited = stack.terminate_gateway();
    stack.wait_not_ready().await;
    stack.start_writer();
    let reply = in_flight.await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(reply.map(|r| r.0).ok(), Some(201), "the request in flight was answered");
    tokio::time::timeout(Duration::from_secs(10), &mut connection.closed)
        .await
        .unwrap_or_else(|_| panic!("the connection stayed open after the shutdown"))
        .unwrap_or_else(|e| panic!("{e}"));
    let status = tokio::task::spawn_blocking(move || exited.join().ok().flatten()).await.ok().flatten();
    assert!(status.is_some_and(|s| s.success()), "exited cleanly: {status:?}");
}

/// The request with an `x-padding` field that makes its header list `size` bytes as RFC 9113
/// counts it: each field's name and value and 32 bytes, the pseudo-header fields h2 sends too.
fn padded_to(mut request: http::Request<()>, size: usize) -> http::Request<()> {
    let field = |name: &str, value: usize| name.len() + value + 32;
    let uri = request.uri();
    let pseudo = field(":method", request.method().as_str().len())
        + field(":scheme", uri.scheme_str().map_or(0, str::len))
        + field(":authority", uri.authority().map_or(0, |a| a.as_str().len()))
        + field(":path", uri.path_and_query().map_or(0, |p| p.as_str().len()));
    let fields: usize = request.headers().iter().map(|(name, value)| field(name.as_str(), value.len())).sum();
    let padding = size - pseudo - fields - field("x-padding", 0);
    let value = http::HeaderValue::from_str(&"a".repeat(padding)).unwrap_or_else(|e| panic!("{e}"));
    request.headers_mut().insert("x-padding", value);
    request
}

#[tokio::test]
async fn http2_limits_concurrent_streams_and_header_lists() {
    let stack = Stack::start_with(StackOptions {
        gateway_args: args(&[
            "--http2-max-concurrent-streams",
            "2",
            "--http2-max-header-list-size",
            "4096",
            "--body-read-timeout-ms",
            "1500",
        ]),
        ..Default::default()
    })
    .await;
    let key = stack.workspace();
    let mut connection = H2::connect(&stack, None).await;
    assert_eq!(
        connection.send(connection.request("GET", "/v1/openapi.json", None, None), None).await.map(|r| r.0).ok(),
        Some(200)
    );
    assert_eq!(connection.client.current_max_send_streams(), 2, "the server's SETTINGS_MAX_CONCURRENT_STREAMS");

    // A header list of exactly the limit is served; one byte over, 431 on its stream, and the
    // connection goes on.
    for (size, status) in [(4096, 200), (4097, 431)] {
        let request = padded_to(connection.request("GET", "/v1/workspace", Some(&key), None), size);
        assert_eq!(connection.send(request, None).await.map(|r| r.0).ok(), Some(status), "a {size}-byte header list");
    }
    let reply = connection.send(connection.request("GET", "/v1/workspace", Some(&key), None), None).await;
    assert_eq!(reply.map(|r| r.0).ok(), Some(200), "served after the 431");

    // Two streams whose bodies never come hold both places until their 408; a third waits.
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut client = connection.client.clone().ready().await.unwrap_or_else(|e| panic!("{e}"));
        let (response, stream) = client
            .send_request(connection.request("POST", "/v1/conversions", Some(&key), Some(100)), false)
            .unwrap_or_else(|e| panic!("{e}"));
        held.push((response, stream));
    }
    let started = Instant::now();
    let third = connection.send(connection.request("GET", "/v1/openapi.json", None, None), None).await;
    assert_eq!(third.map(|r| r.0).ok(), Some(200));
    let waited = started.elapsed();
    assert!(waited >= Duration::from_millis(1200), "a third stream waited for a place: {waited:?}");
    for (response, _stream) in held {
        assert_eq!(read_response(response).await.map(|r| r.0).ok(), Some(408));
    }

    // The limit is per connection: another connection is served at once.
    let mut other = H2::connect(&stack, None).await;
    let started = Instant::now();
    assert_eq!(
        other.send(other.request("GET", "/v1/openapi.json", None, None), None).await.map(|r| r.0).ok(),
        Some(200)
    );
    assert!(started.elapsed() < Duration::from_secs(1));
}

/// A stack that allows one request per rate-limit window of 10 s, a key, and a window with at
/// least `needed` left, whose end is returned.
async fn one_request_a_window(needed: Duration) -> (Stack, TestKey, Instant) {
    let options = StackOptions { requests_per_minute: 1, rate_limit_window_ms: 10_000, ..Default::default() };
    Stack::with_window(options, needed).await
}

fn post_head(authorization: &str, length: usize) -> Vec<u8> {
    format!("POST /v1/conversions HTTP/1.1\r\nHost: intake\r\nAuthorization: {authorization}\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n\r\n")
        .into_bytes()
}

const GET_OPENAPI: &[u8] = b"GET /v1/openapi.json HTTP/1.1\r\nHost: intake\r\n\r\n";

#[tokio::test]
async fn a_write_refused_before_its_body_keeps_its_http1_connection_unless_the_body_is_large_or_late() {
    // The refusals below fall into the window of the one request (the closes they lead to
    // come after, and do not need it).
    let (stack, key, window_end) = one_request_a_window(Duration::from_secs(6)).await;
    assert_eq!(stack.get("/v1/workspace", &key).await.status, 200, "the one request of the window");
    let body = conversion("lead").to_string().into_bytes();

    // 429, the body sent with the head: no Connection: close, and the connection serves the next
    // request.
    let mut connection = Raw::connect(&stack).await;
    let mut request = post_head(&key.bearer(), body.len());
    request.extend_from_slice(&body);
    connection.send(&request).await;
    let refused = connection.response().await.unwrap_or_else(|| panic!("closed without a response"));
    assert_eq!(refused.status, 429, "{refused:?}");
    assert_eq!(refused.header("connection"), None, "{refused:?}");
    connection.send(GET_OPENAPI).await;
    assert_eq!(connection.response().await.map(|r| r.status), Some(200), "served on the same connection");

    // 401 with the body sent after the response: drained, and the connection kept.
    connection.send(&post_head("Bearer svc_live_unknown", body.len())).await;
    let refused = connection.response().await.unwrap_or_else(|| panic!("closed without a response"));
    assert_eq!((refused.status, refused.header("connection")), (401, None), "{refused:?}");
    connection.send(&body).await;
    connection.send(GET_OPENAPI).await;
    assert_eq!(connection.response().await.map(|r| r.status), Some(200), "served after the drained body");

    // A body over 64 KiB is not waited for: Connection: close, and closed.
    let mut large = Raw::connect(&stack).await;
    large.send(&post_head(&key.bearer(), 100 * 1024)).await;
    let refused = large.response().await.unwrap_or_else(|| panic!("closed without a response"));
    assert_eq!((refused.status, refused.header("connection")), (429, Some("close")), "{refused:?}");
    assert!(large.closed_after(Duration::from_secs(5)).await.is_some(), "closed");

    // More than the declared 64 KiB budget from a chunked body: closed too.
    let mut chunked = Raw::connect(&stack).await;
    chunked
        .send(format!("POST /v1/conversions HTTP/1.1\r\nHost: intake\r\nAuthorization: {}\r\nTransfer-Encoding: chunked\r\n\r\n", key.bearer()).as_bytes())
        .await;
    assert_eq!(chunked.response().await.map(|r| r.status), Some(429));
    let chunk = format!("{:x}\r\n{}\r\n", 70 * 1024, "a".repeat(70 * 1024));
    let _ = chunked.try_send(chunk.as_bytes()).await;
    assert!(chunked.closed_after(Duration::from_secs(5)).await.is_some(), "closed after 64 KiB");

    // A small body that never comes: answered at once, closed after the drain deadline (1 s).
    let mut late = Raw::connect(&stack).await;
    let started = Instant::now();
    late.send(&post_head(&key.bearer(), body.len())).await;
    assert_eq!(late.response().await.map(|r| r.status), Some(429));
    assert!(Instant::now() < window_end, "the refusals took longer than the window: lengthen it");
    // Answered without waiting for the body (the drain deadline is 1 s).
    assert!(started.elapsed() < Duration::from_millis(900), "answered after {:?}", started.elapsed());
    assert!(late.closed_after(Duration::from_secs(5)).await.is_some(), "still open");
    let closed = started.elapsed();
    assert!(closed >= Duration::from_millis(900) && closed < Duration::from_secs(4), "closed after {closed:?}");
}

#[tokio::test]
async fn a_refused_http2_stream_leaves_its_connection_open() {
    let (stack, key, window_end) = one_request_a_window(Duration::from_secs(4)).await;
    let mut connection = H2::connect(&stack, None).await;
    let body = conversion("lead").to_string().into_bytes();
    assert_eq!(
        connection
            .send(connection.request("POST", "/v1/conversions", Some(&key), None), Some(body.clone()))
            .await
            .map(|r| r.0)
            .ok(),
        Some(201)
    );
    // Refused before the body: the stream ends, the connection does not.
    for _ in 0..3 {
        let mut client = connection.client.clone().ready().await.unwrap_or_else(|e| panic!("{e}"));
        let (response, _stream) = client
            .send_request(connection.request("POST", "/v1/conversions", Some(&key), Some(100 * 1024)), false)
            .unwrap_or_else(|e| panic!("{e}"));
        let (status, body) = read_response(response).await.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((status, body["error"]["code"].as_str()), (429, Some("rate_limited")), "{body}");
    }
    assert!(Instant::now() < window_end, "the refusals took longer than the window: lengthen it");
    assert_eq!(
        connection.send(connection.request("GET", "/v1/openapi.json", None, None), None).await.map(|r| r.0).ok(),
        Some(200)
    );
    assert!(!connection.closed.is_finished());
}
