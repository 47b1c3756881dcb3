//! `include/gpupool.h` is generated from `src/ffi/` (`mod.rs` and the
//! modules it declares, in order) by cbindgen and checked in; this test
//! fails when it is stale.
//! `GPUPOOL_BLESS=1 cargo test --test header` rewrites it.

use std::path::Path;

fn generate() -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(root.join("cbindgen.toml"))
        .unwrap_or_else(|e| panic!("reading cbindgen.toml: {e}"));
    let bindings = cbindgen::Builder::new()
        .with_config(config)
        .with_src(root.join("src/ffi/mod.rs"))
        .generate()
        .unwrap_or_else(|e| panic!("cbindgen: {e}"));
    let mut out = Vec::new();
    bindings.write(&mut out);
    String::from_utf8(out).expect("cbindgen writes UTF-8")
}

#[test]
fn header_is_up_to_date() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("include/gpupool.h");
    let fresh = generate();
    if std::env::var_os("GPUPOOL_BLESS").is_some_and(|v| v == "1") {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &fresh).unwrap();
        eprintln!("wrote {}", path.display());
        return;
    }
    let current = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        current == fresh,
        "header is stale: run `GPUPOOL_BLESS=1 cargo test --test header`"
    );
}

#[test]
fn header_names_the_fixed_abi() {
    let h = generate();
    for f in [
        "int gpupool_init(const char *conf)",
        "int gpupool_shutdown(void)",
        "int gpupool_alloc(size_t size, int device, void *stream, void **out)",
        "int gpupool_free(void *ptr, int device, void *stream)",
        "int gpupool_record_stream(void *ptr, int device, void *stream)",
        "int gpupool_stream_create(int device, void **out)",
        "int gpupool_stats_json(int device, char *buf, size_t len)",
        "const char *gpupool_last_error(void)",
        "void *gpupool_torch_malloc(ssize_t size, int device, void *stream)",
        "void gpupool_torch_free(void *ptr, ssize_t size, int device, void *stream)",
        "GPUPOOL_STATUS_OK = 0",
        "int gpupool_begin_allocate_to_pool(int device, uint64_t pool, void *stream)",
        "int gpupool_end_allocate_to_pool(int device, uint64_t pool)",
        "int gpupool_release_pool(int device, uint64_t pool)",
        "int gpupool_alloc_in_pool(size_t size, int device, void *stream, uint64_t pool, void **out)",
    ] {
        assert!(h.contains(f), "header lacks `{f}`:\n{h}");
    }
}
