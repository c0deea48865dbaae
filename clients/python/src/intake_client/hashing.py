"""Normalization and SHA-256 hashing of emails and addresses, exactly as the gateway does it, so
that a conversion can carry ``email_sha256`` and ``address_sha256`` instead of the raw values
(the rules: docs/normalization.md of the repository).

Phones are never hashed here. The gateway's E.164 text of a phone comes from its phone-number
library and depends on the conversion's country, even for a phone that starts with ``+``
(``+4402079460958`` is stored as ``+442079460958``; ``+491701234567`` sent with country ``US`` as
``+49701234567``). A hash made here could differ from it, match nothing and escape an erasure by
``--phone``, so a phone goes to the gateway raw.
"""

from __future__ import annotations

import hashlib
import re
import string
from typing import Any, Mapping

from ._models import Address, ConversionInput

# Unicode White_Space, the set Rust's ``str::trim`` and ``char::is_whitespace`` use. Written out
# because Python's ``str.strip()``/``isspace()`` also take U+001C..U+001F, and JavaScript's
# ``trim()`` takes U+FEFF: both differ from the gateway.
WHITE_SPACE = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680"
    "\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a"
    "\u2028\u2029\u202f\u205f\u3000"
)
_WHITE_SPACE_SET = frozenset(WHITE_SPACE)
_ASCII_PUNCTUATION = frozenset(string.punctuation)
_COUNTRY = re.compile(r"[A-Za-z]{2}")
# Postal code shapes the gateway checks, on canonical (lower-case, single-spaced) text; ASCII
# digits only. Any other country's zip is accepted.
_POSTAL = {
    "US": re.compile(r"[0-9]{5}( ?[0-9]{4})?"),
    "CA": re.compile(r"[a-z][0-9][a-z] ?[0-9][a-z][0-9]"),
    "GB": re.compile(r"[a-z]{1,2}[0-9][a-z0-9]? ?[0-9][a-z]{2}"),
    "DE": re.compile(r"[0-9]{5}"),
    "FR": re.compile(r"[0-9]{5}"),
}


# Lower-case pairs of Unicode 16 and 17, which the gateway's Rust knows and Python 3.11's
# Unicode 14 tables do not; applied after `str.lower()`, so a newer Python loses nothing.
_NEWER_LOWER_CASE = {
    0x1C89: 0x1C8A,
    0xA7CB: 0x0264,
    0xA7CC: 0xA7CD,
    0xA7CE: 0xA7CF,
    0xA7D2: 0xA7D3,
    0xA7D4: 0xA7D5,
    0xA7DA: 0xA7DB,
    0xA7DC: 0x019B,
    **{upper: upper + 0x20 for upper in range(0x10D50, 0x10D66)},  # Garay
    **{upper: upper + 0x1B for upper in range(0x16EA0, 0x16EB9)},  # Beria Erfe
}


def _lower(text: str) -> str:
    """Rust's `str::to_lowercase`: full case mapping, final sigma included."""
    return text.lower().translate(_NEWER_LOWER_CASE)


def sha256_hex(text: str) -> str:
    """Lower-case hex SHA-256 of the UTF-8 text."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _has_control_chars(text: str) -> bool:
    return any(c <= "\x1f" or c == "\x7f" for c in text)


def normalize_email(raw: str) -> str | None:
    """Trimmed and lower-cased; ``None`` when the gateway could not use it (it would answer the
    warning ``email_invalid``): not exactly one ``@``, an empty local part, a domain without a dot
    or with an empty label, white space inside, or a control character anywhere."""
    if _has_control_chars(raw):
        return None
    email = _lower(raw.strip(WHITE_SPACE))
    local, at, domain = email.partition("@")
    if not at or not local or "@" in domain or "." not in domain:
        return None
    if not all(domain.split(".")) or any(c in _WHITE_SPACE_SET for c in email):
        return None
    return email


def _canonical_text(raw: str) -> str:
    words: list[str] = []
    word: list[str] = []
    for c in _lower(raw):
        if c in _ASCII_PUNCTUATION or c in _WHITE_SPACE_SET:
            if word:
                words.append("".join(word))
                word = []
        else:
            word.append(c)
    if word:
        words.append("".join(word))
    return " ".join(words)


def normalize_address(line1: str, zip: str, country: str | None = None) -> str | None:
    """``line1|zip|COUNTRY`` as the gateway hashes it: line and zip lower-cased, ASCII punctuation
    and white space to single spaces, trimmed; a US ZIP+4 cut to its 5 digits. ``country`` is the
    address's country, else the conversion's, else ``US``. ``None`` when the gateway could not use
    it (warning ``address_unparseable``): a control character, nothing left of the line or the
    zip, or a zip that cannot be a postal code of US, CA, GB, DE or FR."""
    country = country or "US"
    if not _COUNTRY.fullmatch(country):
        raise ValueError("country must be two letters (ISO 3166-1 alpha-2)")
    country = country.upper()
    if _has_control_chars(line1) or _has_control_chars(zip):
        return None
    line = _canonical_text(line1)
    postal = _canonical_text(zip)
    if not line or not postal:
        return None
    shape = _POSTAL.get(country)
    if shape is not None and not shape.fullmatch(postal):
        return None
    if country == "US":
        postal = postal[:5]
    return f"{line}|{postal}|{country}"


def hash_email(raw: str) -> str | None:
    """``email_sha256`` of an email, or ``None`` when the gateway could not use it either."""
    normalized = normalize_email(raw)
    return None if normalized is None else sha256_hex(normalized)


def hash_address(line1: str, zip: str, country: str | None = None) -> str | None:
    """``address_sha256`` of an address, or ``None`` when the gateway could not use it either."""
    normalized = normalize_address(line1, zip, country)
    return None if normalized is None else sha256_hex(normalized)


def prehash(conversion: ConversionInput | Mapping[str, Any]) -> ConversionInput:
    """A copy of the conversion whose email and address are replaced by their hashes, so that
    they never leave your servers raw. An email or an address that the gateway could not use
    either is left out (the gateway would drop it with a warning). The phone stays raw, for the
    gateway to normalize and hash (see the module's docstring)."""
    out: dict[str, Any] = dict(conversion)
    email = out.get("email")
    if isinstance(email, str) and email:
        del out["email"]
        hashed = hash_email(email)
        if hashed is not None:
            out["email_sha256"] = hashed
    address = out.get("address")
    if isinstance(address, Mapping):
        del out["address"]
        typed: Address = address  # type: ignore[assignment]
        country = typed.get("country") or out.get("country") or None
        hashed = hash_address(typed["line1"], typed["zip"], country)
        if hashed is not None:
            out["address_sha256"] = hashed
    return out  # type: ignore[return-value]
