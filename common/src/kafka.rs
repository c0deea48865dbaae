//! Every Kafka client setting of both programs, in one place. Each client is librdkafka's
//! defaults, then the settings below (each with why), then the operator's
//! `INTAKE_KAFKA_OPTIONS`, which override anything here. Nothing here is specific to one broker:
//! these are settings of the Kafka protocol and of librdkafka, chosen for Apache Kafka 4 and
//! valid for any Kafka cluster (MSK, Confluent, Redpanda).
//!
//! Left at librdkafka's defaults on purpose: `fetch.min.bytes` (1): a Kafka broker answers a
//! waiting fetch as soon as one byte arrives, so the long poll costs no latency to the
//! partitions it asks for (the writer bounds it for those it does not: `writer_consumer`);
//! `group.protocol` (classic): it keeps the session timeout on the client side, where the
//! writer sets it.

use crate::config::KafkaArgs;
use rdkafka::ClientConfig;
use std::time::Duration;

/// The producer of write requests (gateway → `intake.requests`).
pub fn request_producer(args: &KafkaArgs, write_timeout: Duration) -> ClientConfig {
    let timeout_ms = write_timeout.as_millis().max(1).to_string();
    config(
        args,
        &[
            // An acknowledged write must survive the loss of the partition leader: wait for every
            // in-sync replica (with min.insync.replicas=2 on the topic, at least two copies).
            ("acks", "all"),
            // Not the idempotent producer: after a message timeout (a leader lost under load)
            // librdkafka's idempotent producer drains every partition and bumps its epoch, which
            // stalled writes to healthy partitions for 20 s in the leader-kill fault run, and it
            // does not rule out duplicates across such a bump anyway. The writer recognises a
            // duplicate by its correlation id (applied_messages), so at-least-once is enough...
            ("enable.idempotence", "false"),
            // ...and one request in flight per broker keeps the chunks of one workspace in order
            // through retries. A request still carries every message queued for that broker.
            ("max.in.flight.requests.per.connection", "1"),
            // A write request waits for its reply: sending at once beats batching for latency,
            // and the chunks of one batch are produced together anyway.
            ("linger.ms", "0"),
            // Small request-reply messages: do not hold them back to fill a TCP segment.
            ("socket.nagle.disable", "true"),
            // A message not delivered by the request's deadline fails rather than lingering: the
            // client gets 500 and re-sends (safe), and nothing is sent after it gave up waiting.
            ("message.timeout.ms", &timeout_ms),
        ],
    )
}

/// The reader of this gateway's own reply partition: assigned, never subscribed, never
/// committed (a gateway only needs replies to requests it sends after it starts).
pub fn reply_reader(args: &KafkaArgs) -> ClientConfig {
    config(
        args,
        &[
            // Required by librdkafka for a consumer handle; no group is joined (assign only).
            ("group.id", "intake-gateway-replies"),
            ("enable.auto.commit", "false"),
            ("enable.auto.offset.store", "false"),
            ("socket.nagle.disable", "true"),
        ],
    )
}

/// How long a writer that died without leaving the group keeps its partitions.
pub const WRITER_SESSION_TIMEOUT: Duration = Duration::from_secs(10);

/// The writers' consumer of `intake.requests`, in one consumer group. Refused when the
/// operator's options select an incremental rebalance protocol (see [`refuse_incremental`]).
pub fn writer_consumer(args: &KafkaArgs, group_id: &str, client_id: &str) -> Result<ClientConfig, String> {
    let session_ms = WRITER_SESSION_TIMEOUT.as_millis().to_string();
    let config = config(
        args,
        &[
            ("group.id", group_id),
            // The writer's build and the newest migration it knows: the group's member list
            // then says which versions run, and `intake-writer migrate --contract` refuses
            // while a member's build predates a contract migration. An operator's client.id
            // without it counts as such a build.
            ("client.id", client_id),
            // Offsets are stored by the writer only after the PostgreSQL commit and the reply,
            // then committed in the background; a crash redelivers at most the last 500 ms of
            // work, which applied_messages recognises.
            ("enable.auto.commit", "true"),
            ("enable.auto.offset.store", "false"),
            ("auto.commit.interval.ms", "500"),
            // A group that starts after the gateways have sent requests must not skip them.
            ("auto.offset.reset", "earliest"),
            // A writer killed with SIGKILL holds its partitions until its session times out:
            // 10 s instead of librdkafka's 45 s, so its partitions move to another writer (or
            // to itself, restarted) soon. Heartbeats at a third of it.
            ("session.timeout.ms", &session_ms),
            ("heartbeat.interval.ms", "3000"),
            // How often the group's coordinator is looked up again; a tenth of it while the
            // coordinator is down. With librdkafka's 10 minutes, a writer that started while
            // every broker was down and missed the look-up that follows a broker's return waits
            // up to a minute for the next one, without partitions; with this, a second.
            ("coordinator.query.interval.ms", "10000"),
            // Per-partition lag for /metrics and the stall check of /readyz (writer/src/health.rs).
            ("statistics.interval.ms", "2000"),
            ("socket.nagle.disable", "true"),
            // What librdkafka fetches ahead of the writer is memory outside its read budget
            // (docs/operations.md, "Writer memory"), bounded here: the local queue holds 8 MiB
            // of messages whatever the number of partitions (librdkafka's default is 64 MiB)...
            ("queued.max.messages.kbytes", "8192"),
            // ...which binds before this count per partition (default 100,000)...
            ("queued.min.messages", "1000"),
            // ...plus one fetch response in flight per broker of at most 4 MiB (default 50 MiB),
            // at most 1 MiB of it per partition (a larger message still comes, alone).
            ("fetch.max.bytes", "4194304"),
            ("max.partition.fetch.bytes", "1048576"),
            // A queue this small fills whenever the brokers send faster than the writer reads;
            // librdkafka then waits this long before it fetches again (default 1 s, which its
            // documentation advises lowering with small queues): reading stalls no longer.
            ("fetch.queue.backoff.ms", "50"),
            // A partition that becomes fetchable while a fetch waits at the broker (resumed
            // after a pause of the read budget, sought by a rewind, just assigned) joins only
            // the next fetch: with librdkafka's 500 ms, a fresh writer's first message waited a
            // second (two long polls). A tenth of it bounds that wait, for ten empty fetches a
            // second per broker while the topic is idle.
            ("fetch.wait.max.ms", "100"),
        ],
    );
    refuse_incremental(&config)?;
    Ok(config)
}

/// The writer relies on eager rebalancing: at every rebalance it drops what it read and not yet
/// answered, and every partition is assigned again from its committed offset. An incremental
/// rebalance (the `cooperative-sticky` assignor, or the `consumer` group protocol of KIP-848)
/// keeps some partitions assigned across it: their messages read before it would be dropped
/// while their fetch positions move on, a gap inside a workspace's order.
fn refuse_incremental(config: &ClientConfig) -> Result<(), String> {
    let strategy = config.get("partition.assignment.strategy").unwrap_or_default();
    if strategy.split(',').any(|s| s.trim().to_ascii_lowercase().starts_with("cooperative")) {
        return Err(format!(
            "INTAKE_KAFKA_OPTIONS: partition.assignment.strategy={strategy} is refused: the writer needs eager \
             rebalancing (range or roundrobin); an incremental rebalance would skip messages it had read"
        ));
    }
    if config.get("group.protocol").is_some_and(|p| p.trim().eq_ignore_ascii_case("consumer")) {
        return Err("INTAKE_KAFKA_OPTIONS: group.protocol=consumer is refused: its rebalances are incremental, and \
                    the writer needs eager rebalancing (group.protocol=classic with range or roundrobin)"
            .to_owned());
    }
    Ok(())
}

/// The writer's re-reader of `intake.requests`: reads a partition again, outside the group,
/// for the workspaces its group consumer passed over (writer/src/reread.rs). Never commits: the
/// group consumer's stored offsets stay below what it has not read again.
pub fn writer_rereader(args: &KafkaArgs) -> ClientConfig {
    let session_ms = WRITER_SESSION_TIMEOUT.as_millis().to_string();
    config(
        args,
        &[
            // Required by librdkafka for a consumer handle; no group is joined (assign only).
            ("group.id", "intake-writer-reread"),
            ("enable.auto.commit", "false"),
            ("enable.auto.offset.store", "false"),
            // The operator's options reach it too: with the group consumer's session timeout, a
            // `max.poll.interval.ms` valid for that one is valid for this one.
            ("session.timeout.ms", &session_ms),
            // A workspace's first message left that retention has deleted: read from the
            // partition's start, not its end (librdkafka's default), which would skip the rest.
            ("auto.offset.reset", "earliest"),
            ("socket.nagle.disable", "true"),
            // What it fetches ahead is memory outside the read budget, as the group consumer's:
            // bounded the same way, smaller, as it reads one or two partitions at a time.
            ("queued.max.messages.kbytes", "2048"),
            ("queued.min.messages", "1000"),
            ("fetch.max.bytes", "1048576"),
            ("max.partition.fetch.bytes", "1048576"),
            ("fetch.queue.backoff.ms", "50"),
            ("fetch.wait.max.ms", "100"),
        ],
    )
}

/// The writer's producer of replies (`intake.replies`) and dead letters (`intake.requests.dlq`).
pub fn writer_producer(args: &KafkaArgs) -> ClientConfig {
    config(
        args,
        &[
            // A dead letter is the only copy the writer keeps of a message it skips.
            ("acks", "all"),
            // Replies and dead letters need no order, and a duplicate is harmless (a reply to a
            // request already answered is dropped by the gateway); see request_producer for why
            // not the idempotent producer.
            ("enable.idempotence", "false"),
            ("linger.ms", "0"),
            ("socket.nagle.disable", "true"),
            // Bounded, so that a reply or dead letter that cannot be delivered comes back as an
            // error to the writer's retry policy instead of being retried inside librdkafka
            // forever; the policy decides (writer/src/retry.rs).
            ("message.timeout.ms", "5000"),
        ],
    )
}

/// A consumer outside any group that reads a topic from given offsets (replay, inspection).
pub fn reader(args: &KafkaArgs, purpose: &str) -> ClientConfig {
    config(args, &[("group.id", purpose), ("enable.auto.commit", "false"), ("auto.offset.reset", "earliest")])
}

/// The admin client that creates topics.
pub fn admin(args: &KafkaArgs) -> ClientConfig {
    config(args, &[])
}

/// Defaults, then the operator's options, so that configuration overrides code.
fn config(args: &KafkaArgs, defaults: &[(&str, &str)]) -> ClientConfig {
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", &args.brokers);
    for (key, value) in defaults {
        config.set(*key, *value);
    }
    for (key, value) in &args.options {
        config.set(key, value);
    }
    config
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(options: &[(&str, &str)]) -> KafkaArgs {
        KafkaArgs {
            brokers: "127.0.0.1:1".into(),
            options: options.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect(),
            requests_topic: "r".into(),
            replies_topic: "p".into(),
            dlq_topic: "d".into(),
        }
    }

    #[test]
    fn operator_options_override_the_defaults() {
        let config = request_producer(&args(&[("linger.ms", "5")]), Duration::from_secs(10));
        assert_eq!(config.get("linger.ms"), Some("5"));
        assert_eq!(config.get("acks"), Some("all"));
        assert_eq!(config.get("message.timeout.ms"), Some("10000"));
    }

    #[test]
    fn only_the_writer_bounds_its_long_poll() {
        let a = args(&[]);
        let writer = writer_consumer(&a, "g", "c").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(writer.get("fetch.wait.max.ms"), Some("100"));
        for config in [request_producer(&a, Duration::from_secs(1)), reply_reader(&a), writer_producer(&a)] {
            assert_eq!(config.get("fetch.wait.max.ms"), None);
        }
    }

    #[test]
    fn the_writer_refuses_incremental_rebalancing_with_a_clear_error() {
        for option in [
            ("partition.assignment.strategy", "cooperative-sticky"),
            ("partition.assignment.strategy", "range, Cooperative-Sticky"),
            ("group.protocol", "consumer"),
        ] {
            let Err(refused) = writer_consumer(&args(&[option]), "g", "c") else { panic!("{option:?} accepted") };
            assert!(refused.contains(option.0) && refused.contains("eager"), "{refused}");
        }
        for eager in ["range", "roundrobin", "range,roundrobin"] {
            assert!(writer_consumer(&args(&[("partition.assignment.strategy", eager)]), "g", "c").is_ok());
        }
        assert!(writer_consumer(&args(&[("group.protocol", "classic")]), "g", "c").is_ok());
    }

    #[test]
    fn the_writers_re_reader_accepts_the_options_its_group_consumer_accepts() {
        use rdkafka::consumer::BaseConsumer;
        let a = args(&[("max.poll.interval.ms", "10000")]);
        let group = writer_consumer(&a, "g", "c").unwrap_or_else(|e| panic!("{e}"));
        assert!(group.create::<BaseConsumer>().is_ok());
        assert!(writer_rereader(&a).create::<BaseConsumer>().is_ok(), "one writer, one set of options");
    }

    #[test]
    fn the_writers_prefetch_is_bounded_and_an_operator_may_change_it() {
        let config = writer_consumer(&args(&[]), "g", "c").unwrap_or_else(|e| panic!("{e}"));
        let prefetch: Vec<_> = [
            "queued.max.messages.kbytes",
            "queued.min.messages",
            "fetch.max.bytes",
            "max.partition.fetch.bytes",
            "fetch.queue.backoff.ms",
        ]
        .iter()
        .map(|key| config.get(key).and_then(|v| v.parse::<u64>().ok()).unwrap_or(u64::MAX))
        .collect();
        assert_eq!(prefetch, [8192, 1000, 4 << 20, 1 << 20, 50]);
        let tuned = writer_consumer(&args(&[("queued.max.messages.kbytes", "4096")]), "g", "c")
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(tuned.get("queued.max.messages.kbytes"), Some("4096"));
    }
}
