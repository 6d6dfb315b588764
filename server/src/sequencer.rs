//! Group commit for the decisions that write: Begin, Complete, Heartbeat and their batches.
//!
//! Each request goes to one of N sequencer threads, chosen by its run, so one run's requests
//! are decided in arrival order by one thread. A sequencer drains everything queued for it,
//! decides the drained group in order inside one deferred store section (each decision's
//! writes visible to the next at once, not yet durable: [`Store::deferred_then`]) and hands
//! the group to the store, which answers every request in it once the group is durable. The
//! sequencer meanwhile decides the next group: on RocksDB the store's committer thread
//! writes and syncs one group while the next is decided. No request hops to the blocking
//! pool, and a busy sequencer takes the next group without sleeping, so under load a group
//! costs one sync and no thread wake-ups per request.
//!
//! Nothing is answered before its sync. When the sync fails every request of the group is
//! answered UNAVAILABLE (any of its writes may or may not have survived; a client resending
//! the same request, with its request id, gets the same effect back).

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::mpsc::{self, Receiver, Sender};
use std::thread::JoinHandle;

use tonic::Status;

use crate::ledger::{Ledger, LedgerError};
use crate::store::{Store, StoreError};

/// Most requests decided in one group (one sync); the rest wait for the next group.
const MAX_GROUP: usize = 512;

/// One queued request: decided inside the group's section, answered after its sync.
trait Task<S>: Send {
    /// Decides the request (its writes deferred).
    fn decide(&mut self, ledger: &Ledger<S>);
    /// Answers it: `synced` is the group's sync, `Err` when it failed.
    fn answer(self: Box<Self>, synced: Result<(), Status>);
}

struct Pending<F, T, R> {
    decide: Option<F>,
    outcome: Option<Result<T, Status>>,
    reply: R,
}

impl<S, F, T, R> Task<S> for Pending<F, T, R>
where
    F: FnOnce(&Ledger<S>) -> Result<T, LedgerError> + Send,
    T: Send,
    R: FnOnce(Result<T, Status>) + Send,
{
    fn decide(&mut self, ledger: &Ledger<S>) {
        let Some(decide) = self.decide.take() else {
            return;
        };
        // A panic in one decision must not take the sequencer (and every later request on
        // its runs) down with it; the run's lock is released by unwinding.
        let outcome = catch_unwind(AssertUnwindSafe(|| decide(ledger)))
            .map_err(|_| {
                tracing::error!("a decision panicked; its request is answered INTERNAL");
                Status::internal("the request could not be processed")
            })
            .and_then(|r| r.map_err(Status::from));
        self.outcome = Some(outcome);
    }

    fn answer(self: Box<Self>, synced: Result<(), Status>) {
        let answer = match synced {
            Ok(()) => self
                .outcome
                .unwrap_or_else(|| Err(Status::internal("the request was never decided"))),
            Err(status) => Err(status),
        };
        (self.reply)(answer);
    }
}

type Job<S> = Box<dyn Task<S>>;

/// The sequencer threads of one ledger.
pub struct Sequencer<S> {
    queues: Vec<Sender<Job<S>>>,
    threads: Vec<JoinHandle<()>>,
}

impl<S: Store> Sequencer<S> {
    /// Starts `threads` sequencers (at least one) over `ledger`.
    pub fn start(ledger: Arc<Ledger<S>>, threads: usize) -> Self {
        let mut queues = Vec::new();
        let mut handles = Vec::new();
        for i in 0..threads.max(1) {
            let (tx, rx) = mpsc::channel::<Job<S>>();
            let ledger = ledger.clone();
            let handle = std::thread::Builder::new()
                .name(format!("fence-seq-{i}"))
                .spawn(move || sequence(&ledger, &rx))
                .expect("spawn a sequencer thread");
            queues.push(tx);
            handles.push(handle);
        }
        Self {
            queues,
            threads: handles,
        }
    }

    /// Decides `decide` on the sequencer of `route` (a hash of the run), in order with that
    /// run's other requests, and answers once its group is durable.
    pub async fn submit<T, F>(&self, route: u64, decide: F) -> Result<T, Status>
    where
        T: Send + 'static,
        F: FnOnce(&Ledger<S>) -> Result<T, LedgerError> + Send + 'static,
    {
        let (reply, answer) = tokio::sync::oneshot::channel();
        // The caller may have gone away (deadline, disconnect): nothing to tell it then.
        self.dispatch(route, decide, move |out| {
            let _ = reply.send(out);
        });
        answer
            .await
            .map_err(|_| Status::internal("the request could not be processed"))?
    }

    /// [`Sequencer::submit`] without waiting: `reply` is called with the answer once the
    /// group is durable (on the sequencer thread, so it must not block), or at once with
    /// UNAVAILABLE when the sequencers have stopped.
    pub fn dispatch<T, F, R>(&self, route: u64, decide: F, reply: R)
    where
        T: Send + 'static,
        F: FnOnce(&Ledger<S>) -> Result<T, LedgerError> + Send + 'static,
        R: FnOnce(Result<T, Status>) + Send + 'static,
    {
        let job: Job<S> = Box::new(Pending {
            decide: Some(decide),
            outcome: None,
            reply,
        });
        let queue = &self.queues[(route % self.queues.len() as u64) as usize];
        if let Err(mpsc::SendError(job)) = queue.send(job) {
            job.answer(Err(Status::unavailable("the server is shutting down")));
        }
    }
}

impl<S> Drop for Sequencer<S> {
    fn drop(&mut self) {
        // Closing the queues ends the threads once they answered what they hold; joining them
        // releases their references to the ledger before whoever drops it last closes it.
        self.queues.clear();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// A sequencer thread: groups, each decided and handed to the store to answer once durable.
fn sequence<S: Store>(ledger: &Ledger<S>, queue: &Receiver<Job<S>>) {
    while let Ok(first) = queue.recv() {
        let mut group: Vec<Job<S>> = vec![first];
        while group.len() < MAX_GROUP {
            match queue.try_recv() {
                Ok(job) => group.push(job),
                Err(_) => break,
            }
        }
        ledger.store().deferred_then(Box::new(move || {
            for job in group.iter_mut() {
                job.decide(ledger);
            }
            Box::new(move |synced: Result<(), StoreError>| answer(group, synced))
        }));
    }
}

/// Answers a decided group once its writes are durable (or failed to become so).
fn answer<S>(group: Vec<Job<S>>, synced: Result<(), StoreError>) {
    let synced = synced.map_err(|e| {
        tracing::error!(error = %e, requests = group.len(), "a group's sync failed; its requests are answered UNAVAILABLE");
        Status::unavailable(
            "storage could not make this request durable; it may or may not have been recorded: resend the same request",
        )
    });
    crate::metrics::group_commit(group.len(), synced.is_ok());
    for job in group {
        job.answer(synced.clone());
    }
}

/// The route of a run: requests with the same route go to the same sequencer.
pub fn route_of(tenant: &str, run_id: &str) -> u64 {
    route_of_key(&crate::store::keys::run_key(tenant, run_id))
}

/// The route of a run key (see [`route_of`]).
pub fn route_of_key(key: &crate::store::keys::RunKey) -> u64 {
    u64::from_le_bytes(key[..8].try_into().expect("run keys are 16 bytes"))
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;
    use crate::clock::ManualClock;
    use crate::ledger::{BeginCmd, Decision, LedgerConfig};
    use crate::store::{Batch, Entries, MemStore};

    /// The in-memory store whose group syncs fail while `fail` is set.
    #[derive(Default)]
    struct FlakySync {
        inner: MemStore,
        fail: AtomicBool,
    }

    impl Store for FlakySync {
        fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
            self.inner.get(key)
        }
        fn scan(&self, prefix: &[u8], from: &[u8], limit: usize) -> Result<Entries, StoreError> {
            self.inner.scan(prefix, from, limit)
        }
        fn write(&self, batch: Batch) -> Result<(), StoreError> {
            self.inner.write(batch)
        }
        fn deferred(&self, f: &mut dyn FnMut()) -> Result<(), StoreError> {
            f();
            if self.fail.load(Ordering::SeqCst) {
                return Err(StoreError::Engine("fsync failed".into()));
            }
            Ok(())
        }
    }

    fn ledger() -> Arc<Ledger<FlakySync>> {
        Arc::new(Ledger::new(
            FlakySync::default(),
            Arc::new(ManualClock::new(1_700_000_000_000)),
            LedgerConfig::default(),
        ))
    }

    fn begin(run: &str, step: &str) -> BeginCmd {
        BeginCmd {
            run_id: run.into(),
            tool: "pay".into(),
            step_key: step.into(),
            arguments_json: format!(r#"{{"step":"{step}"}}"#),
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn a_failed_sync_answers_its_whole_group_unavailable() {
        let ledger = ledger();
        let seq = Sequencer::start(ledger.clone(), 1);
        ledger.store().fail.store(true, Ordering::SeqCst);
        let first = || BeginCmd {
            request_id: "req-a".into(),
            ..begin("r", "a")
        };
        let err = seq
            .submit(1, move |l| l.begin("t", &first()))
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::Unavailable);
        // A refusal decided in a failed group is not answered either.
        let err = seq
            .submit(1, |l| {
                l.begin(
                    "t",
                    &BeginCmd {
                        epoch: 9,
                        ..begin("r", "b")
                    },
                )
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::Unavailable);
        ledger.store().fail.store(false, Ordering::SeqCst);
        // Resent with its request id after the failure: the same grant (the write had been
        // applied, though never acknowledged).
        let again = seq
            .submit(1, move |l| l.begin("t", &first()))
            .await
            .unwrap();
        match again.decision {
            Decision::Execute { receipt, .. } => assert_eq!((receipt.seq, receipt.attempt), (1, 1)),
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn a_panicking_decision_is_answered_internal_and_the_sequencer_goes_on() {
        let ledger = ledger();
        let seq = Sequencer::start(ledger, 1);
        let err = seq
            .submit(1, |_| -> Result<(), LedgerError> { panic!("boom") })
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::Internal);
        let ok = seq.submit(1, |l| l.begin("t", &begin("r", "a"))).await;
        assert!(ok.is_ok(), "{ok:?}");
    }

    #[tokio::test]
    async fn one_runs_requests_are_decided_in_order_across_groups() {
        let ledger = ledger();
        let seq = Arc::new(Sequencer::start(ledger, 2));
        let route = route_of("t", "r");
        // Queued without awaiting: they form groups, and each sees the ones before it.
        let answers: Vec<_> = (0..200)
            .map(|i| {
                let seq = seq.clone();
                async move {
                    seq.submit(route, move |l| l.begin("t", &begin("r", &format!("s{i}"))))
                        .await
                }
            })
            .collect();
        let mut seqs = Vec::new();
        for a in futures::future::join_all(answers).await {
            match a.unwrap().decision {
                Decision::Execute { receipt, .. } => seqs.push(receipt.seq),
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(seqs, (1..=200).collect::<Vec<u64>>());
    }
}
