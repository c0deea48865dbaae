//! Where the database stands in the requests topic (docs/architecture.md, "The log is the
//! record"): for each partition, the offset below which every message was answered from it.
//!
//! The writer stores a partition's offset in Kafka only up to its lowest message not yet
//! answered, after the commits it covers were confirmed (`durability.rs`). The same offsets
//! are recorded here, every [`RECORD_EVERY`], in a small transaction of their own rather than in
//! each apply transaction: lanes commit out of offset order, so no apply transaction knows a
//! contiguous position, and a row updated by every apply would be held through every wait for
//! the standby, serialising the partition. The write-ahead log is one sequence, so a node (or a
//! restore) that has a version of the row has every commit it covers: a row is never ahead of
//! the data. A row behind costs a rewind that reads a little more again.

use sqlx::PgPool;
use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::Duration;

/// How often the offsets answered are recorded: what a rewind reads again at most, beside what
/// the database lost.
pub const RECORD_EVERY: Duration = Duration::from_millis(500);

/// The offsets answered since the last recording, for the generation of the assignment (and of
/// the database's lineage) they were answered in.
pub struct Positions {
    topic: String,
    answered: Mutex<Answered>,
}

#[derive(Default)]
struct Answered {
    generation: u64,
    /// Next offset to read, per partition, not yet recorded.
    unrecorded: BTreeMap<i32, i64>,
    /// Next offset to read, per partition, as far as this writer answered it.
    furthest: HashMap<i32, i64>,
    /// What this writer recorded last, per partition, in this generation.
    recorded: HashMap<i32, i64>,
}

impl Positions {
    pub fn new(topic: String) -> Self {
        Positions { topic, answered: Mutex::default() }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Answered> {
        self.answered.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The messages of each partition below its offset were answered in `generation`.
    pub fn answered(&self, generation: u64, offsets: &[(i32, i64)]) {
        let mut answered = self.lock();
        if answered.generation != generation {
            // What was answered before a rebalance or a rewind is no position of the database
            // the writer now applies to.
            answered.generation = generation;
            answered.unrecorded.clear();
            answered.recorded.clear();
        }
        for &(partition, next) in offsets {
            let furthest = answered.furthest.entry(partition).or_insert(next);
            *furthest = (*furthest).max(next);
            let unrecorded = answered.unrecorded.entry(partition).or_insert(next);
            *unrecorded = (*unrecorded).max(next);
        }
    }

    /// How far this writer answered the partition, in any generation: what was answered once is
    /// not answered again by a rewind.
    pub fn furthest_answered(&self, partition: i32) -> Option<i64> {
        self.lock().furthest.get(&partition).copied()
    }

    /// Records the offsets answered since the last time, unless the generation moved on
    /// meanwhile (`current` is read once the connection is at hand: a connection that found a
    /// new primary has moved it on, and nothing answered before is its position). Returns the
    /// partitions whose position the database had lost since this writer recorded it: a
    /// database restored in place, which no change of lineage gives away.
    pub async fn record(&self, pool: &PgPool, current: impl Fn() -> u64) -> Result<Vec<i32>, sqlx::Error> {
        let (generation, offsets) = {
            let mut answered = self.lock();
            (answered.generation, std::mem::take(&mut answered.unrecorded))
        };
        if offsets.is_empty() {
            return Ok(Vec::new());
        }
        let mut connection = pool.acquire().await?;
        if current() != generation {
            return Ok(Vec::new());
        }
        let (partitions, next): (Vec<i32>, Vec<i64>) = offsets.into_iter().unzip();
        let mut tx = sqlx::Connection::begin(&mut *connection).await?;
        // Waited for on no disk and no standby: its commit record follows those of the commits
        // it covers in the WAL whenever it is flushed, and a position lost in a crash is only
        // read again. A flush of its own every half second made the writes' commits wait behind it
        // (single_200rps p99 18.5 → 24.7 ms in deploy/bench.sh's A/B).
        sqlx::query("SET LOCAL synchronous_commit = off").execute(&mut *tx).await?;
        // The positions as they were, read under the rows' locks. One behind what this writer
        // recorded before means the database lost commits: nothing is recorded then, since a
        // position past them would hide them from the rewind.
        let before: HashMap<i32, i64> = sqlx::query_as::<_, (i32, i64)>(
            "SELECT partition, next_offset FROM log_positions
              WHERE topic = $1 AND partition = ANY($2) FOR UPDATE",
        )
        .bind(&self.topic)
        .bind(&partitions)
        .fetch_all(&mut *tx)
        .await?
        .into_iter()
        .collect();
        let behind: Vec<i32> = {
            let answered = self.lock();
            let went_back = |partition: &i32| {
                answered
                    .recorded
                    .get(partition)
                    .is_some_and(|&mine| before.get(partition).is_none_or(|&theirs| theirs < mine))
            };
            partitions.iter().copied().filter(went_back).collect()
        };
        if !behind.is_empty() {
            tx.rollback().await?;
            return Ok(behind);
        }
        sqlx::query(
            "INSERT INTO log_positions (topic, partition, next_offset)
             SELECT $1, p, n FROM unnest($2::int4[], $3::int8[]) AS a(p, n)
             ON CONFLICT (topic, partition) DO UPDATE
                SET next_offset = greatest(log_positions.next_offset, excluded.next_offset), recorded_at = now()",
        )
        .bind(&self.topic)
        .bind(&partitions)
        .bind(&next)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        let mut answered = self.lock();
        if answered.generation == generation {
            answered.recorded.extend(partitions.iter().copied().zip(next.iter().copied()));
        }
        Ok(Vec::new())
    }

    /// Records what was answered every [`RECORD_EVERY`], for as long as the writer runs;
    /// `behind` is told of a database found behind what this writer recorded.
    pub async fn run(self: std::sync::Arc<Self>, pool: PgPool, current: impl Fn() -> u64, behind: impl Fn(&[i32])) {
        loop {
            tokio::time::sleep(RECORD_EVERY).await;
            match self.record(&pool, &current).await {
                Ok(partitions) if !partitions.is_empty() => behind(&partitions),
                Ok(_) => {}
                Err(error) => {
                    tracing::debug!(%error, "positions not recorded; a rewind would read a little more again")
                }
            }
        }
    }
}

/// Records `offsets` as the positions of partitions the database has none of (a database from
/// before positions were kept, or a partition it never applied), committed like a chunk (it
/// waits for a synchronous standby), so that a standby promoted later has a position to rewind
/// to.
pub async fn seed(pool: &PgPool, topic: &str, offsets: &[(i32, i64)]) -> Result<(), sqlx::Error> {
    let (partitions, next): (Vec<i32>, Vec<i64>) = offsets.iter().copied().unzip();
    sqlx::query(
        "INSERT INTO log_positions (topic, partition, next_offset)
         SELECT $1, p, n FROM unnest($2::int4[], $3::int8[]) AS a(p, n) ON CONFLICT DO NOTHING",
    )
    .bind(topic)
    .bind(&partitions)
    .bind(&next)
    .execute(pool)
    .await?;
    Ok(())
}

/// Sets a partition's position to `next`, also below the one recorded: for a position of
/// another log (`rewind::start`), which no later recording would otherwise bring down.
pub async fn replace(pool: &PgPool, topic: &str, partition: i32, next: i64) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO log_positions (topic, partition, next_offset) VALUES ($1, $2, $3)
         ON CONFLICT (topic, partition) DO UPDATE SET next_offset = excluded.next_offset, recorded_at = now()",
    )
    .bind(topic)
    .bind(partition)
    .bind(next)
    .execute(pool)
    .await?;
    Ok(())
}

/// The database's positions of these partitions of `topic`; a partition it has none of is
/// missing (a topic it never applied, or a database from before positions were kept).
pub async fn load(pool: &PgPool, topic: &str, partitions: &[i32]) -> Result<HashMap<i32, i64>, sqlx::Error> {
    let rows: Vec<(i32, i64)> =
        sqlx::query_as("SELECT partition, next_offset FROM log_positions WHERE topic = $1 AND partition = ANY($2)")
            .bind(topic)
            .bind(partitions)
            .fetch_all(pool)
            .await?;
    Ok(rows.into_iter().collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_was_answered_before_a_new_generation_is_not_recorded_but_still_counts_as_answered() {
        let positions = Positions::new("t".into());
        positions.answered(1, &[(0, 10), (1, 4)]);
        positions.answered(1, &[(0, 12)]);
        assert_eq!(positions.lock().unrecorded, BTreeMap::from([(0, 12), (1, 4)]));
        positions.answered(2, &[(0, 3)]);
        assert_eq!(positions.lock().unrecorded, BTreeMap::from([(0, 3)]), "a rewind starts afresh");
        assert_eq!(positions.furthest_answered(0), Some(12), "not answered twice");
        assert_eq!(positions.furthest_answered(1), Some(4));
        assert_eq!(positions.furthest_answered(2), None);
    }
}
