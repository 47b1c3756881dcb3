//! The runtime: one independent [`DevicePool`] per device of a backend.

use crate::backend::{self, Backend};
use crate::config::{BackendKind, PoolConfig};
use crate::error::{Error, Result};
use crate::pool::DevicePool;
use rayon::prelude::*;
use std::sync::Arc;

/// Builds a [`Runtime`].
#[derive(Debug, Default)]
pub struct RuntimeBuilder {
    backend: Option<BackendKind>,
    config: Option<PoolConfig>,
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

    /// Opens the backend and builds one pool per device, in parallel.
    pub fn build(self) -> Result<Runtime> {
        let config = self.config.unwrap_or_default();
        let kind = self.backend.unwrap_or_else(|| config.backend.clone());
        let backend = backend::open(&kind, &config.sim)?;
        Runtime::with_backend(backend, config)
    }
}

/// One pool per device over one backend. Pools share nothing but the
/// backend object, so no lock is ever shared between devices.
#[derive(Debug)]
pub struct Runtime {
    backend: Arc<dyn Backend>,
    config: PoolConfig,
    pools: Vec<DevicePool>,
}

impl Runtime {
    /// A builder with the defaults (backend `Auto`, default config).
    pub fn builder() -> RuntimeBuilder {
        RuntimeBuilder::default()
    }

    /// A runtime over an already opened backend.
    pub fn with_backend(backend: Arc<dyn Backend>, config: PoolConfig) -> Result<Runtime> {
        let pools = (0..backend.device_count())
            .into_par_iter()
            .map(|d| DevicePool::new(backend.clone(), d, config.clone()))
            .collect::<Result<Vec<_>>>()?;
        Ok(Runtime {
            backend,
            config,
            pools,
        })
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
        for p in &self.pools {
            p.flush_thread_cache();
        }
        self.pools
            .par_iter()
            .map(|p| p.trim())
            .try_reduce(|| 0, |a, b| Ok(a + b))
    }

    /// Shuts every pool down: later calls fail with [`Error::Shutdown`].
    pub fn shutdown(&self) {
        for p in &self.pools {
            p.shutdown();
        }
    }
}
