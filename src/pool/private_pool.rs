//! Private pools: the memory of CUDA graphs (PyTorch's graph pools and
//! `MemPool`, through `begin_allocate_to_pool` / `release_pool`).
//!
//! A captured graph keeps the addresses of its allocations; each replay
//! writes them again. So a graph's memory must never be handed to anyone
//! else while the graph lives, not even after the graph's code freed it.
//! A private pool gives that: raw allocations routed to it (from a stream
//! `begin_allocate_to_pool` named, or `alloc_raw_in_pool`) are carved from
//! *segments* the pool takes from the device pool, and a block freed there
//! stays in the private pool, reusable only by later allocations to the
//! same pool, until `release_pool`.
//!
//! * **Segments.** At least 2 MiB (a request's size rounded up to 2 MiB
//!   when larger), taken from the heap as `Clean` memory only (no earlier
//!   use may still run, whatever stream replays the graph) or new memory,
//!   and held as one allocated large range of the device pool: in the
//!   pool's statistics, a private pool's memory is allocated memory.
//! * **Blocks** are carved best fit (256-byte aligned) from the free ranges
//!   of the pool's segments, a linear scan: private pools serve a capture,
//!   not the steady state. A free range is tagged with the stream that
//!   freed it: it is reused by allocations on that stream only (stream
//!   order holds in the graph as on the device); a block freed after
//!   `record_stream` is never reused before release. Fresh space goes to
//!   any stream. Adjacent free ranges with the same tag merge.
//! * **Release.** `release_pool` ends the pool's routing and gives back
//!   every segment with no live block; a segment with live blocks goes back
//!   when its last block is freed. A segment goes back as a free of the
//!   device pool on every stream its blocks were used or freed on (events
//!   recorded there, or parked on its one stream), so the device pool reuses
//!   it only after that work. The graph's replays must have been enqueued
//!   on those streams (or finished) by then: PyTorch releases a pool when
//!   its graphs are destroyed.
//!
//! Lock order: the private pools' mutex, then the heap's. A segment goes
//! back to the device pool after the private mutex is dropped.

use super::size_class::ALIGN;
use super::stream::Stream;
use super::{DevicePool, Kind, PoolShared, StreamCore};
use crate::error::{Error, Result};
use crate::ptr::DevicePtr;
use parking_lot::Mutex;
use rustc_hash::FxHashMap as HashMap;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;

/// The smallest segment.
const SEGMENT: u64 = 2 << 20;

/// Who may reuse a free range of a segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Owner {
    /// Never used: any stream.
    Fresh,
    /// Freed on the stream with this core (by address): that stream only.
    Stream(usize),
    /// Freed after `record_stream`: nobody before release.
    Held,
}

#[derive(Debug)]
struct Segment {
    len: u64,
    /// Free ranges by address: `(len, owner)`.
    free: BTreeMap<u64, (u64, Owner)>,
    live: usize,
    /// Streams its blocks were used on (allocated or freed).
    users: Vec<Stream>,
    /// Streams recorded for its blocks (`record_stream`).
    recorded: Vec<Arc<StreamCore>>,
}

#[derive(Debug, Clone, Copy)]
struct LiveBlock {
    pool: u64,
    seg: u64,
    len: u64,
    requested: u64,
}

#[derive(Debug, Default)]
struct PrivatePool {
    /// Segments by base address.
    segments: BTreeMap<u64, Segment>,
    released: bool,
}

#[derive(Debug, Default)]
struct Inner {
    pools: HashMap<u64, PrivatePool>,
    /// Live blocks of every private pool, by address.
    live: HashMap<u64, LiveBlock>,
    /// Every segment: base -> (len, pool).
    segs: BTreeMap<u64, (u64, u64)>,
}

/// The private pools of one device pool.
#[derive(Debug, Default)]
pub(crate) struct PrivatePools {
    inner: Mutex<Inner>,
    /// `inner.pools.len()`: a raw free reads this (one relaxed load) before
    /// looking here.
    count: AtomicUsize,
}

fn core_key(s: &Stream) -> usize {
    Arc::as_ptr(s.core()) as usize
}

impl Segment {
    /// Inserts a free range, merging with neighbours of the same owner.
    fn put_free(&mut self, mut addr: u64, mut len: u64, owner: Owner) {
        if let Some((&a, &(l, o))) = self.free.range(..addr).next_back() {
            if a + l == addr && o == owner {
                self.free.remove(&a);
                addr = a;
                len += l;
            }
        }
        if let Some(&(l, o)) = self.free.get(&(addr + len)) {
            if o == owner {
                self.free.remove(&(addr + len));
                len += l;
            }
        }
        self.free.insert(addr, (len, owner));
    }

    fn note_user(&mut self, s: &Stream) {
        if !self.users.iter().any(|u| Arc::ptr_eq(u.core(), s.core())) {
            self.users.push(s.clone());
        }
    }
}

impl PrivatePools {
    /// Whether any private pool exists (one relaxed load).
    pub(super) fn any(&self) -> bool {
        self.count.load(Relaxed) != 0
    }

    /// Everything held, for teardown: the streams (dropped by the caller
    /// once the pool is torn down). The memory goes with the heap.
    pub(super) fn clear(&self) -> Vec<Stream> {
        let mut i = self.inner.lock();
        self.count.store(0, Relaxed);
        i.live.clear();
        i.segs.clear();
        i.pools
            .drain()
            .flat_map(|(_, p)| p.segments.into_values().flat_map(|s| s.users))
            .collect()
    }
}

impl PoolShared {
    /// Makes private pool `pool` if it does not exist; an error if it was
    /// released.
    pub(super) fn private_open(&self, pool: u64) -> Result<()> {
        if pool == 0 {
            return Err(Error::InvalidArgument(
                "private pool id 0 is reserved".into(),
            ));
        }
        let mut i = self.private.inner.lock();
        match i.pools.get(&pool) {
            Some(p) if p.released => Err(Error::InvalidArgument(format!(
                "private pool {pool} of device {} was released",
                self.dev
            ))),
            Some(_) => Ok(()),
            None => {
                i.pools.insert(pool, PrivatePool::default());
                self.private.count.store(i.pools.len(), Relaxed);
                Ok(())
            }
        }
    }

    /// Whether private pool `pool` exists (released or not).
    pub(super) fn private_known(&self, pool: u64) -> bool {
        self.private.any() && self.private.inner.lock().pools.contains_key(&pool)
    }

    /// A raw allocation of `size` bytes on `stream` in private pool `pool`.
    pub(super) fn private_alloc(&self, pool: u64, size: u64, stream: &Stream) -> Result<DevicePtr> {
        self.check_live()?;
        self.check_stream(stream)?;
        self.check_size(size)?;
        self.private_open(pool)?;
        let len = size.div_ceil(ALIGN) * ALIGN;
        let key = core_key(stream);
        let mut guard = self.private.inner.lock();
        let i = &mut *guard;
        let p = i.pools.get_mut(&pool).expect("opened above");
        // Best fit among the ranges this stream may reuse.
        let mut best: Option<(u64, u64, u64, Owner)> = None; // (len, addr, seg, owner)
        for (&base, seg) in &p.segments {
            for (&a, &(l, o)) in &seg.free {
                let ok = l >= len && (o == Owner::Fresh || o == Owner::Stream(key));
                if ok && best.is_none_or(|b| (l, a) < (b.0, b.1)) {
                    best = Some((l, a, base, o));
                }
            }
        }
        let (addr, seg_base) = match best {
            Some((l, a, base, o)) => {
                let seg = p.segments.get_mut(&base).expect("found above");
                seg.free.remove(&a);
                if l > len {
                    seg.free.insert(a + len, (l - len, o));
                }
                (a, base)
            }
            None => {
                let seg_len = len.max(SEGMENT).div_ceil(SEGMENT) * SEGMENT;
                let base = self.take_segment(seg_len, size)?;
                let mut seg = Segment {
                    len: seg_len,
                    free: BTreeMap::new(),
                    live: 0,
                    users: Vec::new(),
                    recorded: Vec::new(),
                };
                if seg_len > len {
                    seg.free.insert(base + len, (seg_len - len, Owner::Fresh));
                }
                p.segments.insert(base, seg);
                i.segs.insert(base, (seg_len, pool));
                (base, base)
            }
        };
        let seg = p.segments.get_mut(&seg_base).expect("present");
        seg.live += 1;
        seg.note_user(stream);
        i.live.insert(
            addr,
            LiveBlock {
                pool,
                seg: seg_base,
                len,
                requested: size,
            },
        );
        Ok(DevicePtr(addr))
    }

    /// A raw allocation of a stream routed to a private pool (`None`: not
    /// routed; one relaxed load when no stream is).
    pub(super) fn route_raw(
        &self,
        size: u64,
        stream: &Stream,
        raw: bool,
    ) -> Option<Result<DevicePtr>> {
        if !raw || !self.capture.any_routed() {
            return None;
        }
        let pool = self.capture.route_of(stream)?;
        Some(self.private_alloc(pool, size, stream))
    }

    /// A segment of `seg_len` bytes from the heap: clean memory or new.
    fn take_segment(&self, seg_len: u64, size: u64) -> Result<u64> {
        let mut h = self.heap.lock();
        let t = match h.heap.alloc_backed(seg_len, ALIGN, None) {
            Some(t) => t,
            None => match h.heap.alloc(seg_len, ALIGN, None, false) {
                Ok(t) => t,
                Err(e) if e.is_oom() => {
                    drop(h);
                    return Err(self.oom(size));
                }
                Err(e) => return Err(e),
            },
        };
        // Clean memory only: nothing to wait for, nothing aliased.
        let waits = h.heap.take_steal_waits();
        debug_assert!(waits.is_empty() && t.waits.is_empty());
        let q = h.heap.take_quarantine();
        if !q.is_empty() {
            h.quarantine.push((Default::default(), q));
        }
        drop(h);
        self.counters.on_alloc(seg_len, seg_len);
        Ok(t.addr)
    }

    /// The requested size of a live private block at `addr`.
    pub(super) fn private_size(&self, addr: u64) -> Option<u64> {
        if !self.private.any() {
            return None;
        }
        self.private
            .inner
            .lock()
            .live
            .get(&addr)
            .map(|b| b.requested)
    }

    /// Frees `addr` if it lies in a private segment: `None` if it does not.
    pub(super) fn private_free(&self, addr: u64, stream: &Stream) -> Option<Result<()>> {
        if !self.private.any() {
            return None;
        }
        let mut guard = self.private.inner.lock();
        let i = &mut *guard;
        let (&base, &(seg_len, _)) = i.segs.range(..=addr).next_back()?;
        if addr >= base + seg_len {
            return None;
        }
        let Some(b) = i.live.remove(&addr) else {
            let free = i
                .pools
                .values()
                .filter_map(|p| p.segments.get(&base))
                .any(|s| {
                    s.free
                        .range(..=addr)
                        .next_back()
                        .is_some_and(|(&a, &(l, _))| addr < a + l)
                });
            return Some(Err(if free {
                Error::DoubleFree {
                    ptr: addr,
                    device: self.dev,
                }
            } else {
                Error::UnknownPointer {
                    ptr: addr,
                    device: self.dev,
                }
            }));
        };
        let extra = self.take_recorded_streams(addr);
        let p = i.pools.get_mut(&b.pool).expect("live blocks have pools");
        let seg = p
            .segments
            .get_mut(&b.seg)
            .expect("live blocks have segments");
        let owner = if extra.is_empty() && stream.slot().is_some() {
            Owner::Stream(core_key(stream))
        } else {
            Owner::Held
        };
        seg.put_free(addr, b.len, owner);
        seg.live -= 1;
        seg.note_user(stream);
        for c in extra {
            if !seg.recorded.iter().any(|r| Arc::ptr_eq(r, &c)) {
                seg.recorded.push(c);
            }
        }
        let back = if p.released && seg.live == 0 {
            let s = p.segments.remove(&b.seg).expect("present");
            i.segs.remove(&b.seg);
            if p.segments.is_empty() {
                i.pools.remove(&b.pool);
                self.private.count.store(i.pools.len(), Relaxed);
            }
            Some((b.seg, s))
        } else {
            None
        };
        drop(guard);
        if let Some((a, s)) = back {
            self.return_segment(a, s);
        }
        Some(Ok(()))
    }

    /// Releases private pool `pool`; see `DevicePool::release_pool`.
    pub(super) fn release_pool(&self, pool: u64) -> Result<()> {
        if pool == 0 {
            return Err(Error::InvalidArgument(
                "private pool id 0 is reserved".into(),
            ));
        }
        {
            let i = self.private.inner.lock();
            match i.pools.get(&pool) {
                Some(p) if !p.released => {}
                Some(_) => {
                    return Err(Error::InvalidArgument(format!(
                        "private pool {pool} of device {} was released already",
                        self.dev
                    )))
                }
                None => {
                    return Err(Error::InvalidArgument(format!(
                        "unknown private pool {pool} on device {}",
                        self.dev
                    )))
                }
            }
        }
        self.end_routes_of(pool);
        let back: Vec<(u64, Segment)> = {
            let mut guard = self.private.inner.lock();
            let i = &mut *guard;
            let Some(p) = i.pools.get_mut(&pool) else {
                return Ok(());
            };
            p.released = true;
            let empty: Vec<u64> = p
                .segments
                .iter()
                .filter(|(_, s)| s.live == 0)
                .map(|(&a, _)| a)
                .collect();
            let back: Vec<(u64, Segment)> = empty
                .into_iter()
                .map(|a| (a, p.segments.remove(&a).expect("listed")))
                .collect();
            if p.segments.is_empty() {
                i.pools.remove(&pool);
                self.private.count.store(i.pools.len(), Relaxed);
            }
            for (a, _) in &back {
                i.segs.remove(a);
            }
            back
        };
        for (a, s) in back {
            self.return_segment(a, s);
        }
        Ok(())
    }

    /// Gives a segment back to the device pool: a free on every stream its
    /// blocks were used on (deferred, like any such free, while a capture
    /// is underway).
    fn return_segment(&self, addr: u64, s: Segment) {
        let Segment {
            len,
            users,
            recorded,
            ..
        } = s;
        let (first, rest) = match users.split_first() {
            Some((f, r)) => (f.clone(), r),
            None => return,
        };
        let mut extra: Vec<Arc<StreamCore>> = rest.iter().map(|u| u.core().clone()).collect();
        for c in recorded {
            if !Arc::ptr_eq(&c, first.core()) && !extra.iter().any(|e| Arc::ptr_eq(e, &c)) {
                extra.push(c);
            }
        }
        self.free_block(DevicePtr(addr), Kind::Large { len }, len, &first, &extra);
    }

    /// Bytes of the private pools' segments, and how many live blocks they
    /// hold (`DevicePool::private_pool_stats`).
    pub(super) fn private_figures(&self) -> (u64, usize) {
        let i = self.private.inner.lock();
        (i.segs.values().map(|&(l, _)| l).sum(), i.live.len())
    }
}

impl DevicePool {
    /// A raw allocation of `size` bytes on `stream` in private pool `pool`
    /// (nonzero; made on first use). Free it with [`DevicePool::free_raw`]:
    /// it stays in the pool, reusable by later allocations to the same pool
    /// on the same stream, until [`DevicePool::release_pool`].
    pub fn alloc_raw_in_pool(&self, size: usize, stream: &Stream, pool: u64) -> Result<DevicePtr> {
        self.shared.private_alloc(pool, size as u64, stream)
    }

    /// Releases private pool `pool` (PyTorch's `releasePool`: its graph is
    /// gone): ends its routing, gives its free memory back to the device
    /// pool; blocks still live stay its own until freed, then go back.
    /// Errors, changing nothing: pool 0, unknown, released already.
    pub fn release_pool(&self, pool: u64) -> Result<()> {
        self.shared.release_pool(pool)
    }

    /// The private pools' segment bytes and live blocks.
    pub fn private_pool_figures(&self) -> (u64, usize) {
        self.shared.private_figures()
    }
}
