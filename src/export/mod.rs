//! Exporting pool snapshots: JSON (gpupool's own layout) and a pickle in the
//! layout of PyTorch's `torch.cuda.memory._snapshot()`, which PyTorch's
//! memory viewer (`torch.cuda._memory_viz`, <https://pytorch.org/memory_viz>)
//! opens, and gpupool's trace readers (the tools crate) read back.
//!
//! The pickle is one dict:
//!
//! ```text
//! {"segments": [{"device", "address", "total_size", "allocated_size",
//!                "active_size", "requested_size", "stream", "segment_type",
//!                "segment_pool_id": (0, 0), "is_expandable", "frames": [],
//!                "blocks": [{"address", "size", "requested_size", "state",
//!                            "frames": []}]}],
//!  "device_traces": [[{"action", "addr", "size", "stream", "time_us",
//!                      "frames": []}], ...one list per device index],
//!  "allocator_settings": {}}
//! ```
//!
//! Block states are PyTorch's (`active_allocated`, `active_pending_free`,
//! `inactive`). The history records `alloc` and `free_requested`; each
//! `free_requested` is followed by a `free_completed` at the same time, as
//! PyTorch writes for a free with no other stream to wait for (the viewer
//! draws a block until its `free_completed`). Segments carry stream 0: a
//! gpupool segment is shared by all streams.

use crate::error::Result;
use crate::pool::{BlockState, HistoryAction, Snapshot};
use std::collections::BTreeMap;

pub mod pickle;

pub use pickle::Value;
use std::path::Path;

/// The snapshots as one JSON array of gpupool's own layout (each with
/// `device`, `segments` holding `blocks`, `stats` and `history`).
pub fn snapshot_to_json(snaps: &[Snapshot]) -> String {
    // Serializing plain structs with string keys and finite numbers cannot
    // fail; fall back to an empty array rather than panicking.
    serde_json::to_string(snaps).unwrap_or_else(|_| "[]".to_string())
}

/// The snapshots as a pickle [`Value`] in PyTorch's snapshot layout
/// (see the module docs). `device_traces` has one list per device index up
/// to the highest device among `snaps`.
pub fn snapshot_to_torch(snaps: &[Snapshot]) -> Value {
    let mut segments = Vec::new();
    for snap in snaps {
        for seg in &snap.segments {
            let active: u64 = seg
                .blocks
                .iter()
                .filter(|b| b.state != BlockState::Inactive)
                .map(|b| b.size)
                .sum();
            let blocks = seg
                .blocks
                .iter()
                .map(|b| {
                    dict([
                        ("address", addr(b.address)),
                        ("size", int(b.size)),
                        ("requested_size", int(b.requested_size)),
                        ("state", Value::String(state_name(b.state).into())),
                        ("frames", Value::List(Vec::new())),
                    ])
                })
                .collect();
            segments.push(dict([
                ("device", int(seg.device as u64)),
                ("address", addr(seg.address)),
                ("total_size", int(seg.total_size)),
                ("allocated_size", int(seg.allocated_size)),
                ("active_size", int(active)),
                ("requested_size", int(seg.requested_size)),
                ("stream", int(0)),
                ("segment_type", Value::String(seg.segment_type.into())),
                (
                    "segment_pool_id",
                    Value::Tuple(vec![Value::I64(0), Value::I64(0)]),
                ),
                ("is_expandable", Value::Bool(false)),
                ("frames", Value::List(Vec::new())),
                ("blocks", Value::List(blocks)),
            ]));
        }
    }
    let n_dev = snaps.iter().map(|s| s.device + 1).max().unwrap_or(0);
    let mut traces: Vec<Vec<Value>> = vec![Vec::new(); n_dev];
    for snap in snaps {
        let list = &mut traces[snap.device];
        for e in &snap.history {
            let ev = |action: &str| {
                dict([
                    ("action", Value::String(action.into())),
                    ("addr", addr(e.addr)),
                    ("size", int(e.size)),
                    ("stream", addr(e.stream)),
                    ("time_us", int(e.time_us)),
                    ("frames", Value::List(Vec::new())),
                ])
            };
            match e.action {
                HistoryAction::Alloc => list.push(ev("alloc")),
                HistoryAction::FreeRequested => {
                    list.push(ev("free_requested"));
                    list.push(ev("free_completed"));
                }
            }
        }
    }
    dict([
        ("segments", Value::List(segments)),
        (
            "device_traces",
            Value::List(traces.into_iter().map(Value::List).collect()),
        ),
        ("allocator_settings", Value::Dict(BTreeMap::new())),
    ])
}

/// The snapshots as pickle bytes in PyTorch's snapshot layout; load them
/// with `pickle.load` or open them in PyTorch's memory viewer.
pub fn snapshot_to_pickle(snaps: &[Snapshot]) -> Vec<u8> {
    snapshot_to_torch(snaps).to_pickle()
}

/// Writes [`snapshot_to_pickle`] to `path`.
pub fn write_snapshot_pickle(path: impl AsRef<Path>, snaps: &[Snapshot]) -> Result<()> {
    std::fs::write(path, snapshot_to_pickle(snaps))?;
    Ok(())
}

/// PyTorch's name of a block state.
pub fn state_name(s: BlockState) -> &'static str {
    match s {
        BlockState::ActiveAllocated => "active_allocated",
        BlockState::ActivePendingFree => "active_pending_free",
        BlockState::Inactive => "inactive",
    }
}

fn dict<const N: usize>(items: [(&str, Value); N]) -> Value {
    Value::Dict(items.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
}

/// A size or count (saturates at `i64::MAX`, never reached in practice).
fn int(v: u64) -> Value {
    Value::I64(i64::try_from(v).unwrap_or(i64::MAX))
}

/// An address or handle: its bits as a signed 64-bit integer, as the
/// snapshot reader expects for values at or above 2^63.
fn addr(v: u64) -> Value {
    Value::I64(v as i64)
}
