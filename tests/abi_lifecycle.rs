//! The C ABI's runtime shut down and started again while threads call in
//! (`src/ffi/readers.rs`: calls reach the runtime without a lock, and
//! shutdown and stream removals wait for them). Its own test binary: the
//! ABI's runtime is process-wide.

use gpupool::ffi::{
    gpupool_alloc, gpupool_free, gpupool_init, gpupool_shutdown, gpupool_stream_create,
    gpupool_stream_destroy, GpupoolStatus,
};
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::Duration;

const OK: i32 = GpupoolStatus::Ok as i32;
const SHUT: i32 = GpupoolStatus::Shutdown as i32;
const CONF: &std::ffi::CStr =
    c"backend=sim,devices=1,backing=accounting,capacity=256MiB,maint_ms=0";

/// What one thread saw.
#[derive(Default)]
struct Seen {
    ok_pairs: u64,
    refused: u64,
    unexpected: Vec<String>,
}

/// Allocates 4 KiB or 3 MiB and frees it; every 64 rounds creates and
/// destroys a stream.
/// Between a shutdown and the next init, calls are refused with
/// `GPUPOOL_STATUS_SHUTDOWN`; nothing else may fail.
fn traffic(stop: &AtomicBool, lives: &AtomicU64) -> Seen {
    let mut seen = Seen::default();
    let mut round = 0u64;
    // A pointer or stream of an earlier life is unknown to the next one:
    // legitimate only when a shutdown began since it was made.
    let stale = [
        GpupoolStatus::UnknownPointer as i32,
        GpupoolStatus::InvalidHandle as i32,
    ];
    let check = |what: &str, rc: i32, life: u64, seen: &mut Seen| -> bool {
        match rc {
            OK => true,
            SHUT => {
                seen.refused += 1;
                false
            }
            rc if stale.contains(&rc) && lives.load(Relaxed) != life => {
                seen.refused += 1;
                false
            }
            other => {
                seen.unexpected.push(format!(
                    "{what}: status {other} life {life} now {}",
                    lives.load(Relaxed)
                ));
                false
            }
        }
    };
    while !stop.load(Relaxed) {
        round += 1;
        let size = if round % 8 == 0 { 3 << 20 } else { 4096 };
        let mut p: *mut c_void = std::ptr::null_mut();
        let life = lives.load(Relaxed);
        // SAFETY (the alloc): `p` is valid for one pointer write. No write
        // through `p` itself: a shutdown between the alloc and the free
        // invalidates it (the caller's contract), and this thread cannot
        // know when one runs.
        if check(
            "alloc",
            unsafe { gpupool_alloc(size, 0, std::ptr::null_mut(), &mut p) },
            life,
            &mut seen,
        ) && check(
            "free",
            gpupool_free(p, 0, std::ptr::null_mut()),
            life,
            &mut seen,
        ) {
            seen.ok_pairs += 1;
        }
        if round % 64 == 0 {
            let mut s: *mut c_void = std::ptr::null_mut();
            // SAFETY: `s` is valid for one pointer write.
            let life = lives.load(Relaxed);
            if check(
                "stream_create",
                unsafe { gpupool_stream_create(0, &mut s) },
                life,
                &mut seen,
            ) {
                check(
                    "stream_destroy",
                    gpupool_stream_destroy(0, s),
                    life,
                    &mut seen,
                );
            }
        }
    }
    seen
}

#[test]
fn shutdown_and_init_while_threads_call_in() {
    // SAFETY: a NUL-terminated string that outlives the call.
    assert_eq!(unsafe { gpupool_init(CONF.as_ptr()) }, OK);
    let stop = AtomicBool::new(false);
    // Raised before each shutdown: a call that meets a later life saw it.
    let lives = AtomicU64::new(0);
    let cycles = AtomicU64::new(0);
    let seen: Vec<Seen> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..4)
            .map(|_| sc.spawn(|| traffic(&stop, &lives)))
            .collect();
        for i in 0..40u64 {
            std::thread::sleep(Duration::from_micros(500 + 250 * (i % 5)));
            lives.fetch_add(1, Relaxed);
            assert_eq!(gpupool_shutdown(), OK, "shutdown {i}");
            std::thread::sleep(Duration::from_micros(200));
            // SAFETY: as above.
            assert_eq!(unsafe { gpupool_init(CONF.as_ptr()) }, OK, "init {i}");
            cycles.fetch_add(1, Relaxed);
        }
        std::thread::sleep(Duration::from_millis(2));
        stop.store(true, Relaxed);
        hs.into_iter().map(|h| h.join().expect("thread")).collect()
    });
    assert_eq!(gpupool_shutdown(), OK);
    let unexpected: Vec<&String> = seen.iter().flat_map(|s| &s.unexpected).collect();
    assert!(unexpected.is_empty(), "unexpected statuses: {unexpected:?}");
    let pairs: u64 = seen.iter().map(|s| s.ok_pairs).sum();
    let refused: u64 = seen.iter().map(|s| s.refused).sum();
    assert_eq!(cycles.load(Relaxed), 40);
    // Both sides of the race happened: calls served, and calls refused
    // while the runtime was down.
    assert!(pairs > 1000, "only {pairs} pairs served");
    assert!(refused > 0, "no call was refused across 40 shutdowns");
}
