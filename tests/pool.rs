//! DevicePool behaviour on the simulator: the public contract, stream order,
//! stitching, out-of-memory, bad input, stats and trimming.

use gpupool::backend::sim::{SimBackend, SimConfig};
use gpupool::backend::Backend;
use gpupool::pool::BlockState;
use gpupool::{BackendKind, DevicePool, DevicePtr, Error, PoolConfig, Runtime};
use std::sync::Arc;
use std::time::Duration;

const MIB: u64 = 1 << 20;

fn sim_runtime(devices: usize, capacity: u64) -> Runtime {
    Runtime::builder()
        .backend(BackendKind::Sim(SimConfig {
            devices,
            capacity_bytes: capacity,
            ..Default::default()
        }))
        // These tests check harvesting and pending bytes exactly: no
        // background harvester (tests/maintenance.rs covers it).
        .maintenance(false)
        .build()
        .unwrap()
}

/// One 256 MiB simulated device with pool configuration `conf`, no
/// background harvester.
fn sim_runtime_with(conf: &str) -> Runtime {
    Runtime::builder()
        .backend(BackendKind::Sim(SimConfig {
            capacity_bytes: 256 * MIB,
            ..Default::default()
        }))
        .config(PoolConfig::parse(conf).unwrap())
        .maintenance(false)
        .build()
        .unwrap()
}

/// Pool configuration for the promise and probe tests: no thread cache,
/// no handover, and a probe interval (1 s) no test outlasts, so that a
/// stream gets a probe only when it was quiet or a pass needs one.
const PROBES_ON_DEMAND: &str = "thread_cache=false,handover=false,probe_interval_us=1000000";

/// Counts the event records `pool`'s backend makes from its creation on.
struct RecordsSince<'a> {
    pool: &'a DevicePool,
    start: u64,
}

impl<'a> RecordsSince<'a> {
    fn now(pool: &'a DevicePool) -> Self {
        RecordsSince {
            pool,
            start: Self::total(pool),
        }
    }

    fn total(pool: &DevicePool) -> u64 {
        pool.backend()
            .counters()
            .get(gpupool::backend::Call::EventRecord)
    }

    fn count(&self) -> u64 {
        Self::total(self.pool) - self.start
    }
}

fn sim_of(pool: &DevicePool) -> &SimBackend {
    pool.backend()
        .as_any()
        .downcast_ref::<SimBackend>()
        .expect("simulator")
}

/// Holds a stream busy (a stall) so that events recorded on it cannot
/// complete: a check that another stream never gets memory freed on it
/// is then free of the race with an idle stream's flush completing (after
/// which taking the memory is correct).
struct Busy<'a> {
    sim: &'a SimBackend,
    stream: gpupool::StreamHandle,
    behind: gpupool::EventHandle,
}

impl<'a> Busy<'a> {
    fn hold(sim: &'a SimBackend, stream: &gpupool::Stream) -> Self {
        sim.stall_stream(0, stream.handle(), Duration::from_secs(2))
            .unwrap();
        let behind = sim.create_event(0).unwrap();
        sim.record_event(0, behind, stream.handle()).unwrap();
        Busy {
            sim,
            stream: stream.handle(),
            behind,
        }
    }

    /// Asserts the stall outlasted the checks, then waits it out.
    fn release(self) {
        assert!(
            !self.sim.query_event(0, self.behind).unwrap(),
            "the stall ended before the last check: the checks proved nothing"
        );
        self.sim.sync_stream(0, self.stream).unwrap();
        self.sim.destroy_event(0, self.behind).unwrap();
    }
}

fn three_streams(dev: &DevicePool) -> (gpupool::Stream, gpupool::Stream, gpupool::Stream) {
    (
        dev.new_stream().unwrap(),
        dev.new_stream().unwrap(),
        dev.new_stream().unwrap(),
    )
}

#[test]
fn the_design_contract_example_runs() {
    let rt = Runtime::builder()
        .backend(BackendKind::Sim(SimConfig {
            devices: 4,
            ..Default::default()
        }))
        .config(PoolConfig::default())
        .build()
        .unwrap();
    assert_eq!(rt.device_count(), 4);
    let dev = rt.device(0).unwrap();
    let s = dev.new_stream().unwrap();
    let s2 = dev.new_stream().unwrap();
    let b = dev.alloc(1 << 20, &s).unwrap();
    assert_eq!(b.size(), 1 << 20);
    assert_eq!(b.ptr().addr() % 256, 0);
    b.record_stream(&s2);
    let p2 = dev.alloc_raw(4096, &s).unwrap();
    dev.free_raw(p2, &s).unwrap();
    drop(b);
    let st = dev.stats();
    assert_eq!(st.num_allocs, 2);
    assert_eq!(st.num_frees, 2);
    assert_eq!(st.requested_bytes.current, 0);
    assert_eq!(st.requested_bytes.peak, (1 << 20) + 4096);
    assert!(rt.trim().unwrap() > 0);
    assert_eq!(dev.stats().reserved_bytes.current, 0);
    assert!(matches!(rt.device(4), Err(Error::InvalidDevice { .. })));
}

#[test]
fn blocks_are_aligned_disjoint_and_hold_data() {
    let rt = sim_runtime(1, 512 * MIB);
    let dev = rt.device(0).unwrap();
    let s = dev.new_stream().unwrap();
    let sizes = [
        1usize,
        255,
        256,
        257,
        1000,
        4096,
        70_000,
        256 << 10,
        (256 << 10) + 1,
        3 << 20,
        17 << 20,
    ];
    let blocks: Vec<_> = sizes.iter().map(|&n| dev.alloc(n, &s).unwrap()).collect();
    let mut spans: Vec<(u64, u64)> = blocks
        .iter()
        .map(|b| (b.ptr().addr(), b.size() as u64))
        .collect();
    spans.sort();
    for w in spans.windows(2) {
        assert!(w[0].0 + w[0].1 <= w[1].0, "blocks overlap: {w:?}");
    }
    let be = dev.backend();
    for (i, b) in blocks.iter().enumerate() {
        assert_eq!(b.ptr().addr() % 256, 0);
        let data = vec![i as u8 + 1; b.size()];
        be.copy_from_host(0, b.ptr(), &data).unwrap();
    }
    for (i, b) in blocks.iter().enumerate() {
        let mut back = vec![0u8; b.size()];
        be.copy_to_host(0, b.ptr(), &mut back).unwrap();
        assert!(
            back.iter().all(|&x| x == i as u8 + 1),
            "block {i} was overwritten"
        );
    }
    dev.audit().unwrap();
}

/// Memory freed on s1 is reused on s1 at once; while s1 still has work
/// queued, s2 never gets it. (Once s1's work is complete, s2 may take it:
/// the slow path flushes s1's freed memory with an event and harvests it
/// when that event completes. An idle s1 makes that a race, so s1 is held
/// busy by a stall for the whole test.)
#[test]
fn a_block_freed_on_its_stream_is_reused_at_once_there() {
    let rt = sim_runtime(1, 256 * MIB);
    let dev = rt.device(0).unwrap();
    let (s1, s2) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
    let busy = Busy::hold(sim_of(dev), &s1);
    for size in [512usize, 100_000, 5 << 20] {
        let p = dev.alloc(size, &s1).unwrap().ptr();
        let again = dev.alloc(size, &s1).unwrap();
        assert_eq!(again.ptr(), p, "same-stream reuse of {size} B");
        // Another stream must not get memory still dirty on s1.
        let other = dev.alloc(size, &s2).unwrap();
        assert_ne!(other.ptr(), p);
        drop(again);
        let other2 = dev.alloc(size, &s2).unwrap();
        assert_ne!(
            other2.ptr(),
            p,
            "s2 took memory freed on s1 while s1 still had work queued"
        );
    }
    busy.release();
    dev.audit().unwrap();
}

/// A loop that repeats (a training step, a server's request) pays the
/// slow paths on its first pass only when it runs on one stream: later
/// passes are served from the stream's own caches
/// (`PoolStats::num_*_slow_paths`). On two idle streams taking turns, the
/// streams share one set of memory instead of holding one each: each
/// pass, each stream's first large request takes the slow path once
/// (the other stream's parked ranges, clean since it is idle), with no
/// growth, no reclaim and no small slow path.
#[test]
fn a_repeating_loop_takes_slow_paths_only_to_share_memory_once_warm() {
    let rt = sim_runtime(1, 256 * MIB);
    let dev = rt.device(0).unwrap();
    let (s1, s2) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
    let pass = |streams: &[&gpupool::Stream]| {
        for s in streams {
            let blocks: Vec<_> = [4096usize, 100_000, 5 << 20, 12 << 20, 4096, 3 << 20]
                .into_iter()
                .map(|size| dev.alloc(size, s).unwrap())
                .collect();
            drop(blocks);
        }
    };
    pass(&[&s1]);
    let cold = dev.stats();
    assert!(
        cold.num_small_slow_paths > 0 && cold.num_large_slow_paths > 0,
        "the cold pass made slabs and grew: {cold:?}"
    );
    for _ in 0..50 {
        pass(&[&s1]);
    }
    let warm = dev.stats();
    assert_eq!(warm.num_small_slow_paths, cold.num_small_slow_paths);
    assert_eq!(warm.num_large_slow_paths, cold.num_large_slow_paths);
    assert_eq!(warm.num_reclaims, cold.num_reclaims);
    assert_eq!(warm.num_device_allocs, cold.num_device_allocs);
    // Two streams: two passes to settle who holds what, then 50 that
    // neither grow nor reclaim.
    pass(&[&s1, &s2]);
    pass(&[&s1, &s2]);
    let cold = dev.stats();
    for _ in 0..50 {
        pass(&[&s1, &s2]);
    }
    let warm = dev.stats();
    assert_eq!(warm.num_device_allocs, cold.num_device_allocs);
    assert_eq!(warm.reserved_bytes.current, cold.reserved_bytes.current);
    assert_eq!(warm.num_reclaims, cold.num_reclaims);
    assert_eq!(warm.num_small_slow_paths, cold.num_small_slow_paths);
    let large = warm.num_large_slow_paths - cold.num_large_slow_paths;
    assert!(large <= 2 * 50, "{large} large slow paths in 50 passes");
    dev.audit().unwrap();
}

/// A large request that its stream's memory does not serve, while another
/// (busy) stream holds enough dirty memory, takes the slow path and runs
/// one reclaim, which flushes that memory for every stream; the request,
/// which cannot wait on a stalled stream, grows the device instead.
#[test]
fn a_large_miss_beside_another_streams_dirty_memory_reclaims_once() {
    let rt = sim_runtime(1, 256 * MIB);
    let dev = rt.device(0).unwrap();
    let (s1, s2) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
    drop(dev.alloc(8 << 20, &s1).unwrap());
    let busy = Busy::hold(sim_of(dev), &s1);
    let before = dev.stats();
    let b = dev.alloc(8 << 20, &s2).unwrap();
    let after = dev.stats();
    assert_eq!(after.num_large_slow_paths, before.num_large_slow_paths + 1);
    assert_eq!(after.num_reclaims, before.num_reclaims + 1);
    assert_eq!(after.num_small_slow_paths, before.num_small_slow_paths);
    assert!(
        after.num_device_allocs > before.num_device_allocs,
        "{after:?}"
    );
    assert!(
        after.pending_bytes.current >= 8 << 20,
        "s1's range was flushed"
    );
    let flat = after.memory_stats();
    assert_eq!(flat["num_reclaims"], after.num_reclaims);
    assert_eq!(flat["num_large_slow_paths"], after.num_large_slow_paths);
    assert_eq!(flat["num_small_slow_paths"], after.num_small_slow_paths);
    drop(b);
    busy.release();
    dev.audit().unwrap();
}

/// A large block freed on its stream is parked whole and serves the next
/// request of its size class on that stream (up to 1/64 shorter) without a
/// heap search; the block keeps the whole range, the stats count it, and
/// another stream does not take it.
#[test]
fn parked_ranges_serve_slightly_shorter_requests_of_their_class() {
    let rt = sim_runtime(1, 256 * MIB);
    let dev = rt.device(0).unwrap();
    let (s1, s2) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
    let busy = Busy::hold(sim_of(dev), &s1);
    // Classes of 1 MiB and up are 16 KiB wide.
    let big = (MIB + 12 * 1024) as usize;
    let p = dev.alloc(big, &s1).unwrap().ptr();
    let allocated_before = dev.stats().allocated_bytes.current;
    let shorter = dev.alloc(MIB as usize, &s1).unwrap();
    assert_eq!(shorter.ptr(), p, "a shorter request of the class reuses it");
    assert_eq!(shorter.size(), MIB as usize, "size() is the requested size");
    let st = dev.stats();
    assert_eq!(st.requested_bytes.current, MIB);
    assert_eq!(
        st.allocated_bytes.current - allocated_before,
        big as u64,
        "the block holds the whole parked range"
    );
    dev.audit().unwrap();
    drop(shorter);
    let other = dev.alloc(MIB as usize, &s2).unwrap();
    assert_ne!(other.ptr(), p, "another stream never takes a parked range");
    busy.release();
    drop(other);
    dev.audit().unwrap();
    assert_eq!(dev.stats().requested_bytes.current, 0);
}

/// A parked range taken back by a raw allocation is listed late (the
/// stream's live index logs inserts and makes them in a batch): snapshots,
/// raw frees, raw sizes and the audit must still see every block as it is
/// now, across the log's batch size and after parked ranges go back to the
/// heap. Typed blocks are not listed: a snapshot shows their range.
#[test]
fn raw_blocks_listed_late_are_seen_by_snapshots_raw_frees_and_the_audit() {
    let rt = sim_runtime(1, 1024 * MIB);
    let dev = rt.device(0).unwrap();
    let s = dev.new_stream().unwrap();
    // Later requests are a little shorter than the ranges parked before
    // them, so parking serves them.
    let base = 600 * 1024;
    let requested_at = |addr: u64| {
        dev.snapshot()
            .segments
            .iter()
            .flat_map(|g| &g.blocks)
            .find(|b| b.address == addr && b.state == BlockState::ActiveAllocated)
            .map(|b| b.requested_size)
    };

    // A raw block freed, its range parked, then taken back by a block:
    // the range is a block now, neither a raw allocation nor a freed one.
    let raw = dev.alloc_raw(base + 8192, &s).unwrap();
    dev.free_raw(raw, &s).unwrap();
    assert_eq!(dev.raw_size(raw), None, "freed");
    let b = dev.alloc(base + 100, &s).unwrap();
    assert_eq!(b.ptr(), raw, "the parked range is reused");
    dev.audit().unwrap();
    assert_eq!(requested_at(raw.addr()), Some(base as u64 + 8192));
    assert!(matches!(
        dev.free_raw(raw, &s),
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!(dev.raw_size(raw), None, "a block has no raw size");
    dev.audit().unwrap();

    // The block's range taken back by a raw allocation: raw again, freed
    // once, then a double free.
    drop(b);
    let raw2 = dev.alloc_raw(base + 200, &s).unwrap();
    assert_eq!(raw2, raw, "the parked range is reused");
    assert_eq!(dev.raw_size(raw2), Some(base as u64 + 200));
    dev.record_stream_raw(raw2, &s).unwrap();
    dev.audit().unwrap();
    dev.free_raw(raw2, &s).unwrap();
    assert!(matches!(
        dev.free_raw(raw2, &s),
        Err(Error::DoubleFree { .. })
    ));

    // A block on a parked range freed across streams (its free waits on
    // events) goes to the heap, not to the parking lists.
    let s2 = dev.new_stream().unwrap();
    let c = dev.alloc(base + 300, &s).unwrap();
    let at = c.ptr();
    drop(c);
    let d = dev.alloc(base + 200, &s).unwrap();
    assert_eq!(d.ptr(), at, "the parked range is reused");
    d.record_stream(&s2);
    drop(d);
    dev.audit().unwrap();
    dev.harvest();

    // Many more parked hits than the log holds (raw allocations, the
    // sizes shrinking a little every round): each snapshot, raw size and
    // audit sees the latest sizes.
    let n = 400;
    let size = |i: usize, round: usize| base + 8192 + i * 512 - round * 16;
    let free_all = |ptrs: &[(DevicePtr, usize)]| {
        for &(p, _) in ptrs {
            dev.free_raw(p, &s).unwrap();
        }
    };
    let alloc_all = |round: usize| -> Vec<(DevicePtr, usize)> {
        (0..n)
            .map(|i| (dev.alloc_raw(size(i, round), &s).unwrap(), size(i, round)))
            .collect()
    };
    let mut ptrs = alloc_all(0);
    let mut reused = 0;
    for round in 1..=8 {
        let parked: std::collections::HashSet<u64> = ptrs.iter().map(|p| p.0.addr()).collect();
        free_all(&ptrs);
        ptrs = alloc_all(round);
        reused += ptrs.iter().filter(|p| parked.contains(&p.0.addr())).count();
        if round % 3 == 0 {
            for &(p, n) in &ptrs {
                assert_eq!(dev.raw_size(p), Some(n as u64));
                assert_eq!(requested_at(p.addr()), Some(n as u64));
            }
            dev.audit().unwrap();
        }
    }
    assert!(
        reused >= 2400,
        "{reused} of 3200 allocations took a parked range"
    );
    // A request no parked range fits gives the parked ranges back to the
    // heap; the listed blocks stay as they are.
    let (half, rest) = ptrs.split_at(n / 2);
    free_all(half);
    let big = dev.alloc(64 * MIB as usize, &s).unwrap();
    dev.audit().unwrap();
    for &(p, n) in rest {
        assert_eq!(requested_at(p.addr()), Some(n as u64));
    }
    drop(big);
    free_all(rest);
    assert!(matches!(
        dev.free_raw(rest[0].0, &s),
        Err(Error::DoubleFree { .. })
    ));
    dev.audit().unwrap();
    assert_eq!(dev.stats().requested_bytes.current, 0);
}

/// While the device has room, a stream never waits on another stream's
/// unfinished work: memory freed with `record_stream` and still read by a
/// slow stream is not handed over, the pool grows (`cudaMallocAsync`'s
/// order). At the limit, the large path takes it by handover instead of
/// failing: the taker waits on the free's events on the device, so the
/// bytes the slow stream still reads stay intact.
#[test]
fn pending_memory_is_handed_over_only_when_the_pool_cannot_grow() {
    let rt = sim_runtime(1, 256 * MIB);
    let dev = rt.device(0).unwrap();
    let sim = sim_of(dev);
    let (s1, s2) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
    let size = 3 << 20;
    let b = dev.alloc(size, &s1).unwrap();
    let p = b.ptr();
    sim.launch_write_pattern(0, s1.handle(), p, size as u64, 7, Duration::ZERO)
        .unwrap();
    b.record_stream(&s2);
    // s2 reads the block late, after the free.
    let ev = sim.create_event(0).unwrap();
    sim.record_event(0, ev, s1.handle()).unwrap();
    sim.stream_wait_event(0, s2.handle(), ev).unwrap();
    let check = sim
        .launch_verify_pattern(
            0,
            s2.handle(),
            p,
            size as u64,
            7,
            Duration::from_millis(100),
        )
        .unwrap();
    drop(b);
    let reserved = dev.stats().reserved_bytes.current;
    let handovers = dev.stats().num_handovers;
    // Room to grow: s1 is not tied to s2's late read.
    let grown = dev.alloc(size, &s1).unwrap();
    assert_ne!(grown.ptr(), p, "s1 waited on s2 while the device had room");
    assert_eq!(dev.stats().num_handovers, handovers);
    assert!(dev.stats().reserved_bytes.current > reserved);
    drop(grown);
    // No room: the pending block is handed over.
    let reserved = dev.stats().reserved_bytes.current;
    dev.set_memory_limit(Some(reserved)).unwrap();
    let _fill = dev.alloc(size, &s1).unwrap();
    let x = dev.alloc(size, &s1).unwrap();
    assert_eq!(x.ptr(), p, "the pending block is reused instead of growing");
    assert_eq!(dev.stats().reserved_bytes.current, reserved);
    assert!(dev.stats().num_handovers > handovers);
    // s1 overwrites it: ordered after s2's late read, which still passes.
    sim.launch_write_pattern(0, s1.handle(), x.ptr(), size as u64, 8, Duration::ZERO)
        .unwrap();
    sim.sync_stream(0, s1.handle()).unwrap();
    sim.sync_stream(0, s2.handle()).unwrap();
    assert_eq!(sim.integrity_errors(0), 0);
    let _ = check;
    drop(x);
    dev.audit().unwrap();
}

#[test]
fn adjacent_pending_groups_serve_one_request_at_the_limit() {
    // Two neighbouring blocks freed with record_stream become two pending
    // groups: their free ranges carry different tags and never merge. At
    // the limit, a request for both together must take the run by waiting
    // on both groups on the device, not fail beside it, and its writes
    // must come after the old reads.
    let rt = sim_runtime(1, 256 * MIB);
    let dev = rt.device(0).unwrap();
    let sim = sim_of(dev);
    let (s1, s2, s3) = three_streams(dev);
    let size = 4 << 20;
    let a = dev.alloc(size, &s1).unwrap();
    let b = dev.alloc(size, &s1).unwrap();
    let (pa, pb) = (a.ptr(), b.ptr());
    assert_eq!(pb.addr(), pa.addr() + size as u64, "adjacent blocks");
    for (i, blk) in [&a, &b].into_iter().enumerate() {
        sim.launch_write_pattern(
            0,
            s1.handle(),
            blk.ptr(),
            size as u64,
            i as u64,
            Duration::ZERO,
        )
        .unwrap();
        blk.record_stream(&s2);
    }
    // s2 reads both late, after the frees.
    let ev = sim.create_event(0).unwrap();
    sim.record_event(0, ev, s1.handle()).unwrap();
    sim.stream_wait_event(0, s2.handle(), ev).unwrap();
    for (i, p) in [pa, pb].into_iter().enumerate() {
        sim.launch_verify_pattern(
            0,
            s2.handle(),
            p,
            size as u64,
            i as u64,
            Duration::from_millis(100),
        )
        .unwrap();
    }
    drop(a);
    drop(b);
    let st = dev.stats();
    assert_eq!(st.pending_bytes.current, 2 * size as u64);
    // No room to grow (with room, s3 would grow rather than wait on s2).
    dev.set_memory_limit(Some(st.reserved_bytes.current))
        .unwrap();
    let x = dev.alloc(2 * size, &s3).unwrap();
    assert_eq!(x.ptr(), pa, "the two pending ranges are taken as one");
    assert_eq!(
        dev.stats().reserved_bytes.current,
        st.reserved_bytes.current
    );
    assert!(dev.stats().num_handovers > st.num_handovers);
    sim.launch_write_pattern(0, s3.handle(), x.ptr(), 2 * size as u64, 9, Duration::ZERO)
        .unwrap();
    for s in [&s1, &s2, &s3] {
        sim.sync_stream(0, s.handle()).unwrap();
    }
    assert_eq!(sim.integrity_errors(0), 0);
    drop(x);
    dev.audit().unwrap();
}

/// Records kept back behind a stalled stream are not walked again by
/// every harvest: while the earliest pending event of each stream is still
/// pending, a harvest queries that one event per stream and looks only at
/// new records (which it releases when they are done). Once the stall
/// ends, the next harvest releases everything.
#[test]
fn harvests_leave_records_behind_a_stalled_stream_alone_until_it_moves() {
    let rt = sim_runtime(1, 256 * MIB);
    let dev = rt.device(0).unwrap();
    let sim = sim_of(dev);
    let (slow, s2, s3) = three_streams(dev);
    sim.stall_stream(0, slow.handle(), Duration::from_secs(2))
        .unwrap();
    let behind_stall = sim.create_event(0).unwrap();
    sim.record_event(0, behind_stall, slow.handle()).unwrap();
    // 40 frees (small and large) that also wait for the stalled stream.
    for i in 0..40usize {
        let size = if i % 2 == 0 { 4096 } else { 3 << 20 };
        let b = dev.alloc(size, &s2).unwrap();
        b.record_stream(&slow);
    }
    let kept = dev.stats().pending_bytes.current;
    assert!(kept > 0);
    let st0 = dev.stats();
    for _ in 0..20 {
        assert_eq!(dev.harvest(), 0, "nothing behind the stall can be released");
    }
    // A new record whose streams are idle is released without a walk of
    // the kept ones.
    let b = dev.alloc(3 << 20, &s2).unwrap();
    b.record_stream(&s3);
    drop(b);
    sim.sync_stream(0, s2.handle()).unwrap();
    sim.sync_stream(0, s3.handle()).unwrap();
    assert_eq!(dev.harvest(), 1, "the new record is released");
    let st = dev.stats();
    assert!(
        !sim.query_event(0, behind_stall).unwrap(),
        "the stall ended early: the checks above proved nothing"
    );
    // (The allocation above may have harvested too.)
    assert!(st.num_harvests - st0.num_harvests >= 21);
    assert!(
        st.num_harvest_walks - st0.num_harvest_walks <= 1,
        "{} of 21 harvests walked every record",
        st.num_harvest_walks - st0.num_harvest_walks
    );
    assert_eq!(
        st.pending_bytes.current, kept,
        "the kept records stay pending"
    );
    // The stall ends: the large frees' events and the first small free's
    // probe completed. The small frees after that probe promised on
    // `slow`: the harvest records a probe there for them, and once it has
    // run (the device runs it soon, not at once), the next harvest
    // releases the rest.
    sim.sync_stream(0, slow.handle()).unwrap();
    let first = dev.harvest();
    sim.sync_stream(0, slow.handle()).unwrap();
    assert_eq!(first + dev.harvest(), 40);
    assert_eq!(dev.stats().pending_bytes.current, 0);
    sim.destroy_event(0, behind_stall).unwrap();
    dev.audit().unwrap();
}

/// An allocation's slow path harvests looking at every kept record,
/// whatever the gate above would skip: it needs memory now.
#[test]
fn an_allocations_slow_path_looks_at_every_kept_record() {
    let rt = sim_runtime(1, 256 * MIB);
    let dev = rt.device(0).unwrap();
    let sim = sim_of(dev);
    let (slow, s2, _) = three_streams(dev);
    sim.stall_stream(0, slow.handle(), Duration::from_secs(2))
        .unwrap();
    for _ in 0..8 {
        let b = dev.alloc(3 << 20, &s2).unwrap();
        b.record_stream(&slow);
    }
    // The first pass learns what the kept records wait for; the next
    // ones skip them.
    assert_eq!(dev.harvest(), 0);
    let st0 = dev.stats();
    assert_eq!(dev.harvest(), 0);
    assert_eq!(
        dev.stats().num_harvest_walks,
        st0.num_harvest_walks,
        "an explicit harvest behind the stall skips the kept records"
    );
    // The first small block on `s2`: its class has no slot there yet.
    let st0 = dev.stats();
    let b = dev.alloc(4096, &s2).unwrap();
    let st = dev.stats();
    assert_eq!(st.num_small_slow_paths, st0.num_small_slow_paths + 1);
    assert_eq!(
        st.num_harvest_walks,
        st0.num_harvest_walks + 1,
        "the slow path's harvest looked at the kept records"
    );
    drop(b);
    sim.sync_stream(0, slow.handle()).unwrap();
    assert_eq!(dev.harvest(), 8);
    dev.audit().unwrap();
}

/// A stream's flush puts its dirty slots of every class behind one event
/// (not one per class), and a stream that takes that record by handover
/// gets every class's slots as its own.
#[test]
fn a_flush_records_one_event_for_all_classes_and_hands_them_over_together() {
    let rt = Runtime::builder()
        .backend(BackendKind::Sim(SimConfig {
            capacity_bytes: 256 * MIB,
            ..Default::default()
        }))
        // Frees go to the stream's dirty stacks, not a thread's magazine.
        .config(PoolConfig::parse("thread_cache=false").unwrap())
        .maintenance(false)
        .build()
        .unwrap();
    let dev = rt.device(0).unwrap();
    let (s1, s2) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
    let sizes = [4096usize, 8192, 16384];
    let mut freed = Vec::new();
    for &size in &sizes {
        let b = dev.alloc(size, &s1).unwrap();
        freed.push(b.ptr());
    }
    // Now dirty on s1, in three classes. A stall keeps the flush's event
    // pending, so the memory can only move to s2 by handover.
    sim_of(dev)
        .stall_stream(0, s1.handle(), Duration::from_millis(300))
        .unwrap();
    // Fill s2's view of the device: the limit is what is reserved now, so
    // s2 cannot grow and must take s1's slots.
    dev.set_memory_limit(Some(dev.stats().reserved_bytes.current))
        .unwrap();
    let records = RecordsSince::now(dev);
    let handovers = dev.stats().num_handovers;
    let mut got = Vec::new();
    let mut held = Vec::new();
    for &size in &sizes {
        // Take every clean slot of the class first, then one more.
        loop {
            let b = dev.alloc(size, &s2).unwrap();
            let p = b.ptr();
            held.push(b);
            if freed.contains(&p) {
                got.push(p);
                break;
            }
        }
    }
    assert_eq!(got.len(), 3, "s2 got s1's slot of every class");
    assert_eq!(
        dev.stats().num_handovers - handovers,
        1,
        "one handover brought all three classes"
    );
    assert_eq!(records.count(), 1, "one event for s1's three classes");
    drop(held);
    sim_of(dev).sync_stream(0, s1.handle()).unwrap();
    dev.set_memory_limit(None).unwrap();
    dev.audit().unwrap();
}

#[test]
fn record_stream_holds_memory_back_until_the_other_stream_is_done() {
    // Without handover: a pending block goes to no stream until harvested.
    // (With it, see the next test, a stream may take it by waiting on the
    // device.)
    let rt = sim_runtime_with("handover=false");
    let dev = rt.device(0).unwrap();
    let sim = sim_of(dev);
    let (s1, s2) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
    for size in [4096usize, 3 << 20] {
        let b = dev.alloc(size, &s1).unwrap();
        let p = b.ptr();
        b.record_stream(&s2);
        b.record_stream(&s2);
        // A block is no raw pointer: the mistaken free is refused and
        // leaves the block's recorded stream in place.
        assert!(dev.free_raw(p, &s1).is_err());
        sim.stall_stream(0, s2.handle(), Duration::from_millis(150))
            .unwrap();
        drop(b);
        let st = dev.stats();
        assert!(st.pending_bytes.current > 0, "the free must be pending");
        // While s2 is stalled, neither stream may get the block back.
        let x = dev.alloc(size, &s1).unwrap();
        assert_ne!(x.ptr(), p);
        sim.sync_stream(0, s2.handle()).unwrap();
        sim.sync_stream(0, s1.handle()).unwrap();
        assert_eq!(dev.harvest(), 1);
        assert_eq!(dev.stats().pending_bytes.current, 0);
        // Now a small slot is back on s1's dirty stack (PyTorch's rule,
        // see `returning.rs`), and a large range is clean: any stream may
        // have it.
        let back_on = if size <= 4096 { &s1 } else { &s2 };
        let y = dev.alloc(size, back_on).unwrap();
        assert_eq!(y.ptr(), p);
        dev.audit().unwrap();
    }
}

#[test]
fn large_requests_stitch_scattered_free_chunks() {
    // 64 MiB of device memory; fill it with 4 MiB blocks, free every other
    // one: 32 MiB free, but no hole larger than 4 MiB in address order.
    let rt = sim_runtime(1, 64 * MIB);
    let dev = rt.device(0).unwrap();
    let s = dev.new_stream().unwrap();
    let mut blocks: Vec<_> = (0..16)
        .map(|_| Some(dev.alloc((4 * MIB) as usize, &s).unwrap()))
        .collect();
    assert!(dev.alloc(1, &s).is_err(), "device is full");
    for b in blocks.iter_mut().step_by(2) {
        b.take();
    }
    let big = dev
        .alloc((32 * MIB) as usize, &s)
        .expect("stitching serves 32 MiB from 8 scattered holes");
    let st = dev.stats();
    assert_eq!(st.reserved_bytes.current, 64 * MIB, "no new device memory");
    // The stitched range is usable end to end.
    let be = dev.backend();
    be.copy_from_host(0, big.ptr().offset(32 * MIB - 8), &[7; 8])
        .unwrap();
    be.copy_from_host(0, big.ptr(), &[9; 8]).unwrap();
    dev.audit().unwrap();
    drop(big);
    drop(blocks);
}

/// Stitching steals idle granules in runs (a freed block's granules
/// together). A map that fails part-way must give every granule not yet
/// mapped back to where it was, with its free pieces and tags, so the
/// failed request changes nothing the audit or the live data can see, and
/// a retry succeeds without new device memory.
#[test]
fn a_map_failing_part_way_through_a_stitch_changes_nothing() {
    let rt = sim_runtime(1, 64 * MIB);
    let dev = rt.device(0).unwrap();
    let sim = sim_of(dev);
    let be = dev.backend();
    let s = dev.new_stream().unwrap();
    let mut blocks: Vec<_> = (0..16)
        .map(|_| Some(dev.alloc((4 * MIB) as usize, &s).unwrap()))
        .collect();
    for (i, b) in blocks.iter().enumerate() {
        let b = b.as_ref().unwrap();
        be.copy_from_host(0, b.ptr(), &[i as u8 + 1; 64]).unwrap();
        be.copy_from_host(0, b.ptr().offset(4 * MIB - 64), &[i as u8 + 1; 64])
            .unwrap();
    }
    // Freed on `s` and not flushed: the holes are dirty on `s`, so their
    // granules are stolen by aliasing, in runs of two.
    for b in blocks.iter_mut().step_by(2) {
        b.take();
    }
    let before = dev.stats();
    // The fresh 32 MiB range is one run of 16 granules, mapped all or
    // nothing: every attempt makes up to 16 maps.
    for n in [1, 4, 5, 3] {
        sim.fail_nth_map(0, n).unwrap();
        match dev.alloc((32 * MIB) as usize, &s) {
            Err(Error::InjectedFault(_)) => {}
            other => panic!("map #{n} failing: expected InjectedFault, got {other:?}"),
        }
        dev.audit()
            .unwrap_or_else(|e| panic!("map #{n} failing: audit: {e}"));
        let after = dev.stats();
        assert_eq!(
            (after.requested_bytes.current, after.reserved_bytes.current),
            (
                before.requested_bytes.current,
                before.reserved_bytes.current
            ),
            "map #{n} failing changed the books"
        );
    }
    sim.fail_nth_map(0, 0).unwrap();
    let big = dev
        .alloc((32 * MIB) as usize, &s)
        .expect("the retry stitches the same holes");
    assert_eq!(
        dev.stats().reserved_bytes.current,
        64 * MIB,
        "no new device memory"
    );
    be.copy_from_host(0, big.ptr().offset(32 * MIB - 8), &[7; 8])
        .unwrap();
    for (i, b) in blocks.iter().enumerate() {
        let Some(b) = b else { continue };
        let (mut head, mut tail) = ([0u8; 64], [0u8; 64]);
        be.copy_to_host(0, b.ptr(), &mut head).unwrap();
        be.copy_to_host(0, b.ptr().offset(4 * MIB - 64), &mut tail)
            .unwrap();
        assert_eq!(
            (head, tail),
            ([i as u8 + 1; 64], [i as u8 + 1; 64]),
            "block {i}"
        );
    }
    dev.audit().unwrap();
}

#[test]
fn out_of_memory_is_typed_and_reports_figures() {
    let rt = sim_runtime(1, 32 * MIB);
    let dev = rt.device(0).unwrap();
    let s = dev.new_stream().unwrap();
    let _a = dev.alloc((20 * MIB) as usize, &s).unwrap();
    let before = dev.stats();
    match dev.alloc((16 * MIB) as usize, &s) {
        Err(Error::OutOfMemory(r)) => {
            assert_eq!(r.requested, 16 * MIB);
            assert_eq!(r.live, 20 * MIB);
            assert_eq!(r.reserved, 20 * MIB);
            assert_eq!(r.capacity, 32 * MIB);
            let msg = Error::OutOfMemory(r).to_string();
            for word in [
                "requested",
                "live",
                "reserved",
                "cached",
                "pending",
                "largest free",
            ] {
                assert!(msg.contains(word), "{msg}");
            }
        }
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    let after = dev.stats();
    assert_eq!(after.num_ooms, before.num_ooms + 1);
    assert_eq!(
        after.requested_bytes.current,
        before.requested_bytes.current
    );
    dev.audit().unwrap();
}

#[test]
fn bad_input_returns_typed_errors_and_changes_nothing() {
    let rt = sim_runtime(2, 64 * MIB);
    let dev = rt.device(0).unwrap();
    let dev1 = rt.device(1).unwrap();
    let s = dev.new_stream().unwrap();
    let s_other = dev1.new_stream().unwrap();
    let keep = dev.alloc_raw(1000, &s).unwrap();
    let keep_large = dev.alloc_raw((2 * MIB) as usize, &s).unwrap();
    let freed = dev.alloc_raw(1000, &s).unwrap();
    dev.free_raw(freed, &s).unwrap();
    let freed_large = dev.alloc_raw((3 * MIB) as usize, &s).unwrap();
    dev.free_raw(freed_large, &s).unwrap();
    let before = dev.stats();

    assert!(matches!(
        dev.alloc(0, &s),
        Err(Error::InvalidSize { size: 0, .. })
    ));
    assert!(matches!(
        dev.alloc_raw(0, &s),
        Err(Error::InvalidSize { .. })
    ));
    assert!(matches!(
        dev.alloc((65 * MIB) as usize, &s),
        Err(Error::InvalidSize { .. })
    ));
    assert!(matches!(
        dev.alloc(usize::MAX, &s),
        Err(Error::InvalidSize { .. })
    ));
    assert!(matches!(
        dev.free_raw(freed, &s),
        Err(Error::DoubleFree { .. })
    ));
    assert!(matches!(
        dev.free_raw(freed_large, &s),
        Err(Error::DoubleFree { .. })
    ));
    assert!(matches!(
        dev.free_raw(DevicePtr(0xdead_0000), &s),
        Err(Error::UnknownPointer { .. })
    ));
    assert!(matches!(
        dev.free_raw(DevicePtr(keep.addr() + 256), &s),
        Err(Error::DoubleFree { .. } | Error::UnknownPointer { .. })
    ));
    assert!(matches!(
        dev.free_raw(DevicePtr(keep_large.addr() + 256), &s),
        Err(Error::UnknownPointer { .. })
    ));
    assert!(matches!(
        dev.alloc(64, &s_other),
        Err(Error::InvalidHandle(_))
    ));
    assert!(matches!(
        dev.free_raw(keep, &s_other),
        Err(Error::InvalidHandle(_))
    ));
    assert!(matches!(
        dev1.free_raw(keep, &s_other),
        Err(Error::UnknownPointer { .. })
    ));
    assert!(matches!(
        dev.record_stream_raw(DevicePtr(12345), &s),
        Err(Error::UnknownPointer { .. })
    ));

    let after = dev.stats();
    assert_eq!(before.requested_bytes, after.requested_bytes);
    assert_eq!(before.allocated_bytes, after.allocated_bytes);
    assert_eq!(before.reserved_bytes.current, after.reserved_bytes.current);
    assert_eq!(
        (before.num_allocs, before.num_frees),
        (after.num_allocs, after.num_frees)
    );
    dev.audit().unwrap();
    // The live ones still free normally.
    dev.free_raw(keep, &s).unwrap();
    dev.free_raw(keep_large, &s).unwrap();
    assert_eq!(dev.stats().requested_bytes.current, 0);
}

#[test]
fn use_after_shutdown_is_an_error() {
    let rt = sim_runtime(1, 64 * MIB);
    let dev = rt.device(0).unwrap();
    let s = dev.new_stream().unwrap();
    let p = dev.alloc_raw(512, &s).unwrap();
    rt.shutdown();
    assert!(matches!(dev.alloc(512, &s), Err(Error::Shutdown)));
    assert!(matches!(dev.free_raw(p, &s), Err(Error::Shutdown)));
    assert!(matches!(dev.new_stream(), Err(Error::Shutdown)));
}

#[test]
fn many_streams_never_strand_memory() {
    // 100 streams (more than the pool's stream slots) each allocate and free
    // a large block; a fresh stream must still get memory on a device that
    // only has room for a few such blocks.
    let rt = sim_runtime(1, 48 * MIB);
    let dev = rt.device(0).unwrap();
    let streams: Vec<_> = (0..100).map(|_| dev.new_stream().unwrap()).collect();
    for (i, s) in streams.iter().enumerate() {
        let a = dev
            .alloc((8 * MIB) as usize, s)
            .unwrap_or_else(|e| panic!("stream {i}: {e}"));
        let b = dev
            .alloc(10_000, s)
            .unwrap_or_else(|e| panic!("stream {i} small: {e}"));
        drop((a, b));
    }
    let fresh = dev.new_stream().unwrap();
    for s in &streams {
        dev.backend().sync_stream(0, s.handle()).unwrap();
    }
    let big = dev
        .alloc((40 * MIB) as usize, &fresh)
        .expect("memory freed on 100 other streams is reusable");
    assert!(dev.stats().reserved_bytes.current <= 48 * MIB);
    drop(big);
    drop(streams);
    dev.audit().unwrap();
}

#[test]
fn handover_orders_the_new_stream_instead_of_failing() {
    // A block freed with record_stream on a stalled stream: with handover
    // on, a request that needs that memory is served at once and the new
    // stream waits on the device.
    let cfg = PoolConfig {
        handover: true,
        ..Default::default()
    };
    let rt = Runtime::builder()
        .backend(BackendKind::Sim(SimConfig {
            capacity_bytes: 16 * MIB,
            ..Default::default()
        }))
        .config(cfg)
        .build()
        .unwrap();
    let dev = rt.device(0).unwrap();
    let sim = sim_of(dev);
    let (s1, s2, s3) = three_streams(dev);
    let b = dev.alloc((12 * MIB) as usize, &s1).unwrap();
    let p = b.ptr();
    b.record_stream(&s2);
    sim.stall_stream(0, s2.handle(), Duration::from_millis(200))
        .unwrap();
    sim.launch_write_pattern(0, s2.handle(), p, 12 * MIB, 1, Duration::ZERO)
        .unwrap();
    drop(b);
    let syncs = dev.stats().host_syncs;
    let c = dev.alloc((12 * MIB) as usize, &s3).expect("handover");
    assert!(dev.stats().num_handovers >= 1);
    assert!(dev.stats().reserved_bytes.current <= 16 * MIB);
    assert_eq!(dev.stats().host_syncs, syncs, "no host sync");
    // The new block uses the same physical memory (at the same or a stitched
    // address); s3's work runs after s2's late write, so its pattern survives.
    let q = c.ptr();
    sim.launch_write_pattern(0, s3.handle(), q, 12 * MIB, 2, Duration::ZERO)
        .unwrap();
    let r = sim
        .launch_verify_pattern(0, s3.handle(), q, 12 * MIB, 2, Duration::ZERO)
        .unwrap();
    assert_eq!(r.wait(), 0);
}

#[test]
fn alloc_and_free_never_block_the_host() {
    let rt = sim_runtime(1, 256 * MIB);
    let dev = rt.device(0).unwrap();
    let streams: Vec<_> = (0..4).map(|_| dev.new_stream().unwrap()).collect();
    let before = dev.backend().counters().host_syncs;
    let mut held = Vec::new();
    for i in 0..5000usize {
        let s = &streams[i % 4];
        let size = [300, 5000, 70_000, 1 << 20, 3 << 20][i % 5];
        let b = dev.alloc(size, s).unwrap();
        if i % 3 == 0 {
            b.record_stream(&streams[(i + 1) % 4]);
        }
        held.push(b);
        if held.len() > 40 {
            held.drain(..20);
        }
    }
    drop(held);
    assert_eq!(dev.backend().counters().host_syncs, before);
    dev.audit().unwrap();
}

/// Raw frees find their slot through the slab index; once a trim retires
/// the slabs (their ids are then reused for slabs elsewhere), a stale
/// pointer into one is refused and leaves every live block alone, whatever
/// now lies at its address.
#[test]
fn stale_raw_pointers_into_retired_slabs_are_refused() {
    let rt = sim_runtime(1, 256 * MIB);
    let dev = rt.device(0).unwrap();
    let s = dev.new_stream().unwrap();
    let old: Vec<DevicePtr> = (0..300)
        .map(|i| dev.alloc_raw(4096 + (i % 3) * 256, &s).unwrap())
        .collect();
    for &p in &old {
        dev.free_raw(p, &s).unwrap();
    }
    rt.trim().unwrap();
    assert_eq!(dev.stats().reserved_bytes.current, 0);
    // New blocks over the same addresses: small ones (slabs that reuse the
    // retired ids, maybe at other bases) and large ones.
    let small: Vec<DevicePtr> = (0..300)
        .map(|i| dev.alloc_raw(8192 + (i % 5) * 512, &s).unwrap())
        .collect();
    let large: Vec<DevicePtr> = (0..4)
        .map(|_| dev.alloc_raw(3 * MIB as usize, &s).unwrap())
        .collect();
    let live: std::collections::HashSet<u64> =
        small.iter().chain(&large).map(|p| p.addr()).collect();
    let before = dev.stats();
    for p in old.iter().filter(|p| !live.contains(&p.addr())) {
        assert!(
            matches!(
                dev.free_raw(*p, &s),
                Err(Error::DoubleFree { .. } | Error::UnknownPointer { .. })
            ),
            "{p:?}"
        );
    }
    let after = dev.stats();
    assert_eq!(after.num_frees, before.num_frees);
    assert_eq!(
        after.requested_bytes.current,
        before.requested_bytes.current
    );
    for p in small.into_iter().chain(large) {
        dev.free_raw(p, &s).unwrap();
    }
    dev.audit().unwrap();
    assert_eq!(dev.stats().requested_bytes.current, 0);
}

#[test]
fn trim_gives_everything_back_once_blocks_are_gone() {
    let rt = sim_runtime(2, 256 * MIB);
    for dev in rt.devices() {
        let s = dev.new_stream().unwrap();
        let s2 = dev.new_stream().unwrap();
        let blocks: Vec<_> = (0..200usize)
            .map(|i| dev.alloc(1 + i * 7919 % (4 << 20), &s).unwrap())
            .collect();
        for b in blocks.iter().step_by(7) {
            b.record_stream(&s2);
        }
        assert!(dev.stats().reserved_bytes.current > 0);
        drop(blocks);
        dev.audit().unwrap();
    }
    rt.trim().unwrap();
    for dev in rt.devices() {
        let st = dev.stats();
        assert_eq!(st.reserved_bytes.current, 0, "{st:?}");
        assert_eq!(sim_of(dev).used_bytes(dev.device()), 0);
        dev.audit().unwrap();
    }
}

#[test]
fn pools_of_different_devices_are_independent() {
    let rt = sim_runtime(3, 64 * MIB);
    std::thread::scope(|sc| {
        for dev in rt.devices() {
            sc.spawn(move || {
                let s = dev.new_stream().unwrap();
                for i in 0..2000usize {
                    let _b = dev.alloc(256 + i % 5000, &s).unwrap();
                }
                dev.audit().unwrap();
            });
        }
    });
    for dev in rt.devices() {
        assert_eq!(dev.stats().num_allocs, 2000);
    }
}

#[test]
fn segment_fallback_works_without_vmm() {
    let rt = Runtime::builder()
        .backend(BackendKind::Sim(SimConfig {
            vmm: false,
            capacity_bytes: 256 * MIB,
            ..Default::default()
        }))
        .build()
        .unwrap();
    let dev = rt.device(0).unwrap();
    let s = dev.new_stream().unwrap();
    let blocks: Vec<_> = (0..50usize)
        .map(|i| dev.alloc(1 + i * 104_729 % (12 << 20), &s).unwrap())
        .collect();
    let be: &Arc<dyn Backend> = dev.backend();
    for b in &blocks {
        be.copy_from_host(0, b.ptr(), &[1, 2, 3]).unwrap();
    }
    assert!(be.counters().get(gpupool::backend::Call::MemCreate) == 0);
    dev.audit().unwrap();
    drop(blocks);
    rt.trim().unwrap();
    assert_eq!(dev.stats().reserved_bytes.current, 0);
}

#[test]
fn snapshot_covers_reserved_memory_and_live_blocks() {
    let rt = sim_runtime(1, 256 * MIB);
    let dev = rt.device(0).unwrap();
    let (s, s2) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
    dev.record_history(true);
    let blocks: Vec<_> = [300usize, 5000, 70_000, 3 << 20, 9 << 20, 1000]
        .iter()
        .map(|&n| dev.alloc(n, &s).unwrap())
        .collect();
    let raw = dev.alloc_raw(123_456, &s).unwrap();
    let pending = dev.alloc(4096, &s).unwrap();
    pending.record_stream(&s2);
    dev.backend()
        .as_any()
        .downcast_ref::<SimBackend>()
        .unwrap()
        .stall_stream(0, s2.handle(), Duration::from_millis(100))
        .unwrap();
    drop(pending);
    let snap = dev.snapshot();
    let st = dev.stats();
    let total: u64 = snap.segments.iter().map(|g| g.total_size).sum();
    assert_eq!(
        total, st.reserved_bytes.current,
        "segments cover reserved memory"
    );
    let live: u64 = snap
        .segments
        .iter()
        .flat_map(|g| &g.blocks)
        .filter(|b| b.state == gpupool::pool::BlockState::ActiveAllocated)
        .map(|b| b.requested_size)
        .sum();
    // Exact for slots and raw blocks; a typed large block shows its range.
    let typed_rounding: u64 = blocks
        .iter()
        .filter(|b| b.size() > 32 << 10)
        .map(|b| b.size().next_multiple_of(256) as u64 - b.size() as u64)
        .sum();
    assert_eq!(live, st.requested_bytes.current + typed_rounding);
    assert!(snap
        .segments
        .iter()
        .flat_map(|g| &g.blocks)
        .any(|b| b.state == gpupool::pool::BlockState::ActivePendingFree));
    for g in &snap.segments {
        let mut at = g.address;
        for b in &g.blocks {
            assert_eq!(b.address, at, "blocks tile their segment");
            at += b.size;
        }
        assert_eq!(at, g.address + g.total_size);
    }
    assert!(
        snap.segments.iter().any(|g| g.segment_type == "small")
            && snap.segments.iter().any(|g| g.segment_type == "large")
    );
    let json = serde_json::to_string(&snap).unwrap();
    assert!(json.contains("active_allocated"));
    // History: 8 allocs and 1 free so far, in order.
    let h = dev.history();
    assert_eq!(
        h.iter()
            .filter(|e| e.action == gpupool::pool::HistoryAction::Alloc)
            .count(),
        8
    );
    assert_eq!(
        h.iter()
            .filter(|e| e.action == gpupool::pool::HistoryAction::FreeRequested)
            .count(),
        1
    );
    assert!(h.windows(2).all(|w| w[0].time_us <= w[1].time_us));
    dev.free_raw(raw, &s).unwrap();
    drop(blocks);
    dev.audit().unwrap();
}

/// A parked large range keeps its last owner's record until reused: the
/// pool must still report it as inactive, serve it to the raw API with
/// exact double-free detection, and audit exactly.
#[test]
fn parked_large_ranges_change_hands_between_blocks_and_raw_pointers() {
    let rt = sim_runtime(1, 8 << 30);
    let dev = rt.device(0).unwrap();
    let s = dev.new_stream().unwrap();
    let state_at = |addr: u64| {
        dev.snapshot()
            .segments
            .iter()
            .flat_map(|seg| seg.blocks.iter())
            .find(|b| b.address == addr)
            .map(|b| (b.requested_size, b.state))
    };
    let b = dev.alloc((3 * MIB) as usize, &s).unwrap();
    let addr = b.ptr().addr();
    drop(b);
    dev.audit().unwrap();
    assert_eq!(state_at(addr), Some((0, BlockState::Inactive)), "parked");
    assert!(matches!(
        dev.free_raw(DevicePtr(addr), &s),
        Err(Error::InvalidArgument(_) | Error::DoubleFree { .. })
    ));
    let raw = dev.alloc_raw((3 * MIB) as usize, &s).unwrap();
    assert_eq!(raw.addr(), addr, "the parked range is reused");
    assert_eq!(state_at(addr), Some((3 * MIB, BlockState::ActiveAllocated)));
    dev.audit().unwrap();
    dev.free_raw(raw, &s).unwrap();
    assert!(matches!(
        dev.free_raw(raw, &s),
        Err(Error::DoubleFree { .. })
    ));
    dev.audit().unwrap();
    let b = dev.alloc((3 * MIB - 1000) as usize, &s).unwrap();
    assert_eq!(b.ptr().addr(), addr);
    // A typed block is not listed: its range.
    assert_eq!(state_at(addr), Some((3 * MIB, BlockState::ActiveAllocated)));
    dev.audit().unwrap();
    drop(b);
    assert_eq!(state_at(addr), Some((0, BlockState::Inactive)));
    dev.audit().unwrap();
}

/// PyTorch's `record_stream` rule for small blocks: one event, on the
/// other stream only (the probe of a promise, at the free since that
/// stream was quiet); once it completes the slot goes back to the stream
/// that freed it (its dirty stack), never to another stream before that,
/// and the audit accounts for it while it waits.
#[test]
fn a_recorded_small_block_returns_to_its_stream_behind_one_event() {
    let rt = sim_runtime_with(PROBES_ON_DEMAND);
    let dev = rt.device(0).unwrap();
    let sim = sim_of(dev);
    let (s1, s2) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
    let b = dev.alloc(4096, &s1).unwrap();
    let p = b.ptr();
    b.record_stream(&s2);
    sim.stall_stream(0, s2.handle(), Duration::from_millis(300))
        .unwrap();
    let records = RecordsSince::now(dev);
    drop(b);
    let recorded = || records.count();
    assert_eq!(recorded(), 1, "one event, on the other stream");
    assert!(dev.stats().pending_bytes.current >= 4096);
    dev.audit().unwrap();
    // Neither stream gets it while the other stream's work is pending.
    let mut held = Vec::new();
    for s in [&s1, &s2, &s1] {
        let x = dev.alloc(4096, s).unwrap();
        assert_ne!(x.ptr(), p);
        held.push(x);
    }
    dev.harvest();
    dev.harvest();
    assert_eq!(recorded(), 1, "the probe in flight serves every pass");
    assert!(held.iter().all(|x| x.ptr() != p));
    sim.sync_stream(0, s2.handle()).unwrap();
    dev.harvest();
    // Back on s1's dirty stack: s2 does not get it, s1 does, and no
    // further event was recorded for it.
    let on_s2 = dev.alloc(4096, &s2).unwrap();
    assert_ne!(on_s2.ptr(), p);
    let on_s1 = dev.alloc(4096, &s1).unwrap();
    assert_eq!(on_s1.ptr(), p, "s1 reuses the slot it freed");
    assert_eq!(recorded(), 1);
    drop((on_s1, on_s2, held));
    dev.audit().unwrap();
}

/// A small request that needs a new slab, while other streams hold freed
/// memory, flushes and harvests it before growing the device, as a large
/// request does: on a server's 8 streams, slabs otherwise grew the device
/// beside every stream's own cache (reserved 2.3x live against 1.2x on
/// one stream, `stress --workload serving --cross-percent 0`).
#[test]
fn a_new_slab_takes_other_streams_freed_memory_before_growing() {
    let rt = sim_runtime(1, 64 * MIB);
    let dev = rt.device(0).unwrap();
    let (s1, s2) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
    let large: Vec<_> = (0..8)
        .map(|_| dev.alloc((2 * MIB) as usize, &s1).unwrap())
        .collect();
    drop(large);
    let reserved = dev.stats().reserved_bytes.current;
    assert_eq!(reserved, 16 * MIB);
    let records = RecordsSince::now(dev);
    let small: Vec<_> = (0..8).map(|_| dev.alloc(32 << 10, &s2).unwrap()).collect();
    assert_eq!(
        dev.stats().reserved_bytes.current,
        reserved,
        "a slab grew the device beside s1's freed memory"
    );
    // s1 is idle: its memory came clean after a query of s1, with no
    // event (an event on s1 would also order it, were s1 busy).
    assert!(
        records.count() >= 1 || driver_calls(dev, gpupool::backend::Call::StreamQuery) >= 1,
        "s1's memory came neither behind its event nor after a query"
    );
    dev.audit().unwrap();
    drop(small);
    dev.audit().unwrap();
}

fn driver_calls(pool: &DevicePool, call: gpupool::backend::Call) -> u64 {
    pool.backend().counters().get(call)
}

/// Memory freed on a stream that has run all its work is clean for any
/// stream: another stream's request takes it after one query of that
/// stream, with no event recorded and no wait, and the device does not
/// grow beside it.
#[test]
fn an_idle_streams_freed_memory_serves_another_stream_without_an_event() {
    use gpupool::backend::Call;
    let rt = sim_runtime(1, 256 * MIB);
    let dev = rt.device(0).unwrap();
    let (s1, s2) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
    let a = dev.alloc((64 * MIB) as usize, &s1).unwrap();
    let at = a.ptr();
    drop(a);
    let reserved = dev.stats().reserved_bytes.current;
    let (records, waits, queries) = (
        driver_calls(dev, Call::EventRecord),
        driver_calls(dev, Call::StreamWaitEvent),
        driver_calls(dev, Call::StreamQuery),
    );
    let b = dev.alloc((64 * MIB) as usize, &s2).unwrap();
    assert_eq!(b.ptr(), at, "s1's freed range was not reused");
    assert_eq!(dev.stats().reserved_bytes.current, reserved, "grew");
    assert_eq!(driver_calls(dev, Call::EventRecord), records, "an event");
    assert_eq!(driver_calls(dev, Call::StreamWaitEvent), waits, "a wait");
    assert!(
        driver_calls(dev, Call::StreamQuery) > queries,
        "s1 not asked"
    );
    dev.audit().unwrap();
    drop(b);
    dev.audit().unwrap();
}

/// A miss is served first from the stream's own parked ranges, merged in
/// the heap, with no query. Past them, every stream holding freed memory
/// is asked, the requester's own beside the others: what each idle stream
/// parked or freed goes to the heap clean, so a third stream's request is
/// served from it with no event, wait or growth.
#[test]
fn a_miss_makes_every_idle_streams_parked_ranges_clean_at_once() {
    use gpupool::backend::Call;
    let rt = sim_runtime(1, 256 * MIB);
    let dev = rt.device(0).unwrap();
    let (s1, s2, s3) = (
        dev.new_stream().unwrap(),
        dev.new_stream().unwrap(),
        dev.new_stream().unwrap(),
    );
    let a = dev.alloc((16 * MIB) as usize, &s1).unwrap();
    let b = dev.alloc((16 * MIB) as usize, &s2).unwrap();
    let (a_at, b_at) = (a.ptr().0, b.ptr().0);
    assert_eq!(b_at, a_at + 16 * MIB, "laid side by side");
    drop((a, b));
    // s2's own parked range is of another class: a miss, answered from
    // it, split in the heap, with no stream asked.
    let queries = driver_calls(dev, Call::StreamQuery);
    let c = dev.alloc((8 * MIB) as usize, &s2).unwrap();
    assert_eq!(driver_calls(dev, Call::StreamQuery), queries, "asked");
    assert!(
        c.ptr().0 >= b_at && c.ptr().0 + 8 * MIB <= b_at + 16 * MIB,
        "not from s2's own range"
    );
    let reserved = dev.stats().reserved_bytes.current;
    let (records, waits) = (
        driver_calls(dev, Call::EventRecord),
        driver_calls(dev, Call::StreamWaitEvent),
    );
    // s1's parked range and the rest of s2's, both idle: both asked, and
    // s1's serves s3 clean.
    let d = dev.alloc((16 * MIB) as usize, &s3).unwrap();
    assert!(
        driver_calls(dev, Call::StreamQuery) >= queries + 2,
        "not both asked"
    );
    assert_eq!(d.ptr().0, a_at, "not s1's range");
    assert_eq!(driver_calls(dev, Call::EventRecord), records, "an event");
    assert_eq!(driver_calls(dev, Call::StreamWaitEvent), waits, "a wait");
    assert_eq!(dev.stats().reserved_bytes.current, reserved, "grew");
    dev.audit().unwrap();
    drop((c, d));
    dev.audit().unwrap();
}

/// A stream alone is never asked whether it is idle: what it freed is
/// its own to reuse already, and a query would cost it a driver call at
/// every miss for nothing.
#[test]
fn a_stream_alone_is_never_asked_whether_it_is_idle() {
    use gpupool::backend::Call;
    let rt = sim_runtime(1, 256 * MIB);
    let dev = rt.device(0).unwrap();
    let s = dev.new_stream().unwrap();
    let queries = driver_calls(dev, Call::StreamQuery);
    for mib in [4, 12, 6, 20, 3, 40] {
        let blocks: Vec<_> = (0..3)
            .map(|_| dev.alloc((mib * MIB) as usize, &s).unwrap())
            .collect();
        drop(blocks);
    }
    assert_eq!(driver_calls(dev, Call::StreamQuery), queries);
    dev.audit().unwrap();
}

/// A stream still running work keeps what it freed: another stream's
/// request does not get that memory without being ordered after the
/// work (the late write below lands before the new owner's pattern).
#[test]
fn a_busy_streams_freed_memory_is_not_cleaned_by_a_query_and_asked_once() {
    use gpupool::backend::Call;
    let rt = sim_runtime(1, 256 * MIB);
    let dev = rt.device(0).unwrap();
    let sim = sim_of(dev);
    let (s1, s2) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
    let len = 64 * MIB;
    let a = dev.alloc(len as usize, &s1).unwrap();
    let at = a.ptr();
    let busy = Busy::hold(sim, &s1);
    // A late use of `a` on s1, behind the stall.
    sim.launch_write_pattern(0, s1.handle(), at, len, 7, Duration::ZERO)
        .unwrap();
    drop(a);
    let (waits, queries) = (
        driver_calls(dev, Call::StreamWaitEvent),
        driver_calls(dev, Call::StreamQuery),
    );
    let b = dev.alloc(len as usize, &s2).unwrap();
    // Asked once: the flush that follows the query knows s1 is busy.
    assert_eq!(
        driver_calls(dev, Call::StreamQuery),
        queries + 1,
        "s1 asked once"
    );
    assert!(
        b.ptr() != at || driver_calls(dev, Call::StreamWaitEvent) > waits,
        "s2 got s1's range with no order after s1's work"
    );
    sim.launch_write_pattern(0, s2.handle(), b.ptr(), len, 8, Duration::ZERO)
        .unwrap();
    busy.release();
    let r = sim
        .launch_verify_pattern(0, s2.handle(), b.ptr(), len, 8, Duration::ZERO)
        .unwrap();
    assert_eq!(r.wait(), 0, "s1's late write landed on s2's block");
    drop(b);
    dev.audit().unwrap();
}

/// A busy stream is not asked about at every pass of the pool's own: a
/// "pending" answer holds for 10 us, doubling while the stream stays
/// busy, up to 50 us (`event_order.rs`), so maintenance passes a few
/// microseconds apart make one query per 50 us where each used to make
/// one; and an explicit harvest asks afresh, so once the stream has run
/// its work the memory comes back at once.
#[test]
fn a_busy_stream_is_asked_about_with_backoff_and_its_memory_still_comes_back() {
    use gpupool::backend::Call;
    use std::time::Instant;
    let rt = sim_runtime(1, 256 * MIB);
    let dev = rt.device(0).unwrap();
    let sim = sim_of(dev);
    let (s1, s2) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
    let a = dev.alloc((16 * MIB) as usize, &s2).unwrap();
    a.record_stream(&s1);
    let busy = Busy::hold(sim, &s1);
    drop(a);
    // s2's event completes at once; s1's waits behind the stall.
    let queries = driver_calls(dev, Call::EventQuery);
    let t0 = Instant::now();
    // Queries allowed after `us` microseconds: s2's, the doublings up to
    // the longest hold, then one per 50 us, twice over for a
    // maintenance pass racing this thread's.
    let allowed = |us: u128| 16 + 2 * (us / 50) as u64;
    let mut passes = 0u64;
    // As many passes as it takes to tell a hold from none (four times
    // the queries allowed), however fast a pass runs here.
    while passes < 1_000 || passes < 4 * allowed(t0.elapsed().as_micros()) {
        dev.maintain();
        passes += 1;
        assert!(
            t0.elapsed() < Duration::from_secs(1),
            "{passes} passes took a second"
        );
    }
    let asked = driver_calls(dev, Call::EventQuery) - queries;
    let us = t0.elapsed().as_micros();
    assert!(
        asked <= allowed(us),
        "{asked} event queries in {passes} maintenance passes over {us} us"
    );
    assert!(
        dev.stats().pending_bytes.current > 0,
        "released while s1 was busy"
    );
    busy.release();
    dev.harvest();
    assert_eq!(
        dev.stats().pending_bytes.current,
        0,
        "s1 is done, yet an explicit harvest left its memory pending"
    );
    dev.audit().unwrap();
}

/// A stream query that fails counts as a busy stream: the memory stays
/// its stream's and the request is served the other way (a flush, with
/// an event), with nothing lost and the heap consistent.
#[test]
fn a_failed_stream_query_leaves_the_memory_dirty() {
    use gpupool::backend::Call;
    let rt = sim_runtime(1, 256 * MIB);
    let dev = rt.device(0).unwrap();
    let sim = sim_of(dev);
    let (s1, s2) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
    let a = dev.alloc((64 * MIB) as usize, &s1).unwrap();
    drop(a);
    let queries = driver_calls(dev, Call::StreamQuery);
    let records = RecordsSince::now(dev);
    // The query of s1 before taking its ranges fails: s1 counts as busy,
    // and the flush after it records s1's event without asking again.
    sim.fail_next_event_ops(0, 1).unwrap();
    let b = dev.alloc((64 * MIB) as usize, &s2).unwrap();
    assert_eq!(driver_calls(dev, Call::StreamQuery), queries + 1);
    assert!(records.count() >= 1, "served without s1's event");
    sim.launch_write_pattern(0, s2.handle(), b.ptr(), 64 * MIB, 3, Duration::ZERO)
        .unwrap();
    let r = sim
        .launch_verify_pattern(0, s2.handle(), b.ptr(), 64 * MIB, 3, Duration::ZERO)
        .unwrap();
    assert_eq!(r.wait(), 0);
    dev.audit().unwrap();
    drop(b);
    dev.audit().unwrap();
}

/// Flushing a stream that has run all its work makes what it freed clean
/// at once: no event, no host wait (trim of an idle pool).
#[test]
fn an_idle_streams_flush_needs_no_event() {
    let rt = sim_runtime_with("thread_cache=false");
    let dev = rt.device(0).unwrap();
    let s1 = dev.new_stream().unwrap();
    let small: Vec<_> = (0..4).map(|_| dev.alloc(4096, &s1).unwrap()).collect();
    let large = dev.alloc((4 * MIB) as usize, &s1).unwrap();
    drop(small);
    drop(large);
    let records = RecordsSince::now(dev);
    let syncs = dev.stats().host_syncs;
    dev.trim().unwrap();
    assert_eq!(records.count(), 0, "an event for an idle stream");
    assert_eq!(dev.stats().host_syncs, syncs, "a host wait");
    let st = dev.stats();
    assert_eq!(st.pending_bytes.current, 0);
    assert_eq!(st.reserved_bytes.current, 0);
    dev.audit().unwrap();
}

/// A stream's flush covers its small slots and its large ranges with one
/// event, which both records share: each releases its memory once the
/// event completes, and the event is reused only after both.
#[test]
fn a_flush_covers_small_and_large_memory_with_one_event() {
    let rt = sim_runtime_with("thread_cache=false");
    let dev = rt.device(0).unwrap();
    let sim = sim_of(dev);
    let s1 = dev.new_stream().unwrap();
    let small: Vec<_> = (0..4).map(|_| dev.alloc(4096, &s1).unwrap()).collect();
    let large = dev.alloc((4 * MIB) as usize, &s1).unwrap();
    sim.stall_stream(0, s1.handle(), Duration::from_millis(200))
        .unwrap();
    drop(small);
    drop(large);
    let records = RecordsSince::now(dev);
    // Flushes s1 (one event), then waits for it on the host.
    let released = dev.trim().unwrap();
    assert_eq!(records.count(), 1, "one event for both records");
    let st = dev.stats();
    assert_eq!(st.pending_bytes.current, 0, "both records completed");
    assert_eq!(st.reserved_bytes.current, 0, "{released} B released");
    dev.audit().unwrap();
    // The shared event went back once: two busy streams' frees now take
    // two events, none of them recorded twice at once.
    let s2 = dev.new_stream().unwrap();
    let a = dev.alloc((4 * MIB) as usize, &s1).unwrap();
    let b = dev.alloc((4 * MIB) as usize, &s2).unwrap();
    let c = dev.alloc(4096, &s1).unwrap();
    for s in [&s1, &s2] {
        sim.stall_stream(0, s.handle(), Duration::from_millis(100))
            .unwrap();
    }
    drop((a, b, c));
    let records = RecordsSince::now(dev);
    dev.trim().unwrap();
    assert_eq!(records.count(), 2);
    assert_eq!(dev.stats().reserved_bytes.current, 0);
    dev.audit().unwrap();
}

/// A stream that retires while a slot it freed still waits on another
/// stream hands the slot to the pending list behind that stream's event
/// and its own: a new stream (which may get the retired stream's slot
/// index) reuses it only once both streams' work completed, even when
/// the other stream finishes first.
#[test]
fn a_returning_slot_of_a_retired_stream_waits_for_both_streams() {
    let rt = sim_runtime_with("thread_cache=false,handover=false");
    let dev = rt.device(0).unwrap();
    let sim = sim_of(dev);
    let s2 = dev.new_stream().unwrap();
    let s1 = dev.new_stream().unwrap();
    let b = dev.alloc(4096, &s1).unwrap();
    let p = b.ptr();
    b.record_stream(&s2);
    let start = std::time::Instant::now();
    sim.stall_stream(0, s1.handle(), Duration::from_millis(2500))
        .unwrap();
    sim.stall_stream(0, s2.handle(), Duration::from_millis(50))
        .unwrap();
    drop(b);
    drop(s1);
    dev.audit().unwrap();
    sim.sync_stream(0, s2.handle()).unwrap();
    dev.harvest();
    let s3 = dev.new_stream().unwrap();
    let mut held = Vec::new();
    for _ in 0..40 {
        let x = dev.alloc(4096, &s3).unwrap();
        held.push(x);
    }
    // s1's work is still queued (2.5 s of it; this takes milliseconds).
    assert!(start.elapsed() < Duration::from_millis(2000));
    assert!(
        held.iter().all(|x| x.ptr() != p),
        "reused before the retired stream's work completed"
    );
    std::thread::sleep(Duration::from_millis(2500).saturating_sub(start.elapsed()));
    let mut found = false;
    for _ in 0..2000 {
        dev.harvest();
        let x = dev.alloc(4096, &s3).unwrap();
        found |= x.ptr() == p;
        held.push(x);
        if found {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(found, "the slot is reusable once both streams are done");
    drop(held);
    dev.audit().unwrap();
}

/// Small frees used on another stream record no event each: a probe per
/// stream covers all of them (PyTorch records one event per free: 32
/// here). The slots return to their stream, and none while the other
/// stream's work is pending.
#[test]
fn one_probe_per_stream_covers_many_recorded_frees() {
    let rt = sim_runtime_with(PROBES_ON_DEMAND);
    let dev = rt.device(0).unwrap();
    let sim = sim_of(dev);
    let (s1, s2) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
    sim.stall_stream(0, s2.handle(), Duration::from_millis(300))
        .unwrap();
    let blocks: Vec<_> = (0..32)
        .map(|_| {
            let b = dev.alloc(4096, &s1).unwrap();
            b.record_stream(&s2);
            b
        })
        .collect();
    let freed: Vec<u64> = blocks.iter().map(|b| b.ptr().addr()).collect();
    let records = RecordsSince::now(dev);
    let recorded = || records.count();
    drop(blocks);
    // The first free's probe on s2 (it was quiet); the others promise.
    assert_eq!(recorded(), 1, "32 frees, one event");
    let pending = dev.stats().pending_bytes.current;
    assert!(pending >= 32 * 4096, "{pending}");
    dev.audit().unwrap();
    for _ in 0..5 {
        assert_eq!(dev.harvest(), 0, "s2's work is pending");
    }
    // The probe in flight is older than the later promises: the next one
    // waits for it.
    assert_eq!(recorded(), 1);
    assert!(dev
        .alloc(4096, &s1)
        .is_ok_and(|b| !freed.contains(&b.ptr().addr())));
    assert_eq!(dev.stats().pending_bytes.current, pending);
    // The harvest after the stall releases the first free's slot and
    // records a probe for the later promises; once that probe has run
    // (soon, not at once), the next releases them.
    sim.sync_stream(0, s2.handle()).unwrap();
    let first = dev.harvest();
    sim.sync_stream(0, s2.handle()).unwrap();
    assert_eq!(first + dev.harvest(), 32, "every slot is back");
    assert_eq!(dev.stats().pending_bytes.current, 0);
    assert_eq!(recorded(), 2, "one more probe on s2 for the later frees");
    // Back on s1's stack: s1 reuses them.
    let again = dev.alloc(4096, &s1).unwrap();
    assert!(freed.contains(&again.ptr().addr()));
    drop(again);
    dev.audit().unwrap();
}

/// A framework stream, wrapped, released while a free holds a promise on
/// it that no probe covers yet, then destroyed: its release records the
/// probe while the handle is valid, and the memory comes back after its
/// work with no call on the dead handle.
#[test]
fn a_released_stream_covers_its_promises_before_it_is_destroyed() {
    let rt = sim_runtime_with(PROBES_ON_DEMAND);
    let dev = rt.device(0).unwrap();
    let sim = sim_of(dev);
    let s1 = dev.new_stream().unwrap();
    let h = sim.create_stream(0).unwrap();
    let s2 = dev.stream_from_raw(h);
    sim.stall_stream(0, h, Duration::from_millis(200)).unwrap();
    let (a, b) = (dev.alloc(4096, &s1).unwrap(), dev.alloc(4096, &s1).unwrap());
    a.record_stream(&s2);
    b.record_stream(&s2);
    let records = RecordsSince::now(dev);
    let recorded = || records.count();
    // The first free probes the quiet stream; the second's promise is
    // newer than that probe.
    drop(a);
    drop(b);
    assert_eq!(recorded(), 1);
    drop(s2);
    assert_eq!(recorded(), 2, "the release's probe on s2");
    sim.sync_stream(0, h).unwrap();
    sim.destroy_stream(0, h).unwrap();
    assert_eq!(dev.harvest(), 2);
    assert_eq!(dev.stats().pending_bytes.current, 0);
    rt.trim().unwrap();
    dev.audit().unwrap();
}

/// Every event the pool creates is destroyed with it, a probe still
/// listed at the teardown included: here one a harvest recorded on a
/// stalled stream, for a promise that `trim` then waited for on the host
/// (no query removes the probe after that).
#[test]
fn a_pool_destroys_every_event_it_made_probes_in_flight_included() {
    use gpupool::backend::Call;
    let rt = sim_runtime_with(PROBES_ON_DEMAND);
    let dev = rt.device(0).unwrap();
    let be = dev.backend().clone();
    let sim = sim_of(dev);
    let (s1, s2) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
    let records = RecordsSince::now(dev);
    // s2 is quiet: the free records its probe, which completes at once.
    let a = dev.alloc(4096, &s1).unwrap();
    a.record_stream(&s2);
    drop(a);
    assert_eq!(records.count(), 1);
    sim.sync_stream(0, s2.handle()).unwrap();
    assert_eq!(dev.harvest(), 1);
    // Within the interval: a promise only, then a harvest's probe, which
    // the stall keeps in flight.
    sim.stall_stream(0, s2.handle(), Duration::from_millis(100))
        .unwrap();
    let b = dev.alloc(4096, &s1).unwrap();
    b.record_stream(&s2);
    drop(b);
    assert_eq!(records.count(), 1);
    assert_eq!(dev.harvest(), 0);
    assert_eq!(records.count(), 2, "the harvest's probe");
    // Trim waits for it on the host: nothing left queries it again.
    rt.trim().unwrap();
    assert_eq!(dev.stats().pending_bytes.current, 0);
    drop((s1, s2, rt));
    let c = be.counters();
    assert_eq!(
        c.get(Call::EventCreate),
        c.get(Call::EventDestroy),
        "events leaked"
    );
}

#[test]
fn the_small_fast_lane_keeps_every_check_and_count() {
    // The fast lane serves a pair from the thread's front magazine; these
    // are the checks and counts the general path makes, through it.
    let rt = sim_runtime(2, 256 * MIB);
    let (d0, d1) = (rt.device(0).unwrap(), rt.device(1).unwrap());
    let s1 = d1.new_stream().unwrap();
    let before = d1.stats();
    // Primes the front magazine of `s1` (a typed and a raw pair).
    drop(d1.alloc(1000, &s1).unwrap());
    let p = d1.alloc_raw(1000, &s1).unwrap();
    d1.free_raw(p, &s1).unwrap();

    // Another pool's stream: refused, even with a slot of that stream at
    // hand, and nothing changes.
    assert!(matches!(d0.alloc(1000, &s1), Err(Error::InvalidHandle(_))));
    assert!(matches!(
        d0.alloc_raw(1000, &s1),
        Err(Error::InvalidHandle(_))
    ));
    assert_eq!(d0.stats().num_allocs, 0);

    // Counts: live requested and rounded bytes while a block lives, none
    // after, and every pair counted.
    let b = d1.alloc(1000, &s1).unwrap();
    let live = d1.stats();
    assert_eq!(live.requested_bytes.current, 1000);
    let slot = live.allocated_bytes.current;
    assert!((1000..=2048).contains(&slot), "{slot}");
    drop(b);
    for _ in 0..100 {
        drop(d1.alloc(1000, &s1).unwrap());
        let p = d1.alloc_raw(1000, &s1).unwrap();
        d1.free_raw(p, &s1).unwrap();
    }
    let after = d1.stats();
    assert_eq!(after.num_allocs - before.num_allocs, 203);
    assert_eq!(after.num_frees - before.num_frees, 203);
    assert_eq!(after.requested_bytes.current, 0);
    assert_eq!(after.allocated_bytes.current, 0);
    assert_eq!(after.requested_bytes.peak, 1000);

    // Raw frees through it still refuse bad pointers and change nothing:
    // the slot freed last is the one handed out next (its magazine's top).
    let p = d1.alloc_raw(1000, &s1).unwrap();
    d1.free_raw(p, &s1).unwrap();
    assert!(matches!(d1.free_raw(p, &s1), Err(Error::DoubleFree { .. })));
    let interior = DevicePtr(p.addr() + 256);
    assert!(matches!(
        d1.free_raw(interior, &s1),
        Err(Error::UnknownPointer { .. })
    ));
    let b = d1.alloc(1000, &s1).unwrap();
    assert_eq!(b.ptr(), p);
    assert!(matches!(
        d1.free_raw(b.ptr(), &s1),
        Err(Error::DoubleFree { .. })
    ));
    drop(b);
    d1.audit().unwrap();

    // A thread that exits with slots in its magazine gives them back: all
    // of the pool's memory can be trimmed afterwards.
    std::thread::scope(|sc| {
        sc.spawn(|| {
            let s = d1.new_stream().unwrap();
            for _ in 0..50 {
                drop(d1.alloc(4096, &s).unwrap());
            }
        });
    });
    d1.trim().unwrap();
    let end = d1.audit().unwrap();
    assert_eq!(end.allocated_bytes.current, 0);
    assert_eq!(end.cached_bytes.current, 0, "{end:?}");

    // After a shutdown the primed lane refuses too.
    rt.shutdown();
    assert!(matches!(d1.alloc(1000, &s1), Err(Error::Shutdown)));
    assert!(matches!(d1.alloc_raw(1000, &s1), Err(Error::Shutdown)));
}

/// Every live small block's requested size, in the block and in the
/// snapshot, is its own, however its slot went through the magazine: the
/// fast lane carries each slot's size word beside it (racks fill past
/// their capacity and spill, typed and raw frees interleave), and a word
/// that strayed to another slot would report another block's size, or
/// leave a raw block's live bit unset (its free would fail). No snapshot
/// or audit until the end: both empty this thread's magazines.
#[test]
fn requested_sizes_stay_with_their_slots_through_the_magazine() {
    let rt = sim_runtime(1, 256 * MIB);
    let dev = rt.device(0).unwrap();
    let s = dev.new_stream().unwrap();
    // Sizes of one class (3585..=4096 bytes round to 4 KiB), all distinct
    // within a round.
    let size_of = |round: usize, i: usize| 3585 + (round * 37 + i * 11) % 512;
    let rounds = 6;
    for round in 0..rounds {
        // Forty of each kind: more than a rack holds, so frees spill.
        let typed: Vec<_> = (0..40)
            .map(|i| dev.alloc(size_of(round, i), &s).unwrap())
            .collect();
        let raw: Vec<_> = (40..80)
            .map(|i| {
                (
                    dev.alloc_raw(size_of(round, i), &s).unwrap(),
                    size_of(round, i),
                )
            })
            .collect();
        for (i, b) in typed.iter().enumerate() {
            assert_eq!(b.size(), size_of(round, i), "round {round}, typed {i}");
        }
        let want: u64 = (0..80).map(|i| size_of(round, i) as u64).sum();
        assert_eq!(dev.stats().requested_bytes.current, want, "round {round}");
        if round == rounds - 1 {
            let snap = dev.snapshot();
            let requested_at = |addr: u64| {
                snap.segments
                    .iter()
                    .flat_map(|g| &g.blocks)
                    .find(|b| b.address == addr && b.state == BlockState::ActiveAllocated)
                    .map(|b| b.requested_size)
            };
            for (i, b) in typed.iter().enumerate() {
                assert_eq!(requested_at(b.ptr().addr()), Some(size_of(round, i) as u64));
            }
            for &(p, size) in &raw {
                assert_eq!(requested_at(p.addr()), Some(size as u64));
            }
        }
        // Frees interleaved, typed and raw, in another order than the
        // allocations'.
        let mut typed = typed;
        for (k, (p, _)) in raw.into_iter().enumerate().rev() {
            if k % 2 == 0 {
                typed.pop();
            }
            dev.free_raw(p, &s).unwrap();
        }
        drop(typed);
        assert_eq!(dev.stats().requested_bytes.current, 0);
    }
    dev.audit().unwrap();
}

/// A stream whose own small slots of a class ran dry takes another
/// stream's freed slots once a query finds that stream idle, before a
/// new slab: on many streams each stream's share of a class drifts, and
/// the pool made and retired a slab at every drift.
#[test]
fn an_idle_streams_freed_small_slots_serve_another_stream_before_a_new_slab() {
    use gpupool::backend::Call;
    use std::collections::HashSet;
    let rt = sim_runtime_with("thread_cache=false");
    let dev = rt.device(0).unwrap();
    let (s1, s2) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
    let a: Vec<_> = (0..64).map(|_| dev.alloc(4096, &s1).unwrap()).collect();
    let freed: HashSet<u64> = a.iter().map(|b| b.ptr().0).collect();
    drop(a);
    let reserved = dev.stats().reserved_bytes.current;
    let (records, queries) = (
        driver_calls(dev, Call::EventRecord),
        driver_calls(dev, Call::StreamQuery),
    );
    let b: Vec<_> = (0..64).map(|_| dev.alloc(4096, &s2).unwrap()).collect();
    let got: HashSet<u64> = b.iter().map(|b| b.ptr().0).collect();
    assert_eq!(got, freed, "s2 did not get s1's freed slots");
    assert_eq!(dev.stats().reserved_bytes.current, reserved, "grew");
    assert_eq!(driver_calls(dev, Call::EventRecord), records, "an event");
    assert!(
        driver_calls(dev, Call::StreamQuery) > queries,
        "s1 not asked"
    );
    dev.audit().unwrap();
    drop(b);
    dev.audit().unwrap();
}

/// While that stream still runs work on them, its freed small slots stay
/// its own: the other stream gets other memory, which the late write on
/// the first stream never reaches.
#[test]
fn a_busy_streams_freed_small_slots_stay_its_own() {
    let rt = sim_runtime_with("thread_cache=false");
    let dev = rt.device(0).unwrap();
    let sim = sim_of(dev);
    let (s1, s2) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
    let a: Vec<_> = (0..64).map(|_| dev.alloc(4096, &s1).unwrap()).collect();
    let busy = Busy::hold(sim, &s1);
    for b in &a {
        sim.launch_write_pattern(0, s1.handle(), b.ptr(), 4096, 7, Duration::ZERO)
            .unwrap();
    }
    drop(a);
    let b: Vec<_> = (0..64).map(|_| dev.alloc(4096, &s2).unwrap()).collect();
    for x in &b {
        sim.launch_write_pattern(0, s2.handle(), x.ptr(), 4096, 8, Duration::ZERO)
            .unwrap();
    }
    busy.release();
    for x in &b {
        let r = sim
            .launch_verify_pattern(0, s2.handle(), x.ptr(), 4096, 8, Duration::ZERO)
            .unwrap();
        assert_eq!(r.wait(), 0, "s1's late write landed on s2's block");
    }
    drop(b);
    dev.audit().unwrap();
}

/// Driver calls run outside the device's heap lock (`heap/map_job.rs`):
/// while one thread waits in a slow `cuMemMap` (the simulator's map
/// delay, 2 s), another stream takes the heap lock for memory it already
/// backs (its own freed range: large-path reuse, no driver call) and
/// returns before that map does.
#[test]
fn a_slow_map_does_not_stall_another_streams_reuse() {
    use gpupool::backend::Call;
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    let rt = sim_runtime(1, 1 << 30);
    let pool = rt.device(0).unwrap();
    let sim = sim_of(pool);
    let (x, y) = (pool.new_stream().unwrap(), pool.new_stream().unwrap());
    // Backed memory of y's own: 4 MiB freed on y, which stays busy (its
    // memory is y's alone, neither clean for x nor stealable by it).
    let p = pool.alloc_raw(4 * MIB as usize, &y).unwrap();
    pool.free_raw(p, &y).unwrap();
    sim.stall_stream(0, y.handle(), Duration::from_secs(4))
        .unwrap();
    let maps = || sim.counters().get(Call::Map);
    let before = maps();
    sim.set_map_delay(0, Duration::from_secs(2)).unwrap();
    let mapped = AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            // Fresh granules: a map of 2 s.
            let q = pool.alloc_raw(64 * MIB as usize, &x).unwrap();
            mapped.store(true, SeqCst);
            pool.free_raw(q, &x).unwrap();
        });
        while maps() == before {
            std::thread::yield_now();
        }
        // x is inside its map call now.
        let in_map = maps();
        let r = pool.alloc_raw(3 * MIB as usize, &y).unwrap();
        assert!(
            !mapped.load(SeqCst),
            "y's reuse waited for x's map (a driver call under the heap lock)"
        );
        assert_eq!(maps(), in_map, "y's reuse mapped memory");
        pool.free_raw(r, &y).unwrap();
    });
    sim.set_map_delay(0, Duration::ZERO).unwrap();
    pool.audit().unwrap();
}
