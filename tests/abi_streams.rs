//! A thread taking turns on more streams than it remembers
//! (`src/ffi/thread.rs`, `recent_streams`), with streams destroyed and
//! made again between turns: every call names the stream it means. Its
//! own test binary: the ABI's runtime is process-wide.

use gpupool::ffi::{
    gpupool_alloc, gpupool_free, gpupool_init, gpupool_memory_stats_json, gpupool_shutdown,
    gpupool_stream_create, gpupool_stream_destroy, GpupoolStatus,
};
use std::ffi::c_void;

const OK: i32 = GpupoolStatus::Ok as i32;
const CONF: &std::ffi::CStr =
    c"backend=sim,devices=1,backing=accounting,capacity=256MiB,maint_ms=0";

fn stream() -> *mut c_void {
    let mut s = std::ptr::null_mut();
    // SAFETY: `s` is valid for one pointer write.
    assert_eq!(unsafe { gpupool_stream_create(0, &mut s) }, OK);
    s
}

fn alloc(size: usize, s: *mut c_void) -> (i32, *mut c_void) {
    let mut p = std::ptr::null_mut();
    // SAFETY: `p` is valid for one pointer write.
    let rc = unsafe { gpupool_alloc(size, 0, s, &mut p) };
    (rc, p)
}

/// `"allocated_bytes.all.current"` of device 0.
fn allocated() -> u64 {
    let mut buf = vec![0u8; 1 << 16];
    // SAFETY: `buf` is valid for `buf.len()` bytes.
    let rc = unsafe { gpupool_memory_stats_json(0, buf.as_mut_ptr().cast(), buf.len()) };
    assert_eq!(rc, OK);
    let text = std::ffi::CStr::from_bytes_until_nul(&buf)
        .unwrap()
        .to_str()
        .unwrap();
    let v: serde_json::Value = serde_json::from_str(text).unwrap();
    v["allocated_bytes.all.current"].as_u64().unwrap()
}

#[test]
fn turns_on_more_streams_than_remembered_name_the_right_stream() {
    // SAFETY: a NUL-terminated string that outlives the call.
    assert_eq!(unsafe { gpupool_init(CONF.as_ptr()) }, OK);
    let mut streams: Vec<*mut c_void> = (0..6).map(|_| stream()).collect();
    streams.push(std::ptr::null_mut());
    let mut held = Vec::new();
    for round in 0..200usize {
        for (i, &s) in streams.iter().enumerate() {
            // A small block and a large one, freed on the stream they were
            // made for one turn later.
            for size in [4096 + 256 * i, (3 << 20) + 4096 * i] {
                let (rc, p) = alloc(size, s);
                assert_eq!(rc, OK, "round {round} stream {i}");
                held.push((p, s));
            }
            if held.len() > 2 * streams.len() {
                for (p, s) in held.drain(..2) {
                    assert_eq!(gpupool_free(p, 0, s), OK);
                }
            }
        }
        if round % 7 == 3 {
            // Destroy a stream the thread remembers (its blocks freed
            // first) and make a new one, which the simulator may give the
            // same handle: calls on it must reach the new stream.
            let victim = streams[round % 6];
            held.retain(|&(p, s)| {
                if s == victim {
                    assert_eq!(gpupool_free(p, 0, s), OK);
                }
                s != victim
            });
            assert_eq!(gpupool_stream_destroy(0, victim), OK);
            let again = stream();
            if again != victim {
                // A handle destroyed and not made again is refused.
                assert_eq!(alloc(4096, victim).0, GpupoolStatus::InvalidHandle as i32);
            }
            streams[round % 6] = again;
        }
    }
    for (p, s) in held.drain(..) {
        assert_eq!(gpupool_free(p, 0, s), OK);
    }
    assert_eq!(allocated(), 0);
    for &s in &streams[..6] {
        assert_eq!(gpupool_stream_destroy(0, s), OK);
    }
    assert_eq!(gpupool_shutdown(), OK);
}
