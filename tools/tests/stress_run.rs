//! `gpupool_tools::stress` and `gpupool stress`: the stress run on simulated
//! devices finds no corruption, no leak and no host sync on the alloc/free
//! path, and its negative control shows the verification would see one.

use gpupool_tools::stress::{run, StressOptions, StressReport, Workload};
use std::time::Duration;

const MIB: u64 = 1 << 20;

fn opts(workload: Workload, devices: usize, streams: usize, threads: usize) -> StressOptions {
    StressOptions {
        devices,
        streams,
        threads,
        duration: Duration::from_millis(1500),
        verify: true,
        workload,
        seed: 7,
        capacity_bytes: 256 * MIB,
        sample_every: Duration::from_millis(200),
        ..Default::default()
    }
}

/// The properties every clean run must have.
fn assert_clean(r: &StressReport) {
    eprintln!("{r}");
    assert!(r.ops >= 200, "too little work: {} ops", r.ops);
    assert_eq!(r.allocs, r.frees, "every block is freed");
    assert_eq!(r.ops, r.allocs + r.frees);
    assert!(r.verify_kernels >= r.frees, "one verify per free at least");
    assert_eq!(r.integrity_errors, 0, "corrupted bytes");
    assert_eq!(r.failed_verifies, 0);
    assert_eq!(r.device_faults, 0, "unmapped accesses");
    assert_eq!(r.leaked_bytes, 0, "leaked");
    assert_eq!(r.host_syncs_on_alloc_path, 0, "the pool blocked the host");
    // Percentiles are ordered and plausible (a successful alloc takes more
    // than a nanosecond and less than the run).
    assert!(r.p50_ns > 0 && r.p50_ns <= r.p99_ns && r.p99_ns <= r.p999_ns);
    assert!(r.p999_ns <= r.max_ns);
    assert!((r.max_ns as f64) < r.seconds * 1e9, "{} ns", r.max_ns);
    assert!(r.free_p50_ns > 0 && r.free_p50_ns <= r.free_p99_ns);
    assert!(r.peak_live_bytes > 0 && r.peak_live_bytes <= r.peak_reserved_bytes);
    assert!(r.peak_rss_bytes > 0);
    // Sampled from the start on. On a loaded machine a sample can wait a long
    // time for the pool's heap lock (held across simulator calls that wait
    // for running kernels), so fewer samples than planned may be taken; the
    // verdict needs four.
    assert!(!r.memory_series.is_empty());
    assert!(r.memory_series[0].t_secs < 0.2, "{:?}", r.memory_series[0]);
    assert!(r
        .memory_series
        .windows(2)
        .all(|w| w[0].t_secs < w[1].t_secs));
    assert_eq!(r.reserved_flat.is_some(), r.memory_series.len() >= 4);
    assert_eq!(r.per_device.len(), r.devices);
    for d in &r.per_device {
        assert!(d.ops > 0, "device {} idle", d.device);
        assert_eq!(d.audit_error, None, "device {}", d.device);
        assert!(d.peak_reserved_bytes <= r.capacity_bytes);
    }
    assert_eq!(r.per_device.iter().map(|d| d.ops).sum::<u64>(), r.ops);
    // The pools grew through the driver, and each call is costed: 2 MiB
    // granules at the default table's cuMemCreate cost at least.
    assert!(r.driver_calls.values().all(|&n| n > 0));
    let creates = r.driver_calls.get("cuMemCreate").copied().unwrap_or(0);
    assert!(creates > 0, "{:?}", r.driver_calls);
    let c = gpupool::backend::CostTable::default().cost(gpupool::backend::Call::MemCreate);
    let floor = creates as f64 * (c.us + 2.0 * c.us_per_unit) / 1e3;
    assert!(r.driver_ms >= floor, "{} ms < {floor} ms", r.driver_ms);
    assert!(r.passed());
}

#[test]
fn training_on_four_devices_with_verification_is_clean() {
    let r = run(&opts(Workload::Training, 4, 3, 2), |_| {}).unwrap();
    assert_clean(&r);
    assert!(r.cross_stream_uses > 0 && r.cross_stream_frees > 0, "{r:?}");
    assert!(r.per_device.iter().any(|d| d.pending_frees > 0));
    // Pending frees are harvested, and the report counts the passes.
    assert!(r.per_device.iter().any(|d| d.harvests > 0), "{r:?}");
    assert!(r.per_device.iter().all(|d| d.harvest_walks <= d.harvests));
    // Cross-stream traffic makes large requests miss and reclaim; slow
    // paths are a part of the allocations.
    assert!(r
        .per_device
        .iter()
        .any(|d| d.large_slow_paths > 0 && d.reclaims > 0));
    assert!(r
        .per_device
        .iter()
        .all(|d| d.small_slow_paths + d.large_slow_paths <= d.ops / 2));
}

#[test]
fn serving_with_verification_is_clean() {
    let mut o = opts(Workload::Serving, 2, 4, 2);
    // A small device: KV buffers of long requests evict older requests.
    o.capacity_bytes = 96 * MIB;
    let mut calls = 0;
    let r = run(&o, |p| {
        calls += 1;
        assert!(p.elapsed <= p.duration + Duration::from_millis(200));
    })
    .unwrap();
    assert_clean(&r);
    assert!(calls >= 1, "progress never called");
    assert_eq!(r.workload, Workload::Serving);
}

/// Streams busy part of the time (a simulated kernel after a fifth of the
/// allocations): memory freed on a busy stream must not reach another
/// stream before its work ends, whether the pool asks the stream or
/// waits on an event; the late verify kernels would see it.
#[test]
fn serving_on_busy_streams_with_verification_is_clean() {
    let o = StressOptions {
        kernel_percent: 20,
        kernel_time: Duration::from_micros(50),
        ..opts(Workload::Serving, 1, 4, 2)
    };
    let r = run(&o, |_| {}).unwrap();
    assert_clean(&r);
    assert_eq!((r.kernel_percent, r.kernel_us), (20, 50));
    assert_eq!(r.false_ooms, 0);
}

/// Driver calls that take their modeled time on the calling threads (as
/// on a GPU, where a call made under a lock stalls the threads behind it)
/// change every interleaving of the run; the pool stays clean, with no
/// false out-of-memory, and the report says the time was spent.
#[test]
fn serving_with_driver_time_spent_is_clean() {
    let o = StressOptions {
        spend_driver_time: true,
        ..opts(Workload::Serving, 1, 4, 2)
    };
    let r = run(&o, |_| {}).unwrap();
    assert_clean(&r);
    assert!(r.driver_time_spent);
    assert!(r.driver_ms > 0.0);
    assert_eq!(r.false_ooms, 0);
}

/// `GPUPOOL_CONF`'s `driver_time=spent` asks the same of a stress run.
#[test]
fn driver_time_spent_in_the_configuration_reaches_the_stress_run() {
    let o = StressOptions {
        duration: Duration::from_millis(300),
        verify: false,
        config: gpupool::PoolConfig::parse("driver_time=spent").unwrap(),
        ..opts(Workload::Serving, 1, 2, 1)
    };
    let r = run(&o, |_| {}).unwrap();
    assert!(r.passed(), "{r}");
    assert!(r.driver_time_spent);
    let plain = run(
        &StressOptions {
            config: gpupool::PoolConfig::default(),
            ..o
        },
        |_| {},
    )
    .unwrap();
    assert!(!plain.driver_time_spent);
}

/// The checker works: frees from another stream that skip the ordering
/// event (API misuse) let the pool hand memory to new work while the old
/// verify kernels are still queued, and the run reports corrupted bytes.
#[test]
fn negative_control_unordered_cross_stream_frees_are_caught() {
    let o = StressOptions {
        raw_percent: 100,
        cross_free_percent: 100,
        cross_percent: 0,
        misuse_unordered_frees: true,
        ..opts(Workload::Training, 1, 2, 1)
    };
    let r = run(&o, |_| {}).unwrap();
    eprintln!("{r}");
    assert!(r.cross_stream_frees > 0);
    assert!(
        r.integrity_errors > 0 && r.failed_verifies > 0,
        "misuse went unnoticed: {r:?}"
    );
    assert!(!r.passed());
}

#[test]
fn bad_options_are_typed_errors() {
    for o in [
        StressOptions {
            devices: 0,
            ..Default::default()
        },
        StressOptions {
            threads: 0,
            ..Default::default()
        },
        StressOptions {
            duration: Duration::ZERO,
            ..Default::default()
        },
        StressOptions {
            cross_percent: 101,
            ..Default::default()
        },
        StressOptions {
            kernel_percent: 101,
            ..Default::default()
        },
    ] {
        assert!(matches!(
            run(&o, |_| {}),
            Err(gpupool::Error::InvalidArgument(_))
        ));
    }
}

#[test]
fn cli_json_report_has_the_contract_keys() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_gpupool"))
        .args([
            "stress",
            "--devices",
            "2",
            "--streams",
            "2",
            "--threads",
            "2",
            "--duration",
            "1",
            "--verify",
            "--capacity",
            "128MiB",
            "--workload",
            "serving",
            "--seed",
            "3",
            "--json",
        ])
        .env("GPUPOOL_LOG", "error")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    for k in [
        "ops",
        "integrity_errors",
        "leaked_bytes",
        "host_syncs_on_alloc_path",
        "p50_ns",
        "p99_ns",
        "p999_ns",
        "peak_live_bytes",
        "peak_reserved_bytes",
        "peak_rss_bytes",
    ] {
        assert!(j[k].is_u64(), "{k}: {}", j[k]);
    }
    assert!(j["ops"].as_u64().unwrap() > 0);
    assert_eq!(j["integrity_errors"], 0);
    assert_eq!(j["leaked_bytes"], 0);
    assert_eq!(j["host_syncs_on_alloc_path"], 0);
    assert_eq!(j["workload"], "serving");
    assert_eq!(j["per_device"].as_array().unwrap().len(), 2);
    assert!(j["memory_series"].is_array());
    assert!(j["driver_calls"].is_object());
    assert!(j["driver_ms"].as_f64().unwrap() >= 0.0);

    let bad = std::process::Command::new(env!("CARGO_BIN_EXE_gpupool"))
        .args(["stress", "--workload", "inference", "--duration", "1"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("inference"));

    // `--cross-percent`: no block used on a second stream at 0, and a
    // percentage past 100 refused.
    let run = |pct: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_gpupool"))
            .args([
                "stress",
                "--devices",
                "1",
                "--streams",
                "4",
                "--duration",
                "0.3",
            ])
            .args(["--workload", "serving", "--cross-percent", pct, "--json"])
            .env("GPUPOOL_LOG", "error")
            .output()
            .unwrap()
    };
    let none = run("0");
    assert!(none.status.success());
    let j: serde_json::Value = serde_json::from_slice(&none.stdout).unwrap();
    assert!(j["ops"].as_u64().unwrap() > 0);
    assert_eq!(j["cross_stream_uses"], 0);
    assert!(!run("101").status.success());
}

/// `gpupool stress --fragment --json`: the compaction workload through the
/// CLI, with DESIGN.md's keys, compaction bringing reserved to within
/// 1.10x of live, and a clean run (0 integrity errors, 0 leaks, 0 syncs).
#[test]
fn cli_fragment_report_has_the_contract_keys_and_meets_the_target() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_gpupool"))
        .args([
            "stress",
            "--fragment",
            "--blocks",
            "4000",
            "--passes",
            "50",
            "--capacity",
            "1GiB",
            "--json",
        ])
        .env("GPUPOOL_LOG", "error")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    for k in [
        "ops",
        "integrity_errors",
        "leaked_bytes",
        "host_syncs_on_alloc_path",
        "p50_ns",
        "p99_ns",
        "peak_live_bytes",
        "peak_reserved_bytes",
        "bytes_moved",
        "passes",
    ] {
        assert!(j[k].is_u64(), "{k} missing in {j}");
    }
    for side in ["before", "after"] {
        for k in ["live_bytes", "reserved_bytes"] {
            assert!(j[side][k].is_u64(), "{side}.{k} missing in {j}");
        }
    }
    assert_eq!(j["integrity_errors"], 0);
    assert_eq!(j["leaked_bytes"], 0);
    assert_eq!(j["host_syncs_on_alloc_path"], 0);
    assert!(j["bytes_moved"].as_u64().unwrap() > 0);
    let ratio = |side: &str| {
        j[side]["reserved_bytes"].as_f64().unwrap() / j[side]["live_bytes"].as_f64().unwrap()
    };
    assert!(ratio("before") > 1.5, "the workload fragments: {j}");
    assert!(ratio("after") <= 1.10, "compaction gives memory back: {j}");
}

/// `--peers`: the same traffic runs through both modes of the PyTorch port
/// after the pool's run, and through no allocator at all (the harness's
/// own ceiling), and the report sets them side by side with what each
/// measured (the port takes its device mutex once per operation; the
/// pool's own driver time excludes the harness's ordering events).
#[test]
fn peers_run_the_same_traffic_through_the_pytorch_port() {
    let mut o = opts(Workload::Serving, 1, 4, 2);
    o.duration = Duration::from_millis(600);
    o.peers = true;
    let r = run(&o, |_| {}).unwrap();
    assert!(r.passed(), "{r}");
    let names: Vec<&str> = r.peers.iter().map(|p| p.name).collect();
    assert_eq!(names, ["torch", "torch_expandable", "harness_only"]);
    // The harness alone: the same traffic, with no allocator behind it.
    let ceiling = &r.peers[2];
    assert!(ceiling.ops >= 200 && ceiling.seconds >= 0.5, "{ceiling:?}");
    assert!(ceiling.peak_live_bytes > 0, "{ceiling:?}");
    assert_eq!(
        (
            ceiling.peak_reserved_bytes,
            ceiling.ooms,
            ceiling.false_ooms
        ),
        (0, 0, 0)
    );
    assert!(ceiling.driver_calls.is_empty() && ceiling.driver_ms == 0.0);
    assert_eq!(ceiling.device_locks_per_op, 0.0);
    // Each allocator's own time per operation is measured against that
    // ceiling: none for the harness itself, some for every allocator.
    assert_eq!(ceiling.allocator_ns_per_op, Some(0.0));
    for own in r.peers[..2]
        .iter()
        .map(|p| p.allocator_ns_per_op)
        .chain([r.allocator_ns_per_op])
    {
        assert!(own.is_some_and(|ns| ns > 0.0), "{own:?}");
    }
    for p in &r.peers[..2] {
        assert!(p.ops >= 200, "{p:?}");
        assert!(p.seconds >= 0.5, "{p:?}");
        assert!(
            p.peak_live_bytes > 0 && p.peak_live_bytes <= p.peak_reserved_bytes,
            "{p:?}"
        );
        assert!(p.peak_reserved_bytes <= o.capacity_bytes, "{p:?}");
        // One device lock per malloc and free, plus one per
        // `record_stream` (PyTorch's `recordStream` takes it too).
        assert!(
            p.device_locks_per_op > 1.0 && p.device_locks_per_op < 1.5,
            "{p:?}"
        );
        // Blocks used on other streams were freed behind events, which the
        // next mallocs queried.
        for call in ["cuEventRecord", "cuEventQuery"] {
            assert!(
                p.driver_calls.get(call).is_some_and(|&n| n > 0),
                "{call}: {p:?}"
            );
        }
        assert!(p.p50_ns > 0 && p.p50_ns <= p.p99_ns && p.p99_ns <= p.p999_ns);
        assert!(p.driver_ms > 0.0 && !p.driver_calls.is_empty(), "{p:?}");
    }
    // Only the expandable mode maps pages.
    assert!(!r.peers[0].driver_calls.contains_key("cuMemMap"));
    assert!(r.peers[1].driver_calls.contains_key("cuMemMap"));
    let ordered = (r.cross_stream_uses + r.cross_stream_frees) as f64;
    assert!(r.harness_driver_ms > 0.0 && r.harness_driver_ms < r.driver_ms);
    // One event record and one stream wait per ordered use, at the
    // default table's costs.
    let t = gpupool::backend::CostTable::default();
    let per = (t.cost(gpupool::backend::Call::EventRecord).us
        + t.cost(gpupool::backend::Call::StreamWaitEvent).us)
        / 1e3;
    assert!((r.harness_driver_ms - ordered * per).abs() < 1e-6 * ordered.max(1.0));
    let text = r.to_string();
    assert!(
        text.contains("torch_expandable") && text.contains("same traffic"),
        "{text}"
    );
}
