//! The saga executor against the real server: reverse-order compensation, resumption after
//! the executor is killed mid-compensation (before or after the compensation's downstream
//! commit), and never undoing a step twice.

mod common;

use std::future::Future;
use std::sync::{Arc, Mutex};

use common::{Downstream, TestServer, unique};
use fence_client::{
    CheckFinding, Compensation, EffectState, ExecContext, FenceClient, OperationClass, Receipt,
    RunHandle, Saga, SagaExecutor, SagaOutcome, ToolDef, ToolError, ToolRunner,
};
use tokio::sync::Notify;

/// Where the "crash" happens: the first run of `tool` (optionally after its downstream commit)
/// signals `hit` and never returns.
struct Trap {
    tool: &'static str,
    commit_first: bool,
    hit: Arc<Notify>,
}

/// The travel APIs: bookings and cancellations go to one downstream log; the card can decline.
#[derive(Clone, Default)]
struct Travel {
    world: Downstream,
    decline_card: bool,
    trap: Arc<Mutex<Option<Trap>>>,
    charge_attempts: Arc<Mutex<u32>>,
}

impl Travel {
    fn declining() -> Travel {
        Travel {
            decline_card: true,
            ..Travel::default()
        }
    }

    fn arm(&self, tool: &'static str, commit_first: bool) -> Arc<Notify> {
        let hit = Arc::new(Notify::new());
        *self.trap.lock().unwrap() = Some(Trap {
            tool,
            commit_first,
            hit: hit.clone(),
        });
        hit
    }
}

impl ToolRunner for Travel {
    fn run(
        &self,
        tool: &str,
        _arguments_json: &str,
        ctx: ExecContext,
    ) -> impl Future<Output = Result<Vec<u8>, ToolError>> + Send {
        let trapped = {
            let mut trap = self.trap.lock().unwrap();
            if trap.as_ref().is_some_and(|t| t.tool == tool) {
                trap.take()
            } else {
                None
            }
        };
        if tool == "payments.charge" {
            *self.charge_attempts.lock().unwrap() += 1;
        }
        let world = self.world.clone();
        let decline = self.decline_card && tool == "payments.charge";
        let tool = tool.to_owned();
        async move {
            if let Some(trap) = trapped {
                if trap.commit_first {
                    world.commit(&tool, &ctx.downstream_key);
                }
                trap.hit.notify_one();
                return std::future::pending().await;
            }
            if decline {
                return Err(ToolError::Rejected("card declined".into()));
            }
            Ok(world.commit(&tool, &ctx.downstream_key))
        }
    }

    fn check(&self, receipt: Receipt) -> impl Future<Output = CheckFinding> + Send {
        let evidence = format!("travel API lookup of key {}", receipt.downstream_key);
        let finding = match self.world.lookup(&receipt.downstream_key) {
            Some(result) => CheckFinding::Happened { result, evidence },
            None => CheckFinding::DidNotHappen { evidence },
        };
        std::future::ready(finding)
    }
}

async fn register_tools(client: &FenceClient, compensation_class: OperationClass) {
    for forward in ["flights.book", "hotels.book", "payments.charge"] {
        client
            .register_tool(ToolDef::new(forward, OperationClass::NonRetryable))
            .await
            .unwrap();
    }
    // Short leases: a compensation abandoned by a killed executor lapses quickly.
    for undo in ["flights.cancel", "hotels.cancel", "payments.refund"] {
        client
            .register_tool(ToolDef::new(undo, compensation_class).lease_ms(300))
            .await
            .unwrap();
    }
}

fn trip(id: &str) -> Saga {
    Saga::new(id)
        .step(
            "flight",
            "flights.book",
            r#"{"flight":"LH123","passenger":"ada"}"#,
            Compensation::new("flights.cancel", r#"{"flight":"LH123","passenger":"ada"}"#),
        )
        .step(
            "hotel",
            "hotels.book",
            r#"{"hotel":"h1","nights":2}"#,
            Compensation::new("hotels.cancel", r#"{"hotel":"h1"}"#),
        )
        .step(
            "charge",
            "payments.charge",
            r#"{"amount":90000,"currency":"EUR"}"#,
            Compensation::new("payments.refund", r#"{"amount":90000,"currency":"EUR"}"#),
        )
}

async fn setup(compensation_class: OperationClass) -> (TestServer, RunHandle) {
    let server = TestServer::start().await;
    let client = server.client().await;
    register_tools(&client, compensation_class).await;
    let run = RunHandle::start(client, &unique("trip-run")).await.unwrap();
    (server, run)
}

/// Runs the saga until the armed trap fires, then drops the executor mid-call (a crash).
async fn run_until_trapped(executor: &SagaExecutor<Travel>, saga: &Saga, hit: Arc<Notify>) {
    tokio::select! {
        outcome = executor.execute(saga) => panic!("the saga ended before the crash: {outcome:?}"),
        () = hit.notified() => {}
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completed_saga_replays_when_run_again() {
    let (_server, run) = setup(OperationClass::Deduplicate).await;
    let travel = Travel::default();
    let executor = SagaExecutor::new(run, travel.clone());
    let saga = trip("trip-ok");
    let SagaOutcome::Completed(first) = executor.execute(&saga).await.unwrap() else {
        panic!("expected completion");
    };
    assert_eq!(first.len(), 3);
    let SagaOutcome::Completed(again) = executor.execute(&saga).await.unwrap() else {
        panic!("expected completion");
    };
    assert!(again.iter().all(|o| o.executions == 0));
    assert_eq!(
        travel.world.history(),
        ["flights.book", "hotels.book", "payments.charge"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_step_compensates_the_committed_steps_in_reverse_order_once() {
    let (_server, run) = setup(OperationClass::Deduplicate).await;
    let travel = Travel::declining();
    let executor = SagaExecutor::new(run, travel.clone());
    let saga = trip("trip-declined");

    let outcome = executor.execute(&saga).await.unwrap();
    let SagaOutcome::Compensated {
        failed_step,
        failure,
        compensations,
    } = outcome
    else {
        panic!("expected compensation, got {outcome:?}");
    };
    assert_eq!(failed_step.as_deref(), Some("charge"));
    assert!(failure.contains("card declined"));
    let keys: Vec<_> = compensations
        .iter()
        .map(|r| r.step_key.clone().unwrap())
        .collect();
    assert_eq!(
        keys,
        [
            "trip-declined:hotel:compensate",
            "trip-declined:flight:compensate"
        ]
    );
    assert_eq!(
        travel.world.history(),
        [
            "flights.book",
            "hotels.book",
            "hotels.cancel",
            "flights.cancel"
        ]
    );

    // The saga's record says what was committed and what is undone.
    let state = executor.state("trip-declined").await.unwrap();
    let states: Vec<_> = state.steps.iter().map(|s| s.forward.state).collect();
    assert_eq!(
        states,
        [
            EffectState::Compensated,
            EffectState::Compensated,
            EffectState::FailedBeforeInput
        ]
    );
    assert!(state.is_aborting());
    assert_eq!(state.committed().count(), 0);
    for step in &state.steps[..2] {
        let comp = step.compensation.as_ref().unwrap();
        assert_eq!(
            comp.compensates_effect_id.as_ref(),
            Some(&step.forward.effect_id)
        );
        assert_eq!(
            step.forward.compensated_by_effect_id.as_ref(),
            Some(&comp.effect_id)
        );
    }

    // Running it again (e.g. after a crash right at the end) undoes nothing twice and does
    // not retry the failed charge.
    let again = executor.execute(&saga).await.unwrap();
    assert!(matches!(again, SagaOutcome::Compensated { .. }));
    assert_eq!(travel.world.history().len(), 4);
    assert_eq!(*travel.charge_attempts.lock().unwrap(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_saga_killed_mid_compensation_resumes_and_compensates_each_step_once() {
    let (_server, run) = setup(OperationClass::NonRetryable).await;
    let travel = Travel::declining();
    let saga = trip("trip-crash");
    // Crash while the second compensation (the flight's) runs, before it reaches the API.
    let hit = travel.arm("flights.cancel", false);
    let first = SagaExecutor::new(run.clone(), travel.clone());
    run_until_trapped(&first, &saga, hit).await;
    drop(first);
    assert_eq!(travel.world.count("hotels.cancel"), 1);
    assert_eq!(travel.world.count("flights.cancel"), 0);

    // A new executor resumes: the hotel's compensation is done; the flight's abandoned grant
    // lapses, the outcome check shows it never reached the API, so it runs (once).
    let second = SagaExecutor::new(run, travel.clone());
    let outcome = second.execute(&saga).await.unwrap();
    let SagaOutcome::Compensated { compensations, .. } = outcome else {
        panic!("expected compensation, got {outcome:?}");
    };
    assert_eq!(compensations.len(), 2);
    assert_eq!(travel.world.count("hotels.cancel"), 1);
    assert_eq!(travel.world.count("flights.cancel"), 1);
    let state = second.state("trip-crash").await.unwrap();
    assert_eq!(state.steps[0].forward.state, EffectState::Compensated);
    assert_eq!(state.steps[1].forward.state, EffectState::Compensated);

    // And once more: nothing new happens.
    second.execute(&saga).await.unwrap();
    assert_eq!(travel.world.history().len(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compensation_that_committed_before_the_crash_is_reconciled_not_repeated() {
    let (_server, run) = setup(OperationClass::NonRetryable).await;
    let travel = Travel::declining();
    let saga = trip("trip-crash-after-commit");
    // Crash after the flight's cancellation reached the API, before Complete.
    let hit = travel.arm("flights.cancel", true);
    let first = SagaExecutor::new(run.clone(), travel.clone());
    run_until_trapped(&first, &saga, hit).await;
    drop(first);
    assert_eq!(travel.world.count("flights.cancel"), 1);

    let second = SagaExecutor::new(run, travel.clone());
    let outcome = second.execute(&saga).await.unwrap();
    let SagaOutcome::Compensated { compensations, .. } = outcome else {
        panic!("expected compensation, got {outcome:?}");
    };
    let flight_cancel = &compensations[1];
    assert_eq!(flight_cancel.state, EffectState::Completed);
    assert!(flight_cancel.evidence.starts_with("travel API lookup"));
    assert_eq!(travel.world.count("flights.cancel"), 1);
    assert_eq!(travel.world.count("hotels.cancel"), 1);
    let state = second.state("trip-crash-after-commit").await.unwrap();
    assert!(
        state.steps[..2]
            .iter()
            .all(|s| s.forward.state == EffectState::Compensated)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_explicit_abort_undoes_a_completed_saga_once() {
    let (_server, run) = setup(OperationClass::Deduplicate).await;
    let travel = Travel::default();
    let executor = SagaExecutor::new(run, travel.clone());
    let saga = trip("trip-cancelled");
    executor.execute(&saga).await.unwrap();

    let undone = executor.compensate("trip-cancelled").await.unwrap();
    let tools: Vec<_> = undone.iter().map(|r| r.tool.as_str()).collect();
    assert_eq!(
        tools,
        ["payments.refund", "hotels.cancel", "flights.cancel"]
    );
    let again = executor.compensate("trip-cancelled").await.unwrap();
    let ids = |rs: &[Receipt]| rs.iter().map(|r| r.effect_id.clone()).collect::<Vec<_>>();
    assert_eq!(ids(&again), ids(&undone));
    assert_eq!(travel.world.history().len(), 6);
}
