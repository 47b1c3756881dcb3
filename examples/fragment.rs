//! Runs the fragmentation workload (`gpupool::compact::fragment`) and
//! prints its JSON report; `gpupool stress --fragment` runs the same.
//!
//! `cargo run --release --example fragment -- [blocks] [passes] [pass_blocks] [load_threads]`

use gpupool::compact::fragment::{run, FragmentOptions};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut o = FragmentOptions::default();
    let args: Vec<u64> = std::env::args()
        .skip(1)
        .map(|a| a.parse())
        .collect::<Result<_, _>>()?;
    if let Some(&b) = args.first() {
        o.blocks = b as usize;
    }
    if let Some(&p) = args.get(1) {
        o.passes = p as usize;
    }
    if let Some(&p) = args.get(2) {
        o.pass_blocks = p as usize;
    }
    if let Some(&t) = args.get(3) {
        o.load_threads = t as usize;
    }
    let t0 = std::time::Instant::now();
    let r = run(&o)?;
    println!("{}", serde_json::to_string_pretty(&r)?);
    eprintln!("wall {:.2} s", t0.elapsed().as_secs_f64());
    Ok(())
}
