//! Makes N small (4 KiB) alloc + free pairs through one door (the Rust API,
//! raw pointers, the C ABI, PyTorch's hook) on the simulator: the driver
//! behind the per-pair instruction counts in docs/BENCHMARKS.md §4.
//!
//! ```sh
//! bash scripts/abi-pairs.sh        # instructions per pair, every door
//! target/release/examples/door_pairs c_abi 1000000 2  # 2 threads, own streams:
//! # prints wall ns per pair (each thread makes N pairs)
//! ```
//!
//! `door_pairs.c` beside it makes the same C ABI and hook pairs through
//! `libgpupool.so`, as PyTorch loads them.

use gpupool::backend::sim::{SimBacking, SimConfig};
use gpupool::ffi::{
    gpupool_alloc, gpupool_free, gpupool_init, gpupool_shutdown, gpupool_stream_create,
    gpupool_stream_destroy, gpupool_torch_free, gpupool_torch_malloc,
};
use gpupool::{BackendKind, PoolConfig, Runtime};
use std::hint::black_box;

const SIZE: usize = 4096;

fn main() -> gpupool::Result<()> {
    let mut args = std::env::args().skip(1);
    let door = args.next().unwrap_or_default();
    let n: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(100_000);
    let threads: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(1);
    let t0 = std::time::Instant::now();
    match door.as_str() {
        "rust_api" | "rust_raw" => {
            let rt = Runtime::builder()
                .backend(BackendKind::Sim(SimConfig {
                    devices: 1,
                    capacity_bytes: 8 << 30,
                    backing: SimBacking::Accounting,
                    ..Default::default()
                }))
                .config(PoolConfig::default())
                .maintenance(false)
                .build()?;
            let dev = rt.device(0)?;
            // Decided once: the loop measures the door, not a name compare.
            let typed = door == "rust_api";
            std::thread::scope(|sc| {
                let run = || -> gpupool::Result<()> {
                    let s = dev.new_stream()?;
                    for _ in 0..n {
                        if typed {
                            black_box(dev.alloc(SIZE, &s)?.ptr());
                        } else {
                            let p = dev.alloc_raw(SIZE, &s)?;
                            dev.free_raw(black_box(p), &s)?;
                        }
                    }
                    Ok(())
                };
                let hs: Vec<_> = (0..threads).map(|_| sc.spawn(run)).collect();
                hs.into_iter().try_for_each(|h| h.join().expect("thread"))
            })?;
        }
        "c_abi" | "torch_hook" | "c_abi_3streams" => {
            let conf = c"backend=sim,devices=1,backing=accounting,capacity=8GiB,maint_ms=0";
            // SAFETY: a NUL-terminated string that outlives the call.
            assert_eq!(unsafe { gpupool_init(conf.as_ptr()) }, 0);
            let c_abi = door != "torch_hook";
            // A thread that takes turns on three streams (compute, copy and
            // communication, as a training step does).
            let ways = if door == "c_abi_3streams" { 3 } else { 1 };
            std::thread::scope(|sc| {
                for _ in 0..threads {
                    sc.spawn(|| {
                        // Each thread on a stream of its own (as a raw
                        // address, which is Send).
                        let streams: Vec<usize> = (0..ways)
                            .map(|_| {
                                let mut s = std::ptr::null_mut();
                                // SAFETY: `s` is valid for one pointer write.
                                assert_eq!(unsafe { gpupool_stream_create(0, &mut s) }, 0);
                                s as usize
                            })
                            .collect();
                        let mut k = 0;
                        for _ in 0..n {
                            let s = streams[k] as *mut std::ffi::c_void;
                            k = if k + 1 == ways { 0 } else { k + 1 };
                            if c_abi {
                                let mut p = std::ptr::null_mut();
                                // SAFETY: `p` is valid for one pointer write.
                                assert_eq!(unsafe { gpupool_alloc(SIZE, 0, s, &mut p) }, 0);
                                assert_eq!(gpupool_free(black_box(p), 0, s), 0);
                            } else {
                                let p = gpupool_torch_malloc(SIZE as libc::ssize_t, 0, s);
                                assert!(!p.is_null());
                                gpupool_torch_free(black_box(p), SIZE as libc::ssize_t, 0, s);
                            }
                        }
                        for s in streams {
                            assert_eq!(gpupool_stream_destroy(0, s as *mut std::ffi::c_void), 0);
                        }
                    });
                }
            });
            assert_eq!(gpupool_shutdown(), 0);
        }
        _ => {
            eprintln!(
                "usage: door_pairs rust_api|rust_raw|c_abi|c_abi_3streams|torch_hook [N] [THREADS]"
            );
            std::process::exit(2);
        }
    }
    let ns = t0.elapsed().as_nanos() as f64 / n as f64;
    println!("{door} threads={threads}: {ns:.1} ns per pair per thread (wall)");
    Ok(())
}
