//! Synthetic recordings, written by hand from PyTorch's rules (not produced
//! by the port), for the generic checks of [`super::replay_recording`].

use super::*;
use crate::trace::peers::recording::{RecordedBlock, RecordedEvent, RecordedSegment};

const MIB: u64 = 1 << 20;

fn ev(action: RecordedAction, addr: u64, size: u64) -> RecordedEvent {
    RecordedEvent {
        action,
        addr,
        size,
        stream: 0,
    }
}

fn seg_ev(action: SegmentAction, addr: u64, size: u64) -> RecordedEvent {
    ev(RecordedAction::Segment(action), addr, size)
}

fn alloc(addr: u64, size: u64) -> RecordedEvent {
    ev(RecordedAction::Alloc, addr, size)
}

/// `free_requested` then `free_completed`, as PyTorch records a free with
/// no other stream involved.
fn free(addr: u64, size: u64) -> [RecordedEvent; 2] {
    [
        ev(RecordedAction::FreeRequested, addr, size),
        ev(RecordedAction::FreeCompleted, addr, size),
    ]
}

fn block(addr: u64, size: u64, requested: u64, state: BlockState) -> RecordedBlock {
    RecordedBlock {
        addr,
        size,
        requested,
        state,
    }
}

fn segment(addr: u64, small: bool, blocks: Vec<RecordedBlock>) -> RecordedSegment {
    RecordedSegment {
        addr,
        total_size: blocks.iter().map(|b| b.size).sum(),
        stream: 0,
        small: Some(small),
        expandable: false,
        blocks,
    }
}

fn cfg(expandable: bool) -> TorchConfig {
    TorchConfig {
        capacity_bytes: 1 << 34,
        ..TorchConfig::with_mode(expandable)
    }
}

const S1: u64 = 0x7000_0000_0000;
const S2: u64 = 0x7000_1000_0000;
const S3: u64 = 0x7000_2000_0000;
const S4: u64 = 0x7000_3000_0000;
/// Far enough from [`S1`] for an expandable reservation of 1 1/8 of the
/// test device (16 GiB) in between.
const FAR: u64 = 0x7100_0000_0000;

/// A cold start in default mode, as PyTorch 2.x records it: a small
/// segment, a 20 MiB segment split twice, a 16 MiB segment for a 15 MiB
/// request (1 MiB left: not split), a 2 MiB request taking a whole 3 MiB
/// block (1 MiB left), `empty_cache()` freeing the one wholly free segment,
/// and a new segment at a new address.
fn cold_start_recording() -> Recording {
    use BlockState::*;
    use SegmentAction::*;
    let mut events = vec![
        seg_ev(SegmentAlloc, S1, 2 * MIB),
        alloc(S1, 1000),
        seg_ev(SegmentAlloc, S2, 20 * MIB),
        alloc(S2, 3 * MIB),
        alloc(S2 + 3 * MIB, 3 * MIB),
        seg_ev(SegmentAlloc, S3, 16 * MIB),
        alloc(S3, 15 * MIB),
    ];
    events.extend(free(S2, 3 * MIB));
    events.push(alloc(S2, 2 * MIB));
    events.extend(free(S3, 15 * MIB));
    events.push(seg_ev(SegmentFree, S3, 16 * MIB));
    events.push(seg_ev(SegmentAlloc, S4, 16 * MIB));
    events.push(alloc(S4, 15 * MIB));
    Recording {
        name: "synthetic-cold".into(),
        events,
        segments: vec![
            segment(
                S1,
                true,
                vec![
                    block(S1, 1024, 1000, ActiveAllocated),
                    block(S1 + 1024, 2 * MIB - 1024, 0, Inactive),
                ],
            ),
            segment(
                S2,
                false,
                vec![
                    block(S2, 3 * MIB, 2 * MIB, ActiveAllocated),
                    block(S2 + 3 * MIB, 3 * MIB, 3 * MIB, ActiveAllocated),
                    block(S2 + 6 * MIB, 14 * MIB, 0, Inactive),
                ],
            ),
            segment(
                S4,
                false,
                vec![block(S4, 16 * MIB, 15 * MIB, ActiveAllocated)],
            ),
        ],
        ..Default::default()
    }
}

#[test]
fn cold_start_recording_is_reproduced_event_for_event() {
    let rec = cold_start_recording();
    let run = replay_recording(&rec, cfg(false)).unwrap();
    let v = &run.validation;
    assert!(v.matched, "{}", v.note);
    assert_eq!(v.start_reserved_bytes, 0);
    assert_eq!(v.allocs, 6);
    assert_eq!(v.allocs_at_recorded_address, 6);
    assert_eq!(v.recorded_segment_events, 5);
    assert_eq!(v.port_segment_events, 5);
    assert_eq!(v.empty_cache_calls, 1);
    assert_eq!(v.recorded_peak_reserved_bytes, 38 * MIB);
    assert_eq!(v.peak_reserved_bytes, 38 * MIB);
    assert_eq!(v.driver.calls["cuMemAlloc"], 4);
    assert_eq!(v.driver.calls["cuMemFree"], 1);
}

#[test]
fn a_segment_pytorch_did_not_make_is_a_difference() {
    // PyTorch packed the 15 MiB request's segment differently: say 20 MiB.
    let mut rec = cold_start_recording();
    for e in &mut rec.events {
        if e.addr == S3 && e.action != RecordedAction::Alloc {
            e.size = if e.size == 16 * MIB { 20 * MIB } else { e.size };
        }
    }
    let v = replay_recording(&rec, cfg(false)).unwrap().validation;
    assert!(!v.matched);
    assert!(!v.segment_events_match);
    assert!(
        v.note.contains("segment events differ at #2"),
        "names the first difference: {}",
        v.note
    );
    assert!(v.note.contains("segment_alloc of 20971520 B"), "{}", v.note);
}

#[test]
fn an_allocation_placed_elsewhere_is_a_difference() {
    let mut rec = cold_start_recording();
    // Claim the 2 MiB request went to the big free block instead.
    let i = rec
        .events
        .iter()
        .position(|e| e.action == RecordedAction::Alloc && e.size == 2 * MIB)
        .unwrap();
    rec.events[i].addr = S2 + 6 * MIB;
    let v = replay_recording(&rec, cfg(false)).unwrap().validation;
    assert!(!v.matched);
    assert_eq!(v.allocs_at_recorded_address, v.allocs - 1);
    assert!(v.note.contains(&format!("event {i}: alloc")), "{}", v.note);
    assert!(v.segment_events_match, "segments alone cannot tell");
}

#[test]
fn segment_sizes_in_order_are_compared_not_only_totals() {
    // Same total, other order: the recording claims the 16 MiB segment came
    // before the 20 MiB one.
    let mut a = cold_start_recording();
    let sizes: Vec<u64> = a
        .events
        .iter()
        .filter(|e| e.action == RecordedAction::Segment(SegmentAction::SegmentAlloc))
        .map(|e| e.size)
        .collect();
    assert_eq!(sizes, [2 * MIB, 20 * MIB, 16 * MIB, 16 * MIB]);
    for e in &mut a.events {
        if let RecordedAction::Segment(SegmentAction::SegmentAlloc) = e.action {
            if e.size == 20 * MIB {
                e.size = 16 * MIB;
            } else if e.addr == S3 {
                e.size = 20 * MIB;
            }
        }
    }
    let v = replay_recording(&a, cfg(false)).unwrap().validation;
    assert!(!v.segment_events_match, "{}", v.note);
}

/// A warm start: a 20 MiB segment with a block freed in the trace whose
/// size is not recorded (3 MiB asked, and 0.5 MiB after it that PyTorch
/// could not have split off), a block live throughout (recorded size), and
/// free space; then a 3.2 MiB request that fits only if the freed block
/// took the 0.5 MiB.
fn warm_start_recording() -> Recording {
    use BlockState::*;
    let req_a = 3 * MIB - 1000;
    let req_c = 3_355_443; // 3.2 MiB, rounds to 3_355_648
    let mut events = free(S2, req_a).to_vec();
    events.push(alloc(S2, req_c));
    Recording {
        name: "synthetic-warm".into(),
        events,
        segments: vec![segment(
            S2,
            false,
            vec![
                block(S2, 3 * MIB + MIB / 2, req_c, ActiveAllocated),
                block(S2 + 3 * MIB + MIB / 2, 4 * MIB, 4 * MIB, ActiveAllocated),
                block(S2 + 7 * MIB + MIB / 2, 12 * MIB + MIB / 2, 0, Inactive),
            ],
        )],
        ..Default::default()
    }
}

#[test]
fn warm_start_infers_unsplit_block_sizes() {
    let rec = warm_start_recording();
    let run = replay_recording(&rec, cfg(false)).unwrap();
    let v = &run.validation;
    assert!(v.matched, "{}", v.note);
    assert_eq!(v.start_reserved_bytes, 20 * MIB);
    assert_eq!(v.prelive_blocks, 2);
    assert_eq!(v.inferred_block_sizes, 1);
    assert_eq!(v.peak_reserved_bytes, 20 * MIB);
    assert!(v.driver.calls.is_empty(), "no driver call: {:?}", v.driver);
}

#[test]
fn a_block_outside_every_segment_is_an_error() {
    let mut rec = warm_start_recording();
    rec.events[0].addr = S4;
    rec.events[1].addr = S4;
    let e = replay_recording(&rec, cfg(false)).unwrap_err();
    assert!(e.to_string().contains("lie in no segment"), "{e}");
}

/// A cold start with expandable segments, as PyTorch records it: one
/// 20 MiB page for a 3 MiB request, a 2 MiB small page, a second large page
/// for a 30 MiB request that starts in the free tail of the first, and an
/// `empty_cache()` that unmaps the one wholly free page.
fn expandable_recording() -> Recording {
    use BlockState::*;
    use SegmentAction::*;
    let (e, f) = (S1, FAR);
    let mut events = vec![
        seg_ev(SegmentMap, e, 20 * MIB),
        alloc(e, 3 * MIB),
        seg_ev(SegmentMap, f, 2 * MIB),
        alloc(f, 1000),
        seg_ev(SegmentMap, e + 20 * MIB, 20 * MIB),
        alloc(e + 3 * MIB, 30 * MIB),
    ];
    events.extend(free(e + 3 * MIB, 30 * MIB));
    events.push(seg_ev(SegmentUnmap, e + 20 * MIB, 20 * MIB));
    let expandable = |mut s: RecordedSegment| {
        s.expandable = true;
        s
    };
    Recording {
        name: "synthetic-expandable".into(),
        events,
        segments: vec![
            expandable(segment(
                e,
                false,
                vec![
                    block(e, 3 * MIB, 3 * MIB, ActiveAllocated),
                    block(e + 3 * MIB, 17 * MIB, 0, Inactive),
                ],
            )),
            expandable(segment(
                f,
                true,
                vec![
                    block(f, 1024, 1000, ActiveAllocated),
                    block(f + 1024, 2 * MIB - 1024, 0, Inactive),
                ],
            )),
        ],
        ..Default::default()
    }
}

#[test]
fn expandable_cold_start_is_reproduced_event_for_event() {
    let rec = expandable_recording();
    assert!(rec.expandable());
    let v = replay_recording(&rec, cfg(true)).unwrap().validation;
    assert!(v.matched, "{}", v.note);
    assert_eq!(v.recorded_segment_events, 4);
    assert_eq!(v.peak_reserved_bytes, 42 * MIB);
    let c = &v.driver.calls;
    assert_eq!(c["cuMemAddressReserve"], 2, "one per pool");
    assert_eq!(c["cuMemCreate"], 3);
    assert_eq!(c["cuMemMap"], 3);
    assert_eq!(c["cuMemSetAccess"], 3, "one per mapped range");
    assert_eq!(c["cuMemUnmap"], 1);
    assert_eq!(c["cuMemRelease"], 1);
}

#[test]
fn expandable_recordings_must_start_empty() {
    let mut rec = expandable_recording();
    rec.events.remove(0); // the first page was mapped before recording
    let e = replay_recording(&rec, cfg(true)).unwrap_err();
    assert!(e.to_string().contains("cold-start"), "{e}");
}

#[test]
fn segment_differences_name_position_action_and_size() {
    let e = |pos, action, size| {
        (
            pos,
            SegmentEvent {
                action,
                addr: S1,
                size,
                stream: 0,
            },
        )
    };
    let a = [e(0, SegmentAction::SegmentAlloc, 2 * MIB)];
    assert_eq!(first_segment_difference(&a, &a), None);
    let later = [e(3, SegmentAction::SegmentAlloc, 2 * MIB)];
    assert!(first_segment_difference(&a, &later)
        .unwrap()
        .contains("before block event 3"));
    let d = first_segment_difference(&a, &[]).unwrap();
    assert!(d.contains("#0 of 1 recorded / 0"), "{d}");
    assert!(d.contains("port none"), "{d}");
}
