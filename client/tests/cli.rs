//! The `fence` command line against a real server: health, listing a run's effects (filtered
//! by state, as a table and as JSON lines), reconciling an unknown outcome, compacting the
//! store, and its exit codes.

mod common;

use std::process::Output;
use std::time::Duration;

use common::TestServer;
use fence_client::{Completion, Decision, EffectCall};

use common::fence_cli as fence;

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[tokio::test]
async fn an_operator_finds_and_settles_an_unknown_outcome() {
    let srv = TestServer::start().await;
    let url = srv.url();
    let c = srv.client().await;

    let health = fence(&["--url", &url, "health"]).await;
    assert!(health.status.success(), "{health:?}");
    assert_eq!(stdout(&health).trim(), "serving");

    // One effect completed, one whose executor vanished: its lease lapses, outcome unknown.
    let run = common::unique("cli");
    let done = EffectCall::new(&run, "bank.transfer", r#"{"to":"ann","amount":1}"#).step_key("a");
    let Decision::Execute(grant) = c.begin(&done).await.unwrap().decision else {
        panic!("expected a grant")
    };
    c.complete(
        &grant.effect_id,
        grant.attempt,
        0,
        Completion::Result(b"tx-1".to_vec()),
    )
    .await
    .unwrap();
    let lost = EffectCall::new(&run, "bank.transfer", r#"{"to":"bob","amount":2}"#)
        .step_key("b")
        .lease_ms(50);
    let Decision::Execute(lost) = c.begin(&lost).await.unwrap().decision else {
        panic!("expected a grant")
    };
    tokio::time::sleep(Duration::from_millis(120)).await;

    let table = fence(&["--url", &url, "effects", "list", &run]).await;
    assert!(table.status.success(), "{table:?}");
    let table = stdout(&table);
    assert!(
        table.contains(&grant.effect_id) && table.contains(&lost.effect_id),
        "{table}"
    );
    assert!(
        table.contains("EFFECT_UNKNOWN") && table.contains("COMPLETED"),
        "{table}"
    );

    let unknown = fence(&[
        "--url",
        &url,
        "effects",
        "list",
        &run,
        "--state",
        "effect_unknown",
        "--json",
    ])
    .await;
    assert!(unknown.status.success(), "{unknown:?}");
    let lines: Vec<serde_json::Value> = stdout(&unknown)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["effect_id"], lost.effect_id.as_str());
    assert_eq!(lines[0]["state"], "EFFECT_UNKNOWN");
    assert_eq!(lines[0]["downstream_key"], lost.downstream_key.as_str());

    // The operator checked the bank: the transfer never arrived.
    // Across all runs: the one unknown effect, with its run.
    let unsettled = fence(&[
        "--url",
        &url,
        "effects",
        "unsettled",
        "--state",
        "effect_unknown",
    ])
    .await;
    assert!(unsettled.status.success(), "{unsettled:?}");
    let table = stdout(&unsettled);
    assert!(
        table.contains(&lost.effect_id)
            && table.contains(&run)
            && !table.contains(&grant.effect_id),
        "{table}"
    );
    let listed = fence(&["--url", &url, "effects", "unsettled", "--json"]).await;
    let listed: Vec<serde_json::Value> = stdout(&listed)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0]["state"], "EFFECT_UNKNOWN");
    let settled = fence(&[
        "--url",
        &url,
        "reconcile",
        &lost.effect_id,
        "--failed-before-input",
        "--evidence",
        "no transfer with this key in the bank's ledger",
    ])
    .await;
    assert!(settled.status.success(), "{settled:?}");
    assert!(
        stdout(&settled).contains("FAILED_BEFORE_INPUT"),
        "{}",
        stdout(&settled)
    );
    let unknown = fence(&[
        "--url",
        &url,
        "effects",
        "list",
        &run,
        "--state",
        "effect_unknown",
    ])
    .await;
    let none = fence(&["--url", &url, "effects", "unsettled", "--json"]).await;
    assert_eq!(stdout(&none), "", "settled: nothing left to list");
    assert!(
        !stdout(&unknown).contains(&lost.effect_id),
        "{}",
        stdout(&unknown)
    );

    // The effect and the run, as an operator reads them.
    let shown = fence(&["--url", &url, "effect", "show", &lost.effect_id, "--json"]).await;
    assert!(shown.status.success(), "{shown:?}");
    let shown: serde_json::Value = serde_json::from_str(stdout(&shown).trim()).unwrap();
    assert_eq!(shown["state"], "FAILED_BEFORE_INPUT");
    assert_eq!(shown["step_key"], "b");
    c.checkpoint(&run, "main", 0, "after-b").await.unwrap();
    let info = fence(&["--url", &url, "run", "show", &run, "--json"]).await;
    assert!(info.status.success(), "{info:?}");
    let info: serde_json::Value = serde_json::from_str(stdout(&info).trim()).unwrap();
    assert_eq!(info["epoch"], 1);
    assert_eq!(info["effect_count"], 2);
    assert_eq!(info["branches"][0]["name"], "main");
    assert_eq!(info["checkpoints"][0]["checkpoint_id"], "after-b");
    let table = fence(&["--url", &url, "run", "show", &run]).await;
    assert!(stdout(&table).contains("after-b"), "{}", stdout(&table));

    // The audit trail: both effects in recording order, with arguments and evidence.
    let export = fence(&["--url", &url, "export", &run, "--format", "jsonl"]).await;
    assert!(export.status.success(), "{export:?}");
    let trail: Vec<serde_json::Value> = stdout(&export)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(trail.len(), 2, "{trail:?}");
    assert_eq!(trail[0]["effect_id"], grant.effect_id.as_str());
    assert_eq!(trail[0]["result"], "tx-1");
    assert_eq!(trail[1]["arguments_json"], r#"{"to":"bob","amount":2}"#);
    assert_eq!(
        trail[1]["evidence"],
        "no transfer with this key in the bank's ledger"
    );
}

#[tokio::test]
async fn a_tool_registration_is_shown() {
    let srv = TestServer::start().await;
    let url = srv.url();
    let c = srv.client().await;
    let name = common::unique("payments.charge");
    c.register_tool(
        fence_client::ToolDef::new(&name, fence_client::OperationClass::NonRetryable)
            .volatile(["request_id"]),
    )
    .await
    .unwrap();
    let shown = fence(&["--url", &url, "tools", "show", &name, "--json"]).await;
    assert!(shown.status.success(), "{shown:?}");
    let shown: serde_json::Value = serde_json::from_str(stdout(&shown).trim()).unwrap();
    assert_eq!(shown["version"], 1);
    assert_eq!(shown["class"], "NON_RETRYABLE");
    assert_eq!(shown["volatile_fields"], serde_json::json!(["request_id"]));
    let never = fence(&["--url", &url, "tools", "show", "never.registered"]).await;
    assert_eq!(never.status.code(), Some(4), "{never:?}");
}

#[tokio::test]
async fn exit_codes_say_what_went_wrong() {
    let srv = TestServer::start().await;
    let url = srv.url();
    // No such run: 4.
    let missing = fence(&["--url", &url, "effects", "list", "no-such-run"]).await;
    assert_eq!(missing.status.code(), Some(4), "{missing:?}");
    // A bad state name: usage, 2, and nothing asked of the server.
    let bad = fence(&["--url", &url, "effects", "list", "r", "--state", "gone"]).await;
    assert_eq!(bad.status.code(), Some(2), "{bad:?}");
    assert!(String::from_utf8_lossy(&bad.stderr).contains("not a state"));
    // A format export does not write: usage, 2.
    let csv = fence(&["--url", &url, "export", "r", "--format", "csv"]).await;
    assert_eq!(csv.status.code(), Some(2), "{csv:?}");
    // Nobody listening: 3.
    let down = fence(&["--url", "http://127.0.0.1:9", "health"]).await;
    assert_eq!(down.status.code(), Some(3), "{down:?}");
    // Reconciling an effect that does not exist: 4.
    let id = format!("e{}", "ab".repeat(24));
    let gone = fence(&[
        "--url",
        &url,
        "effect",
        "show",
        &format!("e{}", "cd".repeat(24)),
    ])
    .await;
    assert_eq!(gone.status.code(), Some(4), "{gone:?}");
    let none = fence(&[
        "--url",
        &url,
        "reconcile",
        &id,
        "--failed-before-input",
        "--evidence",
        "x",
    ])
    .await;
    assert_eq!(none.status.code(), Some(4), "{none:?}");
}

#[tokio::test]
async fn runs_are_listed_by_prefix_and_tenant() {
    let srv = TestServer::start().await;
    let url = srv.url();
    let c = srv.client().await;
    for run in ["order-2", "order-1", "order-3", "refund-1"] {
        c.start_run(run).await.unwrap();
    }
    // order-2 restored to a checkpoint before its one effect: one replay pending.
    let pay = EffectCall::new("order-2", "bank.transfer", r#"{"to":"ann","amount":1}"#);
    c.checkpoint("order-2", "main", 1, "start").await.unwrap();
    let Decision::Execute(grant) = c.begin(&pay).await.unwrap().decision else {
        panic!("expected a grant")
    };
    c.complete(
        &grant.effect_id,
        grant.attempt,
        0,
        Completion::Result(b"tx-1".to_vec()),
    )
    .await
    .unwrap();
    c.restore("order-2", "start", None).await.unwrap();
    // Another tenant's run is not listed.
    let other = common::builder(&url)
        .tenant("other")
        .connect()
        .await
        .unwrap();
    other.start_run("order-9").await.unwrap();

    let listed = fence(&[
        "--url", &url, "runs", "list", "--prefix", "order-", "--json",
    ])
    .await;
    assert!(listed.status.success(), "{listed:?}");
    let runs: Vec<serde_json::Value> = stdout(&listed)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let ids: Vec<&str> = runs.iter().map(|r| r["run_id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["order-1", "order-2", "order-3"]);
    assert_eq!(runs[1]["epoch"], 2);
    assert_eq!(runs[1]["effect_count"], 1);
    assert_eq!(runs[1]["branches"][0]["pending_replays"], 1);
    assert!(runs[1].get("checkpoints").is_none(), "{}", runs[1]);

    let table = fence(&["--url", &url, "runs", "list"]).await;
    let table = stdout(&table);
    assert_eq!(table.lines().count(), 5, "{table}");
    assert!(
        table.contains("refund-1") && !table.contains("order-9"),
        "{table}"
    );
    let theirs = fence(&["--url", &url, "--tenant", "other", "runs", "list"]).await;
    let theirs = stdout(&theirs);
    assert!(
        theirs.contains("order-9") && !theirs.contains("order-1"),
        "{theirs}"
    );

    // Pages follow on from each other: two runs a page, nothing twice, nothing missed.
    let (first, next) = c.list_runs_page("", None, 2).await.unwrap();
    let (second, last) = c.list_runs_page("", next.as_deref(), 2).await.unwrap();
    let ids: Vec<String> = first
        .iter()
        .chain(&second)
        .map(|r| r.run_id.clone())
        .collect();
    assert_eq!(ids, ["order-1", "order-2", "order-3", "refund-1"]);
    assert_eq!(last, None);
    // A token the server did not issue is a usage error of the request, not a crash.
    let bad = c.list_runs_page("", Some("zz"), 2).await.unwrap_err();
    assert_eq!(bad.code(), Some(tonic::Code::InvalidArgument), "{bad:?}");
}

#[tokio::test]
async fn tools_are_registered_from_a_file_and_listed() {
    let srv = TestServer::start().await;
    let url = srv.url();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tools.json");
    std::fs::write(
        &file,
        r#"[
          {"name": "payments.charge", "class": "non_retryable", "volatile_fields": ["request_id"]},
          {"name": "search", "class": "SAFE_RETRY", "normalized_fields": ["query"],
           "string_normalization": "trim_lowercase", "retention_ms": 60000}
        ]"#,
    )
    .unwrap();
    let file = file.to_str().unwrap();
    let registered = fence(&["--url", &url, "tools", "register", file]).await;
    assert!(registered.status.success(), "{registered:?}");
    assert_eq!(
        stdout(&registered),
        "payments.charge v1 registered\nsearch v1 registered\n"
    );
    let again = fence(&["--url", &url, "tools", "register", file]).await;
    assert_eq!(
        stdout(&again),
        "payments.charge v1 unchanged\nsearch v1 unchanged\n"
    );

    // What `tools show --json` prints registers as is, and is the same definition.
    let shown = fence(&["--url", &url, "tools", "show", "search", "--json"]).await;
    let shown_file = dir.path().join("search.json");
    std::fs::write(&shown_file, stdout(&shown)).unwrap();
    let round_trip = fence(&[
        "--url",
        &url,
        "tools",
        "register",
        shown_file.to_str().unwrap(),
    ])
    .await;
    assert_eq!(stdout(&round_trip), "search v1 unchanged\n");

    let listed = fence(&["--url", &url, "tools", "list", "--json"]).await;
    let tools: Vec<serde_json::Value> = stdout(&listed)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(tools.len(), 2, "{tools:?}");
    assert_eq!(tools[0]["name"], "payments.charge");
    assert_eq!(tools[0]["class"], "NON_RETRYABLE");
    assert_eq!(tools[1]["name"], "search");
    assert_eq!(tools[1]["string_normalization"], "trim_lowercase");
    assert_eq!(tools[1]["retention_ms"], 60000);
    let table = fence(&["--url", &url, "tools", "list"]).await;
    assert!(stdout(&table).contains("request_id"), "{}", stdout(&table));

    // A misspelt field or a bad class is a usage error, and nothing in the file is registered.
    for bad in [
        r#"[{"name": "refund", "class": "NON_RETRYABLE"}, {"name": "x", "class": "SAFE_RETRY", "volatile": ["a"]}]"#,
        r#"{"name": "refund", "class": "ONCE"}"#,
        r#"{"name": "refund", "class": "NON_RETRYABLE", "lease_ms": -1}"#,
        "not json",
    ] {
        std::fs::write(dir.path().join("bad.json"), bad).unwrap();
        let out = fence(&[
            "--url",
            &url,
            "tools",
            "register",
            dir.path().join("bad.json").to_str().unwrap(),
        ])
        .await;
        assert_eq!(out.status.code(), Some(2), "{bad}: {out:?}");
    }
    let c = srv.client().await;
    assert_eq!(c.list_tools().await.unwrap().len(), 2);
}

#[tokio::test]
async fn tokens_are_checked_and_backups_need_an_admin_token() {
    let srv = TestServer::start_with(|config, dir| {
        let tokens = dir.join("tokens");
        std::fs::write(
            &tokens,
            format!(
                "acme {}\nops {} admin\n",
                fence_server::auth::Auth::hash_token("tok-acme"),
                fence_server::auth::Auth::hash_token("tok-ops")
            ),
        )
        .unwrap();
        config.auth_tokens_file = Some(tokens);
    })
    .await;
    let url = srv.url();
    let scratch = tempfile::tempdir().unwrap();
    let backup = scratch.path().join("b1");
    let backup = backup.to_str().unwrap();

    let bad = fence(&["--url", &url, "--token", "nope", "runs", "list"]).await;
    assert_eq!(bad.status.code(), Some(1), "{bad:?}");
    assert!(String::from_utf8_lossy(&bad.stderr).contains("unknown token"));
    let listed = fence(&["--url", &url, "--token", "tok-acme", "runs", "list"]).await;
    assert!(listed.status.success(), "{listed:?}");

    let tenant_token = fence(&[
        "--url", &url, "--token", "tok-acme", "backup", "create", backup,
    ])
    .await;
    assert_eq!(tenant_token.status.code(), Some(1), "{tenant_token:?}");
    assert!(String::from_utf8_lossy(&tenant_token.stderr).contains("Admin service"));
    assert!(!std::path::Path::new(backup).exists());
    let admin = fence(&[
        "--url", &url, "--token", "tok-ops", "backup", "create", backup,
    ])
    .await;
    assert!(admin.status.success(), "{admin:?}");
}

/// Every table file's bytes contain `needle` somewhere.
fn table_files_hold(ledger_dir: &std::path::Path, needle: &[u8]) -> bool {
    std::fs::read_dir(ledger_dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "sst"))
        .any(|p| {
            std::fs::read(&p)
                .map(|b| b.windows(needle.len()).any(|w| w == needle))
                .unwrap_or(false)
        })
}

#[tokio::test]
async fn store_compact_drops_the_payloads_past_their_window_from_disk_and_keeps_the_rest() {
    // Table files uncompressed, so a payload still on disk is found by its bytes.
    let srv = TestServer::start_with(|c, _| {
        c.retention_ms = 1;
        c.compression = fence_server::store::Compression::None;
    })
    .await;
    let url = srv.url();
    let c = srv.client().await;
    let mut kept =
        fence_client::ToolDef::new("ledger.keep", fence_client::OperationClass::NonRetryable);
    kept.retention_ms = 3_600_000;
    c.register_tool(kept).await.unwrap();
    let run = common::unique("compact");
    for (tool, result) in [
        ("bank.transfer", "gone-7f3a9c"),
        ("ledger.keep", "kept-1b2c4d"),
    ] {
        let call = EffectCall::new(&run, tool, r#"{"amount":1}"#).step_key(tool);
        let Decision::Execute(grant) = c.begin(&call).await.unwrap().decision else {
            panic!("not granted")
        };
        c.complete(
            &grant.effect_id,
            grant.attempt,
            0,
            Completion::Result(result.as_bytes().to_vec()),
        )
        .await
        .unwrap();
    }
    tokio::time::sleep(Duration::from_millis(20)).await;

    let out = fence(&["--url", &url, "store", "compact", "--json"]).await;
    assert!(out.status.success(), "{out:?}");
    let line: serde_json::Value = serde_json::from_str(stdout(&out).trim()).unwrap();
    assert!(line["bytes_after"].as_u64().unwrap() > 0, "{line}");
    assert!(
        line["took_ms"].is_u64() && line["bytes_before"].is_u64(),
        "{line}"
    );

    let ledger_dir = srv
        .dir
        .path()
        .join("data")
        .join(fence_server::server::LEDGER_DIR);
    assert!(
        table_files_hold(&ledger_dir, b"kept-1b2c4d"),
        "within its window: kept"
    );
    // RocksDB deletes the replaced table files as the compaction ends; give it a moment.
    let mut tries = 0;
    while table_files_hold(&ledger_dir, b"gone-7f3a9c") {
        tries += 1;
        assert!(tries < 50, "the expired payload is still in a table file");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Reads answered the tombstone before and after.
    let expired = c
        .begin(&EffectCall::new(&run, "bank.transfer", r#"{"amount":1}"#).step_key("bank.transfer"))
        .await
        .unwrap();
    assert!(
        matches!(expired.decision, Decision::Refused(ref r) if r.reason == fence_client::ReasonCode::Expired),
        "{:?}",
        expired.decision
    );
}
