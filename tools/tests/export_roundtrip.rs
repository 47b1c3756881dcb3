//! Snapshot export read back: the pickle gpupool writes in PyTorch's
//! layout reads through the project's own PyTorch-snapshot reader with the
//! same live blocks, with and without a recorded history.

use gpupool::export::snapshot_to_pickle;
use gpupool_tools::trace::{Trace, TraceEvent};
use std::collections::HashMap;

#[path = "../../tests/common/snapshots.rs"]
mod snapshots;

use snapshots::{live_in, sim_runtime, workload_snapshots};

const MIB: usize = 1 << 20;

/// Requested sizes of the blocks live at the end of a trace, sorted.
fn live_after(trace: &Trace) -> Vec<u64> {
    let mut live: HashMap<u64, u64> = HashMap::new();
    for e in &trace.events {
        match *e {
            TraceEvent::Alloc { id, size, .. } => {
                live.insert(id, size);
            }
            TraceEvent::Free { id, .. } => {
                live.remove(&id).expect("free of a live block");
            }
        }
    }
    let mut v: Vec<u64> = live.into_values().collect();
    v.sort_unstable();
    v
}

#[test]
fn pickle_round_trips_through_the_torch_snapshot_reader() {
    let rt = sim_runtime(2);
    let snaps = workload_snapshots(&rt);
    let bytes = snapshot_to_pickle(&snaps);
    let traces = gpupool_tools::trace::parse_all("gpupool.pickle", &bytes).unwrap();
    assert_eq!(traces.len(), 2, "one trace per device");
    for (d, snap) in snaps.iter().enumerate() {
        let trace = traces
            .iter()
            .find(|t| t.name.ends_with(&format!("#dev{d}")))
            .unwrap_or_else(|| panic!("no trace for device {d}"));
        trace.validate().unwrap();
        let want = live_in(snap);
        assert!(!want.is_empty());
        assert_eq!(live_after(trace), want, "device {d}: live blocks");
        // Reserved bytes at dump time are the segments' sizes.
        let reserved: u64 = snap.segments.iter().map(|s| s.total_size).sum();
        assert_eq!(reserved, snap.stats.reserved_bytes.current);
        assert_eq!(trace.baseline_peak_reserved, Some(reserved));
    }
    // Device 0: the pre-live `a` was freed during recording, so the trace
    // starts with it allocated (rule 1) and frees it.
    assert!(traces
        .iter()
        .find(|t| t.name.ends_with("#dev0"))
        .unwrap()
        .events
        .iter()
        .any(|e| matches!(e, TraceEvent::Alloc { size: 1000, .. })));
}

#[test]
fn pickle_without_history_still_gives_the_live_blocks() {
    let rt = sim_runtime(1);
    let d0 = rt.device(0).unwrap();
    let s = d0.new_stream().unwrap();
    let blocks: Vec<_> = [100usize, 5000, 300_000, 5 * MIB]
        .iter()
        .map(|&n| d0.alloc(n, &s).unwrap())
        .collect();
    let snap = d0.snapshot();
    assert!(snap.history.is_empty());
    let trace = gpupool_tools::trace::parse(
        "one.pickle",
        &snapshot_to_pickle(std::slice::from_ref(&snap)),
    )
    .unwrap();
    assert_eq!(live_after(&trace), live_in(&snap));
    drop(blocks);
}
