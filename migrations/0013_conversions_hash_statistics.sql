-- The planner keeps no statistics of a partial index's expression: without these it would
-- take each hash for 0.5 % of the table, and intersect it with the workspace's rows through
-- another index. ANALYZE reads a sample, taking no lock that writes wait for.
CREATE STATISTICS conversions_email_hash ON (hashtextextended(email_sha256, 0)) FROM conversions;
CREATE STATISTICS conversions_phone_hash ON (hashtextextended(phone_sha256, 0)) FROM conversions;
CREATE STATISTICS conversions_visitor_hash ON (hashtextextended(left(visitor_id, 16), 0)) FROM conversions;
ANALYZE conversions;
