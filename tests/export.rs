//! Snapshot export: the pickle in PyTorch's layout has PyTorch's keys and
//! loads in Python's `pickle`, and the JSON parses. (That the pickle reads
//! back through gpupool's own PyTorch-snapshot reader with the same live
//! blocks is tested with the reader, in `tools/tests/export_roundtrip.rs`.)

use gpupool::export::{snapshot_to_json, snapshot_to_torch, Value};

mod common;
#[path = "common/snapshots.rs"]
mod snapshots;

use snapshots::{sim_runtime, workload_snapshots};

#[test]
fn torch_layout_has_pytorchs_keys() {
    let rt = sim_runtime(2);
    let snaps = workload_snapshots(&rt);
    let v = snapshot_to_torch(&snaps);
    let Value::Dict(root) = v else {
        panic!("not a dict")
    };
    let key = |k: &str| k.to_string();
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
