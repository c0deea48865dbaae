//! The statements that look a person's rows up by identifier: matching's and erasure's; and
//! the look-up of the rows a chunk relates to. Each is
//! a union of lookups that one index answers (migrations 0001, 0003, 0018, 0024, 0025, 0030,
//! 0031, 0037 and 0038), not one condition ORed across columns, which the planner may answer by
//! scanning the whole workspace. Email and phone digests are stored as their 32 bytes and
//! indexed by their first 8 (`digest_key`, migrations 0036 to 0038), visitor ids and contact ids by an
//! 8-byte hash of the value (`hashtextextended`; a contact id's seeded with its workspace's, as
//! contact ids repeat across workspaces): a third of an index of the value itself; each row found
//! is checked against the value and the workspace. The writer speaks hex, as the messages do:
//! the statements decode and encode the digests. Those indexes lead with
//! the month the row was created in, so that a new row's entry goes among the few pages of this
//! month's: a look-up probes each month from the index's first to its last. Kept apart and free
//! of dependencies so that `tests/tests/indexed_lookups.rs` EXPLAINs the very text the writer
//! runs, on tables of realistic size.

/// The month of creation that leads the identifiers' indexes (migrations 0030, 0031, 0037, 0038).
macro_rules! created_month {
    () => {
        "date_trunc('month', created_at AT TIME ZONE 'UTC')"
    };
}

/// A digest of `$kind` (email, phone, address) as bytes: rows written before migration 0036
/// keep theirs as hex, later ones as bytes (see the migration). The look-up indexes (0037,
/// 0038) are on this expression.
macro_rules! digest {
    ($kind:literal) => {
        concat!("coalesce(", $kind, "_digest, decode(", $kind, "_sha256, 'hex'))")
    };
}

/// A digest of `$kind` as hex, as the messages carry it.
macro_rules! digest_hex {
    ($kind:literal) => {
        concat!("coalesce(encode(", $kind, "_digest, 'hex'), ", $kind, "_sha256)")
    };
}

/// `created_month = ANY(every month of the index of the rows where $present holds)`: from its
/// first entry's month to its last's, each read at one end of the index.
macro_rules! in_created_months {
    ($present:expr) => {
        concat!(
            created_month!(),
            " = ANY(ARRAY(SELECT generate_series((SELECT min(",
            created_month!(),
            ") FROM conversions WHERE ",
            $present,
            "), (SELECT max(",
            created_month!(),
            ") FROM conversions WHERE ",
            $present,
            "), interval '1 month')))"
        )
    };
}

/// What the person look-ups return of each conversion: its id and the identifiers it carries
/// (visitor id: its 16 characters; digests as hex).
macro_rules! person_columns {
    () => {
        concat!(
            "id, left(visitor_id, 16) AS visitor_id, click_id, contact_id, ",
            digest_hex!("email"),
            " AS email_sha256, ",
            digest_hex!("phone"),
            " AS phone_sha256"
        )
    };
}

/// The conversions of workspace `$1` whose `$kind` digest is one of `$digests` (hex).
macro_rules! people_by_digests {
    ($kind:literal, $digests:literal) => {
        concat!(
            "SELECT ",
            person_columns!(),
            " FROM conversions WHERE workspace_id = $1 AND ",
            digest!($kind),
            " IS NOT NULL AND ",
            in_created_months!(concat!(digest!($kind), " IS NOT NULL")),
            " AND digest_key(",
            digest!($kind),
            ") = ANY(ARRAY(SELECT digest_key(decode(h, 'hex')) FROM unnest(",
            $digests,
            "::text[]) AS h)) AND ",
            digest!($kind),
            " = ANY(ARRAY(SELECT decode(h, 'hex') FROM unnest(",
            $digests,
            "::text[]) AS h))"
        )
    };
}

/// The conversions of workspace `$1` that carry the identifier `$2`, by its kind, with the
/// identifiers they carry (visitor id: its 16 characters).
pub const PERSON_BY_EMAIL: &str = people_by_digests!("email", "ARRAY[$2]");
pub const PERSON_BY_PHONE: &str = people_by_digests!("phone", "ARRAY[$2]");
pub const PERSON_BY_CONTACT: &str = concat!(
    "SELECT ",
    person_columns!(),
    "
       FROM conversions WHERE workspace_id = $1 AND contact_id IS NOT NULL AND ",
    in_created_months!("contact_id IS NOT NULL"),
    " AND hashtextextended(contact_id, hashtextextended(workspace_id, 0)) = hashtextextended($2, hashtextextended($1, 0))
      AND contact_id = $2"
);
pub const PERSON_BY_VISITOR: &str = concat!(
    "SELECT ",
    person_columns!(),
    "
       FROM conversions WHERE workspace_id = $1 AND visitor_id IS NOT NULL AND ",
    in_created_months!("visitor_id IS NOT NULL"),
    " AND hashtextextended(left(visitor_id, 16), 0) = hashtextextended(left($2, 16), 0)
      AND left(visitor_id, 16) = left($2, 16)"
);

/// One step out (docs/architecture.md, "Privacy"): the conversions of workspace `$1` that are `$2` or carry one of the
/// visitor ids `$3`, contact ids `$4`, email hashes `$5` or phone hashes `$6`.
pub const PERSON_ONE_STEP: &str = concat!(
    "
    SELECT ",
    person_columns!(),
    "
      FROM conversions WHERE workspace_id = $1 AND id = ANY($2)
    UNION
    SELECT ",
    person_columns!(),
    "
      FROM conversions WHERE workspace_id = $1 AND visitor_id IS NOT NULL AND ",
    in_created_months!("visitor_id IS NOT NULL"),
    "
       AND hashtextextended(left(visitor_id, 16), 0) = ANY(ARRAY(SELECT hashtextextended(v, 0) FROM unnest($3::text[]) AS v))
       AND left(visitor_id, 16) = ANY($3)
    UNION
    SELECT ",
    person_columns!(),
    "
      FROM conversions WHERE workspace_id = $1 AND contact_id IS NOT NULL AND ",
    in_created_months!("contact_id IS NOT NULL"),
    "
       AND hashtextextended(contact_id, hashtextextended(workspace_id, 0))
           = ANY(ARRAY(SELECT hashtextextended(c, hashtextextended($1, 0)) FROM unnest($4::text[]) AS c))
       AND contact_id = ANY($4)
    UNION
    ",
    people_by_digests!("email", "$5"),
    "
    UNION
    ",
    people_by_digests!("phone", "$6")
);

/// A tombstone's digest of `$value` (`kind:value`, SHA-256, hex), as `erase::digest` computes
/// it in the writer; `$label` is the kind's name in the digest. NULL when the value is.
macro_rules! tombstone_digest {
    ($label:literal, $value:expr) => {
        concat!("encode(sha256(convert_to('", $label, ":' || ", $value, ", 'UTF8')), 'hex')")
    };
}

/// The conversions of workspace `$1` last written before `$3` whose every identifier (visitor id,
/// contact id, email and phone digests; at least one) has its digest among `$2`: an erasure
/// applied again from its tombstone. The tombstone holds the identifiers of the person and of
/// the conversions one step out, so a conversion found is one the erasure cleared, or one that
/// carries the erased person's identifiers alone; one that also carries another identifier is
/// someone else's and stays. A scan of the workspace, with its person columns.
pub const PEOPLE_BY_TOMBSTONE: &str = concat!(
    "SELECT ",
    person_columns!(),
    " FROM conversions WHERE workspace_id = $1 AND updated_at < $3
        AND num_nonnulls(visitor_id, contact_id, ",
    digest_hex!("email"),
    ", ",
    digest_hex!("phone"),
    ") > 0
        AND (visitor_id IS NULL OR ",
    tombstone_digest!("visitor_id", "left(visitor_id, 16)"),
    " = ANY($2))
        AND (contact_id IS NULL OR ",
    tombstone_digest!("contact_id", "contact_id"),
    " = ANY($2))
        AND (",
    digest_hex!("email"),
    " IS NULL OR ",
    tombstone_digest!("email_sha256", digest_hex!("email")),
    " = ANY($2))
        AND (",
    digest_hex!("phone"),
    " IS NULL OR ",
    tombstone_digest!("phone_sha256", digest_hex!("phone")),
    " = ANY($2))"
);

/// The visitor ids (16 characters) and recipient ids of workspace `$1`'s visits whose digest is
/// one of `$2`: the visits of an erased person that no conversion of theirs names.
pub const VISIT_IDS_BY_TOMBSTONE: &str = concat!(
    "SELECT DISTINCT
            CASE WHEN ",
    tombstone_digest!("visitor_id", "left(visitor_id, 16)"),
    " = ANY($2) THEN left(visitor_id, 16) END,
            CASE WHEN ",
    tombstone_digest!("contact_id", "recipient_id"),
    " = ANY($2) THEN recipient_id END
       FROM visits WHERE workspace_id = $1 AND (",
    tombstone_digest!("visitor_id", "left(visitor_id, 16)"),
    " = ANY($2) OR ",
    tombstone_digest!("contact_id", "recipient_id"),
    " = ANY($2))"
);

/// The person's visits in workspace `$1`: by visitor id `$2`, click id `$3`, recipient id `$4`
/// (their contact ids), and those matched to their conversions `$5`. Their matches go with them
/// (ON DELETE CASCADE).
pub const DELETE_PERSON_VISITS: &str = "
    DELETE FROM visits WHERE id IN (
        SELECT id FROM visits WHERE workspace_id = $1 AND visitor_id IS NOT NULL AND visitor_id = ANY($2)
        UNION
        SELECT id FROM visits WHERE workspace_id = $1 AND click_id IS NOT NULL AND click_id = ANY($3)
        UNION
        SELECT id FROM visits WHERE workspace_id = $1 AND recipient_id IS NOT NULL AND recipient_id = ANY($4)
        UNION
        SELECT visit_id FROM conversion_matches WHERE conversion_id = ANY($5))";

pub const DELETE_PERSON_MATCHES: &str = "DELETE FROM conversion_matches WHERE conversion_id = ANY($1)";

pub const CLEAR_PERSON_CONVERSIONS: &str = "
    UPDATE conversions SET visitor_id = NULL, click_id = NULL, contact_id = NULL, email_digest = NULL,
           phone_digest = NULL, address_digest = NULL, email_sha256 = NULL, phone_sha256 = NULL,
           address_sha256 = NULL, hdyhau = NULL, updated_at = now()
     WHERE id = ANY($1)";

/// Matches the conversions `$2` (with their visitor ids `$3`, click ids `$4`, contact ids `$5`
/// and occurred_at `$6`, epoch ms) of workspace `$1` to the workspace's visits at or before
/// `occurred_at` and within 90 days of it (docs/architecture.md, "Privacy"): three lookups, one per index of `visits`.
/// The 90 days are written as 2160 hours: timestamptz arithmetic counts a day in the session's
/// time zone, 23 or 25 hours across a daylight-saving change.
pub const MATCH_VISITS: &str = "
    WITH c AS MATERIALIZED (
        SELECT id, left(visitor_id, 16) AS visitor_id, click_id, contact_id,
               'epoch'::timestamptz + occurred_at_ms * interval '1 millisecond' AS occurred_at
          FROM unnest($2::text[], $3::text[], $4::text[], $5::text[], $6::int8[])
            AS u(id, visitor_id, click_id, contact_id, occurred_at_ms))
    INSERT INTO conversion_matches (conversion_id, visit_id, matched_by)
    SELECT c.id, v.id, 'visitor_id' FROM c
      JOIN visits v ON v.workspace_id = $1 AND v.visitor_id IS NOT NULL AND v.visitor_id = c.visitor_id
                   AND v.visited_at <= c.occurred_at AND v.visited_at >= c.occurred_at - interval '2160 hours'
    UNION ALL
    SELECT c.id, v.id, 'click_id' FROM c
      JOIN visits v ON v.workspace_id = $1 AND v.click_id IS NOT NULL AND v.click_id = c.click_id
                   AND v.visited_at <= c.occurred_at AND v.visited_at >= c.occurred_at - interval '2160 hours'
    UNION ALL
    SELECT c.id, v.id, 'contact_id' FROM c
      JOIN visits v ON v.workspace_id = $1 AND v.recipient_id IS NOT NULL AND v.recipient_id = c.contact_id
                   AND v.visited_at <= c.occurred_at AND v.visited_at >= c.occurred_at - interval '2160 hours'
    ON CONFLICT DO NOTHING";

/// Moves the conversions of workspace `$1` from the chains `$2` to the chains `$3` (a merge).
/// Each chain is found by the index on the chain id alone (migration 0018): chain ids are unique
/// across workspaces; the workspace is checked in the row.
pub const MERGE_CHAINS: &str = "
    UPDATE conversions c SET chain_id = m.into_chain
      FROM unnest($2::text[], $3::text[]) AS m(from_chain, into_chain)
     WHERE c.workspace_id = $1 AND c.chain_id = m.from_chain";

/// The stored rows a chunk's items can touch or link to: those with one of the items' external
/// ids `$2`, and the children of the items `$3`; found by the two keys that lead with the
/// workspace id's hash (migrations 0024 and 0025), the workspace checked in the row (see
/// `plan::plan_chunk`). Each row also carries, as a JSON array of `[erased_at_ms, digests]`, the
/// workspace's erasures after `$4` (the oldest item's receipt, epoch ms; `erase::Tombstones`),
/// and when no row is related one row carries them alone, its columns null: one round trip for
/// both, both read after the workspace's lock is held.
pub const RELATED_CONVERSIONS: &str = concat!(
    "
    SELECT t.tombstones, r.*
      FROM (SELECT coalesce(jsonb_agg(jsonb_build_array((extract(epoch FROM erased_at) * 1000)::int8, digests)),
                            '[]'::jsonb) AS tombstones
              FROM erasure_tombstones
             WHERE workspace_id = $1 AND erased_at > 'epoch'::timestamptz + $4::int8 * interval '1 millisecond') AS t
      LEFT JOIN (
    SELECT id, event, external_id, chain_id, parent_external_id,
           (extract(epoch FROM occurred_at) * 1000)::int8 AS occurred_at_ms,
           visitor_id, click_id, contact_id, ",
    digest_hex!("email"),
    " AS email_sha256,
           ",
    digest_hex!("phone"),
    " AS phone_sha256, ",
    digest_hex!("address"),
    " AS address_sha256,
           country, value::text AS value, currency, hdyhau, tags
      FROM conversions
     WHERE ",
    intake_model::in_workspace!(),
    "
       AND (external_id = ANY($2) OR (parent_external_id IS NOT NULL AND parent_external_id = ANY($3)))
      ) AS r ON true"
);
