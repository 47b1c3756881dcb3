//! The calling thread's current CUDA context, saved and restored around
//! every entry into the backend.
//!
//! The driver keeps one "current context" per host thread, and the CUDA
//! runtime (PyTorch, CuPy) derives its current device from it. A backend
//! call on device 1 made from a thread whose current device is 0 must make
//! device 1's primary context current for its driver calls and then put
//! device 0's back, or the caller's later runtime calls silently go to
//! device 1. [`CtxGuard`] does that: it reads the current context, switches
//! only where it differs from the target, and restores the saved one
//! (possibly none) when dropped, on every return path.
//!
//! The logic is written against [`CurrentContext`], so that a fake
//! thread-local cell tests it without a driver; [`Driver`] is the real one
//! (`cuCtxGetCurrent` / `cuCtxSetCurrent`).

use super::driver::check;
use crate::error::Result;
use cudarc::driver::sys;
use std::marker::PhantomData;
use std::ptr;

/// A context handle (null: none), shareable between threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ctx(pub(super) sys::CUcontext);

// SAFETY: a CUcontext is an opaque driver handle, not memory Rust reads or
// writes. The driver API is thread safe and a context may be made current on
// (and used from) any thread, which is exactly how this module uses it.
unsafe impl Send for Ctx {}
// SAFETY: as above; sharing the handle value only lets threads pass it to
// the (thread-safe) driver.
unsafe impl Sync for Ctx {}

/// A thread's "current context" slot.
pub(crate) trait CurrentContext {
    /// A context handle (none current: the null handle).
    type Ctx: Copy + PartialEq + std::fmt::Debug;
    /// The calling thread's current context (`cuCtxGetCurrent`).
    fn current(&self) -> Result<Self::Ctx>;
    /// Makes `ctx` current on the calling thread (`cuCtxSetCurrent`).
    fn make_current(&self, ctx: Self::Ctx) -> Result<()>;
}

/// The driver's current-context slot.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Driver;

impl CurrentContext for Driver {
    type Ctx = Ctx;

    fn current(&self) -> Result<Ctx> {
        let mut cur: sys::CUcontext = ptr::null_mut();
        // SAFETY: `cur` is a valid out-pointer; the symbol was resolved when
        // the backend was opened.
        check("cuCtxGetCurrent", unsafe { sys::cuCtxGetCurrent(&mut cur) })?;
        Ok(Ctx(cur))
    }

    fn make_current(&self, ctx: Ctx) -> Result<()> {
        // SAFETY: `ctx` is either null (unbinds the thread's context) or a
        // context that is live: a primary context the backend retains, or
        // the context the caller had current when a guard saved it.
        check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(ctx.0) })
    }
}

/// While alive, the target context is current on this thread; on drop the
/// context that was current before is current again.
///
/// Not `Send`: the current context belongs to the thread that made it so.
/// Guards nest (each restores what it saw), and must be dropped in reverse
/// order of creation, which scoping gives.
#[must_use = "the target context is current only while the guard lives"]
pub(crate) struct CtxGuard<'a, A: CurrentContext> {
    api: &'a A,
    /// The caller's context, where the guard switched away from it.
    restore: Option<A::Ctx>,
    _not_send: PhantomData<*const ()>,
}

impl<'a, A: CurrentContext> CtxGuard<'a, A> {
    /// Makes `target` current (only if it is not already) and remembers
    /// what to restore. On an error nothing was changed.
    pub(crate) fn enter(api: &'a A, target: A::Ctx) -> Result<Self> {
        let saved = api.current()?;
        let restore = if saved == target {
            None
        } else {
            api.make_current(target)?;
            Some(saved)
        };
        Ok(CtxGuard {
            api,
            restore,
            _not_send: PhantomData,
        })
    }

    /// Whether entering switched contexts (and dropping will switch back).
    #[cfg(test)]
    pub(crate) fn switched(&self) -> bool {
        self.restore.is_some()
    }
}

impl<A: CurrentContext> Drop for CtxGuard<'_, A> {
    fn drop(&mut self) {
        if let Some(prev) = self.restore.take() {
            if let Err(e) = self.api.make_current(prev) {
                // Nothing can be returned from drop; the caller's next
                // driver call would see the failure too.
                tracing::error!("could not restore the caller's CUDA context {prev:?}: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use std::cell::{Cell, RefCell};

    /// A fake thread's current-context cell: 0 is "no context".
    #[derive(Default)]
    struct Fake {
        cur: Cell<u32>,
        sets: RefCell<Vec<u32>>,
        fail_get: Cell<bool>,
        fail_set_to: Cell<Option<u32>>,
    }

    impl CurrentContext for Fake {
        type Ctx = u32;
        fn current(&self) -> Result<u32> {
            if self.fail_get.get() {
                return Err(Error::backend("cuCtxGetCurrent", "fake failure"));
            }
            Ok(self.cur.get())
        }
        fn make_current(&self, ctx: u32) -> Result<()> {
            if self.fail_set_to.get() == Some(ctx) {
                return Err(Error::backend("cuCtxSetCurrent", "fake failure"));
            }
            self.sets.borrow_mut().push(ctx);
            self.cur.set(ctx);
            Ok(())
        }
    }

    fn fake(cur: u32) -> Fake {
        let f = Fake::default();
        f.cur.set(cur);
        f
    }

    #[test]
    fn switches_to_the_target_and_restores_the_callers_context() {
        let f = fake(7);
        {
            let g = CtxGuard::enter(&f, 3).unwrap();
            assert!(g.switched());
            assert_eq!(f.cur.get(), 3);
        }
        assert_eq!(f.cur.get(), 7);
        assert_eq!(*f.sets.borrow(), vec![3, 7]);
    }

    #[test]
    fn no_driver_call_when_the_target_is_already_current() {
        let f = fake(3);
        {
            let g = CtxGuard::enter(&f, 3).unwrap();
            assert!(!g.switched());
        }
        assert_eq!(f.cur.get(), 3);
        assert!(f.sets.borrow().is_empty());
    }

    #[test]
    fn a_thread_with_no_context_gets_none_back() {
        let f = fake(0);
        drop(CtxGuard::enter(&f, 5).unwrap());
        assert_eq!(f.cur.get(), 0);
        assert_eq!(*f.sets.borrow(), vec![5, 0]);
    }

    #[test]
    fn nested_guards_restore_in_reverse_order() {
        // A call on device 1 (ctx 2) that reaches device 0 (ctx 1), from a
        // caller whose own context is 9.
        let f = fake(9);
        {
            let _outer = CtxGuard::enter(&f, 2).unwrap();
            {
                let _inner = CtxGuard::enter(&f, 1).unwrap();
                assert_eq!(f.cur.get(), 1);
                // The same device again: no switch.
                let same = CtxGuard::enter(&f, 1).unwrap();
                assert!(!same.switched());
            }
            assert_eq!(f.cur.get(), 2);
        }
        assert_eq!(f.cur.get(), 9);
        assert_eq!(*f.sets.borrow(), vec![2, 1, 2, 9]);
    }

    #[test]
    fn restored_on_every_return_path() {
        fn work(f: &Fake, fail: bool) -> Result<u32> {
            let _g = CtxGuard::enter(f, 4)?;
            if fail {
                return Err(Error::backend("cuMemMap", "fake"));
            }
            Ok(f.cur.get())
        }
        let f = fake(8);
        assert_eq!(work(&f, false).unwrap(), 4);
        assert_eq!(f.cur.get(), 8);
        assert!(work(&f, true).is_err());
        assert_eq!(f.cur.get(), 8);
        // A panic unwinding through the guard restores too.
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _g = CtxGuard::enter(&f, 4).unwrap();
            panic!("boom");
        }));
        assert!(r.is_err());
        assert_eq!(f.cur.get(), 8);
    }

    #[test]
    fn failures_to_read_or_switch_change_nothing() {
        let f = fake(6);
        f.fail_get.set(true);
        assert!(CtxGuard::enter(&f, 2).is_err());
        assert_eq!(f.cur.get(), 6);
        assert!(f.sets.borrow().is_empty());

        let f = fake(6);
        f.fail_set_to.set(Some(2));
        assert!(CtxGuard::enter(&f, 2).is_err());
        assert_eq!(f.cur.get(), 6);
        assert!(f.sets.borrow().is_empty(), "nothing to restore");
    }

    #[test]
    fn a_failed_restore_is_logged_not_panicked() {
        let f = fake(6);
        let g = CtxGuard::enter(&f, 2).unwrap();
        f.fail_set_to.set(Some(6));
        drop(g);
        assert_eq!(f.cur.get(), 2);
    }
}
