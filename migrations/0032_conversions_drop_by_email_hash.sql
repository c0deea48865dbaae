-- no-transaction
-- contract: applied by `intake-writer migrate --contract` only, once no binary of the version
-- before 0028 runs: its erasure looks people up through this index.
-- Served by 0028's index, led by the month of creation.
DROP INDEX CONCURRENTLY IF EXISTS conversions_by_email_hash;
