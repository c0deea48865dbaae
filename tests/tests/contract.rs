//! The OpenAPI document against the running service: it validates as OpenAPI 3.1, and
//! Schemathesis (every check, see tests/schemathesis.toml) finds nothing with 200 examples per
//! operation. The tools come from PyPI; deploy/test.sh installs them and sets their paths.

use intake_tests::{env, Stack, StackOptions};
use std::process::Command;

fn python_tool(name: &str) -> String {
    format!("{}/bin/{name}", env("INTAKE_PY_VENV"))
}

#[tokio::test]
async fn the_document_is_valid_openapi_3_1() {
    let stack = Stack::start().await;
    let document = stack
        .http
        .get(format!("{}/v1/openapi.json", stack.base_url))
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .text()
        .await
        .unwrap_or_default();
    let path = stack.log_dir.join("openapi.json");
    std::fs::write(&path, document).unwrap_or_else(|e| panic!("{e}"));
    let output =
        Command::new(python_tool("openapi-spec-validator")).arg(&path).output().unwrap_or_else(|e| panic!("{e}"));
    assert!(
        output.status.success(),
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

#[tokio::test]
async fn schemathesis_finds_no_failure() {
    // Limits out of the way: this is about the contract, not the rate limiter.
    let stack = Stack::start_with(StackOptions::unlimited()).await;
    let key = stack.workspace();
    let config = intake_tests::repo().join("tests/schemathesis.toml");
    let examples = std::env::var("INTAKE_SCHEMATHESIS_EXAMPLES").unwrap_or_else(|_| "200".to_owned());
    let mut command = Command::new(python_tool("schemathesis"));
    command
        .arg("--config-file")
        .arg(&config)
        .args(["run", &format!("{}/v1/openapi.json", stack.base_url)])
        .args(["--url", &format!("{}/v1", stack.base_url)])
        .args(["-H", &format!("Authorization: {}", key.bearer())])
        .args(["--max-examples", &examples, "--workers", "1"])
        .current_dir(&stack.log_dir);
    if let Ok(seed) = std::env::var("INTAKE_SCHEMATHESIS_SEED") {
        command.args(["--seed", &seed]);
    }
    let output = command.output().unwrap_or_else(|e| panic!("running schemathesis: {e}"));
    let report = String::from_utf8_lossy(&output.stdout);
    println!("{report}");
    assert!(output.status.success(), "schemathesis failed:\n{report}\n{}", String::from_utf8_lossy(&output.stderr));
    assert!(report.contains("No issues found"), "{report}");
}
