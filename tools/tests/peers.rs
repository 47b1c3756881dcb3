//! The PyTorch port against PyTorch's own recordings: the four shared
//! snapshots (recorded after warm-up, so the port starts from their
//! recorded segments) must be reproduced exactly.

use gpupool_tools::trace::peers::recording::read_recordings;
use gpupool_tools::trace::peers::validate::replay_recording;
use gpupool_tools::trace::peers::TorchConfig;

#[path = "../../tests/common/mod.rs"]
mod common;

/// The four snapshots and PyTorch's peak reserved bytes as the table of
/// `traces/README.md` gives them.
const SNAPSHOTS: [(&str, u64); 4] = [
    ("lm-medium-ctx256-train", 9_265_217_536),
    ("lm-medium-ctx1024-infer", 3_204_448_256),
    ("lm-small-10steps-train", 4_238_344_192),
    ("lm-large-forward", 47_234_154_496),
];

#[test]
fn torch_port_reproduces_the_shared_snapshots() {
    let Some(dir) = common::shared_traces() else {
        return;
    };
    for (name, readme_peak) in SNAPSHOTS {
        let path = dir.join(format!("pytorch/{name}.pickle"));
        let Some(path) = common::require_path(path) else {
            continue;
        };
        let recs = read_recordings(&path).unwrap();
        assert_eq!(recs.len(), 1, "{name}: one device");
        let rec = &recs[0];
        let trace = gpupool_tools::trace::read_file(&path).unwrap();
        let mut cfg = TorchConfig {
            capacity_bytes: 1 << 40,
            ..TorchConfig::with_mode(false)
        };
        rec.settings.apply(&mut cfg);
        let run = replay_recording(rec, cfg).unwrap();
        let v = &run.validation;
        eprintln!("{name}: {}", v.note);
        assert_eq!(
            trace.baseline_peak_reserved,
            Some(readme_peak),
            "{name}: the reader's figure"
        );
        assert_eq!(v.recorded_peak_reserved_bytes, readme_peak, "{name}");
        assert_eq!(v.peak_reserved_bytes, readme_peak, "{name}: {}", v.note);
        assert!(v.matched, "{name}: {}", v.note);
    }
}

/// `gpupool replay --json` carries the peers per trace: on a snapshot, the
/// default-mode port is checked against the recording; on a lifetimes
/// trace there is nothing to check.
#[test]
fn replay_reports_both_peers_with_cold_and_warm_driver_calls() {
    use gpupool_tools::trace::replay::{replay_file, ReplayOptions};
    let Some(dir) = common::shared_traces() else {
        return;
    };
    let opts = ReplayOptions {
        repeats: 1,
        ..Default::default()
    };
    let snap = replay_file(&dir.join("pytorch/lm-medium-ctx1024-infer.pickle"), &opts).unwrap();
    let r = &snap[0];
    let j = serde_json::to_value(r).unwrap();
    let baseline = r.baseline.as_ref().unwrap().peak_reserved_bytes;
    for peer in ["torch", "torch_expandable"] {
        let p = &j["peers"][peer];
        for key in [
            "peak_reserved_bytes",
            "overhead",
            "driver_calls",
            "matched_recording",
            "note",
        ] {
            assert!(p.get(key).is_some(), "peers.{peer} lacks {key}");
        }
        assert!(p["driver_calls"]["cold"].is_object());
        assert!(p["driver_calls"]["warm"].is_object());
    }
    let t = &j["peers"]["torch"];
    assert_eq!(t["matched_recording"], true, "{}", t["note"]);
    assert_eq!(t["start"], "recorded_segments");
    assert_eq!(t["peak_reserved_bytes"].as_u64(), Some(baseline));
    // PyTorch made no segment during this recording, and neither did the
    // port.
    assert_eq!(t["driver_calls"]["cold"], serde_json::json!({}));
    let e = &j["peers"]["torch_expandable"];
    assert!(e["matched_recording"].is_null(), "recorded in default mode");
    assert_eq!(e["start"], "empty");

    // From empty with room to spare nothing is released, so the bytes the
    // cold pass allocated or mapped are the peak reserved.
    let cold_start = &t["cold_start"];
    assert_eq!(
        cold_start["driver_bytes"]["cold"]["cuMemAlloc"],
        cold_start["peak_reserved_bytes"]
    );
    assert_eq!(
        e["driver_bytes"]["cold"]["cuMemCreate"],
        e["peak_reserved_bytes"]
    );
    assert!(e["driver_calls"]["cold"]["cuMemMap"].as_u64().unwrap() > 0);

    let life = replay_file(&dir.join("lifetimes/resnet50.csv"), &opts).unwrap();
    let j = serde_json::to_value(&life[0]).unwrap();
    for peer in ["torch", "torch_expandable"] {
        let p = &j["peers"][peer];
        assert!(p["matched_recording"].is_null());
        assert!(p["note"].as_str().unwrap().contains("no recording"));
        let peak = p["peak_reserved_bytes"].as_u64().unwrap();
        assert!(peak >= life[0].peak_live_bytes, "{peer}: {peak}");
        assert_eq!(p["failed_allocs"], 0);
    }
}
