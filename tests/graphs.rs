//! CUDA graph awareness (issue 22, item 7): captures on simulated
//! streams, the calls gpupool must not make while one is underway, frees
//! deferred to the end of a capture, and private graph pools.
//!
//! The simulator counts every call a capture forbids
//! (`SimBackend::capture_violations`, see `backend/sim/capture.rs`); the
//! first test checks that it does, so that the others' "zero violations"
//! means something.

mod common;

use common::watchdog;
use gpupool::backend::sim::SimBackend;
use gpupool::backend::{Backend, Call};
use gpupool::{DevicePool, DevicePtr, Error, PoolConfig, Runtime, SimConfig};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;
/// How long a test may run before it counts as a deadlock or hang.
const WATCHDOG: Duration = Duration::from_secs(120);

fn sim() -> Arc<SimBackend> {
    Arc::new(
        SimBackend::new(SimConfig {
            devices: 1,
            capacity_bytes: 8 << 30,
            ..Default::default()
        })
        .unwrap(),
    )
}

fn pool(be: &Arc<SimBackend>) -> DevicePool {
    DevicePool::new(be.clone(), 0, PoolConfig::default()).unwrap()
}

/// Writes the pattern of `seed` over `[p, p + len)` on `s` after a delay,
/// then checks it there: a block reused before its last use ended shows as
/// integrity errors.
fn write_verify(be: &SimBackend, s: gpupool::StreamHandle, p: DevicePtr, len: u64, seed: u64) {
    be.launch_write_pattern(0, s, p, len, seed, Duration::from_micros(200))
        .unwrap();
    be.launch_verify_pattern(0, s, p, len, seed, Duration::ZERO)
        .unwrap();
}

#[test]
fn the_simulator_counts_forbidden_calls() {
    let be = sim();
    let s = be.create_stream(0).unwrap();
    let other = be.create_stream(0).unwrap();
    let e = be.create_event(0).unwrap();
    assert!(!be.stream_capturing(0, s).unwrap());
    be.begin_capture(0, s).unwrap();
    assert!(be.begin_capture(0, s).is_err(), "a second begin is refused");
    assert!(be.stream_capturing(0, s).unwrap());
    assert!(!be.stream_capturing(0, other).unwrap());
    assert_eq!(be.capture_violations(0), 0);
    // Allowed: recording on another stream, growing.
    be.record_event(0, e, other).unwrap();
    let c = be.create_chunk(0, 2 * MIB).unwrap();
    assert_eq!(be.capture_violations(0), 0);
    // Forbidden: a record on the capturing stream, any query, a release.
    be.record_event(0, e, s).unwrap();
    assert_eq!(be.capture_violations(0), 1);
    be.query_event(0, e).unwrap();
    assert_eq!(be.capture_violations(0), 2);
    be.release_chunk(0, c).unwrap();
    assert_eq!(be.capture_violations(0), 3);
    be.end_capture(0, s).unwrap();
    assert!(be.end_capture(0, s).is_err());
    // An event recorded during the capture stays captured.
    be.query_event(0, e).unwrap();
    assert_eq!(be.capture_violations(0), 4);
    be.record_event(0, e, other).unwrap();
    be.query_event(0, e).unwrap();
    assert_eq!(be.capture_violations(0), 4);
    assert!(be.counters().get(Call::StreamIsCapturing) >= 3);
}

/// A capture on one stream while other threads allocate and free (with
/// `record_stream`, so frees would record events), a thread plays
/// maintenance (maintain, idle release, harvest, trim, compaction) and the
/// runtime's own maintenance thread ticks with idle release on: no call
/// the capture forbids, no corrupted byte, and the deferred frees are
/// made, and reusable, once the capture ends.
#[test]
fn nothing_forbidden_while_a_stream_captures() {
    watchdog("capture", WATCHDOG, || {
        let be = sim();
        let cfg = PoolConfig {
            idle_release: Some(Duration::from_millis(1)),
            idle: Some(Duration::from_millis(1)),
            maintenance_tick: Some(Duration::from_millis(1)),
            ..Default::default()
        };
        let rt = Arc::new(Runtime::with_backend(be.clone(), cfg).unwrap());
        let dev = rt.device(0).unwrap();
        let cap = dev.new_stream().unwrap();
        // Warm up: pending frees, idle granules, parked ranges.
        {
            let a = dev.new_stream().unwrap();
            let b = dev.new_stream().unwrap();
            let mut held = Vec::new();
            for i in 0..40u64 {
                let size = [4096, 300 << 10, 3 << 20, 9 << 20][i as usize % 4];
                let blk = dev.alloc(size, if i % 2 == 0 { &a } else { &b }).unwrap();
                if i % 3 == 0 {
                    blk.record_stream(&cap);
                }
                held.push(blk);
            }
            held.truncate(10);
        }
        dev.settle().unwrap();
        // In flight as the capture begins: pending frees whose events are
        // not complete (a harvest would query them), and blocks of the
        // device pool used on another stream that the capturing stream
        // frees during the capture (their events would go on it).
        let side = dev.new_stream().unwrap();
        for i in 0..6u64 {
            let p = dev.alloc_raw((2 << 20) + 4096 * i as usize, &side).unwrap();
            be.launch_write_pattern(0, side.handle(), p, 4096, i, Duration::from_millis(30))
                .unwrap();
            dev.record_stream_raw(p, &cap).unwrap();
            dev.free_raw(p, &side).unwrap();
        }
        let mut to_free_in_capture = Vec::new();
        for i in 0..6u64 {
            let p = dev.alloc_raw(4096 << i, &cap).unwrap();
            dev.record_stream_raw(p, &side).unwrap();
            to_free_in_capture.push(p);
        }
        assert!(dev.stats().pending_bytes.current > 0);

        dev.begin_allocate_to_pool(7, &cap).unwrap();
        be.begin_capture(0, cap.handle()).unwrap();
        assert!(dev.capture_underway());
        let stop = Arc::new(AtomicBool::new(false));
        let deferred_seen = Arc::new(AtomicU64::new(0));
        let mut threads = Vec::new();
        for t in 0..2u64 {
            let (rt, be, stop, seen) =
                (rt.clone(), be.clone(), stop.clone(), deferred_seen.clone());
            threads.push(std::thread::spawn(move || {
                let dev = rt.device(0).unwrap();
                let a = dev.new_stream().unwrap();
                let b = dev.new_stream().unwrap();
                let mut i = 0u64;
                while !stop.load(Relaxed) && i < 400 {
                    let size = [512, 40 << 10, 700 << 10, 5 << 20][(i % 4) as usize] as u64;
                    let p = dev.alloc_raw(size as usize, &a).unwrap();
                    write_verify(&be, a.handle(), p, size, t * 1000 + i);
                    if i % 2 == 0 {
                        dev.record_stream_raw(p, &b).unwrap();
                    }
                    dev.free_raw(p, &a).unwrap();
                    if dev.deferred_frees() > 0 {
                        seen.fetch_add(1, Relaxed);
                    }
                    i += 1;
                }
            }));
        }
        {
            let (rt, stop) = (rt.clone(), stop.clone());
            threads.push(std::thread::spawn(move || {
                let dev = rt.device(0).unwrap();
                while !stop.load(Relaxed) {
                    dev.maintain();
                    assert_eq!(dev.release_cache(), 0, "no release during a capture");
                    dev.harvest();
                    assert!(dev.trim().is_err(), "trim waits on the host: refused");
                    assert!(dev.settle().is_err());
                    assert!(dev.compact(Default::default()).is_err());
                    std::thread::sleep(Duration::from_micros(300));
                }
            }));
        }
        // The capturing stream frees device-pool blocks used on another
        // stream too: deferred (an event on it would join the graph).
        for p in to_free_in_capture {
            dev.free_raw(p, &cap).unwrap();
        }
        // The capturing stream allocates into its private pool, frees and
        // reuses within it.
        let mut mine = Vec::new();
        for i in 0..60u64 {
            let size = [256, 64 << 10, 3 << 20][(i % 3) as usize];
            let p = dev.alloc_raw(size as usize, &cap).unwrap();
            write_verify(&be, cap.handle(), p, size, 77_000 + i);
            if i % 2 == 0 {
                dev.free_raw(p, &cap).unwrap();
            } else {
                mine.push(p);
            }
        }
        std::thread::sleep(Duration::from_millis(100));
        stop.store(true, Relaxed);
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(
            be.capture_violations(0),
            0,
            "a forbidden call during the capture"
        );
        assert!(dev.deferred_frees() > 0, "record_stream'd frees wait");
        assert!(deferred_seen.load(Relaxed) > 0);

        be.end_capture(0, cap.handle()).unwrap();
        dev.end_allocate_to_pool(7).unwrap();
        assert!(!dev.capture_underway());
        assert_eq!(dev.deferred_frees(), 0, "made at the end of the capture");
        // The deferred frees recorded their events: settle makes them
        // reusable, and trim gives memory back.
        dev.settle().unwrap();
        assert_eq!(dev.stats().pending_bytes.current, 0);
        for p in mine {
            dev.free_raw(p, &cap).unwrap();
        }
        dev.release_pool(7).unwrap();
        assert_eq!(dev.private_pool_figures(), (0, 0));
        assert!(dev.trim().unwrap() > 0);
        be.sync_stream(0, cap.handle()).unwrap();
        dev.audit().unwrap();
        assert_eq!(be.integrity_errors(0), 0);
        assert_eq!(be.device_faults(0), 0);
        assert_eq!(be.capture_violations(0), 0);
    });
}

/// A `record_stream`'d free during a capture is deferred (it stays
/// allocated), made at the end, and its memory is then reused by another
/// stream without growing the pool.
#[test]
fn deferred_frees_become_reusable_after_the_capture() {
    let be = sim();
    let pool = pool(&be);
    let (cap, a, b) = (
        pool.new_stream().unwrap(),
        pool.new_stream().unwrap(),
        pool.new_stream().unwrap(),
    );
    pool.begin_allocate_to_pool(1, &cap).unwrap();
    be.begin_capture(0, cap.handle()).unwrap();
    let p = pool.alloc_raw(8 << 20, &a).unwrap();
    write_verify(&be, a.handle(), p, 8 << 20, 5);
    pool.record_stream_raw(p, &b).unwrap();
    let records = be.counters().get(Call::EventRecord);
    pool.free_raw(p, &a).unwrap();
    assert_eq!(pool.deferred_frees(), 1);
    assert_eq!(
        be.counters().get(Call::EventRecord),
        records,
        "no event yet"
    );
    assert_eq!(
        pool.stats().requested_bytes.current,
        8 << 20,
        "counted live"
    );
    be.end_capture(0, cap.handle()).unwrap();
    pool.end_allocate_to_pool(1).unwrap();
    // Made at the end (behind promises on `a` and `b`, see
    // `pool/probes.rs`): no longer counted live, reused below.
    assert_eq!(pool.deferred_frees(), 0);
    assert_eq!(pool.stats().requested_bytes.current, 0);
    pool.settle().unwrap();
    let reserved = pool.reserved_bytes();
    let q = pool.alloc_raw(8 << 20, &b).unwrap();
    assert_eq!(pool.reserved_bytes(), reserved, "reused, not grown");
    write_verify(&be, b.handle(), q, 8 << 20, 6);
    pool.free_raw(q, &b).unwrap();
    be.sync_stream(0, b.handle()).unwrap();
    assert_eq!(be.integrity_errors(0), 0);
    assert_eq!(be.capture_violations(0), 0);
    pool.audit().unwrap();
}

/// A capture the pool was not told about is found on the next allocation
/// slow path of its stream (one `cuStreamIsCapturing`), and its end by a
/// maintenance step.
#[test]
fn an_untold_capture_is_detected_on_the_slow_path() {
    let be = sim();
    let pool = pool(&be);
    let (s, other) = (pool.new_stream().unwrap(), pool.new_stream().unwrap());
    let warm = pool.alloc(3 << 20, &other).unwrap();
    drop(warm);
    let asked = be.counters().get(Call::StreamIsCapturing);
    be.begin_capture(0, s.handle()).unwrap();
    assert!(!pool.capture_underway());
    let p = pool.alloc_raw(16 << 20, &s).unwrap();
    assert!(be.counters().get(Call::StreamIsCapturing) > asked);
    assert!(pool.capture_underway(), "detected");
    pool.record_stream_raw(p, &other).unwrap();
    pool.free_raw(p, &s).unwrap();
    assert_eq!(pool.deferred_frees(), 1);
    pool.maintain();
    assert!(pool.capture_underway(), "still capturing");
    be.end_capture(0, s.handle()).unwrap();
    pool.maintain();
    assert!(!pool.capture_underway(), "the end is noticed");
    assert_eq!(pool.deferred_frees(), 0);
    assert_eq!(be.capture_violations(0), 0);
    pool.settle().unwrap();
    pool.audit().unwrap();
    // The fast path asks nothing (the first allocation carves a slab).
    drop(pool.alloc(4096, &s).unwrap());
    let asked = be.counters().get(Call::StreamIsCapturing);
    for _ in 0..100 {
        drop(pool.alloc(4096, &s).unwrap());
    }
    assert_eq!(be.counters().get(Call::StreamIsCapturing), asked);
}

/// Memory freed in a private pool is never handed to an allocation outside
/// it; after release it is.
#[test]
fn private_pool_memory_stays_private_until_release() {
    let be = sim();
    let pool = pool(&be);
    let s = pool.new_stream().unwrap();
    let p = pool.alloc_raw_in_pool(MIB as usize, &s, 5).unwrap();
    let q = pool.alloc_raw_in_pool(MIB as usize, &s, 5).unwrap();
    assert_eq!(pool.private_pool_figures(), (2 * MIB, 2));
    assert_eq!(pool.raw_size(p), Some(MIB));
    pool.free_raw(p, &s).unwrap();
    pool.free_raw(q, &s).unwrap();
    assert!(matches!(
        pool.free_raw(p, &s),
        Err(Error::DoubleFree { .. })
    ));
    assert_eq!(pool.private_pool_figures(), (2 * MIB, 0));
    // Outside the pool, on the same stream: never its memory.
    let mut outside = Vec::new();
    for size in [MIB, 2 * MIB, 512 << 10, 4096] {
        let o = pool.alloc_raw(size as usize, &s).unwrap();
        let inside = o.addr() >= p.addr() && o.addr() < p.addr() + 2 * MIB;
        assert!(!inside, "{o:?} lies in the private segment at {p:?}");
        outside.push(o);
    }
    // Inside the pool: reused.
    let r = pool.alloc_raw_in_pool(MIB as usize, &s, 5).unwrap();
    assert!(r == p || r == q);
    pool.free_raw(r, &s).unwrap();
    pool.release_pool(5).unwrap();
    assert_eq!(pool.private_pool_figures(), (0, 0));
    assert!(pool.release_pool(5).is_err(), "released: unknown now");
    // The segment went back to the device pool, parked on its stream.
    let back = pool.alloc_raw(2 * MIB as usize, &s).unwrap();
    assert_eq!(back, p, "the segment is the device pool's again");
    for o in outside.into_iter().chain([back]) {
        pool.free_raw(o, &s).unwrap();
    }
    pool.audit().unwrap();
}

/// Release while blocks live: they stay the pool's until freed, then go
/// back. A block freed after `record_stream` is never reused in the pool.
#[test]
fn release_with_live_blocks_and_recorded_frees() {
    let be = sim();
    let pool = pool(&be);
    let (s, t) = (pool.new_stream().unwrap(), pool.new_stream().unwrap());
    let a = pool.alloc_raw_in_pool(4096, &s, 9).unwrap();
    let b = pool.alloc_raw_in_pool(4096, &s, 9).unwrap();
    write_verify(&be, s.handle(), b, 4096, 1);
    pool.record_stream_raw(b, &t).unwrap();
    pool.free_raw(b, &s).unwrap();
    let c = pool.alloc_raw_in_pool(4096, &s, 9).unwrap();
    assert_ne!(c, b, "freed after record_stream: not reused before release");
    pool.free_raw(c, &s).unwrap();
    // Another stream does not reuse what `s` freed.
    let d = pool.alloc_raw_in_pool(4096, &t, 9).unwrap();
    assert_ne!(d, c);
    pool.audit().unwrap();
    let reserved = pool.reserved_bytes();
    pool.release_pool(9).unwrap();
    assert!(pool.alloc_raw_in_pool(4096, &s, 9).is_err(), "released");
    assert_eq!(pool.private_pool_figures().1, 2, "a and d still live");
    pool.free_raw(d, &t).unwrap();
    assert_eq!(pool.private_pool_figures().1, 1);
    pool.free_raw(a, &s).unwrap();
    assert_eq!(pool.private_pool_figures(), (0, 0));
    assert_eq!(
        pool.reserved_bytes(),
        reserved,
        "back to the device pool, not released"
    );
    pool.settle().unwrap();
    pool.audit().unwrap();
    assert_eq!(be.integrity_errors(0), 0);
}

/// Routing: allocations on a routed stream go to its pool until the end;
/// bad input is an error that changes nothing.
#[test]
fn routing_and_bad_input() {
    let be = sim();
    let pool = pool(&be);
    let (s, t) = (pool.new_stream().unwrap(), pool.new_stream().unwrap());
    assert!(pool.begin_allocate_to_pool(0, &s).is_err());
    assert!(pool.end_allocate_to_pool(0).is_err());
    assert!(pool.release_pool(0).is_err());
    assert!(pool.end_allocate_to_pool(3).is_err(), "never used");
    assert!(pool.release_pool(3).is_err());
    assert!(pool.alloc_raw_in_pool(100, &s, 0).is_err());
    assert!(!pool.capture_underway());
    pool.begin_allocate_to_pool(3, &s).unwrap();
    assert!(
        pool.begin_allocate_to_pool(4, &s).is_err(),
        "routed already"
    );
    pool.begin_allocate_to_pool(3, &t).unwrap();
    assert!(pool.capture_underway());
    assert!(pool.mark_step().is_err(), "no step mark during a capture");
    assert!(pool.trim().is_err());
    let p = pool.alloc_raw(1000, &s).unwrap();
    let q = pool.alloc_raw(1000, &t).unwrap();
    assert_eq!(pool.private_pool_figures().1, 2);
    pool.end_allocate_to_pool(3).unwrap();
    assert!(!pool.capture_underway());
    let r = pool.alloc_raw(1000, &s).unwrap();
    assert_eq!(pool.private_pool_figures().1, 2, "not routed any more");
    for x in [p, q, r] {
        pool.free_raw(x, &s).unwrap();
    }
    pool.release_pool(3).unwrap();
    // Another device pool's stream.
    let be2 = sim();
    let other = DevicePool::new(be2, 0, PoolConfig::default()).unwrap();
    let foreign = other.new_stream().unwrap();
    assert!(pool.begin_allocate_to_pool(8, &foreign).is_err());
    assert!(!pool.capture_underway());
    pool.audit().unwrap();
}

/// A stream that captures while its own free (no `record_stream`) and
/// reuse happen makes no driver call at all on the fast path.
#[test]
fn own_stream_frees_during_a_capture_need_no_driver_call() {
    let be = sim();
    let pool = pool(&be);
    let s = pool.new_stream().unwrap();
    drop(pool.alloc(4096, &s).unwrap());
    pool.begin_allocate_to_pool(2, &s).unwrap();
    be.begin_capture(0, s.handle()).unwrap();
    let before = be.counters();
    let t0 = Instant::now();
    for _ in 0..1000 {
        drop(pool.alloc(4096, &s).unwrap());
    }
    assert!(t0.elapsed() < Duration::from_secs(10));
    let d = be.counters().since(&before);
    assert_eq!(d.total_calls(), 0, "{d:?}");
    be.end_capture(0, s.handle()).unwrap();
    pool.end_allocate_to_pool(2).unwrap();
    assert_eq!(be.capture_violations(0), 0);
}

/// A mapping job makes its driver calls with the heap lock released, and
/// may unmap (stolen clean granules, its own runs after a failed map),
/// which a capture forbids: a capture begun while a job is out waits for
/// it. Here another thread's map takes 1 s (`set_map_delay`);
/// `begin_allocate_to_pool`, called once that map has started, returns
/// only after it.
#[test]
fn a_capture_begun_during_a_mapping_waits_for_it() {
    watchdog("mapping_job_handshake", WATCHDOG, || {
        let be = sim();
        let pool = pool(&be);
        let (x, cap) = (pool.new_stream().unwrap(), pool.new_stream().unwrap());
        let maps = || be.counters().get(Call::Map);
        let before = maps();
        be.set_map_delay(0, Duration::from_secs(1)).unwrap();
        std::thread::scope(|s| {
            s.spawn(|| {
                let p = pool.alloc_raw(64 << 20, &x).unwrap();
                pool.free_raw(p, &x).unwrap();
            });
            while maps() == before {
                std::thread::yield_now();
            }
            let t = Instant::now();
            pool.begin_allocate_to_pool(1, &cap).unwrap();
            let waited = t.elapsed();
            assert!(
                waited >= Duration::from_millis(500),
                "the capture began {waited:?} into a 1 s map"
            );
            pool.end_allocate_to_pool(1).unwrap();
        });
        be.set_map_delay(0, Duration::ZERO).unwrap();
        assert_eq!(be.capture_violations(0), 0);
    });
}
