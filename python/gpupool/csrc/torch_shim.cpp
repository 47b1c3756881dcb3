// gpupool as PyTorch's CUDA allocator, through PyTorch's C++
// pluggable-allocator API (torch/csrc/cuda/CUDAPluggableAllocator.h).
//
// Built by gpupool.torch.install() on first use with the installed torch's
// headers (so the allocator's vtable matches that torch exactly) and loaded
// with ctypes: it is not a Python module and has a plain C entry point,
// gpupool_torch_shim_install(). It links torch (libtorch_cuda, libc10_cuda,
// libc10) and nothing of gpupool: it dlopens the libgpupool.so the Python
// package loaded (same path, so the same loaded copy and the same runtime)
// and resolves gpupool's C ABI with dlsym.
//
// What it wires (each through the C ABI, include/gpupool.h):
//   malloc         gpupool_alloc (or gpupool_alloc_in_pool inside a private
//                  pool); a failure throws: c10::OutOfMemoryError
//                  (torch.OutOfMemoryError) for GPUPOOL_STATUS_OUT_OF_MEMORY,
//                  _DEVICE_OUT_OF_MEMORY and _INVALID_SIZE (malloc never
//                  passes 0, so: larger than the device, which PyTorch's own
//                  allocator also reports as out of memory), c10::Error
//                  (RuntimeError) otherwise, with gpupool_last_error()'s report;
//   free           gpupool_free on the allocation's stream (PyTorch passes it);
//   record_stream  gpupool_torch_record_stream (finds the owning device);
//   empty_cache    gpupool_trim;
//   statistics     torch.cuda.memory_stats() and the helpers built on it
//                  (memory_allocated, max_memory_allocated, memory_reserved,
//                  ...) from gpupool_memory_stats_json (PyTorch's keys, the
//                  "all" entries; no small/large pool split),
//                  reset_peak_memory_stats from gpupool_reset_peak_stats;
//   memory fraction gpupool_set_memory_limit(device, fraction x the device's
//                  total memory, from the driver's cuDeviceTotalMem);
//   private pools  (torch.cuda.graph, torch.cuda.MemPool + use_mem_pool)
//                  gpupool_begin_allocate_to_pool / _alloc_in_pool /
//                  _end_allocate_to_pool / _release_pool, when the library
//                  has them (resolved at install; without them everything
//                  else works and creating a pool raises a clear error).
//
// Why a subclass of CUDAPluggableAllocator rather than the object
// createCustomAllocator() returns: the plain pluggable allocator does not
// override createOrIncrefPool / getPoolUseCount / setUseOnOOM, whose
// CUDAAllocator defaults throw, so torch.cuda.MemPool() could not even be
// constructed (and ~MemPool calls setUseOnOOM). The subclass overrides those
// and getMemoryFraction; everything else is the base class, configured with
// its own setters (set_record_stream_fn, set_memory_fraction_fn,
// set_reset_fn, set_begin_allocate_to_pool, set_end_allocate_to_pool_fn,
// set_release_pool), exactly as createCustomAllocator's object would be.
//
// Private pools. PyTorch names a pool with MempoolId_t, a pair of u64: graph
// pools are {n, 0}, user pools (torch.cuda.MemPool, graph_pool_handle())
// {0, n}. The shim maps it to one nonzero u64 (pool_key below). PyTorch's
// beginAllocateToPool gives a filter over streams, not a stream; the shim
// keeps the active pools with their filters and, in malloc, asks them in
// order of activation: the first that accepts the allocating stream gets
// the allocation, through gpupool_alloc_in_pool. gpupool is told of the
// routed streams with gpupool_begin_allocate_to_pool(device, pool, stream):
// at beginAllocateToPool for the current stream (PyTorch calls it on the
// capturing stream just before the capture begins, as gpupool wants), and
// at the first allocation a pool accepts on any other stream (side streams
// joining a capture); at endAllocateToPool, gpupool_end_allocate_to_pool
// once. Pool lifetimes are counted as PyTorch's own allocator counts them
// (createOrIncrefPool and beginAllocateToPool add one, releasePool takes
// one); at zero the shim calls gpupool_release_pool(device, pool) when
// gpupool has seen the pool. While a pool is active, a free on a stream its
// filter accepts but gpupool was not told of is deferred to
// endAllocateToPool (gpupool records no event on a stream it does not know
// is capturing), and gpupool's calls run in relaxed stream-capture mode (a
// capture in global mode would otherwise fail them on every thread).

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/Exception.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <dlfcn.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace {

// ---- gpupool's C ABI, resolved at install ------------------------------------

constexpr int kOk = 0;
constexpr int kNotInitialized = 1;      // GPUPOOL_STATUS_NOT_INITIALIZED
constexpr int kShutdown = 3;            // GPUPOOL_STATUS_SHUTDOWN
constexpr int kInvalidSize = 7;         // GPUPOOL_STATUS_INVALID_SIZE: larger than the device
constexpr int kOutOfMemory = 14;        // GPUPOOL_STATUS_OUT_OF_MEMORY
constexpr int kDeviceOutOfMemory = 15;  // GPUPOOL_STATUS_DEVICE_OUT_OF_MEMORY

struct Gpupool {
  int (*alloc)(size_t, int, void*, void**) = nullptr;
  int (*free)(void*, int, void*) = nullptr;
  void (*torch_record_stream)(void*, void*) = nullptr;
  int (*trim)() = nullptr;
  int (*set_memory_limit)(int, uint64_t) = nullptr;
  int (*memory_stats_json)(int, char*, size_t) = nullptr;
  size_t (*needed_len)() = nullptr;
  int (*reset_peak_stats)(int) = nullptr;
  const char* (*last_error)() = nullptr;
  const char* (*status_name)(int) = nullptr;
  // Private pools: optional (a library without them serves everything else).
  int (*begin_allocate_to_pool)(int, uint64_t, void*) = nullptr;
  int (*end_allocate_to_pool)(int, uint64_t) = nullptr;
  int (*release_pool)(int, uint64_t) = nullptr;
  int (*alloc_in_pool)(size_t, int, void*, uint64_t, void**) = nullptr;
  bool pools() const {
    return begin_allocate_to_pool && end_allocate_to_pool && release_pool &&
        alloc_in_pool;
  }
};

Gpupool g;
std::string g_missing_pools;  // the pool symbols the library lacks

std::string last_error() {
  const char* m = g.last_error ? g.last_error() : nullptr;
  return m ? std::string(m) : std::string();
}

std::string status_name(int st) {
  const char* n = g.status_name ? g.status_name(st) : nullptr;
  return n ? std::string(n) : ("status " + std::to_string(st));
}

// Throws PyTorch's exception for a failed gpupool call.
[[noreturn]] void throw_status(int st, const char* what) {
  std::string msg = last_error();
  if (st == kOutOfMemory || st == kDeviceOutOfMemory || st == kInvalidSize) {
    TORCH_CHECK_WITH(
        OutOfMemoryError,
        false,
        "gpupool: CUDA out of memory (",
        what,
        "): ",
        msg,
        " [",
        status_name(st),
        "]");
  }
  TORCH_CHECK(false, "gpupool: ", what, " failed: ", msg, " [", status_name(st), "]");
  __builtin_unreachable();
}

// ---- the CUDA driver (device size, stream-capture mode) ----------------------------

// From the libcuda PyTorch loaded, with dlsym: no build-time CUDA library.
struct Driver {
  int (*device_get)(int*, int) = nullptr;                  // cuDeviceGet
  int (*total_mem)(size_t*, int) = nullptr;                // cuDeviceTotalMem_v2
  int (*exchange_capture_mode)(int*) = nullptr;            // cuThreadExchangeStreamCaptureMode
};

const Driver& driver() {
  static Driver d;
  static std::once_flag once;
  std::call_once(once, [] {
    void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (!h) h = dlopen("libcuda.so.1", RTLD_NOW);
    if (!h) return;
    d.device_get = reinterpret_cast<int (*)(int*, int)>(dlsym(h, "cuDeviceGet"));
    d.total_mem = reinterpret_cast<int (*)(size_t*, int)>(dlsym(h, "cuDeviceTotalMem_v2"));
    d.exchange_capture_mode =
        reinterpret_cast<int (*)(int*)>(dlsym(h, "cuThreadExchangeStreamCaptureMode"));
  });
  return d;
}

// The device's total memory (the memory fraction's base); no context needed.
uint64_t device_total_bytes(int device) {
  const Driver& d = driver();
  TORCH_CHECK(d.device_get && d.total_mem, "gpupool: libcuda.so.1 (cuDeviceTotalMem_v2) not found");
  int dev = 0;
  size_t bytes = 0;
  TORCH_CHECK(d.device_get(&dev, device) == 0, "gpupool: cuDeviceGet(", device, ") failed");
  TORCH_CHECK(d.total_mem(&bytes, dev) == 0, "gpupool: cuDeviceTotalMem(", device, ") failed");
  return bytes;
}

// While a private pool is active (a CUDA graph may be capturing, by default
// in cudaStreamCaptureModeGlobal, which makes driver calls that are unsafe
// during capture fail on every thread), gpupool's calls run with this
// thread in relaxed capture mode, as PyTorch's own allocator does around
// cudaMalloc. Calls on the capturing stream itself stay gpupool's business.
class RelaxedCapture {
 public:
  explicit RelaxedCapture(bool want) {
    const Driver& d = driver();
    if (want && d.exchange_capture_mode) {
      on_ = d.exchange_capture_mode(&mode_) == 0;
    }
  }
  ~RelaxedCapture() {
    if (on_) driver().exchange_capture_mode(&mode_);
  }
  RelaxedCapture(const RelaxedCapture&) = delete;
  RelaxedCapture& operator=(const RelaxedCapture&) = delete;

 private:
  int mode_ = 2;  // CU_STREAM_CAPTURE_MODE_RELAXED; the previous mode after the swap
  bool on_ = false;
};

// ---- statistics (torch.cuda.memory_stats and its helpers) -------------------------

constexpr int kBufferTooSmall = 5;  // GPUPOOL_STATUS_BUFFER_TOO_SMALL

// gpupool_memory_stats_json's flat {"key":N,...} (PyTorch's keys), as text.
std::string memory_stats_text(int device) {
  std::vector<char> buf(16384);
  for (int tries = 0; tries < 8; ++tries) {
    int st = g.memory_stats_json(device, buf.data(), buf.size());
    if (st == kOk) return std::string(buf.data());
    if (st != kBufferTooSmall) throw_status(st, "gpupool_memory_stats_json");
    buf.resize(g.needed_len() + 4096);
  }
  TORCH_CHECK(false, "gpupool: gpupool_memory_stats_json kept growing");
  __builtin_unreachable();
}

// The integer after "key": in that text, 0 when absent.
int64_t stat_value(const std::string& text, const std::string& key) {
  std::string needle = "\"" + key + "\":";
  size_t at = text.find(needle);
  if (at == std::string::npos) return 0;
  return std::strtoll(text.c_str() + at + needle.size(), nullptr, 10);
}

void fill_stat(c10::CachingAllocator::Stat& stat, const std::string& text, const std::string& name) {
  stat.current = stat_value(text, name + ".all.current");
  stat.peak = stat_value(text, name + ".all.peak");
  stat.allocated = stat_value(text, name + ".all.allocated");
  stat.freed = stat_value(text, name + ".all.freed");
}

// gpupool's figures in PyTorch's DeviceStats: the aggregate ("all") entry
// of each StatArray (gpupool keeps no small/large pool split), the counters
// PyTorch and gpupool share; the rest stays 0.
c10::CachingDeviceAllocator::DeviceStats device_stats(int device) {
  std::string text = memory_stats_text(device);
  c10::CachingDeviceAllocator::DeviceStats out;
  constexpr size_t kAll = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  fill_stat(out.allocation[kAll], text, "allocation");
  fill_stat(out.active[kAll], text, "active");
  fill_stat(out.allocated_bytes[kAll], text, "allocated_bytes");
  fill_stat(out.reserved_bytes[kAll], text, "reserved_bytes");
  fill_stat(out.active_bytes[kAll], text, "active_bytes");
  fill_stat(out.inactive_split_bytes[kAll], text, "inactive_split_bytes");
  fill_stat(out.requested_bytes[kAll], text, "requested_bytes");
  out.num_alloc_retries = stat_value(text, "num_alloc_retries");
  out.num_ooms = stat_value(text, "num_ooms");
  out.num_device_alloc = stat_value(text, "num_device_alloc");
  out.num_device_free = stat_value(text, "num_device_free");
  return out;
}

// ---- private pools ----------------------------------------------------------------

using PoolId = c10::cuda::MempoolId_t;

// PyTorch's {first, second} as one nonzero u64: graph pools {n, 0} -> 2n,
// user pools {0, n} -> 2n + 1; anything else (both nonzero) mixed, odd bit
// forced so it is never 0.
uint64_t pool_key(PoolId id) {
  uint64_t a = id.first, b = id.second;
  if (a != 0 && b == 0) return a << 1;
  if (a == 0 && b != 0) return (b << 1) | 1;
  uint64_t h = a * 0x9E3779B97F4A7C15ULL ^ (b + 0x7F4A7C159E3779B9ULL + (a << 6) + (a >> 2));
  return h | 1;
}

struct Deferred {
  void* ptr;
  int device;
  cudaStream_t stream;
};

struct Active {
  int device;
  uint64_t pool;
  std::function<bool(cudaStream_t)> filter;
  std::vector<cudaStream_t> tried;  // streams gpupool_begin_allocate_to_pool was called for
  std::vector<cudaStream_t> begun;  // ... and accepted (gpupool knows they route/capture)
  std::vector<Deferred> deferred;   // frees on accepted streams gpupool was not told of
};

// Pools gpupool has seen (a begin or an allocation in it succeeded): the
// only ones gpupool_release_pool is called for.
std::set<std::pair<int, uint64_t>> g_touched;  // under g_pools_mu

bool contains(const std::vector<cudaStream_t>& v, cudaStream_t s) {
  for (auto x : v) {
    if (x == s) return true;
  }
  return false;
}

// Under g_pools_mu. Tells gpupool that `stream` routes to the pool (and may
// capture), once per stream; a refusal (the stream already routed to
// another pool, say) is not an error: allocations still go to the pool
// through gpupool_alloc_in_pool, whatever the stream's routing.
void begin_stream(Active& a, cudaStream_t stream) {
  if (contains(a.tried, stream)) return;
  a.tried.push_back(stream);
  if (g.begin_allocate_to_pool(a.device, a.pool, stream) == kOk) {
    a.begun.push_back(stream);
    g_touched.insert({a.device, a.pool});
  }
}

std::mutex g_pools_mu;
std::vector<Active> g_active;                   // under g_pools_mu
std::map<std::pair<int, uint64_t>, int> g_uses;  // under g_pools_mu
std::atomic<int> g_n_active{0};

void require_pools(const char* what) {
  TORCH_CHECK(
      g.pools(),
      "gpupool: ",
      what,
      ": private memory pools (torch.cuda.graph, torch.cuda.MemPool) are "
      "unavailable: the loaded libgpupool.so lacks ",
      g_missing_pools);
}

void incref(int device, uint64_t pool) {
  g_uses[{device, pool}] += 1;
}

// Under g_pools_mu. Never throws (called from destructors).
void decref(int device, uint64_t pool) {
  auto it = g_uses.find({device, pool});
  if (it == g_uses.end()) return;
  if (--it->second > 0) return;
  g_uses.erase(it);
  if (g.release_pool && g_touched.erase({device, pool}) > 0) {
    int st = g.release_pool(device, pool);
    if (st != kOk) {
      std::fprintf(
          stderr,
          "gpupool: gpupool_release_pool(%d, %llu) failed: %s\n",
          device,
          static_cast<unsigned long long>(pool),
          last_error().c_str());
    }
  }
}

// The pool an allocation on (device, stream) goes to, or 0.
uint64_t route(int device, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(g_pools_mu);
  for (auto& a : g_active) {
    if (a.device != device || !a.filter(stream)) continue;
    begin_stream(a, stream);
    return a.pool;
  }
  return 0;
}

void touched(int device, uint64_t pool) {
  std::lock_guard<std::mutex> lock(g_pools_mu);
  g_touched.insert({device, pool});
}

// ---- the hooks --------------------------------------------------------------------

void* shim_malloc(size_t size, int device, cudaStream_t stream) {
  if (size == 0) return nullptr;  // PyTorch never frees it
  void* out = nullptr;
  bool pools_active = g_n_active.load(std::memory_order_acquire) > 0;
  RelaxedCapture relaxed(pools_active);
  uint64_t pool = pools_active ? route(device, stream) : 0;
  int st = pool ? g.alloc_in_pool(size, device, stream, pool, &out)
                : g.alloc(size, device, stream, &out);
  if (pool && st == kOk) touched(device, pool);
  if (st != kOk) {
    std::string what = "allocating " + std::to_string(size) + " bytes on device " +
        std::to_string(device);
    throw_status(st, what.c_str());
  }
  return out;
}

// A free on a stream an active pool accepts (a capturing stream) but that
// gpupool was not told of (no allocation on it yet in this capture, or
// gpupool refused its routing) waits for that pool's endAllocateToPool, so
// that gpupool records no event on a stream it does not know is
// capturing. Frees on streams gpupool knows are its own business (it
// defers what needs deferring and reuses blocks within the capture, as
// PyTorch's allocator does). Returns whether it was deferred.
bool defer_free(void* ptr, int device, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(g_pools_mu);
  for (auto& a : g_active) {
    if (a.device == device && !contains(a.begun, stream) && a.filter(stream)) {
      a.deferred.push_back(Deferred{ptr, device, stream});
      return true;
    }
  }
  return false;
}

void free_now(void* ptr, int device, cudaStream_t stream) {
  int st = g.free(ptr, device, stream);
  // After gpupool_shutdown (tensors outliving it at exit) the memory is
  // already back with the driver: nothing to report.
  if (st != kOk && st != kShutdown && st != kNotInitialized) {
    // Frees run in destructors: report, never throw.
    std::fprintf(stderr, "gpupool: free of %p on device %d failed: %s\n", ptr, device,
                 last_error().c_str());
  }
}

void shim_free(void* ptr, size_t /*size*/, int device, cudaStream_t stream) {
  if (!ptr) return;
  if (g_n_active.load(std::memory_order_acquire) > 0) {
    RelaxedCapture relaxed(true);
    try {
      if (defer_free(ptr, device, stream)) return;
    } catch (...) {
      // A filter that throws: free now.
    }
    free_now(ptr, device, stream);
    return;
  }
  free_now(ptr, device, stream);
}

void shim_record_stream(void* ptr, cudaStream_t stream) {
  g.torch_record_stream(ptr, stream);
  std::string msg = last_error();
  TORCH_CHECK(msg.empty(), "gpupool: record_stream failed: ", msg);
}

std::mutex g_fraction_mu;
std::map<int, double> g_fraction;  // under g_fraction_mu

void shim_memory_fraction(double fraction, int device) {
  TORCH_CHECK(fraction >= 0.0 && fraction <= 1.0, "gpupool: memory fraction ", fraction,
              " is outside [0, 1]");
  uint64_t total = device_total_bytes(device);
  uint64_t limit = static_cast<uint64_t>(fraction * static_cast<double>(total));
  if (fraction > 0.0 && limit == 0) limit = 1;  // 0 would mean "no limit"
  if (fraction >= 1.0) limit = 0;               // the device itself is the limit
  int st = g.set_memory_limit(device, limit);
  if (st != kOk) throw_status(st, "gpupool_set_memory_limit");
  std::lock_guard<std::mutex> lock(g_fraction_mu);
  g_fraction[device] = fraction;
}

void shim_empty_cache() {
  int st = g.trim();
  if (st != kOk) {
    // ~MemPool calls emptyCache: warn, never throw.
    TORCH_WARN("gpupool: empty_cache (gpupool_trim) failed: ", last_error());
  }
}

void shim_begin_allocate_to_pool(int device, PoolId id, std::function<bool(cudaStream_t)> filter) {
  require_pools("beginAllocateToPool");
  uint64_t pool = pool_key(id);
  std::lock_guard<std::mutex> lock(g_pools_mu);
  for (auto& a : g_active) {
    TORCH_CHECK(!(a.device == device && a.pool == pool),
                "gpupool: beginAllocateToPool: already allocating to this pool");
  }
  incref(device, pool);
  g_active.push_back(Active{device, pool, std::move(filter), {}, {}, {}});
  g_n_active.fetch_add(1, std::memory_order_release);
  // gpupool wants the routed stream before the capture begins, and PyTorch
  // calls this just before cudaStreamBeginCapture, on the capturing stream
  // (use_mem_pool: on the stream the thread allocates on). The filter cannot
  // accept it yet (no capture id), so it is told now, best effort: without
  // a CUDA device (or should the lookup fail) routing starts at the first
  // allocation the filter accepts.
  try {
    begin_stream(g_active.back(), c10::cuda::getCurrentCUDAStream(device).stream());
  } catch (const std::exception&) {
  }
}

void shim_end_allocate_to_pool(int device, PoolId id) {
  if (!g.pools()) return;
  uint64_t pool = pool_key(id);
  bool begun = false;
  std::vector<Deferred> deferred;
  {
    std::lock_guard<std::mutex> lock(g_pools_mu);
    for (auto it = g_active.begin(); it != g_active.end(); ++it) {
      if (it->device == device && it->pool == pool) {
        begun = !it->begun.empty();
        deferred.swap(it->deferred);
        g_active.erase(it);
        g_n_active.fetch_sub(1, std::memory_order_release);
        break;
      }
    }
  }
  int st = begun ? g.end_allocate_to_pool(device, pool) : kOk;
  for (const Deferred& d : deferred) free_now(d.ptr, d.device, d.stream);
  if (st != kOk) throw_status(st, "gpupool_end_allocate_to_pool");
}

void shim_release_pool(int device, PoolId id) {
  std::lock_guard<std::mutex> lock(g_pools_mu);
  decref(device, pool_key(id));
}

struct GpupoolAllocator final : public torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator {
  using Base = torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator;
  GpupoolAllocator() : Base(shim_malloc, shim_free) {}

  // torch.cuda.MemPool(): the pool exists once named; gpupool makes it
  // when allocations are first routed to it.
  void createOrIncrefPool(
      c10::DeviceIndex device,
      c10::cuda::MempoolId_t mempool_id,
      std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator> allocator) override {
    require_pools("torch.cuda.MemPool");
    TORCH_CHECK(!allocator || allocator.get() == this,
                "gpupool: a torch.cuda.MemPool with its own allocator is not supported "
                "while gpupool is PyTorch's allocator");
    std::lock_guard<std::mutex> lock(g_pools_mu);
    incref(device, pool_key(mempool_id));
  }

  int getPoolUseCount(c10::DeviceIndex device, c10::cuda::MempoolId_t mempool_id) override {
    std::lock_guard<std::mutex> lock(g_pools_mu);
    auto it = g_uses.find({static_cast<int>(device), pool_key(mempool_id)});
    return it == g_uses.end() ? 0 : it->second;
  }

  void setUseOnOOM(c10::DeviceIndex, c10::cuda::MempoolId_t, bool use_on_oom) override {
    // ~MemPool calls this with false: must not throw.
    TORCH_CHECK(!use_on_oom, "gpupool: MemPool(use_on_oom=True) is not supported");
  }

  void setNoSplit(c10::DeviceIndex, c10::cuda::MempoolId_t) override {
    // gpupool never splits a block across two tensors' lifetimes in a way
    // the caller can observe; nothing to do.
  }

  // torch.cuda.memory_stats(), memory_allocated(), max_memory_allocated(),
  // memory_reserved(), ... with gpupool's figures.
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    return device_stats(device);
  }

  // torch.cuda.reset_peak_memory_stats().
  void resetPeakStats(c10::DeviceIndex device) override {
    int st = g.reset_peak_stats(device);
    if (st != kOk) throw_status(st, "gpupool_reset_peak_stats");
  }

  // torch.cuda.empty_cache() ({0, 0}) and ~MemPool (its id): gpupool_trim
  // gives every device's cached memory back. Never throws.
  void emptyCache(c10::cuda::MempoolId_t /*mempool_id*/) override {
    shim_empty_cache();
  }

  double getMemoryFraction(c10::DeviceIndex device) override {
    std::lock_guard<std::mutex> lock(g_fraction_mu);
    auto it = g_fraction.find(device);
    return it == g_fraction.end() ? 1.0 : it->second;
  }

  std::string name() override {
    return "gpupool";
  }
};

std::shared_ptr<GpupoolAllocator> g_allocator;
std::mutex g_install_mu;

template <typename F>
bool resolve(void* h, const char* name, F& out) {
  out = reinterpret_cast<F>(dlsym(h, name));
  return out != nullptr;
}

void set_error(char* err, size_t len, const std::string& msg) {
  if (err && len) {
    std::snprintf(err, len, "%s", msg.c_str());
  }
}

}  // namespace

extern "C" {

// 1 when the loaded library has the private-pool functions (after install).
__attribute__((visibility("default"))) int gpupool_torch_shim_has_pools() {
  return g.pools() ? 1 : 0;
}

// The pool symbols the library lacks, "" when it has them all.
__attribute__((visibility("default"))) const char* gpupool_torch_shim_missing_pools() {
  return g_missing_pools.c_str();
}

// PyTorch's MempoolId_t as the u64 gpupool sees (for tests and logs).
__attribute__((visibility("default"))) uint64_t gpupool_torch_shim_pool_key(uint64_t first,
                                                                            uint64_t second) {
  return pool_key(PoolId{first, second});
}

// Opens `libpath` (the libgpupool.so the package loaded), resolves its C
// ABI, and makes the gpupool allocator PyTorch's current CUDA allocator.
// Returns 0, or -1 with a message in err. A second call is a no-op.
__attribute__((visibility("default"))) int gpupool_torch_shim_install(const char* libpath,
                                                                      char* err,
                                                                      size_t errlen) {
  try {
    std::lock_guard<std::mutex> lock(g_install_mu);
    if (g_allocator) return 0;
    void* h = dlopen(libpath, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      set_error(err, errlen, std::string("dlopen failed: ") + dlerror());
      return -1;
    }
    Gpupool f;
    std::string missing;
    auto need = [&](bool ok, const char* name) {
      if (!ok) missing += std::string(missing.empty() ? "" : ", ") + name;
    };
    need(resolve(h, "gpupool_alloc", f.alloc), "gpupool_alloc");
    need(resolve(h, "gpupool_free", f.free), "gpupool_free");
    need(resolve(h, "gpupool_torch_record_stream", f.torch_record_stream),
         "gpupool_torch_record_stream");
    need(resolve(h, "gpupool_trim", f.trim), "gpupool_trim");
    need(resolve(h, "gpupool_set_memory_limit", f.set_memory_limit), "gpupool_set_memory_limit");
    need(resolve(h, "gpupool_last_error", f.last_error), "gpupool_last_error");
    need(resolve(h, "gpupool_status_name", f.status_name), "gpupool_status_name");
    need(resolve(h, "gpupool_memory_stats_json", f.memory_stats_json), "gpupool_memory_stats_json");
    need(resolve(h, "gpupool_needed_len", f.needed_len), "gpupool_needed_len");
    need(resolve(h, "gpupool_reset_peak_stats", f.reset_peak_stats), "gpupool_reset_peak_stats");
    if (!missing.empty()) {
      set_error(err, errlen, std::string(libpath) + " lacks " + missing);
      return -1;
    }
    std::string pools_missing;
    auto opt = [&](bool ok, const char* name) {
      if (!ok) pools_missing += std::string(pools_missing.empty() ? "" : ", ") + name;
    };
    opt(resolve(h, "gpupool_begin_allocate_to_pool", f.begin_allocate_to_pool),
        "gpupool_begin_allocate_to_pool");
    opt(resolve(h, "gpupool_end_allocate_to_pool", f.end_allocate_to_pool),
        "gpupool_end_allocate_to_pool");
    opt(resolve(h, "gpupool_release_pool", f.release_pool), "gpupool_release_pool");
    opt(resolve(h, "gpupool_alloc_in_pool", f.alloc_in_pool), "gpupool_alloc_in_pool");
    if (!pools_missing.empty()) {
      f.begin_allocate_to_pool = nullptr;
      f.end_allocate_to_pool = nullptr;
      f.release_pool = nullptr;
      f.alloc_in_pool = nullptr;
    }
    g = f;
    g_missing_pools = pools_missing;

    auto a = std::make_shared<GpupoolAllocator>();
    a->set_record_stream_fn(shim_record_stream);
    a->set_memory_fraction_fn(shim_memory_fraction);
    a->set_reset_fn(shim_empty_cache);
    a->set_begin_allocate_to_pool(shim_begin_allocate_to_pool);
    a->set_end_allocate_to_pool_fn(shim_end_allocate_to_pool);
    a->set_release_pool(shim_release_pool);
    // What createCustomAllocator does after construction (marks it
    // initialized; no init_fn is set).
    a->init(0);
    torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(a);
    g_allocator = a;
    return 0;
  } catch (const std::exception& e) {
    set_error(err, errlen, e.what());
    return -1;
  } catch (...) {
    set_error(err, errlen, "unknown C++ exception");
    return -1;
  }
}

}  // extern "C"
