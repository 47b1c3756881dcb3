//! Micro-benchmarks run by `gpupool bench` (being written).

use crate::error::Result;

/// What to run.
#[derive(Debug, Clone, Default)]
pub struct BenchOptions {
    /// Fewer iterations (for CI smoke runs).
    pub quick: bool,
}

/// The report of `gpupool bench --json`.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct BenchReport {}

/// Runs the benchmarks.
pub fn run(_opts: &BenchOptions) -> Result<BenchReport> {
    Err(crate::Error::Unsupported("bench is being written".into()))
}
