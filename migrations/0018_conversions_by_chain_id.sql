-- no-transaction
-- The look-up by chain (a merge's update) on the chain id alone: chain ids are unique across
-- workspaces (ULIDs) and sort by creation, so a new chain's entry goes to the right edge of the
-- index instead of a random page among the workspace's, and the entry is 30 bytes narrower
-- (docs/operations.md, "Storage settings"). The workspace is checked in the row. Built
-- concurrently; if this fails, DROP INDEX CONCURRENTLY the invalid index and migrate again.
CREATE INDEX CONCURRENTLY conversions_by_chain_id ON conversions (chain_id);
