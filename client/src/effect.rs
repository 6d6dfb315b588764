//! Running one effect through the fence: [`FenceClient::run_effect`].
//!
//! The protocol, in one call: Begin → run the caller's closure only on `Execute` (with the
//! effect id and downstream key, while a background task heartbeats the lease) → Complete with
//! its result, or with `FAILED_BEFORE_INPUT` / `EFFECT_UNKNOWN` as the closure classified its
//! failure. On `Replay` the closure is not called and the recorded result is returned; on
//! `InProgress` the client waits with jittered backoff and queries the outcome.
//!
//! Invariants:
//! - The closure runs only under a grant. An ambiguous failure of a `NON_RETRYABLE` or
//!   `REQUIRES_EFFECT_CHECK` tool is never retried: it is recorded `EFFECT_UNKNOWN` and only an
//!   [`OutcomeCheck`] (evidence, via Reconcile) can settle it.
//! - A Begin is re-sent (after a transport failure, a failure before input, or a settled wait)
//!   only when the call carries a step key: same step key + same intent is a replay or an
//!   in-progress answer, never a second grant of a live effect.
//! - Complete, Reconcile, Heartbeat and QueryOutcome are idempotent and are retried through
//!   transport failures; a result that could not be recorded is reported as
//!   [`Error::CompletionUnconfirmed`], never silently dropped.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::client::{EffectCall, FenceClient};
use crate::error::Error;
use crate::retry::{RetryPolicy, jittered};
use crate::types::{
    BeginOutcome, Completion, Decision, EffectState, Finding, Grant, OperationClass, OutcomeKey,
    ReasonCode, Receipt, Refusal,
};

/// What the closure of [`FenceClient::run_effect`] gets: the grant it runs under.
///
/// Pass [`ExecContext::downstream_key`] to the external API as its idempotency key (e.g. an
/// `Idempotency-Key` header): every re-grant of the same effect carries the same key.
#[derive(Debug, Clone)]
pub struct ExecContext {
    /// The effect's id (empty for an unrecorded `SAFE_RETRY` call).
    pub effect_id: String,
    /// The key to pass downstream as the external API's idempotency key.
    pub downstream_key: String,
    /// The grant's attempt number (1 = first grant).
    pub attempt: u32,
    /// The run's epoch the grant was made in.
    pub epoch: u64,
    /// The lease expiry at grant time (server clock, ms since the Unix epoch); the client
    /// heartbeats while the closure runs.
    pub lease_expires_at_ms: u64,
    lease_lost: Arc<AtomicBool>,
}

impl ExecContext {
    /// True once a heartbeat was refused because the lease was lost (it lapsed, or the run was
    /// restored). A long-running tool should stop before dispatching anything further.
    pub fn lease_lost(&self) -> bool {
        self.lease_lost.load(Ordering::Acquire)
    }

    fn new(grant: &Grant, epoch: u64) -> Self {
        ExecContext {
            effect_id: grant.effect_id.clone(),
            downstream_key: grant.downstream_key.clone(),
            attempt: grant.attempt,
            epoch,
            lease_expires_at_ms: grant.lease_expires_at_ms,
            lease_lost: Arc::new(AtomicBool::new(false)),
        }
    }
}

/// How the closure of [`FenceClient::run_effect`] failed. The caller classifies: only it knows
/// whether anything reached the outside world.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ToolError {
    /// Nothing reached the outside world, and a retry may succeed (connection refused before
    /// sending, a local validation error that a retry could fix). Recorded
    /// `FAILED_BEFORE_INPUT`; retried within the policy's attempts when the call has a step key.
    #[error("failed before input: {0}")]
    FailedBeforeInput(String),
    /// The outside world definitively refused the call and nothing happened (card declined,
    /// no rooms left). Recorded `FAILED_BEFORE_INPUT`; not retried.
    #[error("rejected: {0}")]
    Rejected(String),
    /// The call may have happened (a timeout after sending, a dropped connection mid-call).
    /// Retried within the grant for `DEDUPLICATE` and `SAFE_RETRY` tools; otherwise recorded
    /// `EFFECT_UNKNOWN` and handed to the outcome check.
    #[error("outcome unknown: {0}")]
    Unknown(String),
}

/// What an outcome check found in the outside world about an effect whose outcome is unknown.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CheckFinding {
    /// The effect happened; here is its result and what shows it (e.g. the downstream
    /// record's id). Recorded with Reconcile as completed.
    Happened {
        /// The effect's result.
        result: Vec<u8>,
        /// Evidence an auditor can verify.
        evidence: String,
    },
    /// The effect did not happen; here is what shows it. Recorded with Reconcile as failed
    /// before input, after which the effect may be granted (and run) again.
    DidNotHappen {
        /// Evidence an auditor can verify.
        evidence: String,
    },
    /// The check cannot tell: the effect stays `EFFECT_UNKNOWN`.
    Unknown,
}

/// Looks an effect up in the outside world (usually by its downstream key) to settle an
/// unknown outcome. Any `Fn(Receipt) -> impl Future<Output = CheckFinding>` is one.
///
/// ```
/// use fence_client::{CheckFinding, OutcomeCheck, Receipt};
///
/// fn check() -> impl OutcomeCheck {
///     |receipt: Receipt| async move {
///         // e.g. GET /charges?idempotency_key={receipt.downstream_key}
///         let _ = receipt.downstream_key;
///         CheckFinding::Unknown
///     }
/// }
/// # let _ = check();
/// ```
pub trait OutcomeCheck {
    /// Checks what happened to the effect in `receipt`.
    fn check(&self, receipt: Receipt) -> impl Future<Output = CheckFinding> + Send;
}

impl<F, Fut> OutcomeCheck for F
where
    F: Fn(Receipt) -> Fut,
    Fut: Future<Output = CheckFinding> + Send,
{
    fn check(&self, receipt: Receipt) -> impl Future<Output = CheckFinding> + Send {
        self(receipt)
    }
}

/// The outcome check of [`FenceClient::run_effect`]: it never knows, so an unknown outcome stays
/// unknown.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoOutcomeCheck;

impl OutcomeCheck for NoOutcomeCheck {
    #[allow(clippy::manual_async_fn)]
    fn check(&self, _receipt: Receipt) -> impl Future<Output = CheckFinding> + Send {
        async { CheckFinding::Unknown }
    }
}

/// Where an [`EffectOutcome`]'s result comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutcomeSource {
    /// This call ran the tool and recorded its result.
    Executed,
    /// The result was already recorded (by an earlier or concurrent attempt, or before a
    /// restore): the tool was not run by this call after that.
    Replayed,
    /// The outcome was unknown and an outcome check settled it as completed.
    Reconciled,
}

/// The result of [`FenceClient::run_effect`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EffectOutcome {
    /// The effect's result (the tool's return value, or the recorded one).
    pub result: Vec<u8>,
    /// The effect's receipt; `None` only for an unrecorded `SAFE_RETRY` call.
    pub receipt: Option<Receipt>,
    /// Where the result comes from.
    pub source: OutcomeSource,
    /// How many times this call ran the closure.
    pub executions: u32,
    /// The run's epoch as of the last Begin.
    pub epoch: u64,
}

impl FenceClient {
    /// Runs one effect through the fence: Begin, run `exec` only if Fence grants execution,
    /// record the outcome. A replay returns the recorded result without calling `exec`.
    /// Equivalent to [`FenceClient::run_effect_checked`] with [`NoOutcomeCheck`]: an unknown
    /// outcome of a non-idempotent tool ends in [`Error::EffectUnknown`].
    ///
    /// Give the call a step key (see [`crate::step_key`]): without one the client cannot
    /// safely re-send a Begin, so it does not retry.
    ///
    /// ```no_run
    /// # async fn demo(client: fence_client::FenceClient) -> Result<(), fence_client::Error> {
    /// use fence_client::{EffectCall, ToolError, step_key};
    ///
    /// let call = EffectCall::new("order-1234", "payments.charge", r#"{"amount":4200,"to":"acme"}"#)
    ///     .step_key(step_key("order-1234", "pay"));
    /// let outcome = client
    ///     .run_effect(&call, |ctx| async move {
    ///         // POST /charges with header Idempotency-Key: ctx.downstream_key
    ///         let _ = ctx.downstream_key;
    ///         Ok::<_, ToolError>(br#"{"charge":"ch_1"}"#.to_vec())
    ///     })
    ///     .await?;
    /// println!("{:?}: {}", outcome.source, String::from_utf8_lossy(&outcome.result));
    /// # Ok(()) }
    /// ```
    pub async fn run_effect<F, Fut>(
        &self,
        call: &EffectCall,
        exec: F,
    ) -> Result<EffectOutcome, Error>
    where
        F: FnMut(ExecContext) -> Fut,
        Fut: Future<Output = Result<Vec<u8>, ToolError>>,
    {
        self.run_effect_checked(call, exec, NoOutcomeCheck).await
    }

    /// [`FenceClient::run_effect`] with an outcome check: when an effect's outcome is unknown
    /// (the closure returned [`ToolError::Unknown`], a lease lapsed, a Begin was refused
    /// `RECONCILE_REQUIRED`), `check` looks at the outside world and the client reconciles with
    /// its evidence: completed → the recorded result is returned; did not happen → the effect is
    /// granted again (same downstream key) and `exec` runs again.
    ///
    /// ```no_run
    /// # async fn demo(client: fence_client::FenceClient) -> Result<(), fence_client::Error> {
    /// use fence_client::{CheckFinding, EffectCall, Receipt, ToolError};
    ///
    /// let call = EffectCall::new("order-1234", "payments.charge", r#"{"amount":4200}"#)
    ///     .step_key("order-1234:pay");
    /// let outcome = client
    ///     .run_effect_checked(
    ///         &call,
    ///         |_ctx| async { Err::<Vec<u8>, _>(ToolError::Unknown("timeout after send".into())) },
    ///         |receipt: Receipt| async move {
    ///             // Look the charge up by receipt.downstream_key at the payment provider.
    ///             CheckFinding::Happened {
    ///                 result: br#"{"charge":"ch_1"}"#.to_vec(),
    ///                 evidence: format!("provider lookup of key {}", receipt.downstream_key),
    ///             }
    ///         },
    ///     )
    ///     .await?;
    /// # let _ = outcome; Ok(()) }
    /// ```
    pub async fn run_effect_checked<F, Fut, C>(
        &self,
        call: &EffectCall,
        exec: F,
        check: C,
    ) -> Result<EffectOutcome, Error>
    where
        F: FnMut(ExecContext) -> Fut,
        Fut: Future<Output = Result<Vec<u8>, ToolError>>,
        C: OutcomeCheck,
    {
        // One request id for every Begin of this logical call: a lost grant comes back at once.
        let stamped;
        let call = match call.request_id {
            Some(_) => call,
            None => {
                stamped = EffectCall {
                    request_id: Some(format!("{:032x}", rand::random::<u128>())),
                    ..call.clone()
                };
                &stamped
            }
        };
        EffectRunner {
            client: self,
            call,
            check: &check,
            executions: 0,
            epoch: call.epoch,
        }
        .run(exec)
        .await
    }
}

/// Retries `op` through transient failures (with jittered exponential backoff) until the
/// policy's transient timeout. Only for idempotent operations.
pub(crate) async fn retry_transient<T, Fut>(
    policy: &RetryPolicy,
    mut op: impl FnMut() -> Fut,
) -> Result<T, Error>
where
    Fut: Future<Output = Result<T, Error>>,
{
    let deadline = Instant::now() + policy.transient_timeout;
    let mut retry = 0;
    loop {
        match op().await {
            Err(err) if err.is_transient() => {
                let wait = policy
                    .backoff(retry)
                    .max(err.retry_after().unwrap_or_default());
                if Instant::now() + wait > deadline {
                    return Err(err);
                }
                tracing::debug!(error = %err, ?wait, "transient failure; retrying");
                tokio::time::sleep(wait).await;
                retry += 1;
            }
            other => return other,
        }
    }
}

/// What to do after one Begin round.
enum Next {
    /// Finished.
    Done(Box<EffectOutcome>),
    /// Begin again (same step key) after a backoff; the error is reported if the attempts run
    /// out.
    Retry(Error),
}

struct EffectRunner<'a, C> {
    client: &'a FenceClient,
    call: &'a EffectCall,
    check: &'a C,
    executions: u32,
    epoch: u64,
}

impl<C: OutcomeCheck> EffectRunner<'_, C> {
    fn policy(&self) -> &RetryPolicy {
        self.client.policy()
    }

    fn outcome(&self, result: Vec<u8>, receipt: Option<Receipt>, source: OutcomeSource) -> Next {
        Next::Done(Box::new(EffectOutcome {
            result,
            receipt,
            source,
            executions: self.executions,
            epoch: self.epoch,
        }))
    }

    fn replayed(&self, receipt: Receipt) -> Next {
        self.outcome(
            receipt.result.clone(),
            Some(receipt),
            OutcomeSource::Replayed,
        )
    }

    /// A Begin may be sent again only with a step key (same key + same intent can never be a
    /// second grant of a live effect); without one, `err` is final.
    fn retry_or_fail(&self, err: Error) -> Result<Next, Error> {
        if self.call.step_key.is_some() {
            Ok(Next::Retry(err))
        } else {
            Err(err)
        }
    }

    async fn run<F, Fut>(mut self, mut exec: F) -> Result<EffectOutcome, Error>
    where
        F: FnMut(ExecContext) -> Fut,
        Fut: Future<Output = Result<Vec<u8>, ToolError>>,
    {
        let max = self.policy().attempts();
        let mut round = 0;
        loop {
            let begun = self.begin().await?;
            self.epoch = begun.epoch;
            let next = match begun.decision {
                Decision::Replay(receipt) => self.replayed(receipt),
                Decision::InProgress {
                    receipt,
                    retry_after_ms,
                } => {
                    let (state, receipt) = self.wait_settled(receipt, retry_after_ms).await?;
                    self.after_wait(state, receipt).await?
                }
                Decision::Refused(refusal) => self.after_refusal(refusal).await?,
                Decision::Execute(grant) => self.execute(grant, &mut exec).await?,
            };
            match next {
                Next::Done(outcome) => return Ok(*outcome),
                Next::Retry(err) => {
                    round += 1;
                    if round >= max || self.executions >= max {
                        return Err(err);
                    }
                    tracing::debug!(error = %err, round, "begin again");
                    tokio::time::sleep(self.policy().backoff(round - 1)).await;
                }
            }
        }
    }

    async fn begin(&self) -> Result<BeginOutcome, Error> {
        if self.call.step_key.is_some() {
            return retry_transient(self.policy(), || self.client.begin(self.call)).await;
        }
        // Without a step key a lost Begin cannot be told from a recorded one: re-send only
        // when the server said it applied nothing (a rate-limit delay).
        let deadline = Instant::now() + self.policy().transient_timeout;
        loop {
            match self.client.begin(self.call).await {
                Err(err) if err.retry_after().is_some() => {
                    let wait = err.retry_after().unwrap_or_default();
                    if Instant::now() + wait > deadline {
                        return Err(err);
                    }
                    tokio::time::sleep(wait).await;
                }
                other => return other,
            }
        }
    }

    async fn query(&self, effect_id: &str) -> Result<(EffectState, Option<Receipt>), Error> {
        let outcome = retry_transient(self.policy(), || {
            self.client
                .query_outcome(OutcomeKey::EffectId(effect_id.to_owned()))
        })
        .await?;
        Ok((outcome.state, outcome.receipt))
    }

    /// Waits until another attempt's effect leaves `ACCEPTED`/`RUNNING` (a lapsed lease reads
    /// `EFFECT_UNKNOWN`), or the policy's in-progress timeout.
    async fn wait_settled(
        &self,
        mut latest: Receipt,
        retry_after_ms: u64,
    ) -> Result<(EffectState, Receipt), Error> {
        let policy = self.policy();
        let deadline = Instant::now() + policy.in_progress_timeout;
        let mut delay = Duration::from_millis(retry_after_ms)
            .max(policy.initial_backoff)
            .min(policy.max_backoff);
        loop {
            tokio::time::sleep(jittered(delay)).await;
            match self
                .client
                .query_outcome(OutcomeKey::EffectId(latest.effect_id.clone()))
                .await
            {
                Ok(outcome) => {
                    if let Some(receipt) = outcome.receipt {
                        latest = receipt;
                    }
                    match outcome.state {
                        EffectState::Accepted | EffectState::Running => {}
                        EffectState::NotFound => {
                            return Err(Error::protocol(format!(
                                "effect {} was in progress and is now not found",
                                latest.effect_id
                            )));
                        }
                        state => return Ok((state, latest)),
                    }
                }
                Err(err) if err.is_transient() => {}
                Err(err) => return Err(err),
            }
            if Instant::now() >= deadline {
                return Err(Error::StillInProgress {
                    receipt: Box::new(latest),
                });
            }
            delay = (delay * 2).min(policy.max_backoff);
        }
    }

    async fn after_wait(&mut self, state: EffectState, receipt: Receipt) -> Result<Next, Error> {
        match state {
            s if s.has_result() => Ok(self.replayed(receipt)),
            EffectState::FailedBeforeInput => self.retry_or_fail(Error::ToolFailed {
                detail: receipt.detail.clone(),
                retryable: true,
                receipt: Some(Box::new(receipt)),
            }),
            // A lapsed DEDUPLICATE lease is granted again with the same downstream key.
            EffectState::EffectUnknown if receipt.class == OperationClass::Deduplicate => {
                let detail = "a lapsed lease of a deduplicated effect".to_owned();
                self.retry_or_fail(Error::EffectUnknown {
                    receipt: Box::new(receipt),
                    detail,
                })
            }
            EffectState::EffectUnknown => {
                let fallback = Error::EffectUnknown {
                    detail: "another attempt's lease lapsed without a completion".into(),
                    receipt: Box::new(receipt.clone()),
                };
                self.settle_unknown(receipt, fallback).await
            }
            other => Err(Error::protocol(format!(
                "unexpected state {other} for a settled effect"
            ))),
        }
    }

    async fn after_refusal(&mut self, refusal: Refusal) -> Result<Next, Error> {
        if refusal.reason == ReasonCode::ReconcileRequired
            && let Some(receipt) = refusal.receipt.clone()
        {
            return self.settle_unknown(receipt, Error::refused(refusal)).await;
        }
        Err(Error::refused(refusal))
    }

    /// Asks the outcome check about an `EFFECT_UNKNOWN` effect and records its finding.
    /// `fallback` is the error when the check cannot tell.
    async fn settle_unknown(&mut self, receipt: Receipt, fallback: Error) -> Result<Next, Error> {
        let (evidence, finding) = match self.check.check(receipt.clone()).await {
            CheckFinding::Unknown => return Err(fallback),
            CheckFinding::Happened { result, evidence } => (evidence, Finding::Completed(result)),
            CheckFinding::DidNotHappen { evidence } => (
                evidence,
                Finding::FailedBeforeInput("an outcome check found it did not happen".into()),
            ),
        };
        let settled = self
            .reconcile(&receipt, &evidence, finding, fallback)
            .await?;
        match settled.state {
            s if s.has_result() => Ok(self.outcome(
                settled.result.clone(),
                Some(settled),
                OutcomeSource::Reconciled,
            )),
            EffectState::FailedBeforeInput | EffectState::Accepted | EffectState::Running => self
                .retry_or_fail(Error::ToolFailed {
                    detail: settled.detail.clone(),
                    retryable: true,
                    receipt: Some(Box::new(settled)),
                }),
            other => Err(Error::protocol(format!(
                "unexpected state {other} after reconcile"
            ))),
        }
    }

    /// Reconciles; if refused (e.g. a concurrent caller settled it first), the current
    /// outcome decides, and `fallback` is returned if it is still unknown.
    async fn reconcile(
        &self,
        receipt: &Receipt,
        evidence: &str,
        finding: Finding,
        fallback: Error,
    ) -> Result<Receipt, Error> {
        let attempt = retry_transient(self.policy(), || {
            self.client
                .reconcile(&receipt.effect_id, self.epoch, evidence, finding.clone())
        })
        .await;
        match attempt {
            Ok(receipt) => Ok(receipt),
            Err(err) if err.refusal().is_some() => {
                tracing::debug!(error = %err, "reconcile refused; querying the outcome");
                match self.query(&receipt.effect_id).await? {
                    (state, Some(mut current)) if state != EffectState::EffectUnknown => {
                        current.state = state;
                        Ok(current)
                    }
                    _ => Err(fallback),
                }
            }
            Err(err) => Err(err),
        }
    }

    async fn execute<F, Fut>(&mut self, grant: Grant, exec: &mut F) -> Result<Next, Error>
    where
        F: FnMut(ExecContext) -> Fut,
        Fut: Future<Output = Result<Vec<u8>, ToolError>>,
    {
        let ctx = ExecContext::new(&grant, self.epoch);
        if !grant.is_recorded() {
            // An unrecorded SAFE_RETRY call: nothing to complete, a new Begin is free.
            self.executions += 1;
            return match exec(ctx).await {
                Ok(result) => Ok(self.outcome(result, None, OutcomeSource::Executed)),
                Err(ToolError::Rejected(detail)) => Err(Error::ToolFailed {
                    detail,
                    retryable: false,
                    receipt: None,
                }),
                Err(ToolError::FailedBeforeInput(detail) | ToolError::Unknown(detail)) => {
                    Ok(Next::Retry(Error::ToolFailed {
                        detail,
                        retryable: true,
                        receipt: None,
                    }))
                }
            };
        }
        let class = grant
            .receipt
            .as_ref()
            .map_or(OperationClass::NonRetryable, |r| r.class);
        let heartbeat = Heartbeat::start(
            self.client.clone(),
            &grant,
            self.epoch,
            self.lease_length(&grant),
            ctx.lease_lost.clone(),
        );
        self.executions += 1;
        let mut result = exec(ctx.clone()).await;
        // DEDUPLICATE / SAFE_RETRY: an ambiguous failure is retried within the grant, with the
        // same downstream key, so the downstream API deduplicates it.
        let mut in_grant = 0;
        while let Err(ToolError::Unknown(detail)) = &result
            && matches!(
                class,
                OperationClass::Deduplicate | OperationClass::SafeRetry
            )
            && self.executions < self.policy().attempts()
            && !ctx.lease_lost()
        {
            tracing::debug!(%detail, "ambiguous failure of an idempotent tool; retrying");
            tokio::time::sleep(self.policy().backoff(in_grant)).await;
            in_grant += 1;
            self.executions += 1;
            result = exec(ctx.clone()).await;
        }
        drop(heartbeat);
        match result {
            Ok(result) => {
                let receipt = self.record_result(&grant, result.clone()).await?;
                Ok(self.outcome(result, Some(receipt), OutcomeSource::Executed))
            }
            Err(ToolError::FailedBeforeInput(detail)) => {
                let completion = Completion::FailedBeforeInput(detail.clone());
                let receipt = self.record_failure(&grant, completion).await?;
                self.after_failure(receipt, detail, true).await
            }
            Err(ToolError::Rejected(detail)) => {
                let completion = Completion::FailedBeforeInput(detail.clone());
                let receipt = self.record_failure(&grant, completion).await?;
                self.after_failure(receipt, detail, false).await
            }
            Err(ToolError::Unknown(detail)) => {
                let completion = Completion::Unknown(detail.clone());
                let receipt = self.record_failure(&grant, completion).await?;
                self.after_failure(receipt, detail, false).await
            }
        }
    }

    /// The lease length of a grant: the call's, or the one the server granted.
    fn lease_length(&self, grant: &Grant) -> Duration {
        if self.call.lease_ms > 0 {
            return Duration::from_millis(self.call.lease_ms);
        }
        let granted_at = grant
            .receipt
            .as_ref()
            .map_or(0, |r| r.updated_at_ms.max(r.created_at_ms));
        match grant.lease_expires_at_ms.checked_sub(granted_at) {
            Some(ms) if ms > 0 && granted_at > 0 => Duration::from_millis(ms),
            _ => Duration::from_secs(3),
        }
    }

    /// After a failure was recorded: the recorded state decides.
    async fn after_failure(
        &mut self,
        receipt: Receipt,
        detail: String,
        retryable: bool,
    ) -> Result<Next, Error> {
        match receipt.state {
            EffectState::FailedBeforeInput if retryable => self.retry_or_fail(Error::ToolFailed {
                detail,
                retryable,
                receipt: Some(Box::new(receipt)),
            }),
            EffectState::FailedBeforeInput => Err(Error::ToolFailed {
                detail,
                retryable,
                receipt: Some(Box::new(receipt)),
            }),
            EffectState::EffectUnknown => {
                let fallback = Error::EffectUnknown {
                    receipt: Box::new(receipt.clone()),
                    detail,
                };
                self.settle_unknown(receipt, fallback).await
            }
            s if s.has_result() => Ok(self.replayed(receipt)),
            other => Err(Error::protocol(format!(
                "unexpected state {other} after recording a failure"
            ))),
        }
    }

    /// Records a failure (before input, or unknown). If the lease lapsed first, the effect
    /// reads `EFFECT_UNKNOWN` and that receipt is returned: only evidence can settle it now.
    async fn record_failure(
        &self,
        grant: &Grant,
        completion: Completion,
    ) -> Result<Receipt, Error> {
        let recorded = retry_transient(self.policy(), || {
            self.client.complete(
                &grant.effect_id,
                grant.attempt,
                self.epoch,
                completion.clone(),
            )
        })
        .await;
        match recorded {
            Ok(receipt) => Ok(receipt),
            Err(err) if lease_gone(&err) => match self.query(&grant.effect_id).await? {
                (state, Some(mut current)) if !state.is_live() => {
                    current.state = state;
                    Ok(current)
                }
                _ => Err(err),
            },
            Err(err) => Err(err),
        }
    }

    /// Records the tool's result. If the lease lapsed before Complete landed, the executor's
    /// own observation of the result is the evidence for a Reconcile.
    async fn record_result(&self, grant: &Grant, result: Vec<u8>) -> Result<Receipt, Error> {
        let unconfirmed = |source: Error| Error::CompletionUnconfirmed {
            effect_id: grant.effect_id.clone(),
            attempt: grant.attempt,
            result: result.clone(),
            source: Box::new(source),
        };
        let completion = Completion::Result(result.clone());
        let recorded = retry_transient(self.policy(), || {
            self.client.complete(
                &grant.effect_id,
                grant.attempt,
                self.epoch,
                completion.clone(),
            )
        })
        .await;
        let err = match recorded {
            Ok(receipt) => return Ok(receipt),
            Err(err) if lease_gone(&err) => err,
            Err(err) => return Err(unconfirmed(err)),
        };
        let (state, current) = self.query(&grant.effect_id).await.map_err(&unconfirmed)?;
        match (state, current) {
            (s, Some(mut current)) if s.has_result() => {
                current.state = s;
                Ok(current)
            }
            (EffectState::EffectUnknown, Some(_)) => {
                let evidence = format!(
                    "the executor of attempt {} saw the tool return this result; its lease \
                     lapsed before Complete was recorded",
                    grant.attempt
                );
                retry_transient(self.policy(), || {
                    self.client.reconcile(
                        &grant.effect_id,
                        self.epoch,
                        &evidence,
                        Finding::Completed(result.clone()),
                    )
                })
                .await
                .map_err(&unconfirmed)
            }
            _ => Err(unconfirmed(err)),
        }
    }
}

/// True when a refusal says this attempt's lease is no longer live.
fn lease_gone(err: &Error) -> bool {
    matches!(
        err.reason(),
        Some(ReasonCode::LeaseLost | ReasonCode::ReconcileRequired | ReasonCode::InvalidTransition)
    )
}

/// A background task extending a grant's lease while the tool runs; stopped when dropped.
struct Heartbeat {
    task: JoinHandle<()>,
}

impl Heartbeat {
    fn start(
        client: FenceClient,
        grant: &Grant,
        epoch: u64,
        lease: Duration,
        lost: Arc<AtomicBool>,
    ) -> Self {
        let effect_id = grant.effect_id.clone();
        let attempt = grant.attempt;
        // Three beats per lease: one lost beat never costs the lease.
        let period = (lease / 3).max(Duration::from_millis(10));
        let task = tokio::spawn(async move {
            loop {
                tokio::time::sleep(period).await;
                match client.heartbeat(&effect_id, attempt, epoch, 0).await {
                    Ok(_) => {}
                    Err(err) if err.is_transient() => {
                        tracing::debug!(error = %err, %effect_id, "heartbeat failed; will retry");
                    }
                    Err(err) => {
                        tracing::warn!(error = %err, %effect_id, "heartbeat refused; lease lost");
                        lost.store(true, Ordering::Release);
                        return;
                    }
                }
            }
        });
        Heartbeat { task }
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{RunHandle, Saga, SagaExecutor, ToolRunner};

    fn assert_send<T: Send>(_: &T) {}

    struct Noop;

    impl ToolRunner for Noop {
        async fn run(&self, _: &str, _: &str, _: ExecContext) -> Result<Vec<u8>, ToolError> {
            Ok(Vec::new())
        }
    }

    /// Every client future must be spawnable on a multi-threaded runtime.
    #[tokio::test]
    async fn protocol_futures_are_send() {
        let client = FenceClient::builder("http://127.0.0.1:1")
            .connect_lazy()
            .unwrap();
        let call = EffectCall::new("r", "t", "{}").step_key("r:s");
        let run_effect = client.run_effect(&call, |_ctx| async { Ok(Vec::new()) });
        assert_send(&run_effect);
        let checked = client.run_effect_checked(
            &call,
            |_ctx| async { Ok(Vec::new()) },
            |_r: Receipt| async { CheckFinding::Unknown },
        );
        assert_send(&checked);
        let run = RunHandle::new(client.clone(), "r", "main", 0);
        let executor = SagaExecutor::new(run, Noop);
        let saga = Saga::new("s");
        assert_send(&executor.execute(&saga));
        assert_send(&executor.compensate("s"));
    }

    #[test]
    fn only_lease_refusals_count_as_a_lost_lease() {
        let refusal = |reason| {
            Error::refused(Refusal {
                reason,
                recovery: crate::RecoveryAction::Stop,
                receipt: None,
                message: String::new(),
                effect_id: None,
                checkpoint_id: None,
                current_epoch: None,
            })
        };
        assert!(lease_gone(&refusal(ReasonCode::LeaseLost)));
        assert!(lease_gone(&refusal(ReasonCode::ReconcileRequired)));
        assert!(!lease_gone(&refusal(ReasonCode::ResultConflict)));
        assert!(!lease_gone(&Error::protocol("x")));
    }
}
