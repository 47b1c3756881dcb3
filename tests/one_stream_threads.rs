//! A stream's memory stays its own while no other stream needs it: a
//! single-stream workload, with one thread or several, never takes the
//! at-capacity path (which flushes every stream's free memory behind an
//! event) on a device far from full (`pool/large.rs`, before growth).

mod common;

use std::collections::VecDeque;

/// A runtime over one simulated 1 GiB device, without the maintenance
/// thread (whose harvests would hide a missing one on the allocation
/// path), its reservation `va_factor` times the device.
fn runtime(va_factor: u64) -> gpupool::Runtime {
    common::sim_runtime(&format!(
        "backend=sim,devices=1,capacity=1GiB,va_factor={va_factor}"
    ))
    .0
}

/// `n` raw blocks of 1..=16 MiB from xorshift seed `seed`, each freed
/// once `hold` newer ones are live.
fn churn(dev: &gpupool::DevicePool, stream: &gpupool::Stream, seed: u64, n: usize, hold: usize) {
    let mut x = seed | 1;
    let mut held = VecDeque::new();
    for _ in 0..n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let len = ((x % 16) + 1) << 20;
        held.push_back(dev.alloc_raw(len as usize, stream).unwrap());
        if held.len() > hold {
            dev.free_raw(held.pop_front().unwrap(), stream).unwrap();
        }
    }
    for p in held {
        dev.free_raw(p, stream).unwrap();
    }
}

#[test]
fn stitching_in_one_thread_never_runs_out_of_addresses() {
    // Every stitch quarantines the old address of the granule it takes
    // until the granule's last uses complete. With the reservation equal
    // to the device, those addresses ran out after a few hundred stitches
    // when nothing harvested them, and requests on a device a fifth full
    // took the at-capacity path.
    let rt = runtime(1);
    let dev = rt.device(0).unwrap();
    let stream = dev.new_stream().unwrap();
    churn(dev, &stream, 0x9e37_79b9_7f4a_7c15, 20_000, 6);
    let st = dev.stats();
    assert!(st.num_device_allocs > 0 && st.reserved_bytes.peak < 400 << 20);
    assert_eq!(
        st.num_alloc_retries,
        0,
        "requests took the at-capacity path with at most {} MiB reserved",
        st.reserved_bytes.peak >> 20
    );
}

#[test]
fn threads_sharing_one_stream_never_flush_it() {
    let rt = runtime(4);
    let dev = rt.device(0).unwrap();
    let stream = dev.new_stream().unwrap();
    std::thread::scope(|s| {
        for t in 0..2u64 {
            let (dev, stream) = (&dev, &stream);
            s.spawn(move || churn(dev, stream, 0x9e37_79b9_7f4a_7c15 ^ (t << 32), 20_000, 6));
        }
    });
    let st = dev.stats();
    assert_eq!(st.num_alloc_retries, 0);
    assert_eq!(
        st.num_handovers, 0,
        "the stream's own memory was handed back to it"
    );
}
