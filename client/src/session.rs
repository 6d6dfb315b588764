//! [`Session`]: Begin, Complete and Heartbeat as messages on one long-lived `Session` stream
//! instead of one RPC each. The same decisions as [`FenceClient`]'s methods of the same names,
//! at a fraction of the per-call cost; many tasks can share one session.
//!
//! The session opens its stream on first use and opens a new one on the next call after a
//! break. A call in flight when the stream breaks fails with UNAVAILABLE: it may or may not
//! have been recorded, and resending it (the same request id for a Begin, the same outcome for
//! a Complete) gets the same effect back, as with a unary call that failed in transit.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use fence_proto::v1 as pb;
use pb::session_request::Call;
use pb::session_response::Result as Answer;
use tokio::sync::{mpsc, oneshot};

use crate::client::{EffectCall, FenceClient, complete_request, heartbeat_request};
use crate::error::Error;
use crate::types::{BeginOutcome, Completion, Receipt, receipt_req};

/// Calls a session queues for its stream before a caller waits to send.
const QUEUE: usize = 256;

/// Begin, Complete and Heartbeat over one `Session` stream (see the module docs). Cheap to
/// clone; clones share the stream.
///
/// ```no_run
/// # async fn demo(client: fence_client::FenceClient) -> Result<(), fence_client::Error> {
/// use fence_client::{Completion, Decision, EffectCall};
///
/// let session = client.session();
/// let call = EffectCall::new("order-7", "payments.charge", r#"{"amount":4200}"#).step_key("pay");
/// if let Decision::Execute(grant) = session.begin(&call).await?.decision {
///     // ... charge the card with grant.downstream_key as its idempotency key ...
///     session
///         .complete(&grant.effect_id, grant.attempt, 0, Completion::Result(b"ch_1".to_vec()))
///         .await?;
/// }
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Session {
    client: FenceClient,
    shared: Arc<Shared>,
    /// Sent with each call (its own trace), when set.
    traceparent: Option<String>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("client", &self.client)
            .field("traceparent", &self.traceparent)
            .finish_non_exhaustive()
    }
}

/// What the clones of a session share: the open stream, if any.
#[derive(Default)]
struct Shared {
    link: Mutex<Option<Arc<Link>>>,
    /// Held while a stream opens, so concurrent first calls open one stream, not several.
    opening: tokio::sync::Mutex<()>,
}

/// One open stream.
struct Link {
    calls: mpsc::Sender<pb::SessionRequest>,
    /// The calls waiting for their answers, by id; `None` once the stream broke.
    waiting: Mutex<Option<HashMap<u64, oneshot::Sender<Answer>>>>,
    next_id: AtomicU64,
}

impl Link {
    fn broken(&self) -> bool {
        lock(&self.waiting).is_none()
    }

    /// Fails every call still waiting (their senders dropped) and refuses new ones.
    fn break_off(&self) {
        lock(&self.waiting).take();
    }

    fn forget(&self, id: u64) {
        if let Some(waiting) = lock(&self.waiting).as_mut() {
            waiting.remove(&id);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A call the broken stream never answered.
fn broken() -> Error {
    Error::Rpc {
        code: tonic::Code::Unavailable,
        message: "the session stream broke before this call was answered; it may or may not \
                  have been recorded: resend it (the same request id or outcome gets the same \
                  effect back)"
            .into(),
        field_violations: Vec::new(),
    }
}

impl Session {
    pub(crate) fn new(client: FenceClient) -> Self {
        Self {
            client,
            shared: Arc::default(),
            traceparent: None,
        }
    }

    /// This session (sharing its stream) sending `traceparent` with each call, so the server's
    /// span for the call joins the caller's trace. Passed as given; the server ignores one
    /// that is not a valid W3C `traceparent`.
    pub fn with_traceparent(&self, traceparent: impl Into<String>) -> Session {
        Session {
            traceparent: Some(traceparent.into()),
            ..self.clone()
        }
    }

    /// Asks to perform one call, as [`FenceClient::begin`].
    pub async fn begin(&self, call: &EffectCall) -> Result<BeginOutcome, Error> {
        match self.call(Call::Begin(pb::BeginRequest::from(call))).await? {
            Answer::Begin(b) => b.try_into(),
            other => Err(unexpected("begin", &other)),
        }
    }

    /// Records a granted effect's outcome, as [`FenceClient::complete`].
    pub async fn complete(
        &self,
        effect_id: &str,
        attempt: u32,
        epoch: u64,
        completion: Completion,
    ) -> Result<Receipt, Error> {
        let request = complete_request(effect_id, attempt, epoch, completion);
        match self.call(Call::Complete(request)).await? {
            Answer::Complete(c) => receipt_req(c.receipt, "receipt"),
            other => Err(unexpected("complete", &other)),
        }
    }

    /// Extends a granted effect's lease, as [`FenceClient::heartbeat`].
    pub async fn heartbeat(
        &self,
        effect_id: &str,
        attempt: u32,
        epoch: u64,
        extend_ms: u64,
    ) -> Result<Receipt, Error> {
        let request = heartbeat_request(effect_id, attempt, epoch, extend_ms);
        match self.call(Call::Heartbeat(request)).await? {
            Answer::Heartbeat(h) => receipt_req(h.receipt, "receipt"),
            other => Err(unexpected("heartbeat", &other)),
        }
    }

    /// Sends one call and waits for its answer (within the client's request timeout).
    async fn call(&self, call: Call) -> Result<Answer, Error> {
        let link = self.link().await?;
        let id = link.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        match lock(&link.waiting).as_mut() {
            Some(waiting) => waiting.insert(id, tx),
            None => return Err(broken()),
        };
        let request = pb::SessionRequest {
            id,
            call: Some(call),
            traceparent: self.traceparent.clone().unwrap_or_default(),
        };
        if link.calls.send(request).await.is_err() {
            link.forget(id);
            return Err(broken());
        }
        let answer = match self.client.request_timeout() {
            Some(timeout) => match tokio::time::timeout(timeout, rx).await {
                Ok(answer) => answer,
                Err(_) => {
                    link.forget(id);
                    return Err(Error::Rpc {
                        code: tonic::Code::DeadlineExceeded,
                        message: format!("no answer within {timeout:?}"),
                        field_violations: Vec::new(),
                    });
                }
            },
            None => rx.await,
        };
        match answer.map_err(|_| broken())? {
            Answer::Error(e) => Err(Error::from(tonic::Status::with_details(
                tonic::Code::from(e.code),
                e.message,
                e.details.into(),
            ))),
            answer => Ok(answer),
        }
    }

    /// The open stream, opening one if there is none or it broke.
    async fn link(&self) -> Result<Arc<Link>, Error> {
        if let Some(link) = self.live() {
            return Ok(link);
        }
        let _opening = self.shared.opening.lock().await;
        if let Some(link) = self.live() {
            return Ok(link);
        }
        let (calls, outbound) = mpsc::channel(QUEUE);
        let link = Arc::new(Link {
            calls,
            waiting: Mutex::new(Some(HashMap::new())),
            next_id: AtomicU64::new(1),
        });
        let answers = self
            .client
            .open_session(tokio_stream::wrappers::ReceiverStream::new(outbound))
            .await?;
        tokio::spawn(read_answers(Arc::downgrade(&link), answers));
        *lock(&self.shared.link) = Some(link.clone());
        Ok(link)
    }

    fn live(&self) -> Option<Arc<Link>> {
        lock(&self.shared.link)
            .as_ref()
            .filter(|l| !l.broken())
            .cloned()
    }
}

/// Hands each answer to its waiting call until the stream ends; then fails the rest.
async fn read_answers(
    link: std::sync::Weak<Link>,
    mut answers: tonic::Streaming<pb::SessionResponse>,
) {
    loop {
        let message = answers.message().await;
        // Every handle to the session is gone: nobody waits for anything.
        let Some(link) = link.upgrade() else {
            return;
        };
        match message {
            Ok(Some(pb::SessionResponse {
                id,
                result: Some(result),
            })) => {
                let waiter = lock(&link.waiting).as_mut().and_then(|w| w.remove(&id));
                // A call that gave up (its timeout) is no longer waiting.
                if let Some(waiter) = waiter {
                    let _ = waiter.send(result);
                }
            }
            // An answer without a result is a server bug: the stream cannot be trusted.
            Ok(Some(_)) | Ok(None) | Err(_) => {
                link.break_off();
                return;
            }
        }
    }
}

fn unexpected(call: &str, answer: &Answer) -> Error {
    Error::protocol(format!("the server answered a {call} call with {answer:?}"))
}
