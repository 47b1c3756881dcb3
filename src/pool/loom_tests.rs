//! Loom models of the pool's lock-free cores. Run with
//! `RUSTFLAGS="--cfg loom" cargo test --release --lib loom`.
//!
//! Each model explores every interleaving (bounded by loom's preemption
//! bound) of a few threads on the structure and checks its invariants.

use super::pending::PendingList;
use super::stack::{collect_chain, IndexStack, Links, NIL};
use super::sync::AtomicU32;
use loom::sync::Arc;
use loom::thread;

struct VecLinks(Vec<AtomicU32>);

impl Links for VecLinks {
    fn link(&self, idx: u32) -> &AtomicU32 {
        &self.0[idx as usize]
    }
}

fn links(n: u32) -> VecLinks {
    VecLinks((0..n).map(|_| AtomicU32::new(NIL)).collect())
}

fn drain(s: &IndexStack, l: &VecLinks) -> Vec<u32> {
    let mut v = Vec::new();
    collect_chain(l, s.take_all(), &mut v);
    v.sort_unstable();
    v
}

/// Two threads pop and push back concurrently (the ABA scenario: A pops
/// x, B pops x and y and pushes x back, A's stale CAS must fail). No index
/// is lost or duplicated, and no index is popped twice at once.
#[test]
fn loom_stack_pop_push_is_aba_safe() {
    loom::model(|| {
        let l = Arc::new(links(3));
        let s = Arc::new(IndexStack::new());
        for i in 0..3 {
            s.push(&*l, i);
        }
        let t = {
            let (l, s) = (l.clone(), s.clone());
            thread::spawn(move || {
                let a = s.pop(&*l);
                if let Some(a) = a {
                    s.push(&*l, a);
                }
                a
            })
        };
        let x = s.pop(&*l);
        let y = s.pop(&*l);
        if let (Some(x), Some(y)) = (x, y) {
            assert_ne!(x, y);
        }
        if let Some(x) = x {
            s.push(&*l, x);
        }
        if let Some(y) = y {
            s.push(&*l, y);
        }
        t.join().unwrap();
        assert_eq!(drain(&s, &l), vec![0, 1, 2]);
    });
}

/// A concurrent pop and a holder of two popped indices never see the same
/// index (exclusive ownership).
#[test]
fn loom_stack_pops_are_exclusive() {
    loom::model(|| {
        let l = Arc::new(links(2));
        let s = Arc::new(IndexStack::new());
        s.push(&*l, 0);
        s.push(&*l, 1);
        let t = {
            let (l, s) = (l.clone(), s.clone());
            thread::spawn(move || s.pop(&*l))
        };
        let mine = s.pop(&*l);
        let theirs = t.join().unwrap();
        match (mine, theirs) {
            (Some(a), Some(b)) => assert_ne!(a, b),
            other => panic!("two pops of a two-element stack must both succeed: {other:?}"),
        }
        assert!(s.is_empty());
    });
}

/// `take_all` racing with pushes: every index ends up either in the taken
/// chain or on the stack, exactly once.
#[test]
fn loom_stack_take_all_races_push() {
    loom::model(|| {
        let l = Arc::new(links(3));
        let s = Arc::new(IndexStack::new());
        s.push(&*l, 0);
        let t = {
            let (l, s) = (l.clone(), s.clone());
            thread::spawn(move || {
                s.push(&*l, 1);
                s.push(&*l, 2);
            })
        };
        let mut taken = Vec::new();
        collect_chain(&*l, s.take_all(), &mut taken);
        t.join().unwrap();
        taken.extend(drain(&s, &l));
        taken.sort_unstable();
        assert_eq!(taken, vec![0, 1, 2]);
    });
}

/// The pending list: a producer pushes while a harvester takes everything
/// and pushes back what is "not complete". Every record is seen exactly once.
#[test]
fn loom_pending_list_loses_nothing() {
    loom::model(|| {
        let list = Arc::new(PendingList::new());
        list.push(0u32);
        let producer = {
            let list = list.clone();
            thread::spawn(move || {
                list.push(1);
                list.push(2);
            })
        };
        // Harvest once concurrently: keep even values, push odd ones back.
        let mut kept = Vec::new();
        for v in list.take_all() {
            if v % 2 == 0 {
                kept.push(v);
            } else {
                list.push(v);
            }
        }
        producer.join().unwrap();
        kept.extend(list.take_all());
        kept.sort_unstable();
        assert_eq!(kept, vec![0, 1, 2]);
        assert_eq!(list.len(), 0);
    });
}
