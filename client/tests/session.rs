//! `Session` against the real server: the same decisions and errors as the unary methods,
//! shared by concurrent tasks, and a new stream after the old one broke.

mod common;

use common::{TestServer, unique};
use fence_client::{Completion, Decision, EffectCall, EffectState, Error, Grant};

fn charge(run: &str, step: &str) -> EffectCall {
    EffectCall::new(run, "payments.charge", r#"{"amount":4200,"to":"acme"}"#).step_key(step)
}

fn granted(decision: Decision) -> Grant {
    match decision {
        Decision::Execute(grant) => grant,
        other => panic!("expected Execute, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_decides_as_the_unary_methods_do() {
    let server = TestServer::start().await;
    let client = server.client().await;
    let session = client.session();
    let run = unique("run");

    let grant = granted(session.begin(&charge(&run, "pay")).await.unwrap().decision);
    let lease = session
        .heartbeat(&grant.effect_id, grant.attempt, 0, 0)
        .await
        .unwrap();
    assert_eq!(lease.state, EffectState::Running);
    let done = session
        .complete(
            &grant.effect_id,
            grant.attempt,
            0,
            Completion::Result(b"ch_1".to_vec()),
        )
        .await
        .unwrap();
    assert_eq!(done.state, EffectState::Completed);

    // A repeat replays on the session and through the unary method alike.
    for outcome in [
        session.begin(&charge(&run, "pay")).await.unwrap(),
        client.begin(&charge(&run, "pay")).await.unwrap(),
    ] {
        match outcome.decision {
            Decision::Replay(receipt) => {
                assert_eq!(receipt.effect_id, grant.effect_id);
                assert_eq!(receipt.result, b"ch_1");
            }
            other => panic!("expected Replay, got {other:?}"),
        }
    }

    // A different result for a completed effect: the structured refusal the unary call gets.
    let unary = client
        .complete(
            &grant.effect_id,
            grant.attempt,
            0,
            Completion::Result(b"x".to_vec()),
        )
        .await
        .unwrap_err();
    let streamed = session
        .complete(
            &grant.effect_id,
            grant.attempt,
            0,
            Completion::Result(b"x".to_vec()),
        )
        .await
        .unwrap_err();
    assert_eq!(streamed.reason(), unary.reason());
    assert!(streamed.reason().is_some(), "{streamed:?}");
    // A malformed call names its field, and the session goes on.
    let bad = session
        .begin(&EffectCall::new("", "payments.charge", "{}"))
        .await
        .unwrap_err();
    match &bad {
        Error::Rpc {
            code,
            field_violations,
            ..
        } => {
            assert_eq!(*code, tonic::Code::InvalidArgument);
            assert_eq!(field_violations[0].field, "run_id");
        }
        other => panic!("expected INVALID_ARGUMENT, got {other:?}"),
    }
    let next = EffectCall::new(&run, "payments.charge", r#"{"amount":1,"to":"acme"}"#);
    granted(
        session
            .begin(&next.step_key("next"))
            .await
            .unwrap()
            .decision,
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_tasks_share_one_session_and_each_gets_its_own_answer() {
    let server = TestServer::start().await;
    let session = server.client().await.session();
    let tasks: Vec<_> = (0..64)
        .map(|i| {
            let session = session.clone();
            tokio::spawn(async move {
                let run = format!("agent-{i}");
                let grant = granted(session.begin(&charge(&run, "pay")).await?.decision);
                let receipt = session
                    .complete(
                        &grant.effect_id,
                        grant.attempt,
                        0,
                        Completion::Result(format!("ch_{i}").into_bytes()),
                    )
                    .await?;
                Ok::<_, Error>((run, receipt))
            })
        })
        .collect();
    for task in tasks {
        let (run, receipt) = task.await.unwrap().unwrap();
        assert_eq!(receipt.run_id, run);
        let i = run.trim_start_matches("agent-");
        assert_eq!(receipt.result, format!("ch_{i}").into_bytes());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_the_server_restarts_the_session_opens_a_new_stream() {
    let mut server = TestServer::start().await;
    let session = server.client().await.session();
    let run = unique("run");
    let call = charge(&run, "pay").request_id("req-1");
    let grant = granted(session.begin(&call).await.unwrap().decision);

    server.restart().await;
    // The old stream ended with the shutdown; the first call after it may still meet the
    // broken stream (UNAVAILABLE), never a wrong answer, and a retry goes through.
    let mut again = session.begin(&call).await;
    if let Err(e) = &again {
        assert!(
            matches!(e, Error::Rpc { code, .. } if *code == tonic::Code::Unavailable),
            "{e:?}"
        );
        again = session.begin(&call).await;
    }
    // The same request id after the restart: the same grant, recorded before it.
    let again = granted(again.unwrap().decision);
    assert_eq!(again.effect_id, grant.effect_id);
    assert_eq!(again.attempt, grant.attempt);
    // Another request for the step while the grant runs: never a second grant.
    let second = session
        .begin(&charge(&run, "pay").request_id("req-2"))
        .await
        .unwrap()
        .decision;
    assert!(
        matches!(second, Decision::InProgress { .. }),
        "a second request for a running effect was {second:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_built_with_sessions_runs_the_protocol_on_one_stream() {
    use fence_client::{OutcomeSource, ToolError};
    let server = TestServer::start().await;
    let (client, faults) = server.faulty_client_with(|b| b.sessions(true)).await;
    let run = unique("run");
    let call = charge(&run, "pay");
    let executed = client
        .run_effect(&call, |ctx| async move {
            Ok::<_, ToolError>(format!("charged:{}", ctx.downstream_key).into_bytes())
        })
        .await
        .unwrap();
    assert_eq!(executed.source, OutcomeSource::Executed);
    let replayed = client
        .run_effect(&call, |_| async {
            panic!("a recorded effect must not run again")
        })
        .await
        .unwrap();
    assert_eq!(replayed.source, OutcomeSource::Replayed);
    assert_eq!(replayed.result, executed.result);
    // Every Begin and Complete went over one Session stream; no unary call was sent.
    assert_eq!(faults.sent("Session"), 1);
    assert_eq!(faults.sent("Begin"), 0);
    assert_eq!(faults.sent("Complete"), 0);
}
