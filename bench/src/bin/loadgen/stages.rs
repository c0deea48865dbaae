//! The stages' own timers over a scenario, read from their ops ports before and after it: the
//! writers' `intake_writer_apply_seconds` (one group of messages, one transaction) and message
//! counter, and the first gateway's `intake_gateway_request_seconds` of the write routes (from
//! the request's arrival to its answer, inside the gateway). Set beside the latency the client
//! saw, they say where a request's time goes: the gateway's view minus the writer's apply is
//! Kafka and the waits around it; the client's view minus the gateway's is the client, the
//! network stack and the scheduler.

use crate::measure::round2;
use intake_tests::serde_json::{json, Value};
use intake_tests::Stack;
use std::collections::BTreeMap;
use std::time::Duration;

/// Cumulative counts by upper bound in seconds (+Inf as infinity).
type Buckets = BTreeMap<u64, f64>;

#[derive(Default)]
pub struct Timers {
    apply_seconds: f64,
    groups: f64,
    messages: f64,
    confirmations_rechecked: f64,
    apply: Buckets,
    gateway: Buckets,
}

fn metric_value(line: &str) -> Option<f64> {
    line.rsplit(' ').next()?.parse().ok()
}

/// The `le` of a bucket line, in microseconds.
fn upper_bound_us(line: &str) -> Option<u64> {
    let le = line.split("le=\"").nth(1)?.split('"').next()?;
    if le == "+Inf" {
        return Some(u64::MAX);
    }
    le.parse::<f64>().ok().map(|s| (s * 1_000_000.0).round() as u64)
}

fn add_bucket(buckets: &mut Buckets, line: &str) {
    if let (Some(le), Some(count)) = (upper_bound_us(line), metric_value(line)) {
        *buckets.entry(le).or_default() += count;
    }
}

async fn metrics(stack: &Stack, url: &str) -> String {
    match stack.http.get(format!("{url}/metrics")).send().await {
        Ok(response) => response.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    }
}

pub async fn read(stack: &Stack) -> Timers {
    let mut timers = Timers::default();
    for url in &stack.writer_ops_urls {
        for line in metrics(stack, url).await.lines() {
            if line.starts_with("intake_writer_apply_seconds_sum ") {
                timers.apply_seconds += metric_value(line).unwrap_or(0.0);
            } else if line.starts_with("intake_writer_apply_seconds_count ") {
                timers.groups += metric_value(line).unwrap_or(0.0);
            } else if line.starts_with("intake_writer_messages_total{") {
                timers.messages += metric_value(line).unwrap_or(0.0);
            } else if line.starts_with("intake_writer_confirmations_rechecked_total ") {
                timers.confirmations_rechecked += metric_value(line).unwrap_or(0.0);
            } else if line.starts_with("intake_writer_apply_seconds_bucket{") {
                add_bucket(&mut timers.apply, line);
            }
        }
    }
    for line in metrics(stack, &stack.ops_url).await.lines() {
        let write_route = line.contains("route=\"conversions\"") || line.contains("route=\"conversions_batch\"");
        if line.starts_with("intake_gateway_request_seconds_bucket{") && write_route {
            add_bucket(&mut timers.gateway, line);
        }
    }
    timers
}

/// The upper bound (ms) of the bucket holding quantile `q` of what was counted between two
/// reads: "at most this", to the buckets' resolution (powers of two from 1 ms).
fn quantile_at_most_ms(before: &Buckets, after: &Buckets, q: f64) -> Option<f64> {
    let delta: Vec<(u64, f64)> =
        after.iter().map(|(le, n)| (*le, n - before.get(le).copied().unwrap_or(0.0))).collect();
    let total = delta.last().map(|(_, n)| *n).filter(|n| *n > 0.0)?;
    let (le, _) = delta.into_iter().find(|(_, n)| *n >= q * total)?;
    Some(if le == u64::MAX { f64::INFINITY } else { le as f64 / 1000.0 })
}

pub fn between(before: &Timers, after: &Timers, elapsed: Duration, writers: usize) -> Value {
    let (seconds, groups, messages) =
        (after.apply_seconds - before.apply_seconds, after.groups - before.groups, after.messages - before.messages);
    let at_most = |b: &Buckets, a: &Buckets, q: f64| quantile_at_most_ms(b, a, q).map(round2);
    json!({
        // The mean number of groups being applied at once in a writer: at most its lanes.
        "apply_lanes_busy_per_writer": round2(seconds / elapsed.as_secs_f64() / writers.max(1) as f64),
        "groups": groups,
        "messages": messages,
        "messages_per_group": round2(messages / groups.max(1.0)),
        "mean_apply_ms_per_group": round2(seconds * 1000.0 / groups.max(1.0)),
        // Groups whose replication had to be confirmed by a second look (the HA layout).
        "confirmations_rechecked": after.confirmations_rechecked - before.confirmations_rechecked,
        "apply_p50_ms_at_most": at_most(&before.apply, &after.apply, 0.5),
        "apply_p99_ms_at_most": at_most(&before.apply, &after.apply, 0.99),
        "gateway_write_p50_ms_at_most": at_most(&before.gateway, &after.gateway, 0.5),
        "gateway_write_p99_ms_at_most": at_most(&before.gateway, &after.gateway, 0.99),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_are_the_upper_bounds_of_the_buckets_that_hold_them() {
        let line = |le: &str, n: u32| format!("intake_writer_apply_seconds_bucket{{le=\"{le}\"}} {n}");
        let (mut before, mut after) = (Buckets::new(), Buckets::new());
        for (le, b, a) in [("0.001", 5, 5), ("0.002", 5, 55), ("0.004", 5, 104), ("0.008", 5, 105), ("+Inf", 5, 105)] {
            add_bucket(&mut before, &line(le, b));
            add_bucket(&mut after, &line(le, a));
        }
        assert_eq!(quantile_at_most_ms(&before, &after, 0.5), Some(2.0));
        assert_eq!(quantile_at_most_ms(&before, &after, 0.99), Some(4.0));
        assert_eq!(quantile_at_most_ms(&before, &before, 0.5), None);
    }
}
