//! The Rust client of Fence: make an AI agent's side effects happen exactly once.
//!
//! - [`FenceClient`]: a typed client over the `fence.v1` gRPC API (URL, timeouts, TLS, bearer
//!   token, dev-mode tenant), one method per RPC, domain types in and out, one [`Error`] enum that
//!   carries Fence's structured refusals.
//! - [`FenceClient::run_effect`]: the whole protocol in one call: Begin, run your closure only
//!   when Fence grants execution (heartbeating the lease), Complete with its result; replay
//!   instead of re-running; wait on an effect in progress; retries by operation class.
//! - [`RunHandle`] and [`step_key`]: deterministic step keys and checkpoint / restore / fork with
//!   the framework's own checkpoint ids; the handle follows the run's epoch and branch.
//! - [`Session`]: Begin, Complete and Heartbeat as messages on one long-lived stream, for
//!   agents that make many calls: the same decisions at a lower cost per call.
//! - [`SagaExecutor`]: forward steps with compensations, undone in reverse order on failure,
//!   each compensation fenced so that a crash mid-compensation never undoes a step twice.
//!
//! ```no_run
//! use fence_client::{FenceClient, OperationClass, RunHandle, ToolDef, ToolError};
//!
//! # async fn demo() -> Result<(), fence_client::Error> {
//! let client = FenceClient::connect("http://127.0.0.1:50051").await?;
//! client
//!     .register_tool(
//!         ToolDef::new("payments.charge", OperationClass::NonRetryable)
//!             .volatile(["request_id", "timestamp"]),
//!     )
//!     .await?;
//! let run = RunHandle::start(client, "wf-42").await?;
//! let call = run
//!     .call("payments.charge", r#"{"amount":4200,"to":"acme","request_id":"9b1d"}"#)
//!     .step_key(run.step_key("pay"));
//! let paid = run
//!     .run_effect(&call, |ctx| async move {
//!         // Charge the card, sending ctx.downstream_key as the provider's idempotency key.
//!         Ok::<_, ToolError>(format!("charged with key {}", ctx.downstream_key).into_bytes())
//!     })
//!     .await?;
//! println!("{:?}", paid.source);
//! # Ok(()) }
//! ```

mod client;
mod effect;
mod error;
mod retry;
mod run;
mod saga;
mod session;
mod types;

pub use client::{
    BoxError, EffectCall, EffectFilter, FenceClient, FenceClientBuilder, TENANT_METADATA,
};
pub use effect::{
    CheckFinding, EffectOutcome, ExecContext, NoOutcomeCheck, OutcomeCheck, OutcomeSource,
    ToolError,
};
pub use error::{ERROR_DOMAIN, Error, FieldViolation};
pub use retry::RetryPolicy;
pub use run::{MAIN_BRANCH, RunHandle, step_key};
pub use saga::{
    Saga, SagaExecutor, SagaOutcome, SagaState, SagaStep, SagaStepState, ToolRunner,
    compensation_step_key, saga_step_key,
};
pub use session::Session;
/// TLS settings for [`FenceClientBuilder::tls`] (re-exported from tonic).
pub use tonic::transport::{Certificate, ClientTlsConfig, Identity};
pub use types::{
    Backup, BackupReport, BeginOutcome, BranchInfo, CheckpointInfo, Compacted, Compensation,
    CompleteCall, Completion, CredentialInfo, CredentialUse, Decision, EffectState, Finding,
    Forked, Grant, IntentSchema, NewCredential, OperationClass, Outcome, OutcomeKey, ReasonCode,
    Receipt, RecoveryAction, Refusal, RegisteredTool, RestoreEvent, Restored, RunInfo, Stored,
    StringNormalization, ToolDef,
};
