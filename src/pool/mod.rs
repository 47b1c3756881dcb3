//! `DevicePool`: one per device, no lock shared between devices.
//!
//! ```text
//!  alloc(size, stream)
//!     ├─ size <= small_max ─► class stacks: dirty[stream] → clean → new slab (heap)
//!     └─ larger ───────────► heap (best fit over VA, granules mapped on demand)
//!  free(block)
//!     ├─ used on its stream only ─► dirty[stream] / Dirty(stream) range: reusable
//!     │                              at once by that stream
//!     ├─ small, record_stream'd ─► events on the other streams → back to
//!     │                             dirty[stream] once they complete
//!     └─ large, record_stream'd ─► events on every stream → pending list →
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

mod addr_index;
mod block;
mod capture;
mod compact_hooks;
mod counted_lock;
mod event_order;
mod event_pool;
mod exact;
mod granule_set;
mod heap;
mod idle;
mod inspect;
mod ipc;
mod large;
mod limits;
#[cfg(all(test, loom))]
mod loom_tests;
mod magazine;
mod maintain;
mod orphans;
mod pause;
mod peer;
mod pending;
mod plan;
mod private_pool;
mod probes;
mod raw;
mod reclaim;
mod release;
mod returning;
mod size_class;
mod size_index;
mod slab_index;
mod small;
mod snapshot;
pub mod stack;
mod stats;
mod stream;
mod stream_large;
pub(crate) mod sync;
mod teardown;
mod thread_state;

pub use block::Block;
pub use compact_hooks::CompactReport;
pub(crate) use compact_hooks::MovableArena;
pub use ipc::{IpcChunk, IpcHandle};
pub use limits::OomCallback;
pub use maintain::MaintainReport;
pub use pause::TagInfo;
pub use plan::PlanStats;
pub use size_class::{SizeClasses, ALIGN};
pub use snapshot::{BlockInfo, BlockState, HistoryAction, HistoryEvent, SegmentInfo, Snapshot};
pub use stats::{PoolStats, Stat};
pub use stream::Stream;

use crate::backend::{Backend, DeviceInfo};
use crate::config::PoolConfig;
use crate::error::{Error, OomReport, Result};
use crate::ptr::{DevicePtr, EventHandle, StreamHandle};
use event_order::Mark;
use heap::{Heap, Tag};
use large::PendingUse;
use parking_lot::Mutex;
use pending::{Pending, PendingList, Waits};
use rustc_hash::FxHashMap as HashMap;
use size_class::round_large;
use small::{SizeWord, Slabs};
use smallvec::SmallVec;
use stats::Counters;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
pub(crate) use stream::StreamCore;
use stream::{StreamRegistry, STREAM_SLOTS};

/// What lives under the heap mutex.
#[derive(Debug)]
struct HeapState {
    heap: Heap,
    /// Events of each pending heap group.
    group_events: HashMap<u32, Waits>,
    /// Slab ids free for reuse.
    /// Retired slab ids by class (an id is only reused within its class).
    free_slab_ids: Vec<Vec<u32>>,
    /// Each class's clean-stack push count at the last slab retirement
    /// pass (`retire_empty_slabs` skips a class whose count is unchanged).
    clean_pushes_seen: Vec<u64>,
    /// Movable regions given back to the heap, to be released to the
    /// device, since compaction last released memory: `(addr, len)`.
    freed_regions: Vec<(u64, u64)>,
    /// Granules aliased by stitching, released when their event completes.
    quarantine: Vec<(Waits, heap::GranuleRuns)>,
    /// Bytes of all slabs, and of slab tails no slot covers.
    slab_bytes: u64,
    slab_tail_bytes: u64,
}

impl HeapState {
    /// Publishes the waits of pending group `id`. A group's waits are
    /// events and unrecorded streams, never promises: handovers and steals
    /// wait on groups under the heap lock, and completing a promise there
    /// could record an event under it (promises live only in small slots'
    /// records, which are handed over outside it; see `probes.rs`).
    fn insert_group(&mut self, id: u32, waits: Waits) {
        debug_assert!(waits.promised.is_empty(), "a heap group took a promise");
        self.group_events.insert(id, waits);
    }
}

/// Attempts at most on the way to out of memory after the host wait, while
/// other threads free memory during them (see `PoolShared::last_attempts`).
const LAST_ATTEMPTS: usize = 3;
/// The longest the last attempts wait for streams retiring on other
/// threads (see `PoolShared::last_attempts`).
const RETIRE_WAIT: std::time::Duration = std::time::Duration::from_millis(100);

/// The state of one device's pool, shared with its streams.
#[derive(Debug)]
pub(crate) struct PoolShared {
    dev: usize,
    backend: Arc<dyn Backend>,
    cfg: PoolConfig,
    info: DeviceInfo,
    slabs: Slabs,
    heap: counted_lock::CountedMutex<HeapState>,
    /// Each stream's parked large ranges and live large blocks, behind
    /// its own lock (see `stream_large.rs`).
    by_stream: stream_large::StreamLarge,
    /// Small slots freed after uses on other streams, on their way back to
    /// the stream that freed them (see `returning.rs`).
    returning: returning::Returning,
    /// The event orders with probes in flight, held so that teardown
    /// finds their events (see `probes.rs`).
    probed: Mutex<Vec<Arc<event_order::EventOrder>>>,
    /// Slab base address -> slab id, for raw frees.
    slab_index: slab_index::SlabIndex,
    pending: PendingList<Pending>,
    /// Records harvests kept back (see `reclaim.rs`).
    kept: reclaim::KeptRecords,
    /// What the last harvest learned of the kept records; held for a whole
    /// harvest pass, so passes run one at a time.
    harvest_gate: Mutex<reclaim::HarvestGate>,
    /// `record_stream`'d frees so far (see `reclaim::PoolShared::pace_harvest`).
    recorded_frees: std::sync::atomic::AtomicU32,
    /// Idle events for reuse, and events pending records share.
    events: event_pool::EventPool,
    streams: StreamRegistry,
    counters: Counters,
    /// Extra streams recorded for raw pointers (`gpupool_record_stream`)
    /// and for blocks ([`Block::record_stream`]), by address.
    recorded_streams: Mutex<HashMap<u64, Vec<Arc<StreamCore>>>>,
    /// Entries of `recorded_streams`: a raw free reads this instead of
    /// taking that mutex when nothing is recorded (the common case).
    recorded_entries: std::sync::atomic::AtomicUsize,
    /// Slots of retired streams still in other threads' magazines.
    tombs: Mutex<orphans::Tombs>,
    /// Whether the pool is shut, and whether alloc and free events are
    /// recorded: one byte, so the small fast lane tests both in one load.
    flags: PoolFlags,
    history: Mutex<History>,
    /// Set once [`PoolShared::teardown`] gave the device memory back: the
    /// pool makes no driver call after that (streams that retire later, from
    /// other threads' caches, only touch host memory).
    torn_down: AtomicBool,
    /// Set when the pool grew: the next maintenance step flushes every
    /// stream's dirty memory, so that memory one stream freed becomes
    /// reusable by the others instead of each stream growing its own cache.
    flush_wanted: AtomicBool,
    /// Whether the heap's quarantine may hold aliases: set with each push
    /// (under the heap lock), cleared when a harvest empties it, so that a
    /// harvest with nothing quarantined takes no heap lock for it.
    quarantined: AtomicBool,
    /// Idle clock of the maintenance step.
    idle: Mutex<maintain::IdleState>,
    /// Held by the runtime's maintenance thread during a tick and by
    /// `audit`, so that an audit never sees a harvest half done.
    maint_gate: Mutex<()>,
    /// Movable blocks: the arena compaction (`src/compact/`) installs.
    movable: compact_hooks::MovableSlot,
    /// The memory limit (shared with the heap) and the out-of-memory
    /// observer (`limits.rs`).
    limits: limits::PoolLimits,
    /// Learned steps (`plan/`): per-stream plans and their arenas.
    plans: plan::Plans,
    /// Tagged blocks, for pause and resume (`pause.rs`).
    tags: pause::TagRegistry,
    /// Memory imported from other processes (`ipc.rs`).
    imports: ipc::Imports,
    /// CUDA graph captures underway and the frees they defer (`capture.rs`).
    capture: capture::Captures,
    /// Private pools: the memory of CUDA graphs (`private_pool.rs`).
    private: private_pool::PrivatePools,
}

thread_local! {
    /// Host-blocking syncs this thread made through the pool, so that an
    /// out-of-memory wait counts its own and not other threads'.
    static HOST_SYNCS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// A pool's shut and recording flags, in one byte.
#[derive(Debug, Default)]
struct PoolFlags(std::sync::atomic::AtomicU8);

impl PoolFlags {
    /// Later calls fail with `Error::Shutdown`.
    const SHUT: u8 = 1;
    /// Alloc and free events are recorded (`record_history`).
    const RECORDING: u8 = 2;

    fn set(&self, flag: u8, on: bool, order: std::sync::atomic::Ordering) {
        if on {
            self.0.fetch_or(flag, order);
        } else {
            self.0.fetch_and(!flag, order);
        }
    }

    #[inline]
    fn shut(&self) -> bool {
        self.0.load(Relaxed) & Self::SHUT != 0
    }

    #[inline]
    fn recording(&self) -> bool {
        self.0.load(Relaxed) & Self::RECORDING != 0
    }

    /// Either flag (the small fast lane serves neither case).
    #[inline(always)]
    fn any(&self) -> bool {
        self.0.load(Relaxed) != 0
    }
}

/// Recorded allocation events.
#[derive(Debug, Default)]
struct History {
    events: Vec<HistoryEvent>,
    start: Option<std::time::Instant>,
}

/// The memory pool of one device. See the module docs for the design.
#[derive(Debug)]
pub struct DevicePool {
    shared: Arc<PoolShared>,
    default_stream: Stream,
}

/// A live large block's record (kept in `stream_large.rs`'s live index).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct LargeLive {
    requested: u64,
    raw: bool,
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
        let max_slab = gran.max(2 << 20);
        let classes = SizeClasses::new(cfg.small_max.min(max_slab / 8));
        let classes_len = classes.len();
        // The heap's shortest request: a large block just over the small
        // classes, or the smallest slab (movable regions are granules).
        let request_floor = round_large(classes.small_max() + 1).min(small::MIN_SLAB);
        let mut heap = Heap::new(
            backend.clone(),
            dev,
            info.total_bytes.saturating_mul(cfg.va_factor),
            request_floor,
        )?;
        let pool_limits = limits::PoolLimits::default();
        pool_limits
            .limit
            .set(limits::configured(&cfg, info.total_bytes));
        heap.limit = pool_limits.limit.clone();
        heap.stitch_budget = cfg.stitch_budget;
        heap.stitch_share = heap::StitchShare::charged(cfg.stitch_share, &cfg.driver_costs);
        let reservation = heap.reservation();
        let shared = Arc::new(PoolShared {
            dev,
            slabs: Slabs::new(classes, max_slab, info.total_bytes, STREAM_SLOTS),
            heap: counted_lock::CountedMutex::new(HeapState {
                heap,
                group_events: HashMap::default(),
                free_slab_ids: vec![Vec::new(); classes_len],
                clean_pushes_seen: vec![u64::MAX; classes_len],
                freed_regions: Vec::new(),
                quarantine: Vec::new(),
                slab_bytes: 0,
                slab_tail_bytes: 0,
            }),
            by_stream: stream_large::StreamLarge::new(STREAM_SLOTS),
            returning: returning::Returning::new(STREAM_SLOTS),
            probed: Mutex::new(Vec::new()),
            slab_index: slab_index::SlabIndex::new(reservation),
            pending: PendingList::new(),
            kept: reclaim::KeptRecords::default(),
            harvest_gate: Mutex::default(),
            recorded_frees: std::sync::atomic::AtomicU32::new(0),
            events: event_pool::EventPool::default(),
            streams: StreamRegistry::new(),
            counters: Counters::new(),
            recorded_streams: Mutex::new(HashMap::default()),
            recorded_entries: std::sync::atomic::AtomicUsize::new(0),
            tombs: Mutex::new(HashMap::default()),
            flags: PoolFlags::default(),
            history: Mutex::new(History::default()),
            torn_down: AtomicBool::new(false),
            flush_wanted: AtomicBool::new(false),
            quarantined: AtomicBool::new(false),
            idle: Mutex::new(maintain::IdleState::default()),
            maint_gate: Mutex::new(()),
            movable: compact_hooks::MovableSlot::new(gran.max(2 << 20).next_power_of_two()),
            limits: pool_limits,
            plans: plan::Plans::new(),
            tags: pause::TagRegistry::default(),
            imports: ipc::Imports::default(),
            capture: capture::Captures::default(),
            private: private_pool::PrivatePools::default(),
            backend,
            cfg,
            info,
        });
        shared.reserve_initial()?;
        let default_stream = shared.stream_for(StreamHandle(0), false);
        // The pool holds the only `PoolShared` reference that ends device
        // memory: streams and per-thread caches may hold the rest.
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

    /// Wraps a stream created elsewhere (e.g. by PyTorch), without owning
    /// it. Wrapping a handle that a live [`Stream`] of this pool already
    /// wraps gives that stream. The pool stops using the handle once every
    /// clone of the wrapper is dropped and every block recorded on it is
    /// freed: do both before the stream's owner destroys it.
    ///
    /// `StreamHandle(0)` and [`StreamHandle::LEGACY`] are the legacy default
    /// stream; [`StreamHandle::PER_THREAD`] is the calling thread's default
    /// stream, and the wrapper stands for that thread's stream only.
    pub fn stream_from_raw(&self, handle: StreamHandle) -> Stream {
        if handle.canonical() == StreamHandle(0) {
            return self.default_stream.clone();
        }
        self.shared.stream_for(handle, false)
    }

    /// Allocates `size` bytes for use on `stream`. The block is freed,
    /// stream-ordered, when dropped.
    #[inline]
    pub fn alloc<'a>(&'a self, size: usize, stream: &'a Stream) -> Result<Block<'a>> {
        if let Some((ptr, idx, class, word)) = self.shared.alloc_front(size as u64, stream, false) {
            // SAFETY: the fast lane serves only a stream of this pool, and
            // the word is the slot's in this pool's slabs (the rack's
            // invariant).
            return Ok(unsafe { Block::small(stream, ptr, idx, class, word) });
        }
        let (ptr, kind) = self.shared.alloc(size as u64, stream, false)?;
        Ok(self.shared.block(stream, ptr, size, kind))
    }

    /// Allocates for a caller that keeps only the pointer (FFI style);
    /// release with [`DevicePool::free_raw`]. Raw blocks are never moved.
    #[inline]
    pub fn alloc_raw(&self, size: usize, stream: &Stream) -> Result<DevicePtr> {
        match self.shared.alloc_front(size as u64, stream, true) {
            Some((ptr, ..)) => Ok(ptr),
            None => Ok(self.shared.alloc(size as u64, stream, true)?.0),
        }
    }

    /// Frees a pointer from [`DevicePool::alloc_raw`], ordered after the
    /// work enqueued so far on `stream` (and on streams recorded for it).
    #[inline]
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

    /// Device memory held now (cheaper than [`DevicePool::stats`]).
    pub fn reserved_bytes(&self) -> u64 {
        self.shared.heap.lock_quiet().heap.reserved()
    }

    /// Resets peaks to the current values.
    pub fn reset_peak_stats(&self) {
        let s = self.stats();
        self.shared.counters.reset_peaks(&stats::PeakReset::of(&s));
    }

    /// Harvests completed pending frees without blocking; returns how many
    /// records were released. Every event is asked about afresh: the
    /// pool's own passes take an event found pending a moment ago as
    /// still pending for a short while (10 to 50 µs), this call does not.
    pub fn harvest(&self) -> usize {
        self.shared.harvest_now()
    }

    /// Gives cached memory back to the device: flushes every stream's freed
    /// memory, waits for the pending frees' events (this call, unlike
    /// alloc and free, blocks the host), retires empty slabs and releases
    /// unused physical memory. Returns the bytes given back.
    pub fn trim(&self) -> Result<u64> {
        self.shared.trim()
    }

    /// Empties the calling thread's per-thread caches of this pool into the
    /// shared free lists (done by `trim`, `audit` and `snapshot` too).
    pub fn flush_thread_cache(&self) {
        magazine::flush_for(&self.shared);
    }

    /// Checks every invariant of the pool against an independent recount of
    /// its structures. Call while no other thread uses the pool. Returns a
    /// description of the first violation.
    pub fn audit(&self) -> std::result::Result<PoolStats, String> {
        self.shared.audit()
    }

    /// The pool's memory now, in PyTorch's snapshot layout (segments
    /// holding blocks), with the recorded history. Exact while no other
    /// thread uses the pool (slots cached in another live thread's
    /// magazine show as allocated); a diagnostic, not a fast call.
    pub fn snapshot(&self) -> Snapshot {
        self.shared.snapshot()
    }

    /// Turns recording of alloc/free events on (clearing earlier ones) or off.
    pub fn record_history(&self, on: bool) {
        let mut h = self.shared.history.lock();
        if on {
            h.events.clear();
            h.start = Some(std::time::Instant::now());
        }
        self.shared.flags.set(PoolFlags::RECORDING, on, Relaxed);
    }

    /// The events recorded so far.
    pub fn history(&self) -> Vec<HistoryEvent> {
        self.shared.history()
    }

    /// Marks a step boundary: call it once per training step (or served
    /// batch), at the same point of each. From the second mark on, each
    /// stream's large requests that repeat the recorded step are served
    /// from a placement planned for that step's lifetimes, in one arena:
    /// no heap lock and no driver call per request, reserved memory close
    /// to the step's peak of live bytes. A step that departs from its plan
    /// is served dynamically from that request on, and recorded anew. See
    /// `src/pool/plan/` for the rules.
    pub fn mark_step(&self) -> Result<()> {
        self.shared.check_live()?;
        self.shared.refuse_during_capture("mark_step")?;
        self.shared.mark_step();
        Ok(())
    }

    /// Figures of the learned steps ([`DevicePool::mark_step`]).
    pub fn plan_stats(&self) -> PlanStats {
        self.shared.plans.stats()
    }

    /// Marks the pool shut down: later calls fail with [`Error::Shutdown`].
    pub fn shutdown(&self) {
        self.shared.flags.set(PoolFlags::SHUT, true, Relaxed);
    }
}

impl Drop for DevicePool {
    fn drop(&mut self) {
        // This thread's magazines hold the pool's streams: empty them.
        // Other threads' magazines may keep `PoolShared` (host memory
        // only) alive; the device memory goes now, whatever they hold.
        magazine::flush_for(&self.shared);
        self.shared.teardown();
    }
}

impl PoolShared {
    fn check_live(&self) -> Result<()> {
        if self.flags.shut() {
            Err(Error::Shutdown)
        } else {
            Ok(())
        }
    }

    fn stream_for(self: &Arc<Self>, handle: StreamHandle, owned: bool) -> Stream {
        let core = StreamCore::new(self.backend.clone(), self.dev, handle, owned);
        self.streams.register(self, core)
    }

    /// Whether the pool gave its device memory back (no driver calls).
    pub(crate) fn is_torn_down(&self) -> bool {
        self.torn_down.load(std::sync::atomic::Ordering::Acquire)
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

    // ---- allocation ---------------------------------------------------------------

    /// The fast lane of an allocation: a small slot from this thread's
    /// magazine of `stream` (`magazine.rs`), counted; `None` sends the caller to
    /// [`PoolShared::alloc`], which also makes every check's error.
    /// Returns the pointer, the slot and its class, and the slot's size
    /// word.
    #[inline(always)]
    fn alloc_front(
        &self,
        size: u64,
        stream: &Stream,
        raw: bool,
    ) -> Option<(DevicePtr, u32, u16, SizeWord)> {
        let class = self.slabs.classes.class_of(size)?;
        if self.flags.any()
            || !std::ptr::eq(stream.pool_ptr(), self)
            || (raw && self.capture.any_routed())
        {
            return None;
        }
        let (idx, addr, word) = magazine::alloc_front(stream, class, size)?;
        // The rack's invariant, checked in debug builds (a word that
        // strayed to another slot would write that slot's size).
        debug_assert_eq!(word, self.slabs.size_word(idx));
        // SAFETY: the slot came from this thread's magazine of `stream`, whose
        // pool is this one (checked above): its rack keeps the slot's size
        // word in this pool's slabs.
        unsafe { self.slabs.note_alloc_at(word, size, raw) };
        Some((DevicePtr(addr), idx, class as u16, word))
    }

    /// A typed block for what [`PoolShared::alloc`] (or a tagged
    /// allocation) returned on `stream`, a stream of this pool: a small
    /// one carries its slot's size word.
    #[inline]
    pub(crate) fn block<'a>(
        &self,
        stream: &'a Stream,
        ptr: DevicePtr,
        size: usize,
        kind: Kind,
    ) -> Block<'a> {
        // The allocation checked it; the block's safety rests on it.
        assert!(
            std::ptr::eq(stream.pool_ptr(), self),
            "a stream of this pool"
        );
        match kind {
            // SAFETY: the word is looked up in this pool's slabs, and
            // `stream` is of this pool (asserted above).
            Kind::Small { idx, class } => unsafe {
                Block::small(stream, ptr, idx, class, self.slabs.size_word(idx))
            },
            Kind::Large { .. } => Block::new(stream, ptr, size, kind),
        }
    }

    fn alloc(&self, size: u64, stream: &Stream, raw: bool) -> Result<(DevicePtr, Kind)> {
        if let Some(routed) = self.route_raw(size, stream, raw) {
            return routed.map(|p| (p, Kind::Large { len: 0 }));
        }
        self.check_live()?;
        self.check_stream(stream)?;
        self.check_size(size)?;
        let slot = stream.slot();
        let mut from_magazine = false;
        let (ptr, kind, rounded) = match self.slabs.classes.class_of(size) {
            Some(class) => {
                let rounded = self.slabs.classes.size_of(class);
                let kind = |idx| Kind::Small {
                    idx,
                    class: class as u16,
                };
                let cached = match slot {
                    Some(_) if self.cfg.thread_cache => magazine::take(stream, class),
                    _ => None,
                };
                from_magazine = cached.is_some();
                let (idx, addr) = match cached {
                    Some(got) => got,
                    None => {
                        let idx = match self.slabs.pop(class, slot.map(usize::from)) {
                            Some(i) => i,
                            None => self.alloc_small_slow(class, size, stream)?,
                        };
                        (idx, self.slabs.slot(idx).addr)
                    }
                };
                self.slabs.note_alloc(idx, size, raw);
                (DevicePtr(addr), kind(idx), rounded)
            }
            None => {
                let len = round_large(size);
                let live = LargeLive {
                    requested: size,
                    raw,
                };
                let planned = match slot {
                    Some(s) if self.plans.enabled() => self.plan_serve(stream, s, len, live),
                    _ => plan::Serve::Dynamic { record: false },
                };
                let (addr, len) = match planned {
                    plan::Serve::Planned(addr) => {
                        if raw {
                            self.by_stream.insert(slot, addr, len, live);
                        }
                        (addr, len)
                    }
                    plan::Serve::Dynamic { record } => {
                        let (addr, got) = self.alloc_large(len, live, stream)?;
                        if let (true, Some(s)) = (record, slot) {
                            self.plan_note_alloc(s, addr, len);
                        }
                        (addr, got)
                    }
                };
                (DevicePtr(addr), Kind::Large { len }, len)
            }
        };
        self.counters.on_alloc_from(size, rounded, from_magazine);
        if self.flags.recording() {
            self.record(HistoryAction::Alloc, ptr.addr(), size, stream.handle());
        }
        Ok((ptr, kind))
    }

    fn alloc_small_slow(&self, class: usize, size: u64, stream: &Stream) -> Result<u32> {
        self.counters.small_slow.fetch_add(1, Relaxed);
        let slot = stream.slot().map(usize::from);
        // Slots this stream freed after uses on other streams whose uses
        // completed since (see `returning.rs`): before any driver call.
        if let Some(s) = stream.slot() {
            if self.settle_returning(s) {
                if let Some(i) = self.slabs.pop(class, slot) {
                    return Ok(i);
                }
            }
        }
        self.detect_capture(stream);
        // Another stream's dirty slots, where that stream is idle (a
        // query, no event): before a harvest pass, which asks about every
        // pending free and at 8 streams rarely served the request (half
        // the allocation p99 with `record_stream`, less driver time).
        if let Some(i) = self.take_idle_dirty(class, slot) {
            return Ok(i);
        }
        self.try_harvest();
        if let Some(i) = self.slabs.pop(class, slot) {
            return Ok(i);
        }
        // Growth before handover of memory behind streams that are not
        // draining (see `alloc_large`).
        let first = self.new_slab(class, stream, PendingUse::Draining);
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
        if self.handover_ok() {
            if let Some(i) = self.handover_slots(class, stream) {
                return Ok(i);
            }
        }
        match self.new_slab(class, stream, PendingUse::Any) {
            Ok(Some(i)) => return Ok(i),
            Ok(None) => {}
            Err(e) if e.is_oom() => {}
            Err(e) => return Err(e),
        }
        // The way to out of memory: wait for what is in flight, then the
        // last attempts.
        self.wait_before_oom();
        let last = self.last_attempts(|| {
            if let Some(i) = self.slabs.pop(class, slot) {
                return Ok(Some(i));
            }
            match self.new_slab(class, stream, PendingUse::Any) {
                Err(e) if e.is_oom() => Ok(None),
                r => r,
            }
        })?;
        last.ok_or_else(|| self.oom(size))
    }

    /// `cuEventSynchronize`, counted in this thread's [`HOST_SYNCS`]. An
    /// error while a capture is underway (see `capture.rs`).
    pub(crate) fn host_sync_event(&self, e: EventHandle) -> Result<()> {
        HOST_SYNCS.with(|c| c.set(c.get() + 1));
        self.outside_capture(|| self.backend.sync_event(self.dev, e))
            .ok_or_else(|| self.capture_error("a host wait"))?
    }

    /// `cuStreamSynchronize`, counted in this thread's [`HOST_SYNCS`]. An
    /// error while a capture is underway.
    pub(crate) fn host_sync_stream(&self, s: StreamHandle) -> Result<()> {
        HOST_SYNCS.with(|c| c.set(c.get() + 1));
        self.outside_capture(|| self.backend.sync_stream(self.dev, s))
            .ok_or_else(|| self.capture_error("a host wait"))?
    }

    /// The last step before out of memory (invariant 3's one exception):
    /// every stream's freed memory to the pending list, then a host wait
    /// for every pending free and quarantined alias, so that all memory not
    /// live is reusable. Counts the wait and its host syncs.
    fn wait_before_oom(&self) {
        // No host wait during a capture (PyTorch's rule): fail instead.
        if self.capture.underway() {
            return;
        }
        let before = HOST_SYNCS.with(|c| c.get());
        self.plan_release_idle();
        self.flush_all_streams();
        if let Err(e) = self.sync_pending() {
            tracing::warn!(device = self.dev, "waiting before out of memory: {e}");
        }
        // Records another thread has detached for harvesting are not on
        // the list just now: complete their heap groups from here.
        self.complete_groups_on_host();
        self.harvest();
        self.retire_empty_slabs();
        let syncs = HOST_SYNCS.with(|c| c.get()) - before;
        self.counters.oom_waits.fetch_add(1, Relaxed);
        self.counters.oom_host_syncs.fetch_add(syncs, Relaxed);
    }

    /// The last attempts before out of memory, after [`wait_before_oom`]:
    /// `attempt` runs after every stream's freed memory is flushed (one
    /// event per stream, no wait) and harvested, and again, up to
    /// [`LAST_ATTEMPTS`] times, while other threads freed memory during
    /// the previous one.
    ///
    /// Why: other threads go on freeing on their own streams while this
    /// one waits on the host, and that memory is dirty on those streams,
    /// which no other stream may take, nor stitch its idle granules, until
    /// an event covers its uses. Flushed, it is pending behind those
    /// events and the attempt takes it by handover (a device wait). A
    /// request failed beside hundreds of MiB that other threads had just
    /// freed (`tests/false_oom.rs` under CPU contention).
    ///
    /// A stream that retires on another thread is no longer found among
    /// the live streams, and what it freed is dirty on its slot until its
    /// retirement flushes it: each attempt first waits for retirements in
    /// progress (host work of microseconds, unless that thread is
    /// descheduled), up to [`RETIRE_WAIT`]. A request failed beside the
    /// 328 MiB a thread had freed on its stream just before it exited.
    ///
    /// [`wait_before_oom`]: PoolShared::wait_before_oom
    fn last_attempts<T>(
        &self,
        mut attempt: impl FnMut() -> Result<Option<T>>,
    ) -> Result<Option<T>> {
        let deadline = std::time::Instant::now() + RETIRE_WAIT;
        for _ in 0..LAST_ATTEMPTS {
            while self.streams.any_retiring() && std::time::Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_micros(50));
            }
            let frees = self.counters.totals().3;
            self.flush_all_streams();
            self.harvest();
            if let Some(t) = attempt()? {
                return Ok(Some(t));
            }
            if self.counters.totals().3 == frees && !self.streams.any_retiring() {
                break;
            }
        }
        Ok(None)
    }

    /// Carves a new slab for `class` and pops one slot of it (or of any
    /// slot that appeared meanwhile); from `pending` memory by handover
    /// too.
    fn new_slab(&self, class: usize, stream: &Stream, pending: PendingUse) -> Result<Option<u32>> {
        let slot = stream.slot();
        let sb = self.slabs.slab_bytes(class);
        let (mut cleaned, mut flushed) = (false, false);
        let (mut h, taken) = loop {
            let mut h = self.heap.lock();
            // Another thread may have refilled the class while we waited.
            if let Some(i) = self.slabs.pop(class, slot.map(usize::from)) {
                return Ok(Some(i));
            }
            if let Some(t) = h.heap.alloc_backed(sb, sb, slot) {
                break (h, t);
            }
            self.unpark(&mut h);
            // Before growth, as on the large path (`alloc_large`): other
            // streams' freed memory, clean where their streams are idle
            // (a query each), else flushed (one event each, no wait) and
            // harvested, when it would cover the slab. Without this a
            // server's streams each kept a cache of their own and slabs
            // grew the device (reserved 2.3x live on 8 streams, 1.2x on 1).
            if !flushed
                && pending == PendingUse::Draining
                && h.heap.dirty_elsewhere_at_least(slot, sb)
            {
                drop(h);
                if !cleaned {
                    cleaned = true;
                    if self.clean_idle_streams(slot) {
                        continue;
                    }
                }
                flushed = true;
                self.flush_all_streams();
                self.try_harvest();
                continue;
            }
            let t = self.heap_alloc(&mut h, sb, sb, stream, pending)?;
            break (h, t);
        };
        let reuse = h.free_slab_ids[class].pop();
        let Some(idxs) = self.slabs.install(class, taken.addr, reuse) else {
            h.heap.free(taken.addr, taken.from).expect("just allocated");
            return Ok(None);
        };
        let id = self.slabs.slab_of(idxs[0]);
        h.slab_bytes += sb;
        h.slab_tail_bytes += self.slabs.tail_bytes(class);
        self.slab_index
            .insert(taken.addr, sb, self.slabs.header_ptr(id));
        let (first, rest) = idxs.split_first().expect("a slab has slots");
        match slot {
            // The creator keeps a run of the first slots (as a refill from
            // the clean stack would give it), so that its slots and another
            // stream's never share a cache line of links.
            Some(s) if !taken.exclusive => {
                let run = rest.len().min(small::REFILL - 1);
                self.slabs.push_dirty_many(class, s as usize, &rest[..run]);
                self.slabs.push_clean(class, &rest[run..]);
            }
            _ if !taken.exclusive => self.slabs.push_clean(class, rest),
            Some(s) => self.slabs.push_dirty_many(class, s as usize, rest),
            // Only this stream may use the slab for now, and it has no
            // dirty stacks: the other slots wait on an event like a free.
            None if !rest.is_empty() => self.park_slots(class, rest.to_vec(), stream.core(), &[]),
            None => {}
        }
        Ok(Some(*first))
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
            live: s.requested_bytes.current,
            reserved: s.reserved_bytes.current,
            cached: s.cached_bytes.current,
            pending: s.pending_bytes.current,
            largest_free,
            capacity: self.info.total_bytes,
        };
        tracing::warn!(device = self.dev, "out of memory: {report}");
        self.limits.report_oom(&report);
        Error::OutOfMemory(Box::new(report))
    }

    // ---- freeing ------------------------------------------------------------------------

    /// The stream slot a raw large free on `stream` parks at once, without
    /// the general path's steps: none while a capture, history recording,
    /// learned steps or tagged blocks ask for those steps.
    #[inline]
    fn parks_at_once(&self, stream: &Stream) -> Option<u16> {
        let quiet = !self.capture.underway()
            && !self.flags.recording()
            && !self.plans.enabled()
            && self.tags.is_empty();
        stream.slot().filter(|_| quiet)
    }

    /// Logs an allocation or free in the recorded history.
    fn record(&self, action: HistoryAction, addr: u64, size: u64, stream: StreamHandle) {
        let mut h = self.history.lock();
        let time_us = h.start.map_or(0, |t| t.elapsed().as_micros() as u64);
        h.events.push(HistoryEvent {
            action,
            addr,
            size,
            stream: stream.raw(),
            time_us,
        });
    }

    /// The fast lane of a small free used on its own stream only: into this
    /// thread's magazine of `stream` if it has one with room (such a
    /// free is never deferred by a capture: see `defer_free`); `false` if
    /// the caller must call [`PoolShared::free_block`]. `stream` is of
    /// this pool; `word` is the slot's size word in this pool's slabs.
    #[inline(always)]
    pub(crate) fn free_small_front(
        &self,
        ptr: DevicePtr,
        idx: u32,
        class: u16,
        requested: u64,
        stream: &Stream,
        word: SizeWord,
    ) -> bool {
        debug_assert!(std::ptr::eq(stream.pool_ptr(), self));
        let class = class as usize;
        if self.flags.recording() {
            return false;
        }
        magazine::free_front(stream, class, idx, ptr.addr(), requested, word)
    }

    /// Frees a block allocated on `stream` and also used on `extra`
    /// streams. A raw large block must be out of the live index already
    /// (`free_raw` takes it out to check it; see `stream_large.rs`).
    pub(crate) fn free_block(
        &self,
        ptr: DevicePtr,
        kind: Kind,
        requested: u64,
        stream: &Stream,
        extra: &[Arc<StreamCore>],
    ) {
        if self.defer_free(ptr, kind, requested, stream, extra) {
            return;
        }
        if self.flags.recording() {
            self.record(
                HistoryAction::FreeRequested,
                ptr.addr(),
                requested,
                stream.handle(),
            );
        }
        let slot = stream.slot();
        match kind {
            Kind::Small { idx, class } => {
                let class = class as usize;
                let rounded = self.slabs.classes.size_of(class);
                let kept = slot.is_some()
                    && extra.is_empty()
                    && self.cfg.thread_cache
                    && magazine::put(stream, class, idx, ptr.addr());
                self.counters.on_free_to(requested, rounded, kept);
                match slot {
                    _ if kept => {}
                    Some(s) if extra.is_empty() => self.slabs.push_dirty(class, s as usize, idx),
                    Some(s) => self.return_slot(s, class, idx, stream.core(), extra),
                    None => self.park_slots(class, vec![idx], stream.core(), extra),
                }
            }
            Kind::Large { len } => {
                self.counters.on_free(requested, len);
                let addr = ptr.addr();
                if self.plans.enabled() && self.plan_free(addr, stream, extra) {
                    return;
                }
                // Tagged blocks are never parked (see `pause.rs`).
                let tagged = self.tags.forget(addr);
                let own_stream_only = slot.is_some() && extra.is_empty();
                if let (Some(s), true, None) = (slot, own_stream_only, tagged) {
                    // Parked under the stream's own lock, not the heap's.
                    self.by_stream.park(s, len, addr);
                    return;
                }
                // A free that waits on events records them before taking
                // the heap lock: no driver call runs under it. The block is
                // still allocated until the free below publishes it.
                let mut waits = (!own_stream_only && tagged != Some(true))
                    .then(|| self.record_events(stream.core(), extra));
                let mut h = self.heap.lock();
                match slot {
                    // Paused: unmapped after a host wait, no use remains.
                    _ if tagged == Some(true) => {
                        h.heap.free(addr, Tag::Clean).expect("block is allocated");
                    }
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
                        let waits = waits.take().expect("recorded above");
                        h.insert_group(id, waits);
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
    fn record_events(&self, own: &Arc<StreamCore>, extra: &[Arc<StreamCore>]) -> Waits {
        let mut w = self.record_events_on(std::slice::from_ref(own));
        w.absorb(self.record_events_on(extra));
        w
    }

    /// Records one pooled event on each of `streams` (see
    /// [`PoolShared::record_events`]).
    fn record_events_on(&self, streams: &[Arc<StreamCore>]) -> Waits {
        let mut w = Waits::default();
        for s in streams {
            match self.record_on(s) {
                Ok((ev, mark)) => w.push(ev, mark),
                Err(e) => {
                    tracing::error!(device = self.dev, "recording a free's event failed: {e}");
                    w.unrecorded.push(s.clone());
                }
            }
        }
        w
    }

    /// Records a pooled event on the stream of `core`. A per-thread default
    /// stream of another thread cannot be named from this one: the event
    /// goes on the legacy default stream, which CUDA orders after the work
    /// of every blocking stream, per-thread default streams included.
    /// The event is numbered in the stream's order (see `event_order.rs`)
    /// when it is recorded on the stream's own handle.
    pub(crate) fn record_on(&self, core: &StreamCore) -> Result<(EventHandle, Option<Mark>)> {
        if core.is_dead() {
            return Err(Error::InvalidHandle(format!(
                "stream {:?} was destroyed with its pool",
                core.handle
            )));
        }
        match core.thread {
            Some(t) if t != std::thread::current().id() => {
                Ok((self.record_one(StreamHandle(0))?, None))
            }
            _ => {
                let (ev, mark) = core.order.record(|| self.record_one(core.handle))?;
                Ok((ev, Some(mark)))
            }
        }
    }

    /// Records a pooled event on stream `s`.
    fn record_one(&self, s: StreamHandle) -> Result<EventHandle> {
        let pooled = self.events.take();
        let ev = match pooled {
            Some(e) => e,
            None => self.backend.create_event(self.dev)?,
        };
        // Never on a stream the pool knows captures (see `capture.rs`).
        let r = self
            .unless_capturing(s, || self.backend.record_event(self.dev, ev, s))
            .unwrap_or_else(|| Err(self.capture_error("an event record on a capturing stream")));
        if let Err(e) = r {
            self.events.give_back(ev);
            return Err(e);
        }
        Ok(ev)
    }

    /// A slot freed on stream slot `s` (of `own`) after uses on `extra`:
    /// one event on each of those, and back to `s` once they complete
    /// (see `returning.rs`). A stream whose event could not be recorded
    /// sends it down the general path, behind an event on `own` too.
    fn return_slot(
        &self,
        s: u16,
        class: usize,
        idx: u32,
        own: &Arc<StreamCore>,
        extra: &[Arc<StreamCore>],
    ) {
        let bytes = self.slabs.classes.size_of(class);
        let extra: SmallVec<[&Arc<StreamCore>; 2]> = extra.iter().collect();
        let mut waits = self.waits_on(&extra);
        self.counters.pending_slot_bytes.fetch_add(bytes, Relaxed);
        self.counters.pending_frees.fetch_add(1, Relaxed);
        if waits.unrecorded.is_empty() {
            let e = returning::Entry {
                class: class as u16,
                idx,
                waits,
                owner_done: event_order::Mark::next(&own.order),
            };
            match self.returning.push(s, e) {
                Ok(()) => return,
                Err(e) => waits = e.waits,
            }
        }
        waits.absorb(self.waits_on(&[own]));
        self.pending.push(Pending::Slots {
            class: class as u16,
            slots: vec![idx],
            waits,
            bytes,
        });
    }

    fn park_slots(
        &self,
        class: usize,
        slots: Vec<u32>,
        own: &Arc<StreamCore>,
        extra: &[Arc<StreamCore>],
    ) {
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
}
