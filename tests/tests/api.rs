//! End-to-end: the real server on an ephemeral port, through the generated gRPC client.

use fence_proto::v1 as pb;
use fence_proto::v1::decision::Outcome as O;
use fence_tests::*;
use tonic::Code;

async fn register_bank(c: &mut pb::fence_client::FenceClient<tonic::transport::Channel>) {
    c.register_tool(pb::RegisterToolRequest {
        tool: Some(pb::ToolSpec {
            name: "bank.transfer".into(),
            class: pb::OperationClass::NonRetryable as i32,
            intent_schema: Some(pb::IntentSchema {
                volatile_fields: vec!["reference".into(), "ts".into()],
                ..Default::default()
            }),
            ..Default::default()
        }),
    })
    .await
    .unwrap();
}

fn transfer(to: &str, reference: &str) -> String {
    format!(r#"{{"to":"{to}","amount":100,"reference":"{reference}","ts":"{reference}"}}"#)
}

#[tokio::test]
async fn grant_complete_replay_and_mismatch_over_grpc() {
    let srv = TestServer::start().await;
    let mut c = srv.client().await;
    register_bank(&mut c).await;
    let req = pb::BeginRequest {
        step_key: "run-1:pay".into(),
        ..begin("run-1", "bank.transfer", &transfer("bob", "u1"))
    };
    let resp = c.begin(req.clone()).await.unwrap().into_inner();
    assert_eq!(resp.epoch, 1);
    let O::Execute(ex) = outcome(resp) else {
        panic!("expected execute")
    };
    assert!(!ex.effect_id.is_empty() && ex.downstream_key.starts_with("fence-"));
    assert_eq!(ex.attempt, 1);

    let done = c
        .complete(pb::CompleteRequest {
            effect_id: ex.effect_id.clone(),
            attempt: 1,
            outcome: Some(pb::complete_request::Outcome::Result(b"tx-1".to_vec())),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        done.receipt.unwrap().state,
        pb::EffectState::Completed as i32
    );

    let drifted = pb::BeginRequest {
        arguments_json: transfer("bob", "u2"),
        ..req.clone()
    };
    let O::Replay(rp) = outcome(c.begin(drifted).await.unwrap().into_inner()) else {
        panic!("expected replay")
    };
    let receipt = rp.receipt.unwrap();
    assert_eq!(receipt.result, b"tx-1");
    assert_eq!(receipt.effect_id, ex.effect_id);
    assert_eq!(receipt.intent_fingerprint.len(), 64);

    let redirected = pb::BeginRequest {
        arguments_json: transfer("carol", "u3"),
        ..req
    };
    let O::Refused(r) = outcome(c.begin(redirected).await.unwrap().into_inner()) else {
        panic!("expected refusal")
    };
    assert_eq!(r.reason, pb::ReasonCode::ArgumentMismatch as i32);
    assert_eq!(r.recovery, pb::RecoveryAction::FixArgument as i32);
    assert!(!r.message.is_empty());
    assert_eq!(r.receipt.unwrap().effect_id, ex.effect_id);
}

#[tokio::test]
async fn malformed_requests_get_invalid_argument_naming_the_field() {
    let srv = TestServer::start().await;
    let mut c = srv.client().await;
    for (req, field) in [
        (begin("", "t", "{}"), "run_id"),
        (begin("  ", "t", "{}"), "run_id"),
        (begin(&"r".repeat(300), "t", "{}"), "run_id"),
        (begin("r", "t", "{not json"), "arguments_json"),
        (begin("r", "", "{}"), "tool"),
    ] {
        let s = c.begin(req).await.unwrap_err();
        assert_eq!(s.code(), Code::InvalidArgument, "{s:?}");
        assert_eq!(bad_field(&s).as_deref(), Some(field));
    }
    // Unknown enum values and missing oneofs.
    let s = c
        .register_tool(pb::RegisterToolRequest {
            tool: Some(pb::ToolSpec {
                name: "t".into(),
                class: 42,
                ..Default::default()
            }),
        })
        .await
        .unwrap_err();
    assert_eq!(
        (s.code(), bad_field(&s).as_deref()),
        (Code::InvalidArgument, Some("tool.class"))
    );
    let s = c
        .register_tool(pb::RegisterToolRequest { tool: None })
        .await
        .unwrap_err();
    assert_eq!(bad_field(&s).as_deref(), Some("tool"));
    let s = c
        .register_tool(pb::RegisterToolRequest {
            tool: Some(pb::ToolSpec {
                name: "t".into(),
                class: 4,
                intent_schema: Some(pb::IntentSchema {
                    string_normalization: 77,
                    ..Default::default()
                }),
                ..Default::default()
            }),
        })
        .await
        .unwrap_err();
    assert_eq!(
        bad_field(&s).as_deref(),
        Some("tool.intent_schema.string_normalization")
    );
    let s = c
        .complete(pb::CompleteRequest {
            effect_id: "e00".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(bad_field(&s).as_deref(), Some("outcome"));
    let s = c
        .query_outcome(pb::QueryOutcomeRequest { key: None })
        .await
        .unwrap_err();
    assert_eq!(bad_field(&s).as_deref(), Some("key"));
    // Nothing was created by any of it.
    let s = c
        .get_run(pb::GetRunRequest { run_id: "r".into() })
        .await
        .unwrap_err();
    assert_eq!(s.code(), Code::NotFound);
}

#[tokio::test]
async fn completion_refusals_are_structured_statuses() {
    let srv = TestServer::start().await;
    let mut c = srv.client().await;
    let O::Execute(ex) = outcome(c.begin(begin("r", "t", "{}")).await.unwrap().into_inner()) else {
        panic!()
    };
    let complete = |id: &str, result: &[u8]| pb::CompleteRequest {
        effect_id: id.into(),
        outcome: Some(pb::complete_request::Outcome::Result(result.to_vec())),
        ..Default::default()
    };
    c.complete(complete(&ex.effect_id, b"a")).await.unwrap();
    c.complete(complete(&ex.effect_id, b"a")).await.unwrap();
    let s = c.complete(complete(&ex.effect_id, b"b")).await.unwrap_err();
    assert_eq!(s.code(), Code::FailedPrecondition);
    assert_eq!(reason_of(&s).as_deref(), Some("RESULT_CONFLICT"));

    // A well-formed id of an effect that does not exist.
    let mut ghost = ex.effect_id.clone();
    ghost.replace_range(ghost.len() - 1.., "f");
    let s = c.complete(complete(&ghost, b"a")).await.unwrap_err();
    assert_eq!(
        (s.code(), reason_of(&s).as_deref()),
        (Code::NotFound, Some("UNKNOWN_RECORD"))
    );

    // Reconcile without evidence.
    let s = c
        .reconcile(pb::ReconcileRequest {
            effect_id: ex.effect_id.clone(),
            evidence: " ".into(),
            outcome: Some(pb::reconcile_request::Outcome::CompletedResult(
                b"a".to_vec(),
            )),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(
        (s.code(), reason_of(&s).as_deref()),
        (Code::InvalidArgument, Some("EVIDENCE_REQUIRED"))
    );
}

#[tokio::test]
async fn tenants_cannot_see_or_touch_each_other() {
    let srv = TestServer::start().await;
    let mut c = srv.client().await;
    let resp = c
        .begin(as_tenant("acme", begin("run", "t", r#"{"a":1}"#)))
        .await
        .unwrap()
        .into_inner();
    let O::Execute(ex) = outcome(resp) else {
        panic!()
    };
    let done = |t: &str| {
        as_tenant(
            t,
            pb::CompleteRequest {
                effect_id: ex.effect_id.clone(),
                outcome: Some(pb::complete_request::Outcome::Result(b"x".to_vec())),
                ..Default::default()
            },
        )
    };
    // Beta guessing acme's effect id finds nothing and changes nothing.
    assert_eq!(
        c.complete(done("beta")).await.unwrap_err().code(),
        Code::NotFound
    );
    let q = c
        .query_outcome(as_tenant(
            "beta",
            pb::QueryOutcomeRequest {
                key: Some(pb::query_outcome_request::Key::EffectId(
                    ex.effect_id.clone(),
                )),
            },
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(q.state, pb::EffectState::NotFound as i32);
    assert_eq!(
        c.list_effects(as_tenant(
            "beta",
            pb::ListEffectsRequest {
                run_id: "run".into(),
                ..Default::default()
            }
        ))
        .await
        .unwrap_err()
        .code(),
        Code::NotFound
    );
    let s = c
        .reconcile(as_tenant(
            "beta",
            pb::ReconcileRequest {
                effect_id: ex.effect_id.clone(),
                evidence: "forged".into(),
                outcome: Some(pb::reconcile_request::Outcome::FailedBeforeInput(
                    pb::FailedBeforeInput { detail: "x".into() },
                )),
                ..Default::default()
            },
        ))
        .await
        .unwrap_err();
    assert_eq!(s.code(), Code::NotFound);
    let s = c
        .heartbeat(as_tenant(
            "beta",
            pb::HeartbeatRequest {
                effect_id: ex.effect_id.clone(),
                ..Default::default()
            },
        ))
        .await
        .unwrap_err();
    assert_eq!(s.code(), Code::NotFound);
    // Acme's credential, once spent, is not beta's to see; beta's identical token is its own.
    let spend = |t: &str, run: &str| {
        as_tenant(
            t,
            pb::BeginRequest {
                credentials: vec![pb::CredentialUse {
                    token: b"otp".to_vec(),
                    budget: 1,
                }],
                ..begin(run, "t", r#"{"spend":1}"#)
            },
        )
    };
    assert!(matches!(
        outcome(c.begin(spend("acme", "run2")).await.unwrap().into_inner()),
        O::Execute(_)
    ));
    let s = c
        .get_credential(as_tenant(
            "beta",
            pb::GetCredentialRequest {
                token: b"otp".to_vec(),
            },
        ))
        .await
        .unwrap_err();
    assert_eq!(s.code(), Code::NotFound);
    assert!(matches!(
        outcome(c.begin(spend("beta", "run2")).await.unwrap().into_inner()),
        O::Execute(_)
    ));
    // The same run id in beta is a different run: beta's identical call executes.
    let resp = c
        .begin(as_tenant("beta", begin("run", "t", r#"{"a":1}"#)))
        .await
        .unwrap()
        .into_inner();
    assert!(matches!(outcome(resp), O::Execute(_)));
    c.complete(done("acme")).await.unwrap();
}

#[tokio::test]
async fn health_and_reflection_are_served() {
    let srv = TestServer::start().await;
    let mut health = tonic_health::pb::health_client::HealthClient::new(srv.channel().await);
    let r = health
        .check(tonic_health::pb::HealthCheckRequest {
            service: "fence.v1.Fence".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        r.status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );

    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    let mut refl = ServerReflectionClient::new(srv.channel().await);
    let req = tonic_reflection::pb::v1::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut stream = refl
        .server_reflection_info(tokio_stream::iter(vec![req]))
        .await
        .unwrap()
        .into_inner();
    let resp = stream.message().await.unwrap().unwrap();
    let Some(MessageResponse::ListServicesResponse(list)) = resp.message_response else {
        panic!()
    };
    let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    assert!(names.contains(&"fence.v1.Fence".to_string()), "{names:?}");
}

#[tokio::test]
async fn bearer_tokens_map_to_tenants() {
    let text = format!(
        "acme {}\nold {} revoked\n",
        fence_server::auth::Auth::hash_token("s3cret"),
        fence_server::auth::Auth::hash_token("gone")
    );
    let opts = Options {
        auth: fence_server::auth::Auth::from_tokens_text(&text).unwrap(),
        ..Options::default()
    };
    let srv = TestServer::start_with(opts).await;
    let mut c = srv.client().await;
    let with = |token: Option<&str>| {
        let mut r = tonic::Request::new(pb::StartRunRequest { run_id: "r".into() });
        if let Some(t) = token {
            r.metadata_mut()
                .insert("authorization", format!("Bearer {t}").parse().unwrap());
        }
        r
    };
    assert_eq!(
        c.start_run(with(None)).await.unwrap_err().code(),
        Code::Unauthenticated
    );
    assert_eq!(
        c.start_run(with(Some("wrong"))).await.unwrap_err().code(),
        Code::Unauthenticated
    );
    assert_eq!(
        c.start_run(with(Some("gone"))).await.unwrap_err().code(),
        Code::Unauthenticated
    );
    assert!(
        c.start_run(with(Some("s3cret")))
            .await
            .unwrap()
            .into_inner()
            .created
    );
    let mut r = with(Some("s3cret"));
    r.metadata_mut()
        .insert("x-fence-tenant", "other".parse().unwrap());
    assert_eq!(
        c.start_run(r).await.unwrap_err().code(),
        Code::PermissionDenied
    );
}

#[tokio::test]
async fn a_graceful_restart_keeps_everything() {
    let srv = TestServer::start().await;
    let mut c = srv.client().await;
    let O::Execute(ex) = outcome(c.begin(begin("r", "t", "{}")).await.unwrap().into_inner()) else {
        panic!()
    };
    c.complete(pb::CompleteRequest {
        effect_id: ex.effect_id.clone(),
        outcome: Some(pb::complete_request::Outcome::Result(b"kept".to_vec())),
        ..Default::default()
    })
    .await
    .unwrap();
    drop(c);
    let (dir, clock) = srv.stop().await;
    let srv = TestServer::start_in(dir, clock, Options::default()).await;
    let mut c = srv.client().await;
    let q = c
        .query_outcome(pb::QueryOutcomeRequest {
            key: Some(pb::query_outcome_request::Key::EffectId(ex.effect_id)),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(q.receipt.unwrap().result, b"kept");
}

#[tokio::test]
async fn a_tenant_over_its_rate_gets_resource_exhausted_and_others_do_not() {
    let limit = std::sync::Arc::new(fence_server::quota::TenantRateLimit::new(1, 3));
    let srv = TestServer::start_with(Options {
        rate_limit: Some(limit),
        ..Options::default()
    })
    .await;
    let mut c = srv.client().await;
    let mut refused = None;
    for i in 0..6 {
        match c
            .start_run(as_tenant(
                "noisy",
                pb::StartRunRequest {
                    run_id: format!("r{i}"),
                },
            ))
            .await
        {
            Ok(_) => {}
            Err(s) => {
                refused = Some((i, s));
                break;
            }
        }
    }
    let (i, s) = refused.expect("the burst of 3 at 1/s must run out within 6 immediate calls");
    assert!(i >= 3);
    assert_eq!(s.code(), Code::ResourceExhausted);
    assert_eq!(reason_of(&s).as_deref(), Some("LIMIT_EXCEEDED"));
    // Other tenants keep their own budget.
    c.start_run(as_tenant(
        "quiet",
        pb::StartRunRequest { run_id: "r".into() },
    ))
    .await
    .unwrap();
}

/// Sends `body` as the raw protobuf of a `fence.v1.Fence/Begin` request.
async fn raw_begin(channel: tonic::transport::Channel, body: Vec<u8>) -> tonic::Status {
    use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};

    #[derive(Default)]
    struct Raw;
    struct RawEncoder;
    struct RawDecoder;
    impl Encoder for RawEncoder {
        type Item = Vec<u8>;
        type Error = tonic::Status;
        fn encode(&mut self, item: Vec<u8>, buf: &mut EncodeBuf<'_>) -> Result<(), tonic::Status> {
            use bytes::BufMut;
            buf.put_slice(&item);
            Ok(())
        }
        fn buffer_settings(&self) -> BufferSettings {
            BufferSettings::default()
        }
    }
    impl Decoder for RawDecoder {
        type Item = Vec<u8>;
        type Error = tonic::Status;
        fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<Vec<u8>>, tonic::Status> {
            use bytes::Buf;
            Ok(Some(buf.copy_to_bytes(buf.remaining()).to_vec()))
        }
        fn buffer_settings(&self) -> BufferSettings {
            BufferSettings::default()
        }
    }
    impl Codec for Raw {
        type Encode = Vec<u8>;
        type Decode = Vec<u8>;
        type Encoder = RawEncoder;
        type Decoder = RawDecoder;
        fn encoder(&mut self) -> RawEncoder {
            RawEncoder
        }
        fn decoder(&mut self) -> RawDecoder {
            RawDecoder
        }
    }

    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let path = tonic::codegen::http::uri::PathAndQuery::from_static("/fence.v1.Fence/Begin");
    grpc.unary(tonic::Request::new(body), path, Raw)
        .await
        .expect_err("a body that does not decode is refused")
}

/// A body that is not a protobuf message is the caller's fault: INVALID_ARGUMENT (which
/// clients do not retry), naming the message.
#[tokio::test]
async fn a_request_body_that_does_not_decode_is_invalid_argument() {
    let srv = TestServer::start().await;
    for body in [
        vec![0xff, 0xff, 0xff],       // field 0x1fff.. with an invalid wire type
        vec![0x0a, 0x10, b'r'],       // a string field whose length runs past the end
        vec![0x08, 0xff, 0xff, 0xff], // a truncated varint
    ] {
        let status = raw_begin(srv.channel().await, body.clone()).await;
        assert_eq!(status.code(), Code::InvalidArgument, "{body:?}: {status:?}");
        assert!(
            status.message().contains("fence.v1.BeginRequest"),
            "{}",
            status.message()
        );
    }
}
