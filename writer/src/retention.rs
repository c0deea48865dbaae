//! How long the writer keeps what it keeps only for messages that can come back, derived from
//! one setting: the requests topic's `retention.ms`, read from Kafka itself, so that the two
//! never drift apart (docs/architecture.md, "Retention").
//!
//! A message can be read from a topic (redelivered, replayed) for at most its `retention.ms`
//! plus its `segment.ms` (Kafka deletes whole closed segments). So:
//! - `applied_messages` is kept for the requests topic's `retention.ms + segment.ms` plus a
//!   margin (`--retention-margin-ms`): any message still in the topic is recognised;
//! - erasure tombstones are kept as long as any message that was sent before the erasure can
//!   still be applied: the longer of the requests and dead-letter topics' windows, plus the margin.
//!
//! `applied_messages` is partitioned by ranges of `applied_at` (migration 0004): ranges are
//! created ahead and dropped whole once all their rows are past the window, so pruning leaves no
//! dead tuples. One writer at a time does it (an advisory lock); the others skip the round.

use crate::topics::segment_ms;
use intake_common::config::KafkaArgs;
use intake_common::kafka;
use intake_common::kafka_errors::QuietContext;
use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};
use sqlx::PgPool;
use std::time::Duration;

/// How long each kind of row is kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Windows {
    pub applied_messages: Duration,
    pub tombstones: Duration,
}

/// A topic's window: how long a message of it can still be read, at most; `None` when it keeps
/// messages for ever (`retention.ms` -1).
pub fn topic_window(retention_ms: i64, segment_ms: i64) -> Option<Duration> {
    (retention_ms >= 0).then(|| Duration::from_millis(u64::try_from(retention_ms + segment_ms).unwrap_or(0)))
}

impl Windows {
    /// `None` for a row kind that must be kept for ever (a topic without retention).
    pub fn of(requests: Option<Duration>, dlq: Option<Duration>, margin: Duration) -> Option<Windows> {
        let requests = requests?;
        Some(Windows { applied_messages: requests + margin, tombstones: requests.max(dlq?) + margin })
    }

    /// The width of one range of `applied_messages`: the largest of a few round widths that is
    /// at most a quarter of the window, so that rows outlive the window by a quarter at most and
    /// a lookup visits about six ranges. A day at the most.
    pub fn range_width(&self) -> Duration {
        // Seconds-long ranges serve retentions of a minute or two (the soak's).
        const WIDTHS: [u64; 9] = [10, 30, 60, 300, 900, 3_600, 6 * 3_600, 12 * 3_600, 24 * 3_600];
        let quarter = self.applied_messages.as_secs() / 4;
        Duration::from_secs(WIDTHS.iter().copied().filter(|&w| w <= quarter).max().unwrap_or(WIDTHS[0]))
    }
}

/// Reads the windows from the topics, prunes, creates ranges ahead; again every few minutes
/// (more often for short windows). Never prunes on a window it could not read.
pub async fn run(pool: PgPool, kafka: KafkaArgs, margin: Duration) {
    loop {
        let pause = match windows(&kafka, margin).await {
            Ok(Some(windows)) => {
                if let Err(error) = maintain(&pool, windows).await {
                    tracing::warn!(%error, "retention: maintaining applied_messages failed; trying again");
                }
                (windows.range_width() / 4).clamp(Duration::from_secs(10), Duration::from_secs(300))
            }
            Ok(None) => {
                tracing::info!("retention: a topic keeps messages for ever; nothing is pruned");
                Duration::from_secs(300)
            }
            Err(error) => {
                tracing::warn!(%error, "retention: reading the topics' retention failed; nothing pruned");
                Duration::from_secs(60)
            }
        };
        tokio::time::sleep(pause).await;
    }
}

/// The windows, from the requests and dead-letter topics' settings (DescribeConfigs).
pub async fn windows(kafka: &KafkaArgs, margin: Duration) -> anyhow::Result<Option<Windows>> {
    // Made again on each pass, with the writer running: its errors are logged as the writer's.
    let admin: AdminClient<QuietContext> = kafka::admin(kafka).create_with_context(QuietContext::default())?;
    let options = AdminOptions::new().request_timeout(Some(Duration::from_secs(10)));
    let topics = [ResourceSpecifier::Topic(&kafka.requests_topic), ResourceSpecifier::Topic(&kafka.dlq_topic)];
    let mut found = Vec::with_capacity(2);
    for result in admin.describe_configs(&topics, &options).await? {
        let resource = result.map_err(|code| anyhow::anyhow!("describing a topic's configuration: {code}"))?;
        let number = |name: &str| -> anyhow::Result<i64> {
            let value = resource.get(name).and_then(|entry| entry.value.clone());
            let value = value.ok_or_else(|| anyhow::anyhow!("{name} is not set"))?;
            Ok(value.parse()?)
        };
        let retention = number("retention.ms")?;
        // A topic created by hand may keep Kafka's segment default; read it rather than assume.
        let segment = number("segment.ms").unwrap_or_else(|_| segment_ms(retention));
        found.push(topic_window(retention, segment));
    }
    anyhow::ensure!(found.len() == 2, "Kafka described {} of the 2 topics", found.len());
    Ok(Windows::of(found[0], found[1], margin))
}

/// Ranges are named for their bounds: `applied_messages_<start>_<end>`, epoch seconds.
const PREFIX: &str = "applied_messages_";
/// One writer maintains at a time.
const LOCK: i64 = 0x1a7e_5e7e;

/// One round: ranges created ahead (two widths), ranges past the window dropped, the default
/// range and the tombstones pruned. Waits for no lock long: a writer mid-transaction is not held
/// up by more than `lock_timeout`; what is not done now is done in the next round.
pub async fn maintain(pool: &PgPool, windows: Windows) -> anyhow::Result<()> {
    let mut tx = pool.begin().await?;
    let locked: bool =
        sqlx::query_scalar("SELECT pg_try_advisory_xact_lock($1)").bind(LOCK).fetch_one(&mut *tx).await?;
    if !locked {
        return Ok(());
    }
    sqlx::query("SET LOCAL lock_timeout = '500ms'").execute(&mut *tx).await?;
    let (now, newest_default): (i64, Option<i64>) = sqlx::query_as(
        "SELECT extract(epoch FROM now())::int8,
                (SELECT ceil(extract(epoch FROM max(applied_at)))::int8 FROM applied_messages_default)",
    )
    .fetch_one(&mut *tx)
    .await?;
    let names: Vec<String> = sqlx::query_scalar(
        "SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
          WHERE i.inhparent = 'applied_messages'::regclass",
    )
    .fetch_all(&mut *tx)
    .await?;
    let ranges: Vec<(i64, i64, &str)> =
        names.iter().filter_map(|name| parse_range(name).map(|(start, end)| (start, end, name.as_str()))).collect();
    let plan = plan_rounds(now, newest_default, &ranges, windows);
    for (start, end) in &plan.create {
        sqlx::query(&format!(
            "CREATE TABLE {PREFIX}{start}_{end} PARTITION OF applied_messages
                FOR VALUES FROM (to_timestamp({start})) TO (to_timestamp({end}))"
        ))
        .execute(&mut *tx)
        .await?;
    }
    for name in &plan.drop {
        sqlx::query(&format!("DROP TABLE {name}")).execute(&mut *tx).await?;
    }
    let keep = windows.applied_messages.as_secs_f64();
    let pruned =
        sqlx::query("DELETE FROM applied_messages_default WHERE applied_at < now() - make_interval(secs => $1)")
            .bind(keep)
            .execute(&mut *tx)
            .await?
            .rows_affected();
    // A failed request's mark is needed as long as its later chunks can come back.
    sqlx::query("DELETE FROM failed_requests WHERE failed_at < now() - make_interval(secs => $1)")
        .bind(keep)
        .execute(&mut *tx)
        .await?;
    let tombstones = sqlx::query("DELETE FROM erasure_tombstones WHERE erased_at < now() - make_interval(secs => $1)")
        .bind(windows.tombstones.as_secs_f64())
        .execute(&mut *tx)
        .await?
        .rows_affected();
    tx.commit().await?;
    if !plan.create.is_empty() || !plan.drop.is_empty() || pruned > 0 || tombstones > 0 {
        tracing::info!(
            created = plan.create.len(),
            dropped = plan.drop.len(),
            default_pruned = pruned,
            tombstones_pruned = tombstones,
            keep_applied_s = windows.applied_messages.as_secs(),
            "retention: applied_messages maintained"
        );
    }
    Ok(())
}

fn parse_range(name: &str) -> Option<(i64, i64)> {
    let (start, end) = name.strip_prefix(PREFIX)?.split_once('_')?;
    Some((start.parse().ok()?, end.parse().ok()?))
}

/// What one round does, in epoch seconds.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Round<'a> {
    pub create: Vec<(i64, i64)>,
    pub drop: Vec<&'a str>,
}

/// Ranges to create so that the next two widths from `now` are covered, and ranges whose every
/// row is past the window. A new range never covers a time the default range holds rows of
/// (`newest_default`): PostgreSQL refuses that; those rows are pruned from the default range.
pub fn plan_rounds<'a>(
    now: i64,
    newest_default: Option<i64>,
    ranges: &[(i64, i64, &'a str)],
    windows: Windows,
) -> Round<'a> {
    let width = i64::try_from(windows.range_width().as_secs()).unwrap_or(86_400).max(1);
    let keep = i64::try_from(windows.applied_messages.as_secs()).unwrap_or(i64::MAX);
    let mut round = Round::default();
    let last_end = ranges.iter().map(|&(_, end, _)| end).max();
    let floor = |t: i64| t - t.rem_euclid(width);
    let mut start = match last_end {
        Some(end) if end >= floor(now) => end,
        _ => floor(now),
    };
    if let Some(newest) = newest_default {
        if newest >= start {
            start = floor(newest) + width;
        }
    }
    let until = now + 2 * width;
    while start < until {
        // Back on the grid of the current width after a range of another width.
        let end = floor(start) + width;
        round.create.push((start, end));
        start = end;
    }
    round.drop =
        ranges.iter().filter(|&&(_, end, _)| end <= now.saturating_sub(keep)).map(|&(_, _, name)| name).collect();
    round
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOUR: Duration = Duration::from_secs(3_600);

    #[test]
    fn the_windows_follow_the_topics() {
        let requests = topic_window(24 * 3_600_000, 3_600_000);
        assert_eq!(requests, Some(25 * HOUR));
        let dlq = topic_window(14 * 24 * 3_600_000, 3_600_000);
        let windows = Windows::of(requests, dlq, HOUR).unwrap_or_else(|| unreachable!());
        assert_eq!(windows.applied_messages, 26 * HOUR, "the requests topic's, plus the margin");
        assert_eq!(windows.tombstones, (14 * 24 + 1 + 1) * HOUR, "the dead letters' too");
        assert_eq!(windows.range_width(), 6 * HOUR);
        assert_eq!(Windows::of(topic_window(-1, 0), dlq, HOUR), None, "kept for ever");
        let short = Windows::of(topic_window(180_000, 45_000), topic_window(180_000, 45_000), Duration::from_secs(60))
            .unwrap_or_else(|| unreachable!());
        assert_eq!(short.range_width(), Duration::from_secs(60));
    }

    #[test]
    fn ranges_are_created_ahead_and_dropped_past_the_window() {
        let windows = Windows { applied_messages: Duration::from_secs(600), tombstones: Duration::from_secs(600) };
        assert_eq!(windows.range_width(), Duration::from_secs(60));
        let now = 10_030;
        let first = plan_rounds(now, None, &[], windows);
        assert_eq!(first.create, vec![(10_020, 10_080), (10_080, 10_140), (10_140, 10_200)], "now + two widths");
        let ranges = [
            (9_300, 9_360, "a"),
            (9_360, 9_420, "b"),
            (9_420, 9_480, "c"),
            (10_020, 10_080, "d"),
            (10_080, 10_140, "e"),
            (10_140, 10_200, "f"),
        ];
        let round = plan_rounds(now, None, &ranges, windows);
        assert_eq!(round.drop, vec!["a", "b"], "ends at or before now - 600");
        assert_eq!(round.create, vec![], "two widths ahead exist");
        let later = plan_rounds(10_100, None, &ranges, windows);
        assert_eq!(later.create, vec![(10_200, 10_260)]);
    }

    #[test]
    fn a_new_range_leaves_the_default_ranges_rows_alone() {
        let windows = Windows { applied_messages: Duration::from_secs(600), tombstones: Duration::from_secs(600) };
        let round = plan_rounds(10_030, Some(10_031), &[], windows);
        assert_eq!(round.create, vec![(10_080, 10_140), (10_140, 10_200)], "from past the default range's newest row");
    }

    #[test]
    fn a_changed_width_goes_back_on_its_grid() {
        let windows = Windows { applied_messages: 26 * HOUR, tombstones: 26 * HOUR };
        let round = plan_rounds(7_200, None, &[(0, 7_260, "odd")], windows);
        assert_eq!(round.create.first(), Some(&(7_260, 21_600)), "to the next 6-hour boundary");
    }
}
