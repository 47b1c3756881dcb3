//! The small path: size-class slabs whose free slots live on lock-free stacks.
//!
//! A slab is one aligned range taken from the heap and cut into equal slots
//! of one class. Its size grows with the class: at least eight slots, at
//! least [`MIN_SLAB`], at most one large slab (2 MiB, a CUDA granule), a
//! power of two, aligned to itself. Small slabs are sub-granule heap
//! ranges, so they fill the partly used granules between large blocks
//! instead of pinning whole granules of their own.
//!
//! Each slot has a global index `slab_id << SLOT_BITS | slot`; its "next"
//! link lives in the slab's host-side arrays, which are never freed while
//! the pool lives, and a retired slab id is only reused by a slab of the
//! same class (same slot count), so the stacks' stale-link reads always read
//! valid memory of the right length.
//!
//! Every class keeps one `clean` stack (slots any stream may take) and one
//! `dirty` stack per stream slot (slots freed on that stream, reusable at
//! once by it alone). Every slot not held by a live block is on exactly one
//! stack or in exactly one pending record; a slab whose slots are all on a
//! clean stack holds no live data and can be retired.

use super::size_class::SizeClasses;
use super::stack::{collect_chain, link_chain, IndexStack, Links, NIL};
use super::sync::{AtomicU32, AtomicU64};
use crossbeam_utils::CachePadded;
use std::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed, Release};
use std::sync::OnceLock;

/// The smallest slab.
pub(crate) const MIN_SLAB: u64 = 64 << 10;

/// Bits of a slot index that number the slot within its slab.
const SLOT_BITS: u32 = 13;

/// Slab headers are allocated in chunks of this many, on first use.
const CHUNK: usize = 1024;

/// Chunks enough for every slab id a slot index can name (`32 -
/// SLOT_BITS` bits): a fixed table, so a lookup masks instead of checking
/// bounds.
const CHUNKS: usize = (1 << (32 - SLOT_BITS)) / CHUNK;

/// Slots taken from the clean stack at once by a stream, so that one
/// stream's slots sit together (their links and sizes share cache lines
/// with each other, not with another thread's).
pub(crate) const REFILL: usize = 16;

/// Host-side arrays of one slab.
#[derive(Debug)]
struct SlabArrays {
    next: Box<[AtomicU32]>,
    /// Requested bytes of the block at each slot (stats, snapshots), with
    /// [`RAW_LIVE`] set while a raw allocation is live there: a raw
    /// allocation is one plain store, its free one `fetch_and` that both
    /// claims the slot (a second free finds the bit clear) and reads the
    /// size.
    requested: Box<[AtomicU32]>,
}

/// The bit of a slot's `requested` word that marks a live raw allocation
/// (small sizes stay below a granule / 8, far under 2^30). Not the top
/// bit: LLVM makes a claim of bit 30 one `lock btr`, of bit 31 a
/// compare-exchange loop.
const RAW_LIVE: u32 = 1 << 30;

/// One slab's header.
#[derive(Debug, Default)]
pub(crate) struct Slab {
    /// Device address; 0 while the id is unused.
    base: AtomicU64,
    class: AtomicU32,
    nslots: AtomicU32,
    /// The slab's bytes, its slots' size and `ceil(2^64 / size)`: fixed
    /// per class, so fixed for the header once first installed (an id is
    /// reused within its class only). A raw free reads them here, on the
    /// line it reads `base` from, instead of in the per-class tables one
    /// dependent load further.
    bytes: AtomicU64,
    size: AtomicU64,
    recip: AtomicU64,
    /// This header's id (its place in the chunks), set when its chunk is
    /// made.
    id: u32,
    arrays: OnceLock<SlabArrays>,
}

impl Slab {
    /// This header's slab id.
    pub(crate) fn id(&self) -> u32 {
        self.id
    }

    /// The slab's base if it is in use and holds `addr` (a slab is a
    /// power of two of bytes, aligned to itself).
    #[inline(always)]
    pub(crate) fn base_holding(&self, addr: u64) -> Option<u64> {
        let base = self.base.load(Acquire);
        let bytes = self.bytes.load(Relaxed);
        (base != 0 && addr & !bytes.wrapping_sub(1) == base).then_some(base)
    }
}

/// The slot of size `size` starting at byte `off` of a slab, or `None` if
/// no slot starts there; `recip` is `ceil(2^64 / size)`.
///
/// With `r = ceil(2^64 / size) = 2^64 / size + e` (`0 <= e < 1`), an
/// offset `off = q * size` gives `off * r = q * 2^64 + off * e`, and
/// `off * e < off < 2^64`: the 128-bit product's high half is exactly
/// `q`. Any other offset fails the multiply-back check. One `mul`
/// instead of a `div` (tens of cycles) on every raw free.
#[inline(always)]
fn slot_of(off: u64, recip: u64, size: u64) -> Option<u64> {
    let s = ((u128::from(off) * u128::from(recip)) >> 64) as u64;
    (s.wrapping_mul(size) == off).then_some(s)
}

/// Per-class stacks.
#[derive(Debug)]
pub(crate) struct ClassStacks {
    pub clean: CachePadded<IndexStack>,
    /// Chains pushed on `clean`, but for the slab retirement's own
    /// push-back: a slab turns all clean only by a push, so a class whose
    /// count has not moved since a retirement pass holds no empty slab that
    /// pass did not retire.
    clean_pushes: CachePadded<AtomicU64>,
    pub dirty: Box<[CachePadded<IndexStack>]>,
}

/// All slabs and class stacks of one pool.
#[derive(Debug)]
pub(crate) struct Slabs {
    pub classes: SizeClasses,
    pub stacks: Box<[ClassStacks]>,
    /// Slab headers by id, in lazily allocated chunks.
    chunks: Box<[OnceLock<Box<[Slab; CHUNK]>>; CHUNKS]>,
    /// Chunks this pool may use (its capacity's worth of slabs).
    max_chunks: usize,
    /// Slab ids handed out so far (high-water mark).
    used_ids: AtomicU32,
    /// Slab bytes per class.
    slab_sizes: Box<[u64]>,
    /// Per class, `ceil(2^64 / size)`: a raw free finds its slot by a
    /// multiply instead of a division (see [`Slabs::slot_of_offset`]).
    recips: Box<[u64]>,
}

/// Why a raw free found no live raw slot at an address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RawMiss {
    /// Not in the slab (a retired one, or past its end): not slab memory.
    Outside,
    /// Inside the slab but not at a slot's start.
    Interior,
    /// A slot's start with no raw allocation live: a double free, or a
    /// typed block.
    NotLive,
}

/// Where a slot's requested size and raw live bit are kept (an entry of
/// its slab's host arrays), found once and carried along: a magazine keeps
/// it beside the slot, a typed block in place of its size, and a raw free
/// finds it anyway (to clear the live bit). So the fast lane's pair makes
/// no slab lookup on a typed block and one on a raw pointer (each was 20
/// instructions).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SizeWord(*const AtomicU32);

impl SizeWord {
    /// No word: fills a rack's unused entries (never read).
    pub(crate) const NONE: SizeWord = SizeWord(std::ptr::null());

    /// The word as an address (a typed small block keeps it in place of
    /// its size).
    #[inline(always)]
    pub(crate) fn to_bits(self) -> usize {
        self.0 as usize
    }

    /// The word at `bits` (from [`SizeWord::to_bits`]).
    #[inline(always)]
    pub(crate) fn from_bits(bits: usize) -> SizeWord {
        SizeWord(bits as *const AtomicU32)
    }

    /// The requested size stored in the word (the live bit masked off).
    ///
    /// # Safety
    ///
    /// The `Slabs` the word came from is alive.
    #[inline(always)]
    pub(crate) unsafe fn requested(self) -> u64 {
        // SAFETY: the word lies in that `Slabs`' slab arrays, never freed,
        // moved or replaced while it lives (the caller's contract).
        u64::from(unsafe { &*self.0 }.load(Relaxed) & !RAW_LIVE)
    }
}

/// A slot index decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SlotRef {
    pub idx: u32,
    pub class: usize,
    pub addr: u64,
}

impl Links for Slabs {
    #[inline]
    fn link(&self, idx: u32) -> &AtomicU32 {
        let (a, s) = self.arrays(idx);
        &a.next[s]
    }
}

impl Slabs {
    /// Slabs for `classes`, at most `max_slab` bytes each, for a device of
    /// `capacity` bytes.
    pub(crate) fn new(
        classes: SizeClasses,
        max_slab: u64,
        capacity: u64,
        stream_slots: usize,
    ) -> Slabs {
        let stacks = (0..classes.len())
            .map(|_| ClassStacks {
                clean: CachePadded::new(IndexStack::new()),
                clean_pushes: CachePadded::new(AtomicU64::new(0)),
                dirty: (0..stream_slots)
                    .map(|_| CachePadded::new(IndexStack::new()))
                    .collect(),
            })
            .collect();
        let slab_sizes: Box<[u64]> = classes
            .sizes()
            .iter()
            .map(|&size| (size * 8).next_power_of_two().clamp(MIN_SLAB, max_slab))
            .collect();
        debug_assert!(slab_sizes
            .iter()
            .zip(classes.sizes())
            .all(|(&sb, &s)| sb / s <= 1 << SLOT_BITS));
        // Below 2^64 for every size of at least 2 (classes are multiples of
        // 256).
        let recips = classes
            .sizes()
            .iter()
            .map(|&size| ((1u128 << 64).div_ceil(u128::from(size))) as u64)
            .collect();
        let max_slabs = (capacity / MIN_SLAB + 1).min((u32::MAX >> SLOT_BITS) as u64 - 1) as usize;
        Slabs {
            classes,
            stacks,
            chunks: Box::new([const { OnceLock::new() }; CHUNKS]),
            max_chunks: max_slabs.div_ceil(CHUNK).min(CHUNKS),
            used_ids: AtomicU32::new(0),
            slab_sizes,
            recips,
        }
    }

    /// The slot of `class` starting at byte `off` of a slab (`off` below
    /// the slab's bytes), or `None` if no slot starts there ([`slot_of`]).
    #[inline(always)]
    fn slot_of_offset(&self, class: usize, off: u64) -> Option<u64> {
        slot_of(off, self.recips[class], self.classes.size_of(class))
    }

    /// Bytes of a slab of `class`.
    #[inline]
    pub(crate) fn slab_bytes(&self, class: usize) -> u64 {
        self.slab_sizes[class]
    }

    #[inline(always)]
    fn header(&self, id: u32) -> &Slab {
        // The mask is the identity on slab ids (below 2^(32 - SLOT_BITS)).
        let chunk = self.chunks[(id as usize / CHUNK) & (CHUNKS - 1)]
            .get()
            .expect("slab ids are installed before use");
        &chunk[id as usize % CHUNK]
    }

    #[inline(always)]
    fn arrays(&self, idx: u32) -> (&SlabArrays, usize) {
        let a = self
            .header(idx >> SLOT_BITS)
            .arrays
            .get()
            .expect("slab arrays exist before its slots are used");
        (a, (idx & ((1 << SLOT_BITS) - 1)) as usize)
    }

    /// Decodes a slot index.
    #[inline]
    pub(crate) fn slot(&self, idx: u32) -> SlotRef {
        let s = self.header(idx >> SLOT_BITS);
        let class = s.class.load(Relaxed) as usize;
        let addr = s.base.load(Relaxed)
            + (idx & ((1 << SLOT_BITS) - 1)) as u64 * self.classes.size_of(class);
        SlotRef { idx, class, addr }
    }

    /// Pops a slot of `class` for stream slot `stream`: its dirty stack
    /// first, then a run of up to [`REFILL`] clean slots (the rest of the
    /// run goes to its dirty stack).
    #[inline]
    pub(crate) fn pop(&self, class: usize, stream: Option<usize>) -> Option<u32> {
        let st = &self.stacks[class];
        let Some(s) = stream else {
            return st.clean.pop(self);
        };
        if let Some(i) = st.dirty[s].pop(self) {
            return Some(i);
        }
        let first = st.clean.pop(self)?;
        let mut run = [NIL; REFILL];
        let mut n = 0;
        while n < REFILL - 1 {
            match st.clean.pop(self) {
                Some(i) => {
                    run[n] = i;
                    n += 1;
                }
                None => break,
            }
        }
        if let Some((f, l)) = link_chain(self, &run[..n]) {
            st.dirty[s].push_chain(self, f, l);
        }
        Some(first)
    }

    /// Pushes a freed slot on its stream's dirty stack.
    #[inline]
    pub(crate) fn push_dirty(&self, class: usize, stream: usize, idx: u32) {
        self.stacks[class].dirty[stream].push(self, idx);
    }

    /// Pushes slots whose last uses completed on the clean stack.
    pub(crate) fn push_clean(&self, class: usize, idxs: &[u32]) {
        if let Some((f, l)) = link_chain(self, idxs) {
            let st = &self.stacks[class];
            st.clean.push_chain(self, f, l);
            st.clean_pushes.fetch_add(1, Release);
        }
    }

    /// [`Slabs::push_clean`] of slots a slab retirement pass took and
    /// kept, uncounted: none of their slabs is all clean.
    pub(crate) fn push_clean_back(&self, class: usize, idxs: &[u32]) {
        if let Some((f, l)) = link_chain(self, idxs) {
            self.stacks[class].clean.push_chain(self, f, l);
        }
    }

    /// Chains pushed on `class`'s clean stack so far (see
    /// [`ClassStacks`]'s `clean_pushes`).
    pub(crate) fn clean_pushes(&self, class: usize) -> u64 {
        self.stacks[class].clean_pushes.load(Acquire)
    }

    /// Pushes slots on a stream's dirty stack in one go.
    pub(crate) fn push_dirty_many(&self, class: usize, stream: usize, idxs: &[u32]) {
        if let Some((f, l)) = link_chain(self, idxs) {
            self.stacks[class].dirty[stream].push_chain(self, f, l);
        }
    }

    /// Whether stream slot `stream` holds dirty slots of `class`.
    pub(crate) fn holds_dirty(&self, class: usize, stream: usize) -> bool {
        !self.stacks[class].dirty[stream].is_empty()
    }

    /// Detaches every dirty stack of stream slot `stream` that holds
    /// slots: `(class, slots)`.
    pub(crate) fn take_dirty_all(&self, stream: usize) -> Vec<(usize, Vec<u32>)> {
        (0..self.classes.len())
            .filter(|&c| self.holds_dirty(c, stream))
            .map(|c| (c, self.take_dirty(c, stream)))
            .filter(|(_, v)| !v.is_empty())
            .collect()
    }

    /// Detaches every slot of a dirty stack.
    pub(crate) fn take_dirty(&self, class: usize, stream: usize) -> Vec<u32> {
        let mut v = Vec::new();
        collect_chain(self, self.stacks[class].dirty[stream].take_all(), &mut v);
        v
    }

    /// Detaches every slot of a clean stack.
    pub(crate) fn take_clean(&self, class: usize) -> Vec<u32> {
        let mut v = Vec::new();
        collect_chain(self, self.stacks[class].clean.take_all(), &mut v);
        v
    }

    /// Registers a new slab of `class` at `base` (reusing a retired id of
    /// the same class if given); returns its slot indices, or `None` when
    /// the slab table is full. Called under the heap lock, so ids are
    /// handed out by one thread at a time.
    pub(crate) fn install(
        &self,
        class: usize,
        base: u64,
        reuse_id: Option<u32>,
    ) -> Option<Vec<u32>> {
        let id = match reuse_id {
            Some(id) => id,
            None => {
                let id = self.used_ids.load(Relaxed);
                if id as usize / CHUNK >= self.max_chunks {
                    return None;
                }
                let first = id - id % CHUNK as u32;
                self.chunks[id as usize / CHUNK].get_or_init(|| {
                    (0..CHUNK as u32)
                        .map(|i| Slab {
                            id: first + i,
                            ..Slab::default()
                        })
                        .collect::<Box<[_]>>()
                        .try_into()
                        .expect("CHUNK headers")
                });
                self.used_ids.store(id + 1, Relaxed);
                id
            }
        };
        let slab = self.header(id);
        let n = (self.slab_bytes(class) / self.classes.size_of(class)) as u32;
        let a = slab.arrays.get_or_init(|| SlabArrays {
            next: (0..n).map(|_| AtomicU32::new(NIL)).collect(),
            requested: (0..n).map(|_| AtomicU32::new(0)).collect(),
        });
        debug_assert_eq!(
            a.next.len(),
            n as usize,
            "slab ids are reused within their class"
        );
        // A raw free finds the slab's base by masking (`free_raw_slot`).
        debug_assert!(
            self.slab_bytes(class).is_power_of_two() && base % self.slab_bytes(class) == 0,
            "a slab is a power of two of bytes, aligned to itself"
        );
        slab.class.store(class as u32, Relaxed);
        slab.nslots.store(n, Relaxed);
        slab.bytes.store(self.slab_bytes(class), Relaxed);
        slab.size.store(self.classes.size_of(class), Relaxed);
        slab.recip.store(self.recips[class], Relaxed);
        // Release: whoever pops one of these slots (Acquire on the stack
        // head) sees the class and base above.
        slab.base.store(base, Release);
        Some((0..n).map(|s| id << SLOT_BITS | s).collect())
    }

    /// The header of slab `id` (for the slab index: headers never move
    /// or go while these `Slabs` live).
    pub(crate) fn header_ptr(&self, id: u32) -> *const Slab {
        self.header(id)
    }

    /// Marks a slab id unused; its slots must be on no stack.
    pub(crate) fn retire(&self, id: u32) {
        self.header(id).base.store(0, Release);
    }

    /// Slab id of a slot index.
    #[inline]
    pub(crate) fn slab_of(&self, idx: u32) -> u32 {
        idx >> SLOT_BITS
    }

    /// Base address, class and slot count of slab `id` (base 0: unused).
    pub(crate) fn slab_info(&self, id: u32) -> (u64, usize, u32) {
        let s = self.header(id);
        (
            s.base.load(Acquire),
            s.class.load(Relaxed) as usize,
            s.nslots.load(Relaxed),
        )
    }

    /// Bytes at the end of a slab of `class` that no slot covers.
    pub(crate) fn tail_bytes(&self, class: usize) -> u64 {
        self.slab_bytes(class) % self.classes.size_of(class)
    }

    /// The slot index of address `addr` in slab `id`, if it is a slot start.
    pub(crate) fn slot_at(&self, id: u32, addr: u64) -> Option<SlotRef> {
        let (base, class, n) = self.slab_info(id);
        if base == 0 || addr < base {
            return None;
        }
        let off = addr - base;
        if off >= self.slab_bytes(class) {
            return None;
        }
        let s = self
            .slot_of_offset(class, off)
            .filter(|&s| s < u64::from(n))?;
        let idx = id << SLOT_BITS | s as u32;
        Some(SlotRef { idx, class, addr })
    }

    /// Notes an allocation at slot `idx`: its requested size, and for a
    /// raw one its live bit (one slab lookup for both).
    #[inline(always)]
    pub(crate) fn note_alloc(&self, idx: u32, requested: u64, raw: bool) {
        let (a, s) = self.arrays(idx);
        Self::note_in(&a.requested[s], requested, raw);
    }

    #[inline(always)]
    fn note_in(word: &AtomicU32, requested: u64, raw: bool) {
        debug_assert!(requested < u64::from(RAW_LIVE));
        let live = if raw { RAW_LIVE } else { 0 };
        // The slot is this thread's until it hands the pointer out:
        // a plain store (release: a free on another thread that got the
        // pointer through the caller's synchronization sees it).
        word.store(requested as u32 | live, Release);
    }

    /// The size word of slot `idx` (see [`SizeWord`]).
    #[inline]
    pub(crate) fn size_word(&self, idx: u32) -> SizeWord {
        let (a, s) = self.arrays(idx);
        SizeWord(&a.requested[s])
    }

    /// [`Slabs::note_alloc`] through the slot's size word, with no lookup.
    ///
    /// # Safety
    ///
    /// `w` came from [`Slabs::size_word`] or [`Slabs::free_raw_slot`] of
    /// this `Slabs` (it is not [`SizeWord::NONE`]).
    #[inline(always)]
    pub(crate) unsafe fn note_alloc_at(&self, w: SizeWord, requested: u64, raw: bool) {
        // SAFETY: by the contract the word lies in this `Slabs`' slab
        // arrays, which are never freed, moved or replaced while it lives
        // (they are made once per slab header and kept when the slab id
        // is reused), and `&self` shows it lives.
        Self::note_in(unsafe { &*w.0 }, requested, raw);
    }

    /// The raw free of the block at `addr`, which the slab index placed
    /// in the slab of header `h` (one of these `Slabs`): the slot and the
    /// requested size of the live raw allocation there, its live bit
    /// cleared. Every figure comes from the header itself, so the slot's
    /// word is two dependent loads from the index entry.
    #[inline]
    pub(crate) fn free_raw_slot(
        &self,
        h: &Slab,
        addr: u64,
    ) -> Result<(SlotRef, u64, SizeWord), RawMiss> {
        let Some(base) = h.base_holding(addr) else {
            return Err(RawMiss::Outside);
        };
        // The header's copies of the class's figures.
        let Some(s) = slot_of(addr - base, h.recip.load(Relaxed), h.size.load(Relaxed)) else {
            return Err(RawMiss::Interior);
        };
        if s >= u64::from(h.nslots.load(Relaxed)) {
            return Err(RawMiss::Interior);
        }
        let s = s as usize;
        let a = h
            .arrays
            .get()
            .expect("slab arrays exist before its slots are used");
        let cell = &a.requested[s];
        // Only the live bit of the old value is used, so this is one
        // `lock btr` on x86, not a compare-exchange loop.
        if cell.fetch_and(!RAW_LIVE, AcqRel) & RAW_LIVE == 0 {
            return Err(RawMiss::NotLive);
        }
        // The size is read after the claim: nobody writes the word until
        // the slot is allocated again, which it cannot be before this free
        // puts it back.
        let word = cell.load(Relaxed);
        let idx = h.id << SLOT_BITS | s as u32;
        Ok((
            SlotRef {
                idx,
                class: h.class.load(Relaxed) as usize,
                addr,
            },
            u64::from(word & !RAW_LIVE),
            SizeWord(cell),
        ))
    }

    /// Requested size of the block last allocated at this slot.
    pub(crate) fn requested(&self, idx: u32) -> u64 {
        let (a, s) = self.arrays(idx);
        u64::from(a.requested[s].load(Relaxed) & !RAW_LIVE)
    }

    /// Whether a raw allocation is live at this slot.
    pub(crate) fn is_raw_live(&self, idx: u32) -> bool {
        let (a, s) = self.arrays(idx);
        a.requested[s].load(Acquire) & RAW_LIVE != 0
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// The multiply finds exactly the offsets a division would, for every
    /// offset of every class's slab, and for far larger offsets too.
    #[test]
    fn slot_of_offset_agrees_with_division() {
        for small_max in [32 << 10, 1 << 20] {
            let classes = SizeClasses::new(small_max);
            let slabs = Slabs::new(classes.clone(), 8 << 20, 1 << 30, 2);
            for (class, &size) in classes.sizes().iter().enumerate() {
                let by_div = |off: u64| (off % size == 0).then_some(off / size);
                for off in 0..slabs.slab_bytes(class) {
                    assert_eq!(
                        slabs.slot_of_offset(class, off),
                        by_div(off),
                        "{size} {off}"
                    );
                }
                let mut off = 1u64;
                while off < u64::MAX / 3 {
                    for o in [off - 1, off, off + 1, off / size * size] {
                        assert_eq!(slabs.slot_of_offset(class, o), by_div(o), "{size} {o}");
                    }
                    off = off * 3 + 7;
                }
            }
        }
    }
}
