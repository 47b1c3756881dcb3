//! The chunks behind a range, for sharing it with another process
//! (`pool/ipc.rs`).

use super::*;

impl Heap {
    /// The chunks backing `[start, start + len)`, one per granule in
    /// address order, and the address of the first granule. VMM mode only;
    /// an error if a granule has no chunk (a paused block).
    pub(crate) fn chunks_covering(&self, start: u64, len: u64) -> Result<(u64, Vec<ChunkHandle>)> {
        let Physical::Vmm { base, granules, .. } = &self.phys else {
            return Err(Error::Unsupported(
                "sharing memory needs virtual memory management (VMM)".into(),
            ));
        };
        let (first, last, _) = physical::granule_span(*base, self.gran, start, len);
        let chunks = (first..=last)
            .map(|g| {
                granules[g as usize].chunk.ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "{start:#x}+{len} has no physical memory (paused?)"
                    ))
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((*base + first as u64 * self.gran, chunks))
    }
}
