// Test harness for gpupool's torch shim without a GPU: the shim's own
// translation unit plus C entry points that drive the installed allocator
// the way PyTorch does, minus the CUDA calls PyTorch makes around it
// (current device, current stream). Built and loaded by
// python/tests/test_torch_shim_cpu.py where a torch with libtorch_cuda is
// importable; gpupool runs on the simulator there, streams are NULL.
#include "../gpupool/csrc/torch_shim.cpp"

namespace {

int report(char* err, size_t len, const char* kind, const char* what) {
  std::snprintf(err, len, "%s: %s", kind, what);
  return 1;
}

template <typename F>
int guarded(char* err, size_t len, F f) {
  try {
    f();
    return 0;
  } catch (const c10::OutOfMemoryError& e) {
    return report(err, len, "OutOfMemoryError", e.what_without_backtrace());
  } catch (const c10::Error& e) {
    return report(err, len, "Error", e.what_without_backtrace());
  } catch (const std::exception& e) {
    return report(err, len, "std::exception", e.what());
  }
}

}  // namespace

extern "C" {

// The allocator PyTorch would now call is the shim's.
int harness_current_is_shim() {
  return c10::cuda::CUDACachingAllocator::get() == g_allocator.get() ? 1 : 0;
}

int harness_name(char* out, size_t len) {
  std::snprintf(out, len, "%s", c10::cuda::CUDACachingAllocator::get()->name().c_str());
  return 0;
}

// CUDAPluggableAllocator::malloc (what allocate() calls after looking up
// the current device and stream).
int harness_malloc(size_t size, int device, void** out, char* err, size_t len) {
  return guarded(err, len, [&] { *out = g_allocator->malloc(size, device, nullptr); });
}

// The same on a given stream.
int harness_malloc_on(size_t size, int device, void* stream, void** out, char* err, size_t len) {
  return guarded(err, len, [&] {
    *out = g_allocator->malloc(size, device, static_cast<cudaStream_t>(stream));
  });
}

// What a DataPtr's deleter does.
int harness_free(void* ptr, char* err, size_t len) {
  return guarded(err, len, [&] { g_allocator->raw_delete(ptr); });
}

int harness_record_stream(void* ptr, char* err, size_t len) {
  return guarded(err, len, [&] { shim_record_stream(ptr, nullptr); });
}

int harness_empty_cache(char* err, size_t len) {
  return guarded(err, len, [&] { c10::cuda::CUDACachingAllocator::get()->emptyCache({0, 0}); });
}

int harness_set_memory_fraction(double fraction, int device, char* err, size_t len) {
  return guarded(err, len, [&] { g_allocator->setMemoryFraction(fraction, device); });
}

// getDeviceStats' aggregate entries, in this order: allocated current/peak,
// reserved current/peak, requested current/peak, active current, allocation
// current, num_ooms.
int harness_stats(int device, int64_t* out, char* err, size_t len) {
  return guarded(err, len, [&] {
    auto s = g_allocator->getDeviceStats(device);
    out[0] = s.allocated_bytes[0].current;
    out[1] = s.allocated_bytes[0].peak;
    out[2] = s.reserved_bytes[0].current;
    out[3] = s.reserved_bytes[0].peak;
    out[4] = s.requested_bytes[0].current;
    out[5] = s.requested_bytes[0].peak;
    out[6] = s.active_bytes[0].current;
    out[7] = s.allocation[0].current;
    out[8] = s.num_ooms;
  });
}

int harness_reset_peak(int device, char* err, size_t len) {
  return guarded(err, len, [&] { g_allocator->resetPeakStats(device); });
}

int harness_create_pool(int device, uint64_t first, uint64_t second, char* err, size_t len) {
  return guarded(err, len, [&] { g_allocator->createOrIncrefPool(device, {first, second}, nullptr); });
}

int harness_pool_use_count(int device, uint64_t first, uint64_t second) {
  return g_allocator->getPoolUseCount(device, {first, second});
}

// beginAllocateToPool with a filter accepting every stream.
int harness_begin_pool(int device, uint64_t first, uint64_t second, char* err, size_t len) {
  return guarded(err, len, [&] {
    g_allocator->beginAllocateToPool(device, {first, second}, [](cudaStream_t) { return true; });
  });
}

int harness_end_pool(int device, uint64_t first, uint64_t second, char* err, size_t len) {
  return guarded(err, len, [&] { g_allocator->endAllocateToPool(device, {first, second}); });
}

int harness_release_pool(int device, uint64_t first, uint64_t second, char* err, size_t len) {
  return guarded(err, len, [&] { g_allocator->releasePool(device, {first, second}); });
}

int harness_set_use_on_oom(int on, char* err, size_t len) {
  return guarded(err, len, [&] { g_allocator->setUseOnOOM(0, {0, 1}, on != 0); });
}

}  // extern "C"
