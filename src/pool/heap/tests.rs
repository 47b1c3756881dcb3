use super::*;
use crate::backend::sim::{SimBackend, SimConfig};

const MIB: u64 = 1 << 20;

/// A 64 MiB simulated device of 2 MiB granules and a heap over 256 MiB
/// of address space on it.
fn sim_and_heap() -> (Arc<SimBackend>, Heap) {
    let sim = Arc::new(
        SimBackend::new(SimConfig {
            devices: 1,
            capacity_bytes: 64 * MIB,
            granularity: 2 * MIB,
            ..Default::default()
        })
        .unwrap(),
    );
    let heap = Heap::new(sim.clone(), 0, 256 * MIB, 0).unwrap();
    (sim, heap)
}

/// A stitch whose unbacked granules form two runs, with the second
/// run's map failing: the first run, already mapped with chunks stolen
/// by aliasing from another stream's dirty memory, must be unmapped
/// again and every chunk put back, so that no other stream can take an
/// aliased chunk under a clean address while its old uses run.
#[test]
fn a_failed_second_run_unmaps_the_first_and_puts_every_chunk_back() {
    let (sim, mut heap) = sim_and_heap();
    let (base, _) = heap.reservation().unwrap();
    // Granules 0..6 backed and freed clean; 6..10 dirty on slot 0.
    let x = heap.alloc(12 * MIB, ALIGN, Some(0), false).unwrap();
    let z = heap.alloc(8 * MIB, ALIGN, Some(0), false).unwrap();
    assert_eq!((x.addr, z.addr), (base, base + 12 * MIB));
    heap.free(x.addr, Tag::Clean).unwrap();
    heap.free(z.addr, Tag::Dirty(0)).unwrap();
    // Holes at granules 0..2 and 4..6: two unbacked runs around 2..4.
    assert_eq!(heap.release_range(base, base + 4 * MIB), 4 * MIB);
    assert_eq!(heap.release_range(base + 8 * MIB, base + 12 * MIB), 4 * MIB);
    sim.set_capacity_limit(0, Some(heap.reserved())).unwrap();
    let layout = heap.layout();
    let reserved = heap.reserved();
    // Run one maps two chunks; the third map (run two) fails.
    sim.fail_nth_map(0, 3).unwrap();
    let r = heap.alloc(12 * MIB, ALIGN, Some(0), false);
    assert!(matches!(r, Err(Error::InjectedFault(_))), "{r:?}");
    sim.fail_nth_map(0, 0).unwrap();
    heap.check().unwrap();
    assert_eq!(heap.layout(), layout, "the failed stitch changed the heap");
    assert_eq!(heap.reserved(), reserved);
    assert!(
        heap.take_quarantine().is_empty(),
        "aliased granules left quarantined"
    );
    // Backed memory is where it was: granules 2..4 (clean) and 6..10
    // (dirty on slot 0), nothing under the holes.
    let backed: Vec<(u64, u64)> = layout
        .iter()
        .flatten()
        .map(|&(a, l, _)| (a - base, l))
        .collect();
    assert_eq!(backed, vec![(4 * MIB, 4 * MIB), (12 * MIB, 8 * MIB)]);
    // The retry succeeds.
    let ok = heap.alloc(12 * MIB, ALIGN, Some(0), false).unwrap();
    assert_eq!(ok.addr, base);
    heap.check().unwrap();
}

/// Four 4 MiB blocks a, b, c, d with a and c freed: two holes that no
/// 8 MiB request fits. Returns the blocks' addresses.
fn two_holes(heap: &mut Heap) -> Vec<u64> {
    let blocks: Vec<u64> = (0..4)
        .map(|_| heap.alloc(4 * MIB, ALIGN, Some(0), false).unwrap().addr)
        .collect();
    heap.free(blocks[0], Tag::Clean).unwrap();
    heap.free(blocks[2], Tag::Clean).unwrap();
    blocks
}

/// `stitch_budget`: a heap that has stolen its budget grows in place of
/// the next steal (and starts counting again); with no budget, a budget
/// not yet spent, or a limit that leaves no room to grow, it steals. Each
/// case runs the same requests: 4 MiB blocks a, b, c, d; a and c freed
/// (two holes no 8 MiB request fits); an 8 MiB request e, stitched from
/// them; b and d freed (two holes again); another 8 MiB request.
#[test]
fn past_its_stitch_budget_the_heap_grows_instead_of_stealing() {
    /// (reserved before and after the last request, granules stolen since
    /// the last growth after it)
    fn run(budget: f64, cap: Option<u64>) -> (u64, u64, u64) {
        run_capped(budget, cap, false)
    }
    /// With the cap at the device instead of the heap's limit (`device`).
    fn run_capped(budget: f64, cap: Option<u64>, device: bool) -> (u64, u64, u64) {
        let (sim, mut heap) = sim_and_heap();
        heap.stitch_budget = budget;
        let blocks = two_holes(&mut heap);
        assert_eq!(heap.reserved(), 16 * MIB);
        // First stitch: nothing stolen yet, so even a budget steals.
        let _e = heap.alloc(8 * MIB, ALIGN, Some(0), false).unwrap();
        assert_eq!(heap.reserved(), 16 * MIB, "the 8 MiB request is stitched");
        assert_eq!(heap.stolen_since_growth, 4);
        heap.free(blocks[1], Tag::Clean).unwrap();
        heap.free(blocks[3], Tag::Clean).unwrap();
        match cap {
            Some(cap) if device => sim.set_capacity_limit(0, Some(cap)).unwrap(),
            Some(cap) => heap.limit.set(Some(cap)),
            None => {}
        }
        let before = heap.reserved();
        heap.alloc(8 * MIB, ALIGN, Some(0), false).unwrap();
        heap.check().unwrap();
        (before, heap.reserved(), heap.stolen_since_growth)
    }
    // No budget: the second request is stitched too.
    let (before, after, stolen) = run(0.0, None);
    assert_eq!(after, before, "stitched, no growth");
    assert!(stolen > 4, "{stolen}");
    // A large budget is not spent yet: the same.
    assert_eq!(run(100.0, None), (before, after, stolen));
    // Budget 0.25 of 8 granules = 2, and 4 were stolen: it grows by what
    // it lacks instead, and the count starts again.
    let (b, grown, s) = run(0.25, None);
    assert_eq!(b, before);
    assert_eq!(
        grown - b,
        (stolen - 4) * 2 * MIB,
        "grew by the granules it would steal"
    );
    assert_eq!(s, 0);
    // Due, but the limit leaves no room: it steals (stitching is what
    // keeps the request from failing).
    assert_eq!(run(0.25, Some(16 * MIB)), (before, after, stolen));
    // The device refuses the chunks (found only when the job creates
    // them, outside the lock): planned again, it steals.
    assert_eq!(
        run_capped(0.25, Some(16 * MIB), true),
        (before, after, stolen)
    );
}

/// `stitch_share`: a heap whose share of wall time cannot cover a steal
/// grows in place of it; with no limit, or a share that covers it, it
/// steals. The requests of the test above: two 4 MiB holes no 8 MiB
/// request fits.
#[test]
fn past_its_share_of_time_the_heap_grows_instead_of_stealing() {
    /// (reserved after the 8 MiB request, granules stolen for it)
    fn run(share: StitchShare, cap: Option<u64>) -> (u64, u64) {
        let (_sim, mut heap) = sim_and_heap();
        heap.stitch_share = share;
        two_holes(&mut heap);
        if let Some(cap) = cap {
            heap.limit.set(Some(cap));
        }
        heap.alloc(8 * MIB, ALIGN, Some(0), false).unwrap();
        heap.check().unwrap();
        (heap.reserved(), heap.stolen_since_growth)
    }
    // No limit, or a share that covers four granules: stitched.
    assert_eq!(run(StitchShare::unlimited(), None), (16 * MIB, 4));
    assert_eq!(run(StitchShare::new(0.01, 1.0), None), (16 * MIB, 4));
    // A share that covers none: it grows by the four granules instead.
    assert_eq!(run(StitchShare::new(0.01, 1e9), None), (24 * MIB, 0));
    // Unless the limit leaves no room: then it steals after all.
    assert_eq!(
        run(StitchShare::new(0.01, 1e9), Some(16 * MIB)),
        (16 * MIB, 4)
    );
}

/// Cleaning a slot's dirty ranges: done only while no range joined the
/// slot since the count was read (a range freed after a stream query is
/// not covered by it), and the cleaned ranges merge with clean ones.
#[test]
fn dirty_ranges_are_cleaned_only_if_none_joined_since_the_count() {
    let (_sim, mut heap) = sim_and_heap();
    let a = heap.alloc(4 * MIB, ALIGN, Some(1), false).unwrap();
    let b = heap.alloc(4 * MIB, ALIGN, Some(1), false).unwrap();
    let c = heap.alloc(4 * MIB, ALIGN, Some(2), false).unwrap();
    heap.free(a.addr, Tag::Dirty(1)).unwrap();
    let seen = heap.dirty_slots();
    assert_eq!(seen, vec![(1, heap.dirty_gen(1))]);
    // Slot 1 frees again after the count was read: nothing is cleaned.
    heap.free(b.addr, Tag::Dirty(1)).unwrap();
    assert_eq!(heap.clean_dirty_if(1, seen[0].1), 0);
    assert!(heap.figures().free_dirty > 0);
    heap.check().unwrap();
    // Read again with nothing joining: all of slot 1's memory is clean,
    // one range, and slot 2 (not asked about) keeps its own.
    heap.free(c.addr, Tag::Dirty(2)).unwrap();
    let gen = heap.dirty_gen(1);
    assert_eq!(heap.clean_dirty_if(1, gen), 8 * MIB);
    heap.check().unwrap();
    assert_eq!(heap.dirty_slots(), vec![(2, heap.dirty_gen(2))]);
    let t = heap
        .alloc_backed(8 * MIB, ALIGN, Some(3))
        .expect("clean for any slot");
    assert_eq!(t.addr, a.addr);
    assert_eq!(t.from, Tag::Clean);
}

/// `find_run` over three neighbourhoods of adjacent free ranges with
/// different tags (pending groups, and dirty memory of the asking slot),
/// walled off by allocated ranges: of the runs that fit, the one with the
/// fewest pending groups wins, then the shortest; a group that is not
/// usable breaks a run; a request no neighbourhood covers finds none.
#[test]
fn find_run_takes_the_fewest_groups_then_the_shortest_run() {
    let (_sim, mut heap) = sim_and_heap();
    const OWN: u16 = 7;
    let mut next_slot = 10;
    let take = |heap: &mut Heap| heap.alloc(4 * MIB, ALIGN, Some(0), false).unwrap().addr;
    // `A B C | D E | F G |`: each a 4 MiB range, `|` an allocated one.
    let addrs: Vec<u64> = (0..10).map(|_| take(&mut heap)).collect();
    for w in addrs.windows(2) {
        assert_eq!(w[0] + 4 * MIB, w[1], "allocations laid side by side");
    }
    let [a, b, c, _, d, e, _, f, g, _] = addrs[..] else {
        unreachable!()
    };
    // A range of its own pending group: freed dirty on a slot of its own,
    // then flushed.
    let mut pending = |heap: &mut Heap, addr: u64| {
        heap.free(addr, Tag::Dirty(next_slot)).unwrap();
        let (id, _) = heap.flush_dirty(next_slot).unwrap();
        next_slot += 1;
        id
    };
    let g_a = pending(&mut heap, a);
    let g_b = pending(&mut heap, b);
    let g_c = pending(&mut heap, c);
    let g_d = pending(&mut heap, d);
    heap.free(e, Tag::Dirty(OWN)).unwrap();
    let g_f = pending(&mut heap, f);
    let g_g = pending(&mut heap, g);
    heap.check().unwrap();
    let all = |_: u32| true;
    // 8 MiB: D+E holds one group, the others two.
    assert_eq!(
        heap.find_run(8 * MIB, ALIGN, OWN, all),
        Some((d, vec![g_d]))
    );
    // Without D's group: A+B and F+G hold two each; F+G's run is the
    // shorter (8 MiB against 12).
    assert_eq!(
        heap.find_run(8 * MIB, ALIGN, OWN, |id| id != g_d),
        Some((f, vec![g_f, g_g]))
    );
    // 12 MiB: only A B C.
    assert_eq!(
        heap.find_run(12 * MIB, ALIGN, OWN, all),
        Some((a, vec![g_a, g_b, g_c]))
    );
    // Another slot may not use E: D+E no longer fits 8 MiB from D's side.
    assert_eq!(
        heap.find_run(8 * MIB, ALIGN, OWN + 1, |id| id != g_a),
        Some((b, vec![g_b, g_c]))
    );
    assert_eq!(heap.find_run(16 * MIB, ALIGN, OWN, all), None);
}

/// While a planned mapping is out (`map_job.rs`), its granules are no
/// other request's: the free rest of its last granule is cut out, so a
/// request that would fit there goes elsewhere; the check refuses to
/// run. Published, the rest is free (and backed) again; a failed map
/// leaves the heap as it was.
#[test]
fn a_planned_mapping_keeps_its_granules_until_published() {
    let (sim, mut heap) = sim_and_heap();
    let (base, _) = heap.reservation().unwrap();
    let layout = heap.layout();
    let reserved = heap.reserved();
    // 3 MiB: granules 0 and 1, the rest of granule 1 free.
    let (t, job) = heap.alloc_planned(3 * MIB, ALIGN, Some(0), false).unwrap();
    let job = job.expect("fresh granules need a mapping");
    assert_eq!(t.addr, base);
    assert!(heap.check().is_err(), "the check ran with a mapping out");
    // 1 MiB would fit in granule 1's rest: it lands past granule 1.
    let other = heap.alloc(MIB, ALIGN, Some(0), false).unwrap();
    assert!(other.addr >= base + 4 * MIB, "{:#x}", other.addr - base);
    heap.free(other.addr, Tag::Clean).unwrap();
    let done = job.run();
    let t = heap.finish_alloc(t, job, done).unwrap();
    heap.check().unwrap();
    assert!(heap.fully_backed(base, 4 * MIB));
    // Granule 1's rest is backed free memory now.
    assert!(heap.is_free(base + 3 * MIB));
    heap.free(t.addr, Tag::Clean).unwrap();
    heap.check().unwrap();
    // A map that fails: everything as before.
    heap.release_cached();
    heap.check().unwrap();
    assert_eq!((heap.layout(), heap.reserved()), (layout.clone(), reserved));
    sim.fail_nth_map(0, 1).unwrap();
    let (t, job) = heap.alloc_planned(3 * MIB, ALIGN, Some(0), false).unwrap();
    let job = job.expect("fresh granules need a mapping");
    let done = job.run();
    let r = heap.finish_alloc(t, job, done);
    assert!(matches!(r, Err(Error::InjectedFault(_))), "{r:?}");
    heap.check().unwrap();
    assert_eq!((heap.layout(), heap.reserved()), (layout, reserved));
}

/// A stolen clean granule is unmapped by the job, outside the lock: if
/// the driver refuses, the request fails and the granules it did not
/// unmap keep their mappings; those it did unmap hold spare chunks. The
/// heap stays consistent and holds what it held, and a retry stitches.
#[test]
fn a_steal_whose_unmap_fails_leaves_the_heap_whole() {
    for nth in [1, 2] {
        let (sim, mut heap) = sim_and_heap();
        let _blocks = two_holes(&mut heap);
        let (layout, reserved) = (heap.layout(), heap.reserved());
        // Two clean runs to steal (the holes); unmap call `nth` fails.
        sim.fail_nth_unmap(0, nth).unwrap();
        let r = heap.alloc(8 * MIB, ALIGN, Some(0), false);
        assert!(matches!(r, Err(Error::InjectedFault(_))), "{r:?}");
        heap.check().unwrap();
        assert_eq!(heap.reserved(), reserved);
        if nth == 1 {
            assert_eq!(heap.layout(), layout, "nothing was unmapped");
        } else {
            // The first hole was unmapped: its chunks are spare.
            assert_eq!(heap.figures().spare, 4 * MIB);
        }
        sim.fail_nth_unmap(0, 0).unwrap();
        heap.alloc(8 * MIB, ALIGN, Some(0), false).unwrap();
        heap.check().unwrap();
        assert_eq!(heap.reserved(), reserved, "stitched, not grown");
    }
}

/// A job that aliased a pending group's idle granules fails after the
/// group completed (while the job was out): the pieces it cut out come
/// back clean, not under a group nothing will complete again.
#[test]
fn pieces_of_a_group_completed_while_a_job_was_out_return_clean() {
    let (sim, mut heap) = sim_and_heap();
    let (base, _) = heap.reservation().unwrap();
    let x = heap.alloc(8 * MIB, ALIGN, Some(0), false).unwrap();
    let id = heap.new_pending_group();
    heap.free(x.addr, Tag::Pending(id)).unwrap();
    // 8 MiB elsewhere, backed by aliasing the pending group's granules.
    let (t, job) = heap.alloc_planned(8 * MIB, ALIGN, Some(0), true).unwrap();
    let job = job.expect("unbacked granules");
    assert_eq!(t.addr, base + 8 * MIB);
    assert_eq!(
        heap.take_steal_waits(),
        Vec::<u32>::new(),
        "held by the job"
    );
    heap.complete_pending(id);
    sim.fail_nth_map(0, 1).unwrap();
    let done = job.run();
    assert!(heap.finish_alloc(t, job, done).is_err());
    heap.check().unwrap();
    let f = heap.figures();
    assert_eq!((f.free_pending, f.free_clean), (0, 8 * MIB), "{f:?}");
    assert!(heap.take_quarantine().is_empty());
}
