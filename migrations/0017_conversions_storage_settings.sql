-- Room on each page of conversions for a re-sent conversion's new version: an update that
-- changes no indexed column (a value, tags) is then a HOT update, with no entry in any of the
-- eight indexes and nothing there for a vacuum to remove. Applies to pages written from now on.
-- Autovacuum by smaller, more frequent passes: at 10 M rows the defaults (20 % of the table)
-- wait for 2 M dead or 2 M new rows, and the vacuum then scans every index in one go; at 1 %
-- the dead rows sit on few enough pages that it skips the indexes (PostgreSQL's bypass below
-- 2 % of the pages). deploy/bench-vacuum.sh measures both; docs/operations.md, "Storage
-- settings". A SHARE UPDATE EXCLUSIVE lock, which writes do not wait for; a running vacuum of
-- the table makes this wait, bounded here: past it the migration fails and is run again.
SET LOCAL lock_timeout = '3s';
ALTER TABLE conversions SET (
    fillfactor = 90,
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_insert_scale_factor = 0.02
);
