//! The runtime's idle release policy (`idle_release_ms`,
//! `release_fraction`): after a busy period, the maintenance thread gives
//! back the cached memory above `release_fraction` times the period's
//! peak, and keeps what a period of that size needs.

use gpupool::backend::Call;
use gpupool::{BackendKind, PoolConfig, Runtime, SimConfig};
use std::time::{Duration, Instant};

/// Waits (at most 10 s) until `done()`.
fn wait_until(mut done: impl FnMut() -> bool, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn idle_release_gives_back_the_surplus_and_keeps_what_the_last_period_needed() {
    let cfg = PoolConfig {
        idle_release: Some(Duration::from_millis(5)),
        release_fraction: 2.0,
        ..PoolConfig::default()
    };
    let rt = Runtime::builder()
        .backend(BackendKind::Sim(SimConfig {
            devices: 1,
            ..Default::default()
        }))
        .config(cfg)
        .maintenance_tick(Duration::from_millis(1))
        .build()
        .unwrap();
    let dev = rt.device(0).unwrap();
    let s = dev.new_stream().unwrap();
    let gran = dev.info().granularity;
    let reserved = || dev.stats().reserved_bytes.current;
    let idle_ticks = || rt.maintenance_stats()[0].idle_ticks;

    // A large period: 64 MiB, then idle. The cache is within twice its
    // peak, so it stays.
    drop(dev.alloc(64 << 20, &s).unwrap());
    let t0 = idle_ticks();
    wait_until(
        || idle_ticks() >= t0 + 20,
        "idle ticks after the large period",
    );
    assert_eq!(reserved(), 64 << 20);

    // A period a quarter that size: twice its peak (32 MiB) stays cached,
    // the rest goes back, whole granules from the top.
    drop(dev.alloc(16 << 20, &s).unwrap());
    wait_until(|| reserved() < 64 << 20, "the idle release");
    let t1 = idle_ticks();
    wait_until(|| idle_ticks() >= t1 + 20, "idle ticks after the release");
    assert_eq!(reserved(), 32 << 20);
    assert_eq!(rt.maintenance_stats()[0].released_bytes, 32 << 20);

    // The next period of that size needs no device memory.
    let creates = rt.backend().counters().get(Call::MemCreate);
    drop(dev.alloc(16 << 20, &s).unwrap());
    assert_eq!(rt.backend().counters().get(Call::MemCreate), creates);
    assert!(reserved() >= 16 << 20 && reserved() % gran == 0);
    dev.audit().unwrap();
}
