//! Domain types of the client's public API, converted from and to the generated `fence.v1`
//! messages. Generated types stop here: everything a caller sees is one of these.
//!
//! Invariant: a conversion from a response never invents a value. An enum that is unspecified
//! or unknown to this client, or a missing required message, is an [`Error::Protocol`]; an
//! optional string field that is empty on the wire becomes `None`.

use std::fmt;

use fence_proto::v1 as pb;

use crate::error::Error;

/// Declares a domain enum mirroring a generated one (same variant names, minus `Unspecified`),
/// with conversions both ways and the protobuf names.
macro_rules! domain_enum {
    (
        $(#[$meta:meta])*
        pub enum $name:ident mirrors $pb:ident {
            $( $(#[$vmeta:meta])* $variant:ident, )+
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum $name {
            $( $(#[$vmeta])* $variant, )+
        }

        impl From<$name> for pb::$pb {
            fn from(value: $name) -> Self {
                match value {
                    $( $name::$variant => pb::$pb::$variant, )+
                }
            }
        }

        impl TryFrom<pb::$pb> for $name {
            type Error = Error;

            fn try_from(value: pb::$pb) -> Result<Self, Error> {
                match value {
                    $( pb::$pb::$variant => Ok($name::$variant), )+
                    pb::$pb::Unspecified => Err(Error::protocol(concat!(
                        stringify!($pb),
                        " is unspecified in an answer"
                    ))),
                }
            }
        }

        impl TryFrom<i32> for $name {
            type Error = Error;

            fn try_from(value: i32) -> Result<Self, Error> {
                let known = pb::$pb::try_from(value).map_err(|_| {
                    Error::protocol(format!(
                        concat!("unknown ", stringify!($pb), " value {}"),
                        value
                    ))
                })?;
                known.try_into()
            }
        }

        impl $name {
            /// The protobuf name of the value (e.g. `"FORK_REQUIRED"`), as used in
            /// `ErrorInfo` details and logs.
            pub fn as_str_name(self) -> &'static str {
                pb::$pb::from(self).as_str_name()
            }

            /// Parses a protobuf name (e.g. `"FORK_REQUIRED"`); `None` for an unknown name or
            /// the unspecified value.
            pub fn from_str_name(name: &str) -> Option<Self> {
                pb::$pb::from_str_name(name).and_then(|value| value.try_into().ok())
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str_name())
            }
        }
    };
}

domain_enum! {
    /// How a tool may be retried (DESIGN.md's table). An unregistered tool is
    /// [`OperationClass::NonRetryable`].
    pub enum OperationClass mirrors OperationClass {
        /// Read-only: retry freely.
        SafeRetry,
        /// Idempotent under its downstream key: a repeat returns the recorded result, an
        /// ambiguous failure is retried with the same key.
        Deduplicate,
        /// A repeat is allowed only after an outcome check says the first did not happen.
        RequiresEffectCheck,
        /// At most once, ever.
        NonRetryable,
    }
}

domain_enum! {
    /// The state of a recorded effect (or the answer state of a query).
    pub enum EffectState mirrors EffectState {
        /// Granted; the lease is live; no progress reported yet.
        Accepted,
        /// Granted and heartbeated; the lease is live.
        Running,
        /// The effect happened; the receipt holds its result.
        Completed,
        /// The effect certainly did not happen; it may be granted again.
        FailedBeforeInput,
        /// The effect may or may not have happened; only a reconcile with evidence settles it.
        EffectUnknown,
        /// Answer state of a call refused as a duplicate.
        RejectedDuplicate,
        /// Answer state of a query that matched nothing.
        NotFound,
        /// A completed saga step whose compensation has completed.
        Compensated,
    }
}

impl EffectState {
    /// True for the states an attempt holding a lease can still change (`ACCEPTED`, `RUNNING`).
    pub fn is_live(self) -> bool {
        matches!(self, EffectState::Accepted | EffectState::Running)
    }

    /// True when the effect happened and its result is recorded (`COMPLETED`, `COMPENSATED`).
    pub fn has_result(self) -> bool {
        matches!(self, EffectState::Completed | EffectState::Compensated)
    }
}

domain_enum! {
    /// Why a call was refused. Retry logic switches on this, never on the message.
    pub enum ReasonCode mirrors ReasonCode {
        /// After a restore, the call differs from the recorded effect due here: fork first.
        ForkRequired,
        /// The step key is recorded with a different intent.
        ArgumentMismatch,
        /// The same intent is already recorded on the lineage and the call has no step key.
        DuplicateIntent,
        /// A presented credential's use budget is spent.
        CredentialConsumed,
        /// The request's epoch is older than the run's: the run was restored since.
        StaleEpoch,
        /// The matching record is past its retention window: only its tombstone remains.
        Expired,
        /// The matching effect's outcome is unknown; reconcile it first.
        ReconcileRequired,
        /// A presented credential is bound to another tool or intent.
        CredentialMismatch,
        /// A completion reports a result different from the recorded one.
        ResultConflict,
        /// The effect, run, checkpoint or tool referred to does not exist.
        UnknownRecord,
        /// The effect is not in a state that allows this transition.
        InvalidTransition,
        /// The lease of this attempt lapsed or was granted to a newer attempt.
        LeaseLost,
        /// Reconcile was called without evidence.
        EvidenceRequired,
        /// A size or count limit was exceeded.
        LimitExceeded,
        /// The request's epoch is newer than the run's: it was never issued.
        UnknownEpoch,
    }
}

domain_enum! {
    /// What a caller should do about a refusal.
    pub enum RecoveryAction mirrors RecoveryAction {
        /// Use the recorded result in the attached receipt; do not execute.
        ReplayResult,
        /// Another attempt holds the lease: wait, then query the outcome.
        WaitAndQuery,
        /// Check the outside world and reconcile with evidence.
        Reconcile,
        /// Fork from `Refusal::checkpoint_id` and continue on the new branch.
        Fork,
        /// Fix the arguments (or use a new step key for a new step).
        FixArgument,
        /// Obtain a fresh credential or approval.
        Reauthenticate,
        /// Do not continue this action.
        Stop,
        /// Fetch the run's current epoch: this process may be a zombie from before a restore.
        RefreshEpoch,
        /// If the repetition is intended, resend as a deliberate repeat or with a new step key.
        ConfirmRepeat,
    }
}

/// How the string values of an intent schema's `normalized_fields` are normalised.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum StringNormalization {
    /// Compare strings exactly.
    #[default]
    Exact,
    /// Trim leading and trailing whitespace.
    Trim,
    /// Trim, then lowercase.
    TrimLowercase,
}

impl From<StringNormalization> for pb::StringNormalization {
    fn from(value: StringNormalization) -> Self {
        match value {
            StringNormalization::Exact => pb::StringNormalization::Unspecified,
            StringNormalization::Trim => pb::StringNormalization::Trim,
            StringNormalization::TrimLowercase => pb::StringNormalization::TrimLowercase,
        }
    }
}

impl TryFrom<i32> for StringNormalization {
    type Error = Error;

    fn try_from(value: i32) -> Result<Self, Error> {
        match pb::StringNormalization::try_from(value) {
            Ok(pb::StringNormalization::Unspecified) => Ok(StringNormalization::Exact),
            Ok(pb::StringNormalization::Trim) => Ok(StringNormalization::Trim),
            Ok(pb::StringNormalization::TrimLowercase) => Ok(StringNormalization::TrimLowercase),
            Err(_) => Err(Error::protocol(format!(
                "unknown StringNormalization value {value}"
            ))),
        }
    }
}

/// `Some(s)` unless `s` is empty (proto3 encodes "absent" strings as empty).
pub(crate) fn non_empty(s: String) -> Option<String> {
    (!s.is_empty()).then_some(s)
}

/// A required sub-message of an answer, or a protocol error naming it.
pub(crate) fn required<T>(value: Option<T>, what: &str) -> Result<T, Error> {
    value.ok_or_else(|| Error::protocol(format!("the answer has no {what}")))
}

// ---------------------------------------------------------------------------------------------
// Tools
// ---------------------------------------------------------------------------------------------

/// Which argument fields are volatile (ignored by the intent fingerprint) and how the rest is
/// normalised.
///
/// ```
/// use fence_client::{IntentSchema, StringNormalization};
///
/// let schema = IntentSchema::default()
///     .volatile(["request_id", "timestamp"])
///     .normalized(["currency"], StringNormalization::TrimLowercase);
/// assert_eq!(schema.volatile_fields, ["request_id", "timestamp"]);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct IntentSchema {
    /// Dotted paths of volatile fields (`*` matches any key or element).
    pub volatile_fields: Vec<String>,
    /// Dotted paths of string fields normalised as `string_normalization` says.
    pub normalized_fields: Vec<String>,
    /// How `normalized_fields` are normalised.
    pub string_normalization: StringNormalization,
}

impl IntentSchema {
    /// Adds volatile field paths.
    #[must_use]
    pub fn volatile<I, S>(mut self, fields: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.volatile_fields
            .extend(fields.into_iter().map(Into::into));
        self
    }

    /// Adds normalised field paths and sets how they are normalised.
    #[must_use]
    pub fn normalized<I, S>(mut self, fields: I, how: StringNormalization) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.normalized_fields
            .extend(fields.into_iter().map(Into::into));
        self.string_normalization = how;
        self
    }
}

impl From<IntentSchema> for pb::IntentSchema {
    fn from(value: IntentSchema) -> Self {
        pb::IntentSchema {
            volatile_fields: value.volatile_fields,
            normalized_fields: value.normalized_fields,
            string_normalization: pb::StringNormalization::from(value.string_normalization) as i32,
        }
    }
}

impl TryFrom<pb::IntentSchema> for IntentSchema {
    type Error = Error;

    fn try_from(value: pb::IntentSchema) -> Result<Self, Error> {
        Ok(IntentSchema {
            volatile_fields: value.volatile_fields,
            normalized_fields: value.normalized_fields,
            string_normalization: value.string_normalization.try_into()?,
        })
    }
}

/// A tool's definition: its name, operation class, intent schema, retention and lease.
///
/// ```
/// use fence_client::{OperationClass, ToolDef};
///
/// let charge = ToolDef::new("payments.charge", OperationClass::NonRetryable)
///     .volatile(["request_id", "timestamp"])
///     .lease_ms(30_000);
/// assert_eq!(charge.class, OperationClass::NonRetryable);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolDef {
    /// The tool's name, as used in calls.
    pub name: String,
    /// How it may be retried.
    pub class: OperationClass,
    /// Which argument fields are volatile.
    pub intent_schema: IntentSchema,
    /// How long a finished effect keeps its payload; 0 = the server default.
    pub retention_ms: u64,
    /// Default lease of a grant; 0 = the server default.
    pub lease_ms: u64,
}

impl ToolDef {
    /// A definition with an empty intent schema and server-default retention and lease.
    pub fn new(name: impl Into<String>, class: OperationClass) -> Self {
        ToolDef {
            name: name.into(),
            class,
            intent_schema: IntentSchema::default(),
            retention_ms: 0,
            lease_ms: 0,
        }
    }

    /// Adds volatile field paths to the intent schema.
    #[must_use]
    pub fn volatile<I, S>(mut self, fields: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.intent_schema = self.intent_schema.volatile(fields);
        self
    }

    /// Replaces the intent schema.
    #[must_use]
    pub fn intent_schema(mut self, schema: IntentSchema) -> Self {
        self.intent_schema = schema;
        self
    }

    /// Sets the retention of finished effects.
    #[must_use]
    pub fn retention_ms(mut self, ms: u64) -> Self {
        self.retention_ms = ms;
        self
    }

    /// Sets the default lease of a grant.
    #[must_use]
    pub fn lease_ms(mut self, ms: u64) -> Self {
        self.lease_ms = ms;
        self
    }
}

impl From<ToolDef> for pb::ToolSpec {
    fn from(value: ToolDef) -> Self {
        pb::ToolSpec {
            name: value.name,
            class: pb::OperationClass::from(value.class) as i32,
            intent_schema: Some(value.intent_schema.into()),
            retention_ms: value.retention_ms,
            lease_ms: value.lease_ms,
            version: 0,
            registered_at_ms: 0,
        }
    }
}

/// A tool's stored registration: its definition and version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegisteredTool {
    /// The definition as stored.
    pub def: ToolDef,
    /// The registration's version (1, 2, ...).
    pub version: u32,
    /// When this version was registered (ms since the Unix epoch).
    pub registered_at_ms: u64,
}

impl TryFrom<pb::ToolSpec> for RegisteredTool {
    type Error = Error;

    fn try_from(value: pb::ToolSpec) -> Result<Self, Error> {
        Ok(RegisteredTool {
            def: ToolDef {
                name: value.name,
                class: value.class.try_into()?,
                intent_schema: value.intent_schema.unwrap_or_default().try_into()?,
                retention_ms: value.retention_ms,
                lease_ms: value.lease_ms,
            },
            version: value.version,
            registered_at_ms: value.registered_at_ms,
        })
    }
}

/// A value returned by a create-if-absent call, and whether this call created it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored<T> {
    /// The stored value (new or existing).
    pub value: T,
    /// True when this call created it; false when it already existed unchanged.
    pub created: bool,
}

// ---------------------------------------------------------------------------------------------
// Effects
// ---------------------------------------------------------------------------------------------

/// A saga step's compensation: the call that undoes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Compensation {
    /// The compensating tool.
    pub tool: String,
    /// Its JSON arguments.
    pub arguments_json: String,
}

impl Compensation {
    /// A compensation calling `tool` with `arguments_json`.
    pub fn new(tool: impl Into<String>, arguments_json: impl Into<String>) -> Self {
        Compensation {
            tool: tool.into(),
            arguments_json: arguments_json.into(),
        }
    }
}

impl From<Compensation> for pb::Compensation {
    fn from(value: Compensation) -> Self {
        pb::Compensation {
            tool: value.tool,
            arguments_json: value.arguments_json,
        }
    }
}

fn compensation_opt(value: Option<pb::Compensation>) -> Option<Compensation> {
    value.filter(|c| !c.tool.is_empty()).map(|c| Compensation {
        tool: c.tool,
        arguments_json: c.arguments_json,
    })
}

/// Everything recorded about one effect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Receipt {
    /// The effect's id (stable, opaque).
    pub effect_id: String,
    /// The run.
    pub run_id: String,
    /// The branch it was recorded on.
    pub branch: String,
    /// The epoch it was granted in.
    pub epoch: u64,
    /// Its position in the branch's log.
    pub position: u64,
    /// The tool.
    pub tool: String,
    /// The tool registration version it was fingerprinted under (0 = unregistered tool).
    pub tool_version: u32,
    /// The class it was fenced under.
    pub class: OperationClass,
    /// The caller's step key, if any.
    pub step_key: Option<String>,
    /// blake3 of the tool and the canonical intent (lowercase hex).
    pub intent_fingerprint: String,
    /// blake3 of the tool and the raw arguments (lowercase hex).
    pub request_fingerprint: String,
    /// Which identical intent this is on the lineage (1 = the first).
    pub occurrence: u32,
    /// The state.
    pub state: EffectState,
    /// The recorded result (when completed). Empty on a tombstone.
    pub result: Vec<u8>,
    /// Failure or reconcile note. Empty on a tombstone.
    pub detail: String,
    /// The key passed downstream as the external API's idempotency key.
    pub downstream_key: String,
    /// How many times it was granted.
    pub attempt: u32,
    /// Lease expiry while accepted or running; 0 otherwise.
    pub lease_expires_at_ms: u64,
    /// When it was recorded.
    pub created_at_ms: u64,
    /// When it last changed state.
    pub updated_at_ms: u64,
    /// When it turns (or turned) into a tombstone; 0 while not finished.
    pub expires_at_ms: u64,
    /// True when only the tombstone remains.
    pub tombstone: bool,
    /// Evidence given to reconcile, if any.
    pub evidence: String,
    /// How many times the recorded result was replayed.
    pub replays: u32,
    /// The epoch of the last replay; 0 if never replayed.
    pub last_replay_epoch: u64,
    /// Keyed hashes of the credentials this effect spent.
    pub credential_hashes: Vec<String>,
    /// The saga it belongs to, if any.
    pub saga_id: Option<String>,
    /// Its compensation, if declared.
    pub compensation: Option<Compensation>,
    /// When it is a compensation: the effect it undoes.
    pub compensates_effect_id: Option<String>,
    /// When it was compensated: the compensating effect.
    pub compensated_by_effect_id: Option<String>,
    /// The call's arguments as sent. Empty on a tombstone.
    pub arguments_json: String,
    /// True when the call was a deliberate repeat of an identical intent.
    pub deliberate_repeat: bool,
    /// The checkpoint the call named as its parent, if any.
    pub parent_checkpoint_id: Option<String>,
}

impl TryFrom<pb::Receipt> for Receipt {
    type Error = Error;

    fn try_from(r: pb::Receipt) -> Result<Self, Error> {
        Ok(Receipt {
            class: r.class.try_into()?,
            state: r.state.try_into()?,
            effect_id: r.effect_id,
            run_id: r.run_id,
            branch: r.branch,
            epoch: r.epoch,
            position: r.position,
            tool: r.tool,
            tool_version: r.tool_version,
            step_key: non_empty(r.step_key),
            intent_fingerprint: r.intent_fingerprint,
            request_fingerprint: r.request_fingerprint,
            occurrence: r.occurrence,
            result: r.result,
            detail: r.detail,
            downstream_key: r.downstream_key,
            attempt: r.attempt,
            lease_expires_at_ms: r.lease_expires_at_ms,
            created_at_ms: r.created_at_ms,
            updated_at_ms: r.updated_at_ms,
            expires_at_ms: r.expires_at_ms,
            tombstone: r.tombstone,
            evidence: r.evidence,
            replays: r.replays,
            last_replay_epoch: r.last_replay_epoch,
            credential_hashes: r.credential_hashes,
            saga_id: non_empty(r.saga_id),
            compensation: compensation_opt(r.compensation),
            compensates_effect_id: non_empty(r.compensates_effect_id),
            compensated_by_effect_id: non_empty(r.compensated_by_effect_id),
            arguments_json: r.arguments_json,
            deliberate_repeat: r.deliberate_repeat,
            parent_checkpoint_id: non_empty(r.parent_checkpoint_id),
        })
    }
}

/// An optional receipt: absent, or present with an empty effect id (nothing recorded), is `None`.
pub(crate) fn receipt_opt(value: Option<pb::Receipt>) -> Result<Option<Receipt>, Error> {
    match value {
        Some(r) if !r.effect_id.is_empty() => Ok(Some(r.try_into()?)),
        _ => Ok(None),
    }
}

/// A required receipt.
pub(crate) fn receipt_req(value: Option<pb::Receipt>, what: &str) -> Result<Receipt, Error> {
    receipt_opt(value)?.ok_or_else(|| Error::protocol(format!("the answer has no {what}")))
}

/// A presented credential (one use of it is spent by the call). Its `Debug` output never shows
/// the raw value.
#[derive(Clone, PartialEq, Eq)]
pub struct CredentialUse {
    /// The raw credential; hashed by the server on arrival, never stored.
    pub token: Vec<u8>,
    /// Use budget on its first presentation if it was not registered; 0 = one-time.
    pub budget: u32,
}

impl fmt::Debug for CredentialUse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CredentialUse")
            .field("token", &"<redacted>")
            .field("budget", &self.budget)
            .finish()
    }
}

/// Permission to execute: the caller runs the tool now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    /// The effect's id (empty for an unrecorded `SAFE_RETRY` call: nothing to complete).
    pub effect_id: String,
    /// Pass this downstream as the external API's idempotency key.
    pub downstream_key: String,
    /// The lease expiry (server clock, ms since the Unix epoch).
    pub lease_expires_at_ms: u64,
    /// The attempt number (1 = first grant).
    pub attempt: u32,
    /// The receipt as recorded; `None` for an unrecorded `SAFE_RETRY` call.
    pub receipt: Option<Receipt>,
}

impl Grant {
    /// True when the grant is recorded and must be completed.
    pub fn is_recorded(&self) -> bool {
        !self.effect_id.is_empty()
    }
}

/// A refusal: nothing was executed or recorded. Carried by [`Decision::Refused`] and by
/// [`Error::Refused`] (for other RPCs' refusals, parsed from the status details).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// Why.
    pub reason: ReasonCode,
    /// What to do about it.
    pub recovery: RecoveryAction,
    /// The receipt it refers to, if any.
    pub receipt: Option<Receipt>,
    /// One short sentence fit to show a model.
    pub message: String,
    /// The effect it refers to, if any (from the receipt, or the status details).
    pub effect_id: Option<String>,
    /// For `FORK_REQUIRED`: the checkpoint to fork from.
    pub checkpoint_id: Option<String>,
    /// For `STALE_EPOCH`: the run's current epoch.
    pub current_epoch: Option<u64>,
}

impl TryFrom<pb::Refusal> for Refusal {
    type Error = Error;

    fn try_from(r: pb::Refusal) -> Result<Self, Error> {
        let receipt = receipt_opt(r.receipt)?;
        Ok(Refusal {
            reason: r.reason.try_into()?,
            recovery: r.recovery.try_into()?,
            effect_id: receipt.as_ref().map(|r| r.effect_id.clone()),
            receipt,
            message: r.message,
            checkpoint_id: non_empty(r.checkpoint_id),
            current_epoch: (r.current_epoch != 0).then_some(r.current_epoch),
        })
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({}): {}", self.reason, self.recovery, self.message)
    }
}

/// The answer to a Begin.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Run the tool now.
    Execute(Grant),
    /// The recorded outcome is the answer: do not run the tool.
    Replay(Receipt),
    /// Another attempt holds the lease: wait, then query the outcome.
    InProgress {
        /// The running effect.
        receipt: Receipt,
        /// A suggested wait before querying, in ms.
        retry_after_ms: u64,
    },
    /// Refused: nothing was executed or recorded.
    Refused(Refusal),
}

impl TryFrom<pb::Decision> for Decision {
    type Error = Error;

    fn try_from(d: pb::Decision) -> Result<Self, Error> {
        use pb::decision::Outcome;
        match required(d.outcome, "decision outcome")? {
            Outcome::Execute(e) => Ok(Decision::Execute(Grant {
                receipt: receipt_opt(e.receipt)?,
                effect_id: e.effect_id,
                downstream_key: e.downstream_key,
                lease_expires_at_ms: e.lease_expires_at_ms,
                attempt: e.attempt,
            })),
            Outcome::Replay(r) => Ok(Decision::Replay(receipt_req(r.receipt, "replay receipt")?)),
            Outcome::InProgress(p) => Ok(Decision::InProgress {
                receipt: receipt_req(p.receipt, "in-progress receipt")?,
                retry_after_ms: p.retry_after_ms,
            }),
            Outcome::Refused(r) => Ok(Decision::Refused(r.try_into()?)),
        }
    }
}

/// A Begin's answer: the decision and the run's current epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BeginOutcome {
    /// The decision.
    pub decision: Decision,
    /// The run's current epoch (so a caller that sent 0 learns it).
    pub epoch: u64,
}

impl TryFrom<pb::BeginResponse> for BeginOutcome {
    type Error = Error;

    fn try_from(r: pb::BeginResponse) -> Result<Self, Error> {
        Ok(BeginOutcome {
            decision: required(r.decision, "decision")?.try_into()?,
            epoch: r.epoch,
        })
    }
}

/// One completion of a [`FenceClient::complete_batch`](crate::FenceClient::complete_batch).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompleteCall {
    /// The effect id from the grant.
    pub effect_id: String,
    /// The attempt number from the grant.
    pub attempt: u32,
    /// The caller's epoch (0 before any restore).
    pub epoch: u64,
    /// How the effect ended.
    pub completion: Completion,
}

impl CompleteCall {
    /// A completion of `effect_id`'s `attempt`, at epoch 0.
    pub fn new(effect_id: impl Into<String>, attempt: u32, completion: Completion) -> Self {
        Self {
            effect_id: effect_id.into(),
            attempt,
            epoch: 0,
            completion,
        }
    }

    /// Sets the caller's epoch.
    pub fn epoch(mut self, epoch: u64) -> Self {
        self.epoch = epoch;
        self
    }
}

/// How a granted effect ended, as reported to Complete.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Completion {
    /// The effect happened: its result.
    Result(Vec<u8>),
    /// It certainly did not happen (nothing reached the outside world): what failed.
    FailedBeforeInput(String),
    /// It may have happened: what is known.
    Unknown(String),
}

impl From<Completion> for pb::complete_request::Outcome {
    fn from(value: Completion) -> Self {
        use pb::complete_request::Outcome;
        match value {
            Completion::Result(r) => Outcome::Result(r),
            Completion::FailedBeforeInput(detail) => {
                Outcome::FailedBeforeInput(pb::FailedBeforeInput { detail })
            }
            Completion::Unknown(detail) => Outcome::Unknown(pb::Unknown { detail }),
        }
    }
}

/// What an outcome check found about an effect whose outcome was unknown (for Reconcile).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finding {
    /// The effect did happen: its result.
    Completed(Vec<u8>),
    /// The effect did not happen: what shows it. It may be granted again.
    FailedBeforeInput(String),
}

impl From<Finding> for pb::reconcile_request::Outcome {
    fn from(value: Finding) -> Self {
        use pb::reconcile_request::Outcome;
        match value {
            Finding::Completed(r) => Outcome::CompletedResult(r),
            Finding::FailedBeforeInput(detail) => {
                Outcome::FailedBeforeInput(pb::FailedBeforeInput { detail })
            }
        }
    }
}

/// What to look an outcome up by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OutcomeKey {
    /// By effect id.
    EffectId(String),
    /// By step key on a run's branch lineage.
    StepKey {
        /// The run.
        run_id: String,
        /// The branch (`None` = "main").
        branch: Option<String>,
        /// The step key.
        step_key: String,
    },
    /// By intent (the latest occurrence on the lineage).
    Intent {
        /// The run.
        run_id: String,
        /// The branch (`None` = "main").
        branch: Option<String>,
        /// The tool.
        tool: String,
        /// The arguments, canonicalised as at Begin.
        arguments_json: String,
    },
}

impl From<OutcomeKey> for pb::query_outcome_request::Key {
    fn from(value: OutcomeKey) -> Self {
        use pb::query_outcome_request::Key;
        match value {
            OutcomeKey::EffectId(id) => Key::EffectId(id),
            OutcomeKey::StepKey {
                run_id,
                branch,
                step_key,
            } => Key::StepKey(pb::StepKeyQuery {
                run_id,
                branch: branch.unwrap_or_default(),
                step_key,
            }),
            OutcomeKey::Intent {
                run_id,
                branch,
                tool,
                arguments_json,
            } => Key::Intent(pb::IntentQuery {
                run_id,
                branch: branch.unwrap_or_default(),
                tool,
                arguments_json,
            }),
        }
    }
}

/// The answer to "what happened?": a state and, unless `NOT_FOUND`, the receipt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// The state as of now (a lapsed lease reads `EFFECT_UNKNOWN`), or `NOT_FOUND`.
    pub state: EffectState,
    /// The receipt; `None` when not found.
    pub receipt: Option<Receipt>,
}

impl TryFrom<pb::QueryOutcomeResponse> for Outcome {
    type Error = Error;

    fn try_from(r: pb::QueryOutcomeResponse) -> Result<Self, Error> {
        Ok(Outcome {
            state: r.state.try_into()?,
            receipt: receipt_opt(r.receipt)?,
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Runs
// ---------------------------------------------------------------------------------------------

/// A named position in a branch's effect log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointInfo {
    /// The caller's name for it (e.g. the agent framework's own checkpoint id).
    pub checkpoint_id: String,
    /// The branch it belongs to.
    pub branch: String,
    /// How many effects the branch had recorded when it was taken.
    pub position: u64,
    /// The run's epoch when it was taken.
    pub epoch: u64,
    /// When it was taken.
    pub created_at_ms: u64,
}

impl From<pb::CheckpointInfo> for CheckpointInfo {
    fn from(c: pb::CheckpointInfo) -> Self {
        CheckpointInfo {
            checkpoint_id: c.checkpoint_id,
            branch: c.branch,
            position: c.position,
            epoch: c.epoch,
            created_at_ms: c.created_at_ms,
        }
    }
}

/// A line of a run's history.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BranchInfo {
    /// The branch's name; the root branch is "main".
    pub name: String,
    /// The parent branch; `None` for "main".
    pub parent: Option<String>,
    /// The checkpoint on the parent it starts from; `None` for "main".
    pub forked_from_checkpoint: Option<String>,
    /// The parent's log position it starts from.
    pub fork_position: u64,
    /// Why it was forked.
    pub reason: String,
    /// How many effects the branch itself has recorded.
    pub length: u64,
    /// Replay tape still to be consumed (0 = on the normal path).
    pub pending_replays: u64,
    /// The checkpoint the pending tape was built from, if any.
    pub restored_from_checkpoint: Option<String>,
    /// The run's epoch when the branch was created.
    pub created_epoch: u64,
    /// When it was created.
    pub created_at_ms: u64,
    /// Effects carried from the parent that the branch has not re-issued yet (see [`Forked`]).
    pub pending_carried: u64,
}

/// What a fork made: the new branch, and what it carries from its parent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Forked {
    /// The new branch.
    pub branch: BranchInfo,
    /// The parent's effects after the checkpoint, in its log order. They stay done: a call on
    /// the new branch equivalent to one of them replays it instead of running again; any other
    /// call is a new effect.
    pub carried: Vec<Receipt>,
}

impl From<pb::BranchInfo> for BranchInfo {
    fn from(b: pb::BranchInfo) -> Self {
        BranchInfo {
            name: b.name,
            parent: non_empty(b.parent),
            forked_from_checkpoint: non_empty(b.forked_from_checkpoint),
            fork_position: b.fork_position,
            reason: b.reason,
            length: b.length,
            pending_replays: b.pending_replays,
            restored_from_checkpoint: non_empty(b.restored_from_checkpoint),
            created_epoch: b.created_epoch,
            created_at_ms: b.created_at_ms,
            pending_carried: b.pending_carried,
        }
    }
}

/// One restore, kept in the run's history.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RestoreEvent {
    /// The epoch it created.
    pub epoch: u64,
    /// The checkpoint restored to.
    pub checkpoint_id: String,
    /// Its branch.
    pub branch: String,
    /// The effects put on the replay tape, in log order.
    pub tape_effect_ids: Vec<String>,
    /// When it happened.
    pub at_ms: u64,
}

impl From<pb::RestoreEvent> for RestoreEvent {
    fn from(e: pb::RestoreEvent) -> Self {
        RestoreEvent {
            epoch: e.epoch,
            checkpoint_id: e.checkpoint_id,
            branch: e.branch,
            tape_effect_ids: e.tape_effect_ids,
            at_ms: e.at_ms,
        }
    }
}

/// A run's state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunInfo {
    /// The caller's run id.
    pub run_id: String,
    /// The current epoch (starts at 1; every restore increments it).
    pub epoch: u64,
    /// All branches, "main" first.
    pub branches: Vec<BranchInfo>,
    /// All checkpoints, in creation order.
    pub checkpoints: Vec<CheckpointInfo>,
    /// Every restore, oldest first.
    pub restores: Vec<RestoreEvent>,
    /// How many effects the run has recorded on all branches.
    pub effect_count: u64,
    /// When the run was created.
    pub created_at_ms: u64,
}

impl From<pb::RunInfo> for RunInfo {
    fn from(r: pb::RunInfo) -> Self {
        RunInfo {
            run_id: r.run_id,
            epoch: r.epoch,
            branches: r.branches.into_iter().map(Into::into).collect(),
            checkpoints: r.checkpoints.into_iter().map(Into::into).collect(),
            restores: r.restores.into_iter().map(Into::into).collect(),
            effect_count: r.effect_count,
            created_at_ms: r.created_at_ms,
        }
    }
}

/// The result of a restore: the new epoch, the rewound branch and its replay tape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Restored {
    /// The new epoch: every later call on the run must carry it.
    pub epoch: u64,
    /// The branch that was rewound.
    pub branch: String,
    /// The effects recorded on the branch after the checkpoint, in log order.
    pub tape: Vec<Receipt>,
}

impl TryFrom<pb::RestoreResponse> for Restored {
    type Error = Error;

    fn try_from(r: pb::RestoreResponse) -> Result<Self, Error> {
        Ok(Restored {
            epoch: r.epoch,
            branch: r.branch,
            tape: r
                .tape
                .into_iter()
                .map(Receipt::try_from)
                .collect::<Result<_, _>>()?,
        })
    }
}

impl TryFrom<pb::ForkResponse> for Forked {
    type Error = Error;

    fn try_from(r: pb::ForkResponse) -> Result<Self, Error> {
        Ok(Forked {
            branch: required(r.branch, "branch")?.into(),
            carried: r
                .carried
                .into_iter()
                .map(Receipt::try_from)
                .collect::<Result<_, _>>()?,
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Credentials
// ---------------------------------------------------------------------------------------------

/// A credential's use state. The raw value is never returned (it is never stored).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CredentialInfo {
    /// The keyed hash (lowercase hex) it is stored under.
    pub credential_hash: String,
    /// How many uses it allows.
    pub budget: u32,
    /// How many are spent.
    pub uses: u32,
    /// If set, only calls of this tool may spend it.
    pub bound_tool: Option<String>,
    /// If set, only calls with this intent fingerprint may spend it.
    pub bound_intent_fingerprint: Option<String>,
    /// The effects that spent it, in order.
    pub spent_by_effect_ids: Vec<String>,
    /// When it was registered (or first presented).
    pub created_at_ms: u64,
}

impl From<pb::CredentialInfo> for CredentialInfo {
    fn from(c: pb::CredentialInfo) -> Self {
        CredentialInfo {
            credential_hash: c.credential_hash,
            budget: c.budget,
            uses: c.uses,
            bound_tool: non_empty(c.bound_tool),
            bound_intent_fingerprint: non_empty(c.bound_intent_fingerprint),
            spent_by_effect_ids: c.spent_by_effect_ids,
            created_at_ms: c.created_at_ms,
        }
    }
}

/// A credential to register: a one-time (or n-time) authority, optionally bound to a tool or
/// to one exact call. Its `Debug` output never shows the raw value.
///
/// ```
/// use fence_client::NewCredential;
///
/// let approval = NewCredential::new(b"approval-7f3a".to_vec())
///     .bound_to_call("payments.charge", r#"{"amount":4200,"to":"acme"}"#);
/// assert_eq!(approval.budget, 1);
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct NewCredential {
    /// The raw credential; hashed on arrival, never stored.
    pub token: Vec<u8>,
    /// Use budget (1 = one-time).
    pub budget: u32,
    /// Bind it to a tool.
    pub bound_tool: Option<String>,
    /// Bind it to one intent of `bound_tool` (an approval of one exact call).
    pub bound_arguments_json: Option<String>,
}

impl NewCredential {
    /// A one-time credential, not bound to any tool.
    pub fn new(token: impl Into<Vec<u8>>) -> Self {
        NewCredential {
            token: token.into(),
            budget: 1,
            bound_tool: None,
            bound_arguments_json: None,
        }
    }

    /// Sets the use budget.
    #[must_use]
    pub fn budget(mut self, budget: u32) -> Self {
        self.budget = budget;
        self
    }

    /// Binds it to a tool.
    #[must_use]
    pub fn bound_to_tool(mut self, tool: impl Into<String>) -> Self {
        self.bound_tool = Some(tool.into());
        self
    }

    /// Binds it to one exact call (tool and arguments, fingerprinted as an intent).
    #[must_use]
    pub fn bound_to_call(
        mut self,
        tool: impl Into<String>,
        arguments_json: impl Into<String>,
    ) -> Self {
        self.bound_tool = Some(tool.into());
        self.bound_arguments_json = Some(arguments_json.into());
        self
    }
}

impl fmt::Debug for NewCredential {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NewCredential")
            .field("token", &"<redacted>")
            .field("budget", &self.budget)
            .field("bound_tool", &self.bound_tool)
            .field("bound_arguments_json", &self.bound_arguments_json)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enums_round_trip_through_the_wire_values_and_names() {
        for reason in [
            ReasonCode::ForkRequired,
            ReasonCode::UnknownEpoch,
            ReasonCode::LeaseLost,
        ] {
            let wire = pb::ReasonCode::from(reason) as i32;
            assert_eq!(ReasonCode::try_from(wire).unwrap(), reason);
            assert_eq!(
                ReasonCode::from_str_name(reason.as_str_name()),
                Some(reason)
            );
        }
        assert_eq!(ReasonCode::ForkRequired.as_str_name(), "FORK_REQUIRED");
        assert_eq!(
            RecoveryAction::from_str_name("REFRESH_EPOCH"),
            Some(RecoveryAction::RefreshEpoch)
        );
        assert_eq!(EffectState::EffectUnknown.to_string(), "EFFECT_UNKNOWN");
    }

    #[test]
    fn unspecified_or_unknown_enum_values_are_protocol_errors() {
        assert!(matches!(
            OperationClass::try_from(0),
            Err(Error::Protocol(_))
        ));
        assert!(matches!(EffectState::try_from(99), Err(Error::Protocol(_))));
        assert_eq!(ReasonCode::from_str_name("REASON_CODE_UNSPECIFIED"), None);
        assert_eq!(ReasonCode::from_str_name("NOT_A_REASON"), None);
    }

    #[test]
    fn empty_optional_strings_become_none() {
        let wire = pb::Receipt {
            effect_id: "e1".into(),
            class: pb::OperationClass::NonRetryable as i32,
            state: pb::EffectState::Completed as i32,
            compensation: Some(pb::Compensation::default()),
            ..Default::default()
        };
        let receipt = Receipt::try_from(wire).unwrap();
        assert_eq!(receipt.step_key, None);
        assert_eq!(receipt.saga_id, None);
        assert_eq!(receipt.compensation, None);
        assert_eq!(receipt.compensates_effect_id, None);
    }

    #[test]
    fn a_receipt_without_an_effect_id_is_absent() {
        assert_eq!(receipt_opt(Some(pb::Receipt::default())).unwrap(), None);
        assert!(receipt_req(None, "receipt").is_err());
    }

    #[test]
    fn a_decision_without_an_outcome_is_a_protocol_error() {
        assert!(matches!(
            Decision::try_from(pb::Decision { outcome: None }),
            Err(Error::Protocol(_))
        ));
    }

    #[test]
    fn refusal_conversion_keeps_every_structured_field() {
        let wire = pb::Refusal {
            reason: pb::ReasonCode::StaleEpoch as i32,
            recovery: pb::RecoveryAction::RefreshEpoch as i32,
            receipt: None,
            message: "the run was restored".into(),
            checkpoint_id: String::new(),
            current_epoch: 3,
        };
        let refusal = Refusal::try_from(wire).unwrap();
        assert_eq!(refusal.reason, ReasonCode::StaleEpoch);
        assert_eq!(refusal.recovery, RecoveryAction::RefreshEpoch);
        assert_eq!(refusal.current_epoch, Some(3));
        assert_eq!(refusal.checkpoint_id, None);
    }

    #[test]
    fn credentials_never_show_their_raw_value_in_debug_output() {
        let use_ = CredentialUse {
            token: b"secret-token".to_vec(),
            budget: 1,
        };
        assert!(!format!("{use_:?}").contains("secret"));
        let new = NewCredential::new(b"secret-token".to_vec());
        assert!(!format!("{new:?}").contains("secret"));
    }
}

// ---------------------------------------------------------------------------------------------
// Backups
// ---------------------------------------------------------------------------------------------

/// What verifying a backup (or any data dir) found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BackupReport {
    /// The ledger format its records are in.
    pub format_version: u32,
    /// Records read, index entries included.
    pub records: u64,
    /// Runs, over every tenant.
    pub runs: u64,
    /// Effects, over every tenant.
    pub effects: u64,
    /// Registered tools (current versions).
    pub tools: u64,
    /// Registered credentials.
    pub credentials: u64,
    /// What is wrong, one line each (at most 100 listed).
    pub problems: Vec<String>,
    /// How many problems there are; 0 when the copy is sound.
    pub problem_count: u64,
}

impl BackupReport {
    /// True when verification found nothing wrong.
    pub fn is_sound(&self) -> bool {
        self.problem_count == 0
    }
}

impl From<pb::BackupReport> for BackupReport {
    fn from(r: pb::BackupReport) -> Self {
        BackupReport {
            format_version: r.format_version,
            records: r.records,
            runs: r.runs,
            effects: r.effects,
            tools: r.tools,
            credentials: r.credentials,
            problems: r.problems,
            problem_count: r.problem_count,
        }
    }
}

/// What [`FenceClient::compact_store`](crate::FenceClient::compact_store) did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Compacted {
    /// Bytes of the store (table files and memtables) before.
    pub bytes_before: u64,
    /// Bytes of the store after.
    pub bytes_after: u64,
    /// How long it took, in milliseconds.
    pub took_ms: u64,
}

/// A backup written by [`FenceClient::create_backup`](crate::FenceClient::create_backup).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Backup {
    /// The directory written, on the server's machine.
    pub dir: String,
    /// Bytes of its files (shared with the live store by hard links where possible).
    pub bytes: u64,
    /// When it was taken (server clock, ms since the Unix epoch).
    pub created_at_ms: u64,
    /// Its records, as verified right after it was written.
    pub report: BackupReport,
}
