//! The movable arena: regions, their free extents, and the handle table.
//!
//! Movable blocks live in *regions*: heap allocations of `region_bytes`
//! (the larger of the device's granularity and 2 MiB) aligned to their
//! size, so an emptied region gives whole granules back. Inside a region,
//! blocks are carved at 256-byte granularity by best fit over the free
//! extents of every region open for allocation (one ordered set by size,
//! one by address for merging). A block is named by its *handle* (an index
//! into the entry table plus a generation); the entry holds its current
//! address, its pin count and the events of its last uses.
//!
//! This file is pure bookkeeping (no backend calls), so the planner and its
//! tests work on it directly. Per region the bytes always add up:
//! `live + held + free extents = region_bytes`, where `held` is memory
//! waiting on something (freed ranges whose events have not completed, and
//! destinations reserved by an in-flight pass).

use crate::pool::StreamCore;
use crate::ptr::{EventHandle, StreamHandle};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Instant;

/// Allocation unit inside regions (the pool's alignment).
pub(crate) const UNIT: u64 = 256;

/// One region.
#[derive(Debug, Default)]
pub(crate) struct Region {
    /// Bytes of live blocks.
    pub live: u64,
    /// Bytes freed but waiting on events, or reserved as move destinations.
    pub held: u64,
    /// The part of `held` reserved as destinations of the pass in flight.
    pub incoming: u64,
    /// Live blocks: address -> handle id.
    pub blocks: BTreeMap<u64, u32>,
    /// Being emptied by a pass: closed to allocation until it commits.
    pub evacuating: bool,
}

/// One handle's entry.
#[derive(Debug, Default)]
pub(crate) struct Entry {
    /// Bumped at every free, so stale references (a pass's move of a block
    /// freed meanwhile) are recognised.
    pub gen: u32,
    pub live: bool,
    /// Current address and rounded length.
    pub addr: u64,
    pub len: u64,
    /// Pins held now.
    pub pins: u32,
    /// One event per stream that used the block under a pin, recorded at
    /// the pin's release: the block's last uses.
    pub last_use: Vec<(StreamHandle, EventHandle)>,
    /// A use whose event could not be recorded: the block never moves, and
    /// its free waits for a host sync of these streams (`trim`).
    pub unrecorded: Vec<Arc<StreamCore>>,
    /// The pass moving this block, if any (cleared by a pin: cancel).
    pub moving: Option<u64>,
}

impl Entry {
    /// Whether a pass may move this block now.
    pub fn movable(&self) -> bool {
        self.live && self.pins == 0 && self.unrecorded.is_empty() && self.moving.is_none()
    }
}

/// A freed range waiting for its last uses.
#[derive(Debug)]
pub(crate) struct PendingFree {
    pub addr: u64,
    pub len: u64,
    pub events: Vec<EventHandle>,
    pub unrecorded: Vec<Arc<StreamCore>>,
}

/// One move of a pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PlannedMove {
    pub handle: u32,
    pub gen: u32,
    pub src: u64,
    pub dst: u64,
    pub len: u64,
}

/// A pass enqueued on the device and not yet committed.
#[derive(Debug)]
pub(crate) struct InFlight {
    pub id: u64,
    pub moves: Vec<PlannedMove>,
    /// Regions being emptied.
    pub sources: Vec<u64>,
    /// Recorded on the compaction stream after the moves.
    pub done: EventHandle,
    pub started: Instant,
    /// Whether the regions this pass empties go back to the device
    /// (`CompactOptions::release` of the call that started it), however
    /// late and by whom it is committed.
    pub release: bool,
}

/// Running totals over the pool's life.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Totals {
    pub passes: u64,
    pub bytes_moved: u64,
    pub blocks_moved: u64,
    pub cancelled: u64,
    pub regions_released: u64,
}

/// Everything under the arena lock.
#[derive(Debug)]
pub(crate) struct ArenaState {
    pub region_bytes: u64,
    pub regions: BTreeMap<u64, Region>,
    free_by_addr: BTreeMap<u64, u64>,
    /// `(len, addr)` of the extents in regions open for allocation.
    free_by_size: BTreeSet<(u64, u64)>,
    pub entries: Vec<Entry>,
    free_ids: Vec<u32>,
    pub pending: Vec<PendingFree>,
    pub pass: Option<InFlight>,
    /// The compaction stream, created on the first pass.
    pub stream: Option<StreamHandle>,
    pub next_pass: u64,
    /// Sum of every region's `held`.
    pub held_total: u64,
    pub totals: Totals,
}

impl ArenaState {
    pub fn new(region_bytes: u64) -> Self {
        assert!(region_bytes.is_power_of_two() && region_bytes >= UNIT);
        ArenaState {
            region_bytes,
            regions: BTreeMap::new(),
            free_by_addr: BTreeMap::new(),
            free_by_size: BTreeSet::new(),
            entries: Vec::new(),
            free_ids: Vec::new(),
            pending: Vec::new(),
            pass: None,
            stream: None,
            next_pass: 1,
            held_total: 0,
            totals: Totals::default(),
        }
    }

    /// The largest block the arena serves (larger movable requests take the
    /// ordinary large path and never move).
    pub fn max_block(&self) -> u64 {
        self.region_bytes / 4
    }

    pub fn region_of(&self, addr: u64) -> u64 {
        addr & !(self.region_bytes - 1)
    }

    fn region_mut(&mut self, addr: u64) -> &mut Region {
        let base = self.region_of(addr);
        self.regions
            .get_mut(&base)
            .expect("address inside a movable region")
    }

    /// Free bytes of the region at `base`.
    pub fn region_free(&self, base: u64) -> u64 {
        let r = &self.regions[&base];
        self.region_bytes - r.live - r.held
    }

    // ---- extents ------------------------------------------------------------------

    /// Adds a free extent, merging with neighbours of the same region.
    pub fn insert_free(&mut self, mut addr: u64, mut len: u64) {
        let base = self.region_of(addr);
        if let Some((&pa, &pl)) = self.free_by_addr.range(..addr).next_back() {
            if pa + pl == addr && self.region_of(pa) == base {
                self.remove_free(pa);
                addr = pa;
                len += pl;
            }
        }
        if let Some(&nl) = self.free_by_addr.get(&(addr + len)) {
            if self.region_of(addr + len) == base {
                self.remove_free(addr + len);
                len += nl;
            }
        }
        self.free_by_addr.insert(addr, len);
        if !self.regions[&base].evacuating {
            self.free_by_size.insert((len, addr));
        }
    }

    /// Removes the free extent starting at `addr`; returns its length.
    fn remove_free(&mut self, addr: u64) -> u64 {
        let len = self
            .free_by_addr
            .remove(&addr)
            .expect("a free extent starts here");
        self.free_by_size.remove(&(len, addr));
        len
    }

    /// Best fit among regions open for allocation: the smallest extent of at
    /// least `len` (lowest address among equals); carves `len` off its start.
    pub fn take_fit(&mut self, len: u64) -> Option<u64> {
        let &(elen, addr) = self.free_by_size.range((len, 0)..).next()?;
        self.remove_free(addr);
        if elen > len {
            self.insert_free(addr + len, elen - len);
        }
        Some(addr)
    }

    /// Opens or closes a region for allocation.
    pub fn set_evacuating(&mut self, base: u64, on: bool) {
        let r = self.regions.get_mut(&base).expect("a region");
        if r.evacuating == on {
            return;
        }
        r.evacuating = on;
        let extents: Vec<(u64, u64)> = self
            .free_by_addr
            .range(base..base + self.region_bytes)
            .map(|(&a, &l)| (l, a))
            .collect();
        for e in extents {
            if on {
                self.free_by_size.remove(&e);
            } else {
                self.free_by_size.insert(e);
            }
        }
    }

    // ---- regions ----------------------------------------------------------------

    /// Adds a new, empty region at `base`.
    pub fn add_region(&mut self, base: u64) {
        debug_assert_eq!(self.region_of(base), base);
        self.regions.insert(base, Region::default());
        self.insert_free(base, self.region_bytes);
    }

    /// Removes the region at `base` if it is empty and open; returns whether.
    pub fn drop_if_empty(&mut self, base: u64) -> bool {
        match self.regions.get(&base) {
            Some(r) if r.live == 0 && r.held == 0 && !r.evacuating => {}
            _ => return false,
        }
        let len = self.remove_free(base);
        debug_assert_eq!(len, self.region_bytes);
        self.regions.remove(&base);
        true
    }

    // ---- held bytes ------------------------------------------------------------------

    pub fn hold(&mut self, addr: u64, len: u64) {
        self.region_mut(addr).held += len;
        self.held_total += len;
    }

    /// Reserves a move destination of `len` by best fit in open regions.
    pub fn reserve_dst(&mut self, len: u64) -> Option<u64> {
        let dst = self.take_fit(len)?;
        self.hold(dst, len);
        self.region_mut(dst).incoming += len;
        Some(dst)
    }

    /// Like [`ArenaState::reserve_dst`], but only in a region holding more
    /// than `than` bytes (live and incoming). The planner passes the
    /// source's live bytes minus `len`: such a move raises the sum of
    /// squared region occupancies, so a sequence of them can never cycle.
    /// Looks at the 4096 best fits.
    pub fn reserve_dst_denser(&mut self, len: u64, than: u64) -> Option<u64> {
        let &(elen, addr) = self
            .free_by_size
            .range((len, 0)..)
            .take(4096)
            .find(|&&(_, a)| {
                let r = &self.regions[&self.region_of(a)];
                r.live + r.incoming > than
            })?;
        self.remove_free(addr);
        if elen > len {
            self.insert_free(addr + len, elen - len);
        }
        self.hold(addr, len);
        self.region_mut(addr).incoming += len;
        Some(addr)
    }

    /// Frees a reserved destination (a cancelled or undone move).
    pub fn release_dst(&mut self, dst: u64, len: u64) {
        self.region_mut(dst).incoming -= len;
        self.unhold_free(dst, len);
    }

    /// Ends a hold and frees the range.
    pub fn unhold_free(&mut self, addr: u64, len: u64) {
        self.region_mut(addr).held -= len;
        self.held_total -= len;
        self.insert_free(addr, len);
    }

    // ---- blocks -------------------------------------------------------------------

    /// Allocates a block of `len` (a multiple of [`UNIT`]) if some open
    /// region has room; returns `(handle, gen)`.
    pub fn alloc_block(&mut self, len: u64) -> Option<(u32, u32)> {
        let addr = self.take_fit(len)?;
        let id = match self.free_ids.pop() {
            Some(id) => id,
            None => {
                self.entries.push(Entry::default());
                (self.entries.len() - 1) as u32
            }
        };
        let e = &mut self.entries[id as usize];
        e.live = true;
        e.addr = addr;
        e.len = len;
        e.pins = 0;
        e.moving = None;
        debug_assert!(e.last_use.is_empty() && e.unrecorded.is_empty());
        let gen = e.gen;
        let r = self.region_mut(addr);
        r.live += len;
        r.blocks.insert(addr, id);
        Some((id, gen))
    }

    /// The live entry `id` of generation `gen`.
    pub fn entry(&mut self, id: u32, gen: u32) -> &mut Entry {
        let e = &mut self.entries[id as usize];
        assert!(e.live && e.gen == gen, "stale movable handle");
        e
    }

    /// Frees block `id`: its range becomes held (the caller frees it now or
    /// after its events). Returns the entry's address, length, last-use
    /// events and unrecorded streams.
    pub fn free_block(&mut self, id: u32) -> (u64, u64, Vec<EventHandle>, Vec<Arc<StreamCore>>) {
        let e = &mut self.entries[id as usize];
        debug_assert!(e.live && e.pins == 0);
        e.live = false;
        e.gen = e.gen.wrapping_add(1);
        e.moving = None;
        let (addr, len) = (e.addr, e.len);
        let events = e.last_use.drain(..).map(|(_, ev)| ev).collect();
        let unrecorded = std::mem::take(&mut e.unrecorded);
        self.free_ids.push(id);
        let r = self.region_mut(addr);
        r.live -= len;
        r.blocks.remove(&addr);
        self.hold(addr, len);
        (addr, len, events, unrecorded)
    }

    /// Moves live block `id` to `dst`, whose bytes were held for it; its old
    /// range is freed.
    pub fn relocate(&mut self, id: u32, dst: u64) {
        let e = &mut self.entries[id as usize];
        let (src, len) = (e.addr, e.len);
        e.addr = dst;
        e.moving = None;
        let r = self.region_mut(src);
        r.live -= len;
        r.blocks.remove(&src);
        self.insert_free(src, len);
        let d = self.region_mut(dst);
        d.held -= len;
        d.incoming -= len;
        d.live += len;
        d.blocks.insert(dst, id);
        self.held_total -= len;
    }

    // ---- figures and checks ---------------------------------------------------------

    /// Bytes of all regions, of live blocks, held, and free.
    pub fn figures(&self) -> (u64, u64, u64, u64) {
        let regions = self.regions.len() as u64 * self.region_bytes;
        let live: u64 = self.regions.values().map(|r| r.live).sum();
        let free: u64 = self.free_by_addr.values().sum();
        (regions, live, self.held_total, free)
    }

    /// Recounts every structure; the first inconsistency found.
    pub fn check(&self) -> Result<(), String> {
        let mut held = 0;
        for (&base, r) in &self.regions {
            let free: u64 = self
                .free_by_addr
                .range(base..base + self.region_bytes)
                .map(|(_, l)| l)
                .sum();
            if r.incoming > r.held || (self.pass.is_none() && r.incoming > 0) {
                return Err(format!(
                    "movable region {base:#x}: incoming {} B",
                    r.incoming
                ));
            }
            if r.live + r.held + free != self.region_bytes {
                return Err(format!(
                    "movable region {base:#x}: live {} + held {} + free {free} != {}",
                    r.live, r.held, self.region_bytes
                ));
            }
            let mut sum = 0;
            let mut end = base;
            for (&a, &id) in &r.blocks {
                let e = &self.entries[id as usize];
                if !e.live || e.addr != a {
                    return Err(format!("movable block at {a:#x}: handle {id} disagrees"));
                }
                if a < end {
                    return Err(format!("movable blocks overlap at {a:#x}"));
                }
                if self.free_by_addr.range(a..a + e.len).next().is_some()
                    || self
                        .free_by_addr
                        .range(..a)
                        .next_back()
                        .is_some_and(|(&fa, &fl)| fa + fl > a)
                {
                    return Err(format!("movable block at {a:#x} overlaps a free extent"));
                }
                end = a + e.len;
                sum += e.len;
            }
            if end > base + self.region_bytes || sum != r.live {
                return Err(format!("movable region {base:#x}: blocks sum to {sum}"));
            }
            if r.live == 0 && r.held == 0 && !r.evacuating && self.pass.is_none() {
                return Err(format!("movable region {base:#x} is empty but kept"));
            }
            held += r.held;
        }
        if held != self.held_total {
            return Err(format!("held total {} != {held}", self.held_total));
        }
        let mut prev: Option<(u64, u64)> = None;
        for (&a, &l) in &self.free_by_addr {
            let base = self.region_of(a);
            let Some(r) = self.regions.get(&base) else {
                return Err(format!("free extent {a:#x} outside every region"));
            };
            if a + l > base + self.region_bytes || l == 0 || l % UNIT != 0 {
                return Err(format!("free extent {a:#x}+{l} is malformed"));
            }
            if let Some((pa, pl)) = prev {
                if pa + pl > a || (pa + pl == a && self.region_of(pa) == base) {
                    return Err(format!(
                        "free extents at {pa:#x} and {a:#x} overlap or touch"
                    ));
                }
            }
            if self.free_by_size.contains(&(l, a)) == r.evacuating {
                return Err(format!("free extent {a:#x}: size index disagrees"));
            }
            prev = Some((a, l));
        }
        if self.free_by_size.len() > self.free_by_addr.len() {
            return Err("size index holds extents that do not exist".into());
        }
        let live = self.entries.iter().filter(|e| e.live).count();
        let blocks: usize = self.regions.values().map(|r| r.blocks.len()).sum();
        if live != blocks {
            return Err(format!("{live} live handles, {blocks} blocks in regions"));
        }
        if self.pass.is_none() && self.regions.values().any(|r| r.evacuating) {
            return Err("a region is evacuating with no pass in flight".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const R: u64 = 1 << 20;

    #[test]
    fn best_fit_merging_and_accounting() {
        let mut a = ArenaState::new(R);
        a.add_region(4 * R);
        let (x, gx) = a.alloc_block(4096).unwrap();
        let (y, _) = a.alloc_block(8192).unwrap();
        let (z, _) = a.alloc_block(4096).unwrap();
        a.check().unwrap();
        assert_eq!(a.entry(x, gx).addr, 4 * R);
        // Free the middle block: a hole of 8 KiB; a 4 KiB request takes the
        // hole (best fit), not the big tail.
        let (addr, len, _, _) = a.free_block(y);
        a.unhold_free(addr, len);
        a.check().unwrap();
        let (w, gw) = a.alloc_block(4096).unwrap();
        assert_eq!(a.entry(w, gw).addr, 4 * R + 4096);
        // Free everything: one extent again, the region can go.
        for id in [x, z, w] {
            let (addr, len, _, _) = a.free_block(id);
            a.unhold_free(addr, len);
        }
        assert!(a.drop_if_empty(4 * R));
        assert!(a.regions.is_empty());
        a.check().unwrap();
    }

    #[test]
    fn evacuating_regions_take_no_allocations_and_extents_never_merge_across_regions() {
        let mut a = ArenaState::new(R);
        a.add_region(0);
        a.add_region(R);
        a.set_evacuating(0, true);
        let (x, g) = a.alloc_block(R).unwrap();
        assert_eq!(a.entry(x, g).addr, R);
        assert!(a.alloc_block(256).is_none());
        a.set_evacuating(0, false);
        assert!(a.alloc_block(R).is_some());
        a.check().unwrap();
    }
}
