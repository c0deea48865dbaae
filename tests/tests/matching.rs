//! Matching to visits at write time, and the operator's erasure of a person (docs/api.md,
//! "Matching to visits"; docs/api.md, "Erasure").

#[allow(dead_code)]
#[path = "../../writer/src/lookups.rs"]
mod lookups;

use intake_tests::serde_json::{json, Value};
use intake_tests::{database, now_ms, Stack};

const DAY_MS: i64 = 24 * 60 * 60 * 1000;

/// Inserts a visit `age_ms` before now and returns its id.
async fn visit(
    workspace_id: &str,
    visitor: Option<&str>,
    click: Option<&str>,
    recipient: Option<&str>,
    at_ms: i64,
) -> i64 {
    sqlx::query_scalar(
        "INSERT INTO visits (workspace_id, visitor_id, click_id, recipient_id, visited_at, page)
         VALUES ($1, $2, $3, $4, 'epoch'::timestamptz + $5 * interval '1 millisecond', '/pricing') RETURNING id",
    )
    .bind(workspace_id)
    .bind(visitor)
    .bind(click)
    .bind(recipient)
    .bind(at_ms)
    .fetch_one(&database().await)
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

async fn matches(conversion_id: &Value) -> Vec<(i64, String)> {
    sqlx::query_as(
        "SELECT visit_id, matched_by FROM conversion_matches WHERE conversion_id = $1 ORDER BY visit_id, matched_by",
    )
    .bind(conversion_id.as_str().unwrap_or_default())
    .fetch_all(&database().await)
    .await
    .unwrap_or_default()
}

fn unique(length: usize) -> String {
    ulid::Ulid::new().to_string().chars().rev().take(length).collect()
}

#[tokio::test]
async fn matches_by_visitor_click_and_contact_within_the_window() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    let ws = &key.workspace_id;
    let (visitor, click, contact) = (unique(16), unique(12), format!("crm-{}", unique(8)));
    let occurred = now_ms() - 10 * DAY_MS;
    let by_visitor = visit(ws, Some(&visitor), None, None, occurred - DAY_MS).await;
    let by_click = visit(ws, None, Some(&click), None, occurred).await;
    let by_contact = visit(ws, None, None, Some(&contact), occurred - 89 * DAY_MS).await;
    let _after = visit(ws, Some(&visitor), None, None, occurred + 1000).await;
    let _too_old = visit(ws, Some(&visitor), None, None, occurred - 91 * DAY_MS).await;
    let _other_workspace = visit(&stack.workspace().workspace_id, Some(&visitor), None, None, occurred - DAY_MS).await;

    let input = json!({"event": "purchase", "external_id": unique(10), "occurred_at": occurred,
        "visitor_id": format!("{visitor}.12345678"), "click_id": click, "contact_id": contact});
    let reply = stack.post("/v1/conversions", &key, &input).await;
    assert_eq!(reply.status, 201, "{reply:?}");
    let found = matches(&reply.body["conversion"]["id"]).await;
    assert_eq!(
        found,
        vec![
            (by_visitor, "visitor_id".to_owned()),
            (by_click, "click_id".to_owned()),
            (by_contact, "contact_id".to_owned())
        ]
    );
}

#[tokio::test]
async fn conversions_older_than_90_days_get_no_matches() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    let visitor = unique(16);
    let just_inside = now_ms() - 90 * DAY_MS + 60_000;
    let just_outside = now_ms() - 90 * DAY_MS - 60_000;
    visit(&key.workspace_id, Some(&visitor), None, None, just_outside - DAY_MS).await;
    let send = |occurred: i64| json!({"event": "lead", "external_id": unique(10), "occurred_at": occurred, "visitor_id": visitor});
    let inside = stack.post("/v1/conversions", &key, &send(just_inside)).await;
    let outside = stack.post("/v1/conversions", &key, &send(just_outside)).await;
    assert_eq!((inside.status, outside.status), (201, 201), "old conversions are accepted");
    assert_eq!(matches(&inside.body["conversion"]["id"]).await.len(), 1);
    assert_eq!(matches(&outside.body["conversion"]["id"]).await.len(), 0);
}

/// The window is 90 times 24 hours in any time zone of the database session: a calendar day of
/// timestamptz arithmetic is 23 or 25 hours across a daylight-saving change. The writer's own
/// statement, in a transaction that is rolled back.
#[tokio::test]
async fn the_window_is_90_times_24_hours_in_any_time_zone() {
    let db = database().await;
    let mut tx = db.begin().await.unwrap_or_else(|e| panic!("{e}"));
    let (ws, conversion, visitor) = (format!("ws_tz{}", unique(10)), format!("cnv_tz{}", unique(10)), unique(16));
    // 2025-05-01T12:00:00Z, six weeks after New York moved its clocks forward.
    let occurred: i64 = 1_746_100_800_000;
    let statements = [
        "SET LOCAL TimeZone = 'America/New_York'".to_owned(),
        format!("INSERT INTO workspaces (id, name, project_id) VALUES ('{ws}', 'tz', 'tz')"),
        format!("INSERT INTO chains (id, workspace_id) VALUES ('chn_{conversion}', '{ws}')"),
        format!(
            "INSERT INTO conversions (id, workspace_id, event, external_id, chain_id, occurred_at)
             VALUES ('{conversion}', '{ws}', 'lead', '1', 'chn_{conversion}', 'epoch'::timestamptz + {occurred} * interval '1 millisecond')"
        ),
    ];
    for statement in &statements {
        sqlx::query(statement).execute(&mut *tx).await.unwrap_or_else(|e| panic!("{statement}: {e}"));
    }
    // Half an hour inside 90 x 24 hours; a calendar-day window in New York would start an hour
    // later and leave it out.
    let visited = occurred - 2160 * 3_600_000 + 1_800_000;
    sqlx::query(
        "INSERT INTO visits (workspace_id, visitor_id, visited_at, page)
         VALUES ($1, $2, 'epoch'::timestamptz + $3 * interval '1 millisecond', '/')",
    )
    .bind(&ws)
    .bind(&visitor)
    .bind(visited)
    .execute(&mut *tx)
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    sqlx::query(lookups::MATCH_VISITS)
        .bind(&ws)
        .bind(vec![conversion.clone()])
        .bind(vec![Some(visitor)])
        .bind(vec![None::<String>])
        .bind(vec![None::<String>])
        .bind(vec![occurred])
        .execute(&mut *tx)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let matched: i64 = sqlx::query_scalar("SELECT count(*) FROM conversion_matches WHERE conversion_id = $1")
        .bind(&conversion)
        .fetch_one(&mut *tx)
        .await
        .unwrap_or(-1);
    tx.rollback().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(matched, 1, "a visit 2159.5 hours before the conversion is in its window");
}

#[tokio::test]
async fn erasure_clears_identifiers_deletes_visits_keeps_counts_and_is_idempotent() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    let ws = key.workspace_id.clone();
    let (visitor, contact) = (unique(16), format!("crm-{}", unique(8)));
    let email = format!("{}@Example.com", unique(8));
    let occurred = now_ms() - DAY_MS;
    visit(&ws, Some(&visitor), None, None, occurred - 1000).await;
    visit(&ws, None, None, Some(&contact), occurred - 2000).await;
    let input = json!({"event": "lead", "external_id": unique(10), "occurred_at": occurred, "email": email,
        "phone": "+14155552671", "visitor_id": visitor, "contact_id": contact, "hdyhau": "radio",
        "address": {"line1": "1 Main St", "zip": "94105"}});
    let created = stack.post("/v1/conversions", &key, &input).await;
    let other = stack
        .post("/v1/conversions", &key, &json!({"event": "lead", "external_id": unique(10), "occurred_at": occurred}))
        .await;
    assert_eq!((created.status, other.status), (201, 201));
    assert_eq!(matches(&created.body["conversion"]["id"]).await.len(), 2);

    let erased = stack
        .run_writer_command_with_input(
            &["erase", "--workspace", &ws, "--email"],
            &format!("  {}\n", email.to_uppercase()),
        )
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(erased, json!({"conversions": 1, "visits": 2}));
    let db = database().await;
    let row: Vec<Option<String>> =
        sqlx::query_scalar("SELECT ARRAY[visitor_id, click_id, contact_id, encode(email_digest, 'hex'), encode(phone_digest, 'hex'), encode(address_digest, 'hex'), hdyhau] FROM conversions WHERE id = $1")
            .bind(created.body["conversion"]["id"].as_str().unwrap_or_default())
            .fetch_one(&db).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(row, vec![None; 7], "visitor, click and contact ids, the three hashes and hdyhau are cleared");
    let (conversions, visits, audits): (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM conversions WHERE workspace_id = $1), (SELECT count(*) FROM visits WHERE workspace_id = $1),
                (SELECT count(*) FROM erasures WHERE workspace_id = $1 AND identifier_kind = 'email')")
        .bind(&ws).fetch_one(&db).await.unwrap_or_default();
    assert_eq!((conversions, visits, audits), (2, 0, 1), "counts stay; visits go; one audit row");
    let audit_text: String = sqlx::query_scalar("SELECT row_to_json(e)::text FROM erasures e WHERE workspace_id = $1")
        .bind(&ws)
        .fetch_one(&db)
        .await
        .unwrap_or_default();
    assert!(!audit_text.to_lowercase().contains(&email.to_lowercase()));

    let again = stack
        .run_writer_command_with_input(&["erase", "--workspace", &ws, "--email"], &email)
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(again, json!({"conversions": 0, "visits": 0}));

    let resent = stack.post("/v1/conversions", &key, &input).await;
    assert_eq!(resent.body["conversion"]["result"], "updated", "a later send stores the data again");
    let email_hash: Option<String> =
        sqlx::query_scalar("SELECT encode(email_digest, 'hex') FROM conversions WHERE id = $1")
            .bind(created.body["conversion"]["id"].as_str().unwrap_or_default())
            .fetch_one(&db)
            .await
            .unwrap_or_default();
    assert!(email_hash.is_some());
}

#[tokio::test]
async fn erasure_by_phone_contact_and_visitor_id() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    let ws = key.workspace_id.clone();
    let (visitor, contact) = (unique(16), format!("crm-{}", unique(8)));
    let send = |extra: Value| {
        let mut input = json!({"event": "lead", "external_id": unique(10), "occurred_at": now_ms()});
        for (k, v) in extra.as_object().cloned().unwrap_or_default() {
            input[k] = v;
        }
        input
    };
    stack.post("/v1/conversions", &key, &send(json!({"phone": "(415) 555-2671", "country": "US"}))).await;
    stack.post("/v1/conversions", &key, &send(json!({"contact_id": contact}))).await;
    stack.post("/v1/conversions", &key, &send(json!({"visitor_id": format!("{visitor}.20260101")}))).await;
    visit(&ws, Some(&visitor), None, None, now_ms() - 5000).await;
    let erase = |flags: &[&str], value: &str| {
        let args: Vec<&str> = ["erase", "--workspace", ws.as_str()].into_iter().chain(flags.iter().copied()).collect();
        stack.run_writer_command_with_input(&args, value).unwrap_or_else(|e| panic!("{e:#}"))
    };
    assert_eq!(erase(&["--phone", "--country", "us"], "415-555-2671\n"), json!({"conversions": 1, "visits": 0}));
    assert_eq!(erase(&["--contact-id"], &contact), json!({"conversions": 1, "visits": 0}));
    // From a file instead of standard input.
    let file = std::env::temp_dir().join(format!("erase-{}", unique(8)));
    std::fs::write(&file, format!("{visitor}\n")).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        erase(&["--visitor-id", "--from", &file.display().to_string()], ""),
        json!({"conversions": 1, "visits": 1})
    );
    let _ = std::fs::remove_file(&file);
    assert!(
        stack.run_writer_command_with_input(&["erase", "--workspace", &ws], "x").is_err(),
        "an identifier kind is required"
    );
    assert!(stack
        .run_writer_command_with_input(&["erase", "--workspace", &ws, "--email", "--contact-id"], "x")
        .is_err());
    assert!(
        stack.run_writer_command_with_input(&["erase", "--workspace", &ws, "--email"], "\n").is_err(),
        "a value is required"
    );
    assert!(
        stack.run_writer_command_with_input(&["erase", "--workspace", &ws, "--email", "a@b.co"], "").is_err(),
        "the value is never an argument"
    );
}

#[tokio::test]
async fn erasure_reaches_the_persons_conversions_one_step_out_and_no_further() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    let ws = key.workspace_id.clone();
    let (email, contact, visitor) = (format!("{}@example.com", unique(8)), format!("crm-{}", unique(8)), unique(16));
    let send = |extra: Value| {
        let mut input = json!({"event": "lead", "external_id": unique(10), "occurred_at": now_ms()});
        for (k, v) in extra.as_object().cloned().unwrap_or_default() {
            input[k] = v;
        }
        input
    };
    // A carries the email; B shares A's contact id; C shares B's phone only (two steps away).
    let a = stack.post("/v1/conversions", &key, &send(json!({"email": email, "contact_id": contact}))).await;
    let b = stack
        .post(
            "/v1/conversions",
            &key,
            &send(json!({"contact_id": contact, "phone": "+14155550100", "visitor_id": visitor})),
        )
        .await;
    let c = stack.post("/v1/conversions", &key, &send(json!({"phone": "+14155550100"}))).await;
    assert_eq!((a.status, b.status, c.status), (201, 201, 201));
    visit(&ws, Some(&visitor), None, None, now_ms() - 5000).await;

    let erased = stack
        .run_writer_command_with_input(&["erase", "--workspace", &ws, "--email"], &email)
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(erased, json!({"conversions": 2, "visits": 1}), "A, and B one step out, and B's visit");
    let cleared = |id: &Value| {
        let id = id.as_str().unwrap_or_default().to_owned();
        async move {
            let row: Vec<Option<String>> = sqlx::query_scalar(
                "SELECT ARRAY[visitor_id, contact_id, encode(email_digest, 'hex'), encode(phone_digest, 'hex')] FROM conversions WHERE id = $1",
            )
            .bind(id)
            .fetch_one(&database().await)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
            row.iter().all(Option::is_none)
        }
    };
    assert!(cleared(&a.body["conversion"]["id"]).await);
    assert!(cleared(&b.body["conversion"]["id"]).await);
    assert!(!cleared(&c.body["conversion"]["id"]).await, "two steps out is another person as far as we know");
}

#[tokio::test]
async fn an_update_that_changes_no_matching_input_keeps_the_matches() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    let ws = key.workspace_id.clone();
    let visitor = unique(16);
    // Older than 90 days: no match is computed for it any more, so a recomputation would lose
    // the one it has (made when it was young).
    let occurred = now_ms() - 100 * DAY_MS;
    let mut input = json!({"event": "lead", "external_id": unique(10), "occurred_at": occurred, "visitor_id": visitor, "value": "1"});
    let created = stack.post("/v1/conversions", &key, &input).await;
    assert_eq!(created.status, 201);
    let id = created.body["conversion"]["id"].clone();
    let visit_id = visit(&ws, Some(&visitor), None, None, occurred - 1000).await;
    sqlx::query("INSERT INTO conversion_matches (conversion_id, visit_id, matched_by) VALUES ($1, $2, 'visitor_id')")
        .bind(id.as_str().unwrap_or_default())
        .bind(visit_id)
        .execute(&database().await)
        .await
        .unwrap_or_else(|e| panic!("{e}"));

    input["value"] = json!("2");
    input["tags"] = json!({"stage": "won"});
    assert_eq!(stack.post("/v1/conversions", &key, &input).await.body["conversion"]["result"], "updated");
    assert_eq!(matches(&id).await.len(), 1, "value and tags are no matching inputs");

    input["visitor_id"] = json!(unique(16));
    assert_eq!(stack.post("/v1/conversions", &key, &input).await.body["conversion"]["result"], "updated");
    assert!(matches(&id).await.is_empty(), "a new visitor id recomputes: older than 90 days, none");
}
