//! The simulated downstream world: a bank, a cloud provider, an approval service, a payment
//! processor, an e-mail sender and a travel agency. It is the ground truth of the fault
//! benchmark: it counts every real effect, whatever any arm believes happened.
//!
//! Like real APIs, each service accepts an optional idempotency key (an `Idempotency-Key`
//! header) and answers a repeated key with the response it recorded for it, without acting
//! again, and whatever the rest of the request says (so a key reused for a different call
//! gets the first call's answer). Each arm passes a different key: none (naive retry), the
//! UUID the model wrote into the arguments, or Fence's downstream key.
//!
//! Payment tokens come from the approval service and are validated statelessly, as in the
//! ACRFence testbed: a token that was ever issued is accepted; every use past the first is a
//! resurrected credential.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use serde_json::Value;

use crate::scenario::{Service, ToolSpec, tool_by_name};

/// A stable 64-bit FNV-1a hash (results and tokens name the intent they were made for).
pub fn fnv(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The ground-truth identity of an intent: the tool and its intent fields (volatile fields
/// removed, keys sorted, every number spelled as an `f64`). Computed independently of Fence.
pub fn intent_tag(tool: &ToolSpec, args: &Value) -> String {
    fn normalise(v: &Value) -> Value {
        match v {
            Value::Number(n) => n.as_f64().map_or(Value::Null, Value::from),
            Value::Array(items) => Value::Array(items.iter().map(normalise).collect()),
            Value::Object(map) => {
                Value::Object(map.iter().map(|(k, v)| (k.clone(), normalise(v))).collect())
            }
            other => other.clone(),
        }
    }
    let mut v = normalise(args);
    if let Value::Object(map) = &mut v {
        for field in tool.volatile {
            map.remove(*field);
        }
    }
    // serde_json's map is ordered by key: the text is canonical.
    format!("{}{}", tool.name, v)
}

/// What a service answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// The effect happened (now, or earlier under the same idempotency key): its response.
    Done(Vec<u8>),
    /// The service refused and nothing happened (sold out, invalid token).
    Rejected(String),
}

/// The response body every service returns: which intent it acted on, and what it made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// The FNV hash of the intent tag the service acted on.
    pub intent: u64,
    /// The id of what it made (a transfer, a server, a booking...).
    pub id: String,
    /// For an approval: the one-time token it issued.
    pub token: Option<String>,
}

impl Response {
    /// Encodes the response as the bytes a service returns.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::json!({"intent": format!("{:016x}", self.intent), "id": self.id, "token": self.token})
            .to_string()
            .into_bytes()
    }

    /// Decodes response bytes (None if they are not a response).
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        let v: Value = serde_json::from_slice(bytes).ok()?;
        Some(Self {
            intent: u64::from_str_radix(v.get("intent")?.as_str()?, 16).ok()?,
            id: v.get("id")?.as_str()?.to_owned(),
            token: v.get("token").and_then(Value::as_str).map(str::to_owned),
        })
    }
}

#[derive(Default)]
struct State {
    /// Real effects per intent tag.
    effects: HashMap<String, u32>,
    /// The idempotency keys each intent was executed under (to explain duplicates).
    keys: HashMap<String, Vec<Option<String>>>,
    /// Total real effects.
    executed: u64,
    /// Recorded responses per (service, idempotency key).
    by_key: HashMap<(Service, String), Vec<u8>>,
    /// Tokens the approval service issued.
    issued: HashSet<String>,
    /// Uses of each token.
    token_uses: HashMap<String, u32>,
    /// Uses of a token past its first.
    resurrections: u64,
    /// Rejections (sold out, invalid token): no effect.
    rejections: u64,
    /// Intents the world rejected.
    rejected: HashSet<String>,
    /// Trips whose car is sold out.
    sold_out: HashSet<String>,
}

/// The downstream world of one arm.
#[derive(Default)]
pub struct World {
    state: Mutex<State>,
}

/// What the world saw, for the report.
#[derive(Debug, Clone, Default)]
pub struct Totals {
    /// Real effects per intent tag.
    pub effects: HashMap<String, u32>,
    /// Total real effects.
    pub executed: u64,
    /// Token uses past the first.
    pub resurrections: u64,
    /// Requests refused without an effect.
    pub rejections: u64,
    /// Intents the world refused.
    pub rejected: HashSet<String>,
    /// Up to ten intents executed more than once, with the keys of each execution.
    pub duplicate_samples: Vec<(String, Vec<Option<String>>)>,
}

impl World {
    /// An empty world.
    pub fn new() -> Self {
        Self::default()
    }

    /// Marks a trip's rental car as sold out (its booking is rejected, triggering the saga's
    /// compensation).
    pub fn sell_out(&self, trip: &str) {
        self.lock().sold_out.insert(trip.to_owned());
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Performs a call of `tool` with these arguments and an optional idempotency key.
    pub fn call(&self, tool: &str, args_json: &str, key: Option<&str>) -> Reply {
        let Some(spec) = tool_by_name(tool) else {
            return Reply::Rejected(format!("no such tool {tool}"));
        };
        let Ok(args) = serde_json::from_str::<Value>(args_json) else {
            return Reply::Rejected("malformed request".into());
        };
        let mut st = self.lock();
        if let Some(k) = key
            && let Some(recorded) = st.by_key.get(&(spec.service, k.to_owned()))
        {
            return Reply::Done(recorded.clone());
        }
        let tag = intent_tag(spec, &args);
        let field = |name: &str| args.get(name).and_then(Value::as_str).unwrap_or_default();
        match spec.service {
            Service::Payments => {
                let token = field("token").to_owned();
                if !st.issued.contains(&token) {
                    st.rejections += 1;
                    st.rejected.insert(tag);
                    return Reply::Rejected("invalid approval token".into());
                }
                let uses = st.token_uses.entry(token).or_default();
                *uses += 1;
                if *uses > 1 {
                    st.resurrections += 1;
                }
            }
            Service::Travel
                if spec.name == "travel.book_car" && st.sold_out.contains(field("trip")) =>
            {
                st.rejections += 1;
                st.rejected.insert(tag);
                return Reply::Rejected("no cars left".into());
            }
            _ => {}
        }
        let n = {
            let count = st.effects.entry(tag.clone()).or_default();
            *count += 1;
            *count
        };
        st.executed += 1;
        st.keys
            .entry(tag.clone())
            .or_default()
            .push(key.map(str::to_owned));
        let intent = fnv(&tag);
        let token = (spec.service == Service::Approvals).then(|| format!("tok-{intent:016x}-{n}"));
        if let Some(t) = &token {
            st.issued.insert(t.clone());
        }
        let response = Response {
            intent,
            id: format!("{}-{intent:016x}-{n}", spec.service.prefix()),
            token,
        }
        .encode();
        if let Some(k) = key {
            st.by_key
                .insert((spec.service, k.to_owned()), response.clone());
        }
        Reply::Done(response)
    }

    /// The outcome check: what the service recorded under an idempotency key, if anything
    /// (`GET /transfers?idempotency_key=...`).
    pub fn lookup(&self, tool: &str, key: &str) -> Option<Vec<u8>> {
        let spec = tool_by_name(tool)?;
        self.lock()
            .by_key
            .get(&(spec.service, key.to_owned()))
            .cloned()
    }

    /// What happened so far.
    pub fn totals(&self) -> Totals {
        let st = self.lock();
        let mut duplicate_samples: Vec<(String, Vec<Option<String>>)> = st
            .keys
            .iter()
            .filter(|(_, k)| k.len() > 1)
            .map(|(t, k)| (t.clone(), k.clone()))
            .collect();
        duplicate_samples.sort();
        duplicate_samples.truncate(10);
        Totals {
            duplicate_samples,
            effects: st.effects.clone(),
            executed: st.executed,
            resurrections: st.resurrections,
            rejections: st.rejections,
            rejected: st.rejected.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_deduplicate_and_tokens_resurrect() {
        let w = World::new();
        let t = r#"{"from":"a","to":"b","amount":5,"purpose":"x","ref":"r1"}"#;
        let first = w.call("bank.transfer", t, Some("k1"));
        assert_eq!(w.call("bank.transfer", t, Some("k1")), first);
        // Same intent, other key, other spelling: a second real transfer.
        let t2 = r#"{ "amount": 5.0, "to":"b","from":"a","purpose":"x","ref":"r2"}"#;
        assert_ne!(w.call("bank.transfer", t2, Some("k2")), first);
        let totals = w.totals();
        assert_eq!(totals.executed, 2);
        assert_eq!(
            totals.effects.values().copied().collect::<Vec<_>>(),
            vec![2]
        );

        let Reply::Done(approval) = w.call(
            "approvals.request",
            r#"{"operation":"pay","target":"v","amount":3,"order":"o","request_id":"q"}"#,
            None,
        ) else {
            panic!("approval refused")
        };
        let token = Response::decode(&approval).unwrap().token.unwrap();
        let pay = |r: &str| {
            format!(r#"{{"vendor":"v","amount":3,"invoice":"o","token":"{token}","ref":"{r}"}}"#)
        };
        assert!(matches!(
            w.call("payments.execute", &pay("1"), None),
            Reply::Done(_)
        ));
        assert!(matches!(
            w.call("payments.execute", &pay("2"), None),
            Reply::Done(_)
        ));
        assert_eq!(w.totals().resurrections, 1);
        assert!(matches!(
            w.call(
                "payments.execute",
                r#"{"vendor":"v","amount":3,"invoice":"o","token":"forged"}"#,
                None
            ),
            Reply::Rejected(_)
        ));
    }
}
