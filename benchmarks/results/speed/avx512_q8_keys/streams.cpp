// A probe: one core reading 30 layers x 3 heads x 4,000 entries of 8-bit rows (codes, scales, minimums of keys and values),
// pass by pass in 6 streams, in 2, or in 1. g++ -O2 -march=native -std=c++20 streams.cpp -o streams && ./streams
// single-thread read rate of one head's rows as int8 Kaizen stores them: per pass of 64 rows, key codes 4 KiB,
// key scales 256 B, key minimums 256 B, the same for values (6 streams), vs the same bytes in 2 streams, vs 1
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <vector>
#include <cstdlib>
int main(int argc, char** argv) {
  const int64_t layers = 30, heads = 3, L = 4000, D = 64;
  const int64_t code_bytes = L * D, factor_bytes = L * 2 * 2;  // per head: codes; scales (or minimums)
  std::vector<std::vector<uint8_t>> bufs;
  // per layer: 6 tensors (H, L, ...)
  for (int64_t l = 0; l < layers; ++l) {
    bufs.emplace_back(heads * code_bytes, 1); bufs.emplace_back(heads * factor_bytes, 1); bufs.emplace_back(heads * factor_bytes, 1);
    bufs.emplace_back(heads * code_bytes, 1); bufs.emplace_back(heads * factor_bytes, 1); bufs.emplace_back(heads * factor_bytes, 1);
  }
  std::vector<uint8_t> merged(layers * heads * 2 * (code_bytes + 2 * factor_bytes), 1);
  std::vector<uint8_t> flush(256 << 20, 1);
  auto touch = [](const uint8_t* p, int64_t n, __m512i& acc) { for (int64_t i = 0; i < n; i += 64) acc = _mm512_add_epi32(acc, _mm512_loadu_si512(p + i)); };
  for (int mode = 0; mode < 3; ++mode) for (int rep = 0; rep < 3; ++rep) {
    __m512i acc = _mm512_setzero_si512();
    touch(flush.data(), flush.size(), acc);
    auto t0 = std::chrono::steady_clock::now();
    int64_t total = 0;
    for (int64_t l = 0; l < layers; ++l) for (int64_t h = 0; h < heads; ++h) {
      if (mode == 0) {  // 6 streams, pass by pass
        for (int64_t j = 0; j < L; j += 64) {
          const int64_t n = std::min<int64_t>(64, L - j);
          for (int s = 0; s < 6; ++s) {
            const bool codes = s % 3 == 0; const int64_t row = codes ? D : 4;
            const uint8_t* p = bufs[l * 6 + s].data() + h * (codes ? code_bytes : factor_bytes) + j * row;
            touch(p, n * row, acc); total += n * row;
          }
        }
      } else if (mode == 1) {  // 2 streams (keys record, values record)
        const int64_t rec = D + 8;
        for (int64_t j = 0; j < L; j += 64) { const int64_t n = std::min<int64_t>(64, L - j);
          for (int s = 0; s < 2; ++s) { const uint8_t* p = merged.data() + ((l * heads + h) * 2 + s) * L * rec + j * rec; touch(p, n * rec, acc); total += n * rec; } }
      } else {  // 1 stream
        const int64_t rec = 2 * (D + 8);
        const uint8_t* p = merged.data() + (l * heads + h) * L * rec; touch(p, L * rec, acc); total += L * rec;
      }
    }
    auto t1 = std::chrono::steady_clock::now();
    double s = std::chrono::duration<double>(t1 - t0).count();
    int sink[16]; _mm512_storeu_si512(sink, acc);
    printf("mode %d (%s): %.1f MB in %.2f ms = %.1f GB/s %d\n", mode, mode == 0 ? "6 streams" : mode == 1 ? "2 streams" : "1 stream", total / 1e6, s * 1e3, total / s / 1e9, sink[0] & 1);
  }
}
