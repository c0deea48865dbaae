//! The quick start (`deploy/up.sh` builds the two services) and the suite (`deploy/test.sh`
//! builds every program and test) share one build of the dependencies on one profile, and the
//! suite runs the very service binaries the quick start runs. Cargo compiles a dependency again
//! for every other set of features, so a dependency added to one member with other features
//! would silently double the suite's build; `workspace-hack/Cargo.toml` keeps the sets equal.
//! The suite's builds are done when this runs: each cargo call below only reads fingerprints.

use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

/// Every artifact cargo reports for a build: (package, target, kind, test or not) to its files
/// (one set per feature set it was built with), and what was not fresh.
struct Artifacts {
    files: BTreeMap<(String, String, String, bool), BTreeSet<Vec<String>>>,
    compiled: Vec<String>,
}

fn build(args: &[&str]) -> Artifacts {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let mut command = Command::new(cargo);
    // The variables nextest sets for this test (CARGO_MANIFEST_DIR, CARGO_PKG_NAME...) are ones
    // that build scripts (ring's, cc's) ask to be rerun on: cargo would rebuild them and all
    // that depends on them, here and in the next build of the suite.
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        if (name.starts_with("CARGO_") && name != "CARGO_HOME" && name != "CARGO_TARGET_DIR") || name == "OUT_DIR" {
            command.env_remove(name.as_ref());
        }
    }
    let output = command
        .args(["build", "--release", "--message-format=json"])
        .args(args)
        .current_dir(intake_tests::repo())
        .output()
        .unwrap_or_else(|e| panic!("cargo: {e}"));
    assert!(output.status.success(), "cargo build {args:?}: {}", String::from_utf8_lossy(&output.stderr));
    let mut artifacts = Artifacts { files: BTreeMap::new(), compiled: Vec::new() };
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let Ok(message) = serde_json::from_str::<Value>(line) else { continue };
        if message["reason"] != "compiler-artifact" {
            continue;
        }
        let package = message["package_id"].as_str().unwrap_or_default().to_owned();
        let target = message["target"]["name"].as_str().unwrap_or_default().to_owned();
        let kind = message["target"]["kind"].to_string();
        let test = message["profile"]["test"].as_bool().unwrap_or_default();
        if message["fresh"] != true {
            artifacts.compiled.push(format!("{target} ({package})"));
        }
        let files = message["filenames"].as_array().into_iter().flatten();
        let files = files.filter_map(|f| f.as_str()).map(str::to_owned).collect();
        artifacts.files.entry((package, target, kind, test)).or_default().insert(files);
    }
    artifacts
}

#[test]
fn the_quick_start_and_the_suite_share_one_build() {
    let suite = build(&["--workspace", "--bins", "--tests"]);
    let quick_start = build(&["-p", "intake-gateway", "-p", "intake-writer", "--bins"]);
    assert!(
        quick_start.compiled.is_empty(),
        "after the suite's build, the quick start's build compiled these again (other features \
         than in the suite's build: see workspace-hack/Cargo.toml): {:#?}",
        quick_start.compiled
    );
    let differing: Vec<_> = quick_start
        .files
        .iter()
        .filter(|(key, files)| suite.files.get(*key) != Some(*files))
        .map(|((package, target, _, _), _)| format!("{target} ({package})"))
        .collect();
    assert!(differing.is_empty(), "built twice, once for the quick start and once for the suite: {differing:#?}");
    let services: Vec<_> = quick_start.files.keys().filter(|(_, _, kind, _)| kind.contains("bin")).collect();
    assert_eq!(services.len(), 2, "the two services, built by both: {services:?}");
}

/// The programs the quick start and production run keep their symbol table: a panic's
/// backtrace and a profile name functions (Cargo.toml, `strip` of the release profile).
#[test]
fn the_service_binaries_keep_their_symbols() {
    for program in ["intake-gateway", "intake-writer"] {
        let path = std::path::PathBuf::from(intake_tests::env("INTAKE_BIN_DIR")).join(program);
        let sections = Command::new("readelf")
            .args(["--section-headers", "--wide"])
            .arg(&path)
            .output()
            .unwrap_or_else(|e| panic!("readelf: {e}"));
        let sections = String::from_utf8_lossy(&sections.stdout);
        assert!(sections.contains(" .symtab "), "{} has no symbol table:\n{sections}", path.display());
    }
}

/// The suite's build is its lint (docs/testing.md): cargo runs every compilation of the
/// workspace through `deploy/rustc-lint.sh`, which gives a test target to clippy-driver, with
/// clippy's findings as errors, and anything else to rustc itself. Checked with stand-ins for
/// both compilers, which print what they were given.
#[test]
fn test_targets_compile_through_clippy_and_the_programs_through_rustc() {
    let repo = intake_tests::repo();
    let config = std::fs::read_to_string(repo.join(".cargo/config.toml")).unwrap_or_else(|e| panic!("{e}"));
    let setting = |line: &str| config.lines().any(|l| l.trim() == line);
    assert!(setting(r#"rustc-workspace-wrapper = "deploy/rustc-lint.sh""#), ".cargo/config.toml:\n{config}");
    assert!(setting(r#"CLIPPY_ARGS = "-Dwarnings""#), ".cargo/config.toml:\n{config}");

    let dir = std::env::temp_dir().join(format!("intake-lint-{}", ulid::Ulid::new()));
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
    for (name, says) in [("clippy-driver", "clippy"), ("rustc", "rustc")] {
        let path = dir.join(name);
        std::fs::write(&path, format!("#!/bin/sh\necho {says} \"$@\"\n")).unwrap_or_else(|e| panic!("{e}"));
        let made = Command::new("chmod").arg("+x").arg(&path).status().unwrap_or_else(|e| panic!("{e}"));
        assert!(made.success());
    }
    let rustc = dir.join("rustc").display().to_string();
    let path = format!("{}:{}", dir.display(), std::env::var("PATH").unwrap_or_default());
    let compile = |args: &[&str]| {
        let output = Command::new(repo.join("deploy/rustc-lint.sh"))
            .arg(&rustc)
            .args(args)
            .env("PATH", &path)
            .output()
            .unwrap_or_else(|e| panic!("deploy/rustc-lint.sh: {e}"));
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        String::from_utf8_lossy(&output.stdout).trim().to_owned()
    };
    let test = compile(&["--crate-name", "intake_writer", "--test", "writer/src/lib.rs"]);
    let program = compile(&["--crate-name", "intake_writer", "--crate-type", "lib", "writer/src/lib.rs"]);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(test, format!("clippy {rustc} --crate-name intake_writer --test writer/src/lib.rs"));
    assert_eq!(program, "rustc --crate-name intake_writer --crate-type lib writer/src/lib.rs");
}
