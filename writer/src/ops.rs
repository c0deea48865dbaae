//! The writer's ops port: `/healthz` (alive and not stalled, unless it waits out an outage: a
//! liveness probe restarts a stalled writer, and a restart cures no outage), `/readyz` (in the
//! group, not stalled, not shutting down) and Prometheus `/metrics`; and, under systemd, the
//! readiness and watchdog notifications that stand in for the probes.

use crate::health::{Health, NotReady};
use bytes::Bytes;
use http_body_util::Full;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use std::convert::Infallible;
use std::sync::Arc;
use tokio::net::TcpListener;

pub async fn serve(listener: TcpListener, health: Arc<Health>) {
    // Under systemd (Type=notify, WatchdogSec=): ready once the ops port serves, as Kubernetes'
    // startup probe finds /healthz, and restarted when no longer alive, as its liveness probe
    // does, on the same verdict.
    let watched = health.clone();
    tokio::spawn(intake_common::systemd::serve(move || alive(&watched)));
    loop {
        let Ok((stream, _)) = listener.accept().await else { continue };
        let health = health.clone();
        let service = service_fn(move |request: http::Request<hyper::body::Incoming>| {
            let response = answer(&health, request.uri().path());
            async move { Ok::<_, Infallible>(response) }
        });
        tokio::spawn(async move {
            let _ = http1::Builder::new().serve_connection(TokioIo::new(stream), service).await;
        });
    }
}

/// `/healthz`'s verdict: not stuck. Stalled while an outage is waited out, or only behind
/// another session's locks, is alive: a restart would end neither.
fn alive(health: &Health) -> bool {
    !health.stuck()
}

fn answer(health: &Health, path: &str) -> http::Response<Full<Bytes>> {
    let (status, content_type, body) = match path {
        "/healthz" if !alive(health) => (503, "application/json", r#"{"status":"stalled"}"#.to_owned()),
        "/healthz" => (200, "application/json", r#"{"status":"ok"}"#.to_owned()),
        "/readyz" => match health.ready() {
            Ok(()) => (200, "application/json", r#"{"status":"ready"}"#.to_owned()),
            Err(reason) => {
                let reason = match reason {
                    NotReady::ShuttingDown => "shutting_down",
                    NotReady::SchemaBehind => "schema_behind",
                    NotReady::NotInGroup => "not_in_group",
                    NotReady::Rewinding => "rewinding",
                    NotReady::Stalled => "stalled",
                    NotReady::WorkspaceHeld => "workspace_held",
                };
                (503, "application/json", format!(r#"{{"status":"not_ready","reason":"{reason}"}}"#))
            }
        },
        "/metrics" => {
            health.stalled(); // refreshes the stalled gauge
            (200, intake_common::metrics::CONTENT_TYPE, health.metrics.render())
        }
        _ => (404, "application/json", r#"{"error":"not found"}"#.to_owned()),
    };
    let mut response = http::Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = http::StatusCode::from_u16(status).unwrap_or(http::StatusCode::INTERNAL_SERVER_ERROR);
    response.headers_mut().insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static(content_type));
    response
}
