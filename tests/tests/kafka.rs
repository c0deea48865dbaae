//! On Apache Kafka: a writer killed with SIGKILL and started again gets partitions and serves
//! them; a writer stopped with SIGTERM hands them over at once; every broker down and back. (The
//! leader of a request partition killed under traffic is the fault harness's, deploy/faults.sh.)

use intake_tests::serde_json::Value;
use intake_tests::{
    check_ledger, database, stored_conversion_ids, stored_count, wait_until, FaultReport, KafkaCluster, Stack,
    StackOptions, Traffic,
};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// A killed writer keeps its partitions until its session times out (10 s).
const SESSION_TIMEOUT: Duration = Duration::from_secs(10);
const DEADLINE: Duration = Duration::from_secs(10);
/// How long the broker stays down after a writer is started without it (an outage's length).
const STILL_DOWN_AFTER_THE_WRITER_STARTS: Duration = Duration::from_secs(15);

async fn kill_a_writer_and_start_it_again(writers: usize, back_within: Duration) {
    let mut stack = Stack::start_with(StackOptions { writers, ..StackOptions::unlimited() }).await;
    let keys = stack.workspaces_on_every_partition();
    let traffic = Traffic::start(stack.client(), &keys);
    traffic.wait_recovered(Instant::now(), Duration::from_secs(30)).await;

    let killed_at = Instant::now();
    stack.kill_writer(0);
    stack.start_writer(); // as a supervisor would
    traffic.wait_recovered(killed_at, back_within + Duration::from_secs(3)).await;
    let sent = traffic.stop().await;

    let report = FaultReport::of(&sent, keys.len(), killed_at);
    assert!(report.unexpected.is_empty(), "{report:?}");
    assert!(report.longest < DEADLINE + Duration::from_secs(2), "every request ended within the deadline: {report:?}");
    let recovered =
        report.recovered_after.unwrap_or_else(|| panic!("writes never came back on every partition: {report:?}"));
    assert!(recovered <= back_within, "every partition served again after {recovered:?}: {report:?}");
    let check = check_ledger(&keys, &sent, Duration::from_secs(30)).await;
    assert!(check.is_clean(), "acknowledged but not stored, or stored with an older value: {check:?}");
    assert!(check.updated > 0, "the traffic updated rows: {check:?}");
}

#[tokio::test]
async fn one_of_two_writers_killed_and_restarted_every_partition_is_served_again() {
    kill_a_writer_and_start_it_again(2, SESSION_TIMEOUT + Duration::from_secs(15)).await;
}

#[tokio::test]
async fn the_only_writer_killed_and_restarted_writes_come_back_within_30_s() {
    kill_a_writer_and_start_it_again(1, Duration::from_secs(30)).await;
}

#[tokio::test]
async fn a_writer_stopped_with_sigterm_hands_its_partitions_over_at_once() {
    let mut stack = Stack::start_with(StackOptions { writers: 2, ..StackOptions::unlimited() }).await;
    let keys = stack.workspaces_on_every_partition();
    let traffic = Traffic::start(stack.client(), &keys);
    traffic.wait_recovered(Instant::now(), Duration::from_secs(30)).await;
    let stopped_at = Instant::now();
    let exited = stack.terminate_writer(0);
    let (took, status) =
        tokio::task::spawn_blocking(move || exited.join().unwrap_or_default()).await.unwrap_or_default();
    // Every partition is served after the writer has gone, by the other one.
    traffic.wait_recovered(Instant::now(), Duration::from_secs(8)).await;
    let sent = traffic.stop().await;
    assert!(status.is_some_and(|s| s.success()), "exited cleanly: {status:?}");
    assert!(took < Duration::from_secs(5), "finished its group, committed and left in {took:?}");
    let report = FaultReport::of(&sent, keys.len(), stopped_at);
    assert_eq!(
        report.failed, 0,
        "no request failed: the partitions moved without waiting for a session timeout: {report:?}"
    );
    assert!(report.longest < SESSION_TIMEOUT / 2, "{report:?}");
    let check = check_ledger(&keys, &sent, Duration::from_secs(30)).await;
    assert!(check.is_clean(), "acknowledged but not stored, or stored with an older value: {check:?}");
    assert!(check.updated > 0, "the traffic updated rows: {check:?}");
}

/// Every broker down (the one broker of the test's own): a writer stopped with SIGTERM exits
/// cleanly in bounded time; a write that Kafka never took gets no reply, and once the broker is
/// back, its workspace's writes are admitted at once, not refused as behind for as long as that
/// lost chunk would be remembered. What is stored is what the clients were told: every write
/// answered 2xx once, with the id it was given, and nothing of the one answered 5xx and never
/// sent again.
#[tokio::test]
async fn every_broker_down_a_writer_exits_on_sigterm_and_writes_come_back_with_the_broker() {
    let cluster = KafkaCluster::start();
    // The group's joins and the coordinator's answers in the writer's log, for a failure's report.
    let writer_env = vec![
        ("INTAKE_LOG".to_owned(), "info,librdkafka=debug".to_owned()),
        ("INTAKE_KAFKA_OPTIONS".to_owned(), "debug=cgrp".to_owned()),
    ];
    let options =
        StackOptions { kafka_brokers: Some(cluster.bootstrap.clone()), writer_env, ..StackOptions::unlimited() };
    let mut stack = Stack::start_with(options).await;
    let (key, fresh) = (stack.workspace(), stack.workspace());
    // What each workspace's client was told was stored: external id to conversion id.
    let (mut told, mut fresh_told) = (BTreeMap::new(), BTreeMap::new());
    let before = intake_tests::conversion("lead");
    let reply = stack.post("/v1/conversions", &key, &before).await;
    assert_eq!(reply.status, 201, "{}", reply.body);
    told.insert(external_id(&before), conversion_id(&reply.body));
    cluster.kill();
    let outage = Instant::now();
    let down = || async { std::net::TcpStream::connect(&cluster.bootstrap).is_err() };
    wait_until("the broker down", Duration::from_secs(10), down).await;
    let unsent = intake_tests::conversion("lead");
    let during = stack.post("/v1/conversions", &key, &unsent).await;
    assert!((500..600).contains(&during.status), "no broker took it: {} {}", during.status, during.body);

    let exited = stack.terminate_writer(0);
    let (took, status) =
        tokio::task::spawn_blocking(move || exited.join().unwrap_or_default()).await.unwrap_or_default();
    assert!(status.is_some_and(|s| s.success()), "the writer exited cleanly, not by a crash: {status:?}");
    // The default shutdown timeout is 10 s; the commit and the group leave wait at most that.
    assert!(took < Duration::from_secs(15), "exited after {took:?}");

    // A writer started while every broker is down, and kept waiting for them a while: the
    // client errors librdkafka queues meanwhile must not hold its assignment back afterwards.
    stack.start_writer();
    tokio::time::sleep(STILL_DOWN_AFTER_THE_WRITER_STARTS).await;
    cluster.restart_stopped();
    let outage = outage.elapsed();
    // Kafka takes writes again: a workspace that sent nothing during the outage gets through.
    // Its client sends the same conversion again after each 5xx, as a client should: the answer
    // is 201, or 200 where a send answered 5xx was stored after all.
    let back = Instant::now();
    let retried = intake_tests::conversion("lead");
    loop {
        let reply = stack.post("/v1/conversions", &fresh, &retried).await;
        if (200..300).contains(&reply.status) {
            fresh_told.insert(external_id(&retried), conversion_id(&reply.body));
            break;
        }
        assert!((500..600).contains(&reply.status), "refused, not failed: {} {}", reply.status, reply.body);
        assert!(
            back.elapsed() < Duration::from_secs(60),
            "Kafka never took writes again: {} {}",
            reply.status,
            reply.body
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let after = intake_tests::conversion("lead");
    let reply = stack.post("/v1/conversions", &key, &after).await;
    assert_eq!(reply.status, 201, "the workspace that wrote during the outage: {}", reply.body);
    told.insert(external_id(&after), conversion_id(&reply.body));

    // Stored: each acknowledged conversion once, under the id its client was told; the one
    // answered 5xx while no broker ran is not, though its client never sent it again: its
    // producer gave it up at its deadline, and a message past its deadline is never applied. (Had
    // it reached the topic at all, it came before its workspace's last write, applied by now.)
    let db = database().await;
    for (key, told) in [(&key, &told), (&fresh, &fresh_told)] {
        let stored = stored_conversion_ids(&db, &key.workspace_id).await;
        assert_eq!(&stored, told, "stored against told, answered 5xx: {}", external_id(&unsent));
        assert_eq!(stored_count(&db, &key.workspace_id).await, i64::try_from(told.len()).unwrap_or_default());
    }

    // librdkafka raised client errors all along, several a second per client: each client logs
    // the first and then at most one line per 5 s, and rdkafka's own line per error is gone.
    // Clients: the gateway's producer and reply reader; the writer's reader, producer and
    // retention look-up, in each of its two runs (unthrottled, 756 lines in a 47 s outage).
    let logs = stack.logs();
    let logged = logs.matches("Kafka client error").count();
    let most = 8 * (outage.as_secs() as usize / 5 + 2);
    assert!((1..=most).contains(&logged), "{logged} lines of client errors in a {outage:?} outage, at most {most}");
    assert!(!logs.contains("librdkafka: Global error"), "rdkafka's own line per client error");
}

fn external_id(conversion: &Value) -> String {
    conversion["external_id"].as_str().unwrap_or_default().to_owned()
}

/// The conversion id an answer gave.
fn conversion_id(body: &Value) -> String {
    body["conversion"]["id"].as_str().unwrap_or_else(|| panic!("no conversion id: {body}")).to_owned()
}
