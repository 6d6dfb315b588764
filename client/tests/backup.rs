//! Online backup end to end: `fence backup create` while agents keep writing, the copy moved
//! into a new directory and served by a new server, and every completion acknowledged before
//! the backup was asked for is there; `fence backup verify` passes a sound copy and fails a
//! damaged one.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{TestServer, fence_cli};
use fence_client::{Completion, Decision, EffectCall, EffectState, OutcomeKey};

/// An acknowledged completion: the effect and its result.
type Acked = (String, Vec<u8>);

/// Copies the directory tree `from` into a new `to`.
fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &to.join(entry.file_name()));
        } else {
            std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_backup_taken_under_load_holds_every_acknowledged_completion() {
    let srv = TestServer::start().await;
    let url = srv.url();
    let scratch = tempfile::tempdir().unwrap();

    // A one-time approval, spent before the backup.
    let first = srv.client().await;
    let approved = EffectCall::new("approvals", "bank.transfer", r#"{"to":"ann","amount":900}"#)
        .credential(b"approval-1".to_vec(), 1);
    let Decision::Execute(spent) = first.begin(&approved).await.unwrap().decision else {
        panic!("the approved call was not granted")
    };
    first
        .complete(
            &spent.effect_id,
            spent.attempt,
            0,
            Completion::Result(b"tx-ann".to_vec()),
        )
        .await
        .unwrap();

    // Agents completing effects without pause; each completion is noted once acknowledged.
    let acked: Arc<Mutex<Vec<Acked>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let mut agents = Vec::new();
    for agent in 0..6 {
        let client = srv.client().await;
        let (acked, stop) = (acked.clone(), stop.clone());
        agents.push(tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                n += 1;
                let run = format!("agent-{agent}");
                let call = EffectCall::new(&run, "bank.transfer", format!(r#"{{"n":{n}}}"#))
                    .step_key(format!("step-{n}"));
                let Decision::Execute(grant) = client.begin(&call).await.unwrap().decision else {
                    panic!("a new step was not granted")
                };
                let result = format!("tx-{agent}-{n}").into_bytes();
                client
                    .complete(
                        &grant.effect_id,
                        grant.attempt,
                        0,
                        Completion::Result(result.clone()),
                    )
                    .await
                    .unwrap();
                acked.lock().unwrap().push((grant.effect_id, result));
            }
        }));
    }
    common::eventually("the agents to complete 200 effects", || {
        acked.lock().unwrap().len() >= 200
    })
    .await;

    // Everything acknowledged before the backup is asked for must be in it.
    let before: Vec<Acked> = acked.lock().unwrap().clone();
    let dir = scratch.path().join("backup-1");
    let dir = dir.to_str().unwrap();
    let created = fence_cli(&["--url", &url, "backup", "create", dir, "--json"]).await;
    assert!(created.status.success(), "{created:?}");
    let during = acked.lock().unwrap().len();
    tokio::time::sleep(Duration::from_millis(100)).await;
    stop.store(true, Ordering::Relaxed);
    for a in agents {
        a.await.unwrap();
    }
    assert!(
        acked.lock().unwrap().len() > during,
        "the agents kept completing effects after the backup"
    );
    let report: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&created.stdout).trim()).unwrap();
    assert_eq!(report["problem_count"], 0, "{report}");
    assert!(
        report["effects"].as_u64().unwrap() >= before.len() as u64,
        "{report}"
    );
    assert_eq!(report["runs"], 7, "{report}");

    // Restore: the copy in a new directory, served by a new server.
    let restored_dir = scratch.path().join("restored");
    copy_dir(std::path::Path::new(dir), &restored_dir);
    let restored = TestServer::start_with(|config, _| config.data_dir = restored_dir.clone()).await;
    let client = restored.client().await;
    for (effect_id, result) in &before {
        let outcome = client
            .query_outcome(OutcomeKey::EffectId(effect_id.clone()))
            .await
            .unwrap();
        assert_eq!(outcome.state, EffectState::Completed, "{effect_id}");
        assert_eq!(&outcome.receipt.unwrap().result, result, "{effect_id}");
    }
    // The restored ledger still fences: a recorded step replays.
    let again = EffectCall::new("agent-0", "bank.transfer", r#"{"n":1}"#).step_key("step-1");
    assert!(matches!(
        client.begin(&again).await.unwrap().decision,
        Decision::Replay(_)
    ));

    // The approval stays spent: the backup holds the key credentials are hashed with.
    let resurrected = EffectCall::new("approvals", "bank.transfer", r#"{"to":"bob","amount":900}"#)
        .credential(b"approval-1".to_vec(), 1);
    assert!(
        matches!(
            client.begin(&resurrected).await.unwrap().decision,
            Decision::Refused(_)
        ),
        "a spent approval was accepted again after the restore"
    );
    assert_eq!(client.get_credential(b"approval-1").await.unwrap().uses, 1);

    // Verify: the sound copy passes...
    let verified = fence_cli(&["--url", &url, "backup", "verify", dir]).await;
    assert!(verified.status.success(), "{verified:?}");
    assert!(String::from_utf8_lossy(&verified.stdout).contains("problem_count    0"));
    // ...a damaged one does not (a flipped byte in a table file's first data block).
    let damaged = scratch.path().join("damaged");
    copy_dir(std::path::Path::new(dir), &damaged);
    let table = std::fs::read_dir(damaged.join("ledger"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "sst"))
        .max_by_key(|p| std::fs::metadata(p).unwrap().len())
        .expect("the backup holds a table file");
    let mut bytes = std::fs::read(&table).unwrap();
    bytes[100] ^= 0xff;
    std::fs::write(&table, bytes).unwrap();
    let damaged = damaged.to_str().unwrap();
    let found = fence_cli(&["--url", &url, "backup", "verify", damaged, "--json"]).await;
    assert_eq!(found.status.code(), Some(5), "{found:?}");
    let report: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&found.stdout).trim()).unwrap();
    assert!(report["problem_count"].as_u64().unwrap() > 0, "{report}");

    // Usage and refusals: a relative path (2), an existing directory (1, nothing written),
    // a directory that is not there (4).
    let relative = fence_cli(&["--url", &url, "backup", "create", "backups/x"]).await;
    assert_eq!(relative.status.code(), Some(2), "{relative:?}");
    let exists = fence_cli(&["--url", &url, "backup", "create", dir]).await;
    assert_eq!(exists.status.code(), Some(1), "{exists:?}");
    assert!(String::from_utf8_lossy(&exists.stderr).contains("already exists"));
    let missing = scratch.path().join("never-written");
    let missing = fence_cli(&["--url", &url, "backup", "verify", missing.to_str().unwrap()]).await;
    assert_eq!(missing.status.code(), Some(4), "{missing:?}");
}
