-- no-transaction
-- Served by 0020's index of a hash of the contact id.
DROP INDEX CONCURRENTLY IF EXISTS conversions_by_contact;
