//! Retry policy: bounded attempts and jittered exponential backoff.
//!
//! What is retried, and how, follows the tool's operation class (DESIGN.md):
//!
//! | class | tool failed before input | outcome unknown (timeout after dispatch) |
//! |---|---|---|
//! | `SAFE_RETRY` | retried | retried |
//! | `DEDUPLICATE` | retried (re-granted, same downstream key) | retried within the grant, same downstream key |
//! | `REQUIRES_EFFECT_CHECK` | retried (re-granted) | recorded `EFFECT_UNKNOWN`; the outcome check decides |
//! | `NON_RETRYABLE` | retried (re-granted) | recorded `EFFECT_UNKNOWN`; only reconcile with evidence |
//!
//! Every tool execution counts against [`RetryPolicy::max_attempts`]. Idempotent RPCs
//! (Complete, Heartbeat, Reconcile, QueryOutcome, and a Begin that carries a step key) are
//! retried through transport failures until [`RetryPolicy::transient_timeout`].

use std::time::Duration;

use rand::Rng;

/// How hard the client retries.
///
/// ```
/// use std::time::Duration;
/// use fence_client::RetryPolicy;
///
/// let policy = RetryPolicy {
///     max_attempts: 5,
///     initial_backoff: Duration::from_millis(20),
///     ..RetryPolicy::default()
/// };
/// assert!(policy.backoff(3) <= policy.max_backoff);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryPolicy {
    /// At most this many executions of one effect's tool (grants, re-grants after a failure
    /// before input, in-grant retries of a `DEDUPLICATE` or `SAFE_RETRY` tool). At least 1.
    pub max_attempts: u32,
    /// The first backoff; each retry doubles it, up to `max_backoff`.
    pub initial_backoff: Duration,
    /// The largest backoff.
    pub max_backoff: Duration,
    /// How long an idempotent RPC is retried through transport failures.
    pub transient_timeout: Duration,
    /// How long to wait for an effect whose lease another attempt holds.
    pub in_progress_timeout: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 3,
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(5),
            transient_timeout: Duration::from_secs(30),
            in_progress_timeout: Duration::from_secs(120),
        }
    }
}

impl RetryPolicy {
    /// The backoff before retry number `retry` (0-based): "equal jitter", a uniformly random
    /// duration between half and all of `min(max_backoff, initial_backoff * 2^retry)`, so
    /// concurrent callers spread out but never retry immediately.
    pub fn backoff(&self, retry: u32) -> Duration {
        jittered(self.ceiling(retry))
    }

    /// The un-jittered ceiling of the backoff before retry number `retry`.
    fn ceiling(&self, retry: u32) -> Duration {
        let factor = 1u32.checked_shl(retry.min(31)).unwrap_or(u32::MAX);
        self.initial_backoff
            .saturating_mul(factor)
            .min(self.max_backoff)
    }

    /// `max_attempts`, at least 1.
    pub(crate) fn attempts(&self) -> u32 {
        self.max_attempts.max(1)
    }
}

/// A uniformly random duration in `[ceiling / 2, ceiling]`.
pub(crate) fn jittered(ceiling: Duration) -> Duration {
    let half = ceiling / 2;
    let spread = u64::try_from((ceiling - half).as_micros()).unwrap_or(u64::MAX);
    half + Duration::from_micros(rand::rng().random_range(0..=spread))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_exponentially_up_to_the_cap_and_stays_jittered() {
        let policy = RetryPolicy {
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(1),
            ..RetryPolicy::default()
        };
        assert_eq!(policy.ceiling(0), Duration::from_millis(100));
        assert_eq!(policy.ceiling(2), Duration::from_millis(400));
        assert_eq!(policy.ceiling(10), Duration::from_secs(1));
        assert_eq!(policy.ceiling(u32::MAX), Duration::from_secs(1));
        for retry in 0..8 {
            let ceiling = policy.ceiling(retry);
            for _ in 0..50 {
                let b = policy.backoff(retry);
                assert!(
                    b >= ceiling / 2 && b <= ceiling,
                    "{b:?} outside {ceiling:?}"
                );
            }
        }
    }

    #[test]
    fn jitter_actually_spreads() {
        let samples: std::collections::HashSet<Duration> =
            (0..64).map(|_| jittered(Duration::from_secs(1))).collect();
        assert!(samples.len() > 1);
    }

    #[test]
    fn zero_attempts_means_one() {
        let policy = RetryPolicy {
            max_attempts: 0,
            ..RetryPolicy::default()
        };
        assert_eq!(policy.attempts(), 1);
    }
}
