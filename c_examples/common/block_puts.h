/*
 * block_puts.h: how the CUDA examples split one transfer over blocks that each put a slice with
 * putWithSignalBlock() (the perf tools' -B, the bandwidth example's --blocks). Header-only,
 * C11 or C++, with the CUDA runtime.
 *
 *   block_split(n, max_blocks, limit, &blocks, &chunk)
 *     blocks of at least 64 KiB each (as NVSHMEM's perf tool splits), at most `max_blocks`,
 *     16-byte aligned chunks; one block with all `n` bytes where a chunk would be over `limit`
 *     (the library hands such block puts to the proxy, one trigger each: 128 blocks pushing
 *     2 MiB triggers at once ran 1000x slower than one trigger, bench/RESULTS.md session 17).
 *   block_limit(conn, &limit)
 *     the largest block put the library copies directly on `conn` (its epoch block's word
 *     MSCCLPP_EPOCH_DIRECT_BLOCK_BYTES; 0 where the direct path is off). cudaSuccess or the
 *     copy's error.
 */
#ifndef MSCCLPP_EXAMPLES_BLOCK_PUTS_H_
#define MSCCLPP_EXAMPLES_BLOCK_PUTS_H_

#include <cuda_runtime.h>
#include <mscclpp.h>
#include <stdint.h>

static inline void block_split(uint64_t n, uint64_t max_blocks, uint64_t limit, uint64_t *blocks,
                               uint64_t *chunk)
{
  uint64_t b = (n + (64u << 10) - 1) / (64u << 10);
  if (b < 1) b = 1;
  if (b > max_blocks) b = max_blocks;
  *blocks = b;
  *chunk = ((n + b - 1) / b + 15) / 16 * 16;
  if (*chunk > limit) {
    *blocks = 1;
    *chunk = n;
  }
}

static inline cudaError_t block_limit(const mscclppDevConn_t *conn, uint64_t *limit)
{
  uint64_t w[MSCCLPP_EPOCH_DIRECT_BLOCK_BYTES + 1];
  cudaError_t e = cudaMemcpy(w, (const void *)conn->localSignalEpochId, sizeof w,
                             cudaMemcpyDeviceToHost);
  if (e == cudaSuccess) *limit = w[MSCCLPP_EPOCH_DIRECT_BYTES] ? w[MSCCLPP_EPOCH_DIRECT_BLOCK_BYTES] : 0;
  return e;
}

#endif /* MSCCLPP_EXAMPLES_BLOCK_PUTS_H_ */
