//! Disk trouble: when the data dir's filesystem is full, calls fail with UNAVAILABLE and change
//! nothing; when space returns, the server recovers without a restart and everything
//! acknowledged before is intact. Runs the real `fenced` on a small tmpfs (needs root, as CI is).

use std::io::Write;
use std::process::Command;

mod common;

use common::fenced::Fenced;
use fence_proto::v1 as pb;
use fence_proto::v1::decision::Outcome as O;
use fence_proto::v1::fence_client::FenceClient;
use tonic::Code;

struct Tmpfs(std::path::PathBuf);

impl Tmpfs {
    fn mount(size: &str) -> Self {
        let dir = tempfile::tempdir().unwrap().keep();
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&dir)
            .status()
            .expect("run mount");
        assert!(
            ok.success(),
            "mounting a tmpfs needs root (CI runs as root)"
        );
        Self(dir)
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

/// Fills the filesystem until writes fail; returns the filler's path.
fn fill(dir: &std::path::Path) -> std::path::PathBuf {
    let path = dir.join("filler");
    let mut f = std::fs::File::create(&path).unwrap();
    // Down to the last byte: a few free kilobytes would still take a small write.
    for size in [64 << 10, 4096, 512, 1] {
        let chunk = vec![0u8; size];
        while f.write_all(&chunk).and_then(|_| f.sync_data()).is_ok() {}
    }
    path
}

fn begin(step: &str) -> pb::BeginRequest {
    padded(step, 2048)
}

fn padded(step: &str, pad: usize) -> pb::BeginRequest {
    pb::BeginRequest {
        run_id: "run".into(),
        tool: "pay".into(),
        step_key: step.into(),
        arguments_json: format!(r#"{{"step":"{step}","pad":"{}"}}"#, "x".repeat(pad)),
        ..Default::default()
    }
}

/// Starts `fenced` on `data`; returns it and a client.
async fn start_fenced(data: &std::path::Path) -> (Fenced, FenceClient<tonic::transport::Channel>) {
    let fenced = Fenced::start(data, &[]);
    let client = FenceClient::connect(fenced.url()).await.unwrap();
    (fenced, client)
}

#[tokio::test]
async fn a_full_disk_is_unavailable_and_recovers_when_space_returns() {
    let fs = Tmpfs::mount("48m");
    let data = fs.0.join("data");
    let (_fenced, mut c) = start_fenced(&data).await;

    let O::Execute(before) = c
        .begin(begin("before"))
        .await
        .unwrap()
        .into_inner()
        .decision
        .unwrap()
        .outcome
        .unwrap()
    else {
        panic!("expected a grant")
    };

    let filler = fill(&fs.0);
    // Writes go on into space the WAL already has (written ahead at start, at most an eighth
    // of the free space: here about 6 MiB) and are acknowledged, durably: an overwrite needs
    // no new blocks. Past it they are refused, and every failure is UNAVAILABLE.
    let mut refused = 0;
    let mut granted = Vec::new();
    for i in 0..1000 {
        match c.begin(padded(&format!("full-{i}"), 64 << 10)).await {
            Ok(r) => {
                let O::Execute(g) = r.into_inner().decision.unwrap().outcome.unwrap() else {
                    panic!("expected a grant")
                };
                granted.push(g.effect_id);
            }
            Err(s) => {
                assert_eq!(s.code(), Code::Unavailable, "{s:?}");
                refused += 1;
                if refused == 20 {
                    break;
                }
            }
        }
    }
    assert!(refused > 0, "a full disk must refuse writes");

    std::fs::remove_file(filler).unwrap();
    // Space is back: the server recovers by itself, and what was acknowledged is intact.
    let mut recovered = false;
    for _ in 0..50 {
        if let Ok(r) = c.begin(begin("after")).await {
            assert!(matches!(
                r.into_inner().decision.unwrap().outcome.unwrap(),
                O::Execute(_)
            ));
            recovered = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(recovered, "the server did not recover when space returned");
    let q = c
        .query_outcome(pb::QueryOutcomeRequest {
            key: Some(pb::query_outcome_request::Key::EffectId(
                before.effect_id.clone(),
            )),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(q.receipt.unwrap().effect_id, before.effect_id);
    for effect_id in granted {
        let q = c
            .query_outcome(pb::QueryOutcomeRequest {
                key: Some(pb::query_outcome_request::Key::EffectId(effect_id.clone())),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(q.receipt.unwrap().effect_id, effect_id);
    }
}
