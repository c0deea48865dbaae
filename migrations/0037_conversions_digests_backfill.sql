-- no-transaction
-- Fills 0036's digest columns of the rows written before it, 10,000 rows a transaction in the
-- order of their ids, each committed before the next: a concurrent write to one of those rows
-- waits for one batch at most (well under a second), never for the whole table. The trigger of
-- 0036 covers every row written since. Rerunnable: a batch skips the rows already filled.
DO $$
DECLARE
    done_to text := '';
    batch_end text;
BEGIN
    LOOP
        SELECT max(id) INTO batch_end
          FROM (SELECT id FROM conversions WHERE id > done_to ORDER BY id LIMIT 10000) AS batch;
        EXIT WHEN batch_end IS NULL;
        UPDATE conversions
           SET email_digest = decode(email_sha256, 'hex'),
               phone_digest = decode(phone_sha256, 'hex'),
               address_digest = decode(address_sha256, 'hex')
         WHERE id > done_to AND id <= batch_end
           AND (email_digest IS NULL AND email_sha256 IS NOT NULL
                OR phone_digest IS NULL AND phone_sha256 IS NOT NULL
                OR address_digest IS NULL AND address_sha256 IS NOT NULL);
        done_to := batch_end;
        COMMIT;
    END LOOP;
END
$$;
