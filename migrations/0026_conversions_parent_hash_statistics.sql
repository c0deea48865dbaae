-- Statistics on 0025's hash expression, as 0022 gave the contacts': the planner keeps none of a
-- partial index's expression, and without them it estimated a look-up of ten parents at 5 % of
-- the table and answered a chunk's related rows with a sequential scan of `conversions` (seconds
-- a chunk at 10 M). ANALYZE reads a sample, taking no lock that writes wait for.
CREATE STATISTICS conversions_parent_hash
    ON (hashtextextended(parent_external_id, hashtextextended(workspace_id, 0))) FROM conversions;
ANALYZE conversions;
