//! Trace replay through the real pool, on the real traces in ../shared/traces.

use gpupool::trace::replay::{replay, replay_file, ReplayOptions};
use std::path::PathBuf;

mod common;

/// The real traces; a test without them fails under `CI=true`.
fn traces() -> Option<PathBuf> {
    common::shared_traces()
}

fn opts() -> ReplayOptions {
    ReplayOptions {
        repeats: 1,
        samples: 100,
        ..Default::default()
    }
}

#[test]
fn pytorch_trace_replays_with_its_peak_and_beats_pytorch() {
    let Some(dir) = traces() else { return };
    let r = replay_file(&dir.join("pytorch/lm-small-10steps-train.pickle"), &opts()).unwrap();
    assert_eq!(r.len(), 1);
    let r = &r[0];
    assert_eq!(
        r.peak_live_bytes, 3_849_232_640,
        "the README's peak live bytes"
    );
    assert_eq!(r.failed_allocs, 0);
    assert_eq!(r.format, "torch-snapshot");
    let baseline = r
        .baseline
        .as_ref()
        .expect("snapshots carry PyTorch's reserved bytes");
    assert_eq!(baseline.peak_reserved_bytes, 4_238_344_192);
    assert!(r.peak_reserved_bytes >= r.peak_live_bytes);
    assert!(r.overhead < 0.03, "overhead {}", r.overhead);
    assert!(
        r.overhead * 2.0 <= r.baseline_overhead.unwrap(),
        "at most half of PyTorch's overhead"
    );
    assert!(!r.samples.is_empty());
    let j = serde_json::to_value(r).unwrap();
    for key in [
        "name",
        "format",
        "events",
        "allocs",
        "frees",
        "peak_live_bytes",
        "peak_reserved_bytes",
        "overhead",
        "baseline",
        "events_per_sec",
    ] {
        assert!(j.get(key).is_some(), "replay JSON lacks {key}");
    }
}

#[test]
fn lifetime_trace_replays_within_ten_percent() {
    let Some(dir) = traces() else { return };
    let t = gpupool::trace::read_file(dir.join("lifetimes/resnet50.csv")).unwrap();
    let r = replay(&t, &opts()).unwrap();
    assert_eq!(r.peak_live_bytes, 1_515_472_556);
    assert!(r.overhead < 0.10, "overhead {}", r.overhead);
    assert!(r.baseline.is_none());
}

#[test]
fn replays_are_deterministic() {
    let Some(dir) = traces() else { return };
    let t = gpupool::trace::read_file(dir.join("lifetimes/bert_base.csv")).unwrap();
    let a = replay(&t, &opts()).unwrap();
    let b = replay(&t, &opts()).unwrap();
    assert_eq!(a.peak_reserved_bytes, b.peak_reserved_bytes);
    assert_eq!(a.maps, b.maps);
}
