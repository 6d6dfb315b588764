//! `begin_batch` and `complete_batch` against the real server: one result per call, each the
//! answer or the structured error the call would have got alone, and a resent batch gets the
//! same effects back.

mod common;

use common::{TestServer, unique};
use fence_client::{
    CompleteCall, Completion, Decision, EffectCall, EffectState, Error, OperationClass, ReasonCode,
    ToolDef,
};

const PAY: &str = "bank.transfer";

fn pay(run: &str, step: &str, amount: u32) -> EffectCall {
    EffectCall::new(
        run,
        PAY,
        format!(
            r#"{{"to":"bob","amount":{amount},"ts":"{}"}}"#,
            unique("ts")
        ),
    )
    .step_key(step)
    .request_id(unique("req"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_answers_each_call_as_if_sent_alone() {
    let server = TestServer::start().await;
    let client = server.client().await;
    client
        .register_tool(ToolDef::new(PAY, OperationClass::NonRetryable).volatile(["ts"]))
        .await
        .unwrap();
    let run = unique("run");
    let calls = [
        pay(&run, "flight", 100),
        pay(&run, "hotel", 200),
        // The same step with another amount, after it was granted earlier in this batch.
        pay(&run, "flight", 999),
        // Malformed arguments: an error for this call only.
        EffectCall::new(&run, PAY, "{not json").step_key("car"),
    ];
    let results = client.begin_batch(&calls).await.unwrap();
    assert_eq!(results.len(), calls.len());
    let mut grants = Vec::new();
    for r in &results[..2] {
        match &r.as_ref().unwrap().decision {
            Decision::Execute(grant) => grants.push(grant.clone()),
            other => panic!("expected a grant, got {other:?}"),
        }
    }
    assert_ne!(grants[0].downstream_key, grants[1].downstream_key);
    match &results[2].as_ref().unwrap().decision {
        Decision::Refused(r) => assert_eq!(r.reason, ReasonCode::ArgumentMismatch),
        other => panic!("expected ARGUMENT_MISMATCH, got {other:?}"),
    }
    match &results[3] {
        Err(Error::Rpc {
            code,
            field_violations,
            ..
        }) => {
            assert_eq!(*code, tonic::Code::InvalidArgument);
            assert_eq!(field_violations[0].field, "arguments_json");
        }
        other => panic!("expected INVALID_ARGUMENT on arguments_json, got {other:?}"),
    }

    // A lost response: the same batch resent gets its own grants back, nothing new.
    let again = client.begin_batch(&calls[..2]).await.unwrap();
    for (r, grant) in again.iter().zip(&grants) {
        match &r.as_ref().unwrap().decision {
            Decision::Execute(g) => assert_eq!(g.effect_id, grant.effect_id),
            other => panic!("expected the same grant, got {other:?}"),
        }
    }

    let done = [
        CompleteCall::new(
            &grants[0].effect_id,
            grants[0].attempt,
            Completion::Result(b"PNR-1".to_vec()),
        ),
        CompleteCall::new("not-an-effect-id", 1, Completion::Result(b"?".to_vec())),
        CompleteCall::new(
            &grants[1].effect_id,
            grants[1].attempt,
            Completion::FailedBeforeInput("hotel API refused the connection".into()),
        ),
    ];
    let results = client.complete_batch(&done).await.unwrap();
    assert_eq!(results[0].as_ref().unwrap().state, EffectState::Completed);
    assert!(
        matches!(
            &results[1],
            Err(Error::Rpc {
                code: tonic::Code::InvalidArgument,
                ..
            })
        ),
        "{:?}",
        results[1]
    );
    assert_eq!(
        results[2].as_ref().unwrap().state,
        EffectState::FailedBeforeInput
    );

    // Afterwards the flight replays, the hotel is granted again under the same key.
    let after = client.begin_batch(&calls[..2]).await.unwrap();
    match &after[0].as_ref().unwrap().decision {
        Decision::Replay(receipt) => assert_eq!(receipt.result, b"PNR-1".to_vec()),
        other => panic!("expected a replay, got {other:?}"),
    }
    match &after[1].as_ref().unwrap().decision {
        Decision::Execute(g) => assert_eq!(g.downstream_key, grants[1].downstream_key),
        other => panic!("expected a re-grant, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_batch_is_a_structured_error() {
    let server = TestServer::start().await;
    let client = server.client().await;
    match client.begin_batch(&[]).await {
        Err(Error::Rpc {
            code,
            field_violations,
            ..
        }) => {
            assert_eq!(code, tonic::Code::InvalidArgument);
            assert_eq!(field_violations[0].field, "calls");
        }
        other => panic!("expected INVALID_ARGUMENT, got {other:?}"),
    }
    // A batch whose every call is malformed still answers per call.
    let only_bad = [EffectCall::new(unique("run"), PAY, "{not json")];
    let results = client.begin_batch(&only_bad).await.unwrap();
    assert!(
        matches!(
            &results[..],
            [Err(Error::Rpc {
                code: tonic::Code::InvalidArgument,
                ..
            })]
        ),
        "{results:?}"
    );
}
