//! A workload's pool snapshots, for the export tests of both crates
//! (`tests/export.rs` here, `tools/tests/export_roundtrip.rs` through the
//! trace readers), which include this file by path.
#![allow(dead_code)] // each test binary uses its own part

use gpupool::backend::sim::SimBackend;
use gpupool::pool::{BlockState, Snapshot};
use gpupool::{BackendKind, Runtime, SimConfig};
use std::time::Duration;

const MIB: usize = 1 << 20;

/// A simulated runtime of `devices` devices of 256 MiB.
pub fn sim_runtime(devices: usize) -> Runtime {
    Runtime::builder()
        .backend(BackendKind::Sim(SimConfig {
            devices,
            capacity_bytes: 256 << 20,
            ..Default::default()
        }))
        .build()
        .unwrap()
}

/// Requested sizes of the snapshot's live blocks, sorted.
pub fn live_in(snap: &Snapshot) -> Vec<u64> {
    let mut v: Vec<u64> = snap
        .segments
        .iter()
        .flat_map(|s| &s.blocks)
        .filter(|b| b.state == BlockState::ActiveAllocated)
        .map(|b| b.requested_size)
        .collect();
    v.sort_unstable();
    v
}

/// Two devices with blocks live before recording started (some freed
/// during it), blocks allocated and freed while recording, a pending
/// cross-stream free, and live blocks of every size path.
pub fn workload_snapshots(rt: &Runtime) -> Vec<Snapshot> {
    let d0 = rt.device(0).unwrap();
    let d1 = rt.device(1).unwrap();
    let (s, s2) = (d0.new_stream().unwrap(), d0.new_stream().unwrap());
    let t = d1.new_stream().unwrap();

    // Live before recording.
    let a = d0.alloc_raw(1000, &s).unwrap();
    let b = d0.alloc(3 * MIB, &s).unwrap();
    let c = d0.alloc_raw(70_000, &s).unwrap();
    let x = d1.alloc_raw(12_345, &t).unwrap();
    d0.record_history(true);
    d1.record_history(true);

    d0.free_raw(a, &s).unwrap(); // a pre-live block freed while recording
    let d = d0.alloc_raw(5000, &s).unwrap();
    let e = d0.alloc(9 * MIB + 17, &s).unwrap();
    let f = d0.alloc(300, &s).unwrap();
    drop(e);
    let again = d0.alloc_raw(1000, &s).unwrap(); // may reuse `a`'s slot
    let pending = d0.alloc_raw(4096, &s).unwrap();
    d0.record_stream_raw(pending, &s2).unwrap();
    d0.backend()
        .as_any()
        .downcast_ref::<SimBackend>()
        .unwrap()
        .stall_stream(0, s2.handle(), Duration::from_millis(200))
        .unwrap();
    d0.free_raw(pending, &s).unwrap();

    let y = d1.alloc_raw(64 << 10, &t).unwrap();
    let z = d1.alloc_raw(2 * MIB + 1, &t).unwrap();
    d1.free_raw(y, &t).unwrap();

    let snaps = vec![d0.snapshot(), d1.snapshot()];
    assert!(
        snaps[0]
            .segments
            .iter()
            .flat_map(|g| &g.blocks)
            .any(|b| b.state == BlockState::ActivePendingFree),
        "the cross-stream free is pending in the snapshot"
    );
    for p in [c, d, again] {
        d0.free_raw(p, &s).unwrap();
    }
    for p in [x, z] {
        d1.free_raw(p, &t).unwrap();
    }
    drop((b, f));
    snaps
}
