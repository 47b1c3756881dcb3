//! # gpupool-tools
//!
//! What is built on the allocator library ([`gpupool`]) rather than part of
//! it: the `gpupool` command line, and the modules behind its commands. A
//! program that embeds the allocator links none of this.
//!
//! * [`demo`] and [`train`]: the data-parallel training harness `gpupool
//!   demo` runs.
//! * [`stress`]: multi-device, multi-stream stress with integrity checks.
//! * [`bench`](mod@bench): micro-benchmarks and the baselines they are measured
//!   against.
//! * [`trace`]: allocation-trace readers (PyTorch snapshots, RMM logs,
//!   lifetimes CSVs), replay through the pool, and ports of PyTorch's
//!   allocator as peers to compare with.

#![warn(missing_docs)]

pub mod bench;
pub mod demo;
pub mod stress;
pub mod trace;
pub mod train;
