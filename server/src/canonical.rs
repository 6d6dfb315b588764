//! Canonical intent: the one form every duplicate check compares.
//!
//! A call's arguments are parsed strictly (one JSON value, no duplicate object keys), the
//! tool's declared volatile fields are removed, declared string fields are normalised, and the
//! result is written with sorted object keys, no insignificant whitespace and one spelling per
//! number (`1`, `1.0` and `1e0` are the same). The intent fingerprint is blake3 over the tool
//! name and those bytes. Deterministic by construction: no model judges similarity, and
//! reordering keys can never bypass a check because nothing ever hashes the raw text except the
//! audit-only request fingerprint.

use std::collections::BTreeMap;
use std::fmt;

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
    let mut value = args.clone();
    for path in &schema.volatile {
        remove_path(&mut value, &path.0);
    }
    if schema.rule != StringRule::Exact {
        for path in &schema.normalized {
            normalize_path(&mut value, &path.0, schema.rule);
        }
    }
    let mut out = Vec::with_capacity(64);
    write_canonical(&value, &mut out);
    out
}

/// blake3 over the tool name and the canonical intent: equal for the same intent, whatever the
/// volatile fields, key order, whitespace or number spelling.
pub fn intent_fingerprint(tool: &str, canonical: &[u8]) -> Fingerprint {
    let mut h = blake3::Hasher::new_derive_key("fence.v1 intent fingerprint");
    h.update(&(tool.len() as u64).to_be_bytes());
    h.update(tool.as_bytes());
    h.update(canonical);
    *h.finalize().as_bytes()
}

/// blake3 over the tool name and the raw arguments as sent (audit only; never used to match).
pub fn request_fingerprint(tool: &str, raw_arguments: &str) -> Fingerprint {
    let mut h = blake3::Hasher::new_derive_key("fence.v1 request fingerprint");
    h.update(&(tool.len() as u64).to_be_bytes());
    h.update(tool.as_bytes());
    h.update(raw_arguments.as_bytes());
    *h.finalize().as_bytes()
}

fn remove_path(value: &mut Value, path: &[Segment]) {
    let Some((head, rest)) = path.split_first() else {
        return;
    };
    match value {
        Value::Object(map) => match head {
            Segment::Key(k) if rest.is_empty() => {
                map.remove(k);
            }
            Segment::Key(k) => {
                if let Some(child) = map.get_mut(k) {
                    remove_path(child, rest);
                }
            }
            Segment::Any if rest.is_empty() => map.clear(),
            Segment::Any => map.values_mut().for_each(|c| remove_path(c, rest)),
        },
        Value::Array(items) => match head {
            Segment::Any if rest.is_empty() => items.clear(),
            Segment::Any => items.iter_mut().for_each(|c| remove_path(c, rest)),
            Segment::Key(k) => {
                if let Some(child) = k.parse::<usize>().ok().and_then(|i| items.get_mut(i)) {
                    if rest.is_empty() {
                        // Blank the element rather than remove it: removing would shift the
                        // next one into its place, and canonicalising again would remove that
                        // too (found by the fuzzer; kept in fuzz/regressions/canonical).
                        *child = Value::Null;
                    } else {
                        remove_path(child, rest);
                    }
                }
            }
        },
        _ => {}
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
        Value::String(s) => {
            // serde_json's string escaping is deterministic; reuse it.
            out.extend_from_slice(Value::String(s.clone()).to_string().as_bytes());
        }
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
            let sorted: BTreeMap<&String, &Value> = map.iter().collect();
            out.push(b'{');
            for (i, (k, v)) in sorted.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                out.extend_from_slice(Value::String(k.clone()).to_string().as_bytes());
                out.push(b':');
                write_canonical(v, out);
            }
            out.push(b'}');
        }
    }
}

/// Largest integer an f64 holds exactly (2^53).
const F64_EXACT_INT: f64 = 9_007_199_254_740_992.0;

fn write_number(n: &Number, out: &mut Vec<u8>) {
    if let Some(u) = n.as_u64() {
        out.extend_from_slice(u.to_string().as_bytes());
    } else if let Some(i) = n.as_i64() {
        out.extend_from_slice(i.to_string().as_bytes());
    } else if let Some(f) = n.as_f64() {
        // An integral float spells like the integer (`1.0` == `1`, `-0.0` == `0`); any other
        // float uses the shortest round-trip form.
        if f.fract() == 0.0 && f.abs() < F64_EXACT_INT {
            out.extend_from_slice((f as i64).to_string().as_bytes());
        } else {
            out.extend_from_slice(n.to_string().as_bytes());
        }
    }
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
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        Number::from_f64(v)
            .map(Value::Number)
            .ok_or_else(|| E::custom("non-finite number"))
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
    }
}
