//! The schema's migrations, embedded at build time (build.rs) and applied by sqlx's migrator:
//! each is recorded in `_sqlx_migrations` with its version and the SHA-384 of its text, as
//! sqlx's `migrate!` macro records them, so that a database migrated by either takes the other.
//!
//! A schema change that the previous version's binaries cannot run against comes in two steps
//! (deploy/RUNBOOK.md, "Schema migrations"): migrations that add what the new version uses
//! (expand), applied before the rollout, and a migration marked `-- contract:` that removes what
//! only the previous version used, applied once none of its binaries runs. `migrate` applies all
//! but the contract migrations not yet applied; `migrate --contract` applies those too.

use sqlx::migrate::{Migration, MigrationType, Migrator};
use sqlx::PgPool;
use std::borrow::Cow;

include!(concat!(env!("OUT_DIR"), "/migrations.rs"));

/// sqlx's marker for a migration run outside a transaction (`CREATE INDEX CONCURRENTLY`).
const NO_TRANSACTION: &str = "-- no-transaction";

/// Ours, on a line of a migration's leading comment: it removes what the previous version's
/// binaries use.
const CONTRACT: &str = "-- contract:";

/// How far `migrate` goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// All but the contract migrations not yet applied: safe while the previous version runs.
    Expand,
    /// Every migration.
    Contract,
}

fn is_contract(sql: &str) -> bool {
    sql.lines().take_while(|line| line.starts_with("--")).any(|line| line.starts_with(CONTRACT))
}

/// The migrations that `stage` applies to a database that has `applied`, none past `through`,
/// and the versions that wait for `--contract`. The expand stage applies every migration but the
/// contract ones not yet applied, those of later versions included: a database several versions
/// behind then takes every version's additions at once, and the binaries of the version it ran
/// keep what they use until the contract, so no rollout has to stop at each version between.
/// An expand migration therefore never relies on an earlier contract having run.
fn selected(stage: Stage, applied: &[i64], through: Option<i64>) -> (Vec<(i64, &'static str, &'static str)>, Vec<i64>) {
    let migrations = &MIGRATIONS[..MIGRATIONS.partition_point(|&(version, _, _)| through.is_none_or(|t| version <= t))];
    let held = |&(version, _, sql): &(i64, &str, &str)| {
        stage == Stage::Expand && is_contract(sql) && !applied.contains(&version)
    };
    let run = migrations.iter().filter(|m| !held(m)).copied().collect();
    let waiting = migrations.iter().filter(|m| held(m)).map(|&(version, _, _)| version).collect();
    (run, waiting)
}

/// Applies `stage`'s migrations, none past `through`; returns the versions that wait for
/// `--contract`.
pub async fn run(pool: &PgPool, stage: Stage, through: Option<i64>) -> anyhow::Result<Vec<i64>> {
    let applied = match stage {
        Stage::Expand => applied(pool).await?,
        Stage::Contract => Vec::new(),
    };
    let (migrations, waiting) = selected(stage, &applied, through);
    migrator_of(&migrations).run(pool).await?;
    Ok(waiting)
}

/// The versions of this build's expand migrations, the schema its statements use, that the
/// database has not applied (all of them on a database never migrated).
pub async fn missing(pool: &PgPool) -> Result<Vec<i64>, sqlx::Error> {
    let applied = applied(pool).await?;
    let (expand, _) = selected(Stage::Expand, &applied, None);
    Ok(expand.into_iter().map(|(version, _, _)| version).filter(|version| !applied.contains(version)).collect())
}

/// The versions the database has applied (none if it was never migrated).
async fn applied(pool: &PgPool) -> Result<Vec<i64>, sqlx::Error> {
    let migrated: bool =
        sqlx::query_scalar("SELECT to_regclass('_sqlx_migrations') IS NOT NULL").fetch_one(pool).await?;
    if !migrated {
        return Ok(Vec::new());
    }
    sqlx::query_scalar("SELECT version FROM _sqlx_migrations WHERE success").fetch_all(pool).await
}

fn migrator_of(migrations: &[(i64, &'static str, &'static str)]) -> Migrator {
    let migrations: Vec<Migration> = migrations
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
        let migrator = migrator_of(MIGRATIONS);
        let versions: Vec<i64> = migrator.iter().map(|m| m.version).collect();
        let expected: Vec<i64> = (1..=i64::try_from(versions.len()).unwrap_or(0)).collect();
        assert_eq!(versions, expected, "numbered from 1 without a gap");
        let first = migrator.iter().next().unwrap_or_else(|| panic!("no migration"));
        assert_eq!(first.description, "spine");
        let concurrent: Vec<i64> = migrator.iter().filter(|m| m.no_tx).map(|m| m.version).collect();
        assert!(concurrent.contains(&18), "CREATE INDEX CONCURRENTLY runs outside a transaction: {concurrent:?}");
    }

    #[test]
    fn migrate_holds_back_the_contract_migrations_not_applied() {
        let contracts: Vec<i64> = MIGRATIONS.iter().filter(|m| is_contract(m.2)).map(|m| m.0).collect();
        assert_eq!(
            contracts,
            [26, 27, 32, 33, 34, 35, 40, 41, 42],
            "the drops of the keys on the workspace id and of the identifier hashes, and the end of the hex digests"
        );
        let versions = |m: &[(i64, &str, &str)]| m.iter().map(|m| m.0).collect::<Vec<_>>();
        let last = MIGRATIONS.len() as i64;

        let expand_only: Vec<i64> = (1..=last).filter(|v| !contracts.contains(v)).collect();
        let (run, waiting) = selected(Stage::Expand, &[], None);
        assert_eq!(versions(&run), expand_only, "a new database, expand only: every version's additions");
        assert_eq!(waiting, contracts);

        let applied: Vec<i64> = (1..=5).collect();
        let (run, waiting) = selected(Stage::Expand, &applied, None);
        assert_eq!(versions(&run), expand_only, "several versions behind: the additions of each at once");
        assert_eq!(waiting, contracts);

        let (run, waiting) = selected(Stage::Contract, &[], None);
        assert_eq!(versions(&run).len(), MIGRATIONS.len());
        assert!(waiting.is_empty());

        let applied: Vec<i64> = (1..=27).collect();
        let (run, waiting) = selected(Stage::Expand, &applied, None);
        let expected: Vec<i64> = (1..=last).filter(|v| ![32, 33, 34, 35, 40, 41, 42].contains(v)).collect();
        assert_eq!(versions(&run), expected, "the month-led indexes beside the old ones, the digests' bytes too");
        assert_eq!(waiting, [32, 33, 34, 35, 40, 41, 42]);

        let applied: Vec<i64> = (1..=35).collect();
        let (run, waiting) = selected(Stage::Expand, &applied, None);
        assert_eq!(versions(&run), (1..=39).collect::<Vec<_>>(), "the digests' bytes beside their hex");
        assert_eq!(waiting, [40, 41, 42]);

        let applied: Vec<i64> = (1..=last).collect();
        let (run, waiting) = selected(Stage::Expand, &applied, None);
        assert_eq!(versions(&run).len(), MIGRATIONS.len(), "contracted already: nothing held back");
        assert!(waiting.is_empty());
    }

    #[test]
    fn through_brings_a_database_to_an_earlier_version() {
        let versions = |m: &[(i64, &str, &str)]| m.iter().map(|m| m.0).collect::<Vec<_>>();
        let (run, waiting) = selected(Stage::Contract, &[], Some(35));
        assert_eq!(versions(&run), (1..=35).collect::<Vec<_>>());
        assert!(waiting.is_empty(), "nothing past 35 is reported as waiting: {waiting:?}");

        let applied: Vec<i64> = (1..=35).collect();
        let (run, waiting) = selected(Stage::Expand, &applied, Some(36));
        assert_eq!(versions(&run), (1..=36).collect::<Vec<_>>(), "one step of a staged rollout");
        assert!(waiting.is_empty());
    }

    #[test]
    fn only_a_leading_comment_marks_a_contract_migration() {
        assert!(is_contract("-- no-transaction\n-- contract: after the rollout\nDROP INDEX x;"));
        assert!(!is_contract("-- no-transaction\nDROP INDEX x;\n-- contract"));
        assert!(!is_contract("-- no-transaction\n-- contracts of the chains\nCREATE INDEX x;"));
    }
}
