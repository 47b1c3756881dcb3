//! Buffer-lifetimes CSV (`id,lower,upper,size[,offset]`), as minimalloc and
//! compiler memory planners (MindSpore SOMAS, IREE) write them.

use std::collections::HashMap;

use super::{trace_err, Builder, Skipped, Trace, TraceFormat};
use gpupool::Result;

const COLUMNS: [&str; 5] = ["id", "lower", "upper", "size", "offset"];

/// One buffer: live on `[lower, upper)`.
struct Buffer {
    lower: i64,
    upper: i64,
    size: u64,
}

pub(super) fn parse(file: &str, base: &str, text: &str) -> Result<Trace> {
    let mut buffers: Vec<Buffer> = Vec::new();
    let mut first_line: HashMap<&str, usize> = HashMap::new();
    let mut skipped = Skipped::default();
    let mut seen_first = false;

    for (line, raw, fields) in super::csv_rows(text) {
        let at = |msg: String| trace_err(file, format!("line {line}: {msg}"));
        if !seen_first {
            seen_first = true;
            if fields[0].eq_ignore_ascii_case("id") {
                let ok = (fields.len() == 4 || fields.len() == 5)
                    && fields
                        .iter()
                        .zip(COLUMNS)
                        .all(|(f, c)| f.eq_ignore_ascii_case(c));
                if !ok {
                    return Err(at(format!(
                        "unexpected header `{raw}` (expected `id,lower,upper,size[,offset]`)"
                    )));
                }
                continue;
            }
        }
        if fields.len() != 4 && fields.len() != 5 {
            return Err(at(format!(
                "expected 4 or 5 fields (id,lower,upper,size[,offset]), found {}",
                fields.len()
            )));
        }
        let bad = |col: usize, why: &str| {
            at(format!(
                "bad `{}` field `{}`: {why}",
                COLUMNS[col], fields[col]
            ))
        };
        let id = fields[0];
        if id.is_empty() {
            return Err(bad(0, "empty"));
        }
        if let Some(first) = first_line.insert(id, line) {
            return Err(at(format!("duplicate id `{id}` (first on line {first})")));
        }
        let lower: i64 = fields[1]
            .parse()
            .map_err(|_| bad(1, "expected an integer time"))?;
        let upper: i64 = fields[2]
            .parse()
            .map_err(|_| bad(2, "expected an integer time"))?;
        let size = parse_unsigned(fields[3], "negative size").map_err(|why| bad(3, why))?;
        if let Some(off) = fields.get(4) {
            if !off.is_empty() {
                parse_unsigned(off, "negative offset").map_err(|why| bad(4, why))?;
            }
        }
        if upper < lower {
            return Err(at(format!("upper {upper} is below lower {lower}")));
        }
        if upper == lower {
            skipped.empty_lifetimes += 1;
            continue;
        }
        if size == 0 {
            skipped.zero_size += 1;
            continue;
        }
        buffers.push(Buffer { lower, upper, size });
    }

    // (time, 0 = free / 1 = alloc, buffer index): frees first at equal
    // times, then file order.
    let mut order: Vec<(i64, u8, u32)> = Vec::with_capacity(buffers.len() * 2);
    for (i, buf) in buffers.iter().enumerate() {
        let i = i as u32;
        order.push((buf.lower, 1, i));
        order.push((buf.upper, 0, i));
    }
    order.sort_unstable();

    let mut b = Builder::new();
    b.events.reserve(order.len());
    let mut ids = vec![0u64; buffers.len()];
    for (_, kind, i) in order {
        let i = i as usize;
        if kind == 1 {
            ids[i] = b.alloc(buffers[i].size, 0);
        } else {
            b.free(ids[i], 0);
        }
    }

    Ok(Trace {
        name: base.to_owned(),
        format: TraceFormat::Lifetimes,
        events: b.events,
        baseline_peak_reserved: None,
        skipped,
    })
}

/// A decimal u64; `negative` is the complaint for a negative integer.
fn parse_unsigned(s: &str, negative: &'static str) -> std::result::Result<u64, &'static str> {
    if let Some(rest) = s.strip_prefix('-') {
        if !rest.is_empty() && rest.bytes().all(|c| c.is_ascii_digit()) {
            return Err(negative);
        }
    }
    if s.is_empty() || !s.bytes().all(|c| c.is_ascii_digit()) {
        return Err("expected a non-negative integer");
    }
    s.parse().map_err(|_| "out of range")
}
