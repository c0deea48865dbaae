//! `docs/configuration.md` is generated from the programs' clap definitions; it must match them.

use std::process::{Command, Stdio};

#[test]
fn the_configuration_reference_matches_the_programs_flags() {
    let script = intake_tests::repo().join("deploy/config-reference.sh");
    // The script uses the programs in INTAKE_BIN_DIR, which the suite built.
    let output = Command::new("bash")
        .arg(script)
        .arg("--check")
        .env("INTAKE_BIN_DIR", intake_tests::env("INTAKE_BIN_DIR"))
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("running deploy/config-reference.sh: {e}"));
    assert!(
        output.status.success(),
        "docs/configuration.md differs from the programs' flags; regenerate it with deploy/config-reference.sh\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
}
