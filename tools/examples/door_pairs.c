/* N small (4 KiB) alloc + free pairs through libgpupool.so, as PyTorch
 * loads it (dlopen'ed or linked: every thread-local access of the library
 * goes through __tls_get_addr): the driver behind the ".so" instruction
 * counts in docs/BENCHMARKS.md section 4. Built and run by
 * scripts/abi-pairs.sh.
 *
 *   door_pairs_c c_abi|torch_hook [N]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "gpupool.h"

int main(int argc, char **argv) {
  const char *door = argc > 1 ? argv[1] : "c_abi";
  long n = argc > 2 ? atol(argv[2]) : 100000;
  int torch = strcmp(door, "torch_hook") == 0;
  if (!torch && strcmp(door, "c_abi") != 0) {
    fprintf(stderr, "usage: door_pairs_c c_abi|torch_hook [N]\n");
    return 2;
  }
  if (gpupool_init("backend=sim,devices=1,backing=accounting,capacity=8GiB,maint_ms=0")) {
    fprintf(stderr, "gpupool_init: %s\n", gpupool_last_error());
    return 1;
  }
  void *s = NULL;
  if (gpupool_stream_create(0, &s)) return 1;
  for (long i = 0; i < n; i++) {
    if (torch) {
      void *p = gpupool_torch_malloc(4096, 0, s);
      if (!p) return 1;
      gpupool_torch_free(p, 4096, 0, s);
    } else {
      void *p = NULL;
      if (gpupool_alloc(4096, 0, s, &p) || gpupool_free(p, 0, s)) {
        fprintf(stderr, "%s\n", gpupool_last_error());
        return 1;
      }
    }
  }
  if (gpupool_stream_destroy(0, s)) return 1;
  return gpupool_shutdown();
}
