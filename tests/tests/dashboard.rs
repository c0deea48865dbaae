//! The Grafana dashboard (`deploy/grafana/intake.json`) shows only what exists: every
//! expression, with Grafana's variables given values, parses as PromQL (`promtool check rules`
//! on a rules file made of them), and every metric it names is one that a real gateway and
//! writer export on their `/metrics`, or one that Patroni, kafka_exporter or CloudNativePG's
//! instances export.

use intake_tests::serde_json::{self, json, Value};
use intake_tests::Stack;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn repo() -> PathBuf {
    intake_tests::repo()
}

fn dashboard() -> Value {
    let path = repo().join("deploy/grafana/intake.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Patroni's metrics, as its REST API's metrics handler writes them (`do_GET_metrics` in
/// patroni/api.py of Patroni 3.0.2, Debian 12's). Where Patroni is installed, the names are
/// also checked against its own source.
const PATRONI_METRICS: &[&str] = &[
    "patroni_version",
    "patroni_postgres_running",
    "patroni_postmaster_start_time",
    "patroni_master",
    "patroni_primary",
    "patroni_xlog_location",
    "patroni_standby_leader",
    "patroni_replica",
    "patroni_sync_standby",
    "patroni_xlog_received_location",
    "patroni_xlog_replayed_location",
    "patroni_xlog_replayed_timestamp",
    "patroni_xlog_paused",
    "patroni_postgres_server_version",
    "patroni_cluster_unlocked",
    "patroni_failsafe_mode_is_active",
    "patroni_postgres_timeline",
    "patroni_dcs_last_seen",
    "patroni_pending_restart",
    "patroni_is_paused",
];

/// kafka_exporter's metrics the dashboard may use (danielqsj/kafka_exporter, `kafka_exporter.go`:
/// its `prometheus.NewDesc` names).
const KAFKA_EXPORTER_METRICS: &[&str] = &[
    "kafka_brokers",
    "kafka_consumergroup_current_offset",
    "kafka_consumergroup_lag",
    "kafka_consumergroup_lag_sum",
    "kafka_consumergroup_members",
    "kafka_topic_partition_current_offset",
];

/// CloudNativePG's instance metrics the dashboard may use: the operator's default queries
/// (`config/manager/default-monitoring.yaml` of CloudNativePG 1.30, named `cnpg_` + query +
/// column) and its collector's own (`pg_collector.go`).
const CLOUDNATIVEPG_METRICS: &[&str] = &[
    "cnpg_collector_up",
    "cnpg_pg_replication_in_recovery",
    "cnpg_pg_replication_lag",
    "cnpg_pg_replication_streaming_replicas",
];

/// Every PromQL expression of the dashboard, with where it is: the panels' queries (rows'
/// panels too) and the selectors of the template variables' `label_values(selector, label)`.
fn expressions(dashboard: &Value) -> Vec<(String, String)> {
    fn panels(list: &Value, found: &mut Vec<(String, String)>) {
        for panel in list.as_array().into_iter().flatten() {
            let title = panel["title"].as_str().unwrap_or("?");
            for target in panel["targets"].as_array().into_iter().flatten() {
                if let Some(expr) = target["expr"].as_str() {
                    let reference = target["refId"].as_str().unwrap_or("?");
                    found.push((format!("panel \"{title}\" query {reference}"), expr.to_owned()));
                }
            }
            panels(&panel["panels"], found);
        }
    }
    let mut found = Vec::new();
    panels(&dashboard["panels"], &mut found);
    for variable in dashboard["templating"]["list"].as_array().into_iter().flatten() {
        let query = variable["query"]["query"].as_str().or_else(|| variable["query"].as_str()).unwrap_or("");
        if let Some(arguments) = query.trim().strip_prefix("label_values(").and_then(|q| q.strip_suffix(')')) {
            if let Some((selector, _label)) = arguments.rsplit_once(',') {
                let name = variable["name"].as_str().unwrap_or("?");
                found.push((format!("variable ${name}"), selector.trim().to_owned()));
            }
        }
    }
    found
}

/// The values Grafana gives its variables when it sends a query: its own (`$__rate_interval`
/// and the like) and the dashboard's, at "All" (their `allValue`).
fn variable_values(dashboard: &Value) -> BTreeMap<String, String> {
    let mut values: BTreeMap<String, String> = [
        ("__rate_interval", "1m"),
        ("__interval", "30s"),
        ("__interval_ms", "30000"),
        ("__range", "6h"),
        ("__range_s", "21600"),
        ("__range_ms", "21600000"),
    ]
    .into_iter()
    .map(|(name, value)| (name.to_owned(), value.to_owned()))
    .collect();
    for variable in dashboard["templating"]["list"].as_array().into_iter().flatten() {
        let name = variable["name"].as_str().unwrap_or_default().to_owned();
        let value = variable["allValue"].as_str().unwrap_or(".+").to_owned();
        values.insert(name, value);
    }
    values
}

/// `expr` with every `$name`, `${name}` and `${name:format}` replaced; an unknown name panics,
/// so that a variable the test does not know is not sent to promtool as text.
fn substituted(expr: &str, values: &BTreeMap<String, String>) -> String {
    let mut out = String::new();
    let mut rest = expr;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        rest = &rest[at + 1..];
        let name = if let Some(braced) = rest.strip_prefix('{') {
            let end = braced.find('}').unwrap_or_else(|| panic!("unclosed ${{ in {expr}"));
            rest = &braced[end + 1..];
            braced[..end].split(':').next().unwrap_or_default()
        } else {
            let end = rest.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(rest.len());
            let name = &rest[..end];
            rest = &rest[end..];
            name
        };
        let value = values.get(name).unwrap_or_else(|| panic!("no value for the variable ${name} in {expr}"));
        out.push_str(value);
    }
    out.push_str(rest);
    out
}

/// The metric names a PromQL expression selects: its identifiers that are not functions
/// (followed by `(`), aggregations, keywords, label names (in a grouping list or a matcher) or
/// numbers and durations. Strings, matchers (`{...}`) and ranges (`[...]`) are skipped whole.
fn metric_names(expr: &str) -> BTreeSet<String> {
    const KEYWORDS: &str = "and or unless offset bool inf nan \
        sum min max avg group stddev stdvar count count_values bottomk topk quantile limitk limit_ratio";
    const GROUPING: &[&str] = &["by", "without", "on", "ignoring", "group_left", "group_right"];
    let chars: Vec<char> = expr.chars().collect();
    let skip_quoted = |mut i: usize| -> usize {
        let quote = chars[i];
        i += 1;
        while i < chars.len() && chars[i] != quote {
            i += if chars[i] == '\\' && quote != '`' { 2 } else { 1 };
        }
        i + 1
    };
    let (mut names, mut in_label_list, mut label_list_next) = (BTreeSet::new(), false, false);
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '"' || c == '\'' || c == '`' {
            i = skip_quoted(i);
        } else if c == '{' || c == '[' {
            let close = if c == '{' { '}' } else { ']' };
            while i < chars.len() && chars[i] != close {
                i = if chars[i] == '"' || chars[i] == '\'' { skip_quoted(i) } else { i + 1 };
            }
            i += 1;
        } else if c == '(' {
            in_label_list = std::mem::take(&mut label_list_next);
            i += 1;
        } else if c == ')' {
            in_label_list = false;
            i += 1;
        } else if c.is_ascii_digit() || c == '.' {
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                i += 1;
            }
        } else if c.is_ascii_alphabetic() || c == '_' || c == ':' {
            let start = i;
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == ':') {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            let next = chars[i..].iter().find(|c| !c.is_whitespace()).copied();
            if GROUPING.contains(&word.as_str()) {
                label_list_next = next == Some('(');
            } else {
                let keyword = KEYWORDS.split_whitespace().any(|keyword| keyword == word);
                if !(in_label_list || keyword || next == Some('(')) {
                    names.insert(word);
                }
            }
        } else {
            i += 1;
        }
    }
    names
}

/// The series names a `/metrics` text can hold: the samples' names, and for each `# TYPE` line
/// the names of its type (prometheus-client writes a family's `# TYPE` line even before its
/// first sample, and names a counter there without its `_total`).
fn exported_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in text.lines() {
        if let Some(declared) = line.strip_prefix("# TYPE ") {
            let mut words = declared.split_whitespace();
            let (Some(name), Some(kind)) = (words.next(), words.next()) else { continue };
            let suffixes: &[&str] = match kind {
                "counter" => &["_total", ""],
                "histogram" => &["_bucket", "_sum", "_count"],
                "summary" => &["", "_sum", "_count"],
                _ => &[""],
            };
            names.extend(suffixes.iter().map(|suffix| format!("{}{suffix}", name.trim_end_matches("_total"))));
        } else if !line.starts_with('#') {
            if let Some(name) = line.split(['{', ' ']).next().filter(|n| !n.is_empty()) {
                names.insert(name.to_owned());
            }
        }
    }
    names
}

fn promtool() -> PathBuf {
    let output = Command::new("bash")
        .arg(repo().join("deploy/validate.sh"))
        .arg("promtool")
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("running deploy/validate.sh promtool: {e}"));
    assert!(output.status.success(), "installing promtool: {}", String::from_utf8_lossy(&output.stderr));
    let printed = String::from_utf8_lossy(&output.stdout);
    PathBuf::from(printed.lines().last().unwrap_or_default().trim())
}

/// `promtool check rules` on a rules file with one recording rule per expression.
fn check_rules(promtool: &Path, expressions: &[(String, String)], name: &str) -> (bool, String) {
    let rules: Vec<Value> = expressions
        .iter()
        .enumerate()
        .map(|(index, (_, expr))| json!({ "record": format!("dashboard_expression_{index}"), "expr": expr }))
        .collect();
    // JSON is YAML: promtool reads it as a rules file.
    let file = std::env::temp_dir().join(format!("intake-dashboard-{name}-{}.yml", std::process::id()));
    std::fs::write(&file, json!({ "groups": [{ "name": "dashboard", "rules": rules }] }).to_string())
        .unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    let output = Command::new(promtool)
        .args(["check", "rules"])
        .arg(&file)
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", promtool.display()));
    let _ = std::fs::remove_file(&file);
    let printed = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    let numbered: Vec<String> = expressions
        .iter()
        .enumerate()
        .map(|(i, (place, expr))| format!("dashboard_expression_{i}: {place}: {expr}"))
        .collect();
    (output.status.success(), format!("{printed}\n{}", numbered.join("\n")))
}

#[test]
fn every_expression_of_the_dashboard_parses() {
    let dashboard = dashboard();
    let values = variable_values(&dashboard);
    let expressions: Vec<(String, String)> =
        expressions(&dashboard).into_iter().map(|(place, expr)| (place, substituted(&expr, &values))).collect();
    assert!(expressions.len() > 20, "too few expressions found: {expressions:?}");
    let promtool = promtool();
    let (parsed, printed) = check_rules(&promtool, &expressions, "all");
    assert!(parsed, "promtool refused an expression of the dashboard:\n{printed}");
    // The check can fail: an expression that does not parse is refused.
    let broken = vec![("broken".to_owned(), "sum by (route) (rate(intake_gateway_requests_total[1m])".to_owned())];
    assert!(!check_rules(&promtool, &broken, "broken").0, "promtool took an unbalanced expression");
}

#[tokio::test]
async fn the_dashboard_names_only_metrics_the_programs_export() {
    let dashboard = dashboard();
    let values = variable_values(&dashboard);
    let mut used: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (place, expr) in expressions(&dashboard) {
        for name in metric_names(&substituted(&expr, &values)) {
            used.entry(name).or_default().push(place.clone());
        }
    }
    // What an operator comes to the dashboard for, each shown by a metric of its own.
    for shown in [
        "intake_gateway_requests_total",
        "intake_gateway_request_seconds_bucket",
        "intake_gateway_writes_in_flight",
        "intake_gateway_load_shed_total",
        "intake_writer_consumer_lag",
        "intake_writer_workspace_waiting_seconds",
        "intake_writer_stalled",
        "intake_writer_dead_lettered_total",
        "intake_gateway_redis_fail_open_total",
        "intake_gateway_key_cache_total",
        "patroni_primary",
        "patroni_replica",
        "patroni_xlog_location",
        "patroni_xlog_replayed_location",
        "process_resident_memory_bytes",
        "process_cpu_seconds_total",
        "kafka_consumergroup_lag",
        "cnpg_pg_replication_in_recovery",
    ] {
        assert!(used.contains_key(shown), "the dashboard does not show {shown}; it uses {:?}", used.keys());
    }

    // The real programs' metrics. No traffic is needed: every registered family has its
    // `# TYPE` line from the start.
    let stack = Stack::start().await;
    let gateway = stack.metrics().await.0;
    let writer = stack.writer_metrics(0).await.0;
    let mut exported = exported_names(&gateway);
    exported.extend(exported_names(&writer));
    assert!(
        exported.contains("intake_gateway_requests_total") && exported.contains("intake_writer_consumer_lag"),
        "the scrapes are not what this test reads:\n{gateway}\n{writer}"
    );
    // Each service exports its process's metrics itself (intake_common::process).
    for (service, text) in [("gateway", &gateway), ("writer", &writer)] {
        assert!(
            exported_names(text).contains("process_resident_memory_bytes"),
            "the {service} has no process metrics:\n{text}"
        );
    }

    let patroni: BTreeSet<String> = PATRONI_METRICS.iter().map(|name| (*name).to_owned()).collect();
    let installed = patroni_source_names();
    let of_exporters = |name: &str| KAFKA_EXPORTER_METRICS.contains(&name) || CLOUDNATIVEPG_METRICS.contains(&name);
    let unknown: Vec<String> = used
        .iter()
        .filter(|(name, _)| {
            let of_patroni = patroni.contains(*name) && installed.as_ref().is_none_or(|names| names.contains(*name));
            !(exported.contains(*name) || of_patroni || of_exporters(name))
        })
        .map(|(name, places)| format!("{name} (in {})", places.join("; ")))
        .collect();
    assert!(
        unknown.is_empty(),
        "the dashboard names metrics no program exports:\n{}\nexported: {exported:?}\nPatroni's (installed: {installed:?}): {patroni:?}",
        unknown.join("\n")
    );
}

/// The one expression of the panel titled `title`, its variables given values.
fn panel_expression(dashboard: &Value, title: &str) -> String {
    let place = format!("panel \"{title}\" query A");
    let (_, expr) = expressions(dashboard)
        .into_iter()
        .find(|(found, _)| *found == place)
        .unwrap_or_else(|| panic!("the dashboard has no panel \"{title}\""));
    substituted(&expr, &variable_values(dashboard))
}

#[test]
fn the_database_panels_tell_the_primary_from_the_replica_and_its_lag() {
    // Two nodes as Patroni reports them: db1 the primary at WAL position 1000, db2 a replica
    // that has received up to 900 and replayed up to 600. Patroni writes 0 for the positions a
    // node's role does not have.
    let node = |name: &str, primary: u8, location: u32, received: u32, replayed: u32| {
        [
            ("patroni_primary", u32::from(primary)),
            ("patroni_replica", u32::from(1 - primary)),
            ("patroni_xlog_location", location),
            ("patroni_xlog_received_location", received),
            ("patroni_xlog_replayed_location", replayed),
        ]
        .map(|(metric, value)| {
            json!({ "series": format!("{metric}{{instance=\"{name}\",job=\"patroni\",scope=\"pg\"}}"), "values": format!("{value}x5") })
        })
    };
    let series: Vec<Value> = node("db1", 1, 1000, 0, 0).into_iter().chain(node("db2", 0, 0, 900, 600)).collect();
    let dashboard = dashboard();
    let replica = r#"{instance="db2",job="patroni",scope="pg"}"#;
    let expected = [
        ("Role", vec![(r#"{instance="db1"}"#, 2), (r#"{instance="db2"}"#, 1)]),
        ("Replication lag", vec![(replica, 400)]),
        ("Received, not yet replayed", vec![(replica, 300)]),
    ];
    let checks: Vec<Value> = expected
        .iter()
        .map(|(title, samples)| {
            let samples: Vec<Value> =
                samples.iter().map(|(labels, value)| json!({ "labels": labels, "value": value })).collect();
            json!({ "expr": panel_expression(&dashboard, title), "eval_time": "2m", "exp_samples": samples })
        })
        .collect();
    let tests = json!({
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [{ "interval": "1m", "input_series": series, "promql_expr_test": checks }],
    });
    let file = std::env::temp_dir().join(format!("intake-dashboard-patroni-{}.yml", std::process::id()));
    std::fs::write(&file, tests.to_string()).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    let output = Command::new(promtool())
        .args(["test", "rules"])
        .arg(&file)
        .output()
        .unwrap_or_else(|e| panic!("running promtool: {e}"));
    let _ = std::fs::remove_file(&file);
    assert!(
        output.status.success(),
        "the database panels compute something else:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// The metric names in the installed Patroni's metrics handler, when Patroni is installed.
fn patroni_source_names() -> Option<BTreeSet<String>> {
    let output = Command::new("python3")
        .args(["-c", "import patroni.api; print(patroni.api.__file__)"])
        .stderr(Stdio::null())
        .output()
        .ok()
        .filter(|output| output.status.success())?;
    let source = std::fs::read_to_string(String::from_utf8_lossy(&output.stdout).trim()).ok()?;
    let names: BTreeSet<String> = source
        .split("# TYPE ")
        .skip(1)
        .filter_map(|rest| rest.split_whitespace().next())
        .filter(|name| name.starts_with("patroni_"))
        .map(str::to_owned)
        .collect();
    Some(names)
}

#[test]
fn the_parts_of_the_checks_read_what_they_should() {
    let names = metric_names(
        r#"max by (scope) (patroni_xlog_location{scope=~".+"}) - on (scope) group_right () (patroni_xlog_replayed_location and on (instance, scope) patroni_replica == 1)"#,
    );
    let expected: BTreeSet<String> = ["patroni_xlog_location", "patroni_xlog_replayed_location", "patroni_replica"]
        .into_iter()
        .map(str::to_owned)
        .collect();
    assert_eq!(names, expected);
    let names = metric_names(
        r#"histogram_quantile(0.99, sum(rate(a_bucket{l="x}"}[5m])) by (le)) + topk(10, b) * time() / sum without (c) (d offset 1h) > bool count by (e)(f)"#,
    );
    assert_eq!(names, ["a_bucket", "b", "d", "f"].into_iter().map(str::to_owned).collect());

    let values: BTreeMap<String, String> =
        [("gateway", ".+"), ("__rate_interval", "1m")].into_iter().map(|(k, v)| (k.to_owned(), v.to_owned())).collect();
    assert_eq!(
        substituted(r#"rate(x{instance=~"$gateway"}[$__rate_interval]) or y{i=~"${gateway:regex}"}"#, &values),
        r#"rate(x{instance=~".+"}[1m]) or y{i=~".+"}"#
    );

    let exported = exported_names(
        "# HELP a_requests HTTP requests.\n# TYPE a_requests counter\na_requests_total{route=\"x\"} 1\n\
         # TYPE a_seconds histogram\n# TYPE a_gauge gauge\n# EOF\n",
    );
    for name in ["a_requests_total", "a_seconds_bucket", "a_seconds_count", "a_gauge"] {
        assert!(exported.contains(name), "{name} missing from {exported:?}");
    }
    assert!(!exported.contains("a_seconds"));
}
