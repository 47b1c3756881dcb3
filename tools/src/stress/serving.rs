//! The serving workload: an inference server's batch of requests.
//!
//! Each tick may admit a request (while fewer than [`MAX_BATCH`] are
//! active): a prefill activation buffer proportional to its sequence length
//! lives only for the prefill, its KV-cache buffer for the request's whole
//! life. Every tick, each active request runs a decode step with a
//! short-lived activation buffer; one step in eight grows its KV cache by
//! reallocating it larger (allocate, write, free the old one). Finished
//! requests free their KV buffers in whatever order they finish, some
//! from another stream (the response path). Out of memory evicts the
//! oldest request, as a server preempts.

use super::worker::{Item, Worker};
use super::workload::ServingShape;
use gpupool::Result;
use std::collections::VecDeque;

/// Most concurrent requests per thread.
pub const MAX_BATCH: usize = 16;

struct Request<'a> {
    kv: Item<'a>,
    tokens: u64,
    steps_left: u32,
}

/// Serves requests until the run stops; every block is freed on return.
pub(crate) fn run(w: &mut Worker<'_>, shape: ServingShape) -> Result<()> {
    let mut active = VecDeque::new();
    let result = serve(w, shape, &mut active);
    for r in active.drain(..) {
        w.retire(r.kv)?;
    }
    result
}

fn serve<'a>(
    w: &mut Worker<'a>,
    shape: ServingShape,
    active: &mut VecDeque<Request<'a>>,
) -> Result<()> {
    while !w.stopped() {
        if active.len() < MAX_BATCH && (active.is_empty() || w.rng.chance(30)) {
            admit(w, shape, active)?;
        }
        let mut i = 0;
        while i < active.len() {
            decode(w, shape, &mut active[i])?;
            if active[i].steps_left == 0 {
                let done = active.remove(i).expect("index in range");
                w.retire(done.kv)?;
            } else {
                i += 1;
            }
        }
    }
    Ok(())
}

/// Allocates on `si`, evicting the oldest requests while out of memory.
fn alloc_evicting<'a>(
    w: &mut Worker<'a>,
    active: &mut VecDeque<Request<'a>>,
    size: u64,
    si: usize,
) -> Result<Option<Item<'a>>> {
    loop {
        if let Some(it) = w.alloc(size, si)? {
            return Ok(Some(it));
        }
        match active.pop_front() {
            Some(old) => w.retire(old.kv)?,
            None => return Ok(None),
        }
    }
}

fn admit<'a>(
    w: &mut Worker<'a>,
    shape: ServingShape,
    active: &mut VecDeque<Request<'a>>,
) -> Result<()> {
    let si = w.home_stream();
    let tokens = shape.tokens(&mut w.rng);
    let steps_left = shape.lifetime_steps(&mut w.rng);
    let Some(kv) = alloc_evicting(w, active, tokens * shape.kv_bytes_per_token, si)? else {
        return Ok(());
    };
    // The prefill's activations die when the prefill is done; the KV
    // cache it filled stays.
    match alloc_evicting(w, active, tokens * shape.act_bytes_per_token, si)? {
        Some(prefill) => w.retire(prefill)?,
        None => {
            w.retire(kv)?;
            return Ok(());
        }
    }
    active.push_back(Request {
        kv,
        tokens,
        steps_left,
    });
    Ok(())
}

fn decode<'a>(w: &mut Worker<'a>, shape: ServingShape, r: &mut Request<'a>) -> Result<()> {
    r.steps_left -= 1;
    let si = r.kv.stream;
    let size = shape.step_bytes(&mut w.rng);
    if let Some(tmp) = w.alloc(size, si)? {
        w.retire(tmp)?;
    }
    if w.rng.chance(12) {
        // The cache grows by the tokens decoded since the last growth.
        let tokens = r.tokens + 8;
        if let Some(bigger) = w.alloc(tokens * shape.kv_bytes_per_token, si)? {
            let old = std::mem::replace(&mut r.kv, bigger);
            r.tokens = tokens;
            w.retire(old)?;
        }
    }
    Ok(())
}
