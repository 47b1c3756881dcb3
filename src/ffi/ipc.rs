//! Sharing device memory between processes through the C ABI:
//! `gpupool_export`, `gpupool_import`, `gpupool_import_close` (the rules
//! are those of `src/pool/ipc.rs`).
//!
//! Invariant: descriptors cross the boundary by value: `gpupool_export`
//! hands the caller new descriptors it then owns (and closes), and
//! `gpupool_import` only borrows the caller's.

use super::state::with_state;
use super::status::{status, Fail, GpupoolStatus};
use crate::ptr::DevicePtr;
use std::ffi::{c_int, c_void};
use std::os::fd::{BorrowedFd, IntoRawFd};

/// One exported chunk: a file descriptor and the offset of the chunk's
/// bytes in the file it refers to (0 on CUDA).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct GpupoolIpcChunk {
    /// The shareable handle: a POSIX file descriptor.
    pub fd: c_int,
    /// Offset of the chunk in the file.
    pub fd_offset: u64,
}

/// Exports the allocation at `ptr` on `device` (from `gpupool_alloc`, live
/// and not paused) for another process: the chunks of device memory under
/// it, one per granule in address order, into `chunks[0..*n_chunks]` as
/// new descriptors the caller owns (send them with `SCM_RIGHTS`, then
/// close them), with `*chunk_bytes` (each chunk's size), `*offset` (of the
/// allocation in the first chunk) and `*size`. The other process passes
/// all of it to `gpupool_import`. Every granule the allocation touches is
/// shared, neighbours' bytes included; keep the allocation alive while it
/// is imported. When `max_chunks` is too small, nothing is exported,
/// `*n_chunks` is the count needed and the status is
/// `GPUPOOL_STATUS_BUFFER_TOO_SMALL`. `GPUPOOL_STATUS_UNSUPPORTED` without
/// virtual memory management or shareable handles.
///
/// # Safety
/// `chunks` is NULL (with `max_chunks == 0`) or valid for `max_chunks`
/// writes; `n_chunks`, `chunk_bytes`, `offset` and `size` are each valid
/// for one write.
#[no_mangle]
pub unsafe extern "C" fn gpupool_export(
    ptr: *mut c_void,
    device: c_int,
    chunks: *mut GpupoolIpcChunk,
    max_chunks: usize,
    n_chunks: *mut usize,
    chunk_bytes: *mut u64,
    offset: *mut u64,
    size: *mut u64,
) -> c_int {
    status("gpupool_export", || {
        for (p, name) in [
            (ptr.cast_const(), "ptr"),
            (n_chunks.cast_const().cast(), "n_chunks"),
            (chunk_bytes.cast_const().cast(), "chunk_bytes"),
            (offset.cast_const().cast(), "offset"),
            (size.cast_const().cast(), "size"),
        ] {
            if p.is_null() {
                return Err(Fail::null(name));
            }
        }
        if chunks.is_null() && max_chunks > 0 {
            return Err(Fail::null("chunks"));
        }
        // SAFETY: non-NULL and valid for one write (caller's contract).
        unsafe { n_chunks.write(0) };
        let addr = ptr as usize as u64;
        let h = with_state(|st| {
            let pool = st.pool(device)?;
            pool.export(DevicePtr(addr))
                .map_err(|e| st.classify(e, addr, pool.device()))
        })?;
        // SAFETY: as above.
        unsafe { n_chunks.write(h.chunks.len()) };
        if h.chunks.len() > max_chunks {
            // The descriptors close as `h` drops: nothing was handed out.
            return Err(Fail::new(
                GpupoolStatus::BufferTooSmall,
                format!(
                    "the allocation spans {} chunks; room for {max_chunks}",
                    h.chunks.len()
                ),
            ));
        }
        // SAFETY: each out-pointer is valid for one write (caller's contract).
        unsafe {
            chunk_bytes.write(h.chunk_bytes);
            offset.write(h.offset);
            size.write(h.size);
        }
        for (i, c) in h.chunks.into_iter().enumerate() {
            let out = GpupoolIpcChunk {
                fd_offset: c.fd_offset,
                fd: c.fd.into_raw_fd(),
            };
            // SAFETY: `i < n <= max_chunks` and `chunks` is valid for
            // `max_chunks` writes (caller's contract).
            unsafe { chunks.add(i).write(out) };
        }
        Ok(())
    })
}

/// Maps memory another process exported with `gpupool_export` into this
/// one, on `device`: `chunks[0..n_chunks]`, `chunk_bytes`, `offset` and
/// `size` as it gave them (the descriptors stay the caller's: close them
/// after). `*out` is the address of the allocation's first byte here, or
/// `NULL` on failure. The memory is the exporter's: no statistic of this
/// process counts it. `gpupool_import_close` unmaps it.
///
/// # Safety
/// `chunks` is valid for `n_chunks` reads; `out` is NULL or valid for one
/// pointer write.
#[no_mangle]
pub unsafe extern "C" fn gpupool_import(
    device: c_int,
    chunks: *const GpupoolIpcChunk,
    n_chunks: usize,
    chunk_bytes: u64,
    offset: u64,
    size: u64,
    out: *mut *mut c_void,
) -> c_int {
    status("gpupool_import", || {
        if out.is_null() {
            return Err(Fail::null("out"));
        }
        // SAFETY: non-NULL and valid for writes (caller's contract).
        unsafe { out.write(std::ptr::null_mut()) };
        if chunks.is_null() {
            return Err(Fail::null("chunks"));
        }
        // SAFETY: `chunks` is non-NULL and valid for `n_chunks` reads.
        let given = unsafe { std::slice::from_raw_parts(chunks, n_chunks) };
        let mut pairs = Vec::with_capacity(given.len());
        for c in given {
            if c.fd < 0 {
                return Err(Fail::new(
                    GpupoolStatus::InvalidArgument,
                    format!("invalid file descriptor {}", c.fd),
                ));
            }
            // SAFETY: a non-negative descriptor the caller keeps open for
            // the call; it is only borrowed (duplicated where kept).
            pairs.push((unsafe { BorrowedFd::borrow_raw(c.fd) }, c.fd_offset));
        }
        let p = with_state(|st| Ok(st.pool(device)?.import(&pairs, chunk_bytes, offset, size)?))?;
        // SAFETY: as above.
        unsafe { out.write(p.addr() as usize as *mut c_void) };
        Ok(())
    })
}

/// Unmaps memory mapped by `gpupool_import` on `device` (work using it
/// must have completed). `GPUPOOL_STATUS_UNKNOWN_POINTER` for any other
/// pointer.
#[no_mangle]
pub extern "C" fn gpupool_import_close(ptr: *mut c_void, device: c_int) -> c_int {
    status("gpupool_import_close", || {
        if ptr.is_null() {
            return Err(Fail::null("ptr"));
        }
        let addr = ptr as usize as u64;
        with_state(|st| Ok(st.pool(device)?.close_import(DevicePtr(addr))?))
    })
}
