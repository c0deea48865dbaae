-- applied_messages is pruned by dropping whole partitions by age (writer/src/retention.rs), not
-- by DELETE, which leaves dead tuples behind in the table and its index. Ranges of applied_at;
-- the writer creates them ahead and drops those older than the replay window. Rows that find no
-- range (a writer started before its ranges were created, the old table's rows) go to the
-- default partition, pruned by DELETE; it stays small.
ALTER TABLE applied_messages RENAME TO applied_messages_unpartitioned;
ALTER INDEX applied_messages_pkey RENAME TO applied_messages_unpartitioned_pkey;
ALTER INDEX applied_messages_by_age RENAME TO applied_messages_unpartitioned_by_age;

-- A partitioned table's unique key must hold the partition key: (correlation_id, applied_at).
CREATE TABLE applied_messages (
    correlation_id text NOT NULL,
    workspace_id   text NOT NULL,
    results        jsonb NOT NULL,
    applied_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (correlation_id, applied_at)
) PARTITION BY RANGE (applied_at);
CREATE TABLE applied_messages_default PARTITION OF applied_messages DEFAULT;

-- The key above no longer makes one correlation id unique across ranges. A message applied by
-- two writers (both held it during a rebalance) must still fail the second time, as it did on
-- the old primary key: this check runs after each insert, on a snapshot that sees the other
-- writer's commit, and raises the same unique_violation.
CREATE FUNCTION applied_messages_once() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM applied_messages a JOIN inserted i USING (correlation_id)
                GROUP BY a.correlation_id HAVING count(*) > 1) THEN
        RAISE unique_violation USING MESSAGE = 'message already applied (applied_messages)';
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER applied_messages_once AFTER INSERT ON applied_messages
    REFERENCING NEW TABLE AS inserted FOR EACH STATEMENT EXECUTE FUNCTION applied_messages_once();

INSERT INTO applied_messages (correlation_id, workspace_id, results, applied_at)
SELECT correlation_id, workspace_id, results, applied_at FROM applied_messages_unpartitioned;
DROP TABLE applied_messages_unpartitioned;
