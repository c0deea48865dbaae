//! The schema's migrations, embedded at build time (build.rs) and applied by sqlx's migrator:
//! each is recorded in `_sqlx_migrations` with its version and the SHA-384 of its text, as
//! sqlx's `migrate!` macro records them, so that a database migrated by either takes the other.
//!
//! A schema change that the previous version's binaries cannot run against comes in two steps
//! (deploy/RUNBOOK.md, "Schema migrations"): migrations that add what the new version uses
//! (expand), applied before the rollout, and a migration marked `-- contract:` that removes what
//! only the previous version used, applied once none of its binaries runs. `migrate` applies all
//! but the contract migrations not yet applied; `migrate --contract` applies those too.

use intake_common::config::KafkaArgs;
use intake_common::kafka;
use intake_common::kafka_errors::QuietContext;
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use sqlx::migrate::{Migrate as _, Migration, MigrationType, Migrator};
use sqlx::{Acquire, PgConnection, PgPool, Postgres};
use std::borrow::Cow;
use std::time::Duration;

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
/// `--contract`. Under sqlx's own advisory lock, taken here rather than by the migrator so
/// that the invalid indexes of a killed run are dropped while no other `migrate` (of this
/// build or another) can be building them.
pub async fn run(pool: &PgPool, stage: Stage, through: Option<i64>) -> anyhow::Result<Vec<i64>> {
    let mut connection = pool.acquire().await?;
    // A build whose client was killed (a deadline, a lost pod) goes on in its backend, holding
    // the lock, until it writes to the closed socket: unrecorded, then, and a retry would fail
    // on the index it left. Checked every few seconds instead (PostgreSQL 14 and later), the
    // build is cancelled and leaves an invalid index, which the next run drops.
    sqlx::query(
        "SELECT set_config('client_connection_check_interval', '5s', false)
          WHERE current_setting('server_version_num')::int >= 140000",
    )
    .execute(&mut *connection)
    .await?;
    connection.lock().await?;
    let outcome = run_locked(&mut connection, stage, through).await;
    let unlocked = connection.unlock().await;
    let waiting = outcome?;
    unlocked?;
    Ok(waiting)
}

/// The newest migration this build knows: the schema its statements are written for. A writer
/// of a build with a lower one predates every contract migration above it.
pub fn newest() -> i64 {
    MIGRATIONS.last().map_or(0, |&(version, _, _)| version)
}

/// The contract migrations `migrate --contract` would apply, none past `through`. None on a
/// database never migrated: no binary can have used what they remove.
async fn contracts_to_apply(pool: &PgPool, through: Option<i64>) -> Result<Vec<i64>, sqlx::Error> {
    let applied = applied(pool).await?;
    if applied.is_empty() {
        return Ok(Vec::new());
    }
    Ok(selected(Stage::Expand, &applied, through).1)
}

/// The Kafka client.id of this build's writers, which names the newest migration it knows.
pub fn writer_client_id() -> String {
    format!("intake-writer/{}/schema-{}", env!("CARGO_PKG_VERSION"), newest())
}

/// The newest migration a writer's client.id names; none for a build from before it named one.
fn schema_of(client_id: &str) -> Option<i64> {
    client_id.strip_prefix("intake-writer/")?.rsplit_once("/schema-")?.1.parse().ok()
}

/// How long the writers' group is asked for its members.
const GROUP_LIST_TIMEOUT: Duration = Duration::from_secs(10);

/// Refuses (an error naming them) while a member of the writers' consumer group `group` runs a
/// build older than a contract migration `--contract` would apply, none past `through`: it does
/// not know that migration, and the contract removes what it uses. A member whose client.id
/// names no migration is such a build too. Kafka not answering is a refusal as well: the check
/// is never skipped. A writer outside the group (stopped, restarting, waiting for its schema)
/// is not seen: one of a build older than an applied migration refuses to start
/// ([`drifted`]).
pub async fn refuse_older_writers(
    pool: &PgPool,
    kafka: &KafkaArgs,
    group: &str,
    through: Option<i64>,
) -> anyhow::Result<()> {
    let contracts = contracts_to_apply(pool, through).await?;
    let Some(&last) = contracts.iter().max() else { return Ok(()) };
    let members = tokio::task::block_in_place(|| group_members(kafka, group)).map_err(|error| {
        anyhow::anyhow!(
            "could not list the members of the writers' group {group:?} from Kafka ({error}); `migrate --contract` \
             applies {contracts:?} only once it knows that no writer older than them runs"
        )
    })?;
    let older: Vec<String> = members
        .into_iter()
        .filter(|(client_id, _)| schema_of(client_id).is_none_or(|schema| schema < last))
        .map(|(client_id, host)| format!("{client_id} on {host}"))
        .collect();
    anyhow::ensure!(
        older.is_empty(),
        "writers older than the contract migrations {contracts:?} are in the group {group:?}: {}. Their builds \
         use what these migrations remove; roll them out to this version first (deploy/RUNBOOK.md, \"Upgrades, one \
         instance at a time\")",
        older.join(", ")
    );
    Ok(())
}

/// The client.id and host of each member of `group`.
fn group_members(kafka: &KafkaArgs, group: &str) -> Result<Vec<(String, String)>, rdkafka::error::KafkaError> {
    let consumer: BaseConsumer<QuietContext> =
        kafka::reader(kafka, "intake-migrate").create_with_context(QuietContext::default())?;
    let groups = consumer.fetch_group_list(Some(group), GROUP_LIST_TIMEOUT)?;
    Ok(groups
        .groups()
        .iter()
        .filter(|g| g.name() == group)
        .flat_map(|g| g.members())
        .map(|m| (m.client_id().to_owned(), m.client_host().to_owned()))
        .collect())
}

async fn run_locked(connection: &mut PgConnection, stage: Stage, through: Option<i64>) -> anyhow::Result<Vec<i64>> {
    let applied = applied(&mut *connection).await?;
    let (migrations, waiting) = selected(stage, &applied, through);
    for &(version, description, sql) in &migrations {
        if sql.starts_with(NO_TRANSACTION) && !applied.contains(&version) {
            drop_invalid_indexes(&mut *connection, version, description, sql).await?;
        }
    }
    let mut migrator = migrator_of(&migrations);
    migrator.set_locking(false);
    migrator.run_direct(connection).await?;
    Ok(waiting)
}

/// A `CREATE INDEX CONCURRENTLY` that did not finish (killed, cancelled, failed) leaves its
/// index behind, invalid, and the migration unrecorded: run again, it would fail on the name.
/// A committed migration never changes (no `IF NOT EXISTS` can be added), so what it would
/// create and finds invalid is dropped before it runs. A valid index of its name is left: the
/// migration then fails on it, and that one is for an operator to look at.
async fn drop_invalid_indexes(
    connection: &mut PgConnection,
    version: i64,
    description: &str,
    sql: &str,
) -> Result<(), sqlx::Error> {
    for index in concurrently_created_indexes(sql) {
        let invalid: Option<String> = sqlx::query_scalar(
            "SELECT format('%I.%I', n.nspname, c.relname)
               FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid JOIN pg_namespace n ON n.oid = c.relnamespace
              WHERE c.relname = $1 AND NOT i.indisvalid AND pg_table_is_visible(c.oid)",
        )
        .bind(&index)
        .fetch_optional(&mut *connection)
        .await?;
        if let Some(invalid) = invalid {
            tracing::warn!(
                version,
                description,
                index = invalid,
                "dropping the invalid index an unfinished run of this migration left, before running it again"
            );
            sqlx::raw_sql(&format!("DROP INDEX CONCURRENTLY IF EXISTS {invalid}")).execute(&mut *connection).await?;
        }
    }
    Ok(())
}

/// The names of the indexes `sql` builds with `CREATE [UNIQUE] INDEX CONCURRENTLY [IF NOT
/// EXISTS] name`, outside comments, as PostgreSQL folds an unquoted name.
fn concurrently_created_indexes(sql: &str) -> Vec<String> {
    let code: Vec<&str> = sql
        .lines()
        .map(|line| line.split_once("--").map_or(line, |(code, _)| code))
        .flat_map(str::split_whitespace)
        .collect();
    let keyword = |i: usize, word: &str| code.get(i).is_some_and(|w| w.eq_ignore_ascii_case(word));
    let mut names = Vec::new();
    for start in (0..code.len()).filter(|&i| keyword(i, "CREATE")) {
        let mut at = start + 1;
        if keyword(at, "UNIQUE") {
            at += 1;
        }
        if !(keyword(at, "INDEX") && keyword(at + 1, "CONCURRENTLY")) {
            continue;
        }
        at += 2;
        if keyword(at, "IF") && keyword(at + 1, "NOT") && keyword(at + 2, "EXISTS") {
            at += 3;
        }
        if let Some(name) = code.get(at).filter(|name| !name.eq_ignore_ascii_case("ON")) {
            let name = name.split('(').next().unwrap_or_default();
            names.push(match name.strip_prefix('"').and_then(|n| n.strip_suffix('"')) {
                Some(quoted) => quoted.to_owned(),
                None => name.to_ascii_lowercase(),
            });
        }
    }
    names
}

/// The versions of this build's expand migrations, the schema its statements use, that the
/// database has not applied (all of them on a database never migrated).
pub async fn missing(pool: &PgPool) -> Result<Vec<i64>, sqlx::Error> {
    let applied = applied(pool).await?;
    let (expand, _) = selected(Stage::Expand, &applied, None);
    Ok(expand.into_iter().map(|(version, _, _)| version).filter(|version| !applied.contains(version)).collect())
}

/// Appended to a contract migration's description as `_sqlx_migrations` records it, so that a
/// build that does not know the migration can tell it from an expansion.
const CONTRACT_RECORDED: &str = " (contract)";

/// The applied migrations that this build's files do not match, each named with what differs:
/// a file changed after it was applied (sqlx's SHA-384 of it differs), or an applied version no
/// file of this build knows, unless a newer build recorded it as an expansion: the schema then
/// holds all this build uses, as during a rollout, and a writer rolled back to this build
/// before the contract runs on it. A writer refuses to start on any other: its schema is not
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
            None if version > newest() && !description.ends_with(CONTRACT_RECORDED) => None,
            None => Some(format!("{version} ({description}): applied, but this build has no such migration")),
            Some(m) if *m.checksum != *checksum => {
                Some(format!("{version} ({description}): its file changed after it was applied (checksum differs)"))
            }
            Some(_) => None,
        })
        .collect())
}

/// The versions the database has applied (none if it was never migrated).
async fn applied(connection: impl Acquire<'_, Database = Postgres>) -> Result<Vec<i64>, sqlx::Error> {
    let mut connection = connection.acquire().await?;
    let migrated: bool =
        sqlx::query_scalar("SELECT to_regclass('_sqlx_migrations') IS NOT NULL").fetch_one(&mut *connection).await?;
    if !migrated {
        return Ok(Vec::new());
    }
    sqlx::query_scalar("SELECT version FROM _sqlx_migrations WHERE success").fetch_all(&mut *connection).await
}

fn migrator_of(migrations: &[(i64, &'static str, &'static str)]) -> Migrator {
    let migrations: Vec<Migration> = migrations
        .iter()
        .map(|&(version, description, sql)| {
            Migration::new(
                version,
                if is_contract(sql) {
                    Cow::Owned(format!("{description}{CONTRACT_RECORDED}"))
                } else {
                    Cow::Borrowed(description)
                },
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
        let contract = migrator.iter().find(|m| m.version == 26).map(|m| m.description.to_string());
        assert_eq!(
            contract.as_deref(),
            Some("conversions drop unique by workspace id (contract)"),
            "marked for the builds that do not know it"
        );
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
    fn the_indexes_a_concurrent_migration_builds_are_read_from_its_statement_not_its_comments() {
        let built: Vec<(i64, Vec<String>)> = MIGRATIONS
            .iter()
            .filter(|m| m.2.starts_with(NO_TRANSACTION))
            .map(|&(version, _, sql)| (version, concurrently_created_indexes(sql)))
            .filter(|(_, names)| !names.is_empty())
            .collect();
        let versions: Vec<i64> = built.iter().map(|b| b.0).collect();
        assert_eq!(versions, [7, 10, 11, 12, 18, 20, 23, 24, 25, 28, 29, 30, 31, 37, 38], "{built:?}");
        let first = |version: i64| built.iter().find(|b| b.0 == version).map(|b| b.1.clone()).unwrap_or_default();
        assert_eq!(first(7), ["conversions_by_workspace_external_id_event"]);
        assert_eq!(first(23), ["workspaces_by_id_hash"], "the comment's DROP INDEX is no statement");
        assert_eq!(first(37), ["conversions_by_month_email_digest"]);
        assert!(built.iter().all(|b| b.1.len() == 1 && b.1[0].starts_with(['c', 'w'])), "{built:?}");

        let names = concurrently_created_indexes(
            "-- CREATE INDEX CONCURRENTLY in_a_comment ON t (a);\n\
             create unique index concurrently if not exists Folded on t (a);\n\
             CREATE INDEX CONCURRENTLY \"Quoted\"(a);\nCREATE INDEX plain ON t (a);\nCREATE INDEX CONCURRENTLY ON t (b);",
        );
        assert_eq!(names, ["folded", "Quoted"]);
    }

    #[test]
    fn a_writer_s_client_id_names_the_newest_migration_of_its_build() {
        assert_eq!(schema_of(&writer_client_id()), Some(newest()));
        assert_eq!(newest(), MIGRATIONS.len() as i64);
        assert_eq!(schema_of("intake-writer/0.1.0/schema-39"), Some(39));
        assert_eq!(schema_of("rdkafka"), None, "a build from before the client.id named it");
        assert_eq!(schema_of("intake-writer/0.1.0"), None);
        assert_eq!(schema_of("other/0.1.0/schema-99"), None);
    }

    #[test]
    fn only_a_leading_comment_marks_a_contract_migration() {
        assert!(is_contract("-- no-transaction\n-- contract: after the rollout\nDROP INDEX x;"));
        assert!(!is_contract("-- no-transaction\nDROP INDEX x;\n-- contract"));
        assert!(!is_contract("-- no-transaction\n-- contracts of the chains\nCREATE INDEX x;"));
    }
}
