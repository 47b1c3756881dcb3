//! RMM `logging_resource_adaptor` CSV logs: reader and writer.

use std::collections::HashMap;
use std::io::{BufWriter, Write};

use super::{trace_err, Builder, Skipped, Trace, TraceEvent, TraceFormat};
use gpupool::{Error, Result};

const COLUMNS: [&str; 6] = ["Thread", "Time", "Action", "Pointer", "Size", "Stream"];

/// Whether `s` (lower case) is an action of the RMM log.
pub(super) fn is_action(s: &str) -> bool {
    matches!(s, "allocate" | "free" | "deallocate" | "allocate failure")
}

pub(super) fn parse(file: &str, base: &str, text: &str) -> Result<Trace> {
    let mut b = Builder::new();
    let mut skipped = Skipped::default();
    // Pointer -> (block id, or None for a dropped zero-size block; line).
    let mut live: HashMap<u64, (Option<u64>, usize)> = HashMap::new();
    let mut seen_first = false;

    for (line, raw, fields) in super::csv_rows(text) {
        let at = |msg: String| trace_err(file, format!("line {line}: {msg}"));
        if !seen_first {
            seen_first = true;
            if fields[0].eq_ignore_ascii_case("thread") {
                let ok = fields.len() == COLUMNS.len()
                    && fields
                        .iter()
                        .zip(COLUMNS)
                        .all(|(f, c)| f.eq_ignore_ascii_case(c));
                if !ok {
                    return Err(at(format!(
                        "unexpected header `{raw}` (expected `{}`)",
                        COLUMNS.join(",")
                    )));
                }
                continue;
            }
        }
        if fields.len() != COLUMNS.len() {
            return Err(at(format!(
                "expected {} fields ({}), found {}",
                COLUMNS.len(),
                COLUMNS.join(","),
                fields.len()
            )));
        }
        let bad = |col: usize, why: &str| {
            at(format!(
                "bad `{}` field `{}`: {why}",
                COLUMNS[col], fields[col]
            ))
        };
        if fields[0].is_empty() {
            return Err(bad(0, "empty"));
        }
        check_time(fields[1]).map_err(|why| bad(1, why))?;
        let action = fields[2].to_ascii_lowercase();
        let ptr = parse_hex(fields[3]).map_err(|why| bad(3, why))?;
        let size = parse_size(fields[4]).map_err(|why| bad(4, why))?;
        let stream = parse_hex(fields[5]).map_err(|why| bad(5, why))?;
        match action.as_str() {
            "allocate" => {
                if let Some(&(Some(_), first)) = live.get(&ptr) {
                    return Err(at(format!(
                        "allocate of pointer {ptr:#x}, which is already live (allocated on line {first})"
                    )));
                }
                let id = if size == 0 {
                    skipped.zero_size += 1;
                    None
                } else {
                    Some(b.alloc(size, stream))
                };
                live.insert(ptr, (id, line));
            }
            "free" | "deallocate" => match live.remove(&ptr) {
                Some((Some(id), _)) => b.free(id, stream),
                Some((None, _)) => {}
                None => {
                    return Err(at(format!(
                        "free of unknown pointer {ptr:#x} (never allocated, or already freed)"
                    )))
                }
            },
            "allocate failure" => skipped.alloc_failures += 1,
            _ => {
                return Err(at(format!(
                    "unknown action `{}` (expected allocate, free, deallocate or allocate failure)",
                    fields[2]
                )))
            }
        }
    }

    Ok(Trace {
        name: base.to_owned(),
        format: TraceFormat::RmmLog,
        events: b.events,
        baseline_peak_reserved: None,
        skipped,
    })
}

/// Accepts `HH:MM:SS[.ffffff]` (as the C++ adaptor writes it) or decimal
/// seconds.
fn check_time(s: &str) -> std::result::Result<(), &'static str> {
    fn decimal(s: &str) -> bool {
        let (int, frac) = s.split_once('.').unwrap_or((s, ""));
        !int.is_empty()
            && int.bytes().all(|c| c.is_ascii_digit())
            && frac.bytes().all(|c| c.is_ascii_digit())
    }
    fn two_digits(s: &str, max: u32) -> bool {
        s.len() == 2
            && s.bytes().all(|c| c.is_ascii_digit())
            && s.parse::<u32>().is_ok_and(|v| v <= max)
    }
    let parts: Vec<&str> = s.split(':').collect();
    let ok = match parts.as_slice() {
        [secs] => decimal(secs),
        [h, m, sec] => {
            !h.is_empty()
                && h.bytes().all(|c| c.is_ascii_digit())
                && two_digits(m, 59)
                && decimal(sec)
                && sec.split('.').next().is_some_and(|w| two_digits(w, 60))
        }
        _ => false,
    };
    if ok {
        Ok(())
    } else {
        Err("expected HH:MM:SS.ffffff or decimal seconds")
    }
}

/// Hex with or without `0x`; `(nil)` (glibc's `%p` of a null pointer) is 0.
fn parse_hex(s: &str) -> std::result::Result<u64, &'static str> {
    if s == "(nil)" {
        return Ok(0);
    }
    let digits = s
        .strip_prefix("0x")
        .or_else(|| s.strip_prefix("0X"))
        .unwrap_or(s);
    if digits.is_empty() || !digits.bytes().all(|c| c.is_ascii_hexdigit()) {
        return Err("expected a hex number");
    }
    u64::from_str_radix(digits, 16).map_err(|_| "hex number out of range")
}

fn parse_size(s: &str) -> std::result::Result<u64, &'static str> {
    if let Some(rest) = s.strip_prefix('-') {
        if !rest.is_empty() && rest.bytes().all(|c| c.is_ascii_digit()) {
            return Err("negative size");
        }
    }
    if s.is_empty() || !s.bytes().all(|c| c.is_ascii_digit()) {
        return Err("expected a decimal byte count");
    }
    s.parse().map_err(|_| "size out of range")
}

/// Writes events as an RMM `logging_resource_adaptor` log (header, then one
/// `allocate` or `free` line per event), so that a trace recorded from a live
/// pool can be saved and read back with [`parse`](super::parse).
///
/// Takes a [`Trace`] or a slice of events. The log has no block ids, so the
/// writer invents pointers: blocks are laid out one after another from
/// `0x7f0000000000`, each rounded up to 256 bytes, never reused. Thread is
/// `0`; Time is the event index in microseconds as `HH:MM:SS.ffffff`. Reading
/// the log back gives the same events with ids renumbered in allocation
/// order (the identity for traces built by the readers).
///
/// Errors: [`Error::Trace`] (file `<rmm-log writer>`) naming the event index
/// when an id is allocated twice or a free names a block that is not live;
/// [`Error::Io`] when the writer fails. Zero-size allocations are written as
/// they are (a reader drops them again).
pub fn write_rmm_log<W: Write>(events: impl AsRef<[TraceEvent]>, writer: W) -> Result<()> {
    const WHO: &str = "<rmm-log writer>";
    const BASE: u64 = 0x7f00_0000_0000;
    let mut w = BufWriter::new(writer);
    writeln!(w, "{}", COLUMNS.join(","))?;
    // id -> (pointer, size) while live; ids once used.
    let mut live: HashMap<u64, (u64, u64)> = HashMap::new();
    let mut used: std::collections::HashSet<u64> = std::collections::HashSet::new();
    let mut next_ptr = BASE;
    for (i, ev) in events.as_ref().iter().enumerate() {
        let us = i as u64;
        let time = format!(
            "{:02}:{:02}:{:02}.{:06}",
            us / 3_600_000_000,
            us / 60_000_000 % 60,
            us / 1_000_000 % 60,
            us % 1_000_000
        );
        match *ev {
            TraceEvent::Alloc { id, size, stream } => {
                if !used.insert(id) {
                    return Err(trace_err(
                        WHO,
                        format!("event {i}: block id {id} allocated twice"),
                    ));
                }
                let ptr = next_ptr;
                next_ptr = size
                    .checked_add(255)
                    .map(|s| s & !255)
                    .and_then(|s| next_ptr.checked_add(s.max(256)))
                    .ok_or_else(|| {
                        trace_err(WHO, format!("event {i}: invented addresses overflow"))
                    })?;
                live.insert(id, (ptr, size));
                writeln!(w, "0,{time},allocate,{ptr:#x},{size},{stream:#x}")?;
            }
            TraceEvent::Free { id, stream } => {
                let (ptr, size) = live.remove(&id).ok_or_else(|| {
                    trace_err(
                        WHO,
                        format!("event {i}: free of block id {id}, which is not live"),
                    )
                })?;
                writeln!(w, "0,{time},free,{ptr:#x},{size},{stream:#x}")?;
            }
        }
    }
    w.flush().map_err(Error::from)
}

impl AsRef<[TraceEvent]> for Trace {
    fn as_ref(&self) -> &[TraceEvent] {
        &self.events
    }
}
