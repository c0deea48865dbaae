-- The email, phone and address digests as their 32 bytes (`bytea`) instead of 64 hex
-- characters: a row with all three 96 bytes narrower. Added beside the hex columns, which stay:
-- the rows written before keep their hex (rewriting every row to convert it would give each a
-- new version too wide for its page, an entry in every index, and the whole table's size again
-- in WAL; at 1 M rows it doubled the heap and the indexes), and a digest is read as
-- `coalesce(<kind>_digest, decode(<kind>_sha256, 'hex'))` (writer/src/lookups.rs). Until
-- `intake-writer migrate --contract` (0042) a trigger keeps each pair in step, whichever side a
-- statement wrote, for the previous version's binaries, which read and write the hex: its
-- writes and erasures set the hex, this version's the bytes; from the contract on, a new row
-- carries its digests once, as bytes.
-- Columns added without a default change no row: an ACCESS EXCLUSIVE lock for a moment, as is
-- the trigger's SHARE ROW EXCLUSIVE, each waited for at most 3 s; past that the migration
-- fails, writes were never queued behind it, and it is run again.
SET LOCAL lock_timeout = '3s';
ALTER TABLE conversions
    ADD COLUMN email_digest bytea,
    ADD COLUMN phone_digest bytea,
    ADD COLUMN address_digest bytea;

-- A digest's first 8 bytes as a bigint: the key its look-up index holds. A SHA-256 is uniform
-- already, so its prefix is as good a hash as any, at no cost of hashing.
CREATE FUNCTION digest_key(digest bytea) RETURNS int8
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    RETURN ('x' || encode(substring(digest FROM 1 FOR 8), 'hex'))::bit(64)::int8;

-- On an update the bytes win: this version's upsert also clears a stale hex (a row stored before
-- whose digest a re-send changed), which the previous version never does to the bytes.
CREATE FUNCTION conversions_digests_in_step() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        NEW.email_digest := coalesce(NEW.email_digest, decode(NEW.email_sha256, 'hex'));
        NEW.email_sha256 := coalesce(NEW.email_sha256, encode(NEW.email_digest, 'hex'));
        NEW.phone_digest := coalesce(NEW.phone_digest, decode(NEW.phone_sha256, 'hex'));
        NEW.phone_sha256 := coalesce(NEW.phone_sha256, encode(NEW.phone_digest, 'hex'));
        NEW.address_digest := coalesce(NEW.address_digest, decode(NEW.address_sha256, 'hex'));
        NEW.address_sha256 := coalesce(NEW.address_sha256, encode(NEW.address_digest, 'hex'));
        RETURN NEW;
    END IF;
    IF NEW.email_digest IS DISTINCT FROM OLD.email_digest THEN
        NEW.email_sha256 := encode(NEW.email_digest, 'hex');
    ELSIF NEW.email_sha256 IS DISTINCT FROM OLD.email_sha256 THEN
        NEW.email_digest := decode(NEW.email_sha256, 'hex');
    END IF;
    IF NEW.phone_digest IS DISTINCT FROM OLD.phone_digest THEN
        NEW.phone_sha256 := encode(NEW.phone_digest, 'hex');
    ELSIF NEW.phone_sha256 IS DISTINCT FROM OLD.phone_sha256 THEN
        NEW.phone_digest := decode(NEW.phone_sha256, 'hex');
    END IF;
    IF NEW.address_digest IS DISTINCT FROM OLD.address_digest THEN
        NEW.address_sha256 := encode(NEW.address_digest, 'hex');
    ELSIF NEW.address_sha256 IS DISTINCT FROM OLD.address_sha256 THEN
        NEW.address_digest := decode(NEW.address_sha256, 'hex');
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER conversions_digests_in_step BEFORE INSERT OR UPDATE ON conversions
    FOR EACH ROW EXECUTE FUNCTION conversions_digests_in_step();
