//! Canonical intent: the one form every duplicate check compares.
//!
//! A call's arguments are parsed strictly (one JSON value, no duplicate object keys), the
//! tool's declared volatile fields are removed (a value that held nothing but volatile fields
//! goes with them), declared string fields are normalised, and the result is written with
//! sorted object keys, no insignificant whitespace and one spelling per exact decimal value
//! (`100`, `100.0` and `1e2` are the same; `100` and `100.000000000000001` are not; numbers
//! never pass through floating point). The intent fingerprint is blake3 over the tool
//! name and those bytes. Deterministic by construction: no model judges similarity, and
//! reordering keys can never bypass a check because nothing ever hashes the raw text except the
//! audit-only request fingerprint.

use std::collections::BTreeMap;
use std::fmt;

use crate::store::keys::DeriveKey;
use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};

/// Errors in arguments or schemas; each names what is wrong in one sentence.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CanonicalError {
    /// The arguments are not one valid JSON value.
    #[error("arguments are not valid JSON: {0}")]
    InvalidJson(String),
    /// A field path in an intent schema is malformed.
    #[error("invalid field path {path:?}: {why}")]
    InvalidPath {
        /// The path as given.
        path: String,
        /// What is wrong with it.
        why: &'static str,
    },
}

/// One segment of a [`FieldPath`].
#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    /// An object key (or, on an array, a decimal index).
    Key(String),
    /// Any object key or any array element.
    Any,
}

/// A dotted path into a JSON value (`meta.request_id`, `items.*.nonce`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldPath(Vec<Segment>);

impl FieldPath {
    /// Parses a dotted path; `*` matches any key or element.
    pub fn parse(path: &str) -> Result<Self, CanonicalError> {
        let invalid = |why| CanonicalError::InvalidPath {
            path: path.to_owned(),
            why,
        };
        if path.is_empty() {
            return Err(invalid("it is empty"));
        }
        if path.len() > 512 {
            return Err(invalid("it is longer than 512 bytes"));
        }
        let segments = path
            .split('.')
            .map(|s| match s {
                "" => Err(invalid("it has an empty segment")),
                "*" => Ok(Segment::Any),
                key => Ok(Segment::Key(key.to_owned())),
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self(segments))
    }
}

/// How string values at the normalised paths are rewritten before fingerprinting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StringRule {
    /// Compare exactly.
    #[default]
    Exact,
    /// Trim surrounding whitespace.
    Trim,
    /// Trim, then lowercase.
    TrimLowercase,
}

/// A tool's intent schema, parsed and ready to apply.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IntentSchema {
    volatile: Vec<FieldPath>,
    normalized: Vec<FieldPath>,
    rule: StringRule,
}

impl IntentSchema {
    /// Builds a schema from its declared paths.
    pub fn new(
        volatile_fields: &[String],
        normalized_fields: &[String],
        rule: StringRule,
    ) -> Result<Self, CanonicalError> {
        let parse = |paths: &[String]| {
            paths
                .iter()
                .map(|p| FieldPath::parse(p))
                .collect::<Result<Vec<_>, _>>()
        };
        Ok(Self {
            volatile: parse(volatile_fields)?,
            normalized: parse(normalized_fields)?,
            rule,
        })
    }

    /// Does some volatile path name an array element by index? Then vanished elements are
    /// blanked rather than removed (see [`strip`]).
    fn blanks_elements(&self) -> bool {
        self.volatile.iter().any(|p| {
            p.0.iter()
                .any(|s| matches!(s, Segment::Key(k) if k.parse::<usize>().is_ok()))
        })
    }
}

/// A 32-byte blake3 digest.
pub type Fingerprint = [u8; 32];

/// Parses arguments strictly: one JSON value, and an object may not repeat a key (parsers
/// disagree on which duplicate wins, so accepting one would let the tool and the fence see
/// different calls).
pub fn parse_arguments(text: &str) -> Result<Value, CanonicalError> {
    let mut de = serde_json::Deserializer::from_str(text);
    let StrictValue(value) = StrictValue::deserialize(&mut de)
        .map_err(|e| CanonicalError::InvalidJson(e.to_string()))?;
    de.end()
        .map_err(|e| CanonicalError::InvalidJson(e.to_string()))?;
    Ok(value)
}

/// The canonical intent bytes of `args` under `schema`.
pub fn canonical_intent(args: &Value, schema: &IntentSchema) -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    if schema.volatile.is_empty()
        && (schema.rule == StringRule::Exact || schema.normalized.is_empty())
    {
        // Nothing to strip or normalise: no copy to edit.
        write_canonical(args, &mut out);
        return out;
    }
    let mut value = args.clone();
    let volatile: Vec<&[Segment]> = schema.volatile.iter().map(|p| &p.0[..]).collect();
    strip(&mut value, &volatile, schema.blanks_elements());
    if schema.rule != StringRule::Exact {
        for path in &schema.normalized {
            normalize_path(&mut value, &path.0, schema.rule);
        }
    }
    write_canonical(&value, &mut out);
    out
}

/// blake3 over the tool name and the canonical intent: equal for the same intent, whatever the
/// volatile fields, key order, whitespace or number spelling.
pub fn intent_fingerprint(tool: &str, canonical: &[u8]) -> Fingerprint {
    static CONTEXT: DeriveKey = DeriveKey::new("fence.v1 intent fingerprint");
    let mut h = CONTEXT.hasher();
    h.update(&(tool.len() as u64).to_be_bytes());
    h.update(tool.as_bytes());
    h.update(canonical);
    *h.finalize().as_bytes()
}

/// blake3 over the tool name and the raw arguments as sent (audit only; never used to match).
pub fn request_fingerprint(tool: &str, raw_arguments: &str) -> Fingerprint {
    static CONTEXT: DeriveKey = DeriveKey::new("fence.v1 request fingerprint");
    let mut h = CONTEXT.hasher();
    h.update(&(tool.len() as u64).to_be_bytes());
    h.update(tool.as_bytes());
    h.update(raw_arguments.as_bytes());
    *h.finalize().as_bytes()
}

/// Removes every field the `paths` (all applied at once, so their order does not matter) mark
/// volatile from `value`. Returns true when `value` held nothing but volatile fields: it had
/// some, and nothing else is left. Such a value leaves no trace in its parent (a retry that
/// adds an optional `"meta": {"trace_id": ..}` is the same call): an object member is removed,
/// and an array element too unless `blank` says the schema addresses array elements by index,
/// where removing one would shift the next into its place (and canonicalising again would then
/// remove that too: the fuzzer found this, kept in fuzz/regressions/canonical), so it is
/// blanked to `null` instead, as an element named by index itself always is.
fn strip(value: &mut Value, paths: &[&[Segment]], blank: bool) -> bool {
    if paths.is_empty() {
        return false;
    }
    match value {
        Value::Object(map) => {
            let mut removed = false;
            map.retain(|key, child| {
                let mut terminal = false;
                let mut sub: Vec<&[Segment]> = Vec::new();
                for (head, rest) in paths.iter().filter_map(|p| p.split_first()) {
                    if matches!(head, Segment::Key(k) if k != key) {
                        continue;
                    }
                    if rest.is_empty() {
                        terminal = true;
                    } else {
                        sub.push(rest);
                    }
                }
                let gone = terminal || strip(child, &sub, blank);
                removed |= gone;
                !gone
            });
            removed && map.is_empty()
        }
        Value::Array(items) => {
            let n = items.len();
            let mut vanished = 0;
            let mut kept = Vec::with_capacity(n);
            for (i, mut child) in std::mem::take(items).into_iter().enumerate() {
                let (mut any_terminal, mut index_terminal) = (false, false);
                let mut sub: Vec<&[Segment]> = Vec::new();
                for (head, rest) in paths.iter().filter_map(|p| p.split_first()) {
                    let index = match head {
                        Segment::Any => false,
                        Segment::Key(k) if k.parse::<usize>() == Ok(i) => true,
                        Segment::Key(_) => continue,
                    };
                    match (rest.is_empty(), index) {
                        (true, false) => any_terminal = true,
                        (true, true) => index_terminal = true,
                        (false, _) => sub.push(rest),
                    }
                }
                if any_terminal {
                    vanished += 1;
                } else if index_terminal || strip(&mut child, &sub, blank) {
                    vanished += 1;
                    if index_terminal || blank {
                        kept.push(Value::Null);
                    }
                } else {
                    kept.push(child);
                }
            }
            *items = kept;
            vanished > 0 && vanished == n
        }
        _ => false,
    }
}

fn normalize_path(value: &mut Value, path: &[Segment], rule: StringRule) {
    let Some((head, rest)) = path.split_first() else {
        if let Value::String(s) = value {
            let trimmed = s.trim();
            *s = match rule {
                StringRule::Exact => return,
                StringRule::Trim => trimmed.to_owned(),
                StringRule::TrimLowercase => trimmed.to_lowercase(),
            };
        }
        return;
    };
    match (value, head) {
        (Value::Object(map), Segment::Key(k)) => {
            if let Some(child) = map.get_mut(k) {
                normalize_path(child, rest, rule);
            }
        }
        (Value::Object(map), Segment::Any) => {
            map.values_mut().for_each(|c| normalize_path(c, rest, rule));
        }
        (Value::Array(items), Segment::Any) => {
            items.iter_mut().for_each(|c| normalize_path(c, rest, rule));
        }
        (Value::Array(items), Segment::Key(k)) => {
            if let Some(child) = k.parse::<usize>().ok().and_then(|i| items.get_mut(i)) {
                normalize_path(child, rest, rule);
            }
        }
        _ => {}
    }
}

/// Writes `value` with sorted keys and canonical numbers. Sorting here (rather than relying on
/// `serde_json::Map`'s order) keeps the form stable even if a dependency enables
/// `preserve_order` through feature unification.
fn write_canonical(value: &Value, out: &mut Vec<u8>) {
    match value {
        Value::Null => out.extend_from_slice(b"null"),
        Value::Bool(b) => out.extend_from_slice(if *b { b"true" } else { b"false" }),
        Value::Number(n) => write_number(n, out),
        Value::String(s) => write_string(s, out),
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_canonical(item, out);
            }
            out.push(b']');
        }
        Value::Object(map) => {
            out.push(b'{');
            let mut member = |i: usize, k: &String, v: &Value| {
                if i > 0 {
                    out.push(b',');
                }
                write_string(k, out);
                out.push(b':');
                write_canonical(v, out);
            };
            if map.keys().is_sorted() {
                // serde_json's own map is sorted already (the common case): no second one.
                for (i, (k, v)) in map.iter().enumerate() {
                    member(i, k, v);
                }
            } else {
                let sorted: BTreeMap<&String, &Value> = map.iter().collect();
                for (i, (k, v)) in sorted.into_iter().enumerate() {
                    member(i, k, v);
                }
            }
            out.push(b'}');
        }
    }
}

/// A JSON string as serde_json writes it (its escaping is deterministic), straight into `out`.
fn write_string(s: &str, out: &mut Vec<u8>) {
    serde_json::to_writer(&mut *out, s).expect("writing a string into a Vec cannot fail");
}

fn write_number(n: &Number, out: &mut Vec<u8>) {
    // Parsed numbers are canonical already (see `StrictVisitor`); anything else is made so.
    let text = n.to_string();
    match canonical_number(&text) {
        Ok(canonical) => out.extend_from_slice(canonical.as_bytes()),
        Err(_) => out.extend_from_slice(text.as_bytes()),
    }
}

/// Integers up to this many digits are written out in full; larger ones in exponent form.
const MAX_PLAIN_INTEGER_DIGITS: i64 = 64;
/// Fractions with up to this many zeros after the point are written out in full.
const MAX_PLAIN_LEADING_ZEROS: i64 = 16;
/// Exponents beyond this magnitude are refused rather than compared approximately.
const MAX_EXPONENT: i64 = 1_000_000_000_000_000;

/// The one spelling of a JSON number's exact decimal value: `100`, `100.0`, `1e2` and
/// `1.00e+2` all give `100`; `0.5`, `5e-1` give `0.5`; a huge or tiny one `1.5e300`. No
/// floating point is involved, so integers past 2^64 and decimals of any precision stay
/// distinct. `text` must be JSON number syntax.
pub fn canonical_number(text: &str) -> Result<String, CanonicalError> {
    let invalid = |why: &str| CanonicalError::InvalidJson(format!("number {text:?} {why}"));
    let (negative, body) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text),
    };
    let (mantissa, exponent) = match body.find(['e', 'E']) {
        Some(i) => (&body[..i], &body[i + 1..]),
        None => (body, "0"),
    };
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let exp_digits = exponent.trim_start_matches(['+', '-']);
    let well_formed = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !well_formed(int) || !(frac.is_empty() || well_formed(frac)) || !well_formed(exp_digits) {
        return Err(invalid("is not a JSON number"));
    }
    let exp_digits = exp_digits.trim_start_matches('0');
    if exp_digits.len() > 16 {
        return Err(invalid("has an exponent out of range"));
    }
    let mut exp: i64 = exp_digits.parse().unwrap_or(0);
    if exponent.starts_with('-') {
        exp = -exp;
    }
    if exp.abs() > MAX_EXPONENT {
        return Err(invalid("has an exponent out of range"));
    }
    // value = digits * 10^exp, with digits free of leading and trailing zeros.
    let all: String = [int, frac].concat();
    exp -= frac.len() as i64;
    let digits = all.trim_start_matches('0');
    let trimmed = digits.trim_end_matches('0');
    exp += (digits.len() - trimmed.len()) as i64;
    let digits = trimmed;
    if digits.is_empty() {
        return Ok("0".to_owned());
    }
    let mut out = String::with_capacity(digits.len() + 8);
    if negative {
        out.push('-');
    }
    let n = digits.len() as i64;
    // Digits before the decimal point in plain notation.
    let point = n + exp;
    // The bound applies to the canonical spelling too, so that it parses again.
    if (point - 1).abs() > MAX_EXPONENT {
        return Err(invalid("has an exponent out of range"));
    }
    if exp >= 0 && point <= MAX_PLAIN_INTEGER_DIGITS {
        out.push_str(digits);
        out.extend(std::iter::repeat_n('0', exp as usize));
    } else if exp < 0 && point > 0 {
        let (whole, fraction) = digits.split_at(point as usize);
        out.push_str(whole);
        out.push('.');
        out.push_str(fraction);
    } else if exp < 0 && -point < MAX_PLAIN_LEADING_ZEROS {
        out.push_str("0.");
        out.extend(std::iter::repeat_n('0', (-point) as usize));
        out.push_str(digits);
    } else {
        out.push_str(&digits[..1]);
        if n > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        out.push('e');
        out.push_str(&(point - 1).to_string());
    }
    Ok(out)
}

/// Marks a number inside `visit_map` when serde_json keeps numbers as text
/// (`arbitrary_precision`); the same name serde_json's own `Value` recognises.
const NUMBER_TOKEN: &str = "$serde_json::private::Number";

/// A parsed number in its canonical spelling.
fn number_value<E: de::Error>(text: &str) -> Result<Value, E> {
    let canonical = canonical_number(text).map_err(|e| E::custom(e.to_string()))?;
    canonical
        .parse::<Number>()
        .map(Value::Number)
        .map_err(|e| E::custom(format_args!("number {text:?}: {e}")))
}

/// A JSON value whose objects may not repeat a key.
struct StrictValue(Value);

impl<'de> Deserialize<'de> for StrictValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(StrictVisitor).map(StrictValue)
    }
}

struct StrictVisitor;

impl<'de> Visitor<'de> for StrictVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Value, E> {
        // serde_json is built with `arbitrary_precision`: numbers arrive as text (see
        // `visit_map`), never through floating point, so this would be a build mistake.
        Err(E::custom(
            "numbers must be compared exactly; floating point is not accepted",
        ))
    }
    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }
    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(StrictValue(v)) = seq.next_element()? {
            items.push(v);
        }
        Ok(Value::Array(items))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut access: A) -> Result<Value, A::Error> {
        let mut map = Map::new();
        while let Some(key) = access.next_key::<String>()? {
            if map.is_empty() && key == NUMBER_TOKEN {
                let text: String = access.next_value()?;
                return number_value(&text);
            }
            if map.contains_key(&key) {
                return Err(de::Error::custom(format_args!("duplicate key {key:?}")));
            }
            let StrictValue(v) = access.next_value()?;
            map.insert(key, v);
        }
        Ok(Value::Object(map))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn canon(text: &str, schema: &IntentSchema) -> String {
        String::from_utf8(canonical_intent(&parse_arguments(text).unwrap(), schema)).unwrap()
    }

    fn schema(volatile: &[&str]) -> IntentSchema {
        let v: Vec<String> = volatile.iter().map(|s| s.to_string()).collect();
        IntentSchema::new(&v, &[], StringRule::Exact).unwrap()
    }

    /// The canonical form is stored (as fingerprints) in every ledger: these bytes must never
    /// change. Escapes, non-ASCII text, unsorted and nested keys, number spelling.
    #[test]
    fn the_canonical_form_is_pinned_byte_for_byte() {
        let text = r#"{"b":"q\"\\\n\u0001\u00e9\ud83d\ude00 /","a":[1,{"z":null,"y":true}],"c":1.50,"\u00e9":-0}"#;
        let expected = r#"{"a":[1,{"y":true,"z":null}],"b":"q\"\\\n\u0001é😀 /","c":1.5,"é":0}"#;
        assert_eq!(canon(text, &schema(&[])), expected);
        // The same through the path that edits a copy (a volatile field that is absent).
        assert_eq!(canon(text, &schema(&["absent"])), expected);
    }

    #[test]
    fn key_order_and_whitespace_do_not_matter() {
        let s = schema(&[]);
        assert_eq!(
            canon(r#"{"to":"bob","amount":100}"#, &s),
            canon("{ \"amount\" :\n 100 ,\t\"to\": \"bob\" }", &s)
        );
        assert_eq!(
            canon(r#"{"b":{"y":1,"x":2},"a":[3,1]}"#, &s),
            r#"{"a":[3,1],"b":{"x":2,"y":1}}"#
        );
    }

    #[test]
    fn number_spelling_is_normalised() {
        let s = schema(&[]);
        for spelling in ["1", "1.0", "1e0", "10e-1", "1.000"] {
            assert_eq!(
                canon(&format!(r#"{{"n":{spelling}}}"#), &s),
                r#"{"n":1}"#,
                "{spelling}"
            );
        }
        assert_eq!(canon(r#"{"n":-0.0}"#, &s), r#"{"n":0}"#);
        assert_eq!(canon(r#"{"n":1.5}"#, &s), r#"{"n":1.5}"#);
        assert_ne!(canon(r#"{"n":1.5}"#, &s), canon(r#"{"n":1.50001}"#, &s));
    }

    #[test]
    fn numbers_are_compared_exactly() {
        let s = schema(&[]);
        let c = |n: &str| canon(&format!(r#"{{"n":{n}}}"#), &s);
        // One number, many spellings.
        for spelling in [
            "100", "100.0", "1e2", "1.00e+2", "1E2", "10000e-2", "0.001e5",
        ] {
            assert_eq!(c(spelling), r#"{"n":100}"#, "{spelling}");
        }
        assert_eq!(c("9007199254740992"), c("9007199254740992.0"));
        // Two numbers that floating point would confuse.
        assert_ne!(c("100"), c("100.000000000000001"));
        assert_ne!(c("18446744073709551616"), c("18446744073709551617"));
        assert_ne!(c("9007199254740993"), c("9007199254740992"));
        assert_ne!(c("0.1"), c("0.1000000000000000055511151231257827"));
        assert_eq!(c("18446744073709551617"), r#"{"n":18446744073709551617}"#);
        assert_eq!(c("-0.0e7"), r#"{"n":0}"#);
        assert_eq!(c("-12.5000"), r#"{"n":-12.5}"#);
        assert_eq!(c("0.000125"), r#"{"n":0.000125}"#);
        assert_eq!(c("1.5e300"), r#"{"n":1.5e300}"#);
        assert_eq!(c("15e299"), c("1.5e300"));
        assert_eq!(c("-25e-40"), r#"{"n":-2.5e-39}"#);
        // Huge exponents are refused, not rounded.
        let huge = parse_arguments(r#"{"n":1e99999999999999999999}"#).unwrap_err();
        assert!(huge.to_string().contains("out of range"), "{huge}");
        // Also where only the normalised exponent is past the bound (found by the fuzzer: the
        // canonical form must parse again).
        assert!(parse_arguments(r#"{"n":1e1000000000000000}"#).is_ok());
        assert!(parse_arguments(r#"{"n":1000e1000000000000000}"#).is_err());
    }

    #[test]
    fn canonical_numbers_are_one_spelling_per_value() {
        for (text, want) in [
            ("0", "0"),
            ("-0", "0"),
            ("7", "7"),
            ("7.10", "7.1"),
            ("123e-2", "1.23"),
            ("1e64", "1e64"),
            ("1e63", &format!("1{}", "0".repeat(63))),
            ("1e-16", "0.0000000000000001"),
            ("1e-17", "1e-17"),
            ("1e-15", "0.000000000000001"),
        ] {
            assert_eq!(canonical_number(text).unwrap(), want, "{text}");
            // The canonical spelling is a fixed point.
            assert_eq!(canonical_number(want).unwrap(), want, "{want}");
        }
    }

    #[test]
    fn a_value_that_held_only_volatile_fields_leaves_no_trace() {
        let s = schema(&["meta.trace_id", "items.*.nonce", "reference"]);
        let base = canon(r#"{"amount":5,"items":[{"sku":"k"}]}"#, &s);
        assert_eq!(
            canon(
                r#"{"amount":5,"meta":{"trace_id":"t1"},"items":[{"sku":"k"}]}"#,
                &s
            ),
            base
        );
        assert_eq!(
            canon(
                r#"{"amount":5,"items":[{"nonce":1},{"sku":"k","nonce":2}]}"#,
                &s
            ),
            base
        );
        // Emptied all the way up: the array held only volatile elements.
        assert_eq!(
            canon(r#"{"amount":5,"items":[{"nonce":1}]}"#, &s),
            r#"{"amount":5}"#
        );
        // What the caller sent empty is kept: it is not the absence of a field.
        assert_ne!(
            canon(r#"{"amount":5,"meta":{}}"#, &s),
            canon(r#"{"amount":5}"#, &s)
        );
        // A non-volatile sibling keeps its object.
        assert_eq!(
            canon(r#"{"amount":5,"meta":{"trace_id":"t","source":"x"}}"#, &s),
            r#"{"amount":5,"meta":{"source":"x"}}"#
        );
    }

    #[test]
    fn volatile_paths_apply_whatever_their_order() {
        let a = IntentSchema::new(&["*.x".into(), "1".into()], &[], StringRule::Exact).unwrap();
        let b = IntentSchema::new(&["1".into(), "*.x".into()], &[], StringRule::Exact).unwrap();
        for text in [r#"[{"x":1},{"y":2},{"z":3}]"#, r#"[{"y":1},{"x":2}]"#] {
            let once = canon(text, &a);
            assert_eq!(once, canon(text, &b));
            assert_eq!(canon(&once, &a), once, "not a fixed point: {text}");
        }
    }

    #[test]
    fn volatile_fields_are_dropped_at_any_depth() {
        let s = schema(&["request_id", "meta.timestamp", "items.*.nonce"]);
        let a = canon(
            r#"{"request_id":"a1","amount":5,"meta":{"timestamp":1,"source":"x"},"items":[{"nonce":1,"sku":"k"}]}"#,
            &s,
        );
        let b = canon(
            r#"{"amount":5,"request_id":"b2","meta":{"timestamp":99,"source":"x"},"items":[{"sku":"k","nonce":7}]}"#,
            &s,
        );
        assert_eq!(a, b);
        assert_eq!(
            a,
            r#"{"amount":5,"items":[{"sku":"k"}],"meta":{"source":"x"}}"#
        );
    }

    #[test]
    fn a_volatile_array_element_is_blanked_so_canonical_form_is_a_fixed_point() {
        let s = schema(&["0"]);
        let once = canon("[2, 4]", &s);
        assert_eq!(once, "[null,4]");
        assert_eq!(canon(&once, &s), once);
        assert_eq!(canon("[9, 4]", &s), once);
    }

    #[test]
    fn an_added_optional_volatile_field_is_still_the_same_intent() {
        let s = schema(&["memo"]);
        assert_eq!(
            canon(r#"{"amount":5}"#, &s),
            canon(r#"{"amount":5,"memo":"retry"}"#, &s)
        );
    }

    #[test]
    fn changing_an_intent_field_changes_the_fingerprint() {
        let s = schema(&["reference"]);
        let fp = |t: &str| intent_fingerprint("bank.transfer", &canon(t, &s).into_bytes());
        let base = fp(r#"{"to":"bob","amount":100,"reference":"u1"}"#);
        assert_eq!(base, fp(r#"{"amount":100,"to":"bob","reference":"u2"}"#));
        assert_ne!(base, fp(r#"{"to":"carol","amount":100,"reference":"u1"}"#));
        assert_ne!(base, fp(r#"{"to":"bob","amount":1000,"reference":"u1"}"#));
        assert_ne!(base, fp(r#"{"to":"bob","amount":"100","reference":"u1"}"#));
    }

    #[test]
    fn the_tool_name_is_part_of_the_fingerprint() {
        let c = canon(r#"{"a":1}"#, &schema(&[]));
        assert_ne!(
            intent_fingerprint("a", c.as_bytes()),
            intent_fingerprint("b", c.as_bytes())
        );
        // Length-prefixing keeps ("ab", "c...") and ("a", "bc...") apart.
        assert_ne!(
            intent_fingerprint("ab", b"{}"),
            intent_fingerprint("a", b"b{}")
        );
    }

    #[test]
    fn declared_string_fields_are_normalised() {
        let s = IntentSchema::new(&[], &["email".into()], StringRule::TrimLowercase).unwrap();
        assert_eq!(
            canon(r#"{"email":"  Bob@X.com "}"#, &s),
            r#"{"email":"bob@x.com"}"#
        );
        // Other strings stay exact.
        assert_eq!(canon(r#"{"name":" Bob"}"#, &s), r#"{"name":" Bob"}"#);
    }

    #[test]
    fn invalid_json_and_duplicate_keys_are_refused() {
        assert!(matches!(
            parse_arguments("{"),
            Err(CanonicalError::InvalidJson(_))
        ));
        assert!(matches!(
            parse_arguments(""),
            Err(CanonicalError::InvalidJson(_))
        ));
        assert!(matches!(
            parse_arguments("{} {}"),
            Err(CanonicalError::InvalidJson(_))
        ));
        let dup = parse_arguments(r#"{"amount":1,"amount":100}"#).unwrap_err();
        assert!(dup.to_string().contains("duplicate key"), "{dup}");
        assert!(parse_arguments(r#"{"a":{"b":1,"c":{"b":2}}}"#).is_ok());
    }

    #[test]
    fn malformed_paths_are_refused() {
        for bad in ["", "a..b", ".a", "a."] {
            assert!(FieldPath::parse(bad).is_err(), "{bad:?}");
        }
    }

    fn json_value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(|i| Value::Number(i.into())),
            (-1.0e6f64..1.0e6).prop_map(|f| Number::from_f64(f).map_or(Value::Null, Value::Number)),
            "[a-z ]{0,8}".prop_map(Value::String),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::btree_map("[a-e]{1,3}", inner, 0..4)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        /// Whatever the key order or whitespace of the text, the canonical form is the same,
        /// and canonicalising the canonical form changes nothing.
        #[test]
        fn canonical_form_ignores_spelling(v in json_value()) {
            let s = schema(&[]);
            let compact = serde_json::to_string(&v).unwrap();
            let pretty = serde_json::to_string_pretty(&v).unwrap();
            let c1 = canonical_intent(&parse_arguments(&compact).unwrap(), &s);
            let c2 = canonical_intent(&parse_arguments(&pretty).unwrap(), &s);
            prop_assert_eq!(&c1, &c2);
            let again = canonical_intent(&parse_arguments(std::str::from_utf8(&c1).unwrap()).unwrap(), &s);
            prop_assert_eq!(c1, again);
        }

        /// Under volatile paths of every kind (keys, wildcards, indexes), the canonical form
        /// is a fixed point and ignores spelling.
        #[test]
        fn stripping_volatile_fields_is_a_fixed_point(v in json_value(), with_index in any::<bool>()) {
            let mut paths = vec!["a", "b.*", "*.c", "d.*.e"];
            if with_index {
                paths.push("0");
                paths.push("*.1");
            }
            let s = schema(&paths);
            let pretty = serde_json::to_string_pretty(&v).unwrap();
            let c1 = canonical_intent(&parse_arguments(&serde_json::to_string(&v).unwrap()).unwrap(), &s);
            prop_assert_eq!(&c1, &canonical_intent(&parse_arguments(&pretty).unwrap(), &s));
            let again = canonical_intent(&parse_arguments(std::str::from_utf8(&c1).unwrap()).unwrap(), &s);
            prop_assert_eq!(c1, again);
        }

        /// Any spelling of a decimal value canonicalises like its plain spelling.
        #[test]
        fn number_spellings_agree(mantissa in "-?[0-9]{1,30}", shift in -40i64..40) {
            // mantissa * 10^shift, spelled as "<mantissa>e<shift>" and as plain decimal.
            let (neg, digits) = match mantissa.strip_prefix('-') {
                Some(d) => (true, d.to_owned()),
                None => (false, mantissa.clone()),
            };
            let plain = if shift >= 0 {
                format!("{digits}{}", "0".repeat(shift as usize))
            } else {
                let pad = format!("{}{digits}", "0".repeat(-shift as usize + 1));
                let (w, f) = pad.split_at(pad.len() - (-shift) as usize);
                format!("{w}.{f}")
            };
            let sign = if neg { "-" } else { "" };
            prop_assert_eq!(
                canonical_number(&format!("{sign}{digits}e{shift}")).unwrap(),
                canonical_number(&format!("{sign}{plain}")).unwrap()
            );
        }
    }
}
