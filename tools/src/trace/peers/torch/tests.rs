//! The default mode's rules, one at a time.

use super::*;

const MIB: u64 = 1 << 20;

fn torch(capacity: u64) -> TorchAllocator {
    let mut a = TorchAllocator::new(TorchConfig {
        capacity_bytes: capacity,
        ..TorchConfig::default()
    });
    a.log_segment_events(true);
    a
}

fn seg_sizes(a: &mut TorchAllocator) -> Vec<(SegmentAction, u64)> {
    a.take_segment_events()
        .iter()
        .map(|e| (e.action, e.size))
        .collect()
}

#[test]
fn segments_are_2_mib_20_mib_or_the_request_rounded_to_2_mib() {
    use SegmentAction::SegmentAlloc as A;
    let mut a = torch(1 << 34);
    let x = a.malloc(100, 0).unwrap();
    let y = a.malloc(100, 0).unwrap();
    assert_eq!(y, x + 512, "small requests pack into one 2 MiB segment");
    a.malloc(MIB + 1, 0).unwrap();
    // 11 MiB fits in the 20 MiB segment's free rest; 21 MiB does not.
    a.malloc(11 * MIB + 1, 0).unwrap();
    a.malloc(21 * MIB + 1, 0).unwrap();
    assert_eq!(
        seg_sizes(&mut a),
        [(A, 2 * MIB), (A, 20 * MIB), (A, 22 * MIB)]
    );
    assert_eq!(a.reserved_bytes(), 44 * MIB);
    assert_eq!(a.driver_calls()["cuMemAlloc"], 3);
    let rest_of_22 = MIB - 512;
    assert_eq!(
        a.stats().allocated_bytes,
        1024 + (MIB + 512) + (11 * MIB + 512) + (21 * MIB + 512 + rest_of_22),
        "the 22 MiB segment's last 1 MiB - 512 B is not split off"
    );
}

#[test]
fn best_fit_takes_the_smallest_block_then_the_lowest_address() {
    let mut a = torch(1 << 34);
    let keep: Vec<u64> = (0..6).map(|_| a.malloc(3 * MIB, 0).unwrap()).collect();
    // Free blocks of 3 MiB at keep[1] and keep[3], and 2 MiB at the end.
    a.free(keep[1]).unwrap();
    a.free(keep[3]).unwrap();
    assert_eq!(
        a.malloc(2 * MIB + 1, 0).unwrap(),
        keep[1],
        "lowest of two equal"
    );
    assert_eq!(a.malloc(3 * MIB, 0).unwrap(), keep[3]);
    let tail = keep[5] + 3 * MIB;
    assert_eq!(a.malloc(2 * MIB, 0).unwrap(), tail, "the 2 MiB tail block");
    assert_eq!(a.segments().len(), 1);
}

#[test]
fn splits_need_more_than_1_mib_left_in_the_large_pool() {
    let mut a = torch(1 << 34);
    let x = a.malloc(19 * MIB, 0).unwrap();
    let seg = &a.segments()[0];
    assert_eq!(seg.blocks.len(), 1, "1 MiB left of 20 is not split off");
    assert_eq!(seg.blocks[0].size, 20 * MIB);
    a.free(x).unwrap();
    a.malloc(18 * MIB, 0).unwrap();
    assert_eq!(a.segments()[0].blocks.len(), 2, "2 MiB left is split off");
}

#[test]
fn frees_merge_with_both_neighbours() {
    let mut a = torch(1 << 34);
    let v: Vec<u64> = (0..3).map(|_| a.malloc(4 * MIB, 0).unwrap()).collect();
    a.free(v[0]).unwrap();
    a.free(v[2]).unwrap();
    assert_eq!(
        a.segments()[0].blocks.len(),
        3,
        "v[2] merged with the free rest"
    );
    a.free(v[1]).unwrap();
    let s = &a.segments()[0];
    assert_eq!(s.blocks.len(), 1);
    assert_eq!(s.blocks[0].size, 20 * MIB);
}

#[test]
fn blocks_are_kept_per_stream() {
    let mut a = torch(1 << 34);
    let x = a.malloc(4 * MIB, 1).unwrap();
    a.free(x).unwrap();
    let y = a.malloc(4 * MIB, 2).unwrap();
    assert_ne!(y, x, "stream 2 cannot take stream 1's cached block");
    assert_eq!(a.reserved_bytes(), 40 * MIB);
    assert_eq!(a.malloc(4 * MIB, 1).unwrap(), x);
}

#[test]
fn out_of_memory_releases_cached_segments_and_retries() {
    use SegmentAction::*;
    let mut a = torch(40 * MIB);
    let x = a.malloc(4 * MIB, 1).unwrap();
    let small = a.malloc(512, 1).unwrap();
    a.free(x).unwrap();
    a.free(small).unwrap();
    seg_sizes(&mut a);
    // 20 + 2 MiB cached on stream 1; stream 2 needs 20 MiB of 40.
    let y = a.malloc(4 * MIB, 2).unwrap();
    assert_eq!(
        seg_sizes(&mut a),
        [
            (SegmentFree, 20 * MIB),
            (SegmentFree, 2 * MIB),
            (SegmentAlloc, 20 * MIB)
        ],
        "cudaMalloc failed, every cached segment went back, the retry succeeded"
    );
    assert_eq!(a.stats().num_alloc_retries, 1);
    assert_eq!(a.driver_calls()["cuMemAlloc"], 4, "the failed call counts");
    a.malloc(4 * MIB, 2).unwrap();
    let e = a.malloc(21 * MIB, 2).unwrap_err();
    assert!(e.is_oom(), "{e}");
    assert_eq!(a.stats().num_ooms, 1);
    a.free(y).unwrap();
}

#[test]
fn max_split_size_keeps_oversize_blocks_whole() {
    let mut cfg = TorchConfig {
        capacity_bytes: 1 << 34,
        ..TorchConfig::default()
    };
    cfg.apply_alloc_conf("max_split_size_mb:64").unwrap();
    let mut a = TorchAllocator::new(cfg);
    let big = a.malloc(100 * MIB, 0).unwrap();
    a.free(big).unwrap();
    // A small request never takes the oversize block.
    let s = a.malloc(30 * MIB, 0).unwrap();
    assert_ne!(s, big);
    // An oversize request takes it if at most 20 MiB larger, unsplit.
    assert_eq!(a.malloc(81 * MIB, 0).unwrap(), big);
    let seg = a.segments().into_iter().find(|s| s.addr == big).unwrap();
    assert_eq!(seg.blocks.len(), 1);
    a.free(big).unwrap();
    let other = a.malloc(64 * MIB, 0).unwrap();
    assert_ne!(other, big, "36 MiB larger: too much to waste");
}

#[test]
fn max_split_size_releases_oversize_blocks_first_on_out_of_memory() {
    use SegmentAction::*;
    let mut cfg = TorchConfig {
        capacity_bytes: 260 * MIB,
        ..TorchConfig::default()
    };
    cfg.apply_alloc_conf("max_split_size_mb:64").unwrap();
    let mut a = TorchAllocator::new(cfg);
    a.log_segment_events(true);
    let x = a.malloc(100 * MIB, 0).unwrap();
    let y = a.malloc(120 * MIB, 0).unwrap();
    let z = a.malloc(4 * MIB, 0).unwrap();
    a.free(x).unwrap();
    a.free(y).unwrap();
    a.free(z).unwrap();
    seg_sizes(&mut a);
    // 150 MiB: neither cached block fits within 20 MiB; 36 MiB free on the
    // device. One oversize block of 150+ MiB does not exist, so the largest
    // go first until 150 MiB are released: 120, then 100.
    a.malloc(150 * MIB, 0).unwrap();
    assert_eq!(
        seg_sizes(&mut a),
        [
            (SegmentFree, 120 * MIB),
            (SegmentFree, 100 * MIB),
            (SegmentAlloc, 150 * MIB)
        ],
        "the 20 MiB segment of the small request stays"
    );
    assert_eq!(a.stats().num_alloc_retries, 0);
}

#[test]
fn garbage_collection_frees_old_cached_segments_above_the_threshold() {
    use SegmentAction::*;
    let mut cfg = TorchConfig {
        capacity_bytes: 1000 * MIB,
        memory_fraction: Some(0.1),
        ..TorchConfig::default()
    };
    cfg.apply_alloc_conf("garbage_collection_threshold:0.5")
        .unwrap();
    let mut a = TorchAllocator::new(cfg);
    a.log_segment_events(true);
    // Allowed: 100 MiB; threshold 50 MiB.
    let old = a.malloc(30 * MIB, 0).unwrap();
    a.free(old).unwrap();
    let young = a.malloc(24 * MIB, 1).unwrap();
    a.free(young).unwrap();
    seg_sizes(&mut a);
    // 54 MiB reserved (> 50): a miss collects. Both segments are whole and
    // free; the older (more searches since it was cached) goes first, and
    // 4 MiB over the threshold is enough.
    a.malloc(12 * MIB, 2).unwrap();
    assert_eq!(
        seg_sizes(&mut a),
        [(SegmentFree, 30 * MIB), (SegmentAlloc, 12 * MIB)]
    );
}

#[test]
fn roundup_power2_divisions_change_block_and_segment_sizes() {
    let mut cfg = TorchConfig {
        capacity_bytes: 1 << 34,
        ..TorchConfig::default()
    };
    cfg.apply_alloc_conf("roundup_power2_divisions:4").unwrap();
    let mut a = TorchAllocator::new(cfg);
    a.malloc(17 * MIB, 0).unwrap();
    assert_eq!(a.reserved_bytes(), 20 * MIB, "17 MiB rounds to 20 (16 + 4)");
    assert_eq!(a.stats().allocated_bytes, 20 * MIB);
}

#[test]
fn seeding_checks_blocks_against_their_segment() {
    let seg = |live| SeedSegment {
        addr: 1 << 40,
        size: 20 * MIB,
        stream: 0,
        small: false,
        live,
    };
    let ok = TorchAllocator::with_segments(
        TorchConfig::default(),
        &[seg(vec![((1 << 40) + 2 * MIB, 4 * MIB, 4 * MIB)])],
    )
    .unwrap();
    let s = ok.segments();
    assert_eq!(s[0].blocks.len(), 3, "free, live, free");
    assert_eq!(ok.reserved_bytes(), 20 * MIB);
    assert!(ok.driver_calls().is_empty());
    for bad in [
        vec![((1 << 40) + 18 * MIB, 4 * MIB, 1)],
        vec![(1 << 40, 4 * MIB, 1), ((1 << 40) + 2 * MIB, 4 * MIB, 1)],
    ] {
        assert!(TorchAllocator::with_segments(TorchConfig::default(), &[seg(bad)]).is_err());
    }
    assert!(TorchAllocator::with_segments(TorchConfig::with_mode(true), &[]).is_err());
}
