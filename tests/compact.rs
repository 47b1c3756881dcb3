//! Compaction: movable blocks, pins, passes (on demand and idle-time), and
//! the fragmentation workload, on the simulator with delayed pattern
//! kernels checking every byte.

use gpupool::backend::sim::SimBackend;
use gpupool::backend::Call;
use gpupool::compact::fragment::{self, FragmentOptions};
use gpupool::compact::CompactTotals;
use gpupool::{CompactOptions, DevicePool, Error, MovableBlock, PoolConfig, SimConfig, Stream};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

const KIB: usize = 1 << 10;

fn pool_with(cfg: PoolConfig, sim: SimConfig) -> DevicePool {
    let be = Arc::new(SimBackend::new(sim).unwrap());
    DevicePool::new(be, 0, cfg).unwrap()
}

fn pool() -> DevicePool {
    pool_with(PoolConfig::default(), SimConfig::default())
}

fn sim(pool: &DevicePool) -> &SimBackend {
    pool.backend().as_any().downcast_ref().unwrap()
}

/// Pins `b` on `s` and enqueues a delayed write (or verify) of `seed`.
fn touch(pool: &DevicePool, b: &MovableBlock<'_>, s: &Stream, seed: u64, write: bool) -> u64 {
    let p = b.pin(s);
    let d = Duration::from_micros(seed % 300);
    let (dev, h, len) = (pool.device(), s.handle(), b.size() as u64);
    if write {
        sim(pool)
            .launch_write_pattern(dev, h, p.ptr(), len, seed, d)
            .unwrap();
    } else {
        sim(pool)
            .launch_verify_pattern(dev, h, p.ptr(), len, seed, d)
            .unwrap();
    }
    p.ptr().addr()
}

fn sync(pool: &DevicePool, s: &Stream) {
    pool.backend()
        .sync_stream(pool.device(), s.handle())
        .unwrap();
}

/// Sizes that fragment: deterministic, 1..=96 KiB, not multiples of 256.
fn size_of(i: usize) -> usize {
    (i * 7919 % 96 + 1) * KIB - (i % 5) * 37
}

/// Allocates `n` written blocks and frees every other one.
fn fragmented<'a>(pool: &'a DevicePool, s: &'a Stream, n: usize) -> Vec<(MovableBlock<'a>, u64)> {
    let mut v = Vec::new();
    for i in 0..n {
        let b = pool.alloc_movable(size_of(i), s).unwrap();
        touch(pool, &b, s, 1000 + i as u64, true);
        if i % 2 == 1 {
            v.push((b, 1000 + i as u64));
        }
    }
    v
}

#[test]
fn movable_blocks_are_accounted_and_bad_input_is_rejected() {
    let pool = pool();
    let s = pool.new_stream().unwrap();
    let b = pool.alloc_movable(64 * KIB, &s).unwrap();
    assert!(b.is_movable());
    assert_eq!(b.size(), 64 * KIB);
    let addr = b.pin(&s).ptr().addr();
    assert_eq!(addr % 256, 0);
    let st = pool.audit().unwrap();
    assert_eq!(st.requested_bytes.current, 64 << 10);
    assert_eq!(st.allocated_bytes.current, 64 << 10);
    assert!(matches!(
        pool.alloc_movable(0, &s),
        Err(Error::InvalidSize { .. })
    ));
    let other = pool_with(PoolConfig::default(), SimConfig::default());
    let foreign = other.new_stream().unwrap();
    assert!(pool.alloc_movable(4096, &foreign).is_err());
    assert_eq!(pool.stats().num_allocs, 1);
    drop(b);
    let st = pool.audit().unwrap();
    assert_eq!(st.requested_bytes.current, 0);
    // The block was pinned, so its range waited on an event (pending)
    // before it became cached; trim gives everything back.
    pool.trim().unwrap();
    assert_eq!(pool.audit().unwrap().reserved_bytes.current, 0);
}

#[test]
fn compaction_preserves_every_byte_and_gives_memory_back() {
    let pool = pool();
    let s = pool.new_stream().unwrap();
    let live = fragmented(&pool, &s, 400);
    // Let the freed blocks' last uses finish, so their ranges are free.
    sync(&pool, &s);
    let before = pool.audit().unwrap();
    let addrs: Vec<u64> = live.iter().map(|(b, _)| b.pin(&s).ptr().addr()).collect();
    let r = pool.compact(CompactOptions::default()).unwrap();
    assert!(r.committed && !r.in_flight, "{r:?}");
    assert!(r.blocks_moved > 0 && r.regions_released > 0, "{r:?}");
    assert!(r.bytes_released > 0, "{r:?}");
    let after = pool.audit().unwrap();
    assert!(after.reserved_bytes.current < before.reserved_bytes.current);
    assert_eq!(
        after.requested_bytes.current,
        before.requested_bytes.current
    );
    let moved = live
        .iter()
        .zip(&addrs)
        .filter(|((b, _), &a)| b.pin(&s).ptr().addr() != a)
        .count() as u64;
    assert_eq!(moved, r.blocks_moved);
    for (b, seed) in &live {
        touch(&pool, b, &s, *seed, false);
    }
    sync(&pool, &s);
    assert_eq!(sim(&pool).integrity_errors(0), 0);
    assert_eq!(sim(&pool).device_faults(0), 0);
    // The host waited for the pass (compact is explicit), never on alloc/free.
    assert_eq!(pool.compact_totals().passes, 1);
}

#[test]
fn without_compact_release_the_emptied_memory_stays_cached() {
    let cfg = PoolConfig {
        compact_release: false,
        ..PoolConfig::default()
    };
    let pool = pool_with(cfg, SimConfig::default());
    let s = pool.new_stream().unwrap();
    let live = fragmented(&pool, &s, 400);
    sync(&pool, &s);
    pool.maintain();
    let before = pool.audit().unwrap();
    let r = pool
        .compact(CompactOptions::from_config(pool.config()))
        .unwrap();
    assert!(r.regions_released > 0 && r.bytes_released == 0, "{r:?}");
    let after = pool.audit().unwrap();
    assert_eq!(after.reserved_bytes.current, before.reserved_bytes.current);
    assert_eq!(after.cached_bytes.current, before.cached_bytes.current);
    // The cached bytes are now whole granules: they serve a granule-sized
    // request without new device memory, and trim gives them back.
    let devs = pool.stats().num_device_allocs;
    let b = pool.alloc(2 << 20, &s).unwrap();
    assert_eq!(pool.stats().num_device_allocs, devs);
    drop(b);
    assert!(pool.trim().unwrap() >= 2 << 20);
    drop(live);
}

/// A pass started without waiting commits later, in `maintain` (as the
/// runtime's maintenance thread does): the regions it empties are given
/// back to the device or kept as the call that started it asked, not as
/// the committer's configuration says. A training loop compacts between
/// steps keeping what it empties, because the next step takes it again.
#[test]
fn a_pass_committed_by_maintain_keeps_its_callers_release_choice() {
    for release in [false, true] {
        let pool = pool();
        assert!(pool.config().compact_release, "the default releases");
        let s = pool.new_stream().unwrap();
        let live = fragmented(&pool, &s, 400);
        sync(&pool, &s);
        pool.maintain();
        let reserved = pool.stats().reserved_bytes.current;
        let releases = pool.backend().counters().get(Call::MemRelease);
        let before = pool.compact_totals();
        sim(&pool)
            .set_op_delay(0, Duration::from_millis(30))
            .unwrap();
        let r = pool
            .compact(CompactOptions {
                release,
                wait: false,
                ..CompactOptions::default()
            })
            .unwrap();
        assert!(r.in_flight && r.blocks_planned > 0, "{r:?}");
        sim(&pool).set_op_delay(0, Duration::ZERO).unwrap();
        let t = finish(&pool, before);
        assert!(t.regions_released > 0, "{t:?}");
        let now = pool.stats().reserved_bytes.current;
        let released = pool.backend().counters().get(Call::MemRelease) - releases;
        if release {
            assert!(
                now < reserved && released > 0,
                "{now} {reserved} {released}"
            );
        } else {
            assert_eq!((now, released), (reserved, 0));
        }
        for (b, seed) in &live {
            touch(&pool, b, &s, *seed, false);
        }
        sync(&pool, &s);
        assert_eq!(sim(&pool).integrity_errors(0), 0);
        pool.audit().unwrap();
    }
}

#[test]
fn pinned_raw_and_plain_blocks_never_move() {
    let pool = pool();
    let s = pool.new_stream().unwrap();
    // Plain blocks and raw pointers interleaved with movable ones.
    let mut plain = Vec::new();
    let mut raw = Vec::new();
    let mut mv = Vec::new();
    for i in 0..300 {
        let b = pool.alloc_movable(size_of(i), &s).unwrap();
        touch(&pool, &b, &s, i as u64, true);
        if i % 3 == 0 {
            mv.push((b, i as u64));
        }
        if i % 10 == 0 {
            plain.push(pool.alloc(size_of(i), &s).unwrap());
            raw.push(pool.alloc_raw(size_of(i + 1), &s).unwrap());
        }
    }
    let big = pool.alloc_movable(3 << 20, &s).unwrap();
    assert!(!big.is_movable());
    let big_addr = big.pin(&s).ptr().addr();
    let plain_addrs: Vec<u64> = plain.iter().map(|b| b.ptr().addr()).collect();
    sync(&pool, &s);
    // Pin every 25th survivor across the passes.
    let pins: Vec<_> = mv.iter().step_by(25).map(|(b, _)| b.pin(&s)).collect();
    let pinned_addrs: Vec<u64> = pins.iter().map(|p| p.ptr().addr()).collect();
    let mut moved = 0;
    for _ in 0..10 {
        moved += pool
            .compact(CompactOptions::default())
            .unwrap()
            .blocks_moved;
    }
    assert!(moved > 0);
    for (p, a) in pins.iter().zip(&pinned_addrs) {
        assert_eq!(p.ptr().addr(), *a);
    }
    for (i, (b, _)) in mv.iter().step_by(25).enumerate() {
        assert_eq!(
            b.pin(&s).ptr().addr(),
            pinned_addrs[i],
            "pinned block moved"
        );
    }
    assert_eq!(big.pin(&s).ptr().addr(), big_addr);
    for (b, a) in plain.iter().zip(&plain_addrs) {
        assert_eq!(b.ptr().addr(), *a);
    }
    for &r in &raw {
        assert!(pool.raw_size(r).is_some());
    }
    drop(pins);
    for (b, seed) in &mv {
        touch(&pool, b, &s, *seed, false);
    }
    sync(&pool, &s);
    assert_eq!(sim(&pool).integrity_errors(0), 0);
    for r in raw {
        pool.free_raw(r, &s).unwrap();
    }
    drop(plain);
    pool.audit().unwrap();
}

/// A pass slowed down by the simulator's per-operation delay, so that pins,
/// frees and allocations land while it is in flight.
fn slow_pool() -> DevicePool {
    pool()
}

fn start_slow_pass(pool: &DevicePool) -> gpupool::CompactReport {
    let r = start_pass_still_slow(pool);
    sim(pool).set_op_delay(0, Duration::ZERO).unwrap();
    r
}

/// Starts a pass with every device operation delayed by 30 ms and leaves
/// the delay on: the caller turns it off (`set_op_delay(0, ZERO)`) once
/// what must happen during the pass has happened, so that a loaded
/// machine cannot let the pass commit first.
fn start_pass_still_slow(pool: &DevicePool) -> gpupool::CompactReport {
    sim(pool)
        .set_op_delay(0, Duration::from_millis(30))
        .unwrap();
    let r = pool
        .compact(CompactOptions {
            wait: false,
            ..CompactOptions::default()
        })
        .unwrap();
    assert!(r.in_flight && r.blocks_planned > 0, "{r:?}");
    r
}

/// Waits (maintain, without blocking) until the pass in flight committed;
/// returns the totals it added.
fn finish(pool: &DevicePool, before: CompactTotals) -> CompactTotals {
    let deadline = Instant::now() + Duration::from_secs(20);
    while pool.compact_totals().passes == before.passes {
        assert!(Instant::now() < deadline, "the pass never committed");
        std::thread::sleep(Duration::from_millis(2));
        pool.maintain();
    }
    let t = pool.compact_totals();
    CompactTotals {
        passes: t.passes - before.passes,
        bytes_moved: t.bytes_moved - before.bytes_moved,
        blocks_moved: t.blocks_moved - before.blocks_moved,
        moves_cancelled: t.moves_cancelled - before.moves_cancelled,
        regions_released: t.regions_released - before.regions_released,
    }
}

#[test]
fn a_pin_during_a_pass_cancels_that_move_and_sees_the_old_address() {
    let pool = slow_pool();
    let s = pool.new_stream().unwrap();
    let live = fragmented(&pool, &s, 200);
    sync(&pool, &s);
    let addrs: Vec<u64> = live.iter().map(|(b, _)| b.pin(&s).ptr().addr()).collect();
    let t0 = pool.compact_totals();
    let planned = start_slow_pass(&pool).blocks_planned;
    // Pin everything while the moves are queued; rewrite each block under
    // its pin (a new pattern, at the old address).
    let pins: Vec<_> = live.iter().map(|(b, _)| b.pin(&s)).collect();
    for (p, a) in pins.iter().zip(&addrs) {
        assert_eq!(
            p.ptr().addr(),
            *a,
            "a pin during a pass sees the old address"
        );
    }
    for (i, ((b, _), p)) in live.iter().zip(&pins).enumerate() {
        sim(&pool)
            .launch_write_pattern(
                0,
                s.handle(),
                p.ptr(),
                b.size() as u64,
                5000 + i as u64,
                Duration::ZERO,
            )
            .unwrap();
    }
    drop(pins);
    let c = finish(&pool, t0);
    assert_eq!(c.moves_cancelled, planned);
    assert_eq!(c.blocks_moved, 0);
    pool.audit().unwrap();
    for (i, (b, _)) in live.iter().enumerate() {
        assert_eq!(b.pin(&s).ptr().addr(), addrs[i]);
        touch(&pool, b, &s, 5000 + i as u64, false);
    }
    sync(&pool, &s);
    assert_eq!(sim(&pool).integrity_errors(0), 0);
    // Nothing pinned now: a new pass moves them, preserving the new data.
    let r = pool.compact(CompactOptions::default()).unwrap();
    assert!(r.blocks_moved > 0);
    for (i, (b, _)) in live.iter().enumerate() {
        touch(&pool, b, &s, 5000 + i as u64, false);
    }
    sync(&pool, &s);
    assert_eq!(sim(&pool).integrity_errors(0), 0);
    pool.audit().unwrap();
}

#[test]
fn frees_and_allocations_during_a_pass_keep_the_pool_consistent() {
    let pool = slow_pool();
    let s = pool.new_stream().unwrap();
    let mut live = fragmented(&pool, &s, 300);
    sync(&pool, &s);
    let t0 = pool.compact_totals();
    let planned = start_pass_still_slow(&pool).blocks_planned;
    // Free a third of the blocks (some are being moved), allocate new ones
    // (they must not land on reserved destinations or closed regions).
    // Every third block across the whole list: which blocks a pass plans
    // varies from run to run, and a spread-out third always meets it.
    let (freed, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut live)
        .into_iter()
        .enumerate()
        .partition(|(i, _)| i % 3 == 0);
    live = kept.into_iter().map(|(_, b)| b).collect();
    drop(freed);
    sim(&pool).set_op_delay(0, Duration::ZERO).unwrap();
    let mut fresh = Vec::new();
    for i in 0..100 {
        let b = pool.alloc_movable(size_of(i + 7), &s).unwrap();
        touch(&pool, &b, &s, 9000 + i as u64, true);
        fresh.push((b, 9000 + i as u64));
    }
    pool.audit().unwrap();
    let c = finish(&pool, t0);
    assert!(
        c.moves_cancelled > 0 && c.moves_cancelled < planned,
        "{c:?}"
    );
    assert_eq!(c.blocks_moved + c.moves_cancelled, planned);
    pool.audit().unwrap();
    for (b, seed) in live.iter().chain(&fresh) {
        touch(&pool, b, &s, *seed, false);
    }
    sync(&pool, &s);
    assert_eq!(sim(&pool).integrity_errors(0), 0);
    assert_eq!(sim(&pool).device_faults(0), 0);
    drop(live);
    drop(fresh);
    pool.trim().unwrap();
    let st = pool.audit().unwrap();
    assert_eq!(st.requested_bytes.current, 0);
    assert_eq!(st.reserved_bytes.current, 0);
}

#[test]
fn concurrent_traffic_on_several_streams_during_passes_loses_no_byte() {
    let pool = pool();
    let main = pool.new_stream().unwrap();
    let shared = fragmented(&pool, &main, 300);
    sync(&pool, &main);
    let stop = AtomicBool::new(false);
    std::thread::scope(|sc| {
        for t in 0..3u64 {
            let (pool, shared, stop) = (&pool, &shared, &stop);
            sc.spawn(move || {
                let s = pool.new_stream().unwrap();
                let mut mine: Vec<(MovableBlock<'_>, u64)> = Vec::new();
                let mut n = 0u64;
                while !stop.load(Relaxed) {
                    n += 1;
                    let seed = t << 40 | n;
                    match n % 7 {
                        0..=2 if mine.len() < 40 => {
                            let b = pool
                                .alloc_movable(size_of(n as usize + t as usize), &s)
                                .unwrap();
                            touch(pool, &b, &s, seed, true);
                            mine.push((b, seed));
                        }
                        3 | 4 if !mine.is_empty() => {
                            let (b, sd) = mine.swap_remove((n as usize * 31) % mine.len());
                            touch(pool, &b, &s, sd, false);
                        }
                        5 => {
                            let (b, sd) = &shared[(n as usize * 17) % shared.len()];
                            touch(pool, b, &s, *sd, false);
                        }
                        _ => std::thread::sleep(Duration::from_micros(200)),
                    }
                    if n % 16 == 0 {
                        // Keep the queue short (the host must not run
                        // unboundedly ahead of the device).
                        sync(pool, &s);
                    }
                }
                for (b, sd) in &mine {
                    touch(pool, b, &s, *sd, false);
                }
                sync(pool, &s);
            });
        }
        let mut moved = 0;
        let mut passes = 0;
        let t0 = Instant::now();
        while passes < 40 && t0.elapsed() < Duration::from_secs(30) {
            let r = pool
                .compact(CompactOptions {
                    max_blocks: 16,
                    wait: passes % 2 == 0,
                    ..CompactOptions::default()
                })
                .unwrap();
            moved += r.blocks_moved;
            passes += 1;
            std::thread::sleep(Duration::from_millis(1));
        }
        stop.store(true, Relaxed);
        assert!(moved > 0);
    });
    for (b, seed) in &shared {
        touch(&pool, b, &main, *seed, false);
    }
    sync(&pool, &main);
    assert_eq!(sim(&pool).integrity_errors(0), 0);
    assert_eq!(sim(&pool).device_faults(0), 0);
    pool.compact(CompactOptions::default()).unwrap();
    pool.audit().unwrap();
}

#[test]
fn idle_maintain_runs_passes_until_compact_then_stops() {
    let cfg = PoolConfig {
        idle: Some(Duration::from_millis(5)),
        compact_max_blocks: 24,
        ..PoolConfig::default()
    };
    let pool = pool_with(cfg, SimConfig::default());
    let s = pool.new_stream().unwrap();
    let live = fragmented(&pool, &s, 300);
    sync(&pool, &s);
    let before = pool.stats().reserved_bytes.current;
    // Traffic resets the clock: no pass right after an allocation.
    assert!(pool
        .maintain()
        .compaction
        .is_none_or(|c| c.blocks_planned == 0));
    let deadline = Instant::now() + Duration::from_secs(20);
    let (mut moved, mut quiet) = (0, 0);
    let host_syncs = pool.stats().host_syncs;
    while quiet < 20 {
        assert!(Instant::now() < deadline, "idle compaction never settled");
        std::thread::sleep(Duration::from_millis(2));
        match pool.maintain().compaction {
            Some(c) => {
                moved += c.blocks_moved;
                quiet = 0;
            }
            None => quiet += 1,
        }
    }
    assert!(moved > 24, "several bounded passes ran: {moved}");
    assert!(pool.stats().reserved_bytes.current < before);
    // maintain never blocked the host on the device.
    assert_eq!(pool.stats().host_syncs, host_syncs);
    let passes = pool.compact_totals().passes;
    for _ in 0..10 {
        std::thread::sleep(Duration::from_millis(2));
        assert!(pool.maintain().compaction.is_none());
    }
    assert_eq!(
        pool.compact_totals().passes,
        passes,
        "no passes once compact"
    );
    for (b, seed) in &live {
        touch(&pool, b, &s, *seed, false);
    }
    sync(&pool, &s);
    assert_eq!(sim(&pool).integrity_errors(0), 0);
    pool.audit().unwrap();
}

#[test]
fn fragmentation_workload_reaches_the_ratio_with_no_integrity_error() {
    let r = fragment::run(&FragmentOptions {
        capacity_bytes: 2 << 30,
        blocks: 6000,
        passes: 60,
        pass_blocks: 64,
        load_threads: 2,
        ..FragmentOptions::default()
    })
    .unwrap();
    eprintln!("{}", serde_json::to_string_pretty(&r).unwrap());
    assert_eq!(r.integrity_errors, 0);
    assert_eq!(r.device_faults, 0);
    assert_eq!(r.audit_error, None);
    assert!(r.before.ratio > 1.5, "fragmenting worked: {:?}", r.before);
    assert!(r.after.ratio <= 1.10, "after compaction: {:?}", r.after);
    assert!(r.passes > 0 && r.bytes_moved > 0);
}

// ---- model test ---------------------------------------------------------------------

mod model {
    use super::*;
    use proptest::prelude::*;

    const STREAMS: usize = 3;

    #[derive(Debug, Clone)]
    enum Op {
        /// Allocate (sizes up to 160 KiB; now and then one too large for
        /// the arena, which must never move).
        Alloc {
            size: u32,
            stream: u8,
        },
        /// Allocate `n` blocks of 8..=104 KiB (fills several regions).
        Burst {
            n: u8,
            stream: u8,
        },
        Free(u16),
        /// Free every `k`-th live block (fragments the regions).
        Thin(u8),
        /// Pin on a stream, enqueue a delayed write of a new pattern (or a
        /// verify of the current one), unpin.
        Touch {
            pick: u16,
            stream: u8,
            write: bool,
        },
        RecordStream(u16, u8),
        /// Hold pins on the picked blocks across a pass (after waiting for
        /// every stream, with `idle`, as at the end of a step).
        Compact {
            pins: Vec<u16>,
            wait: bool,
            max_blocks: u8,
            idle: bool,
        },
        Maintain,
        /// Wait for every stream (no pass left unfinished either).
        Sync,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (1u32..160 << 10, 0..STREAMS as u8).prop_map(|(size, stream)| Op::Alloc { size, stream }),
            1 => (700u32 << 10..900 << 10, 0..STREAMS as u8).prop_map(|(size, stream)| Op::Alloc { size, stream }),
            2 => (10u8..60, 0..STREAMS as u8).prop_map(|(n, stream)| Op::Burst { n, stream }),
            3 => any::<u16>().prop_map(Op::Free),
            2 => (2u8..5).prop_map(Op::Thin),
            3 => (any::<u16>(), 0..STREAMS as u8, any::<bool>())
                .prop_map(|(pick, stream, write)| Op::Touch { pick, stream, write }),
            1 => (any::<u16>(), 0..STREAMS as u8).prop_map(|(p, s)| Op::RecordStream(p, s)),
            3 => (prop::collection::vec(any::<u16>(), 0..3), any::<bool>(), 1u8..40, any::<bool>())
                .prop_map(|(pins, wait, max_blocks, idle)| Op::Compact { pins, wait, max_blocks, idle }),
            2 => Just(Op::Maintain),
            1 => Just(Op::Sync),
        ]
    }

    struct Live<'a> {
        b: MovableBlock<'a>,
        seed: u64,
        stream: usize,
    }

    /// Orders `to`'s later work after `from`'s work so far (device side).
    fn order(pool: &DevicePool, from: &Stream, to: &Stream) {
        if from.handle() == to.handle() {
            return;
        }
        let be = pool.backend();
        let ev = be.create_event(0).unwrap();
        be.record_event(0, ev, from.handle()).unwrap();
        be.stream_wait_event(0, to.handle(), ev).unwrap();
        be.destroy_event(0, ev).unwrap();
    }

    fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
        let pool = pool_with(
            PoolConfig::default(),
            SimConfig {
                capacity_bytes: 256 << 20,
                ..SimConfig::default()
            },
        );
        let streams: Vec<Stream> = (0..STREAMS).map(|_| pool.new_stream().unwrap()).collect();
        let mut live: Vec<Live<'_>> = Vec::new();
        let mut next_seed = 1u64;
        for op in ops {
            match op {
                Op::Alloc { size, stream } => {
                    let s = &streams[stream as usize];
                    let b = pool.alloc_movable(size as usize, s).unwrap();
                    next_seed += 1;
                    touch(&pool, &b, s, next_seed, true);
                    live.push(Live {
                        b,
                        seed: next_seed,
                        stream: stream as usize,
                    });
                }
                Op::Burst { n, stream } => {
                    let s = &streams[stream as usize];
                    for k in 0..n as usize {
                        let size = (8 + (next_seed as usize * 7 + k * 13) % 97) * KIB;
                        let b = pool.alloc_movable(size, s).unwrap();
                        next_seed += 1;
                        touch(&pool, &b, s, next_seed, true);
                        live.push(Live {
                            b,
                            seed: next_seed,
                            stream: stream as usize,
                        });
                    }
                }
                Op::Thin(k) => {
                    let mut i = 0;
                    live.retain(|l| {
                        i += 1;
                        if i % k as usize == 0 {
                            touch(&pool, &l.b, l.b.stream(), l.seed, false);
                            false
                        } else {
                            true
                        }
                    });
                }
                Op::Free(p) if !live.is_empty() => {
                    let i = p as usize % live.len();
                    let l = live.swap_remove(i);
                    // Verify before the free, on the block's own stream: a
                    // free is ordered after it.
                    touch(&pool, &l.b, l.b.stream(), l.seed, false);
                }
                Op::Touch {
                    pick,
                    stream,
                    write,
                } if !live.is_empty() => {
                    let i = pick as usize % live.len();
                    // A write on another stream than the last writer's must
                    // be ordered after it: use the block's own stream.
                    let s = &streams[if write {
                        live[i].stream
                    } else {
                        stream as usize
                    }];
                    if write {
                        next_seed += 1;
                        live[i].seed = next_seed;
                    }
                    // A verify on another stream is ordered after the
                    // block's last write, and the block's later work after it.
                    let own = &streams[live[i].stream];
                    order(&pool, own, s);
                    touch(&pool, &live[i].b, s, live[i].seed, write);
                    order(&pool, s, own);
                }
                Op::RecordStream(p, s) if !live.is_empty() => {
                    let i = p as usize % live.len();
                    live[i].b.record_stream(&streams[s as usize]);
                }
                Op::Compact {
                    pins,
                    wait,
                    max_blocks,
                    idle,
                } => {
                    if idle {
                        for s in &streams {
                            sync(&pool, s);
                        }
                    }
                    let picked: Vec<usize> = if live.is_empty() {
                        Vec::new()
                    } else {
                        pins.iter().map(|&p| p as usize % live.len()).collect()
                    };
                    let held: Vec<_> = picked.iter().map(|&i| live[i].b.pin(&streams[0])).collect();
                    let at: Vec<u64> = held.iter().map(|p| p.ptr().addr()).collect();
                    let r = pool
                        .compact(CompactOptions {
                            max_blocks: max_blocks as usize,
                            wait,
                            ..CompactOptions::default()
                        })
                        .unwrap();
                    prop_assert!(r.blocks_planned <= max_blocks as u64);
                    if wait {
                        prop_assert!(!r.in_flight);
                    }
                    for (&i, a) in picked.iter().zip(&at) {
                        let again = live[i].b.pin(&streams[1]).ptr().addr();
                        prop_assert_eq!(again, *a, "a pinned block moved");
                    }
                    drop(held);
                }
                Op::Maintain => {
                    pool.maintain();
                }
                Op::Sync => {
                    for s in &streams {
                        sync(&pool, s);
                    }
                    // Finish any pass in flight, then check that live
                    // blocks are disjoint.
                    pool.compact(CompactOptions {
                        max_blocks: 0,
                        ..CompactOptions::default()
                    })
                    .unwrap();
                    let mut spans: Vec<(u64, u64)> = live
                        .iter()
                        .map(|l| (l.b.pin(&streams[0]).ptr().addr(), l.b.size() as u64))
                        .collect();
                    spans.sort_unstable();
                    for w in spans.windows(2) {
                        prop_assert!(w[0].0 + w[0].1 <= w[1].0, "live blocks overlap: {:?}", w);
                    }
                }
                _ => {}
            }
            let st = pool.audit().map_err(TestCaseError::fail)?;
            let want: u64 = live.iter().map(|l| l.b.size() as u64).sum();
            prop_assert_eq!(st.requested_bytes.current, want);
        }
        for l in &live {
            touch(&pool, &l.b, l.b.stream(), l.seed, false);
        }
        for s in &streams {
            sync(&pool, s);
        }
        prop_assert_eq!(sim(&pool).integrity_errors(0), 0);
        prop_assert_eq!(sim(&pool).device_faults(0), 0);
        if std::env::var_os("MODEL_TRACE").is_some() {
            eprintln!("{:?}", pool.compact_totals());
        }
        drop(live);
        pool.trim().unwrap();
        let st = pool.audit().map_err(TestCaseError::fail)?;
        prop_assert_eq!(st.requested_bytes.current, 0);
        prop_assert_eq!(
            st.reserved_bytes.current,
            0,
            "{:?} {:?}",
            pool.movable_usage(),
            pool.snapshot()
                .segments
                .iter()
                .map(|s| (s.address, s.total_size, s.allocated_size))
                .collect::<Vec<_>>()
        );
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(24),
            ..ProptestConfig::default()
        })]

        #[test]
        fn movable_ops_against_the_model(ops in prop::collection::vec(op(), 1..80)) {
            run(ops)?;
        }
    }
}
