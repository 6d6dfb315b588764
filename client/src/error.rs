//! The client's one error enum, and the one place a `tonic::Status` is turned into it.
//!
//! A Fence refusal is structured whether it comes from a Begin decision or from another RPC's
//! gRPC status (`ErrorInfo{reason, domain: "fence.v1", metadata: {recovery, effect_id,
//! message}}`): both become [`Error::Refused`] carrying a [`Refusal`]. Deterministic retry logic
//! switches on [`Error::reason`] / [`Error::recovery`], never on a message.

use std::time::Duration;

use tonic::Code;
use tonic_types::StatusExt;

use crate::types::{EffectState, ReasonCode, Receipt, RecoveryAction, Refusal};

/// The `ErrorInfo.domain` of Fence's own refusals.
pub const ERROR_DOMAIN: &str = "fence.v1";

/// A request field the server refused, from a `BadRequest` status detail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldViolation {
    /// The field's path in the request (e.g. `run_id`).
    pub field: String,
    /// Why it was refused.
    pub description: String,
}

/// Everything that can go wrong in a client call.
///
/// ```
/// use fence_client::{Error, ReasonCode, RecoveryAction};
///
/// fn next_step(err: &Error) -> &'static str {
///     match (err.reason(), err.recovery()) {
///         (Some(ReasonCode::ForkRequired), _) => "fork from the refusal's checkpoint",
///         (_, Some(RecoveryAction::RefreshEpoch)) => "this process is a zombie: stop",
///         _ if err.is_transient() => "retry later",
///         _ => "give up",
///     }
/// }
/// # let _ = next_step;
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The client's configuration is invalid (a bad URL, a token that is not valid metadata...).
    #[error("invalid client configuration: {0}")]
    Config(String),

    /// The connection to the server could not be established.
    #[error("cannot connect to the Fence server")]
    Connect(#[source] tonic::transport::Error),

    /// Fence refused the call: a Begin decision `Refused`, or another RPC's domain refusal.
    #[error("refused: {refusal}")]
    Refused {
        /// The structured refusal (reason, recovery action, receipt, message).
        refusal: Box<Refusal>,
        /// The gRPC status code, when the refusal came as a status (not from a Begin decision).
        code: Option<Code>,
        /// Request fields named by a `BadRequest` detail, if any.
        field_violations: Vec<FieldViolation>,
        /// When the status carries a `RetryInfo` (e.g. a tenant over its rate limit): nothing
        /// was applied, and the same call may be sent again after this delay.
        retry_after: Option<Duration>,
    },

    /// A gRPC status that is not a Fence refusal: a malformed request, authentication,
    /// availability (transport failures surface here as `UNAVAILABLE`, timeouts as
    /// `DEADLINE_EXCEEDED`).
    #[error("rpc failed with {code:?}: {message}")]
    Rpc {
        /// The status code.
        code: Code,
        /// The status message.
        message: String,
        /// Request fields named by a `BadRequest` detail, if any.
        field_violations: Vec<FieldViolation>,
    },

    /// The tool failed and nothing reached the outside world; this is recorded as
    /// `FAILED_BEFORE_INPUT` (when the effect is recorded at all).
    #[error("the tool failed before any input reached the outside world: {detail}")]
    ToolFailed {
        /// What failed.
        detail: String,
        /// True when the tool said a retry could succeed (it was retried as the policy allows).
        retryable: bool,
        /// The effect's receipt after the failure was recorded, if recorded.
        receipt: Option<Box<Receipt>>,
    },

    /// The effect may or may not have happened and no outcome check settled it. It is recorded
    /// as `EFFECT_UNKNOWN`: check the outside world and reconcile with evidence before anything
    /// else. Never re-run it blindly.
    #[error("the outcome of effect {} is unknown: {detail}", .receipt.effect_id)]
    EffectUnknown {
        /// The effect's receipt.
        receipt: Box<Receipt>,
        /// What is known.
        detail: String,
    },

    /// Another attempt still held the effect's lease when the wait ran out.
    #[error("effect {} is still in progress", .receipt.effect_id)]
    StillInProgress {
        /// The effect's latest receipt.
        receipt: Box<Receipt>,
    },

    /// The tool ran and returned a result, but recording it with Fence could not be confirmed.
    /// The effect happened: do not run it again; record `result` later (Complete, or Reconcile
    /// with evidence if the lease lapsed).
    #[error("effect {effect_id} happened but its completion could not be recorded")]
    CompletionUnconfirmed {
        /// The effect.
        effect_id: String,
        /// Its attempt number.
        attempt: u32,
        /// The result the tool returned.
        result: Vec<u8>,
        /// Why recording failed.
        #[source]
        source: Box<Error>,
    },

    /// The server answered something this client cannot interpret (a missing field, an
    /// unspecified enum value).
    #[error("unexpected answer from the server: {0}")]
    Protocol(String),
}

impl Error {
    pub(crate) fn protocol(message: impl Into<String>) -> Self {
        Error::Protocol(message.into())
    }

    pub(crate) fn refused(refusal: Refusal) -> Self {
        Error::Refused {
            refusal: Box::new(refusal),
            code: None,
            field_violations: Vec::new(),
            retry_after: None,
        }
    }

    /// The structured refusal, if this is one.
    pub fn refusal(&self) -> Option<&Refusal> {
        match self {
            Error::Refused { refusal, .. } => Some(refusal),
            Error::CompletionUnconfirmed { source, .. } => source.refusal(),
            _ => None,
        }
    }

    /// The refusal's reason code, if this is a refusal.
    pub fn reason(&self) -> Option<ReasonCode> {
        self.refusal().map(|r| r.reason)
    }

    /// The refusal's recovery action, if this is a refusal.
    pub fn recovery(&self) -> Option<RecoveryAction> {
        self.refusal().map(|r| r.recovery)
    }

    /// The receipt the error refers to, if any.
    pub fn receipt(&self) -> Option<&Receipt> {
        match self {
            Error::Refused { refusal, .. } => refusal.receipt.as_ref(),
            Error::ToolFailed { receipt, .. } => receipt.as_deref(),
            Error::EffectUnknown { receipt, .. } | Error::StillInProgress { receipt } => {
                Some(receipt)
            }
            _ => None,
        }
    }

    /// The effect's state implied by the error, when it refers to a recorded effect.
    pub fn effect_state(&self) -> Option<EffectState> {
        self.receipt().map(|r| r.state)
    }

    /// The gRPC status code, when the error came from a status.
    pub fn code(&self) -> Option<Code> {
        match self {
            Error::Refused { code, .. } => *code,
            Error::Rpc { code, .. } => Some(*code),
            _ => None,
        }
    }

    /// The delay after which the server invited a retry of the very same call (a `RetryInfo`
    /// detail, e.g. a tenant over its rate limit). Such a call was not applied at all.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Error::Refused { retry_after, .. } => *retry_after,
            _ => None,
        }
    }

    /// True when the failure may be a lost request or response (the transport broke, the
    /// server was unavailable or slow) rather than an answer, or when the server asked for
    /// the same call again later ([`Error::retry_after`]). Only idempotent calls may be
    /// retried on a lost response: the client retries Complete, Heartbeat, Reconcile,
    /// QueryOutcome and a Begin that carries a step key; a Begin without one only on
    /// [`Error::retry_after`] (nothing was applied).
    pub fn is_transient(&self) -> bool {
        match self {
            Error::Connect(_) => true,
            Error::Refused { retry_after, .. } => retry_after.is_some(),
            Error::Rpc { code, .. } => matches!(
                code,
                Code::Unavailable
                    | Code::DeadlineExceeded
                    | Code::Cancelled
                    | Code::Unknown
                    | Code::Aborted
                    | Code::Internal
                    | Code::ResourceExhausted
            ),
            _ => false,
        }
    }
}

impl From<tonic::Status> for Error {
    /// The one mapping from a gRPC status to an [`Error`]: a status whose `ErrorInfo` is in
    /// the `fence.v1` domain with a known reason is a [`Error::Refused`]; anything else is an
    /// [`Error::Rpc`].
    fn from(status: tonic::Status) -> Self {
        let details = status.get_error_details();
        let field_violations: Vec<FieldViolation> = details
            .bad_request()
            .map(|br| {
                br.field_violations
                    .iter()
                    .map(|v| FieldViolation {
                        field: v.field.clone(),
                        description: v.description.clone(),
                    })
                    .collect()
            })
            .unwrap_or_default();
        if let Some(info) = details.error_info()
            && info.domain == ERROR_DOMAIN
            && let Some(reason) = ReasonCode::from_str_name(&info.reason)
        {
            let recovery = info
                .metadata
                .get("recovery")
                .and_then(|r| RecoveryAction::from_str_name(r))
                // A refusal without a recognised recovery is treated as final: fail closed.
                .unwrap_or(RecoveryAction::Stop);
            let message = info
                .metadata
                .get("message")
                .cloned()
                .unwrap_or_else(|| status.message().to_owned());
            let refusal = Refusal {
                reason,
                recovery,
                receipt: None,
                message,
                effect_id: info.metadata.get("effect_id").cloned(),
                checkpoint_id: info.metadata.get("checkpoint_id").cloned(),
                current_epoch: info
                    .metadata
                    .get("current_epoch")
                    .and_then(|e| e.parse().ok()),
            };
            return Error::Refused {
                refusal: Box::new(refusal),
                code: Some(status.code()),
                field_violations,
                retry_after: details.retry_info().and_then(|r| r.retry_delay),
            };
        }
        Error::Rpc {
            code: status.code(),
            message: status.message().to_owned(),
            field_violations,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use tonic_types::{ErrorDetails, StatusExt};

    use super::*;

    fn fence_status(code: Code, reason: &str, metadata: &[(&str, &str)]) -> tonic::Status {
        let metadata: HashMap<String, String> = metadata
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        let mut details = ErrorDetails::with_error_info(reason, ERROR_DOMAIN, metadata);
        details.add_bad_request_violation("effect_id", "unknown effect");
        tonic::Status::with_error_details(code, "status message", details)
    }

    #[test]
    fn a_fence_status_becomes_a_structured_refusal() {
        let status = fence_status(
            Code::FailedPrecondition,
            "RESULT_CONFLICT",
            &[
                ("recovery", "STOP"),
                ("effect_id", "e-42"),
                ("message", "a different result is recorded"),
            ],
        );
        let err = Error::from(status);
        assert_eq!(err.reason(), Some(ReasonCode::ResultConflict));
        assert_eq!(err.recovery(), Some(RecoveryAction::Stop));
        assert_eq!(err.code(), Some(Code::FailedPrecondition));
        let refusal = err.refusal().unwrap();
        assert_eq!(refusal.effect_id.as_deref(), Some("e-42"));
        assert_eq!(refusal.message, "a different result is recorded");
        match err {
            Error::Refused {
                field_violations, ..
            } => assert_eq!(field_violations[0].field, "effect_id"),
            other => panic!("not a refusal: {other:?}"),
        }
        assert!(!Error::from(fence_status(Code::NotFound, "UNKNOWN_RECORD", &[])).is_transient());
    }

    #[test]
    fn a_rate_limited_call_is_a_transient_refusal_with_its_delay() {
        let metadata: HashMap<String, String> =
            [("recovery".to_owned(), "WAIT_AND_QUERY".to_owned())].into();
        let mut details = ErrorDetails::with_error_info("LIMIT_EXCEEDED", ERROR_DOMAIN, metadata);
        details.set_retry_info(Some(std::time::Duration::from_millis(250)));
        let err = Error::from(tonic::Status::with_error_details(
            Code::ResourceExhausted,
            "tenant request rate exceeded",
            details,
        ));
        assert_eq!(err.reason(), Some(ReasonCode::LimitExceeded));
        assert_eq!(
            err.retry_after(),
            Some(std::time::Duration::from_millis(250))
        );
        assert!(err.is_transient());
        // A limit without a retry delay (e.g. a run full of effects) is final.
        let err = Error::from(fence_status(Code::ResourceExhausted, "LIMIT_EXCEEDED", &[]));
        assert_eq!(err.retry_after(), None);
        assert!(!err.is_transient());
    }

    #[test]
    fn a_refusal_without_a_known_recovery_fails_closed() {
        let err = Error::from(fence_status(Code::FailedPrecondition, "LEASE_LOST", &[]));
        assert_eq!(err.reason(), Some(ReasonCode::LeaseLost));
        assert_eq!(err.recovery(), Some(RecoveryAction::Stop));
        assert_eq!(err.refusal().unwrap().message, "status message");
    }

    #[test]
    fn other_statuses_are_rpc_errors_and_availability_is_transient() {
        let err = Error::from(tonic::Status::unavailable("connection refused"));
        assert!(err.is_transient());
        assert_eq!(err.reason(), None);
        let foreign = ErrorDetails::with_error_info("QUOTA", "example.com", HashMap::new());
        let err = Error::from(tonic::Status::with_error_details(
            Code::InvalidArgument,
            "bad",
            foreign,
        ));
        assert!(matches!(
            err,
            Error::Rpc {
                code: Code::InvalidArgument,
                ..
            }
        ));
        assert!(!err.is_transient());
    }
}
