/* A stand-in libgpupool for the torch shim's private-pool routing test:
 * forwards the C ABI to the real library ($GPUPOOL_REAL_LIB, the same
 * loaded copy the test's Python uses) and implements the four pool
 * functions the C ABI is gaining by logging each call (fake_pool_log())
 * and allocating through gpupool_alloc. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void *real(const char *name) {
    static void *h;
    if (!h) h = dlopen(getenv("GPUPOOL_REAL_LIB"), RTLD_NOW | RTLD_LOCAL);
    void *f = h ? dlsym(h, name) : NULL;
    if (!f) {
        fprintf(stderr, "fake_pool_lib: %s unavailable\n", name);
        abort();
    }
    return f;
}

static char log_buf[1 << 14];

static void logf_(const char *fmt, unsigned long long a, unsigned long long b,
                  unsigned long long c, unsigned long long d) {
    size_t n = strlen(log_buf);
    snprintf(log_buf + n, sizeof log_buf - n, fmt, a, b, c, d);
}

const char *fake_pool_log(void) { return log_buf; }

int gpupool_alloc(size_t size, int device, void *stream, void **out) {
    return ((int (*)(size_t, int, void *, void **))real("gpupool_alloc"))(size, device, stream, out);
}
int gpupool_free(void *ptr, int device, void *stream) {
    logf_("free %llu %llu %llu%.0llu\n", (unsigned long long)(uintptr_t)ptr, device,
          (unsigned long long)(uintptr_t)stream, 0);
    return ((int (*)(void *, int, void *))real("gpupool_free"))(ptr, device, stream);
}
void gpupool_torch_record_stream(void *ptr, void *stream) {
    ((void (*)(void *, void *))real("gpupool_torch_record_stream"))(ptr, stream);
}
int gpupool_trim(void) { return ((int (*)(void))real("gpupool_trim"))(); }
int gpupool_set_memory_limit(int device, uint64_t n) {
    return ((int (*)(int, uint64_t))real("gpupool_set_memory_limit"))(device, n);
}
const char *gpupool_last_error(void) {
    return ((const char *(*)(void))real("gpupool_last_error"))();
}
const char *gpupool_status_name(int st) {
    return ((const char *(*)(int))real("gpupool_status_name"))(st);
}
int gpupool_memory_stats_json(int device, char *buf, size_t len) {
    return ((int (*)(int, char *, size_t))real("gpupool_memory_stats_json"))(device, buf, len);
}
size_t gpupool_needed_len(void) { return ((size_t (*)(void))real("gpupool_needed_len"))(); }
int gpupool_reset_peak_stats(int device) {
    return ((int (*)(int))real("gpupool_reset_peak_stats"))(device);
}

int gpupool_begin_allocate_to_pool(int device, uint64_t pool, void *stream) {
    logf_("begin %llu %llu %llu%.0llu\n", device, pool, (unsigned long long)(uintptr_t)stream, 0);
    return 0;
}
int gpupool_end_allocate_to_pool(int device, uint64_t pool) {
    logf_("end %llu %llu%.0llu%.0llu\n", device, pool, 0, 0);
    return 0;
}
int gpupool_release_pool(int device, uint64_t pool) {
    logf_("release %llu %llu%.0llu%.0llu\n", device, pool, 0, 0);
    return 0;
}
int gpupool_alloc_in_pool(size_t size, int device, void *stream, uint64_t pool, void **out) {
    logf_("alloc_in_pool %llu %llu %llu %llu\n", size, device, (unsigned long long)(uintptr_t)stream, pool);
    return gpupool_alloc(size, device, stream, out);
}
