-- A request whose chunk failed for good: no later chunk of it is applied, by any writer, so
-- that a failed batch leaves a prefix committed, never a gap. Kept as long as applied_messages.
CREATE TABLE failed_requests (
    request_id   text PRIMARY KEY,
    workspace_id text NOT NULL,
    -- The chunk that failed: the chunks after it are not applied (it may be, redriven from the
    -- dead-letter topic).
    chunk_index  int NOT NULL,
    failed_at    timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX failed_requests_by_age ON failed_requests (failed_at);

-- One row the writer updates to tell whether PostgreSQL takes writes at all, when a chunk
-- raises an error that could be an outage (out of memory, disk full) or its own problem.
CREATE TABLE writer_probe (
    id int PRIMARY KEY,
    at timestamptz NOT NULL
);
