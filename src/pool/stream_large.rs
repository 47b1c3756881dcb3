//! Each stream's large blocks: the ranges it parked for reuse (`exact.rs`)
//! and the live large blocks it allocated, by address, in one part per
//! stream slot (one more part for streams without a slot), each part split
//! into [`SHARDS`] shards with a lock each, one per thread (by the
//! thread's counter shard, `stats.rs`).
//!
//! A stream reuses the range it freed (the steady state of every training
//! loop and server) by locking only its own part's shard of the calling
//! thread, once per allocation and once per free: no lock or written cache
//! line is shared with another stream, nor with another thread of the same
//! stream (a server's threads on the default stream: with one lock per
//! stream, two threads ran at a third of one thread's throughput). A
//! thread that finds nothing in its shard looks in the stream's other
//! shards before the heap. The device's heap lock is taken only to give
//! parked ranges back (`drain_*`, with the shard locks nested inside it:
//! heap, then shard, never the other way round).
//!
//! The live index holds the raw large blocks (the C ABI and PyTorch path
//! keep only an address): what a raw free, `record_stream`, IPC export and
//! the census need to know of one: its range length and bytes requested.
//! A typed [`Block`](super::Block) carries all that itself, so typed blocks
//! are not listed and their reuse touches no map at all. A lookup names
//! the part to try first (the freeing stream's: in PyTorch a block is
//! freed on the stream that allocated it) and starts in the calling
//! thread's shard; only a block freed on another stream, and a bad
//! pointer, visit every part.
//!
//! Invariants:
//! 1. An address is in the live index exactly while a raw large block
//!    handed to a caller is live at it (planned blocks of learned steps
//!    included): inserted when the pool hands the range out, removed
//!    before the free that publishes the range again (to the parking
//!    lists, the heap, an arena or a pending group).
//! 2. A parked range is an allocated heap range listed by exactly one
//!    shard of one part, the part of the slot of the stream that freed it;
//!    that stream alone may take it back without waiting (stream order
//!    covers its old uses), from any thread.
//! 3. A shard's `count`, `bytes` and `live` are written only under its
//!    lock, after each change, for readers that do not take it.
//! 4. A raw block is listed by a shard of the part of the stream that
//!    allocated it.
//! 5. No thread holds two shard locks at once, except a drain, which
//!    takes them in index order under the heap lock.

use super::exact::ParkedLists;
use super::LargeLive;
use crossbeam_utils::CachePadded;
use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use std::sync::atomic::{
    AtomicBool, AtomicU64, AtomicUsize,
    Ordering::{Acquire, Relaxed, Release},
};

/// A live large block: its range's length and its record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LiveEntry {
    pub len: u64,
    pub live: LargeLive,
}

/// Shards per part: threads on one stream lock different shards as long
/// as their counter shards differ modulo this.
pub(crate) const SHARDS: usize = 8;

/// One thread shard of a stream slot's part.
#[derive(Debug, Default)]
struct Shard {
    state: Mutex<PartState>,
    /// Parked ranges and their bytes, as of the last change.
    count: AtomicUsize,
    bytes: AtomicU64,
    /// Live raw blocks listed, as of the last change: a lookup passes a
    /// shard with none without locking it.
    live: AtomicUsize,
    /// Ranges ever parked here, as of the last change (published with
    /// `Release`: a reader that sees a count sees the frees behind it).
    puts: AtomicU64,
}

#[derive(Debug, Default)]
struct PartState {
    parked: ParkedLists,
    live: LiveIndex,
}

/// Changes to a part's live index held back before they are made in one
/// pass (see [`LiveIndex`]).
const LOG: usize = 128;
/// Most recent log entries a removal looks through for its block's insert.
const CANCEL: usize = 8;

/// A part's live raw blocks by address, with the inserts of the fast
/// path held back in a short log, made in one pass when it fills or
/// before anything reads the map.
///
/// A block allocated at random among many live ones has a cold map entry:
/// inserted at once, its miss holds up the allocation; made in a pass,
/// one after another, independent misses overlap. A removal reads the
/// entry (a raw free checks it): one freed within [`CANCEL`] changes of
/// its allocation (a PyTorch tensor freed after its kernel, a pair) finds
/// its insert still in the log and cancels it, touching no map.
#[derive(Debug, Default)]
struct LiveIndex {
    map: FxHashMap<u64, LiveEntry>,
    /// Inserts not yet made, oldest first (no address twice: invariant 1).
    log: Vec<(u64, LiveEntry)>,
}

impl LiveIndex {
    #[inline]
    fn insert(&mut self, addr: u64, e: LiveEntry) {
        if self.log.capacity() == 0 {
            self.log.reserve_exact(LOG);
        }
        self.log.push((addr, e));
        if self.log.len() >= LOG {
            self.apply();
        }
    }

    /// Blocks listed, logged ones included.
    #[inline]
    fn len(&self) -> usize {
        self.map.len() + self.log.len()
    }

    /// Makes the logged inserts.
    fn apply(&mut self) {
        for (addr, e) in self.log.drain(..) {
            let old = self.map.insert(addr, e);
            debug_assert!(old.is_none(), "a live large block at {addr:#x} already");
        }
    }

    /// The map, with every insert made.
    #[inline]
    fn map(&mut self) -> &mut FxHashMap<u64, LiveEntry> {
        if !self.log.is_empty() {
            self.apply();
        }
        &mut self.map
    }

    /// Takes the block at `addr` out if `take(its entry)`: `Ok` with the
    /// entry, else `Err` with the block there, if any, left as it was.
    #[inline]
    fn take_if(
        &mut self,
        addr: u64,
        take: impl Fn(&LiveEntry) -> bool,
    ) -> Result<LiveEntry, Option<LiveEntry>> {
        // Freed soon after its allocation (the usual reuse): its insert
        // is still logged, and goes without touching the map.
        let n = self.log.len();
        if let Some(i) = (n.saturating_sub(CANCEL)..n)
            .rev()
            .find(|&i| self.log[i].0 == addr)
        {
            let e = self.log[i].1;
            if !take(&e) {
                return Err(Some(e));
            }
            self.log.remove(i);
            return Ok(e);
        }
        let m = self.map();
        match m.get(&addr) {
            Some(e) if take(e) => Ok(m.remove(&addr).expect("just found")),
            other => Err(other.copied()),
        }
    }
}

impl Shard {
    /// Publishes the parked counts after a change made under the lock.
    #[inline]
    fn publish(&self, st: &PartState) {
        self.count.store(st.parked.count, Relaxed);
        self.bytes.store(st.parked.bytes, Relaxed);
        self.live.store(st.live.len(), Relaxed);
        self.puts.store(st.parked.puts, Release);
    }
}

/// Every stream slot's large blocks (see the file's comment).
#[derive(Debug)]
pub(crate) struct StreamLarge {
    /// Shard `t` of part `p` at `p * SHARDS + t`; part `s` for slot `s`,
    /// the last for streams without a slot.
    shards: Box<[CachePadded<Shard>]>,
    /// One shard's addresses while [`StreamLarge::drain_sorted`] hands them
    /// over (kept for its capacity; drains run under the heap lock).
    scratch: Mutex<Vec<u64>>,
    /// Per part: another stream's slow path gave the part's parked ranges
    /// to the heap since its stream last looked (see
    /// [`StreamLarge::take_parks_taken`]).
    parks_taken: Box<[AtomicBool]>,
}

/// Takes shard `sh`'s parked addresses into `scratch`, ascending, and
/// runs `f` on them with `first`'s answer (asked of the shard's park
/// count before the take) while the shard's lock is held; whether it had
/// any.
fn drain_shard_sorted<R>(
    sh: &Shard,
    scratch: &mut Vec<u64>,
    first: impl FnOnce(u64) -> R,
    f: impl FnOnce(R, &[u64]),
) -> bool {
    if sh.count.load(Relaxed) == 0 {
        return false;
    }
    let mut st = sh.state.lock();
    let r = first(st.parked.puts);
    scratch.clear();
    st.parked.drain_each(|_, a| scratch.push(a));
    sh.publish(&st);
    if scratch.is_empty() {
        return false;
    }
    scratch.sort_unstable();
    f(r, scratch);
    true
}

/// The calling thread's shard in every part.
#[inline]
fn my_shard() -> usize {
    super::thread_state::thread_index() % SHARDS
}

impl StreamLarge {
    /// Parts for stream slots `0..slots`, and one for slotless streams.
    pub(crate) fn new(slots: usize) -> Self {
        StreamLarge {
            shards: (0..(slots + 1) * SHARDS)
                .map(|_| CachePadded::default())
                .collect(),
            scratch: Mutex::default(),
            parks_taken: (0..=slots).map(|_| AtomicBool::new(false)).collect(),
        }
    }

    /// Notes that a slow path of another stream than `slot`'s gave
    /// `slot`'s parked ranges to the heap.
    pub(crate) fn note_parks_taken(&self, slot: u16) {
        self.parks_taken[self.part(Some(slot))].store(true, Relaxed);
    }

    /// Whether another stream's slow path gave `slot`'s parked ranges to
    /// the heap since `slot`'s stream last asked.
    pub(crate) fn take_parks_taken(&self, slot: u16) -> bool {
        let f = &self.parks_taken[self.part(Some(slot))];
        f.load(Relaxed) && f.swap(false, Relaxed)
    }

    fn parts(&self) -> usize {
        self.shards.len() / SHARDS
    }

    /// The part of stream slot `slot`.
    #[inline]
    fn part(&self, slot: Option<u16>) -> usize {
        let last = self.parts() - 1;
        slot.map_or(last, |s| (s as usize).min(last))
    }

    /// The shards of part `p`, the calling thread's first.
    #[inline]
    fn shards_of(&self, p: usize) -> impl Iterator<Item = &Shard> {
        let me = my_shard();
        (0..SHARDS).map(move |k| &*self.shards[p * SHARDS + (me + k) % SHARDS])
    }

    /// The calling thread's shard of part `p`.
    #[inline]
    fn mine(&self, p: usize) -> &Shard {
        &self.shards[p * SHARDS + my_shard()]
    }

    // ---- the fast paths: one lock of the stream's own part ---------------------------

    /// A range parked by `slot` of `len` bytes or a little more, handed
    /// out at once as a live block `live` (listed if raw): `(addr, its
    /// length)`. The calling thread's shard first, then the stream's
    /// others.
    #[inline]
    pub(crate) fn take_parked(&self, slot: u16, len: u64, live: LargeLive) -> Option<(u64, u64)> {
        if slot as usize >= self.parts() {
            return None;
        }
        self.shards_of(slot as usize).find_map(|sh| {
            if sh.count.load(Relaxed) == 0 {
                return None;
            }
            let mut st = sh.state.lock();
            let (addr, got) = st.parked.take(len)?;
            if live.raw {
                st.live.insert(addr, LiveEntry { len: got, live });
            }
            sh.publish(&st);
            Some((addr, got))
        })
    }

    /// The raw free of the block at `addr` on `slot`, into `slot`'s
    /// parking lists (the shard that listed it), if `slot`'s part holds
    /// it as a raw block: what it was. `None` changes nothing.
    #[inline]
    pub(crate) fn park_live_raw(&self, slot: u16, addr: u64) -> Option<LiveEntry> {
        self.shards_of(self.part(Some(slot))).find_map(|sh| {
            if sh.live.load(Relaxed) == 0 {
                return None;
            }
            let mut st = sh.state.lock();
            let e = st.live.take_if(addr, |e| e.live.raw).ok()?;
            st.parked.put(e.len, addr);
            sh.publish(&st);
            Some(e)
        })
    }

    /// Parks a range of `len` bytes freed on `slot` (no longer live).
    pub(crate) fn park(&self, slot: u16, len: u64, addr: u64) {
        let sh = self.mine(self.part(Some(slot)));
        let mut st = sh.state.lock();
        st.parked.put(len, addr);
        sh.publish(&st);
    }

    // ---- the live index ---------------------------------------------------------------

    /// Records the block just handed out at `addr` by a stream of `slot`.
    #[inline]
    pub(crate) fn insert(&self, slot: Option<u16>, addr: u64, len: u64, live: LargeLive) {
        let sh = self.mine(self.part(slot));
        let mut st = sh.state.lock();
        st.live.insert(addr, LiveEntry { len, live });
        sh.publish(&st);
    }

    /// Runs `f` on the live map holding `addr`, looking first in `hint`'s
    /// part, then in the slotless one, then in every other; `None` if no
    /// part holds it.
    fn with_live<R>(
        &self,
        hint: Option<u16>,
        addr: u64,
        mut f: impl FnMut(&mut FxHashMap<u64, LiveEntry>) -> R,
    ) -> Option<R> {
        let first = self.part(hint);
        let last = self.parts() - 1;
        let order = std::iter::once(first)
            .chain((first != last).then_some(last))
            .chain((0..last).filter(move |&p| p != first));
        for p in order {
            for sh in self.shards_of(p) {
                // A block the caller may look up was listed before the
                // call (its allocation happened before), so a shard that
                // published none holds none of those.
                if sh.live.load(Relaxed) == 0 {
                    continue;
                }
                let mut st = sh.state.lock();
                let m = st.live.map();
                if m.contains_key(&addr) {
                    let r = f(m);
                    sh.publish(&st);
                    return Some(r);
                }
            }
        }
        None
    }

    /// The live raw block at `addr`, if any (`hint`: the slot whose part
    /// is looked at first).
    pub(crate) fn get(&self, hint: Option<u16>, addr: u64) -> Option<LiveEntry> {
        self.with_live(hint, addr, |m| m[&addr])
    }

    /// Takes the block at `addr` out if it is a raw allocation, in one
    /// step (of two threads freeing one pointer, one gets it): `Ok` with
    /// what it was, else `Err` with the block there, if any, left as it
    /// was.
    pub(crate) fn remove_raw(
        &self,
        hint: Option<u16>,
        addr: u64,
    ) -> Result<LiveEntry, Option<LiveEntry>> {
        let found = self.with_live(hint, addr, |m| {
            let e = m[&addr];
            if e.live.raw {
                m.remove(&addr);
                Ok(e)
            } else {
                Err(Some(e))
            }
        });
        found.unwrap_or(Err(None))
    }

    /// Bytes of the ranges of every live block (exact while no thread
    /// allocates or frees meanwhile).
    pub(crate) fn live_bytes(&self) -> u64 {
        self.shards
            .iter()
            .map(|sh| {
                sh.state
                    .lock()
                    .live
                    .map()
                    .values()
                    .map(|e| e.len)
                    .sum::<u64>()
            })
            .sum()
    }

    // ---- giving parked ranges back ----------------------------------------------------

    /// The slots with ranges parked, each with its
    /// shards' park counts (`Acquire`: every range parked up to a count
    /// was freed before it was read), for [`StreamLarge::drain_sorted`]
    /// to tell which ranges were parked before a stream query. Streams
    /// without a slot are not listed (they cannot be asked).
    pub(crate) fn parked_slots(&self) -> Vec<(u16, [u64; SHARDS])> {
        (0..self.parts() - 1)
            .filter_map(|p| {
                let shards = &self.shards[p * SHARDS..(p + 1) * SHARDS];
                if shards.iter().all(|sh| sh.count.load(Relaxed) == 0) {
                    return None;
                }
                Some((
                    p as u16,
                    std::array::from_fn(|k| shards[k].puts.load(Acquire)),
                ))
            })
            .collect()
    }

    /// Removes every parked range, passing each shard's addresses to `f`
    /// at once with the slot of its part and whether they are clean,
    /// that is, `clean(slot, shard, its park count)` (see
    /// [`StreamLarge::parked_slots`]; read under the shard's lock, so no
    /// range joins after the check), ascending: freed in that order,
    /// ranges that sit side by side (often parked neighbours) merge while
    /// their index entries are still cached, and the granules' records are
    /// read in order, where class order visited them at random (the
    /// lengths are the heap's to give: bare addresses sort in half the
    /// instructions of `(addr, len)` pairs). Each shard's lock is held
    /// while `f` runs, so no range is ever out of both the lists and the
    /// heap while its stream could look for it.
    pub(crate) fn drain_sorted(
        &self,
        clean: impl Fn(u16, usize, u64) -> bool,
        mut f: impl FnMut(u16, bool, &[u64]),
    ) {
        let mut scratch = self.scratch.lock();
        for (i, sh) in self.shards.iter().enumerate() {
            let slot = (i / SHARDS) as u16;
            drain_shard_sorted(
                sh,
                &mut scratch,
                |puts| clean(slot, i % SHARDS, puts),
                |is_clean, addrs| f(slot, is_clean, addrs),
            );
        }
    }

    /// [`StreamLarge::drain_sorted`] for `slot`'s part alone: its parked
    /// ranges' addresses, a shard's at a time, ascending, to `f` (the
    /// shard's lock held); whether there were any.
    pub(crate) fn drain_slot_sorted(&self, slot: u16, mut f: impl FnMut(&[u64])) -> bool {
        let mut scratch = self.scratch.lock();
        let mut any = false;
        for sh in self.shards_of(self.part(Some(slot))) {
            any |= drain_shard_sorted(sh, &mut scratch, |_| (), |(), addrs| f(addrs));
        }
        any
    }

    /// Removes and returns the ranges parked by `slot` as `(len, addr)`.
    pub(crate) fn drain_slot(&self, slot: u16) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        for sh in self.shards_of(self.part(Some(slot))) {
            let mut st = sh.state.lock();
            st.parked.drain_each(|l, a| out.push((l, a)));
            sh.publish(&st);
        }
        out
    }

    /// Every parked address (exact while no stream parks or takes).
    pub(crate) fn parked_addrs(&self) -> Vec<u64> {
        let mut out = Vec::new();
        for sh in self.shards.iter() {
            out.extend(sh.state.lock().parked.addrs());
        }
        out
    }

    /// Bytes parked (as last published by each shard).
    pub(crate) fn parked_bytes(&self) -> u64 {
        self.shards.iter().map(|sh| sh.bytes.load(Relaxed)).sum()
    }

    /// Whether nothing is parked (as last published by each shard).
    pub(crate) fn nothing_parked(&self) -> bool {
        self.shards.iter().all(|sh| sh.count.load(Relaxed) == 0)
    }

    /// Forgets every parked range and live block (teardown).
    pub(crate) fn clear(&self) {
        for sh in self.shards.iter() {
            let mut st = sh.state.lock();
            let puts = st.parked.puts;
            *st = PartState::default();
            st.parked.puts = puts;
            sh.publish(&st);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn live(requested: u64, raw: bool) -> LargeLive {
        LargeLive { requested, raw }
    }

    #[test]
    fn blocks_are_found_from_any_stream_until_removed() {
        let l = StreamLarge::new(4);
        l.insert(Some(1), 0x20_0000, 4 << 20, live(4_000_000, true));
        l.insert(Some(3), 0x80_0000, 2 << 20, live(2_000_000, false));
        l.insert(None, 0xc0_0000, 1 << 20, live(1 << 20, false));
        assert_eq!(l.live_bytes(), 7 << 20);
        // Found with the right hint, another slot's, or none.
        for hint in [Some(1), Some(0), None] {
            assert_eq!(
                l.get(hint, 0x20_0000).map(|e| e.live.requested),
                Some(4_000_000)
            );
        }
        assert_eq!(l.get(Some(2), 0xc0_0000).map(|e| e.len), Some(1 << 20));
        // A typed block is not freed as raw, and stays.
        let typed = l.remove_raw(Some(3), 0x80_0000).expect_err("not raw");
        assert_eq!(typed.map(|e| e.len), Some(2 << 20));
        assert_eq!(l.park_live_raw(3, 0x80_0000), None);
        assert!(l.get(Some(3), 0x80_0000).is_some());
        // A raw one is, once, whichever stream frees it.
        assert_eq!(l.remove_raw(Some(2), 0x20_0000).map(|e| e.len), Ok(4 << 20));
        assert_eq!(l.remove_raw(Some(1), 0x20_0000), Err(None));
        assert_eq!(l.live_bytes(), 3 << 20);
        assert!(l.nothing_parked());
    }

    #[test]
    fn a_stream_takes_back_only_what_it_parked() {
        let l = StreamLarge::new(2);
        let mib = 1u64 << 20;
        l.insert(Some(1), 0x200_0000, 4 * mib, live(4 * mib, true));
        l.park(0, 4 * mib, 0x100_0000);
        assert_eq!(l.park_live_raw(1, 0x200_0000).map(|e| e.len), Some(4 * mib));
        assert_eq!((l.parked_bytes(), l.live_bytes()), (8 * mib, 0));
        // Each stream gets its own range back, live again.
        assert_eq!(
            l.take_parked(1, 4 * mib, live(5, true)),
            Some((0x200_0000, 4 * mib))
        );
        assert_eq!(l.take_parked(1, 4 * mib, live(5, true)), None);
        assert_eq!(
            l.get(Some(1), 0x200_0000).map(|e| e.live.requested),
            Some(5)
        );
        let mut drained = Vec::new();
        l.drain_sorted(|_, _, _| false, |s, _, a| drained.push((s, a.to_vec())));
        assert_eq!(drained, vec![(0, vec![0x100_0000])]);
        assert!(l.nothing_parked() && l.take_parked(0, 4 * mib, live(1, false)).is_none());
        l.park(1, 2 * mib, 0x300_0000);
        assert_eq!(l.drain_slot(1), vec![(2 * mib, 0x300_0000)]);
        assert_eq!(l.parked_addrs(), Vec::<u64>::new());
    }

    /// A drain calls a shard's ranges clean only while its park count is
    /// the one read before (a stream query): a range parked since might
    /// have been freed after work the query did not see.
    #[test]
    fn only_ranges_parked_before_the_count_was_read_drain_clean() {
        let l = StreamLarge::new(3);
        let mib = 1u64 << 20;
        assert!(l.parked_slots().is_empty());
        l.park(0, mib, 0x100_0000);
        l.park(1, mib, 0x200_0000);
        l.park(2, mib, 0x300_0000);
        // Slot 2 is not asked about (its count is not read).
        let counts: Vec<_> = l.parked_slots().into_iter().filter(|c| c.0 != 2).collect();
        assert_eq!(counts.iter().map(|c| c.0).collect::<Vec<_>>(), vec![0, 1]);
        // Slot 1 parks again after its count was read.
        l.park(1, mib, 0x400_0000);
        let read = |slot: u16| counts.iter().find(|c| c.0 == slot).map(|c| c.1);
        let mut drained = Vec::new();
        l.drain_sorted(
            |slot, k, puts| read(slot).is_some_and(|c| c[k] == puts),
            |slot, clean, a| drained.push((slot, clean, a.to_vec())),
        );
        assert_eq!(
            drained,
            vec![
                (0, true, vec![0x100_0000]),
                (1, false, vec![0x200_0000, 0x400_0000]),
                (2, false, vec![0x300_0000]),
            ]
        );
        // Counts never go back: what was read before a drain is stale.
        l.park(0, mib, 0x500_0000);
        let again = l.parked_slots();
        assert_ne!(again[0].1, counts[0].1);
    }

    /// Threads of one stream park in their own shards, and each finds
    /// the others' ranges (a range parked on a stream is that stream's,
    /// whichever thread freed it); drains and counts see every shard.
    #[test]
    fn threads_of_one_stream_share_what_it_parked() {
        let l = StreamLarge::new(2);
        let mib = 1u64 << 20;
        let addrs: Vec<u64> = (0..6u64).map(|i| (i + 1) << 26).collect();
        // Six threads (so at least two shards) each park one range on
        // slot 1, the first three also a raw live block.
        std::thread::scope(|s| {
            for (i, &a) in addrs.iter().enumerate() {
                let l = &l;
                s.spawn(move || {
                    l.park(1, 4 * mib, a);
                    if i < 3 {
                        l.insert(Some(1), a + (8 << 20), 2 * mib, live(2 * mib, true));
                    }
                });
            }
        });
        assert_eq!(l.parked_bytes(), 24 * mib);
        assert_eq!(l.live_bytes(), 6 * mib);
        let mut got: Vec<u64> = (0..6)
            .map(|_| l.take_parked(1, 4 * mib, live(1, false)).expect("parked").0)
            .collect();
        got.sort_unstable();
        assert_eq!(got, addrs);
        assert!(l.nothing_parked() && l.take_parked(1, 4 * mib, live(1, false)).is_none());
        // Raw frees from this thread find blocks other threads listed,
        // and park them on the stream.
        for &a in &addrs[..3] {
            assert_eq!(
                l.park_live_raw(1, a + (8 << 20)).map(|e| e.len),
                Some(2 * mib)
            );
        }
        assert_eq!(l.live_bytes(), 0);
        let mut drained: Vec<u64> = l.drain_slot(1).into_iter().map(|(_, a)| a).collect();
        drained.sort_unstable();
        assert_eq!(
            drained,
            addrs[..3].iter().map(|a| a + (8 << 20)).collect::<Vec<_>>()
        );
        // Another stream finds none of them.
        std::thread::scope(|s| {
            s.spawn(|| l.park(1, 4 * mib, addrs[0]));
        });
        assert!(l.take_parked(0, 4 * mib, live(1, false)).is_none());
        let mut sorted = Vec::new();
        l.drain_sorted(
            |_, _, _| false,
            |slot, _, a| sorted.push((slot, a.to_vec())),
        );
        assert_eq!(sorted, vec![(1, vec![addrs[0]])]);
    }

    #[test]
    fn two_threads_freeing_one_raw_pointer_free_it_once() {
        let l = StreamLarge::new(2);
        for round in 0..200u64 {
            let addr = 0x40_0000 + (round << 22);
            l.insert(Some((round % 2) as u16), addr, 1 << 20, live(1 << 20, true));
            let wins: usize = std::thread::scope(|s| {
                let hs: Vec<_> = (0..2u16)
                    .map(|t| {
                        let l = &l;
                        s.spawn(move || {
                            let won = if round % 3 == 0 {
                                l.park_live_raw(t, addr).is_some()
                                    || l.remove_raw(Some(t), addr).is_ok()
                            } else {
                                l.remove_raw(Some(t), addr).is_ok()
                            };
                            usize::from(won)
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().expect("no panic")).sum()
            });
            assert_eq!(wins, 1);
            l.drain_sorted(|_, _, _| false, |_, _, _| {});
        }
        assert_eq!(l.live_bytes(), 0);
    }
}
