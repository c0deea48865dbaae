-- The check that a message is applied once, as one index probe per range for each id inserted,
-- whatever the sizes. Written as a join of the table to the inserted rows, it was free to be
-- planned as a merge join over every range's whole primary key, and was, for ranges not yet
-- analyzed (the EXISTS asks for a plan that starts fast): each insert then read every row of
-- applied_messages. A scalar subquery with LIMIT is never turned into a join.
-- Replacing the function takes no lock on the table; the sessions of writers already running
-- use the new body from their next insert on.
CREATE OR REPLACE FUNCTION applied_messages_once() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- Another row of the same id: one committed by another writer (the row inserted here has
    -- this transaction's applied_at; a second one with the same would break the primary key).
    IF EXISTS (SELECT 1 FROM inserted i
                WHERE (SELECT true FROM applied_messages a
                        WHERE a.correlation_id = i.correlation_id AND a.applied_at <> i.applied_at
                        LIMIT 1)) THEN
        RAISE unique_violation USING MESSAGE = 'message already applied (applied_messages)';
    END IF;
    RETURN NULL;
END $$;
