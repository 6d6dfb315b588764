//! A property test of the rules a real agent framework meets (DESIGN.md, "The replay-or-fork
//! rule"): a simulated agent runs steps of one or two parallel tool calls, saves each step's
//! checkpoint on time or late (after the next step's calls, as LangGraph's default durability
//! does), retries calls in flight and after they finished, and is restored to earlier
//! checkpoints, where it re-issues the steps it had done, sometimes with one intent changed
//! (then it forks, as a framework does on FORK_REQUIRED). Step keys follow a random policy:
//! stable, absent, or new on every attempt (as model-minted tool-call ids are).
//!
//! Whatever the interleaving:
//! - no recorded occurrence is executed twice: the world never holds more effects of an intent
//!   than the agent made distinct calls of it (across retries, restores and forks);
//! - a replay answers a call only with an effect of the same intent;
//! - a call whose intent did not change is never refused FORK_REQUIRED;
//! - a changed call where the call it replaces is certainly due (that call made an effect,
//!   and since the restore the agent re-issued only unchanged steps of the restored branch and
//!   did not fork) is refused FORK_REQUIRED: it never runs on the branch unasked.

mod common;

use std::collections::{HashMap, HashSet};

use common::*;
use fence_server::ledger::runs::{CheckpointCmd, ForkCmd};
use fence_server::ledger::{BeginCmd, Decision, OpClass, Outcome, Reason};
use proptest::prelude::*;

const PAY: &str = "pay";

#[derive(Debug, Clone, Copy)]
enum Keys {
    /// The same key on every attempt of a call.
    Stable,
    /// No step key.
    Absent,
    /// A fresh key on every attempt.
    NewPerAttempt,
}

#[derive(Debug, Clone)]
enum Event {
    /// The agent's next step: one or two parallel calls of distinct intents.
    Step {
        first: u8,
        second: Option<u8>,
        late_checkpoint: bool,
        retry_in_flight: bool,
    },
    /// Re-send the last step's calls after they finished.
    Retry,
    /// Crash and restore to one of the recorded checkpoints of the current line; the agent
    /// re-issues what it had done since, one call changed when `drift` says so.
    Restore { to: usize, drift: Option<usize> },
}

fn event() -> impl Strategy<Value = Event> {
    prop_oneof![
        5 => (0..4u8, prop::option::of(0..4u8), any::<bool>(), prop::bool::weighted(0.3))
            .prop_map(|(first, second, late_checkpoint, retry_in_flight)| Event::Step {
                first,
                second: second.filter(|s| *s != first),
                late_checkpoint,
                retry_in_flight,
            }),
        1 => Just(Event::Retry),
        2 => (0..8usize, prop::option::of(0..6usize)).prop_map(|(to, drift)| Event::Restore { to, drift }),
    ]
}

fn keys() -> impl Strategy<Value = Keys> {
    prop_oneof![
        Just(Keys::Stable),
        Just(Keys::Absent),
        Just(Keys::NewPerAttempt)
    ]
}

/// One call the agent makes: a logical id (stable across retries and re-issues) and an intent.
#[derive(Debug, Clone)]
struct LogicalCall {
    id: u32,
    intent: u32,
}

/// How Fence answered one call.
enum Answer {
    /// Run it under this grant (effect id, attempt), then complete it.
    Granted(String, u32),
    /// Replayed, in progress or refused: nothing to run.
    Answered,
    /// Refused FORK_REQUIRED: nothing to run; the agent forks if it meant the change.
    MustFork,
}

impl Answer {
    /// The grant to complete, with the intent it runs.
    fn grant(self, intent: u32) -> Option<((String, u32), u32)> {
        match self {
            Answer::Granted(id, attempt) => Some(((id, attempt), intent)),
            Answer::Answered | Answer::MustFork => None,
        }
    }
}

/// A step as the agent remembers it: the checkpoint it descended from and its calls.
#[derive(Debug, Clone)]
struct Step {
    parent: String,
    /// The branch it ran on.
    branch: String,
    /// It holds a call changed after a restore: re-issuing it again departs from any line
    /// that still holds the original call.
    changed: bool,
    calls: Vec<LogicalCall>,
    /// The checkpoint saved after it (recorded or, when late, still pending).
    checkpoint: String,
}

struct Agent<'h> {
    h: &'h Harness,
    keys: Keys,
    epoch: u64,
    branch: String,
    /// The steps of the current line of history, oldest first.
    steps: Vec<Step>,
    /// Checkpoints recorded on the current line: (name, index of the step it follows;
    /// `None` = before the first step).
    recorded: Vec<(String, Option<usize>)>,
    /// A late checkpoint not yet saved: (name, parent).
    pending: Option<(String, String)>,
    next_id: u32,
    next_cp: u32,
    attempt_counter: u32,
    /// Intent -> the distinct logical calls the agent made of it.
    calls: HashMap<u32, HashSet<u32>>,
    /// Intent -> the effects executed for it.
    effects: HashMap<u32, HashSet<u64>>,
    /// Since the last restore, the agent's history differs from the restored branch's (a
    /// changed call, or steps it re-issues were done on another branch or changed before):
    /// a call where a recorded effect is due may then rightly be refused FORK_REQUIRED.
    diverged: bool,
    /// A changed call re-issued where the call it replaces is certainly due (that call made
    /// an effect, every step re-issued since the restore is unchanged and on the restored
    /// branch, and the agent has not forked since): it
    /// must be refused FORK_REQUIRED, never executed on the branch without a fork.
    must_fork: Option<u32>,
    /// The logical calls that made an effect of their own.
    executed: HashSet<u32>,
}

fn args(intent: u32, attempt: u32) -> String {
    format!(r#"{{"target":{intent},"nonce":{attempt}}}"#)
}

impl Agent<'_> {
    fn key_for(&mut self, call: &LogicalCall) -> String {
        self.attempt_counter += 1;
        match self.keys {
            Keys::Stable => format!("call-{}", call.id),
            Keys::Absent => String::new(),
            Keys::NewPerAttempt => format!("call-{}-attempt-{}", call.id, self.attempt_counter),
        }
    }

    /// Begins one call and checks the answer.
    fn begin(
        &mut self,
        call: &LogicalCall,
        parent: &str,
        changed: bool,
    ) -> Result<Answer, TestCaseError> {
        let step_key = self.key_for(call);
        self.calls.entry(call.intent).or_default().insert(call.id);
        let cmd = BeginCmd {
            epoch: self.epoch,
            branch: self.branch.clone(),
            parent_checkpoint_id: parent.to_owned(),
            step_key,
            request_id: format!("req-{}-{}", call.id, self.attempt_counter),
            ..common::call("run", PAY, &args(call.intent, self.attempt_counter))
        };
        let answer = self.h.begin(&cmd);
        trace(|| {
            format!(
                "call {} intent {} parent {parent} on {} epoch {} key {:?}: {}",
                call.id,
                call.intent,
                self.branch,
                self.epoch,
                cmd.step_key,
                answer.kind()
            )
        });
        match answer {
            Decision::Execute { receipt, .. } => {
                prop_assert!(
                    self.must_fork != Some(call.id),
                    "a changed call was executed without a fork while the call it replaces was \
                     due (call {}, intent {})",
                    call.id,
                    call.intent
                );
                // The n-th occurrence of an intent is executed at most once: the world never
                // holds more effects of an intent than the agent made distinct calls of it.
                // (A call may be answered with an equal effect another call of the same intent
                // made: intent, not the agent's bookkeeping, is what identifies an occurrence.)
                self.executed.insert(call.id);
                let effects = self.effects.entry(call.intent).or_default();
                effects.insert(receipt.seq);
                let calls = self.calls.get(&call.intent).map_or(0, HashSet::len);
                prop_assert!(
                    effects.len() <= calls,
                    "intent {} executed {} times for {calls} calls (call {}, effects {effects:?})",
                    call.intent,
                    effects.len(),
                    call.id
                );
                Ok(Answer::Granted(receipt.id().to_string(), receipt.attempt))
            }
            Decision::Replay(rec) => {
                let recorded: serde_json::Value =
                    serde_json::from_str(&rec.arguments_json).unwrap();
                prop_assert_eq!(
                    recorded["target"].as_u64(),
                    Some(u64::from(call.intent)),
                    "a call was answered with another intent's result"
                );
                Ok(Answer::Answered)
            }
            Decision::InProgress { .. } => Ok(Answer::Answered),
            Decision::Refused(r) => {
                prop_assert!(
                    r.reason != Reason::ForkRequired || changed || self.diverged,
                    "an unchanged call was refused FORK_REQUIRED: {r:?}"
                );
                Ok(if r.reason == Reason::ForkRequired {
                    Answer::MustFork
                } else {
                    Answer::Answered
                })
            }
        }
    }

    fn complete(&self, grant: (String, u32), intent: u32) {
        self.h
            .ledger
            .complete(
                T,
                &grant.0,
                grant.1,
                self.epoch,
                Outcome::Completed(format!("done-{intent}").into_bytes()),
            )
            .unwrap();
    }

    fn save(&mut self, name: &str, parent: &str) {
        self.h
            .ledger
            .checkpoint(
                T,
                &CheckpointCmd {
                    run_id: "run".into(),
                    branch: self.branch.clone(),
                    epoch: self.epoch,
                    checkpoint_id: name.into(),
                    parent_checkpoint_id: parent.into(),
                },
            )
            .unwrap();
        let after = self.steps.iter().position(|s| s.checkpoint == name);
        self.recorded.push((name.to_owned(), after));
    }

    fn flush_pending(&mut self) {
        if let Some((name, parent)) = self.pending.take() {
            self.save(&name, &parent);
        }
    }

    fn current_parent(&self) -> String {
        match self.steps.last() {
            Some(s) => s.checkpoint.clone(),
            None => self.recorded[0].0.clone(),
        }
    }

    /// Runs one step of calls; on FORK_REQUIRED for a changed call, forks and runs it there.
    fn step(
        &mut self,
        calls: Vec<LogicalCall>,
        changed: &[u32],
        late: bool,
        retry_in_flight: bool,
        was_changed: bool,
    ) -> Result<(), TestCaseError> {
        let parent = self.current_parent();
        let mut grants = Vec::new();
        for c in &calls {
            match self.begin(c, &parent, changed.contains(&c.id))? {
                Answer::MustFork => {
                    // The framework forks at the checkpoint its state is at, then re-sends.
                    self.flush_pending();
                    let at = self.recorded.last().unwrap().0.clone();
                    let forked = self
                        .h
                        .ledger
                        .fork(
                            T,
                            &ForkCmd {
                                run_id: "run".into(),
                                checkpoint_id: at,
                                epoch: self.epoch,
                                new_branch: String::new(),
                                reason: "intent changed".into(),
                            },
                        )
                        .unwrap();
                    self.branch = forked.branch.name;
                    self.diverged = false;
                    self.must_fork = None;
                    let again = self.begin(c, &parent, true)?;
                    prop_assert!(
                        !matches!(again, Answer::MustFork),
                        "a call was refused FORK_REQUIRED again on the fork made for it"
                    );
                    grants.extend(again.grant(c.intent));
                }
                answer => grants.extend(answer.grant(c.intent)),
            }
        }
        // A late checkpoint of the previous step lands now, after this step's calls.
        self.flush_pending();
        if retry_in_flight {
            for c in &calls {
                let answer = self.begin(c, &parent, false)?;
                grants.extend(answer.grant(c.intent));
            }
        }
        for (g, intent) in grants {
            self.complete(g, intent);
        }
        self.next_cp += 1;
        let name = format!("cp-{}", self.next_cp);
        self.steps.push(Step {
            parent: parent.clone(),
            branch: self.branch.clone(),
            changed: was_changed || !changed.is_empty(),
            calls,
            checkpoint: name.clone(),
        });
        if late {
            self.pending = Some((name, parent));
        } else {
            self.save(&name, &parent);
        }
        Ok(())
    }
}

/// With FENCE_PROPS_TRACE set, prints what the agent does (to debug a shrunk failure).
fn trace(line: impl FnOnce() -> String) {
    if std::env::var_os("FENCE_PROPS_TRACE").is_some() {
        eprintln!("{}", line());
    }
}

/// One step of a shrunk case: its calls' intents, and whether its checkpoint is saved late.
fn step(first: u8, second: Option<u8>, late_checkpoint: bool) -> Event {
    Event::Step {
        first,
        second,
        late_checkpoint,
        retry_in_flight: false,
    }
}

/// Runs the agent through `events` under a step-key policy, checking every answer.
fn run_agent(policy: Keys, events: Vec<Event>) -> Result<(), TestCaseError> {
    let h = harness();
    h.tool(PAY, OpClass::NonRetryable, &["nonce"]);
    let mut agent = Agent {
        h: &h,
        keys: policy,
        epoch: 1,
        branch: "main".into(),
        steps: Vec::new(),
        recorded: Vec::new(),
        pending: None,
        next_id: 0,
        next_cp: 0,
        attempt_counter: 0,
        calls: HashMap::new(),
        effects: HashMap::new(),
        diverged: false,
        must_fork: None,
        executed: HashSet::new(),
    };
    agent.save("cp-0", "");
    for ev in events {
        match ev {
            Event::Step {
                first,
                second,
                late_checkpoint,
                retry_in_flight,
            } => {
                let mut calls = Vec::new();
                for intent in std::iter::once(first).chain(second) {
                    agent.next_id += 1;
                    calls.push(LogicalCall {
                        id: agent.next_id,
                        intent: u32::from(intent),
                    });
                }
                agent.step(calls, &[], late_checkpoint, retry_in_flight, false)?;
            }
            Event::Retry => {
                if let Some(last) = agent.steps.last().cloned() {
                    for c in &last.calls {
                        if let Some((g, intent)) =
                            agent.begin(c, &last.parent, false)?.grant(c.intent)
                        {
                            agent.complete(g, intent);
                        }
                    }
                }
            }
            Event::Restore { to, drift } => {
                // The crash loses a checkpoint not saved yet.
                agent.pending = None;
                let (name, after) = agent.recorded[to % agent.recorded.len()].clone();
                let restored = h.ledger.restore(T, "run", &name, agent.epoch).unwrap();
                let tape: Vec<u64> = restored.tape.iter().map(|r| r.seq).collect();
                trace(|| format!("restore {name} -> {} tape {tape:?}", restored.branch));
                agent.epoch = restored.epoch;
                agent.branch = restored.branch;
                let restored_branch = agent.branch.clone();
                let keep = after.map_or(0, |i| i + 1);
                let redo: Vec<Step> = agent.steps.split_off(keep);
                agent.diverged = redo.iter().any(|s| s.branch != agent.branch || s.changed);
                agent.recorded.retain(|(_, a)| a.is_none_or(|i| i < keep));
                // The restored agent re-issues what it had done since that checkpoint.
                for (i, step) in redo.into_iter().enumerate() {
                    let mut calls = step.calls.clone();
                    let mut changed = Vec::new();
                    if drift == Some(i) {
                        if !agent.diverged
                            && agent.branch == restored_branch
                            && agent.executed.contains(&calls[0].id)
                        {
                            agent.must_fork = Some(agent.next_id + 1);
                        }
                        agent.diverged = true;
                        agent.next_id += 1;
                        let c = &mut calls[0];
                        *c = LogicalCall {
                            id: agent.next_id,
                            // An intent no other call has: a changed call is a new one.
                            intent: 100 + agent.next_id,
                        };
                        changed.push(c.id);
                    }
                    agent.step(calls, &changed, false, false, step.changed)?;
                }
            }
        }
    }
    h.assert_sound();
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(64), ..ProptestConfig::default() })]

    #[test]
    fn retries_restores_and_late_checkpoints_never_execute_a_call_twice(
        policy in keys(),
        events in prop::collection::vec(event(), 1..24),
    ) {
        run_agent(policy, events)?;
    }
}

/// Found by the property: restores to a checkpoint on a line that forked and came back.
#[test]
fn restoring_across_forks_executes_no_call_twice() {
    use Event::*;
    let events = vec![
        step(0, None, false),
        step(0, None, false),
        step(0, None, false),
        step(1, None, false),
        step(0, None, false),
        step(1, None, false),
        Restore {
            to: 2,
            drift: Some(3),
        },
        Restore {
            to: 2,
            drift: Some(1),
        },
        Restore { to: 3, drift: None },
        step(0, None, false),
    ];
    run_agent(Keys::NewPerAttempt, events).unwrap();
}

/// Found by the property: a late checkpoint lost in a crash, and restores back to the start.
#[test]
fn a_lost_late_checkpoint_and_restores_to_the_start_execute_no_call_twice() {
    use Event::*;
    let events = vec![
        step(0, None, true),
        Restore {
            to: 0,
            drift: Some(0),
        },
        step(1, None, false),
        Restore { to: 0, drift: None },
        step(2, None, true),
        step(0, None, false),
        step(0, None, false),
        Restore { to: 3, drift: None },
    ];
    run_agent(Keys::NewPerAttempt, events).unwrap();
}

/// Found by the property: a retry after a fork, then a restore past the fork point.
#[test]
fn a_retry_on_a_fork_then_a_restore_execute_no_call_twice() {
    use Event::*;
    let events = vec![
        step(0, None, false),
        step(0, None, false),
        step(0, Some(2), false),
        Restore {
            to: 0,
            drift: Some(0),
        },
        Retry,
        Restore { to: 0, drift: None },
        step(2, None, false),
        step(1, Some(2), false),
        Restore { to: 1, drift: None },
    ];
    run_agent(Keys::NewPerAttempt, events).unwrap();
}

/// Found by the property: stable keys, a changed call forked, then restores back along the
/// original line.
#[test]
fn stable_keys_and_restores_along_the_original_line_need_no_fork() {
    use Event::*;
    let events = vec![
        step(0, None, false),
        step(0, None, false),
        step(0, None, false),
        step(0, None, false),
        Restore {
            to: 6,
            drift: Some(1),
        },
        Restore { to: 1, drift: None },
        Restore { to: 0, drift: None },
        step(1, None, false),
    ];
    run_agent(Keys::Stable, events).unwrap();
}

/// Found by the property at PROPTEST_CASES=1500: keys new on every attempt, three restores
/// with drift, the last one to a checkpoint (cp-15) recorded while a tape was due. The
/// restore's tape holds only effects causally after cp-15; the effects still due when cp-15
/// was recorded (rewound by the restores to cp-0, never re-answered on main) must stay done
/// (carried), or call 7 executes intent 2 a third time.
#[test]
fn new_keys_per_attempt_and_drifting_restores_execute_no_call_twice() {
    use Event::*;
    let events = vec![
        step(0, None, false),
        step(0, None, false),
        step(0, None, false),
        step(0, None, false),
        step(2, None, false),
        step(0, None, false),
        step(2, None, false),
        Restore {
            to: 0,
            drift: Some(0),
        },
        Restore {
            to: 0,
            drift: Some(5),
        },
        Restore { to: 1, drift: None },
    ];
    run_agent(Keys::NewPerAttempt, events).unwrap();
}

/// Found by the property at 64 cases: the same loss with two parallel calls a step, where
/// the last call of intent 0 would have executed a fifth time for four calls.
#[test]
fn parallel_calls_and_a_restore_to_a_checkpoint_saved_while_a_tape_was_due_execute_no_call_twice() {
    use Event::*;
    let events = vec![
        step(2, None, false),
        step(2, None, false),
        step(0, None, false),
        step(0, None, false),
        step(0, Some(1), false),
        step(2, Some(0), false),
        Restore {
            to: 0,
            drift: Some(0),
        },
        Restore {
            to: 0,
            drift: Some(3),
        },
        Restore { to: 1, drift: None },
    ];
    run_agent(Keys::NewPerAttempt, events).unwrap();
}

/// Found by the property at PROPTEST_CASES=10000 (a false fork, present before the fix of the
/// case above): restored to a checkpoint (cp-10) its framework saved while an earlier tape was
/// due, the agent re-issues its steps, then makes a new call. One due entry (call 4's first
/// effect, on a line that left cp-10's history at cp-2) was placed after cp-10 only because
/// its checkpoint chain ended on another branch; it stayed on the tape and refused the new
/// call FORK_REQUIRED. A chain that meets one of cp-10's ancestors first is beside cp-10, not
/// after it.
#[test]
fn a_due_entry_from_a_line_beside_the_restored_checkpoint_forces_no_fork() {
    use Event::*;
    let events = vec![
        step(0, None, false),
        Restore {
            to: 6,
            drift: Some(0),
        },
        step(0, None, false),
        step(0, None, false),
        step(2, None, false),
        Restore {
            to: 1,
            drift: Some(0),
        },
        step(1, None, false),
        Restore { to: 1, drift: None },
        Restore { to: 2, drift: None },
        step(1, None, false),
    ];
    run_agent(Keys::NewPerAttempt, events).unwrap();
}

/// Found by the property at PROPTEST_CASES=10000 (a false fork): an effect still due at a
/// checkpoint (e2, superseded by a drifted call) is carried by a restore to it, then replayed
/// on its own branch. Adopted there a second time, it sat twice in the branch's log and on a
/// later restore's tape, and the copy nothing re-issued refused a new call FORK_REQUIRED. An
/// effect already in the branch's log keeps its one place.
#[test]
fn a_carried_effect_replayed_on_its_own_branch_is_logged_once() {
    use Event::*;
    let events = vec![
        step(0, None, false),
        step(2, None, false),
        step(0, None, false),
        step(0, None, false),
        step(0, None, false),
        Retry,
        Restore {
            to: 6,
            drift: Some(1),
        },
        Restore { to: 7, drift: None },
        step(0, None, false),
        step(0, Some(2), false),
        Restore { to: 0, drift: None },
        Restore { to: 2, drift: None },
        step(0, None, false),
    ];
    run_agent(Keys::NewPerAttempt, events).unwrap();
}

/// Found by the property over the in-memory store at PROPTEST_CASES=20000 (a false
/// FORK_REQUIRED): a fork taken at a checkpoint saved while a tape was due (cp-12: e4 still due,
/// e5 already re-issued) starts at the first due entry's log position. It carried e5 although
/// the agent had re-issued it, so a second call of e5's intent replayed e5 instead of being new;
/// a later restore's tape then held e5 once for the two calls it had answered, and the second
/// call, re-issued, met the still-due e4 and was refused. What was re-issued before the
/// checkpoint now opens the fork's own log (CheckpointRecord.log_length says where the
/// checkpoint's log ended).
#[test]
fn a_fork_from_a_checkpoint_saved_mid_tape_does_not_carry_what_was_reissued() {
    use Event::*;
    let events = vec![
        step(0, None, false),
        step(0, None, false),
        step(2, None, false),
        step(0, Some(1), false),
        Restore {
            to: 0,
            drift: Some(0),
        },
        Restore { to: 0, drift: None },
        step(1, None, false),
        Restore { to: 4, drift: None },
        step(0, None, false),
        step(0, None, false),
        Restore { to: 1, drift: None },
    ];
    run_agent(Keys::NewPerAttempt, events).unwrap();
}

/// Found by the property on RocksDB at PROPTEST_CASES=20000: a false FORK_REQUIRED (safe:
/// nothing runs twice; the agent is asked to fork when it need not). A call drifted away from
/// e2 (intent 1) leaves e2 due at cp-6; the restore to cp-6 carries it, and a later, new call
/// of intent 1 (call 9, after cp-16) replays it, so e2 now answers cp-16's step too. The
/// restore to cp-16 carries e2 again (it was due there), but call 9, re-issued, was taken for
/// a repeat within cp-16's step (DUPLICATE_INTENT) before the carried effects were looked at,
/// and e2 went on to answer call 10, a new call of a later step. Restored once more, calls 9
/// and 10 then met one e2 between them, and call 10 was refused. Now a repeat whose effect is
/// due again is answered by that due effect, as a tape entry would be: call 9 replays e2 and
/// call 10 is a new effect.
#[test]
fn a_superseded_due_entry_answering_a_new_call_forces_no_fork_later() {
    use Event::*;
    let events = vec![
        step(0, None, false),
        step(1, None, false),
        step(0, None, false),
        step(0, None, false),
        step(0, None, false),
        Restore {
            to: 6,
            drift: Some(1),
        },
        step(2, None, true),
        Restore { to: 7, drift: None },
        step(0, Some(1), false),
        Restore { to: 6, drift: None },
        step(1, Some(2), false),
        Restore { to: 2, drift: None },
    ];
    run_agent(Keys::NewPerAttempt, events).unwrap();
}

/// Found by the property at PROPTEST_RNG_SEED=12 and PROPTEST_CASES=10000 (in memory): a
/// false FORK_REQUIRED (safe: nothing ran twice). Call 1 (e1) drifts into call 6, which is
/// refused and forked; a restore to cp-0 on main then takes the agent's call 6 back there,
/// answered by e6 carried from the fork. e1 stayed due on main's tape although call 6 took
/// its place: the re-issued calls 2-5 were matched by intent to four of e1-e5 and one entry
/// was left over, which a later new call met. The fork now records the entry it was made to
/// replace (`BranchRecord::fork_replaces`), its first new effect takes that over
/// (`EffectRecord::supersedes`), and adopting it back onto main makes e1 done, not due.
#[test]
fn a_forked_call_taken_back_to_its_branch_leaves_no_superseded_entry_due() {
    use Event::*;
    let events = vec![
        step(0, None, false),
        step(0, None, false),
        step(1, None, false),
        step(0, Some(1), false),
        Restore {
            to: 0,
            drift: Some(0),
        },
        Restore { to: 5, drift: None },
        Retry,
        Restore { to: 1, drift: None },
        step(1, None, false),
    ];
    run_agent(Keys::NewPerAttempt, events).unwrap();
}

/// Found by the property at PROPTEST_RNG_SEED=12 and PROPTEST_CASES=10000 (in memory) with
/// an earlier form of the superseding fix: the same false fork, the call forked from cp-1
/// coming back to main after a restore to cp-0, under cp-8, the framework's new name for the
/// state after call 1 (cp-8 sits where cp-1 does in main's log).
#[test]
fn a_forked_call_taken_back_under_a_new_checkpoint_name_supersedes_its_entry() {
    use Event::*;
    let events = vec![
        step(0, None, false),
        step(0, None, false),
        step(1, None, false),
        step(0, Some(1), false),
        Restore {
            to: 1,
            drift: Some(0),
        },
        Restore { to: 5, drift: None },
        Retry,
        Restore { to: 2, drift: None },
        step(1, None, false),
    ];
    run_agent(Keys::NewPerAttempt, events).unwrap();
}

/// Found by the property (seed 12, 10,000 cases in memory) against a first form of the
/// superseding fix tried above, which let any carried effect supersede a due entry: call 6's own effect e2 (carried by
/// the restore to cp-11, as it was due there) took the place of e6, call 7's, in their shared
/// step; call 7 then consumed call 9's entry, and call 9 ran a second time on the fork made
/// for call 10. A guard for any later form: only another line's effect replaces an entry.
#[test]
fn an_effect_carried_from_its_own_branch_supersedes_no_entry_of_its_step() {
    use Event::*;
    let events = vec![
        step(0, None, false),
        step(3, None, true),
        Restore {
            to: 2,
            drift: Some(1),
        },
        step(0, None, false),
        step(0, None, false),
        step(3, Some(1), false),
        Restore { to: 0, drift: None },
        step(0, Some(1), false),
        Restore {
            to: 4,
            drift: Some(1),
        },
    ];
    run_agent(Keys::NewPerAttempt, events).unwrap();
}

/// Found by the property (seed 17, 10,000 cases in memory) once it checked that a changed
/// call is refused where the call it replaces is due: a missed FORK_REQUIRED. e3, rewound by
/// the restore to cp-6 and carried, answered call 9 after cp-12; a restore to cp-12 left it
/// out of the tape (it sits before cp-12 in the log), so call 9 consumed e9, call 10's
/// effect, and call 11, changed from call 10, ran as new on main. A due entry re-issued after
/// the checkpoint is due again on a restore to it.
#[test]
fn a_carried_entry_reissued_after_a_checkpoint_is_due_on_a_restore_to_it() {
    use Event::*;
    let events = vec![
        step(0, None, false),
        step(0, None, false),
        step(3, None, false),
        step(0, None, false),
        step(0, None, false),
        Restore {
            to: 0,
            drift: Some(2),
        },
        Restore { to: 1, drift: None },
        step(0, None, false),
        step(0, Some(3), false),
        step(3, None, false),
        Restore {
            to: 3,
            drift: Some(4),
        },
    ];
    run_agent(Keys::NewPerAttempt, events).unwrap();
}

/// Found by the property (seed 14, 10,000 cases in memory) against the second form of the
/// superseding fix, before it looked at the fork's line: a double execution. Calls 2 and 3 share a step; call 9 replaced
/// call 2 on fork-1, where call 3 replayed e3. Back on main, call 9 answered by e9 superseded
/// e3, the first due entry of its step, though fork-1 had re-issued it; call 3 then consumed
/// call 8's entry, and call 8 ran again on a later fork. An entry the fork's line holds too
/// is not the one its effect replaced (a guard for any later form).
#[test]
fn a_forked_effect_supersedes_no_entry_its_own_line_reissued() {
    use Event::*;
    let events = vec![
        step(0, None, false),
        step(2, Some(1), false),
        step(0, None, false),
        step(0, None, false),
        step(0, None, false),
        step(0, None, false),
        step(1, None, false),
        Restore {
            to: 0,
            drift: Some(1),
        },
        Restore {
            to: 1,
            drift: Some(1),
        },
    ];
    run_agent(Keys::NewPerAttempt, events).unwrap();
}

/// Found by the property (seed 17, 10,000 cases in memory) against the third form of the
/// superseding fix (counted by intent against the fork's line): a false fork. Passes on the
/// landed ledger; a guard for any later form.
#[test]
fn repeated_restores_to_cp0_after_a_drift_force_no_fork() {
    use Event::*;
    let events = vec![
        step(0, None, false),
        step(0, None, false),
        Restore {
            to: 4,
            drift: Some(0),
        },
        Restore { to: 0, drift: None },
        step(1, None, false),
        Restore { to: 0, drift: None },
        step(0, None, false),
        step(0, None, false),
        step(0, None, false),
        step(0, None, false),
        step(1, None, false),
        Restore { to: 2, drift: None },
    ];
    run_agent(Keys::NewPerAttempt, events).unwrap();
}

/// Found by the property (seed 18, 10,000 cases in memory) against the third form of the
/// superseding fix: a changed call executed twice. Passes on the landed ledger; a guard for
/// any later form.
#[test]
fn a_changed_call_reissued_after_two_restores_runs_once() {
    use Event::*;
    let events = vec![
        step(0, None, false),
        step(0, None, false),
        step(0, None, false),
        step(2, None, false),
        step(0, Some(2), false),
        Restore {
            to: 3,
            drift: Some(0),
        },
        Restore { to: 0, drift: None },
        step(0, None, false),
        step(0, Some(2), false),
        Restore {
            to: 5,
            drift: Some(1),
        },
        Restore { to: 4, drift: None },
    ];
    run_agent(Keys::NewPerAttempt, events).unwrap();
}

/// Found by the property (seed 13, 10,000 cases in memory) against a first form of the
/// fork's link, before the superseding effect took its entry's place on the tape: a call run
/// three times. After call 3 (forked in place of call 1's e1) was taken back to main, a
/// restore listed main's tape in log order, e2 before e3 (adopted after it), so the next
/// drifted call was refused for e2 and its fork linked to e2, not to e3 it replaced; e2 was
/// then superseded on main while its call was still to come. The tape now holds a
/// superseding effect where its entry was.
#[test]
fn a_superseding_effect_takes_its_entrys_place_on_a_later_tape() {
    use Event::*;
    let events = vec![
        step(0, Some(1), false),
        Restore {
            to: 0,
            drift: Some(0),
        },
        step(2, None, false),
        Restore { to: 3, drift: None },
        Restore {
            to: 3,
            drift: Some(0),
        },
        step(0, None, false),
        step(1, None, false),
        Restore {
            to: 5,
            drift: Some(1),
        },
    ];
    run_agent(Keys::NewPerAttempt, events).unwrap();
}

/// Found by the property (seed 19, 10,000 cases in memory), before the fork's link existed
/// and with its first form: a false fork. The drifted call was refused after call 1 replayed,
/// and forked from cp-7, a checkpoint saved after the restore while e2-e6 were due, not from
/// the checkpoint restored to; the fork's call replaced e2 all the same.
#[test]
fn a_fork_from_a_checkpoint_saved_while_entries_are_due_replaces_the_first() {
    use Event::*;
    let events = vec![
        step(0, None, false),
        step(0, None, false),
        step(0, None, false),
        step(0, None, false),
        step(0, None, false),
        step(0, None, false),
        Restore {
            to: 0,
            drift: Some(1),
        },
        Restore { to: 0, drift: None },
        Retry,
        Restore { to: 2, drift: None },
        step(1, None, false),
    ];
    run_agent(Keys::NewPerAttempt, events).unwrap();
}

/// Found by the property (seed 20, 10,000 cases in memory) with the fork's link: a false
/// fork. Call 4's checkpoint (cp-6) was saved late, after call 6 had been answered by e2 (done
/// on main, superseded by the fork's e3, so carried): e2 was due where cp-6 belongs but no
/// longer when it was saved, so a restore to cp-6 left it off the tape and call 6 consumed
/// call 7's entry. A late checkpoint now counts as due what was due where it belongs
/// (`OpenStep::due_seqs`).
#[test]
fn a_late_checkpoint_counts_what_was_due_where_it_belongs() {
    use Event::*;
    let events = vec![
        step(0, None, false),
        step(2, None, false),
        Retry,
        Restore {
            to: 4,
            drift: Some(0),
        },
        Restore { to: 0, drift: None },
        step(0, None, true),
        step(0, Some(2), false),
        step(2, Some(0), false),
        Restore { to: 3, drift: None },
    ];
    run_agent(Keys::NewPerAttempt, events).unwrap();
}

/// Found by the property (seed 12, 10,000 cases in memory) with the fork's link before a
/// fork answered identical intents around its replaced entry: a call run five times. Call 5
/// was forked in place of e2 (call 2); on the fork, call 3, of e2's intent, was answered by e2
/// (the earliest carried), leaving e3 over, so the fork had done e2 after all and its e5
/// replaced e3, not e2. A fork's replaced entry now answers an identical intent there only
/// when no other carried effect does, and an effect replaces nothing its own branch re-issued
/// (`EffectRecord::took_place_of`).
#[test]
fn a_fork_answers_its_replaced_entrys_intent_with_another_effect_first() {
    use Event::*;
    let events = vec![
        step(0, None, false),
        step(2, None, false),
        step(2, Some(0), false),
        Restore {
            to: 0,
            drift: Some(1),
        },
        Restore {
            to: 1,
            drift: Some(1),
        },
        Restore { to: 4, drift: None },
        step(2, None, false),
        step(0, None, false),
        step(1, Some(0), false),
        Restore {
            to: 2,
            drift: Some(3),
        },
    ];
    run_agent(Keys::NewPerAttempt, events).unwrap();
}
