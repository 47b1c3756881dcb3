//! A loop that repeats its requests reaches a steady state: after its first
//! iterations, the pool takes no slow path, makes no driver call and no
//! host heap allocation, on one stream, on several streams one thread
//! takes turns on, and on several threads at once. Host allocations are
//! counted by this binary's global allocator, per thread.

use gpupool::backend::sim::SimConfig;
use gpupool::backend::BackendCounters;
use gpupool::{BackendKind, DevicePool, Runtime, Stream};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::Barrier;

struct Counting;

thread_local! {
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: forwards every call to the system allocator unchanged; the count
// is a const-initialized thread-local without a destructor, so counting
// allocates nothing and works during thread exit (`try_with`).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

/// Host allocations made by this thread so far.
fn host_allocs() -> u64 {
    ALLOCS.with(Cell::get)
}

const MIB: usize = 1 << 20;

fn runtime() -> Runtime {
    Runtime::builder()
        .backend(BackendKind::Sim(SimConfig {
            capacity_bytes: 1 << 30,
            ..Default::default()
        }))
        // No background harvester: its passes are not the loop's.
        .maintenance(false)
        .build()
        .unwrap()
}

/// One iteration of a loop on `s`: blocks of `sizes` allocated in turn,
/// two live at a time, every block freed on its stream.
fn iteration(dev: &DevicePool, s: &Stream, sizes: &[usize]) {
    let mut prev = None;
    for &n in sizes {
        let b = dev.alloc(n, s).unwrap();
        drop(prev.replace(b));
    }
}

/// What the pool did over a measured stretch.
struct Stretch {
    slow_paths: u64,
    driver: BackendCounters,
    host_allocs: u64,
}

impl Stretch {
    fn assert_steady(&self, what: &str) {
        assert_eq!(self.slow_paths, 0, "{what}: slow paths");
        assert_eq!(
            self.driver.total_calls(),
            0,
            "{what}: driver calls {:?}",
            self.driver.nonzero_calls()
        );
        assert_eq!(self.host_allocs, 0, "{what}: host allocations");
    }
}

fn slow_paths(dev: &DevicePool) -> u64 {
    let s = dev.stats();
    s.num_small_slow_paths + s.num_large_slow_paths
}

/// Runs `warm` then `measured` iterations of `sizes` on this thread,
/// taking turns on `streams`.
fn one_thread(dev: &DevicePool, streams: &[Stream], sizes: &[usize]) -> Stretch {
    let run = |n: usize| {
        for i in 0..n {
            iteration(dev, &streams[i % streams.len()], sizes);
        }
    };
    run(64);
    let (slow, c) = (slow_paths(dev), dev.backend().counters());
    let a = host_allocs();
    run(20_000);
    // Read first: reading the statistics allocates.
    let host_allocs = host_allocs() - a;
    Stretch {
        slow_paths: slow_paths(dev) - slow,
        driver: dev.backend().counters().since(&c),
        host_allocs,
    }
}

/// Small and large sizes, the same every iteration.
const FIXED: [usize; 4] = [4096, 3 * MIB, 700, 64 << 10];
/// Large sizes that change from one block to the next: no parked range
/// fits the next request exactly.
const VARYING: [usize; 6] = [4096, 3 * MIB, 700, 12 * MIB, 64 << 10, 5 * MIB];

#[test]
fn one_stream_repeating_its_sizes_makes_no_driver_call_and_no_host_allocation() {
    let rt = runtime();
    let dev = rt.device(0).unwrap();
    let s = [dev.new_stream().unwrap()];
    one_thread(dev, &s, &FIXED).assert_steady("fixed sizes");
    one_thread(dev, &s, &VARYING).assert_steady("varying sizes");
}

#[test]
fn one_thread_taking_turns_on_four_streams_reaches_a_steady_state() {
    let rt = runtime();
    let dev = rt.device(0).unwrap();
    let streams: Vec<Stream> = (0..4).map(|_| dev.new_stream().unwrap()).collect();
    let r = one_thread(dev, &streams, &FIXED);
    r.assert_steady("4 streams in turn");
    // A range per stream, not one per request: the device holds little
    // beyond the streams' blocks.
    let st = dev.stats();
    assert!(
        st.reserved_bytes.current <= 64 * MIB as u64,
        "reserved {}",
        st.reserved_bytes.current
    );
}

#[test]
fn four_threads_each_on_its_stream_reach_a_steady_state_together() {
    let rt = runtime();
    let dev = rt.device(0).unwrap();
    let threads = 4;
    let barrier = Barrier::new(threads + 1);
    let (stretch, host_allocs) = std::thread::scope(|sc| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                sc.spawn(|| {
                    let s = dev.new_stream().unwrap();
                    // Every thread's blocks live at once: each stream
                    // parks memory of its own, as overlapping threads
                    // need (on 2 cores, iterations alone rarely overlap
                    // before the measured ones).
                    let held: Vec<_> = FIXED.iter().map(|&n| dev.alloc(n, &s).unwrap()).collect();
                    barrier.wait();
                    drop(held);
                    for _ in 0..64 {
                        iteration(dev, &s, &FIXED);
                    }
                    barrier.wait(); // warm
                    barrier.wait(); // counters read
                    let a = host_allocs();
                    for _ in 0..20_000 {
                        iteration(dev, &s, &FIXED);
                    }
                    let n = host_allocs() - a;
                    barrier.wait(); // done
                    barrier.wait(); // counters read, before the stream goes
                    n
                })
            })
            .collect();
        barrier.wait(); // held
        barrier.wait(); // warm
        let (slow, c) = (slow_paths(dev), dev.backend().counters());
        barrier.wait(); // counters read
        barrier.wait(); // done
        let stretch = (slow_paths(dev) - slow, dev.backend().counters().since(&c));
        barrier.wait();
        let host = workers.into_iter().map(|w| w.join().unwrap()).sum::<u64>();
        (stretch, host)
    });
    let (slow_paths, driver) = stretch;
    Stretch {
        slow_paths,
        driver,
        host_allocs,
    }
    .assert_steady("4 threads");
}
