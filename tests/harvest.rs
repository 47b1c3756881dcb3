//! Harvesting pending frees asks the device little: a stream runs its work
//! in order, so its events complete in order, and a few queries per stream
//! settle every record waiting on it (`pool/event_order.rs`).

use gpupool::backend::sim::SimBackend;
use gpupool::backend::{Backend, Call};
use gpupool::{PoolConfig, Runtime, SimConfig};
use std::sync::Arc;
use std::time::Duration;

#[test]
fn harvest_queries_a_few_events_per_stream_not_one_per_record() {
    let be = Arc::new(
        SimBackend::new(SimConfig {
            devices: 1,
            capacity_bytes: 1 << 30,
            ..Default::default()
        })
        .unwrap(),
    );
    // No maintenance thread: the test's own harvests are the only ones.
    let cfg = PoolConfig {
        maintenance_tick: None,
        ..PoolConfig::default()
    };
    let rt = Runtime::with_backend(be.clone(), cfg).unwrap();
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
