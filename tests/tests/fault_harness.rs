//! The shortened form of `deploy/faults.sh` (a writer killed, the leader of a request partition
//! killed, PostgreSQL stopped): nothing acknowledged is lost and writes come back by themselves.

use std::process::Command;

#[test]
fn the_fault_harness_finds_nothing_lost_in_its_short_form() {
    let script = intake_tests::repo().join("deploy/faults.sh");
    let output = Command::new("bash").arg(script).arg("--short").output().unwrap_or_else(|e| panic!("{e}"));
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    let lines: Vec<&str> = stdout.lines().filter(|l| l.starts_with('{')).collect();
    assert_eq!(lines.len(), 4, "one JSON line per scenario, and the checker's self-check:\n{stdout}\n{stderr}");
    for line in &lines {
        assert!(line.starts_with(r#"{"ok":true"#), "{line}\n{stderr}");
    }
    assert!(output.status.success(), "{stdout}\n{stderr}");
}
