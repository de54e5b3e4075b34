// The tile loop of pagedgen's AMX GEMMs, written once over a GEMM "kind" G and a "tile backend" T:
//   G = Bf16Gemm (below): packed_linear_bf16_amx, tdpbf16ps, float32 C tiles (csrc/cpu/linear_amx.cpp);
//   G = Int8Gemm<out_t> (csrc/cpu/linear_int8_amx.h): int8_linear_amx, tdpbssd, int32 C tiles;
//   T = the AMX instructions (linear_amx.cpp, the only code compiled for AMX) or a plain C++ emulation of
//       tileloadd / tdpbf16ps / tdpbssd / tilestored (linear_amx_emulated.cpp, runs on any CPU).
// Every pair shares this indexing, so the emulation's tests (tests/ops/test_packed_linear_amx.py,
// test_int8_linear_amx.py) check the real path's addressing on CPUs without AMX.
//
// In bytes the two kinds are one loop: an A tile is 16 rows of 64 bytes (32 bf16 / 64 int8 of a row's k),
// a B tile 16 rows of 64 bytes (16 outputs x 2 bf16 / 4 int8 of k), a C tile 16 x 16 of 4 bytes. The
// weight stays in the pair layout of every level, [P, Q, 16, 2] with P = ceil(N / 16), Q = ceil(K / 2),
// weight[p, q, j, t] = W[16 p + j, 2 q + t]; k chunk c (64 bytes of an A row) is the 1 KiB of panel
// bytes [1024 c, 1024 c + 1024) in both kinds. bf16 reads it in place (tdpbf16ps' VNNI layout is the
// pair layout); int8 (4 k per int32 lane) interleaves pair rows 2 r and 2 r + 1 into quad row r, into a
// per-thread buffer (G::prepare_b). A panel's last, partial chunk is zero-padded in a buffer (reading on
// would reach the next panel, or past the tensor). A rows are zero-padded to whole chunks and tiles.
//
// Batch invariance by construction: out[m, n] is C = 0; for each chunk c = 0 .. Kt - 1 in order:
// C = dp(C, A row (row m's chunk c), B chunk c of n's panel), whatever M, the row's place in its tile,
// the tile or the thread (a tile row's result depends on that row and B only); then G::store's
// write-back. The zero padding is the same for every M.
// Work: 4 C tiles (2 row tiles x 2 panels), 2 A tiles, 2 B tiles: the 8 tiles of palette 1. Threads
// split groups of 2 panels (at::parallel_for); each thread sweeps G::kRowBlock rows at a time over
// its panels, the B tiles prepared once per panel per row block.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace pagedgen::cpu::amx {
namespace {

constexpr int kPanel = 16;          // outputs per panel = 4-byte columns of a C tile
constexpr int kTileRows = 16;       // rows of an A / C tile
constexpr int kChunkBytes = 64;     // bytes of one A tile row (k per chunk: 32 bf16 / 64 int8)
constexpr int kTileBytes = 1024;    // bytes of a B tile = one chunk of a panel
constexpr int64_t kMinMacsPerThread = 1 << 16;

// A panel's B tiles for one row block: chunks c < whole at head + 1024 c, the others at tail (G::prepare_b).
struct PanelB {
  const uint8_t* head;
  const uint8_t* tail;
  int64_t whole;
  const uint8_t* chunk(int64_t c) const { return c < whole ? head + c * kTileBytes : tail; }
};

// The bf16 kind: out [M, N] bf16 = x [M, K] bf16 @ W^T + bias, float32 sums in the C tiles.
struct Bf16Gemm {
  static constexpr int64_t kRowBlock = 2 * kTileRows;  // A packed 32 rows at a time (per thread)
  static constexpr bool kPacksRows = true;             // rows() copies into the loop's buffer
  static int64_t scratch_bytes(int64_t) { return kTileBytes; }  // per panel: the partial last chunk
  const uint16_t* x;   // [M, K] bf16 bits, row stride ldx
  int64_t ldx, M, K;
  const uint16_t* w;   // [P, Q, 16, 2] bf16 bits
  int64_t N, P, Q;
  const float* bias;   // [P * 16] float32 or nullptr
  c10::BFloat16* out;  // [M, N], row stride ldo
  int64_t ldo;

  int64_t chunks() const { return (Q + 15) / 16; }
  int64_t panel_bytes() const { return Q * 2 * kPanel * 2; }
  // Rows [m0, m0 + R) of x into buf [R rounded up to 32, lda bytes], zeros elsewhere; returns buf.
  const uint8_t* rows(int64_t m0, int64_t R, int64_t lda, uint8_t* buf) const {
    std::memset(buf, 0, (R + 2 * kTileRows - 1) / (2 * kTileRows) * 2 * kTileRows * lda);
    for (int64_t r = 0; r < R; ++r) std::memcpy(buf + r * lda, x + (m0 + r) * ldx, sizeof(uint16_t) * K);
    return buf;
  }
  // Panel p's B tiles: in place, the last chunk copied into scratch (zero-padded) when partial.
  PanelB prepare_b(int64_t p, uint8_t* scratch) const {
    const uint8_t* src = reinterpret_cast<const uint8_t*>(w) + p * panel_bytes();
    const int64_t whole = panel_bytes() / kTileBytes, rest = panel_bytes() % kTileBytes;
    if (rest) {
      std::memset(scratch, 0, kTileBytes);
      std::memcpy(scratch, src + whole * kTileBytes, rest);
    }
    return {src, scratch, whole};
  }
  // C tile [16, 16] float32 -> rows [m0, m0 + R) of panel p: + bias, rounded once to bf16.
  void store(const void* tile, int64_t m0, int64_t R, int64_t p) const {
    const float* c = static_cast<const float*>(tile);
    const int n = static_cast<int>(std::min<int64_t>(kPanel, N - p * kPanel));
    const float* b = bias ? bias + p * kPanel : nullptr;
    for (int64_t r = 0; r < R; ++r) {
      c10::BFloat16* o = out + (m0 + r) * ldo + p * kPanel;
      for (int j = 0; j < n; ++j) o[j] = c10::BFloat16(b ? c[r * kPanel + j] + b[j] : c[r * kPanel + j]);
    }
  }
};

// Panels [p0, p1) for every row. T: the tile backend, with configure(), release(), zero_c(),
// load_a(i, ptr, stride_bytes), load_b(j, ptr) (stride 64 bytes), dp(i, j) (C[2 i + j] += A[i] B[j]),
// store(i, j, void* [16, 16] of 4 bytes); i, j in {0, 1}.
template <class G, class T>
void panels(const G& g, int64_t p0, int64_t p1) {
  T t;
  t.configure();
  const int64_t kt = g.chunks(), lda = kt * kChunkBytes;
  const int64_t block = std::min<int64_t>(G::kRowBlock, (g.M + 2 * kTileRows - 1) / (2 * kTileRows) * 2 * kTileRows);
  std::vector<uint8_t> a(G::kPacksRows ? block * lda : 0);  // one row block's A rows, when G copies them
  std::vector<uint8_t> scratch(2 * G::scratch_bytes(kt) + 64);
  uint8_t* s = scratch.data() + (-reinterpret_cast<uintptr_t>(scratch.data()) & 63);  // 64-byte aligned
  alignas(64) uint8_t c[kTileRows * kPanel * 4];
  for (int64_t m0 = 0; m0 < g.M; m0 += block) {
    const int64_t mb = std::min<int64_t>(block, g.M - m0);
    const uint8_t* rows = g.rows(m0, mb, lda, a.data());
    for (int64_t p = p0; p < p1; p += 2) {
      const int pt = p + 1 < p1 ? 2 : 1;  // panels
      PanelB b[2];
      for (int j = 0; j < pt; ++j) b[j] = g.prepare_b(p + j, s + j * G::scratch_bytes(kt));
      for (int64_t r0 = 0; r0 < mb; r0 += 2 * kTileRows) {
        const int64_t R0 = std::min<int64_t>(kTileRows, mb - r0), R1 = std::min<int64_t>(kTileRows, mb - r0 - R0);
        const int rt = R1 > 0 ? 2 : 1;  // row tiles
        t.zero_c();
        for (int64_t ch = 0; ch < kt; ++ch) {
          for (int i = 0; i < rt; ++i) t.load_a(i, rows + (r0 + i * kTileRows) * lda + ch * kChunkBytes, lda);
          for (int j = 0; j < pt; ++j) t.load_b(j, b[j].chunk(ch));
          for (int i = 0; i < rt; ++i)
            for (int j = 0; j < pt; ++j) t.dp(i, j);
        }
        for (int i = 0; i < rt; ++i)
          for (int j = 0; j < pt; ++j) {
            t.store(i, j, c);
            g.store(c, m0 + r0 + i * kTileRows, i ? R1 : R0, p + j);
          }
      }
    }
  }
  t.release();
}

template <class G, class T>
void run(const G& g) {
  if (g.M == 0 || g.N == 0) return;
  const int64_t groups = (g.P + 1) / 2;
  const int64_t macs = g.M * std::max<int64_t>(g.K, 1) * 2 * kPanel;
  const int64_t grain = std::max<int64_t>(1, kMinMacsPerThread / std::max<int64_t>(macs, 1));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) { panels<G, T>(g, 2 * g0, std::min(g.P, 2 * g1)); });
}

}  // namespace
}  // namespace pagedgen::cpu::amx
