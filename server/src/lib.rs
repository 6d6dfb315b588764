//! Fence server: a durable effect ledger for AI agents' tool calls, served over gRPC.
//!
//! Where things live:
//! - [`canonical`]: canonical intent and fingerprints (what "the same call" means);
//! - [`store`]: the storage seam and its RocksDB implementation (keys, value codec);
//! - [`ledger`]: the state machine (plain Rust): classes, states, leases, the replay-or-fork
//!   decision, checkpoints/restores/forks, credentials, retention;
//! - [`service`], [`convert`], [`status`]: the thin gRPC layer and the one error mapping;
//! - [`sequencer`]: group commit of the decisions that write (one sync per drained group);
//! - [`auth`], [`quota`], [`config`], [`server`]: tenants and tokens, per-tenant rate limits,
//!   settings, wiring and shutdown;
//! - [`trace`]: W3C `traceparent` parsing and the per-RPC span that carries it;
//! - [`metrics`]: Prometheus metrics and their admin listener;
//! - `admin` (with the `rocksdb` feature): the `Admin` service, online backup and its
//!   verification;
//! - `otel` (with the `rocksdb` feature): OpenTelemetry export of the per-RPC spans.

#[cfg(feature = "rocksdb")]
pub mod admin;
pub mod auth;
pub mod canonical;
pub mod clock;
pub mod config;
pub mod convert;
pub mod ledger;
pub mod metrics;
#[cfg(feature = "rocksdb")]
pub mod otel;
pub mod quota;
pub mod sequencer;
#[cfg(feature = "rocksdb")]
pub mod server;
pub mod service;
pub mod session;
pub mod status;
pub mod store;
pub mod trace;

pub use config::Config;
#[cfg(feature = "rocksdb")]
pub use server::{ServeError, ServeOptions, serve, serve_ledger, serve_ledger_with};
