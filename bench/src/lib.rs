//! Fence benchmarks: the fault-injection benchmark (does Fence stop duplicates under real
//! faults?) and the cost benchmarks (what does a durable decision cost, next to the physical
//! floor and a Postgres peer?).
//!
//! - [`scenario`], [`world`], [`faults`]: the fault-injection benchmark (`fence-faults`);
//! - [`load`]: the load generator, the `fdatasync` floor and the Postgres peer (`fence-load`);
//! - [`fenced`]: the real `fenced` binary as a supervised child process;
//! - [`callgrind`]: its instruction counts under valgrind (`fence-load cost --callgrind`);
//! - [`rng`]: the seeded random source everything draws from.

pub mod callgrind;
pub mod faults;
pub mod fenced;
pub mod load;
pub mod rng;
pub mod scenario;
pub mod world;
