//! The writer within its limits (docs/architecture.md, "Memory", "Isolation in the writer"): a
//! database outage longer than the consumer's poll interval costs the writer no more than its
//! read budget and keeps it in its group; incremental rebalancing is refused; a worker that dies
//! is restarted; a workspace held elsewhere for too long makes the writer unready; workspaces
//! passed over are read again in order, however often the re-reader moves.

use intake_model::message::{WriteRequest, WriteRequestV1};
use intake_tests::serde_json::{json, Value};
use intake_tests::*;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BUDGET_MIB: f64 = 4.0;

/// The resident memory of a process, in MiB.
fn rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kib = status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|kib| kib.parse::<f64>().ok());
    kib.unwrap_or_else(|| panic!("no VmRSS for {pid}")) / 1024.0
}

/// `--kafka-option` flags: the environment's INTAKE_KAFKA_OPTIONS (which the flags replace), then
/// `extra`.
fn kafka_options(extra: &[&str]) -> Vec<String> {
    let inherited = std::env::var("INTAKE_KAFKA_OPTIONS").unwrap_or_default();
    let options = inherited.split(',').map(str::trim).filter(|o| !o.is_empty()).chain(extra.iter().copied());
    options.flat_map(|option| ["--kafka-option".to_owned(), option.to_owned()]).collect()
}

/// A large valid conversion: about 700 bytes of text.
fn large_item(external_id: &str) -> Value {
    let text = |c: char, n: usize| std::iter::repeat_n(c, n).collect::<String>();
    let tags: serde_json::Map<String, Value> = ["alpha", "beta", "gamma", "delta", "epsilon"]
        .iter()
        .map(|key| ((*key).to_owned(), json!(text('t', 64))))
        .collect();
    json!({
        "event": "lead", "external_id": external_id, "occurred_at": now_ms() - 1000,
        "hdyhau": text('h', 200), "tags": tags,
    })
}

/// `messages` request messages of 100 large items each, spread over `workspaces`, as gateways
/// would have produced them before the writer could apply them: (workspace id, payload) each,
/// and the items per workspace.
fn backlog(workspaces: &[TestKey], messages: usize) -> (Vec<(String, Vec<u8>)>, Vec<usize>) {
    let mut items = vec![0; workspaces.len()];
    let messages = (0..messages)
        .map(|n| {
            let workspace = n % workspaces.len();
            let conversions = (0..100)
                .map(|i| {
                    let input = large_item(&format!("backlog-{n}-{i}"));
                    intake_model::validate::validate_conversion(&(&input).into(), now_ms())
                        .unwrap_or_else(|e| panic!("invalid backlog item: {e:?}"))
                        .conversion
                })
                .collect::<Vec<_>>();
            items[workspace] += conversions.len();
            let request = WriteRequest::V1(WriteRequestV1 {
                correlation_id: format!("backlog-{}", ulid::Ulid::new()),
                reply_partition: 0,
                deadline_ms: now_ms() + 600_000,
                received_at_ms: now_ms(),
                workspace_id: workspaces[workspace].workspace_id.clone(),
                items: conversions,
                request: None,
                position: None,
            });
            (workspaces[workspace].workspace_id.clone(), serde_json::to_vec(&request).unwrap_or_default())
        })
        .collect();
    (messages, items)
}

/// Produces the [`backlog`]'s messages straight into `topic`.
async fn produce(topic: &str, messages: &[(String, Vec<u8>)]) {
    produce_to(topic, messages.iter().map(|(workspace_id, payload)| (None, workspace_id.as_str(), payload.as_slice())))
        .await;
}

/// Produces messages (a partition, or the key's; a key; a payload) straight into `topic`.
async fn produce_to<'a>(topic: &str, messages: impl IntoIterator<Item = (Option<i32>, &'a str, &'a [u8])>) {
    let producer: rdkafka::producer::FutureProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", env("INTAKE_KAFKA_BROKERS"))
        .set("linger.ms", "5")
        .create()
        .unwrap_or_else(|e| panic!("producer: {e}"));
    let mut deliveries = Vec::new();
    for (partition, key, payload) in messages {
        let mut record = rdkafka::producer::FutureRecord::to(topic).key(key).payload(payload);
        record.partition = partition;
        deliveries.push(producer.send_result(record).unwrap_or_else(|(e, _)| panic!("produce: {e}")));
    }
    for delivery in deliveries {
        assert!(matches!(delivery.await, Ok(Ok(_))), "a message was not delivered");
    }
}

#[tokio::test]
async fn a_database_outage_past_the_poll_interval_keeps_the_writer_in_its_group_and_within_its_budget() {
    let postgres = PrivatePostgres::start_new();
    postgres.migrate();
    let mut writer_args = vec!["--read-budget-mib".to_owned(), BUDGET_MIB.to_string()];
    // A writer that stops polling is out of its group after 10 s: the outage lasts longer. A
    // smaller prefetch than the default, so that the margin on the RSS can be small.
    writer_args.extend(kafka_options(&[
        "max.poll.interval.ms=10000",
        "queued.max.messages.kbytes=2048",
        "fetch.max.bytes=1048576",
    ]));
    let options = StackOptions {
        database_url: Some(postgres.url()),
        write_timeout_ms: 2_000,
        writer_args,
        ..StackOptions::unlimited()
    };
    let stack = Stack::start_with(options).await;
    let keys: Vec<TestKey> = (0..6).map(|_| stack.workspace()).collect();
    let backlog_keys: Vec<TestKey> = (0..3).map(|_| stack.workspace()).collect();
    let traffic = Traffic::start(stack.client(), &keys);
    wait_until("traffic acknowledged", Duration::from_secs(20), || async { traffic.acknowledged() >= 30 }).await;
    let writer = stack.pids().1[0];
    let idle = rss_mib(writer);
    // 400 messages of 100 items, about 12 times the budget once parsed: a writer that held them
    // all would grow by some 48 MiB. Built before the outage, which then lasts its full length.
    let workspaces = backlog_keys.clone();
    let (messages, backlog) = tokio::task::spawn_blocking(move || backlog(&workspaces, 400))
        .await
        .unwrap_or_else(|e| panic!("building the backlog: {e}"));

    postgres.stop();
    let outage = Instant::now();
    produce(&format!("{}.requests", stack.topic_prefix), &messages).await;
    let (mut peak, mut held_max, mut paused_max, mut passed_over_max) = (idle, 0.0_f64, 0.0_f64, 0.0_f64);
    while outage.elapsed() < Duration::from_secs(16) {
        peak = peak.max(rss_mib(writer));
        let metrics = stack.writer_metrics(0).await;
        held_max = held_max.max(metrics.value("intake_writer_backlog_bytes"));
        paused_max = paused_max.max(metrics.value("intake_writer_paused_partitions"));
        passed_over_max = passed_over_max.max(metrics.value("intake_writer_passed_over_workspaces"));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    postgres.start();
    let back = Instant::now();
    traffic.wait_recovered(back, Duration::from_secs(40)).await;
    let sent = traffic.stop().await;
    let report = FaultReport::of(&sent, keys.len(), back);
    let db = sqlx::PgPool::connect(&postgres.url()).await.unwrap_or_else(|e| panic!("{e}"));
    let ledger = check_ledger_in(&db, &keys, &sent, Duration::from_secs(30)).await;
    let drained = || async {
        let mut all = true;
        for (key, items) in backlog_keys.iter().zip(&backlog) {
            all &= stored_count(&db, &key.workspace_id).await == i64::try_from(*items).unwrap_or(-1);
        }
        all
    };
    wait_until("the backlog kept in Kafka applied", Duration::from_secs(60), drained).await;
    let drained_after = back.elapsed();
    let logs = stack.logs();
    let budget = BUDGET_MIB * 1_048_576.0;
    eprintln!(
        "writer RSS idle {idle:.1} MiB, peak {peak:.1} MiB; held at most {:.2} MiB of a {BUDGET_MIB} MiB budget; \
         {paused_max} partitions paused and {passed_over_max} workspaces passed over at most; every workspace wrote again {:?} after the database's return; \
         the backlog was applied {drained_after:?} after it; {report:?}",
        held_max / 1_048_576.0,
        report.recovered_after,
    );
    // Held back: the backlog's workspaces passed over (their messages left in Kafka), or, at the
    // budget, every partition paused.
    assert!(paused_max + passed_over_max >= 1.0, "the budget held the writer back");
    // The budget is crossed by the message that reaches it, at most (one of 100 large items).
    assert!(held_max <= budget + 256.0 * 1024.0, "held {held_max} bytes");
    assert!(peak <= idle + BUDGET_MIB + 24.0, "RSS {idle:.1} MiB idle, {peak:.1} MiB at its peak");
    assert_eq!(logs.matches("partitions assigned").count(), 1, "assigned once, at the start");
    assert!(!logs.contains("partitions revoked"), "the writer stayed in its group through the outage");
    assert!(report.recovered_after.is_some_and(|after| after < Duration::from_secs(40)), "{report:?}");
    assert!(report.unexpected.is_empty(), "{report:?}");
    assert!(ledger.is_clean(), "{ledger:?}");
    assert!(ledger.updated > 0, "the traffic updated rows: {ledger:?}");
}

/// Runs `intake-writer run` with one more Kafka option and returns its exit status and stderr,
/// or panics if it is still running after 20 s.
fn run_writer_with(option: &str) -> (Option<i32>, String) {
    let log = std::env::temp_dir().join(format!("intake-writer-refusal-{}.log", ulid::Ulid::new()));
    let file = std::fs::File::create(&log).unwrap_or_else(|e| panic!("{e}"));
    let mut writer = Command::new(std::path::PathBuf::from(env("INTAKE_BIN_DIR")).join("intake-writer"))
        .args(["run", "--ops-listen", &format!("127.0.0.1:{}", free_port())])
        .args(kafka_options(&[option]))
        .env("INTAKE_REQUESTS_TOPIC", format!("refusal-{}", ulid::Ulid::new()))
        .stdout(Stdio::null())
        .stderr(file)
        .spawn()
        .unwrap_or_else(|e| panic!("{e}"));
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Ok(Some(status)) = writer.try_wait() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = writer.kill();
            panic!("the writer with {option} kept running");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stderr = std::fs::read_to_string(&log).unwrap_or_default();
    let _ = std::fs::remove_file(&log);
    (status.code(), stderr)
}

#[test]
fn the_writer_refuses_incremental_rebalancing_at_start() {
    for (option, named) in [
        ("partition.assignment.strategy=cooperative-sticky", "partition.assignment.strategy"),
        ("group.protocol=consumer", "group.protocol"),
    ] {
        let (code, stderr) = run_writer_with(option);
        assert_eq!(code, Some(1), "{option}: {stderr}");
        assert!(stderr.contains(named) && stderr.contains("refused") && stderr.contains("eager"), "{stderr}");
    }
}

async fn ops(stack: &Stack, ops_url: &str, path: &str) -> (u16, String) {
    stack.ops_get(&format!("{ops_url}{path}")).await
}

#[tokio::test]
async fn a_worker_that_dies_is_restarted_and_a_message_workers_keep_dying_on_is_dead_lettered() {
    let stack = Stack::start_with(StackOptions { start_writer: false, ..Default::default() }).await;
    let (key, other) = (stack.workspace(), stack.workspace());
    let ops_url = format!("http://127.0.0.1:{}", free_port());
    let log = std::fs::File::create(stack.log_dir.join("writer.log")).unwrap_or_else(|e| panic!("{e}"));
    // Workers die four times holding this workspace: three times on its first message (the
    // policy's attempts, then it is given up on), once on the next, which then applies.
    let mut writer = stack
        .writer_command()
        .env("INTAKE_WRITER_FAILPOINT_PANIC", format!("{}:4", key.workspace_id))
        .args(["run", "--ops-listen", ops_url.trim_start_matches("http://")])
        .stdout(log.try_clone().unwrap_or_else(|e| panic!("{e}")))
        .stderr(log)
        .spawn()
        .unwrap_or_else(|e| panic!("{e}"));
    let ready = || async { ops(&stack, &ops_url, "/readyz").await.0 == 200 };
    wait_until("the writer in its group", Duration::from_secs(30), ready).await;

    let first = stack.post("/v1/conversions", &key, &conversion("lead")).await;
    assert_eq!((first.status, first.error_code()), (500, "internal_error"), "given up on: {first:?}");
    let letters = topic_headers(&format!("{}.requests.dlq", stack.topic_prefix), 1, Duration::from_secs(20));
    assert_eq!(letters[0].get("reason").map(String::as_str), Some("worker_died"), "{letters:?}");
    assert_eq!(letters[0].get("attempts").map(String::as_str), Some("3"), "{letters:?}");
    let second = stack.post("/v1/conversions", &key, &conversion("lead")).await;
    assert_eq!(second.status, 201, "the workspace goes on: {second:?}");
    assert_eq!(stack.post("/v1/conversions", &other, &conversion("lead")).await.status, 201);

    let metrics = Metrics(ops(&stack, &ops_url, "/metrics").await.1);
    assert_eq!(metrics.value("intake_writer_worker_restarts_total"), 4.0);
    assert!(writer.try_wait().is_ok_and(|status| status.is_none()), "the same process throughout");
    assert_eq!(ops(&stack, &ops_url, "/healthz").await.0, 200);
    assert_eq!(stored_count(&database().await, &key.workspace_id).await, 1);
    assert!(stack.logs().contains("an apply worker died; started again"));
    let _ = writer.kill();
    let _ = writer.wait();
}

#[tokio::test]
async fn a_workspace_held_elsewhere_past_the_bound_makes_the_writer_unready_but_not_unhealthy() {
    let stack = Stack::start_with(StackOptions {
        write_timeout_ms: 2_000,
        writer_args: ["--workspace-wait-bound-ms", "1000", "--stall-timeout-ms", "2000"].map(String::from).to_vec(),
        ..Default::default()
    })
    .await;
    let key = stack.workspace();
    assert_eq!(stack.post("/v1/conversions", &key, &conversion("lead")).await.status, 201);
    let db = database().await;
    // An operator's session holds the workspace's apply lock, as one left idle in a
    // transaction during an erasure would.
    let mut holder = db.acquire().await.unwrap_or_else(|e| panic!("{e}"));
    hold_workspace(&mut holder, &key.workspace_id).await;
    assert_eq!(stack.post("/v1/conversions", &key, &conversion("lead")).await.status, 500);
    let writer = &stack.writer_ops_urls[0];
    let held = || async {
        ops(&stack, writer, "/readyz").await == (503, r#"{"status":"not_ready","reason":"workspace_held"}"#.into())
    };
    wait_until("the writer unready", Duration::from_secs(20), held).await;
    assert_eq!(ops(&stack, writer, "/healthz").await.0, 200, "a restart would not release the lock");
    let series = format!(r#"intake_writer_workspace_waiting_seconds{{workspace_id="{}"}}"#, key.workspace_id);
    assert!(stack.writer_metrics(0).await.value(&series) >= 1.0);

    release_workspace(&mut holder, &key.workspace_id).await;
    wait_until("the writer ready again", Duration::from_secs(20), || async {
        ops(&stack, writer, "/readyz").await.0 == 200
    })
    .await;
    wait_until("the held write applied", Duration::from_secs(10), || async {
        stored_count(&db, &key.workspace_id).await == 2
    })
    .await;
}

#[tokio::test]
async fn workspaces_stuck_on_every_partition_with_a_small_budget_leave_it_to_their_neighbours_and_lose_nothing() {
    let mut writer_args: Vec<String> =
        ["--read-budget-mib", "1", "--workspace-wait-bound-ms", "60000"].map(String::from).to_vec();
    writer_args.extend(kafka_options(&["queued.max.messages.kbytes=2048", "fetch.max.bytes=1048576"]));
    let mut stack =
        Stack::start_with(StackOptions { write_timeout_ms: 5_000, writer_args, ..StackOptions::unlimited() }).await;
    // A workspace stuck on every partition, and a neighbour beside each.
    let stuck = stack.workspaces_on_every_partition();
    let neighbours = stack.workspaces_on_every_partition();
    let db = database().await;
    let mut holder = db.acquire().await.unwrap_or_else(|e| panic!("{e}"));
    for key in &stuck {
        hold_workspace(&mut holder, &key.workspace_id).await;
    }
    // Their backlogs, each several times its share of the budget.
    let workspaces = stuck.clone();
    let count = 8 * stuck.len();
    let (messages, items) = tokio::task::spawn_blocking(move || backlog(&workspaces, count))
        .await
        .unwrap_or_else(|e| panic!("building the backlog: {e}"));
    produce(&format!("{}.requests", stack.topic_prefix), &messages).await;
    wait_until("the stuck workspaces passed over", Duration::from_secs(30), || async {
        stack.writer_metrics(0).await.value("intake_writer_passed_over_workspaces") == stuck.len() as f64
    })
    .await;

    // The neighbours keep writing on every partition, one send after another.
    let started = Instant::now();
    for round in 0..3 {
        for key in &neighbours {
            let reply = stack.post("/v1/conversions", key, &conversion("lead")).await;
            assert_eq!(reply.status, 201, "round {round}, after {:?}: {reply:?}", started.elapsed());
        }
    }
    let metrics = stack.writer_metrics(0).await;
    let (held, paused) =
        (metrics.value("intake_writer_backlog_bytes"), metrics.value("intake_writer_paused_partitions"));
    eprintln!(
        "{} neighbours' sends in {:?} beside {} stuck workspaces: {held} bytes held of a 1 MiB budget, {paused} \
         partitions paused, {} workspaces passed over",
        3 * neighbours.len(),
        started.elapsed(),
        stuck.len(),
        metrics.value("intake_writer_passed_over_workspaces"),
    );
    assert_eq!(paused, 0.0, "no partition is paused for the stuck workspaces");
    // What the stuck workspaces hold stays within the budget: the rest waits in Kafka.
    assert!(held <= 1.25 * 1024.0 * 1024.0, "{held} bytes held");

    // A writer killed meanwhile: its successor reads from the offsets committed, which stayed
    // below every message left in Kafka, and passes the stuck workspaces over again.
    stack.kill_writer(0);
    stack.start_writer();
    wait_until("the stuck workspaces passed over by the next writer", Duration::from_secs(60), || async {
        let metrics = Metrics::try_scrape(&stack.http, &stack.writer_ops_urls[0]).await;
        metrics.ok().and_then(|m| m.get("intake_writer_passed_over_workspaces")) == Some(stuck.len() as f64)
    })
    .await;

    // Released, each stuck workspace's backlog is read again from Kafka and written whole.
    for key in &stuck {
        release_workspace(&mut holder, &key.workspace_id).await;
    }
    for (key, items) in stuck.iter().zip(items) {
        let items = i64::try_from(items).unwrap_or(i64::MAX);
        wait_until("a stuck workspace's backlog written", Duration::from_secs(60), || async {
            stored_count(&db, &key.workspace_id).await == items
        })
        .await;
    }
    wait_until("no workspace passed over", Duration::from_secs(10), || async {
        stack.writer_metrics(0).await.value("intake_writer_passed_over_workspaces") == 0.0
    })
    .await;
    drop(holder);
}

/// The writer's re-reader moves its consumer between partitions and offsets thousands of times,
/// as a flood of workspaces passed over and read again makes it, and then reads from where it
/// was moved to, in order. (Moved by reassigning the consumer, librdkafka aborted the writer
/// within the first few moves.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_re_reader_moves_thousands_of_times_and_reads_from_where_it_was_moved_to() {
    use intake_writer::reread::{Cursor, Reading};
    use rand::{Rng, SeedableRng};
    use rdkafka::message::Message;
    use std::collections::BTreeMap;
    const PER_PARTITION: i64 = 400;

    let stack =
        Stack::start_with(StackOptions { start_writer: false, request_partitions: 8, ..Default::default() }).await;
    let topic = format!("{}.requests", stack.topic_prefix);
    let partitions = i32::try_from(stack.request_partitions()).unwrap_or(i32::MAX);
    // Each a kilobyte or two, as a chunk is: the fetches carry data while the consumer moves.
    let messages: Vec<(i32, Vec<u8>)> = (0..partitions)
        .flat_map(|partition| {
            (0..PER_PARTITION).map(move |offset| (partition, format!("{partition}/{offset}/{}", "x".repeat(2_000))))
        })
        .map(|(partition, payload)| (partition, payload.into_bytes()))
        .collect();
    produce_to(&topic, messages.iter().map(|(partition, payload)| (Some(*partition), "k", payload.as_slice()))).await;

    let args = intake_common::config::KafkaArgs {
        brokers: env("INTAKE_KAFKA_BROKERS"),
        options: Vec::new(),
        requests_topic: topic.clone(),
        replies_topic: format!("{}.replies", stack.topic_prefix),
        dlq_topic: format!("{}.requests.dlq", stack.topic_prefix),
    };
    let consumer = intake_common::kafka::writer_rereader(&args).create().unwrap_or_else(|e| panic!("consumer: {e}"));
    let mut cursor = Cursor::new(consumer, topic);
    let mut reading = Reading::default();
    let mut random = rand::rngs::StdRng::seed_from_u64(7);
    // Reads what comes within `wait`; the messages read in order from where each partition was
    // moved to (what was fetched before a move comes out of order and is passed, as the
    // re-reader passes it).
    async fn read(
        cursor: &Cursor<rdkafka::consumer::DefaultConsumerContext>,
        next: &mut BTreeMap<i32, i64>,
        wait: Duration,
    ) -> usize {
        let mut in_order = 0;
        while let Ok(Ok(message)) = tokio::time::timeout(wait, cursor.consumer().recv()).await {
            let expected = next.get_mut(&message.partition());
            if let Some(expected) = expected.filter(|expected| **expected == message.offset()) {
                let payload = String::from_utf8_lossy(message.payload().unwrap_or_default()).into_owned();
                assert!(payload.starts_with(&format!("{}/{}/", message.partition(), message.offset())));
                *expected += 1;
                in_order += 1;
            }
        }
        in_order
    }
    let mut generation = 1;
    for round in 0..10_000 {
        if round % 2_000 == 1_999 {
            generation += 1; // a rebalance
        }
        let mut wanted = BTreeMap::new();
        for partition in 0..partitions {
            if random.gen_bool(0.4) {
                wanted.insert(partition, random.gen_range(0..PER_PARTITION));
            }
        }
        if !reading.needs(generation, &wanted) {
            continue;
        }
        let mut next = cursor.read_from(&reading, generation, &wanted).unwrap_or_else(|e| panic!("round {round}: {e}"));
        read(&cursor, &mut next, Duration::from_millis(random.gen_range(0..3))).await;
        reading = Reading::new(generation, next);
    }

    // Moved once more, in the same generation: a partition read now, to a few messages ahead
    // (it reads on, not sought); any other from an offset of its own (sought, and resumed if
    // paused). Each is then read to its end, in order.
    let wanted: BTreeMap<i32, i64> = (0..partitions)
        .map(|partition| match reading.next().get(&partition) {
            Some(next) => (partition, (next + 3).min(PER_PARTITION - 1)),
            None => (partition, i64::from(partition) * 7),
        })
        .collect();
    let mut next = cursor.read_from(&reading, generation, &wanted).unwrap_or_else(|e| panic!("the last move: {e}"));
    let from = next.clone();
    for (partition, offset) in &from {
        let reads_on = reading.next().get(partition).filter(|next| *next <= &wanted[partition]);
        assert_eq!(Some(offset), reads_on.or(wanted.get(partition)), "partition {partition}");
    }
    let started = Instant::now();
    let mut read_in_order = 0;
    while next.values().any(|offset| *offset < PER_PARTITION) && started.elapsed() < Duration::from_secs(20) {
        read_in_order += read(&cursor, &mut next, Duration::from_millis(500)).await;
    }
    let expected: i64 = from.values().map(|from| PER_PARTITION - from).sum();
    assert_eq!(next, (0..partitions).map(|partition| (partition, PER_PARTITION)).collect(), "read to the end");
    assert_eq!(i64::try_from(read_in_order).unwrap_or_default(), expected);
}
