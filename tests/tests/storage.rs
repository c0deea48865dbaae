//! How `conversions` keeps a re-sent conversion: in place. Its pages keep room (the table's
//! fillfactor) so that an update that changes no indexed column (a new value, new tags) is a
//! HOT update: the new version on the same page, no entry written in any of the table's eight
//! indexes, and nothing there for a vacuum to remove. bench/bench-vacuum.sh measures what that
//! saves; docs/operations.md ("Storage settings") says why each setting.

use intake_tests::serde_json::{json, Value};
use intake_tests::{conversion, database, Stack};
use std::collections::BTreeMap;

/// The page of each stored conversion of a workspace, by external id.
async fn pages(db: &sqlx::PgPool, workspace_id: &str) -> BTreeMap<String, i64> {
    sqlx::query_as::<_, (String, i64)>(
        "SELECT external_id, (ctid::text::point)[0]::bigint FROM conversions WHERE workspace_id = $1",
    )
    .bind(workspace_id)
    .fetch_all(db)
    .await
    .unwrap_or_else(|e| panic!("reading the pages of {workspace_id}'s conversions: {e}"))
    .into_iter()
    .collect()
}

/// A conversion with every identifier, as a CRM sends a lead.
fn lead(i: usize) -> Value {
    let mut item = conversion("lead");
    for (field, value) in [
        ("email", json!(format!("person-{i}@example.com"))),
        ("phone", json!("+14155552671")),
        ("visitor_id", json!(format!("{:016x}.17000000", i * 7919))),
        ("contact_id", json!(format!("contact-{i}"))),
        ("click_id", json!(format!("click{i:07}"))),
        ("value", json!("12.50")),
        ("currency", json!("EUR")),
        ("tags", json!({"source": "crm", "season": "spring"})),
    ] {
        item[field] = value;
    }
    item
}

#[tokio::test]
async fn a_conversion_re_sent_with_a_new_value_stays_on_its_page() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    // 500 leads fill pages: an insert takes a page only below the fillfactor, so every page of
    // them but the last is as full as inserts make it.
    let mut items: Vec<Value> = (0..500).map(lead).collect();
    let created = stack.post("/v1/conversions/batch", &key, &json!({ "conversions": items })).await;
    assert_eq!(created.status, 200, "{created:?}");
    assert_eq!(created.body["summary"]["created"], 500, "{}", created.body["results"][0]);
    let db = database().await;
    let before = pages(&db, &key.workspace_id).await;

    // One lead a page re-sent with a new value: each page's room takes one new version.
    let mut first_of_page = BTreeMap::new();
    for (external_id, page) in &before {
        first_of_page.entry(*page).or_insert_with(|| external_id.clone());
    }
    let resent: Vec<Value> = items
        .iter_mut()
        .filter(|item| first_of_page.values().any(|id| item["external_id"] == json!(id)))
        .map(|item| {
            item["value"] = json!("13.75");
            item.clone()
        })
        .collect();
    assert!(resent.len() >= 20, "500 leads take 20 pages or more: {}", resent.len());
    let updated = stack.post("/v1/conversions/batch", &key, &json!({ "conversions": resent })).await;
    assert_eq!(updated.status, 200, "{updated:?}");
    assert_eq!(updated.body["summary"]["updated"], resent.len(), "{}", updated.body["summary"]);

    let after = pages(&db, &key.workspace_id).await;
    let moved: Vec<_> = first_of_page
        .values()
        .filter(|id| after.get(*id) != before.get(*id))
        .map(|id| (id, before.get(id), after.get(id)))
        .collect();
    // At the default fillfactor nearly all of them move (65 of 66 in a run). A page shared with
    // another test's rows can have its room taken by an update of theirs first: two may move.
    assert!(moved.len() <= 2, "{} of {} updated conversions left their page: {moved:?}", moved.len(), resent.len());
}
