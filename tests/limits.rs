//! Memory limits (`max_bytes`, `fraction`, `set_memory_limit`), memory
//! reserved up front (`initial_bytes`), the out-of-memory callback, and the
//! statistics' PyTorch meanings, on the simulator (virtual memory and plain
//! segments alike).

use gpupool::backend::sim::SimBackend;
use gpupool::backend::Backend;
use gpupool::{DevicePool, Error, OomReport, PoolConfig, Runtime};
use std::sync::{Arc, Mutex};
use std::time::Duration;

mod common;

const MIB: u64 = 1 << 20;

fn runtime(conf: &str) -> (Runtime, Arc<SimBackend>) {
    common::sim_runtime(conf)
}

/// Allocates `step`-byte raw blocks until out of memory; returns them and
/// the error, checking that the pool and the device never hold more than
/// `limit`.
fn fill(
    dev: &DevicePool,
    sim: &SimBackend,
    step: usize,
    limit: u64,
) -> (Vec<gpupool::DevicePtr>, Error) {
    let s = dev.default_stream();
    let mut live = Vec::new();
    loop {
        match dev.alloc_raw(step, s) {
            Ok(p) => live.push(p),
            Err(e) => return (live, e),
        }
        let st = dev.stats();
        assert!(st.reserved_bytes.current <= limit, "{st:?}");
        assert!(
            sim.used_bytes(0) <= limit,
            "device holds {}",
            sim.used_bytes(0)
        );
        assert!(
            live.len() as u64 * step as u64 <= 2 * limit,
            "no limit reached"
        );
    }
}

fn check_limit(conf: &str, limit: u64) {
    let (rt, sim) = runtime(conf);
    let dev = rt.device(0).unwrap();
    assert_eq!(dev.memory_limit(), Some(limit), "{conf}");
    for step in [3 * MIB as usize, 100 << 10, 1000] {
        let (live, e) = fill(dev, &sim, step, limit);
        assert!(
            matches!(e, Error::OutOfMemory(_)),
            "{conf}, {step} B: {e:?}"
        );
        // Most of the limit was usable.
        let used = live.len() as u64 * step as u64;
        assert!(
            used * 10 >= limit * 7,
            "{conf}, {step} B: only {used} of {limit} B served"
        );
        assert!(dev.stats().reserved_bytes.peak <= limit);
        for p in live {
            dev.free_raw(p, dev.default_stream()).unwrap();
        }
        dev.trim().unwrap();
        dev.audit().unwrap();
    }
    assert!(dev.stats().num_ooms >= 3);
}

#[test]
fn max_bytes_caps_what_the_pool_reserves() {
    check_limit("backend=sim,capacity=1GiB,max_bytes=64MiB", 64 * MIB);
}

#[test]
fn fraction_caps_what_the_pool_reserves() {
    check_limit("backend=sim,capacity=256MiB,fraction=0.25", 64 * MIB);
    // With both keys the smaller limit wins.
    check_limit(
        "backend=sim,capacity=256MiB,fraction=0.5,max_bytes=48MiB",
        48 * MIB,
    );
}

#[test]
fn limits_hold_with_plain_segments_too() {
    check_limit(
        "backend=sim,capacity=1GiB,vmm=false,max_bytes=64MiB",
        64 * MIB,
    );
}

#[test]
fn bad_limit_keys_name_the_key() {
    for bad in [
        "fraction=0",
        "fraction=1.5",
        "fraction=x",
        "max_bytes=lots",
        "initial_bytes=-1",
    ] {
        match PoolConfig::parse(bad) {
            Err(Error::Config { key, .. }) => assert_eq!(key, bad.split('=').next().unwrap()),
            other => panic!("{bad}: {other:?}"),
        }
    }
    let c = PoolConfig::parse("max_bytes=0,fraction=1").unwrap();
    assert_eq!(
        (c.max_bytes, c.memory_fraction),
        (None, None),
        "0 and 1: no limit"
    );
}

#[test]
fn initial_bytes_are_reserved_when_the_pool_is_built() {
    let (rt, sim) = runtime("backend=sim,capacity=256MiB,initial_bytes=20MiB");
    assert_eq!(sim.used_bytes(0), 0, "pools start on first use");
    let dev = rt.device(0).unwrap();
    let st = dev.stats();
    assert_eq!(st.reserved_bytes.current, 20 * MIB);
    assert_eq!(st.cached_bytes.current, 20 * MIB);
    assert_eq!(sim.used_bytes(0), 20 * MIB);
    let grown = st.num_device_allocs;
    // Served from the reserve: no device allocation.
    let s = dev.default_stream();
    let a = dev.alloc(8 << 20, s).unwrap();
    let b = dev.alloc(4096, s).unwrap();
    assert_eq!(dev.stats().num_device_allocs, grown);
    drop((a, b));
    dev.audit().unwrap();
    // Larger than a limit: building the pool fails cleanly.
    let (rt, _) = runtime("backend=sim,capacity=256MiB,initial_bytes=32MiB,max_bytes=16MiB");
    assert!(rt.device(0).unwrap_err().is_oom());
}

#[test]
fn set_memory_limit_releases_cache_then_refuses_growth() {
    let (rt, sim) = runtime("backend=sim,capacity=256MiB");
    let dev = rt.device(0).unwrap();
    let s = dev.default_stream();
    let keep = dev.alloc_raw(30 * MIB as usize, s).unwrap();
    let gone = dev.alloc_raw(60 * MIB as usize, s).unwrap();
    dev.free_raw(gone, s).unwrap();
    assert!(dev.stats().reserved_bytes.current >= 90 * MIB);
    // Below what is held: the cache goes, the live block stays.
    let released = dev.set_memory_limit(Some(20 * MIB)).unwrap();
    assert!(released >= 60 * MIB, "released {released}");
    assert_eq!(dev.memory_limit(), Some(20 * MIB));
    let held = dev.stats().reserved_bytes.current;
    assert!((30 * MIB..=32 * MIB).contains(&held), "held {held}");
    assert_eq!(sim.used_bytes(0), held);
    // Over the limit: no growth at all.
    let e = dev.alloc_raw(4 * MIB as usize, s).unwrap_err();
    assert!(matches!(e, Error::OutOfMemory(_)), "{e:?}");
    assert_eq!(dev.stats().reserved_bytes.current, held);
    // Raised: it grows again; lifted: up to the device.
    dev.set_memory_limit(Some(40 * MIB)).unwrap();
    let p = dev.alloc_raw(4 * MIB as usize, s).unwrap();
    assert!(dev.alloc_raw(20 * MIB as usize, s).is_err());
    dev.set_memory_limit(None).unwrap();
    assert_eq!(dev.memory_limit(), None);
    let q = dev.alloc_raw(100 * MIB as usize, s).unwrap();
    for x in [keep, p, q] {
        dev.free_raw(x, s).unwrap();
    }
    dev.audit().unwrap();
}

#[test]
fn on_oom_is_called_once_per_out_of_memory_error() {
    let (rt, _) = runtime("backend=sim,capacity=256MiB,max_bytes=32MiB");
    let dev = rt.device(0).unwrap();
    let seen: Arc<Mutex<Vec<OomReport>>> = Arc::default();
    {
        let seen = seen.clone();
        dev.on_oom(Box::new(move |r| seen.lock().unwrap().push(*r)));
    }
    let s = dev.default_stream();
    let a = dev.alloc_raw(20 * MIB as usize, s).unwrap();
    assert!(seen.lock().unwrap().is_empty());
    let e = dev.alloc_raw(20 * MIB as usize, s).unwrap_err();
    let Error::OutOfMemory(report) = e else {
        panic!("{e:?}")
    };
    {
        let seen = seen.lock().unwrap();
        assert_eq!(seen.len(), 1);
        assert_eq!(seen[0], *report);
        assert_eq!((seen[0].device, seen[0].requested), (0, 20 * MIB));
        assert_eq!(seen[0].live, 20 * MIB);
    }
    // Small requests too (a slab the limit refuses).
    let mut small = Vec::new();
    let e = loop {
        match dev.alloc_raw(1000, s) {
            Ok(p) => small.push(p),
            Err(e) => break e,
        }
    };
    assert!(e.is_oom());
    assert_eq!(seen.lock().unwrap().len(), 2);
    assert_eq!(seen.lock().unwrap()[1].requested, 1000);
    dev.clear_on_oom();
    assert!(dev.alloc_raw(20 * MIB as usize, s).is_err());
    assert_eq!(seen.lock().unwrap().len(), 2);
    for p in small.into_iter().chain([a]) {
        dev.free_raw(p, s).unwrap();
    }
}

#[test]
fn stats_have_pytorchs_meanings() {
    let (rt, sim) = runtime("backend=sim,capacity=256MiB");
    let dev = rt.device(0).unwrap();
    let (s1, s2) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
    let a = dev.alloc(100, &s1).unwrap();
    let b = dev.alloc(3 * MIB as usize + 1, &s1).unwrap();
    let st = dev.stats();
    assert_eq!(st.requested_bytes.current, 100 + 3 * MIB + 1);
    // Rounded sizes: a slot of at least 256 B, a range of whole 256 B units.
    assert!(st.allocated_bytes.current >= 256 + 3 * MIB + 256, "{st:?}");
    assert_eq!(
        st.active_bytes.current, st.allocated_bytes.current,
        "nothing pending"
    );
    assert!(st.reserved_bytes.current >= st.active_bytes.current);
    assert_eq!(
        st.reserved_bytes.current,
        st.allocated_bytes.current
            + st.pending_bytes.current
            + st.cached_bytes.current
            + st.overhead_bytes
    );
    let flat = st.memory_stats();
    assert_eq!(
        flat["requested_bytes.all.current"],
        st.requested_bytes.current
    );
    assert_eq!(
        flat["allocated_bytes.all.current"],
        st.allocated_bytes.current
    );
    assert_eq!(flat["allocation.all.current"], 2);
    // A block still read on another stream when freed: no longer
    // allocated, still active (pending) until that read completes.
    sim.stall_stream(0, s2.handle(), Duration::from_millis(300))
        .unwrap();
    b.record_stream(&s2);
    let b_rounded = st.allocated_bytes.current - dev.stats().allocated_bytes.current;
    assert_eq!(b_rounded, 0);
    drop(b);
    let st2 = dev.stats();
    assert_eq!(st2.requested_bytes.current, 100);
    assert!(st2.pending_bytes.current >= 3 * MIB, "{st2:?}");
    assert_eq!(
        st2.active_bytes.current,
        st2.allocated_bytes.current + st2.pending_bytes.current
    );
    assert!(st2.active_bytes.current > st2.allocated_bytes.current);
    // Peaks, and resetting them.
    assert_eq!(st2.requested_bytes.peak, 100 + 3 * MIB + 1);
    sim.sync_stream(0, s2.handle()).unwrap();
    dev.harvest();
    dev.reset_peak_stats();
    let st3 = dev.stats();
    assert_eq!(st3.requested_bytes.peak, 100);
    assert_eq!(st3.allocated_bytes.peak, st3.allocated_bytes.current);
    assert_eq!(st3.active_bytes.peak, st3.active_bytes.current);
    assert_eq!(st3.reserved_bytes.peak, st3.reserved_bytes.current);
    // Inactive split: the free slots beside the live 100-byte block share
    // its slab, and cannot go back to the device; once it is freed and the
    // pool trimmed, nothing is held.
    assert!(st3.inactive_split_bytes.current > 0, "{st3:?}");
    assert!(st3.inactive_split_bytes.current <= st3.cached_bytes.current);
    drop(a);
    dev.trim().unwrap();
    let st4 = dev.stats();
    assert_eq!(st4.reserved_bytes.current, 0, "{st4:?}");
    assert_eq!(st4.inactive_split_bytes.current, 0);
    assert_eq!(st4.active_bytes.current, 0);
    dev.audit().unwrap();
}
