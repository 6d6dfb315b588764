//! The ledger's vocabulary: classes, states, refusal reasons and recovery actions, the
//! commands it accepts and the decisions it returns. Plain Rust; the gRPC layer converts.

use std::fmt;

use super::records::EffectRecord;
use crate::store::StoreError;
use crate::store::keys::RunKey;

macro_rules! code_enum {
    ($(#[$m:meta])* $name:ident { $($(#[$vm:meta])* $v:ident = $n:expr),+ $(,)? }) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[repr(i32)]
        pub enum $name { $($(#[$vm])* $v = $n),+ }
        impl $name {
            /// The stable numeric code (the same number as in the public API).
            pub fn code(self) -> i32 { self as i32 }
            /// The value for a numeric code, if it is one.
            pub fn from_code(code: i32) -> Option<Self> {
                match code { $($n => Some(Self::$v),)+ _ => None }
            }
        }
    };
}

code_enum!(
    /// How a tool may be retried (DESIGN.md, "Operation classes").
    OpClass {
        /// Read-only; retry freely.
        SafeRetry = 1,
        /// Idempotent under its key.
        Deduplicate = 2,
        /// Repeat only after an outcome check.
        RequiresEffectCheck = 3,
        /// At most once, ever.
        NonRetryable = 4,
    }
);

code_enum!(
    /// The state of an effect.
    State {
        /// Granted; lease live; no heartbeat yet.
        Accepted = 1,
        /// Granted; heartbeated; lease live.
        Running = 2,
        /// Happened; result recorded.
        Completed = 3,
        /// Certainly did not happen.
        FailedBeforeInput = 4,
        /// May or may not have happened.
        EffectUnknown = 5,
        /// Answer state of a duplicate refusal.
        RejectedDuplicate = 6,
        /// Answer state of a query that matched nothing.
        NotFound = 7,
        /// A completed saga step that was undone.
        Compensated = 8,
    }
);

code_enum!(
    /// Why something was refused.
    Reason {
        /// Divergent call after a restore.
        ForkRequired = 1,
        /// Known step key, different intent.
        ArgumentMismatch = 2,
        /// Same intent without a step key.
        DuplicateIntent = 3,
        /// Credential budget spent.
        CredentialConsumed = 4,
        /// Older epoch.
        StaleEpoch = 5,
        /// Only a tombstone remains.
        Expired = 6,
        /// Outcome unknown; reconcile first.
        ReconcileRequired = 7,
        /// Credential bound elsewhere.
        CredentialMismatch = 8,
        /// Different result for a completed effect.
        ResultConflict = 9,
        /// No such record.
        UnknownRecord = 10,
        /// Transition not allowed from this state.
        InvalidTransition = 11,
        /// Lease lapsed or superseded.
        LeaseLost = 12,
        /// Reconcile without evidence.
        EvidenceRequired = 13,
        /// A limit was exceeded.
        LimitExceeded = 14,
        /// Epoch never issued.
        UnknownEpoch = 15,
    }
);

code_enum!(
    /// What the caller should do next.
    Recovery {
        /// Use the recorded result.
        ReplayResult = 1,
        /// Wait, then query.
        WaitAndQuery = 2,
        /// Check the world, then Reconcile.
        Reconcile = 3,
        /// Fork and continue on the new branch.
        Fork = 4,
        /// Fix the arguments.
        FixArgument = 5,
        /// Get a fresh credential.
        Reauthenticate = 6,
        /// Do not continue.
        Stop = 7,
        /// Refresh the epoch.
        RefreshEpoch = 8,
        /// Confirm the repetition explicitly.
        ConfirmRepeat = 9,
    }
);

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// A structured refusal: reason, recovery, the receipt it refers to, one sentence for a model.
#[derive(Debug, Clone, PartialEq)]
pub struct Refusal {
    /// Why.
    pub reason: Reason,
    /// What to do.
    pub recovery: Recovery,
    /// The effect it refers to.
    pub receipt: Option<Box<EffectRecord>>,
    /// One short sentence fit to show a model.
    pub message: String,
    /// For FORK_REQUIRED: the checkpoint to fork from.
    pub checkpoint_id: String,
    /// For epoch refusals: the run's current epoch.
    pub current_epoch: u64,
}

impl Refusal {
    /// A refusal without a receipt.
    pub fn new(reason: Reason, recovery: Recovery, message: impl Into<String>) -> Self {
        Self {
            reason,
            recovery,
            receipt: None,
            message: message.into(),
            checkpoint_id: String::new(),
            current_epoch: 0,
        }
    }

    /// Attaches the receipt it refers to.
    pub fn with_receipt(mut self, receipt: EffectRecord) -> Self {
        self.receipt = Some(Box::new(receipt));
        self
    }
}

/// Everything the ledger can fail with. Domain refusals are [`LedgerError::Refused`].
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    /// Malformed input; nothing changed.
    #[error("invalid {field}: {why}")]
    InvalidArgument {
        /// The request field (proto name).
        field: String,
        /// What is wrong.
        why: String,
    },
    /// A domain refusal; nothing changed.
    #[error("{}: {}", .0.reason, .0.message)]
    Refused(Box<Refusal>),
    /// A name is already taken by a different record.
    #[error("{field} already exists: {why}")]
    AlreadyExists {
        /// The request field.
        field: String,
        /// What exists.
        why: String,
    },
    /// A count limit was reached; nothing changed.
    #[error("limit reached for {field}: {why}")]
    ResourceExhausted {
        /// The request field or resource.
        field: String,
        /// Which limit.
        why: String,
    },
    /// Storage failed; nothing was acknowledged.
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl LedgerError {
    /// Shorthand for [`LedgerError::InvalidArgument`].
    pub fn invalid(field: impl Into<String>, why: impl Into<String>) -> Self {
        Self::InvalidArgument {
            field: field.into(),
            why: why.into(),
        }
    }
}

impl From<Refusal> for LedgerError {
    fn from(r: Refusal) -> Self {
        Self::Refused(Box::new(r))
    }
}

/// The ledger's result type.
pub type Result<T, E = LedgerError> = std::result::Result<T, E>;

/// An effect's public id: its run key and sequence number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EffectId {
    /// The run key.
    pub run_key: RunKey,
    /// The sequence number (from 1).
    pub seq: u64,
}

impl fmt::Display for EffectId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // By hand: this is formatted for every answer, and `write!` per digit group costs more
        // than the rest of the answer's conversion.
        let mut text = [0u8; 49];
        text[0] = b'e';
        crate::store::codec::hex_into(&self.run_key, &mut text[1..33]);
        crate::store::codec::hex_into(&self.seq.to_be_bytes(), &mut text[33..]);
        f.write_str(std::str::from_utf8(&text).expect("hex digits are ASCII"))
    }
}

impl std::str::FromStr for EffectId {
    type Err = &'static str;

    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        let body = s
            .strip_prefix('e')
            .filter(|b| b.len() == 48)
            .ok_or("an effect id is 'e' followed by 48 hex digits")?;
        let mut bytes = [0u8; 24];
        crate::store::codec::unhex_into(body, &mut bytes)
            .ok_or("an effect id is hex after the 'e'")?;
        let run_key: RunKey = bytes[..16].try_into().expect("16 of 24 bytes");
        let seq = u64::from_be_bytes(bytes[16..].try_into().expect("8 of 24 bytes"));
        if seq == 0 {
            return Err("effect sequence numbers start at 1");
        }
        Ok(Self { run_key, seq })
    }
}

/// A credential presented with a call.
#[derive(Clone, PartialEq, Eq)]
pub struct CredentialUse {
    /// The raw value (hashed on arrival, never stored).
    pub token: Vec<u8>,
    /// Budget if first presented unregistered (0 = 1).
    pub budget: u32,
}

impl fmt::Debug for CredentialUse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never print the raw credential.
        f.debug_struct("CredentialUse")
            .field("token", &"<redacted>")
            .field("budget", &self.budget)
            .finish()
    }
}

/// A tool's registration, as submitted.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ToolDef {
    /// Name.
    pub name: String,
    /// Class code ([`OpClass`]); anything else is refused.
    pub class: i32,
    /// Volatile field paths.
    pub volatile_fields: Vec<String>,
    /// Normalised string field paths.
    pub normalized_fields: Vec<String>,
    /// String rule code (0 exact, 1 trim, 2 trim+lowercase).
    pub string_rule: i32,
    /// Retention (0 = default).
    pub retention_ms: u64,
    /// Default lease (0 = default).
    pub lease_ms: u64,
}

/// One call of a tool (the `Begin` command).
#[derive(Debug, Clone, Default)]
pub struct BeginCmd {
    /// Run id.
    pub run_id: String,
    /// Branch name ("" = "main").
    pub branch: String,
    /// Caller's epoch (0 = untracked, valid only before any restore).
    pub epoch: u64,
    /// Tool name.
    pub tool: String,
    /// JSON arguments.
    pub arguments_json: String,
    /// Step key ("" = none).
    pub step_key: String,
    /// Deliberate repetition of an identical intent.
    pub deliberate_repeat: bool,
    /// Credentials spent by the call.
    pub credentials: Vec<CredentialUse>,
    /// Lease (0 = default).
    pub lease_ms: u64,
    /// Record a SAFE_RETRY call for audit.
    pub record: bool,
    /// Saga id ("" = none).
    pub saga_id: String,
    /// Compensation (tool, JSON arguments).
    pub compensation: Option<(String, String)>,
    /// The effect this call compensates ("" = none).
    pub compensates_effect_id: String,
    /// The caller's nonce for this logical call ("" = none); see the proto.
    pub request_id: String,
    /// The checkpoint this call descends from ("" = none): its causal position.
    pub parent_checkpoint_id: String,
}

/// How a granted effect ended, as reported by its executor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// It happened; here is the result.
    Completed(Vec<u8>),
    /// It certainly did not happen.
    FailedBeforeInput(String),
    /// It may have happened.
    Unknown(String),
}

/// What an outcome check found (`Reconcile`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finding {
    /// It happened; here is the result.
    Completed(Vec<u8>),
    /// It did not happen.
    FailedBeforeInput(String),
}

/// The answer to a Begin.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// Run the tool now. `recorded` is false for an unrecorded SAFE_RETRY call.
    Execute {
        /// The effect as recorded (state ACCEPTED).
        receipt: Box<EffectRecord>,
        /// Whether it was written (false only for an unrecorded SAFE_RETRY call).
        recorded: bool,
    },
    /// The recorded result is the answer.
    Replay(Box<EffectRecord>),
    /// Another attempt holds the lease.
    InProgress {
        /// The running effect.
        receipt: Box<EffectRecord>,
        /// Suggested wait before querying.
        retry_after_ms: u64,
    },
    /// Refused; nothing executed.
    Refused(Box<Refusal>),
}

impl Decision {
    /// A short name for logs: `execute`, `replay`, `in_progress` or the refusal reason.
    pub fn kind(&self) -> String {
        match self {
            Decision::Execute { .. } => "execute".into(),
            Decision::Replay(_) => "replay".into(),
            Decision::InProgress { .. } => "in_progress".into(),
            Decision::Refused(r) => format!("refused:{}", r.reason),
        }
    }
}

impl From<Refusal> for Decision {
    fn from(r: Refusal) -> Self {
        Self::Refused(Box::new(r))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn effect_ids_print_as_e_run_key_and_sequence_in_hex_and_parse_back() {
        let run_key: RunKey = std::array::from_fn(|i| (i as u8).wrapping_mul(37));
        for seq in [1u64, 0xab, u64::MAX] {
            let id = EffectId { run_key, seq };
            let text = id.to_string();
            // The form every stored and issued id has: it must never change.
            assert_eq!(
                text,
                format!("e{}{seq:016x}", crate::store::codec::hex(&run_key))
            );
            assert_eq!(text.parse::<EffectId>().unwrap(), id);
            let upper = format!("e{}", text[1..].to_uppercase());
            assert_eq!(upper.parse::<EffectId>().unwrap(), id);
        }
        let good = EffectId { run_key, seq: 7 }.to_string();
        for bad in [
            String::new(),
            good[1..].to_owned(),
            format!("x{}", &good[1..]),
            format!("{good}0"),
            format!("e{}", "0".repeat(48)),
            format!("e+{}", &good[2..]),
            format!("e{}g", &good[1..48]),
        ] {
            assert!(bad.parse::<EffectId>().is_err(), "{bad:?}");
        }
    }
}
