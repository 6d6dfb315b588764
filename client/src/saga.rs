//! The saga executor: forward steps, each declaring its compensation; on a step's definite
//! failure, the completed steps are compensated in reverse order.
//!
//! Everything the executor needs to resume is recorded in Fence, not in memory:
//! - a forward step is a fenced effect with step key `{saga}:{step}`, `saga_id` and its
//!   `compensation` (tool and arguments), so re-running the saga replays completed steps;
//! - a compensation is a fenced effect with step key `{saga}:{step}:compensate` and
//!   `compensates_effect_id`; completing it marks the forward effect `COMPENSATED` atomically,
//!   so re-running the executor after a crash never compensates a step twice;
//! - the saga's state is `ListEffects(saga_id)`: what was committed, what is undone.
//!
//! Only a definite failure ([`Error::ToolFailed`]: nothing happened) aborts a saga. Any other
//! error (a transport failure, a refusal, an unknown outcome) interrupts the executor and is
//! returned: run it again to resume, or call [`SagaExecutor::compensate`] to abort explicitly.

use std::future::Future;

use crate::client::EffectFilter;
use crate::effect::{CheckFinding, EffectOutcome, ExecContext, ToolError};
use crate::error::Error;
use crate::run::RunHandle;
use crate::types::{Compensation, EffectState, Receipt};

/// The step key of a saga's forward step: `"{saga}:{step}"`.
///
/// ```
/// assert_eq!(fence_client::saga_step_key("trip-7", "flight"), "trip-7:flight");
/// ```
pub fn saga_step_key(saga_id: &str, step: &str) -> String {
    format!("{saga_id}:{step}")
}

/// The step key of the compensation of a forward step with step key `forward_step_key`:
/// `"{forward_step_key}:compensate"`, i.e. `"{saga}:{step}:compensate"`.
///
/// ```
/// assert_eq!(
///     fence_client::compensation_step_key("trip-7:flight"),
///     "trip-7:flight:compensate"
/// );
/// ```
pub fn compensation_step_key(forward_step_key: &str) -> String {
    format!("{forward_step_key}:compensate")
}

/// One forward step of a saga and the call that undoes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SagaStep {
    /// The step's name, unique within the saga (part of its step key).
    pub name: String,
    /// The forward tool.
    pub tool: String,
    /// Its JSON arguments.
    pub arguments_json: String,
    /// The call that undoes it.
    pub compensation: Compensation,
}

/// A saga: an id (unique within the run, derived from something durable) and its steps.
///
/// ```
/// use fence_client::{Compensation, Saga};
///
/// let trip = Saga::new("trip-7")
///     .step("flight", "flights.book", r#"{"flight":"LH123"}"#,
///           Compensation::new("flights.cancel", r#"{"flight":"LH123"}"#))
///     .step("hotel", "hotels.book", r#"{"hotel":"h1"}"#,
///           Compensation::new("hotels.cancel", r#"{"hotel":"h1"}"#));
/// assert_eq!(trip.steps.len(), 2);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Saga {
    /// The saga's id.
    pub id: String,
    /// The forward steps, in order.
    pub steps: Vec<SagaStep>,
}

impl Saga {
    /// A saga with no steps yet.
    pub fn new(id: impl Into<String>) -> Self {
        Saga {
            id: id.into(),
            steps: Vec::new(),
        }
    }

    /// Appends a step.
    #[must_use]
    pub fn step(
        mut self,
        name: impl Into<String>,
        tool: impl Into<String>,
        arguments_json: impl Into<String>,
        compensation: Compensation,
    ) -> Self {
        self.steps.push(SagaStep {
            name: name.into(),
            tool: tool.into(),
            arguments_json: arguments_json.into(),
            compensation,
        });
        self
    }
}

/// Performs the tools of a saga (forward steps and compensations alike), and optionally checks
/// the outside world when an effect's outcome is unknown.
///
/// ```
/// use fence_client::{ExecContext, ToolError, ToolRunner};
///
/// struct Travel;
///
/// impl ToolRunner for Travel {
///     async fn run(&self, tool: &str, arguments_json: &str, ctx: ExecContext)
///         -> Result<Vec<u8>, ToolError>
///     {
///         // Dispatch on `tool`; send ctx.downstream_key as the idempotency key.
///         Ok(format!("{tool} {arguments_json} {}", ctx.downstream_key).into_bytes())
///     }
/// }
/// ```
pub trait ToolRunner {
    /// Runs `tool` with `arguments_json` under the grant in `ctx`.
    fn run(
        &self,
        tool: &str,
        arguments_json: &str,
        ctx: ExecContext,
    ) -> impl Future<Output = Result<Vec<u8>, ToolError>> + Send;

    /// Checks what happened to an effect whose outcome is unknown (by its downstream key).
    /// The default cannot tell, so an unknown outcome interrupts the saga.
    fn check(&self, receipt: Receipt) -> impl Future<Output = CheckFinding> + Send {
        let _ = receipt;
        async { CheckFinding::Unknown }
    }
}

/// One forward step as recorded, with its compensation if one was recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SagaStepState {
    /// The forward effect.
    pub forward: Receipt,
    /// Its compensating effect, if one was begun.
    pub compensation: Option<Receipt>,
}

impl SagaStepState {
    /// The step's name, from its step key `"{saga}:{step}"`.
    pub fn name(&self) -> Option<&str> {
        let saga = self.forward.saga_id.as_deref()?;
        self.forward
            .step_key
            .as_deref()?
            .strip_prefix(saga)?
            .strip_prefix(':')
    }

    /// True when the forward step happened and is not (yet) undone.
    pub fn is_committed(&self) -> bool {
        self.forward.state == EffectState::Completed
    }
}

/// A saga's record in Fence: its forward steps in recording order, each with its compensation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SagaState {
    /// The saga.
    pub saga_id: String,
    /// The forward steps, in recording order.
    pub steps: Vec<SagaStepState>,
}

impl SagaState {
    /// Builds the state from the saga's effects (as listed by `ListEffects(saga_id)`, in
    /// recording order): every effect that compensates nothing is a forward step; a
    /// compensation is attached to the step it undoes.
    ///
    /// ```
    /// let state = fence_client::SagaState::from_effects("trip-7", Vec::new());
    /// assert!(!state.is_aborting());
    /// ```
    pub fn from_effects(saga_id: &str, effects: Vec<Receipt>) -> Self {
        let (compensations, forwards): (Vec<Receipt>, Vec<Receipt>) = effects
            .into_iter()
            .partition(|r| r.compensates_effect_id.is_some());
        let steps = forwards
            .into_iter()
            .map(|forward| {
                let compensation = compensations
                    .iter()
                    .rev()
                    .find(|c| c.compensates_effect_id.as_deref() == Some(&forward.effect_id))
                    .cloned();
                SagaStepState {
                    forward,
                    compensation,
                }
            })
            .collect();
        SagaState {
            saga_id: saga_id.to_owned(),
            steps,
        }
    }

    /// True once compensation has begun (some step has a compensation or is compensated):
    /// a re-run of the executor continues compensating instead of going forward.
    pub fn is_aborting(&self) -> bool {
        self.steps
            .iter()
            .any(|s| s.compensation.is_some() || s.forward.state == EffectState::Compensated)
    }

    /// The forward steps that happened and are not undone, in recording order.
    pub fn committed(&self) -> impl Iterator<Item = &Receipt> {
        self.steps
            .iter()
            .filter(|s| s.is_committed())
            .map(|s| &s.forward)
    }

    /// The last forward step that failed before input (the one that aborted the saga), if any.
    pub fn failed_step(&self) -> Option<&SagaStepState> {
        self.steps
            .iter()
            .rev()
            .find(|s| s.forward.state == EffectState::FailedBeforeInput)
    }
}

/// How a saga ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SagaOutcome {
    /// Every step completed (or replayed); their outcomes in step order.
    Completed(Vec<EffectOutcome>),
    /// A step failed definitively and every committed step was compensated.
    Compensated {
        /// The step that failed, if known (on a resumed abort: from the record).
        failed_step: Option<String>,
        /// Why it failed.
        failure: String,
        /// The compensating effects, in the order they ran (reverse step order).
        compensations: Vec<Receipt>,
    },
}

/// Runs sagas on one run with one [`ToolRunner`].
///
/// ```no_run
/// # async fn demo(run: fence_client::RunHandle) -> Result<(), fence_client::Error> {
/// use fence_client::{Compensation, ExecContext, Saga, SagaExecutor, SagaOutcome, ToolError, ToolRunner};
///
/// struct Travel;
/// impl ToolRunner for Travel {
///     async fn run(&self, tool: &str, _args: &str, _ctx: ExecContext) -> Result<Vec<u8>, ToolError> {
///         match tool {
///             "payments.charge" => Err(ToolError::Rejected("card declined".into())),
///             _ => Ok(b"ok".to_vec()),
///         }
///     }
/// }
///
/// let trip = Saga::new("trip-7")
///     .step("flight", "flights.book", r#"{"flight":"LH123"}"#,
///           Compensation::new("flights.cancel", r#"{"flight":"LH123"}"#))
///     .step("charge", "payments.charge", r#"{"amount":900}"#,
///           Compensation::new("payments.refund", r#"{"amount":900}"#));
/// match SagaExecutor::new(run, Travel).execute(&trip).await? {
///     SagaOutcome::Completed(_) => println!("booked"),
///     SagaOutcome::Compensated { failure, .. } => println!("undone: {failure}"),
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct SagaExecutor<R> {
    run: RunHandle,
    runner: R,
}

impl<R: ToolRunner> SagaExecutor<R> {
    /// An executor for sagas on `run`, performing tools with `runner`.
    pub fn new(run: RunHandle, runner: R) -> Self {
        SagaExecutor { run, runner }
    }

    /// The run.
    pub fn run_handle(&self) -> &RunHandle {
        &self.run
    }

    /// The tool runner.
    pub fn runner(&self) -> &R {
        &self.runner
    }

    /// Runs a saga to its end, or resumes it: completed steps replay; if compensation had
    /// begun (a previous executor aborted and crashed), it continues compensating. On a
    /// step's definite failure, compensates every committed step in reverse order.
    ///
    /// ```no_run
    /// # async fn demo<R: fence_client::ToolRunner>(executor: fence_client::SagaExecutor<R>, saga: fence_client::Saga)
    /// # -> Result<(), fence_client::Error> {
    /// let outcome = executor.execute(&saga).await?;
    /// println!("{outcome:?}");
    /// # Ok(()) }
    /// ```
    pub async fn execute(&self, saga: &Saga) -> Result<SagaOutcome, Error> {
        let state = self.state(&saga.id).await?;
        if state.is_aborting() {
            let failed = state.failed_step();
            let failed_step = failed.and_then(|s| s.name()).map(str::to_owned);
            let failure = failed.map_or_else(
                || "resumed the compensation of an aborted saga".to_owned(),
                |s| s.forward.detail.clone(),
            );
            let compensations = self.compensate(&saga.id).await?;
            return Ok(SagaOutcome::Compensated {
                failed_step,
                failure,
                compensations,
            });
        }
        let mut outcomes = Vec::with_capacity(saga.steps.len());
        for step in &saga.steps {
            let call = self
                .run
                .call(&step.tool, &step.arguments_json)
                .step_key(saga_step_key(&saga.id, &step.name))
                .saga(&saga.id)
                .compensation(step.compensation.clone());
            let done = self
                .run
                .run_effect_checked(
                    &call,
                    |ctx| self.runner.run(&step.tool, &step.arguments_json, ctx),
                    |receipt| self.runner.check(receipt),
                )
                .await;
            match done {
                Ok(outcome) => outcomes.push(outcome),
                Err(Error::ToolFailed { detail, .. }) => {
                    tracing::info!(saga = %saga.id, step = %step.name, %detail, "saga step failed; compensating");
                    let compensations = self.compensate(&saga.id).await?;
                    return Ok(SagaOutcome::Compensated {
                        failed_step: Some(step.name.clone()),
                        failure: detail,
                        compensations,
                    });
                }
                Err(err) => return Err(err),
            }
        }
        Ok(SagaOutcome::Completed(outcomes))
    }

    /// Compensates every committed step of a saga, in reverse recording order, each as a
    /// fenced effect with step key `{saga}:{step}:compensate`. Already compensated steps are
    /// skipped (their compensation is returned), so calling it again never undoes a step
    /// twice. Refuses to start while a forward step's outcome is unknown or in progress.
    ///
    /// ```no_run
    /// # async fn demo<R: fence_client::ToolRunner>(executor: fence_client::SagaExecutor<R>)
    /// # -> Result<(), fence_client::Error> {
    /// let undone = executor.compensate("trip-7").await?;
    /// println!("{} compensations", undone.len());
    /// # Ok(()) }
    /// ```
    pub async fn compensate(&self, saga_id: &str) -> Result<Vec<Receipt>, Error> {
        let state = self.state(saga_id).await?;
        if let Some(unsettled) = state.steps.iter().find(|s| {
            matches!(
                s.forward.state,
                EffectState::EffectUnknown | EffectState::Accepted | EffectState::Running
            )
        }) {
            let receipt = Box::new(unsettled.forward.clone());
            return Err(if unsettled.forward.state == EffectState::EffectUnknown {
                Error::EffectUnknown {
                    receipt,
                    detail: "a saga step's outcome is unknown: reconcile it before compensating"
                        .into(),
                }
            } else {
                Error::StillInProgress { receipt }
            });
        }
        let mut done = Vec::new();
        for step in state.steps.iter().rev() {
            let forward = &step.forward;
            match forward.state {
                EffectState::Completed => {}
                EffectState::Compensated => {
                    done.extend(step.compensation.clone());
                    continue;
                }
                // Never happened: nothing to undo.
                _ => continue,
            }
            let compensation = forward.compensation.clone().ok_or_else(|| {
                Error::protocol(format!(
                    "saga {saga_id} step {} has no recorded compensation",
                    forward.effect_id
                ))
            })?;
            let forward_key = forward
                .step_key
                .clone()
                .unwrap_or_else(|| saga_step_key(saga_id, &forward.effect_id));
            let call = self
                .run
                .call(&compensation.tool, &compensation.arguments_json)
                .step_key(compensation_step_key(&forward_key))
                .saga(saga_id)
                .compensates(&forward.effect_id);
            let outcome = self
                .run
                .run_effect_checked(
                    &call,
                    |ctx| {
                        self.runner
                            .run(&compensation.tool, &compensation.arguments_json, ctx)
                    },
                    |receipt| self.runner.check(receipt),
                )
                .await?;
            let receipt = outcome.receipt.ok_or_else(|| {
                Error::protocol("a compensation was not recorded (unrecorded SAFE_RETRY tool?)")
            })?;
            done.push(receipt);
        }
        Ok(done)
    }

    /// The saga's record: its forward steps and their compensations.
    ///
    /// ```no_run
    /// # async fn demo<R: fence_client::ToolRunner>(executor: fence_client::SagaExecutor<R>)
    /// # -> Result<(), fence_client::Error> {
    /// let state = executor.state("trip-7").await?;
    /// for step in &state.steps {
    ///     println!("{:?}: {}", step.name(), step.forward.state);
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn state(&self, saga_id: &str) -> Result<SagaState, Error> {
        let effects = self
            .run
            .client()
            .list_effects(&EffectFilter::run(self.run.run_id()).saga(saga_id))
            .await?;
        Ok(SagaState::from_effects(saga_id, effects))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::OperationClass;

    fn receipt(id: &str, state: EffectState, compensates: Option<&str>) -> Receipt {
        Receipt {
            effect_id: id.into(),
            run_id: "r".into(),
            branch: "main".into(),
            epoch: 1,
            position: 0,
            tool: "t".into(),
            tool_version: 0,
            class: OperationClass::NonRetryable,
            step_key: Some(format!("s:{id}")),
            intent_fingerprint: String::new(),
            request_fingerprint: String::new(),
            occurrence: 1,
            state,
            result: Vec::new(),
            detail: String::new(),
            downstream_key: String::new(),
            attempt: 1,
            lease_expires_at_ms: 0,
            created_at_ms: 0,
            updated_at_ms: 0,
            expires_at_ms: 0,
            tombstone: false,
            evidence: String::new(),
            replays: 0,
            last_replay_epoch: 0,
            credential_hashes: Vec::new(),
            saga_id: Some("s".into()),
            compensation: None,
            compensates_effect_id: compensates.map(Into::into),
            compensated_by_effect_id: None,
            arguments_json: String::new(),
            deliberate_repeat: false,
            parent_checkpoint_id: None,
        }
    }

    #[test]
    fn compensations_attach_to_the_steps_they_undo() {
        let state = SagaState::from_effects(
            "s",
            vec![
                receipt("a", EffectState::Compensated, None),
                receipt("b", EffectState::Completed, None),
                receipt("c", EffectState::FailedBeforeInput, None),
                receipt("ca", EffectState::Completed, Some("a")),
            ],
        );
        assert_eq!(state.steps.len(), 3);
        assert_eq!(
            state.steps[0].compensation.as_ref().unwrap().effect_id,
            "ca"
        );
        assert!(state.steps[1].compensation.is_none());
        assert!(state.is_aborting());
        let committed: Vec<&str> = state.committed().map(|r| r.effect_id.as_str()).collect();
        assert_eq!(committed, ["b"]);
        assert_eq!(state.failed_step().unwrap().forward.effect_id, "c");
        assert_eq!(state.steps[1].name(), Some("b"));
    }

    #[test]
    fn a_saga_without_compensations_is_not_aborting() {
        let state = SagaState::from_effects(
            "s",
            vec![
                receipt("a", EffectState::Completed, None),
                receipt("b", EffectState::FailedBeforeInput, None),
            ],
        );
        assert!(!state.is_aborting());
    }

    #[test]
    fn step_keys_are_derived_deterministically() {
        assert_eq!(saga_step_key("trip", "hotel"), "trip:hotel");
        assert_eq!(
            compensation_step_key(&saga_step_key("trip", "hotel")),
            "trip:hotel:compensate"
        );
    }
}
