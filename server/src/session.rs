//! The Session RPC: an agent's Begin, Complete and Heartbeat calls as messages on one
//! long-lived bidirectional stream, decided exactly as their unary RPCs are.
//!
//! This module owns what a stream adds around the decisions: reading calls, taking the
//! tenant's rate limit per call, bounding the calls in flight (the server stops reading while
//! the bound is reached, so HTTP/2 flow control holds the rest), handing each call to its
//! run's sequencer without waiting, and writing each answer as its group becomes durable.
//! When the server shuts down a stream stops reading, answers what it already took, and ends
//! with UNAVAILABLE, so a graceful shutdown never waits on a caller's idle stream.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use fence_proto::v1 as pb;
use pb::session_request::Call;
use pb::session_response::Result as Answer;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, watch};
use tokio_stream::Stream;
use tokio_stream::StreamExt as _;
use tonic::{Status, Streaming};
use tracing::Instrument as _;

use crate::ledger::{Ledger, LedgerError};
use crate::quota::TenantRateLimit;
use crate::sequencer::Sequencer;
use crate::service;
use crate::store::Store;
use crate::trace::TraceParent;

/// The answers of one Session stream, as tonic sends them.
pub type SessionStream = Pin<Box<dyn Stream<Item = Result<pb::SessionResponse, Status>> + Send>>;

/// Calls of one stream decided at once by default (`--max-session-in-flight`).
pub const DEFAULT_MAX_IN_FLIGHT: usize = 256;

/// What every stream of a server shares.
pub(crate) struct Sessions<S> {
    /// What calls are prepared against before their sequencer takes them.
    pub(crate) ledger: Arc<Ledger<S>>,
    pub(crate) sequencer: Arc<Sequencer<S>>,
    pub(crate) rate_limit: Option<Arc<TenantRateLimit>>,
    pub(crate) max_in_flight: usize,
    /// Becomes `true` when the server begins its graceful shutdown.
    pub(crate) stopping: watch::Receiver<bool>,
}

impl<S> Clone for Sessions<S> {
    fn clone(&self) -> Self {
        Self {
            ledger: self.ledger.clone(),
            sequencer: self.sequencer.clone(),
            rate_limit: self.rate_limit.clone(),
            max_in_flight: self.max_in_flight,
            stopping: self.stopping.clone(),
        }
    }
}

/// An answer on its way out, holding its call's in-flight permit until tonic takes it to
/// send: what a stream has in flight is bounded by what its caller actually reads.
type Outgoing = (Reply, Option<OwnedSemaphorePermit>);

/// An answer, made when tonic takes it to send: a decided call's is converted to its message
/// there, on the stream's task, so the sequencer every call of the run waits on spends
/// nothing on it.
type Reply = Box<dyn FnOnce() -> Result<pb::SessionResponse, Status> + Send>;

/// The preparation of a session call on the stream's thread (its route, and what needs no
/// run state): the unary RPC's own.
type Prepare<S, Q, P> = fn(&Ledger<S>, &str, Q) -> Result<(u64, P), LedgerError>;

/// One decision of a session call: the unary RPC's own decision function.
type Decide<S, P, T> = fn(&Ledger<S>, &str, P) -> Result<T, LedgerError>;

impl<S: Store> Sessions<S> {
    /// Starts serving one stream of `tenant`'s calls and returns its answers.
    pub(crate) fn open(
        &self,
        tenant: Arc<str>,
        calls: Streaming<pb::SessionRequest>,
    ) -> SessionStream {
        let (tx, rx) = mpsc::unbounded_channel::<Outgoing>();
        let reader = Reader {
            sessions: self.clone(),
            tenant,
            tx,
            in_flight: Arc::new(Semaphore::new(self.max_in_flight.max(1))),
        };
        // The stream's span (its RPC's) stays the parent of every call's span.
        tokio::spawn(reader.run(calls).instrument(tracing::Span::current()));
        let answers =
            tokio_stream::wrappers::UnboundedReceiverStream::new(rx).map(|(reply, permit)| {
                drop(permit);
                reply()
            });
        Box::pin(answers)
    }
}

struct Reader<S> {
    sessions: Sessions<S>,
    tenant: Arc<str>,
    tx: mpsc::UnboundedSender<Outgoing>,
    in_flight: Arc<Semaphore>,
}

impl<S: Store> Reader<S> {
    async fn run(self, mut calls: Streaming<pb::SessionRequest>) {
        let mut stopping = self.sessions.stopping.clone();
        let shutting_down = || {
            Some(Status::unavailable(
                "the server is shutting down; calls sent after the last answer were not read: \
                 resend them on a new stream",
            ))
        };
        let ended = loop {
            // Wait for room before reading: while the bound is reached the caller's further
            // calls stay in the transport, held by flow control.
            let permit = tokio::select! {
                p = self.in_flight.clone().acquire_owned() => p.expect("the semaphore is never closed"),
                () = shutdown_begun(&mut stopping) => break shutting_down(),
            };
            let message = tokio::select! {
                m = calls.message() => m,
                () = shutdown_begun(&mut stopping) => break shutting_down(),
            };
            match message {
                Ok(Some(call)) => self.call(call, permit),
                // The caller closed its side: answer what is in flight, then end.
                Ok(None) => break None,
                // The stream broke (reset, a message that does not decode): nothing more can
                // be read; what is in flight is still answered if the transport still can.
                Err(status) => break Some(status),
            }
        };
        // Every permit back means every answer taken by tonic to send.
        let all = u32::try_from(self.sessions.max_in_flight.max(1)).unwrap_or(u32::MAX);
        let drained = self.in_flight.acquire_many(all).await;
        drop(drained);
        if let Some(status) = ended {
            let _ = self.tx.send((Box::new(move || Err(status)), None));
        }
    }

    fn call(&self, request: pb::SessionRequest, permit: OwnedSemaphorePermit) {
        let pb::SessionRequest {
            id,
            call,
            traceparent,
        } = request;
        let Some(call) = call else {
            return self.refuse(
                id,
                permit,
                "Session",
                crate::status::invalid_argument(
                    "call",
                    "a Session message must hold one call: begin, complete or heartbeat",
                ),
            );
        };
        // (metrics label, span path): static, so a call allocates nothing for them.
        let (method, path) = match &call {
            Call::Begin(_) => ("Session/Begin", "/fence.v1.Fence/Session/Begin"),
            Call::Complete(_) => ("Session/Complete", "/fence.v1.Fence/Session/Complete"),
            Call::Heartbeat(_) => ("Session/Heartbeat", "/fence.v1.Fence/Session/Heartbeat"),
        };
        if let Some(limit) = &self.sessions.rate_limit
            && let Err(status) = limit.check(&self.tenant)
        {
            crate::metrics::rate_limited();
            return self.refuse(id, permit, method, status);
        }
        let parent = (!traceparent.is_empty())
            .then(|| TraceParent::parse(&traceparent))
            .flatten();
        let call_of = InFlight {
            id,
            method,
            span: crate::trace::call_span(path, parent),
            permit,
            started: Instant::now(),
        };
        // The unary RPCs' own decision functions and routes: a session call is decided by the
        // very same code.
        let tenant = self.tenant.clone();
        match call {
            Call::Begin(r) => {
                let (p, f) = (service::begin_prepare, service::begin_call);
                let wrap = |b| Answer::Begin(crate::convert::begin_response(b));
                self.dispatch(call_of, tenant, r, p, f, wrap);
            }
            Call::Complete(r) => {
                let (p, f) = (service::effect_prepare, service::complete_call);
                let wrap = |rec| Answer::Complete(service::complete_answer(rec));
                self.dispatch(call_of, tenant, r, p, f, wrap);
            }
            Call::Heartbeat(r) => {
                let (p, f) = (service::effect_prepare, service::heartbeat_call);
                let wrap = |rec| Answer::Heartbeat(service::heartbeat_answer(rec));
                self.dispatch(call_of, tenant, r, p, f, wrap);
            }
        }
    }

    /// Answers a call refused before any decision (rate limit, no call in it).
    fn refuse(&self, id: u64, permit: OwnedSemaphorePermit, method: &'static str, status: Status) {
        crate::metrics::rpc(method, Instant::now(), status.code());
        let answer = error_answer(id, &status);
        let _ = self.tx.send((Box::new(move || Ok(answer)), Some(permit)));
    }

    /// Prepares one call here and hands it to its run's sequencer; its answer goes out once
    /// its group is durable (at once when it fails its preparation: nothing was written).
    fn dispatch<Q, P, T>(
        &self,
        call: InFlight,
        tenant: Arc<str>,
        request: Q,
        prepare: Prepare<S, Q, P>,
        decide: Decide<S, P, T>,
        wrap: fn(T) -> Answer,
    ) where
        P: Send + 'static,
        T: Send + 'static,
    {
        let tx = self.tx.clone();
        let decide_span = call.span.clone();
        let prepared = call
            .span
            .in_scope(|| prepare(&self.sessions.ledger, &tenant, request));
        let InFlight {
            id,
            method,
            span,
            permit,
            started,
        } = call;
        let reply = move |out: Result<T, Status>| {
            let answer = move || {
                let code = out.as_ref().map_or_else(Status::code, |_| tonic::Code::Ok);
                crate::metrics::rpc(method, started, code);
                span.in_scope(|| crate::trace::record_status(code));
                Ok(match out {
                    Ok(t) => pb::SessionResponse {
                        id,
                        result: Some(wrap(t)),
                    },
                    Err(status) => error_answer(id, &status),
                })
            };
            // The caller may have gone away: nothing to tell it then.
            let _ = tx.send((Box::new(answer), Some(permit)));
        };
        match prepared {
            Ok((route, prepared)) => self.sessions.sequencer.dispatch(
                route,
                move |ledger: &Ledger<S>| {
                    decide_span.in_scope(|| decide(ledger, &tenant, prepared))
                },
                reply,
            ),
            Err(e) => reply(Err(e.into())),
        }
    }
}

/// One call between its reading and its answer.
struct InFlight {
    id: u64,
    method: &'static str,
    span: tracing::Span,
    permit: OwnedSemaphorePermit,
    started: Instant,
}

/// Resolves once the server's graceful shutdown has begun; never, when no server will
/// signal one (a service built without [`crate::service::FenceService::with_shutdown`]).
async fn shutdown_begun(stopping: &mut watch::Receiver<bool>) {
    if stopping.wait_for(|stop| *stop).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// A call's error as its answer.
fn error_answer(id: u64, status: &Status) -> pb::SessionResponse {
    pb::SessionResponse {
        id,
        result: Some(Answer::Error(service::call_error_of(status))),
    }
}
