//! The stress run behind `gpupool stress`: every simulated device driven by
//! several threads on several streams, with integrity checks.
//!
//! Each device gets `streams` streams and `threads` threads; thread `t`
//! allocates on the streams `i` with `i % threads == t` (on stream
//! `t % streams` when there are fewer streams than threads). A block may be
//! used on any other stream of the device (ordered by an event and
//! `record_stream`ed), and some raw blocks are freed from another stream.
//! With `verify`, a delayed simulated kernel writes a pattern unique to
//! the block after each allocation and another checks it right before the
//! free; frees are stream-ordered, so a block handed to new work before its
//! queued kernels ran shows up as wrong bytes (or as a fault on unmapped
//! memory). The workloads are in [`workload`].
//!
//! Measured: the latency of every successful alloc and free call
//! (histograms), host-blocking syncs counted by the backend during the
//! traffic (the harness makes none, so any is the pool's), leaks (live
//! bytes left after every block is freed, reserved bytes left after trim),
//! pool audits, peak RSS, and reserved/live bytes sampled over time.
//!
//! With `verify`, large-path latencies also include waits on the
//! simulator's per-device memory lock: creating, mapping or unmapping a
//! chunk takes it exclusively, and simulated kernels hold it shared for
//! their whole pass over a block (milliseconds for the large ones). That is
//! a cost of the simulator, not a host sync; runs without `verify` show the
//! pool's own cost.

mod peer;
pub mod report;
mod serving;
mod training;
mod worker;
pub mod workload;

pub use peer::{NoAllocator, StressPeer};
pub use report::{DeviceStress, MemorySample, PeerStress, StressReport};
pub use workload::Workload;

use crate::bench::torch_peer::TorchPeer;
use crate::trace::peers::{DriverCalls, TorchConfig};
use gpupool::backend::sim::SimBackend;
use gpupool::backend::Backend;
use gpupool::config::{BackendKind, PoolConfig, SimConfig};
use gpupool::pool::Stream;
use gpupool::runtime::Runtime;
use gpupool::{Error, Result};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::{Duration, Instant};
use worker::{DeviceShared, Mix, ThreadTotals, Worker};
use workload::{ServingShape, TrainingSizes};

/// What to run.
#[derive(Debug, Clone)]
pub struct StressOptions {
    /// Simulated devices.
    pub devices: usize,
    /// Streams per device.
    pub streams: usize,
    /// Threads per device.
    pub threads: usize,
    /// How long the traffic runs.
    pub duration: Duration,
    /// Write and verify a pattern in every block with simulated kernels.
    pub verify: bool,
    /// The traffic.
    pub workload: Workload,
    /// Seed of every thread's generator.
    pub seed: u64,
    /// Memory of each simulated device (backed by host memory: keep
    /// devices x capacity within reach of the host).
    pub capacity_bytes: u64,
    /// Interval of the memory series.
    pub sample_every: Duration,
    /// Percent of blocks allocated raw (the C ABI's path).
    pub raw_percent: u64,
    /// Percent of blocks also used on another stream.
    pub cross_percent: u64,
    /// Percent of raw blocks freed from another stream.
    pub cross_free_percent: u64,
    /// Percent of allocations followed by a simulated kernel of
    /// `kernel_time` on their stream (time only, no bytes touched): the
    /// streams are busy part of the time, as a server's are, where with
    /// none every stream is idle whenever the pool asks.
    pub kernel_percent: u64,
    /// How long each of those kernels runs.
    pub kernel_time: Duration,
    /// Pool configuration (`GPUPOOL_CONF`); its backend is ignored.
    pub config: PoolConfig,
    /// Then run the same traffic through the PyTorch port, in its default
    /// and its `expandable_segments` mode, each for `duration`
    /// ([`PeerStress`]).
    pub peers: bool,
    /// The simulator spends each driver call's modeled time
    /// (`config.driver_costs`) on the calling thread, and so does the
    /// PyTorch port under its locks, instead of only counting it: calls
    /// made under a lock then stall the threads behind it as on a GPU.
    pub spend_driver_time: bool,
    /// Negative control for tests: cross-stream frees skip the event that
    /// orders them after the block's own stream (API misuse), so the
    /// verification must report corrupted bytes.
    #[doc(hidden)]
    pub misuse_unordered_frees: bool,
}

impl Default for StressOptions {
    fn default() -> Self {
        StressOptions {
            devices: 4,
            streams: 4,
            threads: 2,
            duration: Duration::from_secs(10),
            verify: false,
            workload: Workload::Training,
            seed: 1,
            capacity_bytes: 1 << 30,
            sample_every: Duration::from_secs(1),
            raw_percent: 25,
            cross_percent: 30,
            cross_free_percent: 30,
            kernel_percent: 0,
            kernel_time: Duration::from_micros(20),
            config: PoolConfig::default(),
            peers: false,
            spend_driver_time: false,
            misuse_unordered_frees: false,
        }
    }
}

impl StressOptions {
    fn validate(&self) -> Result<()> {
        let bad = |what: &str| Err(Error::InvalidArgument(format!("stress: {what}")));
        if self.devices == 0 || self.streams == 0 || self.threads == 0 {
            return bad("devices, streams and threads must be at least 1");
        }
        if self.duration.is_zero() || self.sample_every.is_zero() {
            return bad("duration and sample interval must be positive");
        }
        if self.capacity_bytes < 64 << 20 {
            return bad("capacity must be at least 64 MiB");
        }
        if [
            self.raw_percent,
            self.cross_percent,
            self.cross_free_percent,
            self.kernel_percent,
        ]
        .iter()
        .any(|&p| p > 100)
        {
            return bad("percentages must be at most 100");
        }
        Ok(())
    }

    /// This thread's own streams.
    fn home(&self, t: usize) -> Vec<usize> {
        let own: Vec<usize> = (0..self.streams)
            .filter(|i| i % self.threads == t)
            .collect();
        if own.is_empty() {
            vec![t % self.streams]
        } else {
            own
        }
    }
}

/// Where a run stands, passed to the progress callback about ten times a
/// second.
#[derive(Debug, Clone, Copy)]
pub struct Progress {
    /// Time since the traffic started.
    pub elapsed: Duration,
    /// Planned duration.
    pub duration: Duration,
    /// Allocs plus frees so far (published every few hundred per thread).
    pub ops: u64,
    /// Device memory held by all pools now.
    pub reserved_bytes: u64,
    /// Bytes verify kernels found wrong so far.
    pub integrity_errors: u64,
}

/// The cost table the simulator and the PyTorch port spend, if asked
/// (`spend_driver_time`, or `driver_time=spent` in the configuration).
fn driver_time(opts: &StressOptions) -> Option<std::sync::Arc<gpupool::backend::CostTable>> {
    opts.spend_driver_time
        .then(|| std::sync::Arc::new(opts.config.driver_costs.clone()))
        .or_else(|| opts.config.sim.driver_time.clone())
}

/// Runs the stress described by `opts`; `progress` is called from this
/// thread while the traffic runs.
pub fn run(opts: &StressOptions, mut progress: impl FnMut(&Progress)) -> Result<StressReport> {
    opts.validate()?;
    let rt = Runtime::builder()
        .backend(BackendKind::Sim(SimConfig {
            devices: opts.devices,
            capacity_bytes: opts.capacity_bytes,
            driver_time: driver_time(opts),
            ..Default::default()
        }))
        .config(opts.config.clone())
        .build()?;
    let sim = rt
        .backend()
        .as_any()
        .downcast_ref::<SimBackend>()
        .ok_or_else(|| Error::InvalidArgument("stress needs the simulator".into()))?;
    let streams: Vec<Vec<Stream>> = rt
        .devices()
        .iter()
        .map(|d| (0..opts.streams).map(|_| d.new_stream()).collect())
        .collect::<Result<_>>()?;
    let shared: Vec<DeviceShared> = (0..opts.devices).map(|_| DeviceShared::default()).collect();
    let stop = AtomicBool::new(false);
    let syncs_before = rt.backend().counters();
    let start = Instant::now();
    let mut series = Vec::new();
    let per_thread: Vec<Vec<Result<ThreadTotals>>> = std::thread::scope(|sc| {
        let mut handles: Vec<Vec<_>> = Vec::new();
        for (d, dev) in rt.devices().into_iter().enumerate() {
            let mut row = Vec::new();
            for t in 0..opts.threads {
                let (all, shared, stop) = (&streams[d][..], &shared[d], &stop);
                let id = (d * opts.threads + t) as u64;
                row.push(sc.spawn(move || {
                    let r = thread_main(opts, dev, sim, all, t, id, shared, stop, None);
                    if r.is_err() {
                        stop.store(true, Relaxed);
                    }
                    r
                }));
            }
            handles.push(row);
        }
        watch(
            &rt,
            sim,
            opts,
            &shared,
            &stop,
            start,
            &mut series,
            &mut progress,
        );
        stop.store(true, Relaxed);
        handles
            .into_iter()
            .map(|row| {
                row.into_iter()
                    .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
                    .collect()
            })
            .collect()
    });
    let seconds = start.elapsed().as_secs_f64();
    let syncs_after = rt.backend().counters();
    let totals = per_thread
        .into_iter()
        .map(|row| row.into_iter().collect::<Result<Vec<_>>>())
        .collect::<Result<Vec<_>>>()?;
    // The harness's own syncs start here: every stream runs dry.
    for (d, dev) in rt.devices().into_iter().enumerate() {
        for s in &streams[d] {
            sim.sync_stream(d, s.handle())?;
        }
        sim.sync_stream(d, dev.default_stream().handle())?;
    }
    let mut peers = Vec::new();
    if opts.peers {
        for (name, expandable_segments) in [("torch", false), ("torch_expandable", true)] {
            let cfg = TorchConfig {
                expandable_segments,
                capacity_bytes: opts.capacity_bytes,
                driver_time: driver_time(opts),
                ..TorchConfig::default()
            };
            let port = TorchPeer::with_events(opts.devices, cfg, rt.backend());
            peers.push(run_peer(
                opts,
                &rt,
                sim,
                &streams,
                &peer::Torch { name, port: &port },
            )?);
        }
        peers.push(run_peer(opts, &rt, sim, &streams, &NoAllocator)?);
    }
    drop(streams);
    let counts = Counts {
        false_ooms: shared.iter().map(|s| s.false_ooms.load(Relaxed)).collect(),
        syncs_before: &syncs_before,
        syncs_after: &syncs_after,
        seconds,
    };
    let mut r = build_report(&rt, sim, opts, totals, counts, series)?;
    let ceiling = peers
        .iter()
        .find(|p| p.name == NoAllocator.name())
        .map(|p| p.ops_per_sec);
    if let Some(ceiling) = ceiling {
        let threads = (opts.threads * opts.devices) as f64;
        let own = |ops_per_sec: f64| threads * 1e9 * (1.0 / ops_per_sec - 1.0 / ceiling);
        r.allocator_ns_per_op = Some(own(r.ops_per_sec));
        for p in &mut peers {
            p.allocator_ns_per_op = Some(own(p.ops_per_sec));
        }
    }
    r.peers = peers;
    Ok(r)
}

/// The same traffic through `peer` (see [`PeerStress`]), on the streams
/// of the pool run (the harness's own events go there).
fn run_peer(
    opts: &StressOptions,
    rt: &Runtime,
    sim: &SimBackend,
    streams: &[Vec<Stream>],
    peer: &dyn StressPeer,
) -> Result<PeerStress> {
    let shared: Vec<DeviceShared> = (0..opts.devices).map(|_| DeviceShared::default()).collect();
    let stop = AtomicBool::new(false);
    let start = Instant::now();
    let per_thread: Vec<Result<ThreadTotals>> = std::thread::scope(|sc| {
        let mut handles = Vec::new();
        for (d, dev) in rt.devices().into_iter().enumerate() {
            for t in 0..opts.threads {
                let (all, shared, stop) = (&streams[d][..], &shared[d], &stop);
                let id = (d * opts.threads + t) as u64;
                handles.push(sc.spawn(move || {
                    let r = thread_main(opts, dev, sim, all, t, id, shared, stop, Some(peer));
                    if r.is_err() {
                        stop.store(true, Relaxed);
                    }
                    r
                }));
            }
        }
        while start.elapsed() < opts.duration && !stop.load(Relaxed) {
            std::thread::sleep(Duration::from_millis(20).min(opts.duration));
        }
        stop.store(true, Relaxed);
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    });
    let seconds = start.elapsed().as_secs_f64();
    let totals = per_thread.into_iter().collect::<Result<Vec<_>>>()?;
    let mut alloc_ns = worker::new_histogram();
    let mut p = PeerStress {
        name: peer.name(),
        seconds,
        ..Default::default()
    };
    for t in &totals {
        alloc_ns.add(&t.alloc_ns).map_err(hist_err)?;
        p.ops += t.allocs + t.frees;
        p.ooms += t.ooms;
    }
    let mut calls = DriverCalls::new();
    let mut bytes = DriverCalls::new();
    for (d, sh) in shared.iter().enumerate() {
        p.peak_live_bytes += sh.peak_live.load(Relaxed);
        p.false_ooms += sh.false_ooms.load(Relaxed);
        p.peak_reserved_bytes += peer.peak_reserved_bytes(d)?;
        for (k, v) in peer.driver_calls(d)? {
            *calls.entry(k).or_default() += v;
        }
        for (k, v) in peer.driver_bytes(d)? {
            *bytes.entry(k).or_default() += v;
        }
    }
    // As in the replays: `cuMemSetAccess` covers one page per map.
    if let Some(&maps) = calls.get(gpupool::backend::Call::Map.name()) {
        bytes.insert(gpupool::backend::Call::SetAccess.name(), maps);
    }
    p.driver_ms = rt.config().driver_costs.millis_of(&calls, Some(&bytes))?;
    p.driver_calls = calls.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
    p.ops_per_sec = p.ops as f64 / seconds.max(1e-9);
    p.device_locks_per_op = peer.device_locks() as f64 / p.ops.max(1) as f64;
    p.p50_ns = alloc_ns.value_at_quantile(0.50);
    p.p99_ns = alloc_ns.value_at_quantile(0.99);
    p.p999_ns = alloc_ns.value_at_quantile(0.999);
    Ok(p)
}

/// Samples memory and reports progress until the duration is over or a
/// thread failed; also runs each pool's maintenance step, as the
/// runtime's maintenance threads would.
#[allow(clippy::too_many_arguments)]
fn watch(
    rt: &Runtime,
    sim: &SimBackend,
    opts: &StressOptions,
    shared: &[DeviceShared],
    stop: &AtomicBool,
    start: Instant,
    series: &mut Vec<MemorySample>,
    progress: &mut impl FnMut(&Progress),
) {
    let tick = Duration::from_millis(100).min(opts.sample_every);
    let mut next_sample = Duration::ZERO;
    loop {
        let elapsed = start.elapsed();
        if elapsed >= opts.duration || stop.load(Relaxed) {
            break;
        }
        let mut m = MemorySample {
            t_secs: elapsed.as_secs_f64(),
            ..Default::default()
        };
        for dev in rt.devices() {
            dev.maintain();
            let st = dev.stats();
            m.reserved_bytes += st.reserved_bytes.current;
            m.live_bytes += st.requested_bytes.current;
            m.cached_bytes += st.cached_bytes.current;
            m.pending_bytes += st.pending_bytes.current;
        }
        if elapsed >= next_sample {
            series.push(m);
            next_sample += opts.sample_every;
        }
        progress(&Progress {
            elapsed,
            duration: opts.duration,
            ops: shared.iter().map(|s| s.ops.load(Relaxed)).sum(),
            reserved_bytes: m.reserved_bytes,
            integrity_errors: (0..opts.devices).map(|d| sim.integrity_errors(d)).sum(),
        });
        std::thread::sleep(tick.min(opts.duration.saturating_sub(start.elapsed())));
    }
}

#[allow(clippy::too_many_arguments)]
fn thread_main(
    opts: &StressOptions,
    dev: &gpupool::pool::DevicePool,
    sim: &SimBackend,
    streams: &[Stream],
    t: usize,
    id: u64,
    shared: &DeviceShared,
    stop: &AtomicBool,
    peer: Option<&dyn StressPeer>,
) -> Result<ThreadTotals> {
    let mix = Mix {
        raw_percent: opts.raw_percent,
        cross_percent: opts.cross_percent,
        cross_free_percent: opts.cross_free_percent,
        kernel_percent: opts.kernel_percent,
        kernel_time: opts.kernel_time,
        unordered_frees: opts.misuse_unordered_frees,
    };
    let mut w = Worker::new(
        dev,
        sim,
        streams,
        opts.home(t),
        opts.verify,
        mix,
        id,
        opts.seed,
        shared,
        stop,
        peer,
    )?;
    let r = match opts.workload {
        Workload::Training => {
            training::run(&mut w, TrainingSizes::for_capacity(opts.capacity_bytes))
        }
        Workload::Serving => serving::run(&mut w, ServingShape::for_capacity(opts.capacity_bytes)),
    };
    let totals = w.finish()?;
    r.map(|_| totals)
}

/// Counter snapshots around the traffic.
struct Counts<'a> {
    /// False out-of-memory errors per device.
    false_ooms: Vec<u64>,
    syncs_before: &'a gpupool::backend::BackendCounters,
    syncs_after: &'a gpupool::backend::BackendCounters,
    seconds: f64,
}

/// Peak resident set size of this process in bytes (0 if unknown).
pub fn peak_rss_bytes() -> u64 {
    // SAFETY: `getrusage` writes one `rusage` into the zeroed struct we
    // own; RUSAGE_SELF is always valid.
    let (rc, ru) = unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        (libc::getrusage(libc::RUSAGE_SELF, &mut ru), ru)
    };
    if rc != 0 {
        return 0;
    }
    // Linux reports kibibytes.
    (ru.ru_maxrss.max(0) as u64) * 1024
}

fn build_report(
    rt: &Runtime,
    sim: &SimBackend,
    opts: &StressOptions,
    totals: Vec<Vec<ThreadTotals>>,
    counts: Counts<'_>,
    memory_series: Vec<MemorySample>,
) -> Result<StressReport> {
    let mut r = StressReport {
        workload: opts.workload,
        devices: opts.devices,
        streams: opts.streams,
        threads: opts.threads,
        capacity_bytes: opts.capacity_bytes,
        verify: opts.verify,
        seed: opts.seed,
        kernel_percent: opts.kernel_percent,
        kernel_us: opts.kernel_time.as_micros() as u64,
        driver_time_spent: driver_time(opts).is_some(),
        seconds: counts.seconds,
        ..Default::default()
    };
    let driver = counts.syncs_after.since(counts.syncs_before);
    r.driver_calls = driver.nonzero_calls();
    r.driver_ms = rt.config().driver_costs.millis(&driver);
    let ordered: u64 = totals
        .iter()
        .flatten()
        .map(|t| {
            t.cross_stream_uses
                + if opts.misuse_unordered_frees {
                    0
                } else {
                    t.cross_stream_frees
                }
        })
        .sum();
    let harness: DriverCalls = [
        (gpupool::backend::Call::EventRecord.name(), ordered),
        (gpupool::backend::Call::StreamWaitEvent.name(), ordered),
    ]
    .into_iter()
    .collect();
    r.harness_driver_ms = rt.config().driver_costs.millis_of(&harness, None)?;
    let mut alloc_ns = worker::new_histogram();
    let mut small_ns = worker::new_histogram();
    let mut large_ns = worker::new_histogram();
    let mut free_ns = worker::new_histogram();
    for (d, dev) in rt.devices().into_iter().enumerate() {
        let st = dev.stats();
        let mut dr = DeviceStress {
            device: d,
            peak_live_bytes: st.requested_bytes.peak,
            peak_reserved_bytes: st.reserved_bytes.peak,
            integrity_errors: sim.integrity_errors(d),
            device_faults: sim.device_faults(d),
            pending_frees: st.num_pending_frees,
            handovers: st.num_handovers,
            harvests: st.num_harvests,
            harvest_walks: st.num_harvest_walks,
            small_slow_paths: st.num_small_slow_paths,
            large_slow_paths: st.num_large_slow_paths,
            reclaims: st.num_reclaims,
            host_syncs_on_alloc_path: (counts.syncs_after.host_syncs_of(d)
                - counts.syncs_before.host_syncs_of(d))
            .saturating_sub(st.oom_host_syncs),
            false_ooms: counts.false_ooms[d],
            oom_waits: st.num_oom_waits,
            oom_host_syncs: st.oom_host_syncs,
            audit_error: dev.audit().err(),
            ..Default::default()
        };
        for t in &totals[d] {
            alloc_ns.add(&t.alloc_ns).map_err(hist_err)?;
            small_ns.add(&t.small_alloc_ns).map_err(hist_err)?;
            large_ns.add(&t.large_alloc_ns).map_err(hist_err)?;
            free_ns.add(&t.free_ns).map_err(hist_err)?;
            dr.ops += t.allocs + t.frees;
            dr.ooms += t.ooms;
            r.allocs += t.allocs;
            r.frees += t.frees;
            r.cross_stream_uses += t.cross_stream_uses;
            r.cross_stream_frees += t.cross_stream_frees;
            r.verify_kernels += t.verify_kernels;
            r.failed_verifies += t.failed_verifies;
        }
        dr.ops_per_sec = dr.ops as f64 / counts.seconds.max(1e-9);
        dr.heap_locks_per_op = st.heap_lock_acquisitions as f64 / dr.ops.max(1) as f64;
        // Every block is freed by now: what is still live leaked.
        dr.leaked_bytes = st.requested_bytes.current;
        r.per_device.push(dr);
    }
    rt.trim()?;
    for (d, dev) in rt.devices().into_iter().enumerate() {
        let left = dev.stats().reserved_bytes.current.max(sim.used_bytes(d));
        r.per_device[d].leaked_bytes += left;
    }
    for d in &r.per_device {
        r.ops += d.ops;
        r.integrity_errors += d.integrity_errors;
        r.device_faults += d.device_faults;
        r.ooms += d.ooms;
        r.false_ooms += d.false_ooms;
        r.oom_waits += d.oom_waits;
        r.leaked_bytes += d.leaked_bytes;
        r.host_syncs_on_alloc_path += d.host_syncs_on_alloc_path;
        r.peak_live_bytes += d.peak_live_bytes;
        r.peak_reserved_bytes += d.peak_reserved_bytes;
    }
    r.ops_per_sec = r.ops as f64 / counts.seconds.max(1e-9);
    r.heap_locks_per_op = r
        .per_device
        .iter()
        .map(|d| d.heap_locks_per_op * d.ops as f64)
        .sum::<f64>()
        / r.ops.max(1) as f64;
    r.p50_ns = alloc_ns.value_at_quantile(0.50);
    r.p99_ns = alloc_ns.value_at_quantile(0.99);
    r.p999_ns = alloc_ns.value_at_quantile(0.999);
    r.max_ns = alloc_ns.max();
    r.small_p50_ns = small_ns.value_at_quantile(0.50);
    r.small_p99_ns = small_ns.value_at_quantile(0.99);
    r.large_p50_ns = large_ns.value_at_quantile(0.50);
    r.large_p99_ns = large_ns.value_at_quantile(0.99);
    r.free_p50_ns = free_ns.value_at_quantile(0.50);
    r.free_p99_ns = free_ns.value_at_quantile(0.99);
    r.peak_rss_bytes = peak_rss_bytes();
    r.reserved_flat = report::reserved_flat(&memory_series);
    r.reserved_hit_capacity = r
        .per_device
        .iter()
        .all(|d| d.peak_reserved_bytes >= opts.capacity_bytes);
    r.memory_series = memory_series;
    Ok(r)
}

fn hist_err(e: hdrhistogram::AdditionError) -> Error {
    Error::InvalidArgument(format!("latency histogram: {e:?}"))
}
