//! `fence-mcp`: an MCP gateway that puts Fence in front of any MCP server's tools.
//!
//! An MCP host launches `fence-mcp ... -- <the real server's command>` instead of the real
//! server. The gateway lists the upstream server's tools (and passes prompts and resources
//! through) and sends every `tools/call` through the fence: `Begin`, forward the call upstream
//! only on `Execute`, `Complete` with the upstream `CallToolResult`; a replay returns the
//! recorded `CallToolResult` as it was; a refusal becomes an `isError` result whose text is the
//! sentence written for the model and whose `structuredContent` carries the machine-readable
//! reason, recovery and receipt (the structured error object MCP lacks); an upstream failure
//! after the call was sent is recorded as unknown, never retried blind.
//!
//! This module owns the gateway: the `_meta` convention ([`CallMeta`]), the per-tool
//! configuration ([`GatewayConfig`]) and the MCP server handler ([`Gateway`]).

pub mod tools;
pub mod upstreams;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fence_client::{
    EffectCall, Error as FenceError, FenceClient, IntentSchema, OperationClass, Receipt, Refusal,
    StringNormalization, ToolDef, ToolError,
};
use fence_server::trace::{TRACEPARENT, TraceParent};
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, GetPromptRequestParams,
    GetPromptResponse, InitializeResult, JsonObject, ListPromptsResult, ListResourcesResult,
    ListToolsResult, PaginatedRequestParams, ReadResourceRequestParams, ReadResourceResponse,
    ServerCapabilities, Tool,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData as McpError, RoleServer, ServerHandler};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::Mutex;
pub use upstreams::{Upstream, Upstreams};

/// The `_meta` key prefix of the gateway's request fields (see [`CallMeta`]).
pub const META_PREFIX: &str = "dev.fence/";

/// The `_meta` keys of W3C trace context, passed upstream unchanged.
const TRACE_CONTEXT_KEYS: [&str; 2] = [TRACEPARENT, "tracestate"];

/// What a caller may say about a call in the request's `_meta`, each under [`META_PREFIX`]:
/// `runId`, `stepKey`, `epoch`, `branch`, `parentCheckpointId`, `credentials` (an array of
/// strings), `deliberateRepeat`; and `idempotencyKey` (SEP-3182's proposal, used as the step
/// key when no `stepKey` is given). All optional: a caller that sends none gets the gateway's
/// default run and the keyless rules. Outside the prefix, a W3C `traceparent` (the key MCP's
/// tracing convention uses) is carried into the Fence calls; an invalid one is ignored, as
/// the W3C recommendation asks of a receiver.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CallMeta {
    /// The Fence run (default: the gateway's `--run-id`).
    pub run_id: Option<String>,
    /// The step key.
    pub step_key: Option<String>,
    /// The caller's epoch (0 = untracked).
    pub epoch: u64,
    /// The branch (default "main").
    pub branch: Option<String>,
    /// The checkpoint the call descends from.
    pub parent_checkpoint_id: Option<String>,
    /// One-time credentials the call spends.
    pub credentials: Vec<String>,
    /// "An identical call is already recorded, and I mean to do it again."
    pub deliberate_repeat: bool,
    /// The caller's W3C trace context (`_meta.traceparent`), when valid.
    pub traceparent: Option<TraceParent>,
}

impl CallMeta {
    /// Reads the gateway's fields from a request's `_meta`; an ill-typed field is an error
    /// naming it (and nothing is recorded).
    pub fn parse(meta: Option<&JsonObject>) -> Result<Self, String> {
        let mut out = CallMeta::default();
        let Some(meta) = meta else {
            return Ok(out);
        };
        let string = |name: &str| -> Result<Option<String>, String> {
            match meta.get(&format!("{META_PREFIX}{name}")) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) if !s.trim().is_empty() => Ok(Some(s.clone())),
                Some(other) => Err(format!(
                    "_meta \"{META_PREFIX}{name}\" must be a non-empty string, not {other}"
                )),
            }
        };
        out.run_id = string("runId")?;
        out.step_key = string("stepKey")?.or(string("idempotencyKey")?);
        out.branch = string("branch")?;
        out.parent_checkpoint_id = string("parentCheckpointId")?;
        match meta.get(&format!("{META_PREFIX}epoch")) {
            None | Some(Value::Null) => {}
            Some(v) => {
                out.epoch = v.as_u64().ok_or_else(|| {
                    format!("_meta \"{META_PREFIX}epoch\" must be a non-negative integer, not {v}")
                })?
            }
        }
        match meta.get(&format!("{META_PREFIX}deliberateRepeat")) {
            None | Some(Value::Null) => {}
            Some(Value::Bool(b)) => out.deliberate_repeat = *b,
            Some(v) => {
                return Err(format!(
                    "_meta \"{META_PREFIX}deliberateRepeat\" must be a boolean, not {v}"
                ));
            }
        }
        match meta.get(&format!("{META_PREFIX}credentials")) {
            None | Some(Value::Null) => {}
            Some(Value::Array(items)) => {
                for item in items {
                    match item {
                        Value::String(s) if !s.is_empty() => out.credentials.push(s.clone()),
                        other => {
                            return Err(format!(
                                "_meta \"{META_PREFIX}credentials\" must hold non-empty strings, not {other}"
                            ));
                        }
                    }
                }
            }
            Some(v) => {
                return Err(format!(
                    "_meta \"{META_PREFIX}credentials\" must be an array of strings, not {v}"
                ));
            }
        }
        out.traceparent = meta
            .get(TRACEPARENT)
            .and_then(Value::as_str)
            .and_then(TraceParent::parse);
        Ok(out)
    }
}

/// Per-tool settings from the gateway's TOML file (`[tools."name"]` tables).
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ToolSettings {
    /// `SAFE_RETRY`, `DEDUPLICATE`, `REQUIRES_EFFECT_CHECK` or `NON_RETRYABLE` (default: from
    /// the tool's annotations).
    pub class: Option<String>,
    /// Argument paths the model rewrites on every call (request ids, timestamps).
    #[serde(default)]
    pub volatile_fields: Vec<String>,
    /// String argument paths compared after normalising (see `string_normalization`).
    #[serde(default)]
    pub normalized_fields: Vec<String>,
    /// How `normalized_fields` are normalised: `"trim"` or `"trim_lowercase"` (default:
    /// compared exactly).
    pub string_normalization: Option<String>,
    /// Arguments holding one-time credentials: spent with the call, left out of its intent.
    #[serde(default)]
    pub credential_args: Vec<String>,
    /// Retention of finished effects in ms (0 = the server's default).
    #[serde(default)]
    pub retention_ms: u64,
    /// The lease of a grant in ms (0 = the server's default): how long a call may run before
    /// a caller that finds it still running is told its outcome is unknown.
    #[serde(default)]
    pub lease_ms: u64,
    /// An argument that receives the grant's downstream key (it is also sent in `_meta`).
    pub downstream_key_arg: Option<String>,
}

/// An upstream server named in the configuration file (`[upstreams.<name>]`): a command
/// started as a child process speaking MCP on stdio, or a streamable HTTP URL.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct UpstreamSettings {
    /// The command and its arguments.
    #[serde(default)]
    pub command: Vec<String>,
    /// The streamable HTTP endpoint.
    pub url: Option<String>,
}

/// The gateway's configuration file.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct GatewayConfig {
    /// Per-tool settings, by the tool's name as listed (`<upstream>__<tool>` with several
    /// upstreams).
    #[serde(default)]
    pub tools: HashMap<String, ToolSettings>,
    /// Upstream servers by name (their tools are then namespaced); instead of the command
    /// line's single upstream.
    #[serde(default)]
    pub upstreams: std::collections::BTreeMap<String, UpstreamSettings>,
}

impl GatewayConfig {
    /// Parses the TOML text of a configuration file.
    pub fn from_toml(text: &str) -> Result<Self, String> {
        let config: GatewayConfig = toml::from_str(text).map_err(|e| e.to_string())?;
        for (name, up) in &config.upstreams {
            if up.command.is_empty() == up.url.is_none() {
                return Err(format!(
                    "upstreams.{name}: give exactly one of command and url"
                ));
            }
        }
        for (name, tool) in &config.tools {
            if string_rule(tool.string_normalization.as_deref()).is_none() {
                return Err(format!(
                    "tools.{name}.string_normalization: use \"trim\" or \"trim_lowercase\""
                ));
            }
            if let Some(class) = &tool.class
                && OperationClass::from_str_name(class).is_none()
            {
                return Err(format!("tools.{name}.class: unknown class {class:?}"));
            }
        }
        Ok(config)
    }
}

/// The normalisation a configuration names (`None` for an unknown name).
fn string_rule(name: Option<&str>) -> Option<StringNormalization> {
    match name {
        None | Some("exact") => Some(StringNormalization::Exact),
        Some("trim") => Some(StringNormalization::Trim),
        Some("trim_lowercase") => Some(StringNormalization::TrimLowercase),
        Some(_) => None,
    }
}

/// The tool's class: the configuration's, else from its annotations (`readOnlyHint` ->
/// SAFE_RETRY, `idempotentHint` -> DEDUPLICATE), else NON_RETRYABLE. Annotations are hints
/// from the upstream server, so only a configuration can make a tool less fenced than that.
pub fn class_of(tool: Option<&Tool>, settings: Option<&ToolSettings>) -> OperationClass {
    if let Some(class) = settings
        .and_then(|s| s.class.as_deref())
        .and_then(OperationClass::from_str_name)
    {
        return class;
    }
    let annotations = tool.and_then(|t| t.annotations.as_ref());
    match annotations {
        Some(a) if a.read_only_hint == Some(true) => OperationClass::SafeRetry,
        Some(a) if a.idempotent_hint == Some(true) => OperationClass::Deduplicate,
        _ => OperationClass::NonRetryable,
    }
}

/// The gateway: an MCP server whose tools are the upstream server's, fenced. Cheap to clone:
/// clones share the upstream connection, the Fence client and what they learned of the tools
/// (the streamable HTTP transport makes one per session).
#[derive(Clone)]
pub struct Gateway {
    upstreams: Arc<Upstreams>,
    fence: FenceClient,
    /// With client tokens (streamable HTTP): each client's tenant, from its bearer token, and a
    /// Fence client per tenant.
    clients: Option<Arc<ClientTenants>>,
    config: Arc<GatewayConfig>,
    default_run: String,
    /// How long after a keyless call completed an identical one counts as its re-issue (a
    /// broken stream re-sent on a new request id) and gets its result.
    reissue_window: Duration,
    /// How long an upstream call may take; past it the outcome is unknown (it was sent).
    upstream_timeout: Duration,
    /// List and serve the gateway's own tools (see [`tools`]).
    fence_tools: bool,
    /// Upstream tools by name (refreshed on every listing) and the tools registered on Fence.
    tools: Arc<Mutex<KnownTools>>,
}

/// Upstream tools by name, and the classes of those registered on Fence (by tenant and name).
type KnownTools = (
    HashMap<String, Tool>,
    HashMap<(String, String), OperationClass>,
);

/// Makes the Fence client of one tenant.
pub type ClientFactory = dyn Fn(&str) -> Result<FenceClient, FenceError> + Send + Sync;

/// Clients authenticated by bearer token (the same file format as `fenced`'s tokens file),
/// each recorded in its own Fence tenant.
pub struct ClientTenants {
    auth: fence_server::auth::Auth,
    make: Box<ClientFactory>,
    by_tenant: std::sync::Mutex<HashMap<String, FenceClient>>,
}

impl ClientTenants {
    /// Clients from a tokens file's `auth`; `make` builds a tenant's Fence client.
    pub fn new(auth: fence_server::auth::Auth, make: Box<ClientFactory>) -> Self {
        ClientTenants {
            auth,
            make,
            by_tenant: std::sync::Mutex::new(HashMap::new()),
        }
    }

    /// The tenant and Fence client of the client presenting `authorization`; `Err` is the
    /// reason it is not accepted.
    fn resolve(&self, authorization: Option<&str>) -> Result<(String, FenceClient), String> {
        let mut request = tonic::Request::new(());
        if let Some(value) = authorization {
            let value = value
                .parse()
                .map_err(|_| "the authorization header is not valid".to_owned())?;
            request.metadata_mut().insert("authorization", value);
        }
        let request = self
            .auth
            .authenticate(request)
            .map_err(|status| status.message().to_owned())?;
        let tenant = fence_server::auth::tenant_of(&request)
            .map_err(|status| status.message().to_owned())?
            .to_string();
        let mut clients = self.by_tenant.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(client) = clients.get(&tenant) {
            return Ok((tenant, client.clone()));
        }
        let client = (self.make)(&tenant).map_err(|e| e.to_string())?;
        clients.insert(tenant.clone(), client.clone());
        Ok((tenant, client))
    }
}

impl Gateway {
    /// A gateway forwarding to `upstreams` through `fence`.
    pub fn new(
        upstreams: Upstreams,
        fence: FenceClient,
        config: GatewayConfig,
        default_run: String,
        reissue_window: Duration,
        upstream_timeout: Duration,
    ) -> Self {
        Gateway {
            upstreams: Arc::new(upstreams),
            fence,
            clients: None,
            config: Arc::new(config),
            default_run,
            reissue_window,
            upstream_timeout,
            fence_tools: false,
            tools: Arc::new(Mutex::new((HashMap::new(), HashMap::new()))),
        }
    }

    /// The run of a call whose `_meta` names none: the gateway's default run, or over HTTP one
    /// per client credential (its bearer token, hashed), so a re-issue on a new connection is
    /// still the same client's call while two clients never replay each other's.
    fn default_run_of(&self, client: Option<&str>) -> String {
        match client {
            None => self.default_run.clone(),
            Some(authorization) => {
                // The token's blake3 (as in a tokens file), shortened: `<run-id>-<16 hex>`.
                let token = authorization
                    .strip_prefix("Bearer ")
                    .unwrap_or(authorization);
                let hash = blake3::hash(token.trim().as_bytes()).to_hex();
                format!("{}-{}", self.default_run, &hash[..16])
            }
        }
    }

    /// Authenticates clients by bearer token and records each in its own Fence tenant (see
    /// [`ClientTenants`]).
    #[must_use]
    pub fn with_client_tenants(mut self, clients: ClientTenants) -> Self {
        self.clients = Some(Arc::new(clients));
        self
    }

    /// The Fence client (and its tenant's name, "" for the gateway's own) for a client.
    fn fence_for(&self, authorization: Option<&str>) -> Result<(String, FenceClient), String> {
        match &self.clients {
            None => Ok((String::new(), self.fence.clone())),
            Some(clients) => clients.resolve(authorization),
        }
    }

    /// Lists and serves the gateway's own tools (`fence_checkpoint`, `fence_restore`,
    /// `fence_fork`, `fence_outcome`).
    #[must_use]
    pub fn with_fence_tools(mut self, enabled: bool) -> Self {
        self.fence_tools = enabled;
        self
    }

    /// Registers the tool on Fence once (its class and intent schema), returning its class.
    async fn ensure_registered(
        &self,
        fence: &FenceClient,
        tenant: &str,
        name: &str,
    ) -> Result<OperationClass, FenceError> {
        let key = (tenant.to_owned(), name.to_owned());
        let mut tools = self.tools.lock().await;
        if let Some(class) = tools.1.get(&key) {
            return Ok(*class);
        }
        if !tools.0.contains_key(name)
            && let Ok(listed) = self.upstreams.list_all_tools().await
        {
            tools.0 = listed
                .into_iter()
                .map(|t| (t.name.to_string(), t))
                .collect();
        }
        let settings = self.config.tools.get(name);
        let class = class_of(tools.0.get(name), settings);
        let mut volatile: Vec<String> = settings
            .map(|s| s.volatile_fields.clone())
            .unwrap_or_default();
        // Credentials are authority, not intent; the downstream key is the gateway's own.
        if let Some(s) = settings {
            volatile.extend(s.credential_args.iter().cloned());
            volatile.extend(s.downstream_key_arg.iter().cloned());
        }
        let mut def = ToolDef::new(name, class);
        def.intent_schema = IntentSchema::default().volatile(volatile);
        if let Some(s) = settings
            && !s.normalized_fields.is_empty()
        {
            let how = string_rule(s.string_normalization.as_deref()).unwrap_or_default();
            def.intent_schema = def
                .intent_schema
                .normalized(s.normalized_fields.iter().cloned(), how);
        }
        def.retention_ms = settings.map_or(0, |s| s.retention_ms);
        def.lease_ms = settings.map_or(0, |s| s.lease_ms);
        fence.register_tool(def).await?;
        tools.1.insert(key, class);
        Ok(class)
    }

    async fn fenced_call(
        &self,
        request: CallToolRequestParams,
        context_meta: &JsonObject,
        client: Option<&str>,
    ) -> CallToolResult {
        let name = request.name.to_string();
        // The SDK hands a request's `_meta` to the handler in its context.
        let raw_meta = request.meta.as_ref().map_or(context_meta, |m| &m.0.0);
        let meta = match CallMeta::parse(Some(raw_meta)) {
            Ok(meta) => meta,
            Err(why) => {
                return error_result(&why, json!({"reason": "INVALID_META", "detail": why}));
            }
        };
        // The host's trace context goes upstream as it came (the gateway is transparent to it).
        let trace: JsonObject = TRACE_CONTEXT_KEYS
            .iter()
            .filter_map(|&k| raw_meta.get(k).map(|v| (k.to_owned(), v.clone())))
            .collect();
        let mut request = request;
        if !trace.is_empty() {
            request
                .meta
                .get_or_insert_with(Default::default)
                .0
                .0
                .extend(trace);
        }
        if self.upstreams.route(&name).is_none() {
            return error_result(
                &format!("There is no tool named {name:?}."),
                json!({"reason": "UNKNOWN_TOOL"}),
            );
        }
        let (tenant, fence) = match self.fence_for(client) {
            // The caller's trace follows the call into Fence (the value was validated).
            Ok((tenant, fence)) => match meta.traceparent {
                Some(parent) => (
                    tenant,
                    fence.with_traceparent(&parent.to_string()).unwrap_or(fence),
                ),
                None => (tenant, fence),
            },
            Err(why) => {
                return error_result(
                    "This client is not allowed to use these tools.",
                    json!({"reason": "UNAUTHENTICATED", "detail": why}),
                );
            }
        };
        let class = match self.ensure_registered(&fence, &tenant, &name).await {
            Ok(class) => class,
            Err(e) => return fence_unavailable(&e),
        };
        let settings = self.config.tools.get(&name).cloned().unwrap_or_default();
        let arguments = request.arguments.clone().unwrap_or_default();
        let mut call = EffectCall::new(
            meta.run_id
                .clone()
                .unwrap_or_else(|| self.default_run_of(client)),
            name.clone(),
            Value::Object(arguments.clone()).to_string(),
        );
        call.step_key = meta.step_key.clone();
        call.epoch = meta.epoch;
        call.branch = meta.branch.clone();
        call.parent_checkpoint_id = meta.parent_checkpoint_id.clone();
        call.deliberate_repeat = meta.deliberate_repeat;
        for token in meta.credentials.iter().cloned().chain(
            settings
                .credential_args
                .iter()
                .filter_map(|a| arguments.get(a))
                .filter_map(|v| v.as_str().map(str::to_owned)),
        ) {
            call = call.credential(token.into_bytes(), 1);
        }
        if class == OperationClass::SafeRetry {
            // Read-only: nothing to fence; forwarded as is.
            return match self.forward(request, None, &settings).await {
                Ok(result) => result,
                Err(failed) => failed.result,
            };
        }
        let outcome = fence
            .run_effect(&call, |ctx| {
                let request = request.clone();
                let settings = settings.clone();
                async move {
                    match self
                        .forward(request, Some(&ctx.downstream_key), &settings)
                        .await
                    {
                        Ok(result) => serde_json::to_vec(&result)
                            .map_err(|e| ToolError::Unknown(format!("result not encodable: {e}"))),
                        // Recorded as not having happened; the host gets this answer.
                        Err(failed) if !failed.sent => {
                            Err(ToolError::Rejected(text_of(&failed.result)))
                        }
                        Err(failed) => Err(ToolError::Unknown(text_of(&failed.result))),
                    }
                }
            })
            .await;
        match outcome {
            Ok(done) => decode_recorded(&done.result),
            Err(FenceError::Refused { refusal, .. }) => self.refused(*refusal),
            Err(FenceError::ToolFailed { detail, .. }) => error_result(
                "The tool did not act: it asked for input this gateway cannot relay yet.",
                json!({"reason": "UPSTREAM_INPUT_REQUIRED", "detail": detail}),
            ),
            Err(FenceError::EffectUnknown { receipt, detail }) => error_result(
                "This action may or may not have happened (the tool did not answer). Do not retry it; tell the user it needs to be checked.",
                json!({"reason": "RECONCILE_REQUIRED", "recovery": "RECONCILE", "effectId": receipt.effect_id, "detail": detail}),
            ),
            Err(e) => fence_unavailable(&e),
        }
    }

    /// A refusal as the model and the host see it; a keyless re-issue of a call that just
    /// completed gets that call's result instead (the same call, re-sent after a broken stream).
    fn refused(&self, refusal: Refusal) -> CallToolResult {
        if refusal.reason == fence_client::ReasonCode::DuplicateIntent
            && let Some(receipt) = &refusal.receipt
            && receipt.state == fence_client::EffectState::Completed
            && now_ms().saturating_sub(receipt.updated_at_ms)
                <= self.reissue_window.as_millis() as u64
        {
            return decode_recorded(&receipt.result);
        }
        error_result(
            &refusal.message,
            json!({
                "reason": refusal.reason.as_str_name(),
                "recovery": refusal.recovery.as_str_name(),
                "effectId": refusal.effect_id,
                "checkpointId": refusal.checkpoint_id,
                "currentEpoch": refusal.current_epoch,
                "receipt": refusal.receipt.as_ref().map(receipt_json),
            }),
        )
    }

    /// Sends the call upstream, with the downstream key in `_meta` (and in the configured
    /// argument). `Err` holds a result to return as is, and whether the tool may have acted.
    async fn forward(
        &self,
        mut request: CallToolRequestParams,
        downstream_key: Option<&str>,
        settings: &ToolSettings,
    ) -> Result<CallToolResult, Failed> {
        if let Some(key) = downstream_key {
            let mut meta = request.meta.take().unwrap_or_default();
            meta.0
                .0
                .insert(format!("{META_PREFIX}downstreamKey"), json!(key));
            request.meta = Some(meta);
            if let Some(arg) = &settings.downstream_key_arg {
                request
                    .arguments
                    .get_or_insert_with(JsonObject::new)
                    .insert(arg.clone(), json!(key));
            }
        }
        let public = request.name.to_string();
        let Some((upstream, tool)) = self.upstreams.route(&public) else {
            return Err(Failed {
                result: error_result(
                    &format!("There is no tool named {public:?}."),
                    json!({"reason": "UNKNOWN_TOOL"}),
                ),
                sent: false,
            });
        };
        request.name = tool.to_owned().into();
        let sent = tokio::time::timeout(
            self.upstream_timeout,
            upstream.service.call_tool_once(request),
        );
        let Ok(answer) = sent.await else {
            return Err(Failed::maybe_sent(error_result(
                "The tool did not answer in time.",
                json!({"reason": "UPSTREAM_TIMEOUT"}),
            )));
        };
        match answer {
            Ok(CallToolResponse::Complete(result)) => Ok(result),
            // The tool asks for input (MRTR) or defers to a task before acting.
            Ok(_) => Err(Failed {
                result: error_result(
                    "The tool asked for input this gateway cannot relay yet; nothing was done.",
                    json!({"reason": "UPSTREAM_INPUT_REQUIRED"}),
                ),
                sent: false,
            }),
            Err(e) => Err(Failed::maybe_sent(error_result(
                &format!("The tool did not answer: {e}"),
                json!({"reason": "UPSTREAM_FAILED", "detail": e.to_string()}),
            ))),
        }
    }
}

/// An upstream call that gave no result.
struct Failed {
    /// What to answer the host.
    result: CallToolResult,
    /// Whether the tool may have acted (the call was sent and no answer says otherwise).
    sent: bool,
}

impl Failed {
    fn maybe_sent(result: CallToolResult) -> Self {
        Failed { result, sent: true }
    }
}

impl ServerHandler for Gateway {
    fn get_info(&self) -> InitializeResult {
        let mut caps = ServerCapabilities::builder().enable_tools().build();
        for up in self.upstreams.all() {
            if let Some(info) = up.service.peer_info() {
                if caps.prompts.is_none() {
                    caps.prompts = info.capabilities.prompts.clone();
                }
                if caps.resources.is_none() {
                    caps.resources = info.capabilities.resources.clone();
                }
            }
        }
        InitializeResult::new(caps).with_instructions(
            "Tools are fenced by Fence: a repeated or replayed call returns the recorded result instead of acting twice.",
        )
    }

    async fn list_tools(
        &self,
        request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, McpError> {
        let mut listed = self
            .upstreams
            .list_tools(request)
            .await
            .map_err(upstream_error)?;
        let mut tools = self.tools.lock().await;
        for tool in &listed.tools {
            tools.0.insert(tool.name.to_string(), tool.clone());
        }
        if self.fence_tools && listed.next_cursor.is_none() {
            listed.tools.extend(tools::definitions());
        }
        Ok(listed)
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        // Over streamable HTTP: the client's bearer credential, if it sent one.
        let client = context
            .extensions
            .get::<http::request::Parts>()
            .and_then(|parts| parts.headers.get(http::header::AUTHORIZATION))
            .and_then(|value| value.to_str().ok())
            .map(str::to_owned);
        if self.fence_tools && tools::NAMES.contains(&request.name.as_ref()) {
            let args = request.arguments.clone().unwrap_or_default();
            let result = match self.fence_for(client.as_deref()) {
                Ok((_, fence)) => {
                    tools::call(&fence, &self.default_run, &request.name, &args).await
                }
                Err(why) => error_result(
                    "This client is not allowed to use these tools.",
                    json!({"reason": "UNAUTHENTICATED", "detail": why}),
                ),
            };
            return Ok(CallToolResponse::Complete(result));
        }
        let meta = context.meta.0.0.clone();
        Ok(CallToolResponse::Complete(
            self.fenced_call(request, &meta, client.as_deref()).await,
        ))
    }

    async fn list_prompts(
        &self,
        request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListPromptsResult, McpError> {
        self.upstreams
            .list_prompts(request)
            .await
            .map_err(upstream_error)
    }

    async fn get_prompt(
        &self,
        request: GetPromptRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<GetPromptResponse, McpError> {
        self.upstreams
            .get_prompt(request)
            .await
            .map(GetPromptResponse::Complete)
            .map_err(upstream_error)
    }

    async fn list_resources(
        &self,
        request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListResourcesResult, McpError> {
        self.upstreams
            .list_resources(request)
            .await
            .map_err(upstream_error)
    }

    async fn read_resource(
        &self,
        request: ReadResourceRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<ReadResourceResponse, McpError> {
        self.upstreams
            .read_resource(request)
            .await
            .map(ReadResourceResponse::Complete)
            .map_err(upstream_error)
    }
}

fn upstream_error(e: rmcp::service::ServiceError) -> McpError {
    McpError::internal_error(format!("upstream MCP server: {e}"), None)
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// An `isError` result: `message` for the model, `fence` for the host.
fn error_result(message: &str, fence: Value) -> CallToolResult {
    let mut result = CallToolResult::error(vec![ContentBlock::text(message)]);
    result.structured_content = Some(json!({ "fence": fence }));
    result
}

fn fence_unavailable(e: &FenceError) -> CallToolResult {
    error_result(
        "The safety service that records this tool's effects is unavailable, so the call was not made. Try again later.",
        json!({"reason": "FENCE_UNAVAILABLE", "detail": e.to_string()}),
    )
}

/// The recorded result of a call: the upstream `CallToolResult` as it was.
fn decode_recorded(bytes: &[u8]) -> CallToolResult {
    serde_json::from_slice(bytes).unwrap_or_else(|_| {
        CallToolResult::success(vec![ContentBlock::text(String::from_utf8_lossy(bytes))])
    })
}

fn text_of(result: &CallToolResult) -> String {
    serde_json::to_string(&result.structured_content).unwrap_or_default()
}

fn receipt_json(r: &Receipt) -> Value {
    json!({
        "effectId": r.effect_id,
        "tool": r.tool,
        "state": r.state.as_str_name(),
        "argumentsJson": r.arguments_json,
        "attempt": r.attempt,
        "branch": r.branch,
        "epoch": r.epoch,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(v: Value) -> JsonObject {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn meta_fields_are_read_under_the_prefix() {
        let m = CallMeta::parse(Some(&meta(json!({
            "dev.fence/runId": "run-1",
            "dev.fence/idempotencyKey": "k1",
            "dev.fence/epoch": 2,
            "dev.fence/credentials": ["approval-1"],
            "dev.fence/deliberateRepeat": true,
            "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "other/key": 5,
        }))))
        .unwrap();
        assert_eq!(
            m.traceparent.map(|t| t.trace_id_hex()).as_deref(),
            Some("4bf92f3577b34da6a3ce929d0e0e4736")
        );
        // An invalid trace context is ignored, not an error.
        let ignored = CallMeta::parse(Some(&meta(json!({"traceparent": "nonsense"})))).unwrap();
        assert_eq!(ignored.traceparent, None);
        assert_eq!(m.run_id.as_deref(), Some("run-1"));
        assert_eq!(m.step_key.as_deref(), Some("k1"));
        assert_eq!(m.epoch, 2);
        assert_eq!(m.credentials, ["approval-1"]);
        assert!(m.deliberate_repeat);
        assert_eq!(CallMeta::parse(None).unwrap(), CallMeta::default());
    }

    #[test]
    fn malformed_meta_is_an_error_naming_the_field() {
        for bad in [
            json!({"dev.fence/epoch": "two"}),
            json!({"dev.fence/runId": 7}),
            json!({"dev.fence/runId": "  "}),
            json!({"dev.fence/credentials": "x"}),
            json!({"dev.fence/deliberateRepeat": "yes"}),
        ] {
            let err = CallMeta::parse(Some(&meta(bad.clone()))).unwrap_err();
            let field = bad.as_object().unwrap().keys().next().unwrap().clone();
            assert!(err.contains(&field), "{err}");
        }
    }

    #[test]
    fn classes_come_from_configuration_then_annotations() {
        let config = GatewayConfig::from_toml(
            "[tools.charge]\nclass = \"DEDUPLICATE\"\nvolatile_fields = [\"reference\"]\n",
        )
        .unwrap();
        assert_eq!(
            class_of(None, config.tools.get("charge")),
            OperationClass::Deduplicate
        );
        assert_eq!(class_of(None, None), OperationClass::NonRetryable);
        assert!(GatewayConfig::from_toml("[tools.x]\nclass = \"SOMETIMES\"\n").is_err());
        assert!(GatewayConfig::from_toml("[tools.x]\nunknown = 1\n").is_err());
        assert!(GatewayConfig::from_toml("[tools.x]\nstring_normalization = \"upper\"\n").is_err());
        assert!(GatewayConfig::from_toml("[upstreams.a]\n").is_err());
        assert!(
            GatewayConfig::from_toml("[upstreams.a]\ncommand = [\"x\"]\nurl = \"http://y\"\n")
                .is_err()
        );
    }
}
