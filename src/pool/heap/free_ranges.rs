//! The free-range index and the placement policy of the large path.
//!
//! Free ranges live in two indexes kept in step: `by_addr` (address order,
//! for merging neighbours and finding the cover of a granule) and one
//! [`SizeIndex`] per tag (best-fit order). Invariants: every free range is
//! in `by_addr` and, if it is at least `request_floor` long or `Pending`,
//! in its tag's size index; adjacent free ranges with equal tags (in one
//! segment) are merged. Placement is best fit among the shortest [`WIDTH`]
//! candidates of the tags the requesting stream may use, preferring
//! candidates that are already backed by physical memory.

use super::*;

/// Free ranges of each tag that [`Heap::place`] compares: the shortest few.
pub(super) const WIDTH: usize = 8;

/// Two best-fit orders of free ranges `(len, addr)` merged into one, at
/// most `left` more.
pub(super) struct BestFitMerge<I: Iterator> {
    a: Option<std::iter::Peekable<I>>,
    b: Option<std::iter::Peekable<I>>,
    left: usize,
}

impl<I: Iterator<Item = (u64, u64)>> Iterator for BestFitMerge<I> {
    type Item = (u64, u64);

    // Always inlined: it runs for every candidate of a large placement,
    // and as a call it cost 3% of random_allocations.
    #[inline(always)]
    fn next(&mut self) -> Option<(u64, u64)> {
        if self.left == 0 {
            return None;
        }
        let a = self.a.as_mut().and_then(|i| i.peek().copied());
        let b = self.b.as_mut().and_then(|i| i.peek().copied());
        let from_b = match (a, b) {
            (Some(a), Some(b)) => b < a,
            (None, Some(_)) => true,
            (_, None) => false,
        };
        let side = if from_b { &mut self.b } else { &mut self.a };
        let r = side.as_mut().and_then(Iterator::next)?;
        self.left -= 1;
        Some(r)
    }
}

impl Heap {
    // ---- free-range bookkeeping ----------------------------------------------

    pub(super) fn index_insert(&mut self, addr: u64, r: FreeRange) {
        self.by_addr.insert(addr, r);
        self.size_index(r.tag).insert(r.len, addr);
    }

    /// The size index of `tag`, made if it has none.
    #[inline]
    pub(super) fn size_index(&mut self, tag: Tag) -> &mut SizeIndex {
        Self::size_index_in(&mut self.by_tag, self.request_floor, tag)
    }

    /// [`Heap::size_index`] over the map alone (for callers that hold other
    /// fields): `Clean` and `Dirty` indexes get the request floor,
    /// `Pending` ones none.
    #[inline]
    pub(super) fn size_index_in(
        by_tag: &mut FxHashMap<Tag, SizeIndex>,
        request_floor: u64,
        tag: Tag,
    ) -> &mut SizeIndex {
        let floor = match tag {
            Tag::Pending(_) => 0,
            Tag::Clean | Tag::Dirty(_) => request_floor,
        };
        by_tag
            .entry(tag)
            .or_insert_with(|| SizeIndex::with_floor(floor))
    }

    /// Removes the size index of `tag` with every range stored in it (the
    /// unstored ones found by address), for callers that move them all.
    pub(super) fn take_size_index(&mut self, tag: Tag) -> Option<SizeIndex> {
        let mut set = self.by_tag.remove(&tag)?;
        let floor = set.floor();
        if set.unstored() > 0 {
            let short: Vec<(u64, u64)> = self
                .by_addr
                .iter()
                .filter(|(_, r)| r.tag == tag && r.len < floor)
                .map(|(a, r)| (r.len, a))
                .collect();
            set.store_all(short);
        } else if floor > 0 {
            set.store_all([]);
        }
        Some(set)
    }

    pub(super) fn index_remove(&mut self, addr: u64) -> FreeRange {
        let r = self.by_addr.remove(addr).expect("free range exists");
        let set = self.by_tag.get_mut(&r.tag).expect("tag set exists");
        set.remove(r.len, addr);
        if set.is_empty() && matches!(r.tag, Tag::Pending(_)) {
            self.by_tag.remove(&r.tag);
        }
        r
    }

    pub(super) fn same_segment(&self, a: u64, b: u64) -> bool {
        Self::same_segment_in(&self.phys, a, b)
    }

    /// Whether `a` and `b` lie in the same plain segment (always, in VMM
    /// mode). A function of `phys` alone so callers can hold `by_addr`.
    pub(super) fn same_segment_in(phys: &Physical, a: u64, b: u64) -> bool {
        match phys {
            Physical::Vmm { .. } => true,
            Physical::Segments { segs } => {
                let seg_of = |x: u64| segs.range(..=x).next_back().map(|(s, _)| *s);
                seg_of(a) == seg_of(b)
            }
        }
    }

    /// Inserts a free range and merges it with equal-tag neighbours: the
    /// one after by an exact lookup of its start, the one before as the
    /// last start before `addr` (see `addr_index.rs`); a merge with the
    /// range before extends that entry in place.
    pub(super) fn insert_free(&mut self, addr: u64, len: u64, tag: Tag) {
        if len == 0 {
            return;
        }
        if let Tag::Dirty(s) = tag {
            self.note_dirty(s);
        }
        // Each neighbour is looked up once and removed or lengthened where
        // it was found (a lookup and then a change made two searches).
        let phys = &self.phys;
        let next = self.by_addr.remove_if(addr + len, |nr| {
            nr.tag == tag && Self::same_segment_in(phys, addr, addr + len)
        });
        // (`phys` is borrowed: the map alone.)
        let set = Self::size_index_in(&mut self.by_tag, self.request_floor, tag);
        let mut total = len;
        if let Some(nr) = next {
            set.remove(nr.len, addr + len);
            total += nr.len;
        }
        let prev = self.by_addr.extend_ending_at(addr, total, |pa, pr| {
            pr.tag == tag && Self::same_segment_in(phys, pa, addr)
        });
        if let Some((pa, plen)) = prev {
            set.relen(plen, plen + total, pa);
            return;
        }
        self.by_addr.insert(addr, FreeRange { len: total, tag });
        set.insert(total, addr);
    }

    /// Best fit for `len` bytes at `align` among ranges tagged `tag`:
    /// `(range len, range addr)`.
    pub(super) fn best_in(&self, tag: Tag, len: u64, align: u64) -> Option<(u64, u64)> {
        let set = self.by_tag.get(&tag)?;
        let mut tried = 0;
        for (rlen, raddr) in set.at_least(len) {
            let start = align_up(raddr, align);
            if start + len <= raddr + rlen {
                return Some((rlen, raddr));
            }
            tried += 1;
            if tried > 64 {
                // Only aligned (slab) requests get here; a range that large
                // always fits.
                return set.at_least(len + align).next();
            }
        }
        None
    }

    /// Chooses where to put `len` bytes for stream slot `slot`: among the
    /// smallest free ranges that fit (clean, or dirty on that slot), and at
    /// either end of each, the placement that needs the fewest granules
    /// without physical memory, then the smallest range. Fewer unbacked
    /// granules means less stitching now and less memory held at the peak,
    /// because a block placed against a used granule shares it. Returns
    /// `(range len, range addr, start)`.
    pub(super) fn place(&self, slot: Option<u16>, len: u64, align: u64) -> Option<(u64, u64, u64)> {
        let mut best: Option<(u64, u64, u64, u64)> = None; // (cost, rlen, raddr, start)
        for (rlen, raddr) in self.candidates(slot, len, align) {
            for start in self.ends(rlen, raddr, len, align) {
                let c = (self.unbacked(start, len), rlen, raddr, start);
                if best.is_none_or(|b| (c.0, c.1) < (b.0, b.1)) {
                    best = Some(c);
                }
            }
            // Ranges come shortest first: nothing later beats a fully
            // backed place.
            if best.is_some_and(|b| b.0 == 0) {
                break;
            }
        }
        match best {
            Some(b) => Some((b.1, b.2, b.3)),
            None => self.any_fit(slot, len, align),
        }
    }

    /// [`Heap::place`]'s choice when it needs no unbacked granule, else
    /// `None`, found without ranking the candidates: they are visited in
    /// `place`'s order, so the first fully backed placement is `place`'s
    /// too (nothing later can beat it).
    pub(super) fn place_backed(
        &self,
        slot: Option<u16>,
        len: u64,
        align: u64,
    ) -> Option<(u64, u64, u64)> {
        let mut seen = false;
        for (rlen, raddr) in self.candidates(slot, len, align) {
            seen = true;
            for start in self.ends(rlen, raddr, len, align) {
                if self.fully_backed(start, len) {
                    return Some((rlen, raddr, start));
                }
            }
        }
        if seen {
            return None;
        }
        self.any_fit(slot, len, align)
            .filter(|&(_, _, start)| self.fully_backed(start, len))
    }

    /// The free ranges [`Heap::place`] compares for `len` bytes at `align`:
    /// the [`WIDTH`] shortest that fit of `Clean` and `Dirty(slot)`
    /// together, as `(len, addr)` in best-fit order (shortest, then lowest
    /// address). The two tags' indexes are merged as they are read.
    pub(super) fn candidates(
        &self,
        slot: Option<u16>,
        len: u64,
        align: u64,
    ) -> impl Iterator<Item = (u64, u64)> + '_ {
        let fits = move |r: &(u64, u64)| align_up(r.1, align) + len <= r.1 + r.0;
        let of = |tag: Tag| {
            self.by_tag
                .get(&tag)
                .map(|set| set.at_least(len).filter(fits).peekable())
        };
        BestFitMerge {
            a: of(Tag::Clean),
            b: slot.and_then(|s| of(Tag::Dirty(s))),
            left: WIDTH,
        }
    }

    /// Where in free range `(rlen, raddr)` a block of `len` bytes at
    /// `align` may go, preferred end first: blocks smaller than a granule
    /// go to the high end, so that small blocks collect together instead
    /// of pinning granules between large ones; larger ones to the low end.
    pub(super) fn ends(&self, rlen: u64, raddr: u64, len: u64, align: u64) -> [u64; 2] {
        let lo = align_up(raddr, align);
        let hi = ((raddr + rlen - len) / align * align).max(lo);
        if len < self.gran {
            [hi, lo]
        } else {
            [lo, hi]
        }
    }

    /// The first range of `Clean` or `Dirty(slot)` large enough for `len`
    /// bytes at any alignment, at its aligned start: only aligned (slab)
    /// requests can find no candidate that fits, and this serves them.
    pub(super) fn any_fit(
        &self,
        slot: Option<u16>,
        len: u64,
        align: u64,
    ) -> Option<(u64, u64, u64)> {
        let mut any = self.best_in(Tag::Clean, len, align);
        if let Some(d) = slot.and_then(|s| self.best_in(Tag::Dirty(s), len, align)) {
            any = Some(any.map_or(d, |a| a.min(d)));
        }
        any.map(|(rlen, raddr)| (rlen, raddr, align_up(raddr, align)))
    }

    /// Removes `[start, start+len)` from free range `(raddr, rlen)`,
    /// keeping its head and tail free with the same tag; returns the range.
    /// Neither piece can merge with anything: the range's neighbours were
    /// already unmergeable (equal-tag neighbours are always merged), and the
    /// taken part lies between the pieces. So the head keeps the range's
    /// entry, resized in place.
    pub(super) fn split_free(&mut self, raddr: u64, rlen: u64, start: u64, len: u64) -> FreeRange {
        let (head, tail) = (start - raddr, raddr + rlen - start - len);
        let r = self.by_addr.get(raddr).expect("free range exists");
        debug_assert_eq!(r.len, rlen);
        if head > 0 {
            self.by_addr.set_len(raddr, head);
        } else {
            self.by_addr.remove(raddr);
        }
        if tail > 0 {
            self.by_addr.insert(
                start + len,
                FreeRange {
                    len: tail,
                    tag: r.tag,
                },
            );
        }
        let set = self.by_tag.get_mut(&r.tag).expect("tag set exists");
        set.remove(rlen, raddr);
        if head > 0 {
            set.insert(head, raddr);
        }
        if tail > 0 {
            set.insert(tail, start + len);
        }
        if set.is_empty() && matches!(r.tag, Tag::Pending(_)) {
            self.by_tag.remove(&r.tag);
        }
        r
    }

    /// Gives the free memory in `[lo, hi)` the tag `tag`.
    pub(super) fn retag(&mut self, lo: u64, hi: u64, tag: Tag) {
        let first = self.by_addr.at_or_before(lo).map_or(lo, |(a, _)| a);
        let hits: Vec<(u64, FreeRange)> = self
            .by_addr
            .starting_in(first, hi)
            .filter(|(a, r)| a + r.len > lo)
            .collect();
        for (a, r) in hits {
            if r.tag == tag {
                continue;
            }
            self.index_remove(a);
            let (s, e) = (a.max(lo), (a + r.len).min(hi));
            self.insert_free(a, s - a, r.tag);
            self.insert_free(e, a + r.len - e, r.tag);
            self.insert_free(s, e - s, tag);
        }
    }

    /// The largest request that can be served without new device memory:
    /// the longest run of free, backed memory (not pending), or a free range
    /// backed by stitching spare and idle chunks, whichever is larger.
    pub(crate) fn largest_free(&self) -> u64 {
        let mut best = 0;
        let mut longest_range = 0;
        for (a, r) in self.by_addr.iter() {
            if matches!(r.tag, Tag::Pending(_)) {
                continue;
            }
            longest_range = longest_range.max(r.len);
            for (_, l) in self.mapped_parts(a, r.len) {
                best = best.max(l);
            }
        }
        let stitchable = match &self.phys {
            Physical::Vmm { spare, idle, .. } => (spare.len() + idle.len()) as u64 * self.gran,
            Physical::Segments { .. } => 0,
        };
        best.max(longest_range.min(stitchable))
    }
}
