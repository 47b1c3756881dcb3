use super::*;
use crate::backend::sim::{SimBackend, SimConfig};

const MIB: u64 = 1 << 20;

/// A stitch whose unbacked granules form two runs, with the second
/// run's map failing: the first run, already mapped with chunks stolen
/// by aliasing from another stream's dirty memory, must be unmapped
/// again and every chunk put back, so that no other stream can take an
/// aliased chunk under a clean address while its old uses run.
#[test]
fn a_failed_second_run_unmaps_the_first_and_puts_every_chunk_back() {
    let sim = Arc::new(
        SimBackend::new(SimConfig {
            devices: 1,
            capacity_bytes: 64 * MIB,
            granularity: 2 * MIB,
            ..Default::default()
        })
        .unwrap(),
    );
    let mut heap = Heap::new(sim.clone(), 0, 256 * MIB, 0).unwrap();
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
