//! The data-parallel training harness on 4 simulated devices, and its
//! CUDA kernels compiled with NVRTC (no GPU needed).

use gpupool::collective::{AllReduce, HostAllReduce, ReduceBuf};
use gpupool::{BackendKind, PoolConfig, Runtime, SimConfig};
use gpupool_tools::train::{self, IdleWork, TrainOptions};
use std::time::Duration;

#[path = "../../tests/common/mod.rs"]
mod common;

/// The training harness's kernels (`kernels/harness.cu`) compile with
/// NVRTC. Skipped, with the reason printed, where libnvrtc cannot be
/// loaded, unless `GPUPOOL_REQUIRE_NVRTC=1` or `CI=true` (then it fails);
/// get it with `export LD_LIBRARY_PATH="$(bash scripts/install-nvrtc.sh)"`.
#[cfg(feature = "cuda")]
#[test]
fn nvrtc_compiles_the_harness_kernels() {
    if !gpupool::backend::cuda::kernel::nvrtc_available() {
        assert!(
            std::env::var("GPUPOOL_REQUIRE_NVRTC").as_deref() != Ok("1"),
            "GPUPOOL_REQUIRE_NVRTC=1 but libnvrtc could not be loaded"
        );
        common::missing("libnvrtc could not be loaded (run `export LD_LIBRARY_PATH=\"$(bash scripts/install-nvrtc.sh)\"`)");
        return;
    }
    for arch in ["sm_90", "sm_80"] {
        let ptx = train::compile_harness_ptx(arch).unwrap_or_else(|e| panic!("{arch}: {e}"));
        for entry in ["gpupool_pattern", "gpupool_axpy"] {
            assert!(
                ptx.contains(&format!(".entry {entry}")),
                "{arch}: no {entry}"
            );
        }
        eprintln!(
            "harness: compiled harness.cu for {arch}: {} bytes of PTX",
            ptx.len()
        );
    }
}

fn runtime(devices: usize, conf: &str) -> Runtime {
    let cfg = PoolConfig::parse(conf).unwrap();
    Runtime::builder()
        .backend(BackendKind::Sim(SimConfig {
            devices,
            ..Default::default()
        }))
        .config(cfg)
        .build()
        .unwrap()
}

fn small(batches: Vec<usize>) -> TrainOptions {
    TrainOptions {
        batches,
        layers: 6,
        activation_bytes: 8 << 10,
        activation_check_bytes: usize::MAX,
        buckets: 3,
        bucket_bytes: 64 << 10,
        micro_batches: 2,
        streams: 3,
        idle_gap: Duration::from_millis(5),
        verify: true,
        idle_work: None,
        learn_steps: true,
    }
}

#[test]
fn four_devices_hold_identical_expected_gradients_and_pass_every_check() {
    let rt = runtime(4, "");
    let r = train::run(&rt, &small(vec![32; 5])).unwrap();
    assert_eq!(r.devices.len(), 4);
    assert!(r.gradients_match, "{r}");
    assert_eq!(r.gradients_expected, Some(true), "{r}");
    assert!(r.weights_match, "{r}");
    for d in &r.devices {
        assert_eq!(d.steps, 5);
        assert_eq!(d.reserved_after_step.len(), 5);
        assert!(d.allocs > 0 && d.allocs_from_cache > 0);
        assert!(
            d.pending_frees > 0,
            "side-stream activations are record_stream'd"
        );
        assert_eq!(d.host_syncs_on_alloc_path, 0);
        assert_eq!(d.integrity_errors, 0);
        assert!(d.peak_reserved_bytes >= d.peak_live_bytes);
        // Everything freed and trimmed after the run.
        assert_eq!(d.leaked_bytes, 0, "{d:?}");
        assert_eq!(d.reserved_before_run, 0, "{d:?}");
        assert_eq!(d.reserved_after_run, 0, "{d:?}");
        assert_eq!(d.audit, None);
    }
    assert!(r.ok() && r.failed_checks.is_empty(), "{r}");
}

/// With one stream per device and no maintenance threads, every free is
/// ordered on the stream that reuses it, so the pool's choices depend on
/// nothing but the order of calls: reserved memory stops growing after the
/// second step of a fixed batch, in every run. (With side streams, whether
/// a cross-stream free is reusable at the next allocation depends on when
/// the stream workers ran; the harness reports that growth as a figure.)
#[test]
fn one_stream_stops_growing_after_the_second_step() {
    let rt = runtime(2, "maint_ms=0");
    let mut o = small(vec![32; 5]);
    o.streams = 1;
    let r = train::run(&rt, &o).unwrap();
    assert!(r.ok(), "{r}");
    for d in &r.devices {
        assert_eq!(d.pending_frees, 0, "one stream: no cross-stream frees");
        let second = d.reserved_after_step[1];
        assert!(
            d.reserved_after_step[2..].iter().all(|&x| x <= second),
            "{d:?}"
        );
    }
    assert!(r.no_growth_after_step2, "{r}");
}

/// A failing check names itself and fails `ok()`: the report judges
/// leaks, memory returned and audits, not only gradients.
#[test]
fn the_report_names_failed_checks() {
    let rt = runtime(1, "");
    let r = train::run(&rt, &small(vec![16])).unwrap();
    assert!(r.ok(), "{r}");
    // A block kept alive across the run shows as reserved before it.
    let pool = rt.device(0).unwrap();
    let s = pool.new_stream().unwrap();
    let held = pool.alloc(1 << 20, &s).unwrap();
    let r2 = train::run(&rt, &small(vec![16])).unwrap();
    assert!(r2.ok(), "memory held before the run is not a leak: {r2}");
    assert!(r2.devices[0].reserved_before_run > 0);
    assert!(r2.devices[0].reserved_after_run <= r2.devices[0].reserved_before_run);
    drop(held);
}

#[test]
fn accumulation_changes_the_sums_and_they_still_match() {
    let rt = runtime(2, "");
    let mut o = small(vec![16; 2]);
    o.micro_batches = 3;
    let r = train::run(&rt, &o).unwrap();
    assert_eq!(r.micro_batches, 3);
    assert_eq!(r.gradients_expected, Some(true), "{r}");
    // Each micro-batch allocates every activation once more.
    let one = train::run(&runtime(2, ""), &small(vec![16; 2])).unwrap();
    assert!(r.devices[0].allocs > one.devices[0].allocs);
}

/// The harness's own idle work (after each step, once its device work is
/// done and the pool settled) gives the batch-64 surplus back at the
/// first batch-16 step, at that known point, whatever the threads' timing.
/// One stream per device: with side streams, how far the batch-32 steps
/// grow depends on when the stream workers ran (pending cross-stream
/// frees), so "batch 64 reserves more than batch 32" would be a race.
#[test]
fn batch_schedule_grows_then_gives_memory_back_at_the_idle_point() {
    let mut o = small(TrainOptions::schedule(&[(32, 3), (64, 3), (16, 3)]));
    o.streams = 1;
    o.idle_gap = Duration::ZERO;
    o.idle_work = Some(IdleWork {
        compact: true,
        release_fraction: Some(2.0),
    });
    let r = train::run(&runtime(4, ""), &o).unwrap();
    assert!(r.ok(), "{r}");
    let [p32, p64, p16] = &r.phases[..] else {
        panic!("three phases: {r}")
    };
    assert!(
        p64.max_reserved_after_step > p32.max_reserved_after_step,
        "{r}"
    );
    assert!(p16.reserved_at_end < p64.reserved_at_end, "{r}");
    for d in &r.devices {
        let peak64 = d.reserved_after_step[3..6].iter().max().unwrap();
        // Given back right after the first batch-16 step's work.
        let after_first16 = d.reserved_after_idle[6];
        assert!(
            after_first16 < *peak64,
            "device {} kept {after_first16} of {peak64}",
            d.device
        );
        assert!(d.idle_releases > 0 && d.idle_released_bytes > 0, "{d:?}");
        // The maintenance threads were not asked to release anything.
        assert_eq!(d.maintenance.as_ref().unwrap().releases, 0);
    }
}

/// The maintenance threads' idle release policy, left to their clocks,
/// gives the surplus of a large busy period back once a later busy period
/// needed less, with no call from the user. The test waits (with
/// deadlines) for the thread's ticks rather than sleeping fixed times, so
/// it holds however the threads are scheduled.
#[test]
fn maintenance_threads_give_the_surplus_back_after_a_smaller_busy_period() {
    use std::time::Instant;
    let rt = runtime(1, "idle_release_ms=5,maint_ms=2");
    let p = rt.device(0).unwrap();
    let idle_ticks = || rt.maintenance_stats()[0].idle_ticks;
    let wait = |what: &str, done: &dyn Fn() -> bool| {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !done() {
            assert!(
                Instant::now() < deadline,
                "{what}: {:?}",
                rt.maintenance_stats()
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    };
    let s = p.new_stream().unwrap();
    // A large busy period: 32 MiB grown and freed, all of it cached.
    drop(p.alloc(32 << 20, &s).unwrap());
    p.settle().unwrap();
    assert!(p.stats().cached_bytes.current >= 32 << 20);
    // Two idle ticks later, the thread has seen the traffic and then taken
    // the large period's peak (a tick that began before it counts at most
    // one of them), so the next busy period is measured on its own.
    let i0 = idle_ticks();
    wait("two idle ticks", &|| idle_ticks() >= i0 + 2);
    // A small busy period; at its idle gap the cache exceeds twice what it
    // needed, and goes back to the device.
    drop(p.alloc(1 << 20, &s).unwrap());
    wait("the surplus given back", &|| {
        p.stats().reserved_bytes.current < 32 << 20
    });
    let m = &rt.maintenance_stats()[0];
    assert!(m.releases > 0 && m.released_bytes >= 30 << 20, "{m:?}");
}

#[test]
fn without_idle_release_the_pool_keeps_its_memory() {
    let rt = runtime(2, "");
    let mut o = small(TrainOptions::schedule(&[(64, 2), (16, 2)]));
    o.idle_gap = Duration::from_millis(20);
    let r = train::run(&rt, &o).unwrap();
    for d in &r.devices {
        let peak = *d.reserved_after_step.iter().max().unwrap();
        assert_eq!(*d.reserved_after_idle.last().unwrap(), peak, "{d:?}");
        assert_eq!(d.maintenance.as_ref().unwrap().releases, 0);
    }
}

#[test]
fn bad_options_are_typed_errors() {
    let rt = runtime(1, "");
    for o in [
        small(vec![]),
        small(vec![0]),
        TrainOptions {
            bucket_bytes: 12,
            ..small(vec![1])
        },
        TrainOptions {
            streams: 0,
            ..small(vec![1])
        },
    ] {
        assert!(matches!(
            train::run(&rt, &o),
            Err(gpupool::Error::InvalidArgument(_))
        ));
    }
}

#[test]
fn host_all_reduce_waits_for_stream_work() {
    let rt = runtime(3, "");
    let sim = rt
        .backend()
        .as_any()
        .downcast_ref::<gpupool::backend::sim::SimBackend>()
        .unwrap();
    let coll = HostAllReduce::new(rt.backend().clone());
    let streams: Vec<_> = rt
        .devices()
        .iter()
        .map(|p| p.new_stream().unwrap())
        .collect();
    let blocks: Vec<_> = rt
        .devices()
        .iter()
        .zip(&streams)
        .map(|(p, s)| p.alloc(4096, s).unwrap())
        .collect();
    let mut bufs = Vec::new();
    for (d, (b, s)) in blocks.iter().zip(&streams).enumerate() {
        // The write runs late: a premature read would see old bytes.
        sim.stall_stream(d, s.handle(), Duration::from_millis(30))
            .unwrap();
        sim.launch_write_pattern(d, s.handle(), b.ptr(), 4096, 7 + d as u64, Duration::ZERO)
            .unwrap();
        bufs.push(ReduceBuf {
            device: d,
            stream: s.handle(),
            ptr: b.ptr(),
            bytes: 4096,
        });
    }
    coll.all_reduce(&bufs).unwrap();
    let mut want = vec![0u32; 1024];
    let mut tmp = vec![0u8; 4096];
    for d in 0..3 {
        gpupool::backend::sim::fill_pattern(&mut tmp, 7 + d);
        for (w, c) in want.iter_mut().zip(tmp.chunks_exact(4)) {
            *w = w.wrapping_add(u32::from_le_bytes(c.try_into().unwrap()));
        }
    }
    for (d, b) in blocks.iter().enumerate() {
        rt.backend().copy_to_host(d, b.ptr(), &mut tmp).unwrap();
        let got: Vec<u32> = tmp
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(got, want, "device {d}");
    }
    assert_eq!(coll.host_syncs(), 3 * 3);
    // Mismatched calls change nothing.
    let mut short = bufs.clone();
    short[1].bytes = 2048;
    assert!(coll.all_reduce(&short).is_err());
    assert_eq!(coll.host_syncs(), 9);
}
