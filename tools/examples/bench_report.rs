//! Runs the full benchmark (`--quick` for the short one) and prints the
//! JSON report, then the table:
//! `cargo run --release --example bench_report [-- --quick]`.

use gpupool_tools::bench::{run, BenchOptions};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let quick = std::env::args().any(|a| a == "--quick");
    let report = run(&BenchOptions {
        quick,
        ..Default::default()
    })?;
    println!("{}", serde_json::to_string_pretty(&report)?);
    println!();
    print!("{report}");
    Ok(())
}
