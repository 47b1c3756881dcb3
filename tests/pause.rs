//! Tagged allocations, pause and resume on the simulator: byte patterns
//! survive a pause with save, physical memory really goes back to the
//! device (backend counters, pool statistics), and the rules of
//! `src/pool/pause.rs` (unknown tags, double pause and resume, frees of
//! paused blocks, limits, in-flight work, segment mode).

use gpupool::backend::sim::SimBackend;
use gpupool::backend::{Backend, Call};
use gpupool::{DevicePool, Error, Runtime};
use std::sync::Arc;
use std::time::Duration;

mod common;

const MIB: u64 = 1 << 20;
const GRAN: u64 = 2 * MIB;

fn runtime(conf: &str) -> (Runtime, Arc<SimBackend>) {
    common::sim_runtime(conf)
}

fn sim_rt() -> (Runtime, Arc<SimBackend>) {
    runtime("backend=sim,devices=2,capacity=256MiB")
}

fn audit(dev: &DevicePool) -> gpupool::PoolStats {
    dev.audit().unwrap_or_else(|e| panic!("audit: {e}"))
}

/// Writes the pattern of `seed` over `[ptr, ptr+len)` on `s`, `delay` late.
fn write(
    sim: &SimBackend,
    s: &gpupool::Stream,
    ptr: gpupool::DevicePtr,
    len: u64,
    seed: u64,
    delay: u64,
) {
    sim.launch_write_pattern(0, s.handle(), ptr, len, seed, Duration::from_millis(delay))
        .unwrap();
}

/// Checks the pattern of `seed` over `[ptr, ptr+len)` on `s`, after the
/// work enqueued there so far (waits for it).
fn verify(
    sim: &SimBackend,
    s: &gpupool::Stream,
    ptr: gpupool::DevicePtr,
    len: u64,
    seed: u64,
) -> u64 {
    let r = sim
        .launch_verify_pattern(0, s.handle(), ptr, len, seed, Duration::ZERO)
        .unwrap();
    sim.sync_stream(0, s.handle()).unwrap();
    r.mismatches().expect("the verify kernel ran")
}

#[test]
fn a_paused_block_gives_its_memory_back_and_resume_restores_its_bytes() {
    let (rt, sim) = sim_rt();
    let dev = rt.device(0).unwrap();
    let s = dev.new_stream().unwrap();
    let size = 5 * MIB as usize + 4096;
    let b = dev.alloc_tagged(size, &s, 7).unwrap();
    assert_eq!(
        b.ptr().addr() % GRAN,
        0,
        "tagged blocks are granule aligned"
    );
    let st = audit(dev);
    assert_eq!(st.allocated_bytes.current, 6 * MIB, "rounded to granules");
    assert_eq!(st.requested_bytes.current, size as u64);
    // Written late on its stream: pause must wait for the write first.
    write(&sim, &s, b.ptr(), size as u64, 42, 30);
    let used = sim.used_bytes(0);
    let before = sim.counters();
    let released = dev.pause(7, true).unwrap();
    assert_eq!(released, 6 * MIB);
    assert_eq!(sim.used_bytes(0), used - 6 * MIB, "chunks released");
    let d = sim.counters().since(&before);
    assert_eq!(d.get(Call::MemRelease), 3);
    assert_eq!(d.get(Call::Unmap), 3);
    let st = audit(dev);
    assert_eq!(st.paused_bytes, 6 * MIB);
    assert_eq!(st.allocated_bytes.current, 6 * MIB, "still live");
    assert_eq!(st.reserved_bytes.current, used - 6 * MIB);
    let info = dev.tag_info(7);
    assert_eq!((info.blocks, info.paused_blocks), (1, 1));
    assert_eq!(info.saved_bytes, size as u64);
    assert_eq!(dev.memory_stats_paused(), 6 * MIB);

    let mapped = dev.resume(7).unwrap();
    assert_eq!(mapped, 6 * MIB);
    assert_eq!(sim.used_bytes(0), used);
    let st = audit(dev);
    assert_eq!(st.paused_bytes, 0);
    assert_eq!(
        verify(&sim, &s, b.ptr(), size as u64, 42),
        0,
        "bytes restored"
    );
    assert_eq!(sim.integrity_errors(0), 0);
    assert_eq!(sim.device_faults(0), 0);
    drop(b);
    audit(dev);
}

/// The paused figure as `memory_stats()` gives it.
trait PausedStat {
    fn memory_stats_paused(&self) -> u64;
}

impl PausedStat for DevicePool {
    fn memory_stats_paused(&self) -> u64 {
        self.stats().memory_stats()["paused_bytes.all.current"]
    }
}

#[test]
fn without_save_the_addresses_work_after_resume() {
    let (rt, sim) = sim_rt();
    let dev = rt.device(0).unwrap();
    let s = dev.default_stream();
    let p = dev.alloc_raw_tagged(3 * MIB as usize, s, 1).unwrap();
    write(&sim, s, p, 3 * MIB, 5, 0);
    assert_eq!(dev.pause(1, false).unwrap(), 4 * MIB);
    assert_eq!(dev.tag_info(1).saved_bytes, 0);
    // Touching paused memory faults, like an unmapped address on a GPU.
    write(&sim, s, p, 3 * MIB, 6, 0);
    sim.sync_stream(0, s.handle()).unwrap();
    assert!(sim.device_faults(0) > 0);
    let faults = sim.device_faults(0);
    dev.resume(1).unwrap();
    write(&sim, s, p, 3 * MIB, 9, 0);
    assert_eq!(verify(&sim, s, p, 3 * MIB, 9), 0);
    assert_eq!(sim.device_faults(0), faults, "mapped again");
    dev.free_raw(p, s).unwrap();
    audit(dev);
}

#[test]
fn unknown_tags_and_repeated_calls_are_no_ops() {
    let (rt, _sim) = sim_rt();
    let dev = rt.device(0).unwrap();
    assert_eq!(dev.pause(99, true).unwrap(), 0);
    assert_eq!(dev.resume(99).unwrap(), 0);
    let s = dev.default_stream();
    let b = dev.alloc_tagged(MIB as usize, s, 3).unwrap();
    let calls = dev.backend().counters().total_calls();
    assert_eq!(dev.resume(3).unwrap(), 0, "nothing paused");
    assert_eq!(dev.pause(3, true).unwrap(), GRAN);
    assert_eq!(dev.pause(3, false).unwrap(), 0, "already paused");
    assert_eq!(
        dev.tag_info(3).saved_bytes,
        MIB,
        "the first pause's save kept"
    );
    assert_eq!(dev.resume(3).unwrap(), GRAN);
    assert_eq!(dev.resume(3).unwrap(), 0, "already resumed");
    assert!(dev.backend().counters().total_calls() > calls);
    drop(b);
    audit(dev);
}

#[test]
fn freeing_a_paused_block_makes_no_driver_call_on_its_memory() {
    let (rt, sim) = sim_rt();
    let dev = rt.device(0).unwrap();
    let s = dev.new_stream().unwrap();
    let b = dev.alloc_tagged(4 * MIB as usize, &s, 2).unwrap();
    let p = dev.alloc_raw_tagged(MIB as usize, &s, 2).unwrap();
    dev.pause(2, true).unwrap();
    let used = sim.used_bytes(0);
    let before = sim.counters();
    drop(b);
    dev.free_raw(p, &s).unwrap();
    let d = sim.counters().since(&before);
    for c in [Call::Unmap, Call::MemRelease, Call::Map, Call::MemCreate] {
        assert_eq!(d.get(c), 0, "{c:?}");
    }
    assert_eq!(sim.used_bytes(0), used);
    assert_eq!(dev.tag_info(2).blocks, 0);
    assert_eq!(dev.resume(2).unwrap(), 0, "nothing left to resume");
    let st = audit(dev);
    assert_eq!(st.paused_bytes, 0);
    assert_eq!(st.allocated_bytes.current, 0);
    // The addresses are ordinary free memory again.
    let again = dev.alloc(6 * MIB as usize, &s).unwrap();
    write(&sim, &s, again.ptr(), 6 * MIB, 1, 0);
    assert_eq!(verify(&sim, &s, again.ptr(), 6 * MIB, 1), 0);
    drop(again);
    audit(dev);
    assert_eq!(sim.device_faults(0), 0);
}

#[test]
fn tagged_blocks_share_no_granule_with_their_neighbours() {
    let (rt, sim) = sim_rt();
    let dev = rt.device(0).unwrap();
    let s = dev.default_stream();
    // Small and large untagged neighbours, allocated around tagged ones.
    let mut others = Vec::new();
    let mut tagged = Vec::new();
    for i in 0..6u64 {
        others.push((dev.alloc_raw(4096, s).unwrap(), 4096u64));
        tagged.push(dev.alloc_raw_tagged(300_000, s, 11).unwrap());
        others.push((
            dev.alloc_raw(700_000 + i as usize * 4096, s).unwrap(),
            700_000 + i * 4096,
        ));
    }
    for (i, &(p, len)) in others.iter().enumerate() {
        write(&sim, s, p, len, 100 + i as u64, 0);
    }
    for &p in &tagged {
        assert_eq!(p.addr() % GRAN, 0);
        for &(o, len) in &others {
            let disjoint = o.addr() + len <= p.addr() || p.addr() + GRAN <= o.addr();
            let same_granule = o.addr() / GRAN == p.addr() / GRAN
                || (o.addr() + len - 1) / GRAN == p.addr() / GRAN;
            assert!(
                disjoint && !same_granule,
                "{o:?} shares a granule with {p:?}"
            );
        }
    }
    assert_eq!(dev.pause(11, false).unwrap(), 6 * GRAN);
    audit(dev);
    for (i, &(p, len)) in others.iter().enumerate() {
        assert_eq!(verify(&sim, s, p, len, 100 + i as u64), 0, "neighbour {i}");
    }
    assert_eq!(sim.device_faults(0), 0);
    // Stitching a large block while paused: idle memory is stolen, paused
    // granules never are.
    let big = dev.alloc_raw(40 * MIB as usize, s).unwrap();
    write(&sim, s, big, 40 * MIB, 7, 0);
    assert_eq!(verify(&sim, s, big, 40 * MIB, 7), 0);
    audit(dev);
    dev.resume(11).unwrap();
    audit(dev);
    for p in tagged {
        dev.free_raw(p, s).unwrap();
    }
    for (p, _) in others {
        dev.free_raw(p, s).unwrap();
    }
    dev.free_raw(big, s).unwrap();
    audit(dev);
    assert_eq!(sim.device_faults(0), 0);
}

#[test]
fn pause_waits_for_work_on_recorded_streams() {
    let (rt, sim) = sim_rt();
    let dev = rt.device(0).unwrap();
    let s1 = dev.new_stream().unwrap();
    let s2 = dev.new_stream().unwrap();
    let b = dev.alloc_tagged(2 * MIB as usize, &s1, 4).unwrap();
    b.record_stream(&s2);
    // The last write runs on s2, late: the saved bytes must be its.
    write(&sim, &s1, b.ptr(), 2 * MIB, 1, 0);
    sim.sync_stream(0, s1.handle()).unwrap();
    write(&sim, &s2, b.ptr(), 2 * MIB, 2, 40);
    let syncs = sim.counters().host_syncs_of(0);
    dev.pause(4, true).unwrap();
    assert!(
        sim.counters().host_syncs_of(0) > syncs,
        "pause waits on the host"
    );
    dev.resume(4).unwrap();
    assert_eq!(verify(&sim, &s2, b.ptr(), 2 * MIB, 2), 0);
    assert_eq!(sim.device_faults(0), 0);
    drop(b);
    audit(dev);
}

#[test]
fn resume_under_a_limit_fails_cleanly_and_changes_nothing() {
    let (rt, sim) = sim_rt();
    let dev = rt.device(0).unwrap();
    let s = dev.default_stream();
    let b = dev.alloc_tagged(8 * MIB as usize, s, 5).unwrap();
    write(&sim, s, b.ptr(), 8 * MIB, 77, 0);
    dev.pause(5, true).unwrap();
    // Someone else takes the memory the pause gave back.
    dev.set_memory_limit(Some(16 * MIB)).unwrap();
    let other = dev.alloc_raw(12 * MIB as usize, s).unwrap();
    let st = audit(dev);
    let used = sim.used_bytes(0);
    let err = dev.resume(5).unwrap_err();
    assert!(matches!(err, Error::OutOfMemory(_)), "{err}");
    let info = dev.tag_info(5);
    assert_eq!((info.paused_blocks, info.saved_bytes), (1, 8 * MIB));
    let after = audit(dev);
    assert_eq!(after.paused_bytes, st.paused_bytes);
    assert_eq!(after.allocated_bytes.current, st.allocated_bytes.current);
    assert!(sim.used_bytes(0) <= used);
    assert!(after.reserved_bytes.current <= 16 * MIB);
    // Room again: resume succeeds with the bytes intact.
    dev.free_raw(other, s).unwrap();
    dev.resume(5).unwrap();
    assert_eq!(verify(&sim, s, b.ptr(), 8 * MIB, 77), 0);
    drop(b);
    audit(dev);
}

#[test]
fn resume_fails_cleanly_when_the_device_refuses_memory() {
    let (rt, sim) = runtime("backend=sim,devices=1,capacity=64MiB");
    let dev = rt.device(0).unwrap();
    let s = dev.default_stream();
    let a = dev.alloc_raw_tagged(6 * MIB as usize, s, 8).unwrap();
    let b = dev.alloc_raw_tagged(6 * MIB as usize, s, 8).unwrap();
    write(&sim, s, a, 6 * MIB, 1, 0);
    write(&sim, s, b, 6 * MIB, 2, 0);
    dev.pause(8, true).unwrap();
    // The second block's second chunk fails: the first block, already
    // mapped again, is paused again and both keep their saved bytes.
    let used = sim.used_bytes(0);
    sim.fail_nth_physical(0, 5).unwrap();
    let err = dev.resume(8).unwrap_err();
    assert!(matches!(err, Error::InjectedFault(_)), "{err}");
    let info = dev.tag_info(8);
    assert_eq!((info.paused_blocks, info.saved_bytes), (2, 12 * MIB));
    assert_eq!(sim.used_bytes(0), used);
    audit(dev);
    dev.resume(8).unwrap();
    assert_eq!(verify(&sim, s, a, 6 * MIB, 1), 0);
    assert_eq!(verify(&sim, s, b, 6 * MIB, 2), 0);
    dev.free_raw(a, s).unwrap();
    dev.free_raw(b, s).unwrap();
    audit(dev);
}

#[test]
fn blocks_allocated_while_their_tag_is_paused_are_live() {
    let (rt, sim) = sim_rt();
    let dev = rt.device(0).unwrap();
    let s = dev.default_stream();
    let a = dev.alloc_raw_tagged(MIB as usize, s, 6).unwrap();
    dev.pause(6, false).unwrap();
    let b = dev.alloc_raw_tagged(MIB as usize, s, 6).unwrap();
    write(&sim, s, b, MIB, 3, 0);
    assert_eq!(verify(&sim, s, b, MIB, 3), 0);
    let info = dev.tag_info(6);
    assert_eq!((info.blocks, info.paused_blocks), (2, 1));
    assert_eq!(dev.resume(6).unwrap(), GRAN, "only the paused one");
    assert_eq!(dev.pause(6, true).unwrap(), 2 * GRAN, "both now");
    dev.resume(6).unwrap();
    assert_eq!(verify(&sim, s, b, MIB, 3), 0);
    dev.free_raw(a, s).unwrap();
    dev.free_raw(b, s).unwrap();
    audit(dev);
    assert_eq!(sim.device_faults(0), 0);
}

#[test]
fn the_runtime_pauses_and_resumes_every_device() {
    let (rt, sim) = sim_rt();
    let d0 = rt.device(0).unwrap();
    let d1 = rt.device(1).unwrap();
    let a = d0
        .alloc_raw_tagged(3 * MIB as usize, d0.default_stream(), 9)
        .unwrap();
    let b = d1
        .alloc_raw_tagged(MIB as usize, d1.default_stream(), 9)
        .unwrap();
    let used = sim.used_bytes(0) + sim.used_bytes(1);
    assert_eq!(rt.pause(9, false).unwrap(), 3 * GRAN);
    assert_eq!(sim.used_bytes(0) + sim.used_bytes(1), used - 3 * GRAN);
    assert_eq!(rt.resume(9).unwrap(), 3 * GRAN);
    assert_eq!(sim.used_bytes(0) + sim.used_bytes(1), used);
    d0.free_raw(a, d0.default_stream()).unwrap();
    d1.free_raw(b, d1.default_stream()).unwrap();
    audit(d0);
    audit(d1);
}

#[test]
fn segment_mode_refuses_with_a_typed_error() {
    let (rt, _sim) = runtime("backend=sim,devices=1,capacity=64MiB,vmm=false");
    let dev = rt.device(0).unwrap();
    let s = dev.default_stream();
    assert!(matches!(
        dev.alloc_tagged(MIB as usize, s, 1),
        Err(Error::Unsupported(_))
    ));
    assert!(matches!(dev.pause(1, true), Err(Error::Unsupported(_))));
    assert!(matches!(dev.resume(1), Err(Error::Unsupported(_))));
    assert!(matches!(rt.pause(1, true), Err(Error::Unsupported(_))));
    audit(dev);
}

#[test]
fn bad_input_to_tagged_alloc_changes_nothing() {
    let (rt, _sim) = sim_rt();
    let dev = rt.device(0).unwrap();
    let s = dev.default_stream();
    let before = audit(dev);
    assert!(matches!(
        dev.alloc_tagged(0, s, 1),
        Err(Error::InvalidSize { .. })
    ));
    assert!(matches!(
        dev.alloc_tagged(1 << 40, s, 1),
        Err(Error::InvalidSize { .. })
    ));
    let other = rt.device(1).unwrap();
    assert!(matches!(
        dev.alloc_tagged(MIB as usize, other.default_stream(), 1),
        Err(Error::InvalidHandle(_))
    ));
    assert_eq!(dev.tag_info(1).blocks, 0);
    let after = audit(dev);
    assert_eq!(after.allocated_bytes, before.allocated_bytes);
    assert_eq!(after.reserved_bytes, before.reserved_bytes);
}

#[test]
fn a_pool_dropped_with_paused_blocks_gives_everything_back() {
    let (rt, sim) = sim_rt();
    {
        let dev = rt.device(0).unwrap();
        let s = dev.new_stream().unwrap();
        let _p = dev.alloc_raw_tagged(5 * MIB as usize, &s, 1).unwrap();
        let _q = dev.alloc_raw_tagged(MIB as usize, &s, 2).unwrap();
        dev.pause(1, true).unwrap();
    }
    drop(rt);
    assert_eq!(sim.used_bytes(0), 0);
}
