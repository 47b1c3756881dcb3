//! `DevicePool`: one per device, no lock shared between devices.
//!
//! ```text
//!  alloc(size, stream)
//!     ├─ size <= small_max ─► class stacks: dirty[stream] → clean → new slab (heap)
//!     └─ larger ───────────► heap (best fit over VA, granules mapped on demand)
//!  free(block)
//!     ├─ used on its stream only ─► dirty[stream] / Dirty(stream) range: reusable
//!     │                              at once by that stream
//!     └─ record_stream'd ─────────► events on every stream → pending list →
//!                                   clean once they complete (harvested without
//!                                   blocking) or handed over via stream-wait-event
//! ```
//!
//! The fast path (a small alloc or free on a registered stream) is two
//! lock-free stack operations and a few uncontended atomic adds. Slow paths
//! (new slabs, large blocks, harvesting, reclaiming) take this device's heap
//! mutex. Nothing on the alloc/free path ever blocks the host on the device:
//! events are only queried, and cross-stream reuse is ordered on the device
//! with `cuStreamWaitEvent`.

mod block;
mod heap;
#[cfg(all(test, loom))]
mod loom_tests;
mod pending;
mod size_class;
mod small;
pub mod stack;
mod stats;
mod stream;
pub(crate) mod sync;

pub use block::Block;
pub use size_class::{SizeClasses, ALIGN};
pub use stats::{PoolStats, Stat};
pub use stream::Stream;

use crate::backend::{Backend, DeviceInfo};
use crate::config::PoolConfig;
use crate::error::{Error, OomReport, Result};
use crate::ptr::{DevicePtr, EventHandle, StreamHandle};
use heap::{Heap, Tag};
use parking_lot::{Mutex, RwLock};
use pending::{Pending, PendingList, Waits};
use size_class::round_large;
use small::Slabs;
use stats::Counters;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use stream::{StreamInner, StreamRegistry, STREAM_SLOTS};

/// Shard used by streams without a slot.
const SPARE_SHARD: usize = STREAM_SLOTS;

/// What lives under the heap mutex.
#[derive(Debug)]
struct HeapState {
    heap: Heap,
    /// Events of each pending heap group.
    group_events: HashMap<u32, Waits>,
    /// Slab ids free for reuse.
    free_slab_ids: Vec<u32>,
    /// Requested bytes of raw large allocations, by address.
    raw_large: HashMap<u64, u64>,
    /// Granules aliased by stitching, released when their event completes.
    quarantine: Vec<(Waits, Vec<u32>)>,
    /// Bytes of all slabs, and of slab tails no slot covers.
    slab_bytes: u64,
    slab_tail_bytes: u64,
}

/// The state of one device's pool, shared with its streams.
#[derive(Debug)]
pub(crate) struct PoolShared {
    dev: usize,
    backend: Arc<dyn Backend>,
    cfg: PoolConfig,
    info: DeviceInfo,
    slabs: Slabs,
    heap: Mutex<HeapState>,
    /// Slab base address -> slab id, for raw frees.
    slab_index: RwLock<HashMap<u64, u32>>,
    pending: PendingList<Pending>,
    /// Idle events for reuse (a slow-path pool; a mutex is fine here).
    event_pool: Mutex<Vec<EventHandle>>,
    streams: StreamRegistry,
    counters: Counters,
    /// Extra streams recorded for raw pointers (`gpupool_record_stream`).
    raw_streams: Mutex<HashMap<u64, Vec<StreamHandle>>>,
    shut: AtomicBool,
}

/// The memory pool of one device. See the module docs for the design.
#[derive(Debug)]
pub struct DevicePool {
    shared: Arc<PoolShared>,
    default_stream: Stream,
}

/// Where a block's memory came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Small { idx: u32, class: u16 },
    Large { len: u64 },
}

impl DevicePool {
    /// Builds the pool of device `dev` on `backend`.
    pub fn new(backend: Arc<dyn Backend>, dev: usize, cfg: PoolConfig) -> Result<DevicePool> {
        let info = backend.device_info(dev)?;
        let gran = info.granularity;
        let slab_bytes = gran.max(2 << 20);
        let classes = SizeClasses::new(cfg.small_max.min(slab_bytes / 8));
        let max_slabs = (info.total_bytes / slab_bytes + 1).min(1 << 20) as u32;
        let heap = Heap::new(
            backend.clone(),
            dev,
            info.total_bytes.saturating_mul(cfg.va_factor),
        )?;
        let shared = Arc::new(PoolShared {
            dev,
            slabs: Slabs::new(classes, slab_bytes, max_slabs, STREAM_SLOTS),
            heap: Mutex::new(HeapState {
                heap,
                group_events: HashMap::new(),
                free_slab_ids: Vec::new(),
                raw_large: HashMap::new(),
                quarantine: Vec::new(),
                slab_bytes: 0,
                slab_tail_bytes: 0,
            }),
            slab_index: RwLock::new(HashMap::new()),
            pending: PendingList::new(),
            event_pool: Mutex::new(Vec::new()),
            streams: StreamRegistry::new(),
            counters: Counters::new(STREAM_SLOTS + 1),
            raw_streams: Mutex::new(HashMap::new()),
            shut: AtomicBool::new(false),
            backend,
            cfg,
            info,
        });
        let default_stream = shared.stream_for(StreamHandle(0), false);
        Ok(DevicePool {
            shared,
            default_stream,
        })
    }

    /// Device index.
    pub fn device(&self) -> usize {
        self.shared.dev
    }

    /// Facts about the device.
    pub fn info(&self) -> &DeviceInfo {
        &self.shared.info
    }

    /// The configuration in force.
    pub fn config(&self) -> &PoolConfig {
        &self.shared.cfg
    }

    /// The size-class table of the small path.
    pub fn size_classes(&self) -> &SizeClasses {
        &self.shared.slabs.classes
    }

    /// The backend this pool allocates from.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.shared.backend
    }

    /// The device's default (legacy null) stream.
    pub fn default_stream(&self) -> &Stream {
        &self.default_stream
    }

    /// Creates a new stream owned by this pool's device.
    pub fn new_stream(&self) -> Result<Stream> {
        self.shared.check_live()?;
        let h = self.shared.backend.create_stream(self.shared.dev)?;
        Ok(self.shared.stream_for(h, true))
    }

    /// Wraps a stream created elsewhere (e.g. by PyTorch), without owning it.
    pub fn stream_from_raw(&self, handle: StreamHandle) -> Stream {
        self.shared.stream_for(handle, false)
    }

    /// Allocates `size` bytes for use on `stream`. The block is freed,
    /// stream-ordered, when dropped.
    pub fn alloc<'a>(&'a self, size: usize, stream: &'a Stream) -> Result<Block<'a>> {
        let (ptr, kind) = self.shared.alloc(size as u64, stream)?;
        Ok(Block::new(self, stream, ptr, size, kind))
    }

    /// Allocates for a caller that keeps only the pointer (FFI style);
    /// release with [`DevicePool::free_raw`]. Raw blocks are never moved.
    pub fn alloc_raw(&self, size: usize, stream: &Stream) -> Result<DevicePtr> {
        let (ptr, kind) = self.shared.alloc(size as u64, stream)?;
        let mut h = self.shared.heap.lock();
        match kind {
            Kind::Small { idx, .. } => {
                drop(h);
                self.shared.slabs.mark_raw(idx, size as u64);
            }
            Kind::Large { .. } => {
                h.raw_large.insert(ptr.addr(), size as u64);
            }
        }
        Ok(ptr)
    }

    /// Frees a pointer from [`DevicePool::alloc_raw`], ordered after the
    /// work enqueued so far on `stream` (and on streams recorded for it).
    pub fn free_raw(&self, ptr: DevicePtr, stream: &Stream) -> Result<()> {
        self.shared.free_raw(ptr, stream)
    }

    /// Marks a raw pointer as used on `stream` too (PyTorch's
    /// `record_stream`): its free will wait for that stream's work.
    pub fn record_stream_raw(&self, ptr: DevicePtr, stream: &Stream) -> Result<()> {
        self.shared.record_stream_raw(ptr, stream)
    }

    /// Requested size of a live raw allocation, if `ptr` is one.
    pub fn raw_size(&self, ptr: DevicePtr) -> Option<u64> {
        self.shared.raw_size(ptr)
    }

    /// Statistics now.
    pub fn stats(&self) -> PoolStats {
        self.shared.stats()
    }

    /// Resets peaks to the current values.
    pub fn reset_peak_stats(&self) {
        let s = self.stats();
        self.shared.counters.reset_peaks(
            s.reserved_bytes.current,
            s.cached_bytes.current,
            s.pending_bytes.current,
        );
    }

    /// Harvests completed pending frees without blocking; returns how many
    /// records were released.
    pub fn harvest(&self) -> usize {
        self.shared.harvest()
    }

    /// Gives cached memory back to the device: flushes every stream's freed
    /// memory, waits for the pending frees' events (this call, unlike
    /// alloc and free, blocks the host), retires empty slabs and releases
    /// unused physical memory. Returns the bytes given back.
    pub fn trim(&self) -> Result<u64> {
        self.shared.trim()
    }

    /// Checks every invariant of the pool against an independent recount of
    /// its structures. Call while no other thread uses the pool. Returns a
    /// description of the first violation.
    pub fn audit(&self) -> std::result::Result<PoolStats, String> {
        self.shared.audit()
    }

    /// Marks the pool shut down: later calls fail with [`Error::Shutdown`].
    pub fn shutdown(&self) {
        self.shared.shut.store(true, Relaxed);
    }
}

impl Drop for DevicePool {
    fn drop(&mut self) {
        self.shared.shut.store(true, Relaxed);
    }
}

impl PoolShared {
    fn check_live(&self) -> Result<()> {
        if self.shut.load(Relaxed) {
            Err(Error::Shutdown)
        } else {
            Ok(())
        }
    }

    fn stream_for(self: &Arc<Self>, handle: StreamHandle, owned: bool) -> Stream {
        Stream {
            inner: Arc::new(StreamInner {
                device: self.dev,
                handle,
                slot: self.streams.slot_of(handle),
                owned,
                pool: self.clone(),
            }),
        }
    }

    fn check_stream(&self, stream: &Stream) -> Result<()> {
        if stream.device() != self.dev || !std::ptr::eq(stream.pool_ptr(), self) {
            return Err(Error::InvalidHandle(format!(
                "stream {:?} of device {} used with the pool of device {}",
                stream.handle(),
                stream.device(),
                self.dev
            )));
        }
        Ok(())
    }

    fn check_size(&self, size: u64) -> Result<()> {
        if size == 0 {
            return Err(Error::InvalidSize {
                size,
                why: "zero-byte allocation",
            });
        }
        if size > self.info.total_bytes {
            return Err(Error::InvalidSize {
                size,
                why: "larger than the device's memory",
            });
        }
        Ok(())
    }

    #[inline]
    fn shard(slot: Option<u16>) -> usize {
        slot.map_or(SPARE_SHARD, |s| s as usize)
    }

    // ---- allocation ---------------------------------------------------------------

    fn alloc(&self, size: u64, stream: &Stream) -> Result<(DevicePtr, Kind)> {
        self.check_live()?;
        self.check_stream(stream)?;
        self.check_size(size)?;
        let slot = stream.slot();
        let (ptr, kind, rounded) = match self.slabs.classes.class_of(size) {
            Some(class) => {
                let idx = match self.slabs.pop(class, slot.map(usize::from)) {
                    Some(i) => i,
                    None => self.alloc_small_slow(class, size, stream)?,
                };
                let s = self.slabs.slot(idx);
                (
                    DevicePtr(s.addr),
                    Kind::Small {
                        idx,
                        class: class as u16,
                    },
                    self.slabs.classes.size_of(class),
                )
            }
            None => {
                let len = round_large(size);
                let addr = self.alloc_large(len, size, stream)?;
                (DevicePtr(addr), Kind::Large { len }, len)
            }
        };
        self.counters.on_alloc(Self::shard(slot), size, rounded);
        Ok((ptr, kind))
    }

    fn alloc_small_slow(&self, class: usize, size: u64, stream: &Stream) -> Result<u32> {
        let slot = stream.slot().map(usize::from);
        self.harvest();
        if let Some(i) = self.slabs.pop(class, slot) {
            return Ok(i);
        }
        let first = self.new_slab(class, stream);
        match first {
            Ok(Some(i)) => return Ok(i),
            Ok(None) => {}
            Err(e) if !e.is_oom() => return Err(e),
            Err(_) => {}
        }
        // Reclaim: make other streams' free memory reusable, retire empty
        // slabs, then try again; hand pending slots over if allowed.
        self.counters.retries.fetch_add(1, Relaxed);
        self.reclaim();
        if let Some(i) = self.slabs.pop(class, slot) {
            return Ok(i);
        }
        if self.cfg.handover {
            if let Some(i) = self.handover_slots(class, stream) {
                return Ok(i);
            }
        }
        match self.new_slab(class, stream) {
            Ok(Some(i)) => Ok(i),
            Ok(None) => Err(self.oom(size)),
            Err(e) if e.is_oom() => Err(self.oom(size)),
            Err(e) => Err(e),
        }
    }

    /// Carves a new slab for `class` and pops one slot of it (or of any
    /// slot that appeared meanwhile).
    fn new_slab(&self, class: usize, stream: &Stream) -> Result<Option<u32>> {
        let slot = stream.slot();
        let mut h = self.heap.lock();
        // Another thread may have refilled the class while we waited.
        if let Some(i) = self.slabs.pop(class, slot.map(usize::from)) {
            return Ok(Some(i));
        }
        let sb = self.slabs.slab_bytes;
        let taken = self.heap_alloc(&mut h, sb, sb, stream, false)?;
        let reuse = h.free_slab_ids.pop();
        let Some(idxs) = self.slabs.install(class, taken.addr, reuse) else {
            h.heap.free(taken.addr, taken.from).expect("just allocated");
            return Ok(None);
        };
        let id = self.slabs.slab_of(idxs[0]);
        h.slab_bytes += sb;
        h.slab_tail_bytes += self.slabs.tail_bytes(class);
        self.slab_index.write().insert(taken.addr, id);
        let (first, rest) = idxs.split_first().expect("a slab has slots");
        match slot {
            _ if !taken.exclusive => self.slabs.push_clean(class, rest),
            Some(s) => self.slabs.push_dirty_many(class, s as usize, rest),
            // Only this stream may use the slab for now, and it has no
            // dirty stacks: the other slots wait on an event like a free.
            None if !rest.is_empty() => self.park_slots(class, rest.to_vec(), stream.handle(), &[]),
            None => {}
        }
        Ok(Some(*first))
    }

    fn alloc_large(&self, len: u64, size: u64, stream: &Stream) -> Result<u64> {
        {
            let mut h = self.heap.lock();
            match self.heap_alloc(&mut h, len, ALIGN, stream, false) {
                Ok(t) => return Ok(t.addr),
                Err(e) if !e.is_oom() => return Err(e),
                Err(_) => {}
            }
        }
        self.counters.retries.fetch_add(1, Relaxed);
        self.harvest();
        self.reclaim();
        let mut h = self.heap.lock();
        match self.heap_alloc(&mut h, len, ALIGN, stream, self.cfg.handover) {
            Ok(t) => Ok(t.addr),
            Err(e) if e.is_oom() => {
                drop(h);
                Err(self.oom(size))
            }
            Err(e) => Err(e),
        }
    }

    /// One heap allocation for `stream`, with its side effects handled:
    /// the stream waits on any pending groups it takes memory from, and
    /// granules aliased by stitching get an event on the stream.
    fn heap_alloc(
        &self,
        h: &mut HeapState,
        len: u64,
        align: u64,
        stream: &Stream,
        pending_ok: bool,
    ) -> Result<heap::Taken> {
        let device_allocs = h.heap.device_allocs;
        let r = h.heap.alloc(len, align, stream.slot(), pending_ok);
        if h.heap.device_allocs != device_allocs {
            self.counters.grown.fetch_add(1, Relaxed);
        }
        let q = h.heap.take_quarantine();
        if !q.is_empty() {
            let waits = self.record_events(stream.handle(), &[]);
            h.quarantine.push((waits, q));
        }
        let t = r?;
        if !t.waits.is_empty() {
            for id in &t.waits {
                let w = h.group_events.get(id).cloned().unwrap_or_default();
                self.wait_on(stream, &w)?;
            }
            self.counters.handovers.fetch_add(1, Relaxed);
        }
        Ok(t)
    }

    fn oom(&self, requested: u64) -> Error {
        self.counters.ooms.fetch_add(1, Relaxed);
        // Give back what a failed growth left spare, as PyTorch frees its
        // cache before reporting.
        self.heap.lock().heap.release_cached();
        let s = self.stats();
        let largest_free = self.heap.lock().heap.largest_free();
        let report = OomReport {
            device: self.dev,
            requested,
            live: s.allocated_bytes.current,
            reserved: s.reserved_bytes.current,
            cached: s.cached_bytes.current,
            pending: s.pending_bytes.current,
            largest_free,
            capacity: self.info.total_bytes,
        };
        tracing::warn!(device = self.dev, "out of memory: {report}");
        Error::OutOfMemory(Box::new(report))
    }

    // ---- freeing ------------------------------------------------------------------------

    /// Frees a block allocated on `stream` and also used on `extra` streams.
    pub(crate) fn free_block(
        &self,
        ptr: DevicePtr,
        kind: Kind,
        requested: u64,
        stream: &Stream,
        extra: &[StreamHandle],
    ) {
        let slot = stream.slot();
        match kind {
            Kind::Small { idx, class } => {
                let class = class as usize;
                self.counters.on_free(
                    Self::shard(slot),
                    requested,
                    self.slabs.classes.size_of(class),
                );
                match slot {
                    Some(s) if extra.is_empty() => self.slabs.push_dirty(class, s as usize, idx),
                    _ => self.park_slots(class, vec![idx], stream.handle(), extra),
                }
            }
            Kind::Large { len } => {
                self.counters.on_free(Self::shard(slot), requested, len);
                let addr = ptr.addr();
                let mut h = self.heap.lock();
                match slot {
                    Some(s) if extra.is_empty() => {
                        h.heap
                            .free(addr, Tag::Dirty(s))
                            .expect("block is allocated");
                    }
                    _ => {
                        let id = h.heap.new_pending_group();
                        h.heap
                            .free(addr, Tag::Pending(id))
                            .expect("block is allocated");
                        let waits = self.record_events(stream.handle(), extra);
                        h.group_events.insert(id, waits);
                        drop(h);
                        self.counters.pending_frees.fetch_add(1, Relaxed);
                        self.pending.push(Pending::Group { id });
                    }
                }
            }
        }
    }

    /// Records one pooled event on the owning stream and on each extra
    /// stream. A stream whose record fails is kept in `unrecorded`: such
    /// memory is never released by harvesting, only by `trim`, which
    /// synchronizes that stream first.
    fn record_events(&self, own: StreamHandle, extra: &[StreamHandle]) -> Waits {
        let mut w = Waits::default();
        for &s in std::iter::once(&own).chain(extra) {
            match self.record_one(s) {
                Ok(ev) => w.events.push(ev),
                Err(e) => {
                    tracing::error!(device = self.dev, "recording a free's event failed: {e}");
                    w.unrecorded.push(s);
                }
            }
        }
        w
    }

    /// Records a pooled event on stream `s`.
    fn record_one(&self, s: StreamHandle) -> Result<EventHandle> {
        let pooled = self.event_pool.lock().pop();
        let ev = match pooled {
            Some(e) => e,
            None => self.backend.create_event(self.dev)?,
        };
        if let Err(e) = self.backend.record_event(self.dev, ev, s) {
            self.event_pool.lock().push(ev);
            return Err(e);
        }
        Ok(ev)
    }

    fn park_slots(&self, class: usize, slots: Vec<u32>, own: StreamHandle, extra: &[StreamHandle]) {
        let bytes = slots.len() as u64 * self.slabs.classes.size_of(class);
        let waits = self.record_events(own, extra);
        self.counters.pending_slot_bytes.fetch_add(bytes, Relaxed);
        self.counters.pending_frees.fetch_add(1, Relaxed);
        self.pending.push(Pending::Slots {
            class: class as u16,
            slots,
            waits,
            bytes,
        });
    }

    // ---- raw pointers ---------------------------------------------------------------------

    /// The slab id holding `addr`, if it lies in a slab.
    fn slab_holding(&self, addr: u64) -> Option<u32> {
        let base = addr - addr % self.slabs.slab_bytes;
        self.slab_index.read().get(&base).copied()
    }

    fn free_raw(&self, ptr: DevicePtr, stream: &Stream) -> Result<()> {
        self.check_live()?;
        self.check_stream(stream)?;
        let addr = ptr.addr();
        let extra = self.take_raw_streams(addr);
        if let Some(id) = self.slab_holding(addr) {
            let Some(slot) = self.slabs.slot_at(id, addr) else {
                return Err(Error::UnknownPointer {
                    ptr: addr,
                    device: self.dev,
                });
            };
            let requested = self.slabs.unmark_raw(slot.idx).ok_or(Error::DoubleFree {
                ptr: addr,
                device: self.dev,
            })?;
            let kind = Kind::Small {
                idx: slot.idx,
                class: slot.class as u16,
            };
            self.free_block(ptr, kind, requested, stream, &extra);
            return Ok(());
        }
        let (requested, len) = {
            let mut h = self.heap.lock();
            let Some(requested) = h.raw_large.remove(&addr) else {
                return Err(if h.heap.allocated_len(addr).is_some() {
                    Error::InvalidArgument(format!("{addr:#x} is a block, not a raw allocation"))
                } else {
                    Error::UnknownPointer {
                        ptr: addr,
                        device: self.dev,
                    }
                });
            };
            (
                requested,
                h.heap
                    .allocated_len(addr)
                    .expect("raw large blocks are allocated"),
            )
        };
        self.free_block(ptr, Kind::Large { len }, requested, stream, &extra);
        Ok(())
    }

    fn take_raw_streams(&self, addr: u64) -> Vec<StreamHandle> {
        let mut m = self.raw_streams.lock();
        if m.is_empty() {
            return Vec::new();
        }
        m.remove(&addr).unwrap_or_default()
    }

    fn raw_size(&self, ptr: DevicePtr) -> Option<u64> {
        let addr = ptr.addr();
        if let Some(id) = self.slab_holding(addr) {
            let slot = self.slabs.slot_at(id, addr)?;
            return self
                .slabs
                .is_raw_live(slot.idx)
                .then(|| self.slabs.raw_requested(slot.idx));
        }
        self.heap.lock().raw_large.get(&addr).copied()
    }

    fn record_stream_raw(&self, ptr: DevicePtr, stream: &Stream) -> Result<()> {
        self.check_live()?;
        self.check_stream(stream)?;
        if self.raw_size(ptr).is_none() {
            return Err(Error::UnknownPointer {
                ptr: ptr.addr(),
                device: self.dev,
            });
        }
        let mut m = self.raw_streams.lock();
        let v = m.entry(ptr.addr()).or_default();
        if !v.contains(&stream.handle()) {
            v.push(stream.handle());
        }
        Ok(())
    }

    // ---- pending frees ---------------------------------------------------------------------

    /// Whether everything in `w` completed (never, while a stream is unrecorded).
    fn waits_done(&self, w: &Waits) -> bool {
        w.unrecorded.is_empty()
            && w.events
                .iter()
                .all(|&e| match self.backend.query_event(self.dev, e) {
                    Ok(done) => done,
                    Err(err) => {
                        tracing::warn!(device = self.dev, "cuEventQuery failed: {err}");
                        false
                    }
                })
    }

    fn recycle_events(&self, w: Waits) {
        for e in w.events {
            self.event_pool.lock().push(e);
        }
    }

    /// Orders `stream` after everything in `w` on the device.
    fn wait_on(&self, stream: &Stream, w: &Waits) -> Result<()> {
        if !w.unrecorded.is_empty() {
            return Err(Error::InvalidArgument(
                "memory with unrecorded uses cannot be handed over".into(),
            ));
        }
        for &e in &w.events {
            self.backend
                .stream_wait_event(self.dev, stream.handle(), e)?;
        }
        Ok(())
    }

    /// Releases every pending record whose events completed, without blocking.
    fn harvest(&self) -> usize {
        let mut released = self.harvest_quarantine();
        if self.pending.is_empty() {
            return released;
        }
        for p in self.pending.take_all() {
            match p {
                Pending::Slots {
                    class,
                    slots,
                    waits,
                    bytes,
                } => {
                    if self.waits_done(&waits) {
                        self.slabs.push_clean(class as usize, &slots);
                        self.counters.pending_slot_bytes.fetch_sub(bytes, Relaxed);
                        self.recycle_events(waits);
                        released += 1;
                    } else {
                        self.pending.push(Pending::Slots {
                            class,
                            slots,
                            waits,
                            bytes,
                        });
                    }
                }
                Pending::Group { id } => {
                    let mut h = self.heap.lock();
                    let done = h.group_events.get(&id).is_none_or(|w| self.waits_done(w));
                    if done {
                        h.heap.complete_pending(id);
                        if let Some(w) = h.group_events.remove(&id) {
                            self.recycle_events(w);
                        }
                        released += 1;
                    } else {
                        drop(h);
                        self.pending.push(Pending::Group { id });
                    }
                }
            }
        }
        released
    }

    /// Unmaps aliased granules whose old uses completed.
    fn harvest_quarantine(&self) -> usize {
        let mut h = self.heap.lock();
        if h.quarantine.is_empty() {
            return 0;
        }
        let q = std::mem::take(&mut h.quarantine);
        let mut released = 0;
        for (w, gs) in q {
            if self.waits_done(&w) {
                h.heap.release_quarantine(&gs);
                self.recycle_events(w);
                released += 1;
            } else {
                h.quarantine.push((w, gs));
            }
        }
        released
    }

    /// Takes pending slots of `class` for `stream` by ordering the stream
    /// after their events on the device (no host sync).
    fn handover_slots(&self, class: usize, stream: &Stream) -> Option<u32> {
        let slot = stream.slot()? as usize;
        let mut records = self.pending.take_all().into_iter();
        while let Some(p) = records.next() {
            match p {
                Pending::Slots {
                    class: c,
                    slots,
                    waits,
                    bytes,
                } if c as usize == class && waits.unrecorded.is_empty() => {
                    if let Err(e) = self.wait_on(stream, &waits) {
                        tracing::warn!(device = self.dev, "handover failed: {e}");
                        self.pending.push(Pending::Slots {
                            class: c,
                            slots,
                            waits,
                            bytes,
                        });
                        continue;
                    }
                    self.counters.pending_slot_bytes.fetch_sub(bytes, Relaxed);
                    self.counters.handovers.fetch_add(1, Relaxed);
                    self.recycle_events(waits);
                    for other in records {
                        self.pending.push(other);
                    }
                    let (first, rest) = slots.split_first()?;
                    self.slabs.push_dirty_many(class, slot, rest);
                    return Some(*first);
                }
                other => self.pending.push(other),
            }
        }
        None
    }

    /// Moves the memory that stream slot `slot` freed onto the pending list,
    /// with one event recorded on that stream, so that other streams can
    /// reuse it once the event completes.
    fn flush_slot(&self, slot: usize, handle: StreamHandle) {
        for class in 0..self.slabs.classes.len() {
            let idxs = self.slabs.take_dirty(class, slot);
            if !idxs.is_empty() {
                self.park_slots(class, idxs, handle, &[]);
            }
        }
        let mut h = self.heap.lock();
        if let Some((id, _)) = h.heap.flush_dirty(slot as u16) {
            let waits = self.record_events(handle, &[]);
            h.group_events.insert(id, waits);
            drop(h);
            self.pending.push(Pending::Group { id });
        }
    }

    /// Makes free memory reusable across streams and classes: flushes every
    /// stream's dirty memory (the requester gets its own back by handover),
    /// harvests, and retires empty slabs.
    fn reclaim(&self) {
        for slot in 0..STREAM_SLOTS {
            if let Some(h) = self.streams.handle(slot) {
                self.flush_slot(slot, h);
            }
        }
        self.harvest();
        self.retire_empty_slabs();
    }

    /// Returns every slab whose slots are all on its class's clean stack to
    /// the heap.
    fn retire_empty_slabs(&self) -> u64 {
        let mut h = self.heap.lock();
        let mut freed = 0;
        for class in 0..self.slabs.classes.len() {
            let clean = self.slabs.take_clean(class);
            if clean.is_empty() {
                continue;
            }
            let mut per_slab: HashMap<u32, Vec<u32>> = HashMap::new();
            for idx in clean {
                per_slab
                    .entry(self.slabs.slab_of(idx))
                    .or_default()
                    .push(idx);
            }
            let mut keep = Vec::new();
            for (id, idxs) in per_slab {
                let (base, c, n) = self.slabs.slab_info(id);
                if idxs.len() as u32 == n && c == class {
                    self.slab_index.write().remove(&base);
                    self.slabs.retire(id);
                    h.free_slab_ids.push(id);
                    h.heap
                        .free(base, Tag::Clean)
                        .expect("slabs are allocated ranges");
                    h.slab_bytes -= self.slabs.slab_bytes;
                    h.slab_tail_bytes -= self.slabs.tail_bytes(class);
                    freed += self.slabs.slab_bytes;
                } else {
                    keep.extend(idxs);
                }
            }
            self.slabs.push_clean(class, &keep);
        }
        freed
    }

    fn trim(&self) -> Result<u64> {
        self.check_live()?;
        for slot in 0..STREAM_SLOTS {
            if let Some(h) = self.streams.handle(slot) {
                self.flush_slot(slot, h);
            }
        }
        self.sync_pending()?;
        self.harvest();
        self.retire_empty_slabs();
        Ok(self.heap.lock().heap.release_cached())
    }

    /// Blocks until every pending record's uses completed (trim and teardown only).
    fn sync_pending(&self) -> Result<()> {
        let q = std::mem::take(&mut self.heap.lock().quarantine);
        for (w, gs) in q {
            for &e in &w.events {
                self.backend.sync_event(self.dev, e)?;
            }
            for &s in &w.unrecorded {
                self.backend.sync_stream(self.dev, s)?;
            }
            self.heap.lock().heap.release_quarantine(&gs);
            self.recycle_events(w);
        }
        let records = self.pending.take_all();
        let sync = |w: &Waits| -> Result<()> {
            for &e in &w.events {
                self.backend.sync_event(self.dev, e)?;
            }
            for &s in &w.unrecorded {
                self.backend.sync_stream(self.dev, s)?;
            }
            Ok(())
        };
        let mut result = Ok(());
        for p in records {
            let r = match &p {
                Pending::Slots { waits, .. } => sync(waits).map(|()| {
                    let Pending::Slots { waits, .. } = &p else {
                        unreachable!()
                    };
                    waits.clone()
                }),
                Pending::Group { id } => {
                    let h = self.heap.lock();
                    let w = h.group_events.get(id).cloned().unwrap_or_default();
                    drop(h);
                    sync(&w).map(|()| w)
                }
            };
            match r {
                Ok(_) => {
                    // Done: strip unrecorded streams (now synced) so harvest releases it.
                    self.pending.push(Self::mark_synced(p, &self.heap));
                }
                Err(e) => {
                    self.pending.push(p);
                    result = Err(e);
                }
            }
        }
        result
    }

    fn mark_synced(p: Pending, heap: &Mutex<HeapState>) -> Pending {
        match p {
            Pending::Slots {
                class,
                slots,
                mut waits,
                bytes,
            } => {
                waits.unrecorded.clear();
                Pending::Slots {
                    class,
                    slots,
                    waits,
                    bytes,
                }
            }
            Pending::Group { id } => {
                if let Some(w) = heap.lock().group_events.get_mut(&id) {
                    w.unrecorded.clear();
                }
                Pending::Group { id }
            }
        }
    }

    /// A stream is going away: park what it freed, then destroy it if owned.
    pub(crate) fn retire_stream(&self, handle: StreamHandle, slot: Option<u16>, owned: bool) {
        if let Some(s) = slot {
            self.flush_slot(s as usize, handle);
            if owned {
                self.streams.release(s);
            }
        }
        if owned {
            if let Err(e) = self.backend.destroy_stream(self.dev, handle) {
                tracing::warn!(device = self.dev, "cuStreamDestroy failed: {e}");
            }
        }
    }

    // ---- observability -----------------------------------------------------------------

    fn stats(&self) -> PoolStats {
        let (allocated, active, allocs, frees) = self.counters.totals();
        let (reserved, heap_pending, overhead, device_allocs, device_frees) = {
            let h = self.heap.lock();
            let f = h.heap.figures();
            (
                f.reserved,
                f.free_pending,
                h.slab_tail_bytes,
                h.heap.device_allocs,
                h.heap.device_frees,
            )
        };
        let pending = heap_pending + self.counters.pending_slot_bytes.load(Relaxed);
        let cached = reserved.saturating_sub(active + pending + overhead);
        let c = &self.counters;
        c.sample_peaks();
        c.peak_reserved.fetch_max(reserved, Relaxed);
        c.peak_cached.fetch_max(cached, Relaxed);
        c.peak_pending.fetch_max(pending, Relaxed);
        let stat = |current, peak: &std::sync::atomic::AtomicU64| Stat {
            current,
            peak: peak.load(Relaxed).max(current),
        };
        PoolStats {
            device: self.dev,
            allocated_bytes: stat(allocated, &c.peak_allocated),
            reserved_bytes: stat(reserved, &c.peak_reserved),
            active_bytes: stat(active, &c.peak_active),
            cached_bytes: stat(cached, &c.peak_cached),
            pending_bytes: stat(pending, &c.peak_pending),
            overhead_bytes: overhead,
            inactive_split_bytes: active.saturating_sub(allocated),
            num_allocs: allocs,
            num_frees: frees,
            num_device_allocs: device_allocs,
            num_device_frees: device_frees,
            num_allocs_grown: c.grown.load(Relaxed),
            num_alloc_retries: c.retries.load(Relaxed),
            num_ooms: c.ooms.load(Relaxed),
            num_pending_frees: c.pending_frees.load(Relaxed),
            num_handovers: c.handovers.load(Relaxed),
            host_syncs: self.backend.counters().host_syncs_of(self.dev),
            fragmentation: if reserved == 0 {
                0.0
            } else {
                (reserved - allocated.min(reserved)) as f64 / reserved as f64
            },
        }
    }

    fn audit(&self) -> std::result::Result<PoolStats, String> {
        let h = self.heap.lock();
        h.heap.check()?;
        let f = h.heap.figures();
        // Every free slot: on exactly one stack or pending record.
        let mut seen: HashMap<u32, &'static str> = HashMap::new();
        let mut free_slot_bytes = 0u64;
        let mut pending_slot_bytes = 0u64;
        let mut note = |idx: u32, place: &'static str| -> std::result::Result<(), String> {
            match seen.insert(idx, place) {
                Some(other) => Err(format!("slot {idx} is both on {other} and on {place}")),
                None => Ok(()),
            }
        };
        for class in 0..self.slabs.classes.len() {
            let size = self.slabs.classes.size_of(class);
            let clean = self.slabs.take_clean(class);
            for &i in &clean {
                note(i, "a clean stack")?;
                free_slot_bytes += size;
            }
            self.slabs.push_clean(class, &clean);
            for s in 0..STREAM_SLOTS {
                let d = self.slabs.take_dirty(class, s);
                for &i in &d {
                    note(i, "a dirty stack")?;
                    free_slot_bytes += size;
                }
                self.slabs.push_dirty_many(class, s, &d);
            }
        }
        let records = self.pending.take_all();
        let mut check_records = || -> std::result::Result<(), String> {
            for p in &records {
                match p {
                    Pending::Slots {
                        class,
                        slots,
                        bytes,
                        ..
                    } => {
                        for &i in slots {
                            note(i, "the pending list")?;
                        }
                        let b = slots.len() as u64 * self.slabs.classes.size_of(*class as usize);
                        if b != *bytes {
                            return Err(format!("pending record claims {bytes} B, holds {b} B"));
                        }
                        pending_slot_bytes += b;
                    }
                    Pending::Group { id } => {
                        if !h.group_events.contains_key(id) {
                            return Err(format!("pending group {id} has no events"));
                        }
                    }
                }
            }
            Ok(())
        };
        let r = check_records();
        for p in records {
            self.pending.push(p);
        }
        r?;
        for (&i, _) in seen.iter() {
            let (base, _, _) = self.slabs.slab_info(self.slabs.slab_of(i));
            if base == 0 {
                return Err(format!("slot {i} of a retired slab is still free-listed"));
            }
        }
        // Live slot bytes = slab bytes - free - pending - tails.
        let live_slots = h.slab_bytes - free_slot_bytes - pending_slot_bytes - h.slab_tail_bytes;
        let large_live = f.allocated - h.slab_bytes;
        let (allocated, active, _, _) = self.counters.totals();
        drop(h);
        if active != large_live + live_slots {
            return Err(format!(
                "active counter {active} != live large ranges {large_live} + live slots {live_slots}"
            ));
        }
        if allocated > active {
            return Err(format!("allocated {allocated} exceeds active {active}"));
        }
        if pending_slot_bytes != self.counters.pending_slot_bytes.load(Relaxed) {
            return Err("pending slot byte counter drifted".into());
        }
        let stats = self.stats();
        let cached = f.free_clean + f.free_dirty + f.spare + free_slot_bytes;
        let sum = stats.active_bytes.current
            + stats.pending_bytes.current
            + cached
            + stats.overhead_bytes;
        if sum != stats.reserved_bytes.current || cached != stats.cached_bytes.current {
            return Err(format!(
                "reserved {} != active {} + pending {} + cached {cached} + overhead {}",
                stats.reserved_bytes.current,
                stats.active_bytes.current,
                stats.pending_bytes.current,
                stats.overhead_bytes
            ));
        }
        Ok(stats)
    }
}

impl Drop for PoolShared {
    fn drop(&mut self) {
        // Every stream of this pool is gone (they hold the Arc). Wait for
        // pending work, then give everything back.
        let _ = self.sync_pending();
        let mut h = self.heap.lock();
        h.heap.teardown();
        for p in self.pending.take_all() {
            match p {
                Pending::Slots { waits, .. } => self.recycle_events(waits),
                Pending::Group { .. } => {}
            }
        }
        for (_, w) in h.group_events.drain() {
            for e in w.events {
                self.event_pool.lock().push(e);
            }
        }
        for e in std::mem::take(&mut *self.event_pool.lock()) {
            let _ = self.backend.destroy_event(self.dev, e);
        }
    }
}
