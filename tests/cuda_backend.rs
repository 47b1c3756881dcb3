//! The CUDA backend's first-contact properties, on a real GPU (run by
//! `scripts/gpu-check.sh` with `GPUPOOL_REQUIRE_CUDA=1`, where a missing
//! driver fails; elsewhere each case says it was skipped and why).
//!
//! - `callers_context_survives_backend_calls`: a caller's own current
//!   context (none; a context of its own on device 0; device 0's primary
//!   context while the backend and a pool work on device 1, where there
//!   are two devices) is current again after allocations, frees, streams,
//!   events, copies and mappings, and `cuCtxGetDevice` still names the
//!   caller's device.
//! - `host_copies_land_before_pool_stream_work`: bytes copied from pageable
//!   host memory are read by a move enqueued at once on a non-blocking
//!   stream, over and over, and each copy counts one host sync.
//! - `kernel_loads_as_a_cubin`: the compaction kernel loads from the cubin
//!   NVRTC made for the device; the PTX fallback is tried on its own and
//!   reported.
//! - `nccl_loads_and_reduces`: NCCL is found (`libnccl.so.2`) and a
//!   single-process all-reduce over every device sums.
//!
//! With `GPUPOOL_REPORT_DIR` set, each case writes `<case>.json` there for
//! the GPU check's summary.
#![cfg(feature = "cuda")]

use cudarc::driver::sys;
use gpupool::backend::cuda::{kernel, CudaBackend};
use gpupool::{Backend, DevicePtr, Move};
use std::ptr;
use std::sync::Arc;

fn cuda() -> Option<CudaBackend> {
    match CudaBackend::new() {
        Ok(b) => Some(b),
        Err(e) => {
            assert!(
                std::env::var("GPUPOOL_REQUIRE_CUDA").as_deref() != Ok("1"),
                "GPUPOOL_REQUIRE_CUDA=1 but CUDA could not be opened: {e}"
            );
            eprintln!("cuda_backend: SKIPPED (no CUDA): {e}");
            None
        }
    }
}

fn report(case: &str, value: serde_json::Value) {
    eprintln!("cuda_backend: {case}: {value}");
    if let Some(dir) = std::env::var_os("GPUPOOL_REPORT_DIR") {
        let path = std::path::Path::new(&dir).join(format!("{case}.json"));
        std::fs::write(&path, serde_json::to_string_pretty(&value).unwrap()).unwrap();
    }
}

fn ok(call: &str, r: sys::CUresult) {
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "{call}");
}

fn current() -> sys::CUcontext {
    let mut c = ptr::null_mut();
    // SAFETY: a valid out-pointer; the backend opened the driver.
    ok("cuCtxGetCurrent", unsafe { sys::cuCtxGetCurrent(&mut c) });
    c
}

fn set_current(c: sys::CUcontext) {
    // SAFETY: null or a live context of this test.
    ok("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(c) });
}

fn current_device() -> i32 {
    let mut d = -1;
    // SAFETY: a valid out-pointer; a context is current.
    ok("cuCtxGetDevice", unsafe { sys::cuCtxGetDevice(&mut d) });
    d
}

/// A context of the test's own on device 0 (not the primary one).
fn own_context() -> sys::CUcontext {
    let mut c = ptr::null_mut();
    // CUDA 13's cuCtxCreate (_v4), with empty parameters: no affinity, no
    // CIG, i.e. an ordinary context.
    let mut params = sys::CUctxCreateParams {
        execAffinityParams: ptr::null_mut(),
        numExecAffinityParams: 0,
        cigParams: ptr::null_mut(),
    };
    // SAFETY: a valid out-pointer and parameter struct; flags 0; device 0.
    ok("cuCtxCreate_v4", unsafe {
        sys::cuCtxCreate_v4(&mut c, &mut params, 0, 0)
    });
    // Creating a context pushes it: pop so the thread starts clean.
    let mut popped = ptr::null_mut();
    // SAFETY: the context just pushed is popped.
    ok("cuCtxPopCurrent", unsafe {
        sys::cuCtxPopCurrent_v2(&mut popped)
    });
    c
}

/// Allocations, frees, streams, events, copies, mappings and moves on
/// `dev`: every kind of backend entry.
fn exercise(b: &CudaBackend, dev: usize) {
    let info = b.device_info(dev).unwrap();
    let g = info.granularity;
    let s = b.create_stream(dev).unwrap();
    let e = b.create_event(dev).unwrap();
    let p = b.alloc_segment(dev, 1 << 20).unwrap();
    b.copy_from_host(dev, p, &[7u8; 4096]).unwrap();
    b.enqueue_fill(dev, s, p.offset(8192), 4096, 3).unwrap();
    b.enqueue_moves(
        dev,
        s,
        &[Move {
            src: p,
            dst: p.offset(65536),
            len: 4096,
        }],
    )
    .unwrap();
    b.record_event(dev, e, s).unwrap();
    b.stream_wait_event(dev, s, e).unwrap();
    b.sync_event(dev, e).unwrap();
    let _ = b.query_event(dev, e).unwrap();
    b.sync_stream(dev, s).unwrap();
    let mut back = [0u8; 16];
    b.copy_to_host(dev, p.offset(65536), &mut back).unwrap();
    assert_eq!(back, [7u8; 16]);
    if info.vmm_supported {
        let va = b.reserve_va(dev, 2 * g).unwrap();
        let c = b.create_chunk(dev, g).unwrap();
        let c2 = b.create_chunk(dev, g).unwrap();
        b.map_run(dev, va, g, &[c, c2]).unwrap();
        b.set_access(dev, va, 2 * g, &[]).unwrap();
        b.unmap_run(dev, va, g, 2).unwrap();
        b.release_chunk(dev, c).unwrap();
        b.release_chunk(dev, c2).unwrap();
        b.free_va(dev, va, 2 * g).unwrap();
    }
    // An error path restores too.
    assert!(b.free_segment(dev, DevicePtr(0x10)).is_err());
    b.free_segment(dev, p).unwrap();
    b.destroy_event(dev, e).unwrap();
    b.destroy_stream(dev, s).unwrap();
}

#[test]
fn callers_context_survives_backend_calls() {
    let Some(b) = cuda() else { return };
    let mut cases = Vec::new();

    // No context current: none afterwards either.
    set_current(ptr::null_mut());
    exercise(&b, 0);
    assert!(current().is_null(), "the backend left a context current");
    cases.push("none current -> device 0");

    // The caller's own (non-primary) context on device 0.
    let mine = own_context();
    set_current(mine);
    exercise(&b, 0);
    assert_eq!(current(), mine, "the caller's own context was replaced");
    assert_eq!(current_device(), 0);
    cases.push("own context on device 0 -> device 0");
    set_current(ptr::null_mut());
    // SAFETY: the test's own context, no longer current, destroyed once.
    ok("cuCtxDestroy", unsafe { sys::cuCtxDestroy_v2(mine) });

    // Device 0's primary context current (what the CUDA runtime and
    // PyTorch use), while the backend and a pool work on device 1.
    let devices = b.device_count();
    if devices >= 2 {
        let mut primary0 = ptr::null_mut();
        // SAFETY: a valid out-pointer; device 0 exists; released below.
        ok("cuDevicePrimaryCtxRetain", unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut primary0, 0)
        });
        set_current(primary0);
        exercise(&b, 1);
        assert_eq!(current(), primary0, "device 1 work switched the caller");
        assert_eq!(current_device(), 0);
        let b: Arc<dyn Backend> = Arc::new(b);
        {
            let rt = gpupool::Runtime::with_backend(b.clone(), Default::default()).unwrap();
            let pool = rt.device(1).unwrap();
            let s = pool.new_stream().unwrap();
            let blocks: Vec<_> = [4096usize, 1 << 20, 64 << 20]
                .iter()
                .map(|&n| pool.alloc(n, &s).unwrap())
                .collect();
            assert_eq!(current(), primary0);
            drop(blocks);
            rt.trim().unwrap();
            assert_eq!(current(), primary0);
        }
        assert_eq!(current(), primary0);
        assert_eq!(current_device(), 0);
        cases.push("device 0 primary -> device 1 (backend and pool)");
        set_current(ptr::null_mut());
        // SAFETY: balances the retain above.
        ok("cuDevicePrimaryCtxRelease", unsafe {
            sys::cuDevicePrimaryCtxRelease_v2(0)
        });
    } else {
        eprintln!("cuda_backend: one device: the cross-device context case needs two");
    }
    report(
        "context",
        serde_json::json!({"devices": devices, "cases_passed": cases}),
    );
}

#[test]
fn host_copies_land_before_pool_stream_work() {
    let Some(b) = cuda() else { return };
    const LEN: usize = 64 << 20;
    let s = b.create_stream(0).unwrap();
    let src = b.alloc_segment(0, LEN as u64).unwrap();
    let dst = b.alloc_segment(0, LEN as u64).unwrap();
    let rounds = 12u8;
    for round in 0..rounds {
        let data: Vec<u8> = (0..LEN)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(round))
            .collect();
        let syncs = b.counters().host_syncs;
        b.copy_from_host(0, src, &data).unwrap();
        assert_eq!(b.counters().host_syncs, syncs + 1, "one counted host sync");
        // At once, on a non-blocking stream: reads what was just copied.
        b.enqueue_moves(
            0,
            s,
            &[Move {
                src,
                dst,
                len: LEN as u64,
            }],
        )
        .unwrap();
        b.sync_stream(0, s).unwrap();
        let mut got = vec![0u8; LEN];
        b.copy_to_host(0, dst, &mut got).unwrap();
        assert!(got == data, "round {round}: the move read stale bytes");
    }
    b.free_segment(0, src).unwrap();
    b.free_segment(0, dst).unwrap();
    b.destroy_stream(0, s).unwrap();
    report(
        "host_copy",
        serde_json::json!({"rounds": rounds, "bytes_per_round": LEN}),
    );
}

#[test]
fn kernel_loads_as_a_cubin() {
    let Some(b) = cuda() else { return };
    let strict = std::env::var("GPUPOOL_REQUIRE_NVRTC").as_deref() == Ok("1");
    let info = b.move_kernel_info(0).unwrap();
    let ptx = b.try_load_move_kernel(0, kernel::ImageKind::Ptx);
    let cubin = b.try_load_move_kernel(0, kernel::ImageKind::Cubin);
    report(
        "kernel",
        serde_json::json!({
            "driver_library": CudaBackend::driver_library_path(),
            "nvrtc_library": kernel::nvrtc_library_path().ok(),
            "nvrtc_version": kernel::nvrtc_version(),
            "loaded": info.as_ref().ok(),
            "load_error": info.as_ref().err().map(|e| e.to_string()),
            "cubin_loads": cubin.as_ref().map(|_| true).map_err(|e| e.to_string()),
            "ptx_loads": ptx.as_ref().map(|_| true).map_err(|e| e.to_string()),
        }),
    );
    match info {
        Ok(i) => {
            assert_eq!(i.image, kernel::ImageKind::Cubin, "{i:?}");
            assert!(i.arch.starts_with("sm_"));
            cubin.unwrap();
        }
        Err(e) => assert!(!strict, "GPUPOOL_REQUIRE_NVRTC=1 but no kernel: {e}"),
    }
}

#[cfg(feature = "nccl")]
#[test]
fn nccl_loads_and_reduces() {
    use gpupool::collective::{nccl_library_path, AllReduce, NcclAllReduce, ReduceBuf};
    let Some(b) = cuda() else { return };
    let strict = std::env::var("GPUPOOL_REQUIRE_NCCL").as_deref() == Ok("1");
    let (path, version) = match nccl_library_path() {
        Ok(x) => x,
        Err(e) => {
            assert!(!strict, "GPUPOOL_REQUIRE_NCCL=1 but {e}");
            eprintln!("cuda_backend: NCCL case SKIPPED: {e}");
            return;
        }
    };
    let n = b.device_count();
    let devices: Vec<usize> = (0..n).collect();
    let nccl = NcclAllReduce::new(&devices).unwrap();
    const WORDS: usize = 1 << 20;
    let mut bufs = Vec::new();
    for d in 0..n {
        let s = b.create_stream(d).unwrap();
        let p = b.alloc_segment(d, (WORDS * 4) as u64).unwrap();
        let words: Vec<u8> = (0..WORDS as u32)
            .flat_map(|i| (i.wrapping_mul(d as u32 + 1)).to_le_bytes())
            .collect();
        b.copy_from_host(d, p, &words).unwrap();
        bufs.push(ReduceBuf {
            device: d,
            stream: s,
            ptr: p,
            bytes: (WORDS * 4) as u64,
        });
    }
    let registered = nccl.register(0, bufs[0].ptr, bufs[0].bytes).unwrap();
    nccl.all_reduce(&bufs).unwrap();
    let factor: u32 = (1..=n as u32).sum();
    for buf in &bufs {
        b.sync_stream(buf.device, buf.stream).unwrap();
        let mut got = vec![0u8; WORDS * 4];
        b.copy_to_host(buf.device, buf.ptr, &mut got).unwrap();
        for (i, w) in got.chunks_exact(4).enumerate().step_by(997) {
            let v = u32::from_le_bytes(w.try_into().unwrap());
            assert_eq!(v, (i as u32).wrapping_mul(factor), "device {}", buf.device);
        }
    }
    nccl.deregister_all();
    drop(nccl);
    for buf in bufs {
        b.free_segment(buf.device, buf.ptr).unwrap();
        b.destroy_stream(buf.device, buf.stream).unwrap();
    }
    report(
        "nccl",
        serde_json::json!({"library": path, "version": version, "ranks": n, "registered": registered}),
    );
}
