//! The upstream MCP servers behind the gateway, and the names their tools go by.
//!
//! One upstream's tools keep their names. With several, each tool is listed as
//! `<upstream>__<tool>` (MCP tool names allow letters, digits, `_`, `-` and `.`), so two
//! servers' tools never collide and a call is routed by its prefix. Prompts and resources are
//! merged from every upstream and fetched from the first that has them.

use rmcp::RoleClient;
use rmcp::model::{
    GetPromptRequestParams, GetPromptResult, ListPromptsResult, ListResourcesResult,
    ListToolsResult, PaginatedRequestParams, ReadResourceRequestParams, ReadResourceResult, Tool,
};
use rmcp::service::{RunningService, ServiceError};

/// Separates an upstream's name from its tool's in a namespaced tool name.
pub const SEPARATOR: &str = "__";

/// One upstream MCP server.
pub struct Upstream {
    /// Its name (the namespace of its tools when there are several).
    pub name: String,
    /// The MCP session with it.
    pub service: RunningService<RoleClient, ()>,
}

/// The gateway's upstream servers (at least one).
pub struct Upstreams(Vec<Upstream>);

impl Upstreams {
    /// The upstreams; names must be unique, and with several, non-empty and free of the
    /// separator.
    pub fn new(list: Vec<Upstream>) -> Result<Self, String> {
        if list.is_empty() {
            return Err("at least one upstream MCP server is needed".into());
        }
        if list.len() > 1 {
            for (i, up) in list.iter().enumerate() {
                if up.name.is_empty() || up.name.contains(SEPARATOR) {
                    return Err(format!(
                        "upstream name {:?} must be non-empty and must not contain {SEPARATOR:?}",
                        up.name
                    ));
                }
                if list[..i].iter().any(|other| other.name == up.name) {
                    return Err(format!("upstream name {:?} is used twice", up.name));
                }
            }
        }
        Ok(Upstreams(list))
    }

    fn namespaced(&self) -> bool {
        self.0.len() > 1
    }

    /// All upstreams, in configuration order.
    pub fn all(&self) -> &[Upstream] {
        &self.0
    }

    /// The upstream a public tool name belongs to, and the tool's name there.
    pub fn route<'a>(&self, public: &'a str) -> Option<(&Upstream, &'a str)> {
        if !self.namespaced() {
            return Some((&self.0[0], public));
        }
        let (name, tool) = public.split_once(SEPARATOR)?;
        self.0.iter().find(|u| u.name == name).map(|u| (u, tool))
    }

    fn publish(&self, upstream: &Upstream, mut tool: Tool) -> Tool {
        if self.namespaced() {
            tool.name = format!("{}{SEPARATOR}{}", upstream.name, tool.name).into();
        }
        tool
    }

    /// A page of tools under their public names (one upstream: its own pages; several: all
    /// of them in one page).
    pub async fn list_tools(
        &self,
        request: Option<PaginatedRequestParams>,
    ) -> Result<ListToolsResult, ServiceError> {
        if !self.namespaced() {
            return self.0[0].service.list_tools(request).await;
        }
        Ok(ListToolsResult::with_all_items(
            self.list_all_tools().await?,
        ))
    }

    /// Every tool under its public name.
    pub async fn list_all_tools(&self) -> Result<Vec<Tool>, ServiceError> {
        let mut out = Vec::new();
        for up in &self.0 {
            for tool in up.service.list_all_tools().await? {
                out.push(self.publish(up, tool));
            }
        }
        Ok(out)
    }

    /// Prompts of every upstream that offers any.
    pub async fn list_prompts(
        &self,
        request: Option<PaginatedRequestParams>,
    ) -> Result<ListPromptsResult, ServiceError> {
        if !self.namespaced() {
            return self.0[0].service.list_prompts(request).await;
        }
        let mut all = Vec::new();
        for up in self.0.iter().filter(|u| offers(u, |c| c.prompts.is_some())) {
            all.extend(up.service.list_all_prompts().await?);
        }
        Ok(ListPromptsResult::with_all_items(all))
    }

    /// A prompt, from the first upstream that has it.
    pub async fn get_prompt(
        &self,
        request: GetPromptRequestParams,
    ) -> Result<GetPromptResult, ServiceError> {
        let mut last = None;
        for up in self.0.iter().filter(|u| offers(u, |c| c.prompts.is_some())) {
            match up.service.get_prompt(request.clone()).await {
                Ok(found) => return Ok(found),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or(ServiceError::UnexpectedResponse))
    }

    /// Resources of every upstream that offers any.
    pub async fn list_resources(
        &self,
        request: Option<PaginatedRequestParams>,
    ) -> Result<ListResourcesResult, ServiceError> {
        if !self.namespaced() {
            return self.0[0].service.list_resources(request).await;
        }
        let mut all = Vec::new();
        for up in self
            .0
            .iter()
            .filter(|u| offers(u, |c| c.resources.is_some()))
        {
            all.extend(up.service.list_all_resources().await?);
        }
        Ok(ListResourcesResult::with_all_items(all))
    }

    /// A resource, from the first upstream that has it.
    pub async fn read_resource(
        &self,
        request: ReadResourceRequestParams,
    ) -> Result<ReadResourceResult, ServiceError> {
        let mut last = None;
        for up in self
            .0
            .iter()
            .filter(|u| offers(u, |c| c.resources.is_some()))
        {
            match up.service.read_resource(request.clone()).await {
                Ok(found) => return Ok(found),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or(ServiceError::UnexpectedResponse))
    }
}

fn offers(upstream: &Upstream, has: impl Fn(&rmcp::model::ServerCapabilities) -> bool) -> bool {
    upstream
        .service
        .peer_info()
        .is_some_and(|info| has(&info.capabilities))
}
