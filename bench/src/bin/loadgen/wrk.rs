//! The reject paths measured by `wrk` (Debian's package), a client lean enough not to be the
//! bottleneck: on two shared cores this load generator's own client took as much CPU as the
//! gateway it measured. One wrk thread (one core at most), keep-alive connections; the status
//! is checked once beforehand (wrk counts every 4xx as a "status error" and says no more).

use crate::measure::{Measured, Recorder};
use std::time::Duration;

/// The request of a reject scenario.
pub struct Request<'a> {
    pub path: &'a str,
    pub authorization: &'a str,
    pub body: &'a [u8],
    pub status: u16,
}

pub fn available() -> bool {
    std::process::Command::new("wrk")
        .arg("--version")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok()
}

/// `connections` connections on one thread for `duration` against `base_url`.
pub async fn measure(
    base_url: &str,
    request: &Request<'_>,
    connections: usize,
    duration: Duration,
    dir: &std::path::Path,
) -> anyhow::Result<Measured> {
    let http = reqwest::Client::new();
    let probe = http
        .post(format!("{base_url}{}", request.path))
        .header("authorization", request.authorization)
        .header("content-type", "application/json")
        .body(request.body.to_vec())
        .send()
        .await?;
    anyhow::ensure!(probe.status().as_u16() == request.status, "expected {}, got {}", request.status, probe.status());
    let body = String::from_utf8_lossy(request.body);
    anyhow::ensure!(!body.contains("]==]"), "the body cannot go in a Lua long string");
    let script = format!(
        r#"wrk.method = "POST"
wrk.body = [==[{body}]==]
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "{authorization}"
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("RESULT %d %d %d %d %d %d %d %d %d\n", summary.requests, summary.duration,
    e.connect + e.read + e.write + e.timeout, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency.max, e.status, 0))
end
"#,
        authorization = request.authorization,
    );
    let script_path = dir.join(format!("wrk-{}.lua", request.status));
    std::fs::write(&script_path, script)?;
    let output = tokio::process::Command::new("wrk")
        .args(["-t1", "-c", &connections.to_string(), "-d", &format!("{}s", duration.as_secs().max(1))])
        .arg("-s")
        .arg(&script_path)
        .arg(format!("{base_url}{}", request.path))
        .output()
        .await?;
    let _ = std::fs::remove_file(&script_path);
    let stdout = String::from_utf8_lossy(&output.stdout);
    anyhow::ensure!(output.status.success(), "wrk: {stdout}{}", String::from_utf8_lossy(&output.stderr));
    let numbers: Vec<u64> = stdout
        .lines()
        .find_map(|l| l.strip_prefix("RESULT "))
        .ok_or_else(|| anyhow::anyhow!("wrk printed no result: {stdout}"))?
        .split_whitespace()
        .filter_map(|v| v.parse().ok())
        .collect();
    anyhow::ensure!(numbers.len() >= 8, "wrk's result: {stdout}");
    let (requests, micros, errors) = (numbers[0], numbers[1], numbers[2]);
    let (p50, p90, p99, max, statuses) = (numbers[3], numbers[4], numbers[5], numbers[6], numbers[7]);
    // wrk reports quantiles, not every latency: the histogram gets them with their weights, so
    // that its p50, p90, p99 and max are wrk's.
    let mut recorder = Recorder::new();
    for (value, share) in [(p50, 0.5), (p90, 0.4), (p99, 0.09), (max, 0.01)] {
        let count = ((requests as f64 * share) as u64).max(1);
        let _ = recorder.latency.record_n(value.max(1), count);
    }
    recorder.requests = requests;
    // Every answer is expected to be a 4xx here; fewer of them than requests means other answers.
    recorder.errors = errors + requests.saturating_sub(statuses);
    if recorder.errors > 0 {
        recorder.first_error =
            Some(format!("wrk: {errors} socket errors, {} answers not 4xx/5xx", requests.saturating_sub(statuses)));
    }
    Ok(Measured {
        recorder,
        elapsed: Duration::from_micros(micros),
        concurrency: format!("wrk, 1 thread, {connections} connections (latency quantiles from wrk's own report)"),
    })
}
