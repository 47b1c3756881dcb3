//! Splitting a batch of moves into conflict-free launch groups.
//!
//! [`Backend::enqueue_moves`](super::Backend::enqueue_moves) promises
//! in-order semantics: the batch leaves memory as if its moves ran one after
//! another, each like `memmove`. The CUDA compaction kernel
//! (`kernels/compact.cu`) instead runs all moves of one launch at once, and
//! requires of them:
//!
//! > for any two different moves `a` and `b` of one launch, `dst(a)` overlaps
//! > neither `src(b)` nor `dst(b)`.
//!
//! (A move may overlap itself; the kernel gives it `memmove` semantics.)
//! [`conflict_free_groups`] turns any batch into a list of groups that each
//! meet that rule, to be launched in order on one stream.
//!
//! Why running the groups in order equals running the batch in order: call
//! two moves *conflicting* when [`conflicts`] says so. Moves that do not
//! conflict touch disjoint written bytes and never read each other's
//! writes, so swapping two adjacent ones changes nothing; hence every order
//! that keeps each conflicting pair in batch order gives the same result.
//! Move `j` is put in group `1 + max(group(i))` over the earlier moves `i`
//! it conflicts with (group 0 if none), so conflicting moves land in
//! different groups in batch order, and a group holds no conflicting pair,
//! so its concurrent run equals any serial order of it.

use super::Move;
use std::collections::BTreeMap;

/// The half-open byte range `[start, start + len)`, clamped at `u64::MAX`.
fn range(start: u64, len: u64) -> (u64, u64) {
    (start, start.saturating_add(len))
}

fn overlaps(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 < b.1 && b.0 < a.1
}

/// Whether `m` changes nothing: zero length, or source equal to destination.
pub fn is_noop(m: &Move) -> bool {
    m.len == 0 || m.src == m.dst
}

/// Whether `m`'s source and destination overlap (a slide by less than its
/// length), which needs `memmove` rather than a plain copy.
pub fn is_self_overlapping(m: &Move) -> bool {
    !is_noop(m) && overlaps(range(m.src.0, m.len), range(m.dst.0, m.len))
}

/// Whether `a` and `b` may not run concurrently: one writes bytes the other
/// reads or writes. Symmetric; no-op moves conflict with nothing.
pub fn conflicts(a: &Move, b: &Move) -> bool {
    if is_noop(a) || is_noop(b) {
        return false;
    }
    let (ar, aw) = (range(a.src.0, a.len), range(a.dst.0, a.len));
    let (br, bw) = (range(b.src.0, b.len), range(b.dst.0, b.len));
    overlaps(aw, bw) || overlaps(aw, br) || overlaps(ar, bw)
}

/// Whether the moves may share one kernel launch: no two of them conflict.
/// Quadratic; for checks and tests.
pub fn is_conflict_free(group: &[Move]) -> bool {
    group
        .iter()
        .enumerate()
        .all(|(i, a)| group[i + 1..].iter().all(|b| !conflicts(a, b)))
}

/// Checks that no move's range wraps past the end of the address space.
pub fn validate(moves: &[Move]) -> crate::error::Result<()> {
    for (i, m) in moves.iter().enumerate() {
        if m.src.0.checked_add(m.len).is_none() || m.dst.0.checked_add(m.len).is_none() {
            return Err(crate::error::Error::InvalidArgument(format!(
                "move {i} ({} -> {}, {} bytes) wraps past the end of the address space",
                m.src, m.dst, m.len
            )));
        }
    }
    Ok(())
}

/// Byte ranges of placed moves with their group numbers, searchable by
/// overlap.
#[derive(Default)]
struct GroupIndex {
    /// `(start, move number)` -> `(end, group)`.
    by_start: BTreeMap<(u64, usize), (u64, usize)>,
    /// Longest range stored: a range starting more than this before a query
    /// range ends before the query starts.
    max_len: u64,
}

impl GroupIndex {
    fn insert(&mut self, id: usize, r: (u64, u64), group: usize) {
        self.max_len = self.max_len.max(r.1 - r.0);
        self.by_start.insert((r.0, id), (r.1, group));
    }

    /// The highest group of a stored range overlapping `r`.
    fn max_group(&self, r: (u64, u64)) -> Option<usize> {
        let lo = r.0.saturating_sub(self.max_len);
        self.by_start
            .range((lo, 0)..(r.1, 0))
            .filter(|(_, &(end, _))| end > r.0)
            .map(|(_, &(_, g))| g)
            .max()
    }
}

/// Splits `moves` into groups that each satisfy the kernel's contract
/// ([`is_conflict_free`]); running the groups one after another (each group
/// concurrently) leaves memory exactly as running `moves` in order would.
///
/// No-op moves are dropped; within a group, moves keep their batch order.
/// Usually `O(n log n)`: a query scans the ranges starting within the
/// longest move's length before it.
pub fn conflict_free_groups(moves: &[Move]) -> Vec<Vec<Move>> {
    let mut groups: Vec<Vec<Move>> = Vec::new();
    let mut writes = GroupIndex::default();
    let mut reads = GroupIndex::default();
    for (id, m) in moves.iter().enumerate().filter(|(_, m)| !is_noop(m)) {
        let (r, w) = (range(m.src.0, m.len), range(m.dst.0, m.len));
        // Earlier writes to what m reads or writes; earlier reads of what m
        // writes.
        let after = [writes.max_group(r), writes.max_group(w), reads.max_group(w)]
            .into_iter()
            .flatten()
            .max();
        let g = after.map_or(0, |g| g + 1);
        if g == groups.len() {
            groups.push(Vec::new());
        }
        groups[g].push(*m);
        writes.insert(id, w, g);
        reads.insert(id, r, g);
    }
    groups
}

/// Splits one move into copies whose source and destination never overlap,
/// ordered so that running them one after another equals `memmove` of the
/// whole move. Yields `(dst, src, len)`. Used where only plain copies exist
/// (`cuMemcpyDtoDAsync` does not promise `memmove`).
///
/// A move whose ends are at least `len` apart is one copy; one that slides a
/// range by `d < len` bytes becomes `ceil(len / d)` copies of at most `d`
/// bytes, front to back when moving down, back to front when moving up.
pub fn split_move(m: &Move) -> impl Iterator<Item = (u64, u64, u64)> {
    let (src, dst, len) = (m.src.0, m.dst.0, m.len);
    let dist = src.abs_diff(dst);
    // A zero-length or in-place move copies nothing.
    let step = if len == 0 || dist == 0 {
        0
    } else {
        dist.min(len)
    };
    let pieces = if step == 0 { 0 } else { len.div_ceil(step) };
    let down = dst < src;
    (0..pieces).map(move |i| {
        let (off, n) = if down {
            let off = i * step;
            (off, step.min(len - off))
        } else {
            let end = len - i * step;
            let start = end.saturating_sub(step);
            (start, end - start)
        };
        (dst + off, src + off, n)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ptr::DevicePtr;

    fn mv(src: u64, dst: u64, len: u64) -> Move {
        Move {
            src: DevicePtr(src),
            dst: DevicePtr(dst),
            len,
        }
    }

    #[test]
    fn chain_of_slides_is_serialised() {
        // Each move writes what the previous one read: WAR chain.
        let moves = [mv(100, 0, 100), mv(200, 100, 100), mv(300, 200, 100)];
        let g = conflict_free_groups(&moves);
        assert_eq!(g.len(), 3);
        // Reversed, nothing conflicts: RAW would need a read of a written range.
        let moves = [mv(300, 400, 100), mv(500, 600, 100), mv(700, 800, 100)];
        assert_eq!(conflict_free_groups(&moves).len(), 1);
    }

    #[test]
    fn independent_moves_share_a_group_and_noops_vanish() {
        let moves = [
            mv(0, 1000, 10),
            mv(0, 2000, 10), // sources may overlap
            mv(5, 5, 10),
            mv(7, 9, 0),
            mv(3000, 3004, 16), // self-overlapping: one move, one group
        ];
        let g = conflict_free_groups(&moves);
        assert_eq!(g.len(), 1);
        assert_eq!(g[0].len(), 3);
        assert!(is_self_overlapping(&moves[4]));
        assert!(!is_self_overlapping(&moves[0]));
    }

    #[test]
    fn a_later_group_only_after_its_conflicts() {
        // m2 reads what m0 wrote; m1 is independent and stays in group 0.
        let moves = [mv(0, 100, 10), mv(500, 600, 10), mv(100, 200, 10)];
        let g = conflict_free_groups(&moves);
        assert_eq!(g, vec![vec![moves[0], moves[1]], vec![moves[2]]]);
    }

    #[test]
    fn wrapping_moves_are_rejected() {
        assert!(validate(&[mv(u64::MAX - 1, 0, 4)]).is_err());
        assert!(validate(&[mv(0, 16, 16)]).is_ok());
    }

    /// Applies `split_move` pieces as plain non-overlapping copies on a host
    /// buffer and compares with `memmove` of the whole move.
    #[test]
    fn split_move_equals_memmove() {
        const N: u64 = 64;
        for src in 0..N {
            for dst in 0..N {
                for len in 0..=(N - src.max(dst)) {
                    let init: Vec<u8> = (0..N as u8).collect();
                    let mut want = init.clone();
                    want.copy_within(src as usize..(src + len) as usize, dst as usize);
                    let mut got = init;
                    let mut total = 0;
                    for (d, s, n) in split_move(&mv(src, dst, len)) {
                        let (d, s, n) = (d as usize, s as usize, n as usize);
                        assert!(d + n <= s || s + n <= d, "piece overlaps itself");
                        let piece = got[s..s + n].to_vec();
                        got[d..d + n].copy_from_slice(&piece);
                        total += n as u64;
                    }
                    assert_eq!(got, want, "src {src} dst {dst} len {len}");
                    if src != dst {
                        assert_eq!(total, len);
                    }
                }
            }
        }
    }
}
