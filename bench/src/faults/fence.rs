//! The Fence arm: every call goes through the real `fenced` (a child process on loopback,
//! SIGKILLed and restarted on the same data dir during the run), with the protocol a client
//! library follows:
//! Begin → run the call downstream only on `Execute`, passing the downstream key as the
//! idempotency key → Complete; `Replay` returns the recorded result; `IN_PROGRESS` waits;
//! an ambiguous failure is recorded `EFFECT_UNKNOWN` and settled by an outcome check (a
//! downstream lookup by the downstream key) and Reconcile; checkpoints, restores and forks go
//! to Fence too.
//!
//! Every grant, completion and credential use Fence acknowledged is remembered and checked
//! against the server after the run: one that is missing is a lost acknowledgement.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use fence_proto::v1 as pb;
use fence_proto::v1::decision::Outcome;
use fence_proto::v1::fence_client::FenceClient;
use tonic::transport::Channel;
use tonic::{Code, Status};
use tonic_types::StatusExt;

use super::Config;
use super::agent::{Attempt, Protection, StepCtx, StepResult};
use crate::fenced::{Fenced, default_binary};
use crate::scenario::{Call, Fault, KillPhase, SagaRole, TOOLS, Workflow};
use crate::world::{Reply, World};

/// Where and how the Fence arm runs its server.
#[derive(Debug, Clone)]
pub struct FenceOptions {
    /// The `fenced` binary (default: next to this executable).
    pub binary: Option<PathBuf>,
    /// The server's lease (short, so that stalled grants lapse quickly).
    pub lease_ms: u64,
    /// The data dir (default: a temp dir, removed afterwards).
    pub data_dir: Option<PathBuf>,
}

/// What Fence acknowledged.
#[derive(Default)]
struct Acks {
    /// Granted effects and their downstream keys.
    granted: HashMap<String, String>,
    /// Recorded results.
    completed: HashMap<String, Vec<u8>>,
    /// Credentials spent by granted effects.
    spent: HashSet<String>,
}

/// The Fence arm.
pub(super) struct FenceArm<'a> {
    world: &'a World,
    server: Fenced,
    lease: Duration,
    acks: Mutex<Acks>,
    requests: std::sync::atomic::AtomicU64,
    _dir: Option<tempfile::TempDir>,
}

/// One workflow's run in Fence.
pub(super) struct FenceRun {
    run_id: String,
    epoch: u64,
    forks: u32,
}

fn transient(s: &Status) -> bool {
    matches!(
        s.code(),
        Code::Unavailable | Code::Unknown | Code::Cancelled | Code::DeadlineExceeded
    )
}

/// The `ErrorInfo.reason` of a refusal status.
fn reason_of(s: &Status) -> String {
    s.get_error_details()
        .error_info()
        .map(|i| i.reason.clone())
        .unwrap_or_default()
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn done(receipt: pb::Receipt) -> Attempt {
    Attempt::Done(StepResult {
        response: receipt.result,
        effect_id: receipt.effect_id,
    })
}

fn describe(o: &Outcome) -> String {
    let r = |r: &Option<pb::Receipt>| {
        r.as_ref().map_or_else(String::new, |r| {
            format!(
                "{} {} attempt {} pos {} branch {}",
                r.effect_id,
                pb::EffectState::try_from(r.state).map_or("?", |s| s.as_str_name()),
                r.attempt,
                r.position,
                r.branch
            )
        })
    };
    match o {
        Outcome::Execute(e) => format!("EXECUTE {}", r(&e.receipt)),
        Outcome::Replay(p) => format!("REPLAY {}", r(&p.receipt)),
        Outcome::InProgress(p) => format!("IN_PROGRESS {}", r(&p.receipt)),
        Outcome::Refused(x) => format!(
            "REFUSED {} {} (cp {})",
            pb::ReasonCode::try_from(x.reason).map_or("?", |c| c.as_str_name()),
            r(&x.receipt),
            x.checkpoint_id
        ),
    }
}

type Boxed<'a> = Pin<Box<dyn Future<Output = Attempt> + 'a>>;

impl<'a> FenceArm<'a> {
    /// Starts `fenced` and registers the world's tools.
    pub(super) async fn start(cfg: &Config, world: &'a World) -> Result<Self> {
        let (dir, owned) = match &cfg.fence.data_dir {
            Some(d) => (d.clone(), None),
            None => {
                let t = tempfile::Builder::new().prefix("fence-faults-").tempdir()?;
                (t.path().to_path_buf(), Some(t))
            }
        };
        std::fs::create_dir_all(&dir)?;
        let binary = match &cfg.fence.binary {
            Some(b) => b.clone(),
            None => default_binary()?,
        };
        let server = Fenced::start(
            Vec::new(),
            binary,
            dir.join("data"),
            vec!["--lease-ms".into(), cfg.fence.lease_ms.to_string()],
            dir.join("fenced.log"),
            cfg.agents,
        )
        .await?;
        let arm = Self {
            world,
            server,
            lease: Duration::from_millis(cfg.fence.lease_ms),
            acks: Mutex::new(Acks::default()),
            requests: std::sync::atomic::AtomicU64::new(1),
            _dir: owned,
        };
        for t in &TOOLS {
            let tool = pb::ToolSpec {
                name: t.name.into(),
                class: t.class as i32,
                intent_schema: Some(pb::IntentSchema {
                    volatile_fields: t.volatile.iter().map(|f| (*f).to_owned()).collect(),
                    ..Default::default()
                }),
                ..Default::default()
            };
            arm.rpc(|mut c| {
                let req = pb::RegisterToolRequest {
                    tool: Some(tool.clone()),
                };
                async move { c.register_tool(req).await }
            })
            .await
            .with_context(|| format!("register {}", t.name))?;
        }
        Ok(arm)
    }

    /// How many times the server was killed.
    pub(super) fn kills(&self) -> u64 {
        self.server.kills()
    }

    /// Stops the server.
    pub(super) async fn stop(&self) {
        self.server.stop().await;
    }

    fn acks(&self) -> std::sync::MutexGuard<'_, Acks> {
        self.acks.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Calls the server, riding through kills: a transport failure waits for the restart and
    /// tries again (callers only send requests whose repetition the protocol handles).
    async fn rpc<T, F, Fut>(&self, f: F) -> Result<T, Status>
    where
        F: FnMut(FenceClient<Channel>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        // Spread calls over the connections, as separate agent processes would.
        let conn = self
            .requests
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed) as usize;
        self.rpc_on(conn, f).await
    }

    /// [`FenceArm::rpc`] on connection `conn` (each workflow has its own).
    async fn rpc_on<T, F, Fut>(&self, conn: usize, mut f: F) -> Result<T, Status>
    where
        F: FnMut(FenceClient<Channel>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let channel = self
                .server
                .channel_for(conn)
                .await
                .map_err(|e| Status::unavailable(e.to_string()))?;
            let outcome =
                tokio::time::timeout(Duration::from_secs(30), f(FenceClient::new(channel))).await;
            match outcome {
                Ok(Ok(r)) => return Ok(r.into_inner()),
                Ok(Err(s)) if !transient(&s) => return Err(s),
                Ok(Err(s)) if Instant::now() > deadline => return Err(s),
                Err(_) if Instant::now() > deadline => {
                    return Err(Status::deadline_exceeded("no answer for 120 s"));
                }
                _ => tokio::time::sleep(Duration::from_millis(5)).await,
            }
        }
    }

    /// Kills the server while something else is in flight.
    async fn kill_soon(&self) -> Result<(), String> {
        tokio::time::sleep(Duration::from_micros(200)).await;
        self.server
            .kill_and_restart()
            .await
            .map_err(|e| format!("restart after kill -9: {e:#}"))
    }

    fn begin_request(&self, run: &FenceRun, ctx: &StepCtx<'_>, call: &Call) -> pb::BeginRequest {
        let (saga_id, compensation) = match &ctx.step.saga {
            Some(SagaRole::Forward(cancel)) => (
                format!("trip-{}", ctx.workflow.id),
                Some(pb::Compensation {
                    tool: "travel.cancel".into(),
                    arguments_json: serde_json::Value::Object(cancel.clone()).to_string(),
                }),
            ),
            Some(SagaRole::Compensates(_)) => (format!("trip-{}", ctx.workflow.id), None),
            None => (String::new(), None),
        };
        pb::BeginRequest {
            run_id: run.run_id.clone(),
            branch: ctx.branch.to_owned(),
            epoch: run.epoch,
            tool: call.tool.name.into(),
            arguments_json: call.args_json.clone(),
            step_key: if ctx.workflow.step_keys {
                ctx.step_key()
            } else {
                String::new()
            },
            credentials: call
                .token
                .iter()
                .map(|t| pb::CredentialUse {
                    token: t.clone().into_bytes(),
                    budget: 1,
                })
                .collect(),
            saga_id,
            compensation,
            compensates_effect_id: ctx.compensates.clone().unwrap_or_default(),
            // One per logical call of this executor: a Begin re-sent after a lost answer (a
            // kill) gets its own grant back instead of waiting for the lease.
            request_id: format!(
                "req-{}",
                self.requests
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            ),
            ..Default::default()
        }
    }

    async fn complete(
        &self,
        effect_id: &str,
        attempt: u32,
        epoch: u64,
        outcome: pb::complete_request::Outcome,
    ) -> Result<pb::Receipt, Status> {
        let req = pb::CompleteRequest {
            effect_id: effect_id.to_owned(),
            attempt,
            epoch,
            outcome: Some(outcome.clone()),
        };
        let receipt = self
            .rpc(|mut c| {
                let req = req.clone();
                async move { c.complete(req).await }
            })
            .await?
            .receipt
            .unwrap_or_default();
        if let pb::complete_request::Outcome::Result(result) = outcome {
            self.acks().completed.insert(effect_id.to_owned(), result);
        }
        Ok(receipt)
    }

    /// Waits until an effect in progress is no longer (its lease lapsed or it finished).
    async fn wait_settled(&self, receipt: &pb::Receipt) -> Result<(), String> {
        let lapse = receipt.lease_expires_at_ms.saturating_sub(now_ms());
        tokio::time::sleep(Duration::from_millis(lapse.min(60_000) + 5)).await;
        let deadline = Instant::now() + self.lease * 40 + Duration::from_secs(10);
        loop {
            let q = self
                .rpc(|mut c| {
                    let req = pb::QueryOutcomeRequest {
                        key: Some(pb::query_outcome_request::Key::EffectId(
                            receipt.effect_id.clone(),
                        )),
                    };
                    async move { c.query_outcome(req).await }
                })
                .await
                .map_err(|s| format!("QueryOutcome: {s}"))?;
            let live = [
                pb::EffectState::Accepted as i32,
                pb::EffectState::Running as i32,
            ];
            if !live.contains(&q.state) {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!("effect {} stays in progress", receipt.effect_id));
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// The outcome check of an effect whose outcome is unknown: look its downstream key up
    /// in the world, and record what was found with Reconcile.
    async fn settle(&self, run: &FenceRun, receipt: &pb::Receipt) -> Result<(), String> {
        let found = self.world.lookup(&receipt.tool, &receipt.downstream_key);
        let (evidence, outcome) = match &found {
            Some(response) => (
                format!("downstream record under key {}", receipt.downstream_key),
                pb::reconcile_request::Outcome::CompletedResult(response.clone()),
            ),
            None => (
                format!("no downstream record under key {}", receipt.downstream_key),
                pb::reconcile_request::Outcome::FailedBeforeInput(pb::FailedBeforeInput {
                    detail: "the outcome check found nothing downstream".into(),
                }),
            ),
        };
        if self
            .reconcile(&receipt.effect_id, run.epoch, evidence, outcome)
            .await?
            && let Some(response) = found
        {
            self.acks()
                .completed
                .insert(receipt.effect_id.clone(), response);
        }
        Ok(())
    }

    /// Records a checked outcome; `Ok(false)` when Fence had it settled meanwhile (or it is
    /// still running): the next Begin says what to do.
    async fn reconcile(
        &self,
        effect_id: &str,
        epoch: u64,
        evidence: String,
        outcome: pb::reconcile_request::Outcome,
    ) -> Result<bool, String> {
        let req = pb::ReconcileRequest {
            effect_id: effect_id.to_owned(),
            epoch,
            evidence,
            outcome: Some(outcome),
        };
        match self
            .rpc(|mut c| {
                let req = req.clone();
                async move { c.reconcile(req).await }
            })
            .await
        {
            Ok(_) => Ok(true),
            Err(s) if s.code() == Code::FailedPrecondition => Ok(false),
            Err(s) => Err(format!("Reconcile: {s}")),
        }
    }

    fn attempt_boxed<'b>(
        &'b self,
        run: &'b mut FenceRun,
        ctx: &'b StepCtx<'b>,
        call: &'b Call,
        fault: Option<Fault>,
    ) -> Boxed<'b> {
        Box::pin(self.attempt_inner(run, ctx, call, fault))
    }

    async fn attempt_inner(
        &self,
        run: &mut FenceRun,
        ctx: &StepCtx<'_>,
        call: &Call,
        mut fault: Option<Fault>,
    ) -> Attempt {
        let mut req = self.begin_request(run, ctx, call);
        for _ in 0..64 {
            req.epoch = run.epoch;
            let send = self.rpc(|mut c| {
                let req = req.clone();
                async move { c.begin(req).await }
            });
            let begun = if fault == Some(Fault::KillFence(KillPhase::DuringBegin)) {
                fault = None;
                let (begun, killed) = tokio::join!(send, self.kill_soon());
                if let Err(e) = killed {
                    return Attempt::Error(e);
                }
                begun
            } else {
                send.await
            };
            let begun = match begun {
                Ok(b) => b,
                Err(s) => return Attempt::Error(format!("Begin: {s}")),
            };
            if begun.epoch != 0 {
                run.epoch = begun.epoch;
            }
            let Some(outcome) = begun.decision.and_then(|d| d.outcome) else {
                return Attempt::Error("a Begin answer without a decision".into());
            };
            if ctx.trace {
                eprintln!(
                    "    Begin(epoch {}, branch {:?}, key {:?}, repeat {}) -> {}",
                    req.epoch,
                    req.branch,
                    req.step_key,
                    req.deliberate_repeat,
                    describe(&outcome)
                );
            }
            match outcome {
                Outcome::Execute(ex) => return self.execute(run, ctx, call, ex, fault).await,
                Outcome::Replay(r) => {
                    return self.replayed(r.receipt.unwrap_or_default(), fault).await;
                }
                Outcome::InProgress(p) => {
                    if let Err(e) = self.wait_settled(&p.receipt.unwrap_or_default()).await {
                        return Attempt::Error(e);
                    }
                }
                Outcome::Refused(r) => {
                    let reason =
                        pb::ReasonCode::try_from(r.reason).unwrap_or(pb::ReasonCode::Unspecified);
                    let receipt = r.receipt.clone().unwrap_or_default();
                    let state = pb::EffectState::try_from(receipt.state)
                        .unwrap_or(pb::EffectState::Unspecified);
                    let step = match reason {
                        pb::ReasonCode::ReconcileRequired => self.settle(run, &receipt).await,
                        pb::ReasonCode::DuplicateIntent => match state {
                            pb::EffectState::Completed | pb::EffectState::Compensated => {
                                return self.replayed(receipt, fault).await;
                            }
                            pb::EffectState::Accepted | pb::EffectState::Running => {
                                self.wait_settled(&receipt).await
                            }
                            pb::EffectState::EffectUnknown => self.settle(run, &receipt).await,
                            pb::EffectState::FailedBeforeInput => {
                                // It certainly did not happen: do it, as a deliberate repeat.
                                req.deliberate_repeat = true;
                                Ok(())
                            }
                            other => Err(format!(
                                "DUPLICATE_INTENT with a receipt in state {}",
                                other.as_str_name()
                            )),
                        },
                        pb::ReasonCode::ForkRequired
                        | pb::ReasonCode::ArgumentMismatch
                        | pb::ReasonCode::CredentialConsumed
                        | pb::ReasonCode::CredentialMismatch => {
                            let recorded = (!receipt.arguments_json.is_empty()).then(|| {
                                (
                                    receipt.tool.clone(),
                                    receipt.arguments_json.clone(),
                                    receipt.branch.clone(),
                                )
                            });
                            return Attempt::Refused {
                                reason: reason.as_str_name().to_owned(),
                                checkpoint: r.checkpoint_id,
                                recorded,
                            };
                        }
                        other => Err(format!("refused {}: {}", other.as_str_name(), r.message)),
                    };
                    if let Err(e) = step {
                        return Attempt::Error(e);
                    }
                }
            }
        }
        Attempt::Error("no decision after 64 Begins".into())
    }

    /// A recorded result came back instead of a grant: nothing is dispatched, but the agent
    /// can still crash before it uses the result, and the server can still be killed.
    async fn replayed(&self, receipt: pb::Receipt, fault: Option<Fault>) -> Attempt {
        match fault {
            Some(Fault::CrashBeforeDispatch { depth } | Fault::CrashAfterCommit { depth }) => {
                Attempt::Crashed { depth }
            }
            Some(Fault::KillFence(_)) => match self.server.kill_and_restart().await {
                Ok(()) => done(receipt),
                Err(e) => Attempt::Error(format!("{e:#}")),
            },
            _ => done(receipt),
        }
    }

    async fn execute(
        &self,
        run: &mut FenceRun,
        ctx: &StepCtx<'_>,
        call: &Call,
        ex: pb::Execute,
        fault: Option<Fault>,
    ) -> Attempt {
        {
            let mut acks = self.acks();
            acks.granted
                .insert(ex.effect_id.clone(), ex.downstream_key.clone());
            // A new effect spends the credentials it presents (a re-grant spends nothing).
            if ex.attempt == 1
                && let Some(t) = &call.token
            {
                acks.spent.insert(t.clone());
            }
        }
        let key = ex.downstream_key.as_str();
        let tool = call.tool.name;
        let epoch = run.epoch;
        let complete = |outcome| self.complete(&ex.effect_id, ex.attempt, epoch, outcome);
        let unknown = |detail: &str| {
            pb::complete_request::Outcome::Unknown(pb::Unknown {
                detail: detail.to_owned(),
            })
        };
        match fault {
            Some(Fault::CrashBeforeDispatch { depth }) => return Attempt::Crashed { depth },
            Some(Fault::KillFence(KillPhase::AfterGrant)) => {
                if let Err(e) = self.server.kill_and_restart().await {
                    return Attempt::Error(format!("{e:#}"));
                }
            }
            Some(Fault::PauseBeyondLease) => {
                // The executor stalls past its lease, then dispatches and completes anyway;
                // meanwhile a watchdog sends the same call again through Fence.
                let stalled = async {
                    tokio::time::sleep(self.lease * 3 / 2).await;
                    if let Reply::Done(response) = self.world.call(tool, &call.args_json, Some(key))
                    {
                        // Fence may refuse the stale attempt's report; the world is what counts.
                        let _ = complete(pb::complete_request::Outcome::Result(response)).await;
                    }
                };
                let (_, outcome) = tokio::join!(stalled, self.attempt_boxed(run, ctx, call, None));
                return outcome;
            }
            Some(Fault::CancelRace { committed }) => {
                if committed {
                    self.world.call(tool, &call.args_json, Some(key));
                }
                return match complete(unknown("cancelled while in flight")).await {
                    Ok(_) => Attempt::Reissue,
                    Err(s) => Attempt::Error(format!("Complete(unknown) after cancel: {s}")),
                };
            }
            _ => {}
        }
        let response = match self.world.call(tool, &call.args_json, Some(key)) {
            Reply::Done(response) => response,
            Reply::Rejected(why) => {
                let failed =
                    pb::complete_request::Outcome::FailedBeforeInput(pb::FailedBeforeInput {
                        detail: why.clone(),
                    });
                return match complete(failed).await {
                    Ok(_) => Attempt::Rejected(why),
                    // The lease lapsed before the report (the outcome reads unknown now): the
                    // downstream's rejection is the evidence that it did not happen.
                    Err(s) if reason_of(&s) == pb::ReasonCode::ReconcileRequired.as_str_name() => {
                        let outcome = pb::reconcile_request::Outcome::FailedBeforeInput(
                            pb::FailedBeforeInput {
                                detail: why.clone(),
                            },
                        );
                        let evidence = format!("the downstream rejected the call: {why}");
                        match self
                            .reconcile(&ex.effect_id, epoch, evidence, outcome)
                            .await
                        {
                            Ok(_) => Attempt::Rejected(why),
                            Err(e) => Attempt::Error(e),
                        }
                    }
                    Err(s) => Attempt::Error(format!("Complete(failed) after a rejection: {s}")),
                };
            }
        };
        match fault {
            Some(Fault::CrashAfterCommit { depth }) => Attempt::Crashed { depth },
            Some(Fault::LostResponse | Fault::ErrorAfterCommit) => {
                if call.tool.class == pb::OperationClass::Deduplicate {
                    // Idempotent downstream: retry within the grant, with the same key.
                    return match self.world.call(tool, &call.args_json, Some(key)) {
                        Reply::Done(again) => {
                            match complete(pb::complete_request::Outcome::Result(again)).await {
                                Ok(r) => done(r),
                                Err(s) => Attempt::Error(format!("Complete: {s}")),
                            }
                        }
                        Reply::Rejected(why) => Attempt::Error(format!("retry rejected: {why}")),
                    };
                }
                // Ambiguous: record it unknown, check downstream, reconcile.
                if let Err(s) = complete(unknown("no answer after sending")).await {
                    return Attempt::Error(format!("Complete(unknown): {s}"));
                }
                let receipt = pb::Receipt {
                    effect_id: ex.effect_id.clone(),
                    tool: tool.into(),
                    downstream_key: key.to_owned(),
                    ..Default::default()
                };
                if let Err(e) = self.settle(run, &receipt).await {
                    return Attempt::Error(e);
                }
                // The next Begin answers from the reconciled record (a replay).
                self.attempt_boxed(run, ctx, call, None).await
            }
            Some(Fault::KillFence(KillPhase::DuringComplete)) => {
                let (recorded, killed) = tokio::join!(
                    complete(pb::complete_request::Outcome::Result(response)),
                    self.kill_soon()
                );
                match (recorded, killed) {
                    (Ok(r), Ok(())) => done(r),
                    (Err(s), _) => Attempt::Error(format!("Complete across kill -9: {s}")),
                    (_, Err(e)) => Attempt::Error(e),
                }
            }
            _ => match complete(pb::complete_request::Outcome::Result(response)).await {
                Ok(r) => done(r),
                Err(s) => Attempt::Error(format!("Complete: {s}")),
            },
        }
    }

    /// Checks every acknowledgement against the server; returns how many are missing.
    pub(super) async fn verify_acks(&self) -> Result<u64> {
        let acks = std::mem::take(&mut *self.acks());
        let mut lost = 0;
        for (effect_id, key) in &acks.granted {
            let q = self
                .rpc(|mut c| {
                    let req = pb::QueryOutcomeRequest {
                        key: Some(pb::query_outcome_request::Key::EffectId(effect_id.clone())),
                    };
                    async move { c.query_outcome(req).await }
                })
                .await?;
            let Some(receipt) = q.receipt else {
                eprintln!("LOST: granted effect {effect_id} is not found");
                lost += 1;
                continue;
            };
            if &receipt.downstream_key != key {
                eprintln!("LOST: effect {effect_id} changed its downstream key");
                lost += 1;
            }
            if let Some(result) = acks.completed.get(effect_id) {
                let finished = [
                    pb::EffectState::Completed as i32,
                    pb::EffectState::Compensated as i32,
                ];
                if !finished.contains(&q.state) || &receipt.result != result {
                    eprintln!(
                        "LOST: completion of {effect_id} (state {}, result {:?})",
                        q.state,
                        String::from_utf8_lossy(&receipt.result)
                    );
                    lost += 1;
                }
            }
        }
        for token in &acks.spent {
            let info = self
                .rpc(|mut c| {
                    let req = pb::GetCredentialRequest {
                        token: token.clone().into_bytes(),
                    };
                    async move { c.get_credential(req).await }
                })
                .await;
            let used = match info {
                Ok(info) => info.credential.is_some_and(|c| c.uses > 0),
                Err(s) if s.code() == Code::NotFound => false,
                Err(s) => return Err(s.into()),
            };
            if !used {
                eprintln!("LOST: the use of credential {token} is not recorded");
                lost += 1;
            }
        }
        Ok(lost)
    }
}

impl Protection for FenceArm<'_> {
    type Run = FenceRun;

    fn open(&self, workflow: &Workflow) -> FenceRun {
        FenceRun {
            run_id: format!("wf-{}", workflow.id),
            epoch: 1,
            forks: 0,
        }
    }

    async fn checkpoint(&self, run: &mut FenceRun, branch: &str, name: &str) -> Result<(), String> {
        let req = pb::CheckpointRequest {
            run_id: run.run_id.clone(),
            branch: branch.to_owned(),
            epoch: run.epoch,
            checkpoint_id: name.to_owned(),
            ..Default::default()
        };
        self.rpc(|mut c| {
            let req = req.clone();
            async move { c.checkpoint(req).await }
        })
        .await
        .map(|_| ())
        .map_err(|s| format!("{} ({})", s.message(), reason_of(&s)))
    }

    async fn restore(&self, run: &mut FenceRun, name: &str) -> Result<(), String> {
        let req = pb::RestoreRequest {
            run_id: run.run_id.clone(),
            checkpoint_id: name.to_owned(),
            // Compare-and-set: a retried Restore (its answer lost to a kill) cannot apply twice.
            expected_epoch: run.epoch,
        };
        match self
            .rpc(|mut c| {
                let req = req.clone();
                async move { c.restore(req).await }
            })
            .await
        {
            Ok(r) => {
                run.epoch = r.epoch;
                Ok(())
            }
            Err(s) if reason_of(&s) == "STALE_EPOCH" => {
                // Did our own first try apply? Then the run's last restore is this one.
                let info = self
                    .rpc(|mut c| {
                        let req = pb::GetRunRequest {
                            run_id: run.run_id.clone(),
                        };
                        async move { c.get_run(req).await }
                    })
                    .await
                    .map_err(|s| format!("GetRun: {s}"))?
                    .run
                    .unwrap_or_default();
                match info.restores.last() {
                    Some(last) if last.checkpoint_id == name && info.epoch == run.epoch + 1 => {
                        run.epoch = info.epoch;
                        Ok(())
                    }
                    _ => Err(format!("restore refused: {}", s.message())),
                }
            }
            Err(s) => Err(format!("{} ({})", s.message(), reason_of(&s))),
        }
    }

    async fn fork(&self, run: &mut FenceRun, checkpoint: &str) -> Result<String, String> {
        let name = format!("f{}", run.forks + 1);
        let req = pb::ForkRequest {
            run_id: run.run_id.clone(),
            checkpoint_id: checkpoint.to_owned(),
            epoch: run.epoch,
            new_branch: name.clone(),
            reason: "the owner changed the call deliberately".into(),
        };
        let branch = self
            .rpc(|mut c| {
                let req = req.clone();
                async move { c.fork(req).await }
            })
            .await
            .map_err(|s| format!("{} ({})", s.message(), reason_of(&s)))?;
        run.forks += 1;
        Ok(branch.branch.map_or(name, |b| b.name))
    }

    async fn attempt(
        &self,
        run: &mut FenceRun,
        ctx: &StepCtx<'_>,
        call: &Call,
        fault: Option<Fault>,
    ) -> Attempt {
        self.attempt_boxed(run, ctx, call, fault).await
    }
}
