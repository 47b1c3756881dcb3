//! Out of memory only when the memory is in use (issue 21, invariant 6).
//!
//! Threads on several streams each hold up to ten blocks of 1–64 MiB on a
//! 1 GiB device, a fifth of them used on the thread's second stream too
//! (`record_stream`), with late kernels queued on both streams so that
//! frees really wait. An out-of-memory error is *false* when the most
//! bytes live at any moment of the failing call plus the request fit in
//! the device with room to spare for what other threads may have in
//! flight (one largest block each) and for granule rounding. Every false
//! one is a bug.

use gpupool::backend::sim::SimBackend;
use gpupool::{Error, PoolConfig, Runtime, SimConfig};
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

const MIB: u64 = 1 << 20;
const CAPACITY: u64 = 1 << 30;
const MAX_BLOCK: u64 = 64 * MIB;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

#[derive(Debug, Default)]
struct Tally {
    allocs: AtomicU64,
    ooms: AtomicU64,
    false_ooms: AtomicU64,
    live: AtomicU64,
    peak_live: AtomicU64,
    /// Per thread, the most bytes live since its current call began (the
    /// failing call's wait may span many other threads' allocations).
    windows: Vec<AtomicU64>,
}

impl Tally {
    fn new(threads: u64) -> Tally {
        Tally {
            windows: (0..threads).map(|_| AtomicU64::new(0)).collect(),
            ..Default::default()
        }
    }

    /// Counts `size` bytes more live.
    fn add(&self, size: u64) {
        let now = self.live.fetch_add(size, SeqCst) + size;
        self.peak_live.fetch_max(now, SeqCst);
        for w in &self.windows {
            w.fetch_max(now, SeqCst);
        }
    }
}

/// One simulated device of `capacity` bytes.
fn sim(capacity: u64) -> Arc<SimBackend> {
    Arc::new(
        SimBackend::new(SimConfig {
            devices: 1,
            capacity_bytes: capacity,
            ..Default::default()
        })
        .unwrap(),
    )
}

fn run(seed: u64, threads: u64, per_thread: usize) -> Arc<Tally> {
    let be = sim(CAPACITY);
    let rt = Runtime::with_backend(be.clone(), PoolConfig::default()).unwrap();
    let dev = rt.device(0).unwrap();
    let tally = Arc::new(Tally::new(threads));
    std::thread::scope(|sc| {
        for t in 0..threads {
            let (tally, be) = (tally.clone(), be.clone());
            sc.spawn(move || {
                let mut rng = Rng(seed * 1000 + t + 1);
                let a = dev.new_stream().unwrap();
                let b = dev.new_stream().unwrap();
                let mut held = Vec::new();
                for _ in 0..per_thread {
                    if held.len() >= 10 || (!held.is_empty() && rng.next() % 3 == 0) {
                        let i = (rng.next() % held.len() as u64) as usize;
                        let (blk, size): (gpupool::Block<'_>, u64) = held.swap_remove(i);
                        tally.live.fetch_sub(size, SeqCst);
                        drop(blk);
                        continue;
                    }
                    let size = MIB + rng.next() % (MAX_BLOCK - MIB);
                    let window = &tally.windows[t as usize];
                    window.store(tally.live.load(SeqCst), SeqCst);
                    match dev.alloc(size as usize, &a) {
                        Ok(blk) => {
                            tally.allocs.fetch_add(1, SeqCst);
                            tally.add(size);
                            // A late kernel on the block's stream, and on the
                            // second stream for a fifth of them.
                            be.stall_stream(0, a.handle(), Duration::from_micros(200))
                                .unwrap();
                            if rng.next() % 5 == 0 {
                                be.stall_stream(0, b.handle(), Duration::from_micros(300))
                                    .unwrap();
                                blk.record_stream(&b);
                            }
                            held.push((blk, size));
                        }
                        Err(Error::OutOfMemory(report)) => {
                            tally.ooms.fetch_add(1, SeqCst);
                            let live = window.load(SeqCst);
                            let slack = (threads - 1) * MAX_BLOCK + 16 * MIB;
                            if live + size + slack <= CAPACITY {
                                tally.false_ooms.fetch_add(1, SeqCst);
                                eprintln!("false OOM: {size} B asked with {live} B live: {report}");
                            }
                        }
                        Err(e) => panic!("unexpected error {e:?}"),
                    }
                }
                for (blk, size) in held.drain(..) {
                    tally.live.fetch_sub(size, SeqCst);
                    drop(blk);
                }
            });
        }
    });
    rt.trim().unwrap();
    dev.audit().unwrap();
    assert_eq!(be.integrity_errors(0), 0);
    tally
}

#[test]
fn no_false_out_of_memory_with_many_streams_and_threads() {
    let mut false_ooms = 0;
    for seed in 1..=5 {
        let t = run(seed, 4, 400);
        eprintln!(
            "false_oom: seed {seed}: {} allocs, {} OOM, {} false, peak live {:.0}% of capacity",
            t.allocs.load(SeqCst),
            t.ooms.load(SeqCst),
            t.false_ooms.load(SeqCst),
            t.peak_live.load(SeqCst) as f64 * 100.0 / CAPACITY as f64
        );
        false_ooms += t.false_ooms.load(SeqCst);
    }
    assert_eq!(false_ooms, 0, "out of memory while the memory was free");
}

/// The way to out of memory waits on the host for pending memory; other
/// threads go on freeing meanwhile, on their own streams. That memory is
/// dirty on those streams, and the last attempt must still get it (behind
/// an event on each, a device wait), not fail beside it.
#[test]
fn memory_freed_on_another_stream_during_the_oom_wait_is_used() {
    let be = sim(64 * MIB);
    let rt = Runtime::with_backend(be.clone(), PoolConfig::default()).unwrap();
    let dev = rt.device(0).unwrap();
    let (slow, freer, asker) = (
        dev.new_stream().unwrap(),
        dev.new_stream().unwrap(),
        dev.new_stream().unwrap(),
    );
    // 16 MiB freed behind a stream that stalls for a second: pending, and
    // only a host wait makes it usable.
    let p = dev.alloc(16 * MIB as usize, &slow).unwrap();
    be.stall_stream(0, slow.handle(), Duration::from_secs(1))
        .unwrap();
    drop(p);
    // 40 MiB live on another stream; 8 MiB never used.
    let y = dev.alloc(40 * MIB as usize, &freer).unwrap();
    let waits0 = dev.stats().num_oom_waits;
    std::thread::scope(|sc| {
        // Freed while the request below waits for the stalled stream.
        sc.spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            drop(y);
        });
        // 32 MiB: more than the pending and unused memory together (24
        // MiB) until the 40 MiB block is freed.
        let b = dev.alloc(32 * MIB as usize, &asker);
        assert!(
            b.is_ok(),
            "out of memory with nothing live: {}",
            b.err().unwrap()
        );
    });
    assert!(
        dev.stats().num_oom_waits > waits0,
        "the request never waited"
    );
    rt.trim().unwrap();
    dev.audit().unwrap();
}
