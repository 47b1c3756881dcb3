//! A data-parallel training harness over a [`Runtime`]: what `gpupool demo`
//! and `examples/data_parallel.rs` run, and what the harness tests check.
//!
//! Every device holds the same weights and gradient buckets (persistent,
//! allocated from its pool once). One step, on every device in parallel:
//!
//! 1. the buckets are zeroed on the compute stream;
//! 2. for each of `micro_batches` micro-batches: a forward pass allocates
//!    one activation per layer, sized by the step's batch, on the streams
//!    in turn (a side stream writes its activation, the compute stream
//!    waits on an event, takes it with `record_stream`, and on the
//!    simulator verifies its bytes); a backward pass frees them in reverse
//!    order while temporary gradients are written by device work
//!    (deterministic per step, micro-batch, device and bucket) and
//!    accumulated into the buckets (`u32` axpy);
//! 3. the buckets are all-reduced across devices ([`gpupool::collective`]);
//! 4. the optimizer updates the weights on the device (`w -= g`);
//! 5. the harness checks that every device holds identical buckets
//!    (optionally equal to the values the host computes), records memory
//!    figures, runs the idle-time work it is asked to ([`IdleWork`]: a
//!    compaction pass and the idle release test, at this known point,
//!    after the step's device work completed), and sleeps `idle_gap`, in
//!    which the maintenance threads see an idle pool (and do whatever idle
//!    work the pool's configuration asks of them).
//!
//! After the last step everything the harness allocated is freed, each
//! pool is settled and trimmed, and its live bytes, reserved bytes and
//! audit are compared with the start ([`DeviceReport::leaked_bytes`],
//! [`DeviceReport::reserved_after_run`], [`DeviceReport::audit`]).
//!
//! Host syncs of the pool are counted only over the alloc/free phase (2),
//! where the harness itself makes none: any there belong to the pool.
//!
//! [`TrainReport::ok`] judges only what holds in every interleaving of the
//! host threads, the simulator's stream workers and the maintenance
//! threads: gradients, weights, integrity, host syncs on the alloc path,
//! leaks, memory returned after the run and the pools' audits. Figures that
//! depend on when those threads ran (growth after a phase's second step,
//! what an idle gap gave back, steps per second) are reported, not judged.

mod kernels;
mod report;

#[cfg(feature = "cuda")]
pub use kernels::compile_harness_ptx;
pub use kernels::{for_backend as kernels_for, Kernels};
pub use report::{DeviceReport, PhaseReport, Sample, TrainReport};

use gpupool::collective::{self, AllReduce, ReduceBuf};
use gpupool::compact::{CompactOptions, MovableBlock};
use gpupool::pool::{Block, DevicePool, Stream};
use gpupool::runtime::Runtime;
use gpupool::{Error, Result};
use rayon::prelude::*;
use std::time::{Duration, Instant};

/// What the harness runs.
#[derive(Debug, Clone)]
pub struct TrainOptions {
    /// Batch size of each step; the length is the number of steps.
    pub batches: Vec<usize>,
    /// Layers of the model (activations per micro-batch).
    pub layers: usize,
    /// Bytes of one layer's activation per sample (times 1 to 3 by layer).
    pub activation_bytes: usize,
    /// Bytes at the start of each activation that its kernels write and
    /// verify (the whole activation by default). A large model's step is
    /// run at full size for the allocator while the simulated kernels
    /// touch a window of each tensor, so that the demo stays quick.
    pub activation_check_bytes: usize,
    /// Gradient buckets (and weight tensors) per device.
    pub buckets: usize,
    /// Bytes of one bucket (a multiple of 8).
    pub bucket_bytes: usize,
    /// Micro-batches accumulated into the buckets before each all-reduce.
    pub micro_batches: usize,
    /// Streams per device: one compute stream and `streams - 1` side
    /// streams (at least 1).
    pub streams: usize,
    /// Host sleep after each step, for the maintenance threads' idle work.
    pub idle_gap: Duration,
    /// Also compare every bucket with the sums the host computes.
    pub verify: bool,
    /// Idle-time work the harness runs itself after each step (`None`:
    /// only what the maintenance threads do in the idle gap).
    pub idle_work: Option<IdleWork>,
    /// Mark each step on every pool ([`DevicePool::mark_step`]), so that
    /// steps that repeat the one before are served from its plan.
    pub learn_steps: bool,
}

/// Idle-time work the harness runs on every device after each step, at a
/// known point: once the step's device work has completed and the pool is
/// settled (every pending free harvested), before the idle gap. Unlike the
/// maintenance threads' idle clocks, this does not depend on when any
/// thread happened to run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IdleWork {
    /// Run one bounded compaction pass (the pool's configured bounds) and
    /// wait for it.
    pub compact: bool,
    /// The idle release test of the maintenance threads, applied to the
    /// step just run: give back the cached memory above this multiple of
    /// the step's peak of active bytes
    /// ([`DevicePool::release_cache_above`]; `None`: no release).
    pub release_fraction: Option<f64>,
}

impl Default for TrainOptions {
    fn default() -> Self {
        TrainOptions {
            batches: vec![32; 6],
            layers: 8,
            activation_bytes: 16 << 10,
            activation_check_bytes: usize::MAX,
            buckets: 4,
            bucket_bytes: 256 << 10,
            micro_batches: 2,
            streams: 3,
            idle_gap: Duration::from_millis(30),
            verify: true,
            idle_work: None,
            learn_steps: true,
        }
    }
}

impl TrainOptions {
    /// Batch sizes from `(batch, steps)` phases, e.g. `[(32, 3), (64, 3),
    /// (16, 3)]`.
    pub fn schedule(phases: &[(usize, usize)]) -> Vec<usize> {
        phases
            .iter()
            .flat_map(|&(b, n)| std::iter::repeat_n(b, n))
            .collect()
    }

    fn check(&self) -> Result<()> {
        let bad = |m: &str| Err(Error::InvalidArgument(format!("training options: {m}")));
        if self.batches.is_empty() || self.batches.contains(&0) {
            return bad("at least one step, every batch size positive");
        }
        if self.layers == 0 || self.activation_bytes == 0 || self.buckets == 0 {
            return bad("layers, activation_bytes and buckets must be positive");
        }
        if self.bucket_bytes == 0 || self.bucket_bytes % 8 != 0 {
            return bad("bucket_bytes must be a positive multiple of 8");
        }
        if self.micro_batches == 0 || self.streams == 0 {
            return bad("micro_batches and streams must be positive");
        }
        if let Some(f) = self.idle_work.and_then(|w| w.release_fraction) {
            if !(f.is_finite() && f >= 0.0) {
                return bad("the idle release fraction must be finite and not negative");
            }
        }
        Ok(())
    }

    /// Bytes of layer `l`'s activation at `batch`.
    fn activation(&self, l: usize, batch: usize) -> usize {
        self.activation_bytes * batch * (1 + l % 3)
    }
}

/// The gradient seed of one (step, micro-batch, device, bucket).
pub fn gradient_seed(step: usize, micro: usize, dev: usize, bucket: usize) -> u64 {
    let mut z = (step as u64) << 40 ^ (micro as u64) << 24 ^ (dev as u64) << 12 ^ bucket as u64;
    z = z.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z ^ (z >> 29) ^ 0x5EED
}

/// Adds the `u32` words of the pattern of `seed` into `acc`.
fn add_pattern(acc: &mut [u32], seed: u64, scratch: &mut [u8]) {
    gpupool::backend::sim::fill_pattern(scratch, seed);
    for (a, w) in acc.iter_mut().zip(scratch.chunks_exact(4)) {
        *a = a.wrapping_add(u32::from_le_bytes([w[0], w[1], w[2], w[3]]));
    }
}

/// One device's persistent state.
struct Device<'a> {
    pool: &'a DevicePool,
    streams: &'a [Stream],
    weights: Vec<Block<'a>>,
    buckets: Vec<Block<'a>>,
    /// Small per-layer checkpoints kept from the previous step (movable
    /// blocks, with their pattern seeds): half of each step's survive it,
    /// interleaved with freed ones, so the idle gap has fragmented memory
    /// to compact. Each is verified before it is freed.
    checkpoints: Vec<(MovableBlock<'a>, u64)>,
    /// Side streams' events, for the compute stream to wait on.
    events: Vec<gpupool::EventHandle>,
    report: DeviceReport,
    t0: Instant,
}

impl<'a> Device<'a> {
    fn new(
        pool: &'a DevicePool,
        streams: &'a [Stream],
        o: &TrainOptions,
        t0: Instant,
    ) -> Result<Self> {
        let c = &streams[0];
        let be = pool.backend();
        let mut weights = Vec::new();
        let mut buckets = Vec::new();
        for _ in 0..o.buckets {
            weights.push(pool.alloc(o.bucket_bytes, c)?);
            buckets.push(pool.alloc(o.bucket_bytes, c)?);
        }
        let events = streams[1..]
            .iter()
            .map(|_| be.create_event(pool.device()))
            .collect::<Result<_>>()?;
        Ok(Device {
            pool,
            streams,
            weights,
            buckets,
            checkpoints: Vec::new(),
            events,
            report: DeviceReport::new(pool.device()),
            t0,
        })
    }

    fn sample(&mut self) {
        let s = self.pool.stats();
        self.report.samples.push(Sample {
            t_ms: self.t0.elapsed().as_secs_f64() * 1e3,
            live_bytes: s.requested_bytes.current,
            reserved_bytes: s.reserved_bytes.current,
        });
    }

    /// Phase 2 of a step (see the module docs): allocations and frees.
    fn forward_backward(&mut self, k: &dyn Kernels, o: &TrainOptions, step: usize) -> Result<()> {
        let (pool, dev) = (self.pool, self.pool.device());
        let be = pool.backend().clone();
        let c = &self.streams[0];
        let sim = be
            .as_any()
            .downcast_ref::<gpupool::backend::sim::SimBackend>();
        let batch = o.batches[step];
        for b in &self.buckets {
            be.enqueue_fill(dev, c.handle(), b.ptr(), o.bucket_bytes as u64, 0)?;
        }
        for micro in 0..o.micro_batches {
            let mut acts: Vec<Block<'_>> = Vec::with_capacity(o.layers);
            for l in 0..o.layers {
                let si = l % self.streams.len();
                let s = &self.streams[si];
                let a = pool.alloc(o.activation(l, batch), s)?;
                let len = (a.size().min(o.activation_check_bytes) as u64) & !7;
                let seed = gradient_seed(step, micro, dev, 1000 + l);
                k.pattern(dev, s.handle(), a.ptr(), len, seed)?;
                if si > 0 {
                    // The compute stream consumes the side stream's output.
                    let ev = self.events[si - 1];
                    be.record_event(dev, ev, s.handle())?;
                    be.stream_wait_event(dev, c.handle(), ev)?;
                    a.record_stream(c);
                    if let Some(sim) = sim {
                        let r = sim.launch_verify_pattern(
                            dev,
                            c.handle(),
                            a.ptr(),
                            len,
                            seed,
                            Duration::ZERO,
                        )?;
                        self.report.verifies.push(r);
                    }
                }
                acts.push(a);
                self.checkpoint(k, o, step, micro * o.layers + l, batch)?;
            }
            self.sample();
            let per_bucket = o.layers.div_ceil(o.buckets).max(1);
            let mut next_bucket = o.buckets;
            while let Some(a) = acts.pop() {
                let l = acts.len();
                drop(a);
                // Buckets fill from the last layers back, as in DDP.
                while next_bucket > 0 && l <= (next_bucket - 1) * per_bucket {
                    next_bucket -= 1;
                    let i = next_bucket;
                    let tmp = pool.alloc(o.bucket_bytes, c)?;
                    let seed = gradient_seed(step, micro, dev, i);
                    k.pattern(dev, c.handle(), tmp.ptr(), o.bucket_bytes as u64, seed)?;
                    let dst = self.buckets[i].ptr();
                    k.axpy(dev, c.handle(), dst, tmp.ptr(), o.bucket_bytes as u64, 1)?;
                }
            }
            self.sample();
        }
        Ok(())
    }

    /// A small movable checkpoint number `l` of a step (one per layer and
    /// micro-batch; an eighth of the layer's activation, at most 256 KiB),
    /// written through a pin on the compute stream. The previous step's
    /// checkpoint `l` is verified (through a pin: at whatever address
    /// compaction left it) and freed; the new one is kept only for odd
    /// `l`, so each step leaves a half-used arena behind.
    fn checkpoint(
        &mut self,
        k: &dyn Kernels,
        o: &TrainOptions,
        step: usize,
        l: usize,
        batch: usize,
    ) -> Result<()> {
        let (pool, dev, c) = (self.pool, self.pool.device(), &self.streams[0]);
        if let Some(i) = self
            .checkpoints
            .iter()
            .position(|(_, seed)| *seed >> 32 == l as u64)
        {
            let (old, seed) = self.checkpoints.swap_remove(i);
            self.verify_movable(&old, seed)?;
        }
        let bytes = (o.activation(l % o.layers, batch) / 16).clamp(256, 256 << 10);
        let m = pool.alloc_movable(bytes, c)?;
        let seed = (l as u64) << 32 | gradient_seed(step, 0, dev, 2000 + l) & 0xFFFF_FFFF;
        {
            let p = m.pin(c);
            k.pattern(dev, c.handle(), p.ptr(), (bytes as u64) & !7, seed)?;
        }
        if l % 2 == 1 {
            self.checkpoints.push((m, seed));
        } else {
            self.verify_movable(&m, seed)?;
        }
        Ok(())
    }

    /// Checks a checkpoint's pattern on the compute stream (simulator only:
    /// its kernels can verify), through a pin.
    fn verify_movable(&mut self, m: &MovableBlock<'a>, seed: u64) -> Result<()> {
        let be = self.pool.backend();
        if let Some(sim) = be
            .as_any()
            .downcast_ref::<gpupool::backend::sim::SimBackend>()
        {
            let c = &self.streams[0];
            let p = m.pin(c);
            let len = (m.size() as u64) & !7;
            let r = sim.launch_verify_pattern(
                self.pool.device(),
                c.handle(),
                p.ptr(),
                len,
                seed,
                Duration::ZERO,
            )?;
            self.report.verifies.push(r);
        }
        Ok(())
    }

    /// The idle-time work of [`IdleWork`], after a step whose device work
    /// has completed: settle (harvest every pending free; the host waits
    /// here, outside the alloc/free phase), a compaction pass, then the
    /// idle release test against the step's peak of active bytes.
    fn idle_work(&mut self, w: &IdleWork) -> Result<()> {
        let pool = self.pool;
        pool.settle()?;
        if w.compact {
            // The pass keeps what it empties cached: whether memory goes
            // back to the device is the idle release test's call below, so
            // a training loop does not give back each step what the next
            // step takes again.
            pool.compact(CompactOptions {
                release: false,
                ..CompactOptions::from_config(pool.config())
            })?;
        }
        let step_peak = pool.take_window_peak();
        if let Some(fraction) = w.release_fraction {
            let cached = pool.stats().cached_bytes.current;
            let keep = fraction * step_peak as f64;
            if cached as f64 > keep {
                let freed = pool.release_cache_above(keep as u64);
                if freed > 0 {
                    self.report.idle_releases += 1;
                    self.report.idle_released_bytes += freed;
                }
            }
        }
        Ok(())
    }

    /// Phase 4: `w -= g` on the device.
    fn optimizer(&self, k: &dyn Kernels, o: &TrainOptions) -> Result<()> {
        let (dev, c) = (self.pool.device(), self.streams[0].handle());
        for (w, g) in self.weights.iter().zip(&self.buckets) {
            k.axpy(dev, c, w.ptr(), g.ptr(), o.bucket_bytes as u64, u32::MAX)?;
        }
        Ok(())
    }

    /// The buckets' bytes, after the compute stream's work (host sync,
    /// counted as the harness's own).
    fn read(&self, bufs: &[Block<'_>], o: &TrainOptions) -> Result<Vec<u8>> {
        let be = self.pool.backend();
        let dev = self.pool.device();
        be.sync_stream(dev, self.streams[0].handle())?;
        let mut out = vec![0u8; bufs.len() * o.bucket_bytes];
        for (b, chunk) in bufs.iter().zip(out.chunks_mut(o.bucket_bytes)) {
            be.copy_to_host(dev, b.ptr(), chunk)?;
        }
        Ok(out)
    }
}

impl Drop for Device<'_> {
    fn drop(&mut self) {
        for &e in &self.events {
            let _ = self.pool.backend().destroy_event(self.pool.device(), e);
        }
    }
}

/// The sums every bucket must hold after step `step`'s all-reduce.
fn expected_buckets(o: &TrainOptions, step: usize, devices: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(o.buckets * o.bucket_bytes);
    let mut scratch = vec![0u8; o.bucket_bytes];
    for i in 0..o.buckets {
        let mut acc = vec![0u32; o.bucket_bytes / 4];
        for dev in 0..devices {
            for m in 0..o.micro_batches {
                add_pattern(&mut acc, gradient_seed(step, m, dev, i), &mut scratch);
            }
        }
        out.extend(acc.iter().flat_map(|w| w.to_le_bytes()));
    }
    out
}

/// Runs the harness on every device of `rt`.
pub fn run(rt: &Runtime, o: &TrainOptions) -> Result<TrainReport> {
    o.check()?;
    let kernels = kernels::for_backend(rt.backend())?;
    let coll = collective::for_runtime(rt)?;
    run_with(rt, o, &*kernels, &*coll)
}

/// [`run`] with given kernels and collective.
pub fn run_with(
    rt: &Runtime,
    o: &TrainOptions,
    k: &dyn Kernels,
    coll: &dyn AllReduce,
) -> Result<TrainReport> {
    o.check()?;
    let t0 = Instant::now();
    // What the pools held before the run: after it, once everything the
    // harness allocated is freed and each pool trimmed, they must hold no
    // more.
    let before: Vec<(u64, u64)> = rt
        .devices()
        .iter()
        .map(|p| {
            let st = p.stats();
            (st.requested_bytes.current, st.reserved_bytes.current)
        })
        .collect();
    let streams: Vec<Vec<Stream>> = rt
        .devices()
        .iter()
        .map(|p| (0..o.streams).map(|_| p.new_stream()).collect())
        .collect::<Result<_>>()?;
    let mut devs: Vec<Device<'_>> = rt
        .devices()
        .iter()
        .zip(&streams)
        .map(|(p, s)| Device::new(p, s, o, t0))
        .collect::<Result<_>>()?;
    for d in &devs {
        let dev = d.pool.device();
        for w in &d.weights {
            k.pattern(
                dev,
                d.streams[0].handle(),
                w.ptr(),
                o.bucket_bytes as u64,
                0x3E1,
            )?;
        }
        for b in &d.buckets {
            coll.register(dev, b.ptr(), o.bucket_bytes as u64)?;
        }
    }
    let mut gradients_match = true;
    let mut gradients_expected = o.verify.then_some(true);
    let memory_calls = || {
        let c = rt.backend().counters();
        gpupool::backend::Call::MEMORY
            .iter()
            .map(|&k| c.get(k))
            .sum::<u64>()
    };
    let mut memory_calls_by_step = Vec::with_capacity(o.batches.len());
    for step in 0..o.batches.len() {
        let ts = Instant::now();
        let calls0 = memory_calls();
        devs.par_iter_mut().try_for_each(|d| {
            if o.learn_steps {
                d.pool.mark_step()?;
            }
            let counters = || d.pool.backend().counters().host_syncs_of(d.pool.device());
            let before = counters();
            d.sample();
            let r = d.forward_backward(k, o, step);
            d.report.host_syncs_on_alloc_path += counters() - before;
            // Slots this worker thread cached go back to the pool, so that
            // nothing stays in a thread's magazine between steps (and the
            // trim after the run sees every free slot).
            d.pool.flush_thread_cache();
            r
        })?;
        for i in 0..o.buckets {
            let bufs: Vec<ReduceBuf> = devs
                .iter()
                .map(|d| ReduceBuf {
                    device: d.pool.device(),
                    stream: d.streams[0].handle(),
                    ptr: d.buckets[i].ptr(),
                    bytes: o.bucket_bytes as u64,
                })
                .collect();
            coll.all_reduce(&bufs)?;
        }
        let grads: Vec<Vec<u8>> = devs
            .par_iter()
            .map(|d| d.read(&d.buckets, o))
            .collect::<Result<_>>()?;
        devs.par_iter().try_for_each(|d| d.optimizer(k, o))?;
        let same = grads.windows(2).all(|w| w[0] == w[1]);
        gradients_match &= same;
        if o.verify {
            let want = expected_buckets(o, step, devs.len());
            let ok = grads.iter().all(|g| *g == want);
            gradients_expected = Some(gradients_expected.unwrap_or(true) && ok);
        }
        let secs = ts.elapsed().as_secs_f64();
        for d in &mut devs {
            d.report.step_seconds.push(secs);
            d.report
                .reserved_after_step
                .push(d.pool.stats().reserved_bytes.current);
            d.sample();
        }
        if let Some(w) = &o.idle_work {
            for d in &mut devs {
                d.idle_work(w)?;
                d.sample();
            }
        }
        if !o.idle_gap.is_zero() {
            std::thread::sleep(o.idle_gap);
        }
        memory_calls_by_step.push(memory_calls() - calls0);
        for d in &mut devs {
            d.report
                .reserved_after_idle
                .push(d.pool.stats().reserved_bytes.current);
            d.sample();
        }
    }
    let weights: Vec<Vec<u8>> = devs
        .iter()
        .map(|d| d.read(&d.weights, o))
        .collect::<Result<_>>()?;
    let weights_match = weights.windows(2).all(|w| w[0] == w[1]);
    // The buckets are freed below: end their registrations first.
    coll.deregister_all();
    let maint = rt.maintenance_stats();
    let mut devices: Vec<DeviceReport> = devs
        .into_iter()
        .map(|mut d| {
            let st = d.pool.stats();
            let m = maint.iter().find(|m| m.device == d.pool.device()).cloned();
            let dev = d.pool.device();
            let report = std::mem::replace(&mut d.report, DeviceReport::new(dev));
            let ct = d.pool.compact_totals();
            let mut r = report.finish(o, &st, m);
            r.compaction_passes = ct.passes;
            r.compaction_bytes_moved = ct.bytes_moved;
            r.plan = d.pool.plan_stats();
            drop(d);
            r.integrity_errors = r.verifies.iter().map(|v| v.wait()).sum();
            r.verifies.clear();
            r
        })
        .collect();
    // Everything is freed: settle and trim each pool (the streams are
    // still alive), then compare with the start.
    for (r, (p, &(live0, reserved0))) in devices.iter_mut().zip(rt.devices().iter().zip(&before)) {
        p.flush_thread_cache();
        p.settle()?;
        p.trim()?;
        let st = p.stats();
        r.reserved_before_run = reserved0;
        r.reserved_after_run = st.reserved_bytes.current;
        r.leaked_bytes = st.requested_bytes.current.saturating_sub(live0);
        r.audit = p.audit().err();
    }
    drop(streams);
    let mut report = TrainReport::new(
        rt,
        o,
        coll.name(),
        devices,
        gradients_match,
        gradients_expected,
        weights_match,
        t0.elapsed().as_secs_f64(),
    );
    report.memory_calls_by_step = memory_calls_by_step;
    Ok(report)
}
