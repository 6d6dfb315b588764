//! The simulated agent: runs a workflow step by step under a framework that checkpoints
//! before every step and restores after a crash, with a model that writes (and rewrites) each
//! call. Everything protection-specific sits behind [`Protection`], so the three arms run the
//! very same agent.

use std::collections::{HashMap, VecDeque};
use std::future::Future;

use futures::StreamExt;

use super::{Config, Tally};
use crate::rng::Rng;
use crate::scenario::{
    Call, Drift, Fault, ModelParams, SLOTS, SagaRole, Step, Workflow, slot_faults, write_call,
};
use crate::world::{Response, World, fnv};

/// What one step produced, as the agent remembers it.
#[derive(Debug, Clone)]
pub(super) struct StepResult {
    /// The response bytes.
    pub response: Vec<u8>,
    /// Fence's effect id ("" for other arms).
    pub effect_id: String,
}

/// The agent's memory: what a framework checkpoint holds.
#[derive(Debug, Clone)]
pub(super) struct AgentState {
    /// The next plan position.
    pub pos: usize,
    /// The current plan generation.
    pub generation: u32,
    /// The plan.
    pub plan: Vec<Step>,
    /// Results by plan position.
    pub results: Vec<Option<StepResult>>,
    /// The Fence branch the agent is on.
    pub branch: String,
}

/// How an attempt at a call ended, as the agent sees it.
#[derive(Debug)]
pub(super) enum Attempt {
    /// The agent got a response.
    Done(StepResult),
    /// The world refused the call and nothing happened.
    Rejected(String),
    /// The agent crashed; the framework restores it this many checkpoints back.
    Crashed {
        /// Checkpoints back.
        depth: u8,
    },
    /// The call failed in a way the model sees; it writes the call again.
    Reissue,
    /// Fence refused the call (an intent change): reason name and checkpoint to fork from.
    Refused {
        /// The reason code's name.
        reason: String,
        /// For FORK_REQUIRED, the checkpoint to fork from.
        checkpoint: String,
        /// The recorded call the refusal refers to: tool, arguments and branch, if Fence sent
        /// them.
        recorded: Option<(String, String, String)>,
    },
    /// Something unexpected: a finding.
    Error(String),
}

/// What the attempt is about.
pub(super) struct StepCtx<'a> {
    /// The workflow.
    pub workflow: &'a Workflow,
    /// The step.
    pub step: &'a Step,
    /// The branch the agent is on.
    pub branch: &'a str,
    /// For a compensation: the effect id of the step it undoes.
    pub compensates: Option<String>,
    /// Print what happens (debugging).
    pub trace: bool,
}

impl StepCtx<'_> {
    /// The durable step key a framework would give this step (when it gives keys).
    pub fn step_key(&self) -> String {
        format!("s{}-g{}", self.step.slot, self.step.generation)
    }
}

/// A protection: how calls reach the world in one arm.
pub(super) trait Protection {
    /// Per-workflow state.
    type Run;
    /// Starts a workflow.
    fn open(&self, workflow: &Workflow) -> Self::Run;
    /// The framework checkpoints before a step.
    fn checkpoint(
        &self,
        run: &mut Self::Run,
        branch: &str,
        name: &str,
    ) -> impl Future<Output = Result<(), String>>;
    /// The framework restores a checkpoint after a crash.
    fn restore(&self, run: &mut Self::Run, name: &str) -> impl Future<Output = Result<(), String>>;
    /// The agent forks from a checkpoint to make a deliberate change; returns the new branch.
    fn fork(
        &self,
        run: &mut Self::Run,
        checkpoint: &str,
    ) -> impl Future<Output = Result<String, String>>;
    /// One attempt at a call, with the fault scheduled for it.
    fn attempt(
        &self,
        run: &mut Self::Run,
        ctx: &StepCtx<'_>,
        call: &Call,
        fault: Option<Fault>,
    ) -> impl Future<Output = Attempt>;
}

/// Runs every workflow with `cfg.agents` agents at a time.
pub(super) async fn run_all<P: Protection>(
    cfg: &Config,
    flows: &[Workflow],
    protection: &P,
    world: &World,
    tally: &Tally,
) {
    let _ = world;
    futures::stream::iter(flows)
        .map(|w| run_workflow(cfg, w, protection, tally))
        .buffer_unordered(cfg.agents.max(1))
        .for_each(|()| async {})
        .await;
}

const MAX_ATTEMPTS_PER_WORKFLOW: u32 = 400;

async fn run_workflow<P: Protection>(cfg: &Config, wf: &Workflow, p: &P, tally: &Tally) {
    let seed = cfg.seed;
    let mut faults: Vec<VecDeque<Fault>> = (0..SLOTS)
        .map(|s| slot_faults(seed, wf.id, s, &cfg.fault_params).into())
        .collect();
    let mut writes = [0u64; SLOTS];
    let mut reverts = [0u64; SLOTS];
    let mut prior_uuid: Vec<Option<String>> = vec![None; SLOTS];
    let mut last_uuid: HashMap<&'static str, String> = HashMap::new();
    let plan = wf.plan(seed, 0);
    let mut st = AgentState {
        pos: 0,
        generation: 0,
        results: vec![None; plan.len()],
        plan,
        branch: "main".into(),
    };
    let mut history: Vec<(String, AgentState)> = Vec::new();
    let mut run = p.open(wf);
    // Plan generations are never reused, even after a restore rewinds a change.
    let mut next_generation = 1;
    let mut budget = MAX_ATTEMPTS_PER_WORKFLOW;
    let fail = |what: String| tally.error(format!("seed {seed} workflow {}: {what}", wf.id));
    let tracing = cfg.trace == Some(wf.id);
    let trace = |what: String| {
        if tracing {
            eprintln!("[wf {}] {what}", wf.id);
        }
    };
    trace(format!(
        "start: {:?}, step keys {}",
        wf.template, wf.step_keys
    ));

    while st.pos < st.plan.len() {
        if budget == 0 {
            fail(format!(
                "no progress after {MAX_ATTEMPTS_PER_WORKFLOW} attempts"
            ));
            Tally::bump(&tally.abandoned);
            return;
        }
        budget -= 1;
        let pos = st.pos;
        let step = st.plan[pos].clone();
        let cp = format!(
            "cp-{}-{}-s{}-g{}",
            st.branch, pos, step.slot, step.generation
        );
        if let Err(e) = p.checkpoint(&mut run, &st.branch, &cp).await {
            fail(format!("checkpoint {cp}: {e}"));
            Tally::bump(&tally.abandoned);
            return;
        }
        history.push((cp.clone(), st.clone()));
        trace(format!("checkpoint {cp}"));

        // The model writes the call (again, if it wrote it before).
        let token = step
            .credential_from
            .and_then(|from| st.results[from].as_ref())
            .and_then(|r| Response::decode(&r.response))
            .and_then(|r| r.token);
        let slot = step.slot;
        let mut r = Rng::derive(seed, &[wf.id, 4, slot as u64, writes[slot]]);
        writes[slot] += 1;
        let (mut call, mut drift) = write_call(
            &step,
            token.as_deref(),
            prior_uuid[slot].as_deref(),
            last_uuid.get(step.tool.name).map(String::as_str),
            &cfg.model,
            &mut r,
        );
        prior_uuid[slot] = Some(call.uuid.clone());
        last_uuid.insert(step.tool.name, call.uuid.clone());
        let mut step = step;
        if drift.deliberate {
            // The owner wants the change: a new plan from here on (new effects).
            let mut plan = st.plan[..pos].to_vec();
            st.generation = next_generation;
            next_generation += 1;
            let mut changed = step.clone();
            changed.intent = call.intent.clone();
            changed.generation = st.generation;
            plan.push(changed.clone());
            plan.extend(wf.plan(seed, st.generation).into_iter().skip(pos + 1));
            st.results.resize(plan.len(), None);
            st.plan = plan;
            step = changed;
        }

        // What the agent means to do: the planned intent (a deliberate change is in the plan).
        tally.plan(crate::world::intent_tag(
            step.tool,
            &serde_json::Value::Object(step.intent.clone()),
        ));
        let mut fault = faults[slot].pop_front();
        if let Some(f) = &fault {
            tally.fault(f.name());
        }
        trace(format!(
            "step {pos} slot {slot} {}: drift {drift:?}, fault {fault:?}: {}",
            step.tool.name,
            call.args_json.replace('\n', "")
        ));
        let compensates = match &step.saga {
            Some(SagaRole::Compensates(fwd)) => {
                st.results[*fwd].as_ref().map(|r| r.effect_id.clone())
            }
            _ => None,
        };
        loop {
            budget = budget.saturating_sub(1);
            if budget == 0 {
                fail(format!("no progress on step {pos} (slot {slot})"));
                Tally::bump(&tally.abandoned);
                return;
            }
            let ctx = StepCtx {
                workflow: wf,
                step: &step,
                branch: &st.branch,
                compensates: compensates.clone(),
                trace: tracing,
            };
            let outcome = p.attempt(&mut run, &ctx, &call, fault.take()).await;
            trace(format!("  -> {outcome:?}"));
            match outcome {
                Attempt::Done(result) => {
                    match Response::decode(&result.response) {
                        Some(resp) if resp.intent != fnv(&call.tag()) => {
                            Tally::bump(&tally.false_replays)
                        }
                        Some(_) => {}
                        None => fail(format!(
                            "step {pos}: undecodable response {:?}",
                            String::from_utf8_lossy(&result.response)
                        )),
                    }
                    // The agent now believes its planned intent happened (a deliberate change
                    // is in the plan): the world must show it.
                    tally.intend(crate::world::intent_tag(
                        step.tool,
                        &serde_json::Value::Object(step.intent.clone()),
                    ));
                    st.results[pos] = Some(result);
                    st.pos += 1;
                    break;
                }
                Attempt::Rejected(why) => {
                    if step.tool.name == "travel.book_car" {
                        // The saga undoes the bookings made so far, in reverse order.
                        st.plan = wf.compensation_plan(&st.plan, pos, st.generation);
                        st.results.resize(st.plan.len(), None);
                    } else {
                        fail(format!("step {pos} ({}) rejected: {why}", step.tool.name));
                        Tally::bump(&tally.abandoned);
                        return;
                    }
                    break;
                }
                Attempt::Crashed { depth } => {
                    Tally::bump(&tally.restores);
                    let idx = history.len().saturating_sub(1 + usize::from(depth));
                    let (name, snapshot) = history[idx].clone();
                    if let Err(e) = p.restore(&mut run, &name).await {
                        fail(format!("restore {name}: {e}"));
                        Tally::bump(&tally.abandoned);
                        return;
                    }
                    history.truncate(idx);
                    st = snapshot;
                    break;
                }
                Attempt::Reissue => break,
                Attempt::Refused {
                    reason,
                    checkpoint,
                    recorded,
                } => {
                    // A refusal is false when the recorded call it refers to is the same intent
                    // on the agent's own branch.
                    let recorded_tag = recorded.as_ref().and_then(|(tool, args, _)| {
                        let spec = crate::scenario::tool_by_name(tool)?;
                        let v: serde_json::Value = serde_json::from_str(args).ok()?;
                        Some(crate::world::intent_tag(spec, &v))
                    });
                    let same_intent = recorded_tag.map_or(!drift.intent, |t| t == call.tag());
                    let elsewhere = recorded.as_ref().is_some_and(|(_, _, b)| *b != st.branch);
                    if same_intent && !elsewhere {
                        Tally::bump(&tally.false_forks);
                        fail(format!(
                            "step {pos} ({}): the same intent was refused {reason}: {}",
                            step.tool.name,
                            call.args_json.replace('\n', "")
                        ));
                        Tally::bump(&tally.abandoned);
                        return;
                    }
                    let spent = matches!(
                        reason.as_str(),
                        "CREDENTIAL_CONSUMED" | "CREDENTIAL_MISMATCH"
                    );
                    if same_intent || spent {
                        // The approval is spent: by this very call on another branch (a restore
                        // took the agent back across a fork), or by an accidental rewrite that
                        // executed. Authority does not come back on a fork, so the agent follows
                        // the refusal's recovery (REAUTHENTICATE) and stops to ask for a new
                        // approval instead of forking again and again.
                        let where_ = if same_intent {
                            " on another branch"
                        } else {
                            ""
                        };
                        trace(format!("  needs a new approval: {reason}{where_}"));
                        Tally::bump(&tally.abandoned);
                        return;
                    }
                    Tally::bump(&tally.refused_changes);
                    if drift.deliberate || !drift.intent {
                        // The agent means this call (a deliberate change, or its plan, which
                        // differs from what was recorded here before a restore): fork where
                        // the agent is (the checkpoint before this step), so the new branch
                        // keeps every effect the agent already counts as done; Fence's
                        // suggestion (the restored checkpoint) can be further back.
                        let _ = checkpoint;
                        let from = cp.clone();
                        match p.fork(&mut run, &from).await {
                            Ok(branch) => {
                                Tally::bump(&tally.forks);
                                st.branch = branch;
                            }
                            Err(e) => {
                                fail(format!("fork from {from}: {e}"));
                                Tally::bump(&tally.abandoned);
                                return;
                            }
                        }
                        continue;
                    }
                    // An accidental change was refused; the model goes back to the plan.
                    let mut r = Rng::derive(seed, &[wf.id, 5, slot as u64, reverts[slot]]);
                    reverts[slot] += 1;
                    let faithful = ModelParams {
                        intent_drift: 0.0,
                        uuid_reuse: 0.0,
                        ..cfg.model
                    };
                    (call, drift) = write_call(
                        &step,
                        token.as_deref(),
                        Some(&call.uuid),
                        None,
                        &faithful,
                        &mut r,
                    );
                    debug_assert_eq!(drift, Drift::default());
                }
                Attempt::Error(e) => {
                    fail(format!("step {pos} ({}): {e}", step.tool.name));
                    Tally::bump(&tally.abandoned);
                    return;
                }
            }
        }
    }
}
