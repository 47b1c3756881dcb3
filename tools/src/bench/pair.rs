//! The `pair_ns` measurement: median nanoseconds of one alloc + free pair
//! on one thread, for gpupool (small, small through the raw FFI path, large
//! cached) and every baseline, at [`SMALL_BYTES`] and [`LARGE_BYTES`].

use super::baselines::{MutexBestFit, OffsetAllocatorPool};
use super::harness::{baseline_oom, median, sim_runtime, torch_peer_pool, Plan};
use super::report::PairNs;
use super::{CAPACITY_BYTES, LARGE_BYTES, SMALL_BYTES};
use gpupool::Result;
use std::hint::black_box;
use std::time::Instant;

/// Median ns per call of `pair` over `plan.samples` batches.
fn median_pair_ns(plan: &Plan, mut pair: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..plan.warmup {
        pair()?;
    }
    let mut per_pair = Vec::with_capacity(plan.samples);
    for _ in 0..plan.samples {
        let t = Instant::now();
        for _ in 0..plan.batch {
            pair()?;
        }
        per_pair.push(t.elapsed().as_nanos() as f64 / plan.batch as f64);
    }
    Ok(median(&mut per_pair))
}

/// Every pair figure of the report.
pub(super) fn pair_ns(plan: &Plan) -> Result<PairNs> {
    let rt = sim_runtime()?;
    let dev = rt.device(0)?;
    let s = dev.new_stream()?;
    let (small, large) = (SMALL_BYTES as usize, LARGE_BYTES as usize);
    let gpupool_small = median_pair_ns(plan, || {
        let b = dev.alloc(small, &s)?;
        black_box(b.ptr());
        Ok(())
    })?;
    let gpupool_small_raw = median_pair_ns(plan, || {
        let p = dev.alloc_raw(small, &s)?;
        dev.free_raw(black_box(p), &s)
    })?;
    let (gpupool_small_c_abi, gpupool_small_torch_hook) = c_abi_pairs(plan)?;
    // The warm-up frees the range on `s`: every timed pair reuses it.
    let gpupool_large = median_pair_ns(plan, || {
        let b = dev.alloc(large, &s)?;
        black_box(b.ptr());
        Ok(())
    })?;
    let best_fit = MutexBestFit::new(CAPACITY_BYTES);
    let mutex_pair = |size: u64| {
        let a = best_fit
            .alloc(size)
            .ok_or_else(|| baseline_oom("mutex_best_fit"))?;
        best_fit.free(black_box(a));
        Ok(())
    };
    let mutex_best_fit = median_pair_ns(plan, || mutex_pair(SMALL_BYTES))?;
    let mutex_best_fit_large = median_pair_ns(plan, || mutex_pair(LARGE_BYTES))?;
    let torch = torch_peer_pool();
    let torch_pair = |size: u64| {
        let a = torch.alloc(0, size, 0)?;
        torch.free(black_box(a))
    };
    let torch_small = median_pair_ns(plan, || torch_pair(SMALL_BYTES))?;
    let torch_large = median_pair_ns(plan, || torch_pair(LARGE_BYTES))?;
    let offset = OffsetAllocatorPool::new(CAPACITY_BYTES);
    let offset_allocator = median_pair_ns(plan, || {
        let a = offset
            .alloc(SMALL_BYTES)
            .ok_or_else(|| baseline_oom("offset_allocator"))?;
        offset.free(black_box(a));
        Ok(())
    })?;
    Ok(PairNs {
        gpupool_small,
        gpupool_large,
        mutex_best_fit,
        offset_allocator,
        gpupool_small_raw,
        gpupool_small_c_abi,
        gpupool_small_torch_hook,
        mutex_best_fit_large,
        torch_small,
        torch_large,
        small_bytes: SMALL_BYTES,
        large_bytes: LARGE_BYTES,
    })
}

/// Small pairs through the C ABI, as a C or PyTorch caller makes them: the
/// process-wide runtime of the C ABI (started here on the simulator, shut
/// down after), the default stream.
fn c_abi_pairs(plan: &Plan) -> Result<(f64, f64)> {
    use gpupool::ffi::{
        gpupool_alloc, gpupool_free, gpupool_init, gpupool_shutdown, gpupool_torch_free,
        gpupool_torch_malloc,
    };
    let fail = |what: &str| gpupool::Error::InvalidArgument(format!("C ABI bench: {what} failed"));
    let conf = c"backend=sim,devices=1,backing=accounting,capacity=8GiB,maint_ms=0";
    // SAFETY: a NUL-terminated string that outlives the call.
    if unsafe { gpupool_init(conf.as_ptr()) } != 0 {
        return Err(fail("gpupool_init"));
    }
    let null = std::ptr::null_mut();
    let c_abi = median_pair_ns(plan, || {
        let mut p = null;
        // SAFETY: `p` is valid for one pointer write.
        if unsafe { gpupool_alloc(SMALL_BYTES as usize, 0, null, &mut p) } != 0 {
            return Err(fail("gpupool_alloc"));
        }
        if gpupool_free(black_box(p), 0, null) != 0 {
            return Err(fail("gpupool_free"));
        }
        Ok(())
    });
    let hook = median_pair_ns(plan, || {
        let p = gpupool_torch_malloc(SMALL_BYTES as libc::ssize_t, 0, null);
        if p.is_null() {
            return Err(fail("gpupool_torch_malloc"));
        }
        gpupool_torch_free(black_box(p), SMALL_BYTES as libc::ssize_t, 0, null);
        Ok(())
    });
    gpupool_shutdown();
    Ok((c_abi?, hook?))
}
