//! `gpupool bench --gpu`: the pool on a real device, side by side with the
//! driver's own allocators and copy engine, in the same run.
//!
//! * Alloc/free pairs of several sizes: gpupool (`DevicePool` over
//!   `CudaBackend`, a block freed on the stream it was allocated on) vs
//!   `cuMemAlloc`/`cuMemFree` vs `cuMemAllocAsync`/`cuMemFreeAsync`. Host
//!   time per pair, median of several batches.
//! * Compaction kernel bandwidth: one batch of disjoint moves between two
//!   pool blocks through [`Backend::enqueue_moves`](gpupool::Backend::enqueue_moves)
//!   (the NVRTC kernel) vs `cuMemcpyDtoDAsync` of the same bytes, each timed
//!   over several passes including the final stream synchronize. Issue #5's
//!   target: the kernel at 50% or more of the copy bandwidth.
//! * Backing a range by the size of its physical units: one chunk of n
//!   granules against n chunks of one (`mapping.rs`).
//!
//! Needs the `cuda` feature and a device; elsewhere [`run`] returns
//! [`Error::NoDriver`] (or the feature's absence as an error).

use gpupool::{Error, Result};
use std::fmt;

/// One row of the alloc/free pair table.
#[derive(Debug, Clone, serde::Serialize)]
pub struct GpuPairRow {
    /// Bytes per allocation.
    pub bytes: u64,
    /// gpupool pair, ns.
    pub gpupool_ns: f64,
    /// `cuMemAlloc` + `cuMemFree`, ns.
    pub cu_mem_alloc_ns: f64,
    /// `cuMemAllocAsync` + `cuMemFreeAsync`, ns.
    pub cu_mem_alloc_async_ns: f64,
    /// `cu_mem_alloc_ns / gpupool_ns`.
    pub speedup_vs_cu_mem_alloc: f64,
    /// `cu_mem_alloc_async_ns / gpupool_ns`.
    pub speedup_vs_cu_mem_alloc_async: f64,
}

/// Compaction kernel vs device-to-device copy.
#[derive(Debug, Clone, serde::Serialize)]
pub struct MoveBandwidth {
    /// Bytes moved per pass.
    pub bytes_per_pass: u64,
    /// Moves per batch (one kernel launch).
    pub moves_per_batch: usize,
    /// Whether the NVRTC kernel ran (else the backend fell back to copies).
    pub kernel_used: bool,
    /// Kernel bandwidth, GB/s (bytes moved / time).
    pub kernel_gb_per_s: f64,
    /// `cuMemcpyDtoDAsync` bandwidth, GB/s.
    pub memcpy_dtod_gb_per_s: f64,
    /// `kernel / memcpy` (target 0.5 or more).
    pub kernel_vs_memcpy: f64,
}

/// The report of `gpupool bench --gpu --json`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct GpuBenchReport {
    /// Device name.
    pub device: String,
    /// Alloc/free pairs.
    pub pairs: Vec<GpuPairRow>,
    /// Compaction kernel bandwidth.
    pub moves: MoveBandwidth,
    /// Driver time to back a range, by the size of its physical units.
    pub mapping: Vec<super::mapping::MappingRow>,
}

/// Runs the GPU benchmark on device 0 (`quick`: fewer iterations).
#[cfg(feature = "cuda")]
pub fn run(quick: bool) -> Result<GpuBenchReport> {
    imp::run(quick)
}

/// Without the `cuda` feature there is no device to measure.
#[cfg(not(feature = "cuda"))]
pub fn run(_quick: bool) -> Result<GpuBenchReport> {
    Err(Error::NoDriver("built without the cuda feature".into()))
}

/// `gpupool bench --gpu --calibrate <path>`: measures the driver cost table
/// on CUDA device 0 ([`gpupool::backend::cost::calibrate`] over the CUDA
/// backend; `quick`: fewer samples). Without a driver or a device, the
/// typed [`Error::NoDriver`] of opening the backend.
pub fn calibrate(quick: bool) -> Result<gpupool::backend::CostTable> {
    let be = gpupool::backend::open(&gpupool::config::BackendKind::Cuda, &Default::default())?;
    gpupool::backend::cost::calibrate(be.as_ref(), 0, if quick { 5 } else { 31 })
}

#[cfg(feature = "cuda")]
mod imp {
    use super::*;
    use gpupool::backend::cuda::CudaBackend;
    use gpupool::backend::Move;
    use gpupool::config::{BackendKind, PoolConfig};
    use gpupool::runtime::Runtime;
    use std::hint::black_box;
    use std::time::{Duration, Instant};

    const SIZES: [u64; 4] = [4 << 10, 256 << 10, 4 << 20, 64 << 20];

    fn per_iter_ns(d: Duration, iters: u32) -> f64 {
        d.as_nanos() as f64 / iters as f64
    }

    fn median(mut v: Vec<f64>) -> f64 {
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    }

    /// Median over `samples` of `f(iters)`, in ns per iteration.
    fn median_ns(
        samples: usize,
        iters: u32,
        mut f: impl FnMut(u32) -> Result<Duration>,
    ) -> Result<f64> {
        f(iters.min(16))?; // warm-up: first-touch costs out of the figure
        let mut v = Vec::with_capacity(samples);
        for _ in 0..samples {
            v.push(per_iter_ns(f(iters)?, iters));
        }
        Ok(median(v))
    }

    pub(super) fn run(quick: bool) -> Result<GpuBenchReport> {
        let rt = Runtime::builder()
            .backend(BackendKind::Cuda)
            .config(PoolConfig::default())
            .build()?;
        let cuda = rt
            .backend()
            .as_any()
            .downcast_ref::<CudaBackend>()
            .ok_or_else(|| Error::NoDriver("the runtime is not on the CUDA backend".into()))?;
        let dev = rt.device(0)?;
        let s = dev.new_stream()?;
        let (samples, iters) = if quick { (3, 50) } else { (7, 400) };
        let mut pairs = Vec::new();
        for bytes in SIZES {
            let gpupool_ns = median_ns(samples, iters * 10, |n| {
                let t = Instant::now();
                for _ in 0..n {
                    let b = dev.alloc(bytes as usize, &s)?;
                    black_box(b.ptr());
                }
                Ok(t.elapsed())
            })?;
            let cu_mem_alloc_ns =
                median_ns(samples, iters, |n| cuda.time_mem_alloc_pairs(0, bytes, n))?;
            let cu_mem_alloc_async_ns = median_ns(samples, iters, |n| {
                cuda.time_mem_alloc_async_pairs(0, s.handle(), bytes, n)
            })?;
            pairs.push(GpuPairRow {
                bytes,
                gpupool_ns,
                cu_mem_alloc_ns,
                cu_mem_alloc_async_ns,
                speedup_vs_cu_mem_alloc: cu_mem_alloc_ns / gpupool_ns,
                speedup_vs_cu_mem_alloc_async: cu_mem_alloc_async_ns / gpupool_ns,
            });
        }
        let moves = move_bandwidth(&rt, cuda, quick)?;
        let mapping = super::super::mapping::measure(cuda, 0, samples)?;
        Ok(GpuBenchReport {
            device: dev.info().name.clone(),
            pairs,
            moves,
            mapping,
        })
    }

    fn move_bandwidth(rt: &Runtime, cuda: &CudaBackend, quick: bool) -> Result<MoveBandwidth> {
        const MOVE: u64 = 4 << 20;
        let count: usize = if quick { 16 } else { 128 };
        let bytes = MOVE * count as u64;
        let dev = rt.device(0)?;
        let s = dev.new_stream()?;
        let src = dev.alloc(bytes as usize, &s)?;
        let dst = dev.alloc(bytes as usize, &s)?;
        let be = dev.backend();
        be.enqueue_fill(0, s.handle(), src.ptr(), bytes, 0x5a)?;
        let batch: Vec<Move> = (0..count as u64)
            .map(|i| Move {
                src: gpupool::DevicePtr(src.ptr().addr() + i * MOVE),
                dst: gpupool::DevicePtr(dst.ptr().addr() + i * MOVE),
                len: MOVE,
            })
            .collect();
        let kernel_used = cuda.move_kernel_ready(0)?;
        let passes = if quick { 5 } else { 50 };
        let kernel = median_ns(3, passes, |n| {
            let t = Instant::now();
            for _ in 0..n {
                be.enqueue_moves(0, s.handle(), &batch)?;
            }
            be.sync_stream(0, s.handle())?;
            Ok(t.elapsed())
        })?;
        let memcpy = median_ns(3, passes, |n| {
            cuda.time_dtod_copies(0, s.handle(), dst.ptr(), src.ptr(), bytes, n)
        })?;
        let gbps = |ns_per_pass: f64| bytes as f64 / ns_per_pass;
        Ok(MoveBandwidth {
            bytes_per_pass: bytes,
            moves_per_batch: count,
            kernel_used,
            kernel_gb_per_s: gbps(kernel),
            memcpy_dtod_gb_per_s: gbps(memcpy),
            kernel_vs_memcpy: memcpy / kernel,
        })
    }
}

impl fmt::Display for GpuBenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "device: {}", self.device)?;
        writeln!(
            f,
            "{:>10} {:>12} {:>14} {:>18} {:>10} {:>12}",
            "bytes", "gpupool ns", "cuMemAlloc ns", "cuMemAllocAsync ns", "x alloc", "x async"
        )?;
        for r in &self.pairs {
            writeln!(
                f,
                "{:>10} {:>12.0} {:>14.0} {:>18.0} {:>9.1}x {:>11.1}x",
                r.bytes,
                r.gpupool_ns,
                r.cu_mem_alloc_ns,
                r.cu_mem_alloc_async_ns,
                r.speedup_vs_cu_mem_alloc,
                r.speedup_vs_cu_mem_alloc_async
            )?;
        }
        let m = &self.moves;
        writeln!(
            f,
            "compaction kernel ({} moves, {} MiB per pass, kernel {}): {:.1} GB/s vs cuMemcpyDtoD {:.1} GB/s = {:.0}% (target 50%)",
            m.moves_per_batch,
            m.bytes_per_pass >> 20,
            if m.kernel_used { "NVRTC" } else { "fallback copies" },
            m.kernel_gb_per_s,
            m.memcpy_dtod_gb_per_s,
            m.kernel_vs_memcpy * 100.0
        )?;
        writeln!(
            f,
            "backing a range, host µs (create / map+access / unmap / release = total):"
        )?;
        let steps = |s: &super::mapping::Steps| {
            format!(
                "{:.1} / {:.1} / {:.1} / {:.1} = {:.1}",
                s.create,
                s.map,
                s.unmap,
                s.release,
                s.total()
            )
        };
        for r in &self.mapping {
            writeln!(
                f,
                "{:>4} granules ({:>3} MiB): one chunk {:<40} one chunk per granule {}",
                r.granules,
                r.bytes >> 20,
                steps(&r.one_chunk_us),
                steps(&r.per_granule_us)
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn without_a_device_the_gpu_bench_is_a_typed_no_driver_error() {
        if gpupool::backend::open(&gpupool::config::BackendKind::Cuda, &Default::default()).is_ok()
        {
            eprintln!("a CUDA device is present: the GPU bench runs in scripts/gpu-check.sh");
            return;
        }
        match super::run(true) {
            Err(gpupool::Error::NoDriver(_)) => {}
            other => panic!("expected NoDriver, got {other:?}"),
        }
        match super::calibrate(true) {
            Err(gpupool::Error::NoDriver(_)) => {}
            other => panic!("expected NoDriver, got {other:?}"),
        }
    }
}
