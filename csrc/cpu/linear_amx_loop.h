// The tile loop of pagedgen's AMX bf16 GEMM (packed_linear_bf16_amx, csrc/cpu/linear_amx.cpp), written
// once over a "tile backend" T and instantiated twice: with the AMX instructions (linear_amx.cpp, the
// only code compiled for AMX) and with a plain C++ emulation of tileloadd / tdpbf16ps / tilestored
// (linear_amx_emulated.cpp, runs on any CPU). Both share this packing and indexing, so the emulation's
// tests (tests/ops/test_packed_linear_amx.py) check the real path's addressing on CPUs without AMX.
//
// Weight: the bf16-pair layout of packed_linear_bf16, [P, Q, 16, 2] with P = ceil(N / 16), Q = ceil(K / 2),
// weight[p, q, j, t] = W[16 p + j, 2 q + t]. One B tile (16 rows of 64 bytes, tdpbf16ps' VNNI layout:
// row k holds the pair k of 16 outputs) is 16 consecutive pair rows of one panel: 1 KiB, contiguous.
// A panel's last chunk of Q % 16 pairs is copied into a zero-padded B tile (reading on would reach the
// next panel, or past the tensor). Input rows are copied 16 at a time into a zero-padded A buffer
// [16, 32 Qt] (Qt = ceil(Q / 16) chunks of 32 bf16), so rows past M and pairs past Q are zeros.
//
// Batch invariance by construction: out[m, n] is C = 0; for each chunk c = 0 .. Qt - 1 in order:
// C = tdpbf16ps(C, A row (x[m, 32 c .. 32 c + 31]), B chunk c of n's panel), whatever M, the row's
// place in its tile, the tile or the thread (a tile row's result depends on that row and B only);
// then + bias[n] in float32, rounded once to bf16. The zero padding is the same for every M.
// Work: 4 C tiles (2 row tiles x 2 panels), 2 A tiles, 2 B tiles: the 8 tiles of palette 1. Threads
// split groups of 2 panels (at::parallel_for); each thread sweeps all rows over its panels.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace pagedgen::cpu::amx {
namespace {

constexpr int kPanel = 16;      // outputs per panel = float32 columns of a C tile
constexpr int kTileRows = 16;   // rows of an A / C tile
constexpr int kChunkPairs = 16; // pairs per B tile (its rows) = 32 bf16 of an A tile row
constexpr int kChunk = 2 * kChunkPairs;
constexpr int64_t kMinMacsPerThread = 1 << 16;

struct Problem {
  const uint16_t* x;   // [M, K] bf16 bits, row stride ldx
  int64_t ldx, M, K;
  const uint16_t* w;   // [P, Q, 16, 2] bf16 bits
  int64_t N, P, Q;
  const float* bias;   // [P * 16] float32 or nullptr
  c10::BFloat16* out;  // [M, N], row stride ldo
  int64_t ldo;
};

// Rows [m0, m0 + R) of x into a [16, 32 Qt] buffer (row stride 32 Qt bf16), zeros elsewhere.
inline void pack_a(const Problem& g, int64_t m0, int64_t R, int64_t Qt, uint16_t* a) {
  const int64_t lda = Qt * kChunk;
  std::memset(a, 0, sizeof(uint16_t) * kTileRows * lda);
  for (int64_t r = 0; r < R; ++r) std::memcpy(a + r * lda, g.x + (m0 + r) * g.ldx, sizeof(uint16_t) * g.K);
}

// The B tile of chunk c of panel p: in place when whole, else copied into `tail` (zero-padded).
inline const uint16_t* b_tile(const Problem& g, int64_t p, int64_t c, uint16_t* tail) {
  const uint16_t* src = g.w + (p * g.Q + c * kChunkPairs) * 2 * kPanel;
  const int64_t pairs = std::min<int64_t>(kChunkPairs, g.Q - c * kChunkPairs);
  if (pairs == kChunkPairs) return src;
  std::memset(tail, 0, sizeof(uint16_t) * kChunkPairs * 2 * kPanel);
  std::memcpy(tail, src, sizeof(uint16_t) * pairs * 2 * kPanel);
  return tail;
}

// C tile [16, 16] float32 -> rows [m0, m0 + R) of panel p: + bias, rounded once to bf16.
inline void store_c(const Problem& g, const float* c, int64_t m0, int64_t R, int64_t p) {
  const int n = static_cast<int>(std::min<int64_t>(kPanel, g.N - p * kPanel));
  const float* b = g.bias ? g.bias + p * kPanel : nullptr;
  for (int64_t r = 0; r < R; ++r) {
    c10::BFloat16* o = g.out + (m0 + r) * g.ldo + p * kPanel;
    for (int j = 0; j < n; ++j) o[j] = c10::BFloat16(b ? c[r * kPanel + j] + b[j] : c[r * kPanel + j]);
  }
}

// Panels [p0, p1) for every row. T: the tile backend, with configure(), release(), zero_c(),
// load_a(i, ptr, stride_bytes), load_b(j, ptr) (stride 64 bytes), dp(i, j) (C[2 i + j] += A[i] B[j]),
// store(i, j, float* [16, 16]); i, j in {0, 1}.
template <class T>
void panels(const Problem& g, int64_t p0, int64_t p1) {
  T t;
  t.configure();
  const int64_t Qt = (g.Q + kChunkPairs - 1) / kChunkPairs, lda = Qt * kChunk;
  std::vector<uint16_t> a(2 * kTileRows * lda);
  alignas(64) uint16_t tail[2][kChunkPairs * 2 * kPanel];
  alignas(64) float c[kTileRows * kPanel];
  for (int64_t m0 = 0; m0 < g.M; m0 += 2 * kTileRows) {
    const int64_t R0 = std::min<int64_t>(kTileRows, g.M - m0), R1 = std::min<int64_t>(kTileRows, g.M - m0 - R0);
    const int rt = R1 > 0 ? 2 : 1;  // row tiles
    pack_a(g, m0, R0, Qt, a.data());
    if (R1 > 0) pack_a(g, m0 + kTileRows, R1, Qt, a.data() + kTileRows * lda);
    for (int64_t p = p0; p < p1; p += 2) {
      const int pt = p + 1 < p1 ? 2 : 1;  // panels
      t.zero_c();
      for (int64_t ch = 0; ch < Qt; ++ch) {
        for (int i = 0; i < rt; ++i) t.load_a(i, a.data() + i * kTileRows * lda + ch * kChunk, lda * 2);
        for (int j = 0; j < pt; ++j) t.load_b(j, b_tile(g, p + j, ch, tail[j]));
        for (int i = 0; i < rt; ++i)
          for (int j = 0; j < pt; ++j) t.dp(i, j);
      }
      for (int i = 0; i < rt; ++i)
        for (int j = 0; j < pt; ++j) {
          t.store(i, j, c);
          store_c(g, c, m0 + i * kTileRows, i ? R1 : R0, p + j);
        }
    }
  }
  t.release();
}

template <class T>
void run(const Problem& g) {
  if (g.M == 0 || g.N == 0) return;
  const int64_t groups = (g.P + 1) / 2;
  const int64_t macs = g.M * std::max<int64_t>(g.K, 1) * 2 * kPanel;
  const int64_t grain = std::max<int64_t>(1, kMinMacsPerThread / std::max<int64_t>(macs, 1));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) { panels<T>(g, 2 * g0, std::min(g.P, 2 * g1)); });
}

}  // namespace
}  // namespace pagedgen::cpu::amx
