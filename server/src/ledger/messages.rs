//! The sentences a refusal carries for a model.
//!
//! A framework shows a refusal's message to the model that made the call, so each one says
//! what the *model* should do about its own action, in plain words, and never names an API
//! step only the framework can take (forking a branch, resending with a flag, reconciling):
//! those are in the refusal's machine-readable reason and recovery, which the framework acts
//! on. One place, so the voice stays the same everywhere and tests can check it.

/// DUPLICATE_INTENT: the same action was already done in the same step.
pub const DUPLICATE_INTENT: &str = "This exact action was already done; its result is attached. Do not repeat it. If the user really wants it done a second time, ask them to confirm first.";

/// FORK_REQUIRED: after a restore, a call that differs from what was done at this point.
pub const FORK_REQUIRED: &str = "This differs from what was already done at this point before the agent was restored (that action's result is attached). Do not do something different without asking the user first.";

/// ARGUMENT_MISMATCH: a known step key with other arguments.
pub const ARGUMENT_MISMATCH: &str = "This step was already done with different arguments (its result is attached); it was not done again with these. Use the attached result, or ask the user before doing something different.";

/// CREDENTIAL_CONSUMED: a one-time approval presented again.
pub const CREDENTIAL_CONSUMED: &str = "This approval was already used and cannot be used again. Ask the user for a new approval if the action is still wanted.";

/// CREDENTIAL_MISMATCH for an approval bound to another call.
pub const CREDENTIAL_OTHER_CALL: &str =
    "This approval was given for a different action. Ask the user for an approval of this one.";

/// RECONCILE_REQUIRED: the outcome of an earlier attempt is not known.
pub const RECONCILE_REQUIRED: &str = "This action may already have happened, and its outcome is still being checked. Do not retry it; tell the user it is pending confirmation.";

/// EXPIRED: only a tombstone of the matching effect remains.
pub const EXPIRED: &str =
    "This action was already done long ago (only its record remains). Do not repeat it.";

/// Phrases no message for a model may contain: API actions only a framework can take.
#[cfg(test)]
pub(crate) const FRAMEWORK_ONLY: &[&str] = &[
    "deliberate_repeat",
    "fork a new branch",
    "fork",
    "reconcile",
    "step key",
    "epoch",
    "resend",
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_for_a_model_name_no_framework_action() {
        for m in [
            DUPLICATE_INTENT,
            FORK_REQUIRED,
            ARGUMENT_MISMATCH,
            CREDENTIAL_CONSUMED,
            CREDENTIAL_OTHER_CALL,
            RECONCILE_REQUIRED,
            EXPIRED,
        ] {
            let lower = m.to_lowercase();
            for bad in FRAMEWORK_ONLY {
                assert!(!lower.contains(bad), "{m:?} names {bad:?}");
            }
            assert!(m.ends_with('.'), "{m:?}");
        }
    }
}
