-- no-transaction
-- contract: applied by `intake-writer migrate --contract` only, once no binary of the version
-- before 0030 runs: its erasure looks people up through this index.
-- Served by 0030's index, led by the month of creation.
DROP INDEX CONCURRENTLY IF EXISTS conversions_by_visitor_hash;
