import type { ConversionInput } from "./models.js";
/**
 * Unicode White_Space, the set Rust's `str::trim` and `char::is_whitespace` use. Written out
 * because JavaScript's `trim()` and `\s` also take U+FEFF, which the gateway keeps.
 */
export declare const WHITE_SPACE: string;
/** Lower-case hex SHA-256 of the UTF-8 text. */
export declare function sha256Hex(text: string): string;
/**
 * Trimmed and lower-cased; null when the gateway could not use it (it would answer the warning
 * `email_invalid`): not exactly one `@`, an empty local part, a domain without a dot or with an
 * empty label, white space inside, or a control character anywhere.
 */
export declare function normalizeEmail(raw: string): string | null;
/**
 * `line1|zip|COUNTRY` as the gateway hashes it: line and zip lower-cased, ASCII punctuation and
 * white space to single spaces, trimmed; a US ZIP+4 cut to its 5 digits. `country` is the
 * address's country, else the conversion's, else `US`. Null when the gateway could not use it
 * (warning `address_unparseable`): a control character, nothing left of the line or the zip, or
 * a zip that cannot be a postal code of US, CA, GB, DE or FR. Throws on a malformed country.
 */
export declare function normalizeAddress(line1: string, zip: string, country?: string | null): string | null;
/** `email_sha256` of an email, or null when the gateway could not use it either. */
export declare function hashEmail(raw: string): string | null;
/** `address_sha256` of an address, or null when the gateway could not use it either. */
export declare function hashAddress(line1: string, zip: string, country?: string | null): string | null;
/**
 * A copy of the conversion whose email and address are replaced by their hashes, so that they
 * never leave your servers raw. An email or an address that the gateway could not use either is
 * left out (the gateway would drop it with a warning). The phone stays raw, for the gateway to
 * normalize and hash (see the top of this file).
 */
export declare function prehash(conversion: ConversionInput): ConversionInput;
