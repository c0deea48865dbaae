//! The multi-machine deployment files (`deploy/k8s`, `deploy/prometheus`, `deploy/systemd`)
//! through their own validators, the settings they name against the programs' flags, and
//! PostgreSQL's settings in each against the single node's.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn repo() -> PathBuf {
    intake_tests::repo()
}

#[test]
fn deployment_files_pass_their_validators() {
    // Installs kubernetes-validate, promtool and systemd-analyze on first use.
    let output = Command::new("bash")
        .arg(repo().join("deploy/validate.sh"))
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("running deploy/validate.sh: {e}"));
    let printed = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success(), "deploy/validate.sh failed:\n{printed}");
    for checked in [
        "Kubernetes manifests",
        "CloudNativePG resources",
        "Prometheus rules",
        "systemd units",
        "HAProxy configurations",
    ] {
        assert!(printed.contains(&format!("ok: {checked}")), "{checked} were not checked:\n{printed}");
    }
}

/// Runs `deploy/validate.sh crds` (the validation of custom resources against the vendored
/// CRDs) on `manifest`; its success and output.
fn validate_crds(name: &str, manifest: &str) -> (bool, String) {
    let file = std::env::temp_dir().join(format!("intake-crds-{name}-{}.yaml", std::process::id()));
    std::fs::write(&file, manifest).unwrap_or_else(|e| panic!("writing {}: {e}", file.display()));
    let output = Command::new("bash")
        .arg(repo().join("deploy/validate.sh"))
        .arg("crds")
        .arg(&file)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("running deploy/validate.sh crds: {e}"));
    let _ = std::fs::remove_file(&file);
    let printed = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    (output.status.success(), printed)
}

#[test]
fn custom_resources_are_validated_strictly_against_the_vendored_crds() {
    let manifest = std::fs::read_to_string(repo().join("deploy/k8s/15-database.yaml"))
        .unwrap_or_else(|e| panic!("reading deploy/k8s/15-database.yaml: {e}"));
    let (ok, printed) = validate_crds("database", &manifest);
    assert!(ok, "{printed}");
    for resource in ["Cluster intake-db", "ObjectStore intake-db-backups", "ScheduledBackup intake-db-nightly"] {
        let validated = printed.lines().any(|line| line.starts_with("valid: ") && line.contains(resource));
        assert!(validated, "{resource} was not validated:\n{printed}");
    }
    // A field the schema does not name, a value outside an enum, a wrong type: each refused.
    for (name, from, to) in [
        ("unknown-field", "      failoverQuorum: true", "      failoverQuorum: true\n      quorumFailover: true"),
        ("enum", "      dataDurability: required", "      dataDurability: always"),
        ("type", "  instances: 3", "  instances: three"),
        ("metadata", "  name: intake-db\n", "  name: intake-db\n  nmespace: intake\n"),
    ] {
        assert!(manifest.contains(from), "{name}: {from:?} is not in the manifest");
        let (ok, printed) = validate_crds(name, &manifest.replacen(from, to, 1));
        assert!(!ok, "{name}: a broken Cluster passed:\n{printed}");
    }
}

/// Words of `text` that look like a setting's environment variable.
fn variables(text: &str) -> BTreeSet<String> {
    text.split(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
        .filter(|word| (word.starts_with("INTAKE_") && word.len() > 7) || *word == "DATABASE_URL")
        .map(str::to_owned)
        .collect()
}

fn files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|path| path.is_file())
        .collect();
    files.sort();
    files
}

#[test]
fn deployment_files_set_only_settings_the_programs_have() {
    let bin = PathBuf::from(intake_tests::env("INTAKE_BIN_DIR"));
    let mut known = BTreeSet::new();
    for program in ["intake-gateway", "intake-writer"] {
        let output = Command::new(bin.join(program))
            .arg("--config-reference")
            .output()
            .unwrap_or_else(|e| panic!("{program}: {e}"));
        known.extend(variables(&String::from_utf8_lossy(&output.stdout)));
    }
    assert!(known.contains("INTAKE_REPLY_PARTITION") && known.contains("DATABASE_URL"), "{known:?}");
    for dir in ["deploy/k8s", "deploy/systemd", "deploy/prometheus"] {
        for file in files(&repo().join(dir)) {
            let text = std::fs::read_to_string(&file).unwrap_or_default();
            let unknown: Vec<String> = variables(&text).difference(&known).cloned().collect();
            assert!(unknown.is_empty(), "{} names settings no program has: {unknown:?}", file.display());
        }
    }
}

/// The `-c name=value` settings `deploy/lib.sh`'s `start_postgres` gives the single node.
fn single_node_settings() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(repo().join("deploy/lib.sh")).unwrap_or_else(|e| panic!("deploy/lib.sh: {e}"));
    let start = text.find("start_postgres() {").expect("deploy/lib.sh has start_postgres");
    let body = &text[start..start + text[start..].find("\n}\n").expect("start_postgres ends")];
    let words: Vec<&str> = body.split(|c: char| c.is_whitespace() || c == '"').collect();
    words
        .windows(2)
        .filter(|pair| pair[0] == "-c")
        .filter_map(|pair| pair[1].split_once('='))
        .filter(|(name, _)| *name != "listen_addresses")
        .map(|(name, value)| (name.to_string(), value.to_string()))
        .collect()
}

/// The `name: value` lines of the YAML block under the line `parameters:` in `file`, quotes
/// taken off (a flat block of scalars, as these files keep it).
fn yaml_parameters(file: &str) -> Vec<(String, String)> {
    let text = std::fs::read_to_string(repo().join(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
    let mut lines = text.lines().skip_while(|line| line.trim() != "parameters:");
    let indent = |line: &str| line.len() - line.trim_start().len();
    let block = indent(lines.next().unwrap_or_else(|| panic!("{file} has no parameters block")));
    lines
        .filter(|line| !line.trim().is_empty() && !line.trim_start().starts_with('#'))
        .take_while(|line| indent(line) > block)
        .filter_map(|line| line.trim().split_once(": "))
        .map(|(name, value)| (name.to_string(), value.trim_matches('"').to_string()))
        .collect()
}

#[test]
fn every_postgresql_of_the_deployments_runs_with_the_single_node_s_settings() {
    let single = single_node_settings();
    let names: Vec<&str> = single.iter().map(|(name, _)| name.as_str()).collect();
    for expected in ["shared_buffers", "max_wal_size", "checkpoint_timeout", "wal_init_zero", "max_connections"] {
        assert!(names.contains(&expected), "deploy/lib.sh's settings were not read: {single:?}");
    }
    // The Patroni layout takes shared_buffers from the single node's at start (patroni.yml).
    for (file, skipped) in [("deploy/ha/dcs.yml", Some("shared_buffers")), ("deploy/k8s/15-database.yaml", None)] {
        let parameters = yaml_parameters(file);
        for (name, value) in single.iter().filter(|(name, _)| Some(name.as_str()) != skipped) {
            let found = parameters.iter().find(|(other, _)| other == name).map(|(_, value)| value);
            assert_eq!(found, Some(value), "{file}: {name} differs from the single node's (deploy/lib.sh)");
        }
    }
}
