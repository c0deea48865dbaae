// Normalization and SHA-256 hashing of emails and addresses, exactly as the gateway does it, so
// that a conversion can carry `email_sha256` and `address_sha256` instead of the raw values (the
// rules: docs/normalization.md of the repository).
//
// Phones are never hashed here. The gateway's E.164 text of a phone comes from its phone-number
// library and depends on the conversion's country, even for a phone that starts with `+`
// (`+4402079460958` is stored as `+442079460958`; `+491701234567` sent with country `US` as
// `+49701234567`). A hash made here could differ from it, match nothing and escape an erasure by
// `--phone`, so a phone goes to the gateway raw.
import { createHash } from "node:crypto";
/**
 * Unicode White_Space, the set Rust's `str::trim` and `char::is_whitespace` use. Written out
 * because JavaScript's `trim()` and `\s` also take U+FEFF, which the gateway keeps.
 */
export const WHITE_SPACE = "\t\n\v\f\r \u0085\u00a0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a" +
    "\u2028\u2029\u202f\u205f\u3000";
const whiteSpace = new Set(WHITE_SPACE);
const asciiPunctuation = new Set("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~");
const countryCode = /^[A-Za-z]{2}$/;
// Postal code shapes the gateway checks, on canonical (lower-case, single-spaced) text; ASCII
// digits only. Any other country's zip is accepted.
const postal = {
    US: /^[0-9]{5}( ?[0-9]{4})?$/,
    CA: /^[a-z][0-9][a-z] ?[0-9][a-z][0-9]$/,
    GB: /^[a-z]{1,2}[0-9][a-z0-9]? ?[0-9][a-z]{2}$/,
    DE: /^[0-9]{5}$/,
    FR: /^[0-9]{5}$/,
};
// Lower-case pairs of Unicode 16 and 17, which the gateway's Rust knows and the ICU of an older
// Node 20 may not; applied after `toLowerCase()`, so a newer ICU loses nothing.
const newerLowerCase = new Map([
    ["\u1c89", "\u1c8a"],
    ["\ua7cb", "\u0264"],
    ["\ua7cc", "\ua7cd"],
    ["\ua7ce", "\ua7cf"],
    ["\ua7d2", "\ua7d3"],
    ["\ua7d4", "\ua7d5"],
    ["\ua7da", "\ua7db"],
    ["\ua7dc", "\u019b"],
]);
for (let upper = 0x10d50; upper <= 0x10d65; upper++) {
    newerLowerCase.set(String.fromCodePoint(upper), String.fromCodePoint(upper + 0x20)); // Garay
}
for (let upper = 0x16ea0; upper <= 0x16eb8; upper++) {
    newerLowerCase.set(String.fromCodePoint(upper), String.fromCodePoint(upper + 0x1b)); // Beria Erfe
}
const newerUpperCase = /[\u1c89\ua7cb-\ua7dc\u{10d50}-\u{10d65}\u{16ea0}-\u{16eb8}]/gu;
/** Rust's `str::to_lowercase`: full case mapping, final sigma included. */
function lower(text) {
    return text.toLowerCase().replace(newerUpperCase, (c) => newerLowerCase.get(c) ?? c);
}
/** Lower-case hex SHA-256 of the UTF-8 text. */
export function sha256Hex(text) {
    return createHash("sha256").update(text, "utf8").digest("hex");
}
function hasControlChars(text) {
    for (let i = 0; i < text.length; i++) {
        const unit = text.charCodeAt(i);
        if (unit <= 0x1f || unit === 0x7f)
            return true;
    }
    return false;
}
function trimWhiteSpace(text) {
    const chars = [...text];
    let start = 0;
    let end = chars.length;
    while (start < end && whiteSpace.has(chars[start]))
        start++;
    while (end > start && whiteSpace.has(chars[end - 1]))
        end--;
    return chars.slice(start, end).join("");
}
/**
 * Trimmed and lower-cased; null when the gateway could not use it (it would answer the warning
 * `email_invalid`): not exactly one `@`, an empty local part, a domain without a dot or with an
 * empty label, white space inside, or a control character anywhere.
 */
export function normalizeEmail(raw) {
    if (hasControlChars(raw))
        return null;
    const email = lower(trimWhiteSpace(raw));
    const at = email.indexOf("@");
    if (at < 0)
        return null;
    const local = email.slice(0, at);
    const domain = email.slice(at + 1);
    if (local === "" || domain.includes("@") || !domain.includes("."))
        return null;
    if (domain.split(".").some((label) => label === ""))
        return null;
    for (const c of email)
        if (whiteSpace.has(c))
            return null;
    return email;
}
function canonicalText(raw) {
    const words = [];
    let word = "";
    for (const c of lower(raw)) {
        if (asciiPunctuation.has(c) || whiteSpace.has(c)) {
            if (word)
                words.push(word);
            word = "";
        }
        else {
            word += c;
        }
    }
    if (word)
        words.push(word);
    return words.join(" ");
}
/**
 * `line1|zip|COUNTRY` as the gateway hashes it: line and zip lower-cased, ASCII punctuation and
 * white space to single spaces, trimmed; a US ZIP+4 cut to its 5 digits. `country` is the
 * address's country, else the conversion's, else `US`. Null when the gateway could not use it
 * (warning `address_unparseable`): a control character, nothing left of the line or the zip, or
 * a zip that cannot be a postal code of US, CA, GB, DE or FR. Throws on a malformed country.
 */
export function normalizeAddress(line1, zip, country) {
    const code = country || "US";
    if (!countryCode.test(code))
        throw new RangeError("country must be two letters (ISO 3166-1 alpha-2)");
    const upper = code.toUpperCase();
    if (hasControlChars(line1) || hasControlChars(zip))
        return null;
    const line = canonicalText(line1);
    let postalCode = canonicalText(zip);
    if (line === "" || postalCode === "")
        return null;
    const shape = postal[upper];
    if (shape !== undefined && !shape.test(postalCode))
        return null;
    if (upper === "US")
        postalCode = postalCode.slice(0, 5);
    return `${line}|${postalCode}|${upper}`;
}
/** `email_sha256` of an email, or null when the gateway could not use it either. */
export function hashEmail(raw) {
    const normalized = normalizeEmail(raw);
    return normalized === null ? null : sha256Hex(normalized);
}
/** `address_sha256` of an address, or null when the gateway could not use it either. */
export function hashAddress(line1, zip, country) {
    const normalized = normalizeAddress(line1, zip, country);
    return normalized === null ? null : sha256Hex(normalized);
}
/**
 * A copy of the conversion whose email and address are replaced by their hashes, so that they
 * never leave your servers raw. An email or an address that the gateway could not use either is
 * left out (the gateway would drop it with a warning). The phone stays raw, for the gateway to
 * normalize and hash (see the top of this file).
 */
export function prehash(conversion) {
    const out = { ...conversion };
    if (typeof out.email === "string" && out.email !== "") {
        const hashed = hashEmail(out.email);
        delete out.email;
        if (hashed !== null)
            out.email_sha256 = hashed;
    }
    if (out.address !== null && typeof out.address === "object") {
        const { line1, zip, country } = out.address;
        delete out.address;
        const hashed = hashAddress(line1, zip, country || out.country || null);
        if (hashed !== null)
            out.address_sha256 = hashed;
    }
    return out;
}
