//! PyTorch CUDA caching-allocator snapshots (`_dump_snapshot` pickles).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use serde_pickle::{DeOptions, HashableValue, Value};

use super::{trace_err, Builder, Skipped, Trace, TraceFormat};
use gpupool::Result;

pub(super) type Dict = BTreeMap<HashableValue, Value>;

/// Actions PyTorch writes that neither allocate nor free.
const PASSIVE_ACTIONS: &[&str] = &[
    "free_completed",
    "segment_alloc",
    "segment_free",
    "segment_map",
    "segment_unmap",
    "snapshot",
    "oom",
    "user_defined",
];

/// One event of `device_traces[d]`, reduced to what replay needs.
struct Ev<'a> {
    action: &'a str,
    addr: u64,
    size: u64,
    stream: u64,
}

/// One `active*` block of `segments`, live at dump time.
struct ActiveBlock {
    addr: u64,
    size: u64,
    stream: u64,
}

/// Per-device data gathered from the pickle.
#[derive(Default)]
struct Device<'a> {
    events: Vec<Ev<'a>>,
    active: Vec<ActiveBlock>,
    total_size: u64,
}

pub(super) fn parse(file: &str, base: &str, bytes: &[u8]) -> Result<Vec<Trace>> {
    let root = serde_pickle::value_from_slice(bytes, DeOptions::new().replace_unresolved_globals())
        .map_err(|e| trace_err(file, format!("truncated or malformed pickle: {e}")))?;
    let root = as_dict(&root).ok_or_else(|| {
        trace_err(
            file,
            "snapshot is not a dict (expected `segments` and `device_traces`)",
        )
    })?;

    let mut devices: BTreeMap<usize, Device<'_>> = BTreeMap::new();

    if let Some(traces) = get(root, "device_traces") {
        let traces =
            as_list(traces).ok_or_else(|| trace_err(file, "`device_traces` is not a list"))?;
        for (d, list) in traces.iter().enumerate() {
            let list = as_list(list)
                .ok_or_else(|| trace_err(file, format!("`device_traces[{d}]` is not a list")))?;
            if list.is_empty() {
                continue;
            }
            let dev = devices.entry(d).or_default();
            dev.events.reserve(list.len());
            for (i, ev) in list.iter().enumerate() {
                dev.events.push(read_event(file, d, i, ev)?);
            }
        }
    }

    if let Some(segments) = get(root, "segments") {
        let segments =
            as_list(segments).ok_or_else(|| trace_err(file, "`segments` is not a list"))?;
        for (s, seg) in segments.iter().enumerate() {
            read_segment(file, s, seg, &mut devices)?;
        }
    }

    if devices.is_empty() {
        if get(root, "device_traces").is_none() && get(root, "segments").is_none() {
            return Err(trace_err(
                file,
                "not a memory snapshot: neither `device_traces` nor `segments` present",
            ));
        }
        devices.insert(0, Device::default());
    }

    let has_segments = get(root, "segments").is_some();
    let several = devices.len() > 1;
    devices
        .into_iter()
        .map(|(d, dev)| {
            let name = if several {
                format!("{base}#dev{d}")
            } else {
                base.to_owned()
            };
            build(file, d, name, dev, has_segments)
        })
        .collect()
}

fn read_event<'a>(file: &str, d: usize, i: usize, ev: &'a Value) -> Result<Ev<'a>> {
    let at = |msg: String| trace_err(file, format!("device_traces[{d}] event {i}: {msg}"));
    let dict = as_dict(ev).ok_or_else(|| at("not a dict".into()))?;
    let action = match get(dict, "action") {
        Some(Value::String(s)) => s.as_str(),
        Some(_) => return Err(at("`action` is not a string".into())),
        None => return Err(at("no `action`".into())),
    };
    if action != "alloc" && action != "free_requested" && !PASSIVE_ACTIONS.contains(&action) {
        return Err(at(format!("unknown action `{action}`")));
    }
    let int = |key: &str, signed_ok: bool| -> Result<u64> {
        match get(dict, key) {
            None | Some(Value::None) => Ok(0),
            Some(v) => int_field(v, signed_ok).map_err(|m| at(format!("`{key}` {m}"))),
        }
    };
    let size = int("size", false)?;
    let addr = int("addr", true)?;
    let stream = int("stream", true)?;
    if (action == "alloc" || action == "free_requested") && get(dict, "addr").is_none() {
        return Err(at(format!("`{action}` without `addr`")));
    }
    Ok(Ev {
        action,
        addr,
        size,
        stream,
    })
}

fn read_segment(
    file: &str,
    s: usize,
    seg: &Value,
    devices: &mut BTreeMap<usize, Device<'_>>,
) -> Result<()> {
    let at = |msg: String| trace_err(file, format!("segments[{s}]: {msg}"));
    let seg = as_dict(seg).ok_or_else(|| at("not a dict".into()))?;
    let num = |d: &Dict, key: &str, signed_ok: bool| -> Result<Option<u64>> {
        match get(d, key) {
            None | Some(Value::None) => Ok(None),
            Some(v) => int_field(v, signed_ok)
                .map(Some)
                .map_err(|m| at(format!("`{key}` {m}"))),
        }
    };
    let device = num(seg, "device", false)?.unwrap_or(0) as usize;
    let total = num(seg, "total_size", false)?.ok_or_else(|| at("no `total_size`".into()))?;
    let stream = num(seg, "stream", true)?.unwrap_or(0);
    let dev = devices.entry(device).or_default();
    dev.total_size += total;
    let Some(blocks) = get(seg, "blocks") else {
        return Ok(());
    };
    let blocks = as_list(blocks).ok_or_else(|| at("`blocks` is not a list".into()))?;
    for (b, block) in blocks.iter().enumerate() {
        let at_b = |msg: String| at(format!("block {b}: {msg}"));
        let block = as_dict(block).ok_or_else(|| at_b("not a dict".into()))?;
        let active = match get(block, "state") {
            Some(Value::String(st)) => st.starts_with("active"),
            _ => return Err(at_b("no `state` string".into())),
        };
        if !active {
            continue;
        }
        let num_b = |key: &str, signed_ok: bool| -> Result<Option<u64>> {
            match get(block, key) {
                None | Some(Value::None) => Ok(None),
                Some(v) => int_field(v, signed_ok)
                    .map(Some)
                    .map_err(|m| at_b(format!("`{key}` {m}"))),
            }
        };
        let addr = num_b("address", true)?.ok_or_else(|| at_b("no `address`".into()))?;
        let size = match num_b("requested_size", false)? {
            Some(s) => s,
            None => num_b("size", false)?.ok_or_else(|| at_b("no `requested_size`".into()))?,
        };
        dev.active.push(ActiveBlock { addr, size, stream });
    }
    Ok(())
}

/// Replays one device's events into a [`Trace`] following the rule of
/// `traces/README.md`. `has_segments`: whether the snapshot has a `segments`
/// list (which gives the reserved bytes at dump time).
fn build(file: &str, d: usize, name: String, dev: Device<'_>, has_segments: bool) -> Result<Trace> {
    let at =
        |i: usize, msg: String| trace_err(file, format!("device_traces[{d}] event {i}: {msg}"));

    // Pass 1: which addresses are ever allocated, and which frees name a
    // block live before recording (rule 1).
    let mut allocated: BTreeSet<u64> = BTreeSet::new();
    let mut prelive_frees: Vec<usize> = Vec::new();
    for (i, ev) in dev.events.iter().enumerate() {
        match ev.action {
            "alloc" => {
                allocated.insert(ev.addr);
            }
            "free_requested" if !allocated.contains(&ev.addr) => {
                // Only the first such free of an address is a pre-live block;
                // a second one is a double free, reported in pass 2.
                allocated.insert(ev.addr);
                prelive_frees.push(i);
            }
            _ => {}
        }
    }
    let allocated_by_event: BTreeSet<u64> = dev
        .events
        .iter()
        .filter(|e| e.action == "alloc")
        .map(|e| e.addr)
        .collect();

    let mut b = Builder::new();
    let mut skipped = Skipped::default();
    // Address -> live block: Some(id), or None for a dropped zero-size block.
    let mut live: HashMap<u64, Option<u64>> = HashMap::new();

    // Rule 1: blocks freed before any alloc of their address.
    for &i in &prelive_frees {
        let ev = &dev.events[i];
        let id = if ev.size == 0 {
            skipped.zero_size += 1;
            None
        } else {
            Some(b.alloc(ev.size, ev.stream))
        };
        live.insert(ev.addr, id);
    }
    // Rule 2: blocks active at dump time whose address no alloc event names.
    for blk in &dev.active {
        if allocated_by_event.contains(&blk.addr) {
            continue;
        }
        if blk.size == 0 {
            skipped.zero_size += 1;
        } else {
            b.alloc(blk.size, blk.stream);
        }
    }

    // The events, in order; reserved bytes relative to the start.
    let mut reserved: i128 = 0;
    let mut reserved_min: i128 = 0;
    let mut reserved_max: i128 = 0;
    for (i, ev) in dev.events.iter().enumerate() {
        match ev.action {
            "alloc" => {
                if let Some(Some(_)) = live.get(&ev.addr) {
                    return Err(at(
                        i,
                        format!("alloc of address {:#x}, which is already live", ev.addr),
                    ));
                }
                let id = if ev.size == 0 {
                    skipped.zero_size += 1;
                    None
                } else {
                    Some(b.alloc(ev.size, ev.stream))
                };
                live.insert(ev.addr, id);
            }
            "free_requested" => match live.remove(&ev.addr) {
                Some(Some(id)) => b.free(id, ev.stream),
                Some(None) => {}
                None => {
                    return Err(at(
                        i,
                        format!(
                            "free_requested of address {:#x}, which is not live",
                            ev.addr
                        ),
                    ))
                }
            },
            "segment_alloc" | "segment_map" => reserved += i128::from(ev.size),
            "segment_free" | "segment_unmap" => reserved -= i128::from(ev.size),
            _ => {}
        }
        reserved_min = reserved_min.min(reserved);
        reserved_max = reserved_max.max(reserved);
    }

    // Without `segments` the snapshot does not say what was reserved.
    let baseline = if has_segments {
        // reserved at the end is the sum of total_size, so at the start it is
        // total - reserved (relative); the peak is start + reserved_max.
        let start = i128::from(dev.total_size) - reserved;
        if start + reserved_min < 0 {
            return Err(trace_err(
                file,
                format!(
                    "device {d}: segment events do not match `segments` (reserved bytes would \
                     go negative: {} B at the end, {} B net segment growth)",
                    dev.total_size, reserved
                ),
            ));
        }
        Some(u64::try_from(start + reserved_max).unwrap_or(u64::MAX))
    } else {
        None
    };

    Ok(Trace {
        name,
        format: TraceFormat::TorchSnapshot,
        events: b.events,
        baseline_peak_reserved: baseline,
        skipped,
    })
}

pub(super) fn as_dict(v: &Value) -> Option<&Dict> {
    match v {
        Value::Dict(d) => Some(d),
        _ => None,
    }
}

pub(super) fn as_list(v: &Value) -> Option<&[Value]> {
    match v {
        Value::List(l) | Value::Tuple(l) => Some(l),
        _ => None,
    }
}

/// Looks up a string key. Dicts here have a handful of keys, so a scan beats
/// building a `HashableValue` per lookup.
pub(super) fn get<'a>(d: &'a Dict, key: &str) -> Option<&'a Value> {
    d.iter().find_map(|(k, v)| match k {
        HashableValue::String(s) if s == key => Some(v),
        _ => None,
    })
}

/// An integer field as u64. Negative values are an error unless `signed_ok`
/// (addresses and stream ids, kept as their two's-complement bits).
pub(super) fn int_field(v: &Value, signed_ok: bool) -> std::result::Result<u64, String> {
    match v {
        Value::I64(n) if *n >= 0 => Ok(*n as u64),
        Value::I64(n) if signed_ok => Ok(*n as u64),
        Value::I64(n) => Err(format!("is negative ({n})")),
        Value::Int(big) => match u64::try_from(big) {
            Ok(n) => Ok(n),
            Err(_) if signed_ok => i64::try_from(big)
                .map(|n| n as u64)
                .map_err(|_| format!("is out of range ({big})")),
            Err(_) if big.to_string().starts_with('-') => Err(format!("is negative ({big})")),
            Err(_) => Err(format!("is out of range ({big})")),
        },
        Value::Bool(b) => Ok(u64::from(*b)),
        other => Err(format!("is not an integer ({})", kind(other))),
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::None => "None",
        Value::Bool(_) => "bool",
        Value::I64(_) | Value::Int(_) => "int",
        Value::F64(_) => "float",
        Value::Bytes(_) => "bytes",
        Value::String(_) => "str",
        Value::List(_) => "list",
        Value::Tuple(_) => "tuple",
        Value::Set(_) => "set",
        Value::FrozenSet(_) => "frozenset",
        Value::Dict(_) => "dict",
    }
}
