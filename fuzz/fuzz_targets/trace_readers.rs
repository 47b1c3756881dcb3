#![no_main]
//! The trace readers on arbitrary bytes: errors are fine, panics are not.

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    for name in ["fuzz.pickle", "fuzz.csv"] {
        if let Ok(t) = gpupool_tools::trace::parse(name, data) {
            // Touch the derived figures too.
            let _ = (t.allocs(), t.frees(), t.id_bound(), t.peak_live_bytes());
        }
    }
});
