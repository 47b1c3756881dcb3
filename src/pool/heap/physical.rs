//! The physical-memory map of the large path: which chunk backs each
//! granule of the reservation (or which plain segments exist), how many
//! allocated ranges use each granule, and the chunks held unmapped.
//!
//! Invariants: a granule is mapped while any allocated range overlaps it
//! (`users > 0`, or one range covers it whole); an idle granule (mapped, no
//! users) is unmapped only when it lies wholly inside one `Clean` free
//! range, so no pending work can touch an unmapped address; every chunk the
//! heap holds is mapped at exactly one live granule, spare, deferred
//! behind a quarantined mapping, or in a planned mapping not yet published
//! (`map_job.rs`), and counted once in `reserved`.

use super::*;

/// The granules that `[start, start + len)` touches, `first..=last`, and
/// of those the ones it covers whole, `whole.0..whole.1` (empty if none).
/// The others, at most the first and the last, it shares.
#[inline]
pub(super) fn granule_span(base: u64, gran: u64, start: u64, len: u64) -> (u32, u32, (u32, u32)) {
    let (s, e) = (start - base, start + len - base);
    let (first, last) = ((s / gran) as u32, ((e - 1) / gran) as u32);
    let lo = first + (s % gran != 0) as u32;
    let hi = if e % gran == 0 { last + 1 } else { last };
    (first, last, (lo, hi.max(lo)))
}

/// The shared granules of a span from [`granule_span`]: none, one or two.
#[inline]
pub(super) fn shared_granules(first: u32, last: u32, whole: (u32, u32)) -> [Option<u32>; 2] {
    let head = (first < whole.0).then_some(first);
    let tail = (last >= whole.1 && (last > first || head.is_none())).then_some(last);
    [head, tail]
}

impl Heap {
    /// Whether every granule of `[start, start+len)` has physical memory
    /// (`unbacked(start, len) == 0`, without counting: always in segment
    /// mode).
    #[inline]
    pub(super) fn fully_backed(&self, start: u64, len: u64) -> bool {
        let Physical::Vmm { base, mapped, .. } = &self.phys else {
            return true;
        };
        let first = ((start - base) / self.gran) as u32;
        let last = ((start + len - 1 - base) / self.gran) as u32;
        mapped.all_in(first, last + 1)
    }

    /// Granules of `[start, start+len)` with no physical memory (0 in
    /// segment mode, where free memory is always backed).
    #[inline]
    pub(crate) fn unbacked(&self, start: u64, len: u64) -> u64 {
        let Physical::Vmm {
            base,
            mapped,
            granules,
            ..
        } = &self.phys
        else {
            return 0;
        };
        let first = ((start - base) / self.gran) as usize;
        let last = ((start + len - 1 - base) / self.gran) as usize;
        // Most blocks span a granule or two: look at them directly; the
        // bitmap answers for long spans a word (64 granules) at a time.
        if last - first < 4 {
            return granules[first..=last]
                .iter()
                .filter(|g| g.chunk.is_none())
                .count() as u64;
        }
        (last - first + 1) as u64 - mapped.count_in(first as u32, last as u32 + 1) as u64
    }

    /// In segment mode, adds a segment that fits `len` at `align`; in VMM
    /// mode the reservation is exhausted.
    pub(super) fn grow_segments(&mut self, len: u64, align: u64) -> Result<(u64, u64)> {
        let Physical::Segments { .. } = self.phys else {
            return Err(Error::DeviceOutOfMemory {
                device: self.dev,
                requested: len,
                used: self.reserved,
                capacity: self.reserved,
            });
        };
        // PyTorch's segment sizes: small requests share 20 MiB segments.
        let want = if len < (10 << 20) { 20 << 20 } else { len };
        let seg_len = align_up(want + if align > ALIGN { align } else { 0 }, self.gran);
        // Under a memory limit, a small request's segment shrinks to fit.
        let seg_len = self.limit.fit_segment(
            self.reserved,
            seg_len,
            align_up(len + align, self.gran),
            self.gran,
        );
        self.limit.admit(self.dev, self.reserved, seg_len)?;
        let base = self.backend.alloc_segment(self.dev, seg_len)?.addr();
        tracing::debug!(device = self.dev, bytes = seg_len, "segment allocated");
        self.device_allocs += 1;
        self.reserved += seg_len;
        if let Physical::Segments { segs } = &mut self.phys {
            segs.insert(base, seg_len);
        }
        self.index_insert(
            base,
            FreeRange {
                len: seg_len,
                tag: Tag::Clean,
            },
        );
        Ok((seg_len, base))
    }

    pub(super) fn spare_len(&self) -> usize {
        match &self.phys {
            Physical::Vmm { spare, .. } => spare.len(),
            Physical::Segments { .. } => 0,
        }
    }

    pub(super) fn push_spare(&mut self, c: ChunkHandle) {
        if let Physical::Vmm { spare, .. } = &mut self.phys {
            spare.push(c);
        }
    }

    /// Undoes [`Heap::back`]'s count of users for `[start, start + len)`:
    /// granules left with no user that hold memory become idle.
    pub(super) fn drop_users(&mut self, start: u64, len: u64) {
        self.count_users(start, len, false);
    }

    /// Counts `[start, start + len)` as a user of its granules (`add`) or
    /// no longer (`!add`), keeping the idle set exact: a granule is idle
    /// while it holds memory and no allocated range overlaps it. Shared
    /// granules (at most the first and the last) count their users; the
    /// ones the range covers whole change a word of the set at a time.
    #[inline(always)]
    pub(super) fn count_users(&mut self, start: u64, len: u64, add: bool) {
        let Physical::Vmm {
            base,
            granules,
            idle,
            mapped,
            ..
        } = &mut self.phys
        else {
            return;
        };
        let (first, last, whole) = granule_span(*base, self.gran, start, len);
        for g in shared_granules(first, last, whole).into_iter().flatten() {
            let gr = &mut granules[g as usize];
            if add {
                gr.users += 1;
                if gr.users == 1 {
                    idle.remove(g);
                }
            } else {
                gr.users -= 1;
                if gr.users == 0 && gr.chunk.is_some() {
                    idle.insert(g);
                }
            }
        }
        if whole.0 < whole.1 {
            if add {
                idle.remove_range(whole.0, whole.1);
            } else {
                idle.insert_range_of(whole.0, whole.1, mapped);
            }
        }
    }

    /// Records `chunks`, just mapped, under granules `g0..`.
    pub(super) fn note_mapped(&mut self, g0: u32, chunks: &[ChunkHandle]) {
        let Physical::Vmm {
            granules, mapped, ..
        } = &mut self.phys
        else {
            unreachable!("VMM only")
        };
        for (k, &c) in chunks.iter().enumerate() {
            granules[g0 as usize + k].chunk = Some(c);
        }
        mapped.insert_range(g0, g0 + chunks.len() as u32);
    }

    pub(super) fn take_spare(&mut self) -> Option<ChunkHandle> {
        match &mut self.phys {
            Physical::Vmm { spare, .. } => spare.pop(),
            Physical::Segments { .. } => None,
        }
    }

    /// The free ranges covering granule `g`: `(addr, len, tag)`, or `None`
    /// if part of it is not free.
    pub(super) fn granule_cover(&self, g: u32) -> Option<Cover> {
        let Physical::Vmm { base, .. } = &self.phys else {
            return None;
        };
        self.cover(
            *base + g as u64 * self.gran,
            *base + (g as u64 + 1) * self.gran,
        )
    }

    /// The free ranges covering `[gs, ge)` in address order, or `None` if
    /// part of it is not free.
    pub(super) fn cover(&self, gs: u64, ge: u64) -> Option<Cover> {
        let mut out = Cover::new();
        let (a, r) = self.by_addr.at_or_before(gs)?;
        if a + r.len <= gs {
            return None;
        }
        out.push((a, r.len, r.tag));
        let mut cursor = a + r.len;
        while cursor < ge {
            let r = self.by_addr.get(cursor)?;
            out.push((cursor, r.len, r.tag));
            cursor += r.len;
        }
        Some(out)
    }

    /// Whether granule `g` lies wholly inside clean free memory.
    pub(super) fn granule_is_clean(&self, g: u32) -> bool {
        self.granule_cover(g)
            .is_some_and(|c| c.iter().all(|p| p.2 == Tag::Clean))
    }

    /// Grants `peers` access to every mapped granule, and to every granule
    /// mapped from now on. VMM mode only (segments need
    /// `cuCtxEnablePeerAccess`, which the backend seam does not offer):
    /// `Unsupported` otherwise. On an error the earlier peer set stays.
    pub(crate) fn set_peers(&mut self, peers: &[usize]) -> Result<()> {
        let Physical::Vmm { base, granules, .. } = &self.phys else {
            return Err(Error::Unsupported(
                "peer access to plain segments (no VMM)".into(),
            ));
        };
        // One grant per run of mapped granules: access is set per address
        // range, and one call may span every mapping in it.
        let mut g = 0;
        while g < granules.len() {
            if granules[g].chunk.is_none() {
                g += 1;
                continue;
            }
            let start = g;
            while g < granules.len() && granules[g].chunk.is_some() {
                g += 1;
            }
            let va = *base + start as u64 * self.gran;
            let bytes = (g - start) as u64 * self.gran;
            self.backend
                .set_access(self.dev, DevicePtr(va), bytes, peers)?;
        }
        self.peers = peers.to_vec();
        Ok(())
    }

    /// Unmaps an idle granule and returns its chunk.
    pub(super) fn unmap_granule(&mut self, g: u32) -> Option<ChunkHandle> {
        let Physical::Vmm {
            base,
            granules,
            idle,
            mapped,
            ..
        } = &mut self.phys
        else {
            return None;
        };
        let va = *base + g as u64 * self.gran;
        let chunk = granules[g as usize].chunk?;
        if let Err(e) = self.backend.unmap(self.dev, DevicePtr(va), self.gran) {
            tracing::warn!(device = self.dev, "unmap of an idle granule failed: {e}");
            return None;
        }
        granules[g as usize].chunk = None;
        mapped.remove(g);
        idle.remove(g);
        Some(chunk)
    }

    // ---- giving memory back ------------------------------------------------------------

    /// Releases every unmapped spare chunk, every idle clean granule and
    /// (segment mode) every wholly free clean segment to the device. Returns
    /// the bytes released.
    pub(crate) fn release_cached(&mut self) -> u64 {
        self.release_cached_up_to(u64::MAX)
    }

    /// [`Heap::release_cached`], giving back at most `limit` bytes: spare
    /// chunks first (already unmapped), then idle clean granules from the
    /// top of the reservation down (or free segments), each only while it
    /// fits in what is left of `limit`. The idle release policy keeps
    /// what the next busy period is likely to need this way.
    pub(crate) fn release_cached_up_to(&mut self, limit: u64) -> u64 {
        if self.capture_hold {
            return 0;
        }
        let before = self.reserved;
        let fits = |h: &Heap, bytes: u64| before - h.reserved + bytes <= limit;
        match &self.phys {
            Physical::Vmm { idle, .. } => {
                let idle: Vec<u32> = idle.iter().collect();
                let spare = match &mut self.phys {
                    Physical::Vmm { spare, .. } => std::mem::take(spare),
                    Physical::Segments { .. } => unreachable!(),
                };
                for c in spare {
                    if fits(self, self.gran) {
                        self.release_chunk(c);
                    } else {
                        self.push_spare(c);
                    }
                }
                for g in idle.into_iter().rev() {
                    if !fits(self, self.gran) {
                        break;
                    }
                    if self.granule_is_clean(g) {
                        if let Some(c) = self.unmap_granule(g) {
                            self.release_chunk(c);
                        }
                    }
                }
            }
            Physical::Segments { segs } => {
                let free: Vec<(u64, u64)> = segs
                    .iter()
                    .filter(|(b, l)| matches!(self.by_addr.get(**b), Some(r) if r.tag == Tag::Clean && r.len == **l))
                    .map(|(b, l)| (*b, *l))
                    .collect();
                for (b, l) in free {
                    if !fits(self, l) {
                        continue;
                    }
                    if let Err(e) = self.backend.free_segment(self.dev, DevicePtr(b)) {
                        tracing::warn!(device = self.dev, "cuMemFree failed: {e}");
                        continue;
                    }
                    self.index_remove(b);
                    if let Physical::Segments { segs } = &mut self.phys {
                        segs.remove(&b);
                    }
                    self.reserved -= l;
                    self.device_frees += 1;
                }
            }
        }
        if before != self.reserved {
            tracing::debug!(
                device = self.dev,
                released = before - self.reserved,
                "cached memory released"
            );
        }
        before - self.reserved
    }

    /// Gives one unmapped chunk back to the device. A chunk the driver
    /// refuses stays held, on the spare list (it is still counted in
    /// `reserved`), with a warning.
    pub(super) fn release_chunk(&mut self, c: ChunkHandle) {
        if self.aliases.contains_key(&c) {
            // Still mapped at a quarantined address: the device frees it
            // only when that goes (`release_quarantine`), so it stays held.
            self.deferred.insert(c);
            return;
        }
        match self.backend.release_chunk(self.dev, c) {
            Ok(()) => {
                self.reserved -= self.gran;
                self.device_frees += 1;
            }
            Err(e) => {
                tracing::warn!(device = self.dev, "cuMemRelease failed: {e}");
                self.push_spare(c);
            }
        }
    }

    /// Releases to the device the physical memory of idle, clean granules
    /// lying wholly inside `[lo, hi)` (the rest of the cache stays).
    /// Returns the bytes released.
    pub(crate) fn release_range(&mut self, lo: u64, hi: u64) -> u64 {
        if self.capture_hold {
            return 0;
        }
        let Physical::Vmm { base, idle, .. } = &self.phys else {
            return 0;
        };
        let first = (lo.saturating_sub(*base)).div_ceil(self.gran) as u32;
        let end = (hi.saturating_sub(*base) / self.gran) as u32;
        let gs: Vec<u32> = idle.range(first, end).collect();
        let before = self.reserved;
        for g in gs {
            if !self.granule_is_clean(g) {
                continue;
            }
            if let Some(c) = self.unmap_granule(g) {
                self.release_chunk(c);
            }
        }
        before - self.reserved
    }

    /// The parts of `[addr, addr+len)` backed by physical memory.
    pub(super) fn mapped_parts(&self, addr: u64, len: u64) -> Vec<(u64, u64)> {
        let Physical::Vmm { base, granules, .. } = &self.phys else {
            return vec![(addr, len)];
        };
        let mut out: Vec<(u64, u64)> = Vec::new();
        let end = addr + len;
        let mut g = (addr - base) / self.gran;
        loop {
            let gs = base + g * self.gran;
            if gs >= end {
                break;
            }
            if granules[g as usize].chunk.is_some() {
                let (s, e) = (addr.max(gs), end.min(gs + self.gran));
                match out.last_mut() {
                    Some(last) if last.0 + last.1 == s => last.1 += e - s,
                    _ => out.push((s, e - s)),
                }
            }
            g += 1;
        }
        out
    }

    /// Cached bytes [`Heap::release_cached`] can give back (after the
    /// streams' frees are flushed): idle granules, spare chunks and chunks
    /// waiting on quarantined mappings, or wholly free segments. The rest
    /// of the free memory shares a granule or a segment with allocated
    /// ranges (PyTorch's "inactive split" memory).
    pub(crate) fn releasable_bytes(&self) -> u64 {
        match &self.phys {
            Physical::Vmm { idle, spare, .. } => {
                (idle.len() + spare.len() + self.deferred.len()) as u64 * self.gran
            }
            Physical::Segments { segs } => segs
                .iter()
                .filter(|(b, l)| matches!(self.by_addr.get(**b), Some(r) if r.len == **l))
                .map(|(_, l)| *l)
                .sum(),
        }
    }
}
