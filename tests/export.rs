//! Snapshot export: the pickle in PyTorch's layout reads back through the
//! project's own PyTorch-snapshot reader with the same live blocks, loads
//! in Python's `pickle` with PyTorch's keys, and the JSON parses.

use gpupool::backend::sim::SimBackend;
use gpupool::export::{snapshot_to_json, snapshot_to_pickle, snapshot_to_torch};
use gpupool::pool::{BlockState, Snapshot};
use gpupool::trace::{Trace, TraceEvent};
use gpupool::{BackendKind, Runtime, SimConfig};
use std::collections::HashMap;
use std::time::Duration;

mod common;

const MIB: usize = 1 << 20;

fn sim_runtime(devices: usize) -> Runtime {
    Runtime::builder()
        .backend(BackendKind::Sim(SimConfig {
            devices,
            capacity_bytes: 256 << 20,
            ..Default::default()
        }))
        .build()
        .unwrap()
}

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

/// Requested sizes of the snapshot's live blocks, sorted.
fn live_in(snap: &Snapshot) -> Vec<u64> {
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
fn workload_snapshots(rt: &Runtime) -> Vec<Snapshot> {
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

#[test]
fn pickle_round_trips_through_the_torch_snapshot_reader() {
    let rt = sim_runtime(2);
    let snaps = workload_snapshots(&rt);
    let bytes = snapshot_to_pickle(&snaps);
    let traces = gpupool::trace::parse_all("gpupool.pickle", &bytes).unwrap();
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
    let trace = gpupool::trace::parse(
        "one.pickle",
        &snapshot_to_pickle(std::slice::from_ref(&snap)),
    )
    .unwrap();
    assert_eq!(live_after(&trace), live_in(&snap));
    drop(blocks);
}

#[test]
fn torch_layout_has_pytorchs_keys() {
    use serde_pickle::{HashableValue, Value};
    let rt = sim_runtime(2);
    let snaps = workload_snapshots(&rt);
    let v = snapshot_to_torch(&snaps);
    let Value::Dict(root) = v else {
        panic!("not a dict")
    };
    let key = |k: &str| HashableValue::String(k.into());
    let Some(Value::List(traces)) = root.get(&key("device_traces")) else {
        panic!("no device_traces")
    };
    assert_eq!(traces.len(), 2);
    let Value::List(t0) = &traces[0] else {
        panic!()
    };
    let actions: Vec<String> = t0
        .iter()
        .map(|e| match e {
            Value::Dict(d) => match d.get(&key("action")) {
                Some(Value::String(s)) => s.clone(),
                _ => panic!("no action"),
            },
            _ => panic!("event not a dict"),
        })
        .collect();
    let count = |a: &str| actions.iter().filter(|x| *x == a).count();
    assert_eq!(count("alloc"), 5);
    assert_eq!(count("free_requested"), 3);
    assert_eq!(count("free_completed"), 3);
    assert!(matches!(
        root.get(&key("allocator_settings")),
        Some(Value::Dict(_))
    ));
}

#[test]
fn json_export_is_an_array_of_snapshots() {
    let rt = sim_runtime(2);
    let snaps = workload_snapshots(&rt);
    let v: serde_json::Value = serde_json::from_str(&snapshot_to_json(&snaps)).unwrap();
    let arr = v.as_array().unwrap();
    assert_eq!(arr.len(), 2);
    for (d, s) in arr.iter().enumerate() {
        assert_eq!(s["device"], d);
        assert!(!s["segments"].as_array().unwrap().is_empty());
        assert!(s["stats"]["reserved_bytes"]["current"].as_u64().unwrap() > 0);
        assert!(!s["history"].as_array().unwrap().is_empty());
    }
}

/// Python's own `pickle` loads the file into PyTorch's snapshot layout.
#[test]
fn python_pickle_loads_the_torch_layout() {
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    if common::require_tool(&python).is_none() {
        return;
    }
    let rt = sim_runtime(2);
    let snaps = workload_snapshots(&rt);
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("export_layout.pickle");
    gpupool::export::write_snapshot_pickle(&path, &snaps).unwrap();
    let script = r#"
import pickle, sys
with open(sys.argv[1], "rb") as f:
    d = pickle.load(f)
assert isinstance(d, dict), type(d)
assert set(d) == {"segments", "device_traces", "allocator_settings"}, set(d)
seg_keys = {"device", "address", "total_size", "allocated_size", "active_size",
            "requested_size", "stream", "segment_type", "segment_pool_id",
            "is_expandable", "frames", "blocks"}
block_keys = {"address", "size", "requested_size", "state", "frames"}
ev_keys = {"action", "addr", "size", "stream", "time_us", "frames"}
assert d["segments"], "no segments"
for s in d["segments"]:
    assert set(s) == seg_keys, set(s) ^ seg_keys
    assert s["segment_type"] in ("small", "large")
    assert s["segment_pool_id"] == (0, 0)
    assert isinstance(s["is_expandable"], bool)
    assert sum(b["size"] for b in s["blocks"]) == s["total_size"]
    for b in s["blocks"]:
        assert set(b) == block_keys, set(b) ^ block_keys
        assert b["state"] in ("active_allocated", "active_pending_free", "inactive")
        assert all(isinstance(b[k], int) for k in ("address", "size", "requested_size"))
assert isinstance(d["device_traces"], list) and len(d["device_traces"]) == 2
for trace in d["device_traces"]:
    assert trace, "empty trace"
    for e in trace:
        assert set(e) == ev_keys, set(e) ^ ev_keys
        assert e["action"] in ("alloc", "free_requested", "free_completed")
print("ok", len(d["segments"]), [len(t) for t in d["device_traces"]])
"#;
    let o = std::process::Command::new(&python)
        .arg("-c")
        .arg(script)
        .arg(&path)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "python: {}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(String::from_utf8_lossy(&o.stdout).starts_with("ok"));
}
