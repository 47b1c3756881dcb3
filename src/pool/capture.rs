//! CUDA graph capture awareness: what the pool does, and does not do,
//! while a stream of its device captures a graph.
//!
//! A capture records the work enqueued on a stream into a graph instead of
//! running it. Driver calls made meanwhile can break it: an event recorded
//! on the capturing stream becomes a node of the graph (querying it later
//! fails), a stream wait on an outside event joins the capture to work
//! outside it, and in the default global capture mode any event query or
//! synchronization, on any thread, invalidates the capture. Unmapping or
//! releasing memory is never safe: the graph keeps the addresses it saw.
//! PyTorch's caching allocator follows the same rules
//! (`captures_underway`, `insert_events_deferred_until_no_capture`).
//!
//! **What the pool knows.** A capture is *underway* for a stream from
//! [`DevicePool::begin_allocate_to_pool`] (PyTorch calls it before
//! `cudaStreamBeginCapture`) until [`DevicePool::end_allocate_to_pool`]
//! (after `cudaStreamEndCapture`), or from when an allocation slow path on
//! that stream finds it capturing (`cuStreamIsCapturing`, asked only where
//! the pool would otherwise query events or grow) until a later slow path
//! or maintenance tick finds the capture over. One counter, `underway`,
//! says whether any is; the fast path never reads it.
//!
//! **The rules while any capture is underway on the device:**
//!
//! * no event query, event or stream synchronization and no stream wait on
//!   an event (harvesting, handover and the fallbacks that wait on the host
//!   are skipped; `trim`, `settle` and `compact` fail with `InvalidArgument`);
//! * no event record on a capturing stream: a free that would record one
//!   (a `record_stream`'d block, a stream without a slot, a planned block
//!   freed off its stream) is *deferred*, as PyTorch defers its events, and
//!   made when the last capture ends; until then it counts as allocated;
//! * no unmap and no release of physical memory: stitching steals no
//!   granule, idle release, trimming, compaction and quarantine release
//!   wait (the heap's `capture_hold`, set under the heap lock);
//! * new memory may still be created and mapped (not a stream operation;
//!   the CUDA backend makes those calls in relaxed capture mode, as PyTorch
//!   does `cudaMalloc` during a capture): an allocation that needs it grows
//!   the pool.
//!
//! **The guarantee.** For captures the pool is told about, exact: every
//! call those rules forbid is made between two checks of `underway` under a
//! handshake (`inflight`, below) that [`PoolShared::begin`] waits out, so no
//! such call runs once `begin_allocate_to_pool` has returned. Heap unmaps
//! check `capture_hold` under the heap lock; a mapping job that unmaps
//! after releasing it is in the handshake from its plan on. For a capture begun without
//! telling the pool, the rules apply from its detection on: the work of
//! other threads between the capture's start and that detection is not
//! covered (a maintenance tick may query an event), nor is a free on the
//! capturing stream before any allocation slow path ran on it.

use super::stream::Stream;
use super::{DevicePool, Kind, PoolShared, StreamCore};
use crate::error::{Error, Result};
use crate::ptr::{DevicePtr, StreamHandle};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;

/// A stream the pool knows captures.
#[derive(Debug)]
struct Entry {
    stream: Stream,
    /// The private pool its allocations go to (0: none, a detected capture).
    pool: u64,
}

/// A free whose event records wait for the end of every capture.
#[derive(Debug)]
struct Deferred {
    ptr: DevicePtr,
    kind: Kind,
    requested: u64,
    stream: Stream,
    extra: Vec<Arc<StreamCore>>,
}

/// The capture state of one pool.
#[derive(Debug, Default)]
pub(crate) struct Captures {
    entries: Mutex<Vec<Entry>>,
    /// `entries.len()`: whether any capture is underway.
    underway: AtomicUsize,
    /// Entries routed to a private pool (read on the allocation path).
    routed: AtomicUsize,
    /// Calls a capture forbids, in flight now (see [`PoolShared::outside_capture`]).
    inflight: AtomicUsize,
    deferred: Mutex<Vec<Deferred>>,
}

fn same(a: &Stream, b: &Stream) -> bool {
    Arc::ptr_eq(a.core(), b.core())
        || (a.handle() == b.handle() && a.handle() != StreamHandle::PER_THREAD)
}

impl Captures {
    /// Whether any capture is underway (one load).
    pub(crate) fn underway(&self) -> bool {
        self.underway.load(SeqCst) != 0
    }

    /// Whether any stream is routed to a private pool (one relaxed load).
    #[inline]
    pub(super) fn any_routed(&self) -> bool {
        self.routed.load(std::sync::atomic::Ordering::Relaxed) != 0
    }

    /// The private pool `s` is routed to, if any.
    pub(super) fn route_of(&self, s: &Stream) -> Option<u64> {
        self.entries
            .lock()
            .iter()
            .find(|e| e.pool != 0 && same(&e.stream, s))
            .map(|e| e.pool)
    }

    /// Whether the pool knows `h` captures (the legacy stream counts while
    /// any capture is underway: CUDA orders it after every blocking stream).
    fn captures(&self, h: StreamHandle) -> bool {
        if !self.underway() {
            return false;
        }
        h.canonical() == StreamHandle(0)
            || self.entries.lock().iter().any(|e| e.stream.handle() == h)
    }

    fn knows(&self, s: &Stream) -> bool {
        self.underway() && self.entries.lock().iter().any(|e| same(&e.stream, s))
    }

    /// Everything held, for teardown (dropped by the caller after the pool
    /// is torn down: the streams then make no driver call).
    pub(super) fn clear(&self) -> Vec<Stream> {
        let mut out: Vec<Stream> = self.entries.lock().drain(..).map(|e| e.stream).collect();
        out.extend(self.deferred.lock().drain(..).map(|d| d.stream));
        self.underway.store(0, SeqCst);
        self.routed.store(0, SeqCst);
        out
    }
}

/// Leaves the handshake on drop (also on unwind).
pub(super) struct InFlight<'a>(&'a AtomicUsize);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, SeqCst);
    }
}

impl PoolShared {
    /// Enters the handshake for a heap mapping job, which may unmap
    /// (stolen clean granules, or its own runs after a failed map) with
    /// the heap lock released: taken under the heap lock that planned the
    /// job (the plan stole nothing if `capture_hold` was set), so a
    /// [`PoolShared::begin`] that sets the hold after that plan waits for
    /// the job's driver calls.
    pub(super) fn mapping_job(&self) -> InFlight<'_> {
        self.capture.inflight.fetch_add(1, SeqCst);
        InFlight(&self.capture.inflight)
    }

    /// Runs `f`, a driver call that a capture forbids, unless a capture is
    /// underway (`None` then). [`PoolShared::begin`] raises `underway` and
    /// then waits for `inflight` to drain: either it sees this call in
    /// flight and waits for it, or this call sees the capture and skips
    /// (both sides use sequentially consistent operations).
    pub(super) fn outside_capture<T>(&self, f: impl FnOnce() -> T) -> Option<T> {
        let c = &self.capture;
        c.inflight.fetch_add(1, SeqCst);
        let _g = InFlight(&c.inflight);
        (c.underway.load(SeqCst) == 0).then(f)
    }

    /// Like [`PoolShared::outside_capture`] for an event record on `s`:
    /// refused only if the pool knows `s` captures.
    pub(super) fn unless_capturing<T>(&self, s: StreamHandle, f: impl FnOnce() -> T) -> Option<T> {
        let c = &self.capture;
        c.inflight.fetch_add(1, SeqCst);
        let _g = InFlight(&c.inflight);
        (!c.captures(s)).then(f)
    }

    /// Whether pending memory may be handed over now: configured, and no
    /// capture underway (a stream wait on an event is forbidden then).
    pub(super) fn handover_ok(&self) -> bool {
        self.cfg.handover && !self.capture.underway()
    }

    /// An error if a capture is underway: for calls that flush, wait or
    /// give memory back (`mark_step`, `close_import`, ...).
    pub(super) fn refuse_during_capture(&self, what: &str) -> Result<()> {
        if self.capture.underway() {
            return Err(self.capture_error(what));
        }
        Ok(())
    }

    /// The error of a call that cannot run during a capture.
    pub(super) fn capture_error(&self, what: &str) -> Error {
        Error::InvalidArgument(format!(
            "{what} while a CUDA graph capture is underway on device {}",
            self.dev
        ))
    }

    /// Registers a capture on `stream` (routed to private pool `pool`, 0 for
    /// none), then waits out the forbidden calls already in flight.
    fn begin(&self, stream: &Stream, pool: u64) {
        {
            let mut e = self.capture.entries.lock();
            e.push(Entry {
                stream: stream.clone(),
                pool,
            });
            self.capture.underway.fetch_add(1, SeqCst);
            if pool != 0 {
                self.capture.routed.fetch_add(1, SeqCst);
            }
        }
        self.sync_capture_hold();
        while self.capture.inflight.load(SeqCst) != 0 {
            std::thread::yield_now();
        }
    }

    /// Sets the heap's `capture_hold` to whether a capture is underway,
    /// under the heap lock (the last writer reads the final count).
    fn sync_capture_hold(&self) {
        let mut h = self.heap.lock_quiet();
        h.heap.capture_hold = self.capture.underway();
    }

    /// Ends the entries `gone` picks; when no capture is left, makes the
    /// deferred frees. Returns how many ended.
    fn end_where(&self, gone: impl Fn(&Entry) -> bool) -> usize {
        let ended: Vec<Entry> = {
            let mut e = self.capture.entries.lock();
            let (out, keep): (Vec<Entry>, Vec<Entry>) = e.drain(..).partition(|x| gone(x));
            *e = keep;
            for x in &out {
                self.capture.underway.fetch_sub(1, SeqCst);
                if x.pool != 0 {
                    self.capture.routed.fetch_sub(1, SeqCst);
                }
            }
            out
        };
        let n = ended.len();
        drop(ended);
        if n > 0 {
            self.sync_capture_hold();
            self.run_deferred();
        }
        n
    }

    /// Makes the deferred frees once no capture is underway (a free that
    /// meets a new capture is deferred again).
    fn run_deferred(&self) {
        if self.capture.underway() || self.is_torn_down() {
            return;
        }
        let d = std::mem::take(&mut *self.capture.deferred.lock());
        for x in d {
            self.free_block(x.ptr, x.kind, x.requested, &x.stream, &x.extra);
        }
    }

    /// Defers a free that would record events while a capture is underway;
    /// `false` (nothing done) otherwise.
    pub(super) fn defer_free(
        &self,
        ptr: DevicePtr,
        kind: Kind,
        requested: u64,
        stream: &Stream,
        extra: &[Arc<StreamCore>],
    ) -> bool {
        if !self.capture.underway() || self.is_torn_down() {
            return false;
        }
        let records = stream.slot().is_none()
            || !extra.is_empty()
            || matches!(kind, Kind::Large { .. } if self.plans.enabled()
                && self.plans.owner_of(ptr.addr()).is_some_and(|o| Some(o) != stream.slot()));
        if !records {
            return false;
        }
        self.capture.deferred.lock().push(Deferred {
            ptr,
            kind,
            requested,
            stream: stream.clone(),
            extra: extra.to_vec(),
        });
        true
    }

    /// Frees deferred until the end of the captures underway (a figure for
    /// tests and stats).
    pub(super) fn deferred_frees(&self) -> usize {
        self.capture.deferred.lock().len()
    }

    /// On an allocation slow path of `stream`: if the pool does not know
    /// `stream` captures, asks the driver (`cuStreamIsCapturing`) and
    /// registers a capture it finds; also notices detected captures that
    /// ended. One driver call, made only where the pool would otherwise
    /// query events or map memory.
    pub(super) fn detect_capture(&self, stream: &Stream) {
        self.poll_detected();
        if self.capture.knows(stream) || self.is_torn_down() {
            return;
        }
        match self.backend.stream_capturing(self.dev, stream.handle()) {
            Ok(true) => {
                tracing::debug!(device = self.dev, stream = ?stream.handle(), "capture detected");
                self.begin(stream, 0);
            }
            Ok(false) => {}
            Err(e) => tracing::debug!(device = self.dev, "cuStreamIsCapturing failed: {e}"),
        }
    }

    /// Ends the detected captures the driver reports over (maintenance and
    /// slow paths; nothing to do, and no call, when there are none).
    pub(super) fn poll_detected(&self) {
        let detected: Vec<StreamHandle> = {
            if !self.capture.underway() {
                return;
            }
            let e = self.capture.entries.lock();
            e.iter()
                .filter(|x| x.pool == 0)
                .map(|x| x.stream.handle())
                .collect()
        };
        for h in detected {
            let over = !matches!(self.backend.stream_capturing(self.dev, h), Ok(true));
            if over {
                self.end_where(|x| x.pool == 0 && x.stream.handle() == h);
            }
        }
    }

    /// Routes the raw allocations of `stream` to private pool `pool` and
    /// marks a capture underway on it (see `DevicePool::begin_allocate_to_pool`).
    pub(super) fn begin_allocate_to_pool(&self, pool: u64, stream: &Stream) -> Result<()> {
        self.check_live()?;
        self.check_stream(stream)?;
        if pool == 0 {
            return Err(Error::InvalidArgument(
                "private pool id 0 is reserved".into(),
            ));
        }
        if self.capture.route_of(stream).is_some() {
            return Err(Error::InvalidArgument(format!(
                "stream {:?} is routed to a private pool already",
                stream.handle()
            )));
        }
        self.private_open(pool)?;
        // A detected capture of this stream becomes this told one.
        self.end_where(|x| x.pool == 0 && same(&x.stream, stream));
        self.begin(stream, pool);
        Ok(())
    }

    /// Ends the routing of every stream routed to `pool`; see
    /// `DevicePool::end_allocate_to_pool`.
    pub(super) fn end_allocate_to_pool(&self, pool: u64) -> Result<()> {
        if pool == 0 {
            return Err(Error::InvalidArgument(
                "private pool id 0 is reserved".into(),
            ));
        }
        if !self.private_known(pool) {
            return Err(Error::InvalidArgument(format!(
                "unknown private pool {pool} on device {}",
                self.dev
            )));
        }
        self.end_where(|x| x.pool == pool);
        Ok(())
    }

    /// Ends routing to `pool` without checks (release).
    pub(super) fn end_routes_of(&self, pool: u64) {
        self.end_where(|x| x.pool == pool);
    }
}

impl DevicePool {
    /// From now on the raw allocations ([`DevicePool::alloc_raw`], the C ABI)
    /// on `stream` go to private pool `pool` (nonzero; made on first use),
    /// until [`DevicePool::end_allocate_to_pool`], and a capture counts as
    /// underway on `stream` (see `src/pool/capture.rs` for what the pool
    /// then refrains from). PyTorch's `beginAllocateToPool`: call it before
    /// the capture begins, once per stream to route. Errors, changing
    /// nothing: pool 0, a stream of another pool or already routed, a pool
    /// released.
    pub fn begin_allocate_to_pool(&self, pool: u64, stream: &Stream) -> Result<()> {
        self.shared.begin_allocate_to_pool(pool, stream)
    }

    /// Ends the routing of every stream routed to `pool`; their captures
    /// are no longer underway for the pool, and once none is, the deferred
    /// frees record their events. PyTorch's `endAllocateToPool`. Errors:
    /// pool 0 or never used.
    pub fn end_allocate_to_pool(&self, pool: u64) -> Result<()> {
        self.shared.end_allocate_to_pool(pool)
    }

    /// Whether a capture is underway on this device, as far as the pool
    /// knows (told or detected).
    pub fn capture_underway(&self) -> bool {
        self.shared.capture.underway()
    }

    /// Frees waiting for the end of the captures underway.
    pub fn deferred_frees(&self) -> usize {
        self.shared.deferred_frees()
    }
}
