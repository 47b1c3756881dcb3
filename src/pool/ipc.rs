//! Sharing device memory with another process: [`DevicePool::export`] gives
//! the physical chunks behind a live allocation as file descriptors, and
//! [`DevicePool::import`] maps such chunks, sent by another process, at a
//! fresh address range of this one.
//!
//! ```text
//!  exporter: export(ptr) ─► one fd per granule under the block (+ offset, size)
//!            ── fds over a unix socket (SCM_RIGHTS) or inherited ──►
//!  importer: import(fds, chunk_bytes, offset, size) ─► reserve, import, map ─► ptr
//!            close_import(ptr) ─► unmap, release, free the range
//! ```
//!
//! Rules: the exported allocation is a raw pointer or a large block, live
//! and not paused; every granule it touches is exported, so the importer
//! may see the bytes of neighbours sharing those granules (as CUDA IPC
//! shares a whole `cudaMalloc` segment). The exporter keeps the block
//! alive while importers use it: once freed, its memory may back another
//! block. An import is not pool memory (no statistic counts it) and is
//! never moved; the importer synchronizes its work on it before
//! [`DevicePool::close_import`]. Bad input changes nothing. VMM devices
//! only. On the simulator an exported chunk's bytes are a range of the
//! device's memfd, which the other process maps (the simulator shares the
//! whole file, a driver the chunk alone).

use super::{DevicePool, PoolShared};
use crate::error::{Error, Result};
use crate::ptr::{ChunkHandle, DevicePtr};
use parking_lot::Mutex;
use rustc_hash::FxHashMap as HashMap;
use std::os::fd::{BorrowedFd, OwnedFd};

/// One exported chunk: a file descriptor the receiver owns and the offset
/// of the chunk's bytes in the file it refers to (0 on CUDA).
#[derive(Debug)]
pub struct IpcChunk {
    /// The shareable handle (`cuMemExportToShareableHandle`, POSIX fd).
    pub fd: OwnedFd,
    /// Offset of the chunk in the file.
    pub fd_offset: u64,
}

/// A live allocation exported for another process: what
/// [`DevicePool::import`] takes there.
#[derive(Debug)]
pub struct IpcHandle {
    /// The chunks under the allocation, one per granule, in address order.
    pub chunks: Vec<IpcChunk>,
    /// Bytes of each chunk (the exporter's granularity).
    pub chunk_bytes: u64,
    /// Offset of the allocation in the first chunk.
    pub offset: u64,
    /// Bytes of the allocation (its requested size).
    pub size: u64,
}

/// Imports mapped in this pool, by the pointer handed out.
#[derive(Debug, Default)]
pub(crate) struct Imports {
    by_ptr: Mutex<HashMap<u64, Imported>>,
}

#[derive(Debug)]
struct Imported {
    /// The reservation: `chunks` are mapped from its start.
    base: u64,
    len: u64,
    chunk_bytes: u64,
    chunks: Vec<ChunkHandle>,
}

impl DevicePool {
    /// Exports the allocation at `ptr` (a raw pointer or a large block,
    /// live and not paused) for another process: the chunks under it as
    /// file descriptors, its offset in the first and its size. See
    /// `pool/ipc.rs` for the rules.
    pub fn export(&self, ptr: DevicePtr) -> Result<IpcHandle> {
        self.shared.export(ptr)
    }

    /// Maps memory another process exported ([`DevicePool::export`]
    /// there): `chunks` as `(fd, fd_offset)` in the handle's order (the
    /// descriptors stay the caller's), and the handle's `chunk_bytes`,
    /// `offset` and `size`. Returns the address of the allocation's first
    /// byte here; [`DevicePool::close_import`] unmaps it.
    pub fn import(
        &self,
        chunks: &[(BorrowedFd<'_>, u64)],
        chunk_bytes: u64,
        offset: u64,
        size: u64,
    ) -> Result<DevicePtr> {
        self.shared.import(chunks, chunk_bytes, offset, size)
    }

    /// Unmaps an import and frees its address range. Work using it must
    /// have completed. An error, changing nothing, while a CUDA graph
    /// capture is underway on the device (no unmap then).
    pub fn close_import(&self, ptr: DevicePtr) -> Result<()> {
        self.shared.check_live()?;
        self.shared.refuse_during_capture("close_import")?;
        let imp = self
            .shared
            .imports
            .by_ptr
            .lock()
            .remove(&ptr.addr())
            .ok_or(Error::UnknownPointer {
                ptr: ptr.addr(),
                device: self.shared.dev,
            })?;
        self.shared.unmap_import(imp)
    }
}

impl PoolShared {
    fn export(&self, ptr: DevicePtr) -> Result<IpcHandle> {
        self.check_live()?;
        if !self.info.vmm_supported {
            return Err(Error::Unsupported(format!(
                "export needs virtual memory management (device {} has none)",
                self.dev
            )));
        }
        let addr = ptr.addr();
        let unknown = Error::UnknownPointer {
            ptr: addr,
            device: self.dev,
        };
        let small = match self.slab_holding(addr) {
            Some(id) => {
                let slot = self.slabs.slot_at(id, addr).ok_or(unknown.clone())?;
                if !self.slabs.is_raw_live(slot.idx) {
                    return Err(Error::InvalidArgument(format!(
                        "{addr:#x} is not a live raw allocation (only raw pointers are exported)"
                    )));
                }
                Some(self.slabs.requested(slot.idx))
            }
            None => None,
        };
        // Under the heap lock: the chunks cannot move or go meanwhile.
        let h = self.heap.lock();
        let size = match small {
            Some(n) => n,
            None => match self.by_stream.get(None, addr) {
                Some(e) => e.live.requested,
                // Typed large blocks are not listed (`stream_large.rs`).
                None if h.heap.allocated_len(addr).is_some() => {
                    return Err(Error::InvalidArgument(format!(
                        "{addr:#x} is not a live raw allocation (only raw pointers are exported)"
                    )))
                }
                None => return Err(unknown),
            },
        };
        if h.heap.is_paused(addr) {
            return Err(Error::InvalidArgument(format!(
                "{addr:#x} is paused: resume it before exporting"
            )));
        }
        let (first, chunks) = h.heap.chunks_covering(addr, size)?;
        let mut out = Vec::with_capacity(chunks.len());
        for c in chunks {
            let (fd, fd_offset) = self.backend.export_chunk(self.dev, c)?;
            out.push(IpcChunk { fd, fd_offset });
        }
        Ok(IpcHandle {
            chunks: out,
            chunk_bytes: self.info.granularity,
            offset: addr - first,
            size,
        })
    }

    fn import(
        &self,
        chunks: &[(BorrowedFd<'_>, u64)],
        chunk_bytes: u64,
        offset: u64,
        size: u64,
    ) -> Result<DevicePtr> {
        self.check_live()?;
        if !self.info.vmm_supported {
            return Err(Error::Unsupported(format!(
                "import needs virtual memory management (device {} has none)",
                self.dev
            )));
        }
        let gran = self.info.granularity;
        let span = (chunks.len() as u64).saturating_mul(chunk_bytes);
        if chunks.is_empty()
            || chunk_bytes == 0
            || chunk_bytes % gran != 0
            || size == 0
            || offset >= chunk_bytes
            || offset.saturating_add(size) > span
        {
            return Err(Error::InvalidArgument(format!(
                "import of {} chunks of {chunk_bytes} B at offset {offset}, {size} B: \
                 chunks must be whole granules ({gran} B) holding [offset, offset + size)",
                chunks.len()
            )));
        }
        let base = self.backend.reserve_va(self.dev, span)?.addr();
        let mut imp = Imported {
            base,
            len: span,
            chunk_bytes,
            chunks: Vec::with_capacity(chunks.len()),
        };
        for (i, &(fd, fd_offset)) in chunks.iter().enumerate() {
            let mapped = self
                .backend
                .import_chunk(self.dev, fd, fd_offset, chunk_bytes)
                .and_then(|c| {
                    let va = DevicePtr(base + i as u64 * chunk_bytes);
                    match self.backend.map(self.dev, va, chunk_bytes, c, 0) {
                        Ok(()) => Ok(c),
                        Err(e) => {
                            let _ = self.backend.release_chunk(self.dev, c);
                            Err(e)
                        }
                    }
                });
            match mapped {
                Ok(c) => imp.chunks.push(c),
                Err(e) => {
                    // Nothing stays: what was mapped goes, and the range.
                    if let Err(e2) = self.unmap_import(imp) {
                        tracing::warn!(device = self.dev, "undoing an import: {e2}");
                    }
                    return Err(e);
                }
            }
        }
        let ptr = base + offset;
        self.imports.by_ptr.lock().insert(ptr, imp);
        tracing::debug!(device = self.dev, ptr, size, "memory imported");
        Ok(DevicePtr(ptr))
    }

    /// Unmaps and releases an import's chunks and frees its range; the
    /// first error is returned, after every step was tried.
    fn unmap_import(&self, imp: Imported) -> Result<()> {
        let n = imp.chunks.len() as u64;
        let mut first = self
            .backend
            .unmap_run(self.dev, DevicePtr(imp.base), imp.chunk_bytes, n);
        for c in imp.chunks {
            first = first.and(self.backend.release_chunk(self.dev, c));
        }
        first.and(self.backend.free_va(self.dev, DevicePtr(imp.base), imp.len))
    }

    /// Unmaps every import (pool teardown).
    pub(crate) fn close_all_imports(&self) {
        let all: Vec<Imported> = self.imports.by_ptr.lock().drain().map(|e| e.1).collect();
        for imp in all {
            if let Err(e) = self.unmap_import(imp) {
                tracing::warn!(device = self.dev, "closing an import at teardown: {e}");
            }
        }
    }
}
