//! The planner: which blocks one pass moves, and where.
//!
//! A pass empties whole regions, so that every move it makes pays off in a
//! region given back. Candidates are the regions with live blocks, nothing
//! held (no pending frees, no incoming moves) and every block movable
//! (unpinned, no unrecorded use, not already moving), taken sparsest first.
//! A candidate is closed to allocation and each of its blocks, largest
//! first, gets a destination by best fit in the regions still open — a real
//! reservation (the bytes become `held`), so no allocation can take them.
//! If some block finds no room, the candidate's reservations are undone and
//! it is reopened. Regions that receive blocks are never sources in the
//! same pass. The pass stops at its byte and block budgets; a region with
//! more blocks than a whole pass may move is emptied in part, smallest
//! blocks first, by a pass that has nothing else to do — and then only
//! where a move raises the sum of squared region occupancies. Termination:
//! a full evacuation lowers the number of regions, a partial one keeps it
//! and raises that sum; so passes without traffic cannot cycle.
//!
//! Every destination is free memory of an open region and every source lies
//! in a closed one, so within a pass no destination overlaps any source or
//! any other destination: the batch is conflict-free and runs as a single
//! kernel launch.

use super::arena::{ArenaState, PlannedMove};

/// Bounds of one pass.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Budget {
    pub max_bytes: u64,
    pub max_blocks: usize,
}

/// What a pass will do: the moves, and the regions they empty.
#[derive(Debug, Default)]
pub(crate) struct Plan {
    pub moves: Vec<PlannedMove>,
    pub sources: Vec<u64>,
}

impl Plan {
    pub fn bytes(&self) -> u64 {
        self.moves.iter().map(|m| m.len).sum()
    }
}

/// Plans pass `pass` over `st`: reserves destinations, closes sources and
/// marks the moving entries. [`undo`] reverses it exactly.
pub(crate) fn plan(st: &mut ArenaState, budget: Budget, pass: u64) -> Plan {
    let mut cands: Vec<(u64, u64)> = st
        .regions
        .iter()
        .filter(|(_, r)| {
            !r.evacuating
                && r.incoming == 0
                && r.live > 0
                && r.blocks
                    .values()
                    .all(|&id| st.entries[id as usize].movable())
        })
        .map(|(&base, r)| (r.live, base))
        .collect();
    cands.sort_unstable();
    // Free bytes in open regions: a candidate needs its live bytes of room
    // outside itself.
    let mut open_free: u64 = st
        .regions
        .iter()
        .filter(|(_, r)| !r.evacuating)
        .map(|(&b, _)| st.region_free(b))
        .sum();
    let mut plan = Plan::default();
    let mut bytes = 0;
    for (live, base) in cands {
        if st.regions[&base].incoming > 0 {
            continue; // it received blocks earlier in this pass
        }
        let nblocks = st.regions[&base].blocks.len();
        let own_free = st.region_free(base);
        let fits =
            bytes + live <= budget.max_bytes && plan.moves.len() + nblocks <= budget.max_blocks;
        // A region too big for the whole budget is evacuated in part, by
        // the first pass that finds it, so every region can be emptied.
        let limit = if fits {
            None
        } else if plan.moves.is_empty() {
            Some((budget.max_blocks, budget.max_bytes))
        } else {
            continue;
        };
        if open_free < own_free + live.min(limit.map_or(u64::MAX, |l| l.1)) {
            continue;
        }
        if let Some(moves) = evacuate(st, base, pass, limit) {
            let moved: u64 = moves.iter().map(|m| m.len).sum();
            open_free -= own_free + moved;
            bytes += moved;
            plan.moves.extend(moves);
            plan.sources.push(base);
        }
    }
    plan
}

/// Tries to place every block of region `base` (or, with `limit`, up to
/// that many blocks and bytes, smallest first) elsewhere; on success the
/// region stays closed and the moves are returned.
fn evacuate(
    st: &mut ArenaState,
    base: u64,
    pass: u64,
    limit: Option<(usize, u64)>,
) -> Option<Vec<PlannedMove>> {
    st.set_evacuating(base, true);
    let mut blocks: Vec<(u64, u64, u32)> = st.regions[&base]
        .blocks
        .iter()
        .map(|(&a, &id)| (st.entries[id as usize].len, a, id))
        .collect();
    if let Some((n, max_bytes)) = limit {
        blocks.sort_unstable();
        let mut sum = 0;
        let keep = blocks
            .iter()
            .take(n)
            .take_while(|b| {
                sum += b.0;
                sum <= max_bytes
            })
            .count();
        blocks.truncate(keep);
    }
    // Largest first: they are the hardest to place.
    blocks.sort_unstable_by(|a, b| b.cmp(a));
    let mut moves = Vec::with_capacity(blocks.len());
    let own_live = st.regions[&base].live;
    for (len, src, id) in blocks {
        // A partial evacuation frees no region: it may only move blocks to
        // denser regions, so that passes make progress and never cycle.
        let dst = match limit {
            None => st.reserve_dst(len),
            // Moving `len` bytes from a region of `s` live bytes into one of
            // `d` raises the sum of squares iff `d + len > s`.
            Some(_) => st.reserve_dst_denser(len, own_live.saturating_sub(len)),
        };
        match dst {
            Some(dst) => moves.push(PlannedMove {
                handle: id,
                gen: st.entries[id as usize].gen,
                src,
                dst,
                len,
            }),
            None => break,
        }
    }
    let complete = moves.len() == st.regions[&base].blocks.len();
    if moves.is_empty() || (limit.is_none() && !complete) {
        for m in &moves {
            st.release_dst(m.dst, m.len);
        }
        st.set_evacuating(base, false);
        return None;
    }
    for m in &moves {
        st.entries[m.handle as usize].moving = Some(pass);
    }
    Some(moves)
}

/// Reverses [`plan`] (a pass that could not be enqueued).
pub(crate) fn undo(st: &mut ArenaState, plan: &Plan, pass: u64) {
    for m in &plan.moves {
        st.release_dst(m.dst, m.len);
        let e = &mut st.entries[m.handle as usize];
        if e.gen == m.gen && e.moving == Some(pass) {
            e.moving = None;
        }
    }
    for &b in &plan.sources {
        st.set_evacuating(b, false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const R: u64 = 1 << 20;
    const ALL: Budget = Budget {
        max_bytes: u64::MAX,
        max_blocks: usize::MAX,
    };

    /// Two half-empty regions: one is emptied into the other.
    fn two_sparse() -> (ArenaState, Vec<(u32, u32)>) {
        let mut a = ArenaState::new(R);
        a.add_region(0);
        a.add_region(R);
        let mut ids = Vec::new();
        for _ in 0..8 {
            ids.push(a.alloc_block(R / 8).unwrap());
        }
        for _ in 0..8 {
            ids.push(a.alloc_block(R / 8).unwrap());
        }
        // Free every other block in both regions.
        let mut kept = Vec::new();
        for (i, (id, g)) in ids.into_iter().enumerate() {
            if i % 2 == 0 {
                let (addr, len, _, _) = a.free_block(id);
                a.unhold_free(addr, len);
            } else {
                kept.push((id, g));
            }
        }
        (a, kept)
    }

    #[test]
    fn plans_a_conflict_free_batch_that_empties_a_region() {
        let (mut a, _) = two_sparse();
        let p = plan(&mut a, ALL, 1);
        assert_eq!(p.sources.len(), 1);
        assert_eq!(p.moves.len(), 4);
        let src = p.sources[0];
        for m in &p.moves {
            assert_eq!(a.region_of(m.src), src);
            assert_ne!(a.region_of(m.dst), src);
        }
        let mv: Vec<crate::backend::Move> = p
            .moves
            .iter()
            .map(|m| crate::backend::Move {
                src: crate::DevicePtr(m.src),
                dst: crate::DevicePtr(m.dst),
                len: m.len,
            })
            .collect();
        assert!(crate::backend::move_groups::is_conflict_free(&mv));
        // Commit: relocate, and the source region is empty.
        for m in &p.moves {
            a.relocate(m.handle, m.dst);
        }
        a.set_evacuating(src, false);
        assert!(a.drop_if_empty(src));
        a.check().unwrap();
        assert_eq!(a.regions.len(), 1);
    }

    #[test]
    fn budget_pinned_blocks_and_undo() {
        let (mut a, kept) = two_sparse();
        // Region 0 is sparser: one more block gone.
        let (addr, len, _, _) = a.free_block(kept[0].0);
        a.unhold_free(addr, len);
        let before = a.figures();
        // A budget below one region's live bytes empties the sparsest in
        // part, into the denser one.
        let p = plan(
            &mut a,
            Budget {
                max_bytes: R / 4,
                max_blocks: 100,
            },
            1,
        );
        assert_eq!(
            (p.moves.len(), p.sources.clone(), p.bytes()),
            (2, vec![0], R / 4)
        );
        assert!(p.moves.iter().all(|m| a.region_of(m.dst) == R));
        undo(&mut a, &p, 1);
        assert_eq!(a.figures(), before);
        // Pin one block in each region: nothing can move.
        let (g0, g1) = (kept[1], kept[4]);
        a.entry(g0.0, g0.1).pins = 1;
        a.entry(g1.0, g1.1).pins = 1;
        assert!(plan(&mut a, ALL, 2).moves.is_empty());
        a.entry(g0.0, g0.1).pins = 0;
        let p = plan(&mut a, ALL, 3);
        assert_eq!(p.sources, vec![0]);
        undo(&mut a, &p, 3);
        a.check().unwrap();
        assert_eq!(a.figures(), before);
        assert!(a.entries.iter().all(|e| e.moving.is_none()));
    }

    #[test]
    fn partial_evacuations_never_move_into_much_sparser_regions() {
        let (mut a, kept) = two_sparse();
        // Region 0: one block left, pinned (not a candidate); region R:
        // four blocks, more than the budget allows at once.
        for &(id, _) in &kept[1..4] {
            let (addr, len, _, _) = a.free_block(id);
            a.unhold_free(addr, len);
        }
        a.entry(kept[0].0, kept[0].1).pins = 1;
        let b = Budget {
            max_bytes: R / 4,
            max_blocks: 100,
        };
        assert!(plan(&mut a, b, 1).moves.is_empty());
    }

    #[test]
    fn repeated_passes_without_traffic_terminate() {
        // Many regions of mixed occupancy and sizes; small budgets force
        // partial evacuations. Passes must stop making moves.
        let mut a = ArenaState::new(R);
        for r in 0..12 {
            a.add_region(r * R);
        }
        let mut ids = Vec::new();
        let mut i = 0u64;
        while let Some(h) = a.alloc_block(((i * 7919) % 40 + 1) * 1024) {
            ids.push(h);
            i += 1;
        }
        for (k, &(id, _)) in ids.iter().enumerate() {
            if (k * 31) % 5 < 3 {
                let (addr, len, _, _) = a.free_block(id);
                a.unhold_free(addr, len);
            }
        }
        let regions0 = a.regions.len();
        let b = Budget {
            max_bytes: u64::MAX,
            max_blocks: 7,
        };
        let mut passes = 0;
        loop {
            let p = plan(&mut a, b, passes + 1);
            if p.moves.is_empty() {
                break;
            }
            for m in &p.moves {
                a.relocate(m.handle, m.dst);
            }
            for &s in &p.sources {
                a.set_evacuating(s, false);
                a.drop_if_empty(s);
            }
            a.check().unwrap();
            passes += 1;
            assert!(passes < 10_000, "passes cycle");
        }
        assert!(passes > 0 && a.regions.len() < regions0);
    }
}
