//! Growing the requests topic (deploy/RUNBOOK.md, "More partitions"): refused while the
//! writers have not applied everything or the topic is being written to, and each workspace
//! keeps its order through the change.

use intake_tests::serde_json::json;
use intake_tests::*;
use std::time::{Duration, Instant};

fn grow(stack: &Stack, partitions: u32) -> anyhow::Result<serde_json::Value> {
    stack.run_writer_command(&["topics", "--request-partitions", &partitions.to_string(), "--quiet-ms", "1000"])
}

#[tokio::test]
async fn the_requests_topic_grows_only_when_drained_and_every_workspace_keeps_its_order() {
    let mut stack = Stack::start_with(StackOptions { request_partitions: 2, ..Default::default() }).await;
    // At least one of them moves when the topic grows to 4 (six workspaces taken at random all
    // stay in one run of 64).
    let mut keys: Vec<TestKey> = (0..5).map(|_| stack.workspace()).collect();
    keys.push(loop {
        let key = stack.workspace();
        if request_partition_among(&key.workspace_id, 4) >= 2 {
            break key;
        }
    });
    let value_of = |n: u32| {
        move |key: &TestKey| {
            let mut item = conversion("purchase");
            item["external_id"] = json!(format!("order-{}", key.workspace_id));
            item["value"] = json!(n.to_string());
            item
        }
    };
    for key in &keys {
        assert_eq!(stack.post("/v1/conversions", key, &value_of(1)(key)).await.status, 201);
    }

    // Not applied yet: a message waits while no writer runs.
    stack.stop_writers(true);
    let topic = format!("{}.requests", stack.topic_prefix);
    produce_request(&topic, &keys[0].workspace_id, 1, &value_of(2)(&keys[0])).await;
    let refused = grow(&stack, 4).err().map(|e| format!("{e:#}")).unwrap_or_default();
    assert!(refused.contains("has not applied"), "{refused}");

    // Drained and quiet: grown.
    stack.start_writer();
    let deadline = Instant::now() + Duration::from_secs(30);
    let grown = loop {
        match grow(&stack, 4) {
            Ok(output) => break output,
            Err(error) => assert!(Instant::now() < deadline, "never grown: {error:#}"),
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert_eq!(grown["grown"]["partitions"], 4, "{grown}");
    assert_eq!(grow(&stack, 4).map(|o| o.get("grown").is_none()).ok(), Some(true), "nothing more to do");

    // The runbook's step after a growth: restart writers and gateways.
    stack.set_request_partitions(4);
    stack.stop_writers(true);
    stack.start_writer();
    stack.restart_gateway().await;
    assert!(keys.iter().any(|k| stack.request_partition(&k.workspace_id) >= 2), "some workspace moved");
    for n in 3..=4 {
        for key in &keys {
            let reply = stack.post("/v1/conversions", key, &value_of(n)(key)).await;
            assert_eq!(reply.status, 200, "{}", reply.body);
            assert_eq!(reply.body["conversion"]["result"], "updated");
        }
    }
    let db = database().await;
    for key in &keys {
        let values: Vec<_> = stored_values(&db, &key.workspace_id).await.into_values().collect();
        assert_eq!(values, [Some("4".to_owned())], "the last value sent wins in {}", key.workspace_id);
    }
}
