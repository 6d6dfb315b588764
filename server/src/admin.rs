//! The `fence.v1.Admin` service: online backup of the whole ledger, verification of a
//! backup, and compaction of the store on demand. Whole-server actions, so they are guarded
//! by admin tokens ([`Auth::authorize_admin`]) rather than scoped to a tenant.
//!
//! A backup is a data dir: `ledger/` (a RocksDB checkpoint of the store) and `credential.key`
//! (the key credentials are hashed with: without it, a credential spent before the backup would
//! not be recognised after a restore, and could be spent again). `fenced --data-dir` serves it
//! as it is.
//!
//! [`Auth::authorize_admin`]: crate::auth::Auth::authorize_admin

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use fence_proto::v1 as pb;
use tonic::{Request, Response, Status};

use crate::clock::{Clock, SystemClock};
use crate::ledger::verify::VerifyReport;
use crate::ledger::{Ledger, LedgerConfig};
use crate::server::{self, CREDENTIAL_KEY_FILE, LEDGER_DIR};
use crate::store::{RocksStore, Store, StoreOptions};

/// Serves backups of one ledger.
pub struct AdminService {
    ledger: Arc<Ledger<RocksStore>>,
}

impl AdminService {
    /// The admin service of `ledger`.
    pub fn new(ledger: Arc<Ledger<RocksStore>>) -> Self {
        Self { ledger }
    }
}

/// `dir` as an absolute path, or INVALID_ARGUMENT.
#[allow(clippy::result_large_err)]
fn absolute(dir: &str) -> Result<PathBuf, Status> {
    let path = PathBuf::from(dir);
    if dir.is_empty() || !path.is_absolute() {
        return Err(Status::invalid_argument(format!(
            "dir must be an absolute path on the server's machine, not {dir:?}"
        )));
    }
    Ok(path)
}

/// Opens the data dir `dir` read-only and verifies its store and credential key.
#[allow(clippy::result_large_err)]
fn verify_dir(dir: &Path) -> Result<VerifyReport, Status> {
    let ledger_dir = dir.join(LEDGER_DIR);
    if !ledger_dir.is_dir() {
        return Err(Status::failed_precondition(format!(
            "{} is not a Fence data dir: it holds no {LEDGER_DIR}/ directory",
            dir.display()
        )));
    }
    let store = RocksStore::open_read_only(&ledger_dir, &StoreOptions::default()).map_err(|e| {
        Status::failed_precondition(format!(
            "{} is not a readable Fence store: {e}",
            ledger_dir.display()
        ))
    })?;
    let mut report = Ledger::new(store, Arc::new(SystemClock), LedgerConfig::default()).verify();
    let key = dir.join(CREDENTIAL_KEY_FILE);
    match std::fs::metadata(&key) {
        Ok(m) if m.len() == 32 => {}
        _ => report.add_problem(format!(
            "{} is missing or not 32 bytes: credentials spent before the backup would not be recognised after a restore",
            key.display()
        )),
    }
    Ok(report)
}

/// Writes the backup into the new directory `dir` (see the module docs).
#[allow(clippy::result_large_err)]
fn write_backup(ledger: &Ledger<RocksStore>, dir: &Path) -> Result<(), Status> {
    let failed = |what: &str, e: &dyn std::fmt::Display| {
        Status::unavailable(format!("the backup could not be written ({what}): {e}"))
    };
    server::write_new_key_file(
        &dir.join(CREDENTIAL_KEY_FILE),
        &ledger.config().credential_key,
    )
    .map_err(|e| failed("credential key", &e))?;
    ledger
        .store()
        .checkpoint_to(&dir.join(LEDGER_DIR))
        .map_err(|e| failed("store", &e))?;
    // The directory entries themselves, so the copy survives a crash once acknowledged.
    crate::store::sync_dir(dir).map_err(|e| failed("directory", &e))
}

/// Bytes of the regular files directly in `dir`.
fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.metadata().ok())
        .filter(|m| m.is_file())
        .map(|m| m.len())
        .sum()
}

fn report(r: VerifyReport) -> pb::BackupReport {
    pb::BackupReport {
        format_version: r.format_version,
        records: r.records,
        runs: r.runs,
        effects: r.effects,
        tools: r.tools,
        credentials: r.credentials,
        problems: r.problems,
        problem_count: r.problem_count,
    }
}

/// Runs blocking work off the async threads, recording the RPC's metrics.
async fn blocking<T: Send + 'static>(
    method: &'static str,
    f: impl FnOnce() -> Result<T, Status> + Send + 'static,
) -> Result<Response<T>, Status> {
    let started = Instant::now();
    let result = tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Status::internal(format!("the {method} task failed: {e}")))
        .and_then(|r| r);
    crate::metrics::rpc(
        method,
        started,
        result
            .as_ref()
            .map_or_else(Status::code, |_| tonic::Code::Ok),
    );
    result.map(Response::new)
}

#[tonic::async_trait]
impl pb::admin_server::Admin for AdminService {
    async fn create_backup(
        &self,
        req: Request<pb::CreateBackupRequest>,
    ) -> Result<Response<pb::CreateBackupResponse>, Status> {
        let dir = absolute(&req.into_inner().dir)?;
        let ledger = self.ledger.clone();
        blocking("CreateBackup", move || {
            if dir.exists() {
                return Err(Status::already_exists(format!(
                    "{} already exists; a backup goes into a new directory",
                    dir.display()
                )));
            }
            match dir.parent() {
                Some(parent) if parent.is_dir() => {}
                _ => {
                    return Err(Status::failed_precondition(format!(
                        "the parent directory of {} does not exist",
                        dir.display()
                    )));
                }
            }
            let created_at_ms = SystemClock.now_ms();
            std::fs::create_dir(&dir).map_err(|e| {
                Status::failed_precondition(format!("cannot create {}: {e}", dir.display()))
            })?;
            if let Err(status) = write_backup(&ledger, &dir) {
                // Nothing half-written is left to be mistaken for a backup.
                let _ = std::fs::remove_dir_all(&dir);
                return Err(status);
            }
            let found = verify_dir(&dir)?;
            tracing::info!(
                dir = %dir.display(),
                effects = found.effects,
                problems = found.problem_count,
                "backup written"
            );
            Ok(pb::CreateBackupResponse {
                dir: dir.display().to_string(),
                bytes: dir_bytes(&dir) + dir_bytes(&dir.join(LEDGER_DIR)),
                created_at_ms,
                report: Some(report(found)),
            })
        })
        .await
    }

    async fn verify_backup(
        &self,
        req: Request<pb::VerifyBackupRequest>,
    ) -> Result<Response<pb::VerifyBackupResponse>, Status> {
        let dir = absolute(&req.into_inner().dir)?;
        blocking("VerifyBackup", move || {
            if !dir.is_dir() {
                return Err(Status::not_found(format!(
                    "{} is not a directory",
                    dir.display()
                )));
            }
            Ok(pb::VerifyBackupResponse {
                report: Some(report(verify_dir(&dir)?)),
            })
        })
        .await
    }

    async fn compact_store(
        &self,
        _: Request<pb::CompactStoreRequest>,
    ) -> Result<Response<pb::CompactStoreResponse>, Status> {
        let ledger = self.ledger.clone();
        blocking("CompactStore", move || {
            let store = ledger.store();
            let failed = |e: crate::store::StoreError| {
                Status::unavailable(format!("compacting the store failed: {e}"))
            };
            let bytes_before = store.size_bytes().map_err(failed)?;
            let started = Instant::now();
            store.compact().map_err(failed)?;
            let took_ms = started.elapsed().as_millis() as u64;
            let bytes_after = store.size_bytes().map_err(failed)?;
            tracing::info!(bytes_before, bytes_after, took_ms, "store compacted");
            Ok(pb::CompactStoreResponse {
                bytes_before,
                bytes_after,
                took_ms,
            })
        })
        .await
    }
}
