//! Raw pointers (the C ABI and PyTorch path, which keep only an address):
//! finding the block behind an address, freeing it, and the streams
//! recorded for it (`record_stream`). A bad pointer (unknown, interior,
//! freed, a block's) is a typed error that changes nothing.

use super::small::{RawMiss, Slab, SlotRef};
use super::*;

impl PoolShared {
    /// The header of the slab whose range may hold `addr` (bounds and
    /// liveness unchecked), if any.
    #[inline(always)]
    pub(super) fn slab_at(&self, addr: u64) -> Option<&Slab> {
        let h = self.slab_index.lookup(addr)?;
        // SAFETY: the index holds headers of `self.slabs` only (its
        // invariant), which never move or go while `self` lives.
        Some(unsafe { &*h })
    }

    /// The slab id holding `addr`, if it lies in a slab.
    pub(super) fn slab_holding(&self, addr: u64) -> Option<u32> {
        let h = self.slab_at(addr)?;
        h.base_holding(addr).map(|_| h.id())
    }

    /// Frees a small slot whose raw allocation was just found live (and
    /// its bit cleared). Out of line, so that the magazine's fast lane
    /// stays inlined where a typed block drops (its other caller).
    #[inline(never)]
    fn free_small_slot(
        &self,
        ptr: DevicePtr,
        slot: SlotRef,
        requested: u64,
        word: SizeWord,
        stream: &Stream,
    ) {
        // Only once the free is valid: a bad one changes nothing.
        let extra = self.take_recorded_streams(ptr.addr());
        if !(extra.is_empty()
            && self.free_small_front(ptr, slot.idx, slot.class as u16, requested, stream, word))
        {
            let kind = Kind::Small {
                idx: slot.idx,
                class: slot.class as u16,
            };
            self.free_block(ptr, kind, requested, stream, &extra);
            if !extra.is_empty() {
                self.pace_harvest();
            }
        }
    }

    pub(super) fn free_raw(&self, ptr: DevicePtr, stream: &Stream) -> Result<()> {
        self.check_live()?;
        self.check_stream(stream)?;
        let addr = ptr.addr();
        let slab = match self.slab_at(addr) {
            Some(h) => match self.slabs.free_raw_slot(h, addr) {
                Ok(got) => Some(got),
                Err(RawMiss::Outside) => None,
                Err(RawMiss::Interior) => {
                    return Err(Error::UnknownPointer {
                        ptr: addr,
                        device: self.dev,
                    })
                }
                Err(RawMiss::NotLive) => {
                    return Err(Error::DoubleFree {
                        ptr: addr,
                        device: self.dev,
                    })
                }
            },
            None => None,
        };
        // Private segments are heap ranges, never slabs: a small free pays
        // nothing for them.
        if slab.is_none() {
            if let Some(r) = self.private_free(addr, stream) {
                return r;
            }
        }
        if let Some((slot, requested, word)) = slab {
            self.free_small_slot(ptr, slot, requested, word, stream);
            return Ok(());
        }
        // The common case at once: a raw block freed on the stream that
        // allocated it, recorded on no other stream, parked under one lock
        // of that stream's own.
        if let Some(s) = self.parks_at_once(stream) {
            let none_recorded = self
                .recorded_entries
                .load(std::sync::atomic::Ordering::Acquire)
                == 0;
            if none_recorded {
                if let Some(e) = self.by_stream.park_live_raw(s, addr) {
                    self.counters.on_free(e.live.requested, e.len);
                    return Ok(());
                }
            }
        }
        // Taken out of the live index here, in one step, so that of two
        // frees of one pointer only one goes on (planned blocks included).
        let e = match self.by_stream.remove_raw(stream.slot(), addr) {
            Ok(e) => e,
            Err(Some(_)) => {
                return Err(Error::InvalidArgument(format!(
                    "{addr:#x} is a block, not a raw allocation"
                )))
            }
            Err(None) => {
                // No live raw block: a typed block's start (typed blocks
                // are not listed) is not one; if the address starts free
                // or parked memory of this pool, or lies in a learned
                // step's arena, it was freed already.
                let in_arena = self.plans.enabled() && self.plans.in_arena(addr);
                let (allocated, free) = {
                    let h = self.heap.lock();
                    (h.heap.allocated_len(addr).is_some(), h.heap.is_free(addr))
                };
                if allocated && !in_arena && !self.by_stream.parked_addrs().contains(&addr) {
                    return Err(Error::InvalidArgument(format!(
                        "{addr:#x} is a block, not a raw allocation"
                    )));
                }
                return Err(if allocated || free || in_arena {
                    Error::DoubleFree {
                        ptr: addr,
                        device: self.dev,
                    }
                } else {
                    Error::UnknownPointer {
                        ptr: addr,
                        device: self.dev,
                    }
                });
            }
        };
        let extra = self.take_recorded_streams(addr);
        self.free_block(
            ptr,
            Kind::Large { len: e.len },
            e.live.requested,
            stream,
            &extra,
        );
        if !extra.is_empty() {
            self.pace_harvest();
        }
        Ok(())
    }

    /// Removes and returns the streams recorded for the allocation at
    /// `addr` (none if there are none).
    #[inline]
    pub(crate) fn take_recorded_streams(&self, addr: u64) -> Vec<Arc<StreamCore>> {
        // A record_stream happens before the free it orders (the caller's
        // contract), so a count of 0 read here means none for `addr`.
        if self
            .recorded_entries
            .load(std::sync::atomic::Ordering::Acquire)
            == 0
        {
            return Vec::new();
        }
        self.take_recorded_streams_listed(addr)
    }

    #[inline(never)]
    fn take_recorded_streams_listed(&self, addr: u64) -> Vec<Arc<StreamCore>> {
        let mut m = self.recorded_streams.lock();
        let v = m.remove(&addr);
        if v.is_some() {
            self.recorded_entries
                .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
        }
        v.unwrap_or_default()
    }

    /// Records that the allocation at `addr` is used on stream `s` too
    /// (once per stream).
    pub(crate) fn add_recorded_stream(&self, addr: u64, s: &Arc<StreamCore>) {
        let mut m = self.recorded_streams.lock();
        let v = m.entry(addr).or_insert_with(|| {
            self.recorded_entries
                .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
            Vec::new()
        });
        if !v.iter().any(|c| Arc::ptr_eq(c, s)) {
            v.push(s.clone());
        }
    }

    pub(super) fn raw_size(&self, ptr: DevicePtr) -> Option<u64> {
        let addr = ptr.addr();
        if let Some(id) = self.slab_holding(addr) {
            let slot = self.slabs.slot_at(id, addr)?;
            return self
                .slabs
                .is_raw_live(slot.idx)
                .then(|| self.slabs.requested(slot.idx));
        }
        if let Some(n) = self.private_size(addr) {
            return Some(n);
        }
        self.by_stream
            .get(None, addr)
            .filter(|e| e.live.raw)
            .map(|e| e.live.requested)
    }

    pub(super) fn record_stream_raw(&self, ptr: DevicePtr, stream: &Stream) -> Result<()> {
        self.check_live()?;
        self.check_stream(stream)?;
        if self.raw_size(ptr).is_none() {
            return Err(Error::UnknownPointer {
                ptr: ptr.addr(),
                device: self.dev,
            });
        }
        self.add_recorded_stream(ptr.addr(), stream.core());
        Ok(())
    }
}
