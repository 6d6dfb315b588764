//! The two arms without Fence: naive retry (no idempotency key at all) and the usual
//! idempotency key (the UUID the model wrote into the arguments, deduplicated downstream).
//!
//! Both behave the way agent frameworks do today: a transport-level failure is retried with
//! the same request, an error the model sees makes it write the call again, and a restore
//! from a checkpoint re-runs the steps after it.

use super::agent::{Attempt, Protection, StepCtx, StepResult};
use crate::scenario::{Call, Fault, Workflow};
use crate::world::{Reply, World};

/// A protection without Fence.
pub(super) struct Plain<'a> {
    /// The world.
    pub world: &'a World,
    /// Deduplicate on the model's UUID (else: no key).
    pub uuid_key: bool,
}

impl Plain<'_> {
    fn send(&self, call: &Call) -> Reply {
        let key = self.uuid_key.then_some(call.uuid.as_str());
        self.world.call(call.tool.name, &call.args_json, key)
    }
}

fn answer(reply: Reply) -> Attempt {
    match reply {
        Reply::Done(response) => Attempt::Done(StepResult {
            response,
            effect_id: String::new(),
        }),
        Reply::Rejected(why) => Attempt::Rejected(why),
    }
}

impl Protection for Plain<'_> {
    type Run = ();

    fn open(&self, _workflow: &Workflow) -> Self::Run {}

    async fn checkpoint(&self, _run: &mut (), _branch: &str, _name: &str) -> Result<(), String> {
        Ok(())
    }

    async fn restore(&self, _run: &mut (), _name: &str) -> Result<(), String> {
        Ok(())
    }

    async fn fork(&self, _run: &mut (), _checkpoint: &str) -> Result<String, String> {
        Err("arms without Fence never refuse, so they never fork".into())
    }

    async fn attempt(
        &self,
        _run: &mut (),
        _ctx: &StepCtx<'_>,
        call: &Call,
        fault: Option<Fault>,
    ) -> Attempt {
        match fault {
            Some(Fault::CrashBeforeDispatch { depth }) => Attempt::Crashed { depth },
            Some(Fault::CrashAfterCommit { depth }) => {
                self.send(call);
                Attempt::Crashed { depth }
            }
            Some(Fault::LostResponse) => {
                // The answer is lost; the framework retries the same request.
                self.send(call);
                answer(self.send(call))
            }
            Some(Fault::ErrorAfterCommit) => {
                self.send(call);
                Attempt::Reissue
            }
            Some(Fault::PauseBeyondLease) => {
                // A watchdog re-sends the stalled request; the stalled executor wakes up and
                // sends it too.
                let reply = self.send(call);
                self.send(call);
                answer(reply)
            }
            Some(Fault::CancelRace { committed }) => {
                if committed {
                    self.send(call);
                }
                Attempt::Reissue
            }
            // No Fence server to kill.
            Some(Fault::KillFence(_)) | None => answer(self.send(call)),
        }
    }
}
