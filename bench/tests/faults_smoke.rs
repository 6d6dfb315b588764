//! Smoke test of the fault-injection benchmark: a few hundred faults through all three arms,
//! the Fence arm against the real `fenced` (the debug build next to this test), with a few
//! `kill -9`s. Fence must show none of the failures; the unprotected arms must show them.

use fence_bench::faults::{self, ArmKind, ArmReport, Config};

fn config(step_key_rate: f64) -> Config {
    let mut cfg = Config::new(20_260_301, 400);
    cfg.agents = 32;
    cfg.step_key_rate = step_key_rate;
    // A handful of server kills in a small run.
    cfg.fault_params.kill_every = 60;
    // Debug builds are slow: a lease long enough for a normal call, short enough to wait for.
    cfg.fence.lease_ms = 500;
    cfg
}

fn assert_fence_clean(fence: &ArmReport) {
    assert_eq!(
        fence.errors, 0,
        "unexpected answers: {:?}",
        fence.first_errors
    );
    assert_eq!(
        fence.duplicates, 0,
        "Fence let an effect happen twice: {:?}",
        fence.duplicate_samples
    );
    assert_eq!(
        fence.resurrections, 0,
        "Fence let a spent approval be used again"
    );
    assert_eq!(fence.false_replays, 0, "Fence replayed a changed intent");
    assert_eq!(fence.false_forks, 0, "Fence refused an unchanged intent");
    assert_eq!(fence.lost_acks, Some(0), "Fence lost an acknowledgement");
    assert_eq!(
        fence.unresolved, 0,
        "intended effects never happened: {:?}",
        fence.unresolved_samples
    );
}

/// Workflows whose framework gives every step a durable step key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_step_keys_fence_shows_no_failure_where_the_other_arms_do() {
    let reports = faults::run(&config(1.0)).await.expect("the benchmark runs");
    println!("{}", faults::table(&reports));
    println!("{}", faults::details(&reports));
    let arm = |k| reports.iter().find(|r| r.arm == k).expect("every arm ran");
    let (naive, uuid, fence) = (
        arm(ArmKind::Naive),
        arm(ArmKind::UuidKey),
        arm(ArmKind::Fence),
    );

    for r in &reports {
        assert!(
            r.faults_injected() >= 300,
            "{}: too few faults",
            r.arm.name()
        );
    }
    assert!(naive.duplicates > 0, "naive retry should duplicate effects");
    assert!(
        naive.resurrections > 0,
        "naive retry should reuse spent approvals"
    );
    assert!(
        uuid.duplicates > 0,
        "a UUID key rewritten on restore should duplicate effects"
    );
    assert!(
        uuid.false_replays > 0,
        "a reused UUID should replay another call's result"
    );

    assert_fence_clean(fence);
    assert!(fence.kills > 0, "the run should have killed the server");
    assert!(
        fence.refused_changes > 0,
        "intent changes should have been refused"
    );
}

/// Workflows without step keys (the ACRFence setting: the model's calls only). This found
/// that a keyless Begin matching a FAILED_BEFORE_INPUT effect was refused DUPLICATE_INTENT
/// instead of re-granted with the same downstream key (fixed in the ledger).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_step_keys_fence_shows_no_failure() {
    let mut cfg = config(0.0);
    cfg.arms = vec![ArmKind::Fence];
    let reports = faults::run(&cfg).await.expect("the benchmark runs");
    println!("{}", faults::table(&reports));
    println!("{}", faults::details(&reports));
    assert_fence_clean(&reports[0]);
}
