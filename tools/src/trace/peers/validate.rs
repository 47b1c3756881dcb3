//! Checking the PyTorch port against what PyTorch recorded.
//!
//! A snapshot records PyTorch's own decisions: the address of every
//! allocation, every segment it allocated or freed (`segment_alloc`,
//! `segment_free`; `segment_map`, `segment_unmap` with expandable segments),
//! and the segments and blocks at dump time. [`replay_recording`] puts the
//! port where PyTorch was when recording began and replays the events:
//!
//! 1. **Start.** The segments at the start are those at dump time, walked
//!    back through the segment events (a `segment_alloc` did not exist
//!    before, a `segment_free` did). Blocks live at the start follow the
//!    replay rule of `traces/README.md`: a `free_requested` of an address
//!    with no earlier `alloc`, and an `active*` block whose address no
//!    `alloc` names (its size is recorded). The size of a block of the first
//!    kind is not recorded: it is its rounded request, plus the free bytes
//!    after it up to the next live block when PyTorch could not have split
//!    them off (`should_split`). Everything else in a segment is free.
//!    Expandable segments can only start empty (a cold-start recording).
//! 2. **Events.** `alloc` allocates and must land at the recorded address;
//!    a block goes back to the cache at its `free_completed` (at its
//!    `free_requested` in recordings without `free_completed`). A burst of
//!    recorded `segment_free`/`segment_unmap` is the program's
//!    `empty_cache()` or PyTorch's release-and-retry on out of memory: both
//!    run `release_cached_blocks`, which the port runs there too. New
//!    segments get PyTorch's recorded addresses (in order, while sizes
//!    agree), so best fit breaks ties as it did.
//! 3. **Verdict.** Matched when every allocation landed at its recorded
//!    address, the port's segment events equal the recorded ones event for
//!    event (action, size, address, and position among the block events),
//!    its peak reserved bytes equal the recording's, and its segments and
//!    blocks at the end equal the snapshot's, block for block.
//!
//! Invariants: the port starts with exactly the recorded starting segments
//! (so every segment it adds is one PyTorch did not have, and shows as a
//! segment-event difference); the replay never edits the recording.

use std::collections::{BTreeMap, HashMap, HashSet};

use super::device::DriverCounter;
use super::recording::{BlockState, RecordedAction, Recording};
use super::torch::{SeedSegment, SegmentAction, SegmentEvent, TorchAllocator};
use super::{PeerAllocator, TorchConfig, SMALL_BUFFER, SMALL_SIZE};
use gpupool::{Error, Result};

/// The outcome of [`replay_recording`].
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Validation {
    /// Whether the port reproduced the recording (see the [module
    /// docs](self)).
    pub matched: bool,
    /// What matched, or what did not and why.
    pub note: String,
    /// PyTorch's peak reserved bytes during the recording.
    pub recorded_peak_reserved_bytes: u64,
    /// The port's over the same events, from the same start.
    pub peak_reserved_bytes: u64,
    /// Reserved bytes at the start (both).
    pub start_reserved_bytes: u64,
    /// Allocations replayed.
    pub allocs: u64,
    /// Of which the port placed at PyTorch's recorded address.
    pub allocs_at_recorded_address: u64,
    /// Allocations the port refused.
    pub failed_allocs: u64,
    /// Blocks live at the start.
    pub prelive_blocks: u64,
    /// Of which sizes were inferred (freed before any allocation of their
    /// address).
    pub inferred_block_sizes: u64,
    /// Of those, sizes that other splits could also explain.
    pub ambiguous_block_sizes: u64,
    /// Segment events PyTorch recorded.
    pub recorded_segment_events: u64,
    /// Segment events the port made.
    pub port_segment_events: u64,
    /// `release_cached_blocks` runs at recorded release bursts.
    pub empty_cache_calls: u64,
    /// Whether the segment events agreed, event for event.
    pub segment_events_match: bool,
    /// Whether the final segments and blocks agreed.
    pub final_layout_matches: bool,
    /// Driver calls the port made during the replay.
    #[serde(skip)]
    pub driver: DriverCounter,
}

/// A replay of a recording: the port as it ended, and the verdict.
#[derive(Debug, Clone)]
pub struct ValidationRun {
    /// The port after the last event.
    pub allocator: TorchAllocator,
    /// The verdict.
    pub validation: Validation,
}

/// A segment event with its position: the number of block events
/// (`alloc`, `free_requested`, `free_completed`) before it.
type Positioned = (u64, SegmentEvent);

/// A block live at the start: (block size where recorded, requested size,
/// stream).
type Prelive = (Option<u64>, u64, u64);

struct Start {
    segments: Vec<SeedSegment>,
    prelive: u64,
    inferred: u64,
    ambiguous: u64,
}

fn bad(rec: &Recording, msg: impl Into<String>) -> Error {
    Error::Trace {
        file: rec.name.clone(),
        msg: msg.into(),
    }
}

/// The segments and live blocks at the start of the recording.
fn start_state(rec: &Recording, cfg: &TorchConfig) -> Result<Start> {
    // (size, stream, small) by address, walked back from dump time.
    let mut segs: BTreeMap<u64, (u64, u64, bool)> = rec
        .segments
        .iter()
        .map(|s| {
            let small = s.small.unwrap_or(s.total_size == SMALL_BUFFER);
            (s.addr, (s.total_size, s.stream, small))
        })
        .collect();
    for ev in rec.events.iter().rev() {
        let RecordedAction::Segment(act) = ev.action else {
            continue;
        };
        match act {
            SegmentAction::SegmentAlloc | SegmentAction::SegmentMap
                if !cfg.expandable_segments && segs.remove(&ev.addr).is_none() =>
            {
                return Err(bad(
                    rec,
                    format!(
                        "segment_alloc at {:#x} is neither in `segments` nor freed later",
                        ev.addr
                    ),
                ));
            }
            SegmentAction::SegmentFree | SegmentAction::SegmentUnmap
                if !cfg.expandable_segments =>
            {
                segs.insert(ev.addr, (ev.size, ev.stream, ev.size == SMALL_BUFFER));
            }
            _ => {}
        }
    }
    if cfg.expandable_segments {
        // Rebuilding page maps from a snapshot is not attempted: only a
        // recording that starts with nothing mapped can be replayed.
        let mut reserved: i128 = rec.segments.iter().map(|s| i128::from(s.total_size)).sum();
        for ev in &rec.events {
            if let RecordedAction::Segment(a) = ev.action {
                reserved -= if a.grows() { 1 } else { -1 } * i128::from(ev.size);
            }
        }
        if reserved != 0 {
            return Err(Error::Unsupported(format!(
                "an expandable-segments recording that starts with {reserved} B mapped \
                 (only cold-start expandable recordings can be replayed)"
            )));
        }
        segs.clear();
    }

    // Blocks live at the start, by address.
    let mut seen: HashSet<u64> = HashSet::new();
    let mut prelive: BTreeMap<u64, Prelive> = BTreeMap::new();
    let allocated: HashSet<u64> = rec
        .events
        .iter()
        .filter(|e| e.action == RecordedAction::Alloc)
        .map(|e| e.addr)
        .collect();
    for ev in &rec.events {
        match ev.action {
            RecordedAction::Alloc => {
                seen.insert(ev.addr);
            }
            RecordedAction::FreeRequested if seen.insert(ev.addr) => {
                prelive.insert(ev.addr, (None, ev.size, ev.stream));
            }
            _ => {}
        }
    }
    for seg in &rec.segments {
        for b in &seg.blocks {
            if b.state != BlockState::Inactive && !allocated.contains(&b.addr) {
                prelive.insert(b.addr, (Some(b.size), b.requested, seg.stream));
            }
        }
    }

    let mut out = Start {
        segments: Vec::new(),
        prelive: prelive.len() as u64,
        inferred: 0,
        ambiguous: 0,
    };
    let mut placed = 0usize;
    for (&addr, &(size, stream, small)) in &segs {
        let end = addr + size;
        let inside: Vec<(u64, Prelive)> = prelive.range(addr..end).map(|(&a, &v)| (a, v)).collect();
        placed += inside.len();
        let mut live = Vec::with_capacity(inside.len());
        for (i, &(a, (bsize, requested, _))) in inside.iter().enumerate() {
            let bsize = match bsize {
                Some(s) => s,
                None => {
                    out.inferred += 1;
                    let rounded = cfg.round_size(requested);
                    let boundary = inside.get(i + 1).map_or(end, |n| n.0);
                    let gap = boundary.checked_sub(a + rounded).ok_or_else(|| {
                        bad(
                            rec,
                            format!(
                                "block {a:#x} ({requested} B asked) overlaps the next live \
                                 block or its segment's end"
                            ),
                        )
                    })?;
                    if !cfg.should_split(small, rounded + gap, rounded) {
                        rounded + gap
                    } else {
                        if !small && gap > SMALL_SIZE + super::MIN_BLOCK_SIZE {
                            out.ambiguous += 1;
                        }
                        rounded
                    }
                }
            };
            live.push((a, bsize, requested));
        }
        out.segments.push(SeedSegment {
            addr,
            size,
            stream,
            small,
            live,
        });
    }
    if placed != prelive.len() {
        return Err(bad(
            rec,
            format!(
                "{} block(s) live at the start lie in no segment of the start",
                prelive.len() - placed
            ),
        ));
    }
    Ok(out)
}

/// Replays `rec` through the port with settings `cfg` from the recorded
/// start; see the [module docs](self). Errors where the recording
/// contradicts itself or cannot be replayed (an expandable recording that
/// does not start empty); a replay that merely disagrees with PyTorch is
/// `Ok` with `matched: false`.
pub fn replay_recording(rec: &Recording, cfg: TorchConfig) -> Result<ValidationRun> {
    let start = start_state(rec, &cfg)?;
    let mut a = if start.segments.is_empty() {
        TorchAllocator::new(cfg)
    } else {
        TorchAllocator::with_segments(cfg, &start.segments)?
    };
    let start_reserved = a.reserved_bytes();
    a.log_segment_events(true);
    a.script_segment_addresses(rec.events.iter().filter_map(|e| {
        (e.action == RecordedAction::Segment(SegmentAction::SegmentAlloc))
            .then_some((e.size, e.addr))
    }));
    let driver_before = a.device.counter.clone();

    // Recorded address -> port address of live blocks.
    let mut addr_of: HashMap<u64, u64> = start
        .segments
        .iter()
        .flat_map(|s| s.live.iter().map(|&(addr, ..)| (addr, addr)))
        .collect();
    let at_completion = rec
        .events
        .iter()
        .any(|e| e.action == RecordedAction::FreeCompleted);
    let mut pending: HashMap<u64, u64> = HashMap::new();
    let (mut port_seg, mut rec_seg): (Vec<Positioned>, Vec<Positioned>) = (vec![], vec![]);
    let mut v = Validation {
        start_reserved_bytes: start_reserved,
        prelive_blocks: start.prelive,
        inferred_block_sizes: start.inferred,
        ambiguous_block_sizes: start.ambiguous,
        ..Default::default()
    };
    let mut first_misplaced: Option<String> = None;
    let mut pos = 0u64;
    let mut in_release_burst = false;
    for (i, ev) in rec.events.iter().enumerate() {
        let releasing = matches!(
            ev.action,
            RecordedAction::Segment(SegmentAction::SegmentFree | SegmentAction::SegmentUnmap)
        );
        match ev.action {
            RecordedAction::Alloc => {
                v.allocs += 1;
                match a.malloc(ev.size, ev.stream) {
                    Ok(p) => {
                        if p == ev.addr {
                            v.allocs_at_recorded_address += 1;
                        } else if first_misplaced.is_none() {
                            first_misplaced = Some(format!(
                                "event {i}: alloc of {} B at {p:#x}, PyTorch at {:#x}",
                                ev.size, ev.addr
                            ));
                        }
                        addr_of.insert(ev.addr, p);
                    }
                    Err(e) if e.is_oom() => v.failed_allocs += 1,
                    Err(e) => return Err(e),
                }
            }
            RecordedAction::FreeRequested => {
                if let Some(p) = addr_of.remove(&ev.addr) {
                    if at_completion {
                        pending.insert(ev.addr, p);
                    } else {
                        a.free(p)?;
                    }
                }
            }
            RecordedAction::FreeCompleted => {
                if let Some(p) = pending.remove(&ev.addr) {
                    a.free(p)?;
                }
            }
            RecordedAction::Segment(action) => {
                rec_seg.push((
                    pos,
                    SegmentEvent {
                        action,
                        addr: ev.addr,
                        size: ev.size,
                        stream: ev.stream,
                    },
                ));
                if releasing && !in_release_burst {
                    a.release_cached_blocks();
                    v.empty_cache_calls += 1;
                }
                if action == SegmentAction::SegmentMap {
                    // Where PyTorch mapped a new expandable segment's first
                    // pages is where it had reserved it.
                    a.hint_next_reservation(ev.addr);
                }
            }
            RecordedAction::Other => {}
        }
        port_seg.extend(a.take_segment_events().into_iter().map(|e| (pos, e)));
        if matches!(
            ev.action,
            RecordedAction::Alloc | RecordedAction::FreeRequested | RecordedAction::FreeCompleted
        ) {
            pos += 1;
            a.clear_reservation_hint();
        }
        in_release_burst = releasing;
    }

    // Verdict.
    let mut reserved = i128::from(start_reserved);
    let mut peak = reserved;
    for (_, e) in &rec_seg {
        reserved += if e.action.grows() { 1 } else { -1 } * i128::from(e.size);
        peak = peak.max(reserved);
    }
    v.recorded_peak_reserved_bytes = u64::try_from(peak).unwrap_or(0);
    v.peak_reserved_bytes = a.peak_reserved_bytes();
    v.recorded_segment_events = rec_seg.len() as u64;
    v.port_segment_events = port_seg.len() as u64;
    let seg_diff = first_segment_difference(&rec_seg, &port_seg);
    v.segment_events_match = seg_diff.is_none();
    let layout_diff = layout_difference(rec, &a);
    v.final_layout_matches = layout_diff.is_none();
    v.driver = a.device.counter.since(&driver_before);
    v.matched = v.failed_allocs == 0
        && v.allocs_at_recorded_address == v.allocs
        && v.segment_events_match
        && v.final_layout_matches
        && v.peak_reserved_bytes == v.recorded_peak_reserved_bytes;
    v.note = note(&v, first_misplaced, seg_diff, layout_diff);
    Ok(ValidationRun {
        allocator: a,
        validation: v,
    })
}

fn note(
    v: &Validation,
    misplaced: Option<String>,
    seg_diff: Option<String>,
    layout_diff: Option<String>,
) -> String {
    let start = if v.start_reserved_bytes == 0 {
        "from an empty allocator".to_string()
    } else {
        format!(
            "from the recorded segments ({} B, {} blocks live, {} sizes inferred)",
            v.start_reserved_bytes, v.prelive_blocks, v.inferred_block_sizes
        )
    };
    if v.matched {
        return format!(
            "matched: {start}, all {} allocations at PyTorch's addresses, {} segment events \
             as recorded, peak reserved {} B as recorded, final segments equal block for block",
            v.allocs, v.recorded_segment_events, v.peak_reserved_bytes
        );
    }
    let mut why = Vec::new();
    if v.failed_allocs > 0 {
        why.push(format!("{} allocations failed", v.failed_allocs));
    }
    if let Some(m) = misplaced {
        why.push(format!(
            "{} of {} allocations at PyTorch's addresses (first other: {m})",
            v.allocs_at_recorded_address, v.allocs
        ));
    }
    if let Some(d) = seg_diff {
        why.push(d);
    }
    if v.peak_reserved_bytes != v.recorded_peak_reserved_bytes {
        why.push(format!(
            "peak reserved {} B against PyTorch's {} B",
            v.peak_reserved_bytes, v.recorded_peak_reserved_bytes
        ));
    }
    if let Some(d) = layout_diff {
        why.push(format!("final layout differs: {d}"));
    }
    if v.ambiguous_block_sizes > 0 {
        why.push(format!(
            "{} sizes of blocks live at the start were ambiguous (freed before the trace \
             allocated their address, with room after them)",
            v.ambiguous_block_sizes
        ));
    }
    format!("not matched ({start}): {}", why.join("; "))
}

fn describe(e: Option<&Positioned>) -> String {
    match e {
        Some((pos, e)) => format!(
            "{} of {} B at {:#x} before block event {pos}",
            e.action.as_str(),
            e.size,
            e.addr
        ),
        None => "none".into(),
    }
}

/// The first difference between two lists of positioned segment events, as
/// a sentence; `None` when they are equal.
pub(crate) fn first_segment_difference(
    recorded: &[Positioned],
    port: &[Positioned],
) -> Option<String> {
    let same = |(pa, a): &Positioned, (pb, b): &Positioned| {
        pa == pb && a.action == b.action && a.size == b.size && a.addr == b.addr
    };
    let i =
        (0..recorded.len().max(port.len())).find(|&i| match (recorded.get(i), port.get(i)) {
            (Some(r), Some(p)) => !same(r, p),
            _ => true,
        })?;
    Some(format!(
        "segment events differ at #{i} of {} recorded / {} by the port: recorded {}, port {}",
        recorded.len(),
        port.len(),
        describe(recorded.get(i)),
        describe(port.get(i))
    ))
}

/// The first difference between the recorded segments at dump time and the
/// port's, as a sentence; `None` when equal block for block.
fn layout_difference(rec: &Recording, a: &TorchAllocator) -> Option<String> {
    let port = a.segments();
    if port.len() != rec.segments.len() {
        return Some(format!(
            "{} segments against PyTorch's {}",
            port.len(),
            rec.segments.len()
        ));
    }
    for (p, r) in port.iter().zip(&rec.segments) {
        if p.addr != r.addr || p.total_size != r.total_size {
            return Some(format!(
                "segment {:#x} of {} B against PyTorch's {:#x} of {} B",
                p.addr, p.total_size, r.addr, r.total_size
            ));
        }
        if p.blocks.len() != r.blocks.len() {
            return Some(format!(
                "segment {:#x}: {} blocks against PyTorch's {}",
                p.addr,
                p.blocks.len(),
                r.blocks.len()
            ));
        }
        for (pb, rb) in p.blocks.iter().zip(&r.blocks) {
            let r_live = rb.state != BlockState::Inactive;
            if pb.addr != rb.addr || pb.size != rb.size || pb.allocated != r_live {
                return Some(format!(
                    "block {:#x} of {} B ({}) against PyTorch's {:#x} of {} B ({:?})",
                    pb.addr,
                    pb.size,
                    if pb.allocated { "allocated" } else { "free" },
                    rb.addr,
                    rb.size,
                    rb.state
                ));
            }
        }
    }
    None
}

#[cfg(test)]
mod tests;
