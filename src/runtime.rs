//! The runtime: one independent [`DevicePool`] per device of a backend.
//!
//! Besides the pools, a runtime owns one maintenance thread per device,
//! enables peer access between pools where the backend allows it
//! ([`PeerMatrix`]), and runs per-device work in parallel with rayon:
//! construction, [`Runtime::warm_up`] and [`Runtime::trim`].
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
//! `release_fraction` (default 2) times that peak, gives cached memory
//! back without blocking ([`DevicePool::release_cache`]). A pool that needed
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
use rayon::prelude::*;
use std::sync::Arc;
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

/// One pool per device over one backend. Pools share nothing but the
/// backend object, so no lock is ever shared between devices.
#[derive(Debug)]
pub struct Runtime {
    backend: Arc<dyn Backend>,
    config: PoolConfig,
    /// Shared with the maintenance threads, which stop before it drops.
    pools: Arc<Vec<DevicePool>>,
    topology: Topology,
    peers: PeerMatrix,
    maintenance: parking_lot::Mutex<maint::Maintenance>,
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
        let pools = (0..backend.device_count())
            .into_par_iter()
            .map(|d| DevicePool::new(backend.clone(), d, config.clone()))
            .collect::<Result<Vec<_>>>()?;
        let pools = Arc::new(pools);
        let infos: Vec<_> = pools.iter().map(|p| p.info().clone()).collect();
        let topology = crate::topology::discover(&infos);
        let peers = if peers {
            PeerMatrix::enable(&*backend, &pools)
        } else {
            PeerMatrix {
                access: (0..pools.len())
                    .map(|d| (0..pools.len()).map(|p| p == d).collect())
                    .collect(),
                notes: vec!["peer access turned off".into()],
            }
        };
        let maintenance = match config.maintenance_tick {
            Some(tick) => maint::Maintenance::start(&pools, tick, &topology)?,
            None => maint::Maintenance::default(),
        };
        Ok(Runtime {
            backend,
            config,
            pools,
            topology,
            peers,
            maintenance: parking_lot::Mutex::new(maintenance),
        })
    }

    /// The topology found at start (NUMA node and CPUs nearest each device).
    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    /// Which pools' memory which devices may access.
    pub fn peer_matrix(&self) -> &PeerMatrix {
        &self.peers
    }

    /// What each device's maintenance thread did so far (empty when the
    /// threads are off; the counts stay readable after
    /// [`Runtime::shutdown`] stopped them).
    pub fn maintenance_stats(&self) -> Vec<MaintenanceStats> {
        self.maintenance.lock().stats()
    }

    /// Pre-reserves `bytes` on every pool in parallel, so that the first
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
        self.pools
            .par_iter()
            .map(|p| {
                let s = p.new_stream()?;
                drop(p.alloc(size, &s)?);
                drop(s);
                p.settle()?;
                Ok(p.stats().reserved_bytes.current)
            })
            .collect()
    }

    /// The pool of device `dev`.
    pub fn device(&self, dev: usize) -> Result<&DevicePool> {
        self.pools.get(dev).ok_or(Error::InvalidDevice {
            device: dev,
            count: self.pools.len(),
        })
    }

    /// All pools, by device index.
    pub fn devices(&self) -> &[DevicePool] {
        &self.pools
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

    /// Trims every pool in parallel; returns the bytes given back.
    pub fn trim(&self) -> Result<u64> {
        // The pools trim on rayon's threads: empty this thread's magazines
        // here first.
        for p in self.pools.iter() {
            p.flush_thread_cache();
        }
        self.pools
            .par_iter()
            .map(|p| p.trim())
            .try_reduce(|| 0, |a, b| Ok(a + b))
    }

    /// Stops the maintenance threads and shuts every pool down: later
    /// calls fail with [`Error::Shutdown`].
    pub fn shutdown(&self) {
        self.maintenance.lock().stop();
        for p in self.pools.iter() {
            p.shutdown();
        }
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        // The threads hold the pools: stop them before the pools go.
        self.maintenance.get_mut().stop();
    }
}
