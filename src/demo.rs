//! The demo workload behind `gpupool demo`: a short data-parallel training
//! loop over every device, with traffic on several streams per device.
//!
//! Each step, on every device: weights stay live; activations are
//! allocated layer by layer on a compute stream (with a few side buffers on
//! a copy stream that are `record_stream`ed onto the compute stream), then
//! freed in backward order while gradient buckets are filled; the buckets
//! are reduced across devices and checked identical. Gradient contents are
//! deterministic per step (written by device work: simulated kernels, or
//! `cuMemsetD8Async` on CUDA), so comparing them across devices after the
//! reduction proves no bucket was corrupted by a premature reuse.

use crate::backend::sim::SimBackend;
use crate::error::Result;
use crate::pool::{DevicePool, Stream};
use crate::runtime::Runtime;
use rayon::prelude::*;
use std::time::{Duration, Instant};

/// Knobs of the demo.
#[derive(Debug, Clone)]
pub struct DemoOptions {
    /// Training steps.
    pub steps: usize,
    /// Layers of the model.
    pub layers: usize,
    /// Bytes of one layer's activations at batch size 1.
    pub activation_bytes: usize,
    /// Batch size per step (cycled).
    pub batch_sizes: Vec<usize>,
    /// Bytes of one gradient bucket.
    pub bucket_bytes: usize,
}

impl Default for DemoOptions {
    fn default() -> Self {
        DemoOptions {
            steps: 6,
            layers: 12,
            activation_bytes: 256 << 10,
            batch_sizes: vec![8, 8, 16, 16, 4, 4],
            bucket_bytes: 4 << 20,
        }
    }
}

/// Per-device figures of a demo run.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DemoDevice {
    /// Device index.
    pub device: usize,
    /// Steps run.
    pub steps: usize,
    /// Steps per second on this device.
    pub steps_per_sec: f64,
    /// Peak requested bytes.
    pub peak_live_bytes: u64,
    /// Peak device memory held by the pool.
    pub peak_reserved_bytes: u64,
    /// `peak_reserved / peak_live - 1`.
    pub overhead: f64,
    /// Reserved bytes after each step.
    pub reserved_after_step: Vec<u64>,
    /// Allocations served without new device memory.
    pub allocs_from_cache: u64,
    /// Allocations in total.
    pub allocs: u64,
    /// Pending frees seen (cross-stream uses).
    pub pending_frees: u64,
    /// Host-blocking syncs made by the pool on the alloc/free path (the
    /// demo's own syncs for checking are not counted).
    pub host_syncs_on_alloc_path: u64,
}

/// The report of `gpupool demo --json`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DemoReport {
    /// Backend name.
    pub backend: String,
    /// Per-device figures.
    pub devices: Vec<DemoDevice>,
    /// Whether every device held identical gradients after each reduction.
    pub gradients_match: bool,
    /// Wall time of the run in seconds.
    pub seconds: f64,
}

fn write_gradient(
    pool: &DevicePool,
    s: &Stream,
    ptr: crate::DevicePtr,
    len: u64,
    step: usize,
) -> Result<()> {
    let be = pool.backend();
    match be.as_any().downcast_ref::<SimBackend>() {
        Some(sim) => sim.launch_write_pattern(
            pool.device(),
            s.handle(),
            ptr,
            len,
            step as u64 + 1,
            Duration::ZERO,
        ),
        None => be.enqueue_fill(pool.device(), s.handle(), ptr, len, (step % 251) as u8 + 1),
    }
}

/// One step on one device; returns the checksum of its gradient buckets
/// and the host syncs the demo itself made.
fn step(
    pool: &DevicePool,
    compute: &Stream,
    copy: &Stream,
    opts: &DemoOptions,
    step: usize,
) -> Result<(u64, u64)> {
    let batch = opts.batch_sizes[step % opts.batch_sizes.len()];
    let mut acts = Vec::with_capacity(opts.layers);
    for layer in 0..opts.layers {
        let a = pool.alloc(opts.activation_bytes * batch * (1 + layer % 3), compute)?;
        if layer % 4 == 0 {
            let side = pool.alloc(opts.activation_bytes / 4 + 4096, copy)?;
            side.record_stream(compute);
            drop(side);
        }
        acts.push(a);
    }
    let buckets: Vec<_> = (0..opts.layers.div_ceil(4))
        .map(|_| pool.alloc(opts.bucket_bytes, compute))
        .collect::<Result<_>>()?;
    while let Some(a) = acts.pop() {
        let tmp = pool.alloc(a.size() / 2 + 512, compute)?;
        drop(tmp);
        drop(a);
    }
    for b in &buckets {
        write_gradient(pool, compute, b.ptr(), b.size() as u64, step)?;
    }
    // "All-reduce": read every bucket back and fold it into a checksum.
    let be = pool.backend();
    be.sync_stream(pool.device(), compute.handle())?;
    let mut sum = 0u64;
    let mut buf = vec![0u8; opts.bucket_bytes];
    for b in &buckets {
        be.copy_to_host(pool.device(), b.ptr(), &mut buf)?;
        sum = buf.chunks(8).fold(sum, |h, c| {
            h.rotate_left(5) ^ u64::from_le_bytes(c.try_into().unwrap_or([0; 8]))
        });
    }
    // Syncs made here for checking: one stream sync and one per copy.
    Ok((sum, 1 + buckets.len() as u64))
}

/// Runs the demo on every device of `rt`.
pub fn run(rt: &Runtime, opts: &DemoOptions) -> Result<DemoReport> {
    let t0 = Instant::now();
    let results: Vec<Result<(DemoDevice, Vec<u64>)>> = rt
        .devices()
        .par_iter()
        .map(|pool| {
            let compute = pool.new_stream()?;
            let copy = pool.new_stream()?;
            let syncs0 = pool.backend().counters().host_syncs_of(pool.device());
            let mut own_syncs = 0;
            let mut sums = Vec::new();
            let mut reserved_after_step = Vec::new();
            let t = Instant::now();
            for k in 0..opts.steps {
                let (sum, syncs) = step(pool, &compute, &copy, opts, k)?;
                own_syncs += syncs;
                sums.push(sum);
                pool.harvest();
                reserved_after_step.push(pool.stats().reserved_bytes.current);
            }
            let secs = t.elapsed().as_secs_f64();
            let st = pool.stats();
            let live = st.allocated_bytes.peak.max(1);
            let host = pool.backend().counters().host_syncs_of(pool.device()) - syncs0;
            Ok((
                DemoDevice {
                    device: pool.device(),
                    steps: opts.steps,
                    steps_per_sec: opts.steps as f64 / secs.max(1e-9),
                    peak_live_bytes: st.allocated_bytes.peak,
                    peak_reserved_bytes: st.reserved_bytes.peak,
                    overhead: st.reserved_bytes.peak as f64 / live as f64 - 1.0,
                    reserved_after_step,
                    allocs_from_cache: st.num_allocs.saturating_sub(st.num_allocs_grown),
                    allocs: st.num_allocs,
                    pending_frees: st.num_pending_frees,
                    host_syncs_on_alloc_path: host.saturating_sub(own_syncs),
                },
                sums,
            ))
        })
        .collect();
    let mut devices = Vec::new();
    let mut sums = Vec::new();
    for r in results {
        let (d, s) = r?;
        devices.push(d);
        sums.push(s);
    }
    let gradients_match = sums.windows(2).all(|w| w[0] == w[1]);
    Ok(DemoReport {
        backend: rt.backend().name().to_string(),
        devices,
        gradients_match,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

impl std::fmt::Display for DemoReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "gpupool demo on {} ({} devices), {:.2} s",
            self.backend,
            self.devices.len(),
            self.seconds
        )?;
        writeln!(
            f,
            "{:>6} {:>8} {:>10} {:>14} {:>14} {:>9} {:>11} {:>8} {:>11}",
            "device",
            "steps/s",
            "allocs",
            "peak live",
            "peak reserved",
            "overhead",
            "from cache",
            "pending",
            "host syncs"
        )?;
        for d in &self.devices {
            writeln!(
                f,
                "{:>6} {:>8.1} {:>10} {:>14} {:>14} {:>8.2}% {:>11} {:>8} {:>11}",
                d.device,
                d.steps_per_sec,
                d.allocs,
                d.peak_live_bytes,
                d.peak_reserved_bytes,
                d.overhead * 100.0,
                d.allocs_from_cache,
                d.pending_frees,
                d.host_syncs_on_alloc_path
            )?;
        }
        write!(
            f,
            "gradients identical on every device: {}",
            if self.gradients_match { "yes" } else { "NO" }
        )
    }
}
