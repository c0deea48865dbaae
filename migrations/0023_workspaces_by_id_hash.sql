-- no-transaction
-- The 8-byte hash of a workspace id (`hashtextextended(id, 0)`) stands for the id in the keys of
-- `conversions` (0024, 0025): a 29-character id is 30 bytes in every index entry that leads
-- with it, its hash 8. Unique here, so that the hash names one workspace and a key on it is as
-- unique as a key on the id: a new workspace whose id's hash is taken is refused (about one in
-- 10^19 a workspace; create it again). Built concurrently; if this fails, DROP INDEX
-- CONCURRENTLY the invalid index and migrate again.
CREATE UNIQUE INDEX CONCURRENTLY workspaces_by_id_hash ON workspaces (hashtextextended(id, 0));
