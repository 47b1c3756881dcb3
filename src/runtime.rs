//! The runtime: one independent [`DevicePool`] per device of a backend.
//!
//! Besides the pools, a runtime owns one maintenance thread per device,
//! enables peer access between pools where the backend allows it
//! ([`PeerMatrix`]), and runs per-device work in parallel, one scoped
//! thread per device: [`Runtime::warm_up`] and [`Runtime::trim`].
//!
//! **Devices start lazily.** Building a runtime opens the backend and
//! reads each device's facts, nothing more: a device's pool (its address
//! reservation, events, maintenance thread and peer grants) is built on its
//! first use through [`Runtime::device`]. A rank of a multi-process job
//! that only ever uses its own GPU pays for no other (on CUDA, no context
//! on the others). `devices=N` in the config limits the runtime to the
//! first N devices of any backend. No thread pool is started at build time.
//!
//! **Maintenance threads** (`gpupool-maint-<dev>`, on unless
//! [`RuntimeBuilder::maintenance`] turns them off or `maint_ms=0`): every
//! tick (5 ms by default) each calls [`DevicePool::maintain`] (harvest
//! completed frees without blocking, idle clock, idle work), applies the
//! idle release policy, then sleeps (`park_timeout`; shutdown unparks and
//! joins it). With the `hwloc` feature a thread binds itself to the CPUs
//! nearest its device; without it, it stays unbound and says why
//! ([`ThreadBinding`]). [`Runtime::maintenance_stats`] tells what they did.
//!
//! **Idle release policy** (`idle_release_ms`, `release_fraction`; off by
//! default). Once a pool has been idle for `idle_release_ms`, its thread
//! takes the peak of active bytes of the busy period that just ended
//! ([`DevicePool::take_window_peak`]) and, while cached bytes exceed
//! `release_fraction` (default 2) times that peak, gives the cached memory
//! above it back without blocking ([`DevicePool::release_cache_above`]):
//! what the next period of the same size needs stays mapped. A pool that needed
//! about what it holds keeps it (no grow/release churn in a steady loop);
//! a pool that grew for a large batch and then runs smaller ones gives the
//! surplus back at its next idle gap, with no call from the user.

mod maint;
mod peer;

pub use maint::{MaintenanceStats, ThreadBinding};
pub use peer::PeerMatrix;

use crate::backend::{self, Backend};
use crate::config::{BackendKind, PoolConfig};
use crate::error::{Error, Result};
use crate::pool::DevicePool;
use crate::topology::Topology;
use parking_lot::Mutex;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// Builds a [`Runtime`].
#[derive(Debug, Default)]
pub struct RuntimeBuilder {
    backend: Option<BackendKind>,
    config: Option<PoolConfig>,
    maintenance: Option<bool>,
    tick: Option<Duration>,
    peer_access: Option<bool>,
}

impl RuntimeBuilder {
    /// Which backend to use; overrides the config's `backend` key.
    pub fn backend(mut self, kind: BackendKind) -> Self {
        self.backend = Some(kind);
        self
    }

    /// The pool configuration (for example [`PoolConfig::from_env`]).
    pub fn config(mut self, config: PoolConfig) -> Self {
        self.config = Some(config);
        self
    }

    /// Turns the per-device maintenance threads on (the default, unless
    /// the config's `maint_ms` is 0) or off.
    pub fn maintenance(mut self, on: bool) -> Self {
        self.maintenance = Some(on);
        self
    }

    /// The maintenance threads' tick; overrides the config's `maint_ms`.
    pub fn maintenance_tick(mut self, tick: Duration) -> Self {
        self.tick = Some(tick);
        self
    }

    /// Enables peer access between pools where the backend allows it (the
    /// default) or leaves every pool private.
    pub fn peer_access(mut self, on: bool) -> Self {
        self.peer_access = Some(on);
        self
    }

    /// Opens the backend, builds one pool per device in parallel, enables
    /// peer access and starts the maintenance threads.
    pub fn build(self) -> Result<Runtime> {
        let mut config = self.config.unwrap_or_default();
        if let Some(t) = self.tick {
            if t.is_zero() {
                return Err(Error::InvalidArgument(
                    "the maintenance tick must be longer than zero".into(),
                ));
            }
            config.maintenance_tick = Some(t);
        }
        if self.maintenance == Some(false) {
            config.maintenance_tick = None;
        } else if self.maintenance == Some(true) && config.maintenance_tick.is_none() {
            config.maintenance_tick = PoolConfig::default().maintenance_tick;
        }
        let kind = self.backend.unwrap_or_else(|| config.backend.clone());
        let backend = backend::open(&kind, &config.sim)?;
        Runtime::start(backend, config, self.peer_access.unwrap_or(true))
    }
}

/// The pools of a runtime by device, each built on first use. Shared with
/// the maintenance threads, which stop before the runtime drops it.
pub(crate) type Pools = Arc<Vec<OnceLock<DevicePool>>>;

/// One pool per device over one backend. Pools share nothing but the
/// backend object, so no lock is ever shared between devices once they
/// are built.
#[derive(Debug)]
pub struct Runtime {
    backend: Arc<dyn Backend>,
    config: PoolConfig,
    pools: Pools,
    /// Serializes building pools (a slow path, once per device); `true`
    /// once [`Runtime::shutdown`] ran, so that no pool is built after it.
    building: Mutex<bool>,
    topology: Topology,
    peer_access: bool,
    peers: Mutex<PeerMatrix>,
    maintenance: Mutex<maint::Maintenance>,
    /// Set by the first [`Runtime::mark_step`]: a pool built later (on its
    /// first use, inside a step) starts recording at once.
    steps_marked: std::sync::atomic::AtomicBool,
}

impl Runtime {
    /// A builder with the defaults (backend `Auto`, default config).
    pub fn builder() -> RuntimeBuilder {
        RuntimeBuilder::default()
    }

    /// A runtime over an already opened backend, with peer access and
    /// the maintenance threads the config asks for.
    pub fn with_backend(backend: Arc<dyn Backend>, config: PoolConfig) -> Result<Runtime> {
        Runtime::start(backend, config, true)
    }

    fn start(backend: Arc<dyn Backend>, config: PoolConfig, peers: bool) -> Result<Runtime> {
        let n = backend
            .device_count()
            .min(config.device_limit.unwrap_or(usize::MAX));
        if n == 0 {
            return Err(Error::NoDevice(format!(
                "the {} backend has no device to use",
                backend.name()
            )));
        }
        let infos = (0..n)
            .map(|d| backend.device_info(d))
            .collect::<Result<Vec<_>>>()?;
        let topology = crate::topology::discover(&infos);
        let mut matrix = PeerMatrix {
            access: (0..n).map(|d| (0..n).map(|p| p == d).collect()).collect(),
            notes: Vec::new(),
        };
        if !peers {
            matrix.notes.push("peer access turned off".into());
        }
        Ok(Runtime {
            backend,
            config,
            pools: Arc::new((0..n).map(|_| OnceLock::new()).collect()),
            building: Mutex::new(false),
            topology,
            peer_access: peers,
            peers: Mutex::new(matrix),
            maintenance: Mutex::new(maint::Maintenance::default()),
            steps_marked: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Builds the pool of device `dev` (under `building`): the pool, its
    /// peer grants and its maintenance thread.
    fn build_pool(&self, dev: usize) -> Result<&DevicePool> {
        let shut = self.building.lock();
        if let Some(p) = self.pools[dev].get() {
            return Ok(p);
        }
        if *shut {
            return Err(Error::Shutdown);
        }
        let pool = DevicePool::new(self.backend.clone(), dev, self.config.clone())?;
        if self.peer_access {
            let row = PeerMatrix::enable_row(&*self.backend, &pool, self.pools.len());
            self.peers.lock().set_row(dev, row);
        }
        if self.steps_marked.load(std::sync::atomic::Ordering::Relaxed) {
            pool.mark_step()?;
        }
        if self.pools[dev].set(pool).is_err() {
            unreachable!("pools are set under the building lock");
        }
        if let Some(tick) = self.config.maintenance_tick {
            self.maintenance
                .lock()
                .start_one(&self.pools, dev, tick, &self.topology)?;
        }
        tracing::debug!(device = dev, "pool built");
        Ok(self.pools[dev].get().expect("set above"))
    }

    /// The topology found at start (NUMA node and CPUs nearest each device).
    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    /// Which pools' memory which devices may access (rows of pools not
    /// built yet grant nothing).
    pub fn peer_matrix(&self) -> PeerMatrix {
        self.peers.lock().clone()
    }

    /// What each device's maintenance thread did so far (empty when the
    /// threads are off; the counts stay readable after
    /// [`Runtime::shutdown`] stopped them).
    pub fn maintenance_stats(&self) -> Vec<MaintenanceStats> {
        self.maintenance.lock().stats()
    }

    /// Pre-reserves `bytes` on every device in parallel (building every
    /// pool), so that the first
    /// steps of a job do not grow the pools one chunk at a time: allocates
    /// and frees one block of `bytes` per device, then [settles](DevicePool::settle)
    /// the pool so that any stream may reuse the memory. Blocks the host
    /// (once, at warm-up). Returns each device's reserved bytes after.
    pub fn warm_up(&self, bytes: u64) -> Result<Vec<u64>> {
        if bytes == 0 {
            return Err(Error::InvalidSize {
                size: 0,
                why: "zero-byte warm-up",
            });
        }
        let size = usize::try_from(bytes).map_err(|_| Error::InvalidSize {
            size: bytes,
            why: "larger than the address space",
        })?;
        let pools = self.devices_result()?;
        per_device(&pools, |p| {
            let s = p.new_stream()?;
            drop(p.alloc(size, &s)?);
            drop(s);
            p.settle()?;
            Ok(p.stats().reserved_bytes.current)
        })
    }

    /// The pool of device `dev`, built on first use.
    #[inline]
    pub fn device(&self, dev: usize) -> Result<&DevicePool> {
        let slot = self.pools.get(dev).ok_or_else(|| Error::InvalidDevice {
            device: dev,
            count: self.pools.len(),
        })?;
        match slot.get() {
            Some(p) => Ok(p),
            None => self.build_pool(dev),
        }
    }

    /// Every pool, by device index, building those not used yet. Panics
    /// if a pool cannot be built (see [`Runtime::try_devices`]).
    pub fn devices(&self) -> Vec<&DevicePool> {
        self.devices_result()
            .unwrap_or_else(|e| panic!("building the device pools: {e}"))
    }

    /// Every pool, by device index, building those not used yet.
    pub fn try_devices(&self) -> Result<Vec<&DevicePool>> {
        self.devices_result()
    }

    fn devices_result(&self) -> Result<Vec<&DevicePool>> {
        (0..self.pools.len()).map(|d| self.device(d)).collect()
    }

    /// The pool of `dev` if it has been built (`None` for a device not
    /// used yet, or out of range): never builds one.
    pub fn built_device(&self, dev: usize) -> Option<&DevicePool> {
        self.pools.get(dev).and_then(OnceLock::get)
    }

    /// The pools built so far (devices used), by device index.
    pub fn active_devices(&self) -> Vec<&DevicePool> {
        self.pools.iter().filter_map(OnceLock::get).collect()
    }

    /// Number of devices.
    pub fn device_count(&self) -> usize {
        self.pools.len()
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// The configuration in force.
    pub fn config(&self) -> &PoolConfig {
        &self.config
    }

    /// Trims every pool built so far, in parallel; returns the bytes
    /// given back.
    pub fn trim(&self) -> Result<u64> {
        let pools = self.active_devices();
        // The pools trim on their own threads: empty this thread's
        // magazines here first.
        for p in &pools {
            p.flush_thread_cache();
        }
        Ok(per_device(&pools, |p| p.trim())?.into_iter().sum())
    }

    /// Marks a step boundary on every pool built so far (see
    /// [`DevicePool::mark_step`]).
    pub fn mark_step(&self) -> Result<()> {
        self.steps_marked
            .store(true, std::sync::atomic::Ordering::Relaxed);
        for p in self.active_devices() {
            p.mark_step()?;
        }
        Ok(())
    }

    /// [`DevicePool::pause`] on every pool built so far that has virtual
    /// memory management, in parallel; returns the bytes released.
    /// [`Error::Unsupported`] if no such pool exists but some pool does.
    pub fn pause(&self, tag: u64, save: bool) -> Result<u64> {
        let pools = self.vmm_pools()?;
        for p in &pools {
            p.flush_thread_cache();
        }
        Ok(per_device(&pools, |p| p.pause(tag, save))?
            .into_iter()
            .sum())
    }

    /// [`DevicePool::resume`] on every pool built so far that has virtual
    /// memory management, in parallel; returns the bytes mapped again.
    /// All or nothing per device, not across devices: a device that fails
    /// keeps its blocks paused while the others resume.
    pub fn resume(&self, tag: u64) -> Result<u64> {
        let pools = self.vmm_pools()?;
        Ok(per_device(&pools, |p| p.resume(tag))?.into_iter().sum())
    }

    fn vmm_pools(&self) -> Result<Vec<&DevicePool>> {
        let active = self.active_devices();
        let vmm: Vec<&DevicePool> = active
            .iter()
            .copied()
            .filter(|p| p.info().vmm_supported)
            .collect();
        if vmm.is_empty() && !active.is_empty() {
            return Err(Error::Unsupported(
                "pause and resume need virtual memory management; no device has it".into(),
            ));
        }
        Ok(vmm)
    }

    /// Stops the maintenance threads and shuts every pool down: later
    /// calls fail with [`Error::Shutdown`].
    pub fn shutdown(&self) {
        *self.building.lock() = true;
        self.maintenance.lock().stop();
        for p in self.active_devices() {
            p.shutdown();
        }
    }
}

/// Runs `f` on every pool, one scoped thread each (one pool: on this
/// thread), and collects the results in device order.
fn per_device<T: Send>(
    pools: &[&DevicePool],
    f: impl Fn(&DevicePool) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    if pools.len() <= 1 {
        return pools.iter().map(|p| f(p)).collect();
    }
    std::thread::scope(|sc| {
        let handles: Vec<_> = pools.iter().map(|p| sc.spawn(|| f(p))).collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    })
}

impl Drop for Runtime {
    fn drop(&mut self) {
        // The threads hold the pools: stop them before the pools go.
        self.maintenance.get_mut().stop();
    }
}
