//! The one mapping from ledger errors to gRPC statuses.
//!
//! Every status carries structured details (`tonic-types` `ErrorDetails`): a `BadRequest`
//! field violation for malformed input, and for domain refusals an `ErrorInfo` whose `reason` is
//! the `ReasonCode` name, `domain` is `fence.v1`, and whose metadata holds the `recovery` action,
//! the model-facing `message` and, where there is one, the `effect_id` referred to. Retry logic
//! switches on those, never on the status message.

use std::collections::HashMap;

use fence_proto::v1 as pb;
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

use crate::ledger::{LedgerError, Reason, Recovery, Refusal};
use crate::store::StoreError;

/// The `ErrorInfo.domain` of every Fence error.
pub const DOMAIN: &str = "fence.v1";

/// The API name of a reason (e.g. `FORK_REQUIRED`).
pub fn reason_name(reason: Reason) -> &'static str {
    pb::ReasonCode::try_from(reason.code())
        .map(|r| r.as_str_name())
        .unwrap_or("REASON_CODE_UNSPECIFIED")
}

/// The API name of a recovery action (e.g. `REFRESH_EPOCH`).
pub fn recovery_name(recovery: Recovery) -> &'static str {
    pb::RecoveryAction::try_from(recovery.code())
        .map(|r| r.as_str_name())
        .unwrap_or("RECOVERY_ACTION_UNSPECIFIED")
}

fn code_for(reason: Reason) -> Code {
    match reason {
        Reason::UnknownRecord => Code::NotFound,
        Reason::EvidenceRequired => Code::InvalidArgument,
        Reason::LimitExceeded => Code::ResourceExhausted,
        Reason::ForkRequired
        | Reason::ArgumentMismatch
        | Reason::DuplicateIntent
        | Reason::CredentialConsumed
        | Reason::StaleEpoch
        | Reason::Expired
        | Reason::ReconcileRequired
        | Reason::CredentialMismatch
        | Reason::ResultConflict
        | Reason::InvalidTransition
        | Reason::LeaseLost
        | Reason::UnknownEpoch => Code::FailedPrecondition,
    }
}

/// A refusal as a status.
pub fn refusal_status(r: &Refusal) -> Status {
    let mut meta = HashMap::new();
    meta.insert("recovery".to_owned(), recovery_name(r.recovery).to_owned());
    meta.insert("message".to_owned(), r.message.clone());
    if let Some(receipt) = &r.receipt {
        meta.insert("effect_id".to_owned(), receipt.id().to_string());
    }
    if !r.checkpoint_id.is_empty() {
        meta.insert("checkpoint_id".to_owned(), r.checkpoint_id.clone());
    }
    if r.current_epoch != 0 {
        meta.insert("current_epoch".to_owned(), r.current_epoch.to_string());
    }
    let mut details = ErrorDetails::new();
    details.set_error_info(reason_name(r.reason), DOMAIN, meta);
    if r.reason == Reason::EvidenceRequired {
        details.add_bad_request_violation("evidence", "must not be blank");
    }
    Status::with_error_details(code_for(r.reason), r.message.clone(), details)
}

/// A malformed-request status naming the field.
pub fn invalid_argument(field: &str, why: &str) -> Status {
    let mut details = ErrorDetails::new();
    details.add_bad_request_violation(field, why);
    Status::with_error_details(
        Code::InvalidArgument,
        format!("invalid {field}: {why}"),
        details,
    )
}

impl From<LedgerError> for Status {
    fn from(err: LedgerError) -> Self {
        match err {
            LedgerError::InvalidArgument { field, why } => invalid_argument(&field, &why),
            LedgerError::Refused(r) => refusal_status(&r),
            LedgerError::AlreadyExists { field, why } => {
                let mut details = ErrorDetails::new();
                details.add_bad_request_violation(field.clone(), why.clone());
                Status::with_error_details(
                    Code::AlreadyExists,
                    format!("{field} already exists: {why}"),
                    details,
                )
            }
            LedgerError::ResourceExhausted { field, why } => {
                let mut meta = HashMap::new();
                meta.insert("field".to_owned(), field.clone());
                meta.insert(
                    "recovery".to_owned(),
                    recovery_name(Recovery::Stop).to_owned(),
                );
                meta.insert("message".to_owned(), why.clone());
                let mut details = ErrorDetails::new();
                details.set_error_info(reason_name(Reason::LimitExceeded), DOMAIN, meta);
                details.add_bad_request_violation(field, why.clone());
                Status::with_error_details(Code::ResourceExhausted, why, details)
            }
            LedgerError::Store(StoreError::Engine(e)) => {
                tracing::error!(error = %e, "storage engine error; the request was not applied");
                let mut details = ErrorDetails::new();
                details.set_retry_info(Some(std::time::Duration::from_secs(1)));
                Status::with_error_details(
                    Code::Unavailable,
                    "storage is unavailable; nothing was applied",
                    details,
                )
            }
            LedgerError::Store(e @ StoreError::Corrupt { .. }) => {
                tracing::error!(error = %e, "corrupt record");
                Status::new(Code::Internal, "a stored record is unreadable")
            }
        }
    }
}
