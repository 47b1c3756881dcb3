//! Trace readers and the RMM log writer: real traces from `../shared/traces`
//! (skipped with a printed reason when absent, a failure under `CI=true`),
//! small fixtures cut from them (`tools/tests/data`, see its README),
//! synthetic snapshots, and malformed input.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use gpupool::Error;
use gpupool_tools::trace::{
    self, parse, parse_all, read_file, write_rmm_log, Skipped, Trace, TraceEvent, TraceFormat,
};
use serde_pickle::{HashableValue, SerOptions, Value};

const DATA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data");

#[path = "../../tests/common/mod.rs"]
mod common;

/// The real traces; a test without them fails under `CI=true`.
fn shared() -> Option<PathBuf> {
    common::shared_traces()
}

fn data(name: &str) -> PathBuf {
    Path::new(DATA).join(name)
}

/// Loads a file, printing how long it took.
fn timed_read(path: &Path) -> Trace {
    let t0 = Instant::now();
    let trace = read_file(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    println!(
        "loaded {:<28} {:>15} {:>7} events in {:>8.2} ms",
        trace.name,
        trace.format.as_str(),
        trace.events.len(),
        t0.elapsed().as_secs_f64() * 1e3
    );
    trace
}

/// Asserts `r` is an `Error::Trace` whose message contains every needle, and
/// returns the message.
#[track_caller]
fn trace_error<T: std::fmt::Debug>(r: gpupool::Result<T>, file: &str, needles: &[&str]) -> String {
    match r {
        Err(Error::Trace { file: f, msg }) => {
            assert_eq!(f, file, "error names the wrong file: {msg}");
            for n in needles {
                assert!(msg.contains(n), "`{msg}` does not mention `{n}`");
            }
            msg
        }
        other => panic!("expected Error::Trace, got {other:?}"),
    }
}

// ---------------------------------------------------------------- real traces

#[test]
fn real_pytorch_snapshots_match_readme() {
    let Some(dir) = shared() else { return };
    // file, alloc events, peak live bytes, PyTorch peak reserved.
    let expected: [(&str, usize, u64, u64); 4] = [
        (
            "lm-medium-ctx256-train",
            6_624,
            9_103_544_320,
            9_265_217_536,
        ),
        (
            "lm-medium-ctx1024-infer",
            1_280,
            2_877_435_904,
            3_204_448_256,
        ),
        (
            "lm-small-10steps-train",
            2_162,
            3_849_232_640,
            4_238_344_192,
        ),
        ("lm-large-forward", 4_138, 43_754_773_506, 47_234_154_496),
    ];
    for (name, alloc_events, peak, reserved) in expected {
        let t = timed_read(&dir.join("pytorch").join(format!("{name}.pickle")));
        assert_eq!(t.name, name);
        assert_eq!(t.format, TraceFormat::TorchSnapshot);
        t.validate().unwrap();
        // Pre-live blocks come on top of the alloc events.
        assert!(t.allocs() >= alloc_events, "{name}: {} allocs", t.allocs());
        assert_eq!(t.peak_live_bytes(), peak, "{name}: peak live bytes");
        assert_eq!(t.baseline_peak_reserved, Some(reserved), "{name}: baseline");
        assert_eq!(t.skipped, Skipped::default());
    }
}

#[test]
fn real_lifetimes_match_readme() {
    let Some(dir) = shared() else { return };
    let dir = dir.join("lifetimes");
    for (name, peak) in [
        ("bert_base", 15_734_934_689u64),
        ("resnet50", 1_515_472_556),
        ("pangu_2.6B", 5_530_099_775),
        ("iree_mobilebert", 1_674_240),
    ] {
        let t = timed_read(&dir.join(format!("{name}.csv")));
        assert_eq!(t.name, name);
        assert_eq!(t.format, TraceFormat::Lifetimes);
        t.validate().unwrap();
        assert_eq!(t.allocs(), t.frees(), "{name}: every buffer dies");
        assert_eq!(t.peak_live_bytes(), peak, "{name}: peak live bytes");
        assert_eq!(t.baseline_peak_reserved, None);
    }
    let mut n = 0;
    for entry in std::fs::read_dir(dir.join("minimalloc")).unwrap() {
        let t = timed_read(&entry.unwrap().path());
        t.validate().unwrap();
        let peak = t.peak_live_bytes();
        assert!((986_112..=1_048_576).contains(&peak), "{}: {peak}", t.name);
        n += 1;
    }
    assert_eq!(n, 11);
}

#[test]
fn real_traces_round_trip_through_rmm_log() {
    let Some(dir) = shared() else { return };
    for path in [
        dir.join("pytorch/lm-medium-ctx1024-infer.pickle"),
        dir.join("lifetimes/resnet50.csv"),
    ] {
        let t = read_file(&path).unwrap();
        let mut log = Vec::new();
        write_rmm_log(&t, &mut log).unwrap();
        let back = parse("round-trip.csv", &log).unwrap();
        assert_eq!(back.format, TraceFormat::RmmLog);
        assert_eq!(back.events, t.events, "{}", path.display());
    }
}

// ------------------------------------------------------------------ fixtures

#[test]
fn torch_fixture() {
    let t = timed_read(&data("torch_small_excerpt.pickle"));
    assert_eq!(t.name, "torch_small_excerpt");
    assert_eq!(t.format, TraceFormat::TorchSnapshot);
    t.validate().unwrap();
    // 2 blocks freed before any alloc (rule 1), 3 active segment blocks never
    // allocated in the excerpt (rule 2), 20 alloc events, 20 free_requested.
    assert_eq!((t.allocs(), t.frees()), (25, 20));
    assert!(t.events[..5].iter().all(TraceEvent::is_alloc));
    assert_eq!(
        t.events[2..5]
            .iter()
            .map(|e| match e {
                TraceEvent::Alloc { size, .. } => *size,
                _ => 0,
            })
            .collect::<Vec<_>>(),
        [154_389_504; 3]
    );
    assert_eq!(t.peak_live_bytes(), 1_235_116_032);
    assert_eq!(t.baseline_peak_reserved, Some(3 * 155_189_248));
    // Ids are dense, in allocation order.
    let ids: Vec<u64> = t
        .events
        .iter()
        .filter(|e| e.is_alloc())
        .map(|e| e.id())
        .collect();
    assert_eq!(ids, (0..25).collect::<Vec<_>>());
}

#[test]
fn rmm_fixture() {
    let t = timed_read(&data("rmm_excerpt.csv"));
    assert_eq!(t.name, "rmm_excerpt");
    assert_eq!(t.format, TraceFormat::RmmLog);
    t.validate().unwrap();
    assert_eq!((t.allocs(), t.frees()), (42, 38));
    assert_eq!(t.peak_live_bytes(), 1_158_946_816);
    assert_eq!(t.baseline_peak_reserved, None);
}

#[test]
fn lifetimes_fixtures() {
    let t = timed_read(&data("lifetimes_iree_excerpt.csv"));
    assert_eq!(t.format, TraceFormat::Lifetimes);
    t.validate().unwrap();
    assert_eq!((t.allocs(), t.frees()), (40, 40));
    assert_eq!(t.peak_live_bytes(), 1_674_240);

    let t = timed_read(&data("lifetimes_minimalloc_a_noheader.csv"));
    assert_eq!(t.format, TraceFormat::Lifetimes);
    t.validate().unwrap();
    assert_eq!((t.allocs(), t.frees()), (30, 30));
    assert_eq!(t.peak_live_bytes(), 739_328);
}

#[test]
fn fixtures_round_trip_through_rmm_log() {
    for name in [
        "torch_small_excerpt.pickle",
        "rmm_excerpt.csv",
        "lifetimes_iree_excerpt.csv",
    ] {
        let t = read_file(data(name)).unwrap();
        let mut log = Vec::new();
        write_rmm_log(&t.events, &mut log).unwrap();
        let text = String::from_utf8(log.clone()).unwrap();
        assert!(text.starts_with("Thread,Time,Action,Pointer,Size,Stream\n"));
        let back = parse("written.log", &log).unwrap();
        assert_eq!(back.name, "written");
        assert_eq!(back.events, t.events, "{name}");
        assert_eq!(back.peak_live_bytes(), t.peak_live_bytes());
    }
}

#[test]
fn format_names_and_detection() {
    assert_eq!(TraceFormat::TorchSnapshot.as_str(), "torch-snapshot");
    assert_eq!(TraceFormat::RmmLog.as_str(), "rmm-log");
    assert_eq!(TraceFormat::Lifetimes.as_str(), "lifetimes");
    assert_eq!(TraceFormat::RmmLog.to_string(), "rmm-log");
    // Content decides, not the name.
    let pickle = std::fs::read(data("torch_small_excerpt.pickle")).unwrap();
    assert_eq!(
        parse("x", &pickle).unwrap().format,
        TraceFormat::TorchSnapshot
    );
    let rmm = std::fs::read(data("rmm_excerpt.csv")).unwrap();
    assert_eq!(parse("x.txt", &rmm).unwrap().format, TraceFormat::RmmLog);
    let lt = std::fs::read(data("lifetimes_minimalloc_a_noheader.csv")).unwrap();
    assert_eq!(parse("y", &lt).unwrap().format, TraceFormat::Lifetimes);
    assert_eq!(
        trace::detect_format("z", b"1,12:00:00.5,allocate,0x10,8,0x0\n").unwrap(),
        TraceFormat::RmmLog
    );
    trace_error(
        parse("junk.bin", b"hello world\n"),
        "junk.bin",
        &["line 1", "unrecognized"],
    );
    trace_error(parse("empty.csv", b"\n\n"), "empty.csv", &["empty"]);
    let missing = data("no-such-file.csv");
    let shown = missing.display().to_string();
    trace_error(read_file(&missing), &shown, &["cannot read"]);
}

// ----------------------------------------------------------- PyTorch synthetic

fn dict(entries: Vec<(&str, Value)>) -> Value {
    Value::Dict(
        entries
            .into_iter()
            .map(|(k, v)| (HashableValue::String(k.to_owned()), v))
            .collect::<BTreeMap<_, _>>(),
    )
}

fn ev(action: &str, addr: i64, size: i64) -> Value {
    dict(vec![
        ("action", Value::String(action.to_owned())),
        ("addr", Value::I64(addr)),
        ("size", Value::I64(size)),
        ("stream", Value::I64(7)),
        ("time_us", Value::I64(1)),
        ("frames", Value::List(vec![])),
    ])
}

fn segment(device: i64, total: i64, blocks: Vec<(i64, i64, &str)>) -> Value {
    dict(vec![
        ("device", Value::I64(device)),
        ("address", Value::I64(blocks.first().map_or(0, |b| b.0))),
        ("total_size", Value::I64(total)),
        ("stream", Value::I64(0)),
        (
            "blocks",
            Value::List(
                blocks
                    .into_iter()
                    .map(|(addr, req, state)| {
                        dict(vec![
                            ("address", Value::I64(addr)),
                            ("size", Value::I64(req.max(512))),
                            ("requested_size", Value::I64(req)),
                            ("state", Value::String(state.to_owned())),
                        ])
                    })
                    .collect(),
            ),
        ),
    ])
}

fn snapshot(segments: Vec<Value>, devices: Vec<Vec<Value>>) -> Vec<u8> {
    let v = dict(vec![
        ("segments", Value::List(segments)),
        (
            "device_traces",
            Value::List(devices.into_iter().map(Value::List).collect()),
        ),
    ]);
    serde_pickle::value_to_vec(&v, SerOptions::new()).unwrap()
}

#[test]
fn torch_replay_rule_and_passive_actions() {
    let bytes = snapshot(
        vec![segment(
            0,
            4096,
            vec![
                (0x1000, 100, "active_allocated"),    // rule 2: live throughout
                (0x2000, 200, "active_allocated"),    // allocated in the trace
                (0x3000, 300, "inactive"),            // not live
                (0x4000, 400, "active_pending_free"), // rule 2 as well
            ],
        )],
        vec![vec![
            ev("free_requested", 0x5000, 50), // rule 1: live before recording
            ev("free_completed", 0x5000, 50),
            ev("alloc", 0x2000, 200),
            ev("snapshot", 0, 0),
            ev("oom", 0, 1 << 40),
            ev("alloc", 0x6000, 0), // zero size: dropped with its free
            ev("free_requested", 0x6000, 0),
            ev("alloc", 0x5000, 60), // address reused
            ev("user_defined", 0, 0),
        ]],
    );
    let t = parse("synthetic.pickle", &bytes).unwrap();
    t.validate().unwrap();
    let s = 7;
    assert_eq!(
        t.events,
        vec![
            TraceEvent::Alloc {
                id: 0,
                size: 50,
                stream: s
            },
            TraceEvent::Alloc {
                id: 1,
                size: 100,
                stream: 0
            },
            TraceEvent::Alloc {
                id: 2,
                size: 400,
                stream: 0
            },
            TraceEvent::Free { id: 0, stream: s },
            TraceEvent::Alloc {
                id: 3,
                size: 200,
                stream: s
            },
            TraceEvent::Alloc {
                id: 4,
                size: 60,
                stream: s
            },
        ]
    );
    assert_eq!(t.skipped.zero_size, 1);
    assert_eq!(t.peak_live_bytes(), 100 + 400 + 200 + 60);
    assert_eq!(t.baseline_peak_reserved, Some(4096));
}

#[test]
fn torch_baseline_walks_segment_events_backwards() {
    // At the end 30 B are reserved; the trace grew by 60 then shrank by 50,
    // so it started at 20 and peaked at 80.
    let bytes = snapshot(
        vec![segment(0, 30, vec![])],
        vec![vec![
            ev("segment_alloc", 0x10, 60),
            ev("alloc", 0x10, 8),
            ev("segment_free", 0x100, 50),
        ]],
    );
    let t = parse("seg.pickle", &bytes).unwrap();
    assert_eq!(t.baseline_peak_reserved, Some(80));
    // segment_map / segment_unmap (expandable segments) count the same way.
    let bytes = snapshot(
        vec![segment(0, 100, vec![])],
        vec![vec![ev("segment_unmap", 0, 40), ev("segment_map", 0, 10)]],
    );
    assert_eq!(
        parse("map.pickle", &bytes).unwrap().baseline_peak_reserved,
        Some(130)
    );
    // Events that cannot match the segments.
    let bytes = snapshot(
        vec![segment(0, 10, vec![])],
        vec![vec![ev("segment_alloc", 0, 60)]],
    );
    trace_error(
        parse("bad-seg.pickle", &bytes),
        "bad-seg.pickle",
        &["device 0", "segment"],
    );
    // No `segments` at all: no baseline.
    let v = dict(vec![(
        "device_traces",
        Value::List(vec![Value::List(vec![ev("alloc", 1, 8)])]),
    )]);
    let bytes = serde_pickle::value_to_vec(&v, SerOptions::new()).unwrap();
    assert_eq!(parse("noseg", &bytes).unwrap().baseline_peak_reserved, None);
}

#[test]
fn torch_several_devices() {
    let bytes = snapshot(
        vec![
            segment(0, 1000, vec![]),
            segment(1, 2000, vec![(0x9000, 64, "active_allocated")]),
        ],
        vec![
            vec![ev("alloc", 0x10, 8)],
            vec![
                ev("alloc", 0x10, 16),
                ev("alloc", 0x20, 32),
                ev("free_requested", 0x10, 16),
            ],
        ],
    );
    let all = parse_all("multi.pickle", &bytes).unwrap();
    let names: Vec<&str> = all.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["multi#dev0", "multi#dev1"]);
    assert_eq!(all[0].baseline_peak_reserved, Some(1000));
    assert_eq!(all[1].baseline_peak_reserved, Some(2000));
    assert_eq!(all[1].peak_live_bytes(), 64 + 16 + 32);
    // `parse` picks the device with the most events.
    assert_eq!(parse("multi.pickle", &bytes).unwrap().name, "multi#dev1");
}

// ----------------------------------------------------------- malformed input

#[test]
fn torch_truncated_pickle() {
    let bytes = std::fs::read(data("torch_small_excerpt.pickle")).unwrap();
    for cut in [1, bytes.len() / 2, bytes.len() - 1] {
        trace_error(
            parse("cut.pickle", &bytes[..cut]),
            "cut.pickle",
            &["pickle"],
        );
    }
    // A pickle that is not a snapshot.
    let v = serde_pickle::value_to_vec(&Value::I64(3), SerOptions::new()).unwrap();
    trace_error(parse("int.pickle", &v), "int.pickle", &["not a dict"]);
}

#[test]
fn torch_unknown_action_names_event_and_action() {
    let bytes = snapshot(
        vec![],
        vec![vec![
            ev("alloc", 1, 8),
            ev("free_requested", 1, 8),
            ev("teleport", 1, 8),
        ]],
    );
    trace_error(
        parse("u.pickle", &bytes),
        "u.pickle",
        &["event 2", "`teleport`"],
    );
}

#[test]
fn torch_negative_size_names_event() {
    let bytes = snapshot(vec![], vec![vec![ev("alloc", 1, 8), ev("alloc", 2, -8)]]);
    trace_error(
        parse("neg.pickle", &bytes),
        "neg.pickle",
        &["event 1", "negative"],
    );
    let bytes = snapshot(vec![segment(0, -1, vec![])], vec![]);
    trace_error(
        parse("negseg.pickle", &bytes),
        "negseg.pickle",
        &["segments[0]", "negative"],
    );
}

#[test]
fn torch_inconsistent_events_name_event() {
    let bytes = snapshot(vec![], vec![vec![ev("alloc", 1, 8), ev("alloc", 1, 8)]]);
    trace_error(
        parse("dup.pickle", &bytes),
        "dup.pickle",
        &["event 1", "already live"],
    );
    let bytes = snapshot(
        vec![],
        vec![vec![
            ev("alloc", 1, 8),
            ev("free_requested", 1, 8),
            ev("free_requested", 1, 8),
        ]],
    );
    trace_error(
        parse("df.pickle", &bytes),
        "df.pickle",
        &["event 2", "not live"],
    );
    let mut bad = vec![ev("alloc", 1, 8)];
    bad.push(dict(vec![("addr", Value::I64(1))]));
    let bytes = snapshot(vec![], vec![bad]);
    trace_error(
        parse("noact.pickle", &bytes),
        "noact.pickle",
        &["event 1", "action"],
    );
}

#[test]
fn rmm_variants() {
    let log = "\
1,0.000001,allocate,7f0000001000,100,0
1,1.5,allocate,0x7F0000002000,0,0x0
2,3.25,deallocate,0x7f0000001000,100,0x1a
1,12:01:02.000003,allocate failure,(nil),1099511627776,0x0
2,12:01:02.5,free,0x7f0000002000,0,0x0
2,12:01:03,allocate,0x7f0000001000,7,0x1a
";
    let t = parse("variants.log", log.as_bytes()).unwrap();
    assert_eq!(t.format, TraceFormat::RmmLog);
    assert_eq!(
        t.events,
        vec![
            TraceEvent::Alloc {
                id: 0,
                size: 100,
                stream: 0
            },
            TraceEvent::Free {
                id: 0,
                stream: 0x1a
            },
            TraceEvent::Alloc {
                id: 1,
                size: 7,
                stream: 0x1a
            },
        ]
    );
    assert_eq!(
        t.skipped,
        Skipped {
            alloc_failures: 1,
            zero_size: 1,
            empty_lifetimes: 0
        }
    );
    assert_eq!(t.skipped.total(), 2);
}

const RMM_HEAD: &str = "Thread,Time,Action,Pointer,Size,Stream\n";

fn rmm(body: &str) -> gpupool::Result<Trace> {
    parse("bad.csv", format!("{RMM_HEAD}{body}").as_bytes())
}

#[test]
fn rmm_free_of_unknown_pointer_names_line() {
    let body = "1,10:00:00.000001,allocate,0x100,8,0x0\n1,10:00:00.000002,free,0x200,8,0x0\n";
    trace_error(rmm(body), "bad.csv", &["line 3", "unknown pointer 0x200"]);
    // A double free is a free of a pointer no longer live.
    let body = "1,1.0,allocate,0x100,8,0x0\n1,1.1,free,0x100,8,0x0\n\n1,1.2,free,0x100,8,0x0\n";
    trace_error(rmm(body), "bad.csv", &["line 5", "unknown pointer 0x100"]);
}

#[test]
fn rmm_bad_fields_name_line_and_column() {
    let ok = "1,10:00:00.000001,allocate,0x100,8,0x0\n";
    for (line, needle) in [
        ("1,10:00:00.000002,allocate,0x200,abc,0x0", "`Size`"),
        ("1,10:00:00.000002,allocate,0x200,-8,0x0", "negative size"),
        ("1,10:00:00.000002,allocate,0xZZ,8,0x0", "`Pointer`"),
        ("1,10:00:00.000002,allocate,0x200,8,stream", "`Stream`"),
        ("1,10:61:00.000002,allocate,0x200,8,0x0", "`Time`"),
        ("1,yesterday,allocate,0x200,8,0x0", "`Time`"),
        (",1.0,allocate,0x200,8,0x0", "`Thread`"),
        ("1,1.0,allocate,0x200,8", "expected 6 fields"),
        (
            "1,1.0,reallocate,0x200,8,0x0",
            "unknown action `reallocate`",
        ),
        (
            "1,1.0,allocate,0x100,8,0x0",
            "already live (allocated on line 2)",
        ),
    ] {
        let msg = trace_error(
            rmm(&format!("{ok}{line}\n")),
            "bad.csv",
            &["line 3", needle],
        );
        assert!(!msg.is_empty());
    }
    trace_error(
        parse("h.csv", b"Thread,Time,Action,Pointer,Bytes,Stream\n"),
        "h.csv",
        &["line 1", "header"],
    );
}

#[test]
fn lifetimes_order_and_skips() {
    // b and c both touch time 5: b's free comes before c's alloc; d is never
    // live, e has size 0.
    let csv = "a,0,10,4\nb,1,5,8\nc,5,9,16\nd,3,3,32\ne,2,4,0\n";
    let t = parse("order.csv", csv.as_bytes()).unwrap();
    assert_eq!(t.name, "order");
    let s = 0;
    assert_eq!(
        t.events,
        vec![
            TraceEvent::Alloc {
                id: 0,
                size: 4,
                stream: s
            },
            TraceEvent::Alloc {
                id: 1,
                size: 8,
                stream: s
            },
            TraceEvent::Free { id: 1, stream: s },
            TraceEvent::Alloc {
                id: 2,
                size: 16,
                stream: s
            },
            TraceEvent::Free { id: 2, stream: s },
            TraceEvent::Free { id: 0, stream: s },
        ]
    );
    assert_eq!(t.peak_live_bytes(), 20);
    assert_eq!(
        t.skipped,
        Skipped {
            alloc_failures: 0,
            zero_size: 1,
            empty_lifetimes: 1
        }
    );
    // Header with offsets, and CRLF line ends.
    let csv = "id,lower,upper,size,offset\r\n0,0,2,8,0\r\n1,1,3,8,8\r\n";
    assert_eq!(
        parse("crlf.csv", csv.as_bytes()).unwrap().peak_live_bytes(),
        16
    );
}

#[test]
fn lifetimes_malformed_name_line() {
    let head = "id,lower,upper,size\n0,0,4,8\n";
    for (line, needle) in [
        ("0,1,2,8", "duplicate id `0` (first on line 2)"),
        ("1,1,2,-8", "negative size"),
        ("1,x,2,8", "`lower`"),
        ("1,1,2.5,8", "`upper`"),
        ("1,1,2,8kb", "`size`"),
        ("1,1,2,8,-1", "negative offset"),
        ("1,3,2,8", "below lower"),
        ("1,1,2", "expected 4 or 5 fields"),
        (",1,2,8", "`id`"),
    ] {
        trace_error(
            parse("lt.csv", format!("{head}{line}\n").as_bytes()),
            "lt.csv",
            &["line 3", needle],
        );
    }
    trace_error(
        parse("h.csv", b"id,start,end,size\n"),
        "h.csv",
        &["line 1", "header"],
    );
}

// ------------------------------------------------------ writer and validation

#[test]
fn writer_rejects_inconsistent_events() {
    let mut out = Vec::new();
    let events = [TraceEvent::Free { id: 3, stream: 0 }];
    trace_error(
        write_rmm_log(&events[..], &mut out),
        "<rmm-log writer>",
        &["event 0", "not live"],
    );
    let events = [
        TraceEvent::Alloc {
            id: 0,
            size: 8,
            stream: 0,
        },
        TraceEvent::Alloc {
            id: 0,
            size: 8,
            stream: 0,
        },
    ];
    trace_error(
        write_rmm_log(&events[..], &mut out),
        "<rmm-log writer>",
        &["event 1", "twice"],
    );
}

#[test]
fn writer_renumbers_hand_built_ids_in_allocation_order() {
    let mut t = Trace::new("live-pool", TraceFormat::RmmLog);
    t.events = vec![
        TraceEvent::Alloc {
            id: 5,
            size: 300,
            stream: 2,
        },
        TraceEvent::Alloc {
            id: 9,
            size: 1,
            stream: 3,
        },
        TraceEvent::Free { id: 5, stream: 2 },
    ];
    let mut out = Vec::new();
    write_rmm_log(&t, &mut out).unwrap();
    let text = String::from_utf8(out.clone()).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(
        lines,
        [
            "Thread,Time,Action,Pointer,Size,Stream",
            "0,00:00:00.000000,allocate,0x7f0000000000,300,0x2",
            "0,00:00:00.000001,allocate,0x7f0000000200,1,0x3",
            "0,00:00:00.000002,free,0x7f0000000000,300,0x2",
        ]
    );
    let back = parse("back", &out).unwrap();
    assert_eq!(
        back.events,
        vec![
            TraceEvent::Alloc {
                id: 0,
                size: 300,
                stream: 2
            },
            TraceEvent::Alloc {
                id: 1,
                size: 1,
                stream: 3
            },
            TraceEvent::Free { id: 0, stream: 2 },
        ]
    );
}

#[test]
fn validate_catches_hand_built_mistakes() {
    let mut t = Trace::new("hand", TraceFormat::Lifetimes);
    t.events = vec![
        TraceEvent::Alloc {
            id: 0,
            size: 8,
            stream: 0,
        },
        TraceEvent::Free { id: 0, stream: 0 },
        TraceEvent::Free { id: 0, stream: 0 },
    ];
    trace_error(t.validate(), "hand", &["event 2", "freed twice"]);
    t.events = vec![TraceEvent::Alloc {
        id: 1,
        size: 8,
        stream: 0,
    }];
    trace_error(t.validate(), "hand", &["event 0", "not below"]);
    t.events = vec![
        TraceEvent::Alloc {
            id: 0,
            size: 8,
            stream: 0,
        },
        TraceEvent::Alloc {
            id: 0,
            size: 8,
            stream: 0,
        },
    ];
    trace_error(t.validate(), "hand", &["event 1", "allocated twice"]);
    t.events = vec![
        TraceEvent::Free { id: 0, stream: 0 },
        TraceEvent::Alloc {
            id: 0,
            size: 8,
            stream: 0,
        },
    ];
    trace_error(t.validate(), "hand", &["event 0", "before its allocation"]);
    assert_eq!(t.id_bound(), 1);
    assert_eq!((t.allocs(), t.frees()), (1, 1));
}
