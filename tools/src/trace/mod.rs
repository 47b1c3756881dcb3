//! Allocation traces: a format-neutral event model, readers for the three
//! trace formats of `../shared/traces`, and a writer for RMM logs.
//!
//! # Event model
//!
//! A [`Trace`] is an ordered list of [`TraceEvent`]s. Every allocation gets a
//! dense, trace-local block id: the `k`-th [`TraceEvent::Alloc`] of a trace
//! produced by a reader carries `id == k`, so ids run `0..trace.allocs()` and
//! a replayer can keep a `Vec` indexed by id (no address hashing at replay
//! time). A [`TraceEvent::Free`] names the id of a block allocated earlier and
//! not yet freed. Blocks still live at the end are simply never freed.
//! [`Trace::validate`] checks these rules for traces built by hand.
//!
//! # Formats
//!
//! [`parse`] and [`read_file`] detect the format from the content:
//!
//! - **PyTorch snapshot** ([`TraceFormat::TorchSnapshot`]): a pickle (first
//!   byte `0x80`, or a `.pickle`/`.pkl` name) written by
//!   `torch.cuda.memory._dump_snapshot()`. Replay rule of
//!   `traces/README.md`: blocks live before recording (a `free_requested` of
//!   an address with no earlier `alloc`; an `active*` block of `segments`
//!   whose address no `alloc` event names, sized by `requested_size`) are
//!   allocated first, then `alloc` allocates and `free_requested` frees.
//!   `free_completed`, `segment_*`, `snapshot`, `oom` and `user_defined`
//!   events neither allocate nor free; any other action is an error. The
//!   original allocator's peak reserved bytes
//!   ([`Trace::baseline_peak_reserved`]) are the sum of the device's
//!   `segments[*].total_size`, walked backwards through `segment_alloc` /
//!   `segment_map` (reserved grows) and `segment_free` / `segment_unmap`
//!   (reserved shrinks) events; the figure is the maximum along the trace.
//!   **Devices:** one [`Trace`] per device that has events or segments
//!   ([`parse_all`]); when there are several they are named
//!   `<name>#dev<N>`, and [`parse`] returns the one with the most events
//!   (lowest device on ties). The four snapshots in `../shared/traces` only
//!   use device 0.
//! - **RMM log** ([`TraceFormat::RmmLog`]): the CSV written by RMM's
//!   `logging_resource_adaptor`, `Thread,Time,Action,Pointer,Size,Stream`
//!   (header optional). Actions `allocate`, `free` / `deallocate`, and
//!   `allocate failure` (skipped, counted in [`Skipped::alloc_failures`]).
//!   Time is `HH:MM:SS.ffffff` or decimal seconds (checked, not kept: the
//!   file order is the event order). Pointer and Stream are hex, with or
//!   without `0x` (`(nil)` reads as 0). A free of a pointer that is not live
//!   is an error.
//! - **Lifetimes** ([`TraceFormat::Lifetimes`]): CSV `id,lower,upper,size`
//!   with an optional fifth `offset` column (checked, not kept) and an
//!   optional `id,...` header line. A buffer is live on `[lower, upper)`;
//!   events are sorted by time with frees before allocations at equal times,
//!   file order breaking ties. A buffer with `lower == upper` is never live
//!   and is dropped (counted in [`Skipped::empty_lifetimes`]); `lower >
//!   upper` is an error.
//!
//! **Zero-size blocks** are dropped by every reader, together with their
//! frees, and counted in [`Skipped::zero_size`]: the pool refuses size 0, so
//! a replayer could not allocate them anyway, and they hold no bytes.
//!
//! Every malformed input yields [`Error::Trace`] naming the file and the
//! line (CSV, 1-based) or event index (snapshot, 0-based into
//! `device_traces[d]`).

use std::fmt;
use std::path::Path;

use gpupool::{Error, Result};

mod lifetimes;
pub mod peers;
pub mod plot;
pub mod record;
pub mod replay;
mod rmm;
mod torch;

pub use rmm::write_rmm_log;

/// The non-empty lines of a CSV text: `(1-based line number, trimmed line,
/// trimmed comma-separated fields)`.
fn csv_rows(text: &str) -> impl Iterator<Item = (usize, &str, Vec<&str>)> {
    text.lines().enumerate().filter_map(|(idx, raw)| {
        let raw = raw.trim();
        (!raw.is_empty()).then(|| (idx + 1, raw, raw.split(',').map(str::trim).collect()))
    })
}

/// The file format a [`Trace`] was read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TraceFormat {
    /// A PyTorch CUDA caching-allocator snapshot (pickle).
    TorchSnapshot,
    /// An RMM `logging_resource_adaptor` CSV log.
    RmmLog,
    /// A buffer-lifetimes CSV (`id,lower,upper,size[,offset]`).
    Lifetimes,
}

impl TraceFormat {
    /// The format's name in reports: `torch-snapshot`, `rmm-log` or
    /// `lifetimes`.
    pub fn as_str(self) -> &'static str {
        match self {
            TraceFormat::TorchSnapshot => "torch-snapshot",
            TraceFormat::RmmLog => "rmm-log",
            TraceFormat::Lifetimes => "lifetimes",
        }
    }
}

impl fmt::Display for TraceFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One allocation or free, in replay order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TraceEvent {
    /// Allocate block `id` of `size` bytes (the requested size) on `stream`.
    Alloc {
        /// Dense trace-local block id.
        id: u64,
        /// Requested bytes (never 0 in traces built by the readers).
        size: u64,
        /// Stream the block is allocated on, as recorded (0 when the format
        /// has no streams).
        stream: u64,
    },
    /// Free block `id`, allocated earlier, on `stream`.
    Free {
        /// Dense trace-local block id.
        id: u64,
        /// Stream the free is ordered on, as recorded.
        stream: u64,
    },
}

impl TraceEvent {
    /// The block id the event names.
    pub fn id(&self) -> u64 {
        match *self {
            TraceEvent::Alloc { id, .. } | TraceEvent::Free { id, .. } => id,
        }
    }

    /// The stream the event names.
    pub fn stream(&self) -> u64 {
        match *self {
            TraceEvent::Alloc { stream, .. } | TraceEvent::Free { stream, .. } => stream,
        }
    }

    /// Whether this is an [`TraceEvent::Alloc`].
    pub fn is_alloc(&self) -> bool {
        matches!(self, TraceEvent::Alloc { .. })
    }
}

/// What a reader dropped, and why. None of these appear in
/// [`Trace::events`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Skipped {
    /// `allocate failure` lines of an RMM log.
    pub alloc_failures: u64,
    /// Zero-size allocations (their frees are dropped too).
    pub zero_size: u64,
    /// Lifetimes buffers with `lower == upper` (never live).
    pub empty_lifetimes: u64,
}

impl Skipped {
    /// Total number of dropped records.
    pub fn total(&self) -> u64 {
        self.alloc_failures + self.zero_size + self.empty_lifetimes
    }
}

/// A trace in the format-neutral event model. See the [module
/// docs](self) for the rules every reader follows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Trace {
    /// Name for reports: the file name without directories and without a
    /// `.pickle`/`.pkl`/`.csv`/`.log` extension, plus `#dev<N>` for a
    /// snapshot with several devices.
    pub name: String,
    /// Format the trace was read from.
    pub format: TraceFormat,
    /// Events in replay order.
    pub events: Vec<TraceEvent>,
    /// Peak reserved bytes of the allocator that recorded the trace, where
    /// the format carries it (PyTorch snapshots only).
    pub baseline_peak_reserved: Option<u64>,
    /// Records the reader dropped.
    pub skipped: Skipped,
}

impl Trace {
    /// An empty trace with no baseline and nothing skipped.
    pub fn new(name: impl Into<String>, format: TraceFormat) -> Self {
        Trace {
            name: name.into(),
            format,
            events: Vec::new(),
            baseline_peak_reserved: None,
            skipped: Skipped::default(),
        }
    }

    /// Number of [`TraceEvent::Alloc`] events (for reader-built traces, also
    /// the number of block ids).
    pub fn allocs(&self) -> usize {
        self.events.iter().filter(|e| e.is_alloc()).count()
    }

    /// Number of [`TraceEvent::Free`] events.
    pub fn frees(&self) -> usize {
        self.events.len() - self.allocs()
    }

    /// One past the largest block id used (0 for an empty trace): the length
    /// of a `Vec` indexed by id.
    pub fn id_bound(&self) -> usize {
        self.events
            .iter()
            .map(|e| (e.id() as usize).saturating_add(1))
            .max()
            .unwrap_or(0)
    }

    /// Peak live bytes: the maximum, over the event sequence, of the sum of
    /// the sizes of allocated and not yet freed blocks. Frees of ids never
    /// allocated count as 0 bytes. Uses a `Vec` of [`Trace::id_bound`]
    /// entries, so ids must be dense (as readers make them; see
    /// [`Trace::validate`] for hand-built traces).
    pub fn peak_live_bytes(&self) -> u64 {
        let mut sizes = vec![0u64; self.id_bound()];
        let (mut live, mut peak) = (0u64, 0u64);
        for ev in &self.events {
            match *ev {
                TraceEvent::Alloc { id, size, .. } => {
                    sizes[id as usize] = size;
                    live += size;
                    peak = peak.max(live);
                }
                TraceEvent::Free { id, .. } => {
                    live -= std::mem::take(&mut sizes[id as usize]);
                }
            }
        }
        peak
    }

    /// Checks the event-model rules: each id is allocated at most once, a
    /// free names a live block, and ids are dense (`0..allocs()`). Readers
    /// always produce valid traces; this is for traces built by hand (for
    /// example recorded from a live pool).
    pub fn validate(&self) -> Result<()> {
        let n = self.allocs();
        // 0 = never allocated, 1 = live, 2 = freed.
        let mut state = vec![0u8; n];
        for (i, ev) in self.events.iter().enumerate() {
            let id = ev.id();
            let slot = usize::try_from(id)
                .ok()
                .and_then(|k| state.get_mut(k))
                .ok_or_else(|| {
                    trace_err(
                        &self.name,
                        format!(
                            "event {i}: block id {id} is not below the number of allocations {n}"
                        ),
                    )
                })?;
            match (ev, *slot) {
                (TraceEvent::Alloc { .. }, 0) => *slot = 1,
                (TraceEvent::Alloc { .. }, _) => {
                    return Err(trace_err(
                        &self.name,
                        format!("event {i}: block id {id} allocated twice"),
                    ))
                }
                (TraceEvent::Free { .. }, 1) => *slot = 2,
                (TraceEvent::Free { .. }, s) => {
                    let why = if s == 0 {
                        "before its allocation"
                    } else {
                        "twice"
                    };
                    return Err(trace_err(
                        &self.name,
                        format!("event {i}: block id {id} freed {why}"),
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Builds the [`Error::Trace`] every reader returns.
pub(crate) fn trace_err(file: &str, msg: impl Into<String>) -> Error {
    Error::Trace {
        file: file.to_owned(),
        msg: msg.into(),
    }
}

/// Reads a trace file, detecting its format (see the [module docs](self)).
/// For a snapshot with several devices this is the device with the most
/// events; [`read_file_all`] returns them all. Errors name the path.
pub fn read_file(path: impl AsRef<Path>) -> Result<Trace> {
    let mut all = read_file_all(path)?;
    Ok(all.swap_remove(busiest(&all)))
}

/// Reads a trace file into one [`Trace`] per device (one in all, except for
/// snapshots with several devices). Errors name the path.
pub fn read_file_all(path: impl AsRef<Path>) -> Result<Vec<Trace>> {
    let path = path.as_ref();
    let shown = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|e| trace_err(&shown, format!("cannot read: {e}")))?;
    let file_name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| shown.clone());
    parse_inner(&shown, &file_name, &bytes)
}

/// Parses a trace held in memory, detecting its format. `name` is used in
/// errors and, without a known extension, as [`Trace::name`]. For a snapshot
/// with several devices this is the device with the most events.
pub fn parse(name: &str, bytes: &[u8]) -> Result<Trace> {
    let mut all = parse_all(name, bytes)?;
    Ok(all.swap_remove(busiest(&all)))
}

/// Parses a trace held in memory into one [`Trace`] per device (one in all,
/// except for snapshots with several devices).
pub fn parse_all(name: &str, bytes: &[u8]) -> Result<Vec<Trace>> {
    parse_inner(name, name, bytes)
}

/// Detects the format of a trace from its name and first bytes.
pub fn detect_format(name: &str, bytes: &[u8]) -> Result<TraceFormat> {
    let lower = name.to_ascii_lowercase();
    if bytes.first() == Some(&0x80) || lower.ends_with(".pickle") || lower.ends_with(".pkl") {
        return Ok(TraceFormat::TorchSnapshot);
    }
    let first = bytes
        .split(|&b| b == b'\n')
        .map(|l| String::from_utf8_lossy(l).trim().to_owned())
        .find(|l| !l.is_empty())
        .ok_or_else(|| trace_err(name, "empty file"))?;
    let fields: Vec<String> = first
        .split(',')
        .map(|f| f.trim().to_ascii_lowercase())
        .collect();
    match fields[0].as_str() {
        "thread" => return Ok(TraceFormat::RmmLog),
        "id" => return Ok(TraceFormat::Lifetimes),
        _ => {}
    }
    if fields.len() == 6 && rmm::is_action(&fields[2]) {
        return Ok(TraceFormat::RmmLog);
    }
    if fields.len() == 4 || fields.len() == 5 {
        return Ok(TraceFormat::Lifetimes);
    }
    let shown: String = first.chars().take(80).collect();
    Err(trace_err(
        name,
        format!(
            "line 1: unrecognized trace format (not a pickle, RMM log or lifetimes CSV): `{shown}`"
        ),
    ))
}

fn parse_inner(err_name: &str, file_name: &str, bytes: &[u8]) -> Result<Vec<Trace>> {
    let base = trace_name(file_name);
    match detect_format(err_name, bytes)? {
        TraceFormat::TorchSnapshot => torch::parse(err_name, &base, bytes),
        TraceFormat::RmmLog => Ok(vec![rmm::parse(err_name, &base, text(err_name, bytes)?)?]),
        TraceFormat::Lifetimes => Ok(vec![lifetimes::parse(
            err_name,
            &base,
            text(err_name, bytes)?,
        )?]),
    }
}

fn text<'a>(name: &str, bytes: &'a [u8]) -> Result<&'a str> {
    std::str::from_utf8(bytes).map_err(|e| {
        let line = bytes[..e.valid_up_to()]
            .iter()
            .filter(|&&b| b == b'\n')
            .count()
            + 1;
        trace_err(name, format!("line {line}: not UTF-8 text"))
    })
}

/// File name without directories and without a known trace extension.
fn trace_name(file_name: &str) -> String {
    let base = file_name.rsplit(['/', '\\']).next().unwrap_or(file_name);
    for ext in [".pickle", ".pkl", ".csv", ".log"] {
        if base.len() > ext.len() && base.to_ascii_lowercase().ends_with(ext) {
            return base[..base.len() - ext.len()].to_owned();
        }
    }
    base.to_owned()
}

/// Index of the trace with the most events (first on ties). `all` is never
/// empty.
fn busiest(all: &[Trace]) -> usize {
    let mut best = 0;
    for (i, t) in all.iter().enumerate() {
        if t.events.len() > all[best].events.len() {
            best = i;
        }
    }
    best
}

/// Assigns dense block ids to keys (addresses, pointers) as a reader walks a
/// trace, and appends events. Shared by the readers.
pub(crate) struct Builder {
    pub(crate) events: Vec<TraceEvent>,
    next_id: u64,
}

impl Builder {
    pub(crate) fn new() -> Self {
        Builder {
            events: Vec::new(),
            next_id: 0,
        }
    }

    /// Appends an allocation and returns its new id.
    pub(crate) fn alloc(&mut self, size: u64, stream: u64) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        self.events.push(TraceEvent::Alloc { id, size, stream });
        id
    }

    /// Appends a free of `id`.
    pub(crate) fn free(&mut self, id: u64, stream: u64) {
        self.events.push(TraceEvent::Free { id, stream });
    }
}
