//! The published normalization test vectors (`docs/normalization-vectors.json`, described in
//! `docs/normalization.md`) against the gateway's own code: every vector's normalized text,
//! hash and warning must be what `normalize` computes and what validation of a conversion that
//! carries it produces. The committed file is the source of truth; `write_vectors` (ignored)
//! writes it from the inputs below when a case is added:
//! `cargo test -p intake-model --test normalization_vectors -- --ignored write_vectors`.

use intake_model::conversion::Warning;
use intake_model::normalize::{normalized_address, normalized_email, normalized_phone, sha256_hex};
use intake_model::validate::{validate_conversion, Json};
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::path::PathBuf;

const VERSION: u64 = 1;
const MIN_CASES: usize = 100;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Vectors {
    version: u64,
    cases: Vec<Case>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Case {
    name: String,
    kind: Kind,
    input: Input,
    /// The conversion's `country` field.
    country: Option<String>,
    normalized: Option<String>,
    sha256: Option<String>,
    warning: Option<String>,
    client: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Kind {
    Email,
    Phone,
    Address,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
enum Input {
    Text(String),
    Address {
        line1: String,
        zip: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        country: Option<String>,
    },
}

/// What the gateway makes of a case: its normalized text and hash, or its warning.
#[derive(Debug, PartialEq)]
struct Answer {
    normalized: Option<String>,
    sha256: Option<String>,
    warning: Option<String>,
}

fn vectors_path() -> PathBuf {
    // The checkout's at run time: checkouts on this machine share one target directory, and a
    // test binary compiled in one may run in another.
    let manifest_dir = std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_else(|| env!("CARGO_MANIFEST_DIR").into());
    PathBuf::from(manifest_dir).join("../docs/normalization-vectors.json")
}

fn warning_name(warning: Warning) -> String {
    serde_json::to_value(warning).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default()
}

/// The case's answer from `normalize`, checked against what validating a conversion that
/// carries the identifier produces (the gateway's whole path up to the Kafka message).
fn answer(kind: Kind, input: &Input, country: Option<&str>) -> Answer {
    let upper = country.map(str::to_ascii_uppercase);
    let (normalized, warning, field, sent) = match (kind, input) {
        (Kind::Email, Input::Text(raw)) => (normalized_email(raw), Warning::EmailInvalid, "email_sha256", json!(raw)),
        (Kind::Phone, Input::Text(raw)) => {
            (normalized_phone(raw, upper.as_deref()), Warning::PhoneUnparseable, "phone_sha256", json!(raw))
        }
        (Kind::Address, Input::Address { line1, zip, country: address_country }) => {
            let effective = address_country
                .as_deref()
                .map(str::to_ascii_uppercase)
                .or(upper.clone())
                .unwrap_or_else(|| "US".into());
            let mut sent = json!({"line1": line1, "zip": zip});
            if let Some(address_country) = address_country {
                sent["country"] = json!(address_country);
            }
            (normalized_address(line1, zip, &effective), Warning::AddressUnparseable, "address_sha256", sent)
        }
        _ => panic!("{kind:?} with input {input:?}"),
    };
    let answer = Answer {
        sha256: normalized.as_deref().map(|text| sha256_hex(text).as_str().to_owned()),
        warning: normalized.is_none().then(|| warning_name(warning)),
        normalized,
    };

    let identifier = match kind {
        Kind::Email => "email",
        Kind::Phone => "phone",
        Kind::Address => "address",
    };
    let mut conversion = json!({"event": "lead", "external_id": "v", "occurred_at": "2025-01-01T00:00:00Z"});
    conversion[identifier] = sent;
    if let Some(country) = country {
        conversion["country"] = json!(country);
    }
    let body = conversion.to_string();
    let parsed = Json::parse(body.as_bytes()).unwrap_or_else(|e| panic!("{e}"));
    let valid = validate_conversion(&parsed, 1_780_000_000_000)
        .unwrap_or_else(|invalid| panic!("a vector must be a valid input: {invalid:?} for {body}"));
    let stored = serde_json::to_value(&valid.conversion).unwrap_or_default()[field].as_str().map(str::to_owned);
    assert_eq!(stored, answer.sha256, "validation and normalize disagree on {body}");
    let warnings: Vec<String> = valid.warnings.into_iter().map(warning_name).collect();
    assert_eq!(warnings, answer.warning.iter().cloned().collect::<Vec<_>>(), "warnings of {body}");
    answer
}

/// Whether a client hashes the case itself: every email and address, and no phone. A phone's
/// E.164 text is the phone-number crate's parse (with the conversion's country as its region
/// when it has no `+`), and a `+digits` phone is not always kept as sent (the `*_not_client`
/// cases): no client reproduces that, so clients send phones raw.
fn client_side(kind: Kind) -> bool {
    kind != Kind::Phone
}

#[test]
fn every_vector_holds() {
    let text = std::fs::read_to_string(vectors_path()).unwrap_or_else(|e| panic!("{e}"));
    let vectors: Vectors = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(vectors.version, VERSION);
    assert!(vectors.cases.len() >= MIN_CASES, "{} cases", vectors.cases.len());
    let mut names = std::collections::HashSet::new();
    for case in &vectors.cases {
        assert!(names.insert(case.name.as_str()), "two cases named {}", case.name);
        let answer = answer(case.kind, &case.input, case.country.as_deref());
        let published =
            Answer { normalized: case.normalized.clone(), sha256: case.sha256.clone(), warning: case.warning.clone() };
        assert_eq!(published, answer, "vector {}", case.name);
        assert_eq!(case.client, client_side(case.kind), "client flag of {}", case.name);
    }
}

#[test]
fn the_vectors_are_what_the_inputs_below_produce() {
    let text = std::fs::read_to_string(vectors_path()).unwrap_or_else(|e| panic!("{e}"));
    let published: Vectors = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(published, generate(), "regenerate with --ignored write_vectors, and review the diff");
}

#[test]
#[ignore = "writes docs/normalization-vectors.json"]
fn write_vectors() {
    std::fs::write(vectors_path(), render(&generate())).unwrap_or_else(|e| panic!("{e}"));
}

fn generate() -> Vectors {
    let cases = inputs()
        .into_iter()
        .map(|(name, kind, input, country)| {
            let answer = answer(kind, &input, country.as_deref());
            Case {
                name: name.to_owned(),
                kind,
                client: client_side(kind),
                input,
                country,
                normalized: answer.normalized,
                sha256: answer.sha256,
                warning: answer.warning,
            }
        })
        .collect();
    Vectors { version: VERSION, cases }
}

/// One case a line, every character outside ASCII escaped (`\u00a0`, surrogate pairs beyond
/// the BMP), so that invisible characters show in the file.
fn render(vectors: &Vectors) -> String {
    let mut out = format!("{{\"version\": {}, \"cases\": [\n", vectors.version);
    for (index, case) in vectors.cases.iter().enumerate() {
        let line = serde_json::to_string(case).unwrap_or_else(|e| panic!("{e}"));
        out.push_str("  ");
        for c in line.chars() {
            if c.is_ascii() {
                out.push(c);
            } else {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
        }
        out.push_str(if index + 1 < vectors.cases.len() { ",\n" } else { "\n" });
    }
    out.push_str("]}\n");
    out
}

type Input4 = (&'static str, Kind, Input, Option<String>);

fn email(name: &'static str, raw: &str) -> Input4 {
    (name, Kind::Email, Input::Text(raw.to_owned()), None)
}

fn phone(name: &'static str, raw: &str, country: Option<&str>) -> Input4 {
    (name, Kind::Phone, Input::Text(raw.to_owned()), country.map(str::to_owned))
}

fn address(name: &'static str, line1: &str, zip: &str, address_country: Option<&str>, country: Option<&str>) -> Input4 {
    (
        name,
        Kind::Address,
        Input::Address { line1: line1.to_owned(), zip: zip.to_owned(), country: address_country.map(str::to_owned) },
        country.map(str::to_owned),
    )
}

/// The inputs of the vectors, in the file's order. Names say what each case shows.
fn inputs() -> Vec<Input4> {
    vec![
        // Email: trimmed (Unicode White_Space), lower-cased (full Unicode), nothing else.
        email("email_plain", "ann@example.com"),
        email("email_upper_case", "Ann@Example.COM"),
        email("email_spaces_around", "  ann@example.com  "),
        email("email_gmail_dots_kept", "john.doe@gmail.com"),
        email("email_gmail_without_dots_differs", "johndoe@gmail.com"),
        email("email_plus_tag_kept", "john.doe+newsletter@gmail.com"),
        email("email_googlemail_not_mapped_to_gmail", "john.doe@googlemail.com"),
        email("email_plus_in_domain_kept", "ann@ex+ample.com"),
        email("email_nbsp_around_trimmed", "\u{a0}ann@example.com\u{a0}"),
        email("email_ideographic_space_trimmed", "\u{3000}ann@example.com\u{3000}"),
        email("email_em_space_trimmed", "\u{2003}ann@example.com"),
        email("email_line_separator_trimmed", "ann@example.com\u{2028}"),
        email("email_paragraph_separator_trimmed", "\u{2029}ann@example.com"),
        email("email_next_line_u0085_trimmed", "\u{85}ann@example.com\u{85}"),
        email("email_ogham_space_trimmed", "\u{1680}ann@example.com"),
        email("email_narrow_nbsp_trimmed", "ann@example.com\u{202f}"),
        email("email_medium_math_space_trimmed", "\u{205f}ann@example.com"),
        email("email_hair_space_trimmed", "ann@example.com\u{200a}"),
        email("email_bom_ufeff_leading_not_trimmed", "\u{feff}ann@example.com"),
        email("email_bom_ufeff_trailing_not_trimmed", "ann@example.com\u{feff}"),
        email("email_bom_ufeff_inside_kept", "ann\u{feff}@example.com"),
        email("email_zero_width_space_not_trimmed", "\u{200b}ann@example.com"),
        email("email_mongolian_vowel_separator_not_trimmed", "ann@example.com\u{180e}"),
        email("email_soft_hyphen_kept", "an\u{ad}n@example.com"),
        email("email_tab_leading_is_control", "\tann@example.com"),
        email("email_newline_trailing_is_control", "ann@example.com\n"),
        email("email_crlf_trailing_is_control", "ann@example.com\r\n"),
        email("email_nul_is_control", "ann@exa\u{0}mple.com"),
        email("email_del_is_control", "\u{7f}ann@example.com"),
        email("email_escape_is_control", "ann\u{1b}@example.com"),
        email("email_space_inside", "ann smith@example.com"),
        email("email_nbsp_inside", "ann\u{a0}smith@example.com"),
        email("email_ideographic_space_inside", "ann@example\u{3000}.com"),
        email("email_display_name_form", "Ann <ann@example.com>"),
        email("email_angle_brackets_kept", "<ann@example.com>"),
        email("email_mailto_prefix_kept", "mailto:ann@example.com"),
        email("email_quoted_local_part", "\"ann\"@example.com"),
        email("email_ip_literal_domain", "ann@[192.168.0.1]"),
        email("email_dots_at_local_edges_kept", ".ann.@example.com"),
        email("email_only_spaces", "   "),
        email("email_no_at", "ann.example.com"),
        email("email_empty_domain", "ann@"),
        email("email_empty_local_part", "@example.com"),
        email("email_domain_without_dot", "ann@localhost"),
        email("email_two_ats", "a@b@example.com"),
        email("email_domain_leading_dot", "ann@.example.com"),
        email("email_domain_trailing_dot", "ann@example.com."),
        email("email_domain_double_dot", "ann@example..com"),
        email("email_latin_accents_lower_cased", "J\u{dc}RGEN@M\u{dc}LLER.DE"),
        email("email_nfc_e_acute", "jos\u{e9}@example.com"),
        email("email_nfd_e_combining_acute_differs", "jose\u{301}@example.com"),
        email("email_idn_domain_unicode", "user@B\u{dc}CHER.de"),
        email("email_idn_domain_punycode_differs", "user@xn--bcher-kva.de"),
        email(
            "email_cyrillic",
            "\u{418}\u{432}\u{430}\u{43d}@\u{41f}\u{440}\u{438}\u{43c}\u{435}\u{440}.\u{440}\u{444}",
        ),
        email("email_greek_final_sigma", "\u{39f}\u{394}\u{3a5}\u{3a3}\u{3a3}\u{395}\u{3a5}\u{3a3}@example.gr"),
        email("email_greek_sigma_before_dot_not_final", "\u{3a3}\u{391}\u{3a3}.\u{3a3}\u{391}\u{3a3}@example.gr"),
        email("email_turkish_dotted_capital_i", "\u{130}STANBUL@example.com.tr"),
        email("email_turkish_dotless_i_kept", "\u{131}lker@example.com.tr"),
        email("email_german_sharp_s_kept", "stra\u{df}e@example.de"),
        email("email_capital_sharp_s", "STRA\u{1e9e}E@example.de"),
        email("email_kelvin_sign_to_ascii_k", "\u{212a}ELVIN@example.com"),
        email("email_titlecase_digraph", "\u{1c5}ord@example.com"),
        email("email_cherokee", "\u{13a0}\u{13a1}@example.com"),
        email("email_georgian_mtavruli", "\u{1c90}\u{1c91}@example.ge"),
        email("email_fullwidth_letters_not_folded", "\u{ff21}\u{ff2e}\u{ff2e}@example.com"),
        email("email_fullwidth_at_sign_is_no_at", "ann\u{ff20}example.com"),
        email("email_arabic_indic_digits_kept", "user\u{661}\u{662}\u{663}@example.com"),
        email("email_cjk_local_part", "\u{7528}\u{6237}@\u{4f8b}\u{5b50}.\u{4e2d}\u{56fd}"),
        email(
            "email_arabic_script",
            "\u{645}\u{633}\u{62a}\u{62e}\u{62f}\u{645}@\u{645}\u{62b}\u{627}\u{644}.\u{645}\u{635}\u{631}",
        ),
        email("email_emoji_beyond_bmp", "\u{1f600}@example.com"),
        // Phone: E.164 with its leading `+`. The conversion's country is the default region of a
        // phone without `+` only. Clients send every phone raw.
        phone("phone_e164_us", "+14155552671", None),
        phone("phone_e164_gb", "+442079460958", None),
        phone("phone_e164_gb_mobile", "+447911123456", None),
        phone("phone_e164_de_short", "+4930123456", None),
        phone("phone_e164_fr", "+33612345678", None),
        phone("phone_e164_it_leading_zero_kept", "+390612345678", None),
        phone("phone_e164_jp", "+81312345678", None),
        phone("phone_e164_br", "+5511912345678", None),
        phone("phone_e164_ci_leading_zero_kept", "+2250712345678", None),
        phone("phone_e164_bs_nanp", "+12423571234", None),
        phone("phone_e164_in", "+919876543210", None),
        phone("phone_e164_au", "+61412345678", None),
        phone("phone_e164_cn", "+8613812345678", None),
        phone("phone_e164_ae", "+971501234567", None),
        phone("phone_e164_eg", "+201001234567", None),
        phone("phone_e164_ru", "+79161234567", None),
        phone("phone_e164_es", "+34612345678", None),
        phone("phone_e164_with_other_country", "+14155552671", Some("DE")),
        phone("phone_e164_with_unknown_region_uk", "+442079460958", Some("UK")),
        phone("phone_plus_trunk_zero_dropped_not_client", "+4402079460958", None),
        phone("phone_plus_too_short_not_client", "+1415555267", None),
        phone("phone_plus_too_long_not_client", "+141555526711", None),
        phone("phone_plus_zero_country_code", "+0123456789", None),
        phone("phone_plus_trunk_zero_with_country_gb_not_client", "+4402079460958", Some("GB")),
        phone("phone_plus_de_mobile_with_country_us", "+491701234567", Some("US")),
        phone("phone_plus_de_mobile_with_country_de", "+491701234567", Some("DE")),
        phone("phone_plus_us_with_country_ru", "+18015550123", Some("RU")),
        phone("phone_plus_cn_mobile_with_country_us", "+8613812345678", Some("US")),
        phone("phone_plus_fr_with_country_us", "+33142345678", Some("US")),
        phone("phone_plus_then_international_prefix", "+011 49 170 1234567", Some("US")),
        phone("phone_us_national_format", "(415) 555-2671", Some("US")),
        phone("phone_us_lower_case_country", "(415) 555-2671", Some("us")),
        phone("phone_us_dashes", "415-555-2671", Some("US")),
        phone("phone_us_dots", "415.555.2671", Some("US")),
        phone("phone_us_leading_1", "1 415 555 2671", Some("US")),
        phone("phone_us_without_country", "(415) 555-2671", None),
        phone("phone_us_with_unknown_region_zz", "4155552671", Some("ZZ")),
        phone("phone_plus_spaces", "+1 415 555 2671", None),
        phone("phone_plus_dashes_parentheses", "+1 (415) 555-2671", None),
        phone("phone_plus_with_other_country", "+1 415 555 2671", Some("DE")),
        phone("phone_international_prefix_00_from_de", "00 1 415 555 2671", Some("DE")),
        phone("phone_international_prefix_011_from_us", "011 44 20 7946 0958", Some("US")),
        phone("phone_international_prefix_011_de_mobile_from_us", "011 49 170 1234567", Some("US")),
        phone("phone_international_prefix_011_trunk_zero_from_us", "011 44 020 7946 0958", Some("US")),
        phone("phone_international_prefix_810_from_ru", "8 10 1 801 555 0123", Some("RU")),
        phone("phone_international_prefix_00_without_country", "00 49 170 1234567", None),
        phone("phone_gb_national", "020 7946 0958", Some("GB")),
        phone("phone_gb_national_with_unknown_region_uk", "020 7946 0958", Some("UK")),
        phone("phone_gb_plus_with_unknown_region_uk", "+44 20 7946 0958", Some("UK")),
        phone("phone_gb_plus_with_trunk_zero_in_parentheses", "+44 (0)20 7946 0958", None),
        phone("phone_gb_mobile_national", "07911 123456", Some("GB")),
        phone("phone_de_national", "030 123456", Some("DE")),
        phone("phone_fr_national", "06 12 34 56 78", Some("FR")),
        phone("phone_it_national_leading_zero_kept", "06 1234 5678", Some("IT")),
        phone("phone_jp_national", "03-1234-5678", Some("JP")),
        phone("phone_in_national", "098765 43210", Some("IN")),
        phone(
            "phone_fullwidth_digits",
            "\u{ff0b}\u{ff11} \u{ff14}\u{ff11}\u{ff15} \u{ff15}\u{ff15}\u{ff15} \u{ff12}\u{ff16}\u{ff17}\u{ff11}",
            None,
        ),
        phone(
            "phone_arabic_indic_digits",
            "+\u{661} \u{664}\u{661}\u{665} \u{665}\u{665}\u{665} \u{662}\u{666}\u{667}\u{661}",
            None,
        ),
        phone(
            "phone_persian_digits",
            "\u{6f0}\u{6f9}\u{6f1}\u{6f2} \u{6f3}\u{6f4}\u{6f5} \u{6f6}\u{6f7}\u{6f8}\u{6f9}",
            Some("IR"),
        ),
        phone(
            "phone_devanagari_digits",
            "+\u{96f}\u{96e} \u{96f}\u{96e}\u{967}\u{966}\u{966} \u{967}\u{967}\u{967}\u{967}\u{967}",
            None,
        ),
        phone("phone_nbsp_separated", "+1\u{a0}415\u{a0}555\u{a0}2671", None),
        phone("phone_bom_leading", "\u{feff}+14155552671", None),
        phone("phone_vanity_letters", "1-800-FLOWERS", Some("US")),
        phone("phone_extension_ext", "+1 415 555 2671 ext. 123", None),
        phone("phone_extension_x", "+1 415 555 2671 x123", None),
        phone("phone_rfc3966_tel_uri", "tel:+1-415-555-2671", None),
        phone("phone_double_plus", "++14155552671", None),
        phone("phone_too_short", "12", Some("US")),
        phone("phone_letters_only", "not a phone", Some("US")),
        phone("phone_de_too_short", "+49 30 1", None),
        phone("phone_newline_is_control", "+1 415 555 2671\n", None),
        phone("phone_tab_is_control", "\t+14155552671", None),
        // Address: `line1|zip|country`, case-folded, ASCII punctuation to spaces, white space
        // collapsed; ZIP+4 cut; country from the address, else the conversion, else US.
        address("address_us_basic", "1 Main St., Apt 4", "94105", None, None),
        address("address_us_zip_plus4_dash", "1 Main St., Apt 4", "94105-1234", None, None),
        address("address_us_zip_plus4_space", "1 Main St., Apt 4", "94105 1234", None, None),
        address("address_us_zip_plus4_run_together", "1 Main St., Apt 4", "941051234", None, None),
        address("address_us_explicit_country", "1 Main St., Apt 4", "94105", Some("US"), None),
        address("address_us_lower_case_address_country", "1 Main St., Apt 4", "94105", Some("us"), None),
        address("address_us_from_conversion_country", "1 Main St., Apt 4", "94105", None, Some("US")),
        address("address_us_upper_case_and_extra_spaces", "  1  MAIN ST   APT 4 ", "  94105 ", None, None),
        address("address_us_hash_sign", "1 Main St #4", "94105", None, None),
        address("address_us_pipe_in_line", "1 Main St | Apt 4", "94105", None, None),
        address("address_us_underscores", "1_Main_St", "94105", None, None),
        address("address_us_abbreviation_not_expanded", "1 Main Street Apartment 4", "94105", None, None),
        address("address_us_nbsp_collapsed", "1\u{a0}Main\u{a0}St", "94105", None, None),
        address("address_us_ideographic_space_collapsed", "1\u{3000}Main\u{3000}St", "94105", None, None),
        address("address_us_bom_kept", "\u{feff}1 Main St", "94105", None, None),
        address("address_us_zero_width_space_kept", "1 Main\u{200b} St", "94105", None, None),
        address("address_us_zip_four_digits", "1 Main St", "9410", None, None),
        address("address_us_zip_letters", "1 Main St", "ABCDE", None, None),
        address("address_us_zip_plus_two", "1 Main St", "94105-12", None, None),
        address("address_us_zip_arabic_indic_digits", "1 Main St", "\u{669}\u{664}\u{661}\u{660}\u{665}", None, None),
        address("address_us_zip_fullwidth_digits", "1 Main St", "\u{ff19}\u{ff14}\u{ff11}\u{ff10}\u{ff15}", None, None),
        address("address_us_zip_devanagari_digits", "1 Main St", "\u{96f}\u{96a}\u{967}\u{966}\u{96b}", None, None),
        address("address_us_zip_only_punctuation", "1 Main St", "--", None, None),
        address("address_line_only_punctuation", "...", "94105", None, None),
        address("address_line_tab_is_control", "1 Main St\tApt 4", "94105", None, None),
        address("address_line_newline_is_control", "1 Main St\nApt 4", "94105", None, None),
        address("address_zip_nul_is_control", "1 Main St", "94105\u{0}", None, None),
        address("address_ca", "24 Sussex Dr.", "K1A 0B1", Some("CA"), None),
        address("address_ca_lower_case", "24 sussex dr", "k1a 0b1", Some("CA"), None),
        address("address_ca_without_space_differs", "24 Sussex Dr.", "K1A0B1", Some("CA"), None),
        address("address_ca_dash", "24 Sussex Dr.", "K1A-0B1", Some("CA"), None),
        address("address_ca_from_conversion_country", "24 Sussex Dr.", "K1A 0B1", None, Some("CA")),
        address("address_ca_zip_digits_only", "24 Sussex Dr.", "12345", Some("CA"), None),
        address("address_ca_zip_arabic_indic_digit", "24 Sussex Dr.", "K\u{661}A 0B1", Some("CA"), None),
        address("address_gb", "10 Downing Street", "SW1A 2AA", Some("GB"), None),
        address("address_gb_without_space_differs", "10 Downing Street", "SW1A2AA", Some("GB"), None),
        address("address_gb_from_conversion_country_lower_case", "10 Downing Street", "SW1A 2AA", None, Some("gb")),
        address("address_gb_ec1a", "1 St Martin's Le Grand", "EC1A 1BB", Some("GB"), None),
        address("address_gb_m1", "1 Piccadilly", "M1 1AE", Some("GB"), None),
        address("address_gb_dn55", "1 High St", "DN55 1PT", Some("GB"), None),
        address("address_gb_zip_digits", "10 Downing Street", "12345", Some("GB"), None),
        address("address_gb_outward_code_only", "10 Downing Street", "SW1A", Some("GB"), None),
        address("address_unknown_region_uk_not_checked", "10 Downing Street", "SW1A 2AA", Some("UK"), None),
        address("address_unknown_region_uk_from_conversion", "10 Downing Street", "SW1A 2AA", None, Some("UK")),
        address("address_address_country_wins", "10 Downing Street", "SW1A 2AA", Some("GB"), Some("US")),
        address("address_de", "Hauptstra\u{df}e 5", "10115", Some("DE"), None),
        address("address_de_sharp_s_kept", "Stra\u{df}e 1", "10115", Some("DE"), None),
        address("address_de_ss_differs", "STRASSE 1", "10115", Some("DE"), None),
        address("address_de_capital_sharp_s", "STRA\u{1e9e}E 1", "10115", Some("DE"), None),
        address("address_de_zip_four_digits", "Hauptstr. 5", "1011", Some("DE"), None),
        address("address_de_zip_with_country_prefix", "Hauptstr. 5", "D-10115", Some("DE"), None),
        address("address_fr", "55 Rue du Faubourg Saint-Honor\u{e9}", "75008", Some("FR"), None),
        address("address_fr_ascii_apostrophe_to_space", "3 Rue de l'\u{c9}glise", "75008", Some("FR"), None),
        address("address_fr_typographic_apostrophe_kept", "3 Rue de l\u{2019}\u{c9}glise", "75008", Some("FR"), None),
        address("address_fr_zip_with_space", "3 Rue de la Paix", "750 08", Some("FR"), None),
        address("address_fr_corsica", "1 Cours Napol\u{e9}on", "20000", Some("FR"), None),
        address("address_at_not_checked", "Stephansplatz 1", "1010", Some("AT"), None),
        address("address_nl_not_checked", "Damrak 1", "1012 LG", Some("NL"), None),
        address("address_jp_not_checked", "\u{5343}\u{4ee3}\u{7530}1-1", "100-0001", Some("JP"), None),
        address(
            "address_jp_fullwidth_digits_kept",
            "\u{5343}\u{4ee3}\u{7530}\u{ff11}\u{2212}\u{ff11}",
            "\u{ff11}\u{ff10}\u{ff10}\u{2212}\u{ff10}\u{ff10}\u{ff10}\u{ff11}",
            Some("JP"),
            None,
        ),
        address("address_br_not_checked", "Av. Paulista, 1000", "01310-100", Some("BR"), None),
        address(
            "address_ru_cyrillic",
            "\u{443}\u{43b}. \u{422}\u{432}\u{435}\u{440}\u{441}\u{43a}\u{430}\u{44f}, \u{434}. 7",
            "125009",
            Some("RU"),
            None,
        ),
        address(
            "address_gr_final_sigma",
            "\u{39f}\u{394}\u{39f}\u{3a3} \u{391}\u{398}\u{397}\u{39d}\u{391}\u{3a3} 10",
            "10551",
            Some("GR"),
            None,
        ),
        address("address_tr_dotted_capital_i", "\u{130}stiklal Caddesi 10", "34433", Some("TR"), None),
        address(
            "address_eg_arabic",
            "\u{634}\u{627}\u{631}\u{639} \u{627}\u{644}\u{62a}\u{62d}\u{631}\u{64a}\u{631} \u{665}",
            "\u{661}\u{661}\u{665}\u{661}\u{661}",
            Some("EG"),
            None,
        ),
        address("address_fullwidth_comma_kept", "\u{ff11}\u{ff12}\u{ff13} Main St\u{ff0c}Apt 4", "94105", None, None),
        address("address_unchecked_zip_only_punctuation", "Stephansplatz 1", "--", Some("AT"), None),
    ]
}
