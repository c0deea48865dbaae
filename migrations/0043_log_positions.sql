-- Where the database stands in the requests topic: for each partition, the offset below which
-- every message has been answered from this database (applied, failed or expired). A writer
-- records it after the commits it covers were confirmed, in a small transaction of its own;
-- the write-ahead log is one sequence, so any node or restore that has a version of this row
-- has every commit it covers. After a promotion or a restore that lost commits, the writer
-- reads the topic again from here (writer/src/rewind.rs).
CREATE TABLE log_positions (
    topic       text NOT NULL,
    partition   int NOT NULL,
    next_offset bigint NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (topic, partition)
) WITH (fillfactor = 50); -- its rows are updated in place, every half second

