//! The ACRFence scenarios (action replay and authority resurrection after checkpoint-restore),
//! the permission-prompt repeat, and epoch fencing, against the real server over gRPC.

use fence_proto::v1 as pb;
use fence_proto::v1::decision::Outcome as O;
use fence_tests::*;
use tonic::transport::Channel;

type Client = pb::fence_client::FenceClient<Channel>;

async fn setup(srv: &TestServer) -> Client {
    let mut c = srv.client().await;
    for (name, volatile) in [
        ("bank.transfer", vec!["reference", "timestamp"]),
        ("approval.use", vec!["request_id"]),
    ] {
        c.register_tool(pb::RegisterToolRequest {
            tool: Some(pb::ToolSpec {
                name: name.into(),
                class: pb::OperationClass::NonRetryable as i32,
                intent_schema: Some(pb::IntentSchema {
                    volatile_fields: volatile.into_iter().map(String::from).collect(),
                    ..Default::default()
                }),
                ..Default::default()
            }),
        })
        .await
        .unwrap();
    }
    c
}

/// What a model re-generates after a restore: same intent, fresh UUID and timestamp, keys in
/// another order.
fn transfer(to: &str, amount: u64, n: u32) -> String {
    if n.is_multiple_of(2) {
        format!(
            r#"{{"to":"{to}","amount":{amount},"reference":"ref-{n}","timestamp":"2026-12-02T10:{n:02}:00Z"}}"#
        )
    } else {
        format!(
            r#"{{ "timestamp": "2026-12-02T11:{n:02}:00Z", "reference": "uuid-{n}", "amount": {amount}.0, "to": "{to}" }}"#
        )
    }
}

async fn checkpoint(c: &mut Client, epoch: u64, branch: &str, id: &str) {
    c.checkpoint(pb::CheckpointRequest {
        run_id: "agent".into(),
        branch: branch.into(),
        epoch,
        checkpoint_id: id.into(),
        ..Default::default()
    })
    .await
    .unwrap();
}

async fn restore(c: &mut Client, cp: &str) -> pb::RestoreResponse {
    c.restore(pb::RestoreRequest {
        run_id: "agent".into(),
        checkpoint_id: cp.into(),
        expected_epoch: 0,
    })
    .await
    .unwrap()
    .into_inner()
}

async fn call(
    c: &mut Client,
    epoch: u64,
    branch: &str,
    tool: &str,
    args: &str,
    token: Option<&str>,
) -> O {
    let req = pb::BeginRequest {
        run_id: "agent".into(),
        branch: branch.into(),
        epoch,
        tool: tool.into(),
        arguments_json: args.into(),
        credentials: token
            .map(|t| {
                vec![pb::CredentialUse {
                    token: t.as_bytes().to_vec(),
                    budget: 1,
                }]
            })
            .unwrap_or_default(),
        ..Default::default()
    };
    outcome(c.begin(req).await.unwrap().into_inner())
}

async fn finish(c: &mut Client, ex: &pb::Execute, epoch: u64, result: &str) {
    c.complete(pb::CompleteRequest {
        effect_id: ex.effect_id.clone(),
        attempt: ex.attempt,
        epoch,
        outcome: Some(pb::complete_request::Outcome::Result(
            result.as_bytes().to_vec(),
        )),
    })
    .await
    .unwrap();
}

async fn effect_count(c: &mut Client) -> usize {
    c.list_effects(pb::ListEffectsRequest {
        run_id: "agent".into(),
        ..Default::default()
    })
    .await
    .unwrap()
    .into_inner()
    .effects
    .len()
}

fn refusal(o: O) -> pb::Refusal {
    match o {
        O::Refused(r) => r,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[tokio::test]
async fn scenario_1_restored_transfer_is_replayed_one_transfer_in_the_world() {
    let srv = TestServer::start().await;
    let mut c = setup(&srv).await;
    checkpoint(&mut c, 1, "", "verified").await;
    let O::Execute(ex) = call(
        &mut c,
        1,
        "",
        "bank.transfer",
        &transfer("bob", 250, 0),
        None,
    )
    .await
    else {
        panic!()
    };
    finish(&mut c, &ex, 1, r#"{"tx":"T-1"}"#).await;
    // The agent crashes right after the transfer and is restored to the checkpoint before it.
    let r = restore(&mut c, "verified").await;
    assert_eq!((r.epoch, r.tape.len()), (2, 1));
    let O::Replay(rp) = call(
        &mut c,
        2,
        "",
        "bank.transfer",
        &transfer("bob", 250, 1),
        None,
    )
    .await
    else {
        panic!("expected replay")
    };
    assert_eq!(rp.receipt.unwrap().result, br#"{"tx":"T-1"}"#);
    assert_eq!(effect_count(&mut c).await, 1);
}

#[tokio::test]
async fn scenario_2_redirected_transfer_requires_a_fork_then_is_new() {
    let srv = TestServer::start().await;
    let mut c = setup(&srv).await;
    checkpoint(&mut c, 1, "", "verified").await;
    let O::Execute(ex) = call(
        &mut c,
        1,
        "",
        "bank.transfer",
        &transfer("bob", 250, 0),
        None,
    )
    .await
    else {
        panic!()
    };
    finish(&mut c, &ex, 1, "T-1").await;
    restore(&mut c, "verified").await;
    for redirected in [transfer("mallory", 250, 3), transfer("bob", 25_000, 4)] {
        let r = refusal(call(&mut c, 2, "", "bank.transfer", &redirected, None).await);
        assert_eq!(r.reason, pb::ReasonCode::ForkRequired as i32);
        assert_eq!(r.recovery, pb::RecoveryAction::Fork as i32);
        assert_eq!(r.checkpoint_id, "verified");
        assert_eq!(r.receipt.unwrap().effect_id, ex.effect_id);
    }
    assert_eq!(effect_count(&mut c).await, 1);
    let forked = c
        .fork(pb::ForkRequest {
            run_id: "agent".into(),
            checkpoint_id: "verified".into(),
            epoch: 2,
            new_branch: "pay-carol".into(),
            reason: "user changed recipient".into(),
        })
        .await
        .unwrap()
        .into_inner();
    let fork = forked.branch.unwrap();
    assert_eq!((fork.parent.as_str(), fork.fork_position), ("main", 0));
    // The transfer to bob stays done: carried onto the fork, not forgotten.
    assert_eq!(fork.pending_carried, 1);
    let carried: Vec<&str> = forked
        .carried
        .iter()
        .map(|r| r.effect_id.as_str())
        .collect();
    assert_eq!(carried, [ex.effect_id.as_str()]);
    let O::Execute(ex2) = call(
        &mut c,
        2,
        "pay-carol",
        "bank.transfer",
        &transfer("carol", 250, 5),
        None,
    )
    .await
    else {
        panic!("expected a new effect on the fork")
    };
    assert_ne!(ex2.downstream_key, ex.downstream_key);
    assert_eq!(effect_count(&mut c).await, 2);
    // Re-issued on the fork, the transfer to bob replays: still one transfer to bob.
    let O::Replay(rp) = call(
        &mut c,
        2,
        "pay-carol",
        "bank.transfer",
        &transfer("bob", 250, 6),
        None,
    )
    .await
    else {
        panic!("expected the carried transfer to replay")
    };
    assert_eq!(rp.receipt.unwrap().effect_id, ex.effect_id);
    assert_eq!(effect_count(&mut c).await, 2);
    let run = c
        .get_run(pb::GetRunRequest {
            run_id: "agent".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap();
    assert_eq!(run.branches.len(), 2);
    assert_eq!(
        run.branches[0].pending_replays, 1,
        "main still has its tape; nothing hidden"
    );
    assert_eq!(run.restores.len(), 1);
}

#[tokio::test]
async fn scenario_3_a_spent_approval_token_is_refused_after_restore_and_on_a_fork() {
    let srv = TestServer::start().await;
    let mut c = setup(&srv).await;
    c.register_credential(pb::RegisterCredentialRequest {
        token: b"otp-991".to_vec(),
        budget: 1,
        ..Default::default()
    })
    .await
    .unwrap();
    checkpoint(&mut c, 1, "", "before-approval").await;
    let O::Execute(ex) = call(
        &mut c,
        1,
        "",
        "approval.use",
        r#"{"action":"wire","request_id":"a"}"#,
        Some("otp-991"),
    )
    .await
    else {
        panic!()
    };
    finish(&mut c, &ex, 1, "approved").await;
    restore(&mut c, "before-approval").await;
    // Presented again for another action: the authority does not resurrect.
    let r = refusal(
        call(
            &mut c,
            2,
            "",
            "approval.use",
            r#"{"action":"wire-2","request_id":"b"}"#,
            Some("otp-991"),
        )
        .await,
    );
    assert_eq!(r.reason, pb::ReasonCode::CredentialConsumed as i32);
    assert_eq!(r.recovery, pb::RecoveryAction::Reauthenticate as i32);
    // On a fork too: the effect that spent it is carried there, so its exact replay gets the
    // recorded result (no new use) and any other use is refused.
    c.fork(pb::ForkRequest {
        run_id: "agent".into(),
        checkpoint_id: "before-approval".into(),
        epoch: 2,
        new_branch: "f".into(),
        reason: String::new(),
    })
    .await
    .unwrap();
    let r = refusal(
        call(
            &mut c,
            2,
            "f",
            "approval.use",
            r#"{"action":"wire-3","request_id":"c"}"#,
            Some("otp-991"),
        )
        .await,
    );
    assert_eq!(r.reason, pb::ReasonCode::CredentialConsumed as i32);
    let O::Replay(rp) = call(
        &mut c,
        2,
        "f",
        "approval.use",
        r#"{"action":"wire","request_id":"d"}"#,
        Some("otp-991"),
    )
    .await
    else {
        panic!("expected the exact replay of the spending effect")
    };
    assert_eq!(rp.receipt.unwrap().effect_id, ex.effect_id);
    let cred = c
        .get_credential(pb::GetCredentialRequest {
            token: b"otp-991".to_vec(),
        })
        .await
        .unwrap()
        .into_inner()
        .credential
        .unwrap();
    assert_eq!((cred.uses, cred.budget), (1, 1));
    assert_eq!(cred.spent_by_effect_ids, vec![ex.effect_id]);
}

#[tokio::test]
async fn scenario_4_five_crash_restore_cycles_still_one_effect() {
    let srv = TestServer::start().await;
    let mut c = setup(&srv).await;
    checkpoint(&mut c, 1, "", "cp").await;
    let O::Execute(ex) = call(
        &mut c,
        1,
        "",
        "bank.transfer",
        &transfer("bob", 99, 0),
        None,
    )
    .await
    else {
        panic!()
    };
    finish(&mut c, &ex, 1, "T-1").await;
    let mut epoch = 1;
    for cycle in 1..=5 {
        epoch = restore(&mut c, "cp").await.epoch;
        let O::Replay(rp) = call(
            &mut c,
            epoch,
            "",
            "bank.transfer",
            &transfer("bob", 99, cycle),
            None,
        )
        .await
        else {
            panic!("cycle {cycle}: expected replay")
        };
        assert_eq!(rp.receipt.unwrap().effect_id, ex.effect_id);
    }
    assert_eq!(epoch, 6);
    assert_eq!(effect_count(&mut c).await, 1);
}

/// Claude Code issue 13897's pattern: after the user approves a held call it runs, then a
/// second identical call follows. With the approval bound to that call, the second replays.
#[tokio::test]
async fn an_approved_tool_call_repeated_after_the_prompt_replays() {
    let srv = TestServer::start().await;
    let mut c = setup(&srv).await;
    let args = r#"{"action":"deploy","request_id":"first"}"#;
    c.register_credential(pb::RegisterCredentialRequest {
        token: b"user-approval-1".to_vec(),
        budget: 1,
        bound_tool: "approval.use".into(),
        bound_arguments_json: args.into(),
    })
    .await
    .unwrap();
    let O::Execute(ex) = call(&mut c, 1, "", "approval.use", args, Some("user-approval-1")).await
    else {
        panic!()
    };
    finish(&mut c, &ex, 1, "deployed").await;
    let O::Replay(rp) = call(
        &mut c,
        1,
        "",
        "approval.use",
        r#"{"request_id":"second","action":"deploy"}"#,
        Some("user-approval-1"),
    )
    .await
    else {
        panic!("expected the repeat to replay")
    };
    assert_eq!(rp.receipt.unwrap().result, b"deployed");
    assert_eq!(effect_count(&mut c).await, 1);
}

#[tokio::test]
async fn a_zombie_with_a_stale_epoch_can_start_nothing() {
    let srv = TestServer::start().await;
    let mut c = setup(&srv).await;
    checkpoint(&mut c, 1, "", "cp").await;
    let O::Execute(ex) = call(&mut c, 1, "", "bank.transfer", &transfer("bob", 1, 0), None).await
    else {
        panic!()
    };
    restore(&mut c, "cp").await;
    let before = c
        .get_run(pb::GetRunRequest {
            run_id: "agent".into(),
        })
        .await
        .unwrap()
        .into_inner();
    let r = refusal(
        call(
            &mut c,
            1,
            "",
            "bank.transfer",
            &transfer("eve", 1000, 1),
            None,
        )
        .await,
    );
    assert_eq!(r.reason, pb::ReasonCode::StaleEpoch as i32);
    assert_eq!(r.current_epoch, 2);
    // A report naming no granted attempt is new work: fenced off.
    let s = c
        .complete(pb::CompleteRequest {
            effect_id: ex.effect_id.clone(),
            attempt: 0,
            epoch: 1,
            outcome: Some(pb::complete_request::Outcome::Result(b"zombie".to_vec())),
        })
        .await
        .unwrap_err();
    assert_eq!(reason_of(&s).as_deref(), Some("STALE_EPOCH"));
    let after = c
        .get_run(pb::GetRunRequest {
            run_id: "agent".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(before, after);
    assert_eq!(effect_count(&mut c).await, 1);
    // What it was granted before the restore it may still finish: the result is a fact, and
    // the restored agent's call then replays it instead of running the transfer again.
    let done = c
        .complete(pb::CompleteRequest {
            effect_id: ex.effect_id.clone(),
            attempt: ex.attempt,
            epoch: 1,
            outcome: Some(pb::complete_request::Outcome::Result(b"tx-bob".to_vec())),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(done.receipt.unwrap().result, b"tx-bob");
    let O::Replay(replay) =
        call(&mut c, 2, "", "bank.transfer", &transfer("bob", 1, 7), None).await
    else {
        panic!("the restored agent's re-issued call must replay the zombie's result")
    };
    assert_eq!(replay.receipt.unwrap().result, b"tx-bob");
    assert_eq!(effect_count(&mut c).await, 1);
}
