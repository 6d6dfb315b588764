//! `run_effect` against the real server: the closure runs exactly once under injected faults
//! (a timeout after the commit, lost Begin and Complete responses, a server restart mid-call,
//! concurrent duplicate callers), retries follow the operation class, and refusals arrive
//! structured.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use common::{Downstream, TestServer, builder, eventually, unique};
use fence_client::{
    CheckFinding, Completion, EffectOutcome, EffectState, Error, ExecContext, FenceClient, Finding,
    OperationClass, OutcomeKey, OutcomeSource, ReasonCode, Receipt, RecoveryAction, RunHandle,
    ToolDef, ToolError,
};
use tokio::sync::Notify;

async fn register(client: &FenceClient, name: &str, class: OperationClass, lease_ms: u64) {
    client
        .register_tool(
            ToolDef::new(name, class)
                .volatile(["request_id"])
                .lease_ms(lease_ms),
        )
        .await
        .unwrap();
}

/// A closure that commits to `bank` under the downstream key and counts its runs.
fn paying(
    bank: &Downstream,
    runs: &Arc<AtomicU32>,
) -> impl FnMut(ExecContext) -> std::future::Ready<Result<Vec<u8>, ToolError>> + use<> {
    let bank = bank.clone();
    let runs = runs.clone();
    move |ctx| {
        runs.fetch_add(1, Ordering::SeqCst);
        std::future::ready(Ok(bank.commit("pay", &ctx.downstream_key)))
    }
}

/// An outcome check that looks the effect up at `bank` by its downstream key.
fn bank_check(bank: &Downstream) -> impl Fn(Receipt) -> std::future::Ready<CheckFinding> + use<> {
    let bank = bank.clone();
    move |receipt: Receipt| {
        let evidence = format!("bank lookup of key {}", receipt.downstream_key);
        std::future::ready(match bank.lookup(&receipt.downstream_key) {
            Some(result) => CheckFinding::Happened { result, evidence },
            None => CheckFinding::DidNotHappen { evidence },
        })
    }
}

fn must_not_run(_: ExecContext) -> std::future::Ready<Result<Vec<u8>, ToolError>> {
    std::future::ready(Err(ToolError::Rejected("this closure must not run".into())))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_closure_runs_once_and_a_repeat_replays_the_result() {
    let server = TestServer::start().await;
    let client = server.client().await;
    register(&client, "pay", OperationClass::NonRetryable, 0).await;
    let run = RunHandle::start(client, &unique("run")).await.unwrap();
    let (bank, runs) = (Downstream::default(), Arc::new(AtomicU32::new(0)));
    let call = run
        .call("pay", r#"{"amount":10,"request_id":"a"}"#)
        .step_key(run.step_key("pay"));

    let first = run.run_effect(&call, paying(&bank, &runs)).await.unwrap();
    assert_eq!(first.source, OutcomeSource::Executed);
    assert_eq!(first.executions, 1);
    let receipt = first.receipt.as_ref().unwrap();
    assert_eq!(receipt.state, EffectState::Completed);
    assert_eq!(receipt.result, first.result);

    // A retry regenerates a volatile field: same step key, same intent -> replay.
    let again = run
        .call("pay", r#"{"request_id":"b","amount":10}"#)
        .step_key(run.step_key("pay"));
    let second = run.run_effect(&again, must_not_run).await.unwrap();
    assert_eq!(second.source, OutcomeSource::Replayed);
    assert_eq!(second.executions, 0);
    assert_eq!(second.result, first.result);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(bank.count("pay"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_duplicate_callers_run_the_closure_once() {
    const CALLERS: u32 = 12;
    let server = TestServer::start().await;
    let (client, faults) = server.faulty_client().await;
    register(&client, "pay", OperationClass::NonRetryable, 0).await;
    let run = RunHandle::start(client, &unique("run")).await.unwrap();
    let bank = Downstream::default();
    let runs = Arc::new(AtomicU32::new(0));
    let call = run
        .call("pay", r#"{"amount":10}"#)
        .step_key(run.step_key("pay"));

    let mut tasks = Vec::new();
    for _ in 0..CALLERS {
        let (run, call, bank, runs, faults) = (
            run.clone(),
            call.clone(),
            bank.clone(),
            runs.clone(),
            faults.clone(),
        );
        tasks.push(tokio::spawn(async move {
            run.run_effect(&call, move |ctx| {
                let (bank, runs, faults) = (bank.clone(), runs.clone(), faults.clone());
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    // Hold the grant until every caller's Begin was answered: all the others
                    // were told "in progress" while this one ran.
                    eventually("every Begin answered", || {
                        faults.answered("Begin") >= CALLERS
                    })
                    .await;
                    Ok(bank.commit("pay", &ctx.downstream_key))
                }
            })
            .await
        }));
    }
    let mut outcomes: Vec<EffectOutcome> = Vec::new();
    for task in tasks {
        outcomes.push(task.await.unwrap().unwrap());
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(bank.count("pay"), 1);
    let executed = outcomes
        .iter()
        .filter(|o| o.source == OutcomeSource::Executed)
        .count();
    assert_eq!(executed, 1);
    assert!(outcomes.iter().all(|o| o.result == outcomes[0].result));
    assert_eq!(faults.answered("Begin"), CALLERS, "nobody re-began");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeout_after_the_commit_is_reconciled_from_the_outcome_check_not_rerun() {
    let server = TestServer::start().await;
    let client = server.client().await;
    register(&client, "pay", OperationClass::NonRetryable, 0).await;
    let run = RunHandle::start(client, &unique("run")).await.unwrap();
    let bank = Downstream::default();
    let runs = Arc::new(AtomicU32::new(0));
    let call = run
        .call("pay", r#"{"amount":10}"#)
        .step_key(run.step_key("pay"));

    let commits_then_times_out = {
        let (bank, runs) = (bank.clone(), runs.clone());
        move |ctx: ExecContext| {
            runs.fetch_add(1, Ordering::SeqCst);
            bank.commit("pay", &ctx.downstream_key);
            std::future::ready(Err(ToolError::Unknown("timeout after sending".into())))
        }
    };
    let outcome = run
        .run_effect_checked(&call, commits_then_times_out, bank_check(&bank))
        .await
        .unwrap();
    assert_eq!(outcome.source, OutcomeSource::Reconciled);
    assert_eq!(outcome.executions, 1);
    let receipt = outcome.receipt.clone().unwrap();
    assert_eq!(receipt.state, EffectState::Completed);
    assert_eq!(
        Some(receipt.result.clone()),
        bank.lookup(&receipt.downstream_key)
    );
    assert!(receipt.evidence.starts_with("bank lookup"));

    let replay = run.run_effect(&call, must_not_run).await.unwrap();
    assert_eq!(replay.source, OutcomeSource::Replayed);
    assert_eq!(replay.result, outcome.result);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(bank.count("pay"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_outcome_without_a_check_stays_unknown_and_is_never_rerun() {
    let server = TestServer::start().await;
    let client = server.client().await;
    register(&client, "pay", OperationClass::NonRetryable, 0).await;
    let run = RunHandle::start(client, &unique("run")).await.unwrap();
    let bank = Downstream::default();
    let call = run
        .call("pay", r#"{"amount":10}"#)
        .step_key(run.step_key("pay"));
    let commits_then_times_out = {
        let bank = bank.clone();
        move |ctx: ExecContext| {
            bank.commit("pay", &ctx.downstream_key);
            std::future::ready(Err(ToolError::Unknown("timeout after sending".into())))
        }
    };
    let err = run
        .run_effect(&call, commits_then_times_out)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::EffectUnknown { .. }), "{err:?}");
    assert_eq!(err.effect_state(), Some(EffectState::EffectUnknown));

    let err = run.run_effect(&call, must_not_run).await.unwrap_err();
    assert_eq!(err.reason(), Some(ReasonCode::ReconcileRequired), "{err:?}");
    assert_eq!(err.recovery(), Some(RecoveryAction::Reconcile));
    assert_eq!(bank.count("pay"), 1);

    // The check settles it later: the recorded result comes back, still one payment.
    let settled = run
        .run_effect_checked(&call, must_not_run, bank_check(&bank))
        .await
        .unwrap();
    assert_eq!(settled.source, OutcomeSource::Reconciled);
    assert_eq!(bank.count("pay"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_begin_response_never_runs_the_closure_twice() {
    let server = TestServer::start().await;
    let (client, faults) = server.faulty_client().await;
    // A short lease: the lost grant lapses quickly and the outcome check settles it.
    register(&client, "pay", OperationClass::NonRetryable, 300).await;
    let run = RunHandle::start(client, &unique("run")).await.unwrap();
    let (bank, runs) = (Downstream::default(), Arc::new(AtomicU32::new(0)));
    let call = run
        .call("pay", r#"{"amount":10}"#)
        .step_key(run.step_key("pay"));

    faults.lose_responses("Begin", 1);
    let outcome = run
        .run_effect_checked(&call, paying(&bank, &runs), bank_check(&bank))
        .await
        .unwrap();
    assert_eq!(faults.lost(), 1);
    assert_eq!(outcome.source, OutcomeSource::Executed);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(bank.count("pay"), 1);
    // The re-sent Begin carried the same request id, so the lost grant (attempt 1) came back
    // at once instead of waiting for its lease to lapse.
    let receipt = outcome.receipt.unwrap();
    assert_eq!(receipt.attempt, 1);
    assert_eq!(Some(receipt.result), bank.lookup(&receipt.downstream_key));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_lost_by_a_crashed_caller_fails_closed_for_the_next_one() {
    let server = TestServer::start().await;
    let (client, faults) = server.faulty_client().await;
    register(&client, "pay", OperationClass::NonRetryable, 300).await;
    let raw = client.clone();
    let run = RunHandle::start(client, &unique("run")).await.unwrap();
    let (bank, runs) = (Downstream::default(), Arc::new(AtomicU32::new(0)));
    let call = run
        .call("pay", r#"{"amount":10}"#)
        .step_key(run.step_key("pay"));
    // A first process is granted the effect, loses the answer and dies without retrying.
    faults.lose_responses("Begin", 1);
    assert!(
        raw.begin(&call.clone().request_id("process-a"))
            .await
            .is_err()
    );
    // The next process (another request id) must not run it: it waits, the lease lapses, and
    // without an outcome check the effect stays unknown.
    let err = run
        .run_effect(&call.clone().request_id("process-b"), paying(&bank, &runs))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::EffectUnknown { .. }), "{err:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_complete_response_is_recorded_once() {
    let server = TestServer::start().await;
    let (client, faults) = server.faulty_client().await;
    register(&client, "pay", OperationClass::NonRetryable, 0).await;
    let run = RunHandle::start(client, &unique("run")).await.unwrap();
    let (bank, runs) = (Downstream::default(), Arc::new(AtomicU32::new(0)));
    let call = run
        .call("pay", r#"{"amount":10}"#)
        .step_key(run.step_key("pay"));

    faults.lose_responses("Complete", 1);
    let outcome = run.run_effect(&call, paying(&bank, &runs)).await.unwrap();
    assert_eq!(faults.lost(), 1);
    assert_eq!(
        faults.answered("Complete"),
        2,
        "the identical repeat was acknowledged"
    );
    assert_eq!(outcome.source, OutcomeSource::Executed);
    assert_eq!(outcome.receipt.unwrap().state, EffectState::Completed);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(bank.count("pay"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_restart_mid_call_loses_nothing_and_runs_nothing_twice() {
    let mut server = TestServer::start().await;
    let (client, faults) = server.faulty_client().await;
    register(&client, "pay", OperationClass::NonRetryable, 0).await;
    let run = RunHandle::start(client.clone(), &unique("run"))
        .await
        .unwrap();
    let bank = Downstream::default();
    let runs = Arc::new(AtomicU32::new(0));
    let (entered, release) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let call = run
        .call("pay", r#"{"amount":10}"#)
        .step_key(run.step_key("pay"));

    let task = {
        let (run, call, bank, runs) = (run.clone(), call.clone(), bank.clone(), runs.clone());
        let (entered, release) = (entered.clone(), release.clone());
        tokio::spawn(async move {
            run.run_effect(&call, move |ctx| {
                let (bank, runs) = (bank.clone(), runs.clone());
                let (entered, release) = (entered.clone(), release.clone());
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    entered.notify_one();
                    release.notified().await;
                    Ok(bank.commit("pay", &ctx.downstream_key))
                }
            })
            .await
        })
    };
    entered.notified().await;
    server.stop().await;
    // The tool finishes while the server is down: Complete fails and is retried.
    release.notify_one();
    eventually("the tool to finish", || bank.count("pay") == 1).await;
    let sent_before = faults.sent("Complete");
    eventually("Complete retried against the stopped server", || {
        faults.sent("Complete") >= sent_before + 2
    })
    .await;
    assert_eq!(faults.answered("Complete"), 0);
    server.restart().await;

    let outcome = task.await.unwrap().unwrap();
    assert_eq!(outcome.source, OutcomeSource::Executed);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(bank.count("pay"), 1);
    let recorded = client
        .query_outcome(OutcomeKey::StepKey {
            run_id: run.run_id().to_owned(),
            branch: None,
            step_key: run.step_key("pay"),
        })
        .await
        .unwrap();
    assert_eq!(recorded.state, EffectState::Completed);
    assert_eq!(recorded.receipt.unwrap().result, outcome.result);
    let replay = run.run_effect(&call, must_not_run).await.unwrap();
    assert_eq!(replay.source, OutcomeSource::Replayed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_before_input_is_retried_under_the_same_effect_and_key() {
    let server = TestServer::start().await;
    let client = server.client().await;
    register(&client, "pay", OperationClass::NonRetryable, 0).await;
    let run = RunHandle::start(client, &unique("run")).await.unwrap();
    let bank = Downstream::default();
    let keys = Arc::new(std::sync::Mutex::new(Vec::<(String, String)>::new()));
    let call = run
        .call("pay", r#"{"amount":10}"#)
        .step_key(run.step_key("pay"));
    let flaky = {
        let (bank, keys) = (bank.clone(), keys.clone());
        move |ctx: ExecContext| {
            let mut keys = keys.lock().unwrap();
            keys.push((ctx.effect_id.clone(), ctx.downstream_key.clone()));
            std::future::ready(if keys.len() == 1 {
                Err(ToolError::FailedBeforeInput("connection refused".into()))
            } else {
                Ok(bank.commit("pay", &ctx.downstream_key))
            })
        }
    };
    let outcome = run.run_effect(&call, flaky).await.unwrap();
    assert_eq!(outcome.executions, 2);
    assert_eq!(outcome.receipt.unwrap().attempt, 2);
    let keys = keys.lock().unwrap();
    assert_eq!(
        keys[0], keys[1],
        "a re-grant keeps the effect id and downstream key"
    );
    assert_eq!(bank.count("pay"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_before_input_stop_at_max_attempts_and_rejections_are_not_retried() {
    let server = TestServer::start().await;
    let client = server.client().await;
    register(&client, "pay", OperationClass::NonRetryable, 0).await;
    let run = RunHandle::start(client, &unique("run")).await.unwrap();
    let runs = Arc::new(AtomicU32::new(0));
    let always_refused = {
        let runs = runs.clone();
        move |_: ExecContext| {
            runs.fetch_add(1, Ordering::SeqCst);
            std::future::ready(Err(ToolError::FailedBeforeInput(
                "connection refused".into(),
            )))
        }
    };
    let call = run
        .call("pay", r#"{"amount":1}"#)
        .step_key(run.step_key("a"));
    let err = run.run_effect(&call, always_refused).await.unwrap_err();
    assert!(
        matches!(
            err,
            Error::ToolFailed {
                retryable: true,
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(
        runs.load(Ordering::SeqCst),
        common::fast_policy().max_attempts
    );

    let declined = run
        .call("pay", r#"{"amount":2}"#)
        .step_key(run.step_key("b"));
    let err = run
        .run_effect(&declined, |_| {
            std::future::ready(Err(ToolError::Rejected("card declined".into())))
        })
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::ToolFailed {
                retryable: false,
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(err.effect_state(), Some(EffectState::FailedBeforeInput));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deduplicated_tool_is_retried_within_its_grant_with_the_same_key() {
    let server = TestServer::start().await;
    let client = server.client().await;
    register(&client, "refund", OperationClass::Deduplicate, 0).await;
    let run = RunHandle::start(client, &unique("run")).await.unwrap();
    let bank = Downstream::default();
    let keys = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let call = run
        .call("refund", r#"{"amount":10}"#)
        .step_key(run.step_key("refund"));
    let times_out_once = {
        let (bank, keys) = (bank.clone(), keys.clone());
        move |ctx: ExecContext| {
            let mut keys = keys.lock().unwrap();
            keys.push(ctx.downstream_key.clone());
            std::future::ready(if keys.len() == 1 {
                Err(ToolError::Unknown("timeout".into()))
            } else {
                Ok(bank.commit("refund", &ctx.downstream_key))
            })
        }
    };
    let outcome = run.run_effect(&call, times_out_once).await.unwrap();
    assert_eq!(outcome.source, OutcomeSource::Executed);
    assert_eq!(outcome.executions, 2);
    assert_eq!(outcome.receipt.unwrap().attempt, 1, "one grant");
    let keys = keys.lock().unwrap();
    assert_eq!(keys[0], keys[1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restored_agent_replays_and_a_zombie_is_fenced_off() {
    let server = TestServer::start().await;
    let client = server.client().await;
    register(&client, "pay", OperationClass::NonRetryable, 0).await;
    let run = RunHandle::start(client.clone(), &unique("run"))
        .await
        .unwrap();
    let (bank, runs) = (Downstream::default(), Arc::new(AtomicU32::new(0)));
    run.checkpoint("cp-1").await.unwrap();
    // No step key: the model regenerates the call after the restore.
    let paid = run
        .run_effect(
            &run.call("pay", r#"{"amount":10,"request_id":"u1"}"#),
            paying(&bank, &runs),
        )
        .await
        .unwrap();
    let zombie = RunHandle::new(client.clone(), run.run_id(), "main", run.epoch());

    let restored = run.restore("cp-1").await.unwrap();
    assert_eq!(run.epoch(), restored.epoch);
    assert_eq!(restored.tape.len(), 1);
    let regenerated = run.call("pay", r#"{"request_id":"u2","amount":10}"#);
    let replay = run.run_effect(&regenerated, must_not_run).await.unwrap();
    assert_eq!(replay.source, OutcomeSource::Replayed);
    assert_eq!(replay.result, paid.result);

    let err = zombie
        .run_effect(
            &zombie.call("pay", r#"{"amount":99}"#),
            paying(&bank, &runs),
        )
        .await
        .unwrap_err();
    assert_eq!(err.reason(), Some(ReasonCode::StaleEpoch), "{err:?}");
    assert_eq!(err.recovery(), Some(RecoveryAction::RefreshEpoch));
    assert_eq!(err.refusal().unwrap().current_epoch, Some(run.epoch()));
    assert_eq!(
        zombie.epoch(),
        paid.epoch,
        "a handle never adopts a newer epoch by itself"
    );

    // After another restore a divergent call must fork; on the fork it is a new effect.
    run.restore("cp-1").await.unwrap();
    let changed = run.call("pay", r#"{"amount":20,"request_id":"u3"}"#);
    let err = run.run_effect(&changed, must_not_run).await.unwrap_err();
    assert_eq!(err.reason(), Some(ReasonCode::ForkRequired), "{err:?}");
    let checkpoint = err.refusal().unwrap().checkpoint_id.clone().unwrap();
    assert_eq!(checkpoint, "cp-1");
    let fork = run
        .fork(&checkpoint, Some("pay-20"), "the user changed the amount")
        .await
        .unwrap();
    assert_eq!(run.branch(), fork.branch.name);
    // The payment of 10 stays done: it is carried onto the fork.
    let carried: Vec<_> = fork.carried.iter().map(|r| r.effect_id.clone()).collect();
    assert_eq!(carried, [paid.receipt.clone().unwrap().effect_id]);
    assert_eq!(fork.branch.pending_carried, 1);
    let forked = run
        .run_effect(
            &run.call("pay", r#"{"amount":20,"request_id":"u3"}"#),
            paying(&bank, &runs),
        )
        .await
        .unwrap();
    assert_eq!(forked.source, OutcomeSource::Executed);
    assert_eq!(forked.receipt.unwrap().branch, "pay-20");
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    assert_eq!(bank.count("pay"), 2);
    assert_eq!(run.effects().await.unwrap().len(), 2);
    // The fork starts at cp-1 (before the first payment): its lineage is its own payment only.
    let lineage = run
        .client()
        .list_effects(&fence_client::EffectFilter::run(run.run_id()).lineage("pay-20"))
        .await
        .unwrap();
    let amounts: Vec<_> = lineage.iter().map(|r| r.arguments_json.clone()).collect();
    assert_eq!(amounts, [r#"{"amount":20,"request_id":"u3"}"#]);
    // Regenerated on the fork, the carried payment of 10 replays: the bank still has two.
    let again = run
        .run_effect(
            &run.call("pay", r#"{"amount":10,"request_id":"u4"}"#),
            must_not_run,
        )
        .await
        .unwrap();
    assert_eq!(again.source, OutcomeSource::Replayed);
    assert_eq!(again.result, paid.result);
    assert_eq!(bank.count("pay"), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_of_other_rpcs_arrive_structured() {
    let server = TestServer::start().await;
    let client = server.client().await;
    register(&client, "pay", OperationClass::NonRetryable, 0).await;
    let run = RunHandle::start(client.clone(), &unique("run"))
        .await
        .unwrap();
    let call = run
        .call("pay", r#"{"amount":1}"#)
        .step_key(run.step_key("pay"));
    let done = run
        .run_effect(&call, |_| std::future::ready(Ok(b"a".to_vec())))
        .await
        .unwrap();
    let receipt = done.receipt.unwrap();

    let err = client
        .complete(
            &receipt.effect_id,
            receipt.attempt,
            run.epoch(),
            Completion::Result(b"b".to_vec()),
        )
        .await
        .unwrap_err();
    assert_eq!(err.reason(), Some(ReasonCode::ResultConflict), "{err:?}");
    assert_eq!(err.code(), Some(tonic::Code::FailedPrecondition));
    assert_eq!(
        err.refusal().unwrap().effect_id.as_deref(),
        Some(receipt.effect_id.as_str())
    );
    assert!(!err.refusal().unwrap().message.is_empty());

    let err = client
        .reconcile(
            &receipt.effect_id,
            run.epoch(),
            " ",
            Finding::Completed(b"a".to_vec()),
        )
        .await
        .unwrap_err();
    assert_eq!(err.reason(), Some(ReasonCode::EvidenceRequired), "{err:?}");

    let err = client
        .complete("not-an-effect-id", 1, 1, Completion::Result(Vec::new()))
        .await
        .unwrap_err();
    match &err {
        Error::Rpc {
            code,
            field_violations,
            ..
        } => {
            assert_eq!(*code, tonic::Code::InvalidArgument);
            assert_eq!(field_violations[0].field, "effect_id");
        }
        other => panic!("expected an invalid argument, got {other:?}"),
    }
    assert!(!err.is_transient());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tenant_metadata_isolates_runs() {
    let server = TestServer::start().await;
    let acme = builder(&server.url())
        .tenant("acme")
        .connect()
        .await
        .unwrap();
    let globex = builder(&server.url())
        .tenant("globex")
        .connect()
        .await
        .unwrap();
    let run_id = unique("shared");
    acme.start_run(&run_id).await.unwrap();
    acme.get_run(&run_id).await.unwrap();
    let err = globex.get_run(&run_id).await.unwrap_err();
    assert_eq!(err.code(), Some(tonic::Code::NotFound), "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lease_is_heartbeated_while_a_long_tool_runs() {
    let server = TestServer::start().await;
    let client = server.client().await;
    register(&client, "export", OperationClass::NonRetryable, 300).await;
    let run = RunHandle::start(client.clone(), &unique("run"))
        .await
        .unwrap();
    let bank = Downstream::default();
    let call = run
        .call("export", r#"{"table":"orders"}"#)
        .step_key(run.step_key("export"));
    let long_tool = {
        let (bank, client) = (bank.clone(), client.clone());
        move |ctx: ExecContext| {
            let (bank, client) = (bank.clone(), client.clone());
            async move {
                // Run until the server shows the lease extended a full lease length past the
                // grant's expiry: the original lease is over, and only heartbeats kept it.
                let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(20);
                loop {
                    let seen = client
                        .query_outcome(OutcomeKey::EffectId(ctx.effect_id.clone()))
                        .await
                        .unwrap();
                    assert!(seen.state.is_live(), "the lease lapsed: {seen:?}");
                    let receipt = seen.receipt.unwrap();
                    if receipt.state == EffectState::Running
                        && receipt.lease_expires_at_ms > ctx.lease_expires_at_ms + 300
                    {
                        break;
                    }
                    assert!(
                        tokio::time::Instant::now() < deadline,
                        "no heartbeat extended the lease"
                    );
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                }
                assert!(!ctx.lease_lost());
                Ok(bank.commit("export", &ctx.downstream_key))
            }
        }
    };
    let outcome = run.run_effect(&call, long_tool).await.unwrap();
    assert_eq!(outcome.source, OutcomeSource::Executed);
    assert_eq!(outcome.executions, 1);
    assert_eq!(outcome.receipt.unwrap().state, EffectState::Completed);
    assert_eq!(bank.count("export"), 1);
}
