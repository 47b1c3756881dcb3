//! Writing Python pickles: the value tree a snapshot is made of, encoded
//! with pickle protocol 3 (what `pickle.load` and PyTorch's memory viewer
//! read; PyTorch writes its own snapshots with protocol 4, a superset).
//!
//! Only writing is here, and only the values snapshots hold: booleans,
//! 64-bit integers, strings, lists, tuples and dicts with string keys.
//! Reading pickles (PyTorch's snapshots as traces) is the tools crate's.
//!
//! Encoding: `PROTO 3`, then each value in prefix order — `BININT` for
//! integers that fit 32 bits, `LONG1` (little-endian two's complement)
//! for the rest, `BINUNICODE` strings, `EMPTY_LIST`/`EMPTY_DICT` followed
//! by `MARK ... APPENDS`/`SETITEMS` in batches of 1000 (as CPython's
//! pickler does), tuples as `MARK ... TUPLE` — and `STOP`. No memo: a
//! value tree has no shared or cyclic parts.

use std::collections::BTreeMap;

/// A pickle value of the kinds snapshots are made of.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    /// `True` / `False`.
    Bool(bool),
    /// An `int`.
    I64(i64),
    /// A `str`.
    String(String),
    /// A `list`.
    List(Vec<Value>),
    /// A `tuple`.
    Tuple(Vec<Value>),
    /// A `dict` with `str` keys, written in key order.
    Dict(BTreeMap<String, Value>),
}

const PROTO: u8 = 0x80;
const STOP: u8 = b'.';
const MARK: u8 = b'(';
const NEWTRUE: u8 = 0x88;
const NEWFALSE: u8 = 0x89;
const BININT: u8 = b'J';
const LONG1: u8 = 0x8a;
const BINUNICODE: u8 = b'X';
const EMPTY_LIST: u8 = b']';
const APPENDS: u8 = b'e';
const EMPTY_DICT: u8 = b'}';
const SETITEMS: u8 = b'u';
const TUPLE: u8 = b't';
/// Items per `APPENDS` / `SETITEMS`, as CPython batches them.
const BATCH: usize = 1000;

impl Value {
    /// The value as pickle bytes (protocol 3).
    pub fn to_pickle(&self) -> Vec<u8> {
        let mut out = vec![PROTO, 3];
        self.write(&mut out);
        out.push(STOP);
        out
    }

    fn write(&self, out: &mut Vec<u8>) {
        match self {
            Value::Bool(b) => out.push(if *b { NEWTRUE } else { NEWFALSE }),
            Value::I64(v) => write_int(*v, out),
            Value::String(s) => write_str(s, out),
            Value::List(items) => {
                out.push(EMPTY_LIST);
                for batch in items.chunks(BATCH) {
                    out.push(MARK);
                    for v in batch {
                        v.write(out);
                    }
                    out.push(APPENDS);
                }
            }
            Value::Tuple(items) => {
                out.push(MARK);
                for v in items {
                    v.write(out);
                }
                out.push(TUPLE);
            }
            Value::Dict(map) => {
                out.push(EMPTY_DICT);
                let entries: Vec<_> = map.iter().collect();
                for batch in entries.chunks(BATCH) {
                    out.push(MARK);
                    for (k, v) in batch {
                        write_str(k, out);
                        v.write(out);
                    }
                    out.push(SETITEMS);
                }
            }
        }
    }
}

fn write_int(v: i64, out: &mut Vec<u8>) {
    if let Ok(small) = i32::try_from(v) {
        out.push(BININT);
        out.extend_from_slice(&small.to_le_bytes());
        return;
    }
    // The shortest little-endian two's complement form: drop high bytes
    // that only repeat the sign of the byte below them.
    let bytes = v.to_le_bytes();
    let mut n = bytes.len();
    while n > 1 {
        let (top, below) = (bytes[n - 1], bytes[n - 2]);
        let sign_only = (top == 0x00 && below & 0x80 == 0) || (top == 0xff && below & 0x80 != 0);
        if !sign_only {
            break;
        }
        n -= 1;
    }
    out.push(LONG1);
    out.push(n as u8);
    out.extend_from_slice(&bytes[..n]);
}

fn write_str(s: &str, out: &mut Vec<u8>) {
    out.push(BINUNICODE);
    // Strings here are keys and short names, far below 4 GiB.
    let len = u32::try_from(s.len()).expect("a pickled string under 4 GiB");
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_pickle::{DeOptions, HashableValue, Value as P};

    /// The same tree as serde-pickle's value, to compare what it reads.
    fn expected(v: &Value) -> P {
        match v {
            Value::Bool(b) => P::Bool(*b),
            Value::I64(i) => P::I64(*i),
            Value::String(s) => P::String(s.clone()),
            Value::List(l) => P::List(l.iter().map(expected).collect()),
            Value::Tuple(t) => P::Tuple(t.iter().map(expected).collect()),
            Value::Dict(d) => P::Dict(
                d.iter()
                    .map(|(k, v)| (HashableValue::String(k.clone()), expected(v)))
                    .collect(),
            ),
        }
    }

    #[test]
    fn reads_back_as_written() {
        let ints = [
            0,
            1,
            -1,
            127,
            128,
            255,
            256,
            i32::MAX as i64,
            i32::MIN as i64,
            i32::MAX as i64 + 1,
            i32::MIN as i64 - 1,
            1 << 40,
            -(1 << 40),
            0x7f_ffff_ffff,
            0x80_0000_0000,
            i64::MAX,
            i64::MIN,
        ];
        let big: Vec<Value> = (0..2500).map(Value::I64).collect();
        let dict: BTreeMap<String, Value> = (0..1200)
            .map(|i| (format!("k{i:04}"), Value::Bool(i % 2 == 0)))
            .collect();
        let v = Value::Dict(BTreeMap::from([
            (
                "ints".to_string(),
                Value::List(ints.iter().map(|&i| Value::I64(i)).collect()),
            ),
            ("big".to_string(), Value::List(big)),
            ("dict".to_string(), Value::Dict(dict)),
            ("empty".to_string(), Value::List(Vec::new())),
            ("none".to_string(), Value::Dict(BTreeMap::new())),
            (
                "pair".to_string(),
                Value::Tuple(vec![Value::I64(0), Value::I64(0)]),
            ),
            ("unit".to_string(), Value::Tuple(Vec::new())),
            ("text".to_string(), Value::String("héllo \u{1F600}".into())),
            (
                "flags".to_string(),
                Value::List(vec![Value::Bool(true), Value::Bool(false)]),
            ),
        ]));
        let bytes = v.to_pickle();
        assert_eq!(&bytes[..2], &[PROTO, 3]);
        assert_eq!(bytes.last(), Some(&STOP));
        let back = serde_pickle::value_from_slice(&bytes, DeOptions::new()).unwrap();
        assert_eq!(back, expected(&v));
    }

    #[test]
    fn integers_use_the_shortest_form() {
        let enc = |v: i64| Value::I64(v).to_pickle()[2..].to_vec();
        assert_eq!(enc(5), [BININT, 5, 0, 0, 0, STOP]);
        assert_eq!(enc(1 << 31), [LONG1, 5, 0, 0, 0, 0x80, 0, STOP]);
        assert_eq!(
            enc(-(1 << 31) - 1),
            [LONG1, 5, 0xff, 0xff, 0xff, 0x7f, 0xff, STOP]
        );
        assert_eq!(enc(i64::MIN)[..2], [LONG1, 8]);
    }
}
