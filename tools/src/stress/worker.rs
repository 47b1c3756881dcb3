//! One stress thread's view of its device: allocate, write a pattern with a
//! delayed simulated kernel, use on other streams, verify, free.
//!
//! The host never waits on the device here except to bound how far it runs
//! ahead of the device in `--verify` mode (it polls verify results; no
//! backend sync), so every host-blocking sync the backend counts during a
//! run was made by the pool.

use super::peer::StressPeer;
use super::workload::Rng;
use gpupool::backend::sim::{SimBackend, VerifyResult};
use gpupool::backend::Backend;
use gpupool::pool::{Block, DevicePool, Stream};
use gpupool::Result;
use gpupool::{DevicePtr, EventHandle};
use hdrhistogram::Histogram;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Verify kernels a thread may have queued before it waits for the oldest.
const MAX_OUTSTANDING: usize = 64;
/// Operations between two publications of the thread's op count.
const PUBLISH_EVERY: u64 = 256;

/// A latency histogram in nanoseconds (1 ns .. 60 s, 3 significant digits).
pub(crate) fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("valid histogram bounds")
}

/// The memory of an item: a RAII block or a raw pointer of the pool, or
/// an address of a peer allocator (a peer run).
pub(crate) enum Handle<'a> {
    Block(Block<'a>),
    Raw(DevicePtr),
    Peer(u64),
}

/// A live allocation of the workload; kernels may still be queued on it.
pub(crate) struct Item<'a> {
    h: Handle<'a>,
    ptr: DevicePtr,
    /// Requested bytes.
    pub(crate) len: u64,
    seed: u64,
    /// Index of the stream it was allocated on (and last used on).
    pub(crate) stream: usize,
    /// A raw item freed from this other stream, ordered by an event.
    free_on: Option<usize>,
}

/// Percentages that shape how items are used.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Mix {
    /// Items allocated raw (`alloc_raw` / `free_raw`), the C ABI's path.
    pub raw_percent: u64,
    /// Items also used on another stream (`record_stream`).
    pub cross_percent: u64,
    /// Raw items freed from another stream than their own.
    pub cross_free_percent: u64,
    /// Allocations followed by a simulated kernel on their stream.
    pub kernel_percent: u64,
    /// Each such kernel's length.
    pub kernel_time: std::time::Duration,
    /// Misuse for the negative control: free from the other stream without
    /// ordering it after the block's own stream.
    pub unordered_frees: bool,
}

/// Counters shared by all threads of one device.
#[derive(Debug, Default)]
pub(crate) struct DeviceShared {
    /// Allocs plus frees, published every [`PUBLISH_EVERY`] operations.
    pub ops: AtomicU64,
    /// Requested bytes live now (every thread's items).
    pub live: AtomicU64,
    /// The largest request so far.
    pub max_request: AtomicU64,
    /// Threads allocating on the device.
    pub threads: AtomicU64,
    /// Out-of-memory errors while the memory was not in use (see
    /// [`DeviceShared::is_false_oom`]).
    pub false_ooms: AtomicU64,
    /// The most requested bytes live at once (kept for peer runs, whose
    /// allocator keeps no such figure).
    pub peak_live: AtomicU64,
}

impl DeviceShared {
    /// Whether an out-of-memory error for `size` bytes on a device of
    /// `capacity` bytes is false: the bytes live after it, plus the
    /// request, plus one largest request in flight for every other thread
    /// and two granules per thread of rounding, fit in the device.
    pub(crate) fn is_false_oom(&self, size: u64, capacity: u64, granule: u64) -> bool {
        let threads = self.threads.load(Relaxed).max(1);
        let slack = (threads - 1) * self.max_request.load(Relaxed) + threads * 2 * granule;
        self.live.load(Relaxed) + size + slack <= capacity
    }
}

/// What a thread measured, merged into the report at the end.
pub(crate) struct ThreadTotals {
    pub alloc_ns: Histogram<u64>,
    /// Allocs of the small path (size classes) only.
    pub small_alloc_ns: Histogram<u64>,
    /// Allocs of the large path only.
    pub large_alloc_ns: Histogram<u64>,
    pub free_ns: Histogram<u64>,
    pub allocs: u64,
    pub frees: u64,
    pub ooms: u64,
    pub cross_stream_uses: u64,
    pub cross_stream_frees: u64,
    pub verify_kernels: u64,
    pub failed_verifies: u64,
}

/// One thread's state.
pub(crate) struct Worker<'a> {
    pub(crate) dev: &'a DevicePool,
    /// In a peer run, the allocator every block comes from instead of
    /// `dev` (which then only names the device and its size classes).
    peer: Option<&'a dyn StressPeer>,
    sim: &'a SimBackend,
    /// Every stream of the device.
    streams: &'a [Stream],
    /// Indices of this thread's own streams (items are allocated there).
    home: Vec<usize>,
    /// One event per device stream, recorded only on that stream, so its
    /// captures complete in order.
    events: Vec<EventHandle>,
    verify: bool,
    mix: Mix,
    pub(crate) rng: Rng,
    id: u64,
    serial: u64,
    outstanding: VecDeque<Arc<VerifyResult>>,
    shared: &'a DeviceShared,
    stop: &'a AtomicBool,
    unpublished: u64,
    totals: ThreadTotals,
}

impl<'a> Worker<'a> {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        dev: &'a DevicePool,
        sim: &'a SimBackend,
        streams: &'a [Stream],
        home: Vec<usize>,
        verify: bool,
        mix: Mix,
        id: u64,
        seed: u64,
        shared: &'a DeviceShared,
        stop: &'a AtomicBool,
        peer: Option<&'a dyn StressPeer>,
    ) -> Result<Worker<'a>> {
        let events = streams
            .iter()
            .map(|_| sim.create_event(dev.device()))
            .collect::<Result<_>>()?;
        shared.threads.fetch_add(1, Relaxed);
        Ok(Worker {
            dev,
            peer,
            sim,
            streams,
            home,
            events,
            // The port's addresses are simulated: nothing to write.
            verify: verify && peer.is_none(),
            mix,
            rng: Rng::new(seed ^ id.wrapping_mul(0xD1B5_4A32_D192_ED03)),
            id,
            serial: 0,
            outstanding: VecDeque::new(),
            shared,
            stop,
            unpublished: 0,
            totals: ThreadTotals {
                alloc_ns: new_histogram(),
                small_alloc_ns: new_histogram(),
                large_alloc_ns: new_histogram(),
                free_ns: new_histogram(),
                allocs: 0,
                frees: 0,
                ooms: 0,
                cross_stream_uses: 0,
                cross_stream_frees: 0,
                verify_kernels: 0,
                failed_verifies: 0,
            },
        })
    }

    /// Whether the run is over.
    pub(crate) fn stopped(&self) -> bool {
        self.stop.load(Relaxed)
    }

    /// One of this thread's streams, at random.
    pub(crate) fn home_stream(&mut self) -> usize {
        self.home[self.rng.below(self.home.len())]
    }

    /// Any stream of the device other than `si`, if there is one.
    fn other_stream(&mut self, si: usize) -> Option<usize> {
        let n = self.streams.len();
        (n > 1).then(|| (si + 1 + self.rng.below(n - 1)) % n)
    }

    fn device(&self) -> usize {
        self.dev.device()
    }

    /// Allocates `size` bytes on stream `si`, writes its pattern and maybe
    /// uses it on a second stream. `Ok(None)`: out of memory (the caller
    /// frees something and may retry).
    pub(crate) fn alloc(&mut self, size: u64, si: usize) -> Result<Option<Item<'a>>> {
        let raw = self.rng.chance(self.mix.raw_percent);
        let (dev, streams) = (self.dev, self.streams);
        let stream = &streams[si];
        let t = Instant::now();
        let r = match self.peer {
            Some(p) => p
                .alloc(dev.device(), size, stream.handle().raw())
                .map(Handle::Peer),
            None if raw => dev.alloc_raw(size as usize, stream).map(Handle::Raw),
            None => dev.alloc(size as usize, stream).map(Handle::Block),
        };
        let ns = t.elapsed().as_nanos() as u64;
        self.shared.max_request.fetch_max(size, Relaxed);
        let h = match r {
            Ok(h) => h,
            Err(e) if e.is_oom() => {
                self.totals.ooms += 1;
                let info = dev.info();
                if self
                    .shared
                    .is_false_oom(size, info.total_bytes, info.granularity)
                {
                    self.shared.false_ooms.fetch_add(1, Relaxed);
                }
                return Ok(None);
            }
            Err(e) => return Err(e),
        };
        self.totals.alloc_ns.saturating_record(ns.max(1));
        if size <= dev.size_classes().small_max() {
            self.totals.small_alloc_ns.saturating_record(ns.max(1));
        } else {
            self.totals.large_alloc_ns.saturating_record(ns.max(1));
        }
        self.totals.allocs += 1;
        let live = self.shared.live.fetch_add(size, Relaxed) + size;
        self.shared.peak_live.fetch_max(live, Relaxed);
        self.count_op();
        let ptr = match &h {
            Handle::Block(b) => b.ptr(),
            Handle::Raw(p) => *p,
            Handle::Peer(a) => DevicePtr(*a),
        };
        self.serial += 1;
        let seed = (self.id << 40) ^ self.serial;
        let free_on = if raw && self.rng.chance(self.mix.cross_free_percent) {
            self.other_stream(si)
        } else {
            None
        };
        let item = Item {
            h,
            ptr,
            len: size,
            seed,
            stream: si,
            free_on,
        };
        if self.verify {
            let delay = self.rng.kernel_delay();
            self.sim.launch_write_pattern(
                self.device(),
                stream.handle(),
                ptr,
                size,
                seed,
                delay,
            )?;
        }
        if self.mix.kernel_percent > 0 && self.rng.chance(self.mix.kernel_percent) {
            self.sim
                .stall_stream(self.device(), stream.handle(), self.mix.kernel_time)?;
        }
        if self.rng.chance(self.mix.cross_percent) {
            self.use_elsewhere(&item)?;
        }
        Ok(Some(item))
    }

    /// Uses `it` on another stream too, ordered after its own stream's work
    /// by an event (as CUDA callers must), and tells the pool with
    /// `record_stream`.
    fn use_elsewhere(&mut self, it: &Item<'a>) -> Result<()> {
        let Some(o) = self.other_stream(it.stream) else {
            return Ok(());
        };
        let d = self.device();
        let (own, other) = (&self.streams[it.stream], &self.streams[o]);
        self.sim
            .record_event(d, self.events[it.stream], own.handle())?;
        self.sim
            .stream_wait_event(d, other.handle(), self.events[it.stream])?;
        match &it.h {
            Handle::Block(b) => b.record_stream(other),
            Handle::Raw(p) => self.dev.record_stream_raw(*p, other)?,
            Handle::Peer(a) => self
                .peer
                .expect("peer items come from a peer")
                .record_stream(*a, other.handle().raw())?,
        }
        self.totals.cross_stream_uses += 1;
        if self.verify {
            // Only reads on the second stream: the item's own stream may be
            // reading it at the same time (its retire verify), and two
            // streams writing the same bytes at once would be a data race
            // of the harness itself (ThreadSanitizer reports it).
            let delay = self.rng.kernel_delay();
            let r = self.sim.launch_verify_pattern(
                d,
                other.handle(),
                it.ptr,
                it.len,
                it.seed,
                delay,
            )?;
            self.push_result(r);
        }
        Ok(())
    }

    /// Verifies `it` on its stream (without waiting) and frees it at once:
    /// the free is ordered after the queued verify.
    pub(crate) fn retire(&mut self, it: Item<'a>) -> Result<()> {
        let d = self.device();
        let own = &self.streams[it.stream];
        if self.verify {
            let delay = self.rng.kernel_delay();
            let r =
                self.sim
                    .launch_verify_pattern(d, own.handle(), it.ptr, it.len, it.seed, delay)?;
            self.push_result(r);
        }
        let t = Instant::now();
        self.shared.live.fetch_sub(it.len, Relaxed);
        // Freed from another stream: that stream first waits for
        // everything the item's own stream did with it.
        if let Some(o) = it.free_on {
            if !self.mix.unordered_frees {
                self.sim
                    .record_event(d, self.events[it.stream], own.handle())?;
                self.sim
                    .stream_wait_event(d, self.streams[o].handle(), self.events[it.stream])?;
            }
            self.totals.cross_stream_frees += 1;
        }
        let on = &self.streams[it.free_on.unwrap_or(it.stream)];
        match it.h {
            Handle::Block(b) => drop(b),
            Handle::Peer(a) => self.peer.expect("peer items come from a peer").free(a)?,
            Handle::Raw(p) => self.dev.free_raw(p, on)?,
        }
        self.totals
            .free_ns
            .saturating_record((t.elapsed().as_nanos() as u64).max(1));
        self.totals.frees += 1;
        self.count_op();
        self.throttle();
        Ok(())
    }

    fn push_result(&mut self, r: Arc<VerifyResult>) {
        self.totals.verify_kernels += 1;
        self.outstanding.push_back(r);
    }

    /// Drops finished verify results; while too many are queued, polls the
    /// oldest (a host-side flag, not a device sync) so that the host stays
    /// a bounded distance ahead of the simulated device.
    fn throttle(&mut self) {
        while let Some(front) = self.outstanding.front() {
            match front.mismatches() {
                Some(bad) => {
                    if bad > 0 {
                        self.totals.failed_verifies += 1;
                    }
                    self.outstanding.pop_front();
                }
                None if self.outstanding.len() > MAX_OUTSTANDING => {
                    std::thread::sleep(Duration::from_micros(100));
                }
                None => break,
            }
        }
    }

    fn count_op(&mut self) {
        self.unpublished += 1;
        if self.unpublished >= PUBLISH_EVERY {
            self.shared.ops.fetch_add(self.unpublished, Relaxed);
            self.unpublished = 0;
        }
    }

    /// Waits for this thread's verify kernels, hands its cached slots back
    /// and returns what it measured. Every item must have been retired.
    pub(crate) fn finish(mut self) -> Result<ThreadTotals> {
        for r in self.outstanding.drain(..) {
            if r.wait() > 0 {
                self.totals.failed_verifies += 1;
            }
        }
        self.shared.ops.fetch_add(self.unpublished, Relaxed);
        self.dev.flush_thread_cache();
        // Queued waits keep the events alive in the simulator, as in CUDA.
        for ev in self.events.drain(..) {
            self.sim.destroy_event(self.dev.device(), ev)?;
        }
        Ok(self.totals)
    }
}
