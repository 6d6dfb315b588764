//! Authentication: who is calling, and so which tenant's namespace the call lives in.
//!
//! With a tokens file, every call must carry `authorization: Bearer <token>`; the server holds
//! only blake3 hashes of tokens (never plaintext) and compares in constant time. Without one the
//! server runs in dev mode (logged loudly at start): the tenant is the `x-fence-tenant` metadata
//! value, or `default`. Either way the tenant never comes from a request field, so no RPC can
//! name another tenant's records.

use std::path::Path;
use std::sync::Arc;

use tonic::{Request, Status};

use crate::ledger::check_id;

/// The metadata key naming the tenant in dev mode.
pub const TENANT_HEADER: &str = "x-fence-tenant";
/// The tenant of dev-mode calls without a tenant header.
pub const DEFAULT_TENANT: &str = "default";

/// The authenticated tenant of a call (a request extension set by [`Auth`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tenant(pub Arc<str>);

/// One configured token (its hash only).
#[derive(Debug, Clone)]
pub struct TokenEntry {
    tenant: Arc<str>,
    hash: blake3::Hash,
    revoked: bool,
    /// May call the `Admin` service (backups of every tenant's records).
    admin: bool,
}

/// Errors reading a tokens file.
#[derive(Debug, thiserror::Error)]
pub enum AuthConfigError {
    /// The file could not be read.
    #[error("cannot read tokens file {path}: {source}")]
    Read {
        /// The path.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A line is malformed.
    #[error("tokens file line {line}: {why}")]
    Line {
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        why: String,
    },
}

/// How calls are authenticated.
#[derive(Debug, Clone)]
pub enum Auth {
    /// Local development: tenant from `x-fence-tenant`, no token.
    Dev,
    /// Bearer tokens, by blake3 hash.
    Tokens(Arc<[TokenEntry]>),
}

impl Auth {
    /// Reads a tokens file. Each non-empty line not starting with `#` is
    /// `<tenant> <blake3-hex-of-token> [admin] [revoked]`; `fenced hash-token` prints the
    /// hash. An `admin` token may also call the `Admin` service (backups).
    pub fn from_tokens_file(path: &Path) -> Result<Self, AuthConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| AuthConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_tokens_text(&text)
    }

    /// Parses the tokens file format (see [`Auth::from_tokens_file`]).
    pub fn from_tokens_text(text: &str) -> Result<Self, AuthConfigError> {
        let mut entries = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let bad = |why: &str| AuthConfigError::Line {
                line: i + 1,
                why: why.to_owned(),
            };
            let parts: Vec<&str> = line.split_whitespace().collect();
            let usage = "expected `<tenant> <blake3-hex> [admin] [revoked]`";
            let [tenant, hash, flags @ ..] = parts.as_slice() else {
                return Err(bad(usage));
            };
            let (mut admin, mut revoked) = (false, false);
            for flag in flags {
                match *flag {
                    "admin" if !admin => admin = true,
                    "revoked" if !revoked => revoked = true,
                    _ => return Err(bad(usage)),
                }
            }
            let (tenant, hash) = (*tenant, *hash);
            check_id("tenant", tenant, 256).map_err(|e| bad(&e.to_string()))?;
            let hash = blake3::Hash::from_hex(hash)
                .map_err(|_| bad("the token hash must be 64 hex digits (blake3)"))?;
            entries.push(TokenEntry {
                tenant: tenant.into(),
                hash,
                revoked,
                admin,
            });
        }
        Ok(Self::Tokens(entries.into()))
    }

    /// The hash to put in a tokens file for `token`.
    pub fn hash_token(token: &str) -> String {
        blake3::hash(token.as_bytes()).to_hex().to_string()
    }

    /// Authenticates a call and attaches its [`Tenant`].
    #[allow(clippy::result_large_err)] // tonic's interceptor signature
    pub fn authenticate<T>(&self, mut req: Request<T>) -> Result<Request<T>, Status> {
        let tenant = match self {
            Auth::Dev => match req.metadata().get(TENANT_HEADER) {
                None => Arc::from(DEFAULT_TENANT),
                Some(v) => {
                    let t = v.to_str().map_err(|_| {
                        Status::invalid_argument("x-fence-tenant must be printable ASCII")
                    })?;
                    check_id(TENANT_HEADER, t, 256)
                        .map_err(|e| Status::invalid_argument(e.to_string()))?;
                    Arc::from(t)
                }
            },
            Auth::Tokens(entries) => {
                let tenant = bearer_entry(&req, entries)?.tenant.clone();
                if let Some(v) = req.metadata().get(TENANT_HEADER)
                    && v.as_bytes() != tenant.as_bytes()
                {
                    return Err(Status::permission_denied(
                        "this token does not grant access to the tenant named in x-fence-tenant",
                    ));
                }
                tenant
            }
        };
        req.extensions_mut().insert(Tenant(tenant));
        Ok(req)
    }

    /// Authorises a call of the `Admin` service: in token mode only a token marked `admin`;
    /// in dev mode anyone (dev mode authenticates nothing).
    #[allow(clippy::result_large_err)] // tonic's interceptor signature
    pub fn authorize_admin<T>(&self, req: Request<T>) -> Result<Request<T>, Status> {
        if let Auth::Tokens(entries) = self
            && !bearer_entry(&req, entries)?.admin
        {
            return Err(Status::permission_denied(
                "this token may not call the Admin service: mark it `admin` in the tokens file",
            ));
        }
        Ok(req)
    }
}

/// The tokens-file entry of a call's bearer token (live, not revoked).
#[allow(clippy::result_large_err)]
fn bearer_entry<'a, T>(
    req: &Request<T>,
    entries: &'a [TokenEntry],
) -> Result<&'a TokenEntry, Status> {
    let header = req
        .metadata()
        .get("authorization")
        .ok_or_else(|| Status::unauthenticated("missing `authorization: Bearer <token>`"))?;
    let token = header
        .to_str()
        .ok()
        .and_then(|h| h.strip_prefix("Bearer "))
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .ok_or_else(|| {
            Status::unauthenticated("the authorization header must be `Bearer <token>`")
        })?;
    let presented = blake3::hash(token.as_bytes());
    // blake3::Hash equality is constant-time; scan every entry so timing does not reveal
    // which one matched.
    let mut found: Option<&TokenEntry> = None;
    for e in entries {
        if e.hash == presented {
            found = Some(e);
        }
    }
    match found {
        Some(e) if e.revoked => Err(Status::unauthenticated("this token was revoked")),
        Some(e) => Ok(e),
        None => Err(Status::unauthenticated("unknown token")),
    }
}

/// The tenant attached to a request by [`Auth`].
#[allow(clippy::result_large_err)]
pub fn tenant_of<T>(req: &Request<T>) -> Result<Arc<str>, Status> {
    req.extensions()
        .get::<Tenant>()
        .map(|t| t.0.clone())
        .ok_or_else(|| Status::internal("request reached a handler without authentication"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_meta(pairs: &[(&'static str, &str)]) -> Request<()> {
        let mut r = Request::new(());
        for (k, v) in pairs {
            r.metadata_mut().insert(*k, v.parse().unwrap());
        }
        r
    }

    #[test]
    fn dev_mode_takes_the_tenant_header_or_the_default() {
        let t = |r: Request<()>| tenant_of(&Auth::Dev.authenticate(r).unwrap()).unwrap();
        assert_eq!(&*t(with_meta(&[])), DEFAULT_TENANT);
        assert_eq!(&*t(with_meta(&[(TENANT_HEADER, "acme")])), "acme");
        assert!(
            Auth::Dev
                .authenticate(with_meta(&[(TENANT_HEADER, " ")]))
                .is_err()
        );
    }

    #[test]
    fn tokens_map_to_tenants_and_revocation_holds() {
        let text = format!(
            "# comment\nacme {}\nbeta {} revoked\n",
            Auth::hash_token("tok-a"),
            Auth::hash_token("tok-b")
        );
        let auth = Auth::from_tokens_text(&text).unwrap();
        let ok = auth
            .authenticate(with_meta(&[("authorization", "Bearer tok-a")]))
            .unwrap();
        assert_eq!(&*tenant_of(&ok).unwrap(), "acme");
        let code = |pairs: &[(&'static str, &str)]| {
            auth.authenticate(with_meta(pairs)).unwrap_err().code()
        };
        assert_eq!(code(&[]), tonic::Code::Unauthenticated);
        assert_eq!(
            code(&[("authorization", "Bearer nope")]),
            tonic::Code::Unauthenticated
        );
        assert_eq!(
            code(&[("authorization", "tok-a")]),
            tonic::Code::Unauthenticated
        );
        assert_eq!(
            code(&[("authorization", "Bearer tok-b")]),
            tonic::Code::Unauthenticated
        );
        assert_eq!(
            code(&[("authorization", "Bearer tok-a"), (TENANT_HEADER, "beta")]),
            tonic::Code::PermissionDenied
        );
    }

    #[test]
    fn malformed_token_files_are_refused() {
        assert!(Auth::from_tokens_text("acme").is_err());
        assert!(Auth::from_tokens_text("acme zz").is_err());
        assert!(Auth::from_tokens_text(&format!("acme {} maybe", Auth::hash_token("x"))).is_err());
        let twice = format!("acme {} admin admin", Auth::hash_token("x"));
        assert!(Auth::from_tokens_text(&twice).is_err());
    }

    #[test]
    fn only_admin_tokens_may_call_the_admin_service() {
        let text = format!(
            "ops {} admin\nacme {}\nold {} revoked admin\n",
            Auth::hash_token("tok-ops"),
            Auth::hash_token("tok-a"),
            Auth::hash_token("tok-old")
        );
        let auth = Auth::from_tokens_text(&text).unwrap();
        let admin = |token: &str| {
            auth.authorize_admin(with_meta(&[("authorization", token)]))
                .map(|_| ())
                .map_err(|e| e.code())
        };
        assert_eq!(admin("Bearer tok-ops"), Ok(()));
        assert_eq!(admin("Bearer tok-a"), Err(tonic::Code::PermissionDenied));
        assert_eq!(admin("Bearer tok-old"), Err(tonic::Code::Unauthenticated));
        assert_eq!(admin("Bearer nope"), Err(tonic::Code::Unauthenticated));
        // An admin token is still an ordinary token of its tenant elsewhere.
        let ok = auth
            .authenticate(with_meta(&[("authorization", "Bearer tok-ops")]))
            .unwrap();
        assert_eq!(&*tenant_of(&ok).unwrap(), "ops");
        // Dev mode authenticates nothing, so it does not guard the Admin service either.
        assert!(Auth::Dev.authorize_admin(with_meta(&[])).is_ok());
    }
}
