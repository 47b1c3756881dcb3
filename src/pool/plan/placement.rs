//! The offline planner: offsets for blocks whose lifetimes are known.
//!
//! Input: blocks `(len, start, end)` on one logical clock, each live on
//! `[start, end)`. Output: an offset per block and the arena length, such
//! that two blocks whose lifetimes overlap never overlap in the arena
//! (invariant, checked by `check` and the property tests below).
//!
//! The method is greedy (Pisarchyk and Lee, "Efficient Memory Management
//! for Deep Neural Net Inference", 2020), the planners' baseline that the
//! lifetimes traces' sources compare against: blocks in a priority order,
//! each placed in a gap between the blocks already placed that overlap it
//! in time, or above them all when no gap fits. Large blocks go first, so
//! the small ones fill the holes that the large ones' lifetimes leave.
//! [`place_around`] runs four variants (order by length or by length times
//! lifetime; smallest fitting gap or lowest one) and keeps the shortest
//! arena. The arena is never shorter than the peak of the live lengths (a
//! lower bound); on the traces we have the plan is within 1% of it.
//!
//! [`place_around`] places around *fixed* intervals too: address ranges
//! taken for the whole step (blocks that live across it), so that a plan
//! can be laid over the memory the recorded step used, between the blocks
//! that outlive it, instead of in a fresh range that needs its physical
//! memory moved under it.

/// A block to place: `len` bytes live on `[start, end)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Life {
    pub len: u64,
    pub start: u32,
    pub end: u32,
}

impl Life {
    fn overlaps(&self, o: &Life) -> bool {
        self.start < o.end && o.start < self.end
    }
}

/// Offsets for `lives` (same order) and the arena length: the shortest of
/// the four greedy variants.
#[cfg(test)]
pub(crate) fn place(lives: &[Life]) -> (Vec<u64>, u64) {
    place_around(lives, &[])
}

/// Offsets for `lives` (same order), the shortest of the four greedy
/// variants, in an address space where `fixed` (sorted, disjoint
/// `(start, end)` intervals) is taken throughout: no block overlaps a fixed
/// interval. The length returned is the highest end of a block.
pub(crate) fn place_around(lives: &[Life], fixed: &[(u64, u64)]) -> (Vec<u64>, u64) {
    debug_assert!(fixed.windows(2).all(|w| w[0].1 <= w[1].0));
    let by_len = |l: &Life| (l.len as u128, 0u128);
    let by_area = |l: &Life| (l.len as u128 * (l.end - l.start) as u128, l.len as u128);
    let mut best: Option<(Vec<u64>, u64)> = None;
    for key in [&by_len as &dyn Fn(&Life) -> (u128, u128), &by_area] {
        let mut order: Vec<usize> = (0..lives.len()).collect();
        order.sort_by(|&a, &b| {
            key(&lives[b])
                .cmp(&key(&lives[a]))
                .then(lives[a].start.cmp(&lives[b].start))
        });
        for smallest_gap in [true, false] {
            let r = place_in_order(lives, &order, smallest_gap, fixed);
            if best.as_ref().is_none_or(|b| r.1 < b.1) {
                best = Some(r);
            }
        }
    }
    best.unwrap_or_default()
}

/// Greedy placement in `order`: each block in the smallest gap that fits
/// (`smallest_gap`) or the lowest one, else on top; never over `fixed`.
fn place_in_order(
    lives: &[Life],
    order: &[usize],
    smallest_gap: bool,
    fixed: &[(u64, u64)],
) -> (Vec<u64>, u64) {
    let mut offsets = vec![0u64; lives.len()];
    // Placed blocks as (start time, index), sorted by start: those that
    // start at or after a block's end cannot overlap it, so its scan stops
    // at the first of them.
    let mut placed: Vec<(u32, usize)> = Vec::with_capacity(lives.len());
    let mut busy: Vec<(u64, u64)> = Vec::new();
    let mut total = 0u64;
    for &i in order {
        let me = lives[i];
        busy.clear();
        let stop = placed.partition_point(|&(s, _)| s < me.end);
        for &(_, j) in &placed[..stop] {
            if lives[j].overlaps(&me) {
                busy.push((offsets[j], offsets[j] + lives[j].len));
            }
        }
        busy.sort_unstable();
        // Smallest gap that fits, else just above the highest busy end.
        // The fixed intervals are merged in as the sorted walk goes.
        let (mut top, mut best): (u64, Option<(u64, u64)>) = (0, None);
        let walk = Merged {
            a: busy.iter().copied().peekable(),
            b: fixed.iter().copied().peekable(),
        };
        for (lo, hi) in walk {
            if lo > top {
                let gap = lo - top;
                let better = match best {
                    None => true,
                    Some((g, _)) => smallest_gap && gap < g,
                };
                if gap >= me.len && better {
                    best = Some((gap, top));
                }
            }
            top = top.max(hi);
        }
        let off = best.map_or(top, |(_, o)| o);
        offsets[i] = off;
        total = total.max(off + me.len);
        let at = placed.partition_point(|&(s, _)| s <= me.start);
        placed.insert(at, (me.start, i));
    }
    (offsets, total)
}

/// Two sorted interval lists as one, in order of start.
struct Merged<A: Iterator<Item = (u64, u64)>, B: Iterator<Item = (u64, u64)>> {
    a: std::iter::Peekable<A>,
    b: std::iter::Peekable<B>,
}

impl<A: Iterator<Item = (u64, u64)>, B: Iterator<Item = (u64, u64)>> Iterator for Merged<A, B> {
    type Item = (u64, u64);

    fn next(&mut self) -> Option<(u64, u64)> {
        match (self.a.peek(), self.b.peek()) {
            (Some(x), Some(y)) if y < x => self.b.next(),
            (Some(_), _) => self.a.next(),
            (None, _) => self.b.next(),
        }
    }
}

/// The peak of the sum of live lengths: no plan's arena is shorter.
pub(crate) fn peak_live(lives: &[Life]) -> u64 {
    let mut ev: Vec<(u32, i8, u64)> = Vec::with_capacity(lives.len() * 2);
    for l in lives {
        // At equal times ends go first: [start, end) intervals.
        ev.push((l.start, 1, l.len));
        ev.push((l.end, 0, l.len));
    }
    ev.sort_unstable();
    let (mut live, mut peak) = (0u64, 0u64);
    for (_, kind, len) in ev {
        if kind == 1 {
            live += len;
            peak = peak.max(live);
        } else {
            live -= len;
        }
    }
    peak
}

#[cfg(test)]
/// Checks a plan: every block inside the arena, no two blocks that are
/// live at once overlapping. Returns the first violation.
pub(crate) fn check(lives: &[Life], offsets: &[u64], total: u64) -> Result<(), String> {
    check_around(lives, offsets, total, &[])
}

#[cfg(test)]
/// [`check`], and no block over a fixed interval.
pub(crate) fn check_around(
    lives: &[Life],
    offsets: &[u64],
    total: u64,
    fixed: &[(u64, u64)],
) -> Result<(), String> {
    for (i, a) in lives.iter().enumerate() {
        if offsets[i] + a.len > total {
            return Err(format!("block {i} ends past the arena"));
        }
        if let Some(f) = fixed
            .iter()
            .find(|f| offsets[i] < f.1 && f.0 < offsets[i] + a.len)
        {
            return Err(format!("block {i} overlaps the fixed interval {f:?}"));
        }
        for (j, b) in lives.iter().enumerate().skip(i + 1) {
            let apart = offsets[i] + a.len <= offsets[j] || offsets[j] + b.len <= offsets[i];
            if a.overlaps(b) && !apart {
                return Err(format!("blocks {i} and {j} are live together and overlap"));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn life(len: u64, start: u32, end: u32) -> Life {
        Life { len, start, end }
    }

    #[test]
    fn disjoint_lifetimes_share_the_arena() {
        let lives = [life(100, 0, 2), life(100, 2, 4), life(50, 4, 6)];
        let (off, total) = place(&lives);
        assert_eq!(total, 100);
        assert!(off.iter().all(|&o| o == 0));
        check(&lives, &off, total).unwrap();
    }

    #[test]
    fn a_small_block_fills_a_hole_the_large_ones_leave() {
        // Two long-lived blocks around a hole of 64 that a short block
        // fills; the plan reaches the peak of live lengths.
        let lives = [
            life(128, 0, 10),
            life(64, 0, 3),
            life(128, 0, 10),
            life(64, 4, 8),
        ];
        let (off, total) = place(&lives);
        check(&lives, &off, total).unwrap();
        assert_eq!(total, peak_live(&lives));
    }

    #[test]
    fn blocks_go_between_fixed_intervals() {
        // Holes of 100 and 300 between fixed intervals: the 300 block takes
        // the larger hole, the 100 ones the smaller and the space above.
        let fixed = [(100, 200), (300, 400), (700, 800)];
        let lives = [life(300, 0, 4), life(100, 0, 4), life(100, 1, 3)];
        let (off, total) = place_around(&lives, &fixed);
        check_around(&lives, &off, total, &fixed).unwrap();
        assert_eq!(off[0], 400);
        assert!(
            off[1..].iter().all(|&o| !(400..800).contains(&o)),
            "{off:?}"
        );
        assert!(total <= 900, "{total}");
    }

    proptest! {
        #[test]
        fn plans_around_fixed_intervals_are_valid(
            raw in proptest::collection::vec((1u64..64, 0u32..40, 1u32..20), 1..80),
            holes in proptest::collection::vec((0u64..16, 1u64..16), 0..12),
        ) {
            let lives: Vec<Life> = raw
                .iter()
                .map(|&(l, s, d)| life(l * 512, s, s + d))
                .collect();
            // Fixed intervals: alternating gaps and taken runs, in 512s.
            let mut fixed = Vec::new();
            let mut at = 0u64;
            for &(gap, taken) in &holes {
                at += gap * 512;
                fixed.push((at, at + taken * 512));
                at += taken * 512;
            }
            let (off, total) = place_around(&lives, &fixed);
            prop_assert_eq!(check_around(&lives, &off, total, &fixed), Ok(()));
            prop_assert!(off.iter().all(|o| o % 512 == 0));
        }

        #[test]
        fn plans_are_valid_and_never_below_the_peak(
            raw in proptest::collection::vec((1u64..64, 0u32..40, 1u32..20), 1..120)
        ) {
            let lives: Vec<Life> = raw
                .iter()
                .map(|&(l, s, d)| life(l * 512, s, s + d))
                .collect();
            let (off, total) = place(&lives);
            prop_assert_eq!(check(&lives, &off, total), Ok(()));
            prop_assert!(total >= peak_live(&lives));
            prop_assert!(off.iter().all(|o| o % 512 == 0));
        }
    }
}
