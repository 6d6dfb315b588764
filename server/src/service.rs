//! The gRPC service: thin handlers that authenticate, convert, run the ledger off the tokio
//! workers (RocksDB calls never block them) and convert back. The decisions that write on the
//! hot path (Begin, Complete, Heartbeat and their batches) go to the run's sequencer, which
//! commits them in groups ([`crate::sequencer`]); what needs no run state (validation,
//! parsing, hashing, converting the answer) stays on the caller's side, off that one thread.
//! The rest run on the blocking pool.

use std::sync::Arc;

use fence_proto::v1 as pb;
use tonic::{Request, Response, Status};

use crate::auth::tenant_of;
use crate::convert;
use crate::ledger::batch::CompleteCmd;
use crate::ledger::begin::{Begun, PreparedBegin};
use crate::ledger::records::EffectRecord;
use crate::ledger::{BeginCmd, Ledger, LedgerError};
use crate::quota::TenantRateLimit;
use crate::sequencer::{Sequencer, route_of};
use crate::session::{SessionStream, Sessions};
use crate::store::Store;
use tokio::sync::watch;

/// The `fence.v1.Fence` service over a ledger.
pub struct FenceService<S> {
    ledger: Arc<Ledger<S>>,
    sequencer: Arc<Sequencer<S>>,
    sessions: Sessions<S>,
}

impl<S: Store> FenceService<S> {
    /// A service over `ledger`, with one sequencer per two cores.
    pub fn new(ledger: Arc<Ledger<S>>) -> Self {
        Self::with_sequencers(ledger, 0)
    }

    /// A service over `ledger` with `threads` sequencers (0 = one per two cores, at least one).
    pub fn with_sequencers(ledger: Arc<Ledger<S>>, threads: usize) -> Self {
        let threads = match threads {
            // Half the cores: the other half serve the RPCs. On two cores one sequencer makes
            // bigger groups (fewer syncs and wake-ups) and costs a quarter less CPU per effect
            // than two (docs/BENCHMARKS.md).
            0 => std::thread::available_parallelism().map_or(1, |n| (n.get() / 2).max(1)),
            n => n,
        };
        let sequencer = Arc::new(Sequencer::start(ledger.clone(), threads));
        // No server to signal a shutdown yet: streams end when their callers close them.
        let (_, stopping) = watch::channel(false);
        Self {
            sessions: Sessions {
                ledger: ledger.clone(),
                sequencer: sequencer.clone(),
                rate_limit: None,
                max_in_flight: crate::session::DEFAULT_MAX_IN_FLIGHT,
                stopping,
            },
            sequencer,
            ledger,
        }
    }

    /// Whether a lone request may be decided on the thread that received it (see
    /// [`Sequencer::set_inline_callers`]; off until this is called). When on, as many
    /// callers as the current tokio runtime has workers, less one, may do so at once: none
    /// on a one-worker runtime (or outside one), where a blocked worker would leave every
    /// other request unread.
    pub fn with_inline_commit(self, on: bool) -> Self {
        let workers = tokio::runtime::Handle::try_current()
            .map(|rt| rt.metrics().num_workers())
            .unwrap_or(1);
        self.sequencer
            .set_inline_callers(if on { workers.saturating_sub(1) } else { 0 });
        self
    }

    /// The tenant rate limit a Session stream takes per call (unary calls take theirs in the
    /// server's interceptor).
    pub fn with_rate_limit(mut self, limit: Option<Arc<TenantRateLimit>>) -> Self {
        self.sessions.rate_limit = limit;
        self
    }

    /// At most `calls` of one Session stream decided at once (0 = the default, 256).
    pub fn with_max_session_in_flight(mut self, calls: usize) -> Self {
        self.sessions.max_in_flight = match calls {
            0 => crate::session::DEFAULT_MAX_IN_FLIGHT,
            n => n,
        };
        self
    }

    /// Session streams stop reading and end with UNAVAILABLE once `stopping` turns `true`
    /// (the server's graceful shutdown, which would otherwise wait on every open stream).
    pub fn with_shutdown(mut self, stopping: watch::Receiver<bool>) -> Self {
        self.sessions.stopping = stopping;
        self
    }

    /// Prepares the request on this thread (`prepare`: what needs no run state, and the
    /// route), then runs `f` on the sequencer of that route, with the caller's tenant:
    /// answered once the group it was decided in is durable.
    async fn sequenced<T, I, Q, P, F>(
        &self,
        method: &'static str,
        req: Request<Q>,
        prepare: impl FnOnce(&Ledger<S>, &str, Q) -> Result<(u64, P), LedgerError>,
        f: F,
        answer: impl FnOnce(I) -> T,
    ) -> Result<Response<T>, Status>
    where
        I: Send + 'static,
        P: Send + 'static,
        F: FnOnce(&Ledger<S>, &str, P) -> Result<I, LedgerError> + Send + 'static,
    {
        let started = std::time::Instant::now();
        let tenant = tenant_of(&req)?;
        let (route, body) = match prepare(&self.ledger, &tenant, req.into_inner()) {
            Ok(prepared) => prepared,
            Err(e) => return finished(method, started, Err(e.into())),
        };
        // The request's span (its trace, see crate::trace) follows it onto the sequencer.
        let span = tracing::Span::current();
        let out = self
            .sequencer
            .submit(route, move |ledger| {
                span.in_scope(|| f(ledger, &tenant, body))
            })
            .await
            // Converted here, not on the sequencer every call of the run waits on.
            .map(answer);
        finished(method, started, out)
    }

    /// Runs `f` against the ledger on the blocking pool, with the caller's tenant.
    async fn run<T, Q, F>(
        &self,
        method: &'static str,
        req: Request<Q>,
        f: F,
    ) -> Result<Response<T>, Status>
    where
        T: Send + 'static,
        Q: Send + 'static,
        F: FnOnce(&Ledger<S>, &str, Q) -> Result<T, LedgerError> + Send + 'static,
    {
        let started = std::time::Instant::now();
        let tenant = tenant_of(&req)?;
        let body = req.into_inner();
        let ledger = self.ledger.clone();
        // The request's span (its trace, see crate::trace) follows it onto the blocking pool.
        let span = tracing::Span::current();
        let out = tokio::task::spawn_blocking(move || span.in_scope(|| f(&ledger, &tenant, body)))
            .await
            .map_err(|e| {
                tracing::error!(error = %e, "ledger task failed");
                Status::internal("the request could not be processed")
            })
            .and_then(|r| r.map_err(Status::from));
        finished(method, started, out)
    }
}

/// Records a finished RPC's metrics and wraps its answer.
fn finished<T>(
    method: &'static str,
    started: std::time::Instant,
    out: Result<T, Status>,
) -> Result<Response<T>, Status> {
    let code = out.as_ref().map_or_else(Status::code, |_| tonic::Code::Ok);
    crate::metrics::rpc(method, started, code);
    crate::trace::record_status(code);
    out.map(Response::new)
}

/// The route of an effect's run (its id holds the run key); 0 for an id that does not parse,
/// which the ledger then refuses.
pub(crate) fn effect_route(effect_id: &str) -> u64 {
    effect_id
        .parse::<crate::ledger::EffectId>()
        .map_or(0, |id| crate::sequencer::route_of_key(&id.run_key))
}

/// One call's error inside a batch: the status it would have failed with alone.
fn call_error(e: LedgerError) -> pb::CallError {
    call_error_of(&Status::from(e))
}

/// A status as a call's error (a batch's or a Session stream's).
pub(crate) fn call_error_of(status: &Status) -> pb::CallError {
    pb::CallError {
        code: status.code() as i32,
        message: status.message().to_owned(),
        details: status.details().to_vec(),
    }
}

/// Begin's preparation, shared by the RPC and Session calls: converted, validated and
/// hashed on the caller's thread ([`Ledger::prepare_begin`]), routed by its run.
pub(crate) fn begin_prepare<S: Store>(
    l: &Ledger<S>,
    t: &str,
    r: pb::BeginRequest,
) -> Result<(u64, PreparedBegin), LedgerError> {
    let prepared = l.prepare_begin(t, BeginCmd::try_from(r)?)?;
    Ok((prepared.route(), prepared))
}

/// A request about one recorded effect: routed by the run its id names.
pub(crate) trait EffectRequest {
    fn effect_id(&self) -> &str;
}

impl EffectRequest for pb::CompleteRequest {
    fn effect_id(&self) -> &str {
        &self.effect_id
    }
}

impl EffectRequest for pb::HeartbeatRequest {
    fn effect_id(&self) -> &str {
        &self.effect_id
    }
}

/// Complete's and Heartbeat's route, shared by the RPC and Session calls (nothing to
/// prepare).
pub(crate) fn effect_prepare<S: Store, R: EffectRequest>(
    _: &Ledger<S>,
    _: &str,
    r: R,
) -> Result<(u64, R), LedgerError> {
    Ok((effect_route(r.effect_id()), r))
}

/// Begin's decision, shared by the RPC and Session calls (converted to its answer by the
/// caller: [`convert::begin_response`]).
pub(crate) fn begin_call<S: Store>(
    l: &Ledger<S>,
    t: &str,
    prepared: PreparedBegin,
) -> Result<Begun, LedgerError> {
    let begun = l.begin_prepared(t, &prepared)?;
    let cmd = prepared.cmd();
    crate::metrics::decision(&begun.decision);
    crate::trace::record_begin(cmd, &begun.decision);
    tracing::debug!(tenant = t, run = %cmd.run_id, tool = %cmd.tool, decision = %begun.decision.kind(), "begin");
    Ok(begun)
}

/// Complete's transition, shared by the RPC and Session calls (answered by
/// [`complete_answer`]).
pub(crate) fn complete_call<S: Store>(
    l: &Ledger<S>,
    t: &str,
    r: pb::CompleteRequest,
) -> Result<EffectRecord, LedgerError> {
    let outcome = convert::outcome(r.outcome)?;
    let rec = l.complete(t, &r.effect_id, r.attempt, r.epoch, outcome)?;
    tracing::debug!(tenant = t, effect = %r.effect_id, state = rec.state, "complete");
    Ok(rec)
}

/// Complete's answer.
pub(crate) fn complete_answer(rec: EffectRecord) -> pb::CompleteResponse {
    pb::CompleteResponse {
        receipt: Some(convert::receipt(rec, true)),
    }
}

/// Heartbeat's lease extension, shared by the RPC and Session calls (answered by
/// [`heartbeat_answer`]).
pub(crate) fn heartbeat_call<S: Store>(
    l: &Ledger<S>,
    t: &str,
    r: pb::HeartbeatRequest,
) -> Result<EffectRecord, LedgerError> {
    l.heartbeat(t, &r.effect_id, r.attempt, r.epoch, r.extend_ms)
}

/// Heartbeat's answer.
pub(crate) fn heartbeat_answer(rec: EffectRecord) -> pb::HeartbeatResponse {
    pb::HeartbeatResponse {
        receipt: Some(convert::receipt(rec, true)),
    }
}

/// A batch's answers in its calls' order: the calls that converted run together (moved, in
/// order), and a call that did not convert keeps its conversion error in its place.
fn in_order<C, A>(
    converted: Vec<Result<C, LedgerError>>,
    run: impl FnOnce(&[C]) -> Result<Vec<Result<A, LedgerError>>, LedgerError>,
) -> Result<Vec<Result<A, LedgerError>>, LedgerError> {
    let mut cmds = Vec::with_capacity(converted.len());
    let mut failed = Vec::with_capacity(converted.len());
    for c in converted {
        match c {
            Ok(cmd) => {
                cmds.push(cmd);
                failed.push(None);
            }
            Err(e) => failed.push(Some(e)),
        }
    }
    let mut answers = if cmds.is_empty() {
        Vec::new()
    } else {
        run(&cmds)?
    }
    .into_iter();
    Ok(failed
        .into_iter()
        .map(|f| match f {
            Some(e) => Err(e),
            None => answers.next().expect("one answer per call"),
        })
        .collect())
}

#[tonic::async_trait]
impl<S: Store> pb::fence_server::Fence for FenceService<S> {
    async fn register_tool(
        &self,
        req: Request<pb::RegisterToolRequest>,
    ) -> Result<Response<pb::RegisterToolResponse>, Status> {
        self.run("RegisterTool", req, |l, t, r| {
            let (tool, created) = l.register_tool(t, convert::tool_def(r)?)?;
            tracing::info!(tenant = t, tool = %tool.name, version = tool.version, created, "tool registered");
            Ok(pb::RegisterToolResponse {
                tool: Some(convert::tool_spec(&tool)),
                created,
            })
        })
        .await
    }

    async fn get_tool(
        &self,
        req: Request<pb::GetToolRequest>,
    ) -> Result<Response<pb::GetToolResponse>, Status> {
        self.run("GetTool", req, |l, t, r| {
            crate::ledger::check_id("name", &r.name, l.config().limits.max_id_bytes)?;
            let tool = l.registered_tool(t, &r.name, r.version)?;
            Ok(pb::GetToolResponse {
                tool: Some(convert::tool_spec(&tool)),
            })
        })
        .await
    }

    async fn list_tools(
        &self,
        req: Request<pb::ListToolsRequest>,
    ) -> Result<Response<pb::ListToolsResponse>, Status> {
        self.run("ListTools", req, |l, t, r| {
            let (tools, next_page_token) = l.list_tools(t, r.page_size, &r.page_token)?;
            Ok(pb::ListToolsResponse {
                tools: tools.iter().map(convert::tool_spec).collect(),
                next_page_token,
            })
        })
        .await
    }

    async fn start_run(
        &self,
        req: Request<pb::StartRunRequest>,
    ) -> Result<Response<pb::StartRunResponse>, Status> {
        self.run("StartRun", req, |l, t, r| {
            let (view, created) = l.start_run(t, &r.run_id)?;
            Ok(pb::StartRunResponse {
                run: Some(convert::run_info(&view)),
                created,
            })
        })
        .await
    }

    async fn get_run(
        &self,
        req: Request<pb::GetRunRequest>,
    ) -> Result<Response<pb::GetRunResponse>, Status> {
        self.run("GetRun", req, |l, t, r| {
            let view = l.get_run(t, &r.run_id)?;
            Ok(pb::GetRunResponse {
                run: Some(convert::run_info(&view)),
            })
        })
        .await
    }

    async fn list_runs(
        &self,
        req: Request<pb::ListRunsRequest>,
    ) -> Result<Response<pb::ListRunsResponse>, Status> {
        self.run("ListRuns", req, |l, t, r| {
            let (runs, next_page_token) =
                l.list_runs(t, &r.run_id_prefix, r.page_size, &r.page_token)?;
            Ok(pb::ListRunsResponse {
                runs: runs.iter().map(convert::run_info).collect(),
                next_page_token,
            })
        })
        .await
    }

    async fn checkpoint(
        &self,
        req: Request<pb::CheckpointRequest>,
    ) -> Result<Response<pb::CheckpointResponse>, Status> {
        self.run("Checkpoint", req, |l, t, r| {
            let (cp, created) = l.checkpoint(t, &convert::checkpoint_cmd(r))?;
            Ok(pb::CheckpointResponse {
                checkpoint: Some(convert::checkpoint_info(&cp)),
                created,
            })
        })
        .await
    }

    async fn restore(
        &self,
        req: Request<pb::RestoreRequest>,
    ) -> Result<Response<pb::RestoreResponse>, Status> {
        self.run("Restore", req, |l, t, r| {
            let restored = l.restore(t, &r.run_id, &r.checkpoint_id, r.expected_epoch)?;
            tracing::info!(tenant = t, run = %r.run_id, checkpoint = %r.checkpoint_id,
                epoch = restored.epoch, tape = restored.tape.len(), "run restored");
            Ok(convert::restore_response(&restored))
        })
        .await
    }

    async fn fork(
        &self,
        req: Request<pb::ForkRequest>,
    ) -> Result<Response<pb::ForkResponse>, Status> {
        self.run("Fork", req, |l, t, r| {
            let cmd = convert::fork_cmd(r);
            let forked = l.fork(t, &cmd)?;
            let view = l.get_run(t, &cmd.run_id)?;
            tracing::info!(tenant = t, run = %cmd.run_id, branch = %forked.branch.name,
                carried = forked.carried.len(), "branch forked");
            Ok(pb::ForkResponse {
                branch: Some(convert::branch_info(&view.run, &forked.branch)),
                carried: forked
                    .carried
                    .iter()
                    .map(|r| convert::receipt(r.clone(), true))
                    .collect(),
            })
        })
        .await
    }

    async fn begin(
        &self,
        req: Request<pb::BeginRequest>,
    ) -> Result<Response<pb::BeginResponse>, Status> {
        let answer = convert::begin_response;
        self.sequenced("Begin", req, begin_prepare, begin_call, answer)
            .await
    }

    async fn begin_batch(
        &self,
        req: Request<pb::BeginBatchRequest>,
    ) -> Result<Response<pb::BeginBatchResponse>, Status> {
        // Converted and prepared here, each call in its place; decided on the sequencer of
        // the first call's run (a batch is one agent's parallel calls: one run).
        let prepare = |l: &Ledger<S>, t: &str, r: pb::BeginBatchRequest| {
            l.check_batch("calls", r.calls.len())?;
            let route = r.calls.first().map_or(0, |c| route_of(t, &c.run_id));
            let calls: Vec<_> = r
                .calls
                .into_iter()
                .map(|c| l.prepare_begin(t, BeginCmd::try_from(c)?))
                .collect();
            Ok((route, calls))
        };
        let decide = |l: &Ledger<S>, t: &str, calls| {
            let answers = l.begin_many_prepared(t, calls)?;
            tracing::debug!(tenant = t, calls = answers.len(), "begin batch");
            Ok(answers)
        };
        let answer = |answers: Vec<Result<Begun, LedgerError>>| pb::BeginBatchResponse {
            results: answers
                .into_iter()
                .map(|answer| pb::BeginResult {
                    result: Some(match answer {
                        Ok(begun) => {
                            pb::begin_result::Result::Response(convert::begin_response(begun))
                        }
                        Err(e) => pb::begin_result::Result::Error(call_error(e)),
                    }),
                })
                .collect(),
        };
        self.sequenced("BeginBatch", req, prepare, decide, answer)
            .await
    }

    async fn complete_batch(
        &self,
        req: Request<pb::CompleteBatchRequest>,
    ) -> Result<Response<pb::CompleteBatchResponse>, Status> {
        // Converted here, each completion in its place; recorded on the sequencer of the
        // first one's run.
        let prepare = |l: &Ledger<S>, _: &str, r: pb::CompleteBatchRequest| {
            l.check_batch("completions", r.completions.len())?;
            let route = r
                .completions
                .first()
                .map_or(0, |c| effect_route(&c.effect_id));
            let completions: Vec<_> = r
                .completions
                .into_iter()
                .map(|c| {
                    Ok(CompleteCmd {
                        outcome: convert::outcome(c.outcome)?,
                        effect_id: c.effect_id,
                        attempt: c.attempt,
                        epoch: c.epoch,
                    })
                })
                .collect();
            Ok((route, completions))
        };
        let decide = |l: &Ledger<S>, t: &str, completions| {
            in_order(completions, |cmds| l.complete_many(t, cmds))
        };
        let answer = |answers: Vec<Result<EffectRecord, LedgerError>>| pb::CompleteBatchResponse {
            results: answers
                .into_iter()
                .map(|answer| pb::CompleteResult {
                    result: Some(match answer {
                        Ok(rec) => pb::complete_result::Result::Response(complete_answer(rec)),
                        Err(e) => pb::complete_result::Result::Error(call_error(e)),
                    }),
                })
                .collect(),
        };
        self.sequenced("CompleteBatch", req, prepare, decide, answer)
            .await
    }

    async fn heartbeat(
        &self,
        req: Request<pb::HeartbeatRequest>,
    ) -> Result<Response<pb::HeartbeatResponse>, Status> {
        let (p, f) = (effect_prepare, heartbeat_call);
        self.sequenced("Heartbeat", req, p, f, heartbeat_answer)
            .await
    }

    async fn complete(
        &self,
        req: Request<pb::CompleteRequest>,
    ) -> Result<Response<pb::CompleteResponse>, Status> {
        let (p, f) = (effect_prepare, complete_call);
        self.sequenced("Complete", req, p, f, complete_answer).await
    }

    type SessionStream = SessionStream;

    async fn session(
        &self,
        req: Request<tonic::Streaming<pb::SessionRequest>>,
    ) -> Result<Response<SessionStream>, Status> {
        let tenant = tenant_of(&req)?;
        Ok(Response::new(self.sessions.open(tenant, req.into_inner())))
    }

    async fn reconcile(
        &self,
        req: Request<pb::ReconcileRequest>,
    ) -> Result<Response<pb::ReconcileResponse>, Status> {
        self.run("Reconcile", req, |l, t, r| {
            let finding = convert::finding(r.outcome)?;
            let rec = l.reconcile(t, &r.effect_id, r.epoch, &r.evidence, finding)?;
            tracing::info!(tenant = t, effect = %r.effect_id, state = rec.state, "effect reconciled");
            Ok(pb::ReconcileResponse {
                receipt: Some(convert::receipt(rec, true)),
            })
        })
        .await
    }

    async fn query_outcome(
        &self,
        req: Request<pb::QueryOutcomeRequest>,
    ) -> Result<Response<pb::QueryOutcomeResponse>, Status> {
        self.run("QueryOutcome", req, |l, t, r| {
            let key = convert::outcome_key(r.key)?;
            Ok(match l.query_outcome(t, &key)? {
                Some(rec) => pb::QueryOutcomeResponse {
                    state: rec.state,
                    receipt: Some(convert::receipt(rec, true)),
                },
                None => pb::QueryOutcomeResponse {
                    state: pb::EffectState::NotFound as i32,
                    receipt: None,
                },
            })
        })
        .await
    }

    async fn list_effects(
        &self,
        req: Request<pb::ListEffectsRequest>,
    ) -> Result<Response<pb::ListEffectsResponse>, Status> {
        self.run("ListEffects", req, |l, t, r| {
            let (effects, next_page_token) = l.list_effects(t, &convert::list_query(r))?;
            Ok(convert::effects_page(effects, next_page_token))
        })
        .await
    }

    async fn list_unsettled_effects(
        &self,
        req: Request<pb::ListUnsettledEffectsRequest>,
    ) -> Result<Response<pb::ListEffectsResponse>, Status> {
        self.run("ListUnsettledEffects", req, |l, t, r| {
            let state = match r.state {
                0 => None,
                code => Some(crate::ledger::State::from_code(code).ok_or_else(|| {
                    LedgerError::invalid("state", format!("{code} is not an effect state"))
                })?),
            };
            let (effects, next_page_token) =
                l.list_unsettled(t, state, r.page_size, &r.page_token)?;
            Ok(convert::effects_page(effects, next_page_token))
        })
        .await
    }

    async fn register_credential(
        &self,
        req: Request<pb::RegisterCredentialRequest>,
    ) -> Result<Response<pb::RegisterCredentialResponse>, Status> {
        self.run("RegisterCredential", req, |l, t, r| {
            let (cred, created) = l.register_credential(t, &convert::credential_def(r))?;
            Ok(pb::RegisterCredentialResponse {
                credential: Some(convert::credential_info(&cred)),
                created,
            })
        })
        .await
    }

    async fn get_credential(
        &self,
        req: Request<pb::GetCredentialRequest>,
    ) -> Result<Response<pb::GetCredentialResponse>, Status> {
        self.run("GetCredential", req, |l, t, r| {
            let cred = l.get_credential(t, &r.token)?;
            Ok(pb::GetCredentialResponse {
                credential: Some(convert::credential_info(&cred)),
            })
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The inline callers a service allows, built with `on` inside a runtime of `workers`.
    fn inline_callers(workers: usize, on: bool) -> usize {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers)
            .build()
            .unwrap();
        rt.block_on(async {
            let ledger = Arc::new(crate::ledger::test_support::pay_ledger());
            let service = FenceService::with_sequencers(ledger, 1).with_inline_commit(on);
            service.sequencer.inline_callers()
        })
    }

    #[test]
    fn inline_commits_leave_one_runtime_worker_free() {
        // One worker: a caller blocked in a sync would leave every other request unread.
        assert_eq!(inline_callers(1, true), 0);
        assert_eq!(inline_callers(2, true), 1);
        assert_eq!(inline_callers(4, true), 3);
        assert_eq!(inline_callers(4, false), 0);
    }
}
