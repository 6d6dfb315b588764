//! The tool registry: each tool's class, intent schema, retention and lease, versioned.
//!
//! Registering an identical definition again is a no-op; a changed definition becomes the next
//! version. Receipts record the version their fingerprint was computed under, and matching a new
//! call against a receipt recomputes the call's fingerprint under the receipt's version, so a
//! new schema never changes what an old receipt means. An unregistered tool is version 0:
//! NON_RETRYABLE with no volatile fields.

use super::records::{ToolHead, ToolRecord};
use super::{Ledger, LedgerError, OpClass, Result, ToolDef};
use crate::canonical::{self, Fingerprint, IntentSchema, StringRule};
use crate::store::{Batch, Store, codec, keys};

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
        let current = self
            .get::<ToolHead>(&head_key)?
            .map(|h| h.version)
            .unwrap_or(0);
        if current > 0 {
            let existing = self.tool_version(tenant, &def.name, current)?.record;
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
        self.store.write(batch)?;
        Ok((record, true))
    }

    /// The current definition of a tool (version 0 if unregistered).
    pub fn current_tool(&self, tenant: &str, name: &str) -> Result<Tool> {
        let tk = keys::tenant_key(tenant);
        match self.get::<ToolHead>(&keys::tool_head(&tk, name))? {
            Some(head) => self.tool_version(tenant, name, head.version),
            None => Ok(Tool::unregistered(name)),
        }
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
        Ok(tool.record)
    }

    /// A given version of a tool (0 = the unregistered definition).
    pub fn tool_version(&self, tenant: &str, name: &str, version: u32) -> Result<Tool> {
        if version == 0 {
            return Ok(Tool::unregistered(name));
        }
        let tk = keys::tenant_key(tenant);
        let record = self
            .get::<ToolRecord>(&keys::tool(&tk, name, version))?
            .ok_or_else(|| {
                LedgerError::from(super::Refusal::new(
                    super::Reason::UnknownRecord,
                    super::Recovery::FixArgument,
                    format!("Tool {name:?} has no version {version}."),
                ))
            })?;
        Tool::from_record(record)
    }

    /// The fingerprints of `args` under every version of the tool up to `current`, indexed
    /// by version: receipts may predate `current`, and each is compared under its own version.
    pub(crate) fn fingerprints(
        &self,
        tenant: &str,
        current: &Tool,
        args: &serde_json::Value,
    ) -> Result<Vec<Fingerprint>> {
        let mut out = Vec::with_capacity(current.record.version as usize + 1);
        for v in 0..current.record.version {
            out.push(
                self.tool_version(tenant, &current.record.name, v)?
                    .fingerprint(args),
            );
        }
        out.push(current.fingerprint(args));
        Ok(out)
    }
}
