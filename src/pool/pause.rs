//! Tagged allocations, pause and resume: giving the physical memory of a
//! group of live allocations back to the device while their addresses stay
//! theirs (what vLLM's sleep mode and torch_memory_saver do, here inside
//! the pool).
//!
//! ```text
//!  alloc_tagged(size, s, tag) ─► whole granules (aligned, rounded up), never parked
//!  pause(tag, save)  ─► host wait on the blocks' streams ─► [copy to host] ─► unmap, release
//!  resume(tag)       ─► map new chunks at the same addresses ─► [copy back]
//! ```
//!
//! Rules (tested in `tests/pause.rs`):
//!
//! * A tagged block owns whole granules: it starts on a granule and its
//!   length is rounded up to the granularity, so no other range shares its
//!   physical memory and it can go on its own. VMM devices only
//!   ([`Error::Unsupported`] in segment mode).
//! * `pause` waits on the host for every stream the tag's live blocks were
//!   used on (their allocation stream and the streams recorded for them):
//!   the one host wait of this feature, as in `trim`. With `save`, it then
//!   copies each block's requested bytes to host memory. Then every granule
//!   is unmapped and its chunk released: `reserved_bytes` drops, the
//!   block's bytes move to `paused_bytes` (still in `allocated_bytes`). The
//!   addresses stay reserved and allocated; touching them faults.
//! * Pause and resume act per block and are idempotent: pausing a tag
//!   whose blocks are all paused (or an unknown tag) releases nothing and
//!   returns 0, as does resuming a tag with nothing paused. A block
//!   allocated with a tag while it is paused is live and mapped; the next
//!   pause takes it too.
//! * `resume` maps physical memory again under every paused block of the
//!   tag (spare chunks, idle clean granules, new chunks, within the memory
//!   limit) and copies saved bytes back; unsaved contents are undefined.
//!   All or nothing per device: on out of memory it waits for in-flight
//!   frees once and retries, and otherwise fails with
//!   [`Error::OutOfMemory`] with every block still paused and its saved
//!   bytes kept.
//! * Freeing a paused block is allowed: its addresses become free,
//!   unbacked memory, with no driver call and no event (nothing can still
//!   use it: pause waited). Its saved bytes are dropped.
//! * A driver error part way through a pause leaves each block either
//!   paused or live, never half of each.

use super::{Block, DevicePool, Kind, LargeLive, PoolShared, Stream, StreamCore};
use crate::error::{Error, Result};
use crate::ptr::DevicePtr;
use parking_lot::Mutex;
use rustc_hash::FxHashMap as HashMap;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;

/// The tagged blocks of one pool, by address.
#[derive(Debug, Default)]
pub(crate) struct TagRegistry {
    /// Entries in `blocks` (read without the lock on every large free).
    live: AtomicUsize,
    inner: Mutex<Blocks>,
}

#[derive(Debug, Default)]
struct Blocks {
    by_addr: HashMap<u64, Tagged>,
    /// Bumped per entry, so that a pause that let go of the lock acts on
    /// the blocks it synchronized and not on new ones at the same address.
    next_gen: u64,
}

#[derive(Debug)]
struct Tagged {
    tag: u64,
    /// Range length (whole granules).
    len: u64,
    requested: u64,
    /// The allocation stream, held so that a pause can wait for it.
    stream: Arc<StreamCore>,
    gen: u64,
    state: State,
}

#[derive(Debug)]
enum State {
    Live,
    /// Unmapped; the saved bytes (requested size) if the pause saved them.
    Paused(Option<Box<[u8]>>),
}

/// What a pool holds for one tag (see [`DevicePool::tag_info`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct TagInfo {
    /// Live blocks with the tag, paused or not.
    pub blocks: u64,
    /// Their rounded bytes (whole granules).
    pub bytes: u64,
    /// Blocks paused now.
    pub paused_blocks: u64,
    /// Their rounded bytes: physical memory given back.
    pub paused_bytes: u64,
    /// Host bytes holding saved contents of paused blocks.
    pub saved_bytes: u64,
}

impl TagRegistry {
    fn insert(&self, addr: u64, tag: u64, len: u64, requested: u64, stream: &Arc<StreamCore>) {
        let mut b = self.inner.lock();
        let gen = b.next_gen;
        b.next_gen += 1;
        b.by_addr.insert(
            addr,
            Tagged {
                tag,
                len,
                requested,
                stream: stream.clone(),
                gen,
                state: State::Live,
            },
        );
        self.live.store(b.by_addr.len(), Relaxed);
    }

    /// Whether no block is tagged (one relaxed load).
    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        self.live.load(Relaxed) == 0
    }

    /// Forgets the block at `addr` as it is freed: `None` if it is not
    /// tagged, else whether it was paused. One relaxed load while the pool
    /// has no tagged block.
    #[inline]
    pub(crate) fn forget(&self, addr: u64) -> Option<bool> {
        if self.live.load(Relaxed) == 0 {
            return None;
        }
        let mut b = self.inner.lock();
        let t = b.by_addr.remove(&addr)?;
        self.live.store(b.by_addr.len(), Relaxed);
        Some(matches!(t.state, State::Paused(_)))
    }

    /// Drops every entry (pool teardown), returning the streams they held
    /// so that the caller drops them when it chooses.
    pub(crate) fn clear(&self) -> Vec<Arc<StreamCore>> {
        let mut b = self.inner.lock();
        self.live.store(0, Relaxed);
        b.by_addr.drain().map(|(_, t)| t.stream).collect()
    }
}

impl DevicePool {
    /// Allocates `size` bytes for `stream` under `tag`, for
    /// [`DevicePool::pause`] and [`DevicePool::resume`]. The block owns
    /// whole granules: it is granule aligned and its `allocated_bytes` is
    /// `size` rounded up to the granularity. VMM devices only
    /// ([`Error::Unsupported`] otherwise). Freed like any block on drop,
    /// paused or not.
    pub fn alloc_tagged<'a>(
        &'a self,
        size: usize,
        stream: &'a Stream,
        tag: u64,
    ) -> Result<Block<'a>> {
        let (ptr, kind) = self.shared.alloc_tagged(size as u64, stream, false, tag)?;
        Ok(self.shared.block(stream, ptr, size, kind))
    }

    /// [`DevicePool::alloc_tagged`] for a caller that keeps only the
    /// pointer; release with [`DevicePool::free_raw`].
    pub fn alloc_raw_tagged(&self, size: usize, stream: &Stream, tag: u64) -> Result<DevicePtr> {
        Ok(self.shared.alloc_tagged(size as u64, stream, true, tag)?.0)
    }

    /// Gives the physical memory of every live, unpaused block tagged `tag`
    /// back to the device, keeping their addresses; with `save`, their
    /// bytes are copied to host memory first. Waits on the host for the
    /// streams those blocks were used on (allocation stream and recorded
    /// streams). Returns the bytes of device memory released (0 for an
    /// unknown tag or one already paused). See the module docs of
    /// `pool/pause.rs` for the rules.
    pub fn pause(&self, tag: u64, save: bool) -> Result<u64> {
        self.shared.pause(tag, save)
    }

    /// Maps new physical memory under every paused block tagged `tag`, at
    /// the same addresses, and copies saved bytes back. All or nothing on
    /// this device: on [`Error::OutOfMemory`] every block stays paused.
    /// Returns the bytes mapped (0 if nothing was paused).
    pub fn resume(&self, tag: u64) -> Result<u64> {
        self.shared.resume(tag)
    }

    /// The blocks this pool holds under `tag`, paused or not.
    pub fn tag_info(&self, tag: u64) -> TagInfo {
        let b = self.shared.tags.inner.lock();
        let mut i = TagInfo::default();
        for t in b.by_addr.values().filter(|t| t.tag == tag) {
            i.blocks += 1;
            i.bytes += t.len;
            if let State::Paused(saved) = &t.state {
                i.paused_blocks += 1;
                i.paused_bytes += t.len;
                i.saved_bytes += saved.as_ref().map_or(0, |s| s.len() as u64);
            }
        }
        i
    }
}

impl PoolShared {
    fn check_vmm(&self, what: &str) -> Result<()> {
        if self.info.vmm_supported {
            return Ok(());
        }
        Err(Error::Unsupported(format!(
            "{what} needs virtual memory management (device {} has none)",
            self.dev
        )))
    }

    fn alloc_tagged(
        &self,
        size: u64,
        stream: &Stream,
        raw: bool,
        tag: u64,
    ) -> Result<(DevicePtr, Kind)> {
        self.check_live()?;
        self.check_stream(stream)?;
        self.check_size(size)?;
        self.check_vmm("a tagged allocation")?;
        let gran = self.info.granularity;
        let len = size.div_ceil(gran) * gran;
        let live = LargeLive {
            requested: size,
            raw,
        };
        let addr = self.alloc_granules(len, live, stream)?;
        self.tags.insert(addr, tag, len, size, stream.core());
        self.counters.on_alloc(size, len);
        if self.flags.recording() {
            self.record(super::HistoryAction::Alloc, addr, size, stream.handle());
        }
        Ok((DevicePtr(addr), Kind::Large { len }))
    }

    /// `len` bytes (whole granules) at a granule boundary, through the
    /// large path's steps (backed memory, handover and growth, then the
    /// way to out of memory); never from the parking cache, whose ranges
    /// are not granule aligned.
    fn alloc_granules(&self, len: u64, live: LargeLive, stream: &Stream) -> Result<u64> {
        let gran = self.info.granularity;
        let attempt = |this: &Self| -> Result<Option<u64>> {
            let mut h = this.heap.lock();
            let t = match h.heap.alloc_backed(len, gran, stream.slot()) {
                Some(t) => t,
                None => match this.heap_alloc(&mut h, len, gran, stream, super::PendingUse::Any) {
                    Ok(t) => t,
                    Err(e) if e.is_oom() => return Ok(None),
                    Err(e) => return Err(e),
                },
            };
            if live.raw {
                this.by_stream.insert(stream.slot(), t.addr, len, live);
            }
            Ok(Some(t.addr))
        };
        if let Some(a) = attempt(self)? {
            return Ok(a);
        }
        self.counters.retries.fetch_add(1, Relaxed);
        self.harvest();
        self.reclaim();
        self.unpark(&mut self.heap.lock());
        if let Some(a) = attempt(self)? {
            return Ok(a);
        }
        self.wait_before_oom();
        self.unpark(&mut self.heap.lock());
        match attempt(self)? {
            Some(a) => Ok(a),
            None => Err(self.oom(live.requested)),
        }
    }

    fn pause(&self, tag: u64, save: bool) -> Result<u64> {
        self.check_live()?;
        self.check_vmm("pause")?;
        // The live blocks of the tag and the streams they were used on.
        let mut targets: Vec<(u64, u64)> = Vec::new();
        let mut cores: Vec<Arc<StreamCore>> = Vec::new();
        {
            let b = self.tags.inner.lock();
            for (&addr, t) in b.by_addr.iter() {
                if t.tag == tag && matches!(t.state, State::Live) {
                    targets.push((addr, t.gen));
                    cores.push(t.stream.clone());
                }
            }
        }
        if targets.is_empty() {
            return Ok(0);
        }
        {
            let rec = self.recorded_streams.lock();
            for (addr, _) in &targets {
                if let Some(v) = rec.get(addr) {
                    cores.extend(v.iter().cloned());
                }
            }
        }
        cores.sort_unstable_by_key(|c| Arc::as_ptr(c) as usize);
        cores.dedup_by(|a, b| Arc::ptr_eq(a, b));
        // The one host wait: no work may touch the memory once unmapped.
        self.wait_for_streams(&cores)?;
        drop(cores);
        // Quarantined aliases ordered after those streams are done now:
        // released, so that chunks given back below really go.
        self.harvest();
        targets.sort_unstable();
        let mut h = self.heap.lock();
        let mut b = self.tags.inner.lock();
        let mut released = 0;
        for (addr, gen) in targets {
            // Freed (or freed and reallocated) since: not this pause's.
            let Some(t) = b
                .by_addr
                .get_mut(&addr)
                .filter(|t| t.gen == gen && matches!(t.state, State::Live))
            else {
                continue;
            };
            let saved = if save {
                let mut buf: Vec<u8> = Vec::new();
                buf.try_reserve_exact(t.requested as usize).map_err(|e| {
                    Error::backend("host allocation", format!("saving a paused block: {e}"))
                })?;
                buf.resize(t.requested as usize, 0);
                self.backend
                    .copy_to_host(self.dev, DevicePtr(addr), &mut buf)?;
                Some(buf.into_boxed_slice())
            } else {
                None
            };
            released += h.heap.pause_range(addr, t.len)?;
            t.state = State::Paused(saved);
        }
        drop(b);
        drop(h);
        tracing::debug!(device = self.dev, tag, save, released, "tag paused");
        Ok(released)
    }

    /// Blocks the host until the work enqueued so far on each stream of
    /// `cores` completed: an event recorded on it (on the legacy stream for
    /// another thread's per-thread stream) and waited for, or a stream
    /// sync where the record fails.
    fn wait_for_streams(&self, cores: &[Arc<StreamCore>]) -> Result<()> {
        for c in cores.iter().filter(|c| !c.is_dead()) {
            match self.record_on(c) {
                Ok((ev, _)) => {
                    let r = self.host_sync_event(ev);
                    self.events.give_back(ev);
                    r?;
                }
                Err(_) => self.host_sync_stream(c.handle)?,
            }
        }
        Ok(())
    }

    fn resume(&self, tag: u64) -> Result<u64> {
        self.check_live()?;
        self.check_vmm("resume")?;
        match self.try_resume(tag) {
            Err(e) if e.is_oom() => {}
            r => return r,
        }
        // As an allocation would: wait for in-flight frees, make parked
        // and dirty memory clean (stealable), and try once more.
        self.unpark(&mut self.heap.lock());
        self.wait_before_oom();
        match self.try_resume(tag) {
            Err(e) if e.is_oom() => {
                let want = self.tag_paused_bytes(tag);
                Err(self.oom(want))
            }
            r => r,
        }
    }

    fn tag_paused_bytes(&self, tag: u64) -> u64 {
        let b = self.tags.inner.lock();
        b.by_addr
            .values()
            .filter(|t| t.tag == tag && matches!(t.state, State::Paused(_)))
            .map(|t| t.len)
            .sum()
    }

    /// One all-or-nothing resume of `tag`'s paused blocks.
    fn try_resume(&self, tag: u64) -> Result<u64> {
        let mut h = self.heap.lock();
        let mut b = self.tags.inner.lock();
        let mut targets: Vec<(u64, u64)> = b
            .by_addr
            .iter()
            .filter(|(_, t)| t.tag == tag && matches!(t.state, State::Paused(_)))
            .map(|(&a, t)| (a, t.len))
            .collect();
        targets.sort_unstable();
        for (k, &(addr, len)) in targets.iter().enumerate() {
            if let Err(e) = h.heap.resume_range(addr, len) {
                for &(a, l) in &targets[..k] {
                    if let Err(e2) = h.heap.pause_range(a, l) {
                        tracing::error!(device = self.dev, "resume rollback: {e2}");
                    }
                }
                return Err(e);
            }
        }
        // Mapped: restore the saved bytes. A copy that fails leaves that
        // block and the ones after it paused (with their bytes).
        let mut mapped = 0;
        for (k, &(addr, len)) in targets.iter().enumerate() {
            let t = b.by_addr.get_mut(&addr).expect("held under the lock");
            if let State::Paused(Some(saved)) = &t.state {
                if let Err(e) = self
                    .backend
                    .copy_from_host(self.dev, DevicePtr(addr), saved)
                {
                    for &(a, l) in &targets[k..] {
                        if let Err(e2) = h.heap.pause_range(a, l) {
                            tracing::error!(device = self.dev, "resume rollback: {e2}");
                        }
                    }
                    return Err(e);
                }
            }
            t.state = State::Live;
            mapped += len;
        }
        tracing::debug!(device = self.dev, tag, mapped, "tag resumed");
        Ok(mapped)
    }
}
