//! The credential ledger: one-time (or n-time) authorities, stored only as keyed hashes.
//!
//! A credential is scoped to its tenant, not to a run, branch or epoch: once spent it stays
//! spent everywhere. Spending happens in [`begin`](super::begin), atomically with the effect
//! that spends it; this module registers credentials and reports their state.

use super::records::CredentialRecord;
use super::{Ledger, LedgerError, Reason, Recovery, Refusal, Result};
use crate::canonical;
use crate::store::{Batch, Store, codec, keys};

/// A credential registration.
#[derive(Clone, Default)]
pub struct CredentialDef {
    /// The raw value (hashed, never stored).
    pub token: Vec<u8>,
    /// Use budget (0 = 1).
    pub budget: u32,
    /// Bind to a tool ("" = any).
    pub bound_tool: String,
    /// Bind to one intent: the tool's JSON arguments ("" = any).
    pub bound_arguments_json: String,
}

impl std::fmt::Debug for CredentialDef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CredentialDef")
            .field("token", &"<redacted>")
            .field("budget", &self.budget)
            .field("bound_tool", &self.bound_tool)
            .finish_non_exhaustive()
    }
}

impl<S: Store> Ledger<S> {
    fn check_token(&self, token: &[u8]) -> Result<()> {
        if token.is_empty() {
            return Err(LedgerError::invalid("token", "must not be empty"));
        }
        self.check_len("token", token.len(), self.config.limits.max_token_bytes)
    }

    /// Registers a credential; an existing one is returned unchanged (`false`).
    pub fn register_credential(
        &self,
        tenant: &str,
        def: &CredentialDef,
    ) -> Result<(CredentialRecord, bool)> {
        self.check_token(&def.token)?;
        if !def.bound_tool.is_empty() {
            self.check_id("bound_tool", &def.bound_tool)?;
        }
        let bound_intent = if def.bound_arguments_json.is_empty() {
            Vec::new()
        } else {
            if def.bound_tool.is_empty() {
                return Err(LedgerError::invalid(
                    "bound_arguments_json",
                    "binding to an intent requires bound_tool",
                ));
            }
            self.check_len(
                "bound_arguments_json",
                def.bound_arguments_json.len(),
                self.config.limits.max_arguments_bytes,
            )?;
            let args = canonical::parse_arguments(&def.bound_arguments_json)
                .map_err(|e| LedgerError::invalid("bound_arguments_json", e.to_string()))?;
            self.current_tool(tenant, &def.bound_tool)?
                .fingerprint(&args)
                .to_vec()
        };
        let hash = self.credential_hash(tenant, &def.token);
        let key = keys::credential(&keys::tenant_key(tenant), &hash);
        let _guard = self.credentials.lock(&key);
        if let Some(existing) = self.get::<CredentialRecord>(&key)? {
            return Ok((existing, false));
        }
        let record = CredentialRecord {
            hash: hash.to_vec(),
            budget: def.budget.max(1),
            uses: 0,
            bound_tool: def.bound_tool.clone(),
            bound_intent,
            spent_by: Vec::new(),
            created_at_ms: self.now(),
            tenant: tenant.to_owned(),
        };
        let mut batch = Batch::new();
        batch.put(key, codec::encode(&record));
        self.commit(batch)?;
        Ok((record, true))
    }

    /// A credential's state, looked up by its raw value.
    pub fn get_credential(&self, tenant: &str, token: &[u8]) -> Result<CredentialRecord> {
        self.check_token(token)?;
        let hash = self.credential_hash(tenant, token);
        self.get::<CredentialRecord>(&keys::credential(&keys::tenant_key(tenant), &hash))?
            .ok_or_else(|| {
                Refusal::new(
                    Reason::UnknownRecord,
                    Recovery::FixArgument,
                    "This credential was never registered or presented.",
                )
                .into()
            })
    }
}
