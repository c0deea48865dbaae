-- no-transaction
-- Served by 0018's index on the chain id alone.
DROP INDEX CONCURRENTLY IF EXISTS conversions_by_chain;
