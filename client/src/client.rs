//! The typed client: connection setup (URL, timeouts, bearer token, dev-mode tenant) and one
//! method per RPC, taking and returning domain types.
//!
//! These methods make exactly one RPC each (no retries): the protocol logic built on them lives
//! in [`crate::effect`] (`run_effect`), [`crate::run`] and [`crate::saga`].

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use fence_proto::v1 as pb;
use tonic::codegen::http;
use tonic::metadata::AsciiMetadataValue;
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};
use tower::util::BoxCloneSyncService;
use tower::{Service, ServiceExt};

use crate::error::Error;
use crate::retry::RetryPolicy;
use crate::session::Session;
use crate::types::{
    Backup, BackupReport, BeginOutcome, CheckpointInfo, Compacted, Compensation, CompleteCall,
    Completion, CredentialInfo, CredentialUse, EffectState, Finding, Forked, NewCredential,
    Outcome, OutcomeKey, Receipt, RegisteredTool, Restored, RunInfo, Stored, ToolDef, receipt_req,
    required,
};

/// A boxed error, as returned by a custom transport.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The transport under the generated stub: a `Channel`, or any tower service the caller
/// supplies (middleware, fault injection, an in-memory connection).
type Transport = BoxCloneSyncService<
    http::Request<tonic::body::Body>,
    http::Response<tonic::body::Body>,
    TransportError,
>;

/// A transport's error, boxed in a concrete type: with the bare trait object as the service
/// error, rustc cannot prove the generated stub's futures `Send` (a higher-ranked lifetime
/// limitation), and every client future must be spawnable. tonic finds the status (e.g.
/// `UNAVAILABLE` for a refused connection) through `source()`.
#[derive(Debug)]
struct TransportError(BoxError);

impl fmt::Display for TransportError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "transport error: {}", self.0)
    }
}

impl std::error::Error for TransportError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.0)
    }
}

type Stub = pb::fence_client::FenceClient<Transport>;
type AdminStub = pb::admin_client::AdminClient<Transport>;

/// The metadata name of a W3C trace context.
const TRACEPARENT_METADATA: &str = "traceparent";

/// The metadata name of the dev-mode tenant.
pub const TENANT_METADATA: &str = "x-fence-tenant";

/// A connection to a Fence server. Cheap to clone; clones share the connection.
///
/// ```no_run
/// # async fn demo() -> Result<(), fence_client::Error> {
/// use fence_client::FenceClient;
///
/// let client = FenceClient::connect("http://127.0.0.1:50051").await?;
/// let run = client.start_run("order-1234").await?;
/// println!("run {} is at epoch {}", run.value.run_id, run.value.epoch);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct FenceClient {
    stub: Stub,
    admin: AdminStub,
    authorization: Option<AsciiMetadataValue>,
    tenant: Option<AsciiMetadataValue>,
    traceparent: Option<AsciiMetadataValue>,
    request_timeout: Option<Duration>,
    policy: RetryPolicy,
    /// Set by [`FenceClientBuilder::sessions`]: Begin, Complete and Heartbeat go over it.
    session: Option<Arc<Session>>,
}

impl fmt::Debug for FenceClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FenceClient")
            .field(
                "authorization",
                &self.authorization.as_ref().map(|_| "<redacted>"),
            )
            .field("tenant", &self.tenant)
            .field("traceparent", &self.traceparent)
            .field("request_timeout", &self.request_timeout)
            .field("policy", &self.policy)
            .field("sessions", &self.session.is_some())
            .finish_non_exhaustive()
    }
}

/// Configures a [`FenceClient`]: endpoint, timeouts, credentials, retry policy.
///
/// ```no_run
/// # async fn demo() -> Result<(), fence_client::Error> {
/// use std::time::Duration;
/// use fence_client::{FenceClient, RetryPolicy};
///
/// let client = FenceClient::builder("http://127.0.0.1:50051")
///     .connect_timeout(Duration::from_secs(2))
///     .request_timeout(Duration::from_secs(5))
///     .bearer_token("s3cr3t")
///     .retry_policy(RetryPolicy { max_attempts: 5, ..RetryPolicy::default() })
///     .connect()
///     .await?;
/// # let _ = client; Ok(()) }
/// ```
#[derive(Clone)]
pub struct FenceClientBuilder {
    url: String,
    connect_timeout: Option<Duration>,
    request_timeout: Option<Duration>,
    bearer_token: Option<String>,
    tenant: Option<String>,
    tls: Option<ClientTlsConfig>,
    policy: RetryPolicy,
    sessions: bool,
}

impl fmt::Debug for FenceClientBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FenceClientBuilder")
            .field("url", &self.url)
            .field("connect_timeout", &self.connect_timeout)
            .field("request_timeout", &self.request_timeout)
            .field(
                "bearer_token",
                &self.bearer_token.as_ref().map(|_| "<redacted>"),
            )
            .field("tenant", &self.tenant)
            .field("tls", &self.tls.is_some())
            .field("policy", &self.policy)
            .field("sessions", &self.sessions)
            .finish()
    }
}

impl FenceClientBuilder {
    /// A builder for the server at `url` (e.g. `http://127.0.0.1:50051`), with a 5 s connect
    /// timeout, a 10 s per-request timeout and the default [`RetryPolicy`].
    pub fn new(url: impl Into<String>) -> Self {
        FenceClientBuilder {
            url: url.into(),
            connect_timeout: Some(Duration::from_secs(5)),
            request_timeout: Some(Duration::from_secs(10)),
            bearer_token: None,
            tenant: None,
            tls: None,
            policy: RetryPolicy::default(),
            sessions: false,
        }
    }

    /// How long establishing a connection may take.
    #[must_use]
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = Some(timeout);
        self
    }

    /// How long one RPC may take before it fails with `DEADLINE_EXCEEDED` (enforced by the
    /// client and sent to the server as the gRPC deadline).
    #[must_use]
    pub fn request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = Some(timeout);
        self
    }

    /// Sends `authorization: Bearer <token>` with every call.
    #[must_use]
    pub fn bearer_token(mut self, token: impl Into<String>) -> Self {
        self.bearer_token = Some(token.into());
        self
    }

    /// Sends the tenant as `x-fence-tenant` metadata with every call (the server's dev mode
    /// takes the tenant from it; with authentication on, the token decides).
    #[must_use]
    pub fn tenant(mut self, tenant: impl Into<String>) -> Self {
        self.tenant = Some(tenant.into());
        self
    }

    /// Connects with TLS (use an `https://` URL): the CA to trust, the server's name, and for
    /// mutual TLS the client's identity.
    ///
    /// ```no_run
    /// # async fn demo(ca_pem: String, cert_pem: String, key_pem: String) -> Result<(), fence_client::Error> {
    /// use fence_client::{Certificate, ClientTlsConfig, FenceClient, Identity};
    ///
    /// let tls = ClientTlsConfig::new()
    ///     .ca_certificate(Certificate::from_pem(ca_pem))
    ///     .domain_name("fence.internal")
    ///     .identity(Identity::from_pem(cert_pem, key_pem));
    /// let client = FenceClient::builder("https://fence.internal:50051").tls(tls).connect().await?;
    /// # let _ = client; Ok(()) }
    /// ```
    #[must_use]
    pub fn tls(mut self, config: ClientTlsConfig) -> Self {
        self.tls = Some(config);
        self
    }

    /// The retry policy of the protocol helpers (`run_effect`, the saga executor).
    #[must_use]
    pub fn retry_policy(mut self, policy: RetryPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// Sends the client's Begin, Complete and Heartbeat calls (and so `run_effect`, the run
    /// handles' and the saga executor's) as messages on one shared `Session` stream instead
    /// of one RPC each: the same decisions and errors at a lower cost per call (see
    /// [`FenceClient::session`]). Off by default.
    #[must_use]
    pub fn sessions(mut self, on: bool) -> Self {
        self.sessions = on;
        self
    }

    fn endpoint(&self) -> Result<Endpoint, Error> {
        let mut endpoint = Endpoint::from_shared(self.url.clone())
            .map_err(|e| Error::Config(format!("invalid server URL {:?}: {e}", self.url)))?
            .tcp_nodelay(true);
        if let Some(timeout) = self.connect_timeout {
            endpoint = endpoint.connect_timeout(timeout);
        }
        if let Some(tls) = &self.tls {
            endpoint = endpoint
                .tls_config(tls.clone())
                .map_err(|e| Error::Config(format!("invalid TLS configuration: {e}")))?;
        }
        Ok(endpoint)
    }

    /// Connects now; fails if the server cannot be reached.
    pub async fn connect(self) -> Result<FenceClient, Error> {
        let channel = self.endpoint()?.connect().await.map_err(Error::Connect)?;
        self.build_with_channel(channel)
    }

    /// Returns a client that connects on its first call (and reconnects after a failure).
    pub fn connect_lazy(self) -> Result<FenceClient, Error> {
        let channel = self.endpoint()?.connect_lazy();
        self.build_with_channel(channel)
    }

    fn build_with_channel(self, channel: Channel) -> Result<FenceClient, Error> {
        let transport = channel.map_err(|e| -> BoxError { Box::new(e) });
        self.build_with_service(transport)
    }

    /// Builds a client over a caller-supplied transport: typically a [`Channel`] wrapped in
    /// tower middleware (metrics, fault injection). The builder's URL and connect timeout are
    /// not used; the request timeout, credentials and retry policy are.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use fence_client::FenceClientBuilder;
    /// use tonic::transport::Endpoint;
    ///
    /// let channel = Endpoint::from_static("http://127.0.0.1:50051").connect().await?;
    /// let client = FenceClientBuilder::new("unused").build_with_service(channel)?;
    /// # let _ = client; Ok(()) }
    /// ```
    pub fn build_with_service<S>(self, service: S) -> Result<FenceClient, Error>
    where
        S: Service<http::Request<tonic::body::Body>, Response = http::Response<tonic::body::Body>>
            + Clone
            + Send
            + Sync
            + 'static,
        S::Error: Into<BoxError>,
        S::Future: Send + 'static,
    {
        let transport =
            BoxCloneSyncService::new(service.map_err(|e: S::Error| TransportError(e.into())));
        let authorization = self
            .bearer_token
            .as_deref()
            .map(|t| {
                format!("Bearer {t}")
                    .parse::<AsciiMetadataValue>()
                    .map_err(|_| Error::Config("the bearer token is not valid metadata".into()))
            })
            .transpose()?;
        let tenant = self
            .tenant
            .as_deref()
            .map(|t| {
                t.parse::<AsciiMetadataValue>()
                    .map_err(|_| Error::Config(format!("the tenant {t:?} is not valid metadata")))
            })
            .transpose()?;
        let mut client = FenceClient {
            stub: pb::fence_client::FenceClient::new(transport.clone()),
            admin: pb::admin_client::AdminClient::new(transport),
            authorization,
            tenant,
            traceparent: None,
            request_timeout: self.request_timeout,
            policy: self.policy,
            session: None,
        };
        if self.sessions {
            // The session opens its streams with a client of its own that has none.
            client.session = Some(Arc::new(client.session()));
        }
        Ok(client)
    }
}

/// Which effects to list.
///
/// ```
/// use fence_client::EffectFilter;
///
/// let saga = EffectFilter::run("order-1234").saga("trip-7");
/// assert_eq!(saga.saga_id.as_deref(), Some("trip-7"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EffectFilter {
    /// The run.
    pub run_id: String,
    /// Only this branch's own effects; `None` = every branch.
    pub branch: Option<String>,
    /// Only this saga's effects; `None` = all.
    pub saga_id: Option<String>,
    /// With `branch`: the branch's lineage (what its parents recorded before each fork point,
    /// then its own effects) instead of only its own effects.
    pub lineage: bool,
}

impl EffectFilter {
    /// Every effect of a run, on every branch.
    pub fn run(run_id: impl Into<String>) -> Self {
        EffectFilter {
            run_id: run_id.into(),
            branch: None,
            saga_id: None,
            lineage: false,
        }
    }

    /// Only one branch's own effects.
    #[must_use]
    pub fn branch(mut self, branch: impl Into<String>) -> Self {
        self.branch = Some(branch.into());
        self
    }

    /// Only one saga's effects.
    #[must_use]
    pub fn saga(mut self, saga_id: impl Into<String>) -> Self {
        self.saga_id = Some(saga_id.into());
        self
    }

    /// The history `branch` acts on: its lineage, not only its own effects.
    #[must_use]
    pub fn lineage(mut self, branch: impl Into<String>) -> Self {
        self.branch = Some(branch.into());
        self.lineage = true;
        self
    }
}

/// One call of a tool, as sent to Begin: the domain form of `BeginRequest`.
///
/// ```
/// use fence_client::{EffectCall, step_key};
///
/// let call = EffectCall::new("order-1234", "payments.charge", r#"{"amount":4200,"to":"acme"}"#)
///     .step_key(step_key("order-1234", "pay"))
///     .lease_ms(30_000);
/// assert_eq!(call.step_key.as_deref(), Some("order-1234:pay"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct EffectCall {
    /// The run.
    pub run_id: String,
    /// The branch; `None` = "main".
    pub branch: Option<String>,
    /// The caller's epoch; 0 is accepted only while the run was never restored.
    pub epoch: u64,
    /// The tool's name.
    pub tool: String,
    /// The arguments: one JSON value.
    pub arguments_json: String,
    /// The caller's idempotency key for this step. Needed for the client to retry a Begin
    /// through a transport failure, and to re-begin after a failure before input.
    pub step_key: Option<String>,
    /// "An identical intent is already recorded, and I mean to do it again."
    pub deliberate_repeat: bool,
    /// Credentials the call spends.
    pub credentials: Vec<CredentialUse>,
    /// Lease for this grant in ms; 0 = the tool's default, else the server's.
    pub lease_ms: u64,
    /// For a `SAFE_RETRY` tool: record the call for audit.
    pub record: bool,
    /// The saga this forward step belongs to.
    pub saga_id: Option<String>,
    /// How to undo this step (for the saga executor).
    pub compensation: Option<Compensation>,
    /// When this call is a compensation: the effect it undoes.
    pub compensates_effect_id: Option<String>,
    /// A nonce for this logical call, repeated when the same Begin is re-sent, so a grant whose
    /// response was lost comes back at once instead of as "in progress". `run_effect` sets a
    /// random one when this is `None`. Never share one between two callers.
    pub request_id: Option<String>,
    /// The checkpoint this call descends from (the framework's id of the last checkpoint the
    /// agent's state was at): it places the effect after that checkpoint however late the
    /// checkpoint is recorded, and calls naming one checkpoint form one causal step.
    pub parent_checkpoint_id: Option<String>,
}

impl EffectCall {
    /// A call of `tool` with `arguments_json` on `run_id`'s main branch at epoch 0.
    pub fn new(
        run_id: impl Into<String>,
        tool: impl Into<String>,
        arguments_json: impl Into<String>,
    ) -> Self {
        EffectCall {
            run_id: run_id.into(),
            tool: tool.into(),
            arguments_json: arguments_json.into(),
            ..EffectCall::default()
        }
    }

    /// Sets the request id (see [`EffectCall::request_id`]).
    #[must_use]
    pub fn request_id(mut self, request_id: impl Into<String>) -> Self {
        self.request_id = Some(request_id.into());
        self
    }

    /// Sets the checkpoint the call descends from (see [`EffectCall::parent_checkpoint_id`]).
    #[must_use]
    pub fn parent_checkpoint(mut self, checkpoint_id: impl Into<String>) -> Self {
        self.parent_checkpoint_id = Some(checkpoint_id.into());
        self
    }

    /// Sets the branch.
    #[must_use]
    pub fn branch(mut self, branch: impl Into<String>) -> Self {
        self.branch = Some(branch.into());
        self
    }

    /// Sets the epoch.
    #[must_use]
    pub fn epoch(mut self, epoch: u64) -> Self {
        self.epoch = epoch;
        self
    }

    /// Sets the step key (see [`crate::step_key`]).
    #[must_use]
    pub fn step_key(mut self, step_key: impl Into<String>) -> Self {
        self.step_key = Some(step_key.into());
        self
    }

    /// Marks the call as a deliberate repeat of an identical recorded intent.
    #[must_use]
    pub fn deliberate_repeat(mut self) -> Self {
        self.deliberate_repeat = true;
        self
    }

    /// Presents a credential (one use is spent, atomically with the effect's record).
    #[must_use]
    pub fn credential(mut self, token: impl Into<Vec<u8>>, budget: u32) -> Self {
        self.credentials.push(CredentialUse {
            token: token.into(),
            budget,
        });
        self
    }

    /// Sets the lease of this grant, in ms.
    #[must_use]
    pub fn lease_ms(mut self, ms: u64) -> Self {
        self.lease_ms = ms;
        self
    }

    /// Records a `SAFE_RETRY` call for audit.
    #[must_use]
    pub fn record(mut self) -> Self {
        self.record = true;
        self
    }

    /// Makes the call a forward step of a saga.
    #[must_use]
    pub fn saga(mut self, saga_id: impl Into<String>) -> Self {
        self.saga_id = Some(saga_id.into());
        self
    }

    /// Declares the call that undoes this one.
    #[must_use]
    pub fn compensation(mut self, compensation: Compensation) -> Self {
        self.compensation = Some(compensation);
        self
    }

    /// Makes the call the compensation of `effect_id`: completing it marks that effect
    /// `COMPENSATED` in the same atomic write.
    #[must_use]
    pub fn compensates(mut self, effect_id: impl Into<String>) -> Self {
        self.compensates_effect_id = Some(effect_id.into());
        self
    }
}

impl From<&EffectCall> for pb::BeginRequest {
    fn from(c: &EffectCall) -> Self {
        pb::BeginRequest {
            run_id: c.run_id.clone(),
            branch: c.branch.clone().unwrap_or_default(),
            epoch: c.epoch,
            tool: c.tool.clone(),
            arguments_json: c.arguments_json.clone(),
            step_key: c.step_key.clone().unwrap_or_default(),
            deliberate_repeat: c.deliberate_repeat,
            credentials: c
                .credentials
                .iter()
                .map(|u| pb::CredentialUse {
                    token: u.token.clone(),
                    budget: u.budget,
                })
                .collect(),
            lease_ms: c.lease_ms,
            record: c.record,
            saga_id: c.saga_id.clone().unwrap_or_default(),
            compensation: c.compensation.clone().map(Into::into),
            compensates_effect_id: c.compensates_effect_id.clone().unwrap_or_default(),
            request_id: c.request_id.clone().unwrap_or_default(),
            parent_checkpoint_id: c.parent_checkpoint_id.clone().unwrap_or_default(),
        }
    }
}

impl FenceClient {
    /// Connects to the server at `url` with default settings.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), fence_client::Error> {
    /// let client = fence_client::FenceClient::connect("http://127.0.0.1:50051").await?;
    /// # let _ = client; Ok(()) }
    /// ```
    pub async fn connect(url: impl Into<String>) -> Result<FenceClient, Error> {
        FenceClientBuilder::new(url).connect().await
    }

    /// A builder for a client of the server at `url`.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), fence_client::Error> {
    /// let client = fence_client::FenceClient::builder("http://127.0.0.1:50051")
    ///     .tenant("acme")
    ///     .connect()
    ///     .await?;
    /// # let _ = client; Ok(()) }
    /// ```
    pub fn builder(url: impl Into<String>) -> FenceClientBuilder {
        FenceClientBuilder::new(url)
    }

    /// This client (sharing its connection) sending `traceparent` with every call, so the
    /// server's log lines for those calls carry the caller's W3C trace id. The value is passed
    /// as given; the server ignores one that is not a valid W3C `traceparent`.
    ///
    /// ```no_run
    /// # async fn demo(client: fence_client::FenceClient) -> Result<(), fence_client::Error> {
    /// let traced = client.with_traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")?;
    /// # Ok(()) }
    /// ```
    pub fn with_traceparent(&self, traceparent: &str) -> Result<FenceClient, Error> {
        let value = traceparent.parse::<AsciiMetadataValue>().map_err(|_| {
            Error::Config(format!(
                "the traceparent {traceparent:?} is not valid metadata"
            ))
        })?;
        Ok(FenceClient {
            traceparent: Some(value),
            ..self.clone()
        })
    }

    /// The retry policy of the protocol helpers.
    pub fn policy(&self) -> &RetryPolicy {
        &self.policy
    }

    /// `message` with the client's metadata: credentials, tenant, trace.
    fn request<Req>(&self, message: Req) -> tonic::Request<Req> {
        let mut request = tonic::Request::new(message);
        if let Some(value) = &self.authorization {
            request
                .metadata_mut()
                .insert("authorization", value.clone());
        }
        if let Some(value) = &self.tenant {
            request
                .metadata_mut()
                .insert(TENANT_METADATA, value.clone());
        }
        if let Some(value) = &self.traceparent {
            request
                .metadata_mut()
                .insert(TRACEPARENT_METADATA, value.clone());
        }
        request
    }

    /// Begin, Complete and Heartbeat over one long-lived `Session` stream: the same decisions
    /// as this client's methods, at a fraction of the per-call cost. The stream opens on the
    /// first call (and again after a break); clones of the session share it.
    ///
    /// ```no_run
    /// # async fn demo(client: fence_client::FenceClient) -> Result<(), fence_client::Error> {
    /// use fence_client::EffectCall;
    ///
    /// let session = client.session();
    /// let outcome = session
    ///     .begin(&EffectCall::new("order-7", "mail.send", r#"{"to":"ada"}"#).step_key("notify"))
    ///     .await?;
    /// println!("{:?}", outcome.decision);
    /// # Ok(()) }
    /// ```
    pub fn session(&self) -> Session {
        Session::new(self.clone())
    }

    /// Opens a `Session` stream sending `calls` (see [`Session`]).
    pub(crate) async fn open_session(
        &self,
        calls: impl tokio_stream::Stream<Item = pb::SessionRequest> + Send + 'static,
    ) -> Result<tonic::Streaming<pb::SessionResponse>, Error> {
        let request = self.request(calls);
        let mut stub = self.stub.clone();
        let opened = match self.request_timeout {
            Some(timeout) => tokio::time::timeout(timeout, stub.session(request))
                .await
                .map_err(|_| Error::Rpc {
                    code: tonic::Code::DeadlineExceeded,
                    message: format!("the session did not open within {timeout:?}"),
                    field_violations: Vec::new(),
                })?,
            None => stub.session(request).await,
        };
        Ok(opened?.into_inner())
    }

    /// The shared session the client's calls go over ([`FenceClientBuilder::sessions`]), with
    /// this client's traceparent for the call, if any.
    fn session_for_call(&self) -> Option<std::borrow::Cow<'_, Session>> {
        let session = self.session.as_deref()?;
        Some(
            match self.traceparent.as_ref().and_then(|t| t.to_str().ok()) {
                Some(traceparent) => std::borrow::Cow::Owned(session.with_traceparent(traceparent)),
                None => std::borrow::Cow::Borrowed(session),
            },
        )
    }

    /// The per-call timeout, if one is set.
    pub(crate) fn request_timeout(&self) -> Option<Duration> {
        self.request_timeout
    }

    /// Sends one unary RPC of the Fence service with the client's metadata and timeout.
    async fn unary<Req, Resp, Fut>(
        &self,
        message: Req,
        call: impl FnOnce(Stub, tonic::Request<Req>) -> Fut,
    ) -> Result<Resp, Error>
    where
        Fut: Future<Output = Result<tonic::Response<Resp>, tonic::Status>>,
    {
        self.unary_on(self.stub.clone(), message, call).await
    }

    /// Sends one unary RPC on `stub` (the Fence or the Admin service) with the client's
    /// metadata and timeout.
    async fn unary_on<St, Req, Resp, Fut>(
        &self,
        stub: St,
        message: Req,
        call: impl FnOnce(St, tonic::Request<Req>) -> Fut,
    ) -> Result<Resp, Error>
    where
        Fut: Future<Output = Result<tonic::Response<Resp>, tonic::Status>>,
    {
        let mut request = self.request(message);
        let response = match self.request_timeout {
            Some(timeout) => {
                request.set_timeout(timeout);
                match tokio::time::timeout(timeout, call(stub, request)).await {
                    Ok(response) => response,
                    Err(_) => {
                        return Err(Error::Rpc {
                            code: tonic::Code::DeadlineExceeded,
                            message: format!("no answer within {timeout:?}"),
                            field_violations: Vec::new(),
                        });
                    }
                }
            }
            None => call(stub, request).await,
        };
        Ok(response?.into_inner())
    }

    /// Writes a consistent copy of the whole ledger into `dir`, a new directory on the
    /// server's machine, while the server goes on serving (the `Admin` service: in token mode
    /// the client's token must be marked `admin`). Every effect acknowledged before the call is
    /// in it; the copy is verified before this returns. Restore by starting `fenced --data-dir`
    /// on it.
    ///
    /// ```no_run
    /// # async fn demo(client: fence_client::FenceClient) -> Result<(), fence_client::Error> {
    /// let backup = client.create_backup("/var/backups/fence/2026-12-05").await?;
    /// assert!(backup.report.is_sound());
    /// println!("{} effects in {}", backup.report.effects, backup.dir);
    /// # Ok(()) }
    /// ```
    pub async fn create_backup(&self, dir: &str) -> Result<Backup, Error> {
        let request = pb::CreateBackupRequest {
            dir: dir.to_owned(),
        };
        let response = self
            .unary_on(self.admin.clone(), request, |mut s, r| async move {
                s.create_backup(r).await
            })
            .await?;
        Ok(Backup {
            dir: response.dir,
            bytes: response.bytes,
            created_at_ms: response.created_at_ms,
            report: required(response.report, "report")?.into(),
        })
    }

    /// Verifies a backup (or any data dir) on the server's machine: every record is read and
    /// checked; the directory is not changed. Damage is in the report, not an error.
    pub async fn verify_backup(&self, dir: &str) -> Result<BackupReport, Error> {
        let request = pb::VerifyBackupRequest {
            dir: dir.to_owned(),
        };
        let response = self
            .unary_on(self.admin.clone(), request, |mut s, r| async move {
                s.verify_backup(r).await
            })
            .await?;
        Ok(required(response.report, "report")?.into())
    }

    /// Compacts the server's whole store now (the `Admin` service: in token mode the client's
    /// token must be marked `admin`): every finished effect past its retention window becomes
    /// its tombstone on disk too, and space is reclaimed. The server does this in the
    /// background anyway (every table file at least once per `--retention-compaction-hours`);
    /// this is for when it must be done at once. It rewrites every table file.
    pub async fn compact_store(&self) -> Result<Compacted, Error> {
        let response = self
            .unary_on(
                self.admin.clone(),
                pb::CompactStoreRequest {},
                |mut s, r| async move { s.compact_store(r).await },
            )
            .await?;
        Ok(Compacted {
            bytes_before: response.bytes_before,
            bytes_after: response.bytes_after,
            took_ms: response.took_ms,
        })
    }

    /// Registers (or re-registers) a tool. An identical definition returns the current version
    /// with `created == false`.
    ///
    /// ```no_run
    /// # async fn demo(client: fence_client::FenceClient) -> Result<(), fence_client::Error> {
    /// use fence_client::{OperationClass, ToolDef};
    ///
    /// let tool = ToolDef::new("payments.charge", OperationClass::NonRetryable)
    ///     .volatile(["request_id"]);
    /// let stored = client.register_tool(tool).await?;
    /// println!("version {}", stored.value.version);
    /// # Ok(()) }
    /// ```
    pub async fn register_tool(&self, tool: ToolDef) -> Result<Stored<RegisteredTool>, Error> {
        let request = pb::RegisterToolRequest {
            tool: Some(tool.into()),
        };
        let response = self
            .unary(request, |mut s, r| async move { s.register_tool(r).await })
            .await?;
        Ok(Stored {
            value: required(response.tool, "tool")?.try_into()?,
            created: response.created,
        })
    }

    /// Returns a tool's current definition (or the given version).
    ///
    /// ```no_run
    /// # async fn demo(client: fence_client::FenceClient) -> Result<(), fence_client::Error> {
    /// let tool = client.get_tool("payments.charge", None).await?;
    /// println!("{} is {}", tool.def.name, tool.def.class);
    /// # Ok(()) }
    /// ```
    pub async fn get_tool(
        &self,
        name: &str,
        version: Option<u32>,
    ) -> Result<RegisteredTool, Error> {
        let request = pb::GetToolRequest {
            name: name.to_owned(),
            version: version.unwrap_or(0),
        };
        let response = self
            .unary(request, |mut s, r| async move { s.get_tool(r).await })
            .await?;
        required(response.tool, "tool")?.try_into()
    }

    /// One page of the registered tools, each at its current version (`page_size` 0 = the
    /// server default). Returns the tools and the next page's token (`None` at the end).
    pub async fn list_tools_page(
        &self,
        page_token: Option<&str>,
        page_size: u32,
    ) -> Result<(Vec<RegisteredTool>, Option<String>), Error> {
        let request = pb::ListToolsRequest {
            page_size,
            page_token: page_token.unwrap_or_default().to_owned(),
        };
        let response = self
            .unary(request, |mut s, r| async move { s.list_tools(r).await })
            .await?;
        let tools = response
            .tools
            .into_iter()
            .map(RegisteredTool::try_from)
            .collect::<Result<_, _>>()?;
        Ok((tools, crate::types::non_empty(response.next_page_token)))
    }

    /// Every registered tool at its current version (all pages), in the server's stable
    /// order (not alphabetical).
    ///
    /// ```no_run
    /// # async fn demo(client: fence_client::FenceClient) -> Result<(), fence_client::Error> {
    /// for tool in client.list_tools().await? {
    ///     println!("{} v{} {}", tool.def.name, tool.version, tool.def.class);
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn list_tools(&self) -> Result<Vec<RegisteredTool>, Error> {
        all_pages("ListTools", |token| async move {
            self.list_tools_page(token.as_deref(), 0).await
        })
        .await
    }

    /// Creates a run if it does not exist (idempotent). See also [`crate::RunHandle::start`].
    ///
    /// ```no_run
    /// # async fn demo(client: fence_client::FenceClient) -> Result<(), fence_client::Error> {
    /// let run = client.start_run("order-1234").await?;
    /// assert!(run.value.epoch >= 1);
    /// # Ok(()) }
    /// ```
    pub async fn start_run(&self, run_id: &str) -> Result<Stored<RunInfo>, Error> {
        let request = pb::StartRunRequest {
            run_id: run_id.to_owned(),
        };
        let response = self
            .unary(request, |mut s, r| async move { s.start_run(r).await })
            .await?;
        Ok(Stored {
            value: required(response.run, "run")?.into(),
            created: response.created,
        })
    }

    /// Returns a run's epoch, branches, checkpoints and restore history.
    ///
    /// ```no_run
    /// # async fn demo(client: fence_client::FenceClient) -> Result<(), fence_client::Error> {
    /// let run = client.get_run("order-1234").await?;
    /// println!("epoch {}, {} effects", run.epoch, run.effect_count);
    /// # Ok(()) }
    /// ```
    pub async fn get_run(&self, run_id: &str) -> Result<RunInfo, Error> {
        let request = pb::GetRunRequest {
            run_id: run_id.to_owned(),
        };
        let response = self
            .unary(request, |mut s, r| async move { s.get_run(r).await })
            .await?;
        Ok(required(response.run, "run")?.into())
    }

    /// One page of the caller's runs in run-id order, those whose id starts with
    /// `run_id_prefix` (`""`: all). Each run has its epoch, branches and effect count but no
    /// checkpoints or restores ([`get_run`](Self::get_run) has those). Returns the runs and
    /// the next page's token (`None` at the end).
    pub async fn list_runs_page(
        &self,
        run_id_prefix: &str,
        page_token: Option<&str>,
        page_size: u32,
    ) -> Result<(Vec<RunInfo>, Option<String>), Error> {
        let request = pb::ListRunsRequest {
            run_id_prefix: run_id_prefix.to_owned(),
            page_size,
            page_token: page_token.unwrap_or_default().to_owned(),
        };
        let response = self
            .unary(request, |mut s, r| async move { s.list_runs(r).await })
            .await?;
        let runs = response.runs.into_iter().map(RunInfo::from).collect();
        Ok((runs, crate::types::non_empty(response.next_page_token)))
    }

    /// Every run of the caller whose id starts with `run_id_prefix` (all pages), in run-id
    /// order; see [`list_runs_page`](Self::list_runs_page).
    ///
    /// ```no_run
    /// # async fn demo(client: fence_client::FenceClient) -> Result<(), fence_client::Error> {
    /// for run in client.list_runs("order-").await? {
    ///     println!("{} epoch {} ({} effects)", run.run_id, run.epoch, run.effect_count);
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn list_runs(&self, run_id_prefix: &str) -> Result<Vec<RunInfo>, Error> {
        all_pages("ListRuns", |token| async move {
            self.list_runs_page(run_id_prefix, token.as_deref(), 0)
                .await
        })
        .await
    }

    /// Records a named checkpoint (the framework's own checkpoint id) at the current end of a
    /// branch's log. Repeating it returns the existing checkpoint.
    ///
    /// ```no_run
    /// # async fn demo(client: fence_client::FenceClient) -> Result<(), fence_client::Error> {
    /// let cp = client.checkpoint("order-1234", "main", 1, "langgraph-cp-0007").await?;
    /// println!("checkpoint at position {}", cp.value.position);
    /// # Ok(()) }
    /// ```
    pub async fn checkpoint(
        &self,
        run_id: &str,
        branch: &str,
        epoch: u64,
        checkpoint_id: &str,
    ) -> Result<Stored<CheckpointInfo>, Error> {
        self.checkpoint_after(run_id, branch, epoch, checkpoint_id, "")
            .await
    }

    /// Records a checkpoint that follows `parent_checkpoint_id` in the run's history ("" =
    /// none). Frameworks save checkpoints late, after the next step's tools already ran: every
    /// effect that names this checkpoint (or one after it) as its parent is after it, however
    /// late this call arrives.
    ///
    /// ```no_run
    /// # async fn demo(client: fence_client::FenceClient) -> Result<(), fence_client::Error> {
    /// client.checkpoint_after("order-1234", "main", 1, "cp-0008", "cp-0007").await?;
    /// # Ok(()) }
    /// ```
    pub async fn checkpoint_after(
        &self,
        run_id: &str,
        branch: &str,
        epoch: u64,
        checkpoint_id: &str,
        parent_checkpoint_id: &str,
    ) -> Result<Stored<CheckpointInfo>, Error> {
        let request = pb::CheckpointRequest {
            run_id: run_id.to_owned(),
            branch: branch.to_owned(),
            epoch,
            checkpoint_id: checkpoint_id.to_owned(),
            parent_checkpoint_id: parent_checkpoint_id.to_owned(),
        };
        let response = self
            .unary(request, |mut s, r| async move { s.checkpoint(r).await })
            .await?;
        Ok(Stored {
            value: required(response.checkpoint, "checkpoint")?.into(),
            created: response.created,
        })
    }

    /// Rewinds the checkpoint's branch: a new epoch (fencing every older caller) and a replay
    /// tape. With `expected_epoch`, the restore happens only if the run is at that epoch.
    ///
    /// ```no_run
    /// # async fn demo(client: fence_client::FenceClient) -> Result<(), fence_client::Error> {
    /// let restored = client.restore("order-1234", "langgraph-cp-0007", Some(1)).await?;
    /// println!("epoch {} with {} effects to replay", restored.epoch, restored.tape.len());
    /// # Ok(()) }
    /// ```
    pub async fn restore(
        &self,
        run_id: &str,
        checkpoint_id: &str,
        expected_epoch: Option<u64>,
    ) -> Result<Restored, Error> {
        let request = pb::RestoreRequest {
            run_id: run_id.to_owned(),
            checkpoint_id: checkpoint_id.to_owned(),
            expected_epoch: expected_epoch.unwrap_or(0),
        };
        let response = self
            .unary(request, |mut s, r| async move { s.restore(r).await })
            .await?;
        response.try_into()
    }

    /// Creates a branch starting at a checkpoint (`new_branch: None` lets the server name it).
    /// Nothing recorded on the parent is undone: what it did after the checkpoint is carried
    /// onto the new branch, where an equivalent call replays it.
    ///
    /// ```no_run
    /// # async fn demo(client: fence_client::FenceClient) -> Result<(), fence_client::Error> {
    /// let forked = client
    ///     .fork("order-1234", "langgraph-cp-0007", 2, Some("pay-carol"), "user changed payee")
    ///     .await?;
    /// println!("continue on {}; {} effects stay done", forked.branch.name, forked.carried.len());
    /// # Ok(()) }
    /// ```
    pub async fn fork(
        &self,
        run_id: &str,
        checkpoint_id: &str,
        epoch: u64,
        new_branch: Option<&str>,
        reason: &str,
    ) -> Result<Forked, Error> {
        let request = pb::ForkRequest {
            run_id: run_id.to_owned(),
            checkpoint_id: checkpoint_id.to_owned(),
            epoch,
            new_branch: new_branch.unwrap_or_default().to_owned(),
            reason: reason.to_owned(),
        };
        let response = self
            .unary(request, |mut s, r| async move { s.fork(r).await })
            .await?;
        response.try_into()
    }

    /// Asks to perform one call: the raw decision. Most callers want
    /// [`FenceClient::run_effect`], which does the whole protocol.
    ///
    /// ```no_run
    /// # async fn demo(client: fence_client::FenceClient) -> Result<(), fence_client::Error> {
    /// use fence_client::{Decision, EffectCall};
    ///
    /// let call = EffectCall::new("order-1234", "payments.charge", r#"{"amount":4200}"#)
    ///     .step_key("order-1234:pay");
    /// match client.begin(&call).await?.decision {
    ///     Decision::Execute(grant) => println!("run it with key {}", grant.downstream_key),
    ///     Decision::Replay(receipt) => println!("already done: {:?}", receipt.result),
    ///     Decision::InProgress { .. } => println!("someone else is running it"),
    ///     Decision::Refused(refusal) => println!("refused: {refusal}"),
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn begin(&self, call: &EffectCall) -> Result<BeginOutcome, Error> {
        if let Some(session) = self.session_for_call() {
            return session.begin(call).await;
        }
        let request = pb::BeginRequest::from(call);
        let response = self
            .unary(request, |mut s, r| async move { s.begin(r).await })
            .await?;
        response.try_into()
    }

    /// Begins several calls in one request (an agent's parallel tool calls): each is decided
    /// as [`FenceClient::begin`] would decide it alone, in order, and all their writes share
    /// one durable sync on the server. The outer `Err` means the request failed as a whole
    /// (any call may or may not have been recorded: resend the same calls, with their request
    /// ids, to get the same effects back); otherwise there is one result per call.
    ///
    /// ```no_run
    /// # async fn demo(client: fence_client::FenceClient) -> Result<(), fence_client::Error> {
    /// use fence_client::{Decision, EffectCall};
    ///
    /// let calls = [
    ///     EffectCall::new("trip-7", "flights.book", r#"{"flight":"LH400"}"#).step_key("flight"),
    ///     EffectCall::new("trip-7", "hotels.book", r#"{"hotel":"Adlon"}"#).step_key("hotel"),
    /// ];
    /// for result in client.begin_batch(&calls).await? {
    ///     if let Decision::Execute(grant) = result?.decision {
    ///         println!("run {} with key {}", grant.effect_id, grant.downstream_key);
    ///     }
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn begin_batch(
        &self,
        calls: &[EffectCall],
    ) -> Result<Vec<Result<BeginOutcome, Error>>, Error> {
        let request = pb::BeginBatchRequest {
            calls: calls.iter().map(pb::BeginRequest::from).collect(),
        };
        let response = self
            .unary(request, |mut s, r| async move { s.begin_batch(r).await })
            .await?;
        let results = batch_results(calls.len(), response.results, |r| match r.result {
            Some(pb::begin_result::Result::Response(b)) => Ok(Ok(b)),
            Some(pb::begin_result::Result::Error(e)) => Ok(Err(e)),
            None => Err(Error::protocol("a batch result is empty")),
        })?
        .into_iter()
        .map(|r| r.and_then(BeginOutcome::try_from))
        .collect::<Vec<_>>();
        Ok(results)
    }

    /// Records several outcomes in one request, each as [`FenceClient::complete`] would alone,
    /// in order, with one durable sync for all; results as in [`FenceClient::begin_batch`].
    ///
    /// ```no_run
    /// # async fn demo(client: fence_client::FenceClient) -> Result<(), fence_client::Error> {
    /// use fence_client::{CompleteCall, Completion};
    ///
    /// let done = [
    ///     CompleteCall::new("effect-1", 1, Completion::Result(b"PNR-1".to_vec())),
    ///     CompleteCall::new("effect-2", 1, Completion::Result(b"HTL-9".to_vec())),
    /// ];
    /// for result in client.complete_batch(&done).await? {
    ///     println!("{}", result?.state);
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn complete_batch(
        &self,
        completions: &[CompleteCall],
    ) -> Result<Vec<Result<Receipt, Error>>, Error> {
        let request = pb::CompleteBatchRequest {
            completions: completions
                .iter()
                .map(|c| complete_request(&c.effect_id, c.attempt, c.epoch, c.completion.clone()))
                .collect(),
        };
        let response = self
            .unary(request, |mut s, r| async move { s.complete_batch(r).await })
            .await?;
        Ok(
            batch_results(completions.len(), response.results, |r| match r.result {
                Some(pb::complete_result::Result::Response(c)) => Ok(Ok(c)),
                Some(pb::complete_result::Result::Error(e)) => Ok(Err(e)),
                None => Err(Error::protocol("a batch result is empty")),
            })?
            .into_iter()
            .map(|r| r.and_then(|c| receipt_req(c.receipt, "receipt")))
            .collect(),
        )
    }

    /// Extends a granted effect's lease (`extend_ms` 0 = the grant's lease length).
    ///
    /// ```no_run
    /// # async fn demo(client: fence_client::FenceClient) -> Result<(), fence_client::Error> {
    /// let receipt = client.heartbeat("effect-id", 1, 1, 0).await?;
    /// println!("lease until {}", receipt.lease_expires_at_ms);
    /// # Ok(()) }
    /// ```
    pub async fn heartbeat(
        &self,
        effect_id: &str,
        attempt: u32,
        epoch: u64,
        extend_ms: u64,
    ) -> Result<Receipt, Error> {
        if let Some(session) = self.session_for_call() {
            return session
                .heartbeat(effect_id, attempt, epoch, extend_ms)
                .await;
        }
        let request = heartbeat_request(effect_id, attempt, epoch, extend_ms);
        let response = self
            .unary(request, |mut s, r| async move { s.heartbeat(r).await })
            .await?;
        receipt_req(response.receipt, "receipt")
    }

    /// Records a granted effect's outcome. An identical repeat is accepted.
    ///
    /// ```no_run
    /// # async fn demo(client: fence_client::FenceClient) -> Result<(), fence_client::Error> {
    /// use fence_client::Completion;
    ///
    /// let receipt = client
    ///     .complete("effect-id", 1, 1, Completion::Result(br#"{"charge":"ch_1"}"#.to_vec()))
    ///     .await?;
    /// println!("{}", receipt.state);
    /// # Ok(()) }
    /// ```
    pub async fn complete(
        &self,
        effect_id: &str,
        attempt: u32,
        epoch: u64,
        completion: Completion,
    ) -> Result<Receipt, Error> {
        if let Some(session) = self.session_for_call() {
            return session
                .complete(effect_id, attempt, epoch, completion)
                .await;
        }
        let request = complete_request(effect_id, attempt, epoch, completion);
        let response = self
            .unary(request, |mut s, r| async move { s.complete(r).await })
            .await?;
        receipt_req(response.receipt, "receipt")
    }

    /// Settles an effect whose outcome is unknown, with evidence from an outcome check.
    ///
    /// ```no_run
    /// # async fn demo(client: fence_client::FenceClient) -> Result<(), fence_client::Error> {
    /// use fence_client::Finding;
    ///
    /// let receipt = client
    ///     .reconcile("effect-id", 1, "bank API: no charge with key dk-1", Finding::FailedBeforeInput(
    ///         "no charge found".into(),
    ///     ))
    ///     .await?;
    /// println!("{}", receipt.state);
    /// # Ok(()) }
    /// ```
    pub async fn reconcile(
        &self,
        effect_id: &str,
        epoch: u64,
        evidence: &str,
        finding: Finding,
    ) -> Result<Receipt, Error> {
        let request = pb::ReconcileRequest {
            effect_id: effect_id.to_owned(),
            epoch,
            evidence: evidence.to_owned(),
            outcome: Some(finding.into()),
        };
        let response = self
            .unary(request, |mut s, r| async move { s.reconcile(r).await })
            .await?;
        receipt_req(response.receipt, "receipt")
    }

    /// Answers "what happened?" for an effect id, a step key or an intent.
    ///
    /// ```no_run
    /// # async fn demo(client: fence_client::FenceClient) -> Result<(), fence_client::Error> {
    /// use fence_client::OutcomeKey;
    ///
    /// let outcome = client
    ///     .query_outcome(OutcomeKey::StepKey {
    ///         run_id: "order-1234".into(),
    ///         branch: None,
    ///         step_key: "order-1234:pay".into(),
    ///     })
    ///     .await?;
    /// println!("{}", outcome.state);
    /// # Ok(()) }
    /// ```
    pub async fn query_outcome(&self, key: OutcomeKey) -> Result<Outcome, Error> {
        let request = pb::QueryOutcomeRequest {
            key: Some(key.into()),
        };
        let response = self
            .unary(request, |mut s, r| async move { s.query_outcome(r).await })
            .await?;
        response.try_into()
    }

    /// One page of a run's effects (`page_size` 0 = the server default). Returns the effects
    /// and the next page's token (`None` at the end).
    ///
    /// ```no_run
    /// # async fn demo(client: fence_client::FenceClient) -> Result<(), fence_client::Error> {
    /// use fence_client::EffectFilter;
    ///
    /// let (page, next) = client.list_effects_page(&EffectFilter::run("order-1234"), None, 50).await?;
    /// println!("{} effects, more: {}", page.len(), next.is_some());
    /// # Ok(()) }
    /// ```
    pub async fn list_effects_page(
        &self,
        filter: &EffectFilter,
        page_token: Option<&str>,
        page_size: u32,
    ) -> Result<(Vec<Receipt>, Option<String>), Error> {
        let request = pb::ListEffectsRequest {
            run_id: filter.run_id.clone(),
            branch: filter.branch.clone().unwrap_or_default(),
            saga_id: filter.saga_id.clone().unwrap_or_default(),
            page_size,
            page_token: page_token.unwrap_or_default().to_owned(),
            lineage: filter.lineage,
        };
        let response = self
            .unary(request, |mut s, r| async move { s.list_effects(r).await })
            .await?;
        receipts_page(response)
    }

    /// Every effect matching the filter, in recording order (all pages).
    ///
    /// ```no_run
    /// # async fn demo(client: fence_client::FenceClient) -> Result<(), fence_client::Error> {
    /// use fence_client::EffectFilter;
    ///
    /// for receipt in client.list_effects(&EffectFilter::run("order-1234")).await? {
    ///     println!("{} {} {}", receipt.position, receipt.tool, receipt.state);
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn list_effects(&self, filter: &EffectFilter) -> Result<Vec<Receipt>, Error> {
        all_pages("ListEffects", |token| async move {
            self.list_effects_page(filter, token.as_deref(), 0).await
        })
        .await
    }

    /// One page of the caller's effects not settled yet, across all its runs (granted,
    /// running, or of unknown outcome as of now), optionally only those in `state`. Returns
    /// the effects and the next page's token (`None` at the end).
    pub async fn list_unsettled_effects_page(
        &self,
        state: Option<EffectState>,
        page_token: Option<&str>,
        page_size: u32,
    ) -> Result<(Vec<Receipt>, Option<String>), Error> {
        let request = pb::ListUnsettledEffectsRequest {
            state: state.map_or(0, |s| pb::EffectState::from(s) as i32),
            page_size,
            page_token: page_token.unwrap_or_default().to_owned(),
        };
        let response = self
            .unary(request, |mut s, r| async move {
                s.list_unsettled_effects(r).await
            })
            .await?;
        receipts_page(response)
    }

    /// Every effect of the caller not settled yet (all pages), optionally only those in
    /// `state`: with [`EffectState::EffectUnknown`], the ones to reconcile.
    ///
    /// ```no_run
    /// # async fn demo(client: fence_client::FenceClient) -> Result<(), fence_client::Error> {
    /// use fence_client::EffectState;
    ///
    /// for r in client.list_unsettled_effects(Some(EffectState::EffectUnknown)).await? {
    ///     println!("{} {} {} needs a reconcile", r.run_id, r.effect_id, r.tool);
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn list_unsettled_effects(
        &self,
        state: Option<EffectState>,
    ) -> Result<Vec<Receipt>, Error> {
        all_pages("ListUnsettledEffects", |token| async move {
            self.list_unsettled_effects_page(state, token.as_deref(), 0)
                .await
        })
        .await
    }

    /// Registers a one-time (or n-time) credential. An existing one is returned unchanged.
    ///
    /// ```no_run
    /// # async fn demo(client: fence_client::FenceClient) -> Result<(), fence_client::Error> {
    /// use fence_client::NewCredential;
    ///
    /// let stored = client
    ///     .register_credential(&NewCredential::new(b"approval-7f3a".to_vec()).bound_to_tool("payments.charge"))
    ///     .await?;
    /// println!("{} uses left", stored.value.budget - stored.value.uses);
    /// # Ok(()) }
    /// ```
    pub async fn register_credential(
        &self,
        credential: &NewCredential,
    ) -> Result<Stored<CredentialInfo>, Error> {
        let request = pb::RegisterCredentialRequest {
            token: credential.token.clone(),
            budget: credential.budget,
            bound_tool: credential.bound_tool.clone().unwrap_or_default(),
            bound_arguments_json: credential.bound_arguments_json.clone().unwrap_or_default(),
        };
        let response = self
            .unary(
                request,
                |mut s, r| async move { s.register_credential(r).await },
            )
            .await?;
        Ok(Stored {
            value: required(response.credential, "credential")?.into(),
            created: response.created,
        })
    }

    /// Returns a credential's use state (looked up by its raw value, which is not stored).
    ///
    /// ```no_run
    /// # async fn demo(client: fence_client::FenceClient) -> Result<(), fence_client::Error> {
    /// let info = client.get_credential(b"approval-7f3a").await?;
    /// println!("spent by {:?}", info.spent_by_effect_ids);
    /// # Ok(()) }
    /// ```
    pub async fn get_credential(&self, token: &[u8]) -> Result<CredentialInfo, Error> {
        let request = pb::GetCredentialRequest {
            token: token.to_vec(),
        };
        let response = self
            .unary(request, |mut s, r| async move { s.get_credential(r).await })
            .await?;
        Ok(required(response.credential, "credential")?.into())
    }
}

/// Splits a batch response into one result per call, each error as the status the call would
/// have failed with alone; a response with the wrong number of results is a protocol error.
/// The request of one Complete (unary or on a session).
pub(crate) fn complete_request(
    effect_id: &str,
    attempt: u32,
    epoch: u64,
    completion: Completion,
) -> pb::CompleteRequest {
    pb::CompleteRequest {
        effect_id: effect_id.to_owned(),
        attempt,
        epoch,
        outcome: Some(completion.into()),
    }
}

/// The request of one Heartbeat (unary or on a session).
pub(crate) fn heartbeat_request(
    effect_id: &str,
    attempt: u32,
    epoch: u64,
    extend_ms: u64,
) -> pb::HeartbeatRequest {
    pb::HeartbeatRequest {
        effect_id: effect_id.to_owned(),
        attempt,
        epoch,
        extend_ms,
    }
}

fn batch_results<R, T>(
    expected: usize,
    results: Vec<R>,
    split: impl Fn(R) -> Result<Result<T, pb::CallError>, Error>,
) -> Result<Vec<Result<T, Error>>, Error> {
    if results.len() != expected {
        return Err(Error::protocol(format!(
            "the server answered {} results for {expected} calls",
            results.len()
        )));
    }
    results
        .into_iter()
        .map(|r| {
            Ok(split(r)?.map_err(|e| {
                Error::from(tonic::Status::with_details(
                    tonic::Code::from(e.code),
                    e.message,
                    e.details.into(),
                ))
            }))
        })
        .collect()
}

/// The receipts of a ListEffects (or ListUnsettledEffects) page and the next page's token.
fn receipts_page(
    response: pb::ListEffectsResponse,
) -> Result<(Vec<Receipt>, Option<String>), Error> {
    let effects = response
        .effects
        .into_iter()
        .map(Receipt::try_from)
        .collect::<Result<_, _>>()?;
    Ok((effects, crate::types::non_empty(response.next_page_token)))
}

/// Follows a listing's page tokens to the end and returns every item, refusing a server that
/// hands out the same token twice (which would loop forever).
async fn all_pages<T, F, Fut>(rpc: &str, mut page: F) -> Result<Vec<T>, Error>
where
    F: FnMut(Option<String>) -> Fut,
    Fut: std::future::Future<Output = Result<(Vec<T>, Option<String>), Error>>,
{
    let mut all = Vec::new();
    let mut token: Option<String> = None;
    loop {
        let (items, next) = page(token.clone()).await?;
        all.extend(items);
        match next {
            Some(next) if Some(&next) != token.as_ref() => token = Some(next),
            Some(_) => {
                return Err(Error::protocol(format!(
                    "{rpc} returned the same page token twice"
                )));
            }
            None => return Ok(all),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_maps_onto_the_begin_request_field_by_field() {
        let call = EffectCall::new("r1", "t", "{}")
            .branch("b")
            .epoch(3)
            .step_key("r1:s")
            .deliberate_repeat()
            .credential(b"tok".to_vec(), 2)
            .lease_ms(500)
            .record()
            .saga("s1")
            .compensation(Compensation::new("undo", "{\"x\":1}"))
            .compensates("e0");
        let request = pb::BeginRequest::from(&call);
        assert_eq!(request.run_id, "r1");
        assert_eq!(request.branch, "b");
        assert_eq!(request.epoch, 3);
        assert_eq!(request.step_key, "r1:s");
        assert!(request.deliberate_repeat && request.record);
        assert_eq!(request.credentials[0].token, b"tok");
        assert_eq!(request.credentials[0].budget, 2);
        assert_eq!(request.lease_ms, 500);
        assert_eq!(request.saga_id, "s1");
        assert_eq!(request.compensation.unwrap().tool, "undo");
        assert_eq!(request.compensates_effect_id, "e0");
        let plain = pb::BeginRequest::from(&EffectCall::new("r1", "t", "{}"));
        assert_eq!(plain.branch, "");
        assert_eq!(plain.step_key, "");
        assert!(plain.compensation.is_none());
    }

    #[tokio::test]
    async fn invalid_configuration_is_refused_before_connecting() {
        assert!(matches!(
            FenceClient::builder("not a url").connect_lazy(),
            Err(Error::Config(_))
        ));
        assert!(matches!(
            FenceClient::builder("http://127.0.0.1:1")
                .bearer_token("line\nbreak")
                .connect_lazy(),
            Err(Error::Config(_))
        ));
        let client = FenceClient::builder("http://127.0.0.1:1")
            .bearer_token("s3cr3t")
            .connect_lazy()
            .unwrap();
        assert!(!format!("{client:?}").contains("s3cr3t"));
    }

    #[tokio::test]
    async fn an_unreachable_server_is_a_transient_error() {
        // Port 1 on localhost is closed: the lazy channel fails on the first call.
        let client = FenceClient::builder("http://127.0.0.1:1")
            .connect_lazy()
            .unwrap();
        let err = client.get_run("r").await.unwrap_err();
        assert!(err.is_transient(), "{err:?}");
    }
}
