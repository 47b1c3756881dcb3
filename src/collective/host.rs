//! The all-reduce through host memory: exact, simple, for the simulator
//! (and any backend without NCCL).

use super::{validate, AllReduce, ReduceBuf, ELEM_BYTES};
use crate::backend::Backend;
use crate::error::Result;
use crate::ptr::{DevicePtr, StreamHandle};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

/// Sums per-device buffers on the host, in stream order: an event recorded
/// on each buffer's stream is waited for before the buffer is read, and
/// the sums are written back before the call returns, so later work on the
/// stream sees them. Blocks the calling thread (not the alloc/free path):
/// one event sync and two synchronous copies per device, all counted.
#[derive(Debug)]
pub struct HostAllReduce {
    backend: Arc<dyn Backend>,
    syncs: AtomicU64,
}

impl HostAllReduce {
    /// The host all-reduce over `backend`'s devices.
    pub fn new(backend: Arc<dyn Backend>) -> HostAllReduce {
        HostAllReduce {
            backend,
            syncs: AtomicU64::new(0),
        }
    }

    /// Waits on the host for the work enqueued so far on `b.stream`.
    fn wait_stream(&self, b: &ReduceBuf) -> Result<()> {
        let be = &self.backend;
        let ev = be.create_event(b.device)?;
        let r = be
            .record_event(b.device, ev, b.stream)
            .and_then(|()| be.sync_event(b.device, ev));
        if r.is_ok() {
            self.syncs.fetch_add(1, Relaxed);
        }
        let _ = be.destroy_event(b.device, ev);
        r
    }
}

/// Adds `src` into `acc`, as little-endian `u32` words modulo 2^32.
fn add_words(acc: &mut [u8], src: &[u8]) {
    for (a, s) in acc.chunks_exact_mut(4).zip(src.chunks_exact(4)) {
        let v = u32::from_le_bytes([a[0], a[1], a[2], a[3]])
            .wrapping_add(u32::from_le_bytes([s[0], s[1], s[2], s[3]]));
        a.copy_from_slice(&v.to_le_bytes());
    }
}

impl AllReduce for HostAllReduce {
    fn name(&self) -> &'static str {
        "host"
    }

    fn all_reduce(&self, bufs: &[ReduceBuf]) -> Result<()> {
        let bytes = validate(bufs)?;
        debug_assert_eq!(bytes % ELEM_BYTES, 0);
        let len = bytes as usize;
        let mut sum = vec![0u8; len];
        let mut tmp = vec![0u8; len];
        for b in bufs {
            self.wait_stream(b)?;
            self.backend.copy_to_host(b.device, b.ptr, &mut tmp)?;
            self.syncs.fetch_add(1, Relaxed);
            add_words(&mut sum, &tmp);
        }
        for b in bufs {
            self.backend.copy_from_host(b.device, b.ptr, &sum)?;
            self.syncs.fetch_add(1, Relaxed);
            if self.backend.name() != "sim" {
                // CUDA's pageable cuMemcpyHtoD may return before its DMA
                // (on the legacy stream) lands: wait for it, so that work
                // later enqueued on a non-blocking stream sees the sums.
                self.backend.sync_stream(b.device, StreamHandle(0))?;
                self.syncs.fetch_add(1, Relaxed);
            }
        }
        Ok(())
    }

    fn register(&self, _device: usize, _ptr: DevicePtr, _bytes: u64) -> Result<bool> {
        Ok(false)
    }

    fn host_syncs(&self) -> u64 {
        self.syncs.load(Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_wrap() {
        let mut a = [0xff, 0xff, 0xff, 0xff, 1, 0, 0, 0].to_vec();
        add_words(&mut a, &[2, 0, 0, 0, 2, 0, 0, 0]);
        assert_eq!(a, [1, 0, 0, 0, 3, 0, 0, 0]);
    }
}
