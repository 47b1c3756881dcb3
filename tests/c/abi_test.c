/*
 * Exercises every function of include/gpupool.h against the simulator:
 * lifecycle, allocation, streams, stats (nested and PyTorch's flat layout),
 * snapshots, memory limits, the out-of-memory callback, tagged allocations with
 * pause and resume, export and import, the PyTorch hooks, every
 * bad-input case (status, message, and unchanged stats), 8 threads
 * allocating and freeing concurrently, and calls after shutdown.
 *
 * Built and run by tests/c_abi.rs:
 *   cc -std=c11 -Wall -Wextra -Werror -pthread -I include tests/c/abi_test.c \
 *      -L <dir of libgpupool.so> -lgpupool -o abi_test
 *   abi_test <scratch dir>
 * Exit status 0 when every check passed.
 */
#define _POSIX_C_SOURCE 200809L
#include "gpupool.h"

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static int passed, failed;

#define CHECK(cond, ...)                                                       \
    do {                                                                       \
        if (cond) {                                                            \
            passed++;                                                          \
        } else {                                                               \
            failed++;                                                          \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);    \
            fprintf(stderr, __VA_ARGS__);                                      \
            fprintf(stderr, " (last error: \"%s\")\n", gpupool_last_error());  \
        }                                                                      \
    } while (0)

/* A call that must return `want` with a message containing `needle`
 * ("" after a success). */
#define EXPECT(call, want, needle)                                             \
    do {                                                                       \
        int rc_ = (call);                                                      \
        const char *m_ = gpupool_last_error();                                 \
        CHECK(rc_ == (want), "%s returned %s, want %s", #call,                 \
              gpupool_status_name(rc_), gpupool_status_name(want));            \
        if ((want) == GPUPOOL_STATUS_OK) {                                     \
            CHECK(m_[0] == '\0', "%s: message after success: %s", #call, m_);  \
        } else {                                                               \
            CHECK(strstr(m_, (needle)) != NULL,                                \
                  "%s: message \"%s\" lacks \"%s\"", #call, m_, (needle));     \
        }                                                                      \
    } while (0)

#define KIB ((size_t)1 << 10)
#define MIB ((size_t)1 << 20)

static char before[2][8192], after[2][8192];

static void stats_of(int dev, char *buf, size_t len) {
    int rc = gpupool_stats_json(dev, buf, len);
    CHECK(rc == GPUPOOL_STATUS_OK, "stats_json(%d) = %s", dev, gpupool_status_name(rc));
}

static void snap_before(void) {
    stats_of(0, before[0], sizeof before[0]);
    stats_of(1, before[1], sizeof before[1]);
}

/* Stats of both devices are as they were at snap_before(). */
static void same_state(const char *what) {
    stats_of(0, after[0], sizeof after[0]);
    stats_of(1, after[1], sizeof after[1]);
    CHECK(strcmp(before[0], after[0]) == 0 && strcmp(before[1], after[1]) == 0,
          "state changed by %s:\n  before %s\n  after  %s", what, before[0], after[0]);
}

/* A bad call: returns `want`, its message contains `needle`, and the stats
 * of both devices are unchanged. */
#define BAD(call, want, needle)                                                \
    do {                                                                       \
        snap_before();                                                         \
        EXPECT(call, want, needle);                                            \
        same_state(#call);                                                     \
    } while (0)

/* Reads an unsigned field `"key":N` or `"key":{"current":N` from JSON. */
static unsigned long long field(const char *json, const char *key, int current) {
    char pat[128];
    snprintf(pat, sizeof pat, current ? "\"%s\":{\"current\":" : "\"%s\":", key);
    const char *p = strstr(json, pat);
    if (!p) return (unsigned long long)-1;
    return strtoull(p + strlen(pat), NULL, 10);
}

static unsigned long long stat_now(int dev, const char *key, int current) {
    char buf[8192];
    if (gpupool_stats_json(dev, buf, sizeof buf) != GPUPOOL_STATUS_OK) return (unsigned long long)-1;
    return field(buf, key, current);
}

/* ---- the out-of-memory callback ------------------------------------------------- */

static int oom_calls, oom_dev = -1;
static size_t oom_req;
static void *oom_user;

static void on_oom(int device, size_t requested, void *user_data) {
    oom_calls++;
    oom_dev = device;
    oom_req = requested;
    oom_user = user_data;
    /* Statistics may be read from inside the callback. */
    char b[8192];
    if (gpupool_memory_stats_json(device, b, sizeof b) != GPUPOOL_STATUS_OK) oom_calls += 1000;
    /* Shutting down or starting from inside a call is refused, not a deadlock. */
    if (gpupool_shutdown() != GPUPOOL_STATUS_INVALID_ARGUMENT) oom_calls += 1000;
    if (gpupool_init(NULL) != GPUPOOL_STATUS_INVALID_ARGUMENT) oom_calls += 1000;
}

static unsigned long long flat_now(int dev, const char *key) {
    char buf[8192];
    if (gpupool_memory_stats_json(dev, buf, sizeof buf) != GPUPOOL_STATUS_OK) return (unsigned long long)-1;
    return field(buf, key, 0);
}

/* ---- threads --------------------------------------------------------------------- */

#define THREADS 8
#define OPS 20000
#define LIVE 24

struct worker {
    int id, dev;
    int errors;
    long ops;
    char first_error[512];
};

static unsigned rnd(unsigned *s) {
    *s = *s * 1103515245u + 12345u;
    return (*s >> 8) & 0xffffff;
}

static void werr(struct worker *w, const char *what, int rc) {
    if (w->errors++ == 0)
        snprintf(w->first_error, sizeof w->first_error, "%s: %s: %s", what,
                 gpupool_status_name(rc), gpupool_last_error());
}

static void *worker_main(void *arg) {
    struct worker *w = arg;
    void *s = NULL, *s2 = NULL;
    int rc;
    if ((rc = gpupool_stream_create(w->dev, &s)) != GPUPOOL_STATUS_OK) { werr(w, "stream_create", rc); return NULL; }
    if ((rc = gpupool_stream_create(w->dev, &s2)) != GPUPOOL_STATUS_OK) { werr(w, "stream_create", rc); return NULL; }
    void *ptr[LIVE] = {0};
    size_t size[LIVE] = {0};
    uint64_t tag[LIVE] = {0};
    unsigned seed = 12345u + 7919u * (unsigned)w->id;
    for (long op = 0; op < OPS; op++) {
        int k = (int)(rnd(&seed) % LIVE);
        if (ptr[k]) {
            /* Memory is host-backed on the simulator: the tags written at
             * allocation must still be there (no overlap, no early reuse). */
            uint64_t head, tail;
            memcpy(&head, ptr[k], 8);
            memcpy(&tail, (char *)ptr[k] + size[k] - 8, 8);
            if (head != tag[k] || tail != ~tag[k]) werr(w, "integrity", -1);
            if ((rc = gpupool_free(ptr[k], w->dev, s)) != GPUPOOL_STATUS_OK) werr(w, "free", rc);
            ptr[k] = NULL;
        } else {
            unsigned r = rnd(&seed);
            size_t n = (r % 16 == 0) ? 256 * KIB + (size_t)(r % (2 * MIB)) /* large */
                                     : 16 + (size_t)(r % (64 * KIB));     /* small */
            void *p = NULL;
            if ((rc = gpupool_alloc(n, w->dev, s, &p)) != GPUPOOL_STATUS_OK || !p) {
                werr(w, "alloc", rc);
                continue;
            }
            if ((uintptr_t)p % 256 != 0) werr(w, "alignment", -1);
            tag[k] = ((uint64_t)w->id << 56) ^ ((uint64_t)op << 20) ^ n;
            uint64_t inv = ~tag[k];
            memcpy(p, &tag[k], 8);
            memcpy((char *)p + n - 8, &inv, 8);
            if (r % 64 == 1 && (rc = gpupool_record_stream(p, w->dev, s2)) != GPUPOOL_STATUS_OK)
                werr(w, "record_stream", rc);
            ptr[k] = p;
            size[k] = n;
        }
        w->ops++;
    }
    for (int k = 0; k < LIVE; k++)
        if (ptr[k] && (rc = gpupool_free(ptr[k], w->dev, s)) != GPUPOOL_STATUS_OK) werr(w, "free", rc);
    if ((rc = gpupool_stream_destroy(w->dev, s)) != GPUPOOL_STATUS_OK) werr(w, "stream_destroy", rc);
    if ((rc = gpupool_stream_destroy(w->dev, s2)) != GPUPOOL_STATUS_OK) werr(w, "stream_destroy", rc);
    return NULL;
}

/* A thread that ends holding memory in a pthread key: the key's destructor
 * frees it, and allocates and frees once more, after the thread's Rust
 * thread-locals (gpupool's magazines among them) were destroyed (glibc runs
 * those first, then pthread key destructors). */
static pthread_key_t exit_key;
static int exit_rc[5] = {-1, -1, -1, -1, -1};
static void *exit_mem[3];

static void exit_free(void *unused) {
    (void)unused;
    void *p = NULL;
    exit_rc[0] = gpupool_free(exit_mem[0], 0, NULL);
    exit_rc[1] = gpupool_free(exit_mem[1], 0, NULL);
    gpupool_torch_free(exit_mem[2], 4096, 0, NULL);
    exit_rc[2] = gpupool_alloc(4096, 0, NULL, &p);
    exit_rc[3] = p ? gpupool_free(p, 0, NULL) : -1;
    exit_rc[4] = gpupool_alloc(64, 0, NULL, &p) == GPUPOOL_STATUS_OK ? gpupool_free(p, 0, NULL) : -1;
}

static void *exit_main(void *arg) {
    (void)arg;
    if (gpupool_alloc(4096, 0, NULL, &exit_mem[0]) != GPUPOOL_STATUS_OK) return NULL;
    if (gpupool_alloc(3 * MIB, 0, NULL, &exit_mem[1]) != GPUPOOL_STATUS_OK) return NULL;
    exit_mem[2] = gpupool_torch_malloc(4096, 0, NULL);
    /* A pair on the thread's fast path first, so that its magazine exists. */
    void *p = NULL;
    if (gpupool_alloc(4096, 0, NULL, &p) == GPUPOOL_STATUS_OK) gpupool_free(p, 0, NULL);
    pthread_setspecific(exit_key, exit_mem);
    return NULL;
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    const char *scratch = argc > 1 ? argv[1] : ".";
    /* No maintenance threads: the bad-input checks compare stats before and
     * after each call, and a background harvest would change them. */
    const char *conf = "backend=sim,devices=2,capacity=256MiB,maint_ms=0";
    char buf[65536];
    void *p = NULL, *q = NULL, *s0 = NULL, *s0b = NULL, *s1 = NULL;
    int n = 0;
    int dummy = 0;

    /* ---- before init --------------------------------------------------------- */
    CHECK(gpupool_version()[0] != '\0', "version \"%s\"", gpupool_version());
    CHECK(strcmp(gpupool_status_name(GPUPOOL_STATUS_DOUBLE_FREE), "GPUPOOL_STATUS_DOUBLE_FREE") == 0, "status name");
    CHECK(strcmp(gpupool_status_name(12345), "GPUPOOL_STATUS_UNKNOWN") == 0, "unknown status name");
    CHECK(gpupool_abi_version() == GPUPOOL_ABI_VERSION && GPUPOOL_ABI_VERSION >= 1,
          "abi version %d, header %d", gpupool_abi_version(), GPUPOOL_ABI_VERSION);
    EXPECT(gpupool_memory_stats_json(0, buf, sizeof buf), GPUPOOL_STATUS_NOT_INITIALIZED, "not initialized");
    EXPECT(gpupool_reset_peak_stats(0), GPUPOOL_STATUS_NOT_INITIALIZED, "not initialized");
    EXPECT(gpupool_set_memory_limit(0, MIB), GPUPOOL_STATUS_NOT_INITIALIZED, "not initialized");
    /* The callback may be set before init; it stays across restarts. */
    EXPECT(gpupool_set_oom_callback(NULL, NULL), GPUPOOL_STATUS_OK, "");
    EXPECT(gpupool_init("backend=sim,fraction=1.5"), GPUPOOL_STATUS_CONFIG, "fraction");
    EXPECT(gpupool_init("backend=sim,max_bytes=lots"), GPUPOOL_STATUS_CONFIG, "max_bytes");
    EXPECT(gpupool_init("backend=sim,initial_bytes=-1"), GPUPOOL_STATUS_CONFIG, "initial_bytes");
    EXPECT(gpupool_alloc(64, 0, NULL, &p), GPUPOOL_STATUS_NOT_INITIALIZED, "gpupool_init first");
    CHECK(p == NULL, "out not cleared");
    EXPECT(gpupool_free(&dummy, 0, NULL), GPUPOOL_STATUS_NOT_INITIALIZED, "not initialized");
    EXPECT(gpupool_stats_json(0, buf, sizeof buf), GPUPOOL_STATUS_NOT_INITIALIZED, "not initialized");
    EXPECT(gpupool_shutdown(), GPUPOOL_STATUS_NOT_INITIALIZED, "nothing to shut down");
    EXPECT(gpupool_device_count(&n), GPUPOOL_STATUS_NOT_INITIALIZED, "not initialized");
    EXPECT(gpupool_selftest_panic(), GPUPOOL_STATUS_PANIC, "deliberate panic");
    EXPECT(gpupool_init("backend=sim,devices=2,colour=blue"), GPUPOOL_STATUS_CONFIG, "colour");
    EXPECT(gpupool_init("backend=tpu"), GPUPOOL_STATUS_CONFIG, "backend");
    EXPECT(gpupool_init("backend=sim,capacity=lots"), GPUPOOL_STATUS_CONFIG, "capacity");
    EXPECT(gpupool_init("backend=sim,devices=0"), GPUPOOL_STATUS_CONFIG, "devices");
    EXPECT(gpupool_init("backend=sim,\xff=1"), GPUPOOL_STATUS_INVALID_ARGUMENT, "UTF-8");
    EXPECT(gpupool_stream_create(0, &s0), GPUPOOL_STATUS_NOT_INITIALIZED, "not initialized");
    EXPECT(gpupool_pause(1, 1, NULL), GPUPOOL_STATUS_NOT_INITIALIZED, "not initialized");
    EXPECT(gpupool_resume(1, NULL), GPUPOOL_STATUS_NOT_INITIALIZED, "not initialized");
    EXPECT(gpupool_alloc_tagged(64, 0, NULL, 1, &p), GPUPOOL_STATUS_NOT_INITIALIZED, "not initialized");
    EXPECT(gpupool_import_close(&dummy, 0), GPUPOOL_STATUS_NOT_INITIALIZED, "not initialized");

    /* ---- init ---------------------------------------------------------------- */
    EXPECT(gpupool_init(conf), GPUPOOL_STATUS_OK, "");
    EXPECT(gpupool_init(conf), GPUPOOL_STATUS_ALREADY_INITIALIZED, "already initialized");
    EXPECT(gpupool_init(NULL), GPUPOOL_STATUS_ALREADY_INITIALIZED, "already initialized");
    EXPECT(gpupool_device_count(&n), GPUPOOL_STATUS_OK, "");
    CHECK(n == 2, "device count %d", n);

    /* ---- streams --------------------------------------------------------------- */
    EXPECT(gpupool_stream_create(0, &s0), GPUPOOL_STATUS_OK, "");
    EXPECT(gpupool_stream_create(0, &s0b), GPUPOOL_STATUS_OK, "");
    EXPECT(gpupool_stream_create(1, &s1), GPUPOOL_STATUS_OK, "");
    CHECK(s0 && s0b && s1 && s0 != s0b && s0 != s1, "stream handles %p %p %p", s0, s0b, s1);

    /* ---- allocation, real memory ------------------------------------------------ */
    size_t sizes[] = {1, 300, 4096, 70000, 3 * MIB, 9 * MIB + 17};
    void *ptrs[6];
    for (int i = 0; i < 6; i++) {
        void *stream = i % 2 ? s0 : NULL;
        EXPECT(gpupool_alloc(sizes[i], 0, stream, &ptrs[i]), GPUPOOL_STATUS_OK, "");
        CHECK(ptrs[i] && (uintptr_t)ptrs[i] % 256 == 0, "ptr %p", ptrs[i]);
        if (ptrs[i]) memset(ptrs[i], 0x40 + i, sizes[i]);
    }
    for (int i = 0; i < 6; i++) {
        const unsigned char *b = ptrs[i];
        CHECK(b && b[0] == 0x40 + i && b[sizes[i] - 1] == 0x40 + i, "block %d overwritten", i);
    }
    CHECK(stat_now(0, "requested_bytes", 1) == 1 + 300 + 4096 + 70000 + 3 * MIB + 9 * MIB + 17,
          "requested_bytes %llu", stat_now(0, "requested_bytes", 1));
    /* PyTorch's meanings: requested <= allocated (rounded) <= active <= reserved. */
    {
        unsigned long long rq = flat_now(0, "requested_bytes.all.current"),
                           al = flat_now(0, "allocated_bytes.all.current"),
                           ac = flat_now(0, "active_bytes.all.current"),
                           rs = flat_now(0, "reserved_bytes.all.current");
        CHECK(rq == stat_now(0, "requested_bytes", 1) && al == stat_now(0, "allocated_bytes", 1),
              "flat and nested stats agree: %llu %llu", rq, al);
        CHECK(rq < al && al <= ac && ac <= rs, "requested %llu allocated %llu active %llu reserved %llu",
              rq, al, ac, rs);
        CHECK(flat_now(0, "allocation.all.current") == 6, "allocation.all.current %llu",
              flat_now(0, "allocation.all.current"));
        CHECK(flat_now(0, "num_ooms") == 0 && flat_now(0, "num_alloc_retries") != (unsigned long long)-1,
              "flat counters");
    }
    CHECK(stat_now(0, "num_allocs", 0) == 6, "num_allocs %llu", stat_now(0, "num_allocs", 0));
    CHECK(stat_now(0, "device", 0) == 0 && stat_now(1, "device", 0) == 1, "device field");

    /* record_stream onto a second stream, then free on the first. */
    EXPECT(gpupool_record_stream(ptrs[2], 0, s0b), GPUPOOL_STATUS_OK, "");
    EXPECT(gpupool_record_stream(ptrs[2], 0, s0b), GPUPOOL_STATUS_OK, "");

    /* ---- stats buffer protocol ------------------------------------------------- */
    EXPECT(gpupool_stats_json(0, buf, sizeof buf), GPUPOOL_STATUS_OK, "");
    size_t need = gpupool_needed_len();
    CHECK(need == strlen(buf) + 1, "needed %zu vs %zu", need, strlen(buf) + 1);
    CHECK(strstr(buf, "\"reserved_bytes\":{\"current\":") && strstr(buf, "\"num_ooms\":0"), "stats json %s", buf);
    EXPECT(gpupool_stats_json(0, NULL, 0), GPUPOOL_STATUS_BUFFER_TOO_SMALL, "bytes needed");
    CHECK(gpupool_needed_len() == need, "query %zu vs %zu", gpupool_needed_len(), need);
    char small[16];
    memset(small, 'x', sizeof small);
    BAD(gpupool_stats_json(0, small, sizeof small), GPUPOOL_STATUS_BUFFER_TOO_SMALL, "bytes needed");
    CHECK(small[0] == '\0' && small[1] == 'x', "small buffer touched beyond [0]");
    BAD(gpupool_stats_json(0, NULL, 100), GPUPOOL_STATUS_NULL_ARGUMENT, "`buf` is NULL");
    BAD(gpupool_stats_json(2, buf, sizeof buf), GPUPOOL_STATUS_INVALID_DEVICE, "invalid device 2");
    BAD(gpupool_stats_json(-1, buf, sizeof buf), GPUPOOL_STATUS_INVALID_DEVICE, "invalid device -1");

    /* ---- flat (PyTorch) stats: same protocol ---------------------------------- */
    EXPECT(gpupool_memory_stats_json(0, buf, sizeof buf), GPUPOOL_STATUS_OK, "");
    CHECK(buf[0] == '{' && strstr(buf, "\"allocated_bytes.all.peak\":") &&
              strstr(buf, "\"inactive_split_bytes.all.current\":"),
          "memory stats json %s", buf);
    CHECK(gpupool_needed_len() == strlen(buf) + 1, "needed_len after memory_stats_json");
    EXPECT(gpupool_memory_stats_json(0, NULL, 0), GPUPOOL_STATUS_BUFFER_TOO_SMALL, "size query");
    BAD(gpupool_memory_stats_json(0, small, sizeof small), GPUPOOL_STATUS_BUFFER_TOO_SMALL, "bytes needed");
    BAD(gpupool_memory_stats_json(0, NULL, 100), GPUPOOL_STATUS_NULL_ARGUMENT, "`buf` is NULL");
    BAD(gpupool_memory_stats_json(2, buf, sizeof buf), GPUPOOL_STATUS_INVALID_DEVICE, "invalid device 2");
    BAD(gpupool_memory_stats_json(-1, buf, sizeof buf), GPUPOOL_STATUS_INVALID_DEVICE, "invalid device -1");
    BAD(gpupool_reset_peak_stats(2), GPUPOOL_STATUS_INVALID_DEVICE, "invalid device 2");
    BAD(gpupool_reset_peak_stats(-2), GPUPOOL_STATUS_INVALID_DEVICE, "invalid device -2");
    BAD(gpupool_set_memory_limit(2, MIB), GPUPOOL_STATUS_INVALID_DEVICE, "invalid device 2");
    BAD(gpupool_set_memory_limit(-2, MIB), GPUPOOL_STATUS_INVALID_DEVICE, "invalid device -2");

    /* ---- bad inputs: each returns its status and message, changes nothing ---------- */
    BAD(gpupool_alloc(64, 0, NULL, NULL), GPUPOOL_STATUS_NULL_ARGUMENT, "`out` is NULL");
    BAD(gpupool_alloc(0, 0, NULL, &q), GPUPOOL_STATUS_INVALID_SIZE, "zero-byte");
    CHECK(q == NULL, "out set on failure");
    BAD(gpupool_alloc((size_t)1 << 60, 0, NULL, &q), GPUPOOL_STATUS_INVALID_SIZE, "larger than the device");
    BAD(gpupool_alloc(64, 2, NULL, &q), GPUPOOL_STATUS_INVALID_DEVICE, "invalid device 2");
    BAD(gpupool_alloc(64, -1, NULL, &q), GPUPOOL_STATUS_INVALID_DEVICE, "invalid device -1");
    BAD(gpupool_alloc(64, 0, s1, &q), GPUPOOL_STATUS_INVALID_HANDLE, "belongs to device 1");
    BAD(gpupool_alloc(64, 0, (void *)0x7777, &q), GPUPOOL_STATUS_INVALID_HANDLE, "unknown stream");
    BAD(gpupool_free(NULL, 0, NULL), GPUPOOL_STATUS_NULL_ARGUMENT, "`ptr` is NULL");
    BAD(gpupool_free(&dummy, 0, NULL), GPUPOOL_STATUS_UNKNOWN_POINTER, "unknown pointer");
    BAD(gpupool_free((char *)ptrs[1] + 8, 0, NULL), GPUPOOL_STATUS_UNKNOWN_POINTER, "unknown pointer");
    BAD(gpupool_free((char *)ptrs[4] + 256, 0, NULL), GPUPOOL_STATUS_UNKNOWN_POINTER, "unknown pointer");
    BAD(gpupool_free(ptrs[1], 1, NULL), GPUPOOL_STATUS_WRONG_DEVICE, "allocated on device 0, not on device 1");
    BAD(gpupool_free(ptrs[4], 1, NULL), GPUPOOL_STATUS_WRONG_DEVICE, "allocated on device 0, not on device 1");
    BAD(gpupool_free(ptrs[1], 3, NULL), GPUPOOL_STATUS_INVALID_DEVICE, "invalid device 3");
    BAD(gpupool_free(ptrs[1], 0, s1), GPUPOOL_STATUS_INVALID_HANDLE, "belongs to device 1");
    BAD(gpupool_record_stream(NULL, 0, s0), GPUPOOL_STATUS_NULL_ARGUMENT, "`ptr` is NULL");
    BAD(gpupool_record_stream(&dummy, 0, s0), GPUPOOL_STATUS_UNKNOWN_POINTER, "unknown pointer");
    BAD(gpupool_record_stream(ptrs[1], 1, s1), GPUPOOL_STATUS_WRONG_DEVICE, "allocated on device 0");
    BAD(gpupool_record_stream(ptrs[1], 0, (void *)0x7777), GPUPOOL_STATUS_INVALID_HANDLE, "unknown stream");
    BAD(gpupool_stream_create(0, NULL), GPUPOOL_STATUS_NULL_ARGUMENT, "`out` is NULL");
    BAD(gpupool_stream_create(9, &q), GPUPOOL_STATUS_INVALID_DEVICE, "invalid device 9");
    BAD(gpupool_stream_destroy(0, NULL), GPUPOOL_STATUS_INVALID_HANDLE, "default stream");
    BAD(gpupool_stream_destroy(0, s1), GPUPOOL_STATUS_INVALID_HANDLE, "belongs to device 1");
    BAD(gpupool_stream_destroy(0, (void *)0x7777), GPUPOOL_STATUS_INVALID_HANDLE, "unknown stream");
    BAD(gpupool_stream_release(0, NULL), GPUPOOL_STATUS_INVALID_HANDLE, "default stream");
    BAD(gpupool_stream_release(0, (void *)2), GPUPOOL_STATUS_INVALID_HANDLE, "default stream");
    BAD(gpupool_stream_release(0, s0), GPUPOOL_STATUS_INVALID_HANDLE, "gpupool_stream_destroy");
    BAD(gpupool_stream_release(7, (void *)0x7777), GPUPOOL_STATUS_INVALID_DEVICE, "invalid device 7");
    /* A destroyed stream is refused on this thread's next call, though
     * this thread's last call named it (its memory of that call must not
     * outlive the stream). */
    {
        void *sx = NULL, *px = NULL;
        EXPECT(gpupool_stream_create(0, &sx), GPUPOOL_STATUS_OK, "");
        EXPECT(gpupool_alloc(4096, 0, sx, &px), GPUPOOL_STATUS_OK, "");
        EXPECT(gpupool_free(px, 0, sx), GPUPOOL_STATUS_OK, "");
        EXPECT(gpupool_stream_destroy(0, sx), GPUPOOL_STATUS_OK, "");
        BAD(gpupool_alloc(4096, 0, sx, &px), GPUPOOL_STATUS_INVALID_HANDLE, "unknown stream");
        BAD(gpupool_stream_destroy(0, sx), GPUPOOL_STATUS_INVALID_HANDLE, "unknown stream");
    }
    /* A stream never used through the ABI: nothing to release. */
    EXPECT(gpupool_stream_release(0, (void *)0x7777), GPUPOOL_STATUS_OK, "");
    /* The calling thread's default stream (CU_STREAM_PER_THREAD) and the
     * legacy one by its explicit name (CU_STREAM_LEGACY) are understood. */
    {
        void *pt = NULL, *lg = NULL;
        EXPECT(gpupool_alloc(4096, 0, (void *)2, &pt), GPUPOOL_STATUS_OK, "");
        EXPECT(gpupool_free(pt, 0, (void *)2), GPUPOOL_STATUS_OK, "");
        EXPECT(gpupool_alloc(4096, 0, (void *)1, &lg), GPUPOOL_STATUS_OK, "");
        EXPECT(gpupool_free(lg, 0, NULL), GPUPOOL_STATUS_OK, "");
    }
    BAD(gpupool_device_count(NULL), GPUPOOL_STATUS_NULL_ARGUMENT, "`out` is NULL");
    BAD(gpupool_snapshot_pickle(0, NULL), GPUPOOL_STATUS_NULL_ARGUMENT, "`path` is NULL");
    BAD(gpupool_snapshot_pickle(5, "x.pickle"), GPUPOOL_STATUS_INVALID_DEVICE, "invalid device 5");
    BAD(gpupool_snapshot_pickle(0, "/nonexistent-dir/x.pickle"), GPUPOOL_STATUS_IO, "nonexistent-dir");
    BAD(gpupool_snapshot_json(0, NULL, 10), GPUPOOL_STATUS_NULL_ARGUMENT, "`buf` is NULL");
    BAD(gpupool_snapshot_json(0, small, sizeof small), GPUPOOL_STATUS_BUFFER_TOO_SMALL, "bytes needed");
    BAD(gpupool_record_history(4, 1), GPUPOOL_STATUS_INVALID_DEVICE, "invalid device 4");
    BAD(gpupool_init(conf), GPUPOOL_STATUS_ALREADY_INITIALIZED, "already initialized");
    BAD(gpupool_selftest_panic(), GPUPOOL_STATUS_PANIC, "deliberate panic");

    /* Double frees: the first free works, the second changes nothing. */
    EXPECT(gpupool_free(ptrs[1], 0, s0), GPUPOOL_STATUS_OK, "");
    BAD(gpupool_free(ptrs[1], 0, s0), GPUPOOL_STATUS_DOUBLE_FREE, "double free");
    EXPECT(gpupool_free(ptrs[4], 0, NULL), GPUPOOL_STATUS_OK, "");
    /* Large blocks: a freed large pointer starts free (or parked) memory
     * of the pool, which the pool reports as a double free. */
    snap_before();
    {
        int rc = gpupool_free(ptrs[4], 0, NULL);
        CHECK(rc == GPUPOOL_STATUS_DOUBLE_FREE,
              "large double free: %s", gpupool_status_name(rc));
        printf("large double free: %s (%s)\n", gpupool_status_name(rc), gpupool_last_error());
        same_state("large double free");
    }

    /* ---- CUDA graph pools: bad input changes nothing ------------------------------ */
    BAD(gpupool_begin_allocate_to_pool(0, 0, s0), GPUPOOL_STATUS_INVALID_ARGUMENT, "reserved");
    BAD(gpupool_begin_allocate_to_pool(2, 5, s0), GPUPOOL_STATUS_INVALID_DEVICE, "invalid device 2");
    BAD(gpupool_begin_allocate_to_pool(0, 5, s1), GPUPOOL_STATUS_INVALID_HANDLE, "belongs to device 1");
    BAD(gpupool_begin_allocate_to_pool(0, 5, (void *)0x7777), GPUPOOL_STATUS_INVALID_HANDLE, "unknown stream");
    BAD(gpupool_end_allocate_to_pool(0, 0), GPUPOOL_STATUS_INVALID_ARGUMENT, "reserved");
    BAD(gpupool_end_allocate_to_pool(0, 5), GPUPOOL_STATUS_INVALID_ARGUMENT, "unknown private pool");
    BAD(gpupool_end_allocate_to_pool(-1, 5), GPUPOOL_STATUS_INVALID_DEVICE, "invalid device -1");
    BAD(gpupool_release_pool(0, 0), GPUPOOL_STATUS_INVALID_ARGUMENT, "reserved");
    BAD(gpupool_release_pool(0, 5), GPUPOOL_STATUS_INVALID_ARGUMENT, "unknown private pool");
    BAD(gpupool_release_pool(3, 5), GPUPOOL_STATUS_INVALID_DEVICE, "invalid device 3");
    BAD(gpupool_alloc_in_pool(64, 0, s0, 5, NULL), GPUPOOL_STATUS_NULL_ARGUMENT, "`out` is NULL");
    BAD(gpupool_alloc_in_pool(64, 0, s0, 0, &q), GPUPOOL_STATUS_INVALID_ARGUMENT, "reserved");
    CHECK(q == NULL, "out set on failure");
    BAD(gpupool_alloc_in_pool(0, 0, s0, 5, &q), GPUPOOL_STATUS_INVALID_SIZE, "zero-byte");
    BAD(gpupool_alloc_in_pool(64, 4, s0, 5, &q), GPUPOOL_STATUS_INVALID_DEVICE, "invalid device 4");
    BAD(gpupool_alloc_in_pool(64, 0, s1, 5, &q), GPUPOOL_STATUS_INVALID_HANDLE, "belongs to device 1");
    /* Routing: allocations on s0 go to private pool 5 until the end; a
     * block freed there is reused there only. */
    {
        void *g1 = NULL, *g2 = NULL, *g3 = NULL, *g4 = NULL;
        EXPECT(gpupool_begin_allocate_to_pool(0, 5, s0), GPUPOOL_STATUS_OK, "");
        BAD(gpupool_begin_allocate_to_pool(0, 6, s0), GPUPOOL_STATUS_INVALID_ARGUMENT, "routed");
        EXPECT(gpupool_alloc(4096, 0, s0, &g1), GPUPOOL_STATUS_OK, "");
        EXPECT(gpupool_free(g1, 0, s0), GPUPOOL_STATUS_OK, "");
        BAD(gpupool_free(g1, 0, s0), GPUPOOL_STATUS_DOUBLE_FREE, "double free");
        EXPECT(gpupool_alloc(4096, 0, s0, &g2), GPUPOOL_STATUS_OK, "");
        CHECK(g2 == g1, "a private block is reused in its pool: %p vs %p", g2, g1);
        EXPECT(gpupool_end_allocate_to_pool(0, 5), GPUPOOL_STATUS_OK, "");
        EXPECT(gpupool_alloc(4096, 0, s0, &g3), GPUPOOL_STATUS_OK, "");
        CHECK(g3 != g2, "routing ended");
        EXPECT(gpupool_alloc_in_pool(8192, 0, s0, 5, &g4), GPUPOOL_STATUS_OK, "");
        CHECK(g4 != NULL && g4 != g2, "alloc_in_pool %p", g4);
        EXPECT(gpupool_release_pool(0, 5), GPUPOOL_STATUS_OK, "");
        BAD(gpupool_release_pool(0, 5), GPUPOOL_STATUS_INVALID_ARGUMENT, "released already");
        BAD(gpupool_begin_allocate_to_pool(0, 5, s0), GPUPOOL_STATUS_INVALID_ARGUMENT, "released");
        EXPECT(gpupool_free(g2, 0, s0), GPUPOOL_STATUS_OK, "");
        EXPECT(gpupool_free(g4, 0, s0), GPUPOOL_STATUS_OK, "");
        EXPECT(gpupool_free(g3, 0, s0), GPUPOOL_STATUS_OK, "");
        /* Its last block freed, the released pool is gone. */
        BAD(gpupool_release_pool(0, 5), GPUPOOL_STATUS_INVALID_ARGUMENT, "unknown private pool");
    }

    /* Out of memory: 2 x 200 MiB on a 256 MiB device. */
    EXPECT(gpupool_alloc(200 * MIB, 1, s1, &p), GPUPOOL_STATUS_OK, "");
    EXPECT(gpupool_alloc(200 * MIB, 1, s1, &q), GPUPOOL_STATUS_OUT_OF_MEMORY, "requested");
    CHECK(q == NULL, "out after OOM");
    CHECK(stat_now(1, "num_ooms", 0) == 1, "num_ooms %llu", stat_now(1, "num_ooms", 0));
    EXPECT(gpupool_free(p, 1, s1), GPUPOOL_STATUS_OK, "");
    EXPECT(gpupool_alloc(200 * MIB, 1, s1, &q), GPUPOOL_STATUS_OK, "");
    EXPECT(gpupool_free(q, 1, s1), GPUPOOL_STATUS_OK, "");

    /* ---- peaks ---------------------------------------------------------------------- */
    CHECK(flat_now(1, "reserved_bytes.all.peak") >= 200 * MIB, "reserved peak %llu",
          flat_now(1, "reserved_bytes.all.peak"));
    EXPECT(gpupool_trim(), GPUPOOL_STATUS_OK, "");
    EXPECT(gpupool_reset_peak_stats(1), GPUPOOL_STATUS_OK, "");
    CHECK(flat_now(1, "reserved_bytes.all.peak") == flat_now(1, "reserved_bytes.all.current") &&
              flat_now(1, "requested_bytes.all.peak") == 0 && flat_now(1, "allocated_bytes.all.peak") == 0,
          "peaks after reset: reserved %llu (current %llu), requested %llu",
          flat_now(1, "reserved_bytes.all.peak"), flat_now(1, "reserved_bytes.all.current"),
          flat_now(1, "requested_bytes.all.peak"));
    EXPECT(gpupool_reset_peak_stats(-1), GPUPOOL_STATUS_OK, "");

    /* ---- a memory limit and the out-of-memory callback ---------------------------- */
    EXPECT(gpupool_set_oom_callback(on_oom, &oom_calls), GPUPOOL_STATUS_OK, "");
    EXPECT(gpupool_alloc(100 * MIB, 1, s1, &p), GPUPOOL_STATUS_OK, "");
    EXPECT(gpupool_free(p, 1, s1), GPUPOOL_STATUS_OK, "");
    CHECK(stat_now(1, "reserved_bytes", 1) >= 100 * MIB, "cached before the limit");
    /* Lowering the limit below what is held gives cached memory back. */
    EXPECT(gpupool_set_memory_limit(1, 64 * MIB), GPUPOOL_STATUS_OK, "");
    CHECK(stat_now(1, "reserved_bytes", 1) <= 64 * MIB, "reserved %llu after the limit",
          stat_now(1, "reserved_bytes", 1));
    EXPECT(gpupool_alloc(40 * MIB, 1, s1, &p), GPUPOOL_STATUS_OK, "");
    snap_before();
    EXPECT(gpupool_alloc(40 * MIB, 1, s1, &q), GPUPOOL_STATUS_OUT_OF_MEMORY, "requested");
    CHECK(q == NULL, "out after a refused alloc");
    CHECK(oom_calls == 1 && oom_dev == 1 && oom_req == 40 * MIB && oom_user == &oom_calls,
          "callback: %d calls, device %d, %zu bytes", oom_calls, oom_dev, oom_req);
    CHECK(stat_now(1, "reserved_bytes", 1) <= 64 * MIB, "reserved %llu over the limit",
          stat_now(1, "reserved_bytes", 1));
    CHECK(stat_now(1, "num_ooms", 0) == 2, "num_ooms %llu", stat_now(1, "num_ooms", 0));
    /* No limit again: the same request fits. */
    EXPECT(gpupool_set_memory_limit(1, 0), GPUPOOL_STATUS_OK, "");
    EXPECT(gpupool_alloc(40 * MIB, 1, s1, &q), GPUPOOL_STATUS_OK, "");
    CHECK(oom_calls == 1, "callback calls %d", oom_calls);
    EXPECT(gpupool_free(q, 1, s1), GPUPOOL_STATUS_OK, "");
    EXPECT(gpupool_free(p, 1, s1), GPUPOOL_STATUS_OK, "");
    EXPECT(gpupool_set_oom_callback(NULL, NULL), GPUPOOL_STATUS_OK, "");
    EXPECT(gpupool_set_memory_limit(-1, 16 * MIB), GPUPOOL_STATUS_OK, "");
    EXPECT(gpupool_alloc(40 * MIB, 1, s1, &q), GPUPOOL_STATUS_OUT_OF_MEMORY, "requested");
    CHECK(oom_calls == 1, "callback cleared, calls %d", oom_calls);
    EXPECT(gpupool_set_memory_limit(-1, 0), GPUPOOL_STATUS_OK, "");

    /* ---- history and snapshots ------------------------------------------------ */
    EXPECT(gpupool_record_history(-1, 1), GPUPOOL_STATUS_OK, "");
    EXPECT(gpupool_alloc(5000, 0, s0, &p), GPUPOOL_STATUS_OK, "");
    EXPECT(gpupool_alloc(5000, 0, s0, &q), GPUPOOL_STATUS_OK, "");
    EXPECT(gpupool_free(q, 0, s0), GPUPOOL_STATUS_OK, "");
    /* Size query, then a buffer with slack (slabs list every slot: big). */
    EXPECT(gpupool_snapshot_json(0, NULL, 0), GPUPOOL_STATUS_BUFFER_TOO_SMALL, "size query");
    size_t snap_len = gpupool_needed_len() + 4096;
    CHECK(snap_len > 4096 + 100, "snapshot size %zu", snap_len);
    char *sj = malloc(snap_len);
    EXPECT(gpupool_snapshot_json(0, sj, snap_len), GPUPOOL_STATUS_OK, "");
    CHECK(sj[0] == '[' && strstr(sj, "\"segments\"") && strstr(sj, "\"active_allocated\"") &&
              strstr(sj, "\"free_requested\""),
          "snapshot json %.200s", sj);
    CHECK(gpupool_needed_len() == strlen(sj) + 1, "needed_len after success");
    free(sj);
    char path[4096];
    snprintf(path, sizeof path, "%s/abi_snapshot.pickle", scratch);
    EXPECT(gpupool_snapshot_pickle(-1, path), GPUPOOL_STATUS_OK, "");
    struct stat st;
    CHECK(stat(path, &st) == 0 && st.st_size > 100, "pickle written to %s", path);
    EXPECT(gpupool_record_history(-1, 0), GPUPOOL_STATUS_OK, "");
    EXPECT(gpupool_free(p, 0, s0), GPUPOOL_STATUS_OK, "");

    /* ---- the PyTorch hooks ------------------------------------------------------- */
    p = gpupool_torch_malloc(0, 0, NULL);
    CHECK(p == NULL && gpupool_last_error()[0] == '\0', "torch_malloc(0) = %p", p);
    snap_before();
    p = gpupool_torch_malloc(-5, 0, NULL);
    CHECK(p == NULL && strstr(gpupool_last_error(), "negative"), "torch_malloc(-5) = %p", p);
    same_state("torch_malloc(-5)");
    p = gpupool_torch_malloc(64, 7, NULL);
    CHECK(p == NULL && strstr(gpupool_last_error(), "invalid device 7"), "torch_malloc dev 7");
    p = gpupool_torch_malloc(1000, 0, s0);
    CHECK(p != NULL && gpupool_last_error()[0] == '\0', "torch_malloc(1000) = %p", p);
    gpupool_torch_record_stream(p, s0b);
    CHECK(gpupool_last_error()[0] == '\0', "torch_record_stream");
    gpupool_torch_record_stream(&dummy, s0b);
    CHECK(strstr(gpupool_last_error(), "unknown pointer") != NULL, "torch_record_stream unknown");
    gpupool_torch_free(p, 1000, 0, s0);
    CHECK(gpupool_last_error()[0] == '\0', "torch_free");
    gpupool_torch_free(NULL, 0, 0, NULL);
    CHECK(gpupool_last_error()[0] == '\0', "torch_free(NULL)");
    snap_before();
    gpupool_torch_free(p, 1000, 0, s0);
    CHECK(strstr(gpupool_last_error(), "double free") != NULL, "torch double free");
    same_state("torch double free");

    /* ---- tagged allocations, pause and resume ------------------------------------ */
    {
        void *t1 = NULL, *t2 = NULL, *t3 = NULL;
        uint64_t released = 7, mapped = 7;
        BAD(gpupool_alloc_tagged(MIB, 0, NULL, 5, NULL), GPUPOOL_STATUS_NULL_ARGUMENT, "out");
        BAD(gpupool_alloc_tagged(0, 0, NULL, 5, &t1), GPUPOOL_STATUS_INVALID_SIZE, "zero");
        CHECK(t1 == NULL, "out after a refused tagged alloc");
        BAD(gpupool_alloc_tagged(MIB, 7, NULL, 5, &t1), GPUPOOL_STATUS_INVALID_DEVICE, "invalid device 7");
        BAD(gpupool_alloc_tagged(MIB, 0, s1, 5, &t1), GPUPOOL_STATUS_INVALID_HANDLE, "device 1");
        unsigned long long live1 = stat_now(1, "allocated_bytes", 1);
        EXPECT(gpupool_alloc_tagged(3 * MIB, 0, s0, 5, &t1), GPUPOOL_STATUS_OK, "");
        CHECK(t1 && (uintptr_t)t1 % (2 * MIB) == 0, "tagged ptr %p not granule aligned", t1);
        /* A thread tag scope tags gpupool_alloc and the PyTorch hook, also
         * where the fast lane (this thread's last stream, a cached slot of
         * the size) could serve them. */
        {
            void *warm = NULL;
            EXPECT(gpupool_alloc(100, 1, s1, &warm), GPUPOOL_STATUS_OK, "");
            EXPECT(gpupool_free(warm, 1, s1), GPUPOOL_STATUS_OK, "");
        }
        EXPECT(gpupool_set_thread_tag(5), GPUPOOL_STATUS_OK, "");
        EXPECT(gpupool_alloc(100, 1, s1, &t2), GPUPOOL_STATUS_OK, "");
        t3 = gpupool_torch_malloc(5000, 0, NULL);
        EXPECT(gpupool_clear_thread_tag(), GPUPOOL_STATUS_OK, "");
        CHECK(t3 && (uintptr_t)t3 % (2 * MIB) == 0, "torch_malloc in a tag scope: %p", t3);
        CHECK(stat_now(1, "allocated_bytes", 1) == live1 + 2 * MIB, "a tagged 100 B block holds a granule: %llu",
              stat_now(1, "allocated_bytes", 1));
        /* On the simulator device memory is host memory: write it directly. */
        memset(t1, 0xab, 3 * MIB);
        memset(t3, 0xcd, 5000);
        unsigned long long r0 = stat_now(0, "reserved_bytes", 1), r1 = stat_now(1, "reserved_bytes", 1);
        EXPECT(gpupool_pause(5, 1, &released), GPUPOOL_STATUS_OK, "");
        CHECK(released == 8 * MIB, "released %llu", (unsigned long long)released);
        CHECK(stat_now(0, "paused_bytes", 0) == 6 * MIB && stat_now(1, "paused_bytes", 0) == 2 * MIB,
              "paused %llu %llu", stat_now(0, "paused_bytes", 0), stat_now(1, "paused_bytes", 0));
        CHECK(stat_now(0, "reserved_bytes", 1) == r0 - 6 * MIB && stat_now(1, "reserved_bytes", 1) == r1 - 2 * MIB,
              "reserved while paused %llu %llu", stat_now(0, "reserved_bytes", 1), stat_now(1, "reserved_bytes", 1));
        CHECK(flat_now(0, "paused_bytes.all.current") == 6 * MIB, "flat paused %llu",
              flat_now(0, "paused_bytes.all.current"));
        /* Again, and an unknown tag: nothing to do. */
        EXPECT(gpupool_pause(5, 1, &released), GPUPOOL_STATUS_OK, "");
        CHECK(released == 0, "second pause released %llu", (unsigned long long)released);
        EXPECT(gpupool_pause(99, 0, NULL), GPUPOOL_STATUS_OK, "");
        EXPECT(gpupool_resume(99, &mapped), GPUPOOL_STATUS_OK, "");
        CHECK(mapped == 0, "resume of an unknown tag mapped %llu", (unsigned long long)mapped);
        EXPECT(gpupool_resume(5, &mapped), GPUPOOL_STATUS_OK, "");
        CHECK(mapped == 8 * MIB, "mapped %llu", (unsigned long long)mapped);
        CHECK(stat_now(0, "reserved_bytes", 1) == r0 && stat_now(0, "paused_bytes", 0) == 0,
              "reserved after resume %llu", stat_now(0, "reserved_bytes", 1));
        int same = 1;
        for (size_t i = 0; i < 3 * MIB; i++) same &= ((unsigned char *)t1)[i] == 0xab;
        for (size_t i = 0; i < 5000; i++) same &= ((unsigned char *)t3)[i] == 0xcd;
        CHECK(same, "bytes restored by resume");
        /* Paused allocations may be freed, through either free. */
        EXPECT(gpupool_pause(5, 0, NULL), GPUPOOL_STATUS_OK, "");
        EXPECT(gpupool_free(t1, 0, s0), GPUPOOL_STATUS_OK, "");
        EXPECT(gpupool_free(t2, 1, s1), GPUPOOL_STATUS_OK, "");
        gpupool_torch_free(t3, 5000, 0, NULL);
        CHECK(gpupool_last_error()[0] == '\0', "torch_free of a paused block");
        CHECK(stat_now(0, "paused_bytes", 0) == 0 && stat_now(1, "paused_bytes", 0) == 0, "paused after frees");
        BAD(gpupool_free(t1, 0, s0), GPUPOOL_STATUS_DOUBLE_FREE, "double free");
        EXPECT(gpupool_resume(5, &mapped), GPUPOOL_STATUS_OK, "");
        CHECK(mapped == 0, "resume after the frees mapped %llu", (unsigned long long)mapped);
    }

    /* ---- export and import (here across devices; tests/ipc.rs: across processes) -- */
    {
        void *e = NULL, *imp = NULL;
        GpupoolIpcChunk ch[8];
        size_t nch = 99;
        uint64_t cb = 0, off = 0, sz = 0;
        EXPECT(gpupool_alloc(5 * MIB + 7, 0, s0, &e), GPUPOOL_STATUS_OK, "");
        memset(e, 0x5e, 5 * MIB + 7);
        BAD(gpupool_export(NULL, 0, ch, 8, &nch, &cb, &off, &sz), GPUPOOL_STATUS_NULL_ARGUMENT, "ptr");
        BAD(gpupool_export(e, 0, ch, 8, NULL, &cb, &off, &sz), GPUPOOL_STATUS_NULL_ARGUMENT, "n_chunks");
        BAD(gpupool_export(e, 0, NULL, 8, &nch, &cb, &off, &sz), GPUPOOL_STATUS_NULL_ARGUMENT, "chunks");
        BAD(gpupool_export(&dummy, 0, ch, 8, &nch, &cb, &off, &sz), GPUPOOL_STATUS_UNKNOWN_POINTER, "unknown");
        BAD(gpupool_export(e, 1, ch, 8, &nch, &cb, &off, &sz), GPUPOOL_STATUS_WRONG_DEVICE, "device 0");
        EXPECT(gpupool_export(e, 0, NULL, 0, &nch, &cb, &off, &sz), GPUPOOL_STATUS_BUFFER_TOO_SMALL, "chunks");
        CHECK(nch >= 3 && nch <= 4, "chunks needed %zu", nch);
        EXPECT(gpupool_export(e, 0, ch, 8, &nch, &cb, &off, &sz), GPUPOOL_STATUS_OK, "");
        CHECK(cb == 2 * MIB && sz == 5 * MIB + 7 && off < cb && nch == (off + sz + cb - 1) / cb,
              "export: %zu chunks of %llu, offset %llu, size %llu", nch, (unsigned long long)cb,
              (unsigned long long)off, (unsigned long long)sz);
        GpupoolIpcChunk bad = ch[0];
        bad.fd = -1;
        BAD(gpupool_import(1, &bad, 1, cb, 0, 1, &imp), GPUPOOL_STATUS_INVALID_ARGUMENT, "descriptor");
        CHECK(imp == NULL, "out after a refused import");
        BAD(gpupool_import(1, ch, nch, cb, off, cb * nch, &imp), GPUPOOL_STATUS_INVALID_ARGUMENT, "chunks");
        BAD(gpupool_import(1, ch, 0, cb, off, sz, &imp), GPUPOOL_STATUS_INVALID_ARGUMENT, "chunks");
        BAD(gpupool_import(1, NULL, nch, cb, off, sz, &imp), GPUPOOL_STATUS_NULL_ARGUMENT, "chunks");
        BAD(gpupool_import(1, ch, nch, cb, off, sz, NULL), GPUPOOL_STATUS_NULL_ARGUMENT, "out");
        BAD(gpupool_import(7, ch, nch, cb, off, sz, &imp), GPUPOOL_STATUS_INVALID_DEVICE, "invalid device 7");
        unsigned long long r1 = stat_now(1, "reserved_bytes", 1);
        EXPECT(gpupool_import(1, ch, nch, cb, off, sz, &imp), GPUPOOL_STATUS_OK, "");
        for (size_t i = 0; i < nch; i++) close(ch[i].fd);
        CHECK(imp && imp != e && memcmp(imp, e, 5 * MIB + 7) == 0, "imported bytes differ");
        memset(imp, 0x71, 4096);
        CHECK(((unsigned char *)e)[4095] == 0x71, "a write through the import shows in the export");
        CHECK(stat_now(1, "reserved_bytes", 1) == r1, "an import holds no pool memory");
        BAD(gpupool_import_close(e, 1), GPUPOOL_STATUS_UNKNOWN_POINTER, "unknown");
        BAD(gpupool_import_close(NULL, 1), GPUPOOL_STATUS_NULL_ARGUMENT, "ptr");
        EXPECT(gpupool_import_close(imp, 1), GPUPOOL_STATUS_OK, "");
        BAD(gpupool_import_close(imp, 1), GPUPOOL_STATUS_UNKNOWN_POINTER, "unknown");
        EXPECT(gpupool_free(e, 0, s0), GPUPOOL_STATUS_OK, "");
    }

    /* ---- free the rest, trim ------------------------------------------------------ */
    for (int i = 0; i < 6; i++) {
        if (i == 1 || i == 4) continue;
        EXPECT(gpupool_free(ptrs[i], 0, i % 2 ? s0 : NULL), GPUPOOL_STATUS_OK, "");
    }
    CHECK(stat_now(0, "requested_bytes", 1) == 0 && stat_now(0, "allocated_bytes", 1) == 0,
          "live bytes left %llu", stat_now(0, "requested_bytes", 1));
    EXPECT(gpupool_trim(), GPUPOOL_STATUS_OK, "");
    CHECK(stat_now(0, "reserved_bytes", 1) == 0 && stat_now(1, "reserved_bytes", 1) == 0,
          "reserved after trim: %llu %llu", stat_now(0, "reserved_bytes", 1), stat_now(1, "reserved_bytes", 1));

    /* ---- 8 threads at once ------------------------------------------------------- */
    struct worker w[THREADS];
    pthread_t th[THREADS];
    double t0 = now_s();
    for (int i = 0; i < THREADS; i++) {
        memset(&w[i], 0, sizeof w[i]);
        w[i].id = i;
        w[i].dev = i % 2;
        CHECK(pthread_create(&th[i], NULL, worker_main, &w[i]) == 0, "pthread_create");
    }
    long ops = 0;
    int errors = 0;
    for (int i = 0; i < THREADS; i++) {
        pthread_join(th[i], NULL);
        ops += w[i].ops;
        errors += w[i].errors;
        if (w[i].errors) fprintf(stderr, "thread %d: %d errors, first: %s\n", i, w[i].errors, w[i].first_error);
    }
    double dt = now_s() - t0;
    CHECK(errors == 0, "%d errors in the threads", errors);
    CHECK(ops == (long)THREADS * OPS, "ops %ld", ops);
    CHECK(stat_now(0, "requested_bytes", 1) == 0 && stat_now(1, "requested_bytes", 1) == 0,
          "live bytes after threads: %llu %llu", stat_now(0, "requested_bytes", 1), stat_now(1, "requested_bytes", 1));
    printf("threads: %d threads, %ld ops (alloc or free), %d errors, %.3f s\n", THREADS, ops, errors, dt);

    /* ---- calls from a thread's exit destructors ------------------------------------------ */
    {
        unsigned long long live0 = stat_now(0, "requested_bytes", 1);
        pthread_t t;
        CHECK(pthread_key_create(&exit_key, exit_free) == 0, "pthread_key_create");
        CHECK(pthread_create(&t, NULL, exit_main, NULL) == 0, "pthread_create");
        pthread_join(t, NULL);
        CHECK(exit_mem[0] && exit_mem[1] && exit_mem[2], "allocations before the exit");
        for (int i = 0; i < 5; i++)
            CHECK(exit_rc[i] == GPUPOOL_STATUS_OK, "call %d from an exit destructor: %s", i,
                  gpupool_status_name(exit_rc[i]));
        CHECK(stat_now(0, "requested_bytes", 1) == live0, "live bytes after the exit: %llu, before %llu",
              stat_now(0, "requested_bytes", 1), live0);
        void *again = NULL;
        EXPECT(gpupool_alloc(4096, 0, NULL, &again), GPUPOOL_STATUS_OK, "");
        EXPECT(gpupool_free(again, 0, NULL), GPUPOOL_STATUS_OK, "");
        pthread_key_delete(exit_key);
    }

    /* ---- shutdown and after --------------------------------------------------------- */
    EXPECT(gpupool_alloc(4096, 0, s0, &p), GPUPOOL_STATUS_OK, ""); /* left live on purpose */
    EXPECT(gpupool_shutdown(), GPUPOOL_STATUS_OK, "");
    EXPECT(gpupool_shutdown(), GPUPOOL_STATUS_SHUTDOWN, "already shut down");
    EXPECT(gpupool_alloc(64, 0, NULL, &q), GPUPOOL_STATUS_SHUTDOWN, "shut down");
    CHECK(q == NULL, "out after shutdown");
    EXPECT(gpupool_free(p, 0, s0), GPUPOOL_STATUS_SHUTDOWN, "shut down");
    EXPECT(gpupool_record_stream(p, 0, s0), GPUPOOL_STATUS_SHUTDOWN, "shut down");
    EXPECT(gpupool_stream_create(0, &q), GPUPOOL_STATUS_SHUTDOWN, "shut down");
    EXPECT(gpupool_stream_destroy(0, s0), GPUPOOL_STATUS_SHUTDOWN, "shut down");
    EXPECT(gpupool_stats_json(0, buf, sizeof buf), GPUPOOL_STATUS_SHUTDOWN, "shut down");
    EXPECT(gpupool_snapshot_json(0, buf, sizeof buf), GPUPOOL_STATUS_SHUTDOWN, "shut down");
    EXPECT(gpupool_snapshot_pickle(0, path), GPUPOOL_STATUS_SHUTDOWN, "shut down");
    EXPECT(gpupool_record_history(0, 1), GPUPOOL_STATUS_SHUTDOWN, "shut down");
    EXPECT(gpupool_trim(), GPUPOOL_STATUS_SHUTDOWN, "shut down");
    EXPECT(gpupool_device_count(&n), GPUPOOL_STATUS_SHUTDOWN, "shut down");
    EXPECT(gpupool_memory_stats_json(0, buf, sizeof buf), GPUPOOL_STATUS_SHUTDOWN, "shut down");
    EXPECT(gpupool_reset_peak_stats(0), GPUPOOL_STATUS_SHUTDOWN, "shut down");
    EXPECT(gpupool_set_memory_limit(0, MIB), GPUPOOL_STATUS_SHUTDOWN, "shut down");
    EXPECT(gpupool_pause(5, 1, NULL), GPUPOOL_STATUS_SHUTDOWN, "shut down");
    EXPECT(gpupool_resume(5, NULL), GPUPOOL_STATUS_SHUTDOWN, "shut down");
    EXPECT(gpupool_alloc_tagged(64, 0, NULL, 5, &q), GPUPOOL_STATUS_SHUTDOWN, "shut down");
    EXPECT(gpupool_import_close(p, 0), GPUPOOL_STATUS_SHUTDOWN, "shut down");
    CHECK(q == NULL, "tagged out after shutdown");
    q = gpupool_torch_malloc(64, 0, NULL);
    CHECK(q == NULL && strstr(gpupool_last_error(), "shut down"), "torch_malloc after shutdown");
    gpupool_torch_free(p, 4096, 0, NULL);
    CHECK(strstr(gpupool_last_error(), "shut down") != NULL, "torch_free after shutdown");

    /* ---- a second life, configured from GPUPOOL_CONF ------------------------------------ */
    /* With a limit and memory reserved up front from the configuration. */
    setenv("GPUPOOL_CONF", "backend=sim,devices=1,capacity=64MiB,max_bytes=16MiB,initial_bytes=6MiB,maint_ms=0", 1);
    EXPECT(gpupool_init(NULL), GPUPOOL_STATUS_OK, "");
    EXPECT(gpupool_device_count(&n), GPUPOOL_STATUS_OK, "");
    CHECK(n == 1, "device count from GPUPOOL_CONF: %d", n);
    EXPECT(gpupool_alloc(64, 0, NULL, &p), GPUPOOL_STATUS_OK, "");
    CHECK(stat_now(0, "reserved_bytes", 1) >= 6 * MIB, "initial_bytes: reserved %llu",
          stat_now(0, "reserved_bytes", 1));
    CHECK(stat_now(0, "num_device_allocs", 0) == 3, "initial_bytes served the first alloc: %llu chunks",
          stat_now(0, "num_device_allocs", 0));
    EXPECT(gpupool_free(p, 0, NULL), GPUPOOL_STATUS_OK, "");
    EXPECT(gpupool_alloc(20 * MIB, 0, NULL, &p), GPUPOOL_STATUS_OUT_OF_MEMORY, "requested");
    EXPECT(gpupool_alloc(10 * MIB, 0, NULL, &p), GPUPOOL_STATUS_OK, "");
    CHECK(stat_now(0, "reserved_bytes", 1) <= 16 * MIB, "max_bytes: reserved %llu",
          stat_now(0, "reserved_bytes", 1));
    EXPECT(gpupool_free(p, 0, NULL), GPUPOOL_STATUS_OK, "");
    EXPECT(gpupool_alloc(64, 1, NULL, &p), GPUPOOL_STATUS_INVALID_DEVICE, "1 device(s) present");
    EXPECT(gpupool_shutdown(), GPUPOOL_STATUS_OK, "");
    setenv("GPUPOOL_CONF", "backend=sim,bogus=1", 1);
    EXPECT(gpupool_init(NULL), GPUPOOL_STATUS_CONFIG, "bogus");
    EXPECT(gpupool_alloc(64, 0, NULL, &p), GPUPOOL_STATUS_SHUTDOWN, "shut down");

    printf("c_abi: %d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
