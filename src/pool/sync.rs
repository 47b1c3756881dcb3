//! Atomics that `loom` can model: under `--cfg loom` the lock-free cores are
//! built on loom's types, otherwise on std's.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicPtr, AtomicU32, AtomicU64, AtomicUsize};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicPtr, AtomicU32, AtomicU64, AtomicUsize};
