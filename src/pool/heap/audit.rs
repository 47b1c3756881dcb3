//! Figures, snapshots and the full consistency audit of the heap
//! ([`Heap::check`]), which the tests and the debug maintenance pass run
//! after every change they make.

use super::*;

/// One piece of the heap's address space, for snapshots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Piece {
    /// An allocated range (a large block or a slab).
    Allocated,
    /// A free range with its tag.
    Free(Tag),
}

impl Heap {
    // ---- audit -------------------------------------------------------------------------

    /// Recomputes every figure from the structures (slow; for stats and tests).
    pub(crate) fn figures(&self) -> HeapFigures {
        let mut f = HeapFigures {
            reserved: self.reserved,
            allocated: self.allocated_bytes,
            ..Default::default()
        };
        for (addr, r) in self.by_addr.iter() {
            let mapped = self.mapped_bytes_in(addr, r.len);
            match r.tag {
                Tag::Clean => f.free_clean += mapped,
                Tag::Dirty(_) => f.free_dirty += mapped,
                Tag::Pending(_) => f.free_pending += mapped,
            }
        }
        if let Physical::Vmm { spare, .. } = &self.phys {
            f.spare = spare.len() as u64 * self.gran;
        }
        f.deferred = self.deferred.len() as u64 * self.gran;
        f.paused = self.paused_bytes;
        f
    }

    /// Each tag's size index against a recount of the address index: its
    /// ranges and bytes, the unstored ones (under its floor), and every
    /// stored range present there with that tag and length.
    pub(super) fn check_size_indexes(&self) -> std::result::Result<(), String> {
        let mut recount: FxHashMap<Tag, (usize, u64, usize)> = FxHashMap::default();
        for (_, r) in self.by_addr.iter() {
            let floor = self.by_tag.get(&r.tag).map_or(0, |s| s.floor());
            let e = recount.entry(r.tag).or_default();
            e.0 += 1;
            e.1 += r.len;
            e.2 += (r.len < floor) as usize;
        }
        for (tag, set) in &self.by_tag {
            let (n, bytes, short) = recount.get(tag).copied().unwrap_or_default();
            if (set.len(), set.bytes(), set.unstored()) != (n, bytes, short) {
                return Err(format!(
                    "{tag:?} size index holds {} ranges ({} unstored, {} bytes); \
                     the address index {n} ({short} under the floor, {bytes} bytes)",
                    set.len(),
                    set.unstored(),
                    set.bytes()
                ));
            }
            if matches!(tag, Tag::Pending(_)) && set.floor() > 0 {
                return Err(format!("{tag:?} size index has a floor"));
            }
            for (len, addr) in set.at_least(set.floor()) {
                if self.by_addr.get(addr) != Some(FreeRange { len, tag: *tag }) {
                    return Err(format!(
                        "{tag:?} size index holds {addr:#x}+{len}, not free so"
                    ));
                }
            }
        }
        Ok(())
    }

    /// Bytes of `[addr, addr+len)` that lie in mapped granules.
    pub(super) fn mapped_bytes_in(&self, addr: u64, len: u64) -> u64 {
        self.mapped_parts(addr, len).iter().map(|p| p.1).sum()
    }

    /// Checks the heap's structural invariants; returns a description of the
    /// first violation.
    pub(crate) fn check(&self) -> std::result::Result<(), String> {
        if self.in_flight > 0 {
            // A planned mapping's granules are in no set and its cut rests
            // in no range until it is published (`map_job.rs`).
            return Err(format!("{} mappings in flight", self.in_flight));
        }
        // Free and allocated ranges do not overlap and merge rules hold.
        let mut spans: Vec<(u64, u64, Option<Tag>)> = self
            .by_addr
            .iter()
            .map(|(a, r)| (a, r.len, Some(r.tag)))
            .collect();
        if !self.by_addr.consistent() {
            return Err("address index: start, end and order maps disagree".into());
        }
        spans.extend(self.allocated.iter().map(|(&a, &l)| (a, l, None)));
        if let Physical::Vmm {
            base, quarantine, ..
        } = &self.phys
        {
            spans.extend(
                quarantine
                    .iter()
                    .map(|g| (base + g as u64 * self.gran, self.gran, None)),
            );
        }
        spans.sort_unstable_by_key(|s| s.0);
        for w in spans.windows(2) {
            if w[0].0 + w[0].1 > w[1].0 {
                return Err(format!("ranges overlap at {:#x} and {:#x}", w[0].0, w[1].0));
            }
            if w[0].0 + w[0].1 == w[1].0
                && w[0].2.is_some()
                && w[0].2 == w[1].2
                && self.same_segment(w[0].0, w[1].0)
            {
                return Err(format!(
                    "equal-tag free ranges at {:#x} and {:#x} not merged",
                    w[0].0, w[1].0
                ));
            }
        }
        let tagged: usize = self.by_tag.values().map(|s| s.len()).sum();
        if tagged != self.by_addr.len() {
            return Err(format!(
                "tag index has {tagged} ranges, address index {}",
                self.by_addr.len()
            ));
        }
        self.check_size_indexes()?;
        if self.allocated.values().sum::<u64>() != self.allocated_bytes {
            return Err("allocated byte count drifted".into());
        }
        self.check_paused()?;
        let f = self.figures();
        // Paused ranges are allocated but hold no physical memory.
        let accounted =
            f.allocated - f.paused + f.free_clean + f.free_dirty + f.free_pending + f.spare;
        if accounted != f.reserved {
            return Err(format!(
                "reserved {} != allocated - paused + free mapped + spare = {accounted}",
                f.reserved
            ));
        }
        match &self.phys {
            Physical::Vmm {
                base,
                len,
                granules,
                idle,
                mapped,
                ..
            } => {
                if let (Some(first), Some(last)) = (spans.first(), spans.last()) {
                    if first.0 != *base || last.0 + last.1 != base + len {
                        return Err("ranges do not cover the reservation".into());
                    }
                }
                let covered: u64 = spans.iter().map(|s| s.1).sum();
                if covered != *len {
                    return Err(format!("ranges cover {covered} of {len} bytes"));
                }
                for (a, l) in self.allocated.iter().map(|(a, &l)| (a, l)) {
                    if self.paused.contains_key(a) {
                        continue; // wholly unmapped: `check_paused`
                    }
                    let first = (a - base) / self.gran;
                    let last = (a + l - 1 - base) / self.gran;
                    if (first..=last).any(|g| granules[g as usize].chunk.is_none()) {
                        return Err(format!("allocated range {a:#x} is not fully mapped"));
                    }
                }
                // Users recounted from the allocated ranges: shared
                // granules count them, whole ones are covered by one.
                let mut users = vec![0u32; granules.len()];
                let mut whole = vec![false; granules.len()];
                for (&a, &len) in self.allocated.iter() {
                    let (first, last, w) = granule_span(*base, self.gran, a, len);
                    for g in shared_granules(first, last, w).into_iter().flatten() {
                        users[g as usize] += 1;
                    }
                    for g in w.0..w.1 {
                        whole[g as usize] = true;
                    }
                }
                for (g, gr) in granules.iter().enumerate() {
                    if gr.users != users[g] || (whole[g] && users[g] != 0) {
                        return Err(format!(
                            "granule {g} counts {} users, the allocated ranges say {}{}",
                            gr.users,
                            users[g],
                            if whole[g] {
                                " (and one covers it whole)"
                            } else {
                                ""
                            }
                        ));
                    }
                    if mapped.contains(g as u32) != gr.chunk.is_some() {
                        return Err(format!("mapped set wrong for granule {g}"));
                    }
                    let is_idle = users[g] == 0 && !whole[g] && gr.chunk.is_some();
                    if is_idle != idle.contains(g as u32) {
                        return Err(format!("idle set wrong for granule {g}"));
                    }
                }
            }
            Physical::Segments { segs } => {
                let total: u64 = segs.values().sum();
                if total != self.reserved {
                    return Err("segment bytes != reserved".into());
                }
            }
        }
        Ok(())
    }

    /// Every allocated range (for snapshots).
    pub(crate) fn allocated_ranges(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.allocated.iter().map(|(&a, &l)| (a, l))
    }

    /// Every backed piece of the address space in address order, free ranges
    /// clipped to mapped memory, split into runs of adjacent backed memory
    /// (one run per segment in segment mode). Paused ranges hold no memory
    /// and are left out.
    pub(crate) fn layout(&self) -> Vec<Vec<(u64, u64, Piece)>> {
        let mut items: Vec<(u64, u64, Piece)> = self
            .allocated
            .iter()
            .filter(|(a, _)| !self.paused.contains_key(a))
            .map(|(&a, &l)| (a, l, Piece::Allocated))
            .collect();
        for (a, r) in self.by_addr.iter() {
            for (s, l) in self.mapped_parts(a, r.len) {
                items.push((s, l, Piece::Free(r.tag)));
            }
        }
        items.sort_unstable_by_key(|i| i.0);
        let mut runs: Vec<Vec<(u64, u64, Piece)>> = Vec::new();
        for it in items {
            match runs.last_mut() {
                Some(run)
                    if {
                        let last = run.last().expect("runs are non-empty");
                        last.0 + last.1 == it.0 && self.same_segment(last.0, it.0)
                    } =>
                {
                    run.push(it)
                }
                _ => runs.push(vec![it]),
            }
        }
        runs
    }
}
