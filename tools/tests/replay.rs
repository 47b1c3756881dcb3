//! Trace replay through the real pool, on the real traces in ../shared/traces.

use gpupool_tools::trace::replay::{replay, replay_file, ReplayOptions};
use std::path::PathBuf;

#[path = "../../tests/common/mod.rs"]
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
    let t = gpupool_tools::trace::read_file(dir.join("lifetimes/resnet50.csv")).unwrap();
    let r = replay(&t, &opts()).unwrap();
    assert_eq!(r.peak_live_bytes, 1_515_472_556);
    assert!(r.overhead < 0.10, "overhead {}", r.overhead);
    assert!(r.baseline.is_none());
}

#[test]
fn replays_are_deterministic() {
    let Some(dir) = traces() else { return };
    let t = gpupool_tools::trace::read_file(dir.join("lifetimes/bert_base.csv")).unwrap();
    let a = replay(&t, &opts()).unwrap();
    let b = replay(&t, &opts()).unwrap();
    assert_eq!(a.peak_reserved_bytes, b.peak_reserved_bytes);
    assert_eq!(a.maps, b.maps);
    assert_eq!(a.driver_calls, b.driver_calls);
    assert_eq!(a.driver_ms, b.driver_ms);
}

/// The driver calls of each pass are counted by kind and costed with the
/// configuration's table: the figures follow the table, `maps` is the
/// `cuMemMap` count, and the JSON has the contract's shape.
#[test]
fn replay_reports_driver_calls_and_modeled_time_per_pass() {
    use gpupool::backend::{Call, CallCost};
    let Some(dir) = traces() else { return };
    let t = gpupool_tools::trace::read_file(dir.join("lifetimes/bert_base.csv")).unwrap();
    let r = replay(&t, &opts()).unwrap();
    let cold = &r.driver_calls.cold;
    assert_eq!(cold.get("cuMemMap").copied().unwrap_or(0), r.maps[0]);
    assert_eq!(
        r.driver_calls.warm.get("cuMemMap").copied().unwrap_or(0),
        r.maps[1]
    );
    assert!(
        cold["cuMemCreate"] > 0,
        "a cold pass grows the pool: {cold:?}"
    );
    assert!(cold.values().all(|&n| n > 0), "zero counts are left out");
    assert!(r.driver_ms.cold > r.driver_ms.warm && r.driver_ms.warm >= 0.0);
    // cuMemCreate alone: one 2 MiB granule each at the default table's cost.
    let c = gpupool::backend::CostTable::default().cost(gpupool::backend::Call::MemCreate);
    assert!(r.driver_ms.cold >= cold["cuMemCreate"] as f64 * (c.us + 2.0 * c.us_per_unit) / 1e3);

    // Costs follow the table: mapping made ten times dearer adds exactly
    // nine times the maps' share.
    let mut o = opts();
    let base = o.config.driver_costs.cost(Call::Map);
    o.config
        .driver_costs
        .set(
            Call::Map,
            CallCost {
                us: base.us * 10.0,
                ..base
            },
        )
        .unwrap();
    let dear = replay(&t, &o).unwrap();
    assert_eq!(dear.driver_calls, r.driver_calls);
    for (pass, a, b) in [
        (0, r.driver_ms.cold, dear.driver_ms.cold),
        (1, r.driver_ms.warm, dear.driver_ms.warm),
    ] {
        let want = a + 9.0 * base.us * r.maps[pass] as f64 / 1e3;
        assert!((b - want).abs() < 1e-6, "pass {pass}: {b} vs {want}");
    }

    let j = serde_json::to_value(&r).unwrap();
    assert!(j["driver_calls"]["cold"]["cuMemCreate"].as_u64().unwrap() > 0);
    assert!(j["driver_calls"]["warm"].is_object());
    assert!(j["driver_ms"]["cold"].as_f64().unwrap() > 0.0);
    assert!(j["driver_ms"]["warm"].as_f64().is_some());
    assert!(j["maps"].is_array(), "existing keys stay");
}

/// `gpupool replay --json` carries the driver figures per trace; a cost
/// key changes the modeled time and not the counts; `bench --calibrate`
/// needs `--gpu`, and without a device fails with a message and no file.
#[test]
fn cli_replay_json_has_driver_figures_and_follows_cost_keys() {
    let Some(dir) = traces() else { return };
    let file = dir.join("lifetimes/bert_base.csv");
    let run = |conf: &str| -> serde_json::Value {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_gpupool"))
            .args(["replay", "--json", "--repeats", "1"])
            .arg(&file)
            .env("GPUPOOL_CONF", conf)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let a = &run("")["traces"][0];
    let b = &run("cost.cuMemCreate=1000,cost.cuMemCreate.per_unit=0")["traces"][0];
    assert_eq!(a["driver_calls"], b["driver_calls"]);
    let creates = a["driver_calls"]["cold"]["cuMemCreate"].as_u64().unwrap();
    let (ma, mb) = (
        a["driver_ms"]["cold"].as_f64().unwrap(),
        b["driver_ms"]["cold"].as_f64().unwrap(),
    );
    // 2 MiB chunks: the default table's cost each, 1000 µs each under
    // the key.
    let c = gpupool::backend::CostTable::default().cost(gpupool::backend::Call::MemCreate);
    let want = ma + creates as f64 * (1000.0 - (c.us + 2.0 * c.us_per_unit)) / 1e3;
    assert!((mb - want).abs() < 1e-6 * want, "{mb} vs {want}");

    let path = std::env::temp_dir().join(format!("gpupool-cal-{}.json", std::process::id()));
    let no_gpu = std::process::Command::new(env!("CARGO_BIN_EXE_gpupool"))
        .args(["bench", "--calibrate"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(!no_gpu.status.success());
    assert!(String::from_utf8_lossy(&no_gpu.stderr).contains("--gpu"));
    if gpupool::backend::open(&gpupool::BackendKind::Cuda, &Default::default()).is_err() {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_gpupool"))
            .args(["bench", "--gpu", "--quick", "--calibrate"])
            .arg(&path)
            .output()
            .unwrap();
        assert!(!out.status.success());
        assert!(!path.exists(), "no calibration file without a device");
    }
}

/// Every trace we have, each pass marked as a step: the second pass is
/// served from the plan of the first with no driver call at all, and peak
/// reserved stays within 3% of peak live (on traces of more than a few
/// granules: iree_mobilebert's 1.6 MB live cannot go below two 2 MiB
/// granules). Served dynamically instead, the same second pass remaps.
#[test]
fn learned_steps_repeat_every_trace_with_no_driver_call() {
    let Some(dir) = traces() else { return };
    let o = ReplayOptions {
        repeats: 1,
        peers: false,
        ..Default::default()
    };
    let mut files: Vec<PathBuf> = Vec::new();
    for sub in ["pytorch", "lifetimes"] {
        for e in std::fs::read_dir(dir.join(sub)).unwrap() {
            let p = e.unwrap().path();
            if p.is_file() {
                files.push(p);
            }
        }
    }
    files.sort();
    let mut dynamic_warm_maps = 0;
    for f in &files {
        for r in replay_file(f, &o).unwrap() {
            let plan = r.plan.expect("passes are marked as steps");
            assert!(
                plan.plans >= 1 && plan.departures == 0,
                "{}: {plan:?}",
                r.name
            );
            assert!(
                r.driver_calls.warm.is_empty(),
                "{}: warm pass made driver calls {:?}",
                r.name,
                r.driver_calls.warm
            );
            assert_eq!(r.reserved_growth_on_repeat, 0, "{}", r.name);
            if r.peak_live_bytes > 64 << 21 {
                assert!(r.overhead <= 0.03, "{}: {:.2}%", r.name, r.overhead * 100.0);
            }
            assert_eq!(r.failed_allocs, 0);
        }
        if f.ends_with("lm-medium-ctx1024-infer.pickle") {
            let d = ReplayOptions {
                learn_steps: false,
                ..o.clone()
            };
            let r = &replay_file(f, &d).unwrap()[0];
            assert!(r.plan.is_none());
            dynamic_warm_maps = r.maps[1];
        }
    }
    assert!(dynamic_warm_maps > 0, "the dynamic path remaps on repeat");
}
