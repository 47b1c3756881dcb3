// gpupool compaction kernel: one launch runs a batch of device-to-device
// moves. Compiled at run time by NVRTC (src/backend/cuda/kernel.rs), which
// passes -DGPUPOOL_MAX_MOVES and -DGPUPOOL_TILE_BYTES so both sides agree.
//
// CONTRACT (enforced on the host by src/backend/move_groups.rs)
//
//   The moves of one launch run concurrently, in no particular order. So,
//   for any two different moves a and b of one launch:
//       dst(a) overlaps neither src(b) nor dst(b)
//   (ranges are [addr, addr + len)). Sources may overlap each other.
//   Under this rule no byte is written by one move and read or written by
//   another, so every interleaving equals running the moves one by one.
//
//   A single move may overlap itself (src and dst closer than len): it then
//   has memmove semantics. One block does it, staging STAGE_BYTES at a time
//   through shared memory, front to back when sliding down, back to front
//   when sliding up. Staging a window reads all of it before writing any of
//   it, and the writes of a window only land on source bytes of this window
//   or of windows already done, never on bytes still to be read.
//
//   A batch whose later moves read what earlier moves wrote is split by the
//   host into several launches on the same stream; stream order serialises
//   them, so the batch as a whole keeps its in-order (memmove) semantics.
//
// BATCH PASSING
//
//   The batch is a kernel parameter passed by value (MoveBatch, <= 4 KiB,
//   the classic parameter limit). cuLaunchKernel copies parameters when it
//   is called, so the host's copy may be reused at once: no staging buffer,
//   no event, nothing whose lifetime must follow the stream.
//
// WORK DISTRIBUTION
//
//   Each move is cut into units: TILE_BYTES tiles for an ordinary move, one
//   unit for a self-overlapping move. Units are numbered across the batch
//   in move order and unit u belongs to block u % gridDim.x (a grid-stride
//   loop). Every block walks the (at most GPUPOOL_MAX_MOVES) moves to keep
//   the running unit count, which is cheap and needs no prefix array.
//   Copies use 16-byte uint4 loads and stores when src and dst have the
//   same alignment modulo 16 (always, for pool blocks: 256-byte aligned),
//   with byte copies for an unaligned head and tail, and bytes throughout
//   otherwise.

#ifndef GPUPOOL_MAX_MOVES
#define GPUPOOL_MAX_MOVES 168
#endif
#ifndef GPUPOOL_TILE_BYTES
#define GPUPOOL_TILE_BYTES 16384ull
#endif
#ifndef GPUPOOL_STAGE_BYTES
#define GPUPOOL_STAGE_BYTES 8192u
#endif

typedef unsigned long long u64;
typedef unsigned char u8;

// Matches the Rust `#[repr(C)] struct Move { src, dst, len }` (three u64).
struct Move {
    u64 src, dst, len;
};

// Matches the Rust `MoveBatch` in src/backend/cuda/kernel.rs.
struct MoveBatch {
    unsigned n;
    unsigned reserved;
    Move moves[GPUPOOL_MAX_MOVES];
};

static_assert(sizeof(Move) == 24, "Move must be three u64");
static_assert(sizeof(MoveBatch) <= 4096, "kernel parameters are limited to 4 KiB");
static_assert(GPUPOOL_TILE_BYTES % 16 == 0, "tiles keep 16-byte alignment");
static_assert(GPUPOOL_STAGE_BYTES % 16 == 0, "staging windows keep 16-byte alignment");

__device__ __forceinline__ bool is_noop(const Move& m) {
    return m.len == 0 || m.src == m.dst;
}

__device__ __forceinline__ bool self_overlapping(const Move& m) {
    return !is_noop(m) && m.src < m.dst + m.len && m.dst < m.src + m.len;
}

__device__ __forceinline__ u64 units_of(const Move& m) {
    if (is_noop(m)) return 0;
    if (self_overlapping(m)) return 1;
    return (m.len + GPUPOOL_TILE_BYTES - 1) / GPUPOOL_TILE_BYTES;
}

// Copies n bytes; the ranges must not overlap. Called by the whole block.
__device__ void block_copy(u64 dst, u64 src, u64 n) {
    const unsigned t = threadIdx.x, step = blockDim.x;
    u64 head = n, vecs = 0;  // default: bytes only
    if (((src ^ dst) & 15) == 0) {
        head = (16 - (src & 15)) & 15;
        if (head > n) head = n;
        vecs = (n - head) / 16;
    }
    const u8* s = (const u8*)src;
    u8* d = (u8*)dst;
    for (u64 i = t; i < head; i += step) d[i] = s[i];
    const uint4* s4 = (const uint4*)(src + head);
    uint4* d4 = (uint4*)(dst + head);
#pragma unroll 4
    for (u64 i = t; i < vecs; i += step) d4[i] = s4[i];
    for (u64 i = head + vecs * 16 + t; i < n; i += step) d[i] = s[i];
}

// memmove of one self-overlapping move by one block, through shared memory.
// Every thread of the block must call it (it synchronises the block).
__device__ void block_memmove(u64 dst, u64 src, u64 n) {
    __shared__ uint4 stage[GPUPOOL_STAGE_BYTES / 16];
    u8* stage_b = (u8*)stage;
    const unsigned t = threadIdx.x, step = blockDim.x;
    const bool vec = ((src | dst | n) & 15) == 0;
    const bool down = dst < src;
    for (u64 done = 0; done < n; done += GPUPOOL_STAGE_BYTES) {
        const u64 rest = n - done;
        const unsigned w = rest < GPUPOOL_STAGE_BYTES ? (unsigned)rest : GPUPOOL_STAGE_BYTES;
        const u64 off = down ? done : rest - w;  // window [off, off + w)
        if (vec) {
            const uint4* s4 = (const uint4*)(src + off);
            for (unsigned i = t; i < w / 16; i += step) stage[i] = s4[i];
        } else {
            const u8* s = (const u8*)(src + off);
            for (unsigned i = t; i < w; i += step) stage_b[i] = s[i];
        }
        __syncthreads();  // the whole window is read before any of it is written
        if (vec) {
            uint4* d4 = (uint4*)(dst + off);
            for (unsigned i = t; i < w / 16; i += step) d4[i] = stage[i];
        } else {
            u8* d = (u8*)(dst + off);
            for (unsigned i = t; i < w; i += step) d[i] = stage_b[i];
        }
        __syncthreads();  // writes done (and stage free) before the next window
    }
}

extern "C" __global__ void gpupool_compact(const MoveBatch batch) {
    const unsigned n = batch.n < GPUPOOL_MAX_MOVES ? batch.n : GPUPOOL_MAX_MOVES;
    const u64 grid = gridDim.x;
    u64 first = 0;  // number of the current move's first unit in the batch
    for (unsigned k = 0; k < n; ++k) {
        const Move m = batch.moves[k];
        const u64 units = units_of(m);
        // This block's first unit of this move: (first + u) % grid == blockIdx.x.
        for (u64 u = (blockIdx.x + grid - first % grid) % grid; u < units; u += grid) {
            if (self_overlapping(m)) {
                block_memmove(m.dst, m.src, m.len);
            } else {
                const u64 off = u * GPUPOOL_TILE_BYTES;
                const u64 rest = m.len - off;
                block_copy(m.dst + off, m.src + off,
                           rest < GPUPOOL_TILE_BYTES ? rest : GPUPOOL_TILE_BYTES);
            }
        }
        first += units;
    }
}
