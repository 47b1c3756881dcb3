//! Objects that end in any order (issue 19): streams, blocks recorded on
//! other streams, threads with per-thread caches, wrapped foreign streams,
//! default streams and the runtime itself. Each case ends things in an
//! order a real program does and checks that nothing errs, nothing leaks,
//! no dead handle is touched (the simulator rejects unknown handles, so a
//! touch shows as an error) and no byte is corrupted (delayed pattern
//! kernels). Every body runs under a watchdog.

mod common;

use common::watchdog;
use gpupool::backend::sim::SimBackend;
use gpupool::backend::Backend;
use gpupool::{PoolConfig, Runtime, SimConfig, StreamHandle};
use std::sync::{mpsc, Arc};
use std::time::Duration;

const MIB: u64 = 1 << 20;
/// How long a test may run before it counts as a deadlock or hang.
const WATCHDOG: Duration = Duration::from_secs(60);

fn sim(capacity: u64) -> Arc<SimBackend> {
    Arc::new(
        SimBackend::new(SimConfig {
            devices: 1,
            capacity_bytes: capacity,
            ..Default::default()
        })
        .unwrap(),
    )
}

/// A runtime over `be` with the maintenance threads on (the default), so
/// that they race with the objects ending.
fn runtime(be: &Arc<SimBackend>) -> Runtime {
    Runtime::with_backend(be.clone(), PoolConfig::default()).unwrap()
}

/// Sizes of a mixed step: small (slabs), medium and large (heap).
fn size_of(i: usize) -> usize {
    match i % 5 {
        0 => 512,
        1 => 8 << 10,
        2 => 200 << 10,
        3 => 3 << 20,
        _ => 9 << 20,
    }
}

/// Threads that make streams, use them and exit, while the maintenance
/// thread flushes and harvests: trim must never meet a dead handle.
fn threads_make_streams_and_exit(record_every: usize, rounds: usize) {
    for round in 0..rounds {
        let be = sim(1 << 30);
        let rt = Arc::new(runtime(&be));
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let rt = rt.clone();
                std::thread::spawn(move || {
                    let dev = rt.device(0).unwrap();
                    let a = dev.new_stream().unwrap();
                    let b = dev.new_stream().unwrap();
                    let mut held = Vec::new();
                    for i in 0..60 {
                        let blk = dev.alloc(size_of(i + t), &a).unwrap();
                        if record_every > 0 && i % record_every == 0 {
                            blk.record_stream(&b);
                        }
                        held.push(blk);
                        if held.len() > 12 {
                            held.remove(0);
                        }
                    }
                    drop(held);
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        rt.trim()
            .unwrap_or_else(|e| panic!("round {round}: trim after threads exited: {e}"));
        let dev = rt.device(0).unwrap();
        dev.audit()
            .unwrap_or_else(|e| panic!("round {round}: audit: {e}"));
        assert_eq!(dev.stats().reserved_bytes.current, 0, "round {round}");
        assert_eq!(be.integrity_errors(0), 0);
        drop(rt);
        assert_eq!(be.used_bytes(0), 0, "round {round}: memory held after drop");
    }
}

#[test]
fn threads_with_recorded_streams_exit_then_trim() {
    watchdog("recorded", WATCHDOG, || threads_make_streams_and_exit(7, 5));
}

#[test]
fn threads_exit_then_trim_twenty_times() {
    watchdog("plain", WATCHDOG, || threads_make_streams_and_exit(0, 20));
}

#[test]
fn side_stream_dropped_before_the_block_it_touched() {
    watchdog("side", WATCHDOG, || {
        let be = sim(256 * MIB);
        let rt = runtime(&be);
        let dev = rt.device(0).unwrap();
        let main = dev.new_stream().unwrap();
        let other = dev.new_stream().unwrap();
        for size in [4096usize, 6 << 20] {
            let side = dev.new_stream().unwrap();
            let blk = dev.alloc(size, &main).unwrap();
            let len = size.min(64 << 10) as u64;
            // The side stream writes late: the memory must not be reused
            // before that write lands, though the side stream is gone.
            be.launch_write_pattern(
                0,
                side.handle(),
                blk.ptr(),
                len,
                11,
                Duration::from_millis(80),
            )
            .unwrap();
            blk.record_stream(&side);
            drop(side);
            let addr = blk.ptr();
            drop(blk);
            // Another stream takes memory of the same size at once and
            // checks its own pattern after the late write would have landed.
            let again = dev.alloc(size, &other).unwrap();
            be.launch_write_pattern(0, other.handle(), again.ptr(), len, 22, Duration::ZERO)
                .unwrap();
            let v = be
                .launch_verify_pattern(
                    0,
                    other.handle(),
                    again.ptr(),
                    len,
                    22,
                    Duration::from_millis(150),
                )
                .unwrap();
            be.sync_stream(0, other.handle()).unwrap();
            assert_eq!(
                v.mismatches(),
                Some(0),
                "size {size}: reused {:?} (freed {addr:?}) before the dead side stream's write landed",
                again.ptr()
            );
        }
        rt.trim().expect("trim after a recorded side stream ended");
        dev.audit().unwrap();
        assert_eq!(be.integrity_errors(0), 0);
    });
}

#[test]
fn runtime_dropped_while_a_worker_thread_lives_on() {
    watchdog("worker", WATCHDOG, || {
        let be = sim(512 * MIB);
        let rt = Arc::new(runtime(&be));
        let (done_tx, done_rx) = mpsc::channel::<()>();
        let (exit_tx, exit_rx) = mpsc::channel::<()>();
        let worker = {
            let rt = rt.clone();
            std::thread::spawn(move || {
                {
                    let dev = rt.device(0).unwrap();
                    let s = dev.new_stream().unwrap();
                    let small: Vec<_> = (0..2000).map(|_| dev.alloc(256, &s).unwrap()).collect();
                    let big = dev.alloc(32 << 20, &s).unwrap();
                    drop(small);
                    drop(big);
                    drop(s);
                }
                drop(rt);
                done_tx.send(()).unwrap();
                // A framework's worker thread: alive, idle, its caches intact.
                exit_rx.recv().unwrap();
            })
        };
        done_rx.recv().unwrap();
        assert!(be.used_bytes(0) > 0);
        drop(rt);
        assert_eq!(
            be.used_bytes(0),
            0,
            "the last runtime reference is gone but device memory is held"
        );
        // The worker now exits: its thread-local caches must make no
        // driver call (the pool is gone).
        let calls = be.counters().total_calls();
        exit_tx.send(()).unwrap();
        worker.join().unwrap();
        assert_eq!(
            be.counters().total_calls(),
            calls,
            "a thread-local destructor called the driver after shutdown"
        );
    });
}

#[test]
fn wrapped_foreign_stream_released_before_its_owner_destroys_it() {
    watchdog("foreign", WATCHDOG, || {
        let be = sim(256 * MIB);
        let rt = runtime(&be);
        let dev = rt.device(0).unwrap();
        for round in 0..3 {
            // A stream the framework owns, wrapped by the pool.
            let h = be.create_stream(0).unwrap();
            {
                let s = dev.stream_from_raw(h);
                let blocks: Vec<_> = (0..40)
                    .map(|i| dev.alloc(size_of(i), &s).unwrap())
                    .collect();
                let side = dev.stream_from_raw(h);
                blocks[3].record_stream(&dev.new_stream().unwrap());
                drop(blocks);
                drop(side);
            }
            // The owner destroys it once the pool lets it go.
            be.destroy_stream(0, h).unwrap();
            rt.trim().unwrap_or_else(|e| {
                panic!("round {round}: trim after the foreign stream died: {e}")
            });
            dev.audit().unwrap();
        }
        assert_eq!(dev.stats().reserved_bytes.current, 0);
    });
}

#[test]
fn per_thread_default_streams_are_one_stream_per_thread() {
    watchdog("per-thread", WATCHDOG, || {
        let be = sim(256 * MIB);
        let rt = runtime(&be);
        let dev = rt.device(0).unwrap();
        let (tx, rx) = mpsc::channel();
        let rx = std::sync::Mutex::new(rx);
        let len = 64 << 10;
        std::thread::scope(|sc| {
            // Thread A frees a block whose last use (a late write) runs on
            // its per-thread default stream.
            sc.spawn(|| {
                let s = dev.stream_from_raw(StreamHandle::PER_THREAD);
                for size in [4096usize, 5 << 20] {
                    let b = dev.alloc(size, &s).unwrap();
                    let n = (size as u64).min(len);
                    be.launch_write_pattern(
                        0,
                        s.handle(),
                        b.ptr(),
                        n,
                        5,
                        Duration::from_millis(80),
                    )
                    .unwrap();
                    drop(b);
                }
                tx.send(()).unwrap();
                std::thread::sleep(Duration::from_millis(300));
            });
            // Thread B, on its own per-thread default stream (same handle
            // value), must not get that memory without ordering.
            sc.spawn(|| {
                rx.lock().unwrap().recv().unwrap();
                let s = dev.stream_from_raw(StreamHandle::PER_THREAD);
                for size in [4096usize, 5 << 20] {
                    let b = dev.alloc(size, &s).unwrap();
                    let n = (size as u64).min(len);
                    be.launch_write_pattern(0, s.handle(), b.ptr(), n, 6, Duration::ZERO)
                        .unwrap();
                    let v = be
                        .launch_verify_pattern(
                            0,
                            s.handle(),
                            b.ptr(),
                            n,
                            6,
                            Duration::from_millis(150),
                        )
                        .unwrap();
                    be.sync_stream(0, s.handle()).unwrap();
                    assert_eq!(
                        v.mismatches(),
                        Some(0),
                        "size {size}: reused across threads unordered"
                    );
                }
            });
        });
        rt.trim().unwrap();
        dev.audit().unwrap();
        assert_eq!(be.integrity_errors(0), 0);
    });
}

#[test]
fn stream_retires_while_another_threads_cache_holds_its_slots() {
    watchdog("orphans", WATCHDOG, || {
        let be = sim(256 * MIB);
        let rt = Runtime::with_backend(
            be.clone(),
            PoolConfig {
                maintenance_tick: None,
                ..PoolConfig::default()
            },
        )
        .unwrap();
        let dev = rt.device(0).unwrap();
        let shared = dev.new_stream().unwrap();
        let (held_tx, held_rx) = mpsc::channel::<()>();
        let (exit_tx, exit_rx) = mpsc::channel::<()>();
        let size = 4096usize;
        std::thread::scope(|sc| {
            let s = shared.clone();
            let be2 = be.clone();
            sc.spawn(move || {
                // Frees on the shared stream land in this thread's cache,
                // after a late write by the stream.
                let blocks: Vec<_> = (0..8).map(|_| dev.alloc(size, &s).unwrap()).collect();
                for b in &blocks {
                    be2.launch_write_pattern(
                        0,
                        s.handle(),
                        b.ptr(),
                        size as u64,
                        9,
                        Duration::from_millis(60),
                    )
                    .unwrap();
                }
                drop(blocks);
                drop(s);
                held_tx.send(()).unwrap();
                exit_rx.recv().unwrap();
                // Thread exit hands the cached slots over (host memory only).
            });
            held_rx.recv().unwrap();
            // The stream's last user goes while that thread's cache holds
            // its slots.
            drop(shared);
            exit_tx.send(()).unwrap();
        });
        // Every other stream now competes for the slots: none may write
        // before the retired stream's late writes landed.
        let other = dev.new_stream().unwrap();
        let again: Vec<_> = (0..64).map(|_| dev.alloc(size, &other).unwrap()).collect();
        let mut checks = Vec::new();
        for b in &again {
            be.launch_write_pattern(0, other.handle(), b.ptr(), size as u64, 10, Duration::ZERO)
                .unwrap();
            checks.push(
                be.launch_verify_pattern(
                    0,
                    other.handle(),
                    b.ptr(),
                    size as u64,
                    10,
                    Duration::from_millis(1),
                )
                .unwrap(),
            );
        }
        be.sync_stream(0, other.handle()).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        for v in &checks {
            assert_eq!(
                v.mismatches(),
                Some(0),
                "an orphaned slot was reused unordered"
            );
        }
        drop(again);
        dev.audit().unwrap();
        rt.trim().unwrap();
        dev.audit().unwrap();
        assert_eq!(dev.stats().reserved_bytes.current, 0);
        assert_eq!(be.integrity_errors(0), 0);
    });
}

#[test]
fn devices_start_on_first_use_and_the_device_limit_holds() {
    let be = Arc::new(
        SimBackend::new(SimConfig {
            devices: 4,
            ..Default::default()
        })
        .unwrap(),
    );
    let reserves = |be: &SimBackend| be.counters().get(gpupool::backend::Call::AddressReserve);
    let rt = Runtime::with_backend(
        be.clone(),
        PoolConfig {
            device_limit: Some(3),
            ..PoolConfig::default()
        },
    )
    .unwrap();
    assert_eq!(rt.device_count(), 3, "devices=3 on a 4-device backend");
    assert!(
        rt.active_devices().is_empty(),
        "a pool was built before any use"
    );
    assert_eq!(reserves(&be), 0, "address space reserved at start-up");
    assert!(
        rt.maintenance_stats().is_empty(),
        "threads started at start-up"
    );
    let dev = rt.device(2).unwrap();
    let s = dev.new_stream().unwrap();
    drop(dev.alloc(1 << 20, &s).unwrap());
    assert_eq!(rt.active_devices().len(), 1);
    assert_eq!(reserves(&be), 1, "one reservation, for the device in use");
    assert_eq!(rt.maintenance_stats().len(), 1);
    assert!(matches!(
        rt.device(3),
        Err(gpupool::Error::InvalidDevice {
            device: 3,
            count: 3
        })
    ));
    drop(s);
    rt.trim().unwrap();
    assert_eq!(rt.devices().len(), 3);
    drop(rt);
    assert_eq!(be.used_bytes(2), 0);
}

#[test]
fn a_block_recorded_on_one_threads_default_stream_is_freed_on_another() {
    watchdog("per-thread-record", WATCHDOG, || {
        let be = sim(256 * MIB);
        let rt = runtime(&be);
        let dev = rt.device(0).unwrap();
        let main = dev.new_stream().unwrap();
        let other = dev.new_stream().unwrap();
        for size in [4096usize, 6 << 20] {
            let n = (size as u64).min(64 << 10);
            let blk = dev.alloc(size, &main).unwrap();
            // Thread A uses the block late on its per-thread default stream.
            std::thread::scope(|sc| {
                sc.spawn(|| {
                    let mine = dev.stream_from_raw(StreamHandle::PER_THREAD);
                    be.launch_write_pattern(
                        0,
                        mine.handle(),
                        blk.ptr(),
                        n,
                        3,
                        Duration::from_millis(80),
                    )
                    .unwrap();
                    blk.record_stream(&mine);
                });
            });
            // Freed here, on another thread: the pool cannot name A's
            // stream, and must still wait for it.
            drop(blk);
            let again = dev.alloc(size, &other).unwrap();
            be.launch_write_pattern(0, other.handle(), again.ptr(), n, 4, Duration::ZERO)
                .unwrap();
            let v = be
                .launch_verify_pattern(
                    0,
                    other.handle(),
                    again.ptr(),
                    n,
                    4,
                    Duration::from_millis(150),
                )
                .unwrap();
            be.sync_stream(0, other.handle()).unwrap();
            assert_eq!(
                v.mismatches(),
                Some(0),
                "size {size}: reused before thread A's late write"
            );
        }
        rt.trim().unwrap();
        dev.audit().unwrap();
        assert_eq!(be.integrity_errors(0), 0);
    });
}

#[test]
fn no_pool_starts_after_shutdown() {
    let be = Arc::new(
        SimBackend::new(SimConfig {
            devices: 2,
            ..Default::default()
        })
        .unwrap(),
    );
    let rt = Runtime::with_backend(be.clone(), PoolConfig::default()).unwrap();
    let dev0 = rt.device(0).unwrap();
    rt.shutdown();
    assert!(matches!(dev0.new_stream(), Err(gpupool::Error::Shutdown)));
    assert!(matches!(rt.device(1), Err(gpupool::Error::Shutdown)));
    assert_eq!(rt.active_devices().len(), 1);
    assert_eq!(be.counters().get(gpupool::backend::Call::AddressReserve), 1);
}
