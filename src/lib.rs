//! # gpupool
//!
//! A lock-free, multi-GPU device-memory allocator runtime.
//!
//! See `README.md` for the what and why, and `docs/ARCHITECTURE.md` for how
//! the layers fit: [`backend`] (the driver seam, with a faithful simulator),
//! the per-device pool, compaction, and the runtime over all devices.

#![warn(missing_docs)]

pub mod backend;
mod clock;
pub mod collective;
pub mod compact;
pub mod config;
mod error;
pub mod export;
pub mod ffi;
pub mod pool;
mod ptr;
pub mod runtime;
pub mod topology;

pub use backend::{Backend, DeviceInfo, Move};
pub use compact::{CompactOptions, CompactReport, MovableBlock, Pinned};
pub use config::{BackendKind, PoolConfig, SimConfig};
pub use error::{Error, OomReport, Result};
pub use pool::{Block, DevicePool, IpcChunk, IpcHandle, PoolStats, Stat, Stream, TagInfo};
pub use ptr::{ChunkHandle, DevicePtr, EventHandle, StreamHandle};
pub use runtime::{Runtime, RuntimeBuilder};
