//! Journeys linked through parent_external_id in any arrival order (docs/api.md, "Chains").

use intake_tests::serde_json::{json, Value};
use intake_tests::{database, Stack};

fn stage(event: &str, external_id: &str, parent: Option<&str>) -> Value {
    let mut input = json!({"event": event, "external_id": external_id, "occurred_at": intake_tests::now_ms()});
    if let Some(parent) = parent {
        input["parent_external_id"] = json!(parent);
    }
    input
}

fn journey(tag: &str, stages: usize) -> Vec<Value> {
    let events = ["lead", "qualified", "signed", "purchase"];
    (0..stages)
        .map(|i| {
            let parent = (i > 0).then(|| format!("{tag}-{}", i - 1));
            stage(events[i], &format!("{tag}-{i}"), parent.as_deref())
        })
        .collect()
}

fn permutations(n: usize) -> Vec<Vec<usize>> {
    if n == 0 {
        return vec![vec![]];
    }
    let mut all = Vec::new();
    for rest in permutations(n - 1) {
        for position in 0..=rest.len() {
            let mut order = rest.clone();
            order.insert(position, n - 1);
            all.push(order);
        }
    }
    all
}

async fn chains_of(workspace_id: &str, tag: &str) -> Vec<String> {
    sqlx::query_scalar("SELECT DISTINCT chain_id FROM conversions WHERE workspace_id = $1 AND external_id LIKE $2")
        .bind(workspace_id)
        .bind(format!("{tag}-%"))
        .fetch_all(&database().await)
        .await
        .unwrap_or_default()
}

#[tokio::test]
async fn every_order_of_3_and_4_stage_journeys_sent_one_by_one_ends_in_one_chain() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    for stages in [3, 4] {
        for (n, order) in permutations(stages).into_iter().enumerate() {
            let tag = format!("s{stages}o{n}");
            let stages_input = journey(&tag, stages);
            let mut last = Value::Null;
            for &i in &order {
                let reply = stack.post("/v1/conversions", &key, &stages_input[i]).await;
                assert_eq!(reply.status, 201, "{reply:?}");
                last = reply.body["conversion"]["chain_id"].clone();
            }
            let chains = chains_of(&key.workspace_id, &tag).await;
            assert_eq!(chains.len(), 1, "order {order:?}");
            assert_eq!(json!(chains[0]), last, "the last response names the journey's chain");
        }
    }
}

#[tokio::test]
async fn every_order_of_a_4_stage_journey_inside_one_batch_ends_in_one_chain() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    for (n, order) in permutations(4).into_iter().chain(permutations(3)).enumerate() {
        let tag = format!("b{n}");
        let stages = journey(&tag, order.len());
        let items: Vec<Value> = order.iter().map(|&i| stages[i].clone()).collect();
        let reply = stack.post("/v1/conversions/batch", &key, &json!({"conversions": items})).await;
        assert_eq!(reply.body["summary"]["created"], json!(order.len()), "{reply:?}");
        let stored = chains_of(&key.workspace_id, &tag).await;
        assert_eq!(stored.len(), 1, "order {order:?}");
        let answered: Vec<&Value> = reply.body["results"]
            .as_array()
            .map(|results| results.iter().map(|r| &r["conversion"]["chain_id"]).collect())
            .unwrap_or_default();
        assert_eq!(answered.len(), order.len(), "{reply:?}");
        assert!(
            answered.iter().all(|&chain| *chain == json!(stored[0])),
            "every stage is answered with the journey's chain after the write, order {order:?}: {answered:?}"
        );
    }
}

/// The second chunk of a batch merges the chains of two stages of the first: every stage is
/// still answered with the journey's one chain.
#[tokio::test]
async fn a_journey_across_the_chunks_of_a_batch_is_answered_with_its_one_chain() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    let mut items = vec![stage("purchase", "x-p", Some("x-s")), stage("lead", "x-l", None)];
    items.extend((0..98).map(|i| stage("lead", &format!("filler-{i}"), None)));
    items.push(stage("signed", "x-s", Some("x-l")));
    let reply = stack.post("/v1/conversions/batch", &key, &json!({"conversions": items})).await;
    assert_eq!(reply.body["summary"]["created"], json!(101), "{reply:?}");
    let stored = chains_of(&key.workspace_id, "x").await;
    assert_eq!(stored.len(), 1, "{stored:?}");
    let chain = |index: usize| reply.body["results"][index]["conversion"]["chain_id"].clone();
    assert_eq!([chain(0), chain(1), chain(100)], [json!(stored[0]), json!(stored[0]), json!(stored[0])]);
}

#[tokio::test]
async fn merged_chains_resolve_to_the_oldest() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    let child = stack.post("/v1/conversions", &key, &stage("qualified", "m-q", Some("m-l"))).await;
    let other = stack.post("/v1/conversions", &key, &stage("lead", "m-x", None)).await;
    let parent = stack.post("/v1/conversions", &key, &stage("lead", "m-l", Some("m-x"))).await;
    let oldest = child.body["conversion"]["chain_id"].clone();
    assert_eq!(parent.body["conversion"]["chain_id"], oldest);
    let merged = other.body["conversion"]["chain_id"].as_str().unwrap_or_default().to_owned();
    let resolved: Option<String> = sqlx::query_scalar("SELECT merged_into FROM chains WHERE id = $1")
        .bind(&merged)
        .fetch_one(&database().await)
        .await
        .unwrap_or_default();
    assert_eq!(resolved.map(Value::from), Some(oldest), "the merge is recorded");
}

#[tokio::test]
async fn a_chain_merged_twice_resolves_to_the_last_survivor() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    let chain =
        |reply: &intake_tests::Reply| reply.body["conversion"]["chain_id"].as_str().unwrap_or_default().to_owned();
    let oldest = chain(&stack.post("/v1/conversions", &key, &stage("lead", "t-z", None)).await);
    let middle = chain(&stack.post("/v1/conversions", &key, &stage("qualified", "t-y", Some("t-p"))).await);
    let youngest = chain(&stack.post("/v1/conversions", &key, &stage("lead", "t-x", None)).await);
    // t-p joins its child's chain and its parent's: the younger merges into the older.
    let first = stack.post("/v1/conversions", &key, &stage("lead", "t-p", Some("t-x"))).await;
    assert_eq!(chain(&first), middle);
    // t-x, now in the middle chain, names t-z as its parent: the middle chain merges into the oldest.
    let second = stack.post("/v1/conversions", &key, &stage("lead", "t-x", Some("t-z"))).await;
    assert_eq!(chain(&second), oldest, "{second:?}");
    assert_eq!(chains_of(&key.workspace_id, "t").await, vec![oldest.clone()]);
    let merged_into = |id: String| async move {
        sqlx::query_scalar::<_, Option<String>>("SELECT merged_into FROM chains WHERE id = $1")
            .bind(id)
            .fetch_one(&database().await)
            .await
            .unwrap_or_default()
    };
    assert_eq!(merged_into(middle).await.as_deref(), Some(oldest.as_str()));
    assert_eq!(merged_into(youngest).await.as_deref(), Some(oldest.as_str()), "resolves in one step");
}

#[tokio::test]
async fn a_parent_that_arrives_later_links_the_stored_children() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    stack.post("/v1/conversions", &key, &stage("deal", "p-d1", Some("p-lead"))).await;
    stack.post("/v1/conversions", &key, &stage("deal", "p-d2", Some("p-lead"))).await;
    assert_eq!(chains_of(&key.workspace_id, "p").await.len(), 2, "unlinked until the parent arrives");
    let parent = stack.post("/v1/conversions", &key, &stage("lead", "p-lead", None)).await;
    assert_eq!(parent.status, 201);
    assert_eq!(
        chains_of(&key.workspace_id, "p").await,
        vec![parent.body["conversion"]["chain_id"].as_str().unwrap_or_default().to_owned()]
    );
}
