//! The device work of the training harness: gradient contents and a `u32`
//! axpy (accumulation, optimizer update), on the simulator or on CUDA.
//!
//! Arithmetic is on `u32` words modulo 2^32, so results are exact and the
//! host can recompute every expected byte.

use gpupool::backend::sim::{KernelOp, SimBackend};
use gpupool::backend::Backend;
use gpupool::{DevicePtr, StreamHandle};
use gpupool::{Error, Result};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// Stream-ordered kernels the harness needs.
pub trait Kernels: Send + Sync + fmt::Debug {
    /// Writes the pattern of `seed` (the simulator's `fill_pattern`) over
    /// `bytes` (a multiple of 8) at `ptr`.
    fn pattern(
        &self,
        dev: usize,
        s: StreamHandle,
        ptr: DevicePtr,
        bytes: u64,
        seed: u64,
    ) -> Result<()>;

    /// `dst[i] += alpha * src[i]` over `bytes / 4` `u32` words.
    fn axpy(
        &self,
        dev: usize,
        s: StreamHandle,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: u64,
        alpha: u32,
    ) -> Result<()>;
}

/// The kernels for `backend`: simulated kernels, or NVRTC-compiled CUDA
/// kernels (`kernels/harness.cu`).
pub fn for_backend(backend: &Arc<dyn Backend>) -> Result<Box<dyn Kernels>> {
    if backend.as_any().downcast_ref::<SimBackend>().is_some() {
        return Ok(Box::new(SimKernels(backend.clone())));
    }
    #[cfg(feature = "cuda")]
    if backend.name() == "cuda" {
        return Ok(Box::new(cuda::CudaKernels::load(backend.device_count())?));
    }
    Err(Error::Unsupported(format!(
        "no harness kernels for the {} backend",
        backend.name()
    )))
}

/// Compiles `kernels/harness.cu` to PTX for `arch` (e.g. `sm_90`) with
/// NVRTC, as the CUDA harness does at run time; for the NVRTC test.
#[cfg(feature = "cuda")]
pub fn compile_harness_ptx(arch: &str) -> Result<String> {
    cuda::compile(arch)
}

fn check_words(bytes: u64, word: u64) -> Result<()> {
    if bytes == 0 || bytes % word != 0 {
        return Err(Error::InvalidArgument(format!(
            "{bytes} bytes: a positive multiple of {word}"
        )));
    }
    Ok(())
}

/// Simulated kernels: they run on the stream's worker, after the work
/// enqueued before them.
#[derive(Debug)]
struct SimKernels(Arc<dyn Backend>);

impl SimKernels {
    fn sim(&self) -> &SimBackend {
        self.0
            .as_any()
            .downcast_ref()
            .expect("built for the simulator")
    }
}

impl Kernels for SimKernels {
    fn pattern(
        &self,
        dev: usize,
        s: StreamHandle,
        ptr: DevicePtr,
        bytes: u64,
        seed: u64,
    ) -> Result<()> {
        check_words(bytes, 8)?;
        self.sim()
            .launch_write_pattern(dev, s, ptr, bytes, seed, Duration::ZERO)
    }

    fn axpy(
        &self,
        dev: usize,
        s: StreamHandle,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: u64,
        alpha: u32,
    ) -> Result<()> {
        check_words(bytes, 4)?;
        let op = KernelOp::Axpy {
            src: src.addr(),
            alpha,
        };
        self.sim()
            .launch_kernel(dev, s, dst, bytes, Duration::ZERO, op)
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    //! The CUDA side: `kernels/harness.cu` compiled with NVRTC for each
    //! device's architecture, loaded into the device's primary context
    //! (the one `CudaBackend` uses), launched on the pool's raw streams.

    use super::{check_words, Kernels};
    use cudarc::driver::{result, sys};
    use gpupool::{DevicePtr, StreamHandle};
    use gpupool::{Error, Result};
    use std::ffi::{c_void, CString};
    use std::panic::{catch_unwind, AssertUnwindSafe};

    const SOURCE: &str = include_str!("../../../kernels/harness.cu");
    const THREADS: u32 = 256;
    const MAX_BLOCKS: u64 = 1024;

    #[derive(Debug)]
    struct Device {
        ctx: sys::CUcontext,
        cu: sys::CUdevice,
        pattern: sys::CUfunction,
        axpy: sys::CUfunction,
    }

    /// The loaded kernels of every device.
    #[derive(Debug)]
    pub(super) struct CudaKernels {
        devices: Vec<Device>,
    }

    // SAFETY: contexts and functions are opaque driver handles, usable
    // from any thread once the context is made current there (done before
    // every launch); Rust never dereferences them.
    unsafe impl Send for CudaKernels {}
    // SAFETY: as above; launches through shared handles are thread safe.
    unsafe impl Sync for CudaKernels {}

    fn drv(call: &'static str) -> impl Fn(result::DriverError) -> Error {
        move |e| Error::backend(call, format!("{:?}", e.0))
    }

    pub(super) fn compile(arch: &str) -> Result<String> {
        let opts = cudarc::nvrtc::CompileOptions {
            options: vec![format!("--gpu-architecture={arch}")],
            name: Some("harness.cu".into()),
            ..Default::default()
        };
        match catch_unwind(|| cudarc::nvrtc::compile_ptx_with_opts(SOURCE, opts)) {
            Ok(Ok(ptx)) => Ok(ptx.to_src()),
            Ok(Err(e)) => Err(Error::backend("nvrtcCompileProgram", format!("{e:?}"))),
            Err(_) => Err(Error::Unsupported("NVRTC could not be loaded".into())),
        }
    }

    fn load_device(ordinal: usize) -> Result<Device> {
        let cu = result::device::get(ordinal as i32).map_err(drv("cuDeviceGet"))?;
        // SAFETY: `cu` came from cuDeviceGet; the retain is released in
        // Drop.
        let ctx =
            unsafe { result::primary_ctx::retain(cu) }.map_err(drv("cuDevicePrimaryCtxRetain"))?;
        let loaded = (|| {
            // SAFETY: `ctx` was just retained.
            unsafe { result::ctx::set_current(ctx) }.map_err(drv("cuCtxSetCurrent"))?;
            use sys::CUdevice_attribute as A;
            // SAFETY: `cu` is a valid device.
            let major = unsafe {
                result::device::get_attribute(cu, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
            }
            .map_err(drv("cuDeviceGetAttribute"))?;
            // SAFETY: as above.
            let minor = unsafe {
                result::device::get_attribute(cu, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
            }
            .map_err(drv("cuDeviceGetAttribute"))?;
            let ptx = compile(&format!("sm_{major}{minor}")).or_else(|_| compile("compute_75"))?;
            let ptx = CString::new(ptx).map_err(|_| Error::backend("nvrtc", "PTX with NUL"))?;
            // SAFETY: a NUL-terminated PTX image that outlives the call.
            let module = unsafe { result::module::load_data(ptx.as_ptr().cast::<c_void>()) }
                .map_err(drv("cuModuleLoadData"))?;
            let func = |name: &str| {
                // SAFETY: `module` was loaded above and is never unloaded
                // (it goes with the primary context).
                unsafe { result::module::get_function(module, CString::new(name).unwrap()) }
                    .map_err(drv("cuModuleGetFunction"))
            };
            Ok((func("gpupool_pattern")?, func("gpupool_axpy")?))
        })();
        match loaded {
            Ok((pattern, axpy)) => Ok(Device {
                ctx,
                cu,
                pattern,
                axpy,
            }),
            Err(e) => {
                // SAFETY: balances the retain above.
                let _ = unsafe { result::primary_ctx::release(cu) };
                Err(e)
            }
        }
    }

    impl CudaKernels {
        /// Compiles and loads the kernels on devices `0..n`.
        pub(super) fn load(n: usize) -> Result<CudaKernels> {
            let mut devices = Vec::with_capacity(n);
            for d in 0..n {
                match catch_unwind(AssertUnwindSafe(|| load_device(d))) {
                    Ok(Ok(dev)) => devices.push(dev),
                    Ok(Err(e)) => return Err(e),
                    Err(_) => return Err(Error::NoDriver("CUDA driver symbols missing".into())),
                }
            }
            Ok(CudaKernels { devices })
        }

        fn launch(
            &self,
            dev: usize,
            f: impl Fn(&Device) -> sys::CUfunction,
            s: StreamHandle,
            work: u64,
            params: &mut [*mut c_void],
        ) -> Result<()> {
            let d = self.devices.get(dev).ok_or(Error::InvalidDevice {
                device: dev,
                count: self.devices.len(),
            })?;
            let blocks = work.div_ceil(THREADS as u64).clamp(1, MAX_BLOCKS) as u32;
            // SAFETY: the context is retained for the life of `self`; the
            // function belongs to it; `params` point at live locals of the
            // caller matching the kernel's parameters, copied by the driver
            // before the call returns; the stream is a raw CUstream of this
            // device (the pool's).
            unsafe {
                result::ctx::set_current(d.ctx).map_err(drv("cuCtxSetCurrent"))?;
                result::launch_kernel(
                    f(d),
                    (blocks, 1, 1),
                    (THREADS, 1, 1),
                    0,
                    s.raw() as usize as sys::CUstream,
                    params,
                )
            }
            .map_err(drv("cuLaunchKernel"))
        }
    }

    impl Kernels for CudaKernels {
        fn pattern(
            &self,
            dev: usize,
            s: StreamHandle,
            ptr: DevicePtr,
            bytes: u64,
            seed: u64,
        ) -> Result<()> {
            check_words(bytes, 8)?;
            let (mut p, mut n, mut seed) = (ptr.addr(), bytes / 8, seed);
            let mut params = [
                (&mut p as *mut u64).cast::<c_void>(),
                (&mut n as *mut u64).cast::<c_void>(),
                (&mut seed as *mut u64).cast::<c_void>(),
            ];
            self.launch(dev, |d| d.pattern, s, bytes / 8, &mut params)
        }

        fn axpy(
            &self,
            dev: usize,
            s: StreamHandle,
            dst: DevicePtr,
            src: DevicePtr,
            bytes: u64,
            alpha: u32,
        ) -> Result<()> {
            check_words(bytes, 4)?;
            let (mut d, mut sp, mut n, mut a) = (dst.addr(), src.addr(), bytes / 4, alpha);
            let mut params = [
                (&mut d as *mut u64).cast::<c_void>(),
                (&mut sp as *mut u64).cast::<c_void>(),
                (&mut n as *mut u64).cast::<c_void>(),
                (&mut a as *mut u32).cast::<c_void>(),
            ];
            self.launch(dev, |d| d.axpy, s, bytes / 4, &mut params)
        }
    }

    impl Drop for CudaKernels {
        fn drop(&mut self) {
            for d in &self.devices {
                // SAFETY: balances the retain in `load_device`.
                let _ = unsafe { result::primary_ctx::release(d.cu) };
            }
        }
    }
}
