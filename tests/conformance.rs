//! Backend conformance suite: written once, run against every backend present.
//!
//! The simulator always runs. CUDA runs when a driver and a device exist;
//! otherwise its cases are skipped with a printed reason, unless
//! `GPUPOOL_REQUIRE_CUDA=1` is set (as `scripts/gpu-check.sh` does), in which
//! case a missing CUDA backend fails the suite.
//!
//! Cases marked "sim only" exercise the simulator's test hooks (fault
//! injection, pattern kernels); the rest hold for both backends.

use gpupool::backend::sim::{SimBackend, SimConfig};
use gpupool::backend::{self, Backend, Call, Move};
use gpupool::{BackendKind, DevicePtr, Error, EventHandle, StreamHandle};
use std::sync::Arc;
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;

fn sim_config() -> SimConfig {
    SimConfig {
        devices: 2,
        capacity_bytes: 256 * MIB,
        ..Default::default()
    }
}

/// Every backend present: the simulator, and CUDA where it can be opened.
fn backends() -> Vec<Arc<dyn Backend>> {
    let mut v: Vec<Arc<dyn Backend>> = vec![Arc::new(SimBackend::new(sim_config()).unwrap())];
    match backend::open(&BackendKind::Cuda, &sim_config()) {
        Ok(b) => v.push(b),
        Err(e) => {
            if std::env::var("GPUPOOL_REQUIRE_CUDA").as_deref() == Ok("1") {
                panic!("GPUPOOL_REQUIRE_CUDA=1 but CUDA could not be opened: {e}");
            }
            eprintln!("conformance: CUDA cases skipped: {e}");
        }
    }
    v
}

fn sim() -> SimBackend {
    SimBackend::new(sim_config()).unwrap()
}

fn as_sim(b: &Arc<dyn Backend>) -> Option<&SimBackend> {
    b.as_any().downcast_ref::<SimBackend>()
}

/// Enqueues work that takes tens of milliseconds on `stream`.
fn slow_work(b: &Arc<dyn Backend>, stream: StreamHandle) -> Option<(DevicePtr, u64)> {
    if let Some(s) = as_sim(b) {
        s.stall_stream(0, stream, Duration::from_millis(150))
            .unwrap();
        return None;
    }
    // A real device: many large fills keep the stream busy for a while.
    let len = 1u64 << 30;
    let p = b.alloc_segment(0, len).unwrap();
    for i in 0..48 {
        b.enqueue_fill(0, stream, p, len, i as u8).unwrap();
    }
    Some((p, len))
}

fn release_slow(b: &Arc<dyn Backend>, stream: StreamHandle, scratch: Option<(DevicePtr, u64)>) {
    if let Some((p, _)) = scratch {
        b.sync_stream(0, stream).unwrap();
        b.free_segment(0, p).unwrap();
    }
}

/// A mapped range of `chunks` fresh chunks of one granule each.
struct Mapping {
    va: DevicePtr,
    len: u64,
    chunks: Vec<gpupool::ChunkHandle>,
}

fn map_fresh(b: &Arc<dyn Backend>, granules: u64) -> Mapping {
    let g = b.device_info(0).unwrap().granularity;
    let len = granules * g;
    let va = b.reserve_va(0, len).unwrap();
    let chunks: Vec<_> = (0..granules)
        .map(|i| {
            let c = b.create_chunk(0, g).unwrap();
            b.map(0, va.offset(i * g), g, c, 0).unwrap();
            c
        })
        .collect();
    Mapping { va, len, chunks }
}

fn unmap_all(b: &Arc<dyn Backend>, m: Mapping) {
    b.unmap(0, m.va, m.len).unwrap();
    for c in m.chunks {
        b.release_chunk(0, c).unwrap();
    }
    b.free_va(0, m.va, m.len).unwrap();
}

fn read(b: &Arc<dyn Backend>, p: DevicePtr, n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    b.copy_to_host(0, p, &mut v).unwrap();
    v
}

// ---- devices ----------------------------------------------------------------

#[test]
fn device_facts_are_sane() {
    for b in backends() {
        assert!(b.device_count() >= 1, "{}", b.name());
        for d in 0..b.device_count() {
            let i = b.device_info(d).unwrap();
            assert_eq!(i.index, d);
            assert!(i.total_bytes > 0);
            assert!(i.granularity.is_power_of_two() && i.granularity >= 4096);
            assert_eq!(
                i.pci_bus_id.matches(':').count(),
                2,
                "PCI id {}",
                i.pci_bus_id
            );
            assert!(!i.name.is_empty());
        }
    }
}

#[test]
fn bad_device_index_is_a_typed_error() {
    for b in backends() {
        let n = b.device_count();
        assert!(
            matches!(b.device_info(n), Err(Error::InvalidDevice { .. })),
            "{}",
            b.name()
        );
        assert!(matches!(
            b.create_stream(n + 3),
            Err(Error::InvalidDevice { .. })
        ));
        assert!(matches!(
            b.create_chunk(n, 2 * MIB),
            Err(Error::InvalidDevice { .. })
        ));
    }
}

// ---- physical and virtual memory -------------------------------------------

#[test]
fn one_chunk_mapped_at_two_addresses_shows_the_same_bytes() {
    for b in backends() {
        let g = b.device_info(0).unwrap().granularity;
        let chunk = b.create_chunk(0, g).unwrap();
        let va1 = b.reserve_va(0, g).unwrap();
        let va2 = b.reserve_va(0, g).unwrap();
        b.map(0, va1, g, chunk, 0).unwrap();
        b.map(0, va2, g, chunk, 0).unwrap();
        let data: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
        b.copy_from_host(0, va1.offset(g - 4096), &data).unwrap();
        assert_eq!(read(&b, va2.offset(g - 4096), 4096), data, "{}", b.name());
        b.unmap(0, va1, g).unwrap();
        b.unmap(0, va2, g).unwrap();
        b.release_chunk(0, chunk).unwrap();
        b.free_va(0, va1, g).unwrap();
        b.free_va(0, va2, g).unwrap();
    }
}

#[test]
fn remapping_a_chunk_under_a_new_range_keeps_its_bytes() {
    for b in backends() {
        let g = b.device_info(0).unwrap().granularity;
        let chunk = b.create_chunk(0, g).unwrap();
        let va1 = b.reserve_va(0, g).unwrap();
        b.map(0, va1, g, chunk, 0).unwrap();
        b.copy_from_host(0, va1, b"stitched memory survives remapping")
            .unwrap();
        b.unmap(0, va1, g).unwrap();
        let va2 = b.reserve_va(0, 2 * g).unwrap();
        b.map(0, va2.offset(g), g, chunk, 0).unwrap();
        assert_eq!(
            read(&b, va2.offset(g), 34),
            b"stitched memory survives remapping"
        );
        b.unmap(0, va2.offset(g), g).unwrap();
        b.release_chunk(0, chunk).unwrap();
        b.free_va(0, va1, g).unwrap();
        b.free_va(0, va2, 2 * g).unwrap();
    }
}

#[test]
fn separate_chunks_stitch_into_one_contiguous_range() {
    for b in backends() {
        let m = map_fresh(&b, 3);
        let g = m.len / 3;
        // A write straddling both chunk boundaries reads back whole.
        let data: Vec<u8> = (0..(g + 8192)).map(|i| (i % 251) as u8).collect();
        b.copy_from_host(0, m.va.offset(g - 4096), &data).unwrap();
        assert_eq!(
            read(&b, m.va.offset(g - 4096), data.len()),
            data,
            "{}",
            b.name()
        );
        unmap_all(&b, m);
    }
}

/// `map_run`: one call maps a run of chunks with one access grant, and a
/// run that cannot be mapped whole leaves nothing mapped.
#[test]
fn a_run_of_chunks_maps_whole_or_not_at_all() {
    for b in backends() {
        let g = b.device_info(0).unwrap().granularity;
        let chunks: Vec<_> = (0..3).map(|_| b.create_chunk(0, g).unwrap()).collect();
        let va = b.reserve_va(0, 4 * g).unwrap();
        let grants = b.counters().get(Call::SetAccess);
        b.map_run(0, va, g, &chunks).unwrap();
        assert_eq!(
            b.counters().get(Call::SetAccess) - grants,
            1,
            "{}",
            b.name()
        );
        let data: Vec<u8> = (0..(2 * g + 64)).map(|i| (i % 241) as u8).collect();
        b.copy_from_host(0, va.offset(g / 2), &data).unwrap();
        assert_eq!(read(&b, va.offset(g / 2), data.len()), data, "{}", b.name());
        // Granule 3 is free, granule 4 lies past the reservation: a run over
        // both fails ...
        let extra = b.create_chunk(0, g).unwrap();
        assert!(b.map_run(0, va.offset(3 * g), g, &[extra, extra]).is_err());
        // ... and leaves granule 3 unmapped: mapping it alone works.
        b.map(0, va.offset(3 * g), g, extra, 0).unwrap();
        b.unmap(0, va.offset(3 * g), g).unwrap();
        for i in 0..3 {
            b.unmap(0, va.offset(i * g), g).unwrap();
        }
        for c in chunks.into_iter().chain([extra]) {
            b.release_chunk(0, c).unwrap();
        }
        b.free_va(0, va, 4 * g).unwrap();
    }
}

#[test]
fn bad_mappings_are_rejected_and_change_nothing() {
    for b in backends() {
        let g = b.device_info(0).unwrap().granularity;
        let chunk = b.create_chunk(0, g).unwrap();
        let va = b.reserve_va(0, 2 * g).unwrap();
        // Misaligned address.
        assert!(
            b.map(0, va.offset(4096), g, chunk, 0).is_err(),
            "{}",
            b.name()
        );
        // Past the chunk's end.
        assert!(b.map(0, va, 2 * g, chunk, 0).is_err());
        // Good mapping, then the same range again.
        b.map(0, va, g, chunk, 0).unwrap();
        assert!(b.map(0, va, g, chunk, 0).is_err());
        // The good mapping still works.
        b.copy_from_host(0, va, &[9u8; 16]).unwrap();
        assert_eq!(read(&b, va, 16), vec![9u8; 16]);
        b.unmap(0, va, g).unwrap();
        b.release_chunk(0, chunk).unwrap();
        b.free_va(0, va, 2 * g).unwrap();
    }
}

#[test]
fn chunk_sizes_must_be_granule_multiples() {
    for b in backends() {
        let g = b.device_info(0).unwrap().granularity;
        assert!(b.create_chunk(0, g + 1).is_err(), "{}", b.name());
        assert!(b.create_chunk(0, 0).is_err());
    }
}

#[test]
fn exhausting_device_memory_is_an_out_of_memory_error() {
    for b in backends() {
        let i = b.device_info(0).unwrap();
        let too_big = (i.total_bytes / i.granularity + 1) * i.granularity;
        let e = b.create_chunk(0, too_big).unwrap_err();
        assert!(e.is_oom(), "{}: {e}", b.name());
        let e = b.alloc_segment(0, too_big).unwrap_err();
        assert!(e.is_oom(), "{}: {e}", b.name());
    }
}

#[test]
fn plain_segments_hold_data_and_free() {
    for b in backends() {
        let p = b.alloc_segment(0, 3 * MIB + 5).unwrap();
        assert_eq!(p.addr() % 256, 0);
        b.copy_from_host(0, p.offset(3 * MIB), &[1, 2, 3, 4, 5])
            .unwrap();
        assert_eq!(read(&b, p.offset(3 * MIB), 5), vec![1, 2, 3, 4, 5]);
        b.free_segment(0, p).unwrap();
        assert!(b.free_segment(0, p).is_err(), "double cuMemFree must fail");
    }
}

// ---- streams and events -------------------------------------------------------

#[test]
fn an_event_never_recorded_is_complete() {
    for b in backends() {
        let e = b.create_event(0).unwrap();
        assert!(b.query_event(0, e).unwrap(), "{}", b.name());
        b.destroy_event(0, e).unwrap();
    }
}

#[test]
fn an_event_completes_only_after_earlier_work() {
    for b in backends() {
        let s = b.create_stream(0).unwrap();
        let e = b.create_event(0).unwrap();
        let scratch = slow_work(&b, s);
        b.record_event(0, e, s).unwrap();
        assert!(
            !b.query_event(0, e).unwrap(),
            "{}: completed before the work ran",
            b.name()
        );
        b.sync_event(0, e).unwrap();
        assert!(b.query_event(0, e).unwrap());
        release_slow(&b, s, scratch);
        b.destroy_event(0, e).unwrap();
        b.destroy_stream(0, s).unwrap();
    }
}

#[test]
fn a_stream_is_idle_only_once_its_work_completed() {
    for b in backends() {
        let s = b.create_stream(0).unwrap();
        let other = b.create_stream(0).unwrap();
        assert!(
            b.query_stream(0, s).unwrap(),
            "{}: a new stream is idle",
            b.name()
        );
        let scratch = slow_work(&b, s);
        assert!(
            !b.query_stream(0, s).unwrap(),
            "{}: idle before its work ran",
            b.name()
        );
        // Work on one stream does not make another busy.
        assert!(b.query_stream(0, other).unwrap(), "{}", b.name());
        b.sync_stream(0, s).unwrap();
        assert!(b.query_stream(0, s).unwrap(), "{}", b.name());
        release_slow(&b, s, scratch);
        b.destroy_stream(0, other).unwrap();
        b.destroy_stream(0, s).unwrap();
        // A destroyed stream is an error, not an idle one.
        if as_sim(&b).is_some() {
            assert!(b.query_stream(0, s).is_err());
        }
    }
}

#[test]
fn re_recording_replaces_the_earlier_capture() {
    for b in backends() {
        let (s1, s2) = (b.create_stream(0).unwrap(), b.create_stream(0).unwrap());
        let e = b.create_event(0).unwrap();
        b.record_event(0, e, s1).unwrap();
        b.sync_event(0, e).unwrap();
        let scratch = slow_work(&b, s2);
        b.record_event(0, e, s2).unwrap();
        assert!(
            !b.query_event(0, e).unwrap(),
            "{}: new capture must be pending",
            b.name()
        );
        b.sync_stream(0, s2).unwrap();
        assert!(b.query_event(0, e).unwrap());
        release_slow(&b, s2, scratch);
        b.destroy_stream(0, s1).unwrap();
        b.destroy_stream(0, s2).unwrap();
    }
}

#[test]
fn stream_wait_event_orders_work_across_streams() {
    for b in backends() {
        let (a, c) = (b.create_stream(0).unwrap(), b.create_stream(0).unwrap());
        let p = b.alloc_segment(0, MIB).unwrap();
        let e = b.create_event(0).unwrap();
        let scratch = slow_work(&b, a);
        b.enqueue_fill(0, a, p, MIB, 0xAA).unwrap();
        b.record_event(0, e, a).unwrap();
        b.stream_wait_event(0, c, e).unwrap();
        b.enqueue_fill(0, c, p, MIB / 2, 0xBB).unwrap();
        b.sync_stream(0, c).unwrap();
        let v = read(&b, p, MIB as usize);
        assert!(
            v[..(MIB / 2) as usize].iter().all(|&x| x == 0xBB),
            "{}: wait was not honoured",
            b.name()
        );
        assert!(v[(MIB / 2) as usize..].iter().all(|&x| x == 0xAA));
        release_slow(&b, a, scratch);
        b.free_segment(0, p).unwrap();
        b.destroy_stream(0, a).unwrap();
        b.destroy_stream(0, c).unwrap();
    }
}

#[test]
fn waiting_on_an_event_blocks_neither_the_host_nor_other_streams() {
    for b in backends() {
        let (a, w, other) = (
            b.create_stream(0).unwrap(),
            b.create_stream(0).unwrap(),
            b.create_stream(0).unwrap(),
        );
        let e = b.create_event(0).unwrap();
        let scratch = slow_work(&b, a);
        b.record_event(0, e, a).unwrap();
        let t = Instant::now();
        b.stream_wait_event(0, w, e).unwrap();
        let e_w = b.create_event(0).unwrap();
        b.record_event(0, e_w, w).unwrap();
        let e_o = b.create_event(0).unwrap();
        b.record_event(0, e_o, other).unwrap();
        b.sync_event(0, e_o).unwrap();
        assert!(
            t.elapsed() < Duration::from_millis(100),
            "{}: host or other stream was blocked",
            b.name()
        );
        assert!(
            !b.query_event(0, e_w).unwrap(),
            "{}: waiting stream ran ahead",
            b.name()
        );
        b.sync_event(0, e_w).unwrap();
        assert!(b.query_event(0, e).unwrap());
        release_slow(&b, a, scratch);
        for s in [a, w, other] {
            b.destroy_stream(0, s).unwrap();
        }
    }
}

#[test]
fn host_blocking_syncs_are_counted_and_async_calls_are_not() {
    for b in backends() {
        let s = b.create_stream(0).unwrap();
        let e = b.create_event(0).unwrap();
        let before = b.counters();
        b.record_event(0, e, s).unwrap();
        let _ = b.query_event(0, e).unwrap();
        b.stream_wait_event(0, s, e).unwrap();
        let mid = b.counters();
        assert_eq!(mid.host_syncs, before.host_syncs, "{}", b.name());
        assert_eq!(
            mid.get(Call::EventRecord),
            before.get(Call::EventRecord) + 1
        );
        assert_eq!(mid.get(Call::EventQuery), before.get(Call::EventQuery) + 1);
        b.sync_event(0, e).unwrap();
        b.sync_stream(0, s).unwrap();
        assert_eq!(b.counters().host_syncs, before.host_syncs + 2);
        b.destroy_stream(0, s).unwrap();
    }
}

#[test]
fn moves_run_in_order_and_preserve_bytes() {
    for b in backends() {
        let s = b.create_stream(0).unwrap();
        let p = b.alloc_segment(0, 4 * MIB).unwrap();
        let src: Vec<u8> = (0..MIB).map(|i| (i * 13 % 256) as u8).collect();
        b.copy_from_host(0, p, &src).unwrap();
        // A chain: 0 -> 1 MiB, then 1 MiB -> 2.5 MiB (reads what the first wrote),
        // then an overlapping slide 2.5 MiB -> 2.25 MiB.
        let moves = [
            Move {
                src: p,
                dst: p.offset(MIB),
                len: MIB,
            },
            Move {
                src: p.offset(MIB),
                dst: p.offset(5 * MIB / 2),
                len: MIB,
            },
            Move {
                src: p.offset(5 * MIB / 2),
                dst: p.offset(9 * MIB / 4),
                len: MIB / 8,
            },
        ];
        b.enqueue_moves(0, s, &moves).unwrap();
        b.sync_stream(0, s).unwrap();
        assert_eq!(read(&b, p.offset(MIB), MIB as usize), src, "{}", b.name());
        assert_eq!(
            read(&b, p.offset(9 * MIB / 4), (MIB / 8) as usize),
            src[..(MIB / 8) as usize]
        );
        b.free_segment(0, p).unwrap();
        b.destroy_stream(0, s).unwrap();
    }
}

#[test]
fn streams_and_events_of_another_device_are_rejected() {
    for b in backends() {
        if b.device_count() < 2 {
            eprintln!("{}: one device, cross-device case skipped", b.name());
            continue;
        }
        let s1 = b.create_stream(1).unwrap();
        let e0 = b.create_event(0).unwrap();
        if as_sim(&b).is_some() {
            // CUDA checks this only at record time and may accept it; the
            // simulator is stricter by design.
            assert!(matches!(
                b.record_event(0, e0, s1),
                Err(Error::InvalidHandle(_))
            ));
            assert!(matches!(
                b.destroy_stream(0, s1),
                Err(Error::InvalidHandle(_))
            ));
        }
        b.destroy_stream(1, s1).unwrap();
    }
}

// ---- simulator only: faults, kernels, fidelity details ------------------------

#[test]
fn sim_fails_the_nth_physical_allocation() {
    let s = sim();
    let g = s.config().granularity;
    s.fail_nth_physical(0, 3).unwrap();
    let a = s.create_chunk(0, g).unwrap();
    let b = s.alloc_segment(0, 4096).unwrap();
    assert!(matches!(s.create_chunk(0, g), Err(Error::InjectedFault(_))));
    let c = s.create_chunk(0, g).unwrap();
    assert_eq!(
        s.used_bytes(0),
        2 * g + 4096,
        "the failed call must hold nothing"
    );
    s.release_chunk(0, a).unwrap();
    s.release_chunk(0, c).unwrap();
    s.free_segment(0, b).unwrap();
    assert_eq!(s.used_bytes(0), 0);
}

#[test]
fn sim_capacity_cap_makes_allocations_fail_until_lifted() {
    let s = sim();
    let g = s.config().granularity;
    let a = s.create_chunk(0, g).unwrap();
    s.set_capacity_limit(0, Some(g)).unwrap();
    assert!(s.create_chunk(0, g).unwrap_err().is_oom());
    s.set_capacity_limit(0, None).unwrap();
    let b = s.create_chunk(0, g).unwrap();
    s.release_chunk(0, a).unwrap();
    s.release_chunk(0, b).unwrap();
}

#[test]
fn sim_event_faults_surface_as_errors() {
    let s = sim();
    let st = s.create_stream(0).unwrap();
    let e = s.create_event(0).unwrap();
    s.fail_next_event_ops(0, 2).unwrap();
    assert!(matches!(
        s.record_event(0, e, st),
        Err(Error::InjectedFault(_))
    ));
    assert!(matches!(s.query_event(0, e), Err(Error::InjectedFault(_))));
    s.record_event(0, e, st).unwrap();
    s.sync_event(0, e).unwrap();
    assert!(s.query_event(0, e).unwrap());
}

#[test]
fn sim_event_delay_holds_completion_back() {
    let s = sim();
    let st = s.create_stream(0).unwrap();
    let e = s.create_event(0).unwrap();
    s.set_event_delay(0, Duration::from_millis(120)).unwrap();
    s.record_event(0, e, st).unwrap();
    std::thread::sleep(Duration::from_millis(30));
    assert!(!s.query_event(0, e).unwrap());
    s.sync_event(0, e).unwrap();
    assert!(s.query_event(0, e).unwrap());
}

#[test]
fn sim_catches_reuse_before_the_last_use_completed() {
    // A block is written late by a delayed kernel on stream A. Stream B takes
    // the same memory at once (a broken allocator would hand it over without
    // waiting) and writes its own pattern; when B verifies later, A's late
    // write has clobbered it.
    let s = sim();
    let (a, b) = (s.create_stream(0).unwrap(), s.create_stream(0).unwrap());
    let p = s.alloc_segment(0, MIB).unwrap();
    s.launch_write_pattern(0, a, p, MIB, 1, Duration::from_millis(100))
        .unwrap();
    s.launch_write_pattern(0, b, p, MIB, 2, Duration::ZERO)
        .unwrap();
    let r = s
        .launch_verify_pattern(0, b, p, MIB, 2, Duration::from_millis(200))
        .unwrap();
    assert!(r.wait() > MIB / 2, "late write on A must corrupt B's bytes");
    assert!(s.integrity_errors(0) > 0);

    // Ordered correctly (B waits on A's event), the same traffic is clean.
    let s = sim();
    let (a, b) = (s.create_stream(0).unwrap(), s.create_stream(0).unwrap());
    let p = s.alloc_segment(0, MIB).unwrap();
    let e = s.create_event(0).unwrap();
    s.launch_write_pattern(0, a, p, MIB, 1, Duration::from_millis(100))
        .unwrap();
    s.record_event(0, e, a).unwrap();
    s.stream_wait_event(0, b, e).unwrap();
    s.launch_write_pattern(0, b, p, MIB, 2, Duration::ZERO)
        .unwrap();
    let r = s
        .launch_verify_pattern(0, b, p, MIB, 2, Duration::ZERO)
        .unwrap();
    assert_eq!(r.wait(), 0);
    assert_eq!(s.integrity_errors(0), 0);
}

#[test]
fn sim_kernel_outside_mapped_memory_is_a_device_fault_not_a_crash() {
    let s = sim();
    let st = s.create_stream(0).unwrap();
    let g = s.config().granularity;
    let va = s.reserve_va(0, g).unwrap();
    let r = s
        .launch_verify_pattern(0, st, va, 64, 1, Duration::ZERO)
        .unwrap();
    s.launch_write_pattern(0, st, DevicePtr(0x10), 64, 1, Duration::ZERO)
        .unwrap();
    s.sync_stream(0, st).unwrap();
    assert_eq!(r.wait(), 64);
    assert_eq!(s.device_faults(0), 2);
    assert!(s.copy_to_host(0, va, &mut [0u8; 8]).is_err());
}

#[test]
fn sim_release_while_mapped_frees_after_unmap_as_cuda_does() {
    let s = sim();
    let g = s.config().granularity;
    let c = s.create_chunk(0, g).unwrap();
    let va = s.reserve_va(0, g).unwrap();
    s.map(0, va, g, c, 0).unwrap();
    s.release_chunk(0, c).unwrap();
    assert_eq!(s.used_bytes(0), g, "still mapped, still held");
    s.copy_from_host(0, va, &[5u8; 8]).unwrap();
    assert!(
        s.free_va(0, va, g).is_err(),
        "a reservation with mappings cannot be freed"
    );
    s.unmap(0, va, g).unwrap();
    assert_eq!(s.used_bytes(0), 0);
    s.free_va(0, va, g).unwrap();
}

#[test]
fn sim_a_released_chunk_handle_stays_invalid_after_its_slot_is_reused() {
    let s = sim();
    let g = s.config().granularity;
    let old = s.create_chunk(0, g).unwrap();
    s.release_chunk(0, old).unwrap();
    // The simulator's chunk table reuses the freed slot at once: the new
    // handle differs and the old one must not reach the new chunk.
    let new = s.create_chunk(0, g).unwrap();
    assert_ne!(old, new);
    let va = s.reserve_va(0, 2 * g).unwrap();
    assert!(matches!(
        s.map(0, va, g, old, 0),
        Err(Error::InvalidHandle(_))
    ));
    assert!(matches!(
        s.map_run(0, va, g, &[new, old]),
        Err(Error::InvalidHandle(_))
    ));
    assert!(matches!(
        s.release_chunk(0, old),
        Err(Error::InvalidHandle(_))
    ));
    // The failed run changed nothing: both granules map afresh.
    s.map_run(0, va, g, &[new, new]).unwrap();
    s.unmap(0, va, 2 * g).unwrap();
    s.release_chunk(0, new).unwrap();
    assert!(matches!(
        s.release_chunk(0, new),
        Err(Error::InvalidHandle(_))
    ));
    s.free_va(0, va, 2 * g).unwrap();
    assert_eq!(s.used_bytes(0), 0);
}

#[test]
fn sim_a_bad_unmap_keeps_the_map_counts_of_the_mappings_it_passed() {
    let s = sim();
    let g = s.config().granularity;
    let (c0, c1) = (s.create_chunk(0, g).unwrap(), s.create_chunk(0, g).unwrap());
    let va = s.reserve_va(0, 4 * g).unwrap();
    s.map_run(0, va, g, &[c0, c1]).unwrap();
    // Released while mapped: each is freed when its last mapping goes.
    s.release_chunk(0, c0).unwrap();
    s.release_chunk(0, c1).unwrap();
    // Both mappings are passed before the gap at granule 2 is found.
    assert!(s.unmap(0, va, 3 * g).is_err(), "a gap after two mappings");
    assert!(s.unmap(0, va, g + g / 2).is_err(), "would split a mapping");
    assert_eq!(s.used_bytes(0), 2 * g, "nothing was freed");
    s.copy_from_host(0, va, &[1u8; 8]).unwrap();
    s.unmap(0, va, g).unwrap();
    assert_eq!(s.used_bytes(0), g);
    s.unmap(0, va.offset(g), g).unwrap();
    assert_eq!(s.used_bytes(0), 0);
    s.free_va(0, va, 4 * g).unwrap();
}

#[test]
fn sim_unmaps_only_whole_mappings_and_a_bad_unmap_changes_nothing() {
    let s = sim();
    let g = s.config().granularity;
    let (c0, c1) = (
        s.create_chunk(0, 2 * g).unwrap(),
        s.create_chunk(0, g).unwrap(),
    );
    let va = s.reserve_va(0, 8 * g).unwrap();
    // A two-granule mapping at granule 1, a one-granule one at granule 5.
    s.map(0, va.offset(g), 2 * g, c0, 0).unwrap();
    s.map(0, va.offset(5 * g), g, c1, 0).unwrap();
    s.copy_from_host(0, va.offset(g), &[7u8; 16]).unwrap();
    let bad = [
        (va.offset(g), g, "half of a mapping"),
        (va.offset(2 * g), g, "the other half"),
        (va, 3 * g, "a gap before the mapping"),
        (va.offset(g), 5 * g, "a gap between two mappings"),
        (va.offset(7 * g), 2 * g, "past the reservation's end"),
    ];
    for (at, len, what) in bad {
        assert!(s.unmap(0, at, len).is_err(), "{what}");
    }
    // Nothing changed: both mappings hold, and can be unmapped whole.
    assert_eq!(read_sim(&s, va.offset(g), 16), vec![7u8; 16]);
    assert!(
        s.map(0, va.offset(2 * g), g, c1, 0).is_err(),
        "still mapped"
    );
    s.unmap(0, va.offset(g), 2 * g).unwrap();
    s.unmap(0, va.offset(5 * g), g).unwrap();
    assert!(s.unmap(0, va.offset(g), 2 * g).is_err(), "already unmapped");
    // Granule 1 maps again, under the other chunk.
    s.map(0, va.offset(g), g, c1, 0).unwrap();
    s.unmap(0, va.offset(g), g).unwrap();
    s.release_chunk(0, c0).unwrap();
    s.release_chunk(0, c1).unwrap();
    s.free_va(0, va, 8 * g).unwrap();
    assert_eq!(s.used_bytes(0), 0);
}

fn read_sim(s: &SimBackend, p: DevicePtr, n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    s.copy_to_host(0, p, &mut v).unwrap();
    v
}

#[test]
fn sim_unmapped_memory_is_really_inaccessible_to_work() {
    let s = sim();
    let st = s.create_stream(0).unwrap();
    let g = s.config().granularity;
    let c = s.create_chunk(0, g).unwrap();
    let va = s.reserve_va(0, g).unwrap();
    s.map(0, va, g, c, 0).unwrap();
    s.unmap(0, va, g).unwrap();
    s.enqueue_fill(0, st, va, 16, 1).unwrap();
    s.sync_stream(0, st).unwrap();
    assert_eq!(s.device_faults(0), 1);
}

#[test]
fn sim_accounting_mode_tracks_bytes_without_backing() {
    let cfg = SimConfig {
        capacity_bytes: 64 << 40,
        backing: gpupool::backend::sim::SimBacking::Accounting,
        ..Default::default()
    };
    let s = SimBackend::new(cfg).unwrap();
    let g = s.config().granularity;
    let big = 1 << 40; // 1 TiB: far beyond this host.
    let va = s.reserve_va(0, big).unwrap();
    let c = s.create_chunk(0, big).unwrap();
    s.map(0, va, big, c, 0).unwrap();
    assert_eq!(s.used_bytes(0), big);
    assert!(s.map(0, va, g, c, 0).is_err(), "overlap is still checked");
    s.unmap(0, va, big).unwrap();
    s.release_chunk(0, c).unwrap();
    assert_eq!(s.used_bytes(0), 0);
}

/// Sim only: in accounting mode each simulator's devices take fresh fake
/// addresses, so a pointer of a simulator dropped earlier (a runtime shut
/// down and started again) is never one a later simulator hands out.
#[test]
fn sim_fake_addresses_are_not_reused_by_a_later_simulator() {
    let cfg = || SimConfig {
        devices: 2,
        backing: gpupool::backend::sim::SimBacking::Accounting,
        ..Default::default()
    };
    let g = SimBackend::new(cfg()).unwrap().config().granularity;
    let mut seen = Vec::new();
    for _ in 0..3 {
        let s = SimBackend::new(cfg()).unwrap();
        for d in 0..2 {
            let va = s.reserve_va(d, 4 * g).unwrap();
            let seg = s.alloc_segment(d, 4096).unwrap();
            seen.push((va.addr(), 4 * g));
            seen.push((seg.addr(), 4096));
        }
    }
    for (i, &(a, al)) in seen.iter().enumerate() {
        for &(b, bl) in &seen[i + 1..] {
            assert!(a + al <= b || b + bl <= a, "{a:#x} and {b:#x} overlap");
        }
    }
}

#[test]
fn sim_streams_are_asynchronous_fifos() {
    let s = sim();
    let st = s.create_stream(0).unwrap();
    let p = s.alloc_segment(0, 4096).unwrap();
    let t = Instant::now();
    s.launch_write_pattern(0, st, p, 4096, 7, Duration::from_millis(100))
        .unwrap();
    s.enqueue_fill(0, st, p, 8, 0).unwrap();
    assert!(
        t.elapsed() < Duration::from_millis(50),
        "enqueue must not wait for the work"
    );
    s.sync_stream(0, st).unwrap();
    assert!(t.elapsed() >= Duration::from_millis(100));
    let mut v = [1u8; 16];
    s.copy_to_host(0, p, &mut v).unwrap();
    assert_eq!(&v[..8], &[0u8; 8], "FIFO: the fill ran after the kernel");
    assert_eq!(v[8], gpupool::backend::sim::pattern_byte(7, 8));
}

/// A simulator whose launch queues hold 4 operations, with a stream and
/// an event on device 0.
fn shallow_queue() -> (SimBackend, StreamHandle, EventHandle) {
    let sim = SimBackend::new(SimConfig {
        queue_depth: 4,
        ..sim_config()
    })
    .unwrap();
    let s = sim.create_stream(0).unwrap();
    let ev = sim.create_event(0).unwrap();
    (sim, s, ev)
}

/// Sim only: a stream's queue is finite, like a launch queue. Behind a
/// stalled stream, the pushes past the queue's depth block the host until
/// the stall ends; the ones within it return at once.
#[test]
fn sim_full_launch_queue_blocks_the_host_until_the_stream_drains() {
    let (sim, s, ev) = shallow_queue();
    let stall = Duration::from_millis(300);
    sim.stall_stream(0, s, stall).unwrap();
    let t = Instant::now();
    // The worker holds the stall; these fill the queue behind it.
    for _ in 0..4 {
        sim.record_event(0, ev, s).unwrap();
    }
    let within = t.elapsed();
    for _ in 0..4 {
        sim.record_event(0, ev, s).unwrap();
    }
    let past = t.elapsed();
    assert!(
        past >= stall - Duration::from_millis(50),
        "pushes past the queue's depth returned after {past:?}, before the {stall:?} stall ended"
    );
    assert!(
        within < stall / 2,
        "pushes within the queue's depth blocked ({within:?})"
    );
    sim.sync_stream(0, s).unwrap();
    assert!(sim.query_event(0, ev).unwrap());
    sim.destroy_event(0, ev).unwrap();
    sim.destroy_stream(0, s).unwrap();
}

/// Sim only: the launch queue holds what has not run yet. On a stream
/// busy without a break, records that completed behind an earlier stall
/// free their places: the host blocks only while the queue's depth of
/// operations are still to run.
#[test]
fn sim_launch_queue_counts_only_work_still_to_run() {
    let (sim, s, ev) = shallow_queue();
    let t = Instant::now();
    sim.stall_stream(0, s, Duration::from_millis(40)).unwrap();
    for _ in 0..3 {
        sim.record_event(0, ev, s).unwrap();
    }
    // The stream stays busy: a long stall after the three records.
    sim.stall_stream(0, s, Duration::from_secs(2)).unwrap();
    assert!(
        t.elapsed() < Duration::from_millis(40),
        "a push within the depth blocked"
    );
    std::thread::sleep(Duration::from_millis(60));
    // The records ran at 40 ms: the queue holds the long stall alone.
    let t = Instant::now();
    for _ in 0..3 {
        sim.record_event(0, ev, s).unwrap();
    }
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "records blocked behind places of work that had run ({:?})",
        t.elapsed()
    );
    // A fifth operation still to run: the host waits for the stall.
    sim.record_event(0, ev, s).unwrap();
    assert!(t.elapsed() >= Duration::from_millis(1800));
    sim.sync_stream(0, s).unwrap();
    sim.destroy_event(0, ev).unwrap();
    sim.destroy_stream(0, s).unwrap();
}

/// Sim only: a stall on a stream with nothing queued runs on the clock,
/// as a device's kernel does: the stream reads busy until the stall's end
/// and idle after it, an event recorded behind it completes at its end, a
/// stream waiting on that event is busy until then too, and work queued
/// behind the stall (a write, a later event on the waiter) runs after it.
#[test]
fn sim_stalls_end_on_the_clock_and_order_what_follows() {
    let s = sim();
    let (busy, waiter) = (s.create_stream(0).unwrap(), s.create_stream(0).unwrap());
    let (e, f) = (s.create_event(0).unwrap(), s.create_event(0).unwrap());
    let p = s.alloc_segment(0, MIB).unwrap();
    let stall = Duration::from_millis(150);
    let t = Instant::now();
    s.stall_stream(0, busy, stall).unwrap();
    s.record_event(0, e, busy).unwrap();
    s.stream_wait_event(0, waiter, e).unwrap();
    s.record_event(0, f, waiter).unwrap();
    let early = |ok: bool| ok && t.elapsed() < stall;
    assert!(
        !early(s.query_stream(0, busy).unwrap()),
        "a stalled stream read idle before the stall ended"
    );
    for (ev, what) in [(e, "behind the stall"), (f, "after a wait on it")] {
        assert!(
            !early(s.query_event(0, ev).unwrap()),
            "an event {what} completed early"
        );
    }
    assert!(
        !early(s.query_stream(0, waiter).unwrap()),
        "a stream waiting on the stall read idle before it ended"
    );
    // Real work queued behind the deadline runs after it, in order.
    s.launch_write_pattern(0, busy, p, MIB, 9, Duration::ZERO)
        .unwrap();
    let r = s
        .launch_verify_pattern(0, busy, p, MIB, 9, Duration::ZERO)
        .unwrap();
    s.sync_stream(0, busy).unwrap();
    assert!(t.elapsed() >= stall, "the write ran before the stall ended");
    assert_eq!(r.wait(), 0);
    s.sync_event(0, f).unwrap();
    assert!(s.query_event(0, e).unwrap() && s.query_event(0, f).unwrap());
    assert!(s.query_stream(0, busy).unwrap() && s.query_stream(0, waiter).unwrap());
    assert_eq!(s.integrity_errors(0), 0);
    // A second stall starts from the first's end, not from now.
    let t = Instant::now();
    s.stall_stream(0, busy, Duration::from_millis(60)).unwrap();
    s.stall_stream(0, busy, Duration::from_millis(60)).unwrap();
    s.record_event(0, e, busy).unwrap();
    s.sync_event(0, e).unwrap();
    assert!(t.elapsed() >= Duration::from_millis(120));
}

/// Sim only: an event recorded on an idle stream completes at once (no
/// trip through the stream's worker), one recorded behind queued work only
/// when that work has run, and a wait for a completed event is not queued:
/// it orders nothing, so work pushed after it runs as soon as the rest of
/// its stream allows.
#[test]
fn sim_records_on_idle_streams_complete_at_once_and_busy_ones_in_order() {
    let sim = SimBackend::new(sim_config()).unwrap();
    let (idle, busy) = (sim.create_stream(0).unwrap(), sim.create_stream(0).unwrap());
    let (a, b) = (sim.create_event(0).unwrap(), sim.create_event(0).unwrap());
    sim.record_event(0, a, idle).unwrap();
    assert!(
        sim.query_event(0, a).unwrap(),
        "idle stream: complete at once"
    );
    let stall = Duration::from_millis(200);
    sim.stall_stream(0, busy, stall).unwrap();
    let t = Instant::now();
    sim.record_event(0, b, busy).unwrap();
    assert!(
        !sim.query_event(0, b).unwrap() || t.elapsed() >= stall,
        "an event behind a stall completed before it ended"
    );
    // `idle` waits for the completed `a`: nothing to wait for.
    sim.stream_wait_event(0, idle, a).unwrap();
    let c = sim.create_event(0).unwrap();
    sim.record_event(0, c, idle).unwrap();
    assert!(sim.query_event(0, c).unwrap());
    // `idle` waits for `b`, behind the stall: its next event waits too.
    sim.stream_wait_event(0, idle, b).unwrap();
    sim.record_event(0, c, idle).unwrap();
    assert!(
        !sim.query_event(0, c).unwrap() || t.elapsed() >= stall,
        "an event after a wait for a pending one completed early"
    );
    sim.sync_stream(0, idle).unwrap();
    assert!(t.elapsed() >= stall - Duration::from_millis(20));
    assert!(sim.query_event(0, b).unwrap() && sim.query_event(0, c).unwrap());
    for e in [a, b, c] {
        sim.destroy_event(0, e).unwrap();
    }
    sim.destroy_stream(0, idle).unwrap();
    sim.destroy_stream(0, busy).unwrap();
}
