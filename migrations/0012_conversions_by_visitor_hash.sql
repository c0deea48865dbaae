-- no-transaction
-- As conversions_by_email_hash, for the 16 characters of the visitor id that erasure matches.
CREATE INDEX CONCURRENTLY conversions_by_visitor_hash ON conversions (hashtextextended(left(visitor_id, 16), 0))
    WHERE visitor_id IS NOT NULL;
