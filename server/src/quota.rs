//! Per-tenant request rate limits: a token bucket per tenant, checked after authentication, so
//! one tenant cannot starve the others. A refused call is RESOURCE_EXHAUSTED with a RetryInfo
//! delay and an ErrorInfo reason `LIMIT_EXCEEDED`; nothing reaches the ledger.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

use crate::ledger::Reason;
use crate::status::{DOMAIN, reason_name};

#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

/// Token buckets keyed by tenant.
#[derive(Debug)]
pub struct TenantRateLimit {
    per_second: f64,
    burst: f64,
    buckets: Mutex<HashMap<Arc<str>, Bucket>>,
}

impl TenantRateLimit {
    /// `per_second` sustained requests per tenant, with bursts of up to `burst`.
    pub fn new(per_second: u32, burst: u32) -> Self {
        Self {
            per_second: f64::from(per_second.max(1)),
            burst: f64::from(burst.max(1)),
            buckets: Mutex::new(HashMap::new()),
        }
    }

    /// Takes one token for `tenant` at `now`, or says how long to wait for one.
    pub fn take_at(&self, tenant: &Arc<str>, now: Instant) -> Result<(), Duration> {
        let mut buckets = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        let b = buckets.entry(tenant.clone()).or_insert(Bucket {
            tokens: self.burst,
            at: now,
        });
        let elapsed = now.saturating_duration_since(b.at).as_secs_f64();
        b.tokens = (b.tokens + elapsed * self.per_second).min(self.burst);
        b.at = now;
        if b.tokens >= 1.0 {
            b.tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((1.0 - b.tokens) / self.per_second))
        }
    }

    /// Takes one token for `tenant` now, or returns the RESOURCE_EXHAUSTED status.
    #[allow(clippy::result_large_err)] // tonic's interceptor signature
    pub fn check(&self, tenant: &Arc<str>) -> Result<(), Status> {
        self.take_at(tenant, Instant::now()).map_err(|wait| {
            let mut meta = HashMap::new();
            meta.insert("recovery".to_owned(), "WAIT_AND_QUERY".to_owned());
            meta.insert(
                "message".to_owned(),
                "This tenant is over its request rate; retry after the delay.".to_owned(),
            );
            let mut details = ErrorDetails::new();
            details.set_error_info(reason_name(Reason::LimitExceeded), DOMAIN, meta);
            details.set_retry_info(Some(wait));
            Status::with_error_details(
                Code::ResourceExhausted,
                "tenant request rate exceeded",
                details,
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bursts_then_refills_at_the_rate() {
        let limit = TenantRateLimit::new(10, 3);
        let a: Arc<str> = Arc::from("a");
        let b: Arc<str> = Arc::from("b");
        let t0 = Instant::now();
        for _ in 0..3 {
            limit.take_at(&a, t0).unwrap();
        }
        let wait = limit.take_at(&a, t0).unwrap_err();
        assert!(wait <= Duration::from_millis(100) && wait > Duration::ZERO);
        // Another tenant is unaffected.
        limit.take_at(&b, t0).unwrap();
        // 100 ms later one token is back, not more.
        let t1 = t0 + Duration::from_millis(100);
        limit.take_at(&a, t1).unwrap();
        assert!(limit.take_at(&a, t1).is_err());
        assert_eq!(limit.check(&a).unwrap_err().code(), Code::ResourceExhausted);
    }
}
