//! The soak's two-minute form (deploy/soak.sh runs 30 minutes): mixed traffic, retentions of
//! seconds so that pruning happens inside the run, and the soak's own checks (nothing
//! acknowledged missing, no growth of RSS, descriptors or the pruned tables after the warm-up;
//! p99 only in the long run, on a machine of its own). At a modest fixed rate, so that it runs
//! beside the other tests, on a database of its own: the pruned table's rows and ranges are the
//! soak's alone, not those of the tests beside it (whose writers keep a day's window).

use std::process::Command;

#[tokio::test]
async fn a_two_minute_soak_keeps_everything_and_levels_off() {
    let own = intake_tests::OwnDatabase::create("soak").await;
    let out = std::env::temp_dir().join(format!("intake-soak-{}", ulid::Ulid::new()));
    // The benchmark's load generator (bench/), built with every program by deploy/test.sh.
    let output = Command::new(std::path::PathBuf::from(intake_tests::env("INTAKE_BIN_DIR")).join("loadgen"))
        .arg("soak")
        .env("DATABASE_URL", &own.url)
        .env("INTAKE_SOAK_MINUTES", "2")
        .env("INTAKE_SOAK_SAMPLE_SECONDS", "10")
        .env("INTAKE_SOAK_RETENTION_MS", "20000")
        .env("INTAKE_SOAK_RATE", "300")
        // The tests beside it move its latency more than it does; the 30-minute run checks p99.
        .env("INTAKE_SOAK_CHECK_LATENCY", "0")
        .env("INTAKE_BENCH_OUT", &out)
        .output()
        .unwrap_or_else(|e| panic!("loadgen soak: {e}"));
    let report = std::fs::read_to_string(out.join("soak.md")).unwrap_or_default();
    assert!(
        output.status.success(),
        "{report}\n{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("soak.json")).unwrap_or_default()).unwrap_or_default();
    assert_eq!(json["samples"].as_array().map(Vec::len), Some(12), "{report}");
    // Two thirds of the items sent are new (re-sends add none): at least half of those were
    // answered and counted.
    let sent_new = json["items_per_s"].as_f64().unwrap_or(0.0) * 120.0 * 106.0 / 157.0;
    let acknowledged = json["acknowledged_items"].as_f64().unwrap_or(0.0);
    assert!(acknowledged > sent_new / 2.0, "{acknowledged} of about {sent_new} new items acknowledged\n{report}");
    assert_eq!(json["missing_acknowledged"], 0, "{report}");
    let _ = std::fs::remove_dir_all(&out);
}
