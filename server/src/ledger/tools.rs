//! The tool registry: each tool's class, intent schema, retention and lease, versioned.
//!
//! Registering an identical definition again is a no-op; a changed definition becomes the next
//! version. Receipts record the version their fingerprint was computed under, and matching a new
//! call against a receipt recomputes the call's fingerprint under the receipt's version, so a
//! new schema never changes what an old receipt means. An unregistered tool is version 0:
//! NON_RETRYABLE with no volatile fields.

use std::sync::{Arc, RwLock};

use foldhash::HashMap;

use super::records::{ToolHead, ToolRecord};
use super::{Ledger, LedgerError, OpClass, Result, ToolDef};
use crate::canonical::{self, Fingerprint, IntentSchema, StringRule};
use crate::store::{Batch, Store, codec, keys};

/// Parsed tools in memory, so a call neither reads nor parses its tool's records.
///
/// A tool version never changes once written, so cached versions are never stale; a tool's
/// current version changes only through [`Ledger::register_tool`], which updates the cache
/// after its write is durable, and only this process writes the store (RocksDB's lock file
/// keeps a second process out of the data dir). Bounded: when `capacity` entries are cached
/// the cache is emptied and refills from the store.
///
/// Entries are keyed by tenant and tool name as they are ([`cache_key`]), so a hit costs no
/// key derivation (the store's keys are blake3 hashes of the names).
pub(crate) struct ToolCache {
    capacity: usize,
    /// Current version by tenant and name.
    heads: RwLock<HashMap<Vec<u8>, u32>>,
    /// Parsed versions by tenant, name and version.
    versions: RwLock<HashMap<Vec<u8>, Arc<Tool>>>,
}

impl ToolCache {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            heads: RwLock::default(),
            versions: RwLock::default(),
        }
    }

    fn head(&self, key: &[u8]) -> Option<u32> {
        read(&self.heads).get(key).copied()
    }

    fn set_head(&self, key: Vec<u8>, version: u32) {
        insert_bounded(&self.heads, self.capacity, key, version);
    }

    fn version(&self, key: &[u8]) -> Option<Arc<Tool>> {
        read(&self.versions).get(key).cloned()
    }

    fn set_version(&self, key: Vec<u8>, tool: Arc<Tool>) {
        insert_bounded(&self.versions, self.capacity, key, tool);
    }
}

/// The cache key of a tool's version (`0`: its current-version pointer): the tenant and the
/// name, each length-prefixed so that no two pairs share a key.
fn cache_key(tenant: &str, name: &str, version: u32) -> Vec<u8> {
    let mut key = Vec::with_capacity(12 + tenant.len() + name.len());
    key.extend_from_slice(&(tenant.len() as u32).to_be_bytes());
    key.extend_from_slice(tenant.as_bytes());
    key.extend_from_slice(&(name.len() as u32).to_be_bytes());
    key.extend_from_slice(name.as_bytes());
    key.extend_from_slice(&version.to_be_bytes());
    key
}

fn read<K, V>(lock: &RwLock<HashMap<K, V>>) -> std::sync::RwLockReadGuard<'_, HashMap<K, V>> {
    // The maps hold only copies of durable records: a panic elsewhere leaves them valid.
    lock.read().unwrap_or_else(|e| e.into_inner())
}

fn insert_bounded<V>(lock: &RwLock<HashMap<Vec<u8>, V>>, capacity: usize, key: Vec<u8>, value: V) {
    let mut map = lock.write().unwrap_or_else(|e| e.into_inner());
    if map.len() >= capacity && !map.contains_key(&key) {
        map.clear();
    }
    map.insert(key, value);
}

/// A tool version with its parsed schema.
#[derive(Debug, Clone)]
pub struct Tool {
    /// The stored registration.
    pub record: ToolRecord,
    /// Its parsed intent schema.
    pub schema: IntentSchema,
}

impl Tool {
    /// The class.
    pub fn class(&self) -> OpClass {
        OpClass::from_code(self.record.class).unwrap_or(OpClass::NonRetryable)
    }

    /// The intent fingerprint of `args` under this version's schema.
    pub fn fingerprint(&self, args: &serde_json::Value) -> Fingerprint {
        let canonical = canonical::canonical_intent(args, &self.schema);
        canonical::intent_fingerprint(&self.record.name, &canonical)
    }

    fn from_record(record: ToolRecord) -> Result<Self> {
        let rule = string_rule(record.string_rule).ok_or_else(|| {
            LedgerError::invalid("tool.intent_schema.string_normalization", "unknown value")
        })?;
        let schema = IntentSchema::new(&record.volatile_fields, &record.normalized_fields, rule)
            .map_err(|e| LedgerError::invalid("tool.intent_schema", e.to_string()))?;
        Ok(Self { record, schema })
    }

    fn unregistered(name: &str) -> Self {
        Self {
            record: ToolRecord {
                name: name.to_owned(),
                class: OpClass::NonRetryable.code(),
                ..Default::default()
            },
            schema: IntentSchema::default(),
        }
    }
}

fn string_rule(code: i32) -> Option<StringRule> {
    match code {
        0 => Some(StringRule::Exact),
        1 => Some(StringRule::Trim),
        2 => Some(StringRule::TrimLowercase),
        _ => None,
    }
}

impl<S: Store> Ledger<S> {
    /// Registers a tool; returns the current version and whether this call created it.
    pub fn register_tool(&self, tenant: &str, def: ToolDef) -> Result<(ToolRecord, bool)> {
        self.check_id("tool.name", &def.name)?;
        if OpClass::from_code(def.class).is_none() {
            return Err(LedgerError::invalid(
                "tool.class",
                format!("{} is not an operation class (1-4)", def.class),
            ));
        }
        let limits = &self.config.limits;
        let paths = def.volatile_fields.len() + def.normalized_fields.len();
        if paths > limits.max_schema_paths {
            return Err(LedgerError::invalid(
                "tool.intent_schema",
                format!(
                    "has {paths} field paths; the limit is {}",
                    limits.max_schema_paths
                ),
            ));
        }
        if def.lease_ms > self.config.max_lease_ms {
            return Err(LedgerError::invalid(
                "tool.lease_ms",
                format!(
                    "exceeds the maximum lease of {} ms",
                    self.config.max_lease_ms
                ),
            ));
        }
        let candidate = ToolRecord {
            name: def.name.clone(),
            class: def.class,
            volatile_fields: def.volatile_fields,
            normalized_fields: def.normalized_fields,
            string_rule: def.string_rule,
            retention_ms: def.retention_ms,
            lease_ms: def.lease_ms,
            version: 0,
            registered_at_ms: 0,
        };
        // Parse now so a bad schema is refused before anything is written.
        Tool::from_record(candidate.clone())?;

        let tk = keys::tenant_key(tenant);
        let head_key = keys::tool_head(&tk, &def.name);
        let _guard = self.runs.lock(&head_key);
        let current = self.tool_head(tenant, &def.name)?;
        if current > 0 {
            let existing = self
                .tool_version(tenant, &def.name, current)?
                .record
                .clone();
            let same = ToolRecord {
                version: 0,
                registered_at_ms: 0,
                ..existing.clone()
            } == candidate;
            if same {
                return Ok((existing, false));
            }
            if current >= limits.max_tool_versions {
                return Err(LedgerError::ResourceExhausted {
                    field: "tool".into(),
                    why: format!("tool {:?} has {current} versions", def.name),
                });
            }
        }
        let record = ToolRecord {
            version: current + 1,
            registered_at_ms: self.now(),
            ..candidate
        };
        let mut batch = Batch::new();
        batch.put(
            keys::tool(&tk, &def.name, record.version),
            codec::encode(&record),
        );
        batch.put(
            head_key,
            codec::encode(&ToolHead {
                version: record.version,
            }),
        );
        self.commit(batch)?;
        // The version first, then the head that points at it: the next call finds both
        // cached (and can be prepared under it; see `Ledger::prepare_begin`).
        self.tools.set_version(
            cache_key(tenant, &def.name, record.version),
            Arc::new(Tool::from_record(record.clone())?),
        );
        self.tools
            .set_head(cache_key(tenant, &def.name, 0), record.version);
        Ok((record, true))
    }

    /// A page of the tenant's registered tools (each at its current version) and the next
    /// page's token (`""`: done). Tools are listed in an order that is stable across pages
    /// (by a hash of the name), not by name.
    pub fn list_tools(
        &self,
        tenant: &str,
        page_size: u32,
        page_token: &str,
    ) -> Result<(Vec<ToolRecord>, String)> {
        let tk = keys::tenant_key(tenant);
        let prefix = keys::tool_head_prefix(&tk);
        let mut from = prefix.clone();
        if !page_token.is_empty() {
            let nk = codec::unhex(page_token)
                .filter(|b| b.len() == 16)
                .ok_or_else(|| {
                    LedgerError::invalid("page_token", "is not a token this server issued")
                })?;
            from.extend_from_slice(&nk);
        }
        let (tools, next) = self.page(&prefix, from, page_size, |k, v| {
            let (Some(nk), head) = (keys::decode_tool_head(k), codec::decode::<ToolHead>(k, v)?)
            else {
                return Ok(None);
            };
            let key = keys::tool_by_name_key(&tk, &nk, head.version);
            let Some(bytes) = self.store.get(&key)? else {
                return Ok(None);
            };
            let record: ToolRecord = codec::decode(&key, &bytes)?;
            Ok(Some((record, bytes.len())))
        })?;
        let token = next
            .as_deref()
            .and_then(keys::decode_tool_head)
            .map_or_else(String::new, |nk| codec::hex(&nk));
        Ok((tools, token))
    }

    /// The current definition of a tool (version 0 if unregistered).
    pub fn current_tool(&self, tenant: &str, name: &str) -> Result<Arc<Tool>> {
        match self.tool_head(tenant, name)? {
            0 => Ok(Arc::new(Tool::unregistered(name))),
            version => self.tool_version(tenant, name, version),
        }
    }

    /// A tool's current version (0: never registered), from the cache or the store.
    fn tool_head(&self, tenant: &str, name: &str) -> Result<u32> {
        let cached = cache_key(tenant, name, 0);
        if let Some(version) = self.tools.head(&cached) {
            return Ok(version);
        }
        let head_key = keys::tool_head(&keys::tenant_key(tenant), name);
        let version = self.get::<ToolHead>(&head_key)?.map_or(0, |h| h.version);
        // A name never registered is not cached: any string may be called as a tool, and
        // those must not evict the registered ones.
        if version > 0 {
            self.tools.set_head(cached, version);
        }
        Ok(version)
    }

    /// A registered version of a tool (0 = the current one), as `GetTool` answers: a name
    /// never registered is UNKNOWN_RECORD (NOT_FOUND), not the implicit NON_RETRYABLE
    /// definition its calls get, so a typo in a registration check cannot pass for a tool.
    pub fn registered_tool(&self, tenant: &str, name: &str, version: u32) -> Result<ToolRecord> {
        let tool = match version {
            0 => self.current_tool(tenant, name)?,
            v => self.tool_version(tenant, name, v)?,
        };
        if tool.record.version == 0 {
            return Err(super::Refusal::new(
                super::Reason::UnknownRecord,
                super::Recovery::FixArgument,
                format!(
                    "Tool {name:?} was never registered; its calls are treated as NON_RETRYABLE with no volatile fields."
                ),
            )
            .into());
        }
        Ok(tool.record.clone())
    }

    /// A given version of a tool (0 = the unregistered definition).
    pub fn tool_version(&self, tenant: &str, name: &str, version: u32) -> Result<Arc<Tool>> {
        if version == 0 {
            return Ok(Arc::new(Tool::unregistered(name)));
        }
        let cached = cache_key(tenant, name, version);
        if let Some(tool) = self.tools.version(&cached) {
            return Ok(tool);
        }
        let key = keys::tool(&keys::tenant_key(tenant), name, version);
        let record = self.get::<ToolRecord>(&key)?.ok_or_else(|| {
            LedgerError::from(super::Refusal::new(
                super::Reason::UnknownRecord,
                super::Recovery::FixArgument,
                format!("Tool {name:?} has no version {version}."),
            ))
        })?;
        let tool = Arc::new(Tool::from_record(record)?);
        self.tools.set_version(cached, tool.clone());
        Ok(tool)
    }

    /// The tool's current version as far as the cache knows, without reading the store: a
    /// cached head's version, else the implicit definition of a name never registered (a
    /// guess, checked by whoever uses it: see [`Ledger::prepare_begin`]).
    pub(crate) fn cached_current_tool(&self, tenant: &str, name: &str) -> Option<Arc<Tool>> {
        match self.tools.head(&cache_key(tenant, name, 0)) {
            None => Some(Arc::new(Tool::unregistered(name))),
            Some(version) => self.tools.version(&cache_key(tenant, name, version)),
        }
    }

    /// The fingerprints of `args` under the tool versions `run` holds effects of and the
    /// current one (every version up to `current` for a run that does not track them, or
    /// when `run` is `None`): receipts may predate `current`, and each is compared under its
    /// own version.
    pub(crate) fn fingerprints(
        &self,
        tenant: &str,
        current: &Tool,
        args: &serde_json::Value,
        run: Option<&super::records::RunRecord>,
        known: Option<(u32, Fingerprint)>,
    ) -> Result<Fingerprints> {
        let latest = current.record.version;
        let mut by_version = vec![None; latest as usize + 1];
        let older: Vec<u32> = match run {
            Some(run) if run.tracks_tool_versions => run
                .tool_versions
                .iter()
                .find(|t| t.tool == current.record.name)
                .map(|t| t.versions.iter().copied().filter(|v| *v < latest).collect())
                .unwrap_or_default(),
            _ => (0..latest).collect(),
        };
        for v in older {
            by_version[v as usize] = Some(
                self.tool_version(tenant, &current.record.name, v)?
                    .fingerprint(args),
            );
        }
        // Versions are immutable: a fingerprint computed under this version before is it.
        by_version[latest as usize] = Some(match known {
            Some((version, fp)) if version == latest => fp,
            _ => current.fingerprint(args),
        });
        Ok(Fingerprints(by_version))
    }
}

/// A call's intent fingerprints, indexed by tool version; only the versions a lookup needs
/// are computed (see [`Ledger::fingerprints`]), the current one always.
#[derive(Debug, Clone)]
pub(crate) struct Fingerprints(Vec<Option<Fingerprint>>);

impl Fingerprints {
    /// The fingerprint under `version`, if computed.
    pub(crate) fn get(&self, version: u32) -> Option<&Fingerprint> {
        self.0.get(version as usize).and_then(Option::as_ref)
    }

    /// The fingerprint under the current version.
    pub(crate) fn current(&self) -> &Fingerprint {
        self.0
            .last()
            .and_then(Option::as_ref)
            .expect("the current version is always computed")
    }

    /// The computed fingerprints.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &Fingerprint> {
        self.0.iter().flatten()
    }

    /// The distinct computed fingerprints, newest version first: what a call is looked up
    /// by, since receipts may predate the current version.
    pub(crate) fn distinct(&self) -> Vec<Fingerprint> {
        let mut out: Vec<Fingerprint> = Vec::with_capacity(self.0.len());
        for fp in self.0.iter().rev().flatten() {
            if !out.contains(fp) {
                out.push(*fp);
            }
        }
        out
    }
}

/// Notes in `run` that one of its effects was recorded under `version` of `tool`; returns
/// whether the run record changed.
pub(crate) fn note_tool_version(
    run: &mut super::records::RunRecord,
    tool: &str,
    version: u32,
) -> bool {
    if !run.tracks_tool_versions {
        return false;
    }
    let i = match run.tool_versions.iter().position(|t| t.tool == tool) {
        Some(i) => i,
        None => {
            run.tool_versions.push(super::records::ToolVersions {
                tool: tool.to_owned(),
                versions: Vec::new(),
            });
            run.tool_versions.len() - 1
        }
    };
    let versions = &mut run.tool_versions[i].versions;
    match versions.binary_search(&version) {
        Ok(_) => false,
        Err(at) => {
            versions.insert(at, version);
            true
        }
    }
}
