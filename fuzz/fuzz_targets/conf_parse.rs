#![no_main]
//! `GPUPOOL_CONF` parsing: never panics; a string that parses parses the
//! same way again.

use gpupool::PoolConfig;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let s = String::from_utf8_lossy(data);
    if let Ok(c) = PoolConfig::parse(&s) {
        let again = PoolConfig::parse(&s).expect("second parse of an accepted string failed");
        assert_eq!(c, again, "parse is not deterministic for {s:?}");
    }
});
