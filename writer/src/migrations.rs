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

/// The applied migrations that this build's files do not match, each named with what differs:
/// a file changed after it was applied (sqlx's SHA-384 of it differs), or an applied version no
/// file of this build knows. A writer refuses to start on such a database: its schema is not
/// the one the files describe (deploy/RUNBOOK.md, "Schema migrations").
pub async fn drifted(pool: &PgPool) -> Result<Vec<String>, sqlx::Error> {
    let migrated: bool =
        sqlx::query_scalar("SELECT to_regclass('_sqlx_migrations') IS NOT NULL").fetch_one(pool).await?;
    if !migrated {
        return Ok(Vec::new());
    }
    let applied: Vec<(i64, String, Vec<u8>)> =
        sqlx::query_as("SELECT version, description, checksum FROM _sqlx_migrations WHERE success ORDER BY version")
            .fetch_all(pool)
            .await?;
    let ours = migrator_of(MIGRATIONS);
    Ok(applied
        .into_iter()
        .filter_map(|(version, description, checksum)| match ours.iter().find(|m| m.version == version) {
            None => Some(format!("{version} ({description}): applied, but this build has no such migration")),
            Some(m) if *m.checksum != *checksum => {
                Some(format!("{version} ({description}): its file changed after it was applied (checksum differs)"))
            }
            Some(_) => None,
        })
        .collect())
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
    fn no_migration_differs_from_the_committed_manifest() {
        let manifest = include_str!("../../migrations/manifest.txt");
        let listed: Vec<(i64, &str)> = manifest
            .lines()
            .filter(|line| !line.starts_with('#') && !line.trim().is_empty())
            .map(|line| {
                let mut words = line.split_whitespace();
                let version = words.next().and_then(|v| v.parse().ok()).unwrap_or(-1);
                (version, words.next().unwrap_or_default())
            })
            .collect();
        let ours: Vec<(i64, String)> = migrator_of(MIGRATIONS)
            .iter()
            .map(|m| (m.version, m.checksum.iter().map(|b| format!("{b:02x}")).collect()))
            .collect();
        for (version, checksum) in &ours {
            let line = listed.iter().find(|(v, _)| v == version);
            assert!(line.is_some(), "migration {version} is not in migrations/manifest.txt: add its line");
            assert_eq!(
                line.map(|(_, c)| *c),
                Some(checksum.as_str()),
                "migration {version} changed after it was committed: revert it, and make the change a new migration"
            );
        }
        assert_eq!(listed.len(), ours.len(), "the manifest lists a migration that no file holds");
    }

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
        let expected: Vec<i64> = (1..=last).filter(|v| ![40, 41, 42].contains(v)).collect();
        assert_eq!(versions(&run), expected, "the digests' bytes beside their hex");
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
