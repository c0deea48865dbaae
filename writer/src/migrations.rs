//! The schema's migrations, embedded at build time (build.rs) and applied by sqlx's migrator:
//! each is recorded in `_sqlx_migrations` with its version and the SHA-384 of its text, as
//! sqlx's `migrate!` macro records them, so that a database migrated by either takes the other.

use sqlx::migrate::{Migration, MigrationType, Migrator};
use std::borrow::Cow;

include!(concat!(env!("OUT_DIR"), "/migrations.rs"));

/// sqlx's marker for a migration run outside a transaction (`CREATE INDEX CONCURRENTLY`).
const NO_TRANSACTION: &str = "-- no-transaction";

pub fn migrator() -> Migrator {
    let migrations: Vec<Migration> = MIGRATIONS
        .iter()
        .map(|&(version, description, sql)| {
            Migration::new(
                version,
                Cow::Borrowed(description),
                MigrationType::Simple,
                Cow::Borrowed(sql),
                sql.starts_with(NO_TRANSACTION),
            )
        })
        .collect();
    Migrator { migrations: Cow::Owned(migrations), ..Migrator::DEFAULT }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_migration_is_embedded_in_order_with_sqlx_s_descriptions() {
        let migrator = migrator();
        let versions: Vec<i64> = migrator.iter().map(|m| m.version).collect();
        let expected: Vec<i64> = (1..=i64::try_from(versions.len()).unwrap_or(0)).collect();
        assert_eq!(versions, expected, "numbered from 1 without a gap");
        let first = migrator.iter().next().unwrap_or_else(|| panic!("no migration"));
        assert_eq!(first.description, "spine");
        let concurrent: Vec<i64> = migrator.iter().filter(|m| m.no_tx).map(|m| m.version).collect();
        assert!(concurrent.contains(&18), "CREATE INDEX CONCURRENTLY runs outside a transaction: {concurrent:?}");
    }
}
