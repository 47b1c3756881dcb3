//! The training workload: forward/backward phases per step.
//!
//! A few long-lived "weights" stay allocated and one is replaced now and
//! then (optimizer state resized). Each step allocates 4..=24 activations
//! layer by layer (with short-lived workspaces in between), then frees
//! them mostly in reverse order, each after a gradient temporary half its
//! size; one free in ten takes a random activation instead of the last, as
//! autograd does when a tensor dies early. Out of memory during the forward
//! pass ends it early, as a smaller micro-batch would.

use super::worker::{Item, Worker};
use super::workload::TrainingSizes;
use gpupool::Result;

/// Long-lived blocks per thread.
const WEIGHTS: usize = 4;

/// Runs steps until the run stops; every block is freed on return.
pub(crate) fn run(w: &mut Worker<'_>, sizes: TrainingSizes) -> Result<()> {
    let mut weights = Vec::new();
    let result = steps(w, sizes, &mut weights);
    for it in weights.drain(..) {
        w.retire(it)?;
    }
    result
}

fn steps<'a>(w: &mut Worker<'a>, sizes: TrainingSizes, weights: &mut Vec<Item<'a>>) -> Result<()> {
    for _ in 0..WEIGHTS {
        let si = w.home_stream();
        let size = sizes.draw(&mut w.rng);
        if let Some(it) = w.alloc(size, si)? {
            weights.push(it);
        }
    }
    let mut acts: Vec<Item<'a>> = Vec::new();
    while !w.stopped() {
        let r = step(w, sizes, &mut acts);
        for it in acts.drain(..).rev() {
            w.retire(it)?;
        }
        r?;
        if !weights.is_empty() && w.rng.chance(5) {
            let old = weights.swap_remove(w.rng.below(weights.len()));
            w.retire(old)?;
            let si = w.home_stream();
            let size = sizes.draw(&mut w.rng);
            if let Some(it) = w.alloc(size, si)? {
                weights.push(it);
            }
        }
    }
    Ok(())
}

/// One forward and backward pass; activations left in `acts` on error.
fn step<'a>(w: &mut Worker<'a>, sizes: TrainingSizes, acts: &mut Vec<Item<'a>>) -> Result<()> {
    // Most work goes to the thread's first ("compute") stream.
    let compute = w.home_stream();
    let depth = w.rng.range(4, 24) as usize;
    for _ in 0..depth {
        let si = if w.rng.chance(80) {
            compute
        } else {
            w.home_stream()
        };
        let size = sizes.draw(&mut w.rng);
        match w.alloc(size, si)? {
            Some(it) => acts.push(it),
            None => break,
        }
        if w.rng.chance(25) {
            let ws = w.rng.log_uniform(512, 1 << 20);
            if let Some(tmp) = w.alloc(ws, si)? {
                w.retire(tmp)?;
            }
        }
    }
    while !acts.is_empty() {
        let i = if w.rng.chance(10) {
            w.rng.below(acts.len())
        } else {
            acts.len() - 1
        };
        let a = acts.swap_remove(i);
        let grad = (a.len / 2 + 512).min(64 << 20);
        if let Some(tmp) = w.alloc(grad, a.stream)? {
            w.retire(tmp)?;
        }
        w.retire(a)?;
    }
    Ok(())
}
