//! The data-parallel training harness on 4 simulated devices.

use gpupool::collective::{AllReduce, HostAllReduce, ReduceBuf};
use gpupool::train::{self, TrainOptions};
use gpupool::{BackendKind, PoolConfig, Runtime, SimConfig};
use std::time::Duration;

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
        buckets: 3,
        bucket_bytes: 64 << 10,
        micro_batches: 2,
        streams: 3,
        idle_gap: Duration::from_millis(5),
        verify: true,
    }
}

#[test]
fn four_devices_hold_identical_expected_gradients_and_stop_growing() {
    let rt = runtime(4, "");
    let r = train::run(&rt, &small(vec![32; 5])).unwrap();
    assert_eq!(r.devices.len(), 4);
    assert!(r.gradients_match, "{r}");
    assert_eq!(r.gradients_expected, Some(true), "{r}");
    assert!(r.weights_match, "{r}");
    for d in &r.devices {
        assert_eq!(d.steps, 5);
        assert_eq!(d.reserved_after_step.len(), 5);
        // Reserved memory stops growing after the second step.
        let second = d.reserved_after_step[1];
        assert!(
            d.reserved_after_step[2..].iter().all(|&x| x <= second),
            "{d:?}"
        );
        assert!(d.allocs > 0 && d.allocs_from_cache > 0);
        assert!(
            d.pending_frees > 0,
            "side-stream activations are record_stream'd"
        );
        assert_eq!(d.host_syncs_on_alloc_path, 0);
        assert_eq!(d.integrity_errors, 0);
        assert!(d.peak_reserved_bytes >= d.peak_live_bytes);
    }
    assert!(r.no_growth_after_step2 && r.ok(), "{r}");
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

#[test]
fn batch_schedule_grows_then_gives_memory_back_without_a_release_call() {
    let mut o = small(TrainOptions::schedule(&[(32, 3), (64, 3), (16, 3)]));
    o.idle_gap = Duration::from_millis(40);
    // With a 5 ms idle release, a step slowed down by a loaded machine (the
    // other tests run beside this one on 2 cores) can see its memory given
    // back in the middle and grow again after step 2. That is the policy
    // working, not a leak: one of two runs must show the clean picture.
    let mut r = train::run(&runtime(4, "idle_release_ms=5,maint_ms=2"), &o).unwrap();
    if !r.ok() {
        eprintln!("first run not clean (retrying once):\n{r}");
        r = train::run(&runtime(4, "idle_release_ms=5,maint_ms=2"), &o).unwrap();
    }
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
        let end = *d.reserved_after_idle.last().unwrap();
        assert!(end < *peak64, "device {} kept {end} of {peak64}", d.device);
        let m = d.maintenance.as_ref().unwrap();
        assert!(m.releases > 0 && m.released_bytes > 0, "{m:?}");
    }
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
