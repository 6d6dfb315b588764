//! A trip booking saga: book a flight, book a hotel, charge the card. The card is declined, so
//! the hotel and then the flight are cancelled, each cancellation itself a fenced effect.
//! Running the executor again (as after a crash) undoes nothing twice.
//!
//! ```text
//! cargo run -p fence-server --bin fenced -- --data-dir /tmp/fence-demo
//! cargo run -p fence-client --example hotel_booking_saga
//! ```
//!
//! `FENCE_URL` names the server (default `http://127.0.0.1:50051`). Exits non-zero if an
//! invariant is broken (a step undone twice, out of order, or not at all).

use std::process::ExitCode;
use std::sync::{Arc, Mutex};

use anyhow::{Context, bail, ensure};
use fence_client::{
    Compensation, ExecContext, FenceClient, OperationClass, RunHandle, Saga, SagaExecutor,
    SagaOutcome, ToolDef, ToolError, ToolRunner,
};

/// In-memory travel APIs: every call that changed something, in order.
#[derive(Default, Clone)]
pub struct TravelApis {
    log: Arc<Mutex<Vec<String>>>,
}

impl TravelApis {
    /// The tools that changed something, in order.
    pub fn log(&self) -> Vec<String> {
        self.log.lock().unwrap().clone()
    }
}

impl ToolRunner for TravelApis {
    async fn run(
        &self,
        tool: &str,
        arguments_json: &str,
        ctx: ExecContext,
    ) -> Result<Vec<u8>, ToolError> {
        if tool == "payments.charge" {
            println!("         {tool} {arguments_json} -> declined");
            return Err(ToolError::Rejected(
                "card declined: insufficient funds".into(),
            ));
        }
        self.log.lock().unwrap().push(tool.to_owned());
        println!(
            "         {tool} {arguments_json} (idempotency key {})",
            ctx.downstream_key
        );
        Ok(format!("{tool}: confirmed").into_bytes())
    }
}

fn trip() -> Saga {
    Saga::new("trip-to-lisbon")
        .step(
            "flight",
            "flights.book",
            r#"{"flight":"TP1234","date":"2025-06-01","passenger":"Ada Lovelace"}"#,
            Compensation::new(
                "flights.cancel",
                r#"{"flight":"TP1234","passenger":"Ada Lovelace"}"#,
            ),
        )
        .step(
            "hotel",
            "hotels.book",
            r#"{"hotel":"Alfama Suites","nights":3,"guest":"Ada Lovelace"}"#,
            Compensation::new(
                "hotels.cancel",
                r#"{"hotel":"Alfama Suites","guest":"Ada Lovelace"}"#,
            ),
        )
        .step(
            "charge",
            "payments.charge",
            r#"{"amount":129000,"currency":"EUR","card":"tok_visa_4242"}"#,
            Compensation::new("payments.refund", r#"{"amount":129000,"currency":"EUR"}"#),
        )
}

/// The whole scenario against the server at `url`; an error if an invariant is broken.
pub async fn run(url: &str) -> anyhow::Result<()> {
    let client = FenceClient::connect(url)
        .await
        .with_context(|| format!("cannot reach the Fence server at {url}"))?;
    for forward in ["flights.book", "hotels.book", "payments.charge"] {
        client
            .register_tool(ToolDef::new(forward, OperationClass::NonRetryable))
            .await?;
    }
    // Cancelling or refunding by booking is idempotent downstream.
    for undo in ["flights.cancel", "hotels.cancel", "payments.refund"] {
        client
            .register_tool(ToolDef::new(undo, OperationClass::Deduplicate))
            .await?;
    }
    let run_id = format!("travel-agent-{}", uuid::Uuid::new_v4());
    let run = RunHandle::start(client, &run_id).await?;
    let apis = TravelApis::default();
    let executor = SagaExecutor::new(run, apis.clone());
    let saga = trip();

    println!("[saga]    run {run_id}: executing {}", saga.id);
    match executor.execute(&saga).await? {
        SagaOutcome::Compensated {
            failed_step,
            failure,
            compensations,
        } => {
            println!(
                "[saga]    step {failed_step:?} failed ({failure}); undone: {}",
                compensations
                    .iter()
                    .map(|r| r.tool.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
            ensure!(
                failed_step.as_deref() == Some("charge"),
                "the wrong step failed"
            );
        }
        SagaOutcome::Completed(_) => bail!("the declined charge did not abort the saga"),
    }
    let expected = [
        "flights.book",
        "hotels.book",
        "hotels.cancel",
        "flights.cancel",
    ];
    ensure!(
        apis.log() == expected,
        "the APIs saw {:?}, expected {expected:?}",
        apis.log()
    );

    println!("[saga]    the record in Fence:");
    for step in executor.state(&saga.id).await?.steps {
        println!(
            "           {:<8} {:<16} {}{}",
            step.name().unwrap_or("?"),
            step.forward.tool,
            step.forward.state,
            step.compensation
                .as_ref()
                .map(|c| format!(" (undone by {}: {})", c.tool, c.state))
                .unwrap_or_default()
        );
    }

    println!("[saga]    *** the executor restarts and runs the saga again ***");
    executor.execute(&saga).await?;
    ensure!(
        apis.log() == expected,
        "running the saga again changed something: {:?}",
        apis.log()
    );
    Ok(())
}

#[tokio::main]
async fn main() -> ExitCode {
    let url = std::env::var("FENCE_URL").unwrap_or_else(|_| "http://127.0.0.1:50051".into());
    match run(&url).await {
        Ok(()) => {
            println!("OK: booked, declined, undone in reverse order, each step exactly once");
            ExitCode::SUCCESS
        }
        Err(err) => {
            eprintln!("FAILED: {err:#}");
            ExitCode::FAILURE
        }
    }
}
