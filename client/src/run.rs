//! Helpers for agent frameworks: deterministic step keys, and a [`RunHandle`] that carries a
//! run's id, branch and epoch and keeps them current across the framework's own checkpoint,
//! restore and fork operations.
//!
//! Invariant: the handle never adopts a newer epoch on its own. A process whose run was
//! restored by someone else keeps its old epoch and is refused `STALE_EPOCH` (it may be a
//! zombie); only an explicit [`RunHandle::restore`] or [`RunHandle::refresh`] moves it forward.

use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};

use crate::client::{EffectCall, EffectFilter, FenceClient};
use crate::effect::{EffectOutcome, ExecContext, OutcomeCheck, ToolError};
use crate::error::Error;
use crate::types::{CheckpointInfo, Forked, Receipt, Restored, RunInfo};

/// The root branch of every run.
pub const MAIN_BRANCH: &str = "main";

/// The deterministic step key of step `step` of run `run`: `"{run}:{step}"`. Derive both
/// parts from something durable (a workflow run id, a node name and loop index), never from
/// a fresh UUID or a timestamp, so that a retried or restored step gets the same key.
///
/// ```
/// assert_eq!(fence_client::step_key("wf-42", "charge-card"), "wf-42:charge-card");
/// ```
pub fn step_key(run: &str, step: &str) -> String {
    format!("{run}:{step}")
}

#[derive(Debug, Clone)]
struct Position {
    branch: String,
    epoch: u64,
}

/// A run as seen by one agent process: its id, the branch it is on and the epoch it holds.
/// Clones share the position, so a restore or fork through one clone is seen by all.
///
/// ```no_run
/// # async fn demo(client: fence_client::FenceClient) -> Result<(), fence_client::Error> {
/// use fence_client::{RunHandle, ToolError};
///
/// let run = RunHandle::start(client, "wf-42").await?;
/// run.checkpoint("cp-1").await?;
/// let call = run.call("payments.charge", r#"{"amount":4200,"to":"acme"}"#).step_key(run.step_key("pay"));
/// let paid = run
///     .run_effect(&call, |ctx| async move { Ok::<_, ToolError>(ctx.downstream_key.into_bytes()) })
///     .await?;
/// // ... the agent crashes; its framework restores checkpoint cp-1:
/// run.restore("cp-1").await?;
/// let again = run
///     .run_effect(&call, |_ctx| async { Err(ToolError::Rejected("a replay never runs".into())) })
///     .await?;
/// assert_eq!(again.result, paid.result);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct RunHandle {
    client: FenceClient,
    run_id: Arc<str>,
    position: Arc<Mutex<Position>>,
}

impl RunHandle {
    /// Starts the run (idempotent: an existing run is attached to) on "main" at its current
    /// epoch.
    ///
    /// ```no_run
    /// # async fn demo(client: fence_client::FenceClient) -> Result<(), fence_client::Error> {
    /// let run = fence_client::RunHandle::start(client, "wf-42").await?;
    /// assert_eq!(run.branch(), "main");
    /// # Ok(()) }
    /// ```
    pub async fn start(client: FenceClient, run_id: &str) -> Result<RunHandle, Error> {
        let run = client.start_run(run_id).await?.value;
        Ok(RunHandle::new(client, &run.run_id, MAIN_BRANCH, run.epoch))
    }

    /// Attaches to an existing run's branch at the run's current epoch (e.g. a process taking
    /// over after its predecessor was restored).
    ///
    /// ```no_run
    /// # async fn demo(client: fence_client::FenceClient) -> Result<(), fence_client::Error> {
    /// let run = fence_client::RunHandle::attach(client, "wf-42", "main").await?;
    /// println!("epoch {}", run.epoch());
    /// # Ok(()) }
    /// ```
    pub async fn attach(
        client: FenceClient,
        run_id: &str,
        branch: &str,
    ) -> Result<RunHandle, Error> {
        let run = client.get_run(run_id).await?;
        Ok(RunHandle::new(client, &run.run_id, branch, run.epoch))
    }

    /// A handle at a known position, without an RPC (e.g. restored from the framework's own
    /// persisted state). Epoch 0 is accepted only while the run was never restored; the
    /// handle learns the real epoch from the first Begin.
    ///
    /// ```no_run
    /// # fn demo(client: fence_client::FenceClient) {
    /// let run = fence_client::RunHandle::new(client, "wf-42", "main", 0);
    /// assert_eq!(run.epoch(), 0);
    /// # }
    /// ```
    pub fn new(client: FenceClient, run_id: &str, branch: &str, epoch: u64) -> RunHandle {
        RunHandle {
            client,
            run_id: Arc::from(run_id),
            position: Arc::new(Mutex::new(Position {
                branch: branch.to_owned(),
                epoch,
            })),
        }
    }

    fn position(&self) -> Position {
        self.position
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn update(&self, f: impl FnOnce(&mut Position)) {
        f(&mut self.position.lock().unwrap_or_else(PoisonError::into_inner));
    }

    /// The client.
    pub fn client(&self) -> &FenceClient {
        &self.client
    }

    /// The run's id.
    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// The branch this handle is on.
    pub fn branch(&self) -> String {
        self.position().branch
    }

    /// The epoch this handle holds.
    pub fn epoch(&self) -> u64 {
        self.position().epoch
    }

    /// `"{run}:{step}"` for this run (see [`step_key`]).
    ///
    /// ```no_run
    /// # fn demo(run: fence_client::RunHandle) {
    /// assert_eq!(run.step_key("pay"), format!("{}:pay", run.run_id()));
    /// # }
    /// ```
    pub fn step_key(&self, step: &str) -> String {
        step_key(&self.run_id, step)
    }

    /// A call of `tool` on this run, branch and epoch (add a step key, a saga...).
    ///
    /// ```no_run
    /// # fn demo(run: fence_client::RunHandle) {
    /// let call = run.call("email.send", r#"{"to":"a@example.com"}"#).step_key(run.step_key("notify"));
    /// # let _ = call; }
    /// ```
    pub fn call(&self, tool: &str, arguments_json: &str) -> EffectCall {
        let position = self.position();
        EffectCall::new(self.run_id.as_ref(), tool, arguments_json)
            .branch(position.branch)
            .epoch(position.epoch)
    }

    /// `call` stamped with this handle's current branch and epoch.
    fn stamp(&self, call: &EffectCall) -> EffectCall {
        let position = self.position();
        EffectCall {
            run_id: self.run_id.to_string(),
            branch: Some(position.branch),
            epoch: position.epoch,
            ..call.clone()
        }
    }

    /// Learns the run's epoch from a Begin when the handle did not know it (epoch 0).
    fn learn_epoch(&self, epoch: u64) {
        self.update(|p| {
            if p.epoch == 0 {
                p.epoch = epoch;
            }
        });
    }

    /// [`FenceClient::run_effect`] on this run, at the handle's current branch and epoch
    /// (whatever the call says).
    ///
    /// ```no_run
    /// # async fn demo(run: fence_client::RunHandle) -> Result<(), fence_client::Error> {
    /// use fence_client::ToolError;
    ///
    /// let call = run.call("hotels.book", r#"{"hotel":"h1"}"#).step_key(run.step_key("hotel"));
    /// let booked = run
    ///     .run_effect(&call, |_ctx| async { Ok::<_, ToolError>(b"booking-9".to_vec()) })
    ///     .await?;
    /// # let _ = booked; Ok(()) }
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
        let outcome = self.client.run_effect(&self.stamp(call), exec).await?;
        self.learn_epoch(outcome.epoch);
        Ok(outcome)
    }

    /// [`FenceClient::run_effect_checked`] on this run, at the handle's current branch and
    /// epoch.
    ///
    /// ```no_run
    /// # async fn demo(run: fence_client::RunHandle) -> Result<(), fence_client::Error> {
    /// use fence_client::{CheckFinding, Receipt, ToolError};
    ///
    /// let call = run.call("payments.charge", r#"{"amount":1}"#).step_key(run.step_key("pay"));
    /// let paid = run
    ///     .run_effect_checked(
    ///         &call,
    ///         |_ctx| async { Ok::<_, ToolError>(b"ch_1".to_vec()) },
    ///         |_r: Receipt| async { CheckFinding::Unknown },
    ///     )
    ///     .await?;
    /// # let _ = paid; Ok(()) }
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
        let outcome = self
            .client
            .run_effect_checked(&self.stamp(call), exec, check)
            .await?;
        self.learn_epoch(outcome.epoch);
        Ok(outcome)
    }

    /// Records a checkpoint named by the framework's own checkpoint id, at the current end of
    /// this handle's branch.
    ///
    /// ```no_run
    /// # async fn demo(run: fence_client::RunHandle) -> Result<(), fence_client::Error> {
    /// let cp = run.checkpoint("langgraph-cp-0007").await?;
    /// println!("at position {}", cp.position);
    /// # Ok(()) }
    /// ```
    pub async fn checkpoint(&self, checkpoint_id: &str) -> Result<CheckpointInfo, Error> {
        self.checkpoint_after(checkpoint_id, "").await
    }

    /// Records a checkpoint that follows `parent_checkpoint_id` in the run's history, so the
    /// effects naming it are after it however late it is saved (see
    /// [`FenceClient::checkpoint_after`](crate::FenceClient::checkpoint_after)).
    pub async fn checkpoint_after(
        &self,
        checkpoint_id: &str,
        parent_checkpoint_id: &str,
    ) -> Result<CheckpointInfo, Error> {
        let position = self.position();
        let stored = self
            .client
            .checkpoint_after(
                &self.run_id,
                &position.branch,
                position.epoch,
                checkpoint_id,
                parent_checkpoint_id,
            )
            .await?;
        Ok(stored.value)
    }

    /// Restores the run to a checkpoint (compare-and-set on this handle's epoch, so two
    /// restorers cannot both win) and moves the handle to the new epoch and the checkpoint's
    /// branch. Calls after it are matched against the replay tape.
    ///
    /// ```no_run
    /// # async fn demo(run: fence_client::RunHandle) -> Result<(), fence_client::Error> {
    /// let restored = run.restore("langgraph-cp-0007").await?;
    /// assert_eq!(run.epoch(), restored.epoch);
    /// # Ok(()) }
    /// ```
    pub async fn restore(&self, checkpoint_id: &str) -> Result<Restored, Error> {
        let expected = self.epoch();
        let restored = self
            .client
            .restore(
                &self.run_id,
                checkpoint_id,
                (expected != 0).then_some(expected),
            )
            .await?;
        self.update(|p| {
            p.epoch = restored.epoch;
            p.branch.clone_from(&restored.branch);
        });
        Ok(restored)
    }

    /// Forks a new branch at a checkpoint (e.g. the one a `FORK_REQUIRED` refusal names) and
    /// moves the handle onto it. `new_branch: None` lets the server name it.
    ///
    /// ```no_run
    /// # async fn demo(run: fence_client::RunHandle) -> Result<(), fence_client::Error> {
    /// let forked = run.fork("langgraph-cp-0007", None, "user changed the payee").await?;
    /// assert_eq!(run.branch(), forked.branch.name);
    /// # Ok(()) }
    /// ```
    pub async fn fork(
        &self,
        checkpoint_id: &str,
        new_branch: Option<&str>,
        reason: &str,
    ) -> Result<Forked, Error> {
        let forked = self
            .client
            .fork(
                &self.run_id,
                checkpoint_id,
                self.epoch(),
                new_branch,
                reason,
            )
            .await?;
        self.update(|p| p.branch.clone_from(&forked.branch.name));
        Ok(forked)
    }

    /// Fetches the run and adopts its current epoch: the explicit answer to a `STALE_EPOCH`
    /// refusal (`REFRESH_EPOCH`), once the process knows it is not a zombie.
    ///
    /// ```no_run
    /// # async fn demo(run: fence_client::RunHandle) -> Result<(), fence_client::Error> {
    /// let info = run.refresh().await?;
    /// assert_eq!(run.epoch(), info.epoch);
    /// # Ok(()) }
    /// ```
    pub async fn refresh(&self) -> Result<RunInfo, Error> {
        let info = self.client.get_run(&self.run_id).await?;
        self.update(|p| p.epoch = info.epoch);
        Ok(info)
    }

    /// The run's state (epoch, branches, checkpoints, restores), without changing the handle.
    ///
    /// ```no_run
    /// # async fn demo(run: fence_client::RunHandle) -> Result<(), fence_client::Error> {
    /// println!("{} checkpoints", run.info().await?.checkpoints.len());
    /// # Ok(()) }
    /// ```
    pub async fn info(&self) -> Result<RunInfo, Error> {
        self.client.get_run(&self.run_id).await
    }

    /// Every effect of the run on every branch, in recording order (the audit trail).
    ///
    /// ```no_run
    /// # async fn demo(run: fence_client::RunHandle) -> Result<(), fence_client::Error> {
    /// for receipt in run.effects().await? {
    ///     println!("{} {}", receipt.tool, receipt.state);
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn effects(&self) -> Result<Vec<Receipt>, Error> {
        self.client
            .list_effects(&EffectFilter::run(self.run_id.as_ref()))
            .await
    }
}
