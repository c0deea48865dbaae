//! `intake-send` against the real service: a 100,000-row CSV backfill with invalid rows, a
//! forced rate limit, server errors and an unreachable service, JSON Lines from standard input.

use intake_tests::serde_json::{json, Value};
use intake_tests::{database, now_ms, stored_values, wait_until, Stack, StackOptions, TestKey};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const HEADER: &str = "event,external_id,parent_external_id,occurred_at,email,phone,country,address.line1,address.zip,value,currency,tags.plan,tags.source";

/// An input row's problem: what the row carries and the error code the rejects file must give.
#[derive(Clone, Copy)]
enum Invalid {
    Event,
    OccurredAtText,
    OccurredAtFuture,
    Currency,
    ExtraCell,
}

impl Invalid {
    fn of(index: usize) -> Option<Invalid> {
        match index % 1000 {
            7 => Some(Invalid::Event),
            207 => Some(Invalid::OccurredAtText),
            407 => Some(Invalid::OccurredAtFuture),
            607 => Some(Invalid::Currency),
            807 => Some(Invalid::ExtraCell),
            _ => None,
        }
    }

    fn code(self) -> &'static str {
        match self {
            Invalid::Event | Invalid::OccurredAtText | Invalid::Currency => "validation_failed",
            Invalid::OccurredAtFuture => "occurred_at_out_of_range",
            Invalid::ExtraCell => "invalid_csv_row",
        }
    }
}

fn external_id(index: usize) -> String {
    format!("R{index:06}")
}

/// One CSV line: every other row has all the identifiers, the others leave those cells empty;
/// odd rows name the row before them as their parent.
fn csv_line(index: usize, occurred_at: i64) -> String {
    let id = external_id(index);
    let parent = if index % 2 == 1 { external_id(index - 1) } else { String::new() };
    let (mut event, mut when, mut currency) = ("lead".to_owned(), occurred_at.to_string(), "EUR");
    let identifiers = if index.is_multiple_of(2) {
        format!("buyer{index}@example.com,+14155550{:03},US,{index} Main St,10001", index % 1000)
    } else {
        ",,,,".to_owned()
    };
    let mut extra = "";
    match Invalid::of(index) {
        Some(Invalid::Event) => event = "not an event".to_owned(),
        Some(Invalid::OccurredAtText) => when = "yesterday".to_owned(),
        Some(Invalid::OccurredAtFuture) => when = "2099-01-01T00:00:00Z".to_owned(),
        Some(Invalid::Currency) => currency = "EURO",
        Some(Invalid::ExtraCell) => extra = ",surplus",
        None => {}
    }
    format!("{event},{id},{parent},{when},{identifiers},{}.5,{currency},pro,crm{extra}", index % 500)
}

fn temp_dir() -> PathBuf {
    let dir = std::env::temp_dir().join("intake-tests").join(format!("send-{}", ulid::Ulid::new()));
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
    dir
}

fn write_csv(path: &Path, rows: impl Iterator<Item = String>) {
    let mut text = format!("{HEADER}\n");
    for row in rows {
        text.push_str(&row);
        text.push('\n');
    }
    std::fs::write(path, text).unwrap_or_else(|e| panic!("{e}"));
}

/// Runs the command (off the test's runtime) and returns its output.
async fn run(mut command: Command, stdin: Option<String>) -> Output {
    command
        .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    tokio::task::spawn_blocking(move || {
        let mut child = command.spawn().unwrap_or_else(|e| panic!("starting intake-send: {e}"));
        if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
            use std::io::Write;
            // The sender may stop before reading it all (a refused argument).
            let _ = pipe.write_all(text.as_bytes());
        }
        child.wait_with_output().unwrap_or_else(|e| panic!("{e}"))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

/// The JSON summary: the last line of standard output.
fn summary(output: &Output) -> Value {
    let stdout = String::from_utf8_lossy(&output.stdout);
    let last = stdout.lines().last().unwrap_or_default();
    intake_tests::serde_json::from_str(last)
        .unwrap_or_else(|_| panic!("no JSON summary last: {stdout:?} {}", stderr(output)))
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

fn assert_key_never_shown(output: &Output, key: &TestKey) {
    let printed = format!("{}{}", String::from_utf8_lossy(&output.stdout), stderr(output));
    assert!(!printed.contains(&key.secret), "the key was printed: {printed}");
}

async fn stored_ids(key: &TestKey) -> BTreeSet<String> {
    stored_values(&database().await, &key.workspace_id).await.into_keys().collect()
}

fn read_rejects_csv(path: &Path) -> (Vec<String>, Vec<Vec<String>>) {
    let mut reader = csv::ReaderBuilder::new().flexible(true).from_path(path).unwrap_or_else(|e| panic!("{e}"));
    let header = reader.headers().map(|h| h.iter().map(str::to_owned).collect()).unwrap_or_default();
    let rows = reader.records().map(|r| r.map(|r| r.iter().map(str::to_owned).collect()).unwrap_or_default()).collect();
    (header, rows)
}

#[tokio::test]
async fn a_backfill_of_100000_csv_rows_stores_the_valid_ones_and_rejects_the_others() {
    let stack = Stack::start_with(StackOptions {
        requests_per_minute: 100_000,
        conversions_per_minute: 10_000_000,
        ..StackOptions::default()
    })
    .await;
    let key = stack.workspace();
    let dir = temp_dir();
    let (input, rejects) = (dir.join("backfill.csv"), dir.join("rejects.csv"));
    let rows = 100_000;
    let occurred_at = now_ms() - 3_600_000;
    write_csv(&input, (0..rows).map(|i| csv_line(i, occurred_at)));
    let invalid: Vec<usize> = (0..rows).filter(|i| Invalid::of(*i).is_some()).collect();

    let started = Instant::now();
    let mut command = stack.intake_send(&key);
    command.arg(&input).args(["--summary", "json", "--progress", "lines", "--rejects"]).arg(&rejects);
    let output = run(command, None).await;
    let took = started.elapsed();
    eprintln!("100,000 rows in {took:?}: {}", String::from_utf8_lossy(&output.stdout));

    assert_eq!(output.status.code(), Some(1), "rows failed: exit 1; {}", stderr(&output));
    let summary = summary(&output);
    let valid = (rows - invalid.len()) as u64;
    assert_eq!(summary["rows"], json!(rows), "{summary}");
    assert_eq!(summary["created"], json!(valid), "{summary}");
    assert_eq!((summary["updated"].clone(), summary["unchanged"].clone()), (json!(0), json!(0)), "{summary}");
    assert_eq!(summary["failed"], json!(invalid.len()), "{summary}");
    assert!(summary["seconds"].as_f64().is_some_and(|s| s > 0.0), "{summary}");
    if took > Duration::from_secs(6) {
        assert!(stderr(&output).contains("rows/s"), "a progress line every 5 s: {}", stderr(&output));
    }
    assert_key_never_shown(&output, &key);

    // What is stored: every valid row, none of the others; cells became fields.
    let stored = stored_ids(&key).await;
    let expected: BTreeSet<String> = (0..rows).filter(|i| Invalid::of(*i).is_none()).map(external_id).collect();
    assert_eq!(stored.len(), expected.len());
    assert!(stored == expected, "the stored rows are not the valid rows");
    let (email, address, tags, value, parent): (Option<String>, Option<String>, Value, String, Option<String>) =
        sqlx::query_as(
            "SELECT encode(email_digest, 'hex'), encode(address_digest, 'hex'), tags, value::text, parent_external_id FROM conversions
         WHERE workspace_id = $1 AND external_id = 'R000010'",
        )
        .bind(&key.workspace_id)
        .fetch_one(&database().await)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(email.is_some() && address.is_some(), "email and address.* cells were hashed and stored");
    assert_eq!(tags, json!({"plan": "pro", "source": "crm"}));
    assert_eq!(value.parse::<f64>().ok(), Some(10.5));
    assert_eq!(parent, None, "an empty cell is omitted");
    let child_parent: Option<String> = sqlx::query_scalar(
        "SELECT parent_external_id FROM conversions WHERE workspace_id = $1 AND external_id = 'R000011'",
    )
    .bind(&key.workspace_id)
    .fetch_one(&database().await)
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(child_parent.as_deref(), Some("R000010"));

    // The rejects file: exactly the invalid rows, as they were, with their error.
    let (header, rejected) = read_rejects_csv(&rejects);
    let mut expected_header: Vec<String> = HEADER.split(',').map(str::to_owned).collect();
    expected_header.push("error".to_owned());
    assert_eq!(header, expected_header);
    assert_eq!(rejected.len(), invalid.len());
    let rejected_ids: BTreeSet<String> = rejected.iter().map(|r| r[1].clone()).collect();
    assert_eq!(rejected_ids, invalid.iter().copied().map(external_id).collect::<BTreeSet<_>>());
    for row in &rejected {
        let index: usize = row[1][1..].parse().unwrap_or_else(|e| panic!("{e}: {row:?}"));
        let problem = Invalid::of(index).unwrap_or_else(|| panic!("a valid row was rejected: {row:?}"));
        let error = row.last().cloned().unwrap_or_default();
        assert!(error.starts_with(&format!("{}: ", problem.code())), "{row:?}");
        match problem {
            Invalid::ExtraCell => {
                assert_eq!(row.len(), expected_header.len() + 1, "the row is written back as it was: {row:?}")
            }
            _ => assert_eq!(
                row[..row.len() - 1].join(","),
                csv_line(index, occurred_at),
                "the row is written back as it was"
            ),
        }
        match problem {
            Invalid::Event => assert!(error.contains("event: "), "{error}"),
            Invalid::OccurredAtText => assert!(error.contains("occurred_at: "), "{error}"),
            Invalid::Currency => assert!(error.contains("currency: "), "{error}"),
            _ => {}
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_forced_rate_limit_is_waited_out_with_retry_after() {
    // A window of a few seconds: the sender waits out the rest of it, not of a minute.
    let options = StackOptions { conversions_per_minute: 500, rate_limit_window_ms: 8_000, ..StackOptions::default() };
    let (stack, key, window_end) = Stack::with_window(options, Duration::from_secs(6)).await;
    // This window's conversions are used up: the sender's first batch gets 429.
    let batch: Vec<Value> = (0..500).map(|_| intake_tests::conversion("lead")).collect();
    let reply = stack.post("/v1/conversions/batch", &key, &json!({ "conversions": batch })).await;
    assert_eq!(reply.status, 200, "{reply:?}");

    let dir = temp_dir();
    let input = dir.join("rows.csv");
    let occurred_at = now_ms();
    write_csv(&input, (1..=400).filter(|i| Invalid::of(*i).is_none()).map(|i| csv_line(i, occurred_at)));
    let started = Instant::now();
    let mut command = stack.intake_send(&key);
    command.arg(&input).args(["--summary", "json", "--batch-size", "100", "--concurrency", "2", "--progress", "off"]);
    let output = run(command, None).await;
    let took = started.elapsed();

    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let summary = summary(&output);
    let rows = (1..=400).filter(|i| Invalid::of(*i).is_none()).count();
    assert_eq!(summary["created"], json!(rows), "{summary}");
    assert_eq!(summary["failed"], json!(0), "{summary}");
    assert!(summary["retries"].as_u64().is_some_and(|r| r > 0), "429s were retried: {summary}");
    let window_left = window_end.saturating_duration_since(started);
    assert!(!window_left.is_zero(), "the sender started after the window ended: lengthen it");
    assert!(took + Duration::from_secs(1) >= window_left, "it waited for the window: {took:?} of {window_left:?}");
    assert_eq!(stored_ids(&key).await.len(), 500 + rows);
    assert_key_never_shown(&output, &key);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn json_lines_from_standard_input_with_rejects_and_a_second_run_unchanged() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    let when = now_ms() - 60_000;
    let valid = [
        json!({"event": "lead", "external_id": 101, "occurred_at": when, "email": "a@example.com",
               "address": {"line1": "1 Main St", "zip": "10001"}, "tags": {"plan": "pro"}}),
        json!({"event": "purchase", "external_id": "P-1", "parent_external_id": 101, "occurred_at": when.to_string(), "value": 12.5}),
        // A corrected row from an earlier rejects file: its _error is not sent.
        json!({"event": "lead", "external_id": "L-2", "occurred_at": when, "_error": {"code": "validation_failed"}}),
    ];
    let mut lines: Vec<String> = valid.iter().map(Value::to_string).collect();
    lines.insert(1, "{\"event\": \"lead\", oops".to_owned());
    lines.push(json!({"event": "no way", "external_id": "B-1", "occurred_at": when}).to_string());
    lines.push(String::new());
    lines.push("[1, 2]".to_owned());
    let text = lines.join("\n") + "\n";

    let dir = temp_dir();
    let rejects = dir.join("rejects.jsonl");
    let send = |rejects: &Path| {
        let mut command = stack.intake_send(&key);
        command.args(["-", "--format", "jsonl", "--summary", "json", "--progress", "off", "--rejects"]).arg(rejects);
        command
    };
    let output = run(send(&rejects), Some(text.clone())).await;
    assert_eq!(output.status.code(), Some(1), "{}", stderr(&output));
    let summary = summary(&output);
    assert_eq!(summary["rows"], json!(6), "{summary}");
    assert_eq!((summary["created"].clone(), summary["failed"].clone()), (json!(3), json!(3)), "{summary}");
    assert_eq!(stored_ids(&key).await, ["101", "L-2", "P-1"].map(String::from).into_iter().collect());

    let rejected: Vec<Value> = std::fs::read_to_string(&rejects)
        .unwrap_or_default()
        .lines()
        .map(|line| intake_tests::serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}")))
        .collect();
    assert_eq!(rejected.len(), 3, "{rejected:?}");
    let by_code =
        |code: &str| rejected.iter().filter(|r| r["_error"]["code"] == json!(code)).cloned().collect::<Vec<_>>();
    let unparsable = by_code("invalid_json");
    assert_eq!(unparsable.len(), 1, "{rejected:?}");
    assert_eq!(unparsable[0]["_line"], json!("{\"event\": \"lead\", oops"));
    let refused = by_code("validation_failed");
    assert_eq!(refused.len(), 2, "{rejected:?}");
    let bad_event = refused.iter().find(|r| r["external_id"] == json!("B-1")).unwrap_or_else(|| panic!("{rejected:?}"));
    assert_eq!(bad_event["event"], json!("no way"), "the object is written back as it was");
    assert_eq!(bad_event["_error"]["details"][0]["path"], json!("event"));
    assert!(refused.iter().any(|r| r["_line"] == json!("[1, 2]")), "{rejected:?}");

    // The same input again: nothing changes, and re-sending is safe.
    let again = run(send(&dir.join("again.jsonl")), Some(text)).await;
    let summary = self::summary(&again);
    assert_eq!((summary["created"].clone(), summary["unchanged"].clone()), (json!(0), json!(3)), "{summary}");

    // Standard input needs its format; a refused key stops the run (exit 2) without printing it.
    let mut command = stack.intake_send(&key);
    command.args(["-", "--summary", "json"]);
    let no_format = run(command, Some(String::new())).await;
    assert_eq!(no_format.status.code(), Some(2));
    assert!(stderr(&no_format).contains("--format"), "{}", stderr(&no_format));
    let wrong = TestKey { secret: "svc_live_not_a_key_of_anyone".to_owned(), ..key.clone() };
    let mut command = stack.intake_send(&wrong);
    command.args(["-", "--format", "jsonl", "--summary", "json", "--progress", "off"]);
    let refused = run(command, Some(lines[0].clone() + "\n")).await;
    assert_eq!(refused.status.code(), Some(2), "{}", stderr(&refused));
    assert!(stderr(&refused).contains("invalid_api_key"), "{}", stderr(&refused));
    assert_eq!(self::summary(&refused)["failed"], json!(0));
    assert_key_never_shown(&refused, &wrong);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn server_errors_are_retried_until_the_writer_answers() {
    // No writer yet: every write times out with 500 internal_error after 1 s.
    let mut stack =
        Stack::start_with(StackOptions { start_writer: false, write_timeout_ms: 1_000, ..StackOptions::default() })
            .await;
    let key = stack.workspace();
    let dir = temp_dir();
    let input = dir.join("rows.csv");
    let occurred_at = now_ms();
    let rows: Vec<usize> = (1..=300).filter(|i| Invalid::of(*i).is_none()).collect();
    write_csv(&input, rows.iter().map(|i| csv_line(*i, occurred_at)));
    let mut command = stack.intake_send(&key);
    command.arg(&input).args(["--summary", "json", "--batch-size", "100", "--concurrency", "2", "--progress", "off"]);
    let sender = tokio::spawn(run(command, None));
    let answered_500 = || async {
        let series = r#"intake_gateway_requests_total{route="conversions_batch",status="500"}"#;
        stack.metrics().await.get(series).is_some_and(|answered| answered >= 2.0)
    };
    wait_until("the sender being answered 500", Duration::from_secs(20), answered_500).await;
    stack.start_writer();
    let output = sender.await.unwrap_or_else(|e| panic!("{e}"));

    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let summary = summary(&output);
    assert!(summary["retries"].as_u64().is_some_and(|r| r > 0), "{summary}");
    // Batches that timed out were still applied when the writer came; their re-sends read
    // `unchanged` for those items.
    let stored = summary["created"].as_u64().unwrap_or(0) + summary["unchanged"].as_u64().unwrap_or(0);
    assert_eq!(stored, rows.len() as u64, "{summary}");
    assert_eq!(summary["failed"], json!(0), "{summary}");
    assert_eq!(stored_ids(&key).await.len(), rows.len());
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn an_unreachable_service_fails_every_row_after_the_retries() {
    let dir = temp_dir();
    let (input, rejects) = (dir.join("rows.csv"), dir.join("rejects.csv"));
    write_csv(&input, (1..=150).map(|i| csv_line(i, now_ms())));
    let mut command = intake_tests::intake_send();
    command
        .arg(&input)
        .args(["--base-url", &format!("http://127.0.0.1:{}/v1", intake_tests::free_port())])
        .env("INTAKE_API_KEY", "svc_live_secret_of_the_test")
        .args(["--summary", "json", "--batch-size", "100", "--max-retries", "2", "--progress", "off", "--rejects"])
        .arg(&rejects);
    let output = run(command, None).await;

    assert_eq!(output.status.code(), Some(1), "{}", stderr(&output));
    let summary = summary(&output);
    assert_eq!(summary["failed"], json!(150), "{summary}");
    assert_eq!(summary["retries"], json!(4), "two batches, two retries each: {summary}");
    let (_, rejected) = read_rejects_csv(&rejects);
    assert_eq!(rejected.len(), 150);
    assert!(rejected.iter().all(|r| r
        .last()
        .is_some_and(|e| e.starts_with("connection_failed: ") && e.contains("gave up after 2 retries"))));
    let printed = format!("{}{}", String::from_utf8_lossy(&output.stdout), stderr(&output));
    assert!(!printed.contains("svc_live_secret_of_the_test"));
    let _ = std::fs::remove_dir_all(&dir);
}
