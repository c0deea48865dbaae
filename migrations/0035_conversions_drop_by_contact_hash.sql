-- no-transaction
-- contract: applied by `intake-writer migrate --contract` only, once no binary of the version
-- before 0031 runs: its erasure looks people up through this index.
-- Served by 0031's index, led by the month of creation.
DROP INDEX CONCURRENTLY IF EXISTS conversions_by_contact_hash;
