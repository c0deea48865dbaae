//! Retention that fits together (docs/architecture.md, "Retention"): `intake-writer topics` sets every topic's retention,
//! also on topics that exist (AlterConfigs), the dead-letter topic keeping 14 days by default and
//! the requests topic stamped with the broker's append time; the writer keeps `applied_messages`
//! for the requests topic's window read back from Kafka, in ranges created ahead and dropped
//! whole, and prunes erasure tombstones once no message sent before them can come back.

use intake_tests::serde_json::json;
use intake_tests::OwnDatabase;
use intake_tests::{conversion, env, Stack, StackOptions};
use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};
use rdkafka::client::DefaultClientContext;
use rdkafka::ClientConfig;
use sqlx::postgres::PgPoolOptions;
use std::collections::HashMap;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

/// A topic's settings as the broker reports them.
async fn described(topic: &str) -> HashMap<String, String> {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", env("INTAKE_KAFKA_BROKERS"))
        .create()
        .unwrap_or_else(|e| panic!("{e}"));
    let results = admin
        .describe_configs(&[ResourceSpecifier::Topic(topic)], &AdminOptions::new())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let resource = results.into_iter().next().and_then(Result::ok).unwrap_or_else(|| panic!("no {topic}"));
    resource.entries.into_iter().filter_map(|entry| Some((entry.name, entry.value?))).collect()
}

struct Writer(Child);

impl Drop for Writer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn topics_get_their_retentions_and_the_writer_prunes_by_dropping_ranges() {
    let own = OwnDatabase::create("retention").await;
    let db = PgPoolOptions::new().max_connections(2).connect(&own.url).await.unwrap_or_else(|e| panic!("{e}"));
    let options = StackOptions { database_url: Some(own.url.clone()), start_writer: false, ..StackOptions::default() };
    let stack = Stack::start_with(options).await;
    let (requests, replies, dlq) = (
        format!("{}.requests", stack.topic_prefix),
        format!("{}.replies", stack.topic_prefix),
        format!("{}.requests.dlq", stack.topic_prefix),
    );

    // The defaults, on topics just created.
    let settings = described(&requests).await;
    assert_eq!(settings["retention.ms"], "86400000");
    assert_eq!(settings["segment.ms"], "3600000", "a message outlives its retention by an hour at most");
    assert_eq!(settings["message.timestamp.type"], "LogAppendTime");
    assert_eq!(described(&replies).await["message.timestamp.type"], "LogAppendTime", "for Server-Timing");
    assert_eq!(described(&dlq).await["retention.ms"], "1209600000", "dead letters: 14 days");

    // Run again with shorter retentions: a longer one, as an operator raises it during an
    // incident, is kept and said...
    let output = stack
        .run_writer_command(&["topics", "--retention-ms", "60000", "--dlq-retention-ms", "120000"])
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(output["kept_longer_retention"][&requests], json!(86_400_000), "{output}");
    assert_eq!(output["kept_longer_retention"][&dlq], json!(1_209_600_000_i64), "{output}");
    let settings = described(&requests).await;
    assert_eq!((settings["retention.ms"].as_str(), settings["segment.ms"].as_str()), ("86400000", "3600000"));
    assert_eq!(settings["message.timestamp.type"], "LogAppendTime", "kept when the others are set");
    // ...and lowered only when asked: the existing topics take them.
    let output = stack
        .run_writer_command(&["topics", "--retention-ms", "60000", "--dlq-retention-ms", "120000", "--lower-retention"])
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert!(output.get("kept_longer_retention").is_none(), "{output}");
    assert_eq!(output["created"], json!([]));
    assert_eq!(output["configured"].as_array().map(Vec::len), Some(3), "{output}");
    let settings = described(&requests).await;
    assert_eq!(
        (settings["retention.ms"].as_str(), settings["segment.ms"].as_str()),
        ("60000", "15000"),
        "{settings:?}"
    );
    assert_eq!(settings["message.timestamp.type"], "LogAppendTime", "kept when the others change");
    assert_eq!(described(&replies).await["retention.ms"], "60000");
    assert_eq!(described(&dlq).await["retention.ms"], "120000");

    // What is past the window: a range of two hours ago, an old row of the default range, an
    // old tombstone. The requests window is now 60 + 15 s; the tombstones', the dead letters'
    // 120 + 30 s.
    let now: i64 = sqlx::query_scalar("SELECT extract(epoch FROM now())::int8").fetch_one(&db).await.unwrap_or(0);
    let (old_start, old_end) = (now - 7_200, now - 7_140);
    let setup = [
        format!(
            "CREATE TABLE applied_messages_{old_start}_{old_end} PARTITION OF applied_messages
                FOR VALUES FROM (to_timestamp({old_start})) TO (to_timestamp({old_end}))"
        ),
        format!(
            "INSERT INTO applied_messages (correlation_id, workspace_id, results, applied_at)
             VALUES ('old-range', 'ws', '[]', to_timestamp({old_start} + 1)),
                    ('old-default', 'ws', '[]', now() - interval '1 hour')"
        ),
        "INSERT INTO workspaces (id, name, project_id) VALUES ('ws_retention', 'w', 'p')".to_owned(),
        "INSERT INTO erasures (id, workspace_id, identifier_kind, conversions, visits)
         VALUES (1, 'ws_retention', 'email', 0, 0), (2, 'ws_retention', 'email', 0, 0)"
            .to_owned(),
        "INSERT INTO erasure_tombstones (erasure_id, workspace_id, erased_at, digests)
         VALUES (1, 'ws_retention', now() - interval '10 minutes', '{}'), (2, 'ws_retention', now(), '{}')"
            .to_owned(),
    ];
    for statement in &setup {
        sqlx::query(statement).execute(&db).await.unwrap_or_else(|e| panic!("{statement}: {e}"));
    }

    let ops = format!("127.0.0.1:{}", intake_tests::free_port());
    let _writer = Writer(
        stack
            .writer_command()
            .args(["run", "--ops-listen", &ops, "--retention-margin-ms", "0"])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(stack.log_dir.join("writer.log")).unwrap_or_else(|e| panic!("{e}")))
            .spawn()
            .unwrap_or_else(|e| panic!("{e}")),
    );

    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (old_range, old_rows, ahead, tombstones): (i64, i64, i64, Vec<i64>) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM pg_inherits WHERE inhparent = 'applied_messages'::regclass
                       AND inhrelid::regclass::text = $1),
                    (SELECT count(*) FROM applied_messages WHERE correlation_id IN ('old-range', 'old-default')),
                    (SELECT count(*) FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
                      WHERE i.inhparent = 'applied_messages'::regclass
                        AND CASE WHEN c.relname ~ '^applied_messages_[0-9]+_[0-9]+$'
                                 THEN split_part(c.relname, '_', 4)::int8 > extract(epoch FROM now()) + 10 END),
                    (SELECT array_agg(erasure_id ORDER BY erasure_id) FROM erasure_tombstones)",
        )
        .bind(format!("applied_messages_{old_start}_{old_end}"))
        .fetch_one(&db)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        if (old_range, old_rows, ahead > 0, tombstones.as_slice()) == (0, 0, true, &[2][..]) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "after 60 s: old range {old_range}, old rows {old_rows}, ranges ahead {ahead}, tombstones {tombstones:?}; \
             see {}",
            stack.log_dir.display()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // A write now lands in a range, not in the default partition.
    let key = stack.workspace();
    let reply = stack.post("/v1/conversions", &key, &conversion("lead")).await;
    assert_eq!(reply.status, 201, "{reply:?}");
    let partition: String =
        sqlx::query_scalar("SELECT tableoid::regclass::text FROM applied_messages WHERE workspace_id = $1 LIMIT 1")
            .bind(&key.workspace_id)
            .fetch_one(&db)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    assert!(partition.starts_with("applied_messages_1"), "{partition}");
    db.close().await;
}
