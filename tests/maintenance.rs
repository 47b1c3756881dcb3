//! The runtime's maintenance threads: they start, tick, harvest and stop
//! (no thread outlives its runtime). One test in this binary, so that no
//! other runtime's threads are counted.

use gpupool::{BackendKind, Runtime, SimConfig};
use std::time::{Duration, Instant};

/// Names of this process's threads that are maintenance threads.
fn maintenance_threads() -> Vec<String> {
    let mut names = Vec::new();
    for e in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        if let Ok(n) = std::fs::read_to_string(e.path().join("comm")) {
            let n = n.trim().to_string();
            if n.starts_with("gpupool-maint-") {
                names.push(n);
            }
        }
    }
    names.sort();
    names
}

/// The maintenance threads once `n` have named themselves (a new thread
/// sets its OS name as it starts).
fn wait_for_threads(n: usize) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let names = maintenance_threads();
        if names.len() >= n || Instant::now() > deadline {
            return names;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Whether every maintenance thread is gone. A joined thread has exited,
/// but the kernel may list its task under /proc for a moment longer, so
/// this polls (for at most 2 s) instead of reading once.
fn threads_gone() -> bool {
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        if maintenance_threads().is_empty() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn sim(devices: usize) -> BackendKind {
    BackendKind::Sim(SimConfig {
        devices,
        ..Default::default()
    })
}

#[test]
fn maintenance_threads_start_tick_harvest_and_stop() {
    assert!(maintenance_threads().is_empty());
    let rt = Runtime::builder()
        .backend(sim(3))
        .maintenance_tick(Duration::from_millis(1))
        .build()
        .unwrap();
    // Pools (and their threads) start on first use.
    assert!(maintenance_threads().is_empty());
    assert_eq!(rt.devices().len(), 3);
    assert_eq!(
        wait_for_threads(3),
        ["gpupool-maint-0", "gpupool-maint-1", "gpupool-maint-2"]
    );
    // A cross-stream free: the thread harvests it without anyone asking.
    let dev = rt.device(1).unwrap();
    let (a, b) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
    let blk = dev.alloc(1 << 20, &a).unwrap();
    blk.record_stream(&b);
    drop(blk);
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline
        && (rt.maintenance_stats().iter().any(|m| m.ticks < 5)
            || dev.stats().pending_bytes.current > 0)
    {
        std::thread::sleep(Duration::from_millis(1));
    }
    let stats = rt.maintenance_stats();
    assert_eq!(stats.len(), 3);
    assert!(stats.iter().all(|m| m.ticks >= 5), "{stats:?}");
    assert!(stats[1].harvested >= 1, "{stats:?}");
    assert_eq!(dev.stats().pending_bytes.current, 0);
    assert!(stats.iter().all(|m| m.binding.is_some()));
    // Sleeping, not spinning: at most about one tick per millisecond of
    // the time measured, far fewer than a busy loop would make. Judged
    // against the elapsed time, not the 50 ms asked for, so a loaded
    // machine that oversleeps cannot fail it; how few ticks a loaded
    // machine lets the thread make is not judged.
    let (t, t0) = (Instant::now(), rt.maintenance_stats()[0].ticks);
    std::thread::sleep(Duration::from_millis(50));
    let ticks = rt.maintenance_stats()[0].ticks - t0;
    let ms = t.elapsed().as_secs_f64() * 1e3;
    assert!(
        (ticks as f64) <= ms * 1.2 + 2.0,
        "{ticks} ticks in {ms:.1} ms at 1 ms"
    );
    drop((a, b));
    drop(rt);
    assert!(threads_gone(), "threads outlived the runtime");

    // Shutdown stops them too; the counts stay readable.
    let rt = Runtime::builder().backend(sim(2)).build().unwrap();
    rt.devices();
    assert_eq!(wait_for_threads(2).len(), 2);
    rt.shutdown();
    assert!(threads_gone());
    assert_eq!(rt.maintenance_stats().len(), 2);
    drop(rt);

    // The builder switch: no threads at all.
    let rt = Runtime::builder()
        .backend(sim(2))
        .maintenance(false)
        .build()
        .unwrap();
    assert!(maintenance_threads().is_empty());
    assert!(rt.maintenance_stats().is_empty());
    // And a zero tick is refused.
    assert!(Runtime::builder()
        .backend(sim(1))
        .maintenance_tick(Duration::ZERO)
        .build()
        .is_err());
}

#[test]
fn peer_matrix_and_warm_up() {
    let rt = Runtime::builder()
        .backend(sim(3))
        .maintenance(false)
        .build()
        .unwrap();
    // A pool's row is granted when the pool is built.
    assert!(!rt.peer_matrix().can_access(0, 1));
    rt.devices();
    let m = rt.peer_matrix();
    for d in 0..3 {
        for p in 0..3 {
            assert!(m.can_access(d, p), "{m}");
        }
    }
    assert!(!m.can_access(0, 7));
    let reserved = rt.warm_up(48 << 20).unwrap();
    assert_eq!(reserved.len(), 3);
    assert!(reserved.iter().all(|&r| r >= 48 << 20), "{reserved:?}");
    // Warmed memory serves another stream without growing.
    let dev = rt.device(2).unwrap();
    let grown = dev.stats().num_device_allocs;
    let s = dev.new_stream().unwrap();
    let b = dev.alloc(32 << 20, &s).unwrap();
    assert_eq!(dev.stats().num_device_allocs, grown);
    drop(b);
    assert!(rt.warm_up(0).is_err());
    let private = Runtime::builder()
        .backend(sim(2))
        .maintenance(false)
        .peer_access(false)
        .build()
        .unwrap();
    private.devices();
    assert!(!private.peer_matrix().can_access(0, 1));
    assert!(private.peer_matrix().can_access(1, 1));
}
