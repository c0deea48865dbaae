//! `value` as an exact decimal (docs/api.md, "Numbers"): the canonical text of what was sent, from a
//! numeric string or from a JSON number's own text (serde_json's `arbitrary_precision` keeps
//! it), never through `f64`. `"12.50"`, `12.5` and `1.25e1` are the same value, `"12.5"`.
//!
//! Written here rather than with a decimal crate: the input is already digits (the JSON grammar
//! or the string pattern guarantees it), the output is text, and a crate such as rust_decimal
//! refuses exact values it cannot hold in 96 bits (`0e-40`, forty zero decimals) that are
//! simply 0 here.

/// The largest value, in currency units.
pub(crate) const MAX_VALUE: u64 = 1_000_000_000;
/// Decimals a JSON number's exact value may have. SPEC bounds a number by its range only (the
/// string form has a pattern of its own), so `0.1234567` and a float's `0.30000000000000004`
/// are kept as sent; 1,000 holds every decimal of any float (the smallest has 324) and keeps a
/// chunk of 100 items far below Kafka's 1 MB message size.
pub(crate) const MAX_NUMBER_DECIMALS: usize = 1_000;
/// Past this an exponent is clamped: more than the digits any body can hold, so that no digits
/// written beside a clamped exponent can bring its value back into range.
const EXPONENT_CLAMP: i64 = 10_000_000;

/// Canonical text (no leading zeros, no trailing fractional zeros, `-0` is `0`) of a JSON
/// number's text, when it is 0 to [`MAX_VALUE`] with at most [`MAX_NUMBER_DECIMALS`] decimals
/// in its exact value. `None` for anything else, including text that is not a JSON number.
pub(crate) fn json_number_value(text: &str) -> Option<String> {
    let (negative, unsigned) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text),
    };
    let (mantissa, exponent) = match unsigned.split_once(['e', 'E']) {
        Some((mantissa, exponent)) => (mantissa, exponent_value(exponent)?),
        None => (unsigned, 0),
    };
    let (whole, fraction) = match mantissa.split_once('.') {
        Some((_, "")) => return None,
        Some(parts) => parts,
        None => (mantissa, ""),
    };
    if whole.is_empty() || !all_ascii_digits(whole) || !all_ascii_digits(fraction) {
        return None;
    }
    // The value is `significant × 10^scale`, `significant` without leading or trailing zeros.
    let digits = format!("{whole}{fraction}");
    let significant = digits.trim_start_matches('0');
    let trailing_zeros = significant.len() - significant.trim_end_matches('0').len();
    let significant = significant.trim_end_matches('0');
    if significant.is_empty() {
        return Some("0".to_owned());
    }
    if negative {
        return None;
    }
    // Each term is bounded (exponent by `exponent_value`, the others by the body's size).
    let scale = exponent - to_i64(fraction.len()) + to_i64(trailing_zeros);
    let decimals = usize::try_from(-scale).unwrap_or(0);
    let whole_digits = to_i64(significant.len()) + scale;
    if decimals > MAX_NUMBER_DECIMALS || whole_digits > 10 {
        return None;
    }
    let text = if scale >= 0 {
        format!("{significant}{}", "0".repeat(usize::try_from(scale).unwrap_or(0)))
    } else if whole_digits > 0 {
        let (whole, fraction) = significant.split_at(significant.len() - decimals);
        format!("{whole}.{fraction}")
    } else {
        format!("0.{}{significant}", "0".repeat(decimals - significant.len()))
    };
    within_range(&text).then_some(text)
}

/// Canonical text of a string that matched `^[0-9]{1,10}(\.[0-9]{1,6})?$`. The string form
/// follows its pattern only (docs/api.md, "Numbers"), up to 9999999999.999999.
pub(crate) fn numeric_string_value(text: &str) -> String {
    let (whole, fraction) = text.split_once('.').unwrap_or((text, ""));
    let whole = whole.trim_start_matches('0');
    let whole = if whole.is_empty() { "0" } else { whole };
    let fraction = fraction.trim_end_matches('0');
    if fraction.is_empty() {
        whole.to_owned()
    } else {
        format!("{whole}.{fraction}")
    }
}

/// The exponent of a JSON number, clamped to ±[`EXPONENT_CLAMP`]: beyond it no non-zero value
/// is in range, and the clamp keeps `1e99999999999999999999` from overflowing.
fn exponent_value(text: &str) -> Option<i64> {
    let (negative, digits) = match text.strip_prefix('-') {
        Some(digits) => (true, digits),
        None => (false, text.strip_prefix('+').unwrap_or(text)),
    };
    if digits.is_empty() || !all_ascii_digits(digits) {
        return None;
    }
    let digits = digits.trim_start_matches('0');
    let magnitude =
        if digits.len() > 8 { EXPONENT_CLAMP } else { digits.parse::<i64>().unwrap_or(0).min(EXPONENT_CLAMP) };
    Some(if negative { -magnitude } else { magnitude })
}

/// Canonical text is within 0 to [`MAX_VALUE`].
fn within_range(canonical: &str) -> bool {
    let (whole, fraction) = canonical.split_once('.').unwrap_or((canonical, ""));
    match whole.parse::<u64>() {
        Ok(whole) if whole < MAX_VALUE => true,
        Ok(whole) => whole == MAX_VALUE && fraction.is_empty(),
        Err(_) => false,
    }
}

fn all_ascii_digits(text: &str) -> bool {
    text.bytes().all(|b| b.is_ascii_digit())
}

fn to_i64(length: usize) -> i64 {
    i64::try_from(length).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_numbers_are_kept_exactly() {
        let smallest_float = format!("0.{}5", "0".repeat(323));
        let thousandth_decimal = format!("0.{}1", "0".repeat(999));
        let digits_then_exponent = format!("1{}e-1000010", "0".repeat(1_000_000));
        let cases = [
            ("0", "0"),
            ("-0", "0"),
            ("-0.0e5", "0"),
            ("0e-40", "0"),
            ("0.000000000000000000000000000000000000000", "0"),
            ("12.5", "12.5"),
            ("12.50", "12.5"),
            ("1.25e1", "12.5"),
            ("125E-1", "12.5"),
            ("0.1", "0.1"),
            ("123456789.123456", "123456789.123456"),
            ("999999999.999999", "999999999.999999"),
            ("1000000000", "1000000000"),
            ("1e9", "1000000000"),
            ("1000000000.000000000", "1000000000"),
            ("1e-6", "0.000001"),
            ("1e-05", "0.00001"),
            ("0.0000010", "0.000001"),
            ("12.5000000", "12.5"),
            ("1e3", "1000"),
            ("1E+3", "1000"),
            ("100e-2", "1"),
            ("0.10000000000000000000", "0.1"),
            ("0.0000001", "0.0000001"),
            ("1e-7", "0.0000001"),
            ("0.1234567", "0.1234567"),
            ("0.10000000000000001", "0.10000000000000001"),
            ("0.30000000000000004", "0.30000000000000004"),
            ("5e-324", smallest_float.as_str()),
            ("1e-1000", thousandth_decimal.as_str()),
            // Digits beside an exponent as large as a body can hold are counted, not clamped.
            (digits_then_exponent.as_str(), "0.0000000001"),
            ("999999999.9999999999", "999999999.9999999999"),
        ];
        for (text, expected) in cases {
            assert_eq!(json_number_value(text).as_deref(), Some(expected), "{text}");
        }
    }

    #[test]
    fn json_numbers_out_of_range_or_too_precise_are_refused() {
        for text in [
            "-1",
            "-0.5",
            "-1e-9",
            "1000000000.5",
            "1000000001",
            "1e10",
            "10000000000",
            "1.0000001e9",
            "1e99999999999999999999",
            "1e-99999999999999999999",
            "1e-1001",
            "1.5e-1000",
            "99999999999999999999999999999999",
            "",
            "-",
            "1.",
            ".5",
            "1e",
            "1e+",
            "abc",
            "٩",
        ] {
            assert_eq!(json_number_value(text), None, "{text}");
        }
    }

    #[test]
    fn numeric_strings_are_canonical() {
        for (text, expected) in
            [("12.50", "12.5"), ("0012", "12"), ("0.000000", "0"), ("9999999999.999999", "9999999999.999999")]
        {
            assert_eq!(numeric_string_value(text), expected, "{text}");
        }
    }
}
