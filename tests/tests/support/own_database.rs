//! A database of a test's own, migrated by the writer under test, for tests that fill tables
//! with many rows or change their ranges: no other test sees it. Dropped when the test ends.

use intake_tests::env;
use sqlx::postgres::PgPoolOptions;
use std::process::{Command, Stdio};

/// A database of its own, dropped when the test ends (even when it fails).
pub struct OwnDatabase {
    admin_url: String,
    name: String,
    pub url: String,
}

impl OwnDatabase {
    pub async fn create(purpose: &str) -> OwnDatabase {
        let base = env("DATABASE_URL");
        let (server, _) = base.rsplit_once('/').unwrap_or_else(|| panic!("DATABASE_URL has no database"));
        let name = format!("intake_{purpose}_{}", ulid::Ulid::new().to_string().to_lowercase());
        let admin = PgPoolOptions::new().max_connections(1).connect(&base).await.unwrap_or_else(|e| panic!("{e}"));
        sqlx::query(&format!("CREATE DATABASE {name}")).execute(&admin).await.unwrap_or_else(|e| panic!("{e}"));
        let own = OwnDatabase { admin_url: base.clone(), url: format!("{server}/{name}"), name };
        let status = Command::new(std::path::Path::new(&env("INTAKE_BIN_DIR")).join("intake-writer"))
            .arg("migrate")
            .env("DATABASE_URL", &own.url)
            .stdout(Stdio::null())
            .status()
            .unwrap_or_else(|e| panic!("intake-writer migrate: {e}"));
        assert!(status.success(), "intake-writer migrate failed");
        own
    }
}

impl Drop for OwnDatabase {
    fn drop(&mut self) {
        let _ = Command::new("psql")
            .args([&self.admin_url, "-qc", &format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name)])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}
