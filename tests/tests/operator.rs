//! The operator commands of docs/operations.md, "Operator commands" that the other tests do not already cover.

use intake_tests::serde_json::{json, Value};
use intake_tests::{
    conversion, database, now_ms, produce_payload, stored_count, stored_fields, wait_until, Stack, StackOptions,
};
use std::time::Duration;

/// A conversion and the record of its message gone, as after a restore from a backup that
/// predates its write (its chain stays: a replay keeps a chain stored under its derived id).
async fn lose(db: &sqlx::PgPool, workspace_id: &str, external_id: &str) {
    sqlx::query("DELETE FROM applied_messages WHERE workspace_id = $1 AND results::text LIKE '%' || $2 || '%'")
        .bind(workspace_id)
        .bind(external_id)
        .execute(db)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    sqlx::query("DELETE FROM conversions WHERE workspace_id = $1 AND external_id = $2")
        .bind(workspace_id)
        .bind(external_id)
        .execute(db)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
}

fn minute_ago() -> String {
    let at = time::OffsetDateTime::now_utc() - time::Duration::minutes(1);
    at.format(&time::format_description::well_known::Rfc3339).unwrap_or_default()
}

#[tokio::test]
async fn workspace_and_key_commands_print_json_and_fail_clearly() {
    let stack = Stack::start().await;
    let workspace = stack
        .run_writer_command(&[
            "workspace",
            "create",
            "--name",
            "Acme",
            "--project-id",
            "prj_1",
            "--site-restriction",
            "listed",
            "--site",
            "a.example",
            "--site",
            "b.example",
        ])
        .unwrap_or_else(|e| panic!("{e:#}"));
    let id = workspace["id"].as_str().unwrap_or_default().to_owned();
    assert!(id.starts_with("ws_"));
    assert_eq!(workspace.as_object().map(|o| o.len()), Some(1));
    let key = stack
        .run_writer_command(&["key", "create", "--workspace", &id, "--scopes", "workspace:read"])
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert!(key["id"].as_str().is_some_and(|k| k.starts_with("key_")));
    let secret = key["secret"].as_str().unwrap_or_default();
    assert!(secret.starts_with("svc_live_") && secret.len() >= 9 + 32, "{secret}");
    assert_eq!(key["scopes"], json!(["workspace:read"]));
    let stored: Vec<u8> = sqlx::query_scalar("SELECT secret_sha256 FROM api_keys WHERE id = $1")
        .bind(key["id"].as_str())
        .fetch_one(&database().await)
        .await
        .unwrap_or_default();
    assert_eq!(stored.len(), 32, "only the SHA-256 of the secret is stored");

    let reply = stack.send(reqwest::Method::GET, "/v1/workspace", Some(&format!("Bearer {secret}")), None).await;
    assert_eq!(reply.body["workspace"]["siteRestriction"], "listed");
    assert_eq!(reply.body["workspace"]["projectId"], "prj_1");
    assert_eq!(reply.body["sites"].as_array().map(Vec::len), Some(2));

    // Each fails with a message that names what is wrong (the harness's error quotes stderr).
    for (bad, names) in [
        (vec!["key", "create", "--workspace", "ws_nope", "--scopes", "workspace:read"], "no workspace ws_nope"),
        (vec!["key", "create", "--workspace", &id, "--scopes", "admin"], "unknown scope \"admin\""),
        (vec!["workspace", "suspend", "ws_nope"], "no workspace ws_nope"),
        (vec!["key", "revoke", "key_nope"], "no key key_nope"),
        (vec!["workspace", "create", "--name", "x", "--site-restriction", "some"], "--site-restriction"),
    ] {
        let error = stack.run_writer_command(&bad).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(error.contains(&format!("failed: intake-writer: {names}")), "{bad:?} should fail saying so: {error}");
    }
}

#[tokio::test]
async fn replay_changes_nothing_already_applied_and_restores_what_was_lost() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    let inputs: Vec<Value> = (0..3).map(|_| conversion("lead")).collect();
    let mut told = Vec::new();
    for input in &inputs {
        let reply = stack.post("/v1/conversions", &key, input).await;
        assert_eq!(reply.status, 201);
        told.push(reply.body["conversion"].clone());
    }
    let from = minute_ago();
    let replayed = stack.run_writer_command(&["replay", "--from-time", &from]).unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(
        replayed,
        json!({"messages": 3, "applied": 0, "already_applied": 3, "failed": 0, "expired": 0, "request_failed": 0})
    );

    // As after a restore from a backup that predates one write: the conversion, its chain and
    // the record of its message are gone; the replay applies it again, with the ids its client
    // was told.
    let db = database().await;
    let lost = inputs[1]["external_id"].as_str().unwrap_or_default();
    lose(&db, &key.workspace_id, lost).await;
    sqlx::query("DELETE FROM chains WHERE id = $1")
        .bind(told[1]["chain_id"].as_str().unwrap_or_default())
        .execute(&db)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let replayed = stack.run_writer_command(&["replay", "--from-time", &from]).unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(
        replayed,
        json!({"messages": 3, "applied": 1, "already_applied": 2, "failed": 0, "expired": 0, "request_failed": 0})
    );
    assert_eq!(stored_count(&db, &key.workspace_id).await, 3);
    let (id, chain_id): (String, String) =
        sqlx::query_as("SELECT id, chain_id FROM conversions WHERE workspace_id = $1 AND external_id = $2")
            .bind(&key.workspace_id)
            .bind(lost)
            .fetch_one(&db)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!((json!(id), json!(chain_id)), (told[1]["id"].clone(), told[1]["chain_id"].clone()), "the ids told");

    let partition_of_first: i64 = 0;
    let by_offset =
        stack.run_writer_command(&["replay", "--partition", "0", "--from-offset", &partition_of_first.to_string()]);
    assert!(by_offset.is_ok(), "{by_offset:?}");
    assert!(stack.run_writer_command(&["replay"]).is_err(), "a start is required");
}

#[tokio::test]
async fn a_database_restored_in_place_under_a_running_writer_gets_back_what_it_lost() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    let (first, lost, later) = (conversion("lead"), conversion("lead"), conversion("lead"));
    assert_eq!(stack.post("/v1/conversions", &key, &first).await.status, 201);
    let told = stack.post("/v1/conversions", &key, &lost).await;
    assert_eq!(told.status, 201);
    // The writer records where the database stands in the topic: past both messages.
    let db = database().await;
    let topic = format!("{}.requests", stack.topic_prefix);
    let recorded = || async {
        sqlx::query_scalar::<_, i64>("SELECT next_offset FROM log_positions WHERE topic = $1 AND next_offset = 2")
            .bind(&topic)
            .fetch_optional(&db)
            .await
            .ok()
            .flatten()
            .is_some()
    };
    wait_until("the writer's position recorded", Duration::from_secs(10), recorded).await;
    // As after a restore in place from a backup taken between the two writes (the same server,
    // so the same timeline): the second write, its record and the position past it are gone.
    let lost_id = lost["external_id"].as_str().unwrap_or_default();
    lose(&db, &key.workspace_id, lost_id).await;
    sqlx::query("UPDATE log_positions SET next_offset = 1 WHERE topic = $1 AND next_offset = 2")
        .bind(&topic)
        .execute(&db)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    // The next write's position finds the database behind what the writer recorded: it reads
    // the partition again from the database's position, and the lost write is back, under the
    // id its client was told, without a second answer to anyone.
    assert_eq!(stack.post("/v1/conversions", &key, &later).await.status, 201);
    let stored_id = || async {
        sqlx::query_scalar::<_, String>("SELECT id FROM conversions WHERE workspace_id = $1 AND external_id = $2")
            .bind(&key.workspace_id)
            .bind(lost_id)
            .fetch_optional(&db)
            .await
            .unwrap_or_else(|e| panic!("{e}"))
    };
    wait_until("the lost write applied again", Duration::from_secs(15), || async { stored_id().await.is_some() }).await;
    let id = stored_id().await.unwrap_or_default();
    assert_eq!(json!(id), told.body["conversion"]["id"], "the id told");
    let metrics = stack.writer_metrics(0).await;
    assert_eq!(metrics.value("intake_writer_reapplied_messages_total"), 1.0);
    assert_eq!(stored_count(&db, &key.workspace_id).await, 3);
}

/// A request message as the gateways wrote it before the storage migrations, frozen here as
/// text: those migrations change keys and indexes, not the messages, so the requests topic
/// (24 h) and the dead letters (14 days, the same message) written before a migration replay
/// into the new shape, and what they store is found by the new look-ups (deploy/RUNBOOK.md,
/// "Schema migrations").
fn pre_migration_message(ws: &str, external_id: &str, email_sha256: &str) -> String {
    let now = now_ms();
    format!(
        r#"{{"v":"1","correlation_id":"c-{external_id}","reply_partition":0,"deadline_ms":{deadline},"received_at_ms":{now},"workspace_id":"{ws}","items":[{{"event":"lead","external_id":"{external_id}","occurred_at_ms":{occurred},"contact_id":"crm-1","email_sha256":"{email_sha256}","value":"12.5","currency":"EUR"}}]}}"#,
        deadline = now + 10_000,
        occurred = now - 3_600_000,
    )
}

#[tokio::test]
async fn request_messages_and_dead_letters_written_before_the_storage_migrations_replay_into_their_shape() {
    // No writer: the message waits in the topic, as after an outage, until replay applies it.
    let stack = Stack::start_with(StackOptions { start_writer: false, ..Default::default() }).await;
    let key = stack.workspace();
    let ws = key.workspace_id.clone();
    // The digest of ann@example.com, as the gateway hashed it.
    let email_sha256 = "71d4f55f72fa128dfb468a1a3901507c804b74316488744d769d7f4b16696476";
    let from_requests = format!("pre-migration-{}", ulid::Ulid::new());
    let from_dead_letters = format!("pre-migration-dlq-{}", ulid::Ulid::new());
    let requests = format!("{}.requests", stack.topic_prefix);
    let dead_letters = format!("{}.requests.dlq", stack.topic_prefix);
    produce_payload(&requests, &ws, pre_migration_message(&ws, &from_requests, email_sha256).as_bytes()).await;
    produce_payload(&dead_letters, &ws, pre_migration_message(&ws, &from_dead_letters, email_sha256).as_bytes()).await;

    let mut applied_one =
        json!({"messages": 1, "applied": 1, "already_applied": 0, "failed": 0, "expired": 0, "request_failed": 0});
    let replayed =
        stack.run_writer_command(&["replay", "--from-time", &minute_ago()]).unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(replayed, applied_one, "the requests topic");
    let redriven = stack
        .run_writer_command(&["replay", "--topic", &dead_letters, "--from-time", &minute_ago()])
        .unwrap_or_else(|e| panic!("{e:#}"));
    // A dead letter never overwrites a newer write of its conversion; there was none.
    applied_one["kept_newer"] = json!(0);
    assert_eq!(redriven, applied_one, "the dead letters");
    let db = database().await;
    for external_id in [&from_requests, &from_dead_letters] {
        let stored =
            stored_fields(&db, &ws, "lead", external_id, &["email_sha256", "contact_id", "value", "currency"]).await;
        let expected = [email_sha256, "crm-1", "12.5", "EUR"].map(|v| Some(v.to_owned())).to_vec();
        assert_eq!(stored, Some(expected), "{external_id}");
    }

    // Erasure finds both through the month-led index on the email's digest.
    let erased = stack
        .run_writer_command_with_input(&["erase", "--workspace", &ws, "--email"], "ann@example.com\n")
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(erased, json!({"conversions": 2, "visits": 0}));
    for external_id in [&from_requests, &from_dead_letters] {
        let after = stored_fields(&db, &ws, "lead", external_id, &["email_sha256"]).await;
        assert_eq!(after, Some(vec![None]), "{external_id}: the digest erased");
    }
}

#[tokio::test]
async fn workspace_list_and_key_list_show_no_secret() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    let listed = stack.run_writer_command(&["workspace", "list"]).unwrap_or_else(|e| panic!("{e:#}"));
    let ours = listed["workspaces"]
        .as_array()
        .and_then(|all| all.iter().find(|w| w["id"] == json!(key.workspace_id)).cloned());
    let ours = ours.unwrap_or_else(|| panic!("the new workspace is listed: {listed}"));
    assert_eq!(
        (ours["status"].clone(), ours["sites"].clone(), ours["deleted"].clone()),
        (json!("active"), json!(["shop.example"]), json!(false))
    );
    stack.run_writer_command(&["key", "revoke", &key.key_id]).unwrap_or_else(|e| panic!("{e:#}"));
    let keys = stack
        .run_writer_command(&["key", "list", "--workspace", &key.workspace_id])
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(keys["keys"][0]["id"], json!(key.key_id));
    assert_eq!(keys["keys"][0]["revoked"], json!(true));
    assert_eq!(keys["keys"][0]["scopes"], json!(["workspace:read", "conversions:write"]));
    assert!(!keys.to_string().contains(&key.secret) && !keys.to_string().contains("secret"), "{keys}");
    assert!(stack.run_writer_command(&["key", "list", "--workspace", "ws_nope"]).is_err());
}

#[tokio::test]
async fn dlq_inspect_shows_reasons_and_sources_but_no_identifier() {
    let stack = Stack::start().await;
    let topic = format!("{}.requests", stack.topic_prefix);
    let mut input = conversion("lead");
    input["email"] = json!("dead.letter@example.com");
    intake_tests::produce_request(&topic, "ws_missing_workspace", 1, &input).await;
    let mut inspected = Value::Null;
    for _ in 0..100 {
        inspected = stack.run_writer_command(&["dlq", "inspect"]).unwrap_or_else(|e| panic!("{e:#}"));
        if inspected["total"] == json!(1) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    let letter = &inspected["messages"][0];
    assert_eq!(letter["reason"], json!("apply_failed"), "{inspected}");
    assert_eq!(letter["source_topic"], json!(topic));
    assert_eq!(letter["workspace_id"], json!("ws_missing_workspace"));
    assert_eq!(letter["items"], json!(1));
    assert!(letter["age_seconds"].as_i64().is_some_and(|age| age >= 0));
    let email_hash = intake_model::normalize::email_hash("dead.letter@example.com")
        .map(|h| h.as_str().to_owned())
        .unwrap_or_default();
    assert!(!inspected.to_string().contains(&email_hash), "no hash is printed");
}

/// deploy/kafka-tool.sh (deploy/RUNBOOK.md, "Kafka's own tools") runs the tools from what the
/// broker's install fetched, with no registry: here a cache that holds only the broker's
/// directory, and an `mvn` that fails.
#[test]
fn kafka_tools_run_from_the_broker_install_without_a_registry() {
    use std::process::Command;
    let repo = intake_tests::repo();
    let libs = Command::new("bash")
        .args(["-c", "source deploy/lib.sh && echo \"$KAFKA_LIBS\""])
        .current_dir(&repo)
        .output()
        .unwrap_or_else(|e| panic!("{e}"));
    let libs = String::from_utf8_lossy(&libs.stdout).trim().to_owned();
    let install = std::path::Path::new(&libs).parent().unwrap_or_else(|| panic!("{libs}"));
    let name = format!("t{}", ulid::Ulid::new().to_string().to_lowercase());
    let cache = std::env::temp_dir().join("intake-tests").join(&name);
    let bin = cache.join("bin");
    std::fs::create_dir_all(&bin).unwrap_or_else(|e| panic!("{e}"));
    std::os::unix::fs::symlink(install, cache.join(install.file_name().unwrap_or_default()))
        .unwrap_or_else(|e| panic!("{e}"));
    std::fs::write(bin.join("mvn"), "#!/bin/sh\necho 'mvn: no registry here' >&2\nexit 1\n")
        .unwrap_or_else(|e| panic!("{e}"));
    let executable = std::os::unix::fs::PermissionsExt::from_mode(0o755);
    std::fs::set_permissions(bin.join("mvn"), executable).unwrap_or_else(|e| panic!("{e}"));
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
    let tool = |args: &[&str]| {
        let output = Command::new(repo.join("deploy/kafka-tool.sh"))
            .args(args)
            .env("INTAKE_CACHE", &cache)
            .env("PATH", &path)
            .output()
            .unwrap_or_else(|e| panic!("{e}"));
        let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
        assert!(output.status.success(), "kafka-tool.sh {args:?}: {}\n{text}", output.status);
        text
    };
    let topic = format!("{name}.tools");
    tool(&["kafka-topics", "--create", "--topic", &topic, "--partitions", "2", "--replication-factor", "1"]);
    let described = tool(&["kafka-topics", "--describe", "--topic", &topic]);
    assert!(described.contains("PartitionCount: 2"), "{described}");
    tool(&["kafka-topics", "--delete", "--topic", &topic]);

    // Without the broker's install it fetches nothing: it fails, and says what installs them.
    let empty = cache.join("empty");
    std::fs::create_dir_all(&empty).unwrap_or_else(|e| panic!("{e}"));
    let output = Command::new(repo.join("deploy/kafka-tool.sh"))
        .args(["kafka-topics", "--list"])
        .env("INTAKE_CACHE", &empty)
        .env("PATH", &path)
        .output()
        .unwrap_or_else(|e| panic!("{e}"));
    let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert!(!output.status.success() && text.contains("deploy/up.sh"), "{}: {text}", output.status);
    assert!(!text.contains("no registry here"), "it tried to fetch them: {text}");
    std::fs::remove_dir_all(&cache).unwrap_or_else(|e| panic!("{e}"));
}

/// The requests topic's retention deletes `partition`'s messages before `offset`.
async fn delete_before(topic: &str, partition: i32, offset: i64) {
    use rdkafka::admin::{AdminClient, AdminOptions};
    let admin: AdminClient<rdkafka::client::DefaultClientContext> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", intake_tests::env("INTAKE_KAFKA_BROKERS"))
        .create()
        .unwrap_or_else(|e| panic!("admin: {e}"));
    let mut offsets = rdkafka::TopicPartitionList::new();
    offsets.add_partition_offset(topic, partition, rdkafka::Offset::Offset(offset)).unwrap_or_else(|e| panic!("{e}"));
    let deleted = admin.delete_records(&offsets, &AdminOptions::new()).await.unwrap_or_else(|e| panic!("{e}"));
    let low = deleted.find_partition(topic, partition).map(|p| (p.offset(), p.error()));
    assert!(matches!(low, Some((rdkafka::Offset::Offset(o), Ok(()))) if o == offset), "{low:?}");
}

#[tokio::test]
async fn replay_says_what_it_would_do_and_refuses_a_start_the_topic_no_longer_holds() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    let inputs: Vec<Value> = (0..3).map(|_| conversion("lead")).collect();
    for input in &inputs {
        assert_eq!(stack.post("/v1/conversions", &key, input).await.status, 201);
    }
    let from = minute_ago();
    // As after a restore from a backup that predates the second write.
    let db = database().await;
    let lost = inputs[1]["external_id"].as_str().unwrap_or_default();
    lose(&db, &key.workspace_id, lost).await;

    let dry =
        stack.run_writer_command(&["replay", "--from-time", &from, "--dry-run"]).unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(
        dry,
        json!({"messages": 3, "applied": 1, "already_applied": 2, "failed": 0, "expired": 0, "request_failed": 0,
               "dry_run": true})
    );
    assert_eq!(stored_count(&db, &key.workspace_id).await, 2, "a dry run changes nothing");

    // The topic's retention deleted the partition's first message: a replay from before it
    // would miss it, and says so instead of reporting nothing failed.
    let topic = format!("{}.requests", stack.topic_prefix);
    let partition = i32::try_from(stack.request_partition(&key.workspace_id)).unwrap_or(0);
    delete_before(&topic, partition, 1).await;
    for args in [
        vec!["replay", "--from-time", &from],
        vec!["replay", "--partition", &partition.to_string(), "--from-offset", "0"],
    ] {
        let refused = stack.run_writer_command(&args).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(
            refused.contains("no longer holds the start") && refused.contains("--accept-loss"),
            "{args:?}: {refused}"
        );
    }
    assert_eq!(stored_count(&db, &key.workspace_id).await, 2, "a refused replay changes nothing");
    let accepted = stack
        .run_writer_command(&["replay", "--from-time", &from, "--accept-loss"])
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!((accepted["messages"].clone(), accepted["applied"].clone()), (json!(2), json!(1)), "{accepted}");
    let gap = &accepted["lost_to_retention"][0];
    assert_eq!(
        (gap["partition"].clone(), gap["first_offset_held"].clone()),
        (json!(partition), json!(1)),
        "{accepted}"
    );
    assert!(gap["missing_ms"].as_i64().is_some_and(|ms| ms > 0), "{accepted}");
    assert_eq!(stored_count(&db, &key.workspace_id).await, 3);
}

/// A requests topic made again (a new Kafka cluster, a topic deleted and created, the quick
/// start's other layout) starts below the database's positions, which were read from another
/// log: every write to the new one is applied and answered, none taken for one answered before.
#[tokio::test]
async fn a_requests_topic_made_again_below_the_database_s_position_is_read_from_its_start() {
    let mut stack = Stack::start().await;
    let key = stack.workspace();
    for _ in 0..4 {
        assert_eq!(stack.post("/v1/conversions", &key, &conversion("lead")).await.status, 201);
    }
    let db = database().await;
    let topic = format!("{}.requests", stack.topic_prefix);
    let partition = i32::try_from(stack.request_partition(&key.workspace_id)).unwrap_or_default();
    let position = || async {
        sqlx::query_scalar::<_, i64>("SELECT next_offset FROM log_positions WHERE topic = $1 AND partition = $2")
            .bind(&topic)
            .bind(partition)
            .fetch_optional(&db)
            .await
            .ok()
            .flatten()
    };
    wait_until("the position past the four writes recorded", Duration::from_secs(10), || async {
        position().await == Some(4)
    })
    .await;

    stack.stop_writers(true);
    stack.make_requests_topic_again().await;
    stack.start_writer();
    let mut sent = Vec::new();
    for _ in 0..2 {
        let conversion = conversion("lead");
        let reply = stack.post("/v1/conversions", &key, &conversion).await;
        assert_eq!(reply.status, 201, "a write to the new log is answered: {}", reply.body);
        sent.push(conversion);
    }
    for conversion in &sent {
        let stored: Option<String> =
            sqlx::query_scalar("SELECT id FROM conversions WHERE workspace_id = $1 AND external_id = $2")
                .bind(&key.workspace_id)
                .bind(conversion["external_id"].as_str().unwrap_or_default())
                .fetch_optional(&db)
                .await
                .unwrap_or_else(|e| panic!("{e}"));
        assert!(stored.is_some(), "stored: {conversion}");
    }
    // The position is this log's now, so that no later rewind skips what lies below the old one.
    wait_until("the position of the new log recorded", Duration::from_secs(10), || async {
        position().await == Some(2)
    })
    .await;
}
