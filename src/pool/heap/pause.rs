//! Paused ranges: allocated ranges whose physical memory went back to the
//! device while their addresses stay reserved and allocated (the pool's
//! pause and resume, `pool/pause.rs`).
//!
//! Invariants: a paused range is allocated, starts on a granule and is a
//! whole number of granules long, so no other range shares its granules;
//! every granule of it is unmapped (no chunk, not idle, not in the mapped
//! set) and none is ever stolen by stitching, which only takes idle
//! granules. Its bytes stay in `allocated_bytes` and are counted in
//! `paused_bytes`, not in `reserved`. Freeing a paused range makes no
//! driver call: its granules simply become free and unbacked.

use super::*;

impl Heap {
    /// The granules of `[addr, addr + len)` if it is an allocated range
    /// made of whole granules (VMM mode): `(first, count)`.
    fn whole_granules(&self, addr: u64, len: u64) -> Result<(u32, u32)> {
        let Physical::Vmm { base, .. } = &self.phys else {
            return Err(Error::Unsupported(
                "pause and resume need virtual memory management (VMM)".into(),
            ));
        };
        if self.allocated_len(addr) != Some(len) || (addr - base) % self.gran != 0 {
            return Err(Error::InvalidArgument(format!(
                "{addr:#x}+{len} is not an allocated range of whole granules"
            )));
        }
        if len == 0 || len % self.gran != 0 {
            return Err(Error::InvalidArgument(format!(
                "{addr:#x}+{len} is not a whole number of granules"
            )));
        }
        Ok((((addr - base) / self.gran) as u32, (len / self.gran) as u32))
    }

    /// Whether the allocated range at `addr` is paused.
    pub(crate) fn is_paused(&self, addr: u64) -> bool {
        !self.paused.is_empty() && self.paused.contains_key(&addr)
    }

    /// Unmaps every granule of the allocated range `[addr, addr + len)`
    /// (whole granules, all mapped) and releases their chunks to the
    /// device; the range stays allocated. All or nothing: if an unmap
    /// fails, the granules unmapped so far are mapped again and the error
    /// returned. Returns the bytes of physical memory given back.
    pub(crate) fn pause_range(&mut self, addr: u64, len: u64) -> Result<u64> {
        if self.capture_hold {
            return Err(crate::error::Error::InvalidArgument(
                "cannot pause while a CUDA graph capture is underway".into(),
            ));
        }
        let (g0, n) = self.whole_granules(addr, len)?;
        if self.is_paused(addr) {
            return Ok(0);
        }
        let Physical::Vmm { base, granules, .. } = &self.phys else {
            unreachable!("checked by whole_granules")
        };
        let base = *base;
        let chunks: Vec<ChunkHandle> = (g0..g0 + n)
            .map(|g| {
                granules[g as usize]
                    .chunk
                    .expect("allocated granules are mapped")
            })
            .collect();
        for k in 0..n {
            let va = DevicePtr(base + (g0 + k) as u64 * self.gran);
            if let Err(e) = self.backend.unmap(self.dev, va, self.gran) {
                // Put back what this call unmapped: the range stays live.
                let va0 = DevicePtr(base + g0 as u64 * self.gran);
                if let Err(e2) =
                    self.backend
                        .map_run(self.dev, va0, self.gran, &chunks[..k as usize])
                {
                    tracing::error!(
                        device = self.dev,
                        "pause: remapping after a failed unmap failed too: {e2}"
                    );
                } else if !self.peers.is_empty() {
                    let bytes = k as u64 * self.gran;
                    let _ = self.backend.set_access(self.dev, va0, bytes, &self.peers);
                }
                return Err(e);
            }
        }
        if let Physical::Vmm {
            granules, mapped, ..
        } = &mut self.phys
        {
            for g in g0..g0 + n {
                granules[g as usize].chunk = None;
            }
            mapped.remove_range(g0, g0 + n);
        }
        let before = self.reserved;
        for c in chunks {
            self.release_chunk(c);
        }
        self.paused.insert(addr, len);
        self.paused_bytes += len;
        tracing::debug!(device = self.dev, addr, len, "range paused");
        Ok(before - self.reserved)
    }

    /// Backs the paused range at `addr` with physical memory again, at the
    /// same addresses: spare chunks, idle clean granules (stitching) and
    /// then new device memory, within the memory limit. All or nothing: on
    /// an error (out of memory included) the range stays paused and
    /// nothing this call took stays mapped. Returns the bytes mapped (0 if
    /// the range was not paused).
    pub(crate) fn resume_range(&mut self, addr: u64, len: u64) -> Result<u64> {
        self.whole_granules(addr, len)?;
        if !self.is_paused(addr) {
            return Ok(0);
        }
        // No stream slot: only clean idle granules are stolen, never by
        // aliasing (nothing is ordered after old uses of this memory).
        let ctx = StealCtx {
            slot: None,
            pending_ok: false,
        };
        // The range covers its granules whole: counting it as their user
        // again changes nothing, and `back` undoes its count on failure
        // (no granule of the range is mapped then, so none becomes idle).
        self.back(addr, len, ctx)?;
        self.paused.remove(&addr);
        self.paused_bytes -= len;
        tracing::debug!(device = self.dev, addr, len, "range resumed");
        Ok(len)
    }

    /// Forgets that the range at `addr` is paused, as it is freed.
    pub(super) fn unpause_on_free(&mut self, addr: u64) {
        if let Some(len) = self.paused.remove(&addr) {
            self.paused_bytes -= len;
        }
    }

    /// Audit of paused ranges: each is allocated, of whole granules, and
    /// wholly unmapped; their bytes add up to `paused_bytes`.
    pub(super) fn check_paused(&self) -> std::result::Result<(), String> {
        let mut total = 0;
        for (&a, &l) in &self.paused {
            let (g0, n) = self
                .whole_granules(a, l)
                .map_err(|e| format!("paused range {a:#x}: {e}"))?;
            if let Physical::Vmm { granules, .. } = &self.phys {
                if (g0..g0 + n).any(|g| granules[g as usize].chunk.is_some()) {
                    return Err(format!("paused range {a:#x} has mapped granules"));
                }
            }
            total += l;
        }
        if total != self.paused_bytes {
            return Err(format!(
                "paused ranges span {total} B, the count says {}",
                self.paused_bytes
            ));
        }
        Ok(())
    }
}
