use super::*;
use intake_model::validate::validate_conversion;
use serde_json::{json, Value};

const NOW_MS: i64 = 1_780_000_000_000;

/// The database as the store keeps it: rows, with merged chains relabelled.
#[derive(Default)]
struct Db {
    rows: Vec<StoredConversion>,
}

impl Db {
    fn send(&mut self, inputs: &[Value]) -> Vec<ItemResult> {
        self.send_run(inputs, &[inputs.len()])
    }

    /// Messages of `message_sizes` items each, applied in one run.
    fn send_run(&mut self, inputs: &[Value], message_sizes: &[usize]) -> Vec<ItemResult> {
        let plan = self.plan(inputs, message_sizes);
        for (merged, into) in &plan.merges {
            for row in self.rows.iter_mut().filter(|row| &row.chain_id == merged) {
                row.chain_id = into.clone();
            }
        }
        for Write { row: write, .. } in plan.writes {
            match self.rows.iter_mut().find(|row| row.event == write.event && row.external_id == write.external_id) {
                Some(row) => *row = write,
                None => self.rows.push(write),
            }
        }
        plan.results
    }

    fn plan(&self, inputs: &[Value], message_sizes: &[usize]) -> Plan {
        let items: Vec<Conversion> = inputs
            .iter()
            .map(|input| {
                validate_conversion(&input.into(), NOW_MS).map(|v| v.conversion).unwrap_or_else(|e| panic!("{e:?}"))
            })
            .collect();
        let related = self
            .rows
            .iter()
            .filter(|row| {
                items.iter().any(|item| {
                    row.external_id == item.external_id.as_str()
                        || item.parent_external_id.as_ref().is_some_and(|p| p.as_str() == row.external_id)
                        || row.fields.parent_external_id.as_deref() == Some(item.external_id.as_str())
                })
            })
            .cloned()
            .collect();
        let items: Vec<Item<'_>> =
            items.iter().map(|conversion| Item { conversion, received_at_ms: NOW_MS, seed: None }).collect();
        plan_chunk(&items, message_sizes, related)
    }

    fn chains(&self) -> BTreeSet<String> {
        self.rows.iter().map(|row| row.chain_id.clone()).collect()
    }
}

fn stage(event: &str, external_id: &str, parent: Option<&str>) -> Value {
    let mut input = json!({"event": event, "external_id": external_id, "occurred_at": "2026-01-02T03:04:05Z"});
    if let Some(parent) = parent {
        input["parent_external_id"] = json!(parent);
    }
    input
}

fn journey() -> Vec<Value> {
    vec![
        stage("lead", "L1", None),
        stage("qualified", "Q1", Some("L1")),
        stage("signed", "S1", Some("Q1")),
        stage("purchase", "P1", Some("S1")),
    ]
}

fn permutations(items: Vec<Value>) -> Vec<Vec<Value>> {
    if items.len() <= 1 {
        return vec![items];
    }
    let mut all = Vec::new();
    for i in 0..items.len() {
        let mut rest = items.clone();
        let first = rest.remove(i);
        for mut tail in permutations(rest) {
            tail.insert(0, first.clone());
            all.push(tail);
        }
    }
    all
}

#[test]
fn four_stage_journey_sent_one_by_one_in_every_order_ends_in_one_chain() {
    for order in permutations(journey()) {
        let mut db = Db::default();
        let mut last = None;
        for item in &order {
            last = db.send(std::slice::from_ref(item)).pop();
        }
        assert_eq!(db.rows.len(), 4);
        assert_eq!(db.chains().len(), 1, "order {order:?}");
        assert_eq!(last.map(|r| r.chain_id), db.chains().pop_first(), "the response names the chain after the write");
    }
}

#[test]
fn journey_in_one_chunk_in_every_order_ends_in_one_chain() {
    for order in permutations(journey()) {
        let mut db = Db::default();
        let results = db.send(&order);
        assert!(results.iter().all(|r| r.result == WriteResult::Created));
        assert_eq!(db.chains().len(), 1, "order {order:?}");
        let answered: BTreeSet<_> = results.iter().map(|r| r.chain_id.clone()).collect();
        assert_eq!(answered, db.chains(), "every stage answered with the one chain, order {order:?}");
    }
}

#[test]
fn each_message_of_a_run_names_the_chains_as_it_left_them() {
    let mut db = Db::default();
    let inputs = [stage("purchase", "P", Some("S")), stage("lead", "L", None), stage("signed", "S", Some("L"))];
    let results = db.send_run(&inputs, &[2, 1]);
    let (p, l, s) = (&results[0].chain_id, &results[1].chain_id, &results[2].chain_id);
    assert_ne!(p, l, "the first message left P and L in chains of their own");
    assert_eq!(db.chains(), BTreeSet::from([s.clone()]), "the second merged them");
    assert!(s == p || s == l);
    let plan = Db::default().plan(&inputs, &[2, 1]);
    assert_eq!(plan.merged_by_message[0], Vec::new(), "the first message merged nothing");
    let merged = &plan.merged_by_message[1];
    assert_eq!(merged.len(), 1, "{merged:?}");
    assert_eq!(merged[0].into, plan.results[2].chain_id, "the second message's reply names the merge");
}

#[test]
fn three_stage_journey_split_over_two_chunks_in_every_order() {
    let stages = vec![stage("lead", "A", None), stage("deal", "B", Some("A")), stage("won", "C", Some("B"))];
    for order in permutations(stages) {
        for split in 0..=order.len() {
            let mut db = Db::default();
            db.send(&order[..split]);
            if split < order.len() {
                db.send(&order[split..]);
            }
            assert_eq!(db.chains().len(), 1, "order {order:?} split at {split}");
        }
    }
}

#[test]
fn chains_merge_into_the_oldest() {
    let mut db = Db::default();
    let child = db.send(&[stage("qualified", "Q", Some("L"))]).remove(0).chain_id;
    let other = db.send(&[stage("lead", "X", None)]).remove(0).chain_id;
    assert!(child < other);
    // L is named by Q (older chain) and names X's chain as its parent: all three merge into Q's.
    let parent = db.send(&[stage("lead", "L", Some("X"))]).remove(0);
    assert_eq!(parent.chain_id, child);
    assert_eq!(db.chains(), BTreeSet::from([child]));
}

#[test]
fn a_parent_named_by_several_events_links_them_all() {
    let mut db = Db::default();
    db.send(&[stage("lead", "P", None)]);
    db.send(&[stage("signup", "P", None)]);
    assert_eq!(db.chains().len(), 2, "same external_id, other event: a separate conversion and chain");
    db.send(&[stage("deal", "D", Some("P"))]);
    assert_eq!(db.chains().len(), 1, "the child joins the chains of every conversion with its parent id");
}

#[test]
fn a_conversion_never_leaves_its_chain() {
    let mut db = Db::default();
    db.send(&[stage("lead", "A", None), stage("lead", "B", None), stage("deal", "D", Some("A"))]);
    assert_eq!(db.chains().len(), 2);
    db.send(&[stage("deal", "D", Some("B"))]);
    assert_eq!(db.chains().len(), 1, "re-parenting merges; nothing splits");
}

#[test]
fn repeated_pair_in_one_chunk_is_created_then_updated_or_unchanged() {
    let mut db = Db::default();
    let mut changed = stage("lead", "A", None);
    changed["value"] = json!(10);
    let results = db.send(&[stage("lead", "A", None), stage("LEAD", "A", None), changed]);
    let kinds: Vec<_> = results.iter().map(|r| r.result).collect();
    assert_eq!(kinds, vec![WriteResult::Created, WriteResult::Unchanged, WriteResult::Updated]);
    assert!(results.iter().all(|r| r.id == results[0].id));
    assert_eq!(db.rows.len(), 1);
}

#[test]
fn omitted_null_and_empty_fields_keep_stored_values() {
    let mut db = Db::default();
    let mut first = stage("lead", "A", None);
    first["value"] = json!("12.50");
    first["tags"] = json!({"plan": "pro"});
    first["hdyhau"] = json!("radio");
    db.send(&[first]);
    let mut resend = stage("lead", "A", None);
    resend["value"] = json!(12.5);
    resend["hdyhau"] = json!("");
    resend["tags"] = Value::Null;
    assert_eq!(db.send(&[resend])[0].result, WriteResult::Unchanged);
    let mut tags = stage("lead", "A", None);
    tags["tags"] = json!({"plan": "basic"});
    assert_eq!(db.send(&[tags])[0].result, WriteResult::Updated);
    assert_eq!(db.rows[0].fields.tags, Some(BTreeMap::from([("plan".to_owned(), "basic".to_owned())])));
    assert_eq!(db.rows[0].fields.hdyhau.as_deref(), Some("radio"));
}

#[test]
fn visit_matches_are_recomputed_only_when_a_matching_input_changes() {
    let mut db = Db::default();
    let mut first = stage("lead", "A", None);
    first["visitor_id"] = json!("abcdEFGH1234_-xy");
    let created = db.plan(&[first.clone()], &[1]);
    assert!(created.writes.iter().all(|w| w.rematch), "a new conversion is matched");
    db.send(&[first.clone()]);
    let rematch = |db: &Db, field: &str, value: Value| {
        let mut input = first.clone();
        input[field] = value;
        db.plan(&[input], &[1]).writes.iter().map(|w| w.rematch).collect::<Vec<_>>()
    };
    assert_eq!(rematch(&db, "value", json!("99")), vec![false], "a new value keeps the matches");
    assert_eq!(rematch(&db, "tags", json!({"plan": "x"})), vec![false]);
    assert_eq!(rematch(&db, "visitor_id", json!("zzzzEFGH1234_-xy")), vec![true]);
    assert_eq!(rematch(&db, "click_id", json!("abcDEF123456")), vec![true]);
    assert_eq!(rematch(&db, "contact_id", json!("crm-1")), vec![true]);
    assert_eq!(rematch(&db, "occurred_at", json!("2026-01-01T00:00:00Z")), vec![true]);
}

#[test]
fn only_rows_made_by_the_chunk_are_created_and_their_matches_need_no_clearing() {
    let mut db = Db::default();
    db.send(&[stage("lead", "L1", None)]);
    let mut changed = stage("lead", "L1", None);
    changed["visitor_id"] = json!("abcdEFGH1234_-xy");
    let plan = db.plan(&[changed, stage("qualified", "Q1", Some("L1"))], &[2]);
    let created: BTreeMap<&str, bool> = plan.writes.iter().map(|w| (w.row.external_id.as_str(), w.created)).collect();
    assert_eq!(created, BTreeMap::from([("L1", false), ("Q1", true)]));
    assert!(plan.writes.iter().all(|w| w.rematch), "a new visitor id and a new row are both matched again");
}
