//! W3C Trace Context (`traceparent`): the one parser the server and the MCP gateway share, and
//! the per-RPC span that carries a caller's trace into the server's logs.
//!
//! A caller (the Rust and Python clients, the MCP gateway forwarding a host's `_meta`) sends
//! `traceparent` as gRPC metadata. The server opens one `fence.rpc` span per request holding
//! the RPC path and, when the header is valid, its trace id and parent span id, so every log
//! line of that request can be joined with the caller's trace. An invalid header is ignored,
//! as the W3C recommendation says a receiver must (the request itself is unaffected).

use std::fmt;

/// The metadata (HTTP header) name of a W3C trace context.
pub const TRACEPARENT: &str = "traceparent";

/// A parsed, valid `traceparent`: version 00 semantics (later versions are read as 00, as the
/// recommendation requires of a receiver that knows only 00).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceParent {
    /// The trace id: 16 bytes, never all zero.
    pub trace_id: u128,
    /// The caller's span id (the parent of ours): 8 bytes, never all zero.
    pub parent_id: u64,
    /// The trace flags (bit 0: sampled).
    pub flags: u8,
}

impl TraceParent {
    /// Parses a `traceparent` value; `None` when it is not a valid one.
    pub fn parse(value: &str) -> Option<TraceParent> {
        let value = value.trim_matches([' ', '\t']);
        if !value.is_ascii() {
            return None;
        }
        let bytes = value.as_bytes();
        // version "-" trace-id "-" parent-id "-" flags = 2+1+32+1+16+1+2 = 55.
        if bytes.len() < 55 || bytes[2] != b'-' || bytes[35] != b'-' || bytes[52] != b'-' {
            return None;
        }
        let version = hex_u8(&value[0..2])?;
        // ff is forbidden; version 00 has exactly 55 characters; a later version may append
        // fields after another '-'.
        if version == 0xff
            || (version == 0 && bytes.len() != 55)
            || (bytes.len() > 55 && bytes[55] != b'-')
        {
            return None;
        }
        let trace_id = u128::from_str_radix(lower_hex(&value[3..35])?, 16).ok()?;
        let parent_id = u64::from_str_radix(lower_hex(&value[36..52])?, 16).ok()?;
        let flags = hex_u8(&value[53..55])?;
        if trace_id == 0 || parent_id == 0 {
            return None;
        }
        Some(TraceParent {
            trace_id,
            parent_id,
            flags,
        })
    }

    /// The trace id as 32 lowercase hex digits.
    pub fn trace_id_hex(&self) -> String {
        format!("{:032x}", self.trace_id)
    }

    /// The parent span id as 16 lowercase hex digits.
    pub fn parent_id_hex(&self) -> String {
        format!("{:016x}", self.parent_id)
    }
}

impl fmt::Display for TraceParent {
    /// The version 00 header value.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "00-{:032x}-{:016x}-{:02x}",
            self.trace_id, self.parent_id, self.flags
        )
    }
}

/// `s` when it is all lowercase hex digits (the recommendation allows no uppercase).
fn lower_hex(s: &str) -> Option<&str> {
    s.bytes()
        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        .then_some(s)
}

fn hex_u8(s: &str) -> Option<u8> {
    u8::from_str_radix(lower_hex(s)?, 16).ok()
}

/// The span of one RPC (tonic's `trace_fn`): the RPC, the caller's trace when its
/// `traceparent` is valid, and the fields the handler records once it knows them (the
/// decision, reason, tool, class and effect id; gen_ai's `execute_tool` names where they fit).
/// `otel.*` fields name and classify the span for OpenTelemetry (see `fenced --otlp-endpoint`).
/// A debug span: with neither debug logs nor trace export on, it is disabled and costs one
/// filter check.
pub fn rpc_span(request: &tonic::codegen::http::Request<()>) -> tracing::Span {
    let parent = request
        .headers()
        .get(TRACEPARENT)
        .and_then(|v| v.to_str().ok())
        .and_then(TraceParent::parse);
    call_span(request.uri().path(), parent)
}

/// The span of one call: an RPC ([`rpc_span`]) or one call of a Session stream (path
/// "/fence.v1.Fence/Session/Begin", a child of the stream's span unless `parent` names the
/// call's own trace).
pub fn call_span(path: &str, parent: Option<TraceParent>) -> tracing::Span {
    use tracing::field::Empty;
    // "/fence.v1.Fence/Begin" -> ("fence.v1.Fence", "Begin").
    let (service, method) = path
        .trim_start_matches('/')
        .split_once('/')
        .unwrap_or(("", path));
    let span = tracing::debug_span!(
        "fence.rpc",
        rpc = path,
        trace_id = Empty,
        parent_span_id = Empty,
        otel.name = path.trim_start_matches('/'),
        otel.kind = "server",
        otel.status_code = Empty,
        rpc.system = "grpc",
        rpc.service = service,
        rpc.method = method,
        rpc.grpc.status_code = Empty,
        gen_ai.operation.name = Empty,
        gen_ai.tool.name = Empty,
        gen_ai.tool.call.id = Empty,
        fence.run_id = Empty,
        fence.decision = Empty,
        fence.reason = Empty,
        fence.tool.class = Empty,
        fence.effect_id = Empty,
    );
    if let Some(p) = parent
        && !span.is_disabled()
    {
        span.record("trace_id", p.trace_id_hex());
        span.record("parent_span_id", p.parent_id_hex());
        #[cfg(feature = "rocksdb")]
        crate::otel::set_remote_parent(&span, &p);
    }
    span
}

/// Records a Begin's call and decision on the current RPC span (see [`rpc_span`]).
pub fn record_begin(cmd: &crate::ledger::BeginCmd, decision: &crate::ledger::Decision) {
    use crate::ledger::Decision as D;
    let span = tracing::Span::current();
    if span.is_disabled() {
        return;
    }
    span.record("gen_ai.operation.name", "execute_tool");
    span.record("gen_ai.tool.name", cmd.tool.as_str());
    if !cmd.step_key.is_empty() {
        span.record("gen_ai.tool.call.id", cmd.step_key.as_str());
    }
    span.record("fence.run_id", cmd.run_id.as_str());
    let (kind, receipt) = match decision {
        D::Execute { receipt, .. } => ("execute", Some(&**receipt)),
        D::Replay(receipt) => ("replay", Some(&**receipt)),
        D::InProgress { receipt, .. } => ("in_progress", Some(&**receipt)),
        D::Refused(r) => {
            span.record(
                "fence.reason",
                fence_proto::v1::ReasonCode::try_from(r.reason.code())
                    .map_or("UNKNOWN", |c| c.as_str_name()),
            );
            ("refused", r.receipt.as_deref())
        }
    };
    span.record("fence.decision", kind);
    if let Some(rec) = receipt {
        span.record("fence.effect_id", rec.id().to_string());
        span.record(
            "fence.tool.class",
            fence_proto::v1::OperationClass::try_from(rec.class)
                .map_or("UNKNOWN", |c| c.as_str_name()),
        );
    }
}

/// Records an RPC's gRPC status on the current RPC span.
pub fn record_status(code: tonic::Code) {
    let span = tracing::Span::current();
    if span.is_disabled() {
        return;
    }
    span.record("rpc.grpc.status_code", code as i32);
    // OpenTelemetry's gRPC conventions: a server span is an error only for these codes (the
    // others are the caller's to judge).
    use tonic::Code as C;
    if matches!(
        code,
        C::Unknown
            | C::DeadlineExceeded
            | C::Unimplemented
            | C::Internal
            | C::Unavailable
            | C::DataLoss
    ) {
        span.record("otel.status_code", "ERROR");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VALID: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn parses_the_recommendations_example() {
        let p = TraceParent::parse(VALID).unwrap();
        assert_eq!(p.trace_id_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(p.parent_id_hex(), "00f067aa0ba902b7");
        assert_eq!(p.flags, 1);
        assert_eq!(p.to_string(), VALID);
    }

    #[test]
    fn a_later_version_is_read_as_00_and_may_carry_more_fields() {
        let later = "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-comes-next";
        assert_eq!(
            TraceParent::parse(later).unwrap(),
            TraceParent::parse(VALID).unwrap()
        );
    }

    #[test]
    fn invalid_values_are_refused() {
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",
            "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x",
            "00-+bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e47é-00f067aa0ba902b7-01",
        ] {
            assert_eq!(TraceParent::parse(bad), None, "{bad:?}");
        }
    }
}
