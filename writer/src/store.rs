//! Applies chunks to PostgreSQL with a fixed number of statements per workspace, whatever the
//! number of chunks and items: lock and look up the message ids, fetch the related rows, then
//! (only where there is something to do) insert chains, relabel merged chains, upsert the
//! conversions, recompute their visit matches, and record the message ids. The messages a writer
//! has at hand share one transaction; the chunks of one workspace among them are planned as one
//! run of items, in order, so 16 single sends cost the statements of one.

use crate::erase::Tombstones;
use crate::lookups;
use crate::plan::{self, Fields, Plan, StoredConversion};
use intake_common::conversion::Conversion;
use intake_common::message::{ItemResult, WriteRequestV1};
use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::types::Json;
use sqlx::{Postgres, Row, Transaction};
use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

pub async fn connect(url: &str, pool_size: u32) -> Result<PgPool, sqlx::Error> {
    PgPoolOptions::new().max_connections(pool_size).acquire_timeout(Duration::from_secs(5)).connect(url).await
}

/// A pool that connects when first used, so that a writer can start while PostgreSQL is away.
pub fn connect_lazy(url: &str, pool_size: u32) -> Result<PgPool, sqlx::Error> {
    PgPoolOptions::new().max_connections(pool_size).acquire_timeout(Duration::from_secs(5)).connect_lazy(url)
}

pub struct Applied {
    pub results: Vec<ItemResult>,
    /// False when the message had been applied before and these are its first results.
    pub first_time: bool,
}

/// Applies the chunk, or returns the results it had when it was first applied.
pub async fn apply_chunk(pool: &PgPool, request: &WriteRequestV1) -> Result<Applied, sqlx::Error> {
    let mut applied = apply_chunks(pool, &[request]).await?;
    applied.pop().ok_or(sqlx::Error::RowNotFound)
}

/// Applies several chunks in order in one transaction: one commit (one WAL flush) for all the
/// messages a writer has at hand. If any fails, none is applied. Returns one outcome per
/// request, in order.
pub async fn apply_chunks(pool: &PgPool, requests: &[&WriteRequestV1]) -> Result<Vec<Applied>, sqlx::Error> {
    // Workspaces are independent; locking them in id order keeps two writers that briefly hold
    // the same messages (a rebalance) from deadlocking. Within one, requests keep their order.
    let mut workspaces: Vec<&str> = requests.iter().map(|r| r.workspace_id.as_str()).collect();
    workspaces.sort_unstable();
    workspaces.dedup();
    let mut tx = pool.begin().await?;
    let mut applied: Vec<Option<Applied>> = requests.iter().map(|_| None).collect();
    for workspace_id in workspaces {
        let positions: Vec<usize> = (0..requests.len()).filter(|&i| requests[i].workspace_id == workspace_id).collect();
        let own: Vec<&WriteRequestV1> = positions.iter().map(|&i| requests[i]).collect();
        for (position, outcome) in positions.into_iter().zip(apply_workspace(&mut tx, workspace_id, &own).await?) {
            applied[position] = Some(outcome);
        }
    }
    tx.commit().await?;
    applied.into_iter().map(|a| a.ok_or(sqlx::Error::RowNotFound)).collect()
}

/// A message id already applied and its results; both null when none of the ids is (the row of
/// the lock alone).
type LookedUp = (Option<String>, Option<Json<Vec<ItemResult>>>);

/// One workspace's requests, in order.
async fn apply_workspace(
    tx: &mut Transaction<'_, Postgres>,
    workspace_id: &str,
    requests: &[&WriteRequestV1],
) -> Result<Vec<Applied>, sqlx::Error> {
    // One workspace's chunks are applied one at a time, across writers and replays: the chain
    // rules read, then write, rows of the whole workspace. The look-up of the message ids reads
    // a snapshot from before the lock was granted; a message applied meanwhile by another
    // writer is still caught, by the primary key of applied_messages at the insert below.
    let ids: Vec<&str> = requests.iter().map(|r| r.correlation_id.as_str()).collect();
    let previous: Vec<LookedUp> = sqlx::query_as(
        "SELECT m.correlation_id, m.results
           FROM (SELECT pg_advisory_xact_lock(hashtextextended($1, 0))) AS locked
           LEFT JOIN applied_messages m ON m.correlation_id = ANY($2)",
    )
    .bind(workspace_id)
    .bind(&ids)
    .fetch_all(&mut **tx)
    .await?;
    let mut previous: HashMap<String, Vec<ItemResult>> =
        previous.into_iter().filter_map(|(id, results)| Some((id?, results?.0))).collect();

    let fresh: Vec<&WriteRequestV1> =
        requests.iter().copied().filter(|r| !previous.contains_key(&r.correlation_id)).collect();
    let mut fresh_results = HashMap::new();
    if !fresh.is_empty() {
        let sent: Vec<(&Conversion, i64)> =
            fresh.iter().flat_map(|r| r.items.iter().map(|c| (c, r.received_at_ms))).collect();
        // Items sent before an erasure that covers them are stored as it left the person's data.
        let tombstones = Tombstones::load(tx, workspace_id, fresh.iter().map(|r| r.received_at_ms)).await?;
        let cleared: Vec<Option<Conversion>> = sent.iter().map(|&(c, at)| tombstones.clear(c, at)).collect();
        let items: Vec<plan::Item<'_>> = sent
            .iter()
            .zip(&cleared)
            .map(|(&(conversion, received_at_ms), cleared)| plan::Item {
                conversion: cleared.as_ref().unwrap_or(conversion),
                received_at_ms,
            })
            .collect();
        let related = fetch_related(tx, workspace_id, &items).await?;
        let plan = plan::plan_chunk(&items, related);
        write_plan(tx, workspace_id, &plan).await?;
        match_visits(tx, workspace_id, &plan.writes).await?;
        let mut results = plan.results.into_iter();
        for request in &fresh {
            let own: Vec<ItemResult> = results.by_ref().take(request.items.len()).collect();
            fresh_results.insert(request.correlation_id.as_str(), own);
        }
        let texts: Vec<String> = fresh
            .iter()
            .map(|r| {
                serde_json::to_string(&fresh_results[r.correlation_id.as_str()]).unwrap_or_else(|_| "[]".to_owned())
            })
            .collect();
        sqlx::query(
            "INSERT INTO applied_messages (correlation_id, workspace_id, results)
             SELECT id, $1, results::jsonb FROM unnest($2::text[], $3::text[]) AS m(id, results)",
        )
        .bind(workspace_id)
        .bind(fresh.iter().map(|r| r.correlation_id.as_str()).collect::<Vec<_>>())
        .bind(&texts)
        .execute(&mut **tx)
        .await?;
    }
    Ok(requests
        .iter()
        .map(|r| match previous.remove(&r.correlation_id) {
            Some(results) => Applied { results, first_time: false },
            None => Applied {
                results: fresh_results.remove(r.correlation_id.as_str()).unwrap_or_default(),
                first_time: true,
            },
        })
        .collect())
}

/// Every stored row the chunk's items can touch or link to (see [`plan::plan_chunk`]).
async fn fetch_related(
    tx: &mut Transaction<'_, Postgres>,
    workspace_id: &str,
    items: &[plan::Item<'_>],
) -> Result<Vec<StoredConversion>, sqlx::Error> {
    let external_ids: Vec<&str> = items.iter().map(|item| item.conversion.external_id.as_str()).collect();
    let mut ids_and_parents = external_ids.clone();
    ids_and_parents
        .extend(items.iter().filter_map(|item| item.conversion.parent_external_id.as_ref().map(|p| p.as_str())));
    let rows = sqlx::query(
        "SELECT id, event, external_id, chain_id, parent_external_id,
                (extract(epoch FROM occurred_at) * 1000)::int8 AS occurred_at_ms,
                visitor_id, click_id, contact_id, email_sha256, phone_sha256, address_sha256,
                country, value::text AS value, currency, hdyhau, tags
           FROM conversions
          WHERE workspace_id = $1 AND (external_id = ANY($2) OR parent_external_id = ANY($3))",
    )
    .bind(workspace_id)
    .bind(&ids_and_parents)
    .bind(&external_ids)
    .fetch_all(&mut **tx)
    .await?;
    rows.iter()
        .map(|row| {
            Ok(StoredConversion {
                id: row.try_get("id")?,
                event: row.try_get("event")?,
                external_id: row.try_get("external_id")?,
                chain_id: row.try_get("chain_id")?,
                fields: Fields {
                    parent_external_id: row.try_get("parent_external_id")?,
                    occurred_at_ms: row.try_get("occurred_at_ms")?,
                    visitor_id: row.try_get("visitor_id")?,
                    click_id: row.try_get("click_id")?,
                    contact_id: row.try_get("contact_id")?,
                    email_sha256: row.try_get("email_sha256")?,
                    phone_sha256: row.try_get("phone_sha256")?,
                    address_sha256: row.try_get("address_sha256")?,
                    country: row.try_get("country")?,
                    value: row.try_get("value")?,
                    currency: row.try_get("currency")?,
                    hdyhau: row.try_get("hdyhau")?,
                    tags: row.try_get::<Option<Json<BTreeMap<String, String>>>, _>("tags")?.map(|Json(tags)| tags),
                },
            })
        })
        .collect()
}

async fn write_plan(tx: &mut Transaction<'_, Postgres>, workspace_id: &str, plan: &Plan) -> Result<(), sqlx::Error> {
    if !plan.new_chains.is_empty() {
        sqlx::query("INSERT INTO chains (id, workspace_id) SELECT id, $1 FROM unnest($2::text[]) AS new(id)")
            .bind(workspace_id)
            .bind(&plan.new_chains)
            .execute(&mut **tx)
            .await?;
    }
    if !plan.merges.is_empty() {
        let (from, into): (Vec<&str>, Vec<&str>) = plan.merges.iter().map(|(f, i)| (f.as_str(), i.as_str())).unzip();
        sqlx::query(
            "UPDATE conversions c SET chain_id = m.into_chain
               FROM unnest($2::text[], $3::text[]) AS m(from_chain, into_chain)
              WHERE c.workspace_id = $1 AND c.chain_id = m.from_chain",
        )
        .bind(workspace_id)
        .bind(&from)
        .bind(&into)
        .execute(&mut **tx)
        .await?;
        // Chains merged earlier into a chain merged now point straight at the survivor, so an old
        // chain id resolves in one step.
        sqlx::query(
            "UPDATE chains c SET merged_into = m.into_chain, merged_at = now()
               FROM unnest($1::text[], $2::text[]) AS m(from_chain, into_chain)
              WHERE c.id = m.from_chain OR c.merged_into = m.from_chain",
        )
        .bind(&from)
        .bind(&into)
        .execute(&mut **tx)
        .await?;
    }
    if !plan.writes.is_empty() {
        let rows: Vec<&StoredConversion> = plan.writes.iter().map(|write| &write.row).collect();
        upsert_conversions(tx, workspace_id, &rows).await?;
    }
    Ok(())
}

async fn upsert_conversions(
    tx: &mut Transaction<'_, Postgres>,
    workspace_id: &str,
    rows: &[&StoredConversion],
) -> Result<(), sqlx::Error> {
    fn column<'a, T>(rows: &[&'a StoredConversion], f: impl Fn(&'a StoredConversion) -> T) -> Vec<T> {
        rows.iter().map(|row| f(row)).collect()
    }
    let tags: Vec<Option<String>> = column(rows, |r| {
        r.fields.tags.as_ref().map(|tags| serde_json::to_string(tags).unwrap_or_else(|_| "{}".to_owned()))
    });
    sqlx::query(
        "INSERT INTO conversions (id, workspace_id, event, external_id, chain_id, parent_external_id, occurred_at,
                                  visitor_id, click_id, contact_id, email_sha256, phone_sha256, address_sha256,
                                  country, value, currency, hdyhau, tags)
         SELECT u.id, $1, u.event, u.external_id, u.chain_id, u.parent_external_id,
                'epoch'::timestamptz + u.occurred_at_ms * interval '1 millisecond',
                u.visitor_id, u.click_id, u.contact_id, u.email_sha256, u.phone_sha256, u.address_sha256,
                u.country, u.value::numeric, u.currency, u.hdyhau, u.tags::jsonb
           FROM unnest($2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::int8[], $8::text[], $9::text[],
                       $10::text[], $11::text[], $12::text[], $13::text[], $14::text[], $15::text[], $16::text[],
                       $17::text[], $18::text[])
             AS u(id, event, external_id, chain_id, parent_external_id, occurred_at_ms, visitor_id, click_id,
                  contact_id, email_sha256, phone_sha256, address_sha256, country, value, currency, hdyhau, tags)
         ON CONFLICT (workspace_id, event, external_id) DO UPDATE SET
                chain_id = excluded.chain_id, parent_external_id = excluded.parent_external_id,
                occurred_at = excluded.occurred_at, visitor_id = excluded.visitor_id, click_id = excluded.click_id,
                contact_id = excluded.contact_id, email_sha256 = excluded.email_sha256,
                phone_sha256 = excluded.phone_sha256, address_sha256 = excluded.address_sha256,
                country = excluded.country, value = excluded.value, currency = excluded.currency,
                hdyhau = excluded.hdyhau, tags = excluded.tags, updated_at = now()",
    )
    .bind(workspace_id)
    .bind(column(rows, |r| r.id.as_str()))
    .bind(column(rows, |r| r.event.as_str()))
    .bind(column(rows, |r| r.external_id.as_str()))
    .bind(column(rows, |r| r.chain_id.as_str()))
    .bind(column(rows, |r| r.fields.parent_external_id.as_deref()))
    .bind(column(rows, |r| r.fields.occurred_at_ms))
    .bind(column(rows, |r| r.fields.visitor_id.as_deref()))
    .bind(column(rows, |r| r.fields.click_id.as_deref()))
    .bind(column(rows, |r| r.fields.contact_id.as_deref()))
    .bind(column(rows, |r| r.fields.email_sha256.as_deref()))
    .bind(column(rows, |r| r.fields.phone_sha256.as_deref()))
    .bind(column(rows, |r| r.fields.address_sha256.as_deref()))
    .bind(column(rows, |r| r.fields.country.as_deref()))
    .bind(column(rows, |r| r.fields.value.as_deref()))
    .bind(column(rows, |r| r.fields.currency.as_deref()))
    .bind(column(rows, |r| r.fields.hdyhau.as_deref()))
    .bind(tags)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Matching window (DESIGN section 8): conversions older than this at receipt get no matches,
/// and visits older than this before a conversion do not match it.
const MATCH_WINDOW_MS: i64 = 90 * 24 * 60 * 60 * 1000;

/// Recomputes the visit matches of the written conversions: by the 16-character visitor id,
/// by click id, and by contact id against the visit's recipient id; visits at or before
/// `occurred_at` and within 90 days of it. Two statements per chunk; each lookup of the second
/// is answered by an index of `visits` (see [`lookups::MATCH_VISITS`]).
async fn match_visits(
    tx: &mut Transaction<'_, Postgres>,
    workspace_id: &str,
    writes: &[plan::Write],
) -> Result<(), sqlx::Error> {
    // Only rows whose matching inputs changed: a new value or tag keeps the matches it has.
    let writes: Vec<&plan::Write> = writes.iter().filter(|w| w.rematch).collect();
    if writes.is_empty() {
        return Ok(());
    }
    let ids: Vec<&str> = writes.iter().map(|w| w.row.id.as_str()).collect();
    sqlx::query("DELETE FROM conversion_matches WHERE conversion_id = ANY($1)").bind(&ids).execute(&mut **tx).await?;
    let matchable: Vec<&StoredConversion> = writes
        .iter()
        .filter(|w| w.row.fields.occurred_at_ms >= w.received_at_ms - MATCH_WINDOW_MS)
        .map(|w| &w.row)
        .filter(|r| r.fields.visitor_id.is_some() || r.fields.click_id.is_some() || r.fields.contact_id.is_some())
        .collect();
    if matchable.is_empty() {
        return Ok(());
    }
    sqlx::query(lookups::MATCH_VISITS)
        .bind(workspace_id)
        .bind(matchable.iter().map(|r| r.id.as_str()).collect::<Vec<_>>())
        .bind(matchable.iter().map(|r| r.fields.visitor_id.as_deref()).collect::<Vec<_>>())
        .bind(matchable.iter().map(|r| r.fields.click_id.as_deref()).collect::<Vec<_>>())
        .bind(matchable.iter().map(|r| r.fields.contact_id.as_deref()).collect::<Vec<_>>())
        .bind(matchable.iter().map(|r| r.fields.occurred_at_ms).collect::<Vec<_>>())
        .execute(&mut **tx)
        .await?;
    Ok(())
}
