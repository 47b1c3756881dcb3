//! A set of granule indices as a bitmap: O(1) insert, remove and lookup.
//!
//! The heap's idle set changes whenever a granule's last user leaves or its
//! first arrives, which for blocks under a granule is most allocations and
//! frees; an ordered tree paid a descent each time. Iteration (the slow
//! paths: stealing, trimming) skips empty words with a summary bitmap (one
//! bit per word), so it costs about one step per member.

/// Granule indices below a fixed bound.
#[derive(Debug, Clone, Default)]
pub(crate) struct GranuleSet {
    words: Vec<u64>,
    /// Bit `w` set: `words[w]` is not zero.
    summary: Vec<u64>,
}

/// The words that `[lo, hi)` touches, each with the mask of its bits there.
fn word_masks(lo: u32, hi: u32) -> impl Iterator<Item = (usize, u64)> {
    let (mut g, hi) = (lo as usize, hi as usize);
    std::iter::from_fn(move || {
        if g >= hi {
            return None;
        }
        let w = g / 64;
        let end = ((w + 1) * 64).min(hi);
        let mask = (!0u64).checked_shr(64 - (end - g) as u32).unwrap_or(0) << (g % 64);
        g = end;
        Some((w, mask))
    })
}

impl GranuleSet {
    /// An empty set for indices below `n`.
    pub(crate) fn new(n: usize) -> GranuleSet {
        let words = n.div_ceil(64);
        GranuleSet {
            words: vec![0; words],
            summary: vec![0; words.div_ceil(64)],
        }
    }

    /// Adds `g`; whether it was absent.
    #[inline]
    pub(crate) fn insert(&mut self, g: u32) -> bool {
        let (w, bit) = (g as usize / 64, 1u64 << (g % 64));
        let absent = self.words[w] & bit == 0;
        self.words[w] |= bit;
        self.summary[w / 64] |= 1 << (w % 64);
        absent
    }

    /// Removes `g`; whether it was present.
    #[inline]
    pub(crate) fn remove(&mut self, g: u32) -> bool {
        let (w, bit) = (g as usize / 64, 1u64 << (g % 64));
        let present = self.words[w] & bit != 0;
        self.words[w] &= !bit;
        if self.words[w] == 0 {
            self.summary[w / 64] &= !(1 << (w % 64));
        }
        present
    }

    /// Adds every index in `[lo, hi)` (a word at a time).
    pub(crate) fn insert_range(&mut self, lo: u32, hi: u32) {
        self.update_range(lo, hi, true);
    }

    /// Removes every index in `[lo, hi)` (a word at a time).
    pub(crate) fn remove_range(&mut self, lo: u32, hi: u32) {
        self.update_range(lo, hi, false);
    }

    /// Adds every index in `[lo, hi)` that `of` holds (a word at a time).
    pub(crate) fn insert_range_of(&mut self, lo: u32, hi: u32, of: &GranuleSet) {
        for (w, mask) in word_masks(lo, hi) {
            let add = of.words[w] & mask & !self.words[w];
            if add != 0 {
                self.words[w] |= add;
                self.summary[w / 64] |= 1 << (w % 64);
            }
        }
    }

    fn update_range(&mut self, lo: u32, hi: u32, set: bool) {
        for (w, mask) in word_masks(lo, hi) {
            // No count to keep (see `len`): no popcount here.
            if set {
                self.words[w] |= mask;
            } else {
                self.words[w] &= !mask;
            }
            if self.words[w] == 0 {
                self.summary[w / 64] &= !(1 << (w % 64));
            } else {
                self.summary[w / 64] |= 1 << (w % 64);
            }
        }
    }

    /// Whether `g` is in the set.
    #[inline]
    pub(crate) fn contains(&self, g: u32) -> bool {
        self.words
            .get(g as usize / 64)
            .is_some_and(|w| w & (1 << (g % 64)) != 0)
    }

    /// Members, counted when asked: only out-of-memory reports and tests
    /// ask, while keeping a count cost a popcount (a dozen instructions on
    /// the baseline x86-64 target) per changed word of every range update
    /// on the allocation path.
    pub(crate) fn len(&self) -> usize {
        self.count_in(0, u32::MAX) as usize
    }

    /// How many members lie in `[lo, hi)`: popcounts of the words that
    /// the summary marks non-empty, so a long empty span (the unbacked
    /// tail of a reservation) costs one step per 4,096 granules.
    pub(crate) fn count_in(&self, lo: u32, hi: u32) -> u32 {
        let hi = (hi as usize).min(self.words.len() * 64);
        let lo = lo as usize;
        if lo >= hi {
            return 0;
        }
        let (wlo, whi) = (lo / 64, (hi - 1) / 64);
        let mask_lo = !0u64 << (lo % 64);
        let mask_hi = !0u64 >> (63 - (hi - 1) % 64);
        if wlo == whi {
            return (self.words[wlo] & mask_lo & mask_hi).count_ones();
        }
        let mut n =
            (self.words[wlo] & mask_lo).count_ones() + (self.words[whi] & mask_hi).count_ones();
        // Whole words strictly between, found through the summary.
        let mut w = wlo + 1;
        while w < whi {
            let sw = w / 64;
            let end = ((sw + 1) * 64).min(whi); // words [w, end) share summary word sw
            let below_end = (!0u64)
                .checked_shr(64 - (end - sw * 64) as u32)
                .unwrap_or(0);
            let mut bits = self.summary[sw] & (!0u64 << (w % 64)) & below_end;
            while bits != 0 {
                n += self.words[sw * 64 + bits.trailing_zeros() as usize].count_ones();
                bits &= bits - 1;
            }
            w = end;
        }
        n
    }

    /// Whether every index in `[lo, hi)` is a member (true if empty):
    /// mask compares, no popcounts.
    #[inline]
    pub(crate) fn all_in(&self, lo: u32, hi: u32) -> bool {
        word_masks(lo, hi).all(|(w, mask)| self.words.get(w).is_some_and(|&x| x & mask == mask))
    }

    /// Members in `[lo, hi)`, ascending.
    pub(crate) fn range(&self, lo: u32, hi: u32) -> impl Iterator<Item = u32> + '_ {
        let hi = (hi as u64).min(self.words.len() as u64 * 64);
        let mut next = (lo as u64).min(hi);
        std::iter::from_fn(move || {
            let g = self.first_at_or_after(next)?;
            if g >= hi {
                next = hi;
                return None;
            }
            next = g + 1;
            Some(g as u32)
        })
    }

    /// How many consecutive members start at `g`, counting none at or
    /// above `hi`: a word at a time, for walking runs of members.
    #[inline]
    pub(crate) fn run_len(&self, g: u32, hi: u32) -> u32 {
        self.span_len(g, hi, true)
    }

    /// How many consecutive non-members start at `g` (below `hi` and
    /// below the set's bound).
    #[inline]
    pub(crate) fn gap_len(&self, g: u32, hi: u32) -> u32 {
        self.span_len(g, hi, false)
    }

    /// How many consecutive indices from `g` below `hi` are members
    /// (`member`) or are not.
    #[inline]
    fn span_len(&self, g: u32, hi: u32, member: bool) -> u32 {
        let hi = (hi as usize).min(self.words.len() * 64);
        let mut at = g as usize;
        while at < hi {
            let b = at % 64;
            let w = self.words[at / 64];
            let w = if member { !w } else { w };
            // Bits of the word from `b` up that continue the span; the
            // zeros shifted in above bit 63 - b are cut at the word's end.
            let n = ((w >> b).trailing_zeros() as usize).min(64 - b);
            at += n;
            if n < 64 - b {
                break;
            }
        }
        (at.min(hi) as u32).saturating_sub(g)
    }

    /// The smallest member at or after `g`.
    #[inline]
    pub(crate) fn first_at_or_after(&self, g: u64) -> Option<u64> {
        let w = (g / 64) as usize;
        if w >= self.words.len() {
            return None;
        }
        let here = self.words[w] & (!0u64 << (g % 64));
        if here != 0 {
            return Some(w as u64 * 64 + here.trailing_zeros() as u64);
        }
        // The next non-empty word, through the summary.
        let start = w + 1;
        let mut sw = start / 64;
        let mut bits =
            self.summary.get(sw)? & (!0u64).checked_shl((start % 64) as u32).unwrap_or(0);
        loop {
            if bits != 0 {
                let w = sw * 64 + bits.trailing_zeros() as usize;
                return Some(w as u64 * 64 + self.words[w].trailing_zeros() as u64);
            }
            sw += 1;
            bits = *self.summary.get(sw)?;
        }
    }

    /// The largest member at or before `g`.
    #[inline]
    pub(crate) fn last_at_or_before(&self, g: u32) -> Option<u32> {
        let g = (g as usize).min((self.words.len() * 64).checked_sub(1)?);
        let w = g / 64;
        let here = self.words[w] & (!0u64 >> (63 - g % 64));
        if here != 0 {
            return Some((w * 64 + 63 - here.leading_zeros() as usize) as u32);
        }
        // The previous non-empty word, through the summary.
        let w = w.checked_sub(1)?;
        let mut sw = w / 64;
        let mut bits = self.summary[sw] & (!0u64 >> (63 - w % 64));
        loop {
            if bits != 0 {
                let w = sw * 64 + 63 - bits.leading_zeros() as usize;
                return Some((w * 64 + 63 - self.words[w].leading_zeros() as usize) as u32);
            }
            sw = sw.checked_sub(1)?;
            bits = self.summary[sw];
        }
    }

    /// Every member, ascending.
    pub(crate) fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.range(0, u32::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    #[test]
    fn all_in_matches_count_in() {
        let mut s = GranuleSet::new(300);
        s.insert_range(60, 200);
        s.insert(250);
        for (lo, hi) in [
            (60, 200),
            (61, 199),
            (59, 200),
            (60, 201),
            (64, 128),
            (250, 251),
        ] {
            assert_eq!(
                s.all_in(lo, hi),
                s.count_in(lo, hi) == hi - lo,
                "{lo}..{hi}"
            );
        }
        assert!(s.all_in(100, 100));
        assert!(!s.all_in(299, 301));
    }

    #[test]
    fn run_len_counts_consecutive_members_across_words() {
        let mut s = GranuleSet::new(300);
        s.insert_range(60, 200);
        s.insert(201);
        assert_eq!(s.run_len(60, 300), 140);
        assert_eq!(s.run_len(63, 300), 137);
        assert_eq!(s.run_len(64, 128), 64);
        assert_eq!(s.run_len(100, 150), 50);
        assert_eq!(s.run_len(199, 300), 1);
        assert_eq!(s.run_len(200, 300), 0);
        assert_eq!(s.run_len(201, 300), 1);
        assert_eq!(s.run_len(59, 300), 0);
        s.insert_range(256, 300);
        assert_eq!(s.run_len(256, 1000), 44);
        assert_eq!(s.gap_len(0, 300), 60);
        assert_eq!(s.gap_len(200, 300), 1);
        assert_eq!(s.gap_len(202, 300), 54);
        assert_eq!(s.gap_len(202, 230), 28);
        assert_eq!(s.gap_len(60, 300), 0);
        assert_eq!(s.gap_len(299, 1000), 0);
    }

    #[test]
    fn matches_an_ordered_set() {
        let mut s = GranuleSet::new(300);
        let mut model = BTreeSet::new();
        for (i, g) in [5u32, 64, 63, 0, 299, 128, 5, 200, 64]
            .into_iter()
            .enumerate()
        {
            if i % 3 == 2 {
                assert_eq!(s.remove(g), model.remove(&g));
            } else {
                assert_eq!(s.insert(g), model.insert(g));
            }
            assert_eq!(s.len(), model.len());
        }
        assert_eq!(
            s.iter().collect::<Vec<_>>(),
            model.iter().copied().collect::<Vec<_>>()
        );
        let want: Vec<u32> = model.range(6..200).copied().collect();
        assert_eq!(s.range(6, 200).collect::<Vec<_>>(), want);
        assert!(s.contains(299) && !s.contains(298) && !s.contains(10_000));
        assert_eq!(s.range(250, 10).count(), 0);
        let mut big = GranuleSet::new(70_000);
        for g in [3u32, 4_095, 4_096, 69_999] {
            big.insert(g);
        }
        big.remove(4_095);
        assert_eq!(big.iter().collect::<Vec<_>>(), vec![3, 4_096, 69_999]);
        assert_eq!(big.range(4, 69_999).collect::<Vec<_>>(), vec![4_096]);
        assert_eq!(big.last_at_or_before(69_998), Some(4_096));
        assert_eq!(big.last_at_or_before(u32::MAX), Some(69_999));
        assert_eq!(big.last_at_or_before(4_096), Some(4_096));
        assert_eq!(big.last_at_or_before(4_095), Some(3));
        assert_eq!(big.last_at_or_before(2), None);
    }

    /// One step of a 64-bit LCG: reproducible pseudo-random members.
    fn step(x: u64) -> u64 {
        x.wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407)
    }

    #[test]
    fn inserting_the_members_of_another_set_in_a_range() {
        let (mut s, mut of) = (GranuleSet::new(1_000), GranuleSet::new(1_000));
        let mut x = 4242u64;
        for _ in 0..300 {
            x = step(x);
            of.insert(((x >> 20) % 1_000) as u32);
            x = step(x);
            s.insert(((x >> 20) % 1_000) as u32);
        }
        for (lo, hi) in [
            (0, 0),
            (5, 6),
            (60, 70),
            (63, 129),
            (0, 1_000),
            (999, 1_000),
        ] {
            let mut want: BTreeSet<u32> = s.iter().collect();
            want.extend(of.range(lo, hi));
            s.insert_range_of(lo, hi, &of);
            assert_eq!(s.iter().collect::<BTreeSet<u32>>(), want, "[{lo}, {hi})");
            assert_eq!(s.len(), want.len());
            assert_eq!(s.count_in(0, 1_000) as usize, want.len());
        }
    }

    #[test]
    fn counts_match_an_ordered_set() {
        let mut s = GranuleSet::new(20_000);
        let mut model = BTreeSet::new();
        let mut x = 777u64;
        for _ in 0..4_000 {
            x = step(x);
            // Clustered members, so some words are full and some spans empty.
            let g = (((x >> 33) % 40) * 500 + (x >> 20) % 70) as u32;
            if x % 4 == 0 {
                s.remove(g);
                model.remove(&g);
            } else {
                s.insert(g);
                model.insert(g);
            }
            let lo = ((x >> 7) % 20_100) as u32;
            let hi = lo.saturating_add(((x >> 40) % 9_000) as u32);
            assert_eq!(
                s.count_in(lo, hi) as usize,
                model.range(lo..hi.max(lo)).count(),
                "[{lo}, {hi})"
            );
        }
        assert_eq!(s.count_in(0, u32::MAX) as usize, model.len());
        for (lo, hi, add) in [
            (10, 700, true),
            (63, 65, false),
            (0, 20_000, false),
            (130, 131, true),
        ] {
            if add {
                s.insert_range(lo, hi);
                model.extend(lo..hi);
            } else {
                s.remove_range(lo, hi);
                for g in lo..hi {
                    model.remove(&g);
                }
            }
            assert_eq!(s.len(), model.len());
            assert_eq!(
                s.iter().collect::<Vec<_>>(),
                model.iter().copied().collect::<Vec<_>>()
            );
            assert_eq!(s.count_in(0, u32::MAX) as usize, model.len());
        }
        assert_eq!(s.count_in(5, 5), 0);
    }

    #[test]
    fn predecessor_matches_an_ordered_set() {
        let mut s = GranuleSet::new(9_000);
        let mut model = BTreeSet::new();
        let mut x = 12345u64;
        for _ in 0..3_000 {
            x = step(x);
            let g = ((x >> 33) % 9_000) as u32;
            if x % 3 == 0 {
                s.remove(g);
                model.remove(&g);
            } else {
                s.insert(g);
                model.insert(g);
            }
            let probe = ((x >> 13) % 9_100) as u32;
            assert_eq!(
                s.last_at_or_before(probe),
                model.range(..=probe).next_back().copied(),
                "probe {probe}"
            );
        }
    }
}
