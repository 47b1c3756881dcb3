//! What a PyTorch snapshot recorded, as the port needs it to check itself:
//! the allocator's settings, the segments at dump time with every block
//! (address, size, state), and the event list with addresses — unlike the
//! format-neutral [`Trace`](crate::trace::Trace), which keeps only sizes
//! and block ids.
//!
//! Invariants:
//! - One [`Recording`] per device that has events or segments, in device
//!   order, named as [`crate::trace::read_file_all`] names that device's
//!   trace (`<file>` or `<file>#dev<N>`), so the two pair up by name.
//! - `events` are `device_traces[d]` in order, every action kept (the
//!   passive ones too); `segments` are those of device `d`, by address.

use std::collections::BTreeMap;
use std::path::Path;

use serde_pickle::{DeOptions, HashableValue, Value};

use super::super::torch::{as_dict, as_list, get, int_field, Dict};
use super::super::{trace_err, trace_name};
use super::torch::SegmentAction;
use super::{TorchConfig, ROUNDUP_INTERVALS};
use gpupool::Result;

/// The state of a recorded block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BlockState {
    /// `active_allocated`: handed out.
    ActiveAllocated,
    /// `active_pending_free`: freed, waiting for other streams' events.
    ActivePendingFree,
    /// `inactive`: free in the cache.
    Inactive,
}

/// One block of a recorded segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordedBlock {
    /// Address.
    pub addr: u64,
    /// Bytes (rounded).
    pub size: u64,
    /// Bytes asked for.
    pub requested: u64,
    /// State at dump time.
    pub state: BlockState,
}

/// One recorded segment (for expandable segments: one mapped range).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordedSegment {
    /// Start address.
    pub addr: u64,
    /// Bytes.
    pub total_size: u64,
    /// Stream.
    pub stream: u64,
    /// `segment_type == "small"` (None where the snapshot does not say).
    pub small: Option<bool>,
    /// `is_expandable`.
    pub expandable: bool,
    /// Blocks in address order.
    pub blocks: Vec<RecordedBlock>,
}

/// What a recorded event did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordedAction {
    /// `alloc`.
    Alloc,
    /// `free_requested`: the program let go of the block.
    FreeRequested,
    /// `free_completed`: the block went back to the cache.
    FreeCompleted,
    /// `segment_alloc`, `segment_free`, `segment_map`, `segment_unmap`.
    Segment(SegmentAction),
    /// `snapshot`, `oom`, `user_defined`: nothing for the allocator.
    Other,
}

/// One event of `device_traces[d]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordedEvent {
    /// What happened.
    pub action: RecordedAction,
    /// Address (0 where the event has none).
    pub addr: u64,
    /// Bytes (requested bytes for block events).
    pub size: u64,
    /// Stream.
    pub stream: u64,
}

/// The allocator settings a snapshot records (`allocator_settings`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RecordedSettings {
    /// `expandable_segments`.
    pub expandable_segments: Option<bool>,
    /// `max_split_size` in bytes (None: unlimited, recorded as -1, or not
    /// recorded).
    pub max_split_size: Option<u64>,
    /// `garbage_collection_threshold`.
    pub garbage_collection_threshold: f64,
    /// `roundup_power2_divisions` per interval.
    pub roundup_power2_divisions: Option<[u64; ROUNDUP_INTERVALS]>,
}

impl RecordedSettings {
    /// `cfg` with the recorded settings that change placement (the mode is
    /// left to the caller).
    pub fn apply(&self, cfg: &mut TorchConfig) {
        if let Some(m) = self.max_split_size {
            cfg.max_split_size = m;
        }
        cfg.garbage_collection_threshold = self.garbage_collection_threshold;
        if let Some(d) = self.roundup_power2_divisions {
            cfg.roundup_power2_divisions = d;
        }
    }
}

/// One device of a snapshot; see the [module docs](self).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Recording {
    /// The name of the device's [`crate::trace::Trace`].
    pub name: String,
    /// Device index.
    pub device: usize,
    /// Settings.
    pub settings: RecordedSettings,
    /// Segments at dump time, by address.
    pub segments: Vec<RecordedSegment>,
    /// Events in order.
    pub events: Vec<RecordedEvent>,
}

impl Recording {
    /// Whether any segment or segment event is expandable.
    pub fn expandable(&self) -> bool {
        self.settings.expandable_segments.unwrap_or(false)
            || self.segments.iter().any(|s| s.expandable)
            || self.events.iter().any(|e| {
                matches!(
                    e.action,
                    RecordedAction::Segment(
                        SegmentAction::SegmentMap | SegmentAction::SegmentUnmap
                    )
                )
            })
    }
}

/// Reads the recordings of a snapshot file (see [`parse_recordings`]).
pub fn read_recordings(path: impl AsRef<Path>) -> Result<Vec<Recording>> {
    let path = path.as_ref();
    let shown = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|e| trace_err(&shown, format!("cannot read: {e}")))?;
    let file_name = path
        .file_name()
        .map_or_else(|| shown.clone(), |n| n.to_string_lossy().into_owned());
    parse_inner(&shown, &file_name, &bytes)
}

/// Parses a snapshot pickle into one [`Recording`] per device. `name` names
/// the file in errors and the recordings.
pub fn parse_recordings(name: &str, bytes: &[u8]) -> Result<Vec<Recording>> {
    parse_inner(name, name, bytes)
}

fn parse_inner(file: &str, file_name: &str, bytes: &[u8]) -> Result<Vec<Recording>> {
    let root = serde_pickle::value_from_slice(bytes, DeOptions::new().replace_unresolved_globals())
        .map_err(|e| trace_err(file, format!("truncated or malformed pickle: {e}")))?;
    let root = as_dict(&root).ok_or_else(|| trace_err(file, "snapshot is not a dict"))?;
    let settings = read_settings(file, root)?;
    let mut devices: BTreeMap<usize, Recording> = BTreeMap::new();
    if let Some(traces) = get(root, "device_traces") {
        let traces =
            as_list(traces).ok_or_else(|| trace_err(file, "`device_traces` is not a list"))?;
        for (d, list) in traces.iter().enumerate() {
            let list = as_list(list)
                .ok_or_else(|| trace_err(file, format!("`device_traces[{d}]` is not a list")))?;
            if list.is_empty() {
                continue;
            }
            let rec = devices.entry(d).or_default();
            for (i, ev) in list.iter().enumerate() {
                rec.events.push(read_event(file, d, i, ev)?);
            }
        }
    }
    if let Some(segments) = get(root, "segments") {
        let segments =
            as_list(segments).ok_or_else(|| trace_err(file, "`segments` is not a list"))?;
        for (s, seg) in segments.iter().enumerate() {
            let (d, seg) = read_segment(file, s, seg)?;
            devices.entry(d).or_default().segments.push(seg);
        }
    }
    if devices.is_empty() {
        devices.insert(0, Recording::default());
    }
    let base = trace_name(file_name);
    let several = devices.len() > 1;
    Ok(devices
        .into_iter()
        .map(|(d, mut rec)| {
            rec.device = d;
            rec.name = if several {
                format!("{base}#dev{d}")
            } else {
                base.clone()
            };
            rec.settings = settings.clone();
            rec.segments.sort_by_key(|s| s.addr);
            rec
        })
        .collect())
}

fn num(d: &Dict, key: &str, signed_ok: bool) -> std::result::Result<Option<u64>, String> {
    match get(d, key) {
        None | Some(Value::None) => Ok(None),
        Some(v) => int_field(v, signed_ok)
            .map(Some)
            .map_err(|m| format!("`{key}` {m}")),
    }
}

fn read_settings(file: &str, root: &Dict) -> Result<RecordedSettings> {
    let mut s = RecordedSettings::default();
    let Some(d) = get(root, "allocator_settings").and_then(as_dict) else {
        return Ok(s);
    };
    let at = |m: String| trace_err(file, format!("allocator_settings: {m}"));
    if let Some(Value::Bool(b)) = get(d, "expandable_segments") {
        s.expandable_segments = Some(*b);
    }
    s.max_split_size = match get(d, "max_split_size") {
        Some(Value::I64(n)) if *n < 0 => None,
        Some(v) => Some(int_field(v, false).map_err(|m| at(format!("`max_split_size` {m}")))?),
        None => None,
    };
    s.garbage_collection_threshold = match get(d, "garbage_collection_threshold") {
        Some(Value::F64(f)) => *f,
        Some(v) => int_field(v, false).map_err(at)? as f64,
        None => 0.0,
    };
    match get(d, "roundup_power2_divisions") {
        Some(Value::Dict(m)) => {
            // Keys are the interval starts in MiB: "1", "2", ... "32768".
            let mut div = [0u64; ROUNDUP_INTERVALS];
            for (k, v) in m {
                let mib = match k {
                    HashableValue::String(s) => s.parse::<u64>().ok(),
                    HashableValue::I64(n) => u64::try_from(*n).ok(),
                    _ => None,
                }
                .filter(|m| m.is_power_of_two())
                .ok_or_else(|| at(format!("roundup_power2_divisions key {k:?}")))?;
                let i = (mib.ilog2() as usize).min(ROUNDUP_INTERVALS - 1);
                div[i] = int_field(v, false).map_err(at)?;
            }
            s.roundup_power2_divisions = Some(div);
        }
        Some(Value::List(l)) => {
            let mut div = [0u64; ROUNDUP_INTERVALS];
            for (i, v) in l.iter().take(ROUNDUP_INTERVALS).enumerate() {
                div[i] = int_field(v, false).map_err(at)?;
            }
            s.roundup_power2_divisions = Some(div);
        }
        _ => {}
    }
    Ok(s)
}

fn read_event(file: &str, d: usize, i: usize, ev: &Value) -> Result<RecordedEvent> {
    let at = |msg: String| trace_err(file, format!("device_traces[{d}] event {i}: {msg}"));
    let dict = as_dict(ev).ok_or_else(|| at("not a dict".into()))?;
    let action = match get(dict, "action") {
        Some(Value::String(s)) => s.as_str(),
        _ => return Err(at("no `action` string".into())),
    };
    let action = match action {
        "alloc" => RecordedAction::Alloc,
        "free_requested" => RecordedAction::FreeRequested,
        "free_completed" => RecordedAction::FreeCompleted,
        "snapshot" | "oom" | "user_defined" => RecordedAction::Other,
        other => RecordedAction::Segment(
            SegmentAction::parse(other).ok_or_else(|| at(format!("unknown action `{other}`")))?,
        ),
    };
    Ok(RecordedEvent {
        action,
        addr: num(dict, "addr", true).map_err(at)?.unwrap_or(0),
        size: num(dict, "size", false).map_err(at)?.unwrap_or(0),
        stream: num(dict, "stream", true).map_err(at)?.unwrap_or(0),
    })
}

fn read_segment(file: &str, s: usize, seg: &Value) -> Result<(usize, RecordedSegment)> {
    let at = |msg: String| trace_err(file, format!("segments[{s}]: {msg}"));
    let seg = as_dict(seg).ok_or_else(|| at("not a dict".into()))?;
    let device = num(seg, "device", false).map_err(at)?.unwrap_or(0) as usize;
    let total_size = num(seg, "total_size", false)
        .map_err(at)?
        .ok_or_else(|| at("no `total_size`".into()))?;
    let small = match get(seg, "segment_type") {
        Some(Value::String(t)) => Some(t == "small"),
        _ => match get(seg, "is_large") {
            Some(Value::Bool(l)) => Some(!l),
            _ => None,
        },
    };
    let mut out = RecordedSegment {
        addr: num(seg, "address", true).map_err(at)?.unwrap_or(0),
        total_size,
        stream: num(seg, "stream", true).map_err(at)?.unwrap_or(0),
        small,
        expandable: matches!(get(seg, "is_expandable"), Some(Value::Bool(true))),
        blocks: Vec::new(),
    };
    if let Some(blocks) = get(seg, "blocks") {
        let blocks = as_list(blocks).ok_or_else(|| at("`blocks` is not a list".into()))?;
        let mut next_addr = out.addr;
        for (b, block) in blocks.iter().enumerate() {
            let at_b = |m: String| at(format!("block {b}: {m}"));
            let block = as_dict(block).ok_or_else(|| at_b("not a dict".into()))?;
            let size = num(block, "size", false)
                .map_err(at_b)?
                .ok_or_else(|| at_b("no `size`".into()))?;
            // Older snapshots leave out block addresses: blocks tile the
            // segment in order.
            let addr = num(block, "address", true)
                .map_err(at_b)?
                .unwrap_or(next_addr);
            next_addr = addr + size;
            let state = match get(block, "state") {
                Some(Value::String(st)) if st == "active_allocated" => BlockState::ActiveAllocated,
                Some(Value::String(st)) if st == "active_pending_free" => {
                    BlockState::ActivePendingFree
                }
                Some(Value::String(st)) if st == "inactive" => BlockState::Inactive,
                _ => return Err(at_b("no known `state`".into())),
            };
            out.blocks.push(RecordedBlock {
                addr,
                size,
                requested: num(block, "requested_size", false)
                    .map_err(at_b)?
                    .unwrap_or(size),
                state,
            });
        }
    }
    Ok((device, out))
}
