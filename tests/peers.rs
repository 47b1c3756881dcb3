//! The PyTorch port against PyTorch's own recordings: the four shared
//! snapshots (recorded after warm-up, so the port starts from their
//! recorded segments) must be reproduced exactly.

use gpupool::trace::peers::recording::read_recordings;
use gpupool::trace::peers::validate::replay_recording;
use gpupool::trace::peers::TorchConfig;

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
        let trace = gpupool::trace::read_file(&path).unwrap();
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
