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
//! A lone request at low load skips the hand-off: when its sequencer is idle, nothing is
//! queued for it and its last few groups were single requests that nothing overlapped, the
//! caller's thread decides and commits it in the sequencer's place (holding the sequencer's
//! turn, so every run's order holds). At one request at a time that saves a thread wake-up
//! each way, a tenth of the latency and a sixth of the CPU per effect on two cores; under load
//! the groups hold many requests and every request is queued (docs/BENCHMARKS.md). A caller
//! committing inline blocks its thread for a sync, so fewer callers may do so at once than
//! the runtime has workers: one worker always stays free to read the next requests, which is
//! how an overlap is seen at all (on a one-worker runtime, inline commits would decide every
//! request alone, one sync each, however many are waiting).
//!
//! Nothing is answered before its sync. When the sync fails every request of the group is
//! answered UNAVAILABLE (any of its writes may or may not have survived; a client resending
//! the same request, with its request id, gets the same effect back).

use std::collections::VecDeque;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use tonic::Status;

use crate::ledger::{Ledger, LedgerError};
use crate::store::{Store, StoreError};

/// Most requests decided in one group (one sync); the rest wait for the next group.
const MAX_GROUP: usize = 512;

/// Lone groups in a row after which a lone request is decided inline (see
/// [`Sequencer::set_inline_callers`]): with two or more callers, requests often arrive one at
/// a time but overlap, and one decided inline holds the next back from its group.
const LONE_STREAK: u32 = 4;

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

/// One sequencer's queue, and who is deciding its runs' requests right now.
struct Queue<S> {
    state: Mutex<QueueState<S>>,
    /// Signalled when the sequencer thread may have work: jobs queued and nobody deciding.
    ready: Condvar,
}

struct QueueState<S> {
    jobs: VecDeque<Job<S>>,
    /// A group of this sequencer's runs is being decided (by its thread, or inline by a
    /// caller); nobody else may decide one of its runs' requests meanwhile.
    busy: bool,
    /// The sequencer thread waits for work.
    waiting: bool,
    /// How many groups in a row held a single request and saw no other queued while they
    /// were decided and synced: the load is one request at a time.
    lone: u32,
    /// No more jobs are taken.
    closed: bool,
}

impl<S> Queue<S> {
    /// Gives back the turn taken for a group of `n` requests (decided and, where this thread
    /// committed it, synced), waking the sequencer thread when requests queued behind a group
    /// decided inline.
    fn finish(&self, n: usize) {
        let mut state = self.lock();
        state.busy = false;
        state.lone = if n == 1 && state.jobs.is_empty() {
            state.lone.saturating_add(1)
        } else {
            0
        };
        let wake = state.waiting && !state.jobs.is_empty();
        drop(state);
        if wake {
            self.ready.notify_one();
        }
    }

    fn lock(&self) -> MutexGuard<'_, QueueState<S>> {
        // A decision's panic is caught inside its task; a poisoned lock can only come from a
        // panic between jobs, and the state (a queue and flags) is valid at every step.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The sequencer threads of one ledger.
pub struct Sequencer<S> {
    ledger: Arc<Ledger<S>>,
    queues: Vec<Arc<Queue<S>>>,
    threads: Vec<JoinHandle<()>>,
    /// Most callers committing inline at once (0: never); see [`Sequencer::set_inline_callers`].
    inline_limit: AtomicUsize,
    /// Callers committing inline now.
    inline_active: AtomicUsize,
}

impl<S: Store> Sequencer<S> {
    /// Starts `threads` sequencers (at least one) over `ledger`.
    pub fn start(ledger: Arc<Ledger<S>>, threads: usize) -> Self {
        let mut queues = Vec::new();
        let mut handles = Vec::new();
        for i in 0..threads.max(1) {
            let queue = Arc::new(Queue {
                state: Mutex::new(QueueState {
                    jobs: VecDeque::new(),
                    busy: false,
                    waiting: false,
                    lone: 0,
                    closed: false,
                }),
                ready: Condvar::new(),
            });
            let (l, q) = (ledger.clone(), queue.clone());
            let handle = std::thread::Builder::new()
                .name(format!("fence-seq-{i}"))
                .spawn(move || sequence(&l, &q))
                .expect("spawn a sequencer thread");
            queues.push(queue);
            handles.push(handle);
        }
        Self {
            ledger,
            queues,
            threads: handles,
            inline_limit: AtomicUsize::new(0),
            inline_active: AtomicUsize::new(0),
        }
    }

    /// How many callers may decide and commit a lone request on their own thread at once,
    /// across all sequencers (0, the default: none). When a request's sequencer is idle,
    /// nothing is queued for it and its last few groups were lone requests that no other
    /// overlapped, the caller does the sequencer's work itself, and the request costs no
    /// hand-off to the sequencer thread and none back. Under load the groups hold many
    /// requests and every request is queued as before.
    ///
    /// The caller's thread (a runtime worker) is blocked meanwhile for one decision and one
    /// sync, so give fewer than the runtime's workers (the server gives one less): a worker
    /// left free reads the next requests, and a request queued behind an inline one is what
    /// ends a streak. With every worker blocked nothing would be read while a request
    /// commits, each would find its sequencer idle, and requests would be committed one sync
    /// each however many wait.
    pub fn set_inline_callers(&self, callers: usize) {
        self.inline_limit.store(callers, Ordering::Relaxed);
    }

    /// How many callers may commit inline at once (see [`Sequencer::set_inline_callers`]).
    pub fn inline_callers(&self) -> usize {
        self.inline_limit.load(Ordering::Relaxed)
    }

    /// Takes one of the inline callers' places, if one is free.
    fn inline_place(&self) -> Option<InlinePlace<'_>> {
        let limit = self.inline_limit.load(Ordering::Relaxed);
        self.inline_active
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |active| {
                (active < limit).then_some(active + 1)
            })
            .ok()
            .map(|_| InlinePlace(&self.inline_active))
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
    /// group is durable (on the thread that committed it, so it must not block), or at once
    /// with UNAVAILABLE when the sequencers have stopped. A lone request may be decided and
    /// committed before this returns (see [`Sequencer::set_inline_callers`]).
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
        let mut state = queue.lock();
        if state.closed {
            drop(state);
            job.answer(Err(Status::unavailable("the server is shutting down")));
            return;
        }
        if state.lone >= LONE_STREAK
            && !state.busy
            && state.jobs.is_empty()
            && let Some(_place) = self.inline_place()
        {
            // Nothing of these runs is queued or being decided, so deciding here keeps
            // every run's order. The place is held until this thread is free again.
            state.busy = true;
            drop(state);
            crate::metrics::inline_commit();
            decide_group(&self.ledger, queue, vec![job]);
            return;
        }
        state.jobs.push_back(job);
        let wake = state.waiting && !state.busy;
        drop(state);
        if wake {
            queue.ready.notify_one();
        }
    }
}

impl<S> Drop for Sequencer<S> {
    fn drop(&mut self) {
        // Closing the queues ends the threads once they answered what they hold; joining them
        // releases their references to the ledger before whoever drops it last closes it.
        for q in &self.queues {
            q.lock().closed = true;
            q.ready.notify_all();
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// A sequencer thread: groups, each decided and handed to the store to answer once durable.
fn sequence<S: Store>(ledger: &Ledger<S>, queue: &Arc<Queue<S>>) {
    loop {
        let mut state = queue.lock();
        while state.busy || state.jobs.is_empty() {
            if state.closed && (state.jobs.is_empty() || state.busy) {
                // Busy while closing: a group never gave its turn back. What waits behind it
                // is answered rather than left hanging.
                let left: Vec<Job<S>> = state.jobs.drain(..).collect();
                drop(state);
                for job in left {
                    job.answer(Err(Status::unavailable("the server is shutting down")));
                }
                return;
            }
            state.waiting = true;
            state = queue.ready.wait(state).unwrap_or_else(|e| e.into_inner());
            state.waiting = false;
        }
        let n = state.jobs.len().min(MAX_GROUP);
        let group: Vec<Job<S>> = state.jobs.drain(..n).collect();
        state.busy = true;
        drop(state);
        decide_group(ledger, queue, group);
    }
}

/// Decides `group` (the queue's turn taken) in order inside one deferred store section and
/// hands it to the store, which answers it once durable; gives the turn back.
fn decide_group<S: Store>(ledger: &Ledger<S>, queue: &Arc<Queue<S>>, mut group: Vec<Job<S>>) {
    // The turn goes back before the answers when this thread commits the group (so a caller
    // answered sees the sequencer idle, and whether anything overlapped the sync counts),
    // else once the group is handed to the thread committing it: whichever comes first. It
    // goes back on unwinding too, so a panic cannot leave the queue's runs stuck behind it.
    let turn = Arc::new(Turn {
        queue: queue.clone(),
        requests: group.len(),
        held: AtomicBool::new(true),
    });
    let in_answer = turn.clone();
    ledger.store().deferred_then(Box::new(move || {
        for job in group.iter_mut() {
            job.decide(ledger);
        }
        Box::new(move |synced: Result<(), StoreError>| {
            in_answer.give_back();
            answer(group, synced)
        })
    }));
    turn.give_back();
}

/// One of the inline callers' places (see [`Sequencer::set_inline_callers`]), given back
/// when dropped (on unwinding too).
struct InlinePlace<'a>(&'a AtomicUsize);

impl Drop for InlinePlace<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A queue's turn taken for a group: given back once, by whoever comes first.
struct Turn<S> {
    queue: Arc<Queue<S>>,
    requests: usize,
    held: AtomicBool,
}

impl<S> Turn<S> {
    fn give_back(&self) {
        if self.held.swap(false, Ordering::AcqRel) {
            self.queue.finish(self.requests);
        }
    }
}

impl<S> Drop for Turn<S> {
    fn drop(&mut self) {
        self.give_back();
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
    use super::*;
    use crate::clock::ManualClock;
    use crate::ledger::{BeginCmd, Decision, LedgerConfig};
    use crate::store::{Batch, Entries, MemStore};

    /// The in-memory store whose group syncs fail while `fail` is set, and panic (a fault
    /// outside any decision) while `panic` is.
    #[derive(Default)]
    struct FlakySync {
        inner: MemStore,
        fail: AtomicBool,
        panic: AtomicBool,
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
            if self.panic.load(Ordering::SeqCst) {
                panic!("the store failed outside a decision");
            }
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

    /// The thread each of `n` requests on `route` was decided on, one at a time.
    async fn deciding_threads(seq: &Sequencer<FlakySync>, n: usize) -> Vec<std::thread::ThreadId> {
        let mut threads = Vec::new();
        for _ in 0..n {
            threads.push(
                seq.submit(7, |_| Ok(std::thread::current().id()))
                    .await
                    .unwrap(),
            );
        }
        threads
    }

    #[tokio::test]
    async fn a_lone_request_is_decided_on_its_callers_thread_once_the_load_is_lone() {
        let seq = Sequencer::start(ledger(), 1);
        seq.set_inline_callers(1);
        let here = std::thread::current().id();
        let threads = deciding_threads(&seq, LONE_STREAK as usize + 3).await;
        let (queued, inline) = threads.split_at(LONE_STREAK as usize);
        assert!(queued.iter().all(|t| *t != here), "{threads:?}");
        assert!(inline.iter().all(|t| *t == here), "{threads:?}");

        // A failed sync of an inline group is answered UNAVAILABLE too.
        seq.ledger.store().fail.store(true, Ordering::SeqCst);
        let failed = seq
            .submit(7, |_| Ok(std::thread::current().id()))
            .await
            .unwrap_err();
        assert_eq!(failed.code(), tonic::Code::Unavailable);
        seq.ledger.store().fail.store(false, Ordering::SeqCst);
        assert_eq!(deciding_threads(&seq, 1).await, vec![here]);

        // Off: every request goes to the sequencer thread.
        seq.set_inline_callers(0);
        let threads = deciding_threads(&seq, 3).await;
        assert!(threads.iter().all(|t| *t != here), "{threads:?}");
    }

    #[tokio::test]
    async fn a_request_overlapping_an_inline_one_queues_behind_it_and_ends_the_streak() {
        let ledger = ledger();
        let seq = Arc::new(Sequencer::start(ledger, 1));
        seq.set_inline_callers(1);
        let here = std::thread::current().id();
        let route = route_of("t", "r");
        let decided_on = |i: usize| {
            move |l: &Ledger<FlakySync>| {
                let begun = l.begin("t", &begin("r", &format!("s{i}")))?;
                match begun.decision {
                    Decision::Execute { receipt, .. } => {
                        Ok((receipt.seq, std::thread::current().id()))
                    }
                    other => panic!("{other:?}"),
                }
            }
        };
        // Lone requests, one at a time, until one is decided inline.
        for i in 0..LONE_STREAK as usize {
            let (seq_no, thread) = seq.submit(route, decided_on(i)).await.unwrap();
            assert_eq!((seq_no, thread == here), (i as u64 + 1, false));
        }
        // An inline request that holds its turn until another caller (its own thread) has
        // queued a request of the same run behind it.
        let queue = seq.queues[0].clone();
        let (other, overlapping) = std::sync::mpsc::channel();
        let other_seq = seq.clone();
        let first = seq.submit(route, move |l| {
            let before = queue.lock().jobs.len();
            std::thread::spawn(move || {
                let answer = futures::executor::block_on(other_seq.submit(route, decided_on(5)));
                other.send(answer).unwrap();
            });
            while queue.lock().jobs.len() == before {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            decided_on(4)(l)
        });
        let (first_seq, first_thread) = first.await.unwrap();
        let (second_seq, second_thread) = overlapping.recv().unwrap().unwrap();
        assert_eq!((first_seq, first_thread), (5, here));
        // Decided after the inline one, by the sequencer thread it was queued to.
        assert_eq!(second_seq, 6);
        assert_ne!(second_thread, here);
        // The overlap ended the streak: the next lone request is queued too.
        let (seq_no, thread) = seq.submit(route, decided_on(6)).await.unwrap();
        assert_eq!(seq_no, 7);
        assert_ne!(thread, here);
    }

    #[tokio::test]
    async fn a_panic_outside_the_decisions_of_an_inline_group_gives_its_turn_back() {
        let seq = Arc::new(Sequencer::start(ledger(), 1));
        seq.set_inline_callers(1);
        let here = std::thread::current().id();
        deciding_threads(&seq, LONE_STREAK as usize).await;
        seq.ledger.store().panic.store(true, Ordering::SeqCst);
        let inline = seq.clone();
        let crashed =
            tokio::spawn(
                async move { inline.submit(7, |_| Ok(std::thread::current().id())).await },
            )
            .await;
        assert!(crashed.unwrap_err().is_panic());
        seq.ledger.store().panic.store(false, Ordering::SeqCst);
        // The queue is not left busy (its runs would wait forever): the next request is
        // decided, inline again.
        let next = tokio::time::timeout(
            std::time::Duration::from_secs(10),
            deciding_threads(&seq, 1),
        )
        .await
        .expect("a request after the panic is answered");
        assert_eq!(next, vec![here]);
    }

    /// While this thread commits a lone request inline on route 0 (sequencer 0), a lone
    /// request on route 1 (sequencer 1, its streak reached) is sent from another thread: the
    /// thread it was decided on, and that other thread's id.
    fn decided_beside_an_inline_commit(
        callers: usize,
    ) -> (std::thread::ThreadId, std::thread::ThreadId) {
        let seq = Arc::new(Sequencer::start(ledger(), 2));
        seq.set_inline_callers(callers);
        futures::executor::block_on(async {
            for route in [0, 1] {
                for _ in 0..LONE_STREAK {
                    seq.submit(route, |_| Ok(())).await.unwrap();
                }
            }
        });
        let (sent, beside) = std::sync::mpsc::channel();
        let other = seq.clone();
        let here = std::thread::current().id();
        let held_on = futures::executor::block_on(seq.submit(0, move |_| {
            // Inline on this thread: the other request is sent and answered meanwhile.
            std::thread::spawn(move || {
                let decided_on = futures::executor::block_on(
                    other.submit(1, |_| Ok(std::thread::current().id())),
                );
                sent.send((decided_on.unwrap(), std::thread::current().id()))
                    .unwrap();
            })
            .join()
            .unwrap();
            Ok(std::thread::current().id())
        }))
        .unwrap();
        assert_eq!(held_on, here, "the first request holds an inline place");
        beside.recv().unwrap()
    }

    #[test]
    fn no_more_callers_commit_inline_at_once_than_allowed() {
        // Two allowed: the other thread commits its lone request inline too.
        let (decided_on, sender) = decided_beside_an_inline_commit(2);
        assert_eq!(decided_on, sender);
        // One allowed, and this thread holds it: the request goes to its sequencer's thread.
        let (decided_on, sender) = decided_beside_an_inline_commit(1);
        assert_ne!(decided_on, sender);
    }
}
