-- Statistics on 0020's hash expression (whose index replaced 0021's), as 0013 gave the others: the planner keeps none of a
-- partial index's expression, and without them it answered a look-up by contact id with a
-- bitmap of the whole workspace's rows in the unique key ANDed with the hash's (185 ms under
-- the workspace's lock in the largest workspace of 10 M conversions). ANALYZE reads a sample,
-- taking no lock that writes wait for.
CREATE STATISTICS conversions_contact_hash ON (hashtextextended(contact_id, hashtextextended(workspace_id, 0)))
    FROM conversions;
ANALYZE conversions;
