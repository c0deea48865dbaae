//! Normalization and SHA-256 hashing of email, phone and address (docs/normalization.md).
//! The `*_hash` functions take the raw text and return only the hash, or `None` when the
//! identifier cannot be used; the raw text goes no further than this module. The `normalized_*`
//! functions return the text that is hashed, for the published test vectors and their tests
//! (`docs/normalization.md`); the services use the hashes only.

use crate::conversion::Sha256Hex;
use regex::Regex;
use sha2::{Digest, Sha256};
use std::sync::LazyLock;

pub fn sha256_hex(text: &str) -> Sha256Hex {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let digest = Sha256::digest(text.as_bytes());
    let mut hex = String::with_capacity(64);
    for byte in digest {
        hex.push(char::from(HEX[usize::from(byte >> 4)]));
        hex.push(char::from(HEX[usize::from(byte & 0x0f)]));
    }
    Sha256Hex(hex)
}

/// Trimmed and lower-cased; `None` when it does not look like an address: exactly one `@`,
/// a non-empty local part, a domain with a dot between non-empty labels, no white space and no
/// control character anywhere in what was sent.
pub fn email_hash(raw: &str) -> Option<Sha256Hex> {
    normalized_email(raw).map(|email| sha256_hex(&email))
}

/// The text [`email_hash`] hashes. Trimming is `str::trim` (Unicode White_Space, which does not
/// hold U+FEFF); lower-casing is `str::to_lowercase` (full Unicode mappings).
pub fn normalized_email(raw: &str) -> Option<String> {
    if has_control_chars(raw) {
        return None;
    }
    let email = raw.trim().to_lowercase();
    let (local, domain) = email.split_once('@')?;
    let plausible = !local.is_empty()
        && !domain.contains('@')
        && domain.contains('.')
        && domain.split('.').all(|label| !label.is_empty())
        && !email.chars().any(char::is_whitespace);
    plausible.then_some(email)
}

/// E.164. A number written with its calling code (a leading `+`) is parsed without a default
/// region, so `country` never changes it; any other number is parsed with `country` (ISO
/// alpha-2) as the default region, whose international prefix (`00`, `011`) it may start with.
/// A `country` that libphonenumber does not know as a region (`UK`, `ZZ`) is no default region.
/// `None` when it cannot be parsed, is not a possible number for its region, or has a control
/// character.
pub fn phone_hash(raw: &str, country: Option<&str>) -> Option<Sha256Hex> {
    normalized_phone(raw, country).map(|e164| sha256_hex(&e164))
}

/// The E.164 text [`phone_hash`] hashes, with its leading `+`.
pub fn normalized_phone(raw: &str, country: Option<&str>) -> Option<String> {
    if has_control_chars(raw) {
        return None;
    }
    let region = country.and_then(|code| code.parse::<phonenumber::country::Id>().ok());
    let number = parse_phone(raw, region)?;
    let national = number.national().to_string();
    if !is_possible(&number, national.len()) {
        return None;
    }
    // E.164 exactly as the crate's formatter writes it, without the formatter's search for a
    // national format that E.164 does not use (a quarter of a phone's cost).
    Some(format!("+{}{national}", number.country().code()))
}

/// libphonenumber's rule: the default region serves a number written without its calling code
/// only. The crate applies the region's national (trunk) prefix also to the digits after a `+`
/// or after the region's international prefix (`+49 170…` with `US` lost the `1` of `170`), so
/// those numbers are parsed as `+` and the calling code, with no region. One parse for a
/// national number and for one that starts with `+`.
fn parse_phone(raw: &str, region: Option<phonenumber::country::Id>) -> Option<phonenumber::PhoneNumber> {
    use phonenumber::country::Source;
    if region.is_none() || starts_with_plus(raw) {
        return phonenumber::parse(None, raw).ok();
    }
    match phonenumber::parse(region, raw) {
        Ok(number) if matches!(number.code().source(), Source::Default | Source::Number) => Some(number),
        // An international prefix, a `tel:` URI's `phone-context=+`, or an error that the
        // region's trunk prefix may have caused.
        _ => {
            let international = phonenumber::parse_with(&CALLING_CODES, region, raw).ok()?;
            match international.code().source() {
                Source::Plus => phonenumber::parse(None, raw).ok(),
                Source::Idd => {
                    let e164 = format!("+{}{}", international.code().value(), international.national());
                    phonenumber::parse(None, e164).ok()
                }
                Source::Default | Source::Number => None,
            }
        }
    }
}

/// Whether the first character that can start a number (the crate's `[+＋\p{Nd}]`) is a plus.
fn starts_with_plus(raw: &str) -> bool {
    let is_plus = |c: char| c == '+' || c == '\u{ff0b}';
    raw.chars().find(|&c| is_plus(c) || c.is_numeric()).is_some_and(is_plus)
}

/// The crate's regions with their calling codes and international prefixes and nothing else:
/// parsed with it, a number's digits after the international prefix and the calling code are
/// kept as written, with no region's trunk prefix taken off.
static CALLING_CODES: LazyLock<phonenumber::metadata::Database> = LazyLock::new(|| {
    use phonenumber::metadata::{loader, DATABASE};
    let regions = (1..=999u16)
        .filter_map(|code| DATABASE.by_code(&code))
        .flatten()
        .map(|region| loader::Metadata {
            id: Some(region.id().to_owned()),
            country_code: Some(region.country_code()),
            international_prefix: region.international_prefix().map(|idd| idd.as_str().to_owned()),
            general: Some(loader::Descriptor { national_number: Some(r"\d+".to_owned()), ..Default::default() }),
            ..Default::default()
        })
        .collect();
    #[allow(clippy::expect_used)]
    phonenumber::metadata::Database::from(regions).expect("the crate's own prefixes compile")
});

/// libphonenumber's "possible number" (docs/api.md, "Identifiers that cannot be used"): the
/// national number has a length that numbers of its calling code have. Written here because the
/// crate exposes only full validity, which matches every number-type pattern and costs more than
/// the parse itself.
fn is_possible(number: &phonenumber::PhoneNumber, national_length: usize) -> bool {
    use phonenumber::Type;
    // The general descriptor often lists no lengths in the crate's metadata: the possible
    // lengths are those of the number types.
    const TYPES: [Type; 10] = [
        Type::Unknown,
        Type::FixedLine,
        Type::Mobile,
        Type::TollFree,
        Type::PremiumRate,
        Type::SharedCost,
        Type::PersonalNumber,
        Type::Voip,
        Type::Pager,
        Type::Uan,
    ];
    let Ok(length) = u16::try_from(national_length) else {
        return false;
    };
    phonenumber::metadata::DATABASE.by_code(&number.code().value()).is_some_and(|regions| {
        regions.iter().any(|region| {
            TYPES
                .iter()
                .filter_map(|kind| region.descriptors().get(*kind))
                .any(|d| d.possible_length().contains(&length))
        })
    })
}

/// The hash of `line1|zip|country`, canonical; `None` when the address is unusable: a line or
/// zip with a control character, nothing left of one after canonicalization, or a zip that
/// cannot be a postal code of the address's country.
pub fn address_hash(line1: &str, zip: &str, country: &str) -> Option<Sha256Hex> {
    normalized_address(line1, zip, country).map(|address| sha256_hex(&address))
}

/// The `line1|zip|country` text [`address_hash`] hashes.
pub fn normalized_address(line1: &str, zip: &str, country: &str) -> Option<String> {
    if has_control_chars(line1) || has_control_chars(zip) {
        return None;
    }
    let country = country.to_ascii_uppercase();
    let line1 = canonical_text(line1);
    let mut zip = canonical_text(zip);
    if line1.is_empty() || zip.is_empty() || !postal_code_plausible(&zip, &country) {
        return None;
    }
    if country == "US" {
        // ZIP+4 is cut to the 5-digit ZIP, so both forms of one address hash alike. By
        // characters, never by bytes: a byte index can fall inside a character.
        zip = zip.chars().take(5).collect();
    }
    Some(format!("{line1}|{zip}|{country}"))
}

/// Case-folded, punctuation to spaces, white space collapsed, in one pass. The whole text is
/// lower-cased first: `str::to_lowercase` knows a word's final sigma, `char::to_lowercase` does not.
fn canonical_text(raw: &str) -> String {
    let lower = raw.to_lowercase();
    let mut canonical = String::with_capacity(lower.len());
    let mut gap = false;
    for c in lower.chars() {
        if c.is_ascii_punctuation() || c.is_whitespace() {
            gap = !canonical.is_empty();
        } else {
            if gap {
                canonical.push(' ');
                gap = false;
            }
            canonical.push(c);
        }
    }
    canonical
}

/// Postal code shapes of the countries we check; any other country's zip is accepted.
/// `zip` is already canonical (lower-case, single spaces). Digits are ASCII `[0-9]`, never `\d`,
/// which in the regex crate also matches the digits of other scripts (`٩٤١٠٥`).
fn postal_code_plausible(zip: &str, country: &str) -> bool {
    static US: LazyLock<Regex> = LazyLock::new(|| pattern(r"^[0-9]{5}( ?[0-9]{4})?$"));
    static CA: LazyLock<Regex> = LazyLock::new(|| pattern(r"^[a-z][0-9][a-z] ?[0-9][a-z][0-9]$"));
    static GB: LazyLock<Regex> = LazyLock::new(|| pattern(r"^[a-z]{1,2}[0-9][a-z0-9]? ?[0-9][a-z]{2}$"));
    static FIVE_DIGITS: LazyLock<Regex> = LazyLock::new(|| pattern(r"^[0-9]{5}$"));
    match country {
        "US" => US.is_match(zip),
        "CA" => CA.is_match(zip),
        "GB" => GB.is_match(zip),
        "DE" | "FR" => FIVE_DIGITS.is_match(zip),
        _ => true,
    }
}

/// Whether `text` has a C0 control character (U+0000 to U+001F) or DEL (U+007F): text that
/// PostgreSQL cannot store (U+0000) or that no sender means to send.
pub(crate) fn has_control_chars(text: &str) -> bool {
    text.chars().any(|c| c <= '\u{1f}' || c == '\u{7f}')
}

/// Compiles one of this crate's constant patterns.
pub(crate) fn pattern(source: &str) -> Regex {
    #[allow(clippy::expect_used)]
    Regex::new(source).expect("constant pattern compiles")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sha256_of_known_text() {
        assert_eq!(sha256_hex("abc").as_str(), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    }

    #[test]
    fn email_is_trimmed_and_lower_cased() {
        assert_eq!(email_hash("  Ann@Example.COM "), Some(sha256_hex("ann@example.com")));
    }

    #[test]
    fn implausible_emails_are_dropped() {
        for bad in [
            "",
            "   ",
            "ann",
            "ann@",
            "@example.com",
            "ann@example",
            "a@b@c.com",
            "ann smith@example.com",
            "ann@.com",
            "ann@example.",
        ] {
            assert_eq!(email_hash(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn phone_uses_country_as_default_region() {
        let expected = Some(sha256_hex("+14155552671"));
        assert_eq!(phone_hash("(415) 555-2671", Some("US")), expected);
        assert_eq!(phone_hash("+1 415 555 2671", None), expected);
        assert_eq!(phone_hash("+1 415 555 2671", Some("DE")), expected);
        assert_eq!(phone_hash("030 123456", Some("DE")), Some(sha256_hex("+4930123456")));
    }

    #[test]
    fn unusable_phones_are_dropped() {
        assert_eq!(phone_hash("(415) 555-2671", None), None, "no region");
        assert_eq!(phone_hash("12", Some("US")), None, "too short");
        assert_eq!(phone_hash("not a phone", Some("US")), None);
        assert_eq!(phone_hash("4155552671", Some("ZZ")), None, "unknown region");
        assert_eq!(phone_hash("+1 415 555 26711", None), None, "no US number has 11 digits");
        assert_eq!(phone_hash("+49 30 1", None), None, "too short for Germany");
    }

    #[test]
    fn unknown_region_is_no_default_region() {
        let expected = Some(sha256_hex("+442079460958"));
        assert_eq!(phone_hash("+44 20 7946 0958", Some("UK")), expected, "UK is not a region code; GB is");
        assert_eq!(phone_hash("+44 20 7946 0958", Some("ZZ")), expected);
        assert_eq!(phone_hash("020 7946 0958", Some("GB")), expected);
        assert_eq!(phone_hash("020 7946 0958", Some("UK")), None, "no + and no region");
    }

    #[test]
    fn a_plus_number_does_not_depend_on_country() {
        for (raw, country) in
            [("+491701234567", "US"), ("+8613812345678", "US"), ("+33142345678", "US"), ("+18015550123", "RU")]
        {
            assert_eq!(normalized_phone(raw, Some(country)).as_deref(), Some(raw), "{raw} with {country}");
        }
        assert_eq!(normalized_phone("+44 (0)20 7946 0958", Some("US")).as_deref(), Some("+442079460958"));
        // The region's international prefix is not looked for after a `+`.
        assert_eq!(normalized_phone("+011 49 170 1234567", Some("US")), None);
        assert_eq!(normalized_phone("tel:+49-170-1234567", Some("US")).as_deref(), Some("+491701234567"));
    }

    #[test]
    fn after_an_international_prefix_the_number_is_read_as_after_a_plus() {
        for (raw, country, e164) in [
            ("011 49 170 1234567", "US", "+491701234567"),
            ("011 86 138 1234 5678", "US", "+8613812345678"),
            ("011 33 1 42 34 56 78", "US", "+33142345678"),
            ("8 10 1 801 555 0123", "RU", "+18015550123"),
            ("011 44 020 7946 0958", "US", "+442079460958"),
            ("00 44 020 7946 0958", "DE", "+442079460958"),
            ("00 49 170 1234567", "FR", "+491701234567"),
        ] {
            assert_eq!(normalized_phone(raw, Some(country)).as_deref(), Some(e164), "{raw} with {country}");
        }
        assert_eq!(normalized_phone("00 49 170 1234567", None), None, "an international prefix needs a region");
        assert_eq!(normalized_phone("00 49 170 1234567", Some("US")), None, "00 is not the US prefix");
    }

    /// Every region the crate knows, and two codes that are no region.
    fn every_country() -> Vec<String> {
        let mut countries: Vec<String> = phonenumber::metadata::DATABASE
            .iter()
            .map(|region| region.id().to_owned())
            .filter(|id| id.parse::<phonenumber::country::Id>().is_ok())
            .collect();
        countries.extend(["UK".to_owned(), "ZZ".to_owned()]);
        countries
    }

    fn calling_codes() -> Vec<u16> {
        (1..=999u16).filter(|code| phonenumber::metadata::DATABASE.by_code(code).is_some()).collect()
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(128))]
        /// With every country, a `+` number is what it is with none; and with every region whose
        /// international prefix is a fixed digit string, that prefix in place of the `+` too.
        #[test]
        fn a_plus_numbers_e164_never_depends_on_country(
            code in proptest::sample::select(calling_codes()),
            digits in "[0-9]{2,14}",
            separator in proptest::sample::select(vec!["", " ", "-", " ("]),
        ) {
            let raw = format!("+{code}{separator}{digits}");
            let expected = normalized_phone(&raw, None);
            for country in every_country() {
                proptest::prop_assert_eq!(&normalized_phone(&raw, Some(&country)), &expected, "{} with {}", raw, country);
                let idd = DATABASE_IDD.iter().find(|(region, _)| *region == country).map(|(_, idd)| idd.clone());
                if let Some(idd) = idd {
                    let dialled = format!("{idd} {code}{separator}{digits}");
                    proptest::prop_assert_eq!(&normalized_phone(&dialled, Some(&country)), &expected, "{} with {}", dialled, country);
                }
            }
        }
    }

    /// Each region's international prefix where it is one fixed digit string.
    static DATABASE_IDD: LazyLock<Vec<(String, String)>> = LazyLock::new(|| {
        phonenumber::metadata::DATABASE
            .iter()
            .filter_map(|region| {
                let idd = region.international_prefix()?.as_str().to_owned();
                idd.bytes().all(|b| b.is_ascii_digit()).then(|| (region.id().to_owned(), idd))
            })
            .collect()
    });

    #[test]
    fn an_email_with_control_characters_is_unusable() {
        for bad in ["ann@exa\u{0}mple.com", "ann@example.com\u{0}", "\u{7f}ann@example.com", "ann\u{1b}@example.com"] {
            assert_eq!(email_hash(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_phone_with_control_characters_is_unusable() {
        assert_eq!(phone_hash("+1 415 555\u{0}2671", None), None);
        assert_eq!(phone_hash("+1 415 555 2671\u{7}", None), None);
        assert_eq!(phone_hash("\u{1f}(415) 555-2671", Some("US")), None);
    }

    #[test]
    fn an_address_with_control_characters_is_unusable() {
        assert_eq!(address_hash("1 Main\u{0} St", "94105", "US"), None);
        assert_eq!(address_hash("1 Main St\n", "94105", "US"), None);
        assert_eq!(address_hash("1 Main St", "94105\u{7f}", "US"), None);
        assert_eq!(address_hash("1 Main St", "\u{1}SW1A 2AA", "GB"), None);
        assert_eq!(address_hash("1 Main St", "1010\u{0}", "AT"), None, "also where the zip is not checked");
    }

    #[test]
    fn postal_patterns_take_ascii_digits_only() {
        // Arabic-Indic, Devanagari and full-width digits: `\d` would match them, and cutting a
        // ZIP+4 by bytes would then split a character (a panic).
        for zip in ["٩٤١٠٥", "٩٤١٠٥-١٢٣٤", "९४१०५", "９４１０５", "９４１０５-１２３４"]
        {
            for country in ["US", "DE", "FR"] {
                assert_eq!(address_hash("1 Main St", zip, country), None, "{zip} {country}");
            }
        }
        assert_eq!(address_hash("1 Main St", "k١a ٠b١", "CA"), None);
        assert_eq!(address_hash("1 Main St", "sw١a ٢aa", "GB"), None);
        assert_eq!(address_hash("1 Main St", "94105-1234", "US"), address_hash("1 Main St", "94105", "US"));
        // Countries whose zips are not checked keep any script.
        assert!(address_hash("1 Main St", "٩٤١٠٥", "EG").is_some());
    }

    #[test]
    fn e164_is_what_the_crate_formats() {
        for (raw, region) in [
            ("+39 06 1234 5678", None),
            ("+39 333 123 4567", None),
            ("(415) 555-2671", Some("US")),
            ("030 123456", Some("DE")),
            ("+44 20 7946 0958", None),
            ("+81 3-1234-5678", None),
            ("+55 11 91234-5678", None),
            ("+225 07 1234 5678", None),
            ("+1 242 357 1234", None),
            ("0612345678", Some("FR")),
        ] {
            let id = region.and_then(|code: &str| code.parse::<phonenumber::country::Id>().ok());
            let Ok(number) = phonenumber::parse(id, raw) else { panic!("{raw} parses") };
            let formatted = number.format().mode(phonenumber::Mode::E164).to_string();
            assert_eq!(phone_hash(raw, region), Some(sha256_hex(&formatted)), "{raw} = {formatted}");
        }
    }

    proptest::proptest! {
        #[test]
        fn canonical_text_is_the_fold_split_join_it_replaced(raw in "[a-zA-Z0-9 .,#/\\-\t\nΣσςİßé\u{a0}\u{3000}]{0,40}") {
            let folded: String = raw.to_lowercase().chars()
                .map(|c| if c.is_ascii_punctuation() || c.is_whitespace() { ' ' } else { c })
                .collect();
            proptest::prop_assert_eq!(canonical_text(&raw), folded.split_whitespace().collect::<Vec<_>>().join(" "));
        }
    }

    #[test]
    fn address_is_canonicalized() {
        let a = address_hash("1 Main St., Apt 4", "94105-1234", "us");
        assert_eq!(a, Some(sha256_hex("1 main st apt 4|94105|US")));
        assert_eq!(a, address_hash("  1 MAIN ST  APT 4 ", "94105", "US"));
        assert_eq!(
            address_hash("10 Downing Street", "SW1A 2AA", "GB"),
            Some(sha256_hex("10 downing street|sw1a 2aa|GB"))
        );
    }

    #[test]
    fn implausible_zips_are_dropped() {
        assert_eq!(address_hash("1 Main St", "ABCDE", "US"), None);
        assert_eq!(address_hash("1 Main St", "1234", "DE"), None);
        assert_eq!(address_hash("1 Main St", "12345", "CA"), None);
        assert_eq!(address_hash("1 Main St", "12345", "GB"), None);
        assert_eq!(address_hash("1 Main St", "123", "FR"), None);
        assert!(address_hash("1 Main St", "K1A 0B1", "CA").is_some());
        assert!(address_hash("1 Main St", "1010", "AT").is_some(), "unchecked country");
        assert_eq!(address_hash("...", "12345", "US"), None, "nothing left of line1");
    }
}
