//! OpenTelemetry traces: with `fenced --otlp-endpoint URL`, the per-RPC spans of
//! [`crate::trace::rpc_span`] are exported over OTLP/gRPC, each a child of the caller's W3C
//! `traceparent` when it sent one. Off by default: no exporter, no layer, and the spans stay
//! disabled debug spans.

use opentelemetry::trace::{
    SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState, TracerProvider,
};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::{Layer, filter::Filtered};

use crate::trace::TraceParent;

/// The exporter's pipeline; [`Exporter::shutdown`] sends what is still buffered.
pub struct Exporter {
    provider: SdkTracerProvider,
}

impl Exporter {
    /// Flushes the spans still buffered and stops the exporter.
    pub fn shutdown(self) {
        if let Err(e) = self.provider.shutdown() {
            tracing::warn!(error = %e, "exporting the last spans failed");
        }
    }
}

/// The tracing layer exporting RPC spans to the OTLP collector at `endpoint`, and its
/// exporter. Only the RPC spans are exported (target `fence_server::trace`), whatever the log
/// level. Must be called inside the Tokio runtime (the gRPC exporter runs on it).
#[allow(clippy::type_complexity)] // the layer's type, spelled out once
pub fn layer<S>(
    endpoint: &str,
) -> Result<
    (
        Filtered<
            tracing_opentelemetry::OpenTelemetryLayer<S, opentelemetry_sdk::trace::Tracer>,
            Targets,
            S,
        >,
        Exporter,
    ),
    String,
>
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a>,
{
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(endpoint)
        .build()
        .map_err(|e| format!("cannot export traces to {endpoint}: {e}"))?;
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(
            Resource::builder()
                .with_service_name("fenced")
                .with_attribute(opentelemetry::KeyValue::new(
                    "service.version",
                    env!("CARGO_PKG_VERSION"),
                ))
                .build(),
        )
        .build();
    let tracer = provider.tracer("fenced");
    let layer = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        // The RPC spans only: their events are logs, kept in the log.
        .with_filter(Targets::new().with_target("fence_server::trace", tracing::Level::DEBUG));
    Ok((layer, Exporter { provider }))
}

/// Makes the caller's trace context the parent of `span` (a no-op unless spans are exported).
pub fn set_remote_parent(span: &tracing::Span, parent: &TraceParent) {
    let context = SpanContext::new(
        TraceId::from_bytes(parent.trace_id.to_be_bytes()),
        SpanId::from_bytes(parent.parent_id.to_be_bytes()),
        TraceFlags::new(parent.flags),
        true,
        TraceState::default(),
    );
    let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(context));
}
