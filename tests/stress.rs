//! Multi-thread, multi-stream stress of the pools on the simulator, with
//! data-integrity checks by simulated kernels.
//!
//! Each thread allocates blocks of a realistic size mix on its streams,
//! launches delayed kernels that write a pattern unique to the block, uses
//! some blocks on a second stream too (ordered after the first by an event,
//! and `record_stream`ed), verifies the pattern on the block's stream later
//! and frees the block while that verify may still be queued. Frees are
//! stream-ordered, so if the pool handed the memory to another stream before
//! the queued kernels ran, a verify kernel would see foreign bytes (or touch
//! unmapped memory). The host never waits on the device inside the loop, and
//! the pool must not either.

use gpupool::backend::sim::{SimBackend, VerifyResult};
use gpupool::backend::Backend;
use gpupool::{
    BackendKind, Block, DevicePool, DevicePtr, Error, EventHandle, PoolConfig, Runtime, SimConfig,
    Stream,
};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;

/// A small, fast, deterministic generator (xorshift64*).
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
    /// A kernel delay: mostly none, else up to 2 ms.
    fn delay(&mut self) -> Duration {
        if self.chance(60) {
            Duration::ZERO
        } else {
            Duration::from_micros(self.range(1, 2000))
        }
    }
    /// A realistic request size: many small, some large, few very large.
    fn size(&mut self) -> usize {
        let n = match self.next() % 100 {
            0..=54 => self.range(1, 4096),
            55..=84 => self.range(4097, 256 << 10),
            85..=97 => self.range((256 << 10) + 1, 4 * MIB),
            _ => self.range(4 * MIB, 12 * MIB),
        };
        n as usize
    }
}

fn sim_of(rt: &Runtime) -> &SimBackend {
    rt.backend()
        .as_any()
        .downcast_ref::<SimBackend>()
        .expect("simulator")
}

enum Handle<'a> {
    Block(Block<'a>),
    Raw(DevicePtr),
}

/// A block in flight: kernels may still be queued on it.
struct Item<'a> {
    h: Handle<'a>,
    ptr: DevicePtr,
    len: u64,
    seed: u64,
    /// The stream it was allocated on.
    stream: &'a Stream,
}

#[derive(Default)]
struct Totals {
    iterations: AtomicU64,
    cross_stream: AtomicU64,
    ooms: AtomicU64,
}

struct Setup {
    devices: usize,
    threads_per_device: usize,
    streams_per_thread: usize,
    capacity: u64,
    run_for: Duration,
    max_iterations: u64,
    /// Blocks each thread keeps in flight before freeing the oldest.
    in_flight: usize,
    /// Percent of blocks also used on a second stream.
    cross_percent: u64,
    /// Percent of blocks allocated raw.
    raw_percent: u64,
    /// Extra host time of every map call (`SimBackend::set_map_delay`):
    /// a slow driver keeps each mapping out of the heap lock longer.
    map_delay: Duration,
}

/// The loop of one thread: allocate, write, maybe use on another stream,
/// verify, free; never a host sync.
#[allow(clippy::too_many_arguments)]
fn worker<'a>(
    dev: &'a DevicePool,
    sim: &SimBackend,
    own: &'a [Stream],
    all: &'a [Stream],
    id: u64,
    setup: &Setup,
    totals: &Totals,
    results: &mut Vec<Arc<VerifyResult>>,
) {
    let d = dev.device();
    let mut rng = Rng::new(id + 1);
    // One event per own stream: always recorded on the same stream, so
    // its captures complete in order.
    let events: Vec<EventHandle> = own.iter().map(|_| sim.create_event(d).unwrap()).collect();
    let mut flight: VecDeque<Item<'a>> = VecDeque::new();
    let start = Instant::now();
    let mut iter = 0u64;
    let retire = |it: Item<'a>, rng: &mut Rng, results: &mut Vec<Arc<VerifyResult>>| {
        let r = sim
            .launch_verify_pattern(d, it.stream.handle(), it.ptr, it.len, it.seed, rng.delay())
            .unwrap();
        results.push(r);
        // Freed at once: the free is ordered after the queued verify.
        match it.h {
            Handle::Block(b) => drop(b),
            Handle::Raw(p) => dev.free_raw(p, it.stream).unwrap(),
        }
    };
    while iter < setup.max_iterations && start.elapsed() < setup.run_for {
        iter += 1;
        let si = rng.next() as usize % own.len();
        let stream = &own[si];
        let size = rng.size();
        let raw = rng.chance(setup.raw_percent);
        let h = loop {
            let r = if raw {
                dev.alloc_raw(size, stream).map(Handle::Raw)
            } else {
                dev.alloc(size, stream).map(Handle::Block)
            };
            match r {
                Ok(h) => break Some(h),
                Err(Error::OutOfMemory(_)) => {
                    totals.ooms.fetch_add(1, Relaxed);
                    match flight.pop_front() {
                        Some(it) => retire(it, &mut rng, results),
                        None => break None,
                    }
                }
                Err(e) => panic!("alloc({size}) on device {d}: {e}"),
            }
        };
        let Some(h) = h else { continue };
        let ptr = match &h {
            Handle::Block(b) => b.ptr(),
            Handle::Raw(p) => *p,
        };
        let seed = (id << 40) | iter;
        let len = size as u64;
        sim.launch_write_pattern(d, stream.handle(), ptr, len, seed, rng.delay())
            .unwrap();
        if rng.chance(setup.cross_percent) {
            // Use it on another stream too (possibly another thread's),
            // ordered after the write by an event, as CUDA callers must.
            let other = &all[rng.next() as usize % all.len()];
            if other.handle() != stream.handle() {
                totals.cross_stream.fetch_add(1, Relaxed);
                sim.record_event(d, events[si], stream.handle()).unwrap();
                sim.stream_wait_event(d, other.handle(), events[si])
                    .unwrap();
                match &h {
                    Handle::Block(b) => b.record_stream(other),
                    Handle::Raw(p) => dev.record_stream_raw(*p, other).unwrap(),
                }
                // Only a read: the block's own stream may verify it at the
                // same time, and a second writer would make the harness race
                // with itself (ThreadSanitizer reports that).
                let r = sim
                    .launch_verify_pattern(d, other.handle(), ptr, len, seed, rng.delay())
                    .unwrap();
                results.push(r);
            }
        }
        flight.push_back(Item {
            h,
            ptr,
            len,
            seed,
            stream,
        });
        while flight.len() > setup.in_flight {
            let it = flight.pop_front().expect("non-empty");
            retire(it, &mut rng, results);
        }
        // Keep the device at most a bounded amount behind the host, without
        // a host sync: poll (not wait on) an older verify's result.
        while results.len() > 64 && results[results.len() - 64].mismatches().is_none() {
            std::thread::sleep(Duration::from_micros(200));
        }
        if iter % 256 == 0 {
            dev.harvest();
        }
    }
    while let Some(it) = flight.pop_front() {
        retire(it, &mut rng, results);
    }
    totals.iterations.fetch_add(iter, Relaxed);
    // The events may still be waited on by queued work; the simulator keeps
    // them alive for it (as CUDA does).
    for ev in events {
        sim.destroy_event(d, ev).unwrap();
    }
}

fn stress(setup: Setup) {
    let rt = Runtime::builder()
        .backend(BackendKind::Sim(SimConfig {
            devices: setup.devices,
            capacity_bytes: setup.capacity,
            ..Default::default()
        }))
        .config(PoolConfig::default())
        .build()
        .unwrap();
    let sim = sim_of(&rt);
    for d in 0..setup.devices {
        sim.set_map_delay(d, setup.map_delay).unwrap();
    }
    let per_dev = setup.threads_per_device * setup.streams_per_thread;
    let streams: Vec<Vec<Stream>> = rt
        .devices()
        .iter()
        .map(|dev| (0..per_dev).map(|_| dev.new_stream().unwrap()).collect())
        .collect();
    let totals = Totals::default();
    let syncs_before = rt.backend().counters().host_syncs;
    let oom_syncs = || -> u64 {
        rt.devices()
            .into_iter()
            .map(|d| d.stats().oom_host_syncs)
            .sum()
    };
    let oom_syncs_before = oom_syncs();
    let results: Vec<Arc<VerifyResult>> = std::thread::scope(|sc| {
        let mut handles = Vec::new();
        for (d, dev) in rt.devices().into_iter().enumerate() {
            let all = &streams[d][..];
            for t in 0..setup.threads_per_device {
                let own = &all[t * setup.streams_per_thread..(t + 1) * setup.streams_per_thread];
                let id = (d * setup.threads_per_device + t) as u64;
                let (setup, totals) = (&setup, &totals);
                handles.push(sc.spawn(move || {
                    let mut results = Vec::new();
                    worker(dev, sim, own, all, id, setup, totals, &mut results);
                    results
                }));
            }
        }
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("worker panicked"))
            .collect()
    });
    // Every block is freed; the pool blocked the host only on the way to
    // out of memory (invariant 3's one exception), never elsewhere.
    assert_eq!(
        rt.backend().counters().host_syncs - syncs_before,
        oom_syncs() - oom_syncs_before,
        "the pool blocked the host on the device outside the way to out of memory"
    );
    for (d, dev) in rt.devices().into_iter().enumerate() {
        for s in &streams[d] {
            sim.sync_stream(d, s.handle()).unwrap();
        }
        sim.sync_stream(d, dev.default_stream().handle()).unwrap();
    }
    let bad: u64 = results.iter().map(|r| r.wait()).sum();
    let it = totals.iterations.load(Relaxed);
    eprintln!(
        "{} device(s) x {} thread(s): {it} iterations, {} cross-stream uses, {} verifies, {} OOMs",
        setup.devices,
        setup.threads_per_device,
        totals.cross_stream.load(Relaxed),
        results.len(),
        totals.ooms.load(Relaxed)
    );
    assert!(it >= 100, "the run did too little work: {it} iterations");
    for (d, dev) in rt.devices().into_iter().enumerate() {
        let st = dev.stats();
        eprintln!(
            "  device {d}: peak live {} MiB, peak reserved {} MiB, {} pending frees, {} handovers",
            st.requested_bytes.peak >> 20,
            st.reserved_bytes.peak >> 20,
            st.num_pending_frees,
            st.num_handovers
        );
        assert_eq!(sim.integrity_errors(d), 0, "device {d}: corrupted bytes");
        assert_eq!(sim.device_faults(d), 0, "device {d}: unmapped accesses");
        assert_eq!(st.requested_bytes.current, 0, "device {d}: {st:?}");
        assert_eq!(st.num_allocs, st.num_frees, "device {d}: {st:?}");
        dev.audit()
            .unwrap_or_else(|e| panic!("device {d}: audit: {e}"));
    }
    assert_eq!(bad, 0, "verify kernels saw corrupted bytes");
    rt.trim().unwrap();
    for (d, dev) in rt.devices().into_iter().enumerate() {
        let st = dev.audit().unwrap_or_else(|e| panic!("device {d}: {e}"));
        assert_eq!(st.reserved_bytes.current, 0, "device {d}: {st:?}");
        assert_eq!(sim.used_bytes(d), 0, "device {d}: memory still held");
    }
}

#[test]
fn four_threads_two_streams_each_one_device() {
    stress(Setup {
        devices: 1,
        threads_per_device: 4,
        streams_per_thread: 2,
        capacity: 256 * MIB,
        run_for: Duration::from_millis(2500),
        max_iterations: 20_000,
        in_flight: 12,
        cross_percent: 30,
        raw_percent: 25,
        map_delay: Duration::ZERO,
    });
}

#[test]
fn two_devices_two_threads_each() {
    stress(Setup {
        devices: 2,
        threads_per_device: 2,
        streams_per_thread: 2,
        capacity: 128 * MIB,
        run_for: Duration::from_millis(2500),
        max_iterations: 20_000,
        in_flight: 12,
        cross_percent: 30,
        raw_percent: 25,
        map_delay: Duration::ZERO,
    });
}

/// Memory pressure: a small device, so that blocks are constantly reused
/// across streams through the pending list, handovers and stitching.
#[test]
fn small_device_under_pressure() {
    stress(Setup {
        devices: 1,
        threads_per_device: 4,
        streams_per_thread: 2,
        capacity: 48 * MIB,
        run_for: Duration::from_millis(2500),
        max_iterations: 20_000,
        in_flight: 8,
        cross_percent: 30,
        raw_percent: 25,
        map_delay: Duration::ZERO,
    });
}

/// The same with a slow driver (200 µs per map): many requests plan,
/// map outside the heap lock and publish at once, stealing each other's
/// idle granules (`pool/heap/map_job.rs`); every byte stays intact.
#[test]
fn small_device_under_pressure_with_slow_maps() {
    stress(Setup {
        devices: 1,
        threads_per_device: 4,
        streams_per_thread: 2,
        capacity: 48 * MIB,
        run_for: Duration::from_millis(2500),
        max_iterations: 20_000,
        in_flight: 8,
        cross_percent: 30,
        raw_percent: 25,
        map_delay: Duration::from_micros(200),
    });
}

/// One simulated device without a maintenance thread: the control tests
/// below assert the pool's exact choices step by step, and a maintenance
/// tick flushing the streams between a free and the next allocation (the
/// pool grew while another stream held freed memory) would send that
/// memory to the pending list instead (seen once in CI).
fn one_device(capacity: u64) -> Runtime {
    Runtime::builder()
        .backend(BackendKind::Sim(SimConfig {
            capacity_bytes: capacity,
            ..Default::default()
        }))
        .maintenance(false)
        .build()
        .unwrap()
}

/// The checker works: freeing on the wrong stream (API misuse: the free is
/// ordered after that stream only) lets the pool hand the memory to that
/// stream at once, while a delayed write on the real stream is still
/// queued; the late write lands on the new block and its verify sees it.
#[test]
fn negative_control_reuse_before_completion_is_detected() {
    let rt = one_device(64 * MIB);
    let dev = rt.device(0).unwrap();
    let sim = sim_of(&rt);
    let (a, b) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
    for size in [64usize << 10, 3 << 20] {
        let len = size as u64;
        let p = dev.alloc_raw(size, &a).unwrap();
        sim.launch_write_pattern(0, a.handle(), p, len, 1, Duration::from_millis(50))
            .unwrap();
        dev.free_raw(p, &b).unwrap(); // wrong stream
        let q = dev.alloc_raw(size, &b).unwrap();
        assert_eq!(q, p, "the memory freed on b is reused at once on b");
        sim.launch_write_pattern(0, b.handle(), q, len, 2, Duration::ZERO)
            .unwrap();
        let r = sim
            .launch_verify_pattern(0, b.handle(), q, len, 2, Duration::from_millis(300))
            .unwrap();
        assert!(r.wait() > 0, "{size} B: the late write went unnoticed");
        dev.free_raw(q, &b).unwrap();
        sim.sync_stream(0, a.handle()).unwrap();
    }
    assert!(sim.integrity_errors(0) > 0);
}

/// The same scenario used correctly (freed on the stream that used it):
/// the other stream gets other memory, or waits, and sees no corruption.
#[test]
fn positive_control_correct_stream_is_clean() {
    let rt = one_device(64 * MIB);
    let dev = rt.device(0).unwrap();
    let sim = sim_of(&rt);
    let (a, b) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
    for size in [64usize << 10, 3 << 20] {
        let len = size as u64;
        let p = dev.alloc_raw(size, &a).unwrap();
        sim.launch_write_pattern(0, a.handle(), p, len, 1, Duration::from_millis(50))
            .unwrap();
        dev.free_raw(p, &a).unwrap();
        let q = dev.alloc_raw(size, &b).unwrap();
        sim.launch_write_pattern(0, b.handle(), q, len, 2, Duration::ZERO)
            .unwrap();
        let r = sim
            .launch_verify_pattern(0, b.handle(), q, len, 2, Duration::from_millis(300))
            .unwrap();
        assert_eq!(r.wait(), 0, "{size} B: corrupted");
        dev.free_raw(q, &b).unwrap();
        sim.sync_stream(0, a.handle()).unwrap();
    }
    assert_eq!(sim.integrity_errors(0), 0);
    assert_eq!(sim.device_faults(0), 0);
}

/// The checker's own ground truth: a stream that waits on an event waits for
/// the record that preceded the wait, as `cuStreamWaitEvent` does, even if
/// the event is recorded again on another stream (which the pool does when it
/// recycles an event right after a handover). Otherwise the simulator lets
/// work run early and the stress tests report corruption the pool did not
/// cause.
#[test]
fn a_wait_is_for_the_record_before_it_not_a_later_one() {
    let rt = one_device(64 * MIB);
    let dev = rt.device(0).unwrap();
    let sim = sim_of(&rt);
    let (s1, s2, s3) = (
        dev.new_stream().unwrap(),
        dev.new_stream().unwrap(),
        dev.new_stream().unwrap(),
    );
    let p = dev.alloc_raw(4096, &s1).unwrap();
    let ev = sim.create_event(0).unwrap();
    sim.launch_write_pattern(0, s1.handle(), p, 4096, 7, Duration::from_millis(200))
        .unwrap();
    sim.record_event(0, ev, s1.handle()).unwrap();
    sim.stream_wait_event(0, s2.handle(), ev).unwrap();
    // Re-recorded on an idle stream: completes at once.
    sim.record_event(0, ev, s3.handle()).unwrap();
    let r = sim
        .launch_verify_pattern(0, s2.handle(), p, 4096, 7, Duration::ZERO)
        .unwrap();
    assert_eq!(
        r.wait(),
        0,
        "s2 ran before the record it waited on completed"
    );
    sim.sync_stream(0, s1.handle()).unwrap();
    dev.free_raw(p, &s1).unwrap();
    sim.destroy_event(0, ev).unwrap();
}
