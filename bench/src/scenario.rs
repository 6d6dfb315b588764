//! The workload of the fault benchmark: the tools of the simulated world, the workflows agents
//! run, how a model writes (and re-writes) a call, and the faults scheduled for each step.
//!
//! Everything here is a pure function of the seed and a position (workflow, slot, issue
//! number), so every arm sees the same workflows, the same faults and the same drift.

use serde_json::{Map, Value, json};

use crate::rng::Rng;
use fence_proto::v1::OperationClass;

/// A downstream service: one idempotency-key namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Service {
    /// Transfers.
    Bank,
    /// Server creation.
    Cloud,
    /// One-time approval tokens.
    Approvals,
    /// Payments that spend an approval token.
    Payments,
    /// E-mail.
    Email,
    /// Flights, hotels, cars and their cancellations.
    Travel,
}

impl Service {
    /// The prefix of the ids the service makes.
    pub fn prefix(self) -> &'static str {
        match self {
            Service::Bank => "tx",
            Service::Cloud => "srv",
            Service::Approvals => "apv",
            Service::Payments => "pay",
            Service::Email => "msg",
            Service::Travel => "bk",
        }
    }
}

/// A tool of the world, as Fence is told about it (class, volatile fields).
#[derive(Debug, PartialEq, Eq)]
pub struct ToolSpec {
    /// Its name.
    pub name: &'static str,
    /// Its service.
    pub service: Service,
    /// Its operation class.
    pub class: OperationClass,
    /// Top-level fields that do not change the intent (declared volatile to Fence).
    pub volatile: &'static [&'static str],
    /// The field where the model writes a fresh UUID (the usual idempotency key).
    pub uuid_field: &'static str,
}

const fn tool(
    name: &'static str,
    service: Service,
    class: OperationClass,
    volatile: &'static [&'static str],
    uuid_field: &'static str,
) -> ToolSpec {
    ToolSpec {
        name,
        service,
        class,
        volatile,
        uuid_field,
    }
}

/// Every tool.
pub static TOOLS: [ToolSpec; 9] = [
    tool(
        "bank.transfer",
        Service::Bank,
        OperationClass::NonRetryable,
        &["ref", "ts", "meta"],
        "ref",
    ),
    tool(
        "cloud.create_server",
        Service::Cloud,
        OperationClass::Deduplicate,
        &["client_token", "requested_at", "meta"],
        "client_token",
    ),
    tool(
        "approvals.request",
        Service::Approvals,
        OperationClass::NonRetryable,
        &["request_id", "ts", "meta"],
        "request_id",
    ),
    tool(
        "payments.execute",
        Service::Payments,
        OperationClass::NonRetryable,
        &["ref", "ts", "token", "meta"],
        "ref",
    ),
    tool(
        "email.send",
        Service::Email,
        OperationClass::NonRetryable,
        &["message_id", "ts", "meta"],
        "message_id",
    ),
    tool(
        "travel.book_flight",
        Service::Travel,
        OperationClass::RequiresEffectCheck,
        &["request_id", "ts", "meta"],
        "request_id",
    ),
    tool(
        "travel.book_hotel",
        Service::Travel,
        OperationClass::NonRetryable,
        &["request_id", "ts", "meta"],
        "request_id",
    ),
    tool(
        "travel.book_car",
        Service::Travel,
        OperationClass::NonRetryable,
        &["request_id", "ts", "meta"],
        "request_id",
    ),
    tool(
        "travel.cancel",
        Service::Travel,
        OperationClass::Deduplicate,
        &["request_id", "ts", "meta"],
        "request_id",
    ),
];

/// A tool by name.
pub fn tool_by_name(name: &str) -> Option<&'static ToolSpec> {
    TOOLS.iter().find(|t| t.name == name)
}

fn spec(name: &str) -> &'static ToolSpec {
    tool_by_name(name).expect("a known tool")
}

/// The kinds of workflow agents run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Template {
    /// Ask for approval, pay with the one-time token, e-mail the receipt.
    Payment,
    /// Three transfers, then an e-mail.
    Payroll,
    /// Create two servers, then an e-mail.
    Infra,
    /// Book a flight, a hotel and a car; if the car is sold out, cancel the hotel and the
    /// flight (a saga); e-mail the outcome.
    Trip,
}

/// A step's part in a saga.
#[derive(Debug, Clone, PartialEq)]
pub enum SagaRole {
    /// A forward step, undone by `travel.cancel` with these arguments.
    Forward(Map<String, Value>),
    /// A compensation undoing the forward step at this plan position.
    Compensates(usize),
}

/// One step of a plan.
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    /// The fault-schedule slot (stable across re-plans).
    pub slot: usize,
    /// The plan generation it belongs to.
    pub generation: u32,
    /// The tool.
    pub tool: &'static ToolSpec,
    /// The intent fields.
    pub intent: Map<String, Value>,
    /// The plan position of the approval whose token this step spends.
    pub credential_from: Option<usize>,
    /// Its saga role.
    pub saga: Option<SagaRole>,
}

fn obj(v: Value) -> Map<String, Value> {
    match v {
        Value::Object(m) => m,
        _ => unreachable!("an object literal"),
    }
}

/// A workflow: its id, kind and the facts of its world.
#[derive(Debug, Clone)]
pub struct Workflow {
    /// Its number.
    pub id: u64,
    /// Its kind.
    pub template: Template,
    /// Whether the agent's framework gives every step a durable step key.
    pub step_keys: bool,
    /// For a trip: whether the car is sold out (the saga compensates).
    pub car_sold_out: bool,
}

/// Slots of a trip's compensations and closing e-mail.
pub const TRIP_CANCEL_HOTEL: usize = 4;
/// See [`TRIP_CANCEL_HOTEL`].
pub const TRIP_CANCEL_FLIGHT: usize = 5;
/// See [`TRIP_CANCEL_HOTEL`].
pub const TRIP_CANCELLED_MAIL: usize = 6;
/// The number of fault slots of any workflow.
pub const SLOTS: usize = 7;

impl Workflow {
    /// Workflow `id` of the run with `seed`.
    pub fn new(seed: u64, id: u64, step_key_rate: f64) -> Self {
        let mut r = Rng::derive(seed, &[id, 1]);
        let template = *r.pick(&[
            Template::Payment,
            Template::Payroll,
            Template::Infra,
            Template::Trip,
        ]);
        Self {
            id,
            template,
            step_keys: r.chance(step_key_rate),
            car_sold_out: template == Template::Trip && r.chance(0.5),
        }
    }

    /// The trip id of plan generation `generation`.
    pub fn trip(&self, generation: u32) -> String {
        format!("trip-{}-g{generation}", self.id)
    }

    /// The plan of generation `generation` (a deliberate change starts a new generation, and
    /// every later step of a new generation is a new effect).
    pub fn plan(&self, seed: u64, generation: u32) -> Vec<Step> {
        let w = self.id;
        let g = generation;
        let mut r = Rng::derive(seed, &[w, 2, u64::from(g)]);
        let step = |slot, name: &str, intent: Value| Step {
            slot,
            generation: g,
            tool: spec(name),
            intent: obj(intent),
            credential_from: None,
            saga: None,
        };
        let owner = format!("owner-{w}@example.com");
        match self.template {
            Template::Payment => {
                let vendor = format!("vendor-{}", r.below(50));
                let amount = r.range(10, 990);
                let order = format!("po-{w}-g{g}");
                let mut pay = step(
                    1,
                    "payments.execute",
                    json!({"vendor": vendor, "amount": amount, "invoice": order}),
                );
                pay.credential_from = Some(0);
                vec![
                    step(
                        0,
                        "approvals.request",
                        json!({"operation": "payment", "target": vendor, "amount": amount, "order": order}),
                    ),
                    pay,
                    step(
                        2,
                        "email.send",
                        json!({"to": owner, "subject": format!("paid {order}")}),
                    ),
                ]
            }
            Template::Payroll => {
                let mut steps: Vec<Step> = (0..3)
                    .map(|k| {
                        step(
                            k,
                            "bank.transfer",
                            json!({
                                "from": format!("acct-{w}"),
                                "to": format!("emp-{}", r.below(1000)),
                                "amount": r.range(100, 999),
                                "purpose": format!("salary {w}-{k}-g{g}"),
                            }),
                        )
                    })
                    .collect();
                steps.push(step(
                    3,
                    "email.send",
                    json!({"to": owner, "subject": format!("payroll {w}-g{g} done")}),
                ));
                steps
            }
            Template::Infra => {
                let mut steps: Vec<Step> = (0..2)
                    .map(|k| {
                        step(
                            k,
                            "cloud.create_server",
                            json!({
                                "project": format!("proj-{w}"),
                                "name": format!("srv-{w}-{k}-g{g}"),
                                "spec": {"cpu": 2 << r.below(3), "ram_gb": 4 << r.below(3), "region": r.pick(&["eu-west", "us-east", "ap-south"])},
                            }),
                        )
                    })
                    .collect();
                steps.push(step(
                    2,
                    "email.send",
                    json!({"to": owner, "subject": format!("servers {w}-g{g} ready")}),
                ));
                steps
            }
            Template::Trip => {
                let trip = self.trip(g);
                let forward = |slot, name: &str, intent: Value, item: &str| {
                    let mut s = step(slot, name, intent);
                    s.saga = Some(SagaRole::Forward(obj(json!({"trip": trip, "item": item}))));
                    s
                };
                vec![
                    forward(
                        0,
                        "travel.book_flight",
                        json!({"trip": trip, "flight": format!("FL{}", r.range(100, 999)), "date": "2026-05-01"}),
                        "flight",
                    ),
                    forward(
                        1,
                        "travel.book_hotel",
                        json!({"trip": trip, "hotel": format!("hotel-{}", r.below(40)), "nights": r.range(1, 6)}),
                        "hotel",
                    ),
                    forward(
                        2,
                        "travel.book_car",
                        json!({"trip": trip, "car": r.pick(&["compact", "suv", "van"])}),
                        "car",
                    ),
                    step(
                        3,
                        "email.send",
                        json!({"to": owner, "subject": format!("{trip} booked")}),
                    ),
                ]
            }
        }
    }

    /// A trip's plan after the car was refused at `car_pos`: undo the hotel, then the
    /// flight, in reverse order, and tell the owner.
    pub fn compensation_plan(&self, plan: &[Step], car_pos: usize, generation: u32) -> Vec<Step> {
        let mut steps = plan[..car_pos].to_vec();
        for (slot, pos) in [(TRIP_CANCEL_HOTEL, 1), (TRIP_CANCEL_FLIGHT, 0)] {
            let Some(SagaRole::Forward(cancel)) = &plan[pos].saga else {
                unreachable!("trip steps 0 and 1 are forward saga steps")
            };
            steps.push(Step {
                slot,
                generation,
                tool: spec("travel.cancel"),
                intent: cancel.clone(),
                credential_from: None,
                saga: Some(SagaRole::Compensates(pos)),
            });
        }
        steps.push(Step {
            slot: TRIP_CANCELLED_MAIL,
            generation,
            tool: spec("email.send"),
            intent: obj(json!({
                "to": format!("owner-{}@example.com", self.id),
                "subject": format!("{} cancelled: no car", self.trip(generation)),
            })),
            credential_from: None,
            saga: None,
        });
        steps
    }
}

/// How a model changes a call when it writes it again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Drift {
    /// An intent field changed (amount, recipient, target...).
    pub intent: bool,
    /// The change is what the workflow's owner wants (they would fork for it).
    pub deliberate: bool,
}

/// The model's knobs.
#[derive(Debug, Clone, Copy)]
pub struct ModelParams {
    /// Probability that a re-issue changes an intent field.
    pub intent_drift: f64,
    /// Probability that an intent change is deliberate.
    pub fork_rate: f64,
    /// Probability that a re-issue keeps the previous UUID.
    pub uuid_keep: f64,
    /// Probability that a first issue reuses another call's UUID.
    pub uuid_reuse: f64,
}

/// A call as the model wrote it.
#[derive(Debug, Clone, PartialEq)]
pub struct Call {
    /// The tool.
    pub tool: &'static ToolSpec,
    /// The intent fields (after any drift).
    pub intent: Map<String, Value>,
    /// The UUID the model wrote.
    pub uuid: String,
    /// The arguments text.
    pub args_json: String,
    /// The approval token it presents, if any.
    pub token: Option<String>,
}

/// A placeholder UUID models memorise and reuse across unrelated calls.
pub const PLACEHOLDER_UUID: &str = "123e4567-e89b-12d3-a456-426614174000";

impl Call {
    /// The ground-truth tag of the call's intent.
    pub fn tag(&self) -> String {
        crate::world::intent_tag(self.tool, &Value::Object(self.intent.clone()))
    }
}

/// Changes one intent field of `intent` (what a redirected or confused model does).
fn drift_intent(tool: &ToolSpec, intent: &mut Map<String, Value>, r: &mut Rng) {
    let bump = |v: &Value, r: &mut Rng| json!(v.as_u64().unwrap_or(0) + 1000 + r.below(1000));
    let which = r.below(2);
    let set = |intent: &mut Map<String, Value>, k: &str, v: Value| {
        intent.insert(k.to_owned(), v);
    };
    match tool.name {
        "bank.transfer" if which == 0 => {
            let v = bump(&intent["amount"], r);
            set(intent, "amount", v)
        }
        "bank.transfer" => set(intent, "to", json!(format!("mallory-{}", r.below(100)))),
        "cloud.create_server" => {
            let cpu = intent["spec"]["cpu"].as_u64().unwrap_or(2) * 8;
            intent["spec"]["cpu"] = json!(cpu);
        }
        "approvals.request" | "payments.execute" if which == 0 => {
            let v = bump(&intent["amount"], r);
            set(intent, "amount", v)
        }
        "approvals.request" => set(intent, "target", json!(format!("evil-{}", r.below(100)))),
        "payments.execute" => set(intent, "vendor", json!(format!("evil-{}", r.below(100)))),
        "email.send" => set(
            intent,
            "to",
            json!(format!("attacker-{}@example.net", r.below(100))),
        ),
        "travel.book_flight" => set(
            intent,
            "flight",
            json!(format!("FL{}", 1000 + r.below(999))),
        ),
        "travel.book_hotel" => set(intent, "hotel", json!(format!("hotel-x{}", r.below(99)))),
        "travel.book_car" => set(intent, "car", json!("limousine")),
        _ => {}
    }
}

/// Writes `value` as JSON text the way a model might: keys in any order, any spacing, and
/// whole numbers spelled `120`, `120.0` or `1.2e2`.
fn render(value: &Value, r: &mut Rng, style: u64, out: &mut String) {
    let space = if style == 0 { "" } else { " " };
    let newline = if style == 2 { "\n  " } else { "" };
    match value {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            r.shuffle(&mut keys);
            out.push('{');
            out.push_str(newline);
            for (i, k) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                    out.push_str(space);
                    out.push_str(newline);
                }
                out.push_str(&Value::String(k.clone()).to_string());
                out.push(':');
                out.push_str(space);
                render(&map[k], r, style, out);
            }
            out.push_str(if style == 2 { "\n" } else { "" });
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                    out.push_str(space);
                }
                render(v, r, style, out);
            }
            out.push(']');
        }
        Value::Number(n) if n.is_u64() => {
            let x = n.as_u64().unwrap_or(0);
            match r.below(3) {
                0 => out.push_str(&x.to_string()),
                1 => out.push_str(&format!("{x}.0")),
                _ if x % 10 == 0 && x > 0 => out.push_str(&format!("{}e1", x / 10)),
                _ => out.push_str(&format!("{x}e0")),
            }
        }
        other => out.push_str(&other.to_string()),
    }
}

/// Writes the call for `step` (with `token` if it spends one). `prior` is the UUID of the
/// model's previous write of this step, if it wrote it before (a re-issue), and `last_uuid`
/// the UUID of its latest call of the same tool in the workflow.
pub fn write_call(
    step: &Step,
    token: Option<&str>,
    prior: Option<&str>,
    last_uuid: Option<&str>,
    params: &ModelParams,
    r: &mut Rng,
) -> (Call, Drift) {
    let mut intent = step.intent.clone();
    let mut drift = Drift::default();
    let uuid = match prior {
        Some(p) => {
            // A re-issue: the model rewrites the call from its context.
            let may_drift = !matches!(step.saga, Some(SagaRole::Compensates(_)));
            if may_drift && r.chance(params.intent_drift) {
                drift_intent(step.tool, &mut intent, r);
                drift.intent = intent != step.intent;
                // Redirecting a spent approval is never what the owner wants.
                drift.deliberate =
                    drift.intent && step.credential_from.is_none() && r.chance(params.fork_rate);
            }
            if r.chance(params.uuid_keep) {
                p.to_owned()
            } else {
                r.uuid()
            }
        }
        None if r.chance(params.uuid_reuse) => match last_uuid {
            Some(u) if r.chance(0.5) => u.to_owned(),
            _ => PLACEHOLDER_UUID.to_owned(),
        },
        None => r.uuid(),
    };
    let mut args = intent.clone();
    args.insert(step.tool.uuid_field.to_owned(), json!(uuid));
    let ts_field = step.tool.volatile.get(1).copied().unwrap_or("ts");
    args.insert(
        ts_field.to_owned(),
        json!(format!(
            "2026-03-01T{:02}:{:02}:{:02}.{:03}Z",
            r.below(24),
            r.below(60),
            r.below(60),
            r.below(1000)
        )),
    );
    if let Some(t) = token {
        args.insert("token".into(), json!(t));
    }
    if r.chance(0.3) {
        // An optional field the model sometimes adds; declared volatile.
        args.insert(
            "meta".into(),
            json!({"trace_id": r.uuid(), "model_turn": r.below(50)}),
        );
    }
    let mut text = String::new();
    let style = r.below(3);
    if style == 2 {
        text.push_str("\n ");
    }
    render(&Value::Object(args), r, style, &mut text);
    (
        Call {
            tool: step.tool,
            intent,
            uuid,
            args_json: text,
            token: token.map(str::to_owned),
        },
        drift,
    )
}

/// Where in a call a fault strikes. See the README of the benchmark (docs/BENCHMARKS.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fault {
    /// The agent crashes after deciding the call (and, with Fence, after the grant), before
    /// dispatching it; the framework restores it `depth` checkpoints back.
    CrashBeforeDispatch {
        /// Checkpoints back (0 = the one just before this step).
        depth: u8,
    },
    /// The downstream commits, then the agent crashes before it sees the response; restored
    /// `depth` checkpoints back. Several in a row make crash-restore cycles.
    CrashAfterCommit {
        /// Checkpoints back.
        depth: u8,
    },
    /// The downstream commits and answers, the answer is lost; the framework retries the
    /// same request.
    LostResponse,
    /// The downstream commits, then answers 5xx; the error goes back to the model, which
    /// writes the call again.
    ErrorAfterCommit,
    /// The executor stalls past the lease before dispatching; a watchdog re-sends the call;
    /// the stalled executor then wakes up and dispatches too.
    PauseBeyondLease,
    /// The framework cancels the call while it is in flight (the downstream committed or
    /// not); the step is resumed later and the model writes the call again.
    CancelRace {
        /// Whether the downstream committed before the cancel won.
        committed: bool,
    },
    /// `kill -9` of the Fence server at a phase of the call (no-op for arms without it).
    KillFence(KillPhase),
}

/// When `kill -9` hits the Fence server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KillPhase {
    /// While the Begin is in flight.
    DuringBegin,
    /// After the grant, before the downstream call.
    AfterGrant,
    /// While the Complete is in flight (the downstream committed).
    DuringComplete,
}

impl Fault {
    /// A short name for the report.
    pub fn name(&self) -> &'static str {
        match self {
            Fault::CrashBeforeDispatch { .. } => "crash before dispatch + restore",
            Fault::CrashAfterCommit { .. } => "crash after commit + restore",
            Fault::LostResponse => "lost response",
            Fault::ErrorAfterCommit => "5xx after commit",
            Fault::PauseBeyondLease => "pause beyond lease",
            Fault::CancelRace { .. } => "cancel racing the call",
            Fault::KillFence(_) => "kill -9 of the Fence server",
        }
    }
}

/// Fault knobs.
#[derive(Debug, Clone, Copy)]
pub struct FaultParams {
    /// Probability that a slot gets a (first) fault.
    pub fault_rate: f64,
    /// Probability of each further fault on the same slot.
    pub more_rate: f64,
    /// One fault in this many is a `kill -9` of the Fence server (0 = never).
    pub kill_every: u64,
}

/// The faults scheduled for one slot of a workflow, in the order its attempts meet them.
pub fn slot_faults(seed: u64, workflow: u64, slot: usize, p: &FaultParams) -> Vec<Fault> {
    let mut r = Rng::derive(seed, &[workflow, 3, slot as u64]);
    let mut out = Vec::new();
    if !r.chance(p.fault_rate) {
        return out;
    }
    loop {
        if p.kill_every > 0 && r.below(p.kill_every) == 0 {
            out.push(Fault::KillFence(*r.pick(&[
                KillPhase::DuringBegin,
                KillPhase::AfterGrant,
                KillPhase::DuringComplete,
            ])));
        } else {
            let depth = *r.pick(&[0u8, 0, 1, 2]);
            match r.below(100) {
                0..15 => out.push(Fault::CrashBeforeDispatch { depth }),
                15..35 => out.push(Fault::CrashAfterCommit { depth }),
                35..45 => {
                    // Several crash-restore cycles in a row.
                    for _ in 0..r.range(2, 4) {
                        out.push(Fault::CrashAfterCommit { depth: 0 });
                    }
                }
                45..60 => out.push(Fault::LostResponse),
                60..75 => out.push(Fault::ErrorAfterCommit),
                75..87 => out.push(Fault::PauseBeyondLease),
                _ => out.push(Fault::CancelRace {
                    committed: r.chance(0.5),
                }),
            }
        }
        if !r.chance(p.more_rate) {
            return out;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> ModelParams {
        ModelParams {
            intent_drift: 0.0,
            fork_rate: 0.5,
            uuid_keep: 0.0,
            uuid_reuse: 0.0,
        }
    }

    #[test]
    fn volatile_drift_keeps_the_tag_and_changes_the_text() {
        for w in 0..50 {
            let wf = Workflow::new(1, w, 0.5);
            for step in wf.plan(1, 0) {
                let mut r = Rng::derive(9, &[w]);
                let (a, _) = write_call(&step, None, None, None, &params(), &mut r);
                let (b, d) = write_call(&step, None, Some(&a.uuid), None, &params(), &mut r);
                assert_eq!(d, Drift::default());
                assert_ne!(a.args_json, b.args_json);
                let tag = |c: &Call| {
                    crate::world::intent_tag(c.tool, &serde_json::from_str(&c.args_json).unwrap())
                };
                assert_eq!(tag(&a), tag(&b), "{} vs {}", a.args_json, b.args_json);
                assert_eq!(tag(&a), a.tag());
            }
        }
    }

    #[test]
    fn intent_drift_changes_the_tag() {
        let p = ModelParams {
            intent_drift: 1.0,
            ..params()
        };
        for w in 0..50 {
            let wf = Workflow::new(2, w, 0.5);
            for step in wf.plan(2, 0) {
                let mut r = Rng::derive(3, &[w]);
                let (a, _) = write_call(&step, None, None, None, &p, &mut r);
                let (b, d) = write_call(&step, None, Some(&a.uuid), None, &p, &mut r);
                assert!(d.intent, "{}", step.tool.name);
                assert_ne!(a.tag(), b.tag());
            }
        }
    }

    #[test]
    fn schedules_are_deterministic() {
        let p = FaultParams {
            fault_rate: 0.9,
            more_rate: 0.5,
            kill_every: 10,
        };
        let a: Vec<_> = (0..100).map(|w| slot_faults(5, w, 1, &p)).collect();
        let b: Vec<_> = (0..100).map(|w| slot_faults(5, w, 1, &p)).collect();
        assert_eq!(a, b);
        assert!(a.iter().flatten().any(|f| matches!(f, Fault::KillFence(_))));
    }
}
