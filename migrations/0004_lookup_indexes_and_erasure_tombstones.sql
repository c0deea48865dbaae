-- Erasure looks a person up by hash, contact id and visitor id prefix within a workspace; without
-- these it scans the workspace's conversions while it holds the workspace's write lock. Partial:
-- most conversions carry few of the identifiers, and absent ones cost no index entry on write.
CREATE INDEX conversions_by_email ON conversions (workspace_id, email_sha256) WHERE email_sha256 IS NOT NULL;
CREATE INDEX conversions_by_phone ON conversions (workspace_id, phone_sha256) WHERE phone_sha256 IS NOT NULL;
CREATE INDEX conversions_by_contact ON conversions (workspace_id, contact_id) WHERE contact_id IS NOT NULL;
CREATE INDEX conversions_by_visitor ON conversions (workspace_id, left(visitor_id, 16)) WHERE visitor_id IS NOT NULL;

-- What an erasure erased, for the writes sent before it began and applied after it (they were
-- in Kafka, or come back by a replay or a dead-letter redrive): the writer clears the identifiers
-- of such an item when it carries one of these, so that the result is that of one erasure after
-- them. Only SHA-256 digests of 'kind:value', never an identifier; pruned once no message sent
-- before `erased_at` can come back (writer/src/retention.rs).
CREATE TABLE erasure_tombstones (
    erasure_id   bigint PRIMARY KEY REFERENCES erasures (id),
    workspace_id text NOT NULL,
    -- The database's clock once the erasure held the workspace's lock; items received before it
    -- (the gateway's received_at_ms) are covered.
    erased_at    timestamptz NOT NULL,
    digests      text[] NOT NULL
);
CREATE INDEX erasure_tombstones_by_workspace ON erasure_tombstones (workspace_id, erased_at);
