//! Bounds on latency, run alone after the rest of the suite (`deploy/test.sh`, nextest's
//! profile `latency`), so that what they bound is the service's, not the suite's: a workspace
//! held in PostgreSQL holds up only itself (docs/architecture.md, "Isolation in the writer").

use intake_tests::*;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// The neighbours' p99 while a workspace is held, on its partition as on the others, of the
/// time outside their transaction's commit: everything the held workspace could hold them up in
/// (reading, the queue, the apply, the replies).
const NEIGHBOURS_P99: Duration = Duration::from_millis(250);

/// The same with the commit: a commit waits for the disk's flush, and a shared virtual disk
/// stalls a flush now and then for 200 to 500 ms, whatever is held. Each stall holds up a whole
/// round of sends at once, and a round is about 1 % of them, so the p99 with the commit is the
/// host's disk's: bounded here with room for such a stall.
const NEIGHBOURS_P99_WITH_COMMIT: Duration = Duration::from_secs(1);

/// Workspaces sending one conversion at a time, each again as soon as it is answered.
const SINGLE_SENDERS: usize = 32;

/// The longest a 500-item batch may take among single sends that never let up.
const BATCH_AMONG_SINGLES: Duration = Duration::from_millis(2_000);

fn batch(items: Vec<Value>) -> Value {
    json!({ "conversions": items })
}

/// Keys on the same request partition as `held`, and on others.
fn neighbours(stack: &Stack, held: &TestKey, count: usize) -> (Vec<TestKey>, Vec<TestKey>) {
    let partition = stack.request_partition(&held.workspace_id);
    let (mut same, mut other) = (Vec::new(), Vec::new());
    while same.len() < count || other.len() < count {
        let key = stack.workspace();
        if stack.request_partition(&key.workspace_id) == partition {
            if same.len() < count {
                same.push(key);
            }
        } else if other.len() < count {
            other.push(key);
        }
    }
    (same, other)
}

/// How long a refused sender waits: Retry-After, else a moment.
fn retry_after(reply: &Reply) -> Duration {
    match reply.header("retry-after").and_then(|v| v.parse().ok()) {
        Some(seconds) => Duration::from_secs(seconds),
        None => Duration::from_millis(100),
    }
}

/// One neighbour's send: its status, its latency, and where its time went (Server-Timing).
type Send = (u16, Duration, String);

/// Served and p99 of a set of neighbours' sends.
fn figures(sends: &[Send]) -> (usize, usize, Duration) {
    let ok = sends.iter().filter(|(status, _, _)| *status == 201).count();
    (ok, sends.len(), p99(sends.iter().map(|(_, latency, _)| *latency).collect()))
}

fn p99(mut latencies: Vec<Duration>) -> Duration {
    latencies.sort();
    latencies.get(latencies.len() * 99 / 100).copied().unwrap_or_default()
}

/// The p99 of the sends' time outside their transaction's commit (Server-Timing's `commit`).
fn p99_outside_commit(sends: &[Send]) -> Duration {
    let outside = |(_, latency, timing): &Send| {
        let commit_ms = timing
            .split(',')
            .find_map(|stage| stage.trim().strip_prefix("commit;dur="))
            .and_then(|ms| ms.parse::<f64>().ok())
            .unwrap_or(0.0);
        latency.saturating_sub(Duration::from_secs_f64(commit_ms / 1000.0))
    };
    p99(sends.iter().map(outside).collect())
}

/// The slowest sends with their stages, for a failure's message.
fn slowest(sends: &[Send]) -> String {
    let mut sorted: Vec<&Send> = sends.iter().collect();
    sorted.sort_by_key(|(_, latency, _)| std::cmp::Reverse(*latency));
    sorted.iter().take(5).map(|(status, latency, timing)| format!("\n  {status} {latency:?}: {timing}")).collect()
}

/// `INTAKE_TEST_HOLD_SECS` (default 8) sets how long the workspace is held (30 s as the
/// operator's trial holds it).
#[tokio::test]
async fn a_workspace_held_in_postgresql_holds_up_only_itself() {
    let hold =
        Duration::from_secs(std::env::var("INTAKE_TEST_HOLD_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(8));
    let stack = Stack::start_with(StackOptions { write_timeout_ms: 5_000, ..Default::default() }).await;
    let held = stack.workspace();
    let (same, other) = neighbours(&stack, &held, 3);
    let db = database().await;
    // Another session holds the workspace's apply lock, as a long erasure would.
    let mut holder = db.acquire().await.unwrap_or_else(|e| panic!("{e}"));
    hold_workspace(&mut holder, &held.workspace_id).await;

    // The held workspace keeps sending 500-item batches meanwhile, four clients at once.
    let flooding: Vec<_> = (0..4)
        .map(|_| {
            let (client, key) = (stack.client(), held.clone());
            tokio::spawn(async move {
                let started = Instant::now();
                let mut statuses = Vec::new();
                while started.elapsed() < hold {
                    let items: Vec<Value> = (0..500).map(|_| conversion("lead")).collect();
                    let reply = client.post("/v1/conversions/batch", &key, &batch(items)).await;
                    statuses.push(reply.status);
                    // A sender that honours Retry-After (as intake-send and the clients do).
                    tokio::time::sleep(retry_after(&reply).min(hold.saturating_sub(started.elapsed()))).await;
                }
                statuses
            })
        })
        .collect();
    let (mut on_same, mut on_other) = (Vec::new(), Vec::new());
    let started = Instant::now();
    while started.elapsed() < hold {
        let sends = same.iter().chain(&other).map(|key| {
            let client = stack.client();
            let key = key.clone();
            async move {
                let sent = Instant::now();
                let reply = client.post("/v1/conversions", &key, &conversion("lead")).await;
                let timing = reply.header("server-timing").unwrap_or_default().to_owned();
                (reply.status, sent.elapsed(), timing)
            }
        });
        let results = join_all(sends).await;
        let mut results = results.into_iter();
        on_same.extend(results.by_ref().take(same.len()));
        on_other.extend(results);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut held_statuses = Vec::new();
    for task in flooding {
        held_statuses.extend(task.await.unwrap_or_default());
    }
    let all: Vec<Send> = on_same.iter().chain(&on_other).cloned().collect();
    let ((ok, sent, p99), same_figures, other_figures) = (figures(&all), figures(&on_same), figures(&on_other));
    eprintln!(
        "held {hold:?}: neighbours {ok}/{sent} 2xx, p99 {p99:?}; same partition {same_figures:?}; \
         other partitions {other_figures:?}; outside the commit {:?} and {:?}; held workspace's answers \
         {held_statuses:?}",
        p99_outside_commit(&on_same),
        p99_outside_commit(&on_other),
    );
    assert!(ok * 100 >= sent * 99, "neighbours served: {ok} of {sent}");
    for (partitions, sends, (_, _, p99)) in
        [("the same partition", &on_same, same_figures), ("other partitions", &on_other, other_figures)]
    {
        let outside = p99_outside_commit(sends);
        assert!(
            outside < NEIGHBOURS_P99,
            "neighbours' p99 on {partitions} outside the commit {outside:?}; the slowest:{}",
            slowest(sends)
        );
        assert!(
            p99 < NEIGHBOURS_P99_WITH_COMMIT,
            "neighbours' p99 on {partitions} {p99:?}; the slowest:{}",
            slowest(sends)
        );
    }
    assert!(!held_statuses.contains(&200), "the held workspace wrote nothing while held: {held_statuses:?}");
    assert!(held_statuses.contains(&503), "the held workspace is refused alone: {held_statuses:?}");

    // Released: the held workspace writes again soon.
    release_workspace(&mut holder, &held.workspace_id).await;
    let released = Instant::now();
    loop {
        let reply = stack.post("/v1/conversions", &held, &conversion("lead")).await;
        if reply.status == 201 {
            break;
        }
        assert!(released.elapsed() < Duration::from_secs(30), "still refused: {} {}", reply.status, reply.body);
        tokio::time::sleep(retry_after(&reply)).await;
    }
    eprintln!("the held workspace wrote again {:?} after the release", released.elapsed());
}

/// A batch workspace is not starved by steady single sends of others, as its sender sees it:
/// every batch answered within the bound while they never let up. Its groups cannot join
/// theirs (over a chunk of items) and go back to the front of the ready workspaces
/// (docs/architecture.md, "Isolation in the writer"); the order itself is pinned by
/// `apply::tests::a_batch_among_steady_single_sends_is_applied_at_the_next_step`, since here
/// the ready queue rarely holds enough to show it.
#[tokio::test]
async fn a_batch_among_steady_single_sends_is_answered_within_the_bound() {
    let run_for = Duration::from_secs(8);
    let stack = Stack::start().await;
    let batcher = stack.workspace();
    let senders: Vec<TestKey> = (0..SINGLE_SENDERS).map(|_| stack.workspace()).collect();
    let started = Instant::now();
    // Each single sender sends again as soon as it is answered, for the whole run.
    let singles: Vec<_> = senders
        .into_iter()
        .map(|key| {
            let client = stack.client();
            tokio::spawn(async move {
                let mut statuses = Vec::new();
                while started.elapsed() < run_for {
                    statuses.push(client.post("/v1/conversions", &key, &conversion("lead")).await.status);
                }
                statuses
            })
        })
        .collect();
    let client = stack.client();
    let (mut batches, mut created) = (Vec::new(), Vec::new());
    while started.elapsed() < run_for {
        let items: Vec<Value> = (0..500).map(|_| conversion("lead")).collect();
        let sent = Instant::now();
        let reply = client.post("/v1/conversions/batch", &batcher, &batch(items)).await;
        if reply.status == 429 {
            // Past its workspace's rate: a sender waits as told (not the writer's doing).
            tokio::time::sleep(retry_after(&reply).min(run_for.saturating_sub(started.elapsed()))).await;
            continue;
        }
        let timing = reply.header("server-timing").unwrap_or_default().to_owned();
        batches.push((reply.status, sent.elapsed(), timing));
        created.push(reply.body["summary"]["created"].as_u64());
    }
    let mut single_statuses = Vec::new();
    for task in singles {
        single_statuses.extend(task.await.unwrap_or_default());
    }
    let longest = batches.iter().map(|(_, latency, _)| *latency).max().unwrap_or_default();
    eprintln!(
        "{} batches of 500, the longest {longest:?}, beside {} single sends of {SINGLE_SENDERS} workspaces",
        batches.len(),
        single_statuses.len()
    );
    assert!(batches.len() >= 3, "batches answered in {run_for:?}: {}", batches.len());
    assert!(batches.iter().all(|(status, _, _)| *status == 200), "every batch answered: {batches:?}");
    assert!(created.iter().all(|n| *n == Some(500)), "every item of every batch created: {created:?}");
    assert!(single_statuses.iter().all(|status| *status == 201), "every single send written");
    assert!(longest < BATCH_AMONG_SINGLES, "a batch took {longest:?}; the slowest:{}", slowest(&batches));
}
