//! An agent pays, crashes, is restored from its last checkpoint and regenerates the same
//! payment with a fresh request id and timestamp (its keys even in another order). Fence
//! replays the recorded payment instead of paying twice, and fences off the pre-crash process
//! (a zombie holding the old epoch).
//!
//! ```text
//! cargo run -p fence-server --bin fenced -- --data-dir /tmp/fence-demo
//! cargo run -p fence-client --example crash_restore_payment
//! ```
//!
//! `FENCE_URL` names the server (default `http://127.0.0.1:50051`). Exits non-zero if an
//! invariant is broken (the agent paid twice, the zombie was let through).

use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail, ensure};
use fence_client::{
    EffectOutcome, FenceClient, OperationClass, OutcomeSource, ReasonCode, RunHandle, ToolDef,
};

/// An in-memory payment provider: every charge it ever made, with the idempotency key sent.
#[derive(Default, Clone)]
pub struct PaymentProvider {
    charges: Arc<Mutex<Vec<(String, u64)>>>,
}

impl PaymentProvider {
    fn charge(&self, idempotency_key: &str, amount: u64) -> String {
        let mut charges = self.charges.lock().unwrap();
        charges.push((idempotency_key.to_owned(), amount));
        format!("ch_{:04} ({amount} EUR cents)", charges.len())
    }

    /// How many charges were made.
    pub fn charges(&self) -> usize {
        self.charges.lock().unwrap().len()
    }
}

/// The agent's payment step. The model regenerates the tool call every time: a fresh request
/// id, a fresh timestamp, the keys in whatever order it likes.
async fn pay(
    agent: &RunHandle,
    provider: &PaymentProvider,
    amount: u64,
    keys_reordered: bool,
) -> Result<EffectOutcome, fence_client::Error> {
    let request_id = uuid::Uuid::new_v4();
    let timestamp = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    let arguments = if keys_reordered {
        format!(
            r#"{{"timestamp":{timestamp},"to":"acme-hosting","request_id":"{request_id}","currency":"EUR","amount":{amount}}}"#
        )
    } else {
        format!(
            r#"{{"amount":{amount},"currency":"EUR","to":"acme-hosting","request_id":"{request_id}","timestamp":{timestamp}}}"#
        )
    };
    println!("         call payments.charge {arguments}");
    let call = agent.call("payments.charge", &arguments);
    let provider = provider.clone();
    agent
        .run_effect(&call, move |ctx| {
            let charge = provider.charge(&ctx.downstream_key, amount);
            async move { Ok(charge.into_bytes()) }
        })
        .await
}

/// The whole scenario against the server at `url`; an error if an invariant is broken.
pub async fn run(url: &str) -> anyhow::Result<()> {
    let client = FenceClient::connect(url)
        .await
        .with_context(|| format!("cannot reach the Fence server at {url}"))?;
    client
        .register_tool(
            ToolDef::new("payments.charge", OperationClass::NonRetryable)
                .volatile(["request_id", "timestamp"]),
        )
        .await?;
    let provider = PaymentProvider::default();
    let run_id = format!("agent-run-{}", uuid::Uuid::new_v4());

    let agent = RunHandle::start(client.clone(), &run_id).await?;
    agent.checkpoint("step-3-before-payment").await?;
    println!("[agent]   run {run_id}: checkpoint step-3-before-payment");
    let first = pay(&agent, &provider, 4200, false).await?;
    println!(
        "[agent]   paid: {} ({:?})",
        String::from_utf8_lossy(&first.result),
        first.source
    );
    ensure!(
        first.source == OutcomeSource::Executed,
        "the first payment should have executed, got {:?}",
        first.source
    );
    println!("[agent]   *** crash before the next checkpoint ***");
    // The old process may not be dead, only partitioned: it is a zombie from now on.
    let zombie = agent;

    let restored = RunHandle::attach(client.clone(), &run_id, "main").await?;
    let rewound = restored.restore("step-3-before-payment").await?;
    println!(
        "[restore] restored to step-3-before-payment: epoch {}, {} effect(s) on the replay tape",
        rewound.epoch,
        rewound.tape.len()
    );
    let second = pay(&restored, &provider, 4200, true).await?;
    println!(
        "[agent']  got: {} ({:?}, tool runs: {})",
        String::from_utf8_lossy(&second.result),
        second.source,
        second.executions
    );
    ensure!(
        second.source == OutcomeSource::Replayed && second.executions == 0,
        "the regenerated payment was not replayed: {second:?}"
    );
    ensure!(
        second.result == first.result,
        "the replay returned another result"
    );

    match pay(&zombie, &provider, 4200, false).await {
        Err(err) if err.reason() == Some(ReasonCode::StaleEpoch) => {
            println!("[zombie]  {err} (recovery {:?})", err.recovery());
        }
        Ok(outcome) => bail!("the zombie's payment went through: {outcome:?}"),
        Err(err) => bail!("the zombie got an unexpected error: {err}"),
    }

    let charges = provider.charges();
    println!("[check]   the provider charged {charges} time(s)");
    ensure!(
        charges == 1,
        "PAID TWICE: the provider charged {charges} times"
    );
    Ok(())
}

#[tokio::main]
async fn main() -> ExitCode {
    let url = std::env::var("FENCE_URL").unwrap_or_else(|_| "http://127.0.0.1:50051".into());
    match run(&url).await {
        Ok(()) => {
            println!("OK: one payment, replayed after the restore; the zombie was fenced off");
            ExitCode::SUCCESS
        }
        Err(err) => {
            eprintln!("FAILED: {err:#}");
            ExitCode::FAILURE
        }
    }
}
