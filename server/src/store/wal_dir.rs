//! Where a ledger's write-ahead log lives: in the ledger's own directory (the default), or
//! in a directory of its own (`--wal-dir`), typically on a separate device, so that the syncs
//! every acknowledged write waits for do not queue behind the table files that flushes and
//! compactions write.
//!
//! RocksDB finds a database's WAL files only by listing its `wal_dir`, so a ledger opened
//! without the directory its log is in would silently lose every write not yet in a table
//! file, and RocksDB deletes the log files it finds there that it thinks obsolete, so two
//! ledgers sharing one directory would delete each other's. This module owns both guards:
//!
//! - the ledger directory holds a marker, [`MARKER`], naming the WAL directory and an id;
//!   opening a ledger that has one without a WAL directory holding the same id is refused;
//! - the WAL directory holds [`OWNER`] with that id, locked (`flock`) while the ledger is open;
//!   a directory owned by another ledger, or holding log files of no ledger, is refused.
//!
//! Moving a ledger's WAL out of its directory happens at the first open with a WAL directory:
//! the ledger is opened as it was, flushed (so that no record is only in the log) and closed,
//! and only then are the owner file and the marker written. A WAL directory moved elsewhere
//! is found again by its id. Read-only opens (backups, inspection) follow the marker.

use std::fs::File;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::StoreError;

/// The marker in a ledger directory whose WAL is elsewhere.
pub const MARKER: &str = "FENCE-WAL-DIR";

/// The owner file in a WAL directory.
pub const OWNER: &str = "FENCE-WAL-OWNER";

/// What [`MARKER`] holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Marker {
    /// The WAL directory, absolute, as it was when the marker was last written.
    path: PathBuf,
    /// The id the WAL directory's [`OWNER`] file must hold.
    id: String,
}

/// What [`OWNER`] holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Owner {
    /// The same id as the ledger's marker.
    id: String,
    /// The ledger directory, absolute, for messages only.
    ledger: PathBuf,
}

/// A ledger's WAL placement, decided at open and held while it is open.
#[derive(Debug)]
pub struct Placement {
    /// The directory to give RocksDB as `wal_dir`; `None` for the ledger's own.
    pub dir: Option<PathBuf>,
    /// The WAL directory's owner file, locked while this lives.
    _lock: Option<File>,
}

impl Placement {
    /// The WAL in the ledger directory.
    pub fn inside() -> Self {
        Self {
            dir: None,
            _lock: None,
        }
    }
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> StoreError + '_ {
    move |e| StoreError::Engine(format!("{}: {e}", path.display()))
}

fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<Option<T>, StoreError> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes).map(Some).map_err(|e| {
            StoreError::Engine(format!(
                "{} is damaged ({e}): it records where a ledger's write-ahead log is, and fenced \
                 will not guess; restore it from a copy",
                path.display()
            ))
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io(path)(e)),
    }
}

/// Writes `value` to `path` durably and atomically: a temporary file, synced, renamed over,
/// and the directory synced.
fn write_json<T: Serialize>(path: &Path, value: &T) -> Result<(), StoreError> {
    let dir = path.parent().expect("marker paths have a directory");
    let tmp = path.with_extension("tmp");
    let mut f = File::create(&tmp).map_err(io(&tmp))?;
    f.write_all(&serde_json::to_vec_pretty(value).expect("plain struct"))
        .and_then(|()| f.sync_all())
        .map_err(io(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io(path))?;
    super::sync_dir(dir).map_err(io(dir))
}

/// The WAL files (`NNNNNN.log`) in `dir`, as (number, path), oldest first.
pub fn log_files(dir: &Path) -> Result<Vec<(u64, PathBuf)>, StoreError> {
    let mut logs = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io(dir))? {
        let entry = entry.map_err(io(dir))?;
        let number = entry
            .file_name()
            .to_str()
            .and_then(|n| n.strip_suffix(".log"))
            .and_then(|n| n.parse::<u64>().ok());
        if let Some(number) = number {
            logs.push((number, entry.path()));
        }
    }
    logs.sort_unstable();
    Ok(logs)
}

/// Locks `dir`'s owner file for as long as the returned file is open.
fn lock_owner(dir: &Path) -> Result<File, StoreError> {
    let path = dir.join(OWNER);
    let file = File::open(&path).map_err(io(&path))?;
    rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive).map_err(
        |e| {
            StoreError::Engine(format!(
                "{} is locked by another running ledger ({e}): a WAL directory serves one ledger",
                dir.display()
            ))
        },
    )?;
    Ok(file)
}

/// `dir` made absolute, and resolved if it exists (nothing is created here: a directory that
/// is refused is left as it was).
fn resolve(dir: &Path) -> Result<PathBuf, StoreError> {
    match std::fs::canonicalize(dir) {
        Ok(d) => Ok(d),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::path::absolute(dir).map_err(io(dir))
        }
        Err(e) => Err(io(dir)(e)),
    }
}

/// Where the WAL of the ledger in `ledger` is, for a read-only open: the marker's directory
/// if it has one (whatever the caller was told: a read-only open must see every record). No
/// lock is taken: a read-only open writes nothing.
pub fn for_read_only(ledger: &Path) -> Result<Placement, StoreError> {
    Ok(Placement {
        dir: read_json::<Marker>(&ledger.join(MARKER))?.map(|m| m.path),
        _lock: None,
    })
}

/// Decides where the WAL of the ledger in `ledger` goes when it is opened for writing with
/// `wal_dir` (`None`: in the ledger directory), and takes the WAL directory's lock.
///
/// `move_out` is called when an existing ledger whose WAL is in its own directory is first
/// given a WAL directory: it must open the ledger as it is, flush every memtable and close
/// it, so that its log holds nothing a table file does not. Only then is anything written.
pub fn place(
    ledger: &Path,
    wal_dir: Option<&Path>,
    move_out: impl FnOnce() -> Result<(), StoreError>,
) -> Result<Placement, StoreError> {
    std::fs::create_dir_all(ledger).map_err(io(ledger))?;
    let ledger = std::fs::canonicalize(ledger).map_err(io(ledger))?;
    let marker_path = ledger.join(MARKER);
    let marker = read_json::<Marker>(&marker_path)?;
    let wanted = match wal_dir {
        Some(d) => {
            let d = resolve(d)?;
            (d != ledger).then_some(d)
        }
        None => None,
    };
    match (marker, wanted) {
        (None, None) => Ok(Placement::inside()),
        (Some(m), None) => Err(StoreError::Engine(format!(
            "the write-ahead log of the ledger in {} is in {}: start fenced with --wal-dir {} \
             (without it, every write not yet in a table file would be lost)",
            ledger.display(),
            m.path.display(),
            m.path.display()
        ))),
        (Some(m), Some(dir)) => {
            let owner = read_json::<Owner>(&dir.join(OWNER))?;
            if owner.as_ref().map(|o| &o.id) != Some(&m.id) {
                return Err(StoreError::Engine(format!(
                    "{} does not hold the write-ahead log of the ledger in {} (its log was in {}, \
                     with id {} in {OWNER}): start fenced with --wal-dir set to the directory \
                     that holds it",
                    dir.display(),
                    ledger.display(),
                    m.path.display(),
                    m.id
                )));
            }
            let lock = lock_owner(&dir)?;
            if m.path != dir {
                // The operator moved the directory: remember where it is now.
                write_json(
                    &marker_path,
                    &Marker {
                        path: dir.clone(),
                        id: m.id,
                    },
                )?;
            }
            remove_stale_logs(&ledger)?;
            Ok(Placement {
                dir: Some(dir),
                _lock: Some(lock),
            })
        }
        (None, Some(dir)) => {
            std::fs::create_dir_all(&dir).map_err(io(&dir))?;
            let dir = std::fs::canonicalize(&dir).map_err(io(&dir))?;
            let logs = log_files(&dir)?;
            match read_json::<Owner>(&dir.join(OWNER))? {
                // A move of this ledger's log that stopped before its marker was written:
                // RocksDB never wrote there (it is told to only once the marker is).
                Some(o) if o.ledger == ledger && logs.is_empty() => {}
                Some(o) => {
                    return Err(StoreError::Engine(format!(
                        "{} holds the write-ahead log of another ledger ({}, id {}): give this one a \
                     directory of its own, or empty that one if its ledger is gone",
                        dir.display(),
                        o.ledger.display(),
                        o.id
                    )));
                }
                None => {}
            }
            if let Some((_, log)) = logs.first() {
                return Err(StoreError::Engine(format!(
                    "{} holds write-ahead log files of an unknown database ({}): give the ledger \
                     an empty directory",
                    dir.display(),
                    log.display()
                )));
            }
            if ledger.join("CURRENT").exists() {
                move_out()?;
            }
            let id = format!("{:032x}", rand::random::<u128>());
            write_json(
                &dir.join(OWNER),
                &Owner {
                    id: id.clone(),
                    ledger: ledger.clone(),
                },
            )?;
            let lock = lock_owner(&dir)?;
            // Another ledger may have claimed the same empty directory at the same moment:
            // the owner file that is locked is the one that counts.
            if read_json::<Owner>(&dir.join(OWNER))?.map(|o| o.id) != Some(id.clone()) {
                return Err(StoreError::Engine(format!(
                    "{} was claimed by another ledger at the same time: give this one a \
                     directory of its own",
                    dir.display()
                )));
            }
            write_json(
                &marker_path,
                &Marker {
                    path: dir.clone(),
                    id,
                },
            )?;
            remove_stale_logs(&ledger)?;
            Ok(Placement {
                dir: Some(dir),
                _lock: Some(lock),
            })
        }
    }
}

/// Removes the WAL files left in a ledger directory whose log is elsewhere: the ones of
/// before the move, which the move flushed into table files and RocksDB no longer reads.
fn remove_stale_logs(ledger: &Path) -> Result<(), StoreError> {
    for (_, log) in log_files(ledger)? {
        std::fs::remove_file(&log).map_err(io(&log))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{Batch, RocksStore, Store, StoreOptions};

    fn with_wal(dir: &Path) -> StoreOptions {
        StoreOptions {
            wal_dir: Some(dir.to_path_buf()),
            ..StoreOptions::default()
        }
    }

    /// Writes keys `[5, i]` for `i` in `from..to`, each in a synced write of its own.
    fn write(s: &RocksStore, from: u8, to: u8) {
        for i in from..to {
            let mut b = Batch::new();
            b.put(vec![5, i], vec![i; 100]);
            s.write(b).unwrap();
        }
    }

    fn held(s: &RocksStore) -> usize {
        s.scan(&[5], &[5], 1000).unwrap().len()
    }

    fn log_bytes(dir: &Path) -> u64 {
        log_files(dir)
            .unwrap()
            .iter()
            .map(|(_, p)| std::fs::metadata(p).unwrap().len())
            .sum()
    }

    fn refusal(ledger: &Path, opts: &StoreOptions) -> String {
        match RocksStore::open(ledger, opts) {
            Ok(_) => panic!("opening {} with {opts:?} was not refused", ledger.display()),
            Err(e) => e.to_string(),
        }
    }

    /// The log goes where it is told, the ledger refuses to open without it (which changes
    /// nothing), and a read-only open finds it by the marker.
    #[test]
    fn a_store_with_its_wal_elsewhere_keeps_every_write_and_refuses_to_open_without_it() {
        let root = tempfile::tempdir().unwrap();
        let (ledger, wal) = (root.path().join("ledger"), root.path().join("wal"));
        {
            let s = RocksStore::open(&ledger, &with_wal(&wal)).unwrap();
            write(&s, 0, 50);
        }
        assert!(log_files(&ledger).unwrap().is_empty());
        // The writes are in the log, not (only) in table files: the memtable was not flushed.
        assert!(log_bytes(&wal) >= 50 * 100, "{} log bytes", log_bytes(&wal));

        let e = refusal(&ledger, &StoreOptions::default());
        assert!(
            e.contains("--wal-dir") && e.contains(wal.to_str().unwrap()),
            "{e}"
        );
        let elsewhere = root.path().join("elsewhere");
        let e = refusal(&ledger, &with_wal(&elsewhere));
        assert!(e.contains("does not hold the write-ahead log"), "{e}");
        assert!(log_files(&ledger).unwrap().is_empty());

        let ro = RocksStore::open_read_only(&ledger, &StoreOptions::default()).unwrap();
        assert_eq!(held(&ro), 50);
        drop(ro);
        let s = RocksStore::open(&ledger, &with_wal(&wal)).unwrap();
        assert!(s.recovery_losses().is_empty(), "{:?}", s.recovery_losses());
        assert_eq!(held(&s), 50);
    }

    /// An existing ledger given a WAL directory is flushed before its log moves, keeps every
    /// write, and leaves no log behind in its own directory.
    #[test]
    fn an_existing_store_moves_its_wal_out_with_every_write() {
        let root = tempfile::tempdir().unwrap();
        let (ledger, wal) = (root.path().join("ledger"), root.path().join("wal"));
        {
            let s = RocksStore::open(&ledger, &StoreOptions::default()).unwrap();
            write(&s, 0, 30);
        }
        assert!(log_bytes(&ledger) >= 30 * 100);
        {
            let s = RocksStore::open(&ledger, &with_wal(&wal)).unwrap();
            assert_eq!(held(&s), 30);
            write(&s, 30, 40);
        }
        assert!(log_files(&ledger).unwrap().is_empty());
        assert!(ledger.join(MARKER).exists() && wal.join(OWNER).exists());
        let s = RocksStore::open(&ledger, &with_wal(&wal)).unwrap();
        assert_eq!(held(&s), 40);
    }

    /// A WAL directory serves one ledger: another is refused while the first is open and
    /// after, and so is a directory holding log files of no ledger.
    #[test]
    fn a_wal_dir_serves_one_store() {
        let root = tempfile::tempdir().unwrap();
        let wal = root.path().join("wal");
        let a = RocksStore::open(root.path().join("a"), &with_wal(&wal)).unwrap();
        write(&a, 0, 5);
        let e = refusal(&root.path().join("b"), &with_wal(&wal));
        assert!(e.contains("another ledger"), "{e}");
        drop(a);
        let e = refusal(&root.path().join("b"), &with_wal(&wal));
        assert!(e.contains("another ledger"), "{e}");
        let a = RocksStore::open(root.path().join("a"), &with_wal(&wal)).unwrap();
        assert_eq!(held(&a), 5);

        let stray = root.path().join("stray");
        std::fs::create_dir(&stray).unwrap();
        std::fs::write(stray.join("000007.log"), b"x").unwrap();
        let e = refusal(&root.path().join("c"), &with_wal(&stray));
        assert!(e.contains("unknown database"), "{e}");
        assert_eq!(std::fs::read(stray.join("000007.log")).unwrap(), b"x");
    }

    /// The same ledger cannot be placed twice while open: the owner file is locked.
    #[test]
    fn an_open_wal_dir_is_locked() {
        let root = tempfile::tempdir().unwrap();
        let (ledger, wal) = (root.path().join("ledger"), root.path().join("wal"));
        let _s = RocksStore::open(&ledger, &with_wal(&wal)).unwrap();
        let e = place(&ledger, Some(&wal), || Ok(()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("locked"), "{e}");
    }

    /// A WAL directory moved while the ledger was stopped is found again by its id.
    #[test]
    fn a_moved_wal_dir_is_found_by_its_id() {
        let root = tempfile::tempdir().unwrap();
        let ledger = root.path().join("ledger");
        let (old, new) = (root.path().join("old"), root.path().join("new"));
        {
            let s = RocksStore::open(&ledger, &with_wal(&old)).unwrap();
            write(&s, 0, 20);
        }
        std::fs::rename(&old, &new).unwrap();
        {
            let s = RocksStore::open(&ledger, &with_wal(&new)).unwrap();
            assert_eq!(held(&s), 20);
        }
        let marker: Marker = read_json(&ledger.join(MARKER)).unwrap().unwrap();
        assert_eq!(marker.path, std::fs::canonicalize(&new).unwrap());
        let e = refusal(&ledger, &StoreOptions::default());
        assert!(e.contains(new.to_str().unwrap()), "{e}");
    }

    /// A backup (checkpoint) of a ledger whose log is elsewhere stands alone: it holds the
    /// log's writes and no marker.
    #[test]
    fn a_checkpoint_of_a_store_with_its_wal_elsewhere_stands_alone() {
        let root = tempfile::tempdir().unwrap();
        let (ledger, wal) = (root.path().join("ledger"), root.path().join("wal"));
        let backup = root.path().join("backup");
        let s = RocksStore::open(&ledger, &with_wal(&wal)).unwrap();
        write(&s, 0, 25);
        s.checkpoint_to(&backup).unwrap();
        drop(s);
        assert!(!backup.join(MARKER).exists());
        let b = RocksStore::open_read_only(&backup, &StoreOptions::default()).unwrap();
        assert_eq!(held(&b), 25);
    }
}
