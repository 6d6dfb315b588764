//! OpenTelemetry export: `fenced --otlp-endpoint` sends one span per RPC to an OTLP collector
//! (here an in-process one, speaking the OTLP/gRPC trace service), as a child of the caller's
//! `traceparent`, with the decision, reason, tool, class and effect id as attributes.

mod common;

use std::sync::{Arc, Mutex};

use common::fenced::Fenced;
use fence_proto::v1 as pb;
use fence_proto::v1::decision::Outcome as O;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use tonic::metadata::MetadataValue;

const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PARENT_ID: &str = "00f067aa0ba902b7";

/// Keeps every export it receives.
#[derive(Clone, Default)]
struct Collector {
    received: Arc<Mutex<Vec<ExportTraceServiceRequest>>>,
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.received.lock().unwrap().push(request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

fn attr<'a>(span: &'a Span, key: &str) -> Option<&'a Value> {
    span.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref()?.value.as_ref())
}

fn text<'a>(span: &'a Span, key: &str) -> Option<&'a str> {
    match attr(span, key)? {
        Value::StringValue(s) => Some(s),
        _ => None,
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn begin(step: &str, amount: u32) -> tonic::Request<pb::BeginRequest> {
    let mut request = tonic::Request::new(pb::BeginRequest {
        run_id: "order-7".into(),
        tool: "pay".into(),
        step_key: step.into(),
        arguments_json: format!(r#"{{"amount":{amount}}}"#),
        ..Default::default()
    });
    request.metadata_mut().insert(
        "traceparent",
        MetadataValue::try_from(format!("00-{TRACE_ID}-{PARENT_ID}-01")).unwrap(),
    );
    request
}

/// An in-process OTLP collector and a real `fenced` exporting to it.
struct Traced {
    collector: Collector,
    serving: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
    fenced: Fenced,
    client: pb::fence_client::FenceClient<tonic::transport::Channel>,
    _dir: tempfile::TempDir,
}

impl Traced {
    async fn start() -> Traced {
        let collector = Collector::default();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let serving = tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(TraceServiceServer::new(collector.clone()))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        let dir = tempfile::tempdir().unwrap();
        let fenced = Fenced::start(dir.path(), &["--otlp-endpoint", &endpoint]);
        let client = pb::fence_client::FenceClient::connect(fenced.url())
            .await
            .unwrap();
        Traced {
            collector,
            serving,
            fenced,
            client,
            _dir: dir,
        }
    }

    /// Stops `fenced` (which flushes what its exporter still holds) and the collector.
    fn stop(&mut self) {
        assert!(self.fenced.terminate().success());
        self.serving.abort();
    }
}

/// Every span the collector received.
fn spans_of(collector: &Collector) -> Vec<Span> {
    collector
        .received
        .lock()
        .unwrap()
        .iter()
        .flat_map(|r| &r.resource_spans)
        .flat_map(|r| &r.scope_spans)
        .flat_map(|s| s.spans.clone())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_session_call_is_a_span_of_its_own_trace_or_of_the_streams() {
    use pb::session_request::Call;
    let mut traced = Traced::start().await;
    let (calls, outgoing) = tokio::sync::mpsc::channel(4);
    let mut answers = traced
        .client
        .session(tokio_stream::wrappers::ReceiverStream::new(outgoing))
        .await
        .unwrap()
        .into_inner();
    // The Begin carries its own trace; the Heartbeat does not.
    calls
        .send(pb::SessionRequest {
            id: 1,
            call: Some(Call::Begin(begin("charge", 5).into_inner())),
            traceparent: format!("00-{TRACE_ID}-{PARENT_ID}-01"),
        })
        .await
        .unwrap();
    let answer = answers.message().await.unwrap().unwrap();
    let Some(pb::session_response::Result::Begin(begun)) = answer.result else {
        panic!("{answer:?}")
    };
    let Some(O::Execute(grant)) = begun.decision.and_then(|d| d.outcome) else {
        panic!("expected a grant")
    };
    calls
        .send(pb::SessionRequest {
            id: 2,
            call: Some(Call::Heartbeat(pb::HeartbeatRequest {
                effect_id: grant.effect_id.clone(),
                attempt: grant.attempt,
                ..Default::default()
            })),
            ..Default::default()
        })
        .await
        .unwrap();
    answers.message().await.unwrap().unwrap();
    drop(calls);
    while answers.message().await.unwrap().is_some() {}
    traced.stop();

    let spans = spans_of(&traced.collector);
    let named = |name: &str| {
        spans
            .iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("no {name} span in {spans:#?}"))
    };
    let begin = named("fence.v1.Fence/Session/Begin");
    assert_eq!(hex(&begin.trace_id), TRACE_ID);
    assert_eq!(hex(&begin.parent_span_id), PARENT_ID);
    assert_eq!(text(begin, "rpc.method"), Some("Session/Begin"));
    assert_eq!(text(begin, "fence.decision"), Some("execute"));
    assert_eq!(
        text(begin, "fence.effect_id"),
        Some(grant.effect_id.as_str())
    );
    assert_eq!(
        attr(begin, "rpc.grpc.status_code"),
        Some(&Value::IntValue(0))
    );
    // Without a traceparent of its own, a call is a child of its stream's span.
    let stream = named("fence.v1.Fence/Session");
    let heartbeat = named("fence.v1.Fence/Session/Heartbeat");
    assert_eq!(heartbeat.parent_span_id, stream.span_id);
    assert_eq!(heartbeat.trace_id, stream.trace_id);
    assert_eq!(
        attr(heartbeat, "rpc.grpc.status_code"),
        Some(&Value::IntValue(0))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_rpc_is_exported_as_a_span_of_the_callers_trace_with_its_decision() {
    let mut traced = Traced::start().await;
    let c = &mut traced.client;
    let begun = c.begin(begin("charge", 5)).await.unwrap().into_inner();
    let Some(O::Execute(grant)) = begun.decision.and_then(|d| d.outcome) else {
        panic!("expected a grant")
    };
    c.complete(pb::CompleteRequest {
        effect_id: grant.effect_id.clone(),
        attempt: grant.attempt,
        outcome: Some(pb::complete_request::Outcome::Result(b"ch_1".to_vec())),
        ..Default::default()
    })
    .await
    .unwrap();
    c.begin(begin("charge", 5)).await.unwrap();
    c.begin(begin("charge", 6)).await.unwrap();
    traced.stop();

    let received = traced.collector.received.lock().unwrap();
    let resources: Vec<_> = received.iter().flat_map(|r| &r.resource_spans).collect();
    assert!(!resources.is_empty(), "no spans were exported");
    let service = resources[0]
        .resource
        .as_ref()
        .and_then(|r| r.attributes.iter().find(|kv| kv.key == "service.name"))
        .and_then(|kv| kv.value.as_ref()?.value.as_ref());
    assert_eq!(service, Some(&Value::StringValue("fenced".into())));
    let spans: Vec<&Span> = resources
        .iter()
        .flat_map(|r| &r.scope_spans)
        .flat_map(|s| &s.spans)
        .collect();
    let begins: Vec<&Span> = spans
        .iter()
        .copied()
        .filter(|s| s.name == "fence.v1.Fence/Begin")
        .collect();
    assert_eq!(begins.len(), 3, "{spans:#?}");
    for span in &begins {
        // A server span of the caller's trace, child of the caller's span.
        assert_eq!(hex(&span.trace_id), TRACE_ID);
        assert_eq!(hex(&span.parent_span_id), PARENT_ID);
        assert_eq!(span.kind, 2, "SPAN_KIND_SERVER");
        assert_eq!(text(span, "rpc.system"), Some("grpc"));
        assert_eq!(text(span, "rpc.method"), Some("Begin"));
        assert_eq!(text(span, "gen_ai.operation.name"), Some("execute_tool"));
        assert_eq!(text(span, "gen_ai.tool.name"), Some("pay"));
        assert_eq!(text(span, "gen_ai.tool.call.id"), Some("charge"));
        assert_eq!(text(span, "fence.run_id"), Some("order-7"));
        assert_eq!(
            text(span, "fence.effect_id"),
            Some(grant.effect_id.as_str())
        );
        assert_eq!(text(span, "fence.tool.class"), Some("NON_RETRYABLE"));
        assert_eq!(
            attr(span, "rpc.grpc.status_code"),
            Some(&Value::IntValue(0))
        );
    }
    let decisions: Vec<(Option<&str>, Option<&str>)> = begins
        .iter()
        .map(|s| (text(s, "fence.decision"), text(s, "fence.reason")))
        .collect();
    for expected in [
        (Some("execute"), None),
        (Some("replay"), None),
        (Some("refused"), Some("ARGUMENT_MISMATCH")),
    ] {
        assert!(decisions.contains(&expected), "{decisions:?}");
    }
    let complete = spans
        .iter()
        .find(|s| s.name == "fence.v1.Fence/Complete")
        .expect("the Complete span");
    // Sent without a traceparent: the root of a trace of its own.
    assert!(complete.parent_span_id.is_empty(), "{complete:?}");
    assert_ne!(hex(&complete.trace_id), TRACE_ID);
    assert_eq!(
        attr(complete, "rpc.grpc.status_code"),
        Some(&Value::IntValue(0))
    );
    assert_eq!(attr(complete, "fence.decision"), None);
}
