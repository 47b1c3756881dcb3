//! Error paths are transactional (issue 19): a failure part-way through an
//! allocation leaves the pool as it was, with every aliased physical chunk
//! still quarantined until its old uses complete.
//!
//! The scenario: stream A writes patterns into blocks and verifies them
//! late; the blocks are freed while A still runs (recorded on a second
//! stream, so they wait on events). Stream C then asks for more memory
//! than the device has free, so the pool stitches: it takes the physical
//! chunks of A's pending memory under a new address range (aliasing),
//! ordering C after A on the device. One driver operation of that path
//! fails — the n-th `cuMemMap`, or the n-th event operation (record, query
//! or stream wait) — for every n until the path runs out of operations.
//! Stream D then takes whatever it can and writes its own pattern at once.
//! If any failure left an aliased chunk under an address D could take
//! without waiting, A's late verify (or D's) sees the other's bytes: an
//! integrity error. Afterwards the pool must audit clean, trim to zero and
//! give all memory back.

use gpupool::backend::sim::{SimBackend, VerifyResult};
use gpupool::backend::{Backend, Call};
use gpupool::{PoolConfig, Runtime, SimConfig};
use std::sync::Arc;
use std::time::Duration;

const MIB: u64 = 1 << 20;

#[derive(Clone, Copy, Debug)]
enum Fault {
    Map,
    EventOp,
}

#[derive(Debug, Default)]
struct Outcome {
    /// Whether the armed fault was reached.
    fired: bool,
    /// Whether C's stitched allocation failed (with a typed error).
    c_failed: bool,
    d_blocks: usize,
}

fn ops(be: &SimBackend, fault: Fault) -> u64 {
    let c = be.counters();
    match fault {
        Fault::Map => c.get(Call::Map),
        Fault::EventOp => {
            c.get(Call::EventRecord) + c.get(Call::EventQuery) + c.get(Call::StreamWaitEvent)
        }
    }
}

fn scenario(fault: Fault, n: u64) -> Outcome {
    let be = Arc::new(
        SimBackend::new(SimConfig {
            devices: 1,
            capacity_bytes: 64 * MIB,
            ..Default::default()
        })
        .unwrap(),
    );
    let rt = Runtime::with_backend(
        be.clone(),
        PoolConfig {
            maintenance_tick: None,
            ..PoolConfig::default()
        },
    )
    .unwrap();
    let dev = rt.device(0).unwrap();
    let (a, b, c, d) = (
        dev.new_stream().unwrap(),
        dev.new_stream().unwrap(),
        dev.new_stream().unwrap(),
        dev.new_stream().unwrap(),
    );
    let len = 64 << 10;
    let mut checks: Vec<Arc<VerifyResult>> = Vec::new();
    // Live blocks of stream E between A's: A's freed memory is no single
    // run, so C's request is served by stitching its physical chunks.
    let e = dev.new_stream().unwrap();
    let mut fences = Vec::new();
    {
        let blocks: Vec<_> = (0..7)
            .map(|_| {
                let blk = dev.alloc(6 << 20, &a).unwrap();
                fences.push(dev.alloc(2 << 20, &e).unwrap());
                blk
            })
            .collect();
        for (i, f) in fences.iter().enumerate() {
            be.launch_write_pattern(0, e.handle(), f.ptr(), len, 9000 + i as u64, Duration::ZERO)
                .unwrap();
        }
        for (i, blk) in blocks.iter().enumerate() {
            // Check every granule of the block: any one may be stitched.
            for off in (0..6 << 20).step_by(2 << 20) {
                let p = blk.ptr().offset(off);
                be.launch_write_pattern(0, a.handle(), p, len, i as u64 * 10 + off, Duration::ZERO)
                    .unwrap();
            }
        }
        for (i, blk) in blocks.iter().enumerate() {
            for off in (0..6 << 20).step_by(2 << 20) {
                let p = blk.ptr().offset(off);
                let delay = if i == 0 && off == 0 {
                    Duration::from_millis(120)
                } else {
                    Duration::ZERO
                };
                checks.push(
                    be.launch_verify_pattern(0, a.handle(), p, len, i as u64 * 10 + off, delay)
                        .unwrap(),
                );
            }
            blk.record_stream(&b);
        }
    }
    let before = ops(&be, fault);
    match fault {
        Fault::Map => be.fail_nth_map(0, n).unwrap(),
        Fault::EventOp => be.fail_nth_event_op(0, n).unwrap(),
    }
    let big = dev.alloc(40 << 20, &c);
    let fired = ops(&be, fault) - before >= n;
    match fault {
        Fault::Map => be.fail_nth_map(0, 0).unwrap(),
        Fault::EventOp => be.fail_nth_event_op(0, 0).unwrap(),
    }
    let c_failed = match &big {
        Ok(_) => false,
        Err(e) => {
            assert!(
                matches!(
                    e,
                    gpupool::Error::InjectedFault(_) | gpupool::Error::OutOfMemory(_)
                ),
                "{fault:?} #{n}: untyped failure {e:?}"
            );
            true
        }
    };
    if let Ok(blk) = &big {
        be.launch_write_pattern(0, c.handle(), blk.ptr(), len, 777, Duration::ZERO)
            .unwrap();
    }
    // D takes what it can at once and writes over it immediately.
    let mut taken = Vec::new();
    for j in 0..8u64 {
        match dev.alloc(4 << 20, &d) {
            Ok(blk) => {
                for off in (0..4 << 20).step_by(2 << 20) {
                    let p = blk.ptr().offset(off);
                    be.launch_write_pattern(
                        0,
                        d.handle(),
                        p,
                        len,
                        5000 + j * 10 + off,
                        Duration::ZERO,
                    )
                    .unwrap();
                    checks.push(
                        be.launch_verify_pattern(
                            0,
                            d.handle(),
                            p,
                            len,
                            5000 + j * 10 + off,
                            Duration::from_millis(1),
                        )
                        .unwrap(),
                    );
                }
                taken.push(blk);
            }
            Err(e) => {
                assert!(e.is_oom(), "{fault:?} #{n}: D got {e:?}");
                break;
            }
        }
    }
    let d_blocks = taken.len();
    for (i, f) in fences.iter().enumerate() {
        checks.push(
            be.launch_verify_pattern(
                0,
                e.handle(),
                f.ptr(),
                len,
                9000 + i as u64,
                Duration::from_millis(1),
            )
            .unwrap(),
        );
    }
    for s in [&a, &b, &c, &d, &e] {
        be.sync_stream(0, s.handle()).unwrap();
    }
    for (k, v) in checks.iter().enumerate() {
        assert_eq!(
            v.mismatches(),
            Some(0),
            "{fault:?} #{n}: check {k} saw another stream's bytes (aliased chunk reused unordered)"
        );
    }
    assert_eq!(be.integrity_errors(0), 0, "{fault:?} #{n}");
    assert_eq!(
        be.device_faults(0),
        0,
        "{fault:?} #{n}: access to unmapped memory"
    );
    drop(taken);
    drop(big);
    drop(fences);
    dev.audit()
        .unwrap_or_else(|e| panic!("{fault:?} #{n}: audit: {e}"));
    rt.trim()
        .unwrap_or_else(|e| panic!("{fault:?} #{n}: trim: {e}"));
    let st = dev
        .audit()
        .unwrap_or_else(|e| panic!("{fault:?} #{n}: audit after trim: {e}"));
    assert_eq!(st.reserved_bytes.current, 0, "{fault:?} #{n}: {st:?}");
    drop((a, b, c, d, e));
    drop(rt);
    assert_eq!(
        be.used_bytes(0),
        0,
        "{fault:?} #{n}: memory held after the runtime"
    );
    Outcome {
        fired,
        c_failed,
        d_blocks,
    }
}

fn every_n(fault: Fault) {
    let mut n = 1;
    let mut failures = 0;
    let mut d_blocks = 0;
    loop {
        let o = scenario(fault, n);
        if !o.fired {
            break;
        }
        failures += o.c_failed as u64;
        d_blocks += o.d_blocks;
        eprintln!("error_paths: {fault:?} #{n}: {o:?}");
        n += 1;
        assert!(n < 400, "the path never ran out of operations");
    }
    eprintln!(
        "error_paths: {fault:?}: faults at {} positions, {failures} failed allocations, \
         {d_blocks} blocks taken after them, no corruption",
        n - 1
    );
    assert!(
        n > 2,
        "{fault:?}: the scenario made fewer than two operations of that kind"
    );
}

#[test]
fn a_map_fails_at_every_position_of_a_stitch() {
    every_n(Fault::Map);
}

#[test]
fn an_event_operation_fails_at_every_position() {
    every_n(Fault::EventOp);
}
