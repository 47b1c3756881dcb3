//! Harvesting pending frees asks the device little: a stream runs its work
//! in order, so its events complete in order, and a few queries per stream
//! settle every record waiting on it (`pool/event_order.rs`).

use gpupool::backend::sim::SimBackend;
use gpupool::backend::{Backend, Call};
use gpupool::{PoolConfig, Runtime, SimConfig};
use std::sync::Arc;
use std::time::Duration;

/// One simulated device of 1 GiB and a runtime with no maintenance thread:
/// the harvests a test sees are its own and the pool's inline ones.
fn sim_without_maintenance() -> (Arc<SimBackend>, Runtime) {
    let be = Arc::new(
        SimBackend::new(SimConfig {
            devices: 1,
            capacity_bytes: 1 << 30,
            ..Default::default()
        })
        .unwrap(),
    );
    let cfg = PoolConfig {
        maintenance_tick: None,
        ..PoolConfig::default()
    };
    let rt = Runtime::with_backend(be.clone(), cfg).unwrap();
    (be, rt)
}

#[test]
fn harvest_queries_a_few_events_per_stream_not_one_per_record() {
    let (be, rt) = sim_without_maintenance();
    let dev = rt.device(0).unwrap();
    let (a, b) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
    // Stream b is busy for a while: every event recorded on it stays pending.
    let busy = dev.alloc_raw(4096, &b).unwrap();
    be.launch_write_pattern(0, b.handle(), busy, 4096, 1, Duration::from_millis(400))
        .unwrap();
    const N: usize = 64;
    let ptrs: Vec<_> = (0..N)
        .map(|_| dev.alloc_raw(64 << 10, &a).unwrap())
        .collect();
    for &p in &ptrs {
        // Used on b too: the free waits for an event on a and one on b.
        dev.record_stream_raw(p, &b).unwrap();
        dev.free_raw(p, &a).unwrap();
    }
    // Stream a's events have completed (its worker ran them); b's wait.
    be.sync_stream(0, a.handle()).unwrap();
    let queries = || be.counters().get(Call::EventQuery);
    let q0 = queries();
    let released = dev.harvest();
    let asked = queries() - q0;
    assert_eq!(released, 0, "b's events are pending: nothing is released");
    assert!(
        asked <= 4,
        "{asked} event queries for {N} pending records on two streams"
    );
    // Once b is done, one more pass releases every record, again with a
    // few queries.
    be.sync_stream(0, b.handle()).unwrap();
    let q1 = queries();
    let released = dev.harvest();
    let asked = queries() - q1;
    assert!(released >= 1, "the records are released");
    assert!(asked <= 4, "{asked} event queries to release them");
    assert_eq!(
        dev.stats().pending_bytes.current,
        0,
        "nothing pending any more"
    );
    dev.free_raw(busy, &b).unwrap();
}

/// A user never calls `harvest`: the threads that free `record_stream`'d
/// blocks run a pass every so often themselves (`HARVEST_PACE`, 32), so
/// what completed comes back with no allocation slow path, no maintenance
/// thread and no explicit call.
#[test]
fn record_stream_frees_harvest_as_they_go() {
    let (be, rt) = sim_without_maintenance();
    let dev = rt.device(0).unwrap();
    let (a, b) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
    const MIB: usize = 1 << 20;
    let blocks: Vec<_> = (0..32)
        .map(|_| dev.alloc_raw(2 * MIB, &a).unwrap())
        .collect();
    let recorded_free = |p| {
        dev.record_stream_raw(p, &b).unwrap();
        dev.free_raw(p, &a).unwrap();
    };
    for &p in &blocks[..31] {
        recorded_free(p);
    }
    // Every use has completed, but no pass has looked yet.
    be.sync_stream(0, a.handle()).unwrap();
    be.sync_stream(0, b.handle()).unwrap();
    let pending = dev.stats().pending_bytes.current;
    assert_eq!(pending, 31 * 2 * MIB as u64, "all 31 wait for a pass");
    // The 32nd such free runs one: only its own block can still wait.
    recorded_free(blocks[31]);
    let pending = dev.stats().pending_bytes.current;
    assert!(pending <= 2 * MIB as u64, "{pending} bytes still pending");
    // Typed blocks the same way: 31 wait, the 32nd free releases them.
    let mut typed: Vec<_> = (0..32).map(|_| dev.alloc(2 * MIB, &a).unwrap()).collect();
    let last = typed.pop().unwrap();
    for blk in typed {
        blk.record_stream(&b);
    }
    be.sync_stream(0, a.handle()).unwrap();
    be.sync_stream(0, b.handle()).unwrap();
    assert!(dev.stats().pending_bytes.current >= 31 * 2 * MIB as u64);
    last.record_stream(&b);
    drop(last);
    let pending = dev.stats().pending_bytes.current;
    assert!(pending <= 2 * MIB as u64, "{pending} bytes still pending");
}
