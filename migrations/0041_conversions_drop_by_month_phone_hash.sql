-- no-transaction
-- contract: applied by `intake-writer migrate --contract` only, once no binary of the version
-- before 0036 runs: its erasure looks people up through this index.
-- Served by 0038's index on the digest's bytes.
DROP INDEX CONCURRENTLY IF EXISTS conversions_by_month_phone_hash;
